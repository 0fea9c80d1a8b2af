"""Ending attempts that did not succeed: retry, fail, block, and the batch's tally.

Split from :mod:`nexuscrm.connectors.processor` (which runs the flows): the
:class:`BatchOutcome` a batch counts into, and the :class:`Finisher` that ends
an item's attempt after a flow error, a missing route, an unresolved
dependency (the item is blocked on it), an exception no handler expected, or
before any flow when the item can never run (``payload-invalid``,
``replay-superseded``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine

from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue
from nexuscrm.connectors.flows import PAYLOAD_INVALID, DependencyUnresolved, FlowError
from nexuscrm.connectors.identity import Dependency, to_spec
from nexuscrm.connectors.routes import RouteNotFoundError
from nexuscrm.contracts import BatchResult, BlockedWait
from nexuscrm.db.dialect import describe_error, is_transient
from nexuscrm.inputs import kind_of
from nexuscrm.log import log

# A blocked item whose identity wait has not marked it within this grace is
# treated as wait-less by recovery (which starts the wait).
BLOCK_GRACE = dt.timedelta(seconds=60)


def count(
    outcome: BatchOutcome, kind: str, failure_class: str, work_id: str, ended: str = ""
) -> None:
    """Add one item of ``kind`` (``retried`` / ``failed``) with ``failure_class``.

    ``work_id``'s attempt is recorded in ``outcome.ended`` as ``ended`` (default:
    ``kind``; ``blocked`` for a block, which counts as retried).
    """
    setattr(outcome, kind, getattr(outcome, kind) + 1)
    outcome.failure_classes[failure_class] = outcome.failure_classes.get(failure_class, 0) + 1
    outcome.ended[work_id] = (ended or kind, failure_class)


@dataclass
class BatchOutcome:
    """Counts of one batch: succeeded, retried, failed, lost (lease taken over).

    The batch's running tally, not the wire type: ``failure_classes`` (count
    per failure class) stays in the process and ``wake_keys`` is a set while
    items add to it. :meth:`result` is its ``BatchResult``; ``blocked`` is
    already wire data (``BlockedWait``: work id, key hash, ``DependencySpec``).
    """

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    failure_classes: dict[str, int] = field(default_factory=dict)
    blocked: list[BlockedWait] = field(default_factory=list)
    wake_keys: set[str] = field(default_factory=set)
    released: int = 0
    ended: dict[str, tuple[str, str]] = field(default_factory=dict)
    """How each item's attempt ended in this batch, by work id: ``(outcome,
    failure class)``, outcome ``succeeded`` / ``failed`` / ``retried`` /
    ``blocked`` (failure class ``''`` for a success). Items lost to another
    worker or handed back are not in it. For metrics; not on the wire."""

    def succeeded_items(self, items: Sequence[queue.ClaimedItem]) -> None:
        """Count ``items`` succeeded (their finish committed)."""
        self.succeeded += len(items)
        for item in items:
            self.ended[item.work_id] = ("succeeded", "")

    def merge(self, other: BatchOutcome) -> None:
        """Add a later batch's tally to this one (one process activity that ran
        several claimed batches returns their sum: counts added, blocked waits
        and wake keys joined, ``ended`` updated)."""
        self.succeeded += other.succeeded
        self.retried += other.retried
        self.failed += other.failed
        self.lost += other.lost
        for cls, n in other.failure_classes.items():
            self.failure_classes[cls] = self.failure_classes.get(cls, 0) + n
        self.blocked.extend(other.blocked)
        self.wake_keys |= other.wake_keys
        self.released += other.released
        self.ended.update(other.ended)

    def result(self) -> BatchResult:
        """The ``BatchResult`` the process activity returns (``wake_keys`` sorted)."""
        return BatchResult(
            self.succeeded,
            self.retried,
            self.failed,
            self.lost,
            blocked=list(self.blocked),
            wake_keys=sorted(self.wake_keys),
            released=self.released,
        )


class Finisher:
    """Ends attempts of claimed items that did not succeed, and counts them.

    Shared by the batches of one :class:`~nexuscrm.connectors.processor.Processor`
    (stateless apart from ``engine`` and ``max_attempts``; each call gets the
    batch's own ``outcome``). Port of the seed worker's per-event failure
    handling: a retriable error is retried with backoff while attempts remain,
    anything else fails the item with a class naming the cause.
    """

    def __init__(self, engine: Engine, max_attempts: int) -> None:
        self.engine = engine
        self.max_attempts = max_attempts

    def unrunnable(
        self, items: Sequence[queue.ClaimedItem], outcome: BatchOutcome
    ) -> list[queue.ClaimedItem]:
        """Fail the items that no attempt can ever run; return the others.

        ``payload-invalid``: the event's payload is not a JSON object (a
        string, a list, a number). ``replay-superseded``: a replay whose record
        has a later event that succeeded meanwhile (running it would put older
        field values over newer ones; ``queue.replay`` refuses the same case
        up front). Both terminal, each with a summary naming the value.
        """
        keep: list[queue.ClaimedItem] = []
        replays = [i for i in items if i.replay_of_work_id and isinstance(i.payload, dict)]
        superseded: dict[str, list[tuple[str, str]]] = {}
        if replays:
            with self.engine.connect() as conn:
                for item in replays:
                    later = [
                        (w, st)
                        for w, st in queue.superseding_items(
                            conn, item.source_lane_key, item.lane_ordinal
                        )
                        if st == queue.STATE_SUCCEEDED and w != item.work_id
                    ]
                    if later:
                        superseded[item.work_id] = later
        for item in items:
            if not isinstance(item.payload, dict):
                self.failed(
                    item,
                    PAYLOAD_INVALID,
                    f"event {item.event_id} ({item.event_kind}): payload is "
                    f"{kind_of(item.payload)}, "
                    "not an object; no flow can run it",
                    outcome,
                )
            elif item.work_id in superseded:
                later = superseded[item.work_id]
                self.failed(
                    item,
                    "replay-superseded",
                    f"replay {item.work_id} of {item.replay_of_work_id}: later events of the "
                    f"record ({', '.join(w for w, _s in later[:5])}) succeeded since; "
                    "running it would overwrite their newer values",
                    outcome,
                )
            else:
                keep.append(item)
        return keep

    def unexpected(self, item: queue.ClaimedItem, exc: Exception, outcome: BatchOutcome) -> None:
        """Finish ``item`` after an exception no handler expected: retried when it is a
        transient database error and attempts remain, else failed ``flow-error`` naming it."""
        try:
            if is_transient(exc) and item.budget_attempt < self.max_attempts:
                delay = queue.retry_backoff(item.budget_attempt)
                self.retry(item, "transient-db", describe_error(exc), delay, outcome)
            else:
                log.error("work item raised", work_id=item.work_id, err=describe_error(exc))
                self.failed(item, "flow-error", describe_error(exc), outcome)
        except queue.LeaseLost:
            outcome.lost += 1

    def error(
        self,
        conn: Connection,
        item: queue.ClaimedItem,
        exc: Exception,
        outcome: BatchOutcome,
    ) -> None:
        """Finish ``item`` after a route or flow error, in ``conn``'s transaction."""
        if isinstance(exc, DependencyUnresolved):
            self.block(conn, item, exc, outcome)
            return
        if isinstance(exc, FlowError):
            if exc.retriable and item.budget_attempt < self.max_attempts:
                delay = queue.retry_backoff(item.budget_attempt)
                queue.finish_retry(
                    conn,
                    item,
                    run_after=utcnow() + delay,
                    failure_class=exc.failure_class,
                    summary=str(exc),
                )
                count(outcome, "retried", exc.failure_class, item.work_id)
                return
            failure_class = exc.failure_class
        elif isinstance(exc, RouteNotFoundError):
            failure_class = exc.failure_class  # route-not-found, or pack-removed
        else:  # pragma: no cover - only FlowError / RouteNotFoundError reach here
            raise exc
        queue.finish_failed(conn, item, failure_class=failure_class, summary=str(exc))
        count(outcome, "failed", failure_class, item.work_id)

    def block(
        self,
        conn: Connection,
        item: queue.ClaimedItem,
        exc: DependencyUnresolved,
        outcome: BatchOutcome,
    ) -> None:
        p = exc.parent
        dep = Dependency.remote(p.owner_key, p.namespace, p.destination_object, p.remote_id)
        queue.block_item(conn, item, dep, summary=str(exc), probe_after=utcnow() + BLOCK_GRACE)
        outcome.blocked.append(BlockedWait(item.work_id, dep.key_hash, to_spec(dep)))
        count(outcome, "retried", exc.failure_class, item.work_id, ended="blocked")

    def retry(
        self,
        item: queue.ClaimedItem,
        failure_class: str,
        summary: str,
        delay: dt.timedelta,
        outcome: BatchOutcome,
    ) -> None:
        with self.engine.begin() as conn:
            queue.finish_retry(
                conn, item, run_after=utcnow() + delay, failure_class=failure_class, summary=summary
            )
        count(outcome, "retried", failure_class, item.work_id)

    def failed(
        self, item: queue.ClaimedItem, failure_class: str, summary: str, outcome: BatchOutcome
    ) -> None:
        with self.engine.begin() as conn:
            queue.finish_failed(conn, item, failure_class=failure_class, summary=summary)
        count(outcome, "failed", failure_class, item.work_id)
