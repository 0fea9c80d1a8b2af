"""WorkItem claim admission: what must hold before a pack's pool may start.

Port of the seed's ``resolveWorkItemClaimActivation`` and its helpers
(``workItemClaimSchemaReady``, ``probeWorkItemClaimSchema``,
``workItemClaimSchemaMissing``, ``resolveWorkItemClaimGeneration``,
``workItemSchedulerOwnerID`` / ``workItemSchedulerFencingToken``).

Order of the checks, as in the seed:

1. **capability**: the claim path claims both work types (``ConnectorEvent``,
   ``WorkflowActionApply``) -> else :class:`CapabilityGap`;
2. **cutover receipt**: the WorkItem-only execution cutover receipt is present
   -> else :class:`CutoverGap`;
3. **claim schema**: ``SELECT <columns> FROM <table> LIMIT 0`` on the three
   work-queue tables; a missing table or column is :class:`SchemaGap`, any
   other error is transient (:class:`AdmissionProbeError`, retry later);
4. **generation**: the claimable WorkItem generation of the pack.

The gaps fail closed (the pool is stopped and not started); a transient probe
error keeps a pool that already runs (see ``nexuscrm.connectors.reconcile``).

Cutover receipt (a decision of this port; the seed's receipt verifier is
host-owned): the row ``StateKey='connector_work_item_only_cutover'`` of
``_System_BootstrapState`` with ``Status='completed'``. ApplyAll's RunRepair
writes it (step ``EnsureConnectorWorkItemCutover``, :func:`ensure_cutover_receipt`)
once the claim schema is complete and no ``_System_ConnectorEvent`` row is
owned by anything but the WorkItem path (``ExecutionOwner='work_item'``);
otherwise it records ``Status='pending'`` with the reason in ``LastError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm.clock import utcnow
from nexuscrm.connectors import workqueue
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import describe_error, upsert
from nexuscrm.errors import FatalError, NexusError

CUTOVER_RECEIPT_KEY = "connector_work_item_only_cutover"
CUTOVER_COMPLETED = "completed"
CUTOVER_PENDING = "pending"

# The seed's connectorInboundWorkItemClaimSchemaColumns and friends, verbatim.
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
        "CreatedDate, LastModifiedDate"
    ),
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


class CapabilityGap(AdmissionGap):
    """``errConnectorInboundWorkItemCapabilityGap``: the claim path lacks a work type."""

    kind = GAP_CAPABILITY


class CutoverGap(AdmissionGap):
    """``errConnectorInboundWorkItemCutoverGap``: no WorkItem-only cutover receipt."""

    kind = GAP_CUTOVER


class AdmissionProbeError(NexusError):
    """A transient readiness-probe failure (not a gap): a later reconcile retries."""


@dataclass(frozen=True)
class Activation:
    """What a pool carries from admission into every worker and its fingerprint.

    Port of ``connectorInboundWorkItemClaimActivation`` plus the scheduler
    identity: ``generation`` (claimable WorkItem generation, 0 when none),
    ``scheduler_owner_id`` and ``fencing_token``.
    """

    generation: int
    scheduler_owner_id: str
    fencing_token: str


def schema_missing(err: BaseException) -> bool:
    """True if ``err`` says a table or column is missing (``workItemClaimSchemaMissing``)."""
    msg = str(err).lower()
    return any(marker in msg for marker in _MISSING_MARKERS)


def probe_claim_schema(bind: Engine | Connection) -> None:
    """Port of ``workItemClaimSchemaReady``: ``SELECT <columns> FROM <table> LIMIT 0`` x3.

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


def require_capability(work_types: tuple[str, ...] = workqueue.CLAIMABLE_WORK_TYPES) -> None:
    """The claim path must honour both work types (``HonorsClaimWorkTypes``).

    Raises :class:`CapabilityGap` naming the missing work types.
    """
    needed = (workqueue.WORK_TYPE_CONNECTOR_EVENT, workqueue.WORK_TYPE_WORKFLOW_ACTION_APPLY)
    missing = [w for w in needed if w not in work_types]
    if missing:
        raise CapabilityGap(
            "connector inbound supervisor: complete WorkItem execution capability is "
            f"unavailable: claim does not take {', '.join(missing)}"
        )


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
        .where(e.c.ExecutionOwner != workqueue.EXECUTION_OWNER_WORK_ITEM)
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


