"""No wake is lost (issue 16 item 1).

Children blocked on their parents, parents arriving in bursts, processed by the
real fleet and worker (8 inbound workers per pack, so a child's batch and its
parent's batch run at once). Every probe times out here (a probe slot starved
by thousands of waits, as in the issue's 10,000-wait run): only wakes can
finish a child, so a child that no wake reaches stays ``blocked``. The race
that lost them: a child reads "no link", its parent's batch commits the link
and reads the blocked rows to wake (the child's block is not committed yet),
then the child commits its block. Nobody woke it; its wait's probes were its
only way out.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.common import BatchLoad
from activities.identity import (
    CLOSE_PAUSE_BUSY_S,
    PROBE_TIMED_OUT,
    IdentityActivities,
)
from activities.identity_client import start_wait
from nexuscrm.clock import utcnow
from nexuscrm.connectors import processor
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency, to_spec, wait_workflow_id
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import BlockedWait, IdentityWaitConfig, WaitNotifyRequest, WakeResult
from nexuscrm.contracts.visibility import running_waits_query
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexusctl.identity import wake_dependency
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    assert_no_blocked_on_linked,
    blocked_on_linked,
    connector_settings,
    event,
    fast_fleet,
    install,
    record_upsert,
    wait_drained,
)
from tests.identity_waits import (
    NotifyOnce,
    RecoverOnce,
    begin,
    block,
    queue_db,
    states,
    wait_worker,
)
from workflows.identity import IdentityWaitWorkflow

BURSTS = 5
PER_BURST = 40
BLOCK_DELAY_S = 0.3
# Well under a probe schedule (5 s doubling to 60 s) and anything recovery does:
# a child is done soon after its parent, or it was never woken.
BOUND_S = 90.0


def _starved_probe(self: IdentityActivities, dep: Dependency, timeout: float) -> bool:
    raise TimeoutError(PROBE_TIMED_OUT)


def _enqueue(engine: Any, requests: list[Any]) -> None:
    """Enqueue, retrying a deadlock or lock timeout with the running workers (test-side)."""
    for attempt in range(20):
        try:
            wq.enqueue(engine, requests)
            return
        except (OperationalError, wq.QueueLockTimeout) as exc:
            # the slow blocks hold the SQLite writer lock for seconds
            if not isinstance(exc, wq.QueueLockTimeout) and "1213" not in str(exc):
                raise
            if attempt == 19:
                raise
            time.sleep(0.2)


async def _parents_done(engine: Any, n: int, timeout: float = 300) -> None:
    """Until ``n`` parents' remote links are committed; the machine is loaded."""
    rl, deadline = t.connector_remote_link, time.monotonic() + timeout
    query = select(func.count()).select_from(rl).where(rl.c.DestinationObject == "Account")
    while True:
        with engine.connect() as conn:
            done = conn.execute(query).scalar_one()
        if done >= n:
            return
        assert time.monotonic() < deadline, f"{done} of {n} parents done in {timeout} s"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("path", ["chunk", "one-by-one"])
async def test_no_wake_lost_with_parents_in_bursts(temporal_env, settings, monkeypatch, path):
    """Children whose block commits just after their parent's batch read the
    blocked rows are woken anyway, within a bound far under the probe schedule.

    The window is widened (the block waits ``BLOCK_DELAY_S`` after the lookup
    read) and, for ``one-by-one``, every chunk is redone item by item (a chunk
    that raised: the lookup and the block are two transactions there, so the
    race exists on SQLite too).
    """
    monkeypatch.setattr(IdentityActivities, "_resolve_bounded", _starved_probe)
    real_block = wq.block_item

    def slow_block(*args: Any, **kw: Any) -> None:
        time.sleep(BLOCK_DELAY_S)
        real_block(*args, **kw)

    monkeypatch.setattr(wq, "block_item", slow_block)
    if path == "one-by-one":

        def chunk_fails(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("injected chunk failure")

        monkeypatch.setattr(processor, "upsert_records", chunk_fails)
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)

    def child(b: int, k: int) -> Any:
        return record_upsert(
            pack.install_id,
            pack.namespace,
            "Contact",
            f"c{b}-{k}",
            {"LastName": f"L{b}-{k}", "AccountId": f"a{b}-{k}"},
            refs={"AccountId": f"a{b}-{k}"},
        )

    def parent(b: int, k: int) -> Any:
        return record_upsert(
            pack.install_id, pack.namespace, "Account", f"a{b}-{k}", {"Name": f"A{b}-{k}"}, refs={}
        )

    w = t.connector_work_item
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        for b in range(BURSTS):
            await asyncio.to_thread(_enqueue, engine, [child(b, k) for k in range(PER_BURST)])
            await asyncio.sleep(0.2)  # the children's batches are reading their lookups
            await asyncio.to_thread(_enqueue, engine, [parent(b, k) for k in range(PER_BURST)])
            await asyncio.sleep(0.5)
        await _parents_done(engine, BURSTS * PER_BURST)
        parents_done_at = time.monotonic()
        try:
            await wait_drained(engine, timeout=BOUND_S)
        finally:
            with engine.connect() as conn:
                by_state: dict[str, int] = {
                    s: n
                    for s, n in conn.execute(select(w.c.State, func.count()).group_by(w.c.State))
                }
            print(
                f"{path}/{engine.dialect.name}: states {by_state} "
                f"{time.monotonic() - parents_done_at:.1f} s after the last parent; "
                f"blocked on a linked parent: {len(blocked_on_linked(engine))}"
            )
        await assert_no_blocked_on_linked(engine, timeout=5)
        assert by_state == {"succeeded": 2 * BURSTS * PER_BURST}
        await fleet.signal("stop")
        await fleet.result()


