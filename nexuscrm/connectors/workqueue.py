"""The durable connector work queue: enqueue, claim, lease, finish, replay, stats.

Port of the seed's ``connector/workqueue`` WorkItem path on the
``_System_ConnectorEvent`` / ``_System_ConnectorWorkItem`` /
``_System_ConnectorWorkAttempt`` tables (SQLAlchemy 2 Core, synchronous).

Life of an item::

    enqueue ──> pending ──claim──> processing ──finish_succeeded──> succeeded
                   ^                   │  │
                   └───finish_retry────┘  └──finish_failed──> failed ──replay──> (new pending item)

``blocked`` (parked on an identity dependency) is set by a later module; it is
non-terminal (it holds its source lane) and never claimable. The seed's other
parked shape — ``State='processing'`` with ``DependencyKind`` set and no lease —
is treated the same way: it is neither live nor stale.

Ordering rules enforced by :func:`claim`:

* **source lanes** (``SourceLaneKey`` = ``namespace/source_object/source_id``):
  only the head of a lane — the non-terminal item with the smallest
  ``LaneOrdinal`` — is claimable, so the events of one remote record run one
  at a time, in enqueue order;
* **target mutation lanes** (``TargetMutationLaneKey``, default: the source
  lane): at most one item per key holds a live lease at a time;
* **processing budget**: a pack's processing rows (leased, live or stale;
  parked rows excluded) never exceed ``max_processing_rows`` through new
  claims; reclaiming a stale row re-leases a row already counted.

Ordinals and ids. One sequence, allocated under the enqueue lock (below),
numbers every enqueued event and every work item: an event gets
``EventId = 'ev-<n:016d>'`` and ``EnqueueOrdinal = n``, its first work item
``WorkId = 'wi-<n:016d>'`` and ``LaneOrdinal = n``; a replay takes a fresh
``n``. The next ``n`` is read from the primary-key indexes (``MAX(EventId)`` /
``MAX(WorkId)`` within the id prefix: two index probes, O(log rows)), so no
counter table is needed and ordinals are globally unique and increasing —
which makes them increasing within every lane, and puts a replay at the end of
its lane. Sortable work ids also give :func:`claim` a first-in-first-out scan
straight off the claim index.

Locking. MySQL family: enqueue and replay serialize on the named lock
``GET_LOCK('nexuscrm_connector_enqueue')``; claims of one pack serialize on a
per-pack named lock (the processing budget and target-lane exclusivity are
read-then-write decisions and need it). Each lock is taken *before* the
transaction starts, so the transaction's REPEATABLE READ snapshot includes
everything the previous holder committed. Inside a claim, the chosen rows are
locked with ``SELECT ... FOR UPDATE SKIP LOCKED`` (MariaDB 10.6+, MySQL 8) so a
claim never waits behind a worker finishing a row; every state change is a
compare-and-set on (WorkId, State, LeaseToken): finishes and lease extensions
check the rowcount, a claim batch is one UPDATE whose winners are read back by
their fresh, unique tokens. SQLite: ``BEGIN IMMEDIATE`` takes the database
write lock up front, which serializes the same sections.

Scope: source lanes are global (the lane key starts with the pack's
namespace); the live-lease check of target lanes and the budget look at the
claiming pack's rows (the claim index), since ``TargetMutationLaneKey`` has no
index of its own.

Times are naive UTC ``datetime`` with whole seconds (what DATETIME stores);
a ``now`` argument, when given, is truncated to whole seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    and_,
    bindparam,
    case,
    exists,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    union_all,
)
from sqlalchemy.sql.elements import ColumnElement

from nexuscrm.clock import utcnow
from nexuscrm.connectors.identity import (
    FAILURE_CLASS_EXPIRED,
    FAILURE_CLASS_INVALID,
    Dependency,
)
from nexuscrm.cutover import EXECUTION_OWNER_WORK_ITEM
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import dialect_name
from nexuscrm.errors import FatalError, NexusError

# --- vocabulary ---------------------------------------------------------------

STATE_PENDING = "pending"
STATE_PROCESSING = "processing"
STATE_BLOCKED = "blocked"
STATE_SUCCEEDED = "succeeded"
STATE_FAILED = "failed"
NON_TERMINAL_STATES: tuple[str, ...] = (STATE_PENDING, STATE_PROCESSING, STATE_BLOCKED)
TERMINAL_STATES: tuple[str, ...] = (STATE_SUCCEEDED, STATE_FAILED)

WORK_TYPE_CONNECTOR_EVENT = "ConnectorEvent"
WORK_TYPE_WORKFLOW_ACTION_APPLY = "WorkflowActionApply"
CLAIMABLE_WORK_TYPES: tuple[str, ...] = (WORK_TYPE_CONNECTOR_EVENT, WORK_TYPE_WORKFLOW_ACTION_APPLY)


OUTCOME_SUCCEEDED = "succeeded"
OUTCOME_RETRY = "retry"
OUTCOME_FAILED = "failed"
OUTCOME_ABANDONED = "abandoned"
OUTCOME_BLOCKED = "blocked"

EVENT_ID_PREFIX = "ev-"
WORK_ID_PREFIX = "wi-"
_SEQ_WIDTH = 16

RETRY_BACKOFF_BASE = timedelta(seconds=1)
RETRY_BACKOFF_CAP = timedelta(minutes=5)

ENQUEUE_LOCK_NAME = "nexuscrm_connector_enqueue"
LOCK_WAIT_SECONDS = 30

_KEY_LEN = t.KEY  # VARCHAR(191) lane / idempotency key columns
_SUMMARY_LIMIT = 4000
_CODE_LIMIT = 64

_w = t.connector_work_item
_e = t.connector_event
_a = t.connector_work_attempt
# Built once: aliasing a 38-column table is costly in Python. Each UNION
# member is its own scope, so they can share the alias objects.
_W = _w.alias("w")
_P = _w.alias("p")


# --- errors -------------------------------------------------------------------


class LeaseLost(NexusError):
    """A finish or lease extension found that ``work_id``'s lease token changed.

    Another worker reclaimed the item after this worker's lease went stale (or
    the item was finished already); the caller must discard its result and
    roll back its own writes of the same transaction.
    """

    def __init__(self, work_id: str) -> None:
        super().__init__(f"work item {work_id}: lease lost (token no longer matches)")
        self.work_id = work_id


class InvalidWorkRequest(FatalError, ValueError):
    """An enqueue request is malformed (empty key, unserializable payload ...)."""


class QueueLockTimeout(NexusError, TimeoutError):
    """A queue lock (enqueue or per-pack claim) was not granted in time.

    Subclasses ``TimeoutError``, so ``nexuscrm.db.dialect.is_transient`` treats
    it as retryable.
    """


# --- data shapes --------------------------------------------------------------


@dataclass
class EnqueueRequest:
    """One inbound connector event to enqueue.

    ``idempotency_key`` is unique per ``installed_pack_id``: enqueuing the same
    key again is a no-op. ``payload`` must be JSON-serializable. The source lane
    is ``namespace/source_object/source_id``; the target mutation lane is
    ``namespace/target_object/target_remote_id`` when both are given, else the
    source lane. ``queue_class`` is stored trimmed and lower-cased.
    """

    installed_pack_id: str
    namespace: str
    event_kind: str
    idempotency_key: str
    source_object: str
    source_id: str
    payload: dict[str, Any]
    route_version: int = 1
    queue_class: str = "default"
    target_object: str | None = None
    target_remote_id: str | None = None
    companion_pack_install_id: str | None = None
    """Frozen companion AppPack incarnation of a cross-pack event. ``None``:
    frozen by :func:`enqueue` from the route's ``companion_pack`` (the active
    AppPack of that name now, ``''`` when none is active: the event then
    fails its companion check); a string: recorded as given."""


@dataclass
class EnqueueResult:
    """What :func:`enqueue` did.

    ``work_ids`` is parallel to the requests: the new item's id, or for a
    duplicate the id of the event's current work item (the newest replay, if
    the event was replayed; ``''`` for an event some other writer stored
    without a work item).
    """

    inserted: int
    duplicates: int
    work_ids: list[str]


@dataclass
class ClaimedItem:
    """A work item leased to one worker, with its event.

    ``attempt`` is this attempt's number (1 for the first claim);
    ``lease_token`` fences every finish; ``lease_until`` is naive UTC.
    """

    work_id: str
    event_id: str
    installed_pack_id: str
    namespace: str
    event_kind: str
    route_version: int
    queue_class: str
    source_object: str
    source_id: str
    payload: dict[str, Any]
    attempt: int
    lease_owner: str
    lease_token: str
    lease_until: datetime
    source_lane_key: str
    target_mutation_lane_key: str
    replay_of_work_id: str | None
    companion_pack_install_id: str | None = None
    """The event's frozen companion AppPack incarnation (``None``: not cross-pack
    at enqueue; ``''``: cross-pack, but no companion was active then)."""


@dataclass
class PackQueueStats:
    """Queue numbers of one installed pack.

    ``counts`` maps ``(state, queue_class)`` to a number of work items;
    ``oldest_pending_age_s`` is the age in seconds of the oldest pending item
    (by ``CreatedDate``), ``None`` when nothing is pending;
    ``failures_by_class`` counts terminal ``failed`` items by ``FailureClass``
    (``'unknown'`` when unset).
    """

    installed_pack_id: str
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_pending_age_s: float | None = None
    failures_by_class: dict[str, int] = field(default_factory=dict)

    def by_state(self) -> dict[str, int]:
        """Counts summed over queue classes, keyed by state."""
        out: dict[str, int] = {}
        for (state, _qc), n in self.counts.items():
            out[state] = out.get(state, 0) + n
        return out


# --- small helpers ------------------------------------------------------------


def _now(now: datetime | None) -> datetime:
    """``now`` (or the clock) as naive UTC with whole seconds."""
    value = utcnow() if now is None else now
    if value.tzinfo is not None:
        raise ValueError("now must be a naive UTC datetime")
    return value.replace(microsecond=0)


def _lease_until(now: datetime, lease_seconds: float) -> datetime:
    if lease_seconds <= 0:
        raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
    return (now + timedelta(seconds=lease_seconds)).replace(microsecond=0)


def normalize_queue_class(raw: str) -> str:
    """Trimmed, lower-cased queue class (``''`` for a blank one)."""
    return raw.strip().lower()


def _normalize_classes(raw: Sequence[str]) -> list[str]:
    """Normalized, de-duplicated, blanks dropped, order kept."""
    out: list[str] = []
    for value in raw:
        qc = normalize_queue_class(value)
        if qc and qc not in out:
            out.append(qc)
    return out


def lane_key(namespace: str, object_name: str, record_id: str) -> str:
    """``namespace/object/id``; longer than 191 characters -> 150-char prefix + ``#sha1``.

    Deterministic, so every enqueue of one remote record lands in one lane.
    """
    raw = f"{namespace}/{object_name}/{record_id}"
    if len(raw) <= _KEY_LEN:
        return raw
    digest = hashlib.sha1(raw.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"{raw[:150]}#{digest}"


def _seq_id(prefix: str, n: int) -> str:
    return f"{prefix}{n:0{_SEQ_WIDTH}d}"


def _parse_seq(prefix: str, value: str | None) -> int:
    if not value or not value.startswith(prefix):
        return 0
    digits = value[len(prefix) : len(prefix) + _SEQ_WIDTH]
    return int(digits) if digits.isdigit() else 0


def _max_in_prefix(conn: Connection, column: Any, prefix: str) -> int:
    """Largest sequence number among ids ``prefix<digits>`` (a primary-key range probe)."""
    upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    value = conn.execute(
        select(func.max(column)).where(column >= prefix, column < upper)
    ).scalar_one_or_none()
    return _parse_seq(prefix, value)


def _next_seq(conn: Connection) -> int:
    """Next free number of the event/work-item sequence (caller holds the enqueue lock)."""
    return (
        max(
            _max_in_prefix(conn, _e.c.EventId, EVENT_ID_PREFIX),
            _max_in_prefix(conn, _w.c.WorkId, WORK_ID_PREFIX),
        )
        + 1
    )


def _truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


_SKIP_LOCKED_CACHE: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def _skip_locked(conn: Connection) -> bool:
    """True when the server supports ``FOR UPDATE SKIP LOCKED`` (MariaDB 10.6+, MySQL 8).

    TiDB (which reports a MySQL 8 version) is detected by ``VERSION()`` and excluded.
    """
    if dialect_name(conn) != "mysql":
        return False
    engine = conn.engine
    cached = _SKIP_LOCKED_CACHE.get(engine)
    if cached is not None:
        return cached
    version = str(conn.execute(text("SELECT VERSION()")).scalar_one()).lower()
    info = tuple(conn.dialect.server_version_info or ())
    if "tidb" in version:
        ok = False
    elif getattr(conn.dialect, "is_mariadb", False):
        ok = info >= (10, 6)
    else:
        ok = info >= (8, 0, 1)
    _SKIP_LOCKED_CACHE[engine] = ok
    return ok


_SQLITE_WRITERS: dict[str, threading.Lock] = {}
_SQLITE_WRITERS_GUARD = threading.Lock()


@contextmanager
def _sqlite_writer(engine: Engine) -> Iterator[None]:
    """SQLite: hold this process's writer lock of the database file; else nothing.

    SQLite admits one writer; a writer that finds the database locked sleeps
    in the busy handler's steps (up to 100 ms each) instead of waking when
    the lock frees, so concurrent claims and batch commits of one process
    queued behind each other for tens of milliseconds. Writers of one
    process (claims, enqueues, replays and batch finishes) now queue on an
    in-process lock first and start the moment the previous one commits;
    other processes still meet ``BEGIN IMMEDIATE`` and the busy timeout.
    """
    url = engine.url
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        yield
        return
    key = os.path.realpath(str(url.database))
    with _SQLITE_WRITERS_GUARD:
        lock = _SQLITE_WRITERS.setdefault(key, threading.Lock())
    with lock:
        yield


@contextmanager
def _serialized(engine: Engine, lock_name: str) -> Iterator[Connection]:
    """A write transaction serialized on ``lock_name``; commits on success.

    SQLite: ``BEGIN IMMEDIATE`` (the database write lock; ``lock_name`` is
    moot). MySQL family: ``GET_LOCK(lock_name)`` in its own short transaction,
    then a fresh transaction (so its snapshot follows the previous holder's
    commit), ``RELEASE_LOCK`` after commit or rollback. Raises
    ``QueueLockTimeout`` when the lock is not granted in ``LOCK_WAIT_SECONDS``.
    """
    with _sqlite_writer(engine), engine.connect() as conn:
        mysql = dialect_name(conn) == "mysql"
        if mysql:
            got = conn.execute(
                text("SELECT GET_LOCK(:n, :w)"), {"n": lock_name, "w": LOCK_WAIT_SECONDS}
            ).scalar()
            conn.commit()
            if got != 1:
                raise QueueLockTimeout(
                    f"queue lock {lock_name!r} not granted within {LOCK_WAIT_SECONDS} s"
                )
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            if mysql:
                try:
                    conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": lock_name})
                    conn.commit()
                except Exception:  # a dead session has released the lock already
                    conn.invalidate()


def _claim_lock_name(installed_pack_id: str) -> str:
    # MySQL lock names are limited to 64 characters.
    digest = hashlib.sha1(installed_pack_id.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"nexuscrm_claim_{digest[:40]}"


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


# --- enqueue ------------------------------------------------------------------


def _validate(req: EnqueueRequest) -> tuple[str, str]:
    """Check one request; return (payload JSON, normalized queue class)."""
    if not req.installed_pack_id:
        raise InvalidWorkRequest("enqueue: installed_pack_id is empty")
    if not req.idempotency_key:
        raise InvalidWorkRequest(f"enqueue ({req.installed_pack_id}): idempotency_key is empty")
    if len(req.idempotency_key) > _KEY_LEN:
        raise InvalidWorkRequest(
            f"enqueue ({req.installed_pack_id}): idempotency_key longer than {_KEY_LEN} "
            f"characters: {req.idempotency_key[:40]}..."
        )
    if not req.event_kind:
        raise InvalidWorkRequest(f"enqueue {req.idempotency_key}: event_kind is empty")
    if len(req.source_id) > _KEY_LEN:
        raise InvalidWorkRequest(
            f"enqueue {req.idempotency_key}: source_id longer than {_KEY_LEN} characters"
        )
    queue_class = normalize_queue_class(req.queue_class)
    if not queue_class:
        raise InvalidWorkRequest(f"enqueue {req.idempotency_key}: queue_class is empty")
    try:
        payload = json.dumps(req.payload, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidWorkRequest(
            f"enqueue {req.idempotency_key}: payload is not JSON-serializable: {exc}"
        ) from exc
    return payload, queue_class


def _current_work_ids(conn: Connection, event_ids: Sequence[str]) -> dict[str, str]:
    """Current work item of each event: its newest item (by ``LaneOrdinal``).

    Sequence-numbered events are answered from the primary key; only events
    that were replayed or carry foreign ids are looked up by ``EventId``.
    """
    out: dict[str, str] = {}
    derived: dict[str, str] = {}
    for ev in event_ids:
        n = _parse_seq(EVENT_ID_PREFIX, ev)
        if n:
            derived[_seq_id(WORK_ID_PREFIX, n)] = ev
    slow: set[str] = set(event_ids)
    if derived:
        rows = conn.execute(
            select(_w.c.WorkId, _w.c.EventId, _w.c.ReplayedAt).where(_w.c.WorkId.in_(list(derived)))
        ).all()
        for work_id, ev, replayed_at in rows:
            if ev == derived.get(work_id) and replayed_at is None:
                out[ev] = work_id
                slow.discard(ev)
    if slow:
        rows2 = conn.execute(
            select(_w.c.EventId, _w.c.WorkId, _w.c.LaneOrdinal)
            .where(_w.c.EventId.in_(sorted(slow)))
            .order_by(_w.c.LaneOrdinal, _w.c.WorkId)
        ).all()
        for ev, work_id, _ordinal in rows2:
            out[ev] = work_id  # ascending: the newest wins
    return out


def enqueue(
    engine: Engine,
    requests: Sequence[EnqueueRequest],
    *,
    batch_size: int = 500,
    now: datetime | None = None,
) -> EnqueueResult:
    """Enqueue connector events: one event row and one pending work item each.

    Requests are written in batches of ``batch_size``, one transaction per
    batch (a few statements per batch: the lock, two sequence probes, one
    idempotency lookup, one multi-row INSERT per table). A request whose
    (installed_pack_id, idempotency_key) exists already — in the database or
    earlier in ``requests`` — is skipped and counted in ``duplicates``; its
    ``work_ids`` entry is the existing item. New rows: event with
    ``ExecutionOwner='work_item'`` and the next ``EnqueueOrdinal``; work item
    ``WorkType='ConnectorEvent'``, ``State='pending'``, ``Attempt=0``,
    ``RunAfter`` NULL, ``LaneOrdinal`` from the same sequence (see module doc).

    Safe to call from many threads and processes at once: batches serialize on
    the enqueue lock. A failed batch rolls back alone; earlier batches stay.

    Raises ``InvalidWorkRequest`` (before writing anything) for a malformed
    request, ``QueueLockTimeout`` when the enqueue lock is busy for 30 s, and
    SQLAlchemy errors from the database.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    prepared = [(req, *_validate(req)) for req in requests]
    result = EnqueueResult(inserted=0, duplicates=0, work_ids=[])
    for start in range(0, len(prepared), batch_size):
        batch = prepared[start : start + batch_size]
        when = _now(now)
        with _serialized(engine, ENQUEUE_LOCK_NAME) as conn:
            _enqueue_batch(conn, batch, when, result)
    return result


