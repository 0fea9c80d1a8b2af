"""A process activity runs further batches itself (a stint), and dies without losing them.

Issue 15: every batch cost a claim local activity, a process activity and
their workflow tasks, about 100 ms of round trips on a 2-core box whatever
the batch's size, so one worker stayed near 1,000 events/s. Under patch
``process-stint`` the process activity claims and runs further batches under
the worker's own lease owner id for up to ``NEXUS_CONNECTOR_STINT_SECONDS``.
Against the real thing (dev server, SQLite and MariaDB, a local HTTP
endpoint, a worker process killed with SIGKILL):

* the server's histories of the pool's workers hold one ``connectors.process``
  activity for three claims' worth of events (three with the stint off);
* a worker killed in a batch its stint claimed (a lease the workflow never
  saw) costs the heartbeat timeout, not the lease: the workflow hands back
  every lease its owner id still holds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from temporalio.client import Client

from nexuscrm.connectors import knobs, queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    HookServer,
    abandoned_attempts,
    cli_env,
    connector_settings,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
)

ROOT = Path(__file__).resolve().parents[1]


async def _process_activities(client: Client, task_queue: str) -> int:
    """``connectors.process`` activities scheduled by the InboundWorker runs on
    ``task_queue``, counted in their histories on the server."""
    runs = [
        wf
        async for wf in client.list_workflows(
            f"WorkflowType = 'InboundWorker' AND TaskQueue = '{task_queue}'"
        )
    ]
    assert runs, "no InboundWorker run listed"
    scheduled = 0
    for wf in runs:
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        for ev in history.events:
            attrs = ev.activity_task_scheduled_event_attributes
            if ev.HasField("activity_task_scheduled_event_attributes"):
                scheduled += attrs.activity_type.name == "connectors.process"
    return scheduled


@pytest.mark.parametrize(("stint_seconds", "activities"), [(0.0, 3), (60.0, 1)])
async def test_one_process_activity_runs_the_batches_of_its_stint(
    temporal_env, settings, hook: HookServer, tmp_path, monkeypatch, stint_seconds, activities
):
    """250 events for a lone worker (claims of 100): three batches, in three process
    activities with the stint off (the seed's one batch per step) and in one with
    it on; every event posted once either way."""
    monkeypatch.setenv(knobs.ENV_WORKERS_PER_PACK, "1")
    settings = connector_settings(settings).model_copy(
        update={"connector_stint_seconds": stint_seconds}
    )
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    keys = [f"k{n:03d}" for n in range(250)]
    queue.enqueue(engine, hook_events(pack.install_id, keys))
    client = temporal_env.client
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        states = await wait_drained(engine, timeout=120)
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": len(keys)}
    assert sorted(c.body["payload"]["key"] for c in hook.calls) == keys
    for _ in range(100):  # visibility lists the runs shortly after they close
        try:
            scheduled = await _process_activities(client, settings.connector_task_queue)
        except AssertionError:
            await asyncio.sleep(0.1)
            continue
        break
    assert scheduled == activities, (stint_seconds, scheduled)
    engine.dispose()


async def test_worker_killed_in_a_batch_its_stint_claimed_costs_the_heartbeat_timeout(
    temporal_env, settings, hook: HookServer, tmp_path
):
    """The workflow saw only the first batch's leases; the kill comes in a later
    batch the activity claimed itself. Its items are handed back when the
    heartbeat times out (``activity-timeout`` attempts), not 120 s later."""
    long_lease, heartbeat_s = 120, 5
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    first, later = ["k00"], [f"k{n:02d}" for n in range(1, 13)]
    queue.enqueue(engine, hook_events(pack.install_id, first))
    hook.delay = 1.0
    env = {
        **os.environ,
        **cli_env(settings, temporal_env),
        "NEXUS_CONNECTOR_STINT_SECONDS": "60",
        knobs.ENV_WORKERS_PER_PACK: "1",
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)
    try:
        inp = fast_fleet(settings)
        inp.lease_seconds = long_lease
        inp.heartbeat_timeout_seconds = heartbeat_s
        fleet = await start_fleet(temporal_env.client, settings, inp)
        await hook.in_flight(first)  # the batch the workflow claimed is running ...
        queue.enqueue(engine, hook_events(pack.install_id, later))  # ... the stint claims these
        await hook.in_flight(later)
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    hook.delay = 0
    async with build_connector_worker(temporal_env.client, settings):
        states = await wait_drained(engine, timeout=long_lease / 2)
        done = time.monotonic() - killed
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": len(first) + len(later)}
    assert done < long_lease / 2, done  # the heartbeat timeout, not the lease
    abandoned = [(k, c) for k, _w, c in abandoned_attempts(engine)]
    # Items of the stint's own claim went back with the activity's timeout.
    assert abandoned and {c for _k, c in abandoned} == {"activity-timeout"}, abandoned
    assert {k.removeprefix("hook:") for k, _c in abandoned} <= set(later), abandoned
    engine.dispose()
    print(f"SIGKILL in a stint's batch: all done {done:.1f} s after the kill")
