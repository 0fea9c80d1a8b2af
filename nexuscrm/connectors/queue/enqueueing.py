"""Enqueue and replay: new events and work items, numbered from one sequence.

Both run under the enqueue lock (:data:`~nexuscrm.connectors.queue.locking.ENQUEUE_LOCK_NAME`),
which is what makes the sequence probe of :func:`_next_seq` safe.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, select

from nexuscrm.connectors.knobs import QUEUE_CLASSES
from nexuscrm.connectors.queue.locking import ENQUEUE_LOCK_NAME, _serialized
from nexuscrm.connectors.queue.shapes import EnqueueRequest, EnqueueResult
from nexuscrm.connectors.queue.vocabulary import (
    _KEY_LEN,
    EVENT_ID_PREFIX,
    STATE_FAILED,
    STATE_PENDING,
    STATE_PROCESSING,
    STATE_SUCCEEDED,
    WORK_ID_PREFIX,
    WORK_TYPE_CONNECTOR_EVENT,
    IdempotencyConflict,
    InvalidWorkRequest,
    _e,
    _now,
    _parse_seq,
    _seq_id,
    _w,
    lane_key,
    normalize_queue_class,
)
from nexuscrm.connectors.routes import removed_pack_name
from nexuscrm.cutover import EXECUTION_OWNER_WORK_ITEM
from nexuscrm.db import tables as t
from nexuscrm.errors import NexusError
from nexuscrm.inputs import kind_of


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


_TEXT_LIMITS = (
    ("installed_pack_id", 64),
    ("namespace", 128),
    ("event_kind", 128),
    ("idempotency_key", _KEY_LEN),
    ("source_object", 128),
    ("source_id", _KEY_LEN),
)
_OPTIONAL_LIMITS = (("target_object", 128), ("target_remote_id", _KEY_LEN))


def _problems(req: EnqueueRequest) -> list[str]:
    """Every reason ``req`` cannot be stored and processed (``[]``: it can)."""
    out: list[str] = []
    for name, limit in _TEXT_LIMITS:
        value = getattr(req, name)
        if not isinstance(value, str):
            out.append(f"{name} must be a string, got {kind_of(value)} {value!r:.40}")
        elif len(value) > limit:
            out.append(f"{name} longer than {limit} characters: {value[:40]!r}...")
    for name in ("installed_pack_id", "event_kind", "idempotency_key"):
        if isinstance(getattr(req, name), str) and not getattr(req, name):
            out.append(f"{name} is empty")
    for name, limit in _OPTIONAL_LIMITS:
        value = getattr(req, name)
        if value is not None and (not isinstance(value, str) or len(value) > limit):
            out.append(f"{name} must be a string of at most {limit} characters, got {value!r:.40}")
    rv = req.route_version
    if isinstance(rv, bool) or not isinstance(rv, int) or not 1 <= rv <= 2**31 - 1:
        out.append(f"route_version must be a whole number >= 1, got {rv!r:.40}")
    if not isinstance(req.queue_class, str):
        out.append(f"queue_class must be a string, got {req.queue_class!r:.40}")
    else:
        queue_class = normalize_queue_class(req.queue_class)
        if queue_class not in QUEUE_CLASSES:
            out.append(
                f"queue_class {req.queue_class!r} is not a class any worker claims "
                f"(one of {', '.join(QUEUE_CLASSES)}): it would stay pending forever"
            )
    if not isinstance(req.payload, dict):
        out.append(f"payload must be a JSON object, got {kind_of(req.payload)}: no flow can run it")
    return out


def _validate(req: EnqueueRequest) -> tuple[str, str]:
    """Check one request; return (payload JSON, normalized queue class).

    Raises ``InvalidWorkRequest`` naming the request (idempotency key) and
    every problem: a field of the wrong type or too long for its column, an
    empty pack / kind / key, a route version that is not a whole number >= 1,
    a queue class no worker claims (it would stay pending forever), a payload
    that is not a JSON object (no flow could run it) or not serializable.
    """
    problems = _problems(req)
    key = req.idempotency_key if isinstance(req.idempotency_key, str) else repr(req.idempotency_key)
    if problems:
        raise InvalidWorkRequest(f"enqueue {key[:60]}: " + "; ".join(problems))
    try:
        payload = json.dumps(req.payload, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidWorkRequest(
            f"enqueue {key[:60]}: payload is not JSON-serializable: {exc}"
        ) from None
    return payload, normalize_queue_class(req.queue_class)


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
    earlier in ``requests`` — with the same content (event kind, route
    version, source object and id, namespace, payload) is skipped and counted
    in ``duplicates``; its ``work_ids`` entry is the existing item. With other
    content it is refused (:class:`IdempotencyConflict`): one key is one
    event, and a second event under it would be lost unseen. New rows: event with
    ``ExecutionOwner='work_item'`` and the next ``EnqueueOrdinal``; work item
    ``WorkType='ConnectorEvent'``, ``State='pending'``, ``Attempt=0``,
    ``RunAfter`` NULL, ``LaneOrdinal`` from the same sequence (see module doc).

    Safe to call from many threads and processes at once: batches serialize on
    the enqueue lock. A failed batch rolls back alone; earlier batches stay.

    Raises ``InvalidWorkRequest`` (before writing anything) listing every
    malformed request (see :func:`_validate`); ``IdempotencyConflict`` listing
    every key reused with other content (before writing anything; or, when a
    concurrent writer stored the key after that check, from the batch that
    meets it, which rolls back, with ``inserted`` the events of the earlier
    batches, which stay), ``QueueLockTimeout`` when the
    enqueue lock is busy for 30 s, and SQLAlchemy errors from the database.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    prepared: list[tuple[EnqueueRequest, str, str]] = []
    problems: list[str] = []
    for req in requests:
        try:
            prepared.append((req, *_validate(req)))
        except InvalidWorkRequest as exc:
            problems.append(str(exc))
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise InvalidWorkRequest(
            f"{len(problems)} of {len(requests)} request(s) refused, nothing enqueued:\n  "
            + "\n  ".join(problems[:20])
            + more
        )
    conflicts = _conflicts_within(prepared)
    with engine.connect() as conn:
        for start in range(0, len(prepared), _CHECK_CHUNK):
            conflicts += _stored_conflicts(conn, prepared[start : start + _CHECK_CHUNK])[1]
    if conflicts:
        raise _conflict_error(conflicts, len(requests), 0)
    result = EnqueueResult(inserted=0, duplicates=0, work_ids=[])
    for start in range(0, len(prepared), batch_size):
        batch = prepared[start : start + batch_size]
        when = _now(now)
        try:
            with _serialized(engine, ENQUEUE_LOCK_NAME) as conn:
                _enqueue_batch(conn, batch, when, result)
        except IdempotencyConflict as exc:
            raise _conflict_error(exc.conflicts, len(requests), result.inserted) from None
    return result


_CHECK_CHUNK = 500
"""Keys per statement of the conflict check before writing."""

_CONTENT = (
    ("namespace", "Namespace"),
    ("event_kind", "EventKind"),
    ("route_version", "RouteVersion"),
    ("source_object", "SourceObject"),
    ("source_id", "SourceId"),
)


def _differs(req: EnqueueRequest, mine: str, payload: Any, fields: Sequence[Any]) -> str:
    """The content fields (comma-separated) on which ``req`` (its payload's
    JSON text ``mine``) differs from an event given as its ``_CONTENT`` values
    (``fields``) and ``payload`` (a JSON value); ``''`` when it is the same
    event. Payloads compare as JSON values: key order does not count."""
    out = [
        attr
        for (attr, _c), theirs in zip(_CONTENT, fields, strict=True)
        if getattr(req, attr) != theirs
    ]
    if payload != json.loads(mine):
        out.append("payload")
    return ", ".join(out)


def _verb(diff: str) -> str:
    """``'payload differs'`` / ``'payload, source_id differ'``."""
    return f"{diff} differ" if "," in diff else f"{diff} differs"


def _stored_payload(stored: str | None, mine: str) -> Any:
    """A stored event's payload as a JSON value (``mine``'s text: same string, no parse)."""
    if stored == mine:
        return json.loads(mine)
    try:
        return json.loads(stored) if stored is not None else None
    except ValueError:
        return stored


def _conflicts_within(prepared: Sequence[tuple[EnqueueRequest, str, str]]) -> list[str]:
    """One line per request that reuses an earlier request's key with other content."""
    first: dict[tuple[str, str], tuple[int, EnqueueRequest, str]] = {}
    out: list[str] = []
    for n, (req, payload, _q) in enumerate(prepared, start=1):
        seen = first.setdefault((req.installed_pack_id, req.idempotency_key), (n, req, payload))
        if seen[0] != n:
            _n, other, theirs = seen
            fields = [getattr(other, a) for a, _c in _CONTENT]
            diff = _differs(req, payload, _stored_payload(theirs, payload), fields)
            if diff:
                out.append(
                    f"request {n}: idempotency_key {req.idempotency_key!r}: {_verb(diff)} "
                    f"from request {seen[0]} with the same key"
                )
    return out


