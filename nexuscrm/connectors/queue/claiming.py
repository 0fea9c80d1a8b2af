"""Claim: lease a batch of one pack's claimable items, and load claimed items back.

The ordering rules are in the package docstring (:mod:`nexuscrm.connectors.queue`);
candidate selection is in :mod:`nexuscrm.connectors.queue.scan`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm.connectors.queue.fencing import check_claim_fence
from nexuscrm.connectors.queue.leases import _attempt_row, _insert_attempts
from nexuscrm.connectors.queue.locking import _skip_locked, claim_transaction
from nexuscrm.connectors.queue.scan import _Candidate, _pick
from nexuscrm.connectors.queue.shapes import ClaimedItem, ClaimSpec
from nexuscrm.connectors.queue.vocabulary import (
    CLAIMABLE_WORK_TYPES,
    FAILURE_ATTEMPTS_EXHAUSTED,
    OUTCOME_ABANDONED,
    OUTCOME_BLOCKED,
    OUTCOME_FAILED,
    STATE_FAILED,
    STATE_PROCESSING,
    ClaimSchemaMissing,
    _a,
    _case,
    _e,
    _in_processing,
    _lease_until,
    _normalize_classes,
    _now,
    _parked,
    _w,
    fence_value,
)
from nexuscrm.cutover import schema_missing
from nexuscrm.db.dialect import describe_error, dialect_name
from nexuscrm.log import log


def claim(engine: Engine, spec: ClaimSpec) -> list[ClaimedItem]:
    """Lease up to ``spec.batch_size`` claimable items of one pack to ``spec.lease_owner``.

    ``spec`` (a :class:`ClaimSpec`) names the pack, the queue classes, the
    batch size, the lease owner and length, the pack's processing budget, the
    preferred classes and ``now``; the names below are its fields.

    Claimable: ``pending`` with ``RunAfter`` NULL or ``<= now``, or
    ``processing`` whose lease went stale (``LeaseUntil`` NULL or ``< now``,
    not parked) — a dead worker's item, reclaimed; its abandoned attempt gets
    a ``_System_ConnectorWorkAttempt`` row with ``OutcomeState='abandoned'``.
    Work types ``ConnectorEvent`` and ``WorkflowActionApply``.

    Rules: only lane heads (no non-terminal item earlier in the same source
    lane, nor in the same target mutation lane: the mutations of one target
    record run one at a time, in enqueue order, whichever source they come
    from), and none whose target lane holds a live lease;
    ``queue_classes`` filters (empty = every class);
    ``preferred_queue_classes`` are taken first, then stale reclaims, then
    enqueue order (``WorkId`` order; due retries by ``RunAfter``); at most
    ``max_processing_rows - held`` new items where ``held`` counts the pack's
    processing rows, stale ones included and parked ones (dependency set, no
    lease) excluded, all classes (the seed's processing pressure); stale
    reclaims are not limited by it (their rows are already counted). The
    budget is read once per claim: claims running at the same moment can
    together pass it by up to their batches.

    Each item gets ``State='processing'``, a new uuid4 ``LeaseToken``,
    ``LeaseUntil = now + lease_seconds`` (whole seconds) and ``Attempt + 1``
    by compare-and-set; an item changed concurrently is skipped. A picked
    item that has used ``max_attempts`` attempts is failed
    ``attempts-exhausted`` instead (:func:`_fail_exhausted`), however its
    attempts ended. Returns the claimed items in claim order (possibly empty).

    No lock spans the pack (MySQL family): claims of one pack run side by
    side, kept apart by row locks and compare-and-set (see
    :func:`_claim_locked`).

    Fenced (:mod:`nexuscrm.connectors.queue.fencing`): read first, locked shared,
    ``spec.generation`` / ``spec.fencing_token`` must be the pack's current
    claim fence (or 0 / unfenced while the pack has none), else
    ``FenceSuperseded`` and nothing is claimed; each claimed item gets
    ``FencingToken`` and ``Generation`` of the claimer.

    Raises ``ValueError`` for a non-positive ``lease_seconds``,
    ``QueueLockTimeout`` when SQLite's write lock is busy for
    ``LOCK_WAIT_SECONDS`` (10 s), ``ClaimSchemaMissing`` (a ``FatalError``)
    when a queue table or column is missing.
    """
    return _claim(engine, spec, full=True)


def claim_leases(engine: Engine, spec: ClaimSpec) -> list[tuple[str, str]]:
    """:func:`claim`, returning only the ``(work_id, lease_token)`` pairs.

    Same rules, same writes; it skips reading the claimed items' rows and
    events back (for a caller that hands the leases to another process,
    which loads them with :func:`load_claimed`).
    """
    return _claim(engine, spec, full=False)


def _claim(engine: Engine, spec: ClaimSpec, *, full: bool) -> list[Any]:
    """:func:`claim` (``full``: the claimed items) or :func:`claim_leases` (the pairs).

    A missing table or column raises ``ClaimSchemaMissing`` (permanent).
    """
    try:
        return _claim_locked(engine, spec, full=full)
    except SQLAlchemyError as exc:
        if schema_missing(exc):
            raise ClaimSchemaMissing(
                f"work queue claim: schema missing ({describe_error(exc)}); run `nexusctl migrate`"
            ) from exc
        raise


CLAIM_ROUNDS = 3
"""Most candidate picks one claim makes when concurrent claims took its candidates.

Claims run side by side (no lock across a pack on the MySQL family): two
claims that read the queue at the same moment pick the same head items, and
``SKIP LOCKED`` leaves the later one without them. It picks again, past what
it lost (READ COMMITTED: the next read also sees what other claims committed
meanwhile), instead of returning a short or empty batch (an empty claim makes
the worker wait for a wake or its idle timeout)."""


def _claim_locked(engine: Engine, spec: ClaimSpec, *, full: bool) -> list[Any]:
    """The claim in one transaction (see :func:`claim`); no lock across the pack.

    MySQL family (READ COMMITTED): the fence row is read with a shared lock
    (take-overs wait for the claims in flight); the candidates are picked by a
    plain read of the latest commit, then locked by primary key with ``FOR
    UPDATE SKIP LOCKED`` (re-checking their state: a locking read sees the
    latest commit), so a candidate another claim holds or took is skipped and
    picked past in the next round (:data:`CLAIM_ROUNDS`, each a fresh read).
    The scan itself takes no locks: a locking scan would lock the rows its
    lane-head probes read as well (MariaDB applies ``FOR UPDATE`` to a
    statement's subqueries), and claims then deadlocked each other (seen with
    eight concurrent claimers). The UPDATE is a compare-and-set either way
    (TiDB: the compare-and-set alone settles a race). SQLite: the whole claim
    holds the database write lock.
    """
    when = _now(spec.now)
    until = _lease_until(when, spec.lease_seconds)
    if spec.batch_size <= 0 or spec.max_processing_rows <= 0:
        return []
    classes = _normalize_classes(spec.queue_classes)
    preferred = _normalize_classes(spec.preferred_queue_classes)
    with claim_transaction(engine) as conn:
        check_claim_fence(conn, spec.installed_pack_id, spec.generation, spec.fencing_token)
        # One read of the pack's processing rows gives both the live target lanes
        # and the seed's pressure: every processing row that is not parked counts,
        # stale ones too (re-leasing a stale row adds nothing, so only new items
        # are held to the room left). Parked rows have no lease, so never live.
        # A plain read: claims that commit after it are not counted, so claims
        # running at the same moment can together pass the budget by up to their
        # own batches (it bounds pressure; lanes stay exclusive).
        keyed = bool(spec.claim_key) and not full
        processing = conn.execute(
            select(
                _w.c.TargetMutationLaneKey,
                _w.c.LeaseUntil,
                _case(_parked(_w)),
                *((_w.c.WorkId, _w.c.LeaseOwner, _w.c.LeaseToken) if keyed else ()),
            ).where(
                _w.c.InstalledPackId == spec.installed_pack_id,
                _in_processing(_w, dialect_name(conn) == "sqlite"),
                _w.c.WorkType.in_(CLAIMABLE_WORK_TYPES),
            )
        ).all()
        if keyed:
            again = _claimed_before(processing, spec, when)
            if again:
                return again
        busy: set[str | None] = {r[0] for r in processing if r[1] is not None and r[1] >= when}
        held = sum(1 for r in processing if not r[2])
        room = max(0, spec.max_processing_rows - int(held))
        skip_locked = _skip_locked(conn)
        picked: list[_Candidate] = []
        passed: set[str] = set()
        for _round in range(CLAIM_ROUNDS):
            got = _pick(
                conn,
                spec.installed_pack_id,
                classes,
                preferred,
                when,
                spec.batch_size - len(picked),
                busy,
                new_budget=room,
                exclude=passed,
            )
            if not got:
                break
            passed.update(c.work_id for c in got)
            lost = False
            if skip_locked:
                locked = _lock_candidates(conn, got)
                lost = len(locked) < len(got)
                got = [c for c in got if c.work_id in locked]
            picked += got
            room -= sum(1 for c in got if c.tag != "stale")
            busy.update(c.target_lane for c in got if c.target_lane is not None)
            if not lost or len(picked) >= spec.batch_size:
                break
        if not picked:
            return []
        at_cap = [c for c in picked if c.attempt >= spec.max_attempts]
        if at_cap:  # attempts that ended blocked do not count (MAX_ATTEMPTS)
            blocked = _blocked_attempts(conn, [c.work_id for c in at_cap])
            exhausted = [
                c for c in at_cap if c.attempt - blocked.get(c.work_id, 0) >= spec.max_attempts
            ]
            if exhausted:
                _fail_exhausted(conn, exhausted, spec.max_attempts, when)
                gone = {c.work_id for c in exhausted}
                picked = [c for c in picked if c.work_id not in gone]
                if not picked:
                    return []
        tokens = {c.work_id: _lease_token(spec, c.work_id, keyed) for c in picked}
        # One compare-and-set UPDATE for the batch: each row must still be in
        # the (State, LeaseToken, Attempt) it was chosen in. Which rows won is
        # read back by their fresh, unique tokens in _load_claimed.
        _claim_update(conn, picked, tokens, spec.lease_owner, until, when, spec)
        result: list[Any]
        if full:
            result = _load_claimed(conn, picked, tokens)
            won = {i.work_id for i in result}
        else:
            current = {
                r[0]: r[1]
                for r in conn.execute(
                    select(_w.c.WorkId, _w.c.LeaseToken).where(
                        _w.c.WorkId.in_(list(tokens)), _w.c.State == STATE_PROCESSING
                    )
                )
            }
            result = [
                (c.work_id, tokens[c.work_id])
                for c in picked
                if current.get(c.work_id) == tokens[c.work_id]
            ]
            won = {w for w, _t in result}
        abandoned = [
            _attempt_row(
                c.work_id,
                c.attempt,
                c.event_id,
                OUTCOME_ABANDONED,
                when,
                failure_class="lease-expired",
                retriable=True,
            )
            for c in picked
            if c.work_id in won and c.state == STATE_PROCESSING and c.attempt > 0
        ]
        if abandoned:
            _insert_attempts(conn, abandoned, ignore_existing=True)
        return result


_CLAIM_KEY_NAMESPACE = uuid.UUID("6f1d3c2e-8a4b-5c7d-9e0f-1a2b3c4d5e6f")


def _lease_token(spec: ClaimSpec, work_id: str, keyed: bool) -> str:
    """A fresh uuid4 token, or (``keyed``) one derived from the claim key and the item."""
    if keyed:
        return uuid.uuid5(_CLAIM_KEY_NAMESPACE, f"{spec.claim_key}/{work_id}").hex
    return uuid.uuid4().hex


def _claimed_before(rows: Sequence[Any], spec: ClaimSpec, when: datetime) -> list[tuple[str, str]]:
    """The ``(work_id, token)`` pairs an earlier run of this keyed claim leased, still live.

    ``rows`` are the pack's processing rows with ``WorkId``, ``LeaseOwner`` and
    ``LeaseToken`` (see :data:`ClaimSpec.claim_key`); in ``WorkId`` order.
    """
    return sorted(
        (r.WorkId, r.LeaseToken)
        for r in rows
        if r.LeaseOwner == spec.lease_owner
        and r.LeaseUntil is not None
        and r.LeaseUntil >= when
        and r.LeaseToken == _lease_token(spec, r.WorkId, True)
    )


def _lock_candidates(conn: Connection, picked: list[_Candidate]) -> set[str]:
    """Row-lock the picked items still in the state they were picked in; their ids.

    ``SELECT ... FOR UPDATE SKIP LOCKED`` (a locking read, so it sees the
    latest commit): an item another claim holds locked right now is left
    out, and so is one taken since this claim's snapshot (its state or lease
    token changed). The read goes by the primary key only (``FORCE INDEX``:
    a scan of a secondary index would lock, or skip, rows that were not
    picked). The locks hold until the claim commits.
    """
    rows = conn.execute(
        select(_w.c.WorkId, _w.c.State, _w.c.LeaseToken)
        .with_hint(_w, "FORCE INDEX (PRIMARY)", "mysql")
        .where(_w.c.WorkId.in_([c.work_id for c in picked]))
        .with_for_update(skip_locked=True)
    ).all()
    now = {r.WorkId: (r.State, r.LeaseToken) for r in rows}
    return {c.work_id for c in picked if now.get(c.work_id) == (c.state, c.lease_token)}


def _fail_exhausted(
    conn: Connection, exhausted: list[_Candidate], max_attempts: int, when: datetime
) -> None:
    """Fail the picked items that have used every attempt, instead of leasing them.

    The cap covers every way an attempt ends: a retriable flow error on the
    last attempt is failed by the processor, but an attempt that ended any
    other way (the worker died, the activity failed, the lease was handed
    back) leaves the item claimable with its ``Attempt`` count spent. Without
    this it would be reclaimed forever, holding its record's later events
    behind it. Compare-and-set per item on the (State, LeaseToken, Attempt)
    it was picked in; sets ``State='failed'``, ``TerminalAt``,
    ``FailureClass='attempts-exhausted'`` (with a summary naming the cap and
    how the last attempt ended), clears the lease, and writes the attempt row
    of the last attempt (``OutcomeState='failed'``; one already written for it,
    e.g. an ``abandoned`` row from a release, is kept). Replayable like any
    failed item. No seed function: the Go runtime caps only flow failures.
    """
    failed: list[_Candidate] = []
    for c in exhausted:
        how = (
            "its last attempt's lease expired without a result (worker died or its batch "
            "was abandoned)"
            if c.state == STATE_PROCESSING
            else "its last attempt ended without a result"
        )
        res = conn.execute(
            _w.update()
            .where(
                _w.c.WorkId == c.work_id,
                _w.c.State == c.state,
                _w.c.LeaseToken.is_(None)
                if c.lease_token is None
                else _w.c.LeaseToken == c.lease_token,
                _w.c.Attempt == c.attempt,
            )
            .values(
                State=STATE_FAILED,
                TerminalAt=when,
                LeaseOwner=None,
                LeaseToken=None,
                LeaseUntil=None,
                FailureCount=_w.c.FailureCount + 1,
                LastFailureAt=when,
                FailureClass=FAILURE_ATTEMPTS_EXHAUSTED,
                FailureSummary=(f"work item {c.work_id} used all {max_attempts} attempts; {how}"),
                LastModifiedDate=when,
            )
        )
        if res.rowcount == 1:
            failed.append(c)
    if failed:
        _insert_attempts(
            conn,
            [
                _attempt_row(
                    c.work_id,
                    c.attempt,
                    c.event_id,
                    OUTCOME_FAILED,
                    when,
                    failure_class=FAILURE_ATTEMPTS_EXHAUSTED,
                )
                for c in failed
            ],
            ignore_existing=True,
        )
        log.warning(
            "work items failed: attempts exhausted",
            items=[c.work_id for c in failed],
            max_attempts=max_attempts,
        )


def _claim_update(
    conn: Connection,
    picked: list[_Candidate],
    tokens: dict[str, str],
    lease_owner: str,
    until: datetime,
    when: datetime,
    spec: ClaimSpec,
) -> None:
    """The claim's compare-and-set UPDATE, as driver-level SQL.

    ``SET State='processing', LeaseOwner, LeaseToken = CASE WorkId ... END,
    LeaseUntil, Attempt = Attempt + 1, LastModifiedDate, FencingToken,
    Generation WHERE WorkId IN (<picked>) AND (...)``, one
    ``(State, LeaseToken, Attempt, WorkId IN (...))`` group per distinct
    chosen-in state (new pending items share one). Built as a string with
    driver placeholders: the equivalent SQLAlchemy expression (a CASE and an
    OR of one AND per row) cost ~0.25 ms per row to build and compile.
    """
    prep = conn.dialect.identifier_preparer
    q = prep.quote
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    groups: dict[tuple[str, str | None, int], list[str]] = {}
    for c in picked:
        groups.setdefault((c.state, c.lease_token, c.attempt), []).append(c.work_id)
    params: list[Any] = [STATE_PROCESSING, lease_owner]
    case_sql = []
    for c in picked:
        case_sql.append(f"WHEN {mark} THEN {mark}")
        params += [c.work_id, tokens[c.work_id]]
    # SQLite stores DATETIME as text in SQLAlchemy's own format: bind through it.
    bind = _w.c.LeaseUntil.type.dialect_impl(conn.dialect).bind_processor(conn.dialect)
    params += [bind(until), bind(when)] if bind else [until, when]
    params += [fence_value(spec.fencing_token), spec.generation]
    # The primary-key IN list first, so the UPDATE reads (and locks) only the
    # picked rows whatever plan the server prefers for the OR of groups.
    params += [c.work_id for c in picked]
    where_sql = []
    for (state, token, attempt), ids in groups.items():
        token_sql = f"{q('LeaseToken')} IS NULL" if token is None else f"{q('LeaseToken')} = {mark}"
        where_sql.append(
            f"({q('State')} = {mark} AND {token_sql} AND {q('Attempt')} = {mark} "
            f"AND {q('WorkId')} IN ({', '.join([mark] * len(ids))}))"
        )
        params.append(state)
        if token is not None:
            params.append(token)
        params.append(attempt)
        params += ids
    sql = (
        f"UPDATE {prep.format_table(_w)} SET {q('State')} = {mark}, "
        f"{q('LeaseOwner')} = {mark}, "
        f"{q('LeaseToken')} = CASE {q('WorkId')} {' '.join(case_sql)} END, "
        f"{q('LeaseUntil')} = {mark}, {q('Attempt')} = {q('Attempt')} + 1, "
        f"{q('LastModifiedDate')} = {mark}, {q('FencingToken')} = {mark}, "
        f"{q('Generation')} = {mark} WHERE {q('WorkId')} IN ({', '.join([mark] * len(picked))}) "
        f"AND ({' OR '.join(where_sql)})"
    )
    conn.exec_driver_sql(sql, tuple(params))


def _leased_rows(conn: Connection, tokens: dict[str, str]) -> dict[str, Any]:
    """Rows (work item + event) of ``tokens``' work ids that still hold that token."""
    if not tokens:
        return {}
    rows = conn.execute(
        select(
            _w.c.WorkId,
            _w.c.State,
            _w.c.LeaseOwner,
            _w.c.LeaseToken,
            _w.c.LeaseUntil,
            _w.c.EventId,
            _w.c.InstalledPackId,
            _w.c.QueueClass,
            _w.c.Attempt,
            _w.c.SourceLaneKey,
            _w.c.TargetMutationLaneKey,
            _w.c.ReplayOfWorkId,
            _w.c.LaneOrdinal,
            _e.c.Namespace,
            _e.c.EventKind,
            _e.c.RouteVersion,
            _e.c.SourceObject,
            _e.c.SourceId,
            _e.c.Payload,
            _e.c.CompanionPackInstallId,
            _w.c.FencingToken,
            _w.c.Generation,
        )
        .select_from(_w.outerjoin(_e, _e.c.EventId == _w.c.EventId))
        .where(_w.c.WorkId.in_(list(tokens)))
    ).all()
    return {
        r.WorkId: r
        for r in rows
        if r.State == STATE_PROCESSING and r.LeaseToken == tokens[r.WorkId]
    }