def _enqueue_batch(
    conn: Connection,
    batch: Sequence[tuple[EnqueueRequest, str, str]],
    now: datetime,
    result: EnqueueResult,
) -> None:
    by_pack: dict[str, set[str]] = {}
    for req, _p, _q in batch:
        by_pack.setdefault(req.installed_pack_id, set()).add(req.idempotency_key)
    existing: dict[tuple[str, str], str] = {}  # (pack, key) -> EventId
    for pack, keys in by_pack.items():
        for key, event_id in conn.execute(
            select(_e.c.IdempotencyKey, _e.c.EventId).where(
                _e.c.InstalledPackId == pack, _e.c.IdempotencyKey.in_(sorted(keys))
            )
        ).all():
            existing[(pack, key)] = event_id
    existing_work = _current_work_ids(conn, list(existing.values())) if existing else {}
    companions = _freeze_companions(conn, [req for req, _p, _q in batch])

    seq = _next_seq(conn)
    events: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    fresh: dict[tuple[str, str], str] = {}  # keys inserted by this batch -> WorkId
    for req, payload, queue_class in batch:
        ident = (req.installed_pack_id, req.idempotency_key)
        if ident in existing:
            result.duplicates += 1
            result.work_ids.append(existing_work.get(existing[ident], ""))
            continue
        if ident in fresh:
            result.duplicates += 1
            result.work_ids.append(fresh[ident])
            continue
        event_id = _seq_id(EVENT_ID_PREFIX, seq)
        work_id = _seq_id(WORK_ID_PREFIX, seq)
        source_lane = lane_key(req.namespace, req.source_object, req.source_id)
        if req.target_object and req.target_remote_id:
            target_lane = lane_key(req.namespace, req.target_object, req.target_remote_id)
        else:
            target_lane = source_lane
        events.append(
            {
                "EventId": event_id,
                "InstalledPackId": req.installed_pack_id,
                "Namespace": req.namespace,
                "EventKind": req.event_kind,
                "RouteVersion": req.route_version,
                "IdempotencyKey": req.idempotency_key,
                "SourceObject": req.source_object,
                "SourceId": req.source_id,
                "Payload": payload,
                "ExecutionOwner": EXECUTION_OWNER_WORK_ITEM,
                "EnqueueOrdinal": seq,
                "CompanionPackInstallId": (
                    req.companion_pack_install_id
                    if req.companion_pack_install_id is not None
                    else companions.get(_route_key(req))
                ),
                "CreatedDate": now,
                "LastModifiedDate": now,
            }
        )
        items.append(
            _new_item_row(
                work_id,
                event_id,
                req.installed_pack_id,
                queue_class,
                source_lane,
                target_lane,
                seq,
                now,
            )
        )
        fresh[ident] = work_id
        result.work_ids.append(work_id)
        seq += 1
    if events:
        conn.execute(_e.insert(), events)
        conn.execute(_w.insert(), items)
        result.inserted += len(events)


