"""Bootstrap markers in ``_System_BootstrapState`` (the seed's bootstrapStateStore).

Key ``control_plane_apply_all`` carries the ApplyAll lifecycle:
``running`` -> ``failed`` | ``completed``; sibling mutations set
``invalidated``. Key ``formula_view_rebuild_owed`` is the deferred-rebuild
receipt (``pending`` / ``cleared``).

No ``finalization_ready`` state: the seed needs that durable receipt because
its advisory lock lives on a separate session that can die between terminal
verification and the completed write. Here the lease check and the completed
write are one transaction (``controlplane.mark``), so there is no window in
which verification passed but completion is uncommitted, and nothing for a
finalization recovery to recover: a run that stops before ``mark-completed``
leaves ``running`` (or ``failed``) and the next run re-applies in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import Connection, Engine, func, select

from nexuscrm.clock import utcnow
from nexuscrm.cutover import CUTOVER_RECEIPT_KEY
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names, upsert

APPLY_ALL_KEY = "control_plane_apply_all"
REBUILD_OWED_KEY = "formula_view_rebuild_owed"
CONNECTOR_CUTOVER_KEY = CUTOVER_RECEIPT_KEY


class MarkerStatus(StrEnum):
    """Statuses of the ApplyAll marker."""

    running = "running"
    failed = "failed"
    completed = "completed"
    invalidated = "invalidated"


@dataclass(frozen=True)
class Marker:
    """One ``_System_BootstrapState`` row."""

    key: str
    run_id: str
    phase: str
    status: str
    last_error: str | None


def _write(
    conn: Connection,
    key: str,
    run_id: str,
    phase: str,
    status: str,
    error: str | None,
    proof: str | None = None,
) -> None:
    now = utcnow()
    row: dict[str, object] = {
        "StateKey": key,
        "RunID": run_id,
        "Phase": phase,
        "Status": status,
        "LastError": error,
        "CreatedDate": now,
        "LastModifiedDate": now,
    }
    update = ["RunID", "Phase", "Status", "LastError", "LastModifiedDate"]
    if proof is not None:
        # Only the completed marker carries a proof; the column may not exist
        # yet when an older release's database is marked running.
        row["Proof"] = proof
        update.append("Proof")
    upsert(conn, t.bootstrap_state, [row], update)


def mark(
    conn: Connection,
    status: MarkerStatus,
    run_id: str,
    phase: str,
    error: str | None = None,
    proof: str | None = None,
) -> None:
    """Set the ApplyAll marker (write-ahead: the caller commits before mutating).

    ``proof``: the release fingerprint a completed marker proves
    (``nexuscrm.controlplane.release``); only a completed marker carries one.
    """
    _write(conn, APPLY_ALL_KEY, run_id, phase, status.value, error, proof)


def read(bind: Connection | Engine, key: str = APPLY_ALL_KEY) -> Marker | None:
    """Read one marker; ``None`` when the row or the table itself is absent."""
    if t.bootstrap_state.name not in table_names(bind):
        return None
    # Named columns: a database of an older release may lack newer ones (Proof).
    b = t.bootstrap_state.c
    with bind.connect() if isinstance(bind, Engine) else _nullctx(bind) as conn:
        row = (
            conn.execute(
                select(b.StateKey, b.RunID, b.Phase, b.Status, b.LastError).where(b.StateKey == key)
            )
            .mappings()
            .first()
        )
    if row is None:
        return None
    return Marker(key, row["RunID"], row["Phase"], row["Status"], row["LastError"])


class _nullctx:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __enter__(self) -> Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        return None


def rebuild_owed(bind: Connection | Engine) -> bool:
    """Port of ``FormulaViewRebuildOwed``: True while a deferred rebuild is pending."""
    m = read(bind, REBUILD_OWED_KEY)
    return m is not None and m.status == "pending"


def mark_rebuild_owed(conn: Connection, run_id: str) -> None:
    """Port of ``markFormulaViewRebuildOwed``: stamp the write-ahead rebuild debt.

    Written by a ``defer_formula_view_rebuild`` ApplyAll before its running
    marker and before any mutation, and again (defense in depth) right before
    its completed marker. Idempotent: a retry re-stamps the same ``pending``.
    Callers hold the control-plane lease (receipt writes are fenced).
    """
    _write(conn, REBUILD_OWED_KEY, run_id, "owed", "pending", None)


def clear_rebuild_owed(conn: Connection) -> None:
    """Settle the rebuild receipt after a full view rebuild (keeps the row for forensics)."""
    conn.execute(
        t.bootstrap_state.update()
        .where(t.bootstrap_state.c.StateKey == REBUILD_OWED_KEY)
        .values(Status="cleared", LastModifiedDate=utcnow())
    )


class AutoStartAction(StrEnum):
    """What container auto-start does (the seed's ``ControlPlaneAutoStart*``)."""

    skip = "skip"
    apply = "apply"
    halt_for_migration = "halt_for_migration"


@dataclass(frozen=True)
class AutoStartDecision:
    """Action plus the reason shown to the operator."""

    action: AutoStartAction
    reason: str


def classify_auto_start(engine: Engine) -> AutoStartDecision:
    """Port of ``ClassifyControlPlaneAutoStart``.

    - no system tables at all: fresh database -> apply;
    - metadata rows but no marker: a legacy pre-marker database -> halt, an
      explicit ``apply-all`` must migrate it first;
    - marker completed -> skip (the caller still checks pack drift), unless
      the connector WorkItem-only cutover receipt is missing -> apply (its
      RunRepair writes it);
    - any other marker status -> apply.
    """
    names = table_names(engine)
    if t.object_meta.name not in names:
        return AutoStartDecision(AutoStartAction.apply, "fresh database: no control-plane tables")
    marker = read(engine)
    if marker is None:
        with engine.connect() as conn:
            count = conn.execute(select(func.count()).select_from(t.object_meta)).scalar_one()
        if count:
            return AutoStartDecision(
                AutoStartAction.halt_for_migration,
                "legacy database has metadata but no ApplyAll marker",
            )
        return AutoStartDecision(AutoStartAction.apply, "no ApplyAll marker yet")
    if marker.status == MarkerStatus.completed:
        if read(engine, CONNECTOR_CUTOVER_KEY) is None:
            # A database completed before the receipt existed: the connector
            # fleet admits no pool until RunRepair writes it, so apply once.
            return AutoStartDecision(
                AutoStartAction.apply,
                f"ApplyAll marker is completed but the {CONNECTOR_CUTOVER_KEY} receipt is missing",
            )
        return AutoStartDecision(AutoStartAction.skip, "full ApplyAll marker is completed")
    return AutoStartDecision(AutoStartAction.apply, f"ApplyAll marker is {marker.status}")
