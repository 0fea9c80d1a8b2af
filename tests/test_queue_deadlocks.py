"""MariaDB lock conflicts of the connector queue (issue 11 item 11).

A shuffled sync of every corpus project's data plans, through a real worker
with several concurrent InboundWorkers, converges and logs no deadlock or
lock-wait traceback; claims, blocks, wakes and identity probes running side
by side hit no InnoDB deadlock (counted by the sessions that got error
1213/1205, and by the server's ``Innodb_deadlocks``).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.worker import Worker

from activities.common import LOCK_CONFLICT_RETRIED, fatal_is_final
from nexuscrm import catalog
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.settings import Settings
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker, build_worker
from tests.builders import (
    SF_SYNC,
    connector_settings,
    fast_fleet,
    install,
    verify_synced,
    wait_drained,
)
from tests.corpus import corpus_app_packs, corpus_events

COPIES = 4
"""Each corpus plan synced this many times (~1,900 events): enough concurrent
batches, blocks and wakes that the old lock order deadlocked in every run."""

_LOCK_CODES = (1205, 1213)
_LOCK_TEXT = re.compile(r"deadlock|lock wait timeout|database is locked", re.IGNORECASE)


@contextmanager
def lock_errors() -> Iterator[list[int]]:
    """Count the lock errors (1213 deadlock, 1205 lock wait timeout, SQLite
    ``database is locked``) any engine of this process meets, while inside."""
    seen: list[int] = []

    def on_error(ctx: Any) -> None:
        orig = ctx.original_exception
        code = orig.args[0] if getattr(orig, "args", None) else None
        if code in _LOCK_CODES or "database is locked" in str(orig):
            seen.append(code if isinstance(code, int) else 0)

    event.listen(Engine, "handle_error", on_error)
    try:
        yield seen
    finally:
        event.remove(Engine, "handle_error", on_error)


def innodb_deadlocks(engine: Engine) -> int:
    """The server's ``Innodb_deadlocks`` (every database of the server)."""
    with engine.connect() as conn:
        row = conn.execute(text("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")).one()
    return int(row[1])


def lock_tracebacks(records: list[logging.LogRecord], stderr: str) -> list[str]:
    """Log records and stderr tracebacks (at INFO or above) caused by a lock conflict."""
    found = []
    for r in records:
        if r.levelno < logging.INFO or not r.exc_info or r.exc_info[1] is None:
            continue
        exc: BaseException | None = r.exc_info[1]
        chain = []
        while exc is not None:
            chain.append(f"{type(exc).__name__}: {exc}")
            exc = exc.__cause__ or exc.__context__
        if any(_LOCK_TEXT.search(c) for c in chain):
            found.append(f"{r.name}: {r.getMessage()}: {chain[0][:200]}")
    for block in stderr.split("Traceback (most recent call last)")[1:]:
        if _LOCK_TEXT.search(block[:4000]):
            found.append("stderr: " + block[:300])
    return found