def _stored_conflicts(
    conn: Connection, batch: Sequence[tuple[EnqueueRequest, str, str]]
) -> tuple[dict[tuple[str, str], str], list[str]]:
    """The stored events of ``batch``'s keys, ``(pack, key) -> EventId``, and one
    line per request whose key is stored with other content."""
    by_pack: dict[str, set[str]] = {}
    for req, _p, _q in batch:
        by_pack.setdefault(req.installed_pack_id, set()).add(req.idempotency_key)
    rows: dict[tuple[str, str], Any] = {}
    for pack, keys in by_pack.items():
        for row in conn.execute(
            select(
                _e.c.IdempotencyKey,
                _e.c.EventId,
                _e.c.Payload,
                *(_e.c[column] for _a, column in _CONTENT),
            ).where(_e.c.InstalledPackId == pack, _e.c.IdempotencyKey.in_(sorted(keys)))
        ).all():
            rows[(pack, row.IdempotencyKey)] = row
    problems: list[str] = []
    for req, payload, _q in batch:
        found = rows.get((req.installed_pack_id, req.idempotency_key))
        if found is None:
            continue
        stored = _stored_payload(found.Payload, payload)
        diff = _differs(req, payload, stored, [getattr(found, column) for _a, column in _CONTENT])
        if diff:
            problems.append(
                f"idempotency_key {req.idempotency_key!r}: {_verb(diff)} from the stored "
                f"event {found.EventId}"
            )
    return {ident: row.EventId for ident, row in rows.items()}, problems


