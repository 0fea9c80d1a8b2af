"""Formula-view definitions: what the compiler builds now vs what the database holds.

``rebuild-derived`` records, per view, the SHA-256 of the ``CREATE VIEW``
statement the formula compiler built and the definition the database stored
for it (read back right after the CREATE: ``sqlite_master.sql`` on SQLite,
``information_schema.VIEWS.VIEW_DEFINITION`` on the MySQL family, which
rewrites the SQL it is given). Verify then finds a view that is readable but
wrong (say, replaced by ``SELECT 1``): its live definition differs from the
recorded one, or the recorded statement is not what the compiler builds now.
On SQLite, which keeps the statement verbatim, the live definition is also
compared with the compiler's statement directly (whitespace and quoting
normalized).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, Table, inspect, select, text
from sqlalchemy.sql import Select

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import dialect_name, upsert
from nexuscrm.formulas import build_view_select
from nexuscrm.formulas.view import CreateView


def create_statement(bind: Connection | Engine, name: str, view_select: Select[Any]) -> str:
    """The ``CREATE VIEW name AS ...`` statement (literals inlined) for this dialect."""
    return str(CreateView(name, view_select).compile(dialect=bind.dialect))


def source_hash(statement: str) -> str:
    """SHA-256 hex of a normalized ``CREATE VIEW`` statement."""
    return hashlib.sha256(normalize(statement).encode()).hexdigest()


def normalize(sql: str) -> str:
    """Whitespace collapsed, identifier quotes (`` ` `` and ``"``) dropped, lower-cased."""
    return re.sub(r"\s+", " ", sql.replace("`", "").replace('"', "")).strip().lower()


def live_definition(conn: Connection, name: str) -> str | None:
    """The database's definition of view ``name``; ``None`` when there is no such view."""
    if dialect_name(conn) == "sqlite":
        query = "SELECT sql FROM sqlite_master WHERE type = 'view' AND name = :n"
    else:
        query = (
            "SELECT VIEW_DEFINITION FROM information_schema.VIEWS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :n"
        )
    value = conn.execute(text(query), {"n": name}).scalar_one_or_none()
    return None if value is None else str(value)


def record(conn: Connection, name: str, view_select: Select[Any]) -> None:
    """After ``CREATE [OR REPLACE] VIEW``: store the compiler hash and the live definition."""
    upsert(
        conn,
        t.derived_view,
        [
            {
                "ViewName": name,
                "SourceHash": source_hash(create_statement(conn, name, view_select)),
                "Definition": live_definition(conn, name),
                "LastModifiedDate": utcnow(),
            }
        ],
        ["SourceHash", "Definition", "LastModifiedDate"],
    )


def check(
    conn: Connection,
    name: str,
    object_spec: Any,
    table_name: str,
    cat: catalog.Catalog | None = None,
) -> str | None:
    """A finding when view ``name`` is not what the compiler would build now, else ``None``.

    ``object_spec``: the object's ``ObjectSpec``; ``table_name``: its table;
    ``cat``: the catalog the view's cross-object references resolve in (read
    from ``conn`` when not given).
    """
    live = live_definition(conn, name)
    if live is None:
        return f"view {name} is missing"
    # The computed fields the view holds: rebuild-derived leaves out a field
    # the database cannot evaluate (a backend limit, reported there); the
    # recorded hash and definition below still catch any other difference.
    held = {c["name"].lower() for c in inspect(conn).get_columns(name)}
    only = {
        f.api_name.lower()
        for f in object_spec.fields
        if (f.is_formula or f.summary is not None) and f.api_name.lower() in held
    }
    table = Table(table_name, MetaData(), autoload_with=conn)
    context = catalog.formula_context(conn, cat if cat is not None else catalog.load_catalog(conn))
    view_select, _problems = build_view_select(
        object_spec, table, dialect_name(conn), context, only
    )
    statement = create_statement(conn, name, view_select)
    if dialect_name(conn) == "sqlite" and normalize(live) != normalize(statement):
        return f"view {name}: its definition is not what the formula compiler builds now"
    rec = conn.execute(
        select(t.derived_view.c.SourceHash, t.derived_view.c.Definition).where(
            t.derived_view.c.ViewName == name
        )
    ).first()
    if rec is None:
        return f"view {name}: no recorded definition (not built by rebuild-derived)"
    if rec.SourceHash != source_hash(statement):
        return f"view {name}: built from other formulas than the compiler builds now"
    if normalize(rec.Definition or "") != normalize(live):
        return f"view {name}: its definition was changed after rebuild-derived built it"
    return None