def _route_key(req: EnqueueRequest) -> tuple[str, str, int]:
    return (req.installed_pack_id, req.event_kind.strip().lower(), req.route_version)


def _freeze_companions(
    conn: Connection, requests: Sequence[EnqueueRequest]
) -> dict[tuple[str, str, int], str]:
    """Companion incarnation of each cross-pack route among ``requests``, frozen now.

    Maps ``(installed pack id, event kind, route version)`` of every route
    that names a ``companion_pack`` to the ``PackInstallId`` of the active
    AppPack of that name, or ``''`` when none is active (fail closed: the
    event's companion check fails). Routes are read from the connector
    packs' installed payloads (plain JSON, no model parse: this runs under
    the enqueue lock). Requests with an explicit companion are skipped.
    """
    packs = sorted({r.installed_pack_id for r in requests if r.companion_pack_install_id is None})
    if not packs:
        return {}
    ip = t.installed_pack
    wanted: dict[tuple[str, str, int], str] = {}
    for install_id, payload in conn.execute(
        select(ip.c.PackInstallId, ip.c.Payload).where(
            ip.c.PackInstallId.in_(packs), ip.c.Category == "ConnectorPack"
        )
    ).all():
        for route in json.loads(payload or "{}").get("inbound_routes") or ():
            if route.get("companion_pack"):
                key = (install_id, route["event_kind"], int(route.get("route_version", 1)))
                wanted[key] = route["companion_pack"]
    if not wanted:
        return {}
    active = {
        name: install_id
        for name, install_id in conn.execute(
            select(ip.c.Name, ip.c.PackInstallId).where(
                ip.c.Name.in_(sorted(set(wanted.values()))),
                ip.c.Category == "AppPack",
                ip.c.Status == "active",
            )
        ).all()
    }
    return {key: active.get(name, "") for key, name in wanted.items()}


