"""Verify: metadata against physical tables, views readable and built as the
formula compiler builds them now (``viewdefs``), indexes present,
active packs' payload hashes. Any finding fails the apply (port of the seed's
readiness ``Verify``; read-only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Boolean,
    Date,
    DateTime,
    Engine,
    Float,
    Integer,
    Numeric,
    String,
    Text,
    Time,
    inspect,
    select,
    text,
)
from sqlalchemy.types import TypeEngine

from nexuscrm import catalog
from nexuscrm.controlplane import viewdefs
from nexuscrm.controlplane.indexes import standard_indexes
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import index_names, quote
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.db.dialect import view_names as physical_views
from nexuscrm.formulas import view_name
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.model import (
    NUMERIC_TYPES,
    REFERENCE_TYPES,
    TEXT_TYPES,
    FieldSpec,
    FieldType,
    PackManifest,
)


def verify(
    engine: Engine,
    expected_hashes: dict[str, str] | None = None,
    *,
    check_indexes: bool = True,
    check_view_definitions: bool = True,
) -> list[str]:
    """Return findings (empty when converged); each names the object, view, index or pack.

    ``expected_hashes`` maps pack name -> payload hash this apply planned;
    each must be installed ``active`` with exactly that hash.
    ``check_indexes=False`` is VerifyL0: InitL0 builds no broad indexes.
    ``check_view_definitions=False`` (a deferred formula-view rebuild: the
    views are owed, not rebuilt) checks views exist and are readable only.
    """
    findings: list[str] = []
    cat = catalog.CACHE.get(engine)
    tables = physical_tables(engine)
    views = physical_views(engine)
    insp = inspect(engine)
    missing_tables = set(t.system_metadata.tables) - tables
    findings += [f"system table {n} is missing" for n in sorted(missing_tables)]
    for key in sorted(cat.objects):
        obj = cat.objects[key]
        if not obj.has_table:
            continue
        if obj.table_name not in tables:
            findings.append(f"object {obj.api_name}: table {obj.table_name} is missing")
            continue
        cols = {c["name"].lower(): c["type"] for c in insp.get_columns(obj.table_name)}
        for f in obj.fields:
            for col in f.column_names():
                if col.lower() not in cols:
                    findings.append(f"field {obj.api_name}.{f.api_name}: column {col} is missing")
                elif not _type_fits(f, cols[col.lower()]):
                    findings.append(
                        f"field {obj.api_name}.{f.api_name}: column {col} is "
                        f"{cols[col.lower()]}, metadata says {f.type}"
                    )
        vname = view_name(obj.api_name)
        if vname not in views:
            findings.append(f"object {obj.api_name}: view {vname} is missing")
        else:
            try:
                with engine.connect() as conn:
                    conn.execute(text(f"SELECT * FROM {quote(conn, vname)} LIMIT 1")).fetchall()
                    # Readable is not enough: it must be what the compiler builds now.
                    wrong = (
                        viewdefs.check(conn, vname, obj.spec(), obj.table_name, cat)
                        if check_view_definitions
                        else None
                    )
                if wrong is not None:
                    findings.append(f"object {obj.api_name}: {wrong}")
            except Exception as exc:
                findings.append(f"object {obj.api_name}: view {vname} is not readable: {exc}")
    have: dict[str, set[str]] = {}
    for spec in standard_indexes(engine) if check_indexes else []:
        if spec.table not in have:
            have[spec.table] = index_names(engine, spec.table)
        if spec.name not in have[spec.table]:
            findings.append(f"index {spec.name} on {spec.table} is missing")
    findings += verify_packs(engine, expected_hashes or {})
    return findings


def _type_fits(field: FieldSpec, column_type: TypeEngine[Any]) -> bool:
    """Whether a reflected column can hold the field's values (same type family).

    Loose on purpose: dialects reflect BOOLEAN as TINYINT and DECIMAL/INTEGER
    variously; what matters is text vs number vs date/time.
    """
    t_ = field.type
    if t_ in TEXT_TYPES or t_ in REFERENCE_TYPES:
        return isinstance(column_type, String | Text)
    if t_ in NUMERIC_TYPES or t_ == FieldType.Location:
        return isinstance(column_type, Numeric | Integer | Float)
    if t_ == FieldType.Checkbox:
        return isinstance(column_type, Boolean | Integer | Numeric)
    if t_ == FieldType.DateTime:
        return isinstance(column_type, DateTime)
    if t_ == FieldType.Date:
        return isinstance(column_type, Date) and not isinstance(column_type, DateTime)
    if t_ == FieldType.Time:
        return isinstance(column_type, Time)
    return True


def verify_packs(engine: Engine, expected_hashes: dict[str, str]) -> list[str]:
    """Active packs' stored payload hashes match their payload and this apply's plan."""
    findings: list[str] = []
    with engine.connect() as conn:
        rows = {
            r.Name: r
            for r in conn.execute(
                select(
                    t.installed_pack.c.Name,
                    t.installed_pack.c.Status,
                    t.installed_pack.c.PayloadHash,
                    t.installed_pack.c.Payload,
                )
            ).all()
        }
    for name, row in sorted(rows.items()):
        if row.Status != "active":
            if name in expected_hashes:
                findings.append(f"pack {name} is {row.Status}, not active")
            continue
        if row.Payload:
            actual = payload_hash(PackManifest.model_validate_json(row.Payload))
            if actual != row.PayloadHash:
                findings.append(
                    f"pack {name}: stored payload hashes to {actual[:12]}, "
                    f"row says {row.PayloadHash[:12]}"
                )
    for name, digest in sorted(expected_hashes.items()):
        found = rows.get(name)
        if found is None:
            findings.append(f"pack {name} is not installed")
        elif found.PayloadHash != digest:
            findings.append(
                f"pack {name}: installed hash {found.PayloadHash[:12]} != planned {digest[:12]}"
            )
    return findings


def expected(packs: Sequence[PackManifest]) -> dict[str, str]:
    """Pack name -> payload hash for a plan."""
    return {p.name: payload_hash(p) for p in packs}