def _block_each(engine: Any, deps: list[Dependency]) -> dict[str, list[str]]:
    """One item per dependency, enqueued and claimed together, each blocked on its
    own (no liveness mark); key hash -> its work ids."""
    tag = uuid.uuid4().hex[:6]
    wq.enqueue(engine, [event("inst-1", f"{tag}-{k}", obj="Contact") for k in range(len(deps))])
    items = wq.claim(
        engine,
        wq.ClaimSpec(
            installed_pack_id="inst-1",
            queue_classes=[],
            batch_size=len(deps),
            lease_owner="t",
            lease_seconds=60,
            max_processing_rows=1000,
        ),
    )
    assert len(items) == len(deps)
    with engine.begin() as conn:
        for item, dep in zip(items, deps, strict=True):
            wq.block_item(conn, item, dep, summary="parent not linked")
    return {d.key_hash: [i.work_id] for i, d in zip(items, deps, strict=True)}


async def _blocked_deps(
    settings: Any, prefix: str, n: int
) -> tuple[Any, list[Dependency], dict[str, list[str]]]:
    """The database's engine (tables created), ``n`` remote dependencies and an
    item blocked on each (key hash -> its work ids)."""
    engine = make_engine(settings.database_url)
    t.system_metadata.create_all(engine)
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    deps = [Dependency.remote(ns, ns, "Account", f"a{k}") for k in range(n)]
    owned = await asyncio.to_thread(_block_each, engine, deps)
    return engine, deps, owned


async def _start_waits(
    client: Any,
    settings: Any,
    queue: str,
    deps: list[Dependency],
    owned: dict[str, list[str]],
    config: IdentityWaitConfig,
) -> list[Any]:
    """Start the wait of each of ``deps`` with its owned items; their handles."""
    for d in deps:
        await start_wait(
            client,
            database_id=settings.database_id,
            task_queue=queue,
            dependency=d,
            work_ids=owned[d.key_hash],
            config=config,
        )
    return [
        client.get_workflow_handle(wait_workflow_id(settings.database_id, d.key_hash)) for d in deps
    ]


