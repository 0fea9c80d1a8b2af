"""SIGKILL of the worker in each long ApplyAll phase in turn (issue 17, crashes):
one ApplyAll, its worker killed in rebuild-derived, the next one killed in
ensure-indexes, the next in verify; the last worker completes the same
workflow, and the database equals an uninterrupted run (schema and ``_System_*``
rows, via ``snapshot``). The kill in apply-packs is ``tests/test_apply_all.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml
from temporalio.service import RPCError

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import apply_all, snapshot
from tests.conftest import fresh_database_url

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["rebuild-derived", "ensure-indexes", "verify"]


def wide_pack(path: Path, objects: int = 80, fields: int = 12) -> Path:
    """An app pack big enough that each long phase takes a moment."""
    path.write_text(
        yaml.safe_dump(
            {
                "name": "kill-app",
                "category": "AppPack",
                "depends_on": ["platform-core"],
                "objects": [
                    {
                        "api_name": f"Kill{i:03d}__c",
                        "label": f"Kill {i}",
                        "fields": [
                            {"api_name": f"F{j:02d}__c", "type": "Number" if j % 2 else "Text"}
                            for j in range(fields)
                        ],
                    }
                    for i in range(objects)
                ],
            }
        )
    )
    return path


def worker(settings: Settings, temporal_env: Any) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
        "NEXUS_LOG_FORMAT": "json",
        "NEXUS_LOG_LEVEL": "WARNING",
    }
    return subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)


async def test_worker_killed_in_each_long_phase_in_turn(
    temporal_env: Any, settings: Settings, tmp_path: Path
) -> None:
    pack = wide_pack(tmp_path / "wide.yaml")
    killed: list[str] = []
    proc = worker(settings, temporal_env)  # the queue needs a worker to take the request
    try:
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(pack)], heartbeat_timeout_seconds=3),
        )
        for n, phase in enumerate(PHASES):
            if n:
                proc = worker(settings, temporal_env)
            status: dict[str, str] = {}
            for _ in range(3000):
                try:
                    progress = await handle.query("progress")
                except RPCError:  # the new worker is not polling yet (context canceled)
                    await asyncio.sleep(0.2)
                    continue
                status = {p["name"]: p["status"] for p in progress}
                if status.get(phase) != "pending":
                    break
                assert proc.poll() is None, "the worker died on its own"
                await asyncio.sleep(0.02)
            if status.get(phase) == "running":
                proc.send_signal(signal.SIGKILL)
                killed.append(phase)
            else:
                proc.terminate()
            proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, "no phase was running when its worker was killed"
    catalog.CACHE.invalidate()
    async with build_worker(temporal_env.client, settings):
        result = await handle.result()
    assert result.status == "completed", result
    interrupted = snapshot(make_engine(settings.database_url))
    backend = "sqlite" if settings.database_url.startswith("sqlite") else "mysql"
    for url in fresh_database_url(backend, tmp_path / "ref"):
        ref = Settings(
            database_url=url,
            controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
            env="development",
            NEXUS_DATABASE_ID=f"ref-{uuid.uuid4().hex[:8]}",
        )
        catalog.CACHE.invalidate()
        await apply_all(temporal_env, ref, app_pack_sources=[str(pack)])
        assert snapshot(make_engine(url)) == interrupted
