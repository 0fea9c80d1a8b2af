"""SIGKILL of the worker after every ApplyAll phase in turn (issue 17, crashes).

Each phase's activity does all its work (its writes are committed), then its
worker is SIGKILLed before it reports the completion; the server retries the
activity on the next worker after the heartbeat timeout (a local phase: the
next worker runs it again after the workflow task's timeout), and that
worker is killed after the next phase. One ApplyAll runs through all of it: it
completes, every phase was killed once, and the database (schema, metadata
rows, row counts of every ``_System_*`` table) equals an uninterrupted run's.
The kills while a long phase runs are ``test_worker_kills.py``.

Slowest of the fault suite: 17 worker starts per backend, ~75-85 s per backend.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import (
    EventType,
    PendingActivityState,
    PendingWorkflowTaskState,
    TimeoutType,
)
from temporalio.client import WorkflowHandle, WorkflowHistory

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.controlplane.inprocess import APPLY_PHASES
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane
from tests.builders import apply_all, snapshot, system_row_counts, worker_process
from tests.conftest import fresh_database_url
from tests.faults.test_worker_kills import wide_pack

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


STICKY_S = 1
"""The killed workers' NEXUS_STICKY_QUEUE_TIMEOUT_SECONDS."""


def sticky_handoffs(history: WorkflowHistory) -> list[float]:
    """Seconds each workflow task waited on a (dead) worker's sticky queue before
    the server timed it out (schedule-to-start) and let any worker take it."""
    scheduled: dict[int, datetime] = {}
    waits = []
    for ev in history.events:
        if ev.HasField("workflow_task_scheduled_event_attributes"):
            scheduled[ev.event_id] = ev.event_time.ToDatetime()
        if ev.HasField("workflow_task_timed_out_event_attributes"):
            attrs = ev.workflow_task_timed_out_event_attributes
            if attrs.timeout_type == TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START:
                since = scheduled[attrs.scheduled_event_id]
                waits.append((ev.event_time.ToDatetime() - since).total_seconds())
    return waits


RUN_BUDGET_S = 840
"""The whole interrupted run's bound: ~85-110 s here, loaded or not, but 17 worker
processes start one after another, each ~2 s of imports that a loaded CI box may
stretch several times (two CI runs on record passed 600 s, with no sign whether it
was slow or stuck). Past it the test fails with what the workflow waits on and how
far it got, before pytest's timeout (``TEST_TIMEOUT_S``) could hide it."""

TEST_TIMEOUT_S = RUN_BUDGET_S + 240
"""pytest-timeout of the test: the run's budget, then the reference run and the checks."""


async def stuck(handle: WorkflowHandle[Any, Any], proc: subprocess.Popen[bytes], log: Path) -> str:
    """What a run past :data:`RUN_BUDGET_S` waits on, from the server: pending
    activities (type, attempt, state, last failure), the pending workflow task's
    attempt, the history's last events, the worker's state and the phases killed."""
    desc = (await handle.describe()).raw_description
    acts = [
        f"{a.activity_type.name} attempt={a.attempt} state={PendingActivityState.Name(a.state)} "
        f"failure={a.last_failure.message[:120]!r}"
        for a in desc.pending_activities
    ]
    task = desc.pending_workflow_task
    events = (await handle.fetch_history()).events
    tail = [
        f"{e.event_id}:{EventType.Name(e.event_type).removeprefix('EVENT_TYPE_')}"
        for e in events[-12:]
    ]
    killed = log.read_text().split() if log.exists() else []
    return (
        f"ApplyAll not done in {RUN_BUDGET_S} s: worker "
        f"{'alive' if proc.poll() is None else f'exited {proc.returncode}'}, "
        f"pending activities {acts}, workflow task attempt {task.attempt} "
        f"state {PendingWorkflowTaskState.Name(task.state)}, "
        f"{len(events)} events, last {tail}, killed after {killed}"
    )


