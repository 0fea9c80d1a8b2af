"""Apply-side of Salesforce DX extras: customizations of other packs' fields, and
custom metadata records (the rows of an ``__mdt`` table).

Both write only what differs, so a converged database sees no writes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import Boolean, Connection, Date, DateTime, Numeric, Table, select, update
from sqlalchemy.types import TypeEngine

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import dialect_name, upsert
from nexuscrm.errors import PackError
from nexuscrm.packs.model import FieldCustomization, ObjectSpec, RecordSpec


def merge_customizations(
    conn: Connection, object_api: str, merges: Sequence[FieldCustomization]
) -> int:
    """Merge customizations into the ``_System_Field`` rows other packs own.

    A non-empty label or description replaces the row's; picklist values not
    yet in the row are appended after its own. A row that changes is marked
    ``IsCustomized`` (so its pack's reapply keeps the merge, as for an admin's
    edit); a customization that changes nothing writes nothing. Returns rows
    written.
    """
    written = 0
    fm = t.field_meta
    for c in merges:
        row = (
            conn.execute(select(fm).where(fm.c.Id == catalog.field_id(object_api, c.api_name)))
            .mappings()
            .first()
        )
        if row is None:
            continue
        values: dict[str, Any] = {}
        if c.label and c.label != row["Label"]:
            values["Label"] = c.label
        if c.description and c.description != (row["Description"] or ""):
            values["Description"] = c.description
        if c.picklist_values:
            old = json.loads(row["PicklistValues"] or "[]")
            merged = old + [v for v in c.picklist_values if v not in old]
            if merged != old:
                values["PicklistValues"] = json.dumps(merged)
        if values:
            conn.execute(
                update(fm)
                .where(fm.c.Id == row["Id"])
                .values(**values, IsCustomized=True, LastModifiedDate=utcnow())
            )
            written += 1
    return written


def record_id(object_api: str, developer_name: str) -> str:
    """Row ``Id`` of a custom metadata record: ``mdt_`` + 24 hex of sha256."""
    key = f"{object_api.lower()}.{developer_name.lower()}"
    return "mdt_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _convert(type_: TypeEngine[Any], raw: str | None, where: str) -> Any:
    if raw is None:
        return None
    try:
        if isinstance(type_, Boolean):
            return raw.strip().lower() == "true"
        if isinstance(type_, Numeric):
            value = Decimal(raw.strip())
            scale = type_.scale if type_.scale is not None else 0
            return value.quantize(Decimal(1).scaleb(-scale))
        if isinstance(type_, DateTime):
            return dt.datetime.fromisoformat(raw.strip().replace("Z", "+00:00")).replace(
                tzinfo=None
            )
        if isinstance(type_, Date):
            return dt.date.fromisoformat(raw.strip()[:10])
    except (InvalidOperation, ValueError) as exc:
        raise PackError(where, f"value {raw!r} does not fit the column: {exc}") from exc
    return raw


def _norm(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float | Decimal):
        return Decimal(str(v)).normalize()
    if isinstance(v, dt.datetime):
        return v.replace(tzinfo=None, microsecond=0).isoformat()
    if isinstance(v, dt.date):
        return v.isoformat()
    return v


def sync_records(conn: Connection, spec: ObjectSpec, records: Sequence[RecordSpec]) -> int:
    """Make the ``__mdt`` table of ``spec`` hold ``records``; return rows written.

    ``Id`` = :func:`record_id`, ``Name`` = the label, ``DeveloperName``,
    ``MasterLabel``; each value converted to its column's type (checkbox
    ``true``/``false``, numbers to the column's scale, dates). Rows of records
    no longer declared are kept (data is never deleted by apply).

    Raises ``PackError`` naming the record for a value its column cannot hold.
    """
    table: Table = catalog.object_table(spec, dialect_name(conn))
    columns = {c.name.lower(): c for c in table.columns}
    now = utcnow()
    desired: list[dict[str, Any]] = []
    for rec in records:
        row: dict[str, Any] = {
            "Id": record_id(spec.api_name, rec.developer_name),
            "Name": rec.label,
            "DeveloperName": rec.developer_name,
            "MasterLabel": rec.label,
            "IsDeleted": False,
        }
        for name, raw in rec.values.items():
            col = columns.get(name.lower())
            if col is None:
                continue  # a formula / summary field stores nothing
            where = f"{spec.api_name}.{rec.developer_name}.{col.name}"
            row[col.name] = _convert(col.type, raw, where)
        desired.append(row)
    keys = sorted({k for r in desired for k in r})
    for r in desired:
        for k in keys:
            r.setdefault(k, None)
    existing = {
        r["Id"]: r
        for r in conn.execute(
            select(table).where(table.c.Id.in_([r["Id"] for r in desired]))
        ).mappings()
    }
    changed = [
        r
        for r in desired
        if r["Id"] not in existing
        or any(_norm(existing[r["Id"]][k]) != _norm(v) for k, v in r.items())
    ]
    if changed:
        rows = [{**r, "CreatedDate": now, "LastModifiedDate": now} for r in changed]
        upsert(conn, table, rows, [k for k in keys if k != "Id"] + ["LastModifiedDate"])
    return len(changed)