@pytest.mark.parametrize("keys", [3, 60])  # 60: the server's list of running waits
async def test_recovery_never_restarts_a_running_wait(temporal_env, settings, keys):
    """Item 2: liveness is the server's answer. Waits that run, whose rows' liveness
    mark expired while they sleep, are not signal-with-started by recovery (their
    history holds one signal, their start's); their rows are marked instead."""

    engine = make_engine(settings.database_url)
    t.system_metadata.create_all(engine)
    client = temporal_env.client
    queue = settings.identity_task_queue
    ns = f"rec-{uuid.uuid4().hex[:6]}"
    deps = [Dependency.remote(ns, ns, "Account", f"a{k}") for k in range(keys)]
    owned = await asyncio.to_thread(_block_each, engine, deps)
    sleepy = IdentityWaitConfig(probe_interval_seconds=600, max_probe_interval_seconds=600)
    w = t.connector_work_item
    worker = wait_worker(client, settings, engine, lambda _e, _d: False, queue, sleepy)
    async with worker:
        handles = await _start_waits(client, settings, queue, deps, owned, sleepy)
        for h in handles:  # each probed once and now sleeps
            for _ in range(300):
                if (await h.query(IdentityWaitWorkflow.status)).state == "sleeping":
                    break
                await asyncio.sleep(0.1)
        with engine.begin() as conn:  # every liveness mark expired
            conn.execute(
                w.update()
                .where(w.c.State == "blocked")
                .values(DependencyProbeAfter=utcnow() - timedelta(minutes=5))
            )
        started = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert started == 0
        for h in handles:
            signals = [
                e
                async for e in h.fetch_history_events()
                if e.HasField("workflow_execution_signaled_event_attributes")
            ]
            assert len(signals) == 1, h.id
        with engine.connect() as conn:
            marks = conn.execute(select(w.c.DependencyProbeAfter).where(w.c.State == "blocked"))
            assert all(m > utcnow() for (m,) in marks)
        # A wait that no longer runs is restarted: recovery still covers its rows.
        await handles[0].terminate("gone")
        with engine.begin() as conn:
            conn.execute(w.update().where(w.c.State == "blocked").values(DependencyProbeAfter=None))
        again = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert again == 1
        for h in handles:
            await h.terminate("test over")


async def test_recovery_wakes_rows_whose_dependency_resolved_without_a_wait(temporal_env, settings):
    """Rows blocked with no wait (their batch died between the block and its notify)
    whose parent linked meanwhile: recovery wakes them itself, with one read of
    the link, and starts waits only for the rest. The waits' probes are starved
    here (they never resolve), so a resolved row handed to a wait would stay
    blocked."""
    engine, deps, owned = await _blocked_deps(settings, "rec", 6)
    client = temporal_env.client
    queue = settings.identity_task_queue
    linked = deps[:4]
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            t.connector_remote_link.insert(),
            [
                {
                    "ConnectorOwnerKey": d.owner_key,
                    "Namespace": d.namespace,
                    "DestinationObject": d.object_api_name,
                    "RemoteId": d.remote_id,
                    "RecordId": f"rec-{d.remote_id}",
                    "CreatedDate": now,
                    "LastModifiedDate": now,
                }
                for d in linked
            ],
        )
    sleepy = IdentityWaitConfig(probe_interval_seconds=600, max_probe_interval_seconds=600)
    worker = wait_worker(client, settings, engine, lambda _e, _d: False, queue, sleepy)
    w = t.connector_work_item
    async with worker:
        started = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert started == 2  # the two unlinked dependencies get waits
        with engine.connect() as conn:
            states = dict(conn.execute(select(w.c.WorkId, w.c.State)).all())
        assert {states[owned[d.key_hash][0]] for d in linked} == {"pending"}
        assert {states[owned[d.key_hash][0]] for d in deps[4:]} == {"blocked"}
        for d in deps:  # a wait exactly for each unlinked dependency (the server's word)
            handle = client.get_workflow_handle(wait_workflow_id(settings.database_id, d.key_hash))
            if d in linked:
                with pytest.raises(RPCError):
                    await handle.describe()
            else:
                assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
                await handle.terminate("test over")


