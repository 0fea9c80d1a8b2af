"""``packs remove`` while the pack's inbound workers are mid-batch (issue 17, item 8: "320
items failed ``route-not-found`` and 1,410 stranded").

The seed's rules for a removed connector pack (``seeds/000_*``): a reconcile
stops the pools of every incarnation no longer listed (``reconcile``:
``removed`` keys -> ``stopWorkers``), by drain (``stopWorkerHandles``:
``requestDrain``, then force-cancel after the drain timeout; a drained worker
is never restarted, ``superviseWorker``), and a pack that is no longer
installed gets no pool and no credential (``drainOnlyWorkerNoLongerEligible``
/ ``ErrConnectorPackInactive``). So nothing of a removed pack runs after its
drain and no worker will ever take its queued items: the project fails them
``pack-removed`` (replayable, README "packs remove"), never
``route-not-found`` (which says the pack's routes are wrong, not that it went
away), and leaves none pending or processing.

The real worker (``worker.py``, a subprocess, serving the control-plane and
the connector queues) processes a few thousand record events of the
salesforce-sync pack; while its inbound workers hold claimed batches, the
operator runs ``nexusctl packs remove salesforce-sync``. Then, from the
database: every item is ``succeeded`` or ``failed pack-removed`` (no other
class, nothing non-terminal), each succeeded once and each failed one never
applied (attempts), the records and remote links are exactly those of the
succeeded items, each record at the last version applied; and from the
server: no PackSupervisor or InboundWorker of the database runs any more. A
few more fleet reconciles change nothing.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select, text

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.incarnations import FAILURE_PACK_REMOVED
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import ApplyAllInput, FleetStatus
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane, start_fleet
from tests.builders import (
    SF_SYNC,
    account_versions,
    applied_twice,
    apply_all,
    cli_env,
    connector_settings,
    executions,
    fast_fleet,
    invoke_async,
    work_states,
    worker_process,
)

ROOT = Path(__file__).resolve().parents[2]
RECORDS, VERSIONS = 3000, 2  # 6,000 events; the last version of each record enqueued last


def worker(settings: Settings, temporal_env: Any) -> subprocess.Popen[bytes]:
    """``python worker.py`` for this test's database, server and task queues."""
    return worker_process(settings, temporal_env)


def item_rows(engine: Engine) -> dict[str, tuple[str, str | None, int]]:
    """``{work id: (state, failure class, attempt)}`` of every work item."""
    w = t.connector_work_item
    with engine.connect() as conn:
        return {
            r.WorkId: (r.State, r.FailureClass, r.Attempt)
            for r in conn.execute(select(w.c.WorkId, w.c.State, w.c.FailureClass, w.c.Attempt))
        }


def succeeded_attempts(engine: Engine) -> Counter[str]:
    """``{work id: succeeded attempts}``."""
    a = t.connector_work_attempt
    with engine.connect() as conn:
        return Counter(
            {
                r.WorkId: int(r.n)
                for r in conn.execute(
                    select(a.c.WorkId, func.count().label("n"))
                    .where(a.c.OutcomeState == "succeeded")
                    .group_by(a.c.WorkId)
                )
            }
        )


def event_keys(engine: Engine) -> dict[str, str]:
    """``{work id: idempotency key}`` (``acct<k>:v<v>``)."""
    w, e = t.connector_work_item, t.connector_event
    with engine.connect() as conn:
        return {
            r.WorkId: r.IdempotencyKey
            for r in conn.execute(
                select(w.c.WorkId, e.c.IdempotencyKey).join(e, e.c.EventId == w.c.EventId)
            )
        }


async def running(client: Any, settings: Settings, wf_type: str) -> list[str]:
    """Ids of the running executions of ``wf_type`` on this database."""
    query = (
        f"WorkflowType = '{wf_type}' AND ExecutionStatus = 'Running' "
        f"AND NexusDatabase = '{settings.database_id}'"
    )
    return [wf.id for wf in await executions(client, query)]


async def until(check: Any, what: str, timeout: float, engine: Engine | None = None) -> Any:
    """Poll ``check`` until true; after ``timeout`` fail naming ``what`` and the item states."""
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            states = work_states(engine) if engine is not None else {}
            raise AssertionError(f"{what}: not within {timeout} s (items by state: {states})")
        await asyncio.sleep(0.1)


