"""The connector WorkItem-only cutover receipt and the claim-schema probe.

Below both ``nexuscrm.controlplane`` (RunRepair writes the receipt, step
``EnsureConnectorWorkItemCutover``) and ``nexuscrm.connectors`` (admission
requires it before a pool starts), so neither imports the other.

Port of the seed's ``workItemClaimSchemaReady`` / ``probeWorkItemClaimSchema``
/ ``workItemClaimSchemaMissing`` and of the cutover receipt (a decision of
this port; the seed's receipt verifier is host-owned): the row
``StateKey='connector_work_item_only_cutover'`` of ``_System_BootstrapState``
with ``Status='completed'``, written once the claim schema is complete and no
``_System_ConnectorEvent`` row is owned by anything but the WorkItem path
(``ExecutionOwner='work_item'``); otherwise ``Status='pending'`` with the
reason in ``LastError``.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm.clock import utcnow
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import describe_error, upsert
from nexuscrm.errors import FatalError, NexusError

# Who executes a connector event: the WorkItem claim path.
EXECUTION_OWNER_WORK_ITEM = "work_item"

CUTOVER_RECEIPT_KEY = "connector_work_item_only_cutover"
CUTOVER_COMPLETED = "completed"
CUTOVER_PENDING = "pending"

# The seed's connectorInboundWorkItemClaimSchemaColumns and friends, verbatim,
# plus this port's claim fence: WorkItem.FencingToken and the fence table
# (nexuscrm.connectors.queue.fencing). RunRepair's ReconcileManagedTableColumns
# adds the column to an older database; ensure_system_schema creates the table.
CLAIM_SCHEMA: dict[str, str] = {
    "_System_ConnectorWorkItem": (
        "WorkId, EventId, InstalledPackId, WorkType, QueueClass, State, RunAfter, Attempt, "
        "OwnershipEpoch, FailureCount, FailureClass, FailureSummary, LastFailureAt, ReplayedAt, "
        "ReplayOfWorkId, LeaseOwner, LeaseToken, LeaseUntil, SourceLaneKey, "
        "TargetMutationLaneKey, Generation, LaneOrdinal, ProjectionKey, ProjectionActiveKey, "
        "DependencyKind, DependencyObjectAPIName, DependencyRecordId, DependencyKeyHash, "
        "DependencyConnectorOwnerKey, DependencyConnectorNamespace, "
        "DependencyConnectorSourceObject, DependencyDestinationSlotId, "
        "DependencyConnectorRemoteId, DependencyBlockedAt, DependencyProbeAfter, TerminalAt, "
        "CreatedDate, LastModifiedDate, FencingToken"
    ),
    "_System_ConnectorClaimFence": "InstalledPackId, Generation, SchedulerOwnerId, FencingToken",
    "_System_ConnectorEvent": "ExecutionOwner",
    "_System_ConnectorWorkAttempt": (
        "WorkId, Attempt, EventId, FlowExecutionId, OutcomeState, PresentedErrorCode, "
        "CauseCode, CauseCategory, CauseElementType, CauseElementName, Retriable, "
        "CreatedDate, LastModifiedDate"
    ),
}

# Driver messages of a missing table or column (the seed's workItemClaimSchemaMissing).
_MISSING_MARKERS = (
    "unknown column",
    "unknown table",
    "doesn't exist",
    "does not exist",
    "no such table",
    "no such column",
    "error 1054",
    "error 1146",
    "(1054,",
    "(1146,",
)

GAP_SCHEMA = "schema"
GAP_CAPABILITY = "capability"
GAP_CUTOVER = "cutover"


class AdmissionGap(FatalError):
    """A fail-closed admission gap; ``kind`` is ``schema``, ``capability`` or ``cutover``."""

    kind = ""


class SchemaGap(AdmissionGap):
    """``errConnectorInboundWorkItemSchemaGap``: a claim table or column is missing."""

    kind = GAP_SCHEMA


class AdmissionProbeError(NexusError):
    """A transient readiness-probe failure (not a gap): a later reconcile retries."""


def schema_missing(err: BaseException) -> bool:
    """True if ``err`` says a table or column is missing (``workItemClaimSchemaMissing``)."""
    msg = str(err).lower()
    return any(marker in msg for marker in _MISSING_MARKERS)


def probe_claim_schema(bind: Engine | Connection) -> None:
    """Port of ``workItemClaimSchemaReady``: ``SELECT <columns> FROM <table> LIMIT 0`` per table.

    Raises :class:`SchemaGap` naming the table (and the driver's message, which
    names the column) when a table or column is missing, and
    :class:`AdmissionProbeError` naming the table for any other database error.
    """
    for table, columns in CLAIM_SCHEMA.items():
        quoted = ", ".join(c.strip() for c in columns.split(","))
        try:
            if isinstance(bind, Engine):
                with bind.connect() as conn:
                    conn.execute(text(f"SELECT {quoted} FROM {table} LIMIT 0")).close()
            else:
                bind.execute(text(f"SELECT {quoted} FROM {table} LIMIT 0")).close()
        except SQLAlchemyError as exc:
            detail = describe_error(exc)
            if schema_missing(exc):
                raise SchemaGap(
                    "connector inbound supervisor: mandatory WorkItem claim schema is "
                    f"unavailable: {table}: {detail}"
                ) from exc
            raise AdmissionProbeError(
                f"connector inbound supervisor: verify work_item claim schema ({table}): {detail}"
            ) from exc


def cutover_pending_reason(conn: Connection) -> str | None:
    """Why the WorkItem-only cutover cannot be receipted now, or ``None`` if it can.

    Reasons: the claim schema probe fails, or events are owned by another
    execution path (their count and owners are named).
    """
    try:
        probe_claim_schema(conn)
    except (SchemaGap, AdmissionProbeError) as exc:
        return str(exc)
    e = t.connector_event
    rows = conn.execute(
        select(e.c.ExecutionOwner, func.count())
        .where(e.c.ExecutionOwner != EXECUTION_OWNER_WORK_ITEM)
        .group_by(e.c.ExecutionOwner)
    ).all()
    if rows:
        owners = ", ".join(f"{owner}={n}" for owner, n in sorted(rows))
        return f"_System_ConnectorEvent rows not owned by work_item: {owners}"
    return None


def ensure_cutover_receipt(conn: Connection) -> int:
    """RunRepair step ``EnsureConnectorWorkItemCutover``: write the cutover receipt.

    Writes ``completed`` when :func:`cutover_pending_reason` finds nothing,
    else ``pending`` with the reason. A completed receipt is never downgraded
    (the cutover is one-way). Returns 1 if the row changed, else 0.
    """
    row = conn.execute(
        select(t.bootstrap_state.c.Status).where(
            t.bootstrap_state.c.StateKey == CUTOVER_RECEIPT_KEY
        )
    ).first()
    if row is not None and row.Status == CUTOVER_COMPLETED:
        return 0
    reason = cutover_pending_reason(conn)
    status = CUTOVER_COMPLETED if reason is None else CUTOVER_PENDING
    now = utcnow()
    upsert(
        conn,
        t.bootstrap_state,
        [
            {
                "StateKey": CUTOVER_RECEIPT_KEY,
                "RunID": "",
                "Phase": "RunRepair",
                "Status": status,
                "LastError": reason,
                "CreatedDate": now,
                "LastModifiedDate": now,
            }
        ],
        ["Phase", "Status", "LastError", "LastModifiedDate"],
    )
    return 1 if row is None or row.Status != status else 0
