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
3. **claim schema**: ``SELECT <columns> FROM <table> LIMIT 0`` on the
   work-queue tables; a missing table or column is :class:`SchemaGap`, any
   other error is transient (:class:`AdmissionProbeError`, retry later);
4. **generation**: the pack's claim fence (``_System_ConnectorClaimFence``):
   the generation and fencing token of the pool that holds the pack's claims.

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

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm.connectors import queue
from nexuscrm.cutover import (
    CUTOVER_COMPLETED,
    CUTOVER_RECEIPT_KEY,
    GAP_CAPABILITY,
    GAP_CUTOVER,
    AdmissionGap,
    AdmissionProbeError,
    SchemaGap,
    probe_claim_schema,
    schema_missing,
)
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import describe_error


class CapabilityGap(AdmissionGap):
    """``errConnectorInboundWorkItemCapabilityGap``: the claim path lacks a work type."""

    kind = GAP_CAPABILITY


class CutoverGap(AdmissionGap):
    """``errConnectorInboundWorkItemCutoverGap``: no WorkItem-only cutover receipt."""

    kind = GAP_CUTOVER


@dataclass(frozen=True)
class Activation:
    """What a pool carries from admission into every worker and its fingerprint.

    Port of ``connectorInboundWorkItemClaimActivation`` plus the scheduler
    identity: ``generation`` (the pack's claim fence generation, 0 when no
    pool took a fence yet), ``scheduler_owner_id`` and ``fencing_token``
    (the fence's token; before any fence, this fleet's base token).
    """

    generation: int
    scheduler_owner_id: str
    fencing_token: str


def require_capability(work_types: tuple[str, ...] = queue.CLAIMABLE_WORK_TYPES) -> None:
    """The claim path must honour both work types (``HonorsClaimWorkTypes``).

    Raises :class:`CapabilityGap` naming the missing work types.
    """
    needed = (queue.WORK_TYPE_CONNECTOR_EVENT, queue.WORK_TYPE_WORKFLOW_ACTION_APPLY)
    missing = [w for w in needed if w not in work_types]
    if missing:
        raise CapabilityGap(
            "connector inbound supervisor: complete WorkItem execution capability is "
            f"unavailable: claim does not take {', '.join(missing)}"
        )


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


def _read_fence(engine: Engine, install_id: str) -> tuple[int, str] | None:
    """The pack's claim fence, or ``None``; a read error is :class:`AdmissionProbeError`."""
    try:
        with engine.connect() as conn:
            return queue.current_fence(conn, install_id)
    except SQLAlchemyError as exc:
        if schema_missing(exc):
            raise SchemaGap(
                "connector inbound supervisor: mandatory WorkItem claim schema is "
                f"unavailable: {t.connector_claim_fence.name}: {describe_error(exc)}"
            ) from exc
        raise AdmissionProbeError(
            f"connector inbound supervisor: resolve work_item generation for {install_id}: "
            f"{describe_error(exc)}"
        ) from exc


def resolve_claim_generation(engine: Engine, install_id: str, now: datetime | None = None) -> int:
    """Port of ``resolveWorkItemClaimGeneration``: the pack's claim generation.

    The generation of the pack's current claim fence (the pool that took it
    last, :func:`take_fence`); 0 when no pool took one yet. Every claim
    stamps it on the items it takes (``Generation``). ``now`` is accepted for
    symmetry with the seed. Raises :class:`AdmissionProbeError` on a read
    error, :class:`SchemaGap` when the fence table is missing.
    """
    fence = _read_fence(engine, install_id)
    return 0 if fence is None else fence[0]


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

    Read-only: the generation and fencing token are the pack's current claim
    fence (a running pool of this fleet has exactly these in its fingerprint);
    before any fence, generation 0 and this fleet's base token. Raises
    :class:`CapabilityGap` / :class:`CutoverGap` / :class:`SchemaGap`
    (fail closed) or :class:`AdmissionProbeError` (transient); messages name
    the pack as ``for <namespace> (<install id>)``.
    """
    where = f" for {namespace} ({install_id})"
    try:
        require_capability()
        require_cutover(engine)
        probe_claim_schema(engine)
        fence = _read_fence(engine, install_id)
    except AdmissionGap as exc:
        raise type(exc)(f"{exc}{where}") from exc
    except AdmissionProbeError as exc:
        raise AdmissionProbeError(f"{exc}{where}") from exc
    owner = scheduler_owner_id(namespace, install_id, fleet_epoch)
    if fence is None:
        return Activation(0, owner, fencing_token(namespace, install_id, fleet_epoch))
    return Activation(fence[0], owner, fence[1])


def take_fence(engine: Engine, namespace: str, install_id: str, fleet_epoch: str) -> Activation:
    """Take the pack's claim fence for a pool about to start (``queue.take_fence``).

    The token is this fleet's :func:`fencing_token` (the fleet epoch stands
    for the seed's host+pid). Already this fleet's fence (a rebuild): kept,
    same generation. Else the next generation: from this commit on, claims
    under the pack's older fences are refused and their leases are revoked
    (this fleet's pool claims those items at once). Returns the pool's
    :class:`Activation`. Raises ``QueueLockTimeout`` or a database error (the
    caller does not start the pool then).
    """
    owner = scheduler_owner_id(namespace, install_id, fleet_epoch)
    token = fencing_token(namespace, install_id, fleet_epoch)
    generation, stored = queue.take_fence(engine, install_id, owner, token)
    return Activation(generation, owner, stored)
