"""ApplyAll's completion gates: the last checks before the completed marker.

Port of the seed's ``runApplyAllCompletionGates``, in its order. Each gate is
read-only and raises ``CompletionGateError`` with the seed's message when its
condition is not met; ApplyAll then stamps ``failed`` and never ``completed``.

The seed's first three gates read receipts its backfills write. This port
has no legacy data for such backfills (its enqueue has always written the
ordinals and lanes; it never had list views), so each gate checks the real
condition instead of a receipt nobody writes:

- ``connector-event-enqueue-ordinal-final-gate``: no ``_System_ConnectorEvent``
  row without an ``EnqueueOrdinal`` (``<= 0``: a row written before the
  column existed gets the column default 0);
- ``connector-event-source-lane-final-gate``: no ``_System_ConnectorWorkItem``
  row without a ``SourceLaneKey`` or a ``LaneOrdinal`` (the claim orders a
  lane by them; a row without one would run out of order or never);
- ``listview-legacy-cutover-final-gate``: a legacy ``_System_ListView`` table
  (left by the Go system in a migrated database) has no row without an
  ``OwnerId``; no such table: nothing to cut over;
- ``source-revision-advance-final-gate``: every pack the run's sources build
  now is installed ``active`` with exactly that payload hash (no pending
  source-revision advance: a source changed after apply-packs, or a pack was
  left ``installing`` / ``failed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import Engine, func, inspect, or_, select, text

from nexuscrm.db import tables as t
from nexuscrm.db.dialect import quote
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.errors import FatalError
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.model import PackManifest

LEGACY_LIST_VIEW_TABLE = "_System_ListView"

ENQUEUE_ORDINAL_GATE = "connector-event-enqueue-ordinal-final-gate"
SOURCE_LANE_GATE = "connector-event-source-lane-final-gate"
LISTVIEW_GATE = "listview-legacy-cutover-final-gate"
SOURCE_REVISION_GATE = "source-revision-advance-final-gate"

COMPLETION_GATES: tuple[str, ...] = (
    ENQUEUE_ORDINAL_GATE,
    SOURCE_LANE_GATE,
    LISTVIEW_GATE,
    SOURCE_REVISION_GATE,
)
"""The gates in the seed's order; each is one phase of ApplyAll."""


class CompletionGateError(FatalError):
    """A completion gate's condition is not met: the run must not complete."""


def _examples(ids: Sequence[str]) -> str:
    return ", ".join(ids[:3]) + (" ..." if len(ids) > 3 else "")


def enqueue_ordinal_gate(engine: Engine) -> str:
    """Every connector event has an ``EnqueueOrdinal`` (> 0); returns a summary."""
    e = t.connector_event
    missing = or_(e.c.EnqueueOrdinal.is_(None), e.c.EnqueueOrdinal <= 0)
    with engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(e).where(missing)).scalar_one()
        ids = conn.execute(select(e.c.EventId).where(missing).limit(4)).scalars().all()
    if count:
        raise CompletionGateError(
            "connector event enqueue ordinal backfill is not complete; rerun setup apply after "
            f"old connector event writers are stopped ({count} _System_ConnectorEvent row(s) "
            f"have no EnqueueOrdinal: {_examples(ids)}; this release writes ordinals at enqueue "
            "and has no backfill: give those rows their ordinals first)"
        )
    return "every connector event has an enqueue ordinal"


def source_lane_gate(engine: Engine) -> str:
    """Every connector work item has a ``SourceLaneKey`` and a ``LaneOrdinal`` (> 0)."""
    w = t.connector_work_item
    missing = or_(
        w.c.SourceLaneKey.is_(None),
        w.c.SourceLaneKey == "",
        w.c.LaneOrdinal.is_(None),
        w.c.LaneOrdinal <= 0,
    )
    with engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(w).where(missing)).scalar_one()
        ids = conn.execute(select(w.c.WorkId).where(missing).limit(4)).scalars().all()
    if count:
        raise CompletionGateError(
            "connector event source-lane backfill is not complete; rerun setup apply after old "
            f"connector event writers are stopped ({count} _System_ConnectorWorkItem row(s) "
            f"have no SourceLaneKey or LaneOrdinal: {_examples(ids)}; this release writes "
            "lanes at enqueue and has no backfill: give those rows their lanes first)"
        )
    return "every connector work item has a source lane and lane ordinal"


