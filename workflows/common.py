"""Constants and helpers shared by the connector workflows (fleet and pack supervisor)."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError

# Wakes arriving within this window are forwarded as one.
WAKE_COALESCE = timedelta(milliseconds=200)

PACK_KEY = SearchAttributeKey.for_keyword("NexusPack")
"""Search attribute on PackSupervisor and InboundWorker executions: the pack's namespace."""

HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 10_000
"""Bound on a long-lived connector workflow's history (events), beside the server's
``is_continue_as_new_suggested()`` (the hard limit is 51,200 events)."""


def is_not_found(err: BaseException) -> bool:
    """True when a cross-workflow signal failed because the target workflow is gone.

    The SDK raises an ``ApplicationError`` for a failed ``SignalExternalWorkflowExecution``
    command; its cause ``EXTERNAL_WORKFLOW_EXECUTION_NOT_FOUND`` reads "... not found".
    Any other failure is unexpected and must surface (never swallowed).
    """
    return isinstance(err, ApplicationError) and "not found" in str(err).lower()


def brief(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters: a hand-typed signal or update
    argument (``temporal workflow signal --input``) may be a megabyte long."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"