def _conflict_error(conflicts: list[str], total: int, inserted: int) -> IdempotencyConflict:
    kept = (
        "nothing enqueued"
        if not inserted
        else f"{inserted} event(s) of earlier batches enqueued and kept, the rest not"
    )
    more = f"\n  ... and {len(conflicts) - 20} more" if len(conflicts) > 20 else ""
    return IdempotencyConflict(
        f"{len(conflicts)} of {total} request(s) reuse an idempotency key with other "
        f"content (one key is one event; give the new event its own key), {kept}:\n  "
        + "\n  ".join(conflicts[:20])
        + more,
        conflicts,
        inserted,
    )


def _enqueue_batch(
    conn: Connection,
    batch: Sequence[tuple[EnqueueRequest, str, str]],
    now: datetime,
    result: EnqueueResult,
) -> None:
    existing, conflicts = _stored_conflicts(conn, batch)  # (pack, key) -> EventId
    if conflicts:  # stored by a concurrent writer since enqueue's check
        raise IdempotencyConflict("", conflicts)
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


# --- replay -------------------------------------------------------------------


def superseding_items(
    conn: Connection, source_lane: str | None, lane_ordinal: int
) -> list[tuple[str, str]]:
    """``(WorkId, State)`` of the items after ``lane_ordinal`` in ``source_lane`` that
    ``succeeded`` or are ``processing``, in lane order (``[]`` for no lane).

    These are the record's later events whose values a replay of an earlier
    event would overwrite. Reads the lane index only.
    """
    if not source_lane:
        return []
    rows = conn.execute(
        select(_w.c.WorkId, _w.c.State)
        .where(
            _w.c.SourceLaneKey == source_lane,
            _w.c.LaneOrdinal > lane_ordinal,
            _w.c.State.in_([STATE_SUCCEEDED, STATE_PROCESSING]),
        )
        .order_by(_w.c.LaneOrdinal, _w.c.WorkId)
    ).all()
    return [(r[0], r[1]) for r in rows]


def replay(engine: Engine, work_id: str, *, now: datetime | None = None) -> str:
    """Run a ``failed`` item's event again, in its record's order; return the new WorkId.

    Inserts a new pending work item for the same event (same pack, work type,
    queue class and lanes) with ``ReplayOfWorkId=work_id`` and stamps
    ``ReplayedAt`` on the old row, in one transaction under the enqueue lock.
    The new item keeps the old one's ``LaneOrdinal`` (its original position in
    the record's source lane), so it runs before the record's later events
    that are still waiting, never after them.

    A replay that would apply an older version of a record over a newer one is
    refused: while a later event of the same source lane has ``succeeded`` (or
    is ``processing``), replaying this one would overwrite the newer field
    values with older ones. The error names those later items; to apply the
    old values anyway, enqueue them as a new event. The processor checks the
    same rule again when it runs the replay (``replay-superseded``), which
    covers a later event that succeeds between the replay and its claim.

    Raises ``NexusError`` when the item's pack incarnation was removed (it
    would only fail ``pack-removed`` again), the item does not exist, is not ``failed``
    (naming its state), was replayed already (naming the replacement), or a
    later event of its record succeeded or is running (naming them).
    """
    when = _now(now)
    if len(work_id) > t.WORK_ID:
        raise NexusError(
            f"replay {work_id[: t.WORK_ID]}...: no such work item (a work id has at most "
            f"{t.WORK_ID} characters, this one {len(work_id):,})"
        )
    with engine.connect() as probe:
        install_id = probe.execute(
            select(_w.c.InstalledPackId).where(_w.c.WorkId == work_id)
        ).scalar()
    removed = removed_pack_name(engine, install_id) if install_id else None
    if removed is not None:  # a removed incarnation never comes back: no race
        raise NexusError(
            f"replay {work_id}: its pack {removed} (incarnation {install_id}) was removed, so "
            "a replay would only fail pack-removed again; enqueue its event into the installed "
            "pack (events enqueue) to run it there"
        )
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
        later = superseding_items(conn, old["SourceLaneKey"], int(old["LaneOrdinal"] or 0))
        if later:
            shown = ", ".join(f"{w} ({state})" for w, state in later[:5])
            more = f" and {len(later) - 5} more" if len(later) > 5 else ""
            raise NexusError(
                f"replay {work_id}: refused, it would overwrite newer data of its record "
                f"(lane {old['SourceLaneKey']}): later events {shown}{more} already applied "
                "or are running; enqueue the old values as a new event if you mean it"
            )
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
                    int(old["LaneOrdinal"] or seq),
                    when,
                    work_type=old["WorkType"],
                    replay_of=work_id,
                )
            ],
        )
        return new_id
