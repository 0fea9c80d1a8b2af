"""Test helpers: run workers, snapshot a database's converged state."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, inspect, select

from nexuscrm.db import tables as t
from nexuscrm.db.dialect import index_names


def snapshot(engine: Engine) -> dict[str, Any]:
    """Everything ApplyAll converges, minus timestamps and generated install ids.

    Tables with their columns and indexes, views, object/field metadata rows,
    installed packs (name, status, hash) and the ApplyAll marker status.
    """
    insp = inspect(engine)
    tables = {}
    for name in sorted(insp.get_table_names()):
        cols = sorted(c["name"] for c in insp.get_columns(name))
        tables[name] = {"columns": cols, "indexes": sorted(index_names(engine, name))}
    with engine.connect() as conn:
        objects = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.object_meta.c.Id,
                    t.object_meta.c.ApiName,
                    t.object_meta.c.TableType,
                    t.object_meta.c.PackName,
                    t.object_meta.c.Label,
                    t.object_meta.c.PluralLabel,
                )
            )
        )
        fields = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.field_meta.c.Id,
                    t.field_meta.c.ObjectId,
                    t.field_meta.c.FieldType,
                    t.field_meta.c.ColumnNames,
                    t.field_meta.c.PackName,
                    t.field_meta.c.Formula,
                )
            )
        )
        packs = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.installed_pack.c.Name,
                    t.installed_pack.c.Status,
                    t.installed_pack.c.PayloadHash,
                )
            )
        )
    return {
        "tables": tables,
        "views": sorted(insp.get_view_names()),
        "objects": objects,
        "fields": fields,
        "packs": packs,
    }
