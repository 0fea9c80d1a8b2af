"""Identity-convergence parking: block items on a dependency, wake, expire, recover.

``blocked``: the item's lookup waits on a dependency (see
``nexuscrm.connectors.identity``); its Dependency* columns say which, and an
IdentityWaitWorkflow (one per key hash) wakes it. Waking clears the
Dependency* columns (the attempt row with OutcomeState='blocked' and
FailureSummary keep the history), so a pending or processing row never
carries a stale dependency. ``DependencyProbeAfter`` is the wait's liveness
mark: the wait moves it past its next probe each time it probes; a row whose
mark is unset or past is a row without a live wait (recovery starts one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, or_, select

from nexuscrm.connectors.identity import (
    FAILURE_CLASS_EXPIRED,
    FAILURE_CLASS_INVALID,
    Dependency,
)
from nexuscrm.connectors.queue.leases import _attempt_row, _finish, _insert_attempts
from nexuscrm.connectors.queue.locking import write_transaction
from nexuscrm.connectors.queue.shapes import BlockedRow, ClaimedItem
from nexuscrm.connectors.queue.vocabulary import (
    _SUMMARY_LIMIT,
    OUTCOME_BLOCKED,
    STATE_BLOCKED,
    STATE_FAILED,
    STATE_PENDING,
    STATE_PROCESSING,
    _now,
    _parked,
    _truncate,
    _w,
)
from nexuscrm.db.dialect import dialect_name

_DEPENDENCY_COLUMNS = (
    "DependencyKind",
    "DependencyObjectAPIName",
    "DependencyRecordId",
    "DependencyKeyHash",
    "DependencyConnectorOwnerKey",
    "DependencyConnectorNamespace",
    "DependencyConnectorSourceObject",
    "DependencyDestinationSlotId",
    "DependencyConnectorRemoteId",
    "DependencyBlockedAt",
    "DependencyProbeAfter",
)
_CLEARED_DEPENDENCY: dict[str, Any] = dict.fromkeys(_DEPENDENCY_COLUMNS)
RECOVERY_PAGE = 1000
_CHUNK = 500


def _lock_by_id(conn: Connection, work_ids: Sequence[str]) -> list[Any]:
    """Rows of ``work_ids`` (WorkId, InstalledPackId, State, DependencyKeyHash,
    DependencyBlockedAt), locked.

    The lock order of every write of blocked rows (issue 11): primary keys
    only, ascending, no other predicate, so InnoDB takes record locks on the
    rows themselves and never a next-key or gap lock on a secondary index
    (``ix_ConnectorWorkItem_Dependency``) that a batch blocking an item must
    insert into. Callers filter the rows and update them by primary key.
    SQLite: a plain read (the transaction holds the database write lock).
    """
    ids = sorted(set(work_ids))
    mysql = dialect_name(conn) == "mysql"
    rows: list[Any] = []
    for start in range(0, len(ids), _CHUNK):
        stmt = (
            select(
                _w.c.WorkId,
                _w.c.InstalledPackId,
                _w.c.State,
                _w.c.DependencyKeyHash,
                _w.c.DependencyBlockedAt,
            )
            .where(_w.c.WorkId.in_(ids[start : start + _CHUNK]))
            .order_by(_w.c.WorkId)
        )
        rows.extend(conn.execute(stmt.with_for_update() if mysql else stmt).all())
    return rows


def _update_by_id(conn: Connection, work_ids: Sequence[str], values: dict[str, Any]) -> int:
    """``UPDATE ... WHERE WorkId IN (...)`` (rows the caller locked), ascending; rows changed."""
    ids = sorted(set(work_ids))
    n = 0
    for start in range(0, len(ids), _CHUNK):
        n += int(
            conn.execute(
                _w.update().where(_w.c.WorkId.in_(ids[start : start + _CHUNK])).values(**values)
            ).rowcount
        )
    return n


RECOVERY_MAX_PAGES = 100


def block_item(
    conn: Connection,
    item: ClaimedItem,
    dependency: Dependency,
    *,
    summary: str,
    probe_after: datetime | None = None,
    now: datetime | None = None,
) -> None:
    """Block ``item`` on ``dependency`` in the caller's transaction (ends its attempt).

    ``State='blocked'`` with the Dependency* columns, ``DependencyBlockedAt =
    now``, ``DependencyProbeAfter = probe_after`` (grace before recovery treats
    the row as wait-less); ``FailureClass='dependency-unresolved'`` and the
    summary; lease cleared; attempt row ``OutcomeState='blocked'``. The item
    keeps holding its source lane. Raises ``LeaseLost`` like every finish.
    """
    when = _now(now)
    _finish(
        conn,
        item,
        {
            "State": STATE_BLOCKED,
            "RunAfter": None,
            **dependency.columns(),
            "DependencyBlockedAt": when,
            "DependencyProbeAfter": probe_after.replace(microsecond=0) if probe_after else None,
            "LastFailureAt": when,
            "FailureClass": "dependency-unresolved",
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
                OUTCOME_BLOCKED,
                when,
                failure_class="dependency-unresolved",
                retriable=True,
            )
        ],
        ignore_existing=False,
    )


def _blocked_row(r: Any) -> BlockedRow:
    return BlockedRow(
        work_id=r.WorkId,
        installed_pack_id=r.InstalledPackId,
        key_hash=r.DependencyKeyHash,
        blocked_at=r.DependencyBlockedAt,
        probe_after=r.DependencyProbeAfter,
        dependency=Dependency.from_row(r),
    )


def _blocked_select() -> Any:
    return select(
        _w.c.WorkId,
        _w.c.InstalledPackId,
        *[_w.c[c] for c in _DEPENDENCY_COLUMNS],
    ).where(_w.c.State == STATE_BLOCKED)


def blocked_rows(engine: Engine, key_hash: str, work_ids: Sequence[str] = ()) -> list[BlockedRow]:
    """Blocked items of ``key_hash``, plus those of ``work_ids`` still blocked.

    Ordered by WorkId. A registered item whose columns were lost shows up with
    ``dependency=None`` (the wait terminalizes it as invalid).
    """
    cond = _w.c.DependencyKeyHash == key_hash
    if work_ids:
        cond = or_(cond, _w.c.WorkId.in_(list(work_ids)))
    with engine.connect() as conn:
        rows = conn.execute(_blocked_select().where(cond).order_by(_w.c.WorkId)).all()
    return [_blocked_row(r) for r in rows]


def blocked_keys(engine: Engine, key_hashes: Sequence[str]) -> set[str]:
    """The key hashes among ``key_hashes`` that have blocked items (index probes)."""
    out: set[str] = set()
    wanted = sorted(set(key_hashes))
    with engine.connect() as conn:
        for start in range(0, len(wanted), 500):
            out.update(
                conn.execute(
                    select(_w.c.DependencyKeyHash)
                    .where(
                        _w.c.DependencyKeyHash.in_(wanted[start : start + 500]),
                        _w.c.State == STATE_BLOCKED,
                    )
                    .distinct()
                ).scalars()
            )
    return out


def blocked_key_set(engine: Engine) -> set[str]:
    """Every key hash some item is ``blocked`` on (``ix_ConnectorWorkItem_Dependency``)."""
    with engine.connect() as conn:
        return set(
            conn.execute(
                select(_w.c.DependencyKeyHash)
                .where(_w.c.DependencyKeyHash.is_not(None), _w.c.State == STATE_BLOCKED)
                .distinct()
            ).scalars()
        )


WokenHook = Callable[[str, float], None]
"""Called once per woken item after the wake committed: ``(installed pack id,
seconds parked)``, from the item's ``DependencyBlockedAt`` to the wake's ``now``
(0 when the block time is unknown). Metrics use it; it must not raise."""


def wake_blocked_by_pack(
    engine: Engine,
    key_hash: str,
    *,
    now: datetime | None = None,
    on_woken: WokenHook | None = None,
) -> dict[str, int]:
    """Blocked items of ``key_hash`` -> ``pending`` (due now, Dependency* cleared).

    Returns woken items per installed pack id (empty when none was blocked:
    a duplicate wake wakes nothing). See :func:`wake_blocked_keys`.
    """
    return wake_blocked_keys(engine, [key_hash], now=now, on_woken=on_woken)


def wake_blocked_keys(
    engine: Engine,
    key_hashes: Sequence[str],
    *,
    now: datetime | None = None,
    on_woken: WokenHook | None = None,
) -> dict[str, int]:
    """Blocked items of any of ``key_hashes`` -> ``pending``, in one transaction.

    Returns woken items per installed pack id. A plain read finds the items
    first: when nothing is blocked on these keys (a duplicate wake, or a wait
    whose rows the finalizing batch already woke) no write transaction is
    opened, so a burst of such wakes never queues behind the inbound writers.
    The write then locks and updates those items by primary key only
    (:func:`_lock_by_id`), each still blocked on one of the keys. An item that
    blocks after the read registers a wait of its own, whose first probe
    converges. ``on_woken`` (:data:`WokenHook`) runs for each woken item
    after the commit.
    """
    keys = sorted(set(key_hashes))
    if not keys:
        return {}
    when = _now(now)
    candidates: list[str] = []
    with engine.connect() as conn:
        for start in range(0, len(keys), _CHUNK):
            candidates.extend(
                conn.execute(
                    select(_w.c.WorkId).where(
                        _w.c.DependencyKeyHash.in_(keys[start : start + _CHUNK]),
                        _w.c.State == STATE_BLOCKED,
                    )
                ).scalars()
            )
    if not candidates:
        return {}
    wanted = set(keys)
    with write_transaction(engine) as conn:
        rows = [
            r
            for r in _lock_by_id(conn, candidates)
            if r.State == STATE_BLOCKED and r.DependencyKeyHash in wanted
        ]
        _update_by_id(
            conn,
            [r.WorkId for r in rows],
            {"State": STATE_PENDING, "RunAfter": None, "LastModifiedDate": when}
            | _CLEARED_DEPENDENCY,
        )
    out: dict[str, int] = {}
    for r in rows:
        out[r.InstalledPackId] = out.get(r.InstalledPackId, 0) + 1
        if on_woken is not None:
            blocked_at = r.DependencyBlockedAt
            parked = (when - blocked_at).total_seconds() if blocked_at is not None else 0.0
            on_woken(r.InstalledPackId, max(0.0, parked))
    return out


def wake_blocked(engine: Engine, key_hash: str, *, now: datetime | None = None) -> int:
    """:func:`wake_blocked_by_pack`, as a count."""
    return sum(wake_blocked_by_pack(engine, key_hash, now=now).values())


def _terminalize_blocked(
    engine: Engine,
    work_ids: Sequence[str],
    failure_class: str,
    summary: str,
    now: datetime | None,
    key_hash: str | None = None,
) -> int:
    if not work_ids:
        return 0
    when = _now(now)
    with write_transaction(engine) as conn:
        ids = [
            r.WorkId
            for r in _lock_by_id(conn, work_ids)
            if r.State == STATE_BLOCKED and (key_hash is None or r.DependencyKeyHash == key_hash)
        ]
        return _update_by_id(
            conn,
            ids,
            {
                "State": STATE_FAILED,
                "TerminalAt": when,
                "FailureCount": _w.c.FailureCount + 1,
                "LastFailureAt": when,
                "FailureClass": failure_class,
                "FailureSummary": summary,
                "LastModifiedDate": when,
            },
        )


def expire_blocked(
    engine: Engine,
    work_ids: Sequence[str],
    now: datetime | None = None,
    *,
    key_hash: str | None = None,
) -> int:
    """Fail blocked ``work_ids`` with class ``identity-convergence-expired``; returns how many.

    The caller decides they are due (their own ``DependencyBlockedAt`` plus
    the max wait) *after* a fresh probe said the dependency is unresolved;
    ``key_hash`` (when given) must still match. Dependency* columns are kept.
    """
    return _terminalize_blocked(
        engine,
        work_ids,
        FAILURE_CLASS_EXPIRED,
        "identity convergence wait expired: the dependency is still unresolved",
        now,
        key_hash,
    )


def terminalize_invalid(
    engine: Engine, work_ids: Sequence[str], now: datetime | None = None
) -> int:
    """Fail blocked ``work_ids`` with class ``identity-convergence-invalid`` (lost columns)."""
    return _terminalize_blocked(
        engine,
        work_ids,
        FAILURE_CLASS_INVALID,
        "blocked item has no valid dependency (Dependency* columns missing)",
        now,
    )


def list_invalid_blocked(engine: Engine, limit: int = RECOVERY_PAGE) -> list[str]:
    """Blocked items lacking DependencyKind, DependencyKeyHash or DependencyBlockedAt."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(_w.c.WorkId)
                .where(
                    _w.c.State == STATE_BLOCKED,
                    or_(
                        _w.c.DependencyKind.is_(None),
                        _w.c.DependencyKeyHash.is_(None),
                        _w.c.DependencyBlockedAt.is_(None),
                    ),
                )
                .order_by(_w.c.WorkId)
                .limit(limit)
            ).scalars()
        )


