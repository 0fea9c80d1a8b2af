"""SIGTERM of a worker process mid-batch: the batch hands back what it has not started.

A real ``python worker.py`` process on the test's dev server serves a pack
whose items each make a slow webhook call; it is sent SIGTERM while a batch
is in flight. Its ``process`` activity sees the worker shutting down, finishes
the item in hand, hands the leases of the rest back (``queue.release_leases``)
and returns within the graceful shutdown timeout, so a second worker finishes
them at once instead of after the (long) lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import select

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
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
)

ROOT = Path(__file__).resolve().parents[1]
LEASE_S = 120
EVENTS = 300


async def test_sigterm_mid_batch_hands_the_batch_back_at_once(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    pack = next(r for r in list_connector_packs(engine) if r.namespace == "hook-pack")
    keys = [f"k{n:03d}" for n in range(EVENTS)]
    queue.enqueue(engine, hook_events(pack.install_id, keys))
    hook.delay = 0.2  # per item: batches of them are surely in flight at SIGTERM
    env = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
        "NEXUS_CONNECTOR_TASK_QUEUE": settings.connector_task_queue,
        "NEXUS_WORKER_SHUTDOWN_SECONDS": "20",
        # Several batches in flight at SIGTERM, and claims of idle workers beside them.
        "NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK": "4",
        "NEXUS_LOG_FORMAT": "json",
        "NEXUS_LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)
    try:
        inp = fast_fleet(settings)
        inp.lease_seconds = LEASE_S
        fleet = await start_fleet(temporal_env.client, settings, inp)
        for _ in range(1200):  # until the first items of the batch are done
            states = queue.pack_queue_stats(engine)[0].by_state()
            if states.get("succeeded", 0) >= 3 and states.get("processing", 0):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no batch in flight: {states}")
        term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        stopped = time.monotonic() - term
    finally:
        if proc.poll() is None:
            proc.kill()
    # The worker stopped well within its graceful timeout, and left no lease behind.
    assert stopped < 20, stopped
    after_stop = queue.pack_queue_stats(engine)[0].by_state()
    assert not after_stop.get("processing"), after_stop
    assert after_stop.get("pending"), f"the batch was not cut short: {after_stop}"
    hook.delay = 0
    async with build_connector_worker(temporal_env.client, settings):
        states = await wait_drained(engine, timeout=LEASE_S / 2)
        done = time.monotonic() - term
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": EVENTS}
    assert done < LEASE_S / 2, done  # reclaimed at once, not after the lease
    # Every event applied once: one webhook call per key.
    calls = Counter((r.get("payload") or {}).get("key") for r in hook.received)
    assert set(calls) == set(keys) and max(calls.values()) == 1, calls.most_common(3)
    a = t.connector_work_attempt
    with engine.connect() as conn:
        handed_back = conn.execute(
            select(a.c.WorkId).where(
                a.c.OutcomeState == "abandoned", a.c.CauseCode == "worker-shutdown"
            )
        ).all()
    assert handed_back
    print(
        f"SIGTERM: worker exited after {stopped:.1f} s, {len(handed_back)} items handed back, "
        f"all {EVENTS} done {done:.1f} s after SIGTERM (lease {LEASE_S} s)"
    )
