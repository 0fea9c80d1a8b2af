"""DDL rules every table follows, whatever the database's defaults.

MySQL family: every ``CREATE TABLE`` states ``DEFAULT CHARSET=utf8mb4``. A
database created with another default character set (``latin1`` is the
upstream MariaDB default) would otherwise get tables that cannot store
Japanese text or an emoji, and an event carrying one would fail with a
driver error. Registered on import (``nexuscrm.db`` imports this module), for
the ``_System_*`` tables and the object tables of packs alike.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateTable

TABLE_CHARSET = "utf8mb4"


@compiles(CreateTable, "mysql")
def _create_table_utf8mb4(element: CreateTable, compiler: Any, **kw: Any) -> str:
    """``CREATE TABLE ...`` with ``DEFAULT CHARSET=utf8mb4`` unless the table names one."""
    sql: str = compiler.visit_create_table(element, **kw)
    options = element.element.dialect_options["mysql"]
    if options.get("charset") or options.get("default charset"):
        return sql
    return sql.rstrip() + f" DEFAULT CHARSET={TABLE_CHARSET}"
