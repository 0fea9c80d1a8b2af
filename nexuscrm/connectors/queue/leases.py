"""Leases and finishing: extend and hold leases, finish succeeded / retry / failed.

Every finish is a compare-and-set on (WorkId, LeaseToken, FencingToken,
State='processing') in the caller's transaction and writes one
``_System_ConnectorWorkAttempt`` row; a lost lease raises :class:`LeaseLost`
(a lease of a superseded claim fence is lost: see ``queue.fencing``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, or_, select
from sqlalchemy.sql.elements import ColumnElement

from nexuscrm.connectors.queue.locking import write_transaction
from nexuscrm.connectors.queue.shapes import ClaimedItem
from nexuscrm.connectors.queue.vocabulary import (
    _CODE_LIMIT,
    _SUMMARY_LIMIT,
    OUTCOME_ABANDONED,
    OUTCOME_FAILED,
    OUTCOME_RETRY,
    OUTCOME_SUCCEEDED,
    RETRY_BACKOFF_BASE,
    RETRY_BACKOFF_CAP,
    STATE_FAILED,
    STATE_PENDING,
    STATE_PROCESSING,
    STATE_SUCCEEDED,
    LeaseLost,
    _a,
    _lease_until,
    _now,
    _truncate,
    _w,
    fence_value,
)
from nexuscrm.db.dialect import dialect_name


def _fence_is(fences: Sequence[str | None]) -> ColumnElement[bool]:
    """``FencingToken`` is one of ``fences`` (``None``: an unfenced claim's NULL)."""
    named = sorted({f for f in fences if f is not None})
    conds = [_w.c.FencingToken.in_(named)] if named else []
    if any(f is None for f in fences):
        conds.append(_w.c.FencingToken.is_(None))
    return or_(*conds)


def _insert_attempts(
    conn: Connection, rows: list[dict[str, Any]], *, ignore_existing: bool
) -> None:
    """Insert ``_System_ConnectorWorkAttempt`` rows (optionally skipping duplicates)."""
    stmt = _a.insert()
    if ignore_existing:
        stmt = stmt.prefix_with("OR IGNORE" if dialect_name(conn) == "sqlite" else "IGNORE")
    conn.execute(stmt, rows)


def _attempt_row(
    work_id: str,
    attempt: int,
    event_id: str,
    outcome: str,
    now: datetime,
    *,
    flow_execution_id: str | None = None,
    failure_class: str | None = None,
    retriable: bool = False,
) -> dict[str, Any]:
    code = _truncate(failure_class, _CODE_LIMIT) if failure_class else None
    return {
        "WorkId": work_id,
        "Attempt": attempt,
        "EventId": event_id,
        "FlowExecutionId": flow_execution_id,
        "OutcomeState": outcome,
        "PresentedErrorCode": None,
        "CauseCode": code,
        "CauseCategory": code,
        "CauseElementType": None,
        "CauseElementName": None,
        "Retriable": retriable,
        "CreatedDate": now,
        "LastModifiedDate": now,
    }


def extend_leases(
    engine: Engine,
    leases: Sequence[tuple[str, str]],
    lease_seconds: float,
    now: datetime | None = None,
    fencing_token: str | None = None,
) -> list[str]:
    """Push ``LeaseUntil`` to ``now + lease_seconds`` for each ``(work_id, lease_token)``.

    One transaction, one compare-and-set per lease (and on ``FencingToken``
    when ``fencing_token`` is given: the worker's claim fence). A lease that
    expired but was not reclaimed yet is extended (its token still matches).
    Returns the work ids whose lease is lost (token changed, fence revoked
    or other, or no longer processing), in input order. Raises
    ``ValueError`` for a non-positive ``lease_seconds``.
    """
    when = _now(now)
    until = _lease_until(when, lease_seconds)
    lost: list[str] = []
    if not leases:
        return lost
    fence = [] if fencing_token is None else [_fence_is([fence_value(fencing_token)])]
    with engine.begin() as conn:
        for work_id, token in leases:
            res = conn.execute(
                _w.update()
                .where(
                    _w.c.WorkId == work_id,
                    _w.c.LeaseToken == token,
                    _w.c.State == STATE_PROCESSING,
                    *fence,
                )
                .values(LeaseUntil=until, LastModifiedDate=when)
            )
            if res.rowcount != 1:
                lost.append(work_id)
    return lost


RELEASED_CAUSE = "worker-shutdown"
"""``CauseCode`` of the attempt row :func:`release_leases` writes."""


def release_leases(
    engine: Engine,
    items: Sequence[ClaimedItem],
    *,
    cause_code: str = RELEASED_CAUSE,
    now: datetime | None = None,
) -> list[str]:
    """Hand the leases of ``items`` back at once: claimable again now, not at lease expiry.

    For a worker that stops (shutdown) with claimed items it has not started.
    One transaction; per item a compare-and-set on (WorkId, LeaseToken,
    FencingToken, State='processing') sets ``State='pending'`` and clears ``LeaseOwner``,
    ``LeaseToken`` and ``LeaseUntil`` (``RunAfter`` is kept: NULL or past, so
    the next claim takes the item at once). The attempt is recorded the way
    the stale reclaim records a dead worker's (``claiming._claim``): an
    ``OutcomeState='abandoned'``, ``Retriable`` attempt row with
    ``CauseCode=cause_code``; ``FailureCount`` and the failure fields are not
    touched (an abandoned attempt is not a failure). ``Attempt`` keeps the
    claim's count, as after a reclaim (the attempt rows are keyed by it).

    Returns the work ids released, in input order; an item whose lease is
    already lost (token changed, finished) is skipped. No seed function: the
    Go runtime lets the leases expire.
    """
    if not items:
        return []
    when = _now(now)
    released: list[ClaimedItem] = []
    with write_transaction(engine) as conn:
        for item in items:
            res = conn.execute(
                _w.update()
                .where(
                    _w.c.WorkId == item.work_id,
                    _w.c.LeaseToken == item.lease_token,
                    _fence_is([item.fencing_token]),
                    _w.c.State == STATE_PROCESSING,
                )
                .values(
                    State=STATE_PENDING,
                    LeaseOwner=None,
                    LeaseToken=None,
                    LeaseUntil=None,
                    LastModifiedDate=when,
                )
            )
            if res.rowcount == 1:
                released.append(item)
        if released:
            _insert_attempts(
                conn,
                [
                    _attempt_row(
                        i.work_id,
                        i.attempt,
                        i.event_id,
                        OUTCOME_ABANDONED,
                        when,
                        failure_class=cause_code,
                        retriable=True,
                    )
                    for i in released
                ],
                ignore_existing=True,
            )
    return [i.work_id for i in released]


def hold_leases(conn: Connection, items: Sequence[ClaimedItem]) -> list[ClaimedItem]:
    """The items whose lease still holds, locked for the caller's transaction.

    One read of the work-item rows (``FOR UPDATE`` on the MySQL family, so no
    stale reclaim can take them before the caller commits; SQLite: the caller
    holds the write lock, see :func:`write_transaction`). An item whose token
    or fencing token changed or that is no longer ``processing`` is left
    out: its lease is lost and the caller must not write for it. Input order
    is kept.
    """
    if not items:
        return []
    stmt = select(_w.c.WorkId, _w.c.LeaseToken, _w.c.FencingToken).where(
        _w.c.WorkId.in_([i.work_id for i in items]), _w.c.State == STATE_PROCESSING
    )
    if dialect_name(conn) == "mysql":
        stmt = stmt.with_for_update()
    current = {r[0]: (r[1], r[2]) for r in conn.execute(stmt)}
    return [i for i in items if current.get(i.work_id) == (i.lease_token, i.fencing_token)]


def finish_succeeded_many(
    conn: Connection,
    items: Sequence[ClaimedItem],
    *,
    now: datetime | None = None,
    flow_execution_ids: Mapping[str, str] | None = None,
    cause_code: str | None = None,
) -> None:
    """:func:`finish_succeeded` for many items in the caller's transaction, batched.

    ``flow_execution_ids`` (by work id) and ``cause_code`` go to the attempt
    rows: an echo or a runtime handoff records why no flow ran.

    One compare-and-set UPDATE over all items (each row must still be
    ``processing`` with its item's token: lease tokens are fresh uuids, so
    ``WorkId IN (...) AND LeaseToken IN (...)`` matches exactly the pairs)
    and one multi-row INSERT of the attempt rows. Raises ``LeaseLost`` (for
    the first item found not finished by this call) when fewer rows matched
    than items were given — roll the transaction back then.
    """
    if not items:
        return
    when = _now(now)
    work_ids = [i.work_id for i in items]
    if len(set(work_ids)) != len(work_ids):
        raise ValueError("finish_succeeded_many: duplicate work ids")
    res = conn.execute(
        _w.update()
        .where(
            _w.c.WorkId.in_(work_ids),
            _w.c.LeaseToken.in_([i.lease_token for i in items]),
            _fence_is([i.fencing_token for i in items]),
            _w.c.State == STATE_PROCESSING,
        )
        .values(
            LeaseOwner=None,
            LeaseToken=None,
            LeaseUntil=None,
            State=STATE_SUCCEEDED,
            TerminalAt=when,
            LastModifiedDate=when,
        )
    )
    if res.rowcount != len(items):
        rows = {
            r[0]: r[1]
            for r in conn.execute(
                select(_w.c.WorkId, _w.c.State).where(
                    _w.c.WorkId.in_(work_ids), _w.c.LeaseToken.is_(None)
                )
            )
        }
        missing = next((w for w in work_ids if rows.get(w) != STATE_SUCCEEDED), work_ids[0])
        raise LeaseLost(missing)
    _insert_attempts(
        conn,
        [
            _attempt_row(
                i.work_id,
                i.attempt,
                i.event_id,
                OUTCOME_SUCCEEDED,
                when,
                flow_execution_id=(flow_execution_ids or {}).get(i.work_id),
                failure_class=cause_code,
            )
            for i in items
        ],
        ignore_existing=False,
    )


def _finish(conn: Connection, item: ClaimedItem, values: dict[str, Any]) -> None:
    res = conn.execute(
        _w.update()
        .where(
            _w.c.WorkId == item.work_id,
            _w.c.LeaseToken == item.lease_token,
            _fence_is([item.fencing_token]),
            _w.c.State == STATE_PROCESSING,
        )
        .values(LeaseOwner=None, LeaseToken=None, LeaseUntil=None, **values)
    )
    if res.rowcount != 1:
        raise LeaseLost(item.work_id)


def finish_succeeded(
    conn: Connection,
    item: ClaimedItem,
    *,
    flow_execution_id: str | None = None,
    now: datetime | None = None,
    cause_code: str | None = None,
) -> None:
    """Mark ``item`` succeeded (terminal, ``TerminalAt``) in the caller's transaction.

    Compare-and-set on (WorkId, LeaseToken, FencingToken, State='processing'); writes the
    attempt row (``OutcomeState='succeeded'``, ``CauseCode=cause_code``).
    Raises ``LeaseLost`` when the lease token no longer matches — roll the
    transaction back then.
    """
    when = _now(now)
    _finish(conn, item, {"State": STATE_SUCCEEDED, "TerminalAt": when, "LastModifiedDate": when})
    _insert_attempts(
        conn,
        [
            _attempt_row(
                item.work_id,
                item.attempt,
                item.event_id,
                OUTCOME_SUCCEEDED,
                when,
                flow_execution_id=flow_execution_id,
                failure_class=cause_code,
            )
        ],
        ignore_existing=False,
    )


def finish_retry(
    conn: Connection,
    item: ClaimedItem,
    *,
    run_after: datetime,
    failure_class: str,
    summary: str,
    now: datetime | None = None,
) -> None:
    """Put ``item`` back to ``pending`` until ``run_after`` (naive UTC) after a retriable failure.

    Increments ``FailureCount``; sets ``LastFailureAt``, ``FailureClass``
    (first 64 chars), ``FailureSummary`` (first 4000 chars); clears the lease.
    Writes the attempt row (``OutcomeState='retry'``, ``Retriable``). Raises
    ``LeaseLost`` when the lease token no longer matches.
    """
    when = _now(now)
    _finish(
        conn,
        item,
        {
            "State": STATE_PENDING,
            "RunAfter": run_after.replace(microsecond=0),
            "FailureCount": _w.c.FailureCount + 1,
            "LastFailureAt": when,
            "FailureClass": _truncate(failure_class, _CODE_LIMIT),
            "FailureSummary": _truncate(summary, _SUMMARY_LIMIT),
            "LastModifiedDate": when,
        },
    )
    _insert_attempts(
        conn,
        [
            _attempt_row(
                item.work_id,
                item.attempt,
                item.event_id,
                OUTCOME_RETRY,
                when,
                failure_class=failure_class,
                retriable=True,
            )
        ],
        ignore_existing=False,
    )


def finish_failed(
    conn: Connection,
    item: ClaimedItem,
    *,
    failure_class: str,
    summary: str,
    now: datetime | None = None,
) -> None:
    """Mark ``item`` failed (terminal, ``TerminalAt``); it can be :func:`replay`-ed later.

    Increments ``FailureCount``; sets ``LastFailureAt``, ``FailureClass``,
    ``FailureSummary``; clears the lease. Writes the attempt row
    (``OutcomeState='failed'``, not retriable). Raises ``LeaseLost`` when the
    lease token no longer matches.
    """
    when = _now(now)
    _finish(
        conn,
        item,
        {
            "State": STATE_FAILED,
            "TerminalAt": when,
            "FailureCount": _w.c.FailureCount + 1,
            "LastFailureAt": when,
            "FailureClass": _truncate(failure_class, _CODE_LIMIT),
            "FailureSummary": _truncate(summary, _SUMMARY_LIMIT),
            "LastModifiedDate": when,
        },
    )
    _insert_attempts(
        conn,
        [
            _attempt_row(
                item.work_id,
                item.attempt,
                item.event_id,
                OUTCOME_FAILED,
                when,
                failure_class=failure_class,
                retriable=False,
            )
        ],
        ignore_existing=False,
    )


def retry_backoff(failure_count: int) -> timedelta:
    """Delay before the next attempt after ``failure_count`` failures.

    1 s after the first failure, doubling (2 s, 4 s, ...), capped at 5 min
    (reached at the 10th failure). ``failure_count <= 1`` gives 1 s.
    """
    exponent = max(0, failure_count - 1)
    if exponent >= 20:  # 2**20 s is far past the cap; avoid huge numbers
        return RETRY_BACKOFF_CAP
    return min(RETRY_BACKOFF_BASE * (2**exponent), RETRY_BACKOFF_CAP)
