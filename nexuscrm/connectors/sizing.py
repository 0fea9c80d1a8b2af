"""Connector worker sizing: activity slots, threads and database pool from the configuration.

One inbound worker workflow runs at most one claim (a local activity) and one
``process`` (a remote activity) at a time, so a worker process that may serve
``packs`` packs of ``workers_per_pack`` workers each needs that many slots of
each kind; both kinds run on one thread pool, and every thread may hold one
pooled database connection. No seed function: the Go runtime runs one
goroutine per worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from nexuscrm.log import log

CONTROL_ACTIVITIES = 5
"""Remote slots beyond the inbound workers' (reconcile, drain, identity notify/recover,
and the fleet's periodic pass, which holds one while it waits out its interval)."""

DEFAULT_PACK_ALLOWANCE = 4
"""Packs a connector worker is sized for at least (``NEXUS_CONNECTOR_PACK_ALLOWANCE``)."""

DEFAULT_MAX_ACTIVITY_SLOTS = 128
"""Cap on the inbound workers' slots of each kind (``NEXUS_CONNECTOR_MAX_ACTIVITY_SLOTS``).

128 threads waiting on I/O are cheap; beyond that a single process mostly
queues on the GIL and the database. Run more worker processes instead."""

POOL_OVERFLOW = 10
"""Database connections beyond one per thread (short-lived CLI-like reads, pre-pings)."""


@dataclass(frozen=True)
class WorkerSizing:
    """Sizes of one connector worker process.

    ``activities`` / ``local_activities``: ``max_concurrent_activities`` and
    ``max_concurrent_local_activities`` of the connector ``Worker``;
    ``threads``: its ``activity_executor`` size (both kinds share it);
    ``pool_size`` / ``max_overflow``: the SQLAlchemy pool of the engine the
    process shares (threads plus ``extra_threads`` of other workers, plus
    :data:`POOL_OVERFLOW`); ``demand``: inbound workers wanted (packs x
    workers per pack); ``capped``: ``demand`` exceeded the cap.
    """

    packs: int
    workers_per_pack: int
    demand: int
    activities: int
    local_activities: int
    threads: int
    pool_size: int
    max_overflow: int
    capped: bool


def worker_sizing(
    workers_per_pack: int,
    packs: int,
    *,
    max_slots: int = DEFAULT_MAX_ACTIVITY_SLOTS,
    extra_threads: int = 0,
) -> WorkerSizing:
    """Slots, threads and pool for ``packs`` packs of ``workers_per_pack`` workers.

    ``demand = max(1, packs) * max(1, workers_per_pack)``; ``workers =
    min(demand, max_slots)`` (a warning is logged when capped);
    ``local_activities = workers`` (claims), ``activities = workers +
    CONTROL_ACTIVITIES`` (batches plus control activities), ``threads =
    activities + local_activities``, ``pool_size = threads + extra_threads``,
    ``max_overflow = POOL_OVERFLOW``. Raises ``ValueError`` for ``max_slots < 1``.
    """
    if max_slots < 1:
        raise ValueError(f"max_slots must be positive, got {max_slots}")
    packs = max(1, packs)
    per_pack = max(1, workers_per_pack)
    demand = packs * per_pack
    workers = min(demand, max_slots)
    if demand > max_slots:
        log.warning(
            "connector worker capped: fewer activity slots than inbound workers; "
            "run more worker processes or lower NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK",
            packs=packs,
            workers_per_pack=per_pack,
            demand=demand,
            cap=max_slots,
        )
    activities = workers + CONTROL_ACTIVITIES
    threads = activities + workers
    return WorkerSizing(
        packs=packs,
        workers_per_pack=per_pack,
        demand=demand,
        activities=activities,
        local_activities=workers,
        threads=threads,
        pool_size=threads + max(0, extra_threads),
        max_overflow=POOL_OVERFLOW,
        capped=demand > max_slots,
    )