def listview_gate(engine: Engine) -> str:
    """A legacy ``_System_ListView`` (if any) has an ``OwnerId`` on every row."""
    if LEGACY_LIST_VIEW_TABLE not in physical_tables(engine):
        return "no _System_ListView table: nothing to cut over"
    columns = {c["name"].lower() for c in inspect(engine).get_columns(LEGACY_LIST_VIEW_TABLE)}
    if "ownerid" not in columns:
        raise CompletionGateError(
            "list-view legacy cutover is not complete; rerun setup apply after resolving "
            "_System_ListView OwnerId drift (the table has no OwnerId column)"
        )
    with engine.connect() as conn:
        table = quote(conn, LEGACY_LIST_VIEW_TABLE)
        owner = quote(conn, "OwnerId")
        count = conn.execute(
            text(f"SELECT COUNT(*) FROM {table} WHERE {owner} IS NULL OR {owner} = ''")
        ).scalar_one()
    if count:
        raise CompletionGateError(
            "list-view legacy cutover is not complete; rerun setup apply after resolving "
            f"_System_ListView OwnerId drift ({count} row(s) without an OwnerId)"
        )
    return "legacy list views all have an owner"


def pending_source_revisions(engine: Engine, plan: Sequence[PackManifest]) -> list[str]:
    """Each planned pack not installed ``active`` with its current payload hash, as a line."""
    ip = t.installed_pack
    with engine.connect() as conn:
        rows = {
            r.Name: r for r in conn.execute(select(ip.c.Name, ip.c.Status, ip.c.PayloadHash)).all()
        }
    pending: list[str] = []
    for pack in plan:
        digest = payload_hash(pack)
        row = rows.get(pack.name)
        if row is None:
            pending.append(f"pack {pack.name} is not installed (source digest {digest[:12]})")
        elif row.Status != "active":
            pending.append(f"pack {pack.name} is {row.Status}, not active")
        elif row.PayloadHash != digest:
            pending.append(
                f"pack {pack.name}: installed {row.PayloadHash[:12]}, source {digest[:12]}"
            )
    return pending


def source_revision_gate(engine: Engine, plan: Sequence[PackManifest]) -> str:
    """Port of ``requireApplyAllSourceRevisionAdvancePlanCompleted`` for this run's plan."""
    pending = pending_source_revisions(engine, plan)
    if pending:
        raise CompletionGateError(
            f"source revision advance final gate: {len(pending)} pending source revision "
            f"advance(s): {'; '.join(pending[:5])}" + (" ..." if len(pending) > 5 else "")
        )
    return f"{len(plan)} packs installed at their source revision"


def run_gate(engine: Engine, name: str, plan: Callable[[], Sequence[PackManifest]]) -> str:
    """Run the gate ``name`` (one of ``COMPLETION_GATES``); ``plan`` loads the run's packs.

    Returns the gate's one-line summary; raises ``CompletionGateError``, or
    ``FatalError`` for an unknown gate name.
    """
    if name == ENQUEUE_ORDINAL_GATE:
        return enqueue_ordinal_gate(engine)
    if name == SOURCE_LANE_GATE:
        return source_lane_gate(engine)
    if name == LISTVIEW_GATE:
        return listview_gate(engine)
    if name == SOURCE_REVISION_GATE:
        return source_revision_gate(engine, plan())
    raise FatalError(f"unknown completion gate {name!r}: one of {', '.join(COMPLETION_GATES)}")
