"""Observability: queue numbers per pack, a pack's processing pressure, stalled packs,
the failed items an operator may replay."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select

from nexuscrm.connectors.queue.scan import _pick
from nexuscrm.connectors.queue.shapes import PackQueueStats
from nexuscrm.connectors.queue.vocabulary import (
    CLAIMABLE_WORK_TYPES,
    STATE_FAILED,
    STATE_PENDING,
    STATE_PROCESSING,
    _case,
    _normalize_classes,
    _now,
    _parked,
    _w,
)
from nexuscrm.db import tables as t


def pack_queue_stats(
    engine: Engine, installed_pack_id: str | None = None, *, now: datetime | None = None
) -> list[PackQueueStats]:
    """Queue numbers per installed pack (one pack, or every pack with work items).

    Three grouped queries. Sorted by installed pack id.
    """
    when = _now(now)
    stats: dict[str, PackQueueStats] = {}

    def get(pack: str) -> PackQueueStats:
        return stats.setdefault(pack, PackQueueStats(installed_pack_id=pack))

    def scoped(stmt: Any) -> Any:
        if installed_pack_id is not None:
            return stmt.where(_w.c.InstalledPackId == installed_pack_id)
        return stmt

    with engine.connect() as conn:
        for pack, state, qc, n in conn.execute(
            scoped(
                select(_w.c.InstalledPackId, _w.c.State, _w.c.QueueClass, func.count())
            ).group_by(_w.c.InstalledPackId, _w.c.State, _w.c.QueueClass)
        ).all():
            get(pack).counts[(state, qc)] = int(n)
        for pack, oldest in conn.execute(
            scoped(
                select(_w.c.InstalledPackId, func.min(_w.c.CreatedDate)).where(
                    _w.c.State == STATE_PENDING
                )
            ).group_by(_w.c.InstalledPackId)
        ).all():
            if oldest is not None:
                get(pack).oldest_pending_age_s = max(0.0, (when - oldest).total_seconds())
        for pack, fclass, n in conn.execute(
            scoped(
                select(_w.c.InstalledPackId, _w.c.FailureClass, func.count()).where(
                    _w.c.State == STATE_FAILED
                )
            ).group_by(_w.c.InstalledPackId, _w.c.FailureClass)
        ).all():
            fc = get(pack).failures_by_class
            key = fclass or "unknown"
            fc[key] = fc.get(key, 0) + int(n)
    if installed_pack_id is not None and not stats:
        return [PackQueueStats(installed_pack_id=installed_pack_id)]
    return [stats[k] for k in sorted(stats)]


def processing_pressure(
    engine: Engine,
    installed_pack_id: str,
    queue_classes: Sequence[str],
    now: datetime | None = None,
) -> tuple[int, int]:
    """``(ProcessingCount, StaleProcessingCount)`` of a pack's processing rows.

    Port of the seed's ``workItemProcessingPressureProvider.ProcessingPressure``:
    rows with ``State='processing'`` of work types ConnectorEvent and
    WorkflowActionApply, optionally filtered to ``queue_classes`` (normalized;
    empty = all), parked rows (dependency set, no lease) excluded from both
    counts; stale = ``LeaseUntil`` NULL or ``<= now``.
    """
    when = _now(now)
    classes = _normalize_classes(queue_classes)
    not_parked = ~_parked(_w)
    stale = and_(or_(_w.c.LeaseUntil.is_(None), _w.c.LeaseUntil <= when), not_parked)
    stmt = select(
        func.coalesce(func.sum(_case(not_parked)), 0),
        func.coalesce(func.sum(_case(stale)), 0),
    ).where(
        _w.c.InstalledPackId == installed_pack_id,
        _w.c.WorkType.in_(CLAIMABLE_WORK_TYPES),
        _w.c.State == STATE_PROCESSING,
    )
    if classes:
        stmt = stmt.where(_w.c.QueueClass.in_(classes))
    with engine.connect() as conn:
        processing, stale_n = conn.execute(stmt).one()
    return int(processing), int(stale_n)


def stalled_pack(
    engine: Engine,
    installed_pack_id: str,
    worker_count: int,
    max_processing_rows: int,
    now: datetime | None = None,
    *,
    generation: int | None = None,
) -> bool:
    """Whether a pack has claimable work while some of its workers hold no lease.

    The fleet's periodic backlog reconcile (the seed's ``reconcileBacklog``,
    every 5 s) wakes such a pool: its idle workers back their idle timers off
    (up to ``idle_max_seconds``), so work that arrives without a ``wake`` (a
    retry whose ``RunAfter`` came due, a stale lease, an item enqueued by
    another program) is claimed within one reconcile, not one backed-off
    idle timer. A pool whose ``worker_count`` lease owners all hold live
    leases is busy: each worker claims again when its batch ends, so no wake
    is needed (and none is sent while the pool is busy). ``generation``: the
    serving pool's claim-fence generation; only leases claimed under it count
    as its workers' (a rebuilt pool's workers are idle while the old pool's
    draining workers still hold leases: they are woken).

    Claimable is decided by the claim's own candidate scan (lane heads,
    target-exclusive, within the processing budget: see
    :func:`nexuscrm.connectors.queue.claiming.claim`), read-only, for one
    candidate: items pending behind a ``blocked`` lane head are not claimable
    and wake nothing; new items only while the pack's processing rows are
    under ``max_processing_rows``. One read of the pack's processing rows
    plus that scan.
    """
    when = _now(now)
    with engine.connect() as conn:
        processing = conn.execute(
            select(
                _w.c.TargetMutationLaneKey, _w.c.LeaseUntil, _w.c.LeaseOwner, _w.c.Generation
            ).where(
                _w.c.InstalledPackId == installed_pack_id,
                _w.c.State == STATE_PROCESSING,
                _w.c.WorkType.in_(CLAIMABLE_WORK_TYPES),
                ~_parked(_w),
            )
        ).all()
        live = [r for r in processing if r[1] is not None and r[1] >= when]
        ours = [r for r in live if generation is None or int(r[3] or 0) == generation]
        if len({r[2] for r in ours}) >= max(1, worker_count):
            return False
        got = _pick(
            conn,
            installed_pack_id,
            [],
            [],
            when,
            1,
            {r[0] for r in live},
            new_budget=max(0, max_processing_rows - len(processing)),
        )
    return bool(got)


@dataclass(frozen=True)
class FailedItem:
    """One failed work item for an operator: what failed, why, and the id to replay."""

    work_id: str
    installed_pack_id: str
    namespace: str
    event_kind: str
    source_object: str
    source_id: str
    failure_class: str
    failure_summary: str
    failure_count: int
    last_failure_at: datetime | None


def failed_items(
    engine: Engine,
    installed_pack_id: str | None = None,
    failure_class: str | None = None,
    limit: int = 50,
) -> tuple[list[FailedItem], int]:
    """The failed work items not replayed yet (``ReplayedAt`` empty), newest failure
    first, at most ``limit``, with their event's kind and source; and how many
    there are in all. ``installed_pack_id`` / ``failure_class`` narrow both.
    Two queries; ``limit`` < 1 raises ``ValueError``."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    e = t.connector_event
    where = [_w.c.State == STATE_FAILED, _w.c.ReplayedAt.is_(None)]
    if installed_pack_id is not None:
        where.append(_w.c.InstalledPackId == installed_pack_id)
    if failure_class is not None:
        where.append(_w.c.FailureClass == failure_class)
    rows_q = (
        select(
            _w.c.WorkId,
            _w.c.InstalledPackId,
            e.c.Namespace,
            e.c.EventKind,
            e.c.SourceObject,
            e.c.SourceId,
            _w.c.FailureClass,
            _w.c.FailureSummary,
            _w.c.FailureCount,
            _w.c.LastFailureAt,
        )
        .select_from(_w.join(e, e.c.EventId == _w.c.EventId))
        .where(*where)
        .order_by(_w.c.LastFailureAt.desc(), _w.c.WorkId)
        .limit(limit)
    )
    with engine.connect() as conn:
        total = int(conn.execute(select(func.count()).select_from(_w).where(*where)).scalar_one())
        rows = conn.execute(rows_q).all()
    items = [
        FailedItem(
            work_id=r[0],
            installed_pack_id=r[1],
            namespace=r[2] or "",
            event_kind=r[3],
            source_object=r[4] or "",
            source_id=r[5] or "",
            failure_class=r[6] or "unknown",
            failure_summary=r[7] or "",
            failure_count=int(r[8] or 0),
            last_failure_at=r[9],
        )
        for r in rows
    ]
    return items, total