def convert_parked(engine: Engine, *, now: datetime | None = None) -> int:
    """The seed's parked shape (``processing``, DependencyKind set, no lease) -> ``blocked``.

    ``DependencyBlockedAt`` is kept (``now`` when unset); ``DependencyProbeAfter``
    is cleared so recovery starts a wait for it. Returns rows converted.
    Runs at every fleet reconcile: a plain read finds the parked rows (none,
    almost always: no write transaction then); they are locked and updated by
    primary key only, never by a scan that would lock the whole table under
    REPEATABLE READ.
    """
    when = _now(now)
    with engine.connect() as conn:
        parked = list(
            conn.execute(
                select(_w.c.WorkId).where(_w.c.State == STATE_PROCESSING, _parked(_w))
            ).scalars()
        )
    if not parked:
        return 0
    with write_transaction(engine) as conn:
        locked = {r.WorkId for r in _lock_by_id(conn, parked) if r.State == STATE_PROCESSING}
        n = 0
        ids = sorted(locked)
        for start in range(0, len(ids), _CHUNK):
            res = conn.execute(
                _w.update()
                .where(
                    _w.c.WorkId.in_(ids[start : start + _CHUNK]),
                    _w.c.State == STATE_PROCESSING,
                    _parked(_w),
                )
                .values(
                    State=STATE_BLOCKED,
                    DependencyBlockedAt=func.coalesce(_w.c.DependencyBlockedAt, when),
                    DependencyProbeAfter=None,
                    LastModifiedDate=when,
                )
            )
            n += int(res.rowcount)
        return n