def _new_item_row(
    work_id: str,
    event_id: str,
    installed_pack_id: str,
    queue_class: str,
    source_lane: str | None,
    target_lane: str | None,
    lane_ordinal: int,
    now: datetime,
    *,
    work_type: str = WORK_TYPE_CONNECTOR_EVENT,
    replay_of: str | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {c.name: None for c in _w.columns}
    row.update(
        WorkId=work_id,
        EventId=event_id,
        InstalledPackId=installed_pack_id,
        WorkType=work_type,
        QueueClass=queue_class,
        State=STATE_PENDING,
        Attempt=0,
        OwnershipEpoch=0,
        FailureCount=0,
        ReplayOfWorkId=replay_of,
        SourceLaneKey=source_lane,
        TargetMutationLaneKey=target_lane,
        Generation=0,
        LaneOrdinal=lane_ordinal,
        CreatedDate=now,
        LastModifiedDate=now,
    )
    return row


# --- claim --------------------------------------------------------------------


def _parked(w: Any) -> ColumnElement[bool]:
    """The seed's parked-processing shape: a dependency and no lease at all."""
    return and_(
        w.c.DependencyKind.is_not(None),
        w.c.LeaseOwner.is_(None),
        w.c.LeaseToken.is_(None),
        w.c.LeaseUntil.is_(None),
    )


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


def claim(
    engine: Engine,
    *,
    installed_pack_id: str,
    queue_classes: Sequence[str],
    batch_size: int,
    lease_owner: str,
    lease_seconds: float,
    max_processing_rows: int,
    preferred_queue_classes: Sequence[str] = (),
    now: datetime | None = None,
) -> list[ClaimedItem]:
    """Lease up to ``batch_size`` claimable items of one pack to ``lease_owner``.

    Claimable: ``pending`` with ``RunAfter`` NULL or ``<= now``, or
    ``processing`` whose lease went stale (``LeaseUntil`` NULL or ``< now``,
    not parked) — a dead worker's item, reclaimed; its abandoned attempt gets
    a ``_System_ConnectorWorkAttempt`` row with ``OutcomeState='abandoned'``.
    Work types ``ConnectorEvent`` and ``WorkflowActionApply``.

    Rules: only lane heads (no non-terminal item earlier in the same source
    lane); at most one item per target mutation lane, and none whose target
    lane holds a live lease; ``queue_classes`` filters (empty = every class);
    ``preferred_queue_classes`` are taken first, then stale reclaims, then
    enqueue order (``WorkId`` order; due retries by ``RunAfter``); at most
    ``max_processing_rows - held`` new items where ``held`` counts the pack's
    processing rows, stale ones included and parked ones (dependency set, no
    lease) excluded, all classes (the seed's processing pressure); stale
    reclaims are not limited by it (their rows are already counted).

    Each item gets ``State='processing'``, a new uuid4 ``LeaseToken``,
    ``LeaseUntil = now + lease_seconds`` (whole seconds) and ``Attempt + 1``
    by compare-and-set; an item changed concurrently is skipped. Returns the
    claimed items in claim order (possibly empty).

    Raises ``ValueError`` for a non-positive ``lease_seconds``,
    ``QueueLockTimeout`` when the pack's claim lock is busy for 30 s.
    """
    return _claim(
        engine,
        installed_pack_id=installed_pack_id,
        queue_classes=queue_classes,
        batch_size=batch_size,
        lease_owner=lease_owner,
        lease_seconds=lease_seconds,
        max_processing_rows=max_processing_rows,
        preferred_queue_classes=preferred_queue_classes,
        now=now,
        full=True,
    )


def claim_leases(
    engine: Engine,
    *,
    installed_pack_id: str,
    queue_classes: Sequence[str],
    batch_size: int,
    lease_owner: str,
    lease_seconds: float,
    max_processing_rows: int,
    preferred_queue_classes: Sequence[str] = (),
    now: datetime | None = None,
) -> list[tuple[str, str]]:
    """:func:`claim`, returning only the ``(work_id, lease_token)`` pairs.

    Same rules, same writes; it skips reading the claimed items' rows and
    events back (for a caller that hands the leases to another process,
    which loads them with :func:`load_claimed`).
    """
    return _claim(
        engine,
        installed_pack_id=installed_pack_id,
        queue_classes=queue_classes,
        batch_size=batch_size,
        lease_owner=lease_owner,
        lease_seconds=lease_seconds,
        max_processing_rows=max_processing_rows,
        preferred_queue_classes=preferred_queue_classes,
        now=now,
        full=False,
    )


def _claim(
    engine: Engine,
    *,
    installed_pack_id: str,
    queue_classes: Sequence[str],
    batch_size: int,
    lease_owner: str,
    lease_seconds: float,
    max_processing_rows: int,
    preferred_queue_classes: Sequence[str],
    now: datetime | None,
    full: bool,
) -> list[Any]:
    when = _now(now)
    until = _lease_until(when, lease_seconds)
    if batch_size <= 0 or max_processing_rows <= 0:
        return []
    classes = _normalize_classes(queue_classes)
    preferred = _normalize_classes(preferred_queue_classes)
    with _serialized(engine, _claim_lock_name(installed_pack_id)) as conn:
        # One read of the pack's processing rows gives both the live target lanes
        # and the seed's pressure: every processing row that is not parked counts,
        # stale ones too (re-leasing a stale row adds nothing, so only new items
        # are held to the room left). Parked rows have no lease, so never live.
        processing = conn.execute(
            select(_w.c.TargetMutationLaneKey, _w.c.LeaseUntil, _case(_parked(_w))).where(
                _w.c.InstalledPackId == installed_pack_id,
                _w.c.State == STATE_PROCESSING,
                _w.c.WorkType.in_(CLAIMABLE_WORK_TYPES),
            )
        ).all()
        live_targets = [r[0] for r in processing if r[1] is not None and r[1] >= when]
        held = sum(1 for r in processing if not r[2])
        room = max_processing_rows - int(held)
        picked = _pick(
            conn,
            installed_pack_id,
            classes,
            preferred,
            when,
            batch_size,
            set(live_targets),
            new_budget=max(0, room),
        )
        if not picked:
            return []
        if _skip_locked(conn):
            locked = set(
                conn.execute(
                    select(_w.c.WorkId)
                    .where(_w.c.WorkId.in_([c.work_id for c in picked]))
                    .with_for_update(skip_locked=True)
                ).scalars()
            )
            picked = [c for c in picked if c.work_id in locked]
            if not picked:
                return []
        tokens = {c.work_id: uuid.uuid4().hex for c in picked}
        # One compare-and-set UPDATE for the batch: each row must still be in
        # the (State, LeaseToken, Attempt) it was chosen in. Which rows won is
        # read back by their fresh, unique tokens in _load_claimed.
        _claim_update(conn, picked, tokens, lease_owner, until, when)
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


def _claim_update(
    conn: Connection,
    picked: list[_Candidate],
    tokens: dict[str, str],
    lease_owner: str,
    until: datetime,
    when: datetime,
) -> None:
    """The claim's compare-and-set UPDATE, as driver-level SQL.

    ``SET State='processing', LeaseOwner, LeaseToken = CASE WorkId ... END,
    LeaseUntil, Attempt = Attempt + 1, LastModifiedDate WHERE`` one
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
        f"{q('LastModifiedDate')} = {mark} WHERE {' OR '.join(where_sql)}"
    )
    conn.exec_driver_sql(sql, tuple(params))


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
) -> list[_Candidate]:
    """Choose up to ``budget`` candidates (lane heads, target-exclusive, in claim order),
    of which at most ``new_budget`` are not stale reclaims (the processing budget's room).

    The scan is a UNION ALL of index-ordered slices with LIMIT — per queue
    class: never-retried pending items (``RunAfter IS NULL``, enqueue order)
    and due retries (``RunAfter <= now``); plus stale processing rows — each
    filtered by a NOT EXISTS lane-head probe on the lane index. Slices whose
    window was full are paged on with keyset cursors while the budget is not
    met (items skipped for a busy target lane need that), up to 6 rounds.
    """
    scan_classes = classes
    if not scan_classes:
        scan_classes = sorted(
            conn.execute(
                select(_w.c.QueueClass)
                .where(_w.c.InstalledPackId == pack, _w.c.State == STATE_PENDING)
                .distinct()
            ).scalars()
        )
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
        seen = {c.work_id for c in picked}
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
                w.c.State == STATE_PROCESSING,
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
        # Last: MariaDB evaluates attached conditions in order, and the probe is
        # the only costly one.
        conds.append(lane_head)
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
            _e.c.Namespace,
            _e.c.EventKind,
            _e.c.RouteVersion,
            _e.c.SourceObject,
            _e.c.SourceId,
            _e.c.Payload,
            _e.c.CompanionPackInstallId,
        )
        .select_from(_w.outerjoin(_e, _e.c.EventId == _w.c.EventId))
        .where(_w.c.WorkId.in_(list(tokens)))
    ).all()
    return {
        r.WorkId: r
        for r in rows
        if r.State == STATE_PROCESSING and r.LeaseToken == tokens[r.WorkId]
    }


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
    )


def _load_claimed(
    conn: Connection, picked: list[_Candidate], tokens: dict[str, str]
) -> list[ClaimedItem]:
    """The picked items this claim won (their token is ours), with their events, in pick order."""
    rows = _leased_rows(conn, tokens)
    return [_item(rows[c.work_id]) for c in picked if c.work_id in rows]


def load_claimed(engine: Engine, leases: Sequence[tuple[str, str]]) -> list[ClaimedItem]:
    """Re-load claimed items from ``(work_id, lease_token)`` pairs, in input order.

    For a worker that got only the lease pairs from :func:`claim` (e.g. across
    an activity boundary). An item whose lease is lost (token changed, or not
    ``processing`` any more) or that does not exist is left out. Read-only.
    """
    tokens = dict(leases)
    with engine.connect() as conn:
        rows = _leased_rows(conn, tokens)
    return [_item(rows[w]) for w in dict.fromkeys(w for w, _t in leases) if w in rows]


# --- leases and finishing -----------------------------------------------------


def extend_leases(
    engine: Engine,
    leases: Sequence[tuple[str, str]],
    lease_seconds: float,
    now: datetime | None = None,
) -> list[str]:
    """Push ``LeaseUntil`` to ``now + lease_seconds`` for each ``(work_id, lease_token)``.

    One transaction, one compare-and-set per lease. A lease that expired but
    was not reclaimed yet is extended (its token still matches). Returns the
    work ids whose lease is lost (token changed, or no longer processing), in
    input order. Raises ``ValueError`` for a non-positive ``lease_seconds``.
    """
    when = _now(now)
    until = _lease_until(when, lease_seconds)
    lost: list[str] = []
    if not leases:
        return lost
    with engine.begin() as conn:
        for work_id, token in leases:
            res = conn.execute(
                _w.update()
                .where(
                    _w.c.WorkId == work_id,
                    _w.c.LeaseToken == token,
                    _w.c.State == STATE_PROCESSING,
                )
                .values(LeaseUntil=until, LastModifiedDate=when)
            )
            if res.rowcount != 1:
                lost.append(work_id)
    return lost


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A write transaction that commits on success and rolls back on error.

    SQLite: ``BEGIN IMMEDIATE``, so the database write lock is held from the
    first read (a deferred transaction that read first could not upgrade
    after another writer's commit: ``database is locked`` at once). MySQL
    family: an ordinary transaction.
    """
    with _sqlite_writer(engine), engine.connect() as conn:
        if dialect_name(conn) == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise


def hold_leases(conn: Connection, items: Sequence[ClaimedItem]) -> list[ClaimedItem]:
    """The items whose lease still holds, locked for the caller's transaction.

    One read of the work-item rows (``FOR UPDATE`` on the MySQL family, so no
    stale reclaim can take them before the caller commits; SQLite: the caller
    holds the write lock, see :func:`write_transaction`). An item whose token
    changed or that is no longer ``processing`` is left out: its lease is
    lost and the caller must not write for it. Input order is kept.
    """
    if not items:
        return []
    stmt = select(_w.c.WorkId, _w.c.LeaseToken).where(
        _w.c.WorkId.in_([i.work_id for i in items]), _w.c.State == STATE_PROCESSING
    )
    if dialect_name(conn) == "mysql":
        stmt = stmt.with_for_update()
    current = {r[0]: r[1] for r in conn.execute(stmt)}
    return [i for i in items if current.get(i.work_id) == i.lease_token]


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

    Compare-and-set on (WorkId, LeaseToken, State='processing'); writes the
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


# --- replay -------------------------------------------------------------------


def replay(engine: Engine, work_id: str, *, now: datetime | None = None) -> str:
    """Run a ``failed`` item's event again; return the new item's WorkId.

    Inserts a new pending work item for the same event (same pack, work type,
    queue class and lanes) with ``ReplayOfWorkId=work_id`` and a fresh lane
    ordinal at the end of its lane, and stamps ``ReplayedAt`` on the old row,
    in one transaction under the enqueue lock.

    Raises ``NexusError`` when the item does not exist, is not ``failed``
    (naming its state), or was replayed already (naming the replacement).
    """
    when = _now(now)
    with _serialized(engine, ENQUEUE_LOCK_NAME) as conn:
        old = conn.execute(select(_w).where(_w.c.WorkId == work_id)).mappings().first()
        if old is None:
            raise NexusError(f"replay {work_id}: no such work item")
        if old["State"] != STATE_FAILED:
            raise NexusError(
                f"replay {work_id}: only a failed work item can be replayed; it is {old['State']}"
            )
        if old["ReplayedAt"] is not None:
            newer = conn.execute(
                select(_w.c.WorkId).where(_w.c.ReplayOfWorkId == work_id)
            ).scalar_one_or_none()
            raise NexusError(f"replay {work_id}: replayed already (as {newer})")
        seq = _next_seq(conn)
        new_id = _seq_id(WORK_ID_PREFIX, seq)
        res = conn.execute(
            _w.update()
            .where(_w.c.WorkId == work_id, _w.c.State == STATE_FAILED, _w.c.ReplayedAt.is_(None))
            .values(ReplayedAt=when, LastModifiedDate=when)
        )
        if res.rowcount != 1:
            raise NexusError(f"replay {work_id}: the item changed concurrently")
        conn.execute(
            _w.insert(),
            [
                _new_item_row(
                    new_id,
                    old["EventId"],
                    old["InstalledPackId"],
                    old["QueueClass"],
                    old["SourceLaneKey"],
                    old["TargetMutationLaneKey"],
                    seq,
                    when,
                    work_type=old["WorkType"],
                    replay_of=work_id,
                )
            ],
        )
        return new_id


# --- identity-convergence blocks ------------------------------------------------
#
# ``blocked``: the item's lookup waits on a dependency (see
# ``nexuscrm.connectors.identity``); its Dependency* columns say which, and an
# IdentityWaitWorkflow (one per key hash) wakes it. Waking clears the
# Dependency* columns (the attempt row with OutcomeState='blocked' and
# FailureSummary keep the history), so a pending or processing row never
# carries a stale dependency. ``DependencyProbeAfter`` is the wait's liveness
# mark: the wait moves it past its next probe each time it probes; a row whose
# mark is unset or past is a row without a live wait (recovery starts one).

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
RECOVERY_MAX_PAGES = 100


@dataclass
class BlockedRow:
    """A ``blocked`` item: its dependency (``None`` when its columns are incomplete)."""

    work_id: str
    installed_pack_id: str
    key_hash: str | None
    blocked_at: datetime | None
    probe_after: datetime | None
    dependency: Dependency | None


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


def wake_blocked_by_pack(
    engine: Engine, key_hash: str, *, now: datetime | None = None
) -> dict[str, int]:
    """Blocked items of ``key_hash`` -> ``pending`` (due now, Dependency* cleared).

    Returns woken items per installed pack id (empty when none was blocked:
    a duplicate wake wakes nothing). See :func:`wake_blocked_keys`.
    """
    return wake_blocked_keys(engine, [key_hash], now=now)


def wake_blocked_keys(
    engine: Engine, key_hashes: Sequence[str], *, now: datetime | None = None
) -> dict[str, int]:
    """Blocked items of any of ``key_hashes`` -> ``pending``, in one transaction.

    Returns woken items per installed pack id. A read first: when nothing is
    blocked on these keys (a duplicate wake, or a wait whose rows the
    finalizing batch already woke) no write transaction is opened, so a burst
    of such wakes never queues behind the inbound writers. An item that blocks
    after the read registers a wait of its own, whose first probe converges.
    """
    keys = sorted(set(key_hashes))
    if not keys:
        return {}
    when = _now(now)

    def blocked(conn: Connection, lock: bool) -> list[Any]:
        rows: list[Any] = []
        for start in range(0, len(keys), 500):
            stmt = select(_w.c.WorkId, _w.c.InstalledPackId).where(
                _w.c.DependencyKeyHash.in_(keys[start : start + 500]),
                _w.c.State == STATE_BLOCKED,
            )
            if lock and dialect_name(conn) == "mysql":
                stmt = stmt.with_for_update()
            rows.extend(conn.execute(stmt).all())
        return rows

    with engine.connect() as conn:
        if not blocked(conn, lock=False):
            return {}
    with write_transaction(engine) as conn:
        rows = blocked(conn, lock=True)
        ids = [r[0] for r in rows]
        for start in range(0, len(ids), 500):
            conn.execute(
                _w.update()
                .where(_w.c.WorkId.in_(ids[start : start + 500]), _w.c.State == STATE_BLOCKED)
                .values(
                    State=STATE_PENDING, RunAfter=None, LastModifiedDate=when, **_CLEARED_DEPENDENCY
                )
            )
    out: dict[str, int] = {}
    for _work_id, pack in rows:
        out[pack] = out.get(pack, 0) + 1
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
    cond = [_w.c.WorkId.in_(list(work_ids)), _w.c.State == STATE_BLOCKED]
    if key_hash is not None:
        cond.append(_w.c.DependencyKeyHash == key_hash)
    with write_transaction(engine) as conn:
        res = conn.execute(
            _w.update()
            .where(*cond)
            .values(
                State=STATE_FAILED,
                TerminalAt=when,
                FailureCount=_w.c.FailureCount + 1,
                LastFailureAt=when,
                FailureClass=failure_class,
                FailureSummary=summary,
                LastModifiedDate=when,
            )
        )
        return int(res.rowcount)


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
    """
    when = _now(now)
    with write_transaction(engine) as conn:
        res = conn.execute(
            _w.update()
            .where(_w.c.State == STATE_PROCESSING, _parked(_w))
            .values(
                State=STATE_BLOCKED,
                DependencyBlockedAt=func.coalesce(_w.c.DependencyBlockedAt, when),
                DependencyProbeAfter=None,
                LastModifiedDate=when,
            )
        )
        return int(res.rowcount)


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


def mark_wait_alive(engine: Engine, key_hash: str, until: datetime) -> None:
    """Set ``DependencyProbeAfter = until`` on the blocked items of ``key_hash`` (liveness)."""
    with write_transaction(engine) as conn:
        conn.execute(
            _w.update()
            .where(_w.c.DependencyKeyHash == key_hash, _w.c.State == STATE_BLOCKED)
            .values(DependencyProbeAfter=until.replace(microsecond=0))
        )


# --- observability ------------------------------------------------------------


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


def _case(cond: ColumnElement[bool]) -> Any:
    return case((cond, 1), else_=0)
