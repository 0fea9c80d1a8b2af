"""ApplyMetadata: system-table DDL and managed metadata rows for system objects.

Port of the seed's ``ApplyMetadata`` (EnsureL0SchemaDDL, reconnect after DDL,
InitializeSchema). Idempotent: a converged database sees no writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Engine, inspect

from nexuscrm import catalog
from nexuscrm.controlplane import lease
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import after_ddl, index_names, quote, render_type, table_names
from nexuscrm.db.session import ensure_session_user_function
from nexuscrm.log import log
from nexuscrm.packs.model import STANDARD_COLUMNS, FieldSpec


@dataclass(frozen=True)
class MetadataResult:
    """Tables created and metadata rows written by one ApplyMetadata."""

    tables_created: int
    rows_written: int


def ensure_system_schema(engine: Engine) -> int:
    """Create missing ``_System_*`` tables and add their missing columns.

    Port of EnsureL0SchemaDDL plus the seed's managed-column reconcile: a
    system table an older release created lacks the columns this release
    added; each is added with an idempotent ``ALTER TABLE ... ADD COLUMN``
    (SQLite and the MySQL family). Returns how many tables and columns were
    created; reconnects after DDL (TiDB caches the schema per session).
    """
    before = table_names(engine)
    t.system_metadata.create_all(engine, checkfirst=True)
    created = len({tb.name for tb in t.SYSTEM_TABLES} - before)
    with engine.begin() as conn:
        created += add_missing_system_columns(conn)
        # Only tables an older release created can lack an index: create_all
        # just made the others with all of theirs.
        created += add_missing_system_indexes(conn, only=before)
    ensure_session_user_function(engine)
    # TiDB caches the schema per session: reconnect after DDL, as the seed does.
    after_ddl(engine)
    return created


def add_missing_system_columns(conn: Connection) -> int:
    """Add every column of ``nexuscrm.db.tables`` an existing system table lacks.

    Idempotent (a converged database sees no DDL). A NOT NULL column with a
    scalar default is added NOT NULL DEFAULT that value; any other column is
    added nullable (SQLite cannot add a NOT NULL column without a default).
    Returns how many columns were added.
    """
    changed = 0
    existing_tables = table_names(conn)
    for table in t.SYSTEM_TABLES:
        if table.name not in existing_tables:
            continue
        have = {c["name"].lower() for c in inspect(conn).get_columns(table.name)}
        for col in table.columns:
            if col.name.lower() in have:
                continue
            ddl = f"ALTER TABLE {quote(conn, table.name)} ADD COLUMN {quote(conn, col.name)} " + (
                render_type(conn, col.type)
            )
            if col.default is not None and getattr(col.default, "is_scalar", False):
                default = col.default.arg  # type: ignore[attr-defined]
                ddl += f" NOT NULL DEFAULT {_sql_literal(default)}" if not col.nullable else ""
            conn.exec_driver_sql(ddl)
            changed += 1
            log.info("added managed column", table=table.name, column=col.name)
    return changed


def add_missing_system_indexes(conn: Connection, only: set[str] | None = None) -> int:
    """Create every index of ``nexuscrm.db.tables`` an existing system table lacks.

    A table an older release created keeps the indexes it had; a release that
    adds one (e.g. ``ix_ConnectorWorkItem_Target``, which the claim's
    target-lane probe reads) needs it on upgrade too. Indexes are matched by
    name. ``only``: the table names to look at (default: every existing
    system table). Idempotent; returns how many were created.
    """
    created = 0
    existing_tables = table_names(conn) if only is None else only
    for table in t.SYSTEM_TABLES:
        if table.name not in existing_tables or not table.indexes:
            continue
        have = {n.lower() for n in index_names(conn, table.name)}
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            if str(index.name).lower() in have:
                continue
            index.create(conn)
            created += 1
            log.info("added managed index", table=table.name, index=index.name)
    return created


def _sql_literal(v: object) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int | float):
        return str(v)
    return "'" + str(v).replace("'", "''") + "'"


def system_object_rows() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Managed ``_System_Object`` / ``_System_Field`` rows describing the system tables."""
    objects: list[dict[str, object]] = []
    fields: list[dict[str, object]] = []
    std = {c.lower() for c in STANDARD_COLUMNS}
    for table in t.SYSTEM_TABLES:
        objects.append(
            {
                **catalog.object_row_raw(table.name, table.name, "system", pack=""),
            }
        )
        for col in table.columns:
            if col.name.lower() in std:
                continue
            spec = FieldSpec(api_name=col.name, type=catalog.infer_field_type(col.type))
            row = catalog.field_row(table.name, spec, pack="")
            row["Createable"] = row["Updateable"] = False
            fields.append(row)
    return objects, fields


def apply_metadata(engine: Engine, epoch: int | None = None) -> MetadataResult:
    """Run ApplyMetadata: DDL first, then the managed rows in one transaction.

    Raises ``LeaseLostError`` when ``epoch`` is stale (before any write).
    """
    with engine.connect() as conn:
        if t.controlplane_lease.name in table_names(conn):
            lease.require(conn, epoch)
    created = ensure_system_schema(engine)
    objects, fields = system_object_rows()
    with engine.begin() as conn:
        lease.require(conn, epoch)
        written = catalog.sync_rows(conn, t.object_meta, objects)
        written += catalog.sync_rows(conn, t.field_meta, fields)
        if written or catalog.read_version(conn) == 0:
            catalog.bump_version(conn)
    log.info("apply-metadata", tables_created=created, rows_written=written)
    return MetadataResult(created, written)