async def test_wait_registered_after_its_items_woke_is_not_left_running(temporal_env, settings):
    """Item 1, the wait left behind: a child's batch blocks and re-reads "no link";
    the parent's batch links, wakes the child by its direct write and signals a
    wait that does not run yet; only then does the child's notify register the
    wait. That wait completes at once (it used to park until its max wait, with
    expiry off for ever); a wait whose item is still blocked keeps running."""
    engine = make_engine(settings.database_url)
    t.system_metadata.create_all(engine)
    client = temporal_env.client
    queue = settings.identity_task_queue
    ns = f"late-{uuid.uuid4().hex[:6]}"
    deps = [Dependency.remote(ns, ns, "Account", f"a{k}") for k in range(3)]
    owned = await asyncio.to_thread(_block_each, engine, deps)
    woken, still = deps[:2], deps[2]
    parked = IdentityWaitConfig(max_wait_seconds=0)  # no expiry: only a wake ends a wait
    worker = wait_worker(client, settings, engine, lambda _e, _d: False, queue, parked)
    w = t.connector_work_item
    db = settings.database_id

    async def notify(req: WaitNotifyRequest) -> None:
        await client.execute_workflow(
            NotifyOnce.run, req, id=f"notify-{uuid.uuid4().hex}", task_queue=queue
        )

    async with worker:
        # The parent's batch: its direct wake, then its notify (no wait to hear it).
        keys = [d.key_hash for d in woken]
        await asyncio.to_thread(wq.wake_blocked_keys, engine, keys)
        await notify(WaitNotifyRequest(db, [], keys))
        # The child's notify, late.
        blocked = [BlockedWait(owned[d.key_hash][0], d.key_hash, to_spec(d)) for d in deps]
        await notify(WaitNotifyRequest(db, blocked, []))
        handles = {d: client.get_workflow_handle(wait_workflow_id(db, d.key_hash)) for d in deps}
        for d in woken:  # the server's word, not a status query
            status = None
            for _ in range(300):
                status = (await handles[d].describe()).status
                if status != WorkflowExecutionStatus.RUNNING:
                    break
                await asyncio.sleep(0.1)
            assert status == WorkflowExecutionStatus.COMPLETED, d
            assert await handles[d].result() == 0  # woke nothing: the parent's write did
        assert (await handles[still].describe()).status == WorkflowExecutionStatus.RUNNING
        with engine.connect() as conn:
            states = dict(conn.execute(select(w.c.WorkId, w.c.State)).all())
        assert {states[owned[d.key_hash][0]] for d in woken} == {"pending"}
        assert states[owned[still.key_hash][0]] == "blocked"
        await handles[still].terminate("test over")


@pytest.mark.parametrize("pacing", [(CLOSE_PAUSE_BUSY_S, 60.0), (30.0, 0.5)])
async def test_woken_waits_complete_one_at_a_time_while_batches_run(temporal_env, settings, pacing):
    """Item 3: completing the waits a batch's direct write already woke costs the
    server a signal, a workflow task and a close each, the CPU the woken
    children's batches need. While the process runs a batch the closer sends
    one ``wake`` every CLOSE_PAUSE_BUSY_S (counted from the server's closed
    executions: never more than the pace allows); once the batches end, the
    rest complete, and every item was pending from the direct write on. A close
    that has waited its max deferral goes at full pace, batches or not (a
    load that never ends leaves a bounded backlog: here 0.5 s, against a 30 s
    pace that would take minutes)."""
    pause, max_defer = pacing
    engine, deps, owned = await _blocked_deps(settings, "busy", 8)
    client = temporal_env.client
    queue = settings.identity_task_queue
    db = settings.database_id
    load = BatchLoad()
    parked = IdentityWaitConfig(max_wait_seconds=0)  # no expiry: only a wake ends a wait
    worker = wait_worker(
        client, settings, engine, lambda _e, _d: False, queue, parked, load, pacing
    )
    handles = [client.get_workflow_handle(wait_workflow_id(db, d.key_hash)) for d in deps]

    async def notify(req: WaitNotifyRequest) -> None:
        await client.execute_workflow(
            NotifyOnce.run, req, id=f"notify-{uuid.uuid4().hex}", task_queue=queue
        )

    async def closed() -> int:
        statuses = [(await h.describe()).status for h in handles]
        return sum(s != WorkflowExecutionStatus.RUNNING for s in statuses)

    keys = [d.key_hash for d in deps]
    async with worker:
        blocked = [BlockedWait(owned[d.key_hash][0], d.key_hash, to_spec(d)) for d in deps]
        await notify(WaitNotifyRequest(db, blocked, []))  # the children's waits park
        assert await closed() == 0
        batch = load.batch()
        batch.__enter__()  # an inbound batch runs in this process
        try:
            start = time.monotonic()
            await asyncio.to_thread(wq.wake_blocked_keys, engine, keys)  # the parent's write
            await notify(WaitNotifyRequest(db, [], keys))
            ids = [owned[k][0] for k in keys]
            w = t.connector_work_item
            with engine.connect() as conn:
                states = conn.execute(select(w.c.State).where(w.c.WorkId.in_(ids))).all()
            assert sorted(s for (s,) in states) == ["pending"] * len(deps)
            seen = 0
            while max_defer > 5 and time.monotonic() - start < 1.2:
                seen = await closed()
                # The first at once, each next one ``pause`` after the one before.
                allowed = 1 + int((time.monotonic() - start) / pause)
                assert seen <= allowed, (seen, allowed)
                await asyncio.sleep(0.05)
            if max_defer > 5:
                assert seen < len(deps)
            else:  # past the deferral: all of them, the batch still running
                for _ in range(200):
                    if await closed() == len(deps):
                        break
                    await asyncio.sleep(0.1)
                assert await closed() == len(deps)
                assert load.busy()
        finally:
            batch.__exit__(None, None, None)
        for _ in range(300):  # the batch ended: the rest at full pace
            if await closed() == len(deps):
                break
            await asyncio.sleep(0.1)
        assert await closed() == len(deps)
        assert [await h.result() for h in handles] == [0] * len(deps)


