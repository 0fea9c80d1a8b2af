"""Parked identity waits cost nothing while idle; recovery's one recheck wakes them (issue 16).

A wait probes once when it starts, then parks until its first item is due
to expire: no probe, no timer, no history event in between. A dependency
that resolves without a wake (an owner written outside the runtime, a wake
lost with its batch) is found by the fleet's identity recovery, which reads
every blocked row against the remote links and records in one recheck and
wakes only the waits whose dependency resolved. All on real Temporal
servers and real databases (SQLite and MariaDB).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from sqlalchemy import insert
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus

from nexuscrm.connectors.identity import Dependency, resolved_blocked_keys
from nexuscrm.db import tables as t
from tests.builders import blocked_on_linked
from tests.identity_waits import (
    DEP,
    RecoverOnce,
    Switch,
    begin,
    block,
    cfg,
    link,
    no_blocked_on_linked,  # noqa: F401 (autouse)
    queue_db,
    set_blocked_at,
    states,
    wait_worker,
)
from workflows.identity import IdentityWaitWorkflow


async def _probes(handle) -> int:
    """Activity tasks the wait scheduled, counted in its history on the server."""
    n = 0
    async for ev in handle.fetch_history_events():
        if ev.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            n += 1
    return n


async def _sleeping(handle, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await handle.query(IdentityWaitWorkflow.status)).state == "sleeping":
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the wait never parked")


async def test_a_parked_wait_probes_only_when_asked(temporal_env, settings):
    """With a 0.2 s probe interval the earlier loop probed ~10 times in 3 s; a
    parked wait does not probe at all, until ``register()`` without items asks."""
    engine = queue_db(settings)
    client = temporal_env.client
    queue = settings.identity_task_queue
    switch = Switch("unresolved")
    ids = block(engine, 3)
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(
            client, settings, queue, ids, cfg(max_wait_seconds=3600), probe_now=False
        )
        await _sleeping(handle)
        await asyncio.sleep(3)
        assert switch.calls == 0
        assert await _probes(handle) == 0
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.items == sorted(ids) and status.next_probe is not None
        # ``register`` with more items does not probe; without items it does.
        more = block(engine, 2)
        await handle.signal(IdentityWaitWorkflow.register, more)
        await asyncio.sleep(1)
        assert switch.calls == 0
        await handle.signal(IdentityWaitWorkflow.register)
        deadline = time.monotonic() + 20
        while switch.calls < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert switch.calls == 1
        await _sleeping(handle)
        assert sorted((await handle.query(IdentityWaitWorkflow.status)).items) == sorted(ids + more)
        await handle.signal(IdentityWaitWorkflow.wake)
        assert await asyncio.wait_for(handle.result(), 30) == 5
    assert {s for s, _c in states(engine, ids + more).values()} == {"pending"}


async def test_recovery_wakes_a_dependency_resolved_without_a_wake(temporal_env, settings):
    """The parent's link is written and no wake is sent: the parked wait never
    probes, the next recovery finds the link in its one recheck, wakes the
    rows and completes the wait; a wait still unresolved gets no signal."""
    engine = queue_db(settings)
    client = temporal_env.client
    queue = settings.identity_task_queue
    other = Dependency.remote("salesforce-sync", "salesforce-sync", "Account", "acct-unlinked")
    ids = block(engine, 3)
    still = block(engine, 2, other)
    switch = Switch("unresolved")  # the waits' own probes never converge
    async with wait_worker(client, settings, engine, switch, queue):
        config = cfg(max_wait_seconds=3600)
        handle = await begin(client, settings, queue, ids, config, probe_now=False)
        parked = await begin(client, settings, queue, still, config, other, probe_now=False)
        await _sleeping(handle)
        await _sleeping(parked)
        link(engine, DEP)
        assert [k for _w, k in blocked_on_linked(engine)] == [DEP.key_hash] * 3
        assert resolved_blocked_keys(engine) == {DEP.key_hash}
        before = await _probes(parked)
        await client.execute_workflow(
            RecoverOnce.run,
            settings.database_id,
            id=f"recover-{settings.database_id}",
            task_queue=queue,
        )
        # Recovery wakes the rows itself (the write no race can lose), then
        # signals the wait, which finds nothing left and completes.
        assert await asyncio.wait_for(handle.result(), 30) == 0
        assert {s for s, _c in states(engine, ids).values()} == {"pending"}
        assert {s for s, _c in states(engine, still).values()} == {"blocked"}
        assert (await parked.describe()).status == WorkflowExecutionStatus.RUNNING
        assert await _probes(parked) == before
        assert switch.calls == 0  # no wait probed
        assert resolved_blocked_keys(engine) == set()
        await parked.signal(IdentityWaitWorkflow.wake)
        assert await asyncio.wait_for(parked.result(), 30) == 2


async def test_a_parked_wait_expires_at_its_first_due(skipping_env, settings):
    """Expiry needs no probing before it: the wait sleeps to the first item's
    due time (counted from its registration), probes once, and expires it
    (the seed's rule: due and a fresh unresolved read)."""
    engine = queue_db(settings)
    client = skipping_env.client
    queue = settings.identity_task_queue
    switch = Switch("unresolved")
    ids = block(engine, 2)
    await set_blocked_at(skipping_env, engine, ids, 0)  # by the skipping server's clock
    config = cfg(
        probe_interval_seconds=5,
        max_probe_interval_seconds=60,
        max_wait_seconds=600,
        search_attributes=False,
    )
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(client, settings, queue, ids, config, probe_now=False)
        await _sleeping(handle)  # parked, in real time, before any skipping
        await skipping_env.sleep(timedelta(minutes=9))
        assert switch.calls == 0
        await skipping_env.sleep(timedelta(minutes=3))
        assert await asyncio.wait_for(handle.result(), 30) == 0
    assert switch.calls == 1
    assert {c for _s, c in states(engine, ids).values()} == {"identity-convergence-expired"}


def test_recheck_matches_a_probe_per_row_across_kinds_and_collations(settings):
    """The one set-based recheck finds exactly what a probe per blocked row finds:
    remote links and records, on an object table whose collation differs from
    the system tables' (MariaDB: ``utf8mb4_unicode_ci``)."""
    from nexuscrm import catalog
    from nexuscrm.packs.model import ObjectSpec

    engine = queue_db(settings)
    spec = ObjectSpec(api_name="Parent__c")
    with engine.begin() as conn:
        conn.execute(insert(t.object_meta).values(**catalog.object_row(spec, pack="test")))
        table = catalog.object_table(spec, engine.dialect.name)
        table.create(conn)
        if engine.dialect.name == "mysql":
            conn.exec_driver_sql(
                f"ALTER TABLE `{table.name}` CONVERT TO CHARACTER SET utf8mb4 "
                "COLLATE utf8mb4_unicode_ci"
            )
        conn.execute(insert(table).values(Id="p-1", Name="one"))
    catalog.CACHE.invalidate()
    linked = Dependency.remote("o", "ns", "Account", "r-linked")
    deps = [
        linked,
        Dependency.remote("o", "ns", "Account", "r-missing"),
        Dependency.record("Parent__c", "p-1"),
        Dependency.record("Parent__c", "p-2"),
        Dependency.record("NoSuchObject__c", "p-1"),
    ]
    for dep in deps:
        block(engine, 2, dep)
    link(engine, linked)
    want = {k for _w, k in blocked_on_linked(engine)}
    assert want == {linked.key_hash, Dependency.record("Parent__c", "p-1").key_hash}
    assert resolved_blocked_keys(engine) == want
    from nexuscrm.connectors import queue as wq

    wq.wake_blocked_keys(engine, sorted(want))
    assert resolved_blocked_keys(engine) == set() and blocked_on_linked(engine) == []


async def test_a_stopping_worker_stops_the_identity_closer(temporal_env, settings) -> None:
    """The closer (background wake signals of waits whose items woke) outlived its
    worker: in a process that goes on (the bench's next run, on a fresh server) it
    kept retrying thousands of signals to the stopped server. A stopping worker
    group gives it CLOSER_STOP_GRACE_S, then cancels it; what it had not signalled
    is left to recovery's sweep and counted."""
    from activities.common import BatchLoad
    from activities.identity import IdentityActivities
    from nexuscrm.db.engine import make_engine
    from nexusctl.worker import build_connector_worker

    engine = make_engine(settings.database_url)
    load = BatchLoad()
    acts = IdentityActivities(engine, settings, load=load)
    acts.close_pause_busy_s = 1.0  # one close a second while a batch runs
    keys = [f"k{i:03d}" for i in range(100)]
    with load.batch():  # an inbound batch runs throughout: the closer paces itself
        acts._close_later(temporal_env.client, settings.database_id, keys)
        await asyncio.sleep(1.5)
        began = time.monotonic()
        left = await acts.stop_closer(grace_s=0.5)
        stopped_s = time.monotonic() - began
    assert stopped_s < 3, stopped_s
    assert acts._closer is None and not acts._to_close
    assert 90 <= left < 100, left
    assert await acts.stop_closer() == 0  # again: nothing to do
    engine.dispose()
    # the connector worker group runs it when it stops
    group = build_connector_worker(temporal_env.client, settings)
    (hook,) = group.on_stop
    assert isinstance(getattr(hook, "__self__", None), IdentityActivities)
    assert hook.__name__ == "stop_closer"