async def test_shuffled_sync_of_every_corpus_plan_logs_no_lock_traceback(
    temporal_env: Any,
    settings: Settings,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every corpus project's data plans, shuffled, through the fleet's eight
    inbound workers: every record lands once with its lookups, and no lock
    conflict is logged with a traceback (an expected, retried one is one line)."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [*corpus_app_packs(tmp_path), str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    catalog.CACHE.invalidate()
    objects = {o.api_name for o in catalog.CACHE.get(engine).objects.values() if o.has_table}
    events, records, left_out = corpus_events(
        pack.install_id, pack.namespace, objects, seed=11, copies=COPIES
    )
    assert len(events) > 400 * COPIES and left_out < 20 * COPIES, (len(events), left_out)
    assert wq.enqueue(engine, events).inserted == len(events)
    mysql = engine.dialect.name == "mysql"
    before = innodb_deadlocks(engine) if mysql else 0
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    with lock_errors() as met:
        async with (
            build_worker(temporal_env.client, settings),
            build_connector_worker(temporal_env.client, settings),
        ):
            fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
            states = await wait_drained(engine, timeout=600)
            await fleet.signal("stop")
            await fleet.result()
    out, err = capfd.readouterr()
    server = innodb_deadlocks(engine) - before if mysql else 0
    one_liners = (out + err).count(LOCK_CONFLICT_RETRIED)
    print(
        f"lock errors met: {len(met)} {sorted(set(met))}; one-line warnings: {one_liners}; "
        f"server Innodb_deadlocks delta (all databases of the server): {server}"
    )
    assert lock_tracebacks(caplog.records, out + err) == []
    assert states == {"succeeded": len(events)}, states
    verify_synced(engine, records)
    assert met == [], f"lock errors: {met}"


def latest_deadlock(engine: Engine) -> str:
    """The ``LATEST DETECTED DEADLOCK`` section of ``SHOW ENGINE INNODB STATUS`` ('' if none)."""
    with engine.connect() as conn:
        status = str(conn.execute(text("SHOW ENGINE INNODB STATUS")).one()[2])
    start = status.find("LATEST DETECTED DEADLOCK")
    if start < 0:
        return ""
    end = status.find("TRANSACTIONS\n", start)
    return status[start : end if end > 0 else None]


def test_concurrent_claims_blocks_wakes_and_probes_never_deadlock(settings: Settings) -> None:
    """Claims of three packs, batches blocking their items on shared dependencies,
    identity probes (liveness marks), wakes and recovery's parked-row scan, all
    at once for several seconds: no session meets a deadlock or lock wait, and
    no deadlock the server detects involves this database."""
    import random
    import threading
    import time

    from activities.identity import IdentityActivities
    from nexuscrm.clock import utcnow
    from nexuscrm.connectors.identity import Dependency, to_spec
    from nexuscrm.connectors.queue.locking import write_transaction
    from nexuscrm.contracts import IdentityWaitConfig, ProbeRequest
    from nexuscrm.db import tables as t
    from tests.builders import event

    engine = make_engine(settings.database_url, pool_size=20, max_overflow=10)
    t.system_metadata.create_all(engine)
    packs = [f"inst-{p}" for p in range(3)]
    deps = [Dependency.remote("ns", "ns", "Account", f"parent-{k}") for k in range(12)]
    tag = uuid.uuid4().hex[:6]
    wq.enqueue(
        engine,
        [
            event(pack, f"{tag}-{pack}-{n}", namespace="ns", obj="Contact")
            for pack in packs
            for n in range(150)
        ],
    )
    acts = IdentityActivities(engine, settings, IdentityWaitConfig())
    stop = threading.Event()
    errors: list[BaseException] = []
    rounds = {"claims": 0, "probes": 0, "wakes": 0}

    def guarded(fn: Any) -> Any:
        def run() -> None:
            rng = random.Random()
            while not stop.is_set():
                try:
                    fn(rng)
                except Exception as exc:  # counted by lock_errors; others fail the test
                    if not _LOCK_TEXT.search(str(exc)):
                        errors.append(exc)
                        return

        return run

    def claimer(pack: str) -> Any:
        def step(rng: random.Random) -> None:
            items = wq.claim(
                engine,
                wq.ClaimSpec(
                    installed_pack_id=pack,
                    queue_classes=[],
                    batch_size=16,
                    lease_owner="t",
                    lease_seconds=60,
                    max_processing_rows=1000,
                ),
            )
            if not items:
                time.sleep(0.01)
                return
            # A batch's finishing transaction: hold the leases, block each item.
            with write_transaction(engine) as conn:
                for item in wq.hold_leases(conn, items):
                    wq.block_item(conn, item, rng.choice(deps), summary="parent not linked")
            rounds["claims"] += 1

        return step

    def prober(rng: random.Random) -> None:
        dep = rng.choice(deps)
        ids = [r.work_id for r in wq.blocked_rows(engine, dep.key_hash)]
        until = (utcnow() + timedelta(seconds=90)).isoformat()
        acts.probe(ProbeRequest(dep.key_hash, to_spec(dep), ids, until, 5.0))
        rounds["probes"] += 1

    def waker(rng: random.Random) -> None:
        wq.wake_blocked_keys(engine, [d.key_hash for d in rng.sample(deps, 4)])
        wq.convert_parked(engine)  # the fleet reconcile's recovery scan
        rounds["wakes"] += 1
        time.sleep(0.005)

    fns = [*(claimer(p) for p in packs for _ in range(2)), prober, prober, prober, waker, waker]
    mysql = engine.dialect.name == "mysql"
    before = innodb_deadlocks(engine) if mysql else 0
    latest_before = latest_deadlock(engine) if mysql else ""
    with lock_errors() as met:
        threads = [threading.Thread(target=guarded(fn), daemon=True) for fn in fns]
        for th in threads:
            th.start()
        time.sleep(8)
        stop.set()
        for th in threads:
            th.join(60)
    server = innodb_deadlocks(engine) - before if mysql else 0
    latest = latest_deadlock(engine) if mysql else ""
    print(f"rounds {rounds}; lock errors met {met}; server Innodb_deadlocks delta {server}")
    assert errors == []
    assert met == [], f"lock errors met: {met} (server delta {server})"
    assert rounds["claims"] > 5 and rounds["probes"] > 5 and rounds["wakes"] > 5, rounds
    if mysql and latest != latest_before:
        database = engine.url.database
        assert f"`{database}`" not in latest, latest


@workflow.defn(name="LockConflictOnce", sandboxed=False)
class LockConflictOnce:
    """Runs ``test.lock_conflict`` (retried) then ``test.real_error`` (once)."""

    @workflow.run
    async def run(self) -> int:
        calls = await workflow.execute_activity(
            "test.lock_conflict",
            result_type=int,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(milliseconds=100), maximum_attempts=3
            ),
        )
        with suppress(ActivityError):
            await workflow.execute_activity(
                "test.real_error",
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        return int(calls)


class LockConflict:
    """Activities meeting a real lock conflict once (a row or the SQLite write lock
    held by another connection), and a real error (a missing table)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        self.mysql = self.engine.dialect.name == "mysql"
        with self.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE lock_probe (id INTEGER PRIMARY KEY, v INTEGER)")
            conn.exec_driver_sql("INSERT INTO lock_probe VALUES (1, 0)")
        self.holder = self.engine.connect()
        if self.mysql:
            self.holder.exec_driver_sql("BEGIN")
            self.holder.exec_driver_sql("UPDATE lock_probe SET v = v + 1 WHERE id = 1")
        else:
            self.holder.exec_driver_sql("BEGIN IMMEDIATE")
        self.calls = 0

    @activity.defn(name="test.lock_conflict")
    @fatal_is_final
    def conflict(self) -> int:
        self.calls += 1
        with self.engine.connect() as conn:
            try:
                if self.mysql:
                    conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
                    conn.exec_driver_sql("UPDATE lock_probe SET v = v + 1 WHERE id = 1")
                else:
                    conn.exec_driver_sql("PRAGMA busy_timeout = 50")
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                    conn.exec_driver_sql("UPDATE lock_probe SET v = v + 1 WHERE id = 1")
                conn.commit()
            except Exception:
                conn.rollback()
                self.holder.rollback()  # the other transaction ends: the retry gets the lock
                raise
        return self.calls

    @activity.defn(name="test.real_error")
    @fatal_is_final
    def real_error(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT * FROM no_such_table")


async def test_a_retried_lock_conflict_is_one_line_and_a_real_error_stays_loud(
    temporal_env: Any,
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """An activity that meets a real lock conflict (MariaDB lock wait timeout,
    SQLite ``database is locked``) is retried and logs it as one warning line,
    no traceback; a real error (a missing table) still logs its traceback."""
    # The lines are asserted as the worker writes them: JSON, at INFO.
    configure_logging("json", "INFO")
    acts = LockConflict(settings.database_url)
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    queue = f"lock-{uuid.uuid4().hex[:8]}"
    try:
        async with Worker(
            temporal_env.client,
            task_queue=queue,
            workflows=[LockConflictOnce],
            activities=[acts.conflict, acts.real_error],
            activity_executor=ThreadPoolExecutor(2),
        ):
            calls = await temporal_env.client.execute_workflow(
                LockConflictOnce.run, id=f"lock-{uuid.uuid4().hex}", task_queue=queue
            )
    finally:
        acts.holder.close()
        acts.engine.dispose()
    out, err = capfd.readouterr()
    assert calls == 2
    lines = [ln for ln in (out + err).splitlines() if LOCK_CONFLICT_RETRIED in ln]
    assert len(lines) == 1 and "test.lock_conflict" in lines[0], lines
    loud = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.INFO and r.exc_info and "Completing activity as failed" in r.msg
    ]
    assert [m for m in loud if "test.lock_conflict" in m] == []
    assert len([m for m in loud if "test.real_error" in m]) == 1, loud
    assert lock_tracebacks(caplog.records, out + err) == []