def crashing_worker(
    settings: Settings, temporal_env: Any, after: int, log: Path
) -> subprocess.Popen[bytes]:
    """A worker that SIGKILLs itself once ApplyAll's activity ``after`` has done its
    work, after appending the phase it kills to ``log``."""
    return worker_process(
        settings,
        temporal_env,
        "tests/faults/crashing_worker.py",
        log_level="WARNING",
        NEXUS_STICKY_QUEUE_TIMEOUT_SECONDS=str(STICKY_S),
        NEXUS_TEST_CRASH_AFTER_ACTIVITY=str(after),
        NEXUS_TEST_CRASH_LOG=str(log),
    )


@pytest.mark.timeout(TEST_TIMEOUT_S)
async def test_worker_killed_after_every_apply_all_phase_in_turn(
    temporal_env: Any, settings: Settings, tmp_path: Path
) -> None:
    """Each ApplyAll phase's activity does its work, then its worker is SIGKILLed
    before reporting it; the next worker re-runs it (after the heartbeat timeout)
    and is killed after the next one. The one workflow completes, every phase
    was killed once, and the database equals an uninterrupted run's."""
    pack = wide_pack(tmp_path / "wide.yaml", objects=6, fields=4)
    log = tmp_path / "killed.txt"
    kills = 0
    after = 1
    proc = crashing_worker(settings, temporal_env, after, log)
    try:
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(pack)], heartbeat_timeout_seconds=1),
        )
        # A dead worker's local phase is retried after the task timeout, which
        # follows the 1 s heartbeat timeout down to its 2 s floor.
        desc = await handle.describe()
        task_timeout = desc.raw_description.execution_config.default_workflow_task_timeout
        assert task_timeout.ToTimedelta() == timedelta(seconds=2), task_timeout
        deadline = asyncio.get_running_loop().time() + RUN_BUDGET_S
        started = [asyncio.get_running_loop().time()]  # each worker's start
        while True:
            # until this worker is killed or the workflow ends
            while proc.poll() is None:
                desc = await handle.describe()
                if desc.status is not None and desc.status.name != "RUNNING":
                    break
                if asyncio.get_running_loop().time() > deadline:
                    took = [round(b - a, 1) for a, b in itertools.pairwise(started)]
                    raise AssertionError(
                        f"{kills} kills, seconds between worker starts {took}; "
                        + await stuck(handle, proc, log)
                    )
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                break  # the workflow ended with this worker alive
            assert proc.returncode == -signal.SIGKILL, f"worker exited {proc.returncode}"
            kills += 1
            after += 1
            proc = crashing_worker(settings, temporal_env, after, log)
            started.append(asyncio.get_running_loop().time())
        result = await handle.result()
        history = await handle.fetch_history()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    assert result.status == "completed", result
    # A workflow task left on a killed worker's sticky queue went to the next
    # worker after NEXUS_STICKY_QUEUE_TIMEOUT_SECONDS (server time), not
    # Temporal's default 10 s.
    handoffs = sticky_handoffs(history)
    assert handoffs, "no workflow task waited on a dead worker's sticky queue"
    assert all(STICKY_S - 0.1 <= s < STICKY_S + 1 for s in handoffs), handoffs
    # The phase each kill hit, as the killed worker wrote it (a local phase's
    # search attribute never reaches the server when its workflow task dies).
    killed = log.read_text().split()
    assert len(killed) == kills, (kills, killed)
    # mark-running is the 2nd activity; the gates and final-verify are phases too
    assert set(APPLY_PHASES) <= set(killed), (sorted(set(APPLY_PHASES) - set(killed)), killed)
    assert len(killed) == len(set(killed)), killed
    engine = make_engine(settings.database_url)
    interrupted = snapshot(engine), system_row_counts(engine)
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
        ref_engine = make_engine(url)
        assert (snapshot(ref_engine), system_row_counts(ref_engine)) == interrupted
