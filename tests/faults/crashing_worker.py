"""A control-plane worker that SIGKILLs itself right after one activity's work.

Run as ``python tests/faults/crashing_worker.py`` with the worker's ``NEXUS_*``
settings and ``NEXUS_TEST_CRASH_AFTER_ACTIVITY=N``: the first attempt of
activity id ``N`` of a workflow of type ``NEXUS_TEST_CRASH_WORKFLOW_TYPE``
(default ``ApplyAll``) runs to its end (its writes are committed) and the
process is killed before the worker reports the completion. Or with
``NEXUS_TEST_CRASH_AFTER_ACTIVITY_TYPE=T``: killed after the first activity
(or local activity) of type ``T`` whose result is not empty. Or with
``NEXUS_TEST_CRASH_IN_ACTIVITY_TYPE=T``: killed while the first attempt of the
first activity of type ``T`` runs, ``NEXUS_TEST_CRASH_IN_DELAY_S`` (0.05) after
it started (mid-work; an attempt that ends sooner is not killed). The server retries
the activity on the next worker after the heartbeat timeout (a local one
after the workflow task's timeout): the worst case for a phase's
idempotency. With ``NEXUS_TEST_CRASH_LOG=<file>`` the phase killed is
appended to that file first (``phase_of``). Used by ``test_worker_kills.py``
and ``test_phase_kills.py``; a test aid only, never part of the application.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from temporalio import activity
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

import nexusctl.worker
from nexusctl.cli import main as cli_main

CRASH_AFTER = os.environ.get("NEXUS_TEST_CRASH_AFTER_ACTIVITY", "")
CRASH_AFTER_TYPE = os.environ.get("NEXUS_TEST_CRASH_AFTER_ACTIVITY_TYPE", "")
WORKFLOW_TYPE = os.environ.get("NEXUS_TEST_CRASH_WORKFLOW_TYPE", "ApplyAll")
CRASH_LOG = os.environ.get("NEXUS_TEST_CRASH_LOG", "")
CRASH_IN_TYPE = os.environ.get("NEXUS_TEST_CRASH_IN_ACTIVITY_TYPE", "")
CRASH_IN_DELAY_S = float(os.environ.get("NEXUS_TEST_CRASH_IN_DELAY_S", "0.05"))


def _kill_now(phase: str) -> None:
    """Append ``phase`` to the crash log, then SIGKILL this process."""
    if CRASH_LOG:
        with open(CRASH_LOG, "a") as log:
            log.write(phase + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def phase_of(activity_type: str, args: Sequence[Any]) -> str:
    """The ApplyAll phase an activity runs: a gate's name, ``mark-<status>``, or
    the activity's name (``controlplane.plan_packs`` -> ``plan-packs``)."""
    arg: Any = args[0] if args else None
    gate = getattr(arg, "gate", None)
    if isinstance(gate, str):
        return gate
    name = activity_type.removeprefix("controlplane.").replace("_", "-")
    if name == "mark":
        return f"mark-{getattr(arg, 'phase', '')}"
    return name


class _CrashAfter(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        timer = None
        if (
            CRASH_IN_TYPE
            and info.activity_type == CRASH_IN_TYPE
            and info.workflow_type == WORKFLOW_TYPE
            and info.attempt == 1
        ):
            phase = phase_of(info.activity_type, input.args)
            timer = threading.Timer(CRASH_IN_DELAY_S, _kill_now, args=(phase,))
            timer.start()
        try:
            result = await self.next.execute_activity(input)
        finally:
            if timer is not None:
                timer.cancel()
        by_id = bool(CRASH_AFTER) and info.activity_id == CRASH_AFTER
        by_type = bool(CRASH_AFTER_TYPE) and info.activity_type == CRASH_AFTER_TYPE and bool(result)
        if info.workflow_type == WORKFLOW_TYPE and info.attempt == 1 and (by_id or by_type):
            _kill_now(phase_of(info.activity_type, input.args))
        return result


class _Interceptor(Interceptor):
    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _CrashAfter(next)


class _CrashingWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, interceptors=[_Interceptor()], **kwargs)


if __name__ == "__main__":
    # A killed worker's sticky queue holds the workflow's next task this long
    # before any worker may take it: the ~17 kills of one run take a second
    # each, through the worker's own setting.
    os.environ.setdefault("NEXUS_STICKY_QUEUE_TIMEOUT_SECONDS", "1")
    nexusctl.worker.Worker = _CrashingWorker  # type: ignore[misc]
    sys.argv = ["nexusctl", "worker"]
    cli_main()