def _blocked_attempts(conn: Connection, work_ids: Sequence[str]) -> dict[str, int]:
    """Attempts of each work item that ended ``blocked`` (attempt rows), by work id."""
    if not work_ids:
        return {}
    rows = conn.execute(
        select(_a.c.WorkId, func.count())
        .where(_a.c.WorkId.in_(list(work_ids)), _a.c.OutcomeState == OUTCOME_BLOCKED)
        .group_by(_a.c.WorkId)
    ).all()
    return {r[0]: int(r[1]) for r in rows}


def _with_blocked_attempts(conn: Connection, items: list[ClaimedItem]) -> list[ClaimedItem]:
    """Set ``blocked_attempts`` of items past their first attempt (one grouped read)."""
    later = [i.work_id for i in items if i.attempt > 1]
    if later:
        blocked = _blocked_attempts(conn, later)
        for item in items:
            item.blocked_attempts = blocked.get(item.work_id, 0)
    return items


def _item(r: Any) -> ClaimedItem:
    return ClaimedItem(
        work_id=r.WorkId,
        event_id=r.EventId,
        installed_pack_id=r.InstalledPackId,
        namespace=r.Namespace or "",
        event_kind=r.EventKind or "",
        route_version=int(r.RouteVersion or 1),
        queue_class=r.QueueClass,
        source_object=r.SourceObject or "",
        source_id=r.SourceId or "",
        payload=json.loads(r.Payload) if r.Payload else {},
        attempt=int(r.Attempt),
        lease_owner=r.LeaseOwner or "",
        lease_token=r.LeaseToken,
        lease_until=r.LeaseUntil,
        source_lane_key=r.SourceLaneKey or "",
        target_mutation_lane_key=r.TargetMutationLaneKey or "",
        replay_of_work_id=r.ReplayOfWorkId,
        companion_pack_install_id=r.CompanionPackInstallId,
        lane_ordinal=int(r.LaneOrdinal or 0),
        fencing_token=r.FencingToken,
        generation=int(r.Generation or 0),
    )


