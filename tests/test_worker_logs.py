"""A worker's log lines, when they go to a file or a pipe, are JSON, one object a
line, its own and the libraries' alike: the SDK core's (a retried RPC, a failed
poll: forwarded to the stdlib logger ``temporalio.core``) and the Python SDK's
loggers, which came out as coloured text of their own between the JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, temporal_binary
from tests.builders import install

ROOT = Path(__file__).resolve().parents[1]


async def test_a_workers_lines_are_all_json_when_its_server_goes_away(tmp_path: Path) -> None:
    """``python worker.py`` with ``NEXUS_LOG_FORMAT=json`` and stderr a pipe, on a dev
    server of this test's own that is shut down under it: the core's warnings about
    the lost server arrive, and every line the process wrote is a JSON object (its
    own ``worker started``, the core's, the shutdown's). SQLite: the database plays
    no part."""
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'nexus.db'}",
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        env="development",
        NEXUS_DATABASE_ID=f"test-{uuid.uuid4().hex[:8]}",
    )
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    proc: subprocess.Popen[bytes] | None = None
    try:
        await install(env, settings, [])
        environ: dict[str, Any] = {
            **os.environ,
            "NEXUS_DATABASE_URL": settings.database_url,
            "NEXUS_DATABASE_ID": settings.database_id,
            "NEXUS_TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
            "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
            "NEXUS_LOG_FORMAT": "json",
            "NEXUS_LOG_LEVEL": "INFO",
            "NO_COLOR": "",
        }
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py")],
            env=environ,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        await asyncio.sleep(4)  # started and polling
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    finally:
        await env.shutdown()
    assert proc is not None
    await asyncio.sleep(6)  # the pollers find the server gone and the core says so
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    parsed, other = [], []
    for ln in lines:
        try:
            parsed.append(json.loads(ln))
        except json.JSONDecodeError:
            other.append(ln)
    assert not other, other[:10]
    events = [p.get("event", "") for p in parsed]
    assert any(e == "worker started" for e in events), events
    core = [p for p in parsed if str(p.get("logger", "")).startswith("temporalio.core")]
    assert core and all(p.get("level") in ("warning", "error") for p in core), parsed[-10:]
