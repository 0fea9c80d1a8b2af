"""Issue 10 on a real dev server: a pool is serving with every worker it reports, or
visibly rebuilding. Running workers are counted from the server's list of running
executions (``client.list_workflows``), never from the supervisor's status query."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import Client

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import DesiredPack, FleetStatus, SupervisorStatus
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


async def running_ids(client: Client, query: str) -> list[str]:
    """Ids of the running executions matching ``query`` (visibility)."""
    q = f"ExecutionStatus = 'Running' AND {query}"
    return sorted([wf.id async for wf in client.list_workflows(q)])


async def running_workers(client: Client, supervisor_id: str) -> list[str]:
    return await running_ids(
        client, f"WorkflowType = 'InboundWorker' AND WorkflowId STARTS_WITH '{supervisor_id}/'"
    )


async def wait_workers(client: Client, pool: DesiredPack, timeout: float = 30) -> list[str]:
    """Poll visibility until every worker of ``pool`` runs; return their ids."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        ids = await running_workers(client, pool.supervisor_workflow_id)
        if len(ids) == pool.worker_count:
            return ids
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{len(ids)} of {pool.worker_count} workers run: {ids}")
        await asyncio.sleep(0.2)


async def test_rebuild_of_a_busy_pool_runs_every_worker_and_no_event_waits_past_drain(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    fleet_in = fast_fleet(settings)
    client = temporal_env.client
    hook.delay = 0.01
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fleet_in)
        (first,) = await wait_pools(fleet, 1)
        await wait_workers(client, first)
        queue.enqueue(engine, hook_events(pack.install_id, [f"k{i}" for i in range(300)]))
        await asyncio.sleep(0.5)  # busy: batches in flight
        for _ in range(2):  # two ApplyAll-style rebuilds back to back
            await fleet.signal("reconcile")
            await asyncio.sleep(0.3)
        worst = 0.0

        async def watch() -> None:
            nonlocal worst
            while True:
                for s in queue.pack_queue_stats(engine):
                    worst = max(worst, s.oldest_pending_age_s or 0.0)
                await asyncio.sleep(0.2)

        watcher = asyncio.ensure_future(watch())
        deadline = asyncio.get_running_loop().time() + 30
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
        await wait_drained(engine, timeout=60)
        watcher.cancel()
        # The pool seen above may be the first rebuild's, drained by the second
        # one: judge the pool the fleet serves now, and every pool before it.
        (final,) = (await fleet.query("status", result_type=FleetStatus)).pools
        assert final.supervisor_workflow_id != first.supervisor_workflow_id
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
        # The watcher samples every 0.2 s through a query on a loaded CI box: 3 s
        # of slack for the sampling, not for the pool (seen: a CI run over 5 s).
        assert worst <= fleet_in.drain_timeout_seconds + 3, worst
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
