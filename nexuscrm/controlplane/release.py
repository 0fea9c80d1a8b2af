"""What a completed ApplyAll marker proves, and the completed-marker preflight.

A completed marker is a restart convergence proof only for the release that
stamped it. ``mark-completed`` records this release's fingerprint in the
marker's ``Proof`` column: a SHA-256 over the system schema definition
(every table and column of ``nexuscrm.db.tables``: name, type, nullability)
and the registered repair steps (name and flags). Auto-start trusts a
completed marker only when :func:`completed_marker_preflight` finds nothing:

- the marker proves exactly this release (a release that adds a system
  column or a repair step has another fingerprint, so it is applied);
- every system table and column of this release physically exists;
- every one-time (stamped) repair step of this release is stamped;
- every active connector pack's dependencies are installed ``active`` with a
  pack install id (the seed's ``requireConnectorPackDependencyInstallIDsConverged``);
- the WorkItem-only cutover receipt is ``completed`` and the cutover
  precondition still holds (the seed's ``VerifyConnectorExecutionProtocols``).

Port of the completed-marker branch of the seed's ``applyAllWithOptions``
(``ApplyAllIfNeededWithOptionsAndRunnerOptions``). Everything here is
read-only: a missing table or column reads as "not there".
"""

from __future__ import annotations

import hashlib
import json

from sqlalchemy import Connection, Engine, inspect, select

from nexuscrm.controlplane import markers, repair
from nexuscrm.cutover import CUTOVER_COMPLETED, CUTOVER_RECEIPT_KEY, cutover_pending_reason
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.packs.model import Category, PackManifest


def release_fingerprint() -> str:
    """SHA-256 hex (64 chars) of this release's system schema and repair steps.

    Computed from the live definitions (``nexuscrm.db.tables`` and
    ``repair.REPAIR_STEPS``), so a release that adds a column, a table, an
    index (e.g. ``ix_ConnectorWorkItem_Target``, which the claim's target-lane
    probe needs) or a repair step changes it, and the first auto-start after
    the upgrade applies (``ensure_system_schema`` creates what is missing).
    """
    schema = [
        [table.name, [[c.name, repr(c.type), bool(c.nullable)] for c in table.columns]]
        for table in sorted(t.SYSTEM_TABLES, key=lambda tb: tb.name)
    ]
    indexes = [
        [table.name, sorted([str(i.name), [c.name for c in i.columns]] for i in table.indexes)]
        for table in sorted(t.SYSTEM_TABLES, key=lambda tb: tb.name)
        if table.indexes
    ]
    steps = [[s.name, s.fatal, s.once, s.convergence_critical, s.ddl] for s in repair.REPAIR_STEPS]
    doc = json.dumps({"schema": schema, "indexes": indexes, "repair_steps": steps}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


def schema_gaps(bind: Engine | Connection) -> list[str]:
    """System tables and columns of this release missing from the database (read-only)."""
    have = table_names(bind)
    gaps: list[str] = []
    insp = inspect(bind)
    for table in sorted(t.SYSTEM_TABLES, key=lambda tb: tb.name):
        if table.name not in have:
            gaps.append(f"system table {table.name} is missing")
            continue
        cols = {c["name"].lower() for c in insp.get_columns(table.name)}
        gaps += [
            f"system column {table.name}.{c.name} is missing"
            for c in table.columns
            if c.name.lower() not in cols
        ]
    return gaps


def recorded_proof(conn: Connection) -> str | None:
    """The ``Proof`` of the ApplyAll marker row; ``None`` when absent (or no column yet)."""
    cols = {c["name"] for c in inspect(conn).get_columns(t.bootstrap_state.name)}
    if "Proof" not in cols:
        return None
    return conn.execute(
        select(t.bootstrap_state.c.Proof).where(
            t.bootstrap_state.c.StateKey == markers.APPLY_ALL_KEY
        )
    ).scalar_one_or_none()


def connector_dependency_gaps(conn: Connection) -> list[str]:
    """Active connector packs whose dependency identities are not converged.

    Port of ``requireConnectorPackDependencyInstallIDsConverged``: the pack
    and each pack it ``depends_on`` must be installed ``active`` with a
    non-blank ``PackInstallId``.
    """
    ip = t.installed_pack
    rows = conn.execute(select(ip.c.Name, ip.c.Category, ip.c.Status, ip.c.PackInstallId)).all()
    by_name = {r.Name: r for r in rows}
    gaps: list[str] = []
    for r in rows:
        if r.Category != Category.ConnectorPack.value or r.Status != "active":
            continue
        if not r.PackInstallId:
            gaps.append(f"connector pack {r.Name} has no pack install id")
        payload = conn.execute(select(ip.c.Payload).where(ip.c.Name == r.Name)).scalar()
        deps = PackManifest.model_validate_json(payload).depends_on if payload else ()
        for dep in deps:
            row = by_name.get(dep)
            if row is None or row.Status != "active" or not row.PackInstallId:
                state = (
                    "not installed"
                    if row is None
                    else f"{row.Status}, install id {row.PackInstallId!r}"
                )
                gaps.append(f"connector pack {r.Name}: dependency {dep} is {state}")
    return gaps


def completed_marker_preflight(engine: Engine) -> list[str]:
    """Why a completed marker must not be trusted by this release (empty: trust it).

    Read-only. Call only when the ApplyAll marker is ``completed``. Each
    reason names what is missing or different.
    """
    reasons = schema_gaps(engine)
    if reasons:
        return reasons
    with engine.connect() as conn:
        proof = recorded_proof(conn)
        current = release_fingerprint()
        if proof is None:
            reasons.append("the completed marker records no release proof (an older release)")
        elif proof != current:
            reasons.append(
                f"the completed marker proves release {proof[:12]}, this release is {current[:12]}"
            )
        stamped = set(conn.execute(select(t.migration.c.MigrationKey)).scalars())
        reasons += [
            f"repair step {s.name} is not stamped"
            for s in repair.REPAIR_STEPS
            if s.once and s.name not in stamped
        ]
        reasons += connector_dependency_gaps(conn)
        receipt = markers.read(conn, CUTOVER_RECEIPT_KEY)
        if receipt is None or receipt.status != CUTOVER_COMPLETED:
            state = "missing" if receipt is None else receipt.status
            reasons.append(f"the {CUTOVER_RECEIPT_KEY} receipt is {state}")
        else:
            pending = cutover_pending_reason(conn)
            if pending is not None:
                reasons.append(f"the WorkItem-only cutover precondition fails: {pending}")
    return reasons
