"""Issue 10 on a real dev server: a pool is serving with every worker it reports, or
visibly rebuilding. Running workers are counted from the server's list of running
executions (``client.list_workflows``), never from the supervisor's status query."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import func, select
from temporalio.client import Client

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import DesiredPack, FleetStatus, SupervisorStatus
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    connector_settings,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
    wait_pools,
)
from tests.history import activity_types, periodic_outcomes


async def running_ids(client: Client, query: str) -> list[str]:
    """Ids of the running executions matching ``query`` (visibility)."""
    q = f"ExecutionStatus = 'Running' AND {query}"
    return sorted([wf.id async for wf in client.list_workflows(q)])


async def running_workers(client: Client, supervisor_id: str) -> list[str]:
    return await running_ids(
        client, f"WorkflowType = 'InboundWorker' AND WorkflowId STARTS_WITH '{supervisor_id}/'"
    )


def attempts_by_cause(engine: Any) -> dict[str | None, int]:
    """Attempt rows by ``CauseCode`` (``worker-shutdown``: handed back at a drain's
    end; ``lease-expired``: reclaimed after its lease ran out)."""
    a = t.connector_work_attempt
    with engine.connect() as conn:
        rows = conn.execute(select(a.c.CauseCode, func.count()).group_by(a.c.CauseCode)).all()
    return {code: int(n) for code, n in rows}


async def wait_workers(client: Client, pool: DesiredPack, timeout: float = 30) -> list[str]:
    """Poll visibility until every worker of ``pool`` runs; return their ids."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        ids = await running_workers(client, pool.supervisor_workflow_id)
        if len(ids) == pool.worker_count:
            return ids
        if asyncio.get_running_loop().time() > deadline:
            why = await pool_diagnosis(client, pool.supervisor_workflow_id)
            raise AssertionError(f"{len(ids)} of {pool.worker_count} workers run: {ids}\n{why}")
        await asyncio.sleep(0.2)


async def pool_diagnosis(client: Client, supervisor_id: str) -> str:
    """What the server knows of a pool that is short of workers: the supervisor's
    status, every worker execution under it (any status) and the close events
    of the supervisor's children, for the failure message."""
    lines: list[str] = []
    handle = client.get_workflow_handle(supervisor_id)
    try:
        desc = await handle.describe()
        lines.append(f"supervisor {supervisor_id}: {desc.status and desc.status.name}")
        st = await handle.query("status", result_type=SupervisorStatus)
        lines += [f"  slot {w.ordinal}: {w.state} restarts={w.restarts}" for w in st.workers]
    except Exception as err:  # diagnosis only: never hide the assertion
        lines.append(f"supervisor {supervisor_id}: {err!r}")
    q = f"WorkflowId STARTS_WITH '{supervisor_id}/'"
    lines += [
        f"  {wf.id} {wf.run_id[:8]} {wf.status and wf.status.name}"
        async for wf in client.list_workflows(q)
    ]
    try:
        async for event in handle.fetch_history_events():
            kind = event.WhichOneof("attributes") or ""
            if "child_workflow_execution" in kind and not kind.endswith(
                ("started_event_attributes", "initiated_event_attributes")
            ):
                lines.append(f"  event {event.event_id} {kind}: {str(getattr(event, kind))[:400]}")
    except Exception as err:
        lines.append(f"history: {err!r}")
    return "\n".join(lines)


