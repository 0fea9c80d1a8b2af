"""Inbound flows: what a route runs for one claimed event.

``upsert_record`` (the reference flow) maps the event's fields onto the
destination object, resolves lookups through the remote-link table, upserts
the record by its remote id and finalizes the record's own remote link, all
in the caller's transaction. ``webhook`` POSTs the event to a URL.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import Connection, Engine, MetaData, Table, bindparam, select

from nexuscrm.catalog import Catalog, CatalogObject
from nexuscrm.clock import utcnow
from nexuscrm.connectors.enrich import IDEMPOTENCY_HEADER
from nexuscrm.db import tables as t
from nexuscrm.errors import NexusError
from nexuscrm.fieldvalues import (
    MAX_REMOTE_ID_CHARS,
    NAME_FIELD,
    OWNER_FIELD,
    ValueProblem,
    stored_value,
    value_problem,
)
from nexuscrm.inputs import kind_of
from nexuscrm.packs.model import REFERENCE_TYPES, FieldSpec


class FlowError(NexusError):
    """A flow could not finish this event.

    failure_class: short machine-readable class (``mapping``,
    ``dependency-unresolved``, ``webhook-http-503`` ...); retriable: whether a
    later attempt may succeed (the item goes back to pending with backoff).
    """

    def __init__(self, failure_class: str, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.retriable = retriable


@dataclass(frozen=True)
class RemoteIdentity:
    """The remote-link key of a record: (owner key, namespace, destination object, remote id)."""

    owner_key: str
    namespace: str
    destination_object: str
    remote_id: str


class DependencyUnresolved(FlowError):
    """A lookup's parent has no remote link yet; ``parent`` is the identity it waits on.

    Class ``dependency-unresolved``, retriable: the processor blocks the item
    on ``parent`` (an identity-convergence wait) instead of retrying it.
    """

    def __init__(self, message: str, parent: RemoteIdentity) -> None:
        super().__init__("dependency-unresolved", message, retriable=True)
        self.parent = parent


FAILURE_CLASS_CONFLICT = "identity-convergence-conflict"


class IdentityConflict(FlowError):
    """The authority disagrees with itself: a remote link names a record that is
    not there (deleted or restored away). The event fails closed, never retried:
    writing the lookup would point it at nothing, and a fresh record would fork
    the identity."""

    def __init__(self, parent: RemoteIdentity, record_id: str) -> None:
        super().__init__(
            FAILURE_CLASS_CONFLICT,
            f"remote link {parent.namespace}/{parent.destination_object}/{parent.remote_id} "
            f"names {parent.destination_object} record {record_id}, which does not exist",
            retriable=False,
        )
        self.parent = parent


def missing_linked_records(
    conn: Connection, catalog: Catalog, linked: dict[RemoteIdentity, str]
) -> set[RemoteIdentity]:
    """The identities in ``linked`` (identity -> record id) whose record is absent.

    One ``SELECT Id ... IN`` per destination object. An identity whose object is
    not installed is left to the flow's own mapping error.
    """
    by_obj: dict[str, dict[str, list[RemoteIdentity]]] = {}
    for ident, record_id in linked.items():
        by_obj.setdefault(ident.destination_object, {}).setdefault(record_id, []).append(ident)
    missing: set[RemoteIdentity] = set()
    for obj_name, by_record in by_obj.items():
        obj = catalog.get(obj_name)
        if obj is None or not obj.has_table:
            continue
        table = record_table(conn, obj.table_name, catalog.version)
        ordered = sorted(by_record)
        found: set[str] = set()
        for start in range(0, len(ordered), _IN_CHUNK):
            found.update(
                conn.execute(
                    select(table.c.Id).where(table.c.Id.in_(ordered[start : start + _IN_CHUNK]))
                ).scalars()
            )
        for record_id, idents in by_record.items():
            if record_id not in found:
                missing.update(idents)
    return missing


def find_link(conn: Connection, ident: RemoteIdentity) -> str | None:
    """Record id linked to ``ident``, or ``None``."""
    rl = t.connector_remote_link
    return conn.execute(
        select(rl.c.RecordId).where(
            rl.c.ConnectorOwnerKey == ident.owner_key,
            rl.c.Namespace == ident.namespace,
            rl.c.DestinationObject == ident.destination_object,
            rl.c.RemoteId == ident.remote_id,
        )
    ).scalar_one_or_none()


VALUE_INVALID = "value-invalid"
"""Failure class of an event whose field value does not fit its field (not retried)."""


def _coerce(obj: str, f: FieldSpec, column: str, value: Any) -> Any:
    """The stored value of one column; ``FlowError('value-invalid')`` naming the
    object, column and why when it does not fit (:func:`nexuscrm.fieldvalues.stored_value`)."""
    try:
        return stored_value(f, value)
    except ValueProblem as exc:
        raise FlowError(VALUE_INVALID, f"{obj}.{column}: value {exc}", retriable=False) from None


def _columns(obj: CatalogObject) -> dict[str, tuple[FieldSpec, str]]:
    out: dict[str, tuple[FieldSpec, str]] = {}
    for f in obj.fields:
        for col in f.column_names():
            out[col.lower()] = (f, col)
    return out


_COLUMNS: dict[int, tuple[CatalogObject, dict[str, tuple[FieldSpec, str]]]] = {}


def _columns_cached(obj: CatalogObject) -> dict[str, tuple[FieldSpec, str]]:
    """:func:`_columns` once per catalog object (catalog snapshots are immutable).

    Keyed by identity (hashing the frozen dataclass would hash every field);
    the entry keeps the object alive, so its id is not reused meanwhile.
    """
    entry = _COLUMNS.get(id(obj))
    if entry is not None and entry[0] is obj:
        return entry[1]
    cols = _columns(obj)
    if len(_COLUMNS) > 4096:  # old catalog versions: start over
        _COLUMNS.clear()
    _COLUMNS[id(obj)] = (obj, cols)
    return cols


# Reflected record tables per engine, keyed by (table name, metadata version):
# every metadata writer bumps the version, so a DDL change is a new key. The
# reflection itself costs ~10 ms (a dozen PRAGMA / information_schema reads)
# and a fresh Table object also misses SQLAlchemy's compiled-statement cache.
_TABLES: weakref.WeakKeyDictionary[Engine, dict[tuple[str, int], Table]] = (
    weakref.WeakKeyDictionary()
)
_TABLES_LOCK = threading.Lock()


def record_table(conn: Connection, table_name: str, version: int) -> Table:
    """The reflected table ``table_name`` at metadata ``version`` (cached per engine)."""
    engine = conn.engine
    key = (table_name, version)
    with _TABLES_LOCK:
        per_engine = _TABLES.setdefault(engine, {})
        cached = per_engine.get(key)
    if cached is not None:
        return cached
    table = Table(table_name, MetaData(), autoload_with=conn)
    with _TABLES_LOCK:
        per_engine = _TABLES.setdefault(engine, {})
        # Older versions of this table are dead: drop them.
        for old in [k for k in per_engine if k[0] == table_name and k[1] != version]:
            del per_engine[old]
        return per_engine.setdefault(key, table)


@dataclass
class UpsertRequest:
    """One event for :func:`upsert_records` (the arguments of :func:`upsert_record`)."""

    owner_key: str
    namespace: str
    payload: dict[str, Any]
    destination_object: str | None = None
    field_map: dict[str, str] | None = None


@dataclass
class _Prepared:
    """An event mapped onto its destination, lookups not resolved yet.

    ``refs`` are the lookup columns in field order (parent ``None``: set the
    column to NULL); ``error`` is a mapping
    error met after them (a missing parent earlier in the field order wins,
    as in a field-by-field walk).
    """

    obj: CatalogObject
    ident: RemoteIdentity
    values: dict[str, Any]
    refs: list[tuple[str, RemoteIdentity | None, str]]
    error: FlowError | None = None


PAYLOAD_INVALID = "payload-invalid"
"""Failure class of an event whose payload can never run its flow (not retriable)."""


def upsert_payload_problem(payload: Any) -> str:
    """What makes ``payload`` unusable for the ``upsert_record`` flow, ``''`` if nothing.

    ``fields`` and ``references``, when present, must be JSON objects with
    text keys, each reference a remote id (text or a number). Checked by
    ``events enqueue`` for an upsert route (the file is refused) and by the
    flow (the item fails ``payload-invalid``, alone, at once).
    """
    if not isinstance(payload, dict):
        return "payload is not a JSON object"
    for key in ("fields", "references"):
        value = payload.get(key)
        if value is not None and not isinstance(value, dict):
            return f"payload.{key} must be a JSON object (name: value), got {kind_of(value)}"
    for name, value in (payload.get("references") or {}).items():
        if value is not None and not isinstance(value, str | int):
            return f"payload.references.{name} must be a remote id (text), got {kind_of(value)}"
    return ""


def upsert_mapping_problem(
    catalog: Catalog,
    *,
    namespace: str,
    payload: dict[str, Any],
    destination_object: str | None,
    field_map: dict[str, str] | None,
) -> str:
    """What the ``upsert_record`` flow would refuse in ``payload`` whatever the
    database holds, ``''`` if nothing: no ``sobject`` or ``remote_id``, an object
    not installed, a field the object lacks, ``references`` naming a field that
    is not a lookup, a value that does not fit its field (the flow's own
    mapping, :func:`_prepare`, against ``catalog``; no I/O). Each such event
    could only fail (``mapping``, ``payload-invalid``, ``value-invalid``), so
    ``events enqueue`` refuses its file first. The message ends with the class.
    Where the flow stops at a field, every field it would refuse is named
    (:func:`field_problems`), not only the first (a new user's trial).
    """
    try:
        prepared = _prepare(
            catalog,
            owner_key=namespace,
            namespace=namespace,
            payload=payload,
            destination_object=destination_object,
            field_map=field_map,
        )
    except FlowError as exc:
        return _with_other_fields(catalog, exc, payload, destination_object, field_map)
    error = prepared.error
    if error is not None and not error.retriable:
        return _with_other_fields(catalog, error, payload, destination_object, field_map)
    return ""


def _with_other_fields(
    catalog: Catalog,
    error: FlowError,
    payload: dict[str, Any],
    destination_object: str | None,
    field_map: dict[str, str] | None,
) -> str:
    """``error`` and its class, followed by the payload's other field problems."""
    first = f"{error} ({error.failure_class})"
    fields = payload.get("fields")
    if error.failure_class == PAYLOAD_INVALID or not isinstance(fields, dict):
        return first
    sobject = str(destination_object or payload.get("sobject") or "")
    others = field_problems(
        catalog, sobject, fields, destination_object=destination_object, field_map=field_map
    )
    if len(others) <= 1:
        return first
    return f"{len(others)} field problem(s): {'; '.join(others)} ({error.failure_class})"


def _prepare(
    catalog: Catalog,
    *,
    owner_key: str,
    namespace: str,
    payload: dict[str, Any],
    destination_object: str | None,
    field_map: dict[str, str] | None,
) -> _Prepared:
    """Map one event (no I/O); raises FlowError('mapping') for what needs no lookup
    and ``value-invalid`` at once for a value that does not fit its field (even
    after a lookup whose parent is not linked yet: waiting could not help)."""
    sobject = destination_object or payload.get("sobject")
    remote_id = payload.get("remote_id")
    if not sobject or not remote_id:
        raise FlowError("mapping", "event payload lacks sobject or remote_id", retriable=False)
    obj = catalog.get(str(sobject))
    if obj is None or not obj.has_table:
        raise FlowError(
            "mapping", f"destination object {sobject} is not installed", retriable=False
        )
    cols = _columns_cached(obj)
    mapping: dict[str, str] = {k.lower(): v for k, v in (field_map or {}).items()}
    values: dict[str, Any] = {}
    refs: list[tuple[str, RemoteIdentity | None, str]] = []
    shape = upsert_payload_problem(payload)
    if shape:
        raise FlowError(PAYLOAD_INVALID, f"{sobject}: {shape}", retriable=False)
    fields = dict(payload.get("fields") or {})
    raw_references = payload.get("references") or {}
    references = {str(k).lower(): v for k, v in raw_references.items()}
    # A lookup named only under "references" is set too (not silently skipped):
    # it is a field of the event whose value is the parent's remote id.
    named = {str(k).lower() for k in fields}
    only_referenced = [str(k) for k in raw_references if str(k).lower() not in named]
    for name in only_referenced:
        fields[name] = raw_references[name]
    ident = RemoteIdentity(owner_key, namespace, obj.api_name, str(remote_id))
    if len(ident.remote_id) > MAX_REMOTE_ID_CHARS:
        raise FlowError(
            VALUE_INVALID,
            f"{obj.api_name}: remote id has {len(ident.remote_id):,} characters; "
            f"at most {MAX_REMOTE_ID_CHARS}",
            retriable=False,
        )
    try:
        for raw_name, value in fields.items():
            spec = _field_target(obj, cols, mapping, str(raw_name))
            if spec is None:
                continue
            f, col = spec
            if raw_name.lower() in references and f.type not in REFERENCE_TYPES:
                raise FlowError(
                    "mapping",
                    f"{obj.api_name}.{col}: named under references but not a lookup field",
                    retriable=False,
                )
            if f is NAME_FIELD or f is OWNER_FIELD:
                values[col] = _coerce(obj.api_name, f, col, value)
                continue
            if f.type in REFERENCE_TYPES:
                parent_remote = _coerce(
                    obj.api_name, f, col, references.get(raw_name.lower(), value)
                )
                if parent_remote is None:
                    refs.append((col, None, ""))
                    continue
                parent = RemoteIdentity(
                    owner_key, namespace, str(f.reference_to), str(parent_remote)
                )
                message = (
                    f"{obj.api_name}.{col}: parent {f.reference_to} {parent_remote} "
                    "is not linked yet"
                )
                refs.append((col, parent, message))
                continue
            values[col] = _coerce(obj.api_name, f, col, value)
    except FlowError as exc:
        if exc.failure_class == VALUE_INVALID:
            raise  # terminal whatever its parents: fail now, never wait on one first
        return _Prepared(obj, ident, values, refs, exc)
    if not values.get("Name"):
        first, last = fields.get("FirstName"), fields.get("LastName")
        values["Name"] = " ".join(str(p) for p in (first, last) if p) or str(remote_id)
    return _Prepared(obj, ident, values, refs)


_SYSTEM_COLUMNS = frozenset({"id", "createddate", "lastmodifieddate", "isdeleted"})


def _field_target(
    obj: CatalogObject,
    cols: dict[str, tuple[FieldSpec, str]],
    mapping: dict[str, str],
    raw_name: str,
) -> tuple[FieldSpec, str] | None:
    """(field, column) an event field writes, after ``mapping`` (lower-cased
    event name -> field); ``None`` for a system column (the CRM's own: Id,
    CreatedDate, LastModifiedDate, IsDeleted, ignored). ``Name`` and
    ``OwnerId`` are :data:`NAME_FIELD` / :data:`OWNER_FIELD`. Raises
    ``FlowError('mapping')`` when the object has no such field."""
    name = mapping.get(raw_name.lower(), raw_name)
    lower = name.lower()
    if lower == "name":
        return NAME_FIELD, "Name"
    if lower == "ownerid":
        return OWNER_FIELD, "OwnerId"
    if lower in _SYSTEM_COLUMNS:
        return None
    spec = cols.get(lower)
    if spec is None:
        raise FlowError(
            "mapping", f"{obj.api_name} has no field {name} (event field {raw_name})",
            retriable=False,
        )  # fmt: skip
    return spec


def field_problems(
    catalog: Catalog,
    sobject: str,
    fields: dict[str, Any],
    *,
    destination_object: str | None = None,
    field_map: dict[str, str] | None = None,
) -> list[str]:
    """Every reason the ``upsert_record`` flow would refuse these fields, before any I/O.

    ``fields`` is an event payload's ``fields`` (name -> JSON value; a
    lookup's value is the parent's remote id); the destination is
    ``destination_object`` or ``sobject``, names go through ``field_map``
    as in :func:`upsert_record`. Each problem reads ``object X is not
    installed``, ``field F: X has no field F`` or ``field F: value <reason>``
    (:func:`nexuscrm.fieldvalues.stored_value`), in field order. Raises
    nothing. Port of no seed function (the seed's mapping is not in 000_*).
    """
    name = destination_object or sobject
    obj = catalog.get(name)
    if obj is None or not obj.has_table:
        return [f"object {name} is not installed"]
    cols = _columns_cached(obj)
    mapping = {k.lower(): v for k, v in (field_map or {}).items()}
    problems: list[str] = []
    for raw_name, value in fields.items():
        try:
            spec = _field_target(obj, cols, mapping, str(raw_name))
        except FlowError as exc:
            problems.append(f"field {raw_name}: {exc}")
            continue
        if spec is not None:
            reason = value_problem(spec[0], value)
            if reason is not None:
                problems.append(f"field {raw_name}: value {reason}")
    return problems


def _resolve(prepared: _Prepared, lookup: Callable[[RemoteIdentity], str | None]) -> dict[str, Any]:
    """Column values with lookups resolved; raises the event's FlowError, if any."""
    values = dict(prepared.values)
    for col, parent, message in prepared.refs:
        if parent is None:
            values[col] = None
            continue
        record = lookup(parent)
        if record is None:
            raise DependencyUnresolved(message, parent)
        values[col] = record
    if prepared.error is not None:
        raise prepared.error
    return values


def _link_row(ident: RemoteIdentity, record_id: str, now: dt.datetime) -> dict[str, Any]:
    return {
        "ConnectorOwnerKey": ident.owner_key,
        "Namespace": ident.namespace,
        "DestinationObject": ident.destination_object,
        "RemoteId": ident.remote_id,
        "RecordId": record_id,
        "CreatedDate": now,
        "LastModifiedDate": now,
    }


def upsert_record(
    conn: Connection,
    catalog: Catalog,
    *,
    owner_key: str,
    namespace: str,
    payload: dict[str, Any],
    destination_object: str | None = None,
    field_map: dict[str, str] | None = None,
    created: list[RemoteIdentity] | None = None,
) -> tuple[str, RemoteIdentity]:
    """Run the reference flow for one event; return (record id, its remote identity).

    payload: ``{"sobject": str, "remote_id": str, "fields": {name: value},
    "references": {lookup field: remote id of the parent}}``; a lookup field
    may be given in either (``references`` wins); one named under
    ``references`` that is no lookup fails ``mapping``. Field names are
    matched case-insensitively against the destination's columns (after
    ``field_map``); ``Name`` falls back to FirstName + LastName, then the
    remote id. Raises ``FlowError``: ``mapping`` (unknown object or field;
    not retriable), ``value-invalid`` (a value that does not fit its field,
    :func:`nexuscrm.fieldvalues.stored_value`, or a remote id over 128
    characters; not retriable, nothing written), ``DependencyUnresolved`` (a lookup's parent
    has no remote link yet; retriable) or ``IdentityConflict`` (its link names
    a record that is gone; not retriable). A newly finalized remote link is
    appended to ``created`` (the caller wakes its waiters after commit).
    :func:`upsert_records` is the same for many events at once.
    """
    prepared = _prepare(
        catalog,
        owner_key=owner_key,
        namespace=namespace,
        payload=payload,
        destination_object=destination_object,
        field_map=field_map,
    )

    def lookup(parent: RemoteIdentity) -> str | None:
        record = find_link(conn, parent)
        if record is not None and missing_linked_records(conn, catalog, {parent: record}):
            raise IdentityConflict(parent, record)
        return record

    values = _resolve(prepared, lookup)
    ident = prepared.ident
    table = record_table(conn, prepared.obj.table_name, catalog.version)
    now = utcnow()
    record_id = find_link(conn, ident)
    if record_id is not None:
        conn.execute(
            table.update().where(table.c.Id == record_id).values(**values, LastModifiedDate=now)
        )
    else:
        record_id = uuid.uuid4().hex[:18]
        conn.execute(
            table.insert().values(
                Id=record_id, CreatedDate=now, LastModifiedDate=now, IsDeleted=False, **values
            )
        )
        # Finalize the record's own remote link in the same transaction.
        conn.execute(t.connector_remote_link.insert().values(**_link_row(ident, record_id, now)))
        if created is not None:
            created.append(ident)
    return record_id, ident


_IN_CHUNK = 500


def find_links(conn: Connection, idents: Iterable[RemoteIdentity]) -> dict[RemoteIdentity, str]:
    """Record ids linked to ``idents`` (absent ones left out): one query per object."""
    rl = t.connector_remote_link
    groups: dict[tuple[str, str, str], set[str]] = {}
    for ident in idents:
        groups.setdefault((ident.owner_key, ident.namespace, ident.destination_object), set()).add(
            ident.remote_id
        )
    out: dict[RemoteIdentity, str] = {}
    for (owner, ns, obj), remote_ids in groups.items():
        ordered = sorted(remote_ids)
        for start in range(0, len(ordered), _IN_CHUNK):
            rows = conn.execute(
                select(rl.c.RemoteId, rl.c.RecordId).where(
                    rl.c.ConnectorOwnerKey == owner,
                    rl.c.Namespace == ns,
                    rl.c.DestinationObject == obj,
                    rl.c.RemoteId.in_(ordered[start : start + _IN_CHUNK]),
                )
            ).all()
            for remote_id, record_id in rows:
                out[RemoteIdentity(owner, ns, obj, remote_id)] = record_id
    return out


def upsert_records(
    conn: Connection,
    catalog: Catalog,
    requests: Sequence[UpsertRequest],
    created: list[RemoteIdentity] | None = None,
) -> list[tuple[str, RemoteIdentity] | FlowError]:
    """:func:`upsert_record` for many events in the caller's transaction, batched.

    The result is parallel to ``requests``: ``(record id, identity)`` or the
    event's ``FlowError`` (that event wrote nothing). Same outcome as running
    :func:`upsert_record` on each event in order — an event sees the links
    and records of the events before it — in a few statements: one link
    lookup per destination object, one multi-row INSERT per (table, column
    set) for new records, one UPDATE per changed record, one INSERT of the
    new links. A database error fails the whole call (the caller rolls back).
    The identities of the new links are appended to ``created``.
    """
    prepared: list[_Prepared | FlowError] = []
    wanted: set[RemoteIdentity] = set()
    for req in requests:
        try:
            p = _prepare(
                catalog,
                owner_key=req.owner_key,
                namespace=req.namespace,
                payload=req.payload,
                destination_object=req.destination_object,
                field_map=req.field_map,
            )
        except FlowError as exc:
            prepared.append(exc)
            continue
        prepared.append(p)
        wanted.add(p.ident)
        wanted.update(parent for _c, parent, _m in p.refs if parent is not None)
    links = find_links(conn, wanted) if wanted else {}
    parents = {
        parent
        for p in prepared
        if not isinstance(p, FlowError)
        for _c, parent, _m in p.refs
        if parent is not None and parent in links
    }
    dangling = missing_linked_records(conn, catalog, {i: links[i] for i in parents})
    now = utcnow()
    tables: dict[str, Table] = {}
    inserts: dict[str, tuple[str, dict[str, Any]]] = {}  # record id -> (table, row)
    updates: dict[str, tuple[str, dict[str, Any]]] = {}  # record id -> (table, values)
    new_links: list[dict[str, Any]] = []
    out: list[tuple[str, RemoteIdentity] | FlowError] = []
    for entry in prepared:
        if isinstance(entry, FlowError):
            out.append(entry)
            continue
        p = entry

        def lookup(parent: RemoteIdentity) -> str | None:
            if parent in dangling:
                raise IdentityConflict(parent, links[parent])
            return links.get(parent)

        try:
            values = _resolve(p, lookup)
        except FlowError as exc:
            out.append(exc)
            continue
        name = p.obj.table_name
        if name not in tables:
            tables[name] = record_table(conn, name, catalog.version)
        record_id = links.get(p.ident)
        if record_id is None:
            record_id = uuid.uuid4().hex[:18]
            links[p.ident] = record_id
            inserts[record_id] = (
                name,
                {
                    "Id": record_id,
                    "CreatedDate": now,
                    "LastModifiedDate": now,
                    "IsDeleted": False,
                    **values,
                },
            )
            new_links.append(_link_row(p.ident, record_id, now))
            if created is not None:
                created.append(p.ident)
        elif record_id in inserts:  # created earlier in this batch: fold the update in
            inserts[record_id][1].update(values, LastModifiedDate=now)
        else:
            pending = updates.setdefault(record_id, (name, {}))[1]
            pending.update(values, LastModifiedDate=now)
        out.append((record_id, p.ident))
    # Group rows by (table, column set): an executemany needs one shape, and
    # SQLAlchemy turns an INSERT executemany into multi-row VALUES batches.
    insert_groups: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for name, row in inserts.values():
        insert_groups.setdefault((name, tuple(sorted(row))), []).append(row)
    for (name, _cols), rows in insert_groups.items():
        conn.execute(tables[name].insert(), rows)
    update_groups: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for record_id, (name, values) in updates.items():
        update_groups.setdefault((name, tuple(sorted(values))), []).append(
            {"_record_id": record_id, **values}
        )
    for (name, _cols), rows in update_groups.items():
        table = tables[name]
        conn.execute(table.update().where(table.c.Id == bindparam("_record_id")), rows)
    if new_links:
        conn.execute(t.connector_remote_link.insert(), new_links)
    return out


def post_webhook(
    client: httpx.Client,
    url: str,
    event: dict[str, Any],
    *,
    timeout_s: float | None,
    idempotency_key: str | None = None,
) -> int:
    """POST ``event`` as JSON to ``url``; return the HTTP status.

    ``idempotency_key`` (the work id: equal on every attempt of one item, a
    repeat after a crash included) goes as the ``Idempotency-Key`` header:
    the POST is at-least-once, the key lets the receiver drop a repeat.
    Raises ``FlowError``: ``webhook-http-<status>`` (retriable for 429 and 5xx),
    ``webhook-timeout`` and ``webhook-transport`` (retriable).
    """
    headers = {IDEMPOTENCY_HEADER: idempotency_key} if idempotency_key else None
    try:
        response = client.post(url, json=event, timeout=timeout_s, headers=headers)
    except httpx.TimeoutException as exc:
        raise FlowError("webhook-timeout", f"POST {url} timed out", retriable=True) from exc
    except httpx.TransportError as exc:
        raise FlowError("webhook-transport", f"POST {url}: {exc}", retriable=True) from exc
    if response.status_code >= 300:
        retriable = response.status_code == 429 or response.status_code >= 500
        raise FlowError(
            f"webhook-http-{response.status_code}",
            f"POST {url} answered {response.status_code}",
            retriable=retriable,
        )
    return response.status_code
