"""ApplyMetadata: system-table DDL and managed metadata rows for system objects.

Port of the seed's ``ApplyMetadata`` (EnsureL0SchemaDDL, reconnect after DDL,
InitializeSchema). Idempotent: a converged database sees no writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from nexuscrm import catalog
from nexuscrm.controlplane import lease
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import after_ddl, table_names
from nexuscrm.log import log
from nexuscrm.packs.model import STANDARD_COLUMNS, FieldSpec


@dataclass(frozen=True)
class MetadataResult:
    """Tables created and metadata rows written by one ApplyMetadata."""

    tables_created: int
    rows_written: int


def ensure_system_schema(engine: Engine) -> int:
    """Create missing ``_System_*`` tables (port of EnsureL0SchemaDDL); return how many."""
    before = table_names(engine)
    t.system_metadata.create_all(engine, checkfirst=True)
    created = len({tb.name for tb in t.SYSTEM_TABLES} - before)
    # TiDB caches the schema per session: reconnect after DDL, as the seed does.
    after_ddl(engine)
    return created


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
