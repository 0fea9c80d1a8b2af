"""Identity-convergence waits: blocking, waking, expiry, recovery (real Temporal servers)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, select, update
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from activities.identity import IdentityActivities, start_wait
from nexuscrm.connectors import workqueue
from nexuscrm.connectors.identity import Dependency, wait_workflow_id
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.identity import (
    wake_identity_convergence_record,
    wake_identity_convergence_remote_identity,
)
from nexusctl.temporal import SEARCH_ATTRIBUTES
from workflows.identity import IdentityWaitWorkflow
from workflows.models import IdentityWaitConfig, IdentityWaitStatus, WakeResult

DEP = Dependency.remote("salesforce-sync", "salesforce-sync", "Account", "acct-1")


@workflow.defn(name="RecoverOnce", sandboxed=False)
class RecoverOnce:
    @workflow.run
    async def run(self, database_id: str) -> int:
        return await workflow.execute_activity(
            "identity.recover",
            database_id,
            result_type=int,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


class Switch:
    """A scripted resolver: converged / unresolved / raise / hang."""

    def __init__(self, mode: str = "unresolved") -> None:
        self.mode = mode
        self.calls = 0

    def __call__(self, engine: Engine, dep: Dependency) -> bool:
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("owner unavailable")
        if self.mode == "hang":
            import time

            time.sleep(3)
        return self.mode == "converged"


def cfg(**kw: Any) -> IdentityWaitConfig:
    base: dict[str, Any] = {
        "probe_interval_seconds": 0.2,
        "max_probe_interval_seconds": 0.5,
        "probe_timeout_seconds": 1.0,
        "max_wait_seconds": 0,
        "liveness_grace_seconds": 5,
    }
    base.update(kw)
    return IdentityWaitConfig(**base)


def queue_db(settings: Settings) -> Engine:
    engine = make_engine(settings.database_url)
    t.system_metadata.create_all(engine)
    return engine


def block(engine: Engine, n: int, dep: Dependency = DEP, *, probe_after: Any = None) -> list[str]:
    """Enqueue and claim ``n`` items, block them on ``dep``; returns their work ids."""
    tag = uuid.uuid4().hex[:6]
    reqs = [
        workqueue.EnqueueRequest(
            installed_pack_id="inst-1",
            namespace="salesforce-sync",
            event_kind="record.upsert",
            idempotency_key=f"{tag}-{i}",
            source_object="Contact",
            source_id=f"{tag}-{i}",
            payload={},
        )
        for i in range(n)
    ]
    workqueue.enqueue(engine, reqs)
    items = workqueue.claim(
        engine,
        installed_pack_id="inst-1",
        queue_classes=[],
        batch_size=n,
        lease_owner="t",
        lease_seconds=60,
        max_processing_rows=1000,
    )
    with engine.begin() as conn:
        for item in items:
            workqueue.block_item(
                conn, item, dep, summary="parent not linked", probe_after=probe_after
            )
    return [i.work_id for i in items]


def states(engine: Engine, work_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    w = t.connector_work_item
    with engine.connect() as conn:
        rows = conn.execute(
            select(w.c.WorkId, w.c.State, w.c.FailureClass).where(w.c.WorkId.in_(work_ids))
        ).all()
    return {r.WorkId: (r.State, r.FailureClass) for r in rows}


def wait_worker(
    client: Client, settings: Settings, engine: Engine, resolver: Any, queue: str
) -> Worker:
    from concurrent.futures import ThreadPoolExecutor

    acts = IdentityActivities(engine, settings, cfg(), resolver=resolver)
    return Worker(
        client,
        task_queue=queue,
        workflows=[IdentityWaitWorkflow, RecoverOnce],
        activities=acts.all(),
        activity_executor=ThreadPoolExecutor(4),
    )


async def begin(
    client: Client,
    settings: Settings,
    queue: str,
    ids: list[str],
    config: IdentityWaitConfig,
    dep: Dependency = DEP,
) -> Any:
    await start_wait(
        client,
        database_id=settings.database_id,
        task_queue=queue,
        dependency=dep,
        work_ids=ids,
        config=config,
    )
    return client.get_workflow_handle(wait_workflow_id(settings.database_id, dep.key_hash))


async def test_wake_without_waiter_and_duplicate_wakes(temporal_env, settings):
    engine = queue_db(settings)
    ids = block(engine, 2)
    client = temporal_env.client
    args = (DEP.owner_key, DEP.namespace, DEP.object_api_name, DEP.remote_id)
    assert await wake_identity_convergence_remote_identity(client, settings, *args) == 2
    assert await wake_identity_convergence_remote_identity(client, settings, *args) == 0
    assert {s for s, _c in states(engine, ids).values()} == {"pending"}
    assert await wake_identity_convergence_record(client, settings, "Account", "nope") == 0


async def test_wait_converges_on_first_probe_and_on_wake(temporal_env, settings):
    engine = queue_db(settings)
    client = temporal_env.client
    queue = f"id-{uuid.uuid4().hex[:6]}"
    switch = Switch("converged")  # the link exists before the wait starts
    ids = block(engine, 2)
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(client, settings, queue, ids, cfg())
        assert await handle.result() == 2
        assert {s for s, _c in states(engine, ids).values()} == {"pending"}

        switch.mode = "unresolved"
        other = Dependency.record("Account", "001x")
        ids2 = block(engine, 3, other)
        handle = await begin(client, settings, queue, ids2, cfg(probe_interval_seconds=60), other)
        await asyncio.sleep(0.5)
        status = await handle.query(IdentityWaitWorkflow.status)
        assert isinstance(status, IdentityWaitStatus)
        assert status.items == sorted(ids2) and status.probes >= 1
        first, second = await asyncio.gather(
            wake_identity_convergence_record(client, settings, "Account", "001x"),
            wake_identity_convergence_record(client, settings, "Account", "001x"),
        )
        assert sorted([first, second]) == [0, 3]
        assert await handle.result() == 3
        assert await wake_identity_convergence_record(client, settings, "Account", "001x") == 0


async def test_invalid_and_recovery(temporal_env, settings):
    engine = queue_db(settings)
    client = temporal_env.client
    queue = f"id-{uuid.uuid4().hex[:6]}"
    ids = block(engine, 3)
    w = t.connector_work_item
    with engine.begin() as conn:  # one row lost its dependency; one is the seed's parked shape
        conn.execute(update(w).where(w.c.WorkId == ids[0]).values(DependencyKind=None))
        conn.execute(
            update(w)
            .where(w.c.WorkId == ids[1])
            .values(State="processing", DependencyKeyHash="seed-hash")
        )
    switch = Switch("unresolved")
    async with wait_worker(client, settings, engine, switch, queue):
        started = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert started == 1
        got = states(engine, ids)
        assert got[ids[0]] == ("failed", "identity-convergence-invalid")
        assert got[ids[1]][0] == "blocked" and got[ids[2]][0] == "blocked"
        handle = client.get_workflow_handle(wait_workflow_id(settings.database_id, DEP.key_hash))
        await asyncio.sleep(0.5)
        status = await handle.query(IdentityWaitWorkflow.status)
        assert set(status.items) == {ids[1], ids[2]}
        # a live wait marks its rows: a second recovery starts nothing
        again = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert again == 0
        switch.mode = "converged"
        assert await handle.result() == 2


async def test_wait_survives_worker_restart(temporal_env, settings):
    engine = queue_db(settings)
    client = temporal_env.client
    queue = f"id-{uuid.uuid4().hex[:6]}"
    switch = Switch("unresolved")
    ids = block(engine, 1)
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(
            client,
            settings,
            queue,
            ids,
            cfg(probe_interval_seconds=1, max_probe_interval_seconds=1),
        )
        await asyncio.sleep(0.5)
    # no worker while the wait sleeps; the owner converges meanwhile
    switch.mode = "converged"
    await asyncio.sleep(1.5)
    async with wait_worker(client, settings, engine, switch, queue):
        assert await asyncio.wait_for(handle.result(), 20) == 1
    assert states(engine, ids)[ids[0]][0] == "pending"


async def test_expiry_only_after_fresh_unresolved_probe(skipping_env, settings):
    engine = queue_db(settings)
    client = skipping_env.client
    queue = f"id-{uuid.uuid4().hex[:6]}"
    ids = block(engine, 2)
    other = Dependency.record("Account", "never")
    ids_err = block(engine, 1, other)
    switch = Switch("unresolved")
    failing = Switch("raise")

    def resolver(engine: Engine, dep: Dependency) -> bool:
        return (failing if dep == other else switch)(engine, dep)

    config = cfg(
        probe_interval_seconds=5,
        max_probe_interval_seconds=60,
        max_wait_seconds=1800,
        search_attributes=False,  # the time-skipping server has none
    )
    async with wait_worker(client, settings, engine, resolver, queue):
        erring = await begin(client, settings, queue, ids_err, config, other)
        handle = await begin(client, settings, queue, ids, config)
        await skipping_env.sleep(timedelta(minutes=31))  # skipped time
        for _ in range(100):
            if set(states(engine, ids).values()) == {("failed", "identity-convergence-expired")}:
                break
            await asyncio.sleep(0.1)
        assert set(states(engine, ids).values()) == {("failed", "identity-convergence-expired")}
        assert await handle.result() == 0
        assert switch.calls >= 1  # expired only after a fresh unresolved probe
        # the erring probe never expires: still blocked after the same 30+ minutes
        assert states(engine, ids_err)[ids_err[0]][0] == "blocked"
        for _ in range(50):
            if failing.calls >= 2:
                break
            await asyncio.sleep(0.1)
        assert failing.calls >= 2
        assert states(engine, ids_err)[ids_err[0]][0] == "blocked"
        await erring.terminate()


class Gate:
    """A slow resolver: each call signals ``entered`` and blocks until ``release``
    (or ``hold`` seconds), then answers ``converged``. Thread-safe counters."""

    def __init__(self, converged: bool = False, hold: float = 30.0) -> None:
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()
        self.converged = converged
        self.hold = hold
        self.calls = 0

    def __call__(self, engine: Engine, dep: Dependency) -> bool:
        self.calls += 1
        self.entered.set()
        self.release.wait(self.hold)
        return self.converged


class CountingActivities(IdentityActivities):
    """``IdentityActivities`` counting the ``identity.wake`` runs and rows they woke."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.wake_runs = 0
        self.woken_rows = 0

    @activity.defn(name="identity.wake")
    def wake(self, key_hash: str) -> WakeResult:
        res = super().wake(key_hash)
        self.wake_runs += 1
        self.woken_rows += res.woken
        return res


