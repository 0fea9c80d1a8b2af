"""``nexusctl worker --processes N``: N worker processes poll the same task queues.

Real processes on the test's dev server: the server's own list of pollers
(``DescribeTaskQueue``) must show one poller per child process; SIGTERM of the
parent stops every child and exits 0; SIGKILL of the parent takes its
children with it (nothing keeps polling unsupervised); a bad count is refused
before anything starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

from tests.builders import cli_env, invoke

ROOT = Path(__file__).resolve().parents[1]


def _env(settings: Any, temporal_env: Any) -> dict[str, str]:
    return {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
        "NEXUS_CONNECTOR_TASK_QUEUE": settings.connector_task_queue,
        "NEXUS_WORKER_SHUTDOWN_SECONDS": "5",
        "NEXUS_LOG_FORMAT": "json",
        "NEXUS_LOG_LEVEL": "WARNING",
    }


async def _pollers(temporal_env: Any, task_queue: str) -> set[str]:
    """Identities the server saw polling ``task_queue`` for workflow tasks."""
    resp = await temporal_env.client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=temporal_env.client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
    )
    return {p.identity for p in resp.pollers}


async def _start(settings: Any, temporal_env: Any, count: int) -> tuple[subprocess.Popen, list]:
    parent = subprocess.Popen(
        [sys.executable, "-m", "nexusctl.cli", "worker", "--processes", str(count)],
        env=_env(settings, temporal_env),
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = psutil.Process(parent.pid).children()
        pids = {str(c.pid) for c in children}
        polling = await _pollers(temporal_env, settings.controlplane_task_queue)
        if len(children) == count and {i.split("@")[0] for i in polling} >= pids:
            return parent, children
        assert parent.poll() is None, f"parent exited with {parent.returncode}"
        await asyncio.sleep(0.5)
    parent.kill()
    raise AssertionError(f"{count} worker processes did not all poll within 60 s")


async def test_two_processes_poll_and_sigterm_stops_both(temporal_env, settings) -> None:
    parent, children = await _start(settings, temporal_env, 2)
    try:
        # Two distinct processes, each a poller the server knows by its pid.
        assert len({c.pid for c in children}) == 2
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(40) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [] and len(gone) == 2
    finally:
        if parent.poll() is None:
            parent.kill()


async def test_sigkill_of_the_parent_takes_the_children(temporal_env, settings) -> None:
    parent, children = await _start(settings, temporal_env, 2)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [], [c.pid for c in alive]


def test_bad_process_counts_are_refused(settings) -> None:
    for raw, message in (("0", "out of range (1-256)"), ("many", "not a whole number or 'auto'")):
        result = invoke(["worker", "--processes", raw], cli_env(settings))
        assert result.exit_code == 2, result.output  # a command-line mistake
        assert "--processes: " in result.output and message in result.output
        assert "see 'nexusctl worker --help'" in result.output


def test_each_child_gets_a_metrics_port_of_its_own() -> None:
    from nexusctl.worker_processes import child_environment

    env = {"NEXUS_METRICS_ADDRESS": "127.0.0.1:9464", "OTHER": "x"}
    ports = [child_environment(k, env)["NEXUS_METRICS_ADDRESS"] for k in range(3)]
    assert ports == ["127.0.0.1:9464", "127.0.0.1:9465", "127.0.0.1:9466"]
    assert child_environment(1, {"OTHER": "x"}) == {"OTHER": "x"}  # no endpoint: unchanged