def list_waitless_blocked(
    engine: Engine,
    *,
    after: tuple[datetime, str] | None = None,
    limit: int = RECOVERY_PAGE,
    now: datetime | None = None,
) -> list[BlockedRow]:
    """One page of blocked items without a live wait (``DependencyProbeAfter`` unset or past).

    Keyset-ordered by (``DependencyBlockedAt``, ``WorkId``) after ``after``.
    A row whose stored key hash is not the canonical hash of its columns (a
    row of the polled design) gets the canonical hash written here.
    """
    when = _now(now)
    stmt = _blocked_select().where(
        _w.c.DependencyBlockedAt.is_not(None),
        or_(_w.c.DependencyProbeAfter.is_(None), _w.c.DependencyProbeAfter < when),
    )
    if after is not None:
        stmt = stmt.where(
            or_(
                _w.c.DependencyBlockedAt > after[0],
                and_(_w.c.DependencyBlockedAt == after[0], _w.c.WorkId > after[1]),
            )
        )
    stmt = stmt.order_by(_w.c.DependencyBlockedAt, _w.c.WorkId).limit(limit)
    with engine.connect() as conn:
        rows = [_blocked_row(r) for r in conn.execute(stmt).all()]
    stale = [r for r in rows if r.dependency is not None and r.key_hash != r.dependency.key_hash]
    if stale:
        with write_transaction(engine) as conn:
            for r in stale:
                assert r.dependency is not None
                conn.execute(
                    _w.update()
                    .where(_w.c.WorkId == r.work_id, _w.c.State == STATE_BLOCKED)
                    .values(DependencyKeyHash=r.dependency.key_hash)
                )
                r.key_hash = r.dependency.key_hash
    return rows