async def test_wake_during_probe_wakes_once(temporal_env, settings):
    """A ``wake`` signal that arrives while a (slow, unresolved) probe runs is not
    lost: the wait wakes its items exactly once and completes, without probing again."""
    from concurrent.futures import ThreadPoolExecutor

    engine = queue_db(settings)
    client = temporal_env.client
    queue = f"id-{uuid.uuid4().hex[:6]}"
    gate = Gate(converged=False)
    acts = CountingActivities(engine, settings, cfg(), resolver=gate)
    ids = block(engine, 3)
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[IdentityWaitWorkflow],
        activities=acts.all(),
        activity_executor=ThreadPoolExecutor(4),
    )
    # Only a wake can complete this wait: probes say unresolved, the next one is a minute away.
    config = cfg(probe_interval_seconds=60, max_probe_interval_seconds=60, probe_timeout_seconds=20)
    async with worker:
        handle = await begin(client, settings, queue, ids, config)
        assert await asyncio.to_thread(gate.entered.wait, 10), "first probe never ran"
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.state == "probing"
        await handle.signal(IdentityWaitWorkflow.wake)  # lands while the probe is in flight
        await asyncio.sleep(0.5)
        assert (await handle.query(IdentityWaitWorkflow.status)).state == "probing"
        gate.release.set()  # the probe now answers "unresolved"
        assert await asyncio.wait_for(handle.result(), 20) == 3
        assert {s for s, _c in states(engine, ids).values()} == {"pending"}
        assert gate.calls == 1  # no probe after the wake
        assert (acts.wake_runs, acts.woken_rows) == (1, 3)
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.state == "woken" and status.woken == 3
    args = (DEP.owner_key, DEP.namespace, DEP.object_api_name, DEP.remote_id)
    assert await wake_identity_convergence_remote_identity(client, settings, *args) == 0


