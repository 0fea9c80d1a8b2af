"""SIGKILL of the worker in each long ApplyAll phase in turn (issue 17, crashes):
one ApplyAll, its worker killed in the middle of rebuild-derived (50 ms after
the phase's activity started, by ``crashing_worker.py``), the next one in the
middle of ensure-indexes, the next in verify; the last worker completes the
same workflow, and the database equals an uninterrupted run (schema and
``_System_*`` rows, via ``snapshot``). The kill in apply-packs is
``tests/test_apply_all.py``; kills after each phase's work,
``test_phase_kills.py``."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import apply_all, snapshot, worker_process
from tests.conftest import fresh_database_url

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["rebuild-derived", "ensure-indexes", "verify"]
ACTIVITY = {phase: "controlplane." + phase.replace("-", "_") for phase in PHASES}


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


def killed_in(
    settings: Settings, temporal_env: Any, activity_type: str, log: Path
) -> subprocess.Popen[bytes]:
    """A control-plane worker that SIGKILLs itself 50 ms into the first attempt of
    ApplyAll's activity ``activity_type``, after appending the phase to ``log``."""
    return worker_process(
        settings,
        temporal_env,
        "tests/faults/crashing_worker.py",
        log_level="WARNING",
        NEXUS_TEST_CRASH_IN_ACTIVITY_TYPE=activity_type,
        NEXUS_TEST_CRASH_LOG=str(log),
    )


async def test_worker_killed_in_each_long_phase_in_turn(
    temporal_env: Any, settings: Settings, tmp_path: Path
) -> None:
    pack = wide_pack(tmp_path / "wide.yaml")
    log = tmp_path / "killed.txt"
    proc = killed_in(settings, temporal_env, ACTIVITY[PHASES[0]], log)
    try:
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(pack)], heartbeat_timeout_seconds=3),
        )
        for n, phase in enumerate(PHASES):
            if n:
                proc = killed_in(settings, temporal_env, ACTIVITY[phase], log)
            try:
                proc.wait(300)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the worker was not killed in {phase}") from None
            assert proc.returncode == -signal.SIGKILL, (phase, proc.returncode)
    finally:
        if proc.poll() is None:
            proc.kill()
    # each kill hit its phase mid-work, as the killed worker wrote it
    assert log.read_text().split() == PHASES
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