async def test_rebuild_of_a_busy_pool_runs_every_worker_and_no_event_waits_past_drain(
    temporal_env, settings, hook, tmp_path
):
    """Two rebuilds of a pool whose workers hold batches: every worker of the new
    pool runs, the old pools' workers close, and the events the old pools held
    are handed back when their drain ends, never left to their leases.

    The lease (60 s) is far longer than the drain (5 s) plus the heartbeat that
    carries the cancel (3 s timeout): an item freed by lease expiry would show
    as a ``lease-expired`` attempt and a queue drained only after the lease.
    How long the old batches take before the drain ends depends on the box's
    load (seen: 9-21 s from enqueue on a loaded one), so no sub-lease latency
    is asserted here; ``bench/`` measures latency.
    """
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    fleet_in = fast_fleet(settings)
    fleet_in.lease_seconds = 60
    fleet_in.heartbeat_timeout_seconds = 3
    client = temporal_env.client
    # A batch of ~40-100 items takes longer than the drain: the old pools' workers
    # still hold items when their drain ends, on any box.
    hook.delay = 0.1
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fleet_in)
        (first,) = await wait_pools(fleet, 1)
        await wait_workers(client, first)
        queue.enqueue(engine, hook_events(pack.install_id, [f"k{i}" for i in range(300)]))
        await asyncio.sleep(0.5)  # busy: batches in flight
        for _ in range(2):  # two ApplyAll-style rebuilds back to back
            await fleet.signal("reconcile")
            await asyncio.sleep(0.3)
        rebuilt_at = asyncio.get_running_loop().time()
        deadline = rebuilt_at + 30
        while True:
            st = await fleet.query("status", result_type=FleetStatus)
            pool = st.pools[0] if st.pools else None
            if pool and pool.supervisor_workflow_id not in (first.supervisor_workflow_id,):
                try:
                    await wait_workers(client, pool, timeout=10)
                    break
                except AssertionError:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
            await asyncio.sleep(0.2)
        await wait_drained(engine, timeout=2 * fleet_in.lease_seconds)
        drained_after = asyncio.get_running_loop().time() - rebuilt_at
        # The pool seen above may be the first rebuild's, drained by the second
        # one: judge the pool the fleet serves now, and every pool before it.
        (final,) = (await fleet.query("status", result_type=FleetStatus)).pools
        assert final.supervisor_workflow_id != first.supervisor_workflow_id
        assert final.worker_count == 8  # the default pool: no knob leaked into this process
        # every worker of the serving pool runs; nothing of the old pools does
        assert len(await wait_workers(client, final, timeout=30)) == 8
        assert len(await running_workers(client, final.supervisor_workflow_id)) == 8
        # An old pool's worker closes once its drain (or the cancel after the
        # drain timeout) lands; visibility lags a little behind on a loaded box.
        for old in {first.supervisor_workflow_id, pool.supervisor_workflow_id} - {
            final.supervisor_workflow_id
        }:
            left = await running_workers(client, old)
            deadline = asyncio.get_running_loop().time() + fleet_in.drain_timeout_seconds + 30
            while left and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
                left = await running_workers(client, old)
            assert left == [], old
        # Nothing the old pools held waited for its lease: each was finished, or
        # handed back at the drain's end and claimed again by the new pool.
        attempts = attempts_by_cause(engine)
        assert attempts.get("lease-expired", 0) == 0, attempts
        handed_back = attempts.get("worker-shutdown", 0)
        assert handed_back > 0  # the drain ended with batches in hand
        assert drained_after < fleet_in.lease_seconds / 2, drained_after
        await fleet.signal("stop")
        await fleet.result()


async def test_terminated_supervisor_is_rebuilt_within_one_reconcile_interval(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    client = temporal_env.client
    fleet_in = fast_fleet(settings)
    fleet_in.database_id = settings.database_id
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fleet_in)
        (first,) = await wait_pools(fleet, 1)
        await wait_workers(client, first)
        # the Web UI lists a database's runtime by search attribute
        listed = await running_ids(
            client, f"NexusDatabase = '{settings.database_id}' AND NexusPack = 'hook-pack'"
        )
        assert first.supervisor_workflow_id in listed and len(listed) == 1 + first.worker_count
        await client.get_workflow_handle(first.supervisor_workflow_id).terminate("by hand")
        t0 = asyncio.get_running_loop().time()
        while True:
            pools = (await fleet.query("status", result_type=FleetStatus)).pools
            if pools and pools[0].supervisor_workflow_id != first.supervisor_workflow_id:
                break
            await asyncio.sleep(0.05)
        rebuilt_after = asyncio.get_running_loop().time() - t0
        # one reconcile interval, plus the periodic cycle's own activities on a loaded box
        assert rebuilt_after <= fleet_in.reconcile_interval_seconds + 2.0, rebuilt_after
        await wait_workers(client, pools[0])
        # The pass that saw it closed took no claim fence (its plan could have been
        # discarded); the fleet planned again with fences under its lock and started
        # the pool from that plan: the same fleet keeps its generation.
        assert any(o.replan and o.closed for o in await periodic_outcomes(fleet))
        types = await activity_types(fleet)
        replanned = len(types) - 1 - types[::-1].index("connectors.reconcile_plan")
        assert replanned > types.index("connectors.periodic"), types  # not startup's
        assert types[replanned - 1] == "connectors.periodic", types
        assert pools[0].generation == first.generation
        await fleet.signal("stop")
        await fleet.result()


async def test_a_worker_that_returns_is_re_run_not_counted_as_a_restart(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    client = temporal_env.client
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        (pool,) = await wait_pools(fleet, 1)
        ids = await wait_workers(client, pool)
        worker = client.get_workflow_handle(ids[0])
        before = (await worker.describe()).run_id
        await worker.signal("drain")  # it returns "drained" cleanly
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            desc = await client.get_workflow_handle(ids[0]).describe()
            if desc.run_id != before and desc.status is not None and desc.status.name == "RUNNING":
                break
            assert asyncio.get_running_loop().time() < deadline, desc.status
            await asyncio.sleep(0.1)
        sup = client.get_workflow_handle(pool.supervisor_workflow_id)
        status: Any = await sup.query("status", result_type=SupervisorStatus)
        assert sum(w.restarts for w in status.workers) == 0
        assert len(await running_workers(client, pool.supervisor_workflow_id)) == pool.worker_count
        await fleet.signal("stop")
        await fleet.result()
