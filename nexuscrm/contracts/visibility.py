"""Visibility (list-filter) queries that count a database's live workflows from the
server's own list: the source of truth for what runs, beside any status query.

Shared by the activities that act on what runs (orphaned pools drained, waits
recovery, the parked-waits gauge), the CLI (``connectors stop`` / ``status``) and
the tests that count live things.
"""

from __future__ import annotations

_UNQUOTABLE = frozenset("'\\\"\n")


def _quotable(database_id: str) -> bool:
    return bool(database_id) and not any(c in _UNQUOTABLE for c in database_id)


def running_supervisors_query(database_id: str) -> str | None:
    """The query of ``database_id``'s running ``PackSupervisor`` workflows (the
    connector pools, ids ``connector/<db>/...``, see ``supervisor_workflow_id``).

    Returns ``None`` when the id is empty or holds a quote, backslash or newline
    (it cannot be quoted in the query; settings' database ids are slugs).
    """
    if not _quotable(database_id):
        return None
    return (
        "WorkflowType = 'PackSupervisor' AND ExecutionStatus = 'Running' "
        f"AND WorkflowId STARTS_WITH 'connector/{database_id}/'"
    )


def running_waits_query(database_id: str) -> str | None:
    """The query of ``database_id``'s running ``IdentityWait`` workflows (by their
    ``NexusDatabase`` search attribute); ``None`` when the id cannot be quoted."""
    if not _quotable(database_id):
        return None
    return (
        "WorkflowType='IdentityWait' AND ExecutionStatus='Running' "
        f"AND NexusDatabase='{database_id}'"
    )
