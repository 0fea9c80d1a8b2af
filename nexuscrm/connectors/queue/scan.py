"""Candidate selection of a claim: which claimable rows one claim takes, in what order.

:func:`_pick` applies the claim's ordering rules (lane heads, target-lane
exclusivity, preferred classes, the processing budget) over the rows that
:func:`_scan` reads: one UNION ALL of index-ordered, keyset-paged slices.
Internal to :mod:`nexuscrm.connectors.queue.claiming`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    and_,
    bindparam,
    exists,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement

from nexuscrm.connectors.queue.vocabulary import (
    CLAIMABLE_WORK_TYPES,
    NON_TERMINAL_STATES,
    STATE_PENDING,
    _in_processing,
    _parked,
    _w,
)
from nexuscrm.db.dialect import dialect_name

# Built once: aliasing a 38-column table is costly in Python. Each UNION
# member is its own scope, so they can share the alias objects.
_W = _w.alias("w")
_P = _w.alias("p")
_T = _w.alias("t")


@dataclass
class _Member:
    """One index-ordered slice of the candidate scan, with its keyset cursor."""

    tag: str  # 'stale' | 'new' | 'due'
    queue_class: str | None
    cursor: tuple[Any, ...] | None = None
    exhausted: bool = False


@dataclass
class _Candidate:
    work_id: str
    state: str
    lease_token: str | None
    attempt: int
    event_id: str
    queue_class: str
    target_lane: str | None
    order_key: Any
    tag: str


def _pick(
    conn: Connection,
    pack: str,
    classes: list[str],
    preferred: list[str],
    now: datetime,
    budget: int,
    live_targets: set[str | None],
    *,
    new_budget: int,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[_Candidate]:
    """Choose up to ``budget`` candidates (lane heads, target-exclusive, in claim order),
    of which at most ``new_budget`` are not stale reclaims (the processing budget's room);
    none of ``exclude`` (work ids an earlier round of the same claim passed on).

    The scan is a UNION ALL of index-ordered slices with LIMIT — per queue
    class: never-retried pending items (``RunAfter IS NULL``, enqueue order)
    and due retries (``RunAfter <= now``); plus stale processing rows — each
    filtered by NOT EXISTS lane-head probes: on the source lane (lane index)
    and on the target mutation lane (target index). Slices whose
    window was full are paged on with keyset cursors while the budget is not
    met (items skipped for a busy target lane need that), up to 6 rounds.
    """
    scan_classes = classes or _pending_classes(conn, pack)
    members = [_Member("stale", None)]
    if new_budget <= 0:
        scan_classes = []  # only stale reclaims fit: they are already counted
    for qc in scan_classes:
        members += [_Member("new", qc), _Member("due", qc)]
    rank = {qc: i for i, qc in enumerate(preferred)}
    tag_rank = {"stale": 0, "due": 1, "new": 1}

    picked: list[_Candidate] = []
    taken_targets: set[str] = set()
    # Candidates skipped for a busy target lane are rare; a short window plus
    # the doubling rounds below reads fewer rows than a wide first window.
    window = budget + 16
    for _round in range(6):
        active = [m for m in members if not m.exhausted]
        if not active:
            break
        rows = _scan(conn, pack, classes, active, now, window)
        fresh: list[_Candidate] = []
        for m in active:
            got = rows.get(id(m), [])
            if m.tag == "stale" or len(got) < window:
                m.exhausted = True
            if got:
                last = got[-1]
                m.cursor = (
                    (last.order_key,) if m.tag != "due" else (last.order_key[0], last.order_key[1])
                )
            fresh.extend(got)
        fresh.sort(
            key=lambda c: (
                rank.get(c.queue_class, len(rank)),
                tag_rank[c.tag],
                c.order_key if c.tag != "due" else c.order_key[1],
            )
        )
        seen = {c.work_id for c in picked} | set(exclude)
        for cand in fresh:
            if cand.work_id in seen:
                continue
            key = cand.target_lane
            if key is not None and (key in live_targets or key in taken_targets):
                continue
            if cand.tag != "stale":
                if new_budget <= 0:
                    continue
                new_budget -= 1
            picked.append(cand)
            seen.add(cand.work_id)
            if key is not None:
                taken_targets.add(key)
            if len(picked) >= budget:
                return picked
        window *= 2
    return picked


_MIN_CLASS = select(func.min(_w.c.QueueClass)).where(
    _w.c.InstalledPackId == bindparam("pack"), _w.c.State == STATE_PENDING
)
_NEXT_CLASS = _MIN_CLASS.where(_w.c.QueueClass > bindparam("prev"))


def _pending_classes(conn: Connection, pack: str) -> list[str]:
    """The queue classes of the pack's pending items, sorted.

    A loose index scan: one ``MIN(QueueClass)`` per class, each after the
    last (``QueueClass > :prev``), every one answered from the claim index's
    edge (MariaDB: "Select tables optimized away"), so the cost follows the
    number of classes, not of pending rows. ``SELECT DISTINCT`` read every
    pending row's index entry: 30 ms per claim at 100,000 queued on MariaDB
    (a recursive CTE of the same MINs, correlated, was no better: 19 ms).
    """
    out: list[str] = []
    q = conn.execute(_MIN_CLASS, {"pack": pack}).scalar()
    while q is not None:
        out.append(str(q))
        q = conn.execute(_NEXT_CLASS, {"pack": pack, "prev": q}).scalar()
    return out


# Scan statements by shape (dialect, class filter, each member's tag and
# whether it has a cursor); values are bound parameters. Building the UNION
# of aliased subqueries costs more than running it, so it is built once.
_SCAN_CACHE: dict[tuple[Any, ...], Any] = {}


def _scan(
    conn: Connection,
    pack: str,
    classes: list[str],
    members: list[_Member],
    now: datetime,
    window: int,
) -> dict[int, list[_Candidate]]:
    """Run one UNION ALL over ``members``; rows grouped by member (``id(member)``)."""
    sqlite = dialect_name(conn) == "sqlite"
    shape = (sqlite, bool(classes), tuple((m.tag, m.cursor is not None) for m in members))
    stmt = _SCAN_CACHE.get(shape)
    if stmt is None:
        stmt = _SCAN_CACHE.setdefault(shape, _scan_statement(*shape))
    params: dict[str, Any] = {"pack": pack, "now": now, "window": window}
    if classes:
        params["classes"] = classes
    for idx, m in enumerate(members):
        if m.tag == "stale":
            continue
        params[f"qc{idx}"] = m.queue_class
        if m.cursor is not None:
            if m.tag == "new":
                params[f"ok{idx}"] = m.cursor[0]
            else:
                params[f"ra{idx}"], params[f"ok{idx}"] = m.cursor
    return _scan_rows(conn, stmt, params, members)


def _scan_statement(sqlite: bool, filtered: bool, shape: tuple[tuple[str, bool], ...]) -> Any:
    """The UNION ALL of :func:`_scan` for one shape (see ``_SCAN_CACHE``)."""
    pack = bindparam("pack", type_=_w.c.InstalledPackId.type)
    now = bindparam("now", type_=_w.c.RunAfter.type)
    window = bindparam("window", type_=Integer)
    parts = []
    for idx, (tag, has_cursor) in enumerate(shape):
        w, p = _W, _P
        # Enqueue order: WorkId (sequence-numbered) on MySQL, where InnoDB
        # secondary indexes end in the primary key; the rowid on SQLite.
        order_col: Any = literal_column("w.rowid") if sqlite else w.c.WorkId
        order_type = Integer() if sqlite else w.c.WorkId.type
        lane_head = ~exists().where(
            p.c.SourceLaneKey == w.c.SourceLaneKey,
            p.c.State.in_(NON_TERMINAL_STATES),
            p.c.LaneOrdinal <= w.c.LaneOrdinal,
            or_(p.c.LaneOrdinal < w.c.LaneOrdinal, p.c.WorkId < w.c.WorkId),
        )
        # The head of its target mutation lane too: no earlier non-terminal item
        # mutates the same target record. This, not a lock, keeps concurrent
        # claims from leasing two items of one target lane.
        t = _T
        target_head = ~exists().where(
            t.c.TargetMutationLaneKey == w.c.TargetMutationLaneKey,
            t.c.State.in_(NON_TERMINAL_STATES),
            t.c.LaneOrdinal <= w.c.LaneOrdinal,
            or_(t.c.LaneOrdinal < w.c.LaneOrdinal, t.c.WorkId < w.c.WorkId),
        )
        conds: list[ColumnElement[bool]] = [
            w.c.InstalledPackId == pack,
            w.c.WorkType.in_(CLAIMABLE_WORK_TYPES),
        ]
        order: list[Any] = [order_col]
        run_after: Any = null()
        limit: Any = window
        qc = bindparam(f"qc{idx}", type_=w.c.QueueClass.type)
        ok = bindparam(f"ok{idx}", type_=order_type)
        if tag == "stale":
            # Stale leases are few (bounded by the processing budget): take them
            # all, unordered, so the planner scans the claim index range.
            conds += [
                _in_processing(w, sqlite),
                or_(w.c.LeaseUntil.is_(None), w.c.LeaseUntil < now),
                ~_parked(w),
            ]
            if filtered:
                conds.append(w.c.QueueClass.in_(bindparam("classes", expanding=True)))
            order, limit = [], None
        elif tag == "new":
            conds += [
                w.c.State == STATE_PENDING,
                w.c.QueueClass == qc,
                w.c.RunAfter.is_(None),
            ]
            if has_cursor:
                conds.append(order_col > ok)
        else:
            conds += [
                w.c.State == STATE_PENDING,
                w.c.QueueClass == qc,
                w.c.RunAfter.is_not(None),
                w.c.RunAfter <= now,
            ]
            order = [w.c.RunAfter, order_col]
            if has_cursor:
                ra = bindparam(f"ra{idx}", type_=w.c.RunAfter.type)
                conds.append(or_(w.c.RunAfter > ra, and_(w.c.RunAfter == ra, order_col > ok)))
            run_after = w.c.RunAfter
        # Last: MariaDB evaluates attached conditions in order, and the probes
        # are the only costly ones.
        conds += [lane_head, target_head]
        sub = select(
            literal(idx).label("m"),
            w.c.WorkId,
            w.c.State,
            w.c.LeaseToken,
            w.c.Attempt,
            w.c.EventId,
            w.c.QueueClass,
            w.c.TargetMutationLaneKey,
            order_col.label("ok"),
            run_after.label("ra"),
        ).where(*conds)
        if order:
            sub = sub.order_by(*order)
        if limit is not None:
            sub = sub.limit(limit)
        parts.append(select(*sub.subquery(f"m{idx}").c))
    return parts[0] if len(parts) == 1 else union_all(*parts)


def _scan_rows(
    conn: Connection, stmt: Any, params: dict[str, Any], members: list[_Member]
) -> dict[int, list[_Candidate]]:
    out: dict[int, list[_Candidate]] = {}
    for row in conn.execute(stmt, params).all():
        m = members[int(row.m)]
        out.setdefault(id(m), []).append(
            _Candidate(
                work_id=row.WorkId,
                state=row.State,
                lease_token=row.LeaseToken,
                attempt=int(row.Attempt),
                event_id=row.EventId,
                queue_class=row.QueueClass,
                target_lane=row.TargetMutationLaneKey,
                order_key=(row.ra, row.ok) if m.tag == "due" else row.ok,
                tag=m.tag,
            )
        )
    # UNION ALL keeps no order across parts; restore each slice's order.
    for m in members:
        got = out.get(id(m))
        if got:
            got.sort(key=lambda c: c.order_key)
    return out
