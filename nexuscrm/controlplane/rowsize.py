"""Plan-time row-size check and the TEXT layout of wide objects on MySQL/MariaDB.

``plan-packs`` refuses, before anything is written, every object whose table
cannot exist on the configured MySQL-family database however its text
columns are laid out (:mod:`nexuscrm.db.rowsize`); objects of ordinary width
and wide objects of mostly text are laid out to fit instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, inspect
from sqlalchemy.types import TypeEngine

from nexuscrm import catalog
from nexuscrm.db import rowsize
from nexuscrm.db.dialect import dialect_name, table_names
from nexuscrm.errors import PackError
from nexuscrm.packs.model import FieldSpec, ObjectSpec, PackManifest


def _standard_types() -> list[TypeEngine[Any]]:
    return [c.type for c in catalog.standard_columns()]


def rowsize_text_columns(
    engine: Engine, spec: ObjectSpec, reflected: Mapping[str, TypeEngine[Any]]
) -> frozenset[str]:
    """Lower-cased columns of ``spec`` to add as ``TEXT`` to an existing table.

    Empty on databases other than MySQL-family. ``reflected`` maps the table's
    lower-cased column names to their reflected types.
    """
    if dialect_name(engine) != "mysql":
        return frozenset()
    return rowsize.mysql_text_columns(spec, _standard_types(), reflected)


def check_row_sizes(engine: Engine, cat: catalog.Catalog, plan: Sequence[PackManifest]) -> None:
    """Refuse a plan with an object whose table cannot fit a MySQL/MariaDB row.

    Each object is measured with every field the catalog and the plan's
    packs give it, and with the columns its table already has as they are.
    No-op on SQLite. Raises ``PackError`` (naming the pack, then every
    object that cannot fit with its byte count and the limit) when any
    cannot.
    """
    if dialect_name(engine) != "mysql":
        return
    fields: dict[str, dict[str, FieldSpec]] = {}
    specs: dict[str, ObjectSpec] = {}
    owner: dict[str, str] = {}
    for key, obj in cat.objects.items():
        if obj.has_table:
            spec = obj.spec()
            specs[key] = spec
            fields[key] = {f.api_name.lower(): f for f in spec.fields}
    for pack in plan:
        for o in pack.objects:
            if o.kind != "table":
                continue
            key = o.api_name.lower()
            if key not in specs or not o.extends:
                specs.setdefault(key, o)
            owner.setdefault(key, pack.name)
            owner[key] = owner[key] if o.extends else pack.name
            merged = fields.setdefault(key, {})
            for f in o.fields:
                merged[f.api_name.lower()] = f
    if not owner:
        return
    tables = {n.lower(): n for n in table_names(engine)}
    problems: list[tuple[str, str]] = []
    insp = inspect(engine)
    for key, pack_name in owner.items():
        spec = specs[key].model_copy(update={"fields": tuple(fields[key].values())})
        existing: dict[str, TypeEngine[Any]] = {}
        if key in tables:
            existing = {c["name"].lower(): c["type"] for c in insp.get_columns(tables[key])}
        problem = rowsize.row_size_problem(spec, _standard_types(), existing)
        if problem is not None:
            problems.append((pack_name, problem))
    if problems:
        packs = sorted({p for p, _ in problems})
        raise PackError(", ".join(packs), "; ".join(m for _, m in problems))