async def test_hung_probe_times_out_never_expires(skipping_env, settings):
    """A probe hung past the probe timeout counts as a failed probe: the wait
    reschedules and never expires its items, even far past the max wait; the
    worker keeps serving (a second wait converges by probe once the hang ends)."""
    engine = queue_db(settings)
    client = skipping_env.client
    queue = f"id-{uuid.uuid4().hex[:6]}"
    hung = Gate(converged=False, hold=120.0)  # unresolved, but only after the timeout
    fine = Switch("converged")
    other = Dependency.record("Account", "later")

    def resolver(engine: Engine, dep: Dependency) -> bool:
        return (fine if dep == other else hung)(engine, dep)

    ids = block(engine, 2)
    config = cfg(
        probe_interval_seconds=5,
        max_probe_interval_seconds=60,
        probe_timeout_seconds=0.2,  # each timed-out probe costs real time: keep it short
        max_wait_seconds=300,
        search_attributes=False,
    )
    try:
        async with wait_worker(client, settings, engine, resolver, queue):
            handle = await begin(client, settings, queue, ids, config)
            assert await asyncio.to_thread(hung.entered.wait, 10)
            await skipping_env.sleep(timedelta(minutes=15))  # 3x the max wait, skipped
            status = None
            for _ in range(100):
                status = await handle.query(IdentityWaitWorkflow.status)
                if status.probes >= 2 and status.state == "probe-failed":
                    break
                await asyncio.sleep(0.1)
            assert status is not None
            assert status.state == "probe-failed", status
            assert status.probes >= 2  # the timed-out probe was counted and rescheduled
            assert sorted(status.items) == sorted(ids)
            assert hung.calls == 1  # later probes timed out waiting for the held slot
            assert {s for s, _c in states(engine, ids).values()} == {"blocked"}
            desc = await handle.describe()
            assert desc.status == WorkflowExecutionStatus.RUNNING

            # The hang ends; the worker is healthy: a second wait converges by probe.
            hung.release.set()
            ids2 = block(engine, 1, other)
            second = await begin(client, settings, queue, ids2, config, other)
            assert await asyncio.wait_for(second.result(), 30) == 1
            assert fine.calls >= 1
            assert states(engine, ids2)[ids2[0]][0] == "pending"
            assert {s for s, _c in states(engine, ids).values()} == {"blocked"}
            await handle.terminate()
    finally:
        hung.release.set()


async def test_no_wait_left_running_after_sync(temporal_env, settings):
    """The shuffled DreamHouse + eBikes sync converges; no identity wait is left open."""
    from tests.test_connector_runtime import test_corpus_data_plans_sync_shuffled

    await test_corpus_data_plans_sync_shuffled(temporal_env, settings)
    query = f"WorkflowType = 'IdentityWait' AND NexusDatabase = '{settings.database_id}'"
    seen = 0
    for _ in range(50):
        running = 0
        seen = 0
        async for wf in temporal_env.client.list_workflows(query):
            seen += 1
            running += wf.status == WorkflowExecutionStatus.RUNNING
        if running == 0:
            break
        await asyncio.sleep(0.2)
    assert running == 0
    assert seen > 0  # children arrived before parents: waits were used


_ = SEARCH_ATTRIBUTES
