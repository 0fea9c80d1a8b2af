"""Inbound flows: what a route runs for one claimed event.

``upsert_record`` (the reference flow) maps the event's fields onto the
destination object, resolves lookups through the remote-link table, upserts
the record by its remote id and finalizes the record's own remote link, all
in the caller's transaction. ``webhook`` POSTs the event to a URL.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import httpx
from sqlalchemy import Connection, MetaData, Table, select

from nexuscrm.clock import utcnow
from nexuscrm.controlplane.catalog import Catalog, CatalogObject
from nexuscrm.db import tables as t
from nexuscrm.errors import NexusError
from nexuscrm.packs.model import NUMERIC_TYPES, REFERENCE_TYPES, FieldSpec, FieldType


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


def _coerce(obj: str, f: FieldSpec, column: str, value: Any) -> Any:
    """Convert one JSON value to what the column stores; FlowError('mapping') when it cannot."""
    if value is None or value == "":
        return None
    try:
        if f.type in NUMERIC_TYPES or f.type == FieldType.Location:
            return Decimal(str(value))
        if f.type == FieldType.Checkbox:
            if isinstance(value, bool):
                return value
            return str(value).strip().lower() in {"true", "1", "yes"}
        if f.type == FieldType.Date:
            return dt.date.fromisoformat(str(value)[:10])
        if f.type == FieldType.DateTime:
            text = str(value).replace("Z", "+00:00")
            parsed = dt.datetime.fromisoformat(text)
            if parsed.tzinfo is not None:
                parsed = parsed.astimezone(dt.UTC).replace(tzinfo=None)
            return parsed
        if f.type == FieldType.Time:
            return dt.time.fromisoformat(str(value).rstrip("Z"))
        if f.type == FieldType.MultiselectPicklist and isinstance(value, list):
            return ";".join(str(v) for v in value)
    except (ValueError, InvalidOperation) as exc:
        raise FlowError(
            "mapping", f"{obj}.{column}: value {value!r} is not a valid {f.type}", retriable=False
        ) from exc
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _columns(obj: CatalogObject) -> dict[str, tuple[FieldSpec, str]]:
    out: dict[str, tuple[FieldSpec, str]] = {}
    for f in obj.fields:
        for col in f.column_names():
            out[col.lower()] = (f, col)
    return out


def upsert_record(
    conn: Connection,
    catalog: Catalog,
    *,
    owner_key: str,
    namespace: str,
    payload: dict[str, Any],
    destination_object: str | None = None,
    field_map: dict[str, str] | None = None,
) -> tuple[str, RemoteIdentity]:
    """Run the reference flow for one event; return (record id, its remote identity).

    payload: ``{"sobject": str, "remote_id": str, "fields": {name: value},
    "references": {lookup field: remote id of the parent}}``. Field names are
    matched case-insensitively against the destination's columns (after
    ``field_map``); ``Name`` falls back to FirstName + LastName, then the
    remote id. Raises ``FlowError``: ``mapping`` (unknown object, field or
    bad value; not retriable) or ``dependency-unresolved`` (a lookup's parent
    has no remote link yet; retriable).
    """
    sobject = destination_object or payload.get("sobject")
    remote_id = payload.get("remote_id")
    if not sobject or not remote_id:
        raise FlowError("mapping", "event payload lacks sobject or remote_id", retriable=False)
    obj = catalog.get(str(sobject))
    if obj is None or not obj.has_table:
        raise FlowError(
            "mapping", f"destination object {sobject} is not installed", retriable=False
        )
    cols = _columns(obj)
    mapping: dict[str, str] = {k.lower(): v for k, v in (field_map or {}).items()}
    values: dict[str, Any] = {}
    fields = dict(payload.get("fields") or {})
    references = {k.lower(): v for k, v in (payload.get("references") or {}).items()}
    for raw_name, value in fields.items():
        name: str = mapping.get(str(raw_name).lower(), str(raw_name))
        if name.lower() in {"name", "ownerid"}:
            values["Name" if name.lower() == "name" else "OwnerId"] = value
            continue
        if name.lower() in {"id", "createddate", "lastmodifieddate", "isdeleted"}:
            continue  # system columns are the CRM's own
        spec = cols.get(name.lower())
        if spec is None:
            raise FlowError(
                "mapping", f"{obj.api_name} has no field {name} (event field {raw_name})",
                retriable=False,
            )  # fmt: skip
        f, col = spec
        if f.type in REFERENCE_TYPES:
            parent_remote = references.get(raw_name.lower(), value)
            if parent_remote in (None, ""):
                values[col] = None
                continue
            parent = RemoteIdentity(owner_key, namespace, str(f.reference_to), str(parent_remote))
            record = find_link(conn, parent)
            if record is None:
                raise FlowError(
                    "dependency-unresolved",
                    f"{obj.api_name}.{col}: parent {f.reference_to} {parent_remote} "
                    "is not linked yet",
                    retriable=True,
                )
            values[col] = record
            continue
        values[col] = _coerce(obj.api_name, f, col, value)
    if not values.get("Name"):
        first, last = fields.get("FirstName"), fields.get("LastName")
        values["Name"] = " ".join(str(p) for p in (first, last) if p) or str(remote_id)
    ident = RemoteIdentity(owner_key, namespace, obj.api_name, str(remote_id))
    table = Table(obj.table_name, MetaData(), autoload_with=conn)
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
        conn.execute(
            t.connector_remote_link.insert().values(
                ConnectorOwnerKey=owner_key,
                Namespace=namespace,
                DestinationObject=obj.api_name,
                RemoteId=str(remote_id),
                RecordId=record_id,
                CreatedDate=now,
                LastModifiedDate=now,
            )
        )
    return record_id, ident


def post_webhook(
    client: httpx.Client, url: str, event: dict[str, Any], *, timeout_s: float | None
) -> int:
    """POST ``event`` as JSON to ``url``; return the HTTP status.

    Raises ``FlowError``: ``webhook-http-<status>`` (retriable for 429 and 5xx),
    ``webhook-timeout`` and ``webhook-transport`` (retriable).
    """
    try:
        response = client.post(url, json=event, timeout=timeout_s)
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