def _load_claimed(
    conn: Connection, picked: list[_Candidate], tokens: dict[str, str]
) -> list[ClaimedItem]:
    """The picked items this claim won (their token is ours), with their events, in pick order."""
    rows = _leased_rows(conn, tokens)
    return _with_blocked_attempts(
        conn, [_item(rows[c.work_id]) for c in picked if c.work_id in rows]
    )


def load_owned(engine: Engine, installed_pack_id: str, lease_owner: str) -> list[ClaimedItem]:
    """The items of one pack still leased to ``lease_owner``, in ``WorkId`` order.

    For handing back what a worker's failed or timed-out batch left behind
    when that batch claimed further items itself (``connectors.process`` runs
    several claims under the worker's owner id): the pack's ``processing``
    rows (read by the claim index, ``InstalledPackId, State``) whose
    ``LeaseOwner`` is the worker's, loaded as :func:`load_claimed` loads them.
    A blank ``lease_owner`` matches nothing. Read-only.
    """
    if not lease_owner:
        return []
    with engine.connect() as conn:
        pairs = conn.execute(
            select(_w.c.WorkId, _w.c.LeaseToken)
            .where(
                _w.c.InstalledPackId == installed_pack_id,
                _w.c.State == STATE_PROCESSING,
                _w.c.LeaseOwner == lease_owner,
                _w.c.LeaseToken.is_not(None),
            )
            .order_by(_w.c.WorkId)
        ).all()
    return load_claimed(engine, [(w, tok) for w, tok in pairs])


def load_claimed(
    engine: Engine, leases: Sequence[tuple[str, str]], fencing_token: str | None = None
) -> list[ClaimedItem]:
    """Re-load claimed items from ``(work_id, lease_token)`` pairs, in input order.

    For a worker that got only the lease pairs from :func:`claim` (e.g. across
    an activity boundary). An item whose lease is lost (token changed, or not
    ``processing`` any more) or that does not exist is left out; so is one
    not held under ``fencing_token`` when it is given (the worker's fence).
    Read-only.
    """
    tokens = dict(leases)
    with engine.connect() as conn:
        rows = _leased_rows(conn, tokens)
        if fencing_token is not None:
            fence = fence_value(fencing_token)
            rows = {w: r for w, r in rows.items() if r.FencingToken == fence}
        items = [_item(rows[w]) for w in dict.fromkeys(w for w, _t in leases) if w in rows]
        return _with_blocked_attempts(conn, items)
