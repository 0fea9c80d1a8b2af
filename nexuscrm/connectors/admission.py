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

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm.connectors import queue
from nexuscrm.cutover import (
    CUTOVER_COMPLETED,
    CUTOVER_RECEIPT_KEY,
    GAP_CAPABILITY,
    GAP_CUTOVER,
    AdmissionGap,
    AdmissionProbeError,
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
    identity: ``generation`` (claimable WorkItem generation, 0 when none),
    ``scheduler_owner_id`` and ``fencing_token``.
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
                    w.c.WorkType.in_(queue.CLAIMABLE_WORK_TYPES),
                    w.c.State.in_(queue.NON_TERMINAL_STATES),
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
