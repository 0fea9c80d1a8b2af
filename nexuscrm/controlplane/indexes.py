"""EnsureIndexes: the standard indexes on business tables, idempotent and resumable.

Port of the seed's ``EnsureStandardIndexes``: Name, CreatedDate, every lookup
column, external ids (and unique fields as unique indexes). Index names are
deterministic, so existing ones are recognised and skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, Index, MetaData, Table, inspect

from nexuscrm import catalog
from nexuscrm.controlplane import lease
from nexuscrm.db.dialect import index_names
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.packs.model import REFERENCE_TYPES


@dataclass(frozen=True)
class IndexSpec:
    """One standard index: table, deterministic name, columns, uniqueness."""

    table: str
    name: str
    columns: tuple[str, ...]
    unique: bool = False


def index_name(table: str, column: str, unique: bool = False) -> str:
    """``ix_<table>_<column>`` (``ux_`` when unique), hashed down to 64 characters."""
    name = f"{'ux' if unique else 'ix'}_{table}_{column}"
    if len(name) <= 64:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:55]}_{digest}"


def standard_indexes(engine: Engine) -> list[IndexSpec]:
    """Every standard index the catalog calls for, in a stable order."""
    cat = catalog.CACHE.get(engine)
    present = physical_tables(engine)
    insp = inspect(engine)
    out: list[IndexSpec] = []
    for key in sorted(cat.objects):
        obj = cat.objects[key]
        if not obj.has_table or obj.table_name not in present:
            continue
        cols = {c["name"] for c in insp.get_columns(obj.table_name)}
        wanted: list[tuple[str, bool]] = [("Name", False), ("CreatedDate", False)]
        for f in obj.fields:
            if f.type in REFERENCE_TYPES or f.external_id:
                wanted.append((f.api_name, False))
            elif f.unique and f.is_stored and len(f.column_names()) == 1:
                wanted.append((f.api_name, True))
        seen: set[str] = set()
        for col, unique in wanted:
            if col not in cols or col in seen:
                continue
            seen.add(col)
            out.append(
                IndexSpec(obj.table_name, index_name(obj.table_name, col, unique), (col,), unique)
            )
    return out


@dataclass(frozen=True)
class IndexResult:
    """Indexes created now, indexes already present, total standard indexes."""

    created: int
    existing: int
    total: int


def ensure_indexes(
    engine: Engine,
    epoch: int | None = None,
    *,
    start_at: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
) -> IndexResult:
    """Create missing standard indexes, starting at position ``start_at``.

    ``progress(done, total, index_name)`` runs after each index (the activity
    heartbeats it, so a retry passes ``start_at=done`` and resumes). Raises
    ``LeaseLostError`` when fenced out; a unique index over duplicate data
    raises the database's integrity error (fatal: the data must be fixed).
    """
    specs = standard_indexes(engine)
    created = existing = 0
    have: dict[str, set[str]] = {}
    for i, spec in enumerate(specs):
        if i < start_at:
            existing += 1
            continue
        if spec.table not in have:
            have[spec.table] = index_names(engine, spec.table)
        if spec.name in have[spec.table]:
            existing += 1
        else:
            with engine.begin() as conn:
                lease.require(conn, epoch)
                table = Table(spec.table, MetaData(), autoload_with=conn)
                Index(spec.name, *(table.c[c] for c in spec.columns), unique=spec.unique).create(
                    conn
                )
            have[spec.table].add(spec.name)
            created += 1
        if progress is not None:
            progress(i + 1, len(specs), spec.name)
    return IndexResult(created, existing, len(specs))