def require_cutover(engine: Engine) -> None:
    """The receipt must be ``completed``; raises :class:`CutoverGap` saying what it found.

    A database error reading it is :class:`AdmissionProbeError` (transient).
    """
    try:
        with engine.connect() as conn:
            row = conn.execute(
                select(t.bootstrap_state.c.Status, t.bootstrap_state.c.LastError).where(
                    t.bootstrap_state.c.StateKey == CUTOVER_RECEIPT_KEY
                )
            ).first()
    except SQLAlchemyError as exc:
        if schema_missing(exc):
            row = None
        else:
            raise AdmissionProbeError(
                f"connector inbound supervisor: read cutover receipt: {describe_error(exc)}"
            ) from exc
    if row is None:
        raise CutoverGap(
            "connector inbound supervisor: WorkItem-only execution cutover is not ready: "
            f"no {CUTOVER_RECEIPT_KEY} receipt in _System_BootstrapState (run apply-all)"
        )
    if row.Status != CUTOVER_COMPLETED:
        raise CutoverGap(
            "connector inbound supervisor: WorkItem-only execution cutover is not ready: "
            f"receipt {CUTOVER_RECEIPT_KEY} is {row.Status!r}: {row.LastError or ''}".rstrip(": ")
        )


def resolve_claim_generation(engine: Engine, install_id: str, now: datetime | None = None) -> int:
    """Port of ``resolveWorkItemClaimGeneration``: the pack's claimable generation.

    The lowest ``Generation`` among the pack's non-terminal items of either
    claimable work type (the oldest generation still has work to finish);
    0 when the pack has none. ``now`` is accepted for symmetry with the seed.
    """
    w = t.connector_work_item
    try:
        with engine.connect() as conn:
            gen = conn.execute(
                select(func.min(w.c.Generation)).where(
                    w.c.InstalledPackId == install_id,
                    w.c.WorkType.in_(workqueue.CLAIMABLE_WORK_TYPES),
                    w.c.State.in_(workqueue.NON_TERMINAL_STATES),
                )
            ).scalar()
    except SQLAlchemyError as exc:
        raise AdmissionProbeError(
            f"connector inbound supervisor: resolve work_item generation for {install_id}: "
            f"{describe_error(exc)}"
        ) from exc
    return int(gen or 0)


def scheduler_owner_id(namespace: str, install_id: str, fleet_epoch: str) -> str:
    """Port of ``workItemSchedulerOwnerID``; the fleet's first run id stands for host+pid."""
    return (
        f"connector-inbound-{namespace.strip()}-{install_id.strip()}-{fleet_epoch}"
        "#workitem-scheduler"
    )


def fencing_token(namespace: str, install_id: str, fleet_epoch: str) -> str:
    """Port of ``workItemSchedulerFencingToken`` (same identity, ``-fence`` suffix)."""
    return (
        f"connector-inbound-{namespace.strip()}-{install_id.strip()}-{fleet_epoch}"
        "#workitem-scheduler-fence"
    )


def resolve_activation(
    engine: Engine, namespace: str, install_id: str, fleet_epoch: str
) -> Activation:
    """Port of ``resolveWorkItemClaimActivation``: capability, cutover, schema, generation.

    Raises :class:`CapabilityGap` / :class:`CutoverGap` / :class:`SchemaGap`
    (fail closed) or :class:`AdmissionProbeError` (transient); messages name
    the pack as ``for <namespace> (<install id>)``.
    """
    where = f" for {namespace} ({install_id})"
    try:
        require_capability()
        require_cutover(engine)
        probe_claim_schema(engine)
        generation = resolve_claim_generation(engine, install_id)
    except AdmissionGap as exc:
        raise type(exc)(f"{exc}{where}") from exc
    except AdmissionProbeError as exc:
        raise AdmissionProbeError(f"{exc}{where}") from exc
    return Activation(
        generation,
        scheduler_owner_id(namespace, install_id, fleet_epoch),
        fencing_token(namespace, install_id, fleet_epoch),
    )