async def test_packs_remove_while_inbound_workers_are_mid_batch(
    temporal_env: Any, settings: Settings
) -> None:
    started = time.monotonic()
    settings = connector_settings(settings)
    catalog.CACHE.invalidate()
    client = temporal_env.client
    total = RECORDS * VERSIONS
    # One worker process serves everything, from the install on: the control-plane
    # queue then knows the install finished before the removal asks for its turn.
    proc = worker(settings, temporal_env)
    fleet = None
    try:
        install = await start_controlplane(
            client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=[str(SF_SYNC)])
        )
        await install.result()
        engine = make_engine(settings.database_url)
        (pack,) = list_connector_packs(engine)
        queue.enqueue(engine, account_versions(pack.install_id, pack.namespace, RECORDS, VERSIONS))
        fleet = await start_fleet(client, settings, fast_fleet(settings))

        async def mid_batch() -> bool:
            states = work_states(engine)
            # Workers hold claimed batches, some items are done, most still queued.
            return states.get("processing", 0) > 0 and states.get("succeeded", 0) >= 200

        await until(mid_batch, "inbound workers mid-batch", 60, engine)
        at_removal = work_states(engine)
        assert at_removal.get("pending", 0) >= total // 3, at_removal  # a real drain
        assert await running(client, settings, "InboundWorker")

        cli_started = time.monotonic()
        result = await invoke_async(
            ["packs", "remove", pack.namespace], cli_env(settings, temporal_env)
        )
        assert result.exit_code == 0, result.output
        removed_at = time.monotonic()
        cli_s = removed_at - cli_started

        # The pool drains and closes (drain timeout 5 s); nothing of the pack runs any more.
        async def pool_gone() -> bool:
            return not (
                await running(client, settings, "InboundWorker")
                or await running(client, settings, "PackSupervisor")
            )

        await until(pool_gone, "removed pack's pool stopped", 30, engine)
        gone_after = time.monotonic() - removed_at

        async def settled() -> bool:
            states = work_states(engine)
            return not any(states.get(s) for s in ("pending", "processing", "blocked"))

        await until(settled, "no item left non-terminal", 30, engine)
        first = item_rows(engine)
        # A few more reconciles of the fleet change nothing and start nothing.
        status = await fleet.query("status", result_type=FleetStatus)
        reconciles = status.reconciles

        async def reconciled_twice() -> bool:
            st = await fleet.query("status", result_type=FleetStatus)
            return st.reconciles >= reconciles + 2

        await until(reconciled_twice, "two more reconciles", 20)
        assert (await fleet.query("status", result_type=FleetStatus)).pools == []
        assert item_rows(engine) == first
        assert not await running(client, settings, "InboundWorker")
        assert not await running(client, settings, "PackSupervisor")
        await fleet.signal("stop")
        await fleet.result()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # --- the database: every event accounted for, none applied twice ---------
    rows = item_rows(engine)
    assert len(rows) == total
    outcomes = Counter((state, cls) for state, cls, _attempt in rows.values())
    failed_pack_removed = outcomes[("failed", FAILURE_PACK_REMOVED)]
    succeeded = outcomes[("succeeded", None)]
    assert succeeded + failed_pack_removed == total, outcomes  # nothing else, no route-not-found
    assert failed_pack_removed > 0 and succeeded > 0, outcomes
    attempts = succeeded_attempts(engine)
    assert applied_twice(engine) == []
    done = {w for w, (state, _c, _a) in rows.items() if state == "succeeded"}
    assert set(attempts) == done, "a succeeded item without its attempt, or a failed one applied"
    assert all(attempts[w] == 1 for w in done)

    # Records and remote links: exactly the records of the succeeded items, each at the
    # last version that succeeded (a record's versions run in lane order).
    keys = event_keys(engine)
    last: dict[str, int] = {}
    for work_id in done:
        rec, version = keys[work_id].split(":v")
        last[rec] = max(last.get(rec, -1), int(version))
    with engine.connect() as conn:
        phones = {str(n): str(p) for n, p in conn.execute(text("SELECT Name, Phone FROM Account"))}
        links = conn.execute(select(func.count()).select_from(t.connector_remote_link)).scalar_one()
    assert phones == {f"Account {rec[4:]}": f"v{v}" for rec, v in last.items()}
    assert links == len(last)
    # Lane order: a record's later version never succeeded over a failed earlier one.
    failed_keys = {keys[w] for w, (state, _c, _a) in rows.items() if state == "failed"}
    for rec, v in last.items():
        assert not {f"{rec}:v{e}" for e in range(v)} & failed_keys, rec

    elapsed = time.monotonic() - started
    print(
        f"at removal {at_removal}; after: {succeeded} succeeded, {failed_pack_removed} failed "
        f"{FAILURE_PACK_REMOVED}; CLI {cli_s:.1f} s; pool gone {gone_after:.1f} s after the "
        f"CLI returned; test {elapsed:.1f} s"
    )


async def test_a_batch_prepared_after_the_removal_and_before_its_sweep_fails_pack_removed(
    temporal_env: Any, settings: Settings
) -> None:
    """The window the scale test can only hit by chance: a fleet reconcile settles (sweeps
    removed packs' items), the pack is removed, the same reconcile then forgets the
    processor's cached routes; a batch the pack's worker claimed before the removal is
    prepared before the next sweep. Its pack no longer lists: it used to fail
    ``route-not-found`` (issue 17's 320). It fails ``pack-removed`` as the sweep would,
    nothing of it applied."""
    from nexuscrm.connectors.processor import Processor
    from nexuscrm.connectors.queue import ClaimSpec, claim_leases, load_claimed
    from nexuscrm.controlplane.packs_apply import remove_pack

    settings = connector_settings(settings)
    catalog.CACHE.invalidate()
    await apply_all(temporal_env, settings, app_pack_sources=[str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    queue.enqueue(engine, account_versions(pack.install_id, pack.namespace, 20, 1))
    processor = Processor(engine)
    spec = ClaimSpec(
        installed_pack_id=pack.install_id,
        queue_classes=(),
        batch_size=10,
        lease_owner="w/run1",
        lease_seconds=60,
        max_processing_rows=1000,
    )
    first = load_claimed(engine, claim_leases(engine, spec))
    assert processor.process(first).succeeded == 10  # routes cached, pack active
    batch = load_claimed(engine, claim_leases(engine, spec))  # claimed before the removal
    assert len(batch) == 10
    remove_pack(engine, pack.namespace)  # committed; no sweep has run since
    processor.forget()  # the straddling reconcile's forget
    outcome = processor.process(batch)
    assert outcome.failure_classes == {FAILURE_PACK_REMOVED: 10}, outcome.failure_classes
    rows = item_rows(engine)
    assert Counter((s, c) for s, c, _a in rows.values()) == {
        ("succeeded", None): 10,
        ("failed", FAILURE_PACK_REMOVED): 10,
    }
    assert set(succeeded_attempts(engine)) == {i.work_id for i in first}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM Account")).scalar_one() == 10