def mark_wait_alive(engine: Engine, key_hash: str, until: datetime, work_ids: Sequence[str]) -> int:
    """Set ``DependencyProbeAfter = until`` on the wait's items (its liveness mark).

    ``work_ids``: the wait's items (its probe's read of them); only those
    still blocked on ``key_hash`` are marked. Locked and updated by primary
    key only, ascending (:func:`_lock_by_id`): no range lock on the key index
    that a batch blocking an item must insert into, which deadlocked on
    MariaDB under REPEATABLE READ (issue 11). Returns the rows marked.
    """
    if not work_ids:
        return 0
    with write_transaction(engine) as conn:
        ids = [
            r.WorkId
            for r in _lock_by_id(conn, work_ids)
            if r.State == STATE_BLOCKED and r.DependencyKeyHash == key_hash
        ]
        return _update_by_id(conn, ids, {"DependencyProbeAfter": until.replace(microsecond=0)})


def mark_waits_alive(engine: Engine, items: dict[str, str], until: datetime) -> int:
    """``DependencyProbeAfter = until`` on blocked rows whose wait the server says runs.

    ``items``: work id -> key hash of the running wait (recovery's answer from
    the server); only rows still blocked on that key are marked, so recovery
    skips them until ``until``. One transaction, locked and updated by primary
    key only (:func:`_lock_by_id`). Returns the rows marked.
    """
    if not items:
        return 0
    with write_transaction(engine) as conn:
        ids = [
            r.WorkId
            for r in _lock_by_id(conn, list(items))
            if r.State == STATE_BLOCKED and r.DependencyKeyHash == items[r.WorkId]
        ]
        return _update_by_id(conn, ids, {"DependencyProbeAfter": until.replace(microsecond=0)})