def test_batch_load_is_busy_while_a_batch_runs_and_just_after() -> None:
    """``BatchLoad``: busy inside ``batch()`` (also from another thread) and for
    ``quiet_seconds`` after the last batch ended, idle before any and after."""
    import threading

    load = BatchLoad(quiet_seconds=0.05)
    assert not load.busy()
    inside = threading.Event()
    release = threading.Event()

    def run() -> None:
        with load.batch():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(10)
    assert load.busy()
    release.set()
    thread.join(10)
    time.sleep(0.1)
    assert not load.busy()
    with load.batch():
        pass
    assert load.busy()  # just ended: the pool's next claim follows


async def test_a_recovery_that_lists_the_waits_marks_every_row_of_a_running_wait(
    temporal_env, settings, monkeypatch
):
    """Item 2, without chatter: rows block batch after batch, so their liveness
    marks expire one reconcile after another, and every expiry of 50 keys or
    more listed all running waits again. A recovery that listed them marks
    every blocked row of a listed wait (not only the expired ones), so they
    expire, and are listed, together once per recheck."""
    from activities import identity_recovery

    lists: list[str] = []
    real_list = identity_recovery.list_running_waits

    async def counted_list(client: Any, database_id: str) -> set[str] | None:
        lists.append(database_id)
        return await real_list(client, database_id)

    monkeypatch.setattr(identity_recovery, "list_running_waits", counted_list)
    engine, deps, owned = await _blocked_deps(settings, "mark", 60)
    client = temporal_env.client
    queue = settings.identity_task_queue
    parked = IdentityWaitConfig(max_wait_seconds=0)
    w = t.connector_work_item
    worker = wait_worker(client, settings, engine, lambda _e, _d: False, queue, parked)
    async with worker:
        handles = await _start_waits(client, settings, queue, deps, owned, parked)
        # the server lists a wait once its first task set its attributes
        query = running_waits_query(settings.database_id)
        assert query is not None
        for _ in range(300):
            if (await client.count_workflows(query)).count >= len(deps):
                break
            await asyncio.sleep(0.1)
        late = [owned[d.key_hash][0] for d in deps[55:]]  # blocked later: mark not expired
        with engine.begin() as conn:
            conn.execute(
                w.update()
                .where(w.c.State == "blocked")
                .values(DependencyProbeAfter=utcnow() - timedelta(minutes=1))
            )
            conn.execute(
                w.update()
                .where(w.c.WorkId.in_(late))
                .values(DependencyProbeAfter=utcnow() + timedelta(seconds=50))
            )
        started = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert started == 0
        ids = [owned[d.key_hash][0] for d in deps]
        with engine.connect() as conn:
            marks = dict(
                conn.execute(
                    select(w.c.WorkId, w.c.DependencyProbeAfter).where(w.c.WorkId.in_(ids))
                ).all()
            )
        soon = utcnow() + timedelta(minutes=4)
        assert all(marks[i] > soon for i in ids), sorted(i for i in ids if marks[i] <= soon)
        # Parked long, listed again and again: trusted as long as the youngest row
        # has been blocked (here 25 minutes), never past an hour, all at one time.
        for blocked_ago, expected in ((25, 25), (300, 60)):
            with engine.begin() as conn:
                conn.execute(
                    w.update()
                    .where(w.c.State == "blocked")
                    .values(
                        DependencyBlockedAt=utcnow() - timedelta(minutes=blocked_ago),
                        DependencyProbeAfter=utcnow() - timedelta(minutes=1),
                    )
                )
            before = utcnow()
            started = await client.execute_workflow(
                RecoverOnce.run,
                settings.database_id,
                id=f"rec-{uuid.uuid4().hex}",
                task_queue=queue,
            )
            assert started == 0
            with engine.connect() as conn:
                marks = dict(
                    conn.execute(
                        select(w.c.WorkId, w.c.DependencyProbeAfter).where(w.c.WorkId.in_(ids))
                    ).all()
                )
            assert len(set(marks.values())) == 1, sorted(set(marks.values()))
            (mark,) = set(marks.values())
            low = before + timedelta(minutes=expected) - timedelta(seconds=5)
            assert low <= mark <= utcnow() + timedelta(minutes=expected, seconds=5), (
                blocked_ago,
                mark,
            )
        # The first recovery listed; the next two had the server's count match
        # the blocked keys (one request) and listed nothing.
        assert len(lists) == 1, lists
        # A wait that ended without its rows leaves the count short: the full
        # list follows, and that key, and only it, gets its wait again.
        await handles[0].terminate("lost")
        with engine.begin() as conn:
            conn.execute(
                w.update()
                .where(w.c.State == "blocked")
                .values(DependencyProbeAfter=utcnow() - timedelta(minutes=1))
            )
        for _ in range(100):  # visibility follows the end within about a second
            if (await client.count_workflows(query)).count < len(deps):
                break
            await asyncio.sleep(0.1)
        started = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert (started, len(lists)) == (1, 2)
        lost_id = wait_workflow_id(settings.database_id, deps[0].key_hash)
        restarted = client.get_workflow_handle(lost_id)
        assert (await restarted.describe()).status == WorkflowExecutionStatus.RUNNING
        await restarted.terminate("test over")
        for h in handles[1:]:
            await h.terminate("test over")


