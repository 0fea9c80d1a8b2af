"""DDL rules every table follows, whatever the database's defaults.

MySQL family: every ``CREATE TABLE`` states ``DEFAULT CHARSET=utf8mb4`` and
the install's collation (:func:`choose_collation`, spoken on each connection
by :func:`speak_install_collation`). A database created with another default
character set (``latin1`` is the upstream MariaDB default) would otherwise get
tables that cannot store Japanese text or an emoji, and an event carrying one
would fail with a driver error. A charset alone takes the charset's own
default collation (``utf8mb4_general_ci`` on MariaDB), not the database's: in
a database created ``utf8mb4_unicode_ci`` the tables and views came out
``general_ci``, and a user's own table (the database's collation) joined to a
view failed with 1267 'Illegal mix of collations'. Every connection also
speaks the install's collation (``SET NAMES``), so an expression a view
computes (a ``CAST`` to text, a literal) has the collation of the columns
beside it. Registered on import (``nexuscrm.db`` imports this module), for the
``_System_*`` tables and the object tables of packs alike.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateTable

TABLE_CHARSET = "utf8mb4"

COLLATION_ATTR = "nexus_install_collation"
"""Attribute of an engine's dialect holding the install's collation (MySQL family),
set by :func:`speak_install_collation` on each new connection."""

ANCHOR_TABLE = "_System_Object"
"""The table whose collation is the install's once it exists: every later table,
the session function and each connection follow it."""

_COLLATION_NAME = re.compile(r"utf8mb4_[A-Za-z0-9_]+")

_INSTALL_COLLATION_SQL = (
    "SELECT (SELECT TABLE_COLLATION FROM information_schema.TABLES "
    f"WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{ANCHOR_TABLE}'), "
    "@@character_set_database, @@collation_database, "
    "(SELECT COLLATION_NAME FROM information_schema.COLLATIONS "
    "WHERE CHARACTER_SET_NAME = 'utf8mb4' AND IS_DEFAULT = 'Yes' LIMIT 1)"
)


def choose_collation(
    anchor: str | None,
    db_charset: str | None,
    db_collation: str | None,
    utf8mb4_default: str | None,
) -> str | None:
    """The install's utf8mb4 collation, from what the server reports.

    1. An existing install keeps its own: the collation of its ``_System_Object``
       table (``anchor``), so that the tables a later ApplyAll creates match the
       ones before it (an install made before this rule, ``general_ci`` tables in a
       ``unicode_ci`` database, stays ``general_ci`` throughout).
    2. A new install in a ``utf8mb4`` database takes the database's collation.
    3. Else (a ``latin1`` or ``utf8mb3`` database) utf8mb4's default collation.

    ``None`` when none of them is a ``utf8mb4_*`` name (the server's defaults apply).
    """
    for candidate in (anchor, db_collation if db_charset == "utf8mb4" else None, utf8mb4_default):
        if candidate and _COLLATION_NAME.fullmatch(candidate):
            return candidate
    return None


def speak_install_collation(dbapi_conn: Any, dialect: Dialect) -> str | None:
    """On a new MySQL-family DB-API connection: find the install's collation
    (:func:`choose_collation`, one query), make it the connection's
    (``SET NAMES utf8mb4 COLLATE ...``) and the dialect's, for the ``CREATE
    TABLE`` statements compiled on it. Returns the collation (``None``: left as
    the server's)."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute(_INSTALL_COLLATION_SQL)
        row = cur.fetchone()
        collation = choose_collation(*row) if row else None
        if collation:
            cur.execute(f"SET NAMES {TABLE_CHARSET} COLLATE {collation}")
            setattr(dialect, COLLATION_ATTR, collation)
    finally:
        cur.close()
    return collation


@compiles(CreateTable, "mysql")
def _create_table_utf8mb4(element: CreateTable, compiler: Any, **kw: Any) -> str:
    """``CREATE TABLE ...`` with ``DEFAULT CHARSET=utf8mb4`` and the install's collation
    (the dialect's, :func:`speak_install_collation`) unless the table names a charset."""
    sql: str = compiler.visit_create_table(element, **kw)
    options = element.element.dialect_options["mysql"]
    if options.get("charset") or options.get("default charset"):
        return sql
    collation = getattr(compiler.dialect, COLLATION_ATTR, None)
    suffix = f" COLLATE={collation}" if collation else ""
    return sql.rstrip() + f" DEFAULT CHARSET={TABLE_CHARSET}{suffix}"
