"""Observability: queue numbers per pack and a pack's processing pressure."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select

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
