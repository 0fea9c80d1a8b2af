"""Record the histories ``tests/test_replay.py`` replays, from the build checked out now.

Skipped unless ``NEXUS_RECORD_HISTORIES=1``: run it on the build that is about
to be released (``NEXUS_RECORD_HISTORIES=1 pytest -q tests/test_record_histories.py
-k sqlite -s``) and commit the new ``tests/histories/*.json.gz``. It records a
fleet whose pool ran, was rebuilt and which continued-as-new, the first pool's
supervisor (started, rebuilt away, drained) and one of its workers, and prints
the history events per hour of an idle fleet, supervisor and worker with the
default settings (measured over ``NEXUS_MEASURE_SECONDS``, 30 s by default);
and the control-plane queue entity with an ApplyAll and a RemovePack child.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHistory

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import ApplyAllInput, DesiredPack, FleetStatus
from nexuscrm.contracts.controlplane_queue import RemovePackInput
from nexuscrm.db.engine import make_engine
from nexusctl.controlplane_queue import run_queued, settled
from nexusctl.temporal import fleet_input, start_controlplane, start_fleet
from nexusctl.worker import build_connector_worker, build_worker
from tests.builders import (
    connector_settings,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
    wait_pools,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("NEXUS_RECORD_HISTORIES") != "1", reason="records histories on demand"
)
HISTORIES = Path(__file__).parent / "histories"


def save(kind: str, history: WorkflowHistory) -> Path:
    data = history.to_json()
    path = HISTORIES / f"{kind}-{hashlib.sha256(data.encode()).hexdigest()[:12]}.json.gz"
    path.write_bytes(gzip.compress(data.encode(), 9))
    return path


async def rebuilt(fleet: Any, old: DesiredPack, timeout: float = 60) -> DesiredPack:
    """The fleet's one pool once it is no longer ``old`` (another supervisor)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        pools = (await fleet.query("status", result_type=FleetStatus)).pools
        if len(pools) == 1 and pools[0].supervisor_workflow_id != old.supervisor_workflow_id:
            return pools[0]
        assert asyncio.get_running_loop().time() < deadline, pools
        await asyncio.sleep(0.2)


async def history_length(client: Client, wf_id: str) -> int:
    return (await client.get_workflow_handle(wf_id).describe()).history_length


async def test_record_fleet_supervisor_and_worker_histories(temporal_env, settings, hook, tmp_path):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    client = temporal_env.client
    inp = fast_fleet(settings)
    inp.reconciles_before_continue_as_new = 12
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, inp)
        first_run = (await fleet.describe()).run_id
        (first,) = await wait_pools(fleet, 1)
        queue.enqueue(engine, hook_events(pack.install_id, [f"r{i}" for i in range(20)]))
        await wait_drained(engine)
        await fleet.signal("reconcile")  # rebuild the pool
        second = await rebuilt(fleet, first)
        sup = client.get_workflow_handle(first.supervisor_workflow_id)
        assert await sup.result() == "drained"
        # a pool that ended: the periodic pass sees it closed and the fleet plans
        # again with fences (replan, patch fleet-periodic-pass) to rebuild it
        await client.get_workflow_handle(second.supervisor_workflow_id).terminate("by hand")
        await rebuilt(fleet, second)
        while (await fleet.describe()).run_id == first_run:  # continued-as-new
            await asyncio.sleep(0.2)
        worker_id = f"{first.supervisor_workflow_id}/r0/worker-0"
        saved = [
            save("ConnectorFleet", await client.get_workflow_handle(
                fleet.id, run_id=first_run).fetch_history()),
            save("PackSupervisor", await sup.fetch_history()),
            save("InboundWorker", await client.get_workflow_handle(worker_id).fetch_history()),
        ]  # fmt: skip
        await fleet.signal("stop")
        await fleet.result()
        print("recorded", *saved)

        # idle history growth with the default settings (reconcile 5 s, idle 5 s)
        fleet = await start_fleet(client, settings, fleet_input(settings))
        (pool,) = await wait_pools(fleet, 1)
        await asyncio.sleep(5)
        ids = [fleet.id, pool.supervisor_workflow_id, f"{pool.supervisor_workflow_id}/r0/worker-0"]
        before = [await history_length(client, i) for i in ids]
        seconds = float(os.environ.get("NEXUS_MEASURE_SECONDS", "30"))
        await asyncio.sleep(seconds)
        after = [await history_length(client, i) for i in ids]
        for name, b, a in zip(["fleet", "supervisor", "worker"], before, after, strict=True):
            print(f"idle {name}: {(a - b) * 3600 / seconds:.0f} events/hour")
        await fleet.signal("stop")
        await fleet.result()


async def test_record_controlplane_queue_histories(temporal_env, settings, tmp_path):
    """The queue entity after an ApplyAll (an app pack) and a RemovePack, and both children."""
    pack = tmp_path / "gizmo.yaml"
    pack.write_text(
        "name: gizmo-app\ncategory: AppPack\ndepends_on: [platform-core]\n"
        "objects:\n  - api_name: Gizmo__c\n    fields: [{api_name: Size__c, type: Number}]\n"
    )
    client = temporal_env.client
    async with build_worker(client, settings):
        apply = await start_controlplane(
            client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=[str(pack)])
        )
        await apply.result()
        remove = await run_queued(client, settings, "RemovePack", RemovePackInput("gizmo-app"))
        await remove.result()
        await settled(client, settings, remove.id.rsplit("/", 1)[-1])
        entity = client.get_workflow_handle(settings.controlplane_workflow_id)
        for kind, handle in (("ControlPlane", entity), ("ApplyAll", apply), ("RemovePack", remove)):
            print(save(kind, await handle.fetch_history()))
