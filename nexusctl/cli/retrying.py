"""The attempt count and last error of a retrying control-plane phase.

A phase activity that failed and is retried with backoff shows only
``running`` in the workflow's ``progress`` query (the workflow learns of the
retries only when the activity finally completes or fails). Temporal keeps
the pending activity's attempt and last failure; ``progress`` and
``apply-all --wait`` read them from the workflow's description and show them
on the running phase, with no change to the workflow (nothing to replay).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temporalio.client import WorkflowHandle

from nexuscrm.contracts import PhaseReport
from nexusctl.cli.common import QUERY_TIMEOUT


def retry_note(attempt: int, maximum: int, last_error: str) -> str:
    """``attempt N of M, retrying after: <error>`` (``M`` is ``unlimited`` for 0)."""
    limit = str(maximum) if maximum else "unlimited"
    return f"attempt {attempt} of {limit}, retrying after: {last_error or 'an error'}"


async def with_retries(
    handle: WorkflowHandle[Any, Any], phases: list[PhaseReport]
) -> list[PhaseReport]:
    """``phases`` with the running phase's detail set to its retry state, if retrying.

    Reads the workflow's pending activities (one describe call); a pending
    activity past its first attempt names the attempt, the policy's maximum
    and the last failure's message. Unchanged when nothing retries, when not
    exactly one phase runs, or when the description cannot be read.
    """
    try:
        desc = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
    except Exception:
        return phases
    retrying = [a for a in desc.raw_description.pending_activities if a.attempt > 1]
    running = [i for i, p in enumerate(phases) if p.status == "running"]
    if not retrying or len(running) != 1:
        return phases
    a = retrying[0]
    message = a.last_failure.message if a.HasField("last_failure") else ""
    out = list(phases)
    i = running[0]
    out[i] = dataclasses.replace(out[i], detail=retry_note(a.attempt, a.maximum_attempts, message))
    return out