def test_the_recheck_grows_with_how_long_the_rows_were_parked() -> None:
    from activities.identity_recovery import (
        RECOVERY_RECHECK,
        RECOVERY_RECHECK_MAX,
        recheck_interval,
    )

    now = utcnow()
    assert recheck_interval(None, now) == RECOVERY_RECHECK
    assert recheck_interval(now, now) == RECOVERY_RECHECK
    assert recheck_interval(now - timedelta(minutes=17), now) == timedelta(minutes=17)
    assert recheck_interval(now - timedelta(days=3), now) == RECOVERY_RECHECK_MAX


async def test_a_wake_now_during_a_signalled_wake_wakes_what_blocked_since(temporal_env, settings):
    """A ``wake`` signal (a batch's, the closer's) starts the wait's pass; the pass
    reads the rows; an item blocks again; then ``nexusctl wake`` (the ``wake_now``
    update) arrives while the pass is still out. It used to be told that pass's
    count and the new block stayed blocked with no wait (CI, 2026-12-04: a child
    re-blocked at attempt 12 was never woken). Now the wait runs one more pass
    for the update. The wake activity is the real one, held after it wrote."""
    engine = queue_db(settings)
    dep = Dependency.remote("wn", "wn", "Account", f"a-{uuid.uuid4().hex[:6]}")
    first = await asyncio.to_thread(block, engine, 1, dep)
    client = temporal_env.client
    queue = f"wake-now-{uuid.uuid4().hex[:6]}"
    config = IdentityWaitConfig(max_wait_seconds=0)
    acts = IdentityActivities(engine, settings, config, resolver=lambda _e, _d: False)
    passed = threading.Event()

    @activity.defn(name="identity.wake")
    def held_wake(key_hash: str) -> WakeResult:
        res = acts.wake(key_hash)
        passed.set()
        time.sleep(1.5)  # the pass is out: its rows are read and written
        return res

    worker = Worker(
        client,
        task_queue=queue,
        workflows=[IdentityWaitWorkflow],
        activities=[acts.probe, acts.expire, held_wake],
        activity_executor=ThreadPoolExecutor(4),
    )
    async with worker:
        handle = await begin(client, settings, queue, first, config, dep=dep, probe_now=False)
        await handle.signal("wake")
        assert await asyncio.to_thread(passed.wait, 60)
        later = await asyncio.to_thread(block, engine, 1, dep)
        woken = await wake_dependency(client, settings, dep)
        assert {s for s, _f in states(engine, first + later).values()} == {"pending"}
        assert woken == 2  # the signal's pass and the update's
        assert await handle.result() == 2
        # Once the wait has ended, the update fails and the caller wakes the rows.
        again = await asyncio.to_thread(block, engine, 1, dep)
        assert await wake_dependency(client, settings, dep) == 1
        assert {s for s, _f in states(engine, again).values()} == {"pending"}
    engine.dispose()
