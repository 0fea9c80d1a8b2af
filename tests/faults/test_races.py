"""Races with real processes (issue 17, races): the same events enqueued by 100
enqueuers at once (CLI processes and threads) are stored once; two worker
processes on one task queue both process events (read from each process's
own Prometheus endpoint) and apply every event exactly once, each record at
its last version."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from tests.builders import (
    SF_SYNC,
    account_versions,
    applied_twice,
    cli_env,
    connector_settings,
    fast_fleet,
    free_port,
    install,
    last_phones,
    scrape_until,
    value,
)

ROOT = Path(__file__).resolve().parents[2]


async def test_same_events_enqueued_by_many_processes_are_stored_once(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    lines = [
        {
            "event_kind": "salesforce.record.upsert",
            "idempotency_key": f"Account:r{k}",
            "source_object": "Account",
            "source_id": f"r{k}",
            "payload": {"sobject": "Account", "remote_id": f"r{k}", "fields": {"Name": f"R{k}"}},
        }
        for k in range(50)
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    env = {**os.environ, **cli_env(settings, temporal_env)}
    # 100 enqueuers at once: 8 `nexusctl events enqueue` processes and 4
    # processes of 23 threads each (100 CLI processes would take minutes of CPU)
    cli = [sys.executable, "-m", "nexusctl.cli", "events", "enqueue", str(path)]
    threads = [sys.executable, str(ROOT / "tests" / "faults" / "enqueue_threads.py"), str(path)]
    procs = [
        subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for command in [cli] * 8 + [[*threads, "23"]] * 4
    ]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    counts = [line.split() for o in outputs for line in o.splitlines() if "duplicate" in line]
    assert len(counts) == 100, outputs
    # "enqueued N event(s), M duplicate(s) skipped" / "inserted N duplicates M"
    inserted = sum(int(c[1]) for c in counts)
    skipped = sum(int(c[3]) for c in counts)
    assert (inserted, skipped) == (len(lines), 99 * len(lines)), outputs
    with engine.connect() as conn:
        events = conn.execute(select(func.count()).select_from(t.connector_event)).scalar_one()
        items = conn.execute(select(func.count()).select_from(t.connector_work_item)).scalar_one()
    assert (events, items) == (len(lines), len(lines))


async def processed_by(port: int, labels: dict[str, str]) -> int:
    """``nexus_events_processed_total`` with ``labels`` on the worker process
    serving metrics on ``port`` (0 while it has none)."""
    samples = await scrape_until(f"http://127.0.0.1:{port}/metrics", lambda s: True)
    return int(value(samples, "nexus_events_processed_total", **labels) or 0)


async def _pollers(client: Any, task_queue: str, n: int, timeout: float = 60) -> None:
    """Wait until ``n`` distinct workers poll ``task_queue`` for activities (the
    server's ``DescribeTaskQueue``)."""
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    request = DescribeTaskQueueRequest(
        namespace=client.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
    )
    seen: set[str] = set()
    for _ in range(int(timeout / 0.2)):
        described = await client.workflow_service.describe_task_queue(request)
        seen = {p.identity for p in described.pollers}
        if len(seen) >= n:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{len(seen)} of {n} worker processes poll {task_queue}: {seen}")


async def test_two_worker_processes_on_one_task_queue_apply_each_event_once(
    temporal_env: Any, settings: Any
) -> None:
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    records, versions = 1000, 4
    queue.enqueue(engine, account_versions(pack.install_id, pack.namespace, records, versions))
    total = records * versions
    env = {
        **os.environ,
        **cli_env(settings, temporal_env),
        "NEXUS_CONNECTOR_TASK_QUEUE": settings.connector_task_queue,
        # Short stints: a process activity hands its worker back every 0.2 s, so
        # the batches of 4,000 events go to both processes (with the default 2 s,
        # one stint may claim them all before the other process polls).
        "NEXUS_CONNECTOR_STINT_SECONDS": "0.2",
    }
    ports = [free_port(), free_port()]
    workers = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py")],
            env={**env, "NEXUS_METRICS_ADDRESS": f"127.0.0.1:{port}"},
            cwd=ROOT,
        )
        for port in ports
    ]
    labels = {"pack": "salesforce-sync", "queue_class": "default", "outcome": "succeeded"}
    try:
        # Both processes poll the connector activity queue (the server's list of its
        # pollers) before any work, or the first may run them all before the second
        # starts.
        await _pollers(temporal_env.client, settings.connector_task_queue, len(workers))
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        w = t.connector_work_item
        done = 0
        for _ in range(1500):
            with engine.connect() as conn:
                done = conn.execute(
                    select(func.count()).select_from(w).where(w.c.State == "succeeded")
                ).scalar_one()
            if done == total:
                break
            assert all(p.poll() is None for p in workers), "a worker process died"
            await asyncio.sleep(0.2)
        # each process's own count of the events it processed: a batch's
        # counter moves once its activity ends, just after its commit
        per_process: list[int] = []
        for _ in range(150):
            per_process = [await processed_by(port, labels) for port in ports]
            if sum(per_process) >= total:
                break
            await asyncio.sleep(0.2)
        await fleet.signal("stop")
        await fleet.result()
    finally:
        for p in workers:
            p.terminate()
        for p in workers:
            p.wait(60)
    assert done == total
    assert all(n > 0 for n in per_process), per_process  # both processes did work
    assert sum(per_process) == total, per_process  # and no event was processed twice
    a = t.connector_work_attempt
    with engine.connect() as conn:
        owners = conn.execute(
            select(func.count(func.distinct(a.c.WorkId))).where(a.c.OutcomeState == "succeeded")
        ).scalar_one()
    assert applied_twice(engine) == [] and owners == total
    assert last_phones(engine) == {f"Account {k}": f"v{versions - 1}" for k in range(records)}
