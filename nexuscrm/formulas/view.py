"""The formula view of an object: its table's columns plus one column per formula."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement
from sqlalchemy.sql import Select

from nexuscrm.packs.model import ObjectSpec

from .compiler import CompileFailure, compile_field
from .relations import FormulaContext, JoinSet


def view_select(
    obj: ObjectSpec, table: sa.Table, dialect: str, context: FormulaContext | None = None
) -> tuple[Select[Any], list[tuple[str, str]]]:
    """SELECT every column of ``table`` plus each formula and roll-up that compiles.

    Cross-object references become LEFT OUTER JOINs of the parents (one per
    relationship path, shared by the view's formulas); roll-ups correlated
    subqueries over the children. ``context`` names the other objects; without
    it both are left out with a reason. Returns the select and
    ``(field_api_name, reason)`` for each field left out.
    """
    columns: list[Any] = list(table.c)
    taken = {c.name.lower() for c in table.c}
    problems: list[tuple[str, str]] = []
    joins = JoinSet(table)
    for f in obj.fields:
        if not f.is_formula and f.summary is None:
            continue
        if f.api_name.lower() in taken:
            problems.append((f.api_name, f"name collides with column {f.api_name} of the table"))
            continue
        try:
            expr = compile_field(obj, f, table, dialect, context, joins)
        except CompileFailure as exc:
            problems.append((exc.field_api_name, exc.reason))
            continue
        columns.append(expr.label(f.api_name))
        taken.add(f.api_name.lower())
    select = sa.select(*columns)
    if joins.joins:
        select = select.select_from(joins.from_clause())
    return select, problems


class CreateView(ExecutableDDLElement):
    """``CREATE VIEW <name> AS <select>``, with the select's literals inlined.

    Execute it with ``connection.execute(CreateView(name, select))``: SQLAlchemy
    then renders string literals (``'%Y-%m-%d'``) correctly for the driver,
    which a hand-built ``text()`` string would not on PyMySQL.
    """

    inherit_cache = False

    def __init__(self, name: str, select: Select[Any], *, or_replace: bool = False) -> None:
        self.name = name
        self.select = select
        self.or_replace = or_replace


class DropView(ExecutableDDLElement):
    """``DROP VIEW IF EXISTS <name>``."""

    inherit_cache = False

    def __init__(self, name: str) -> None:
        self.name = name


@compiles(CreateView)
def _compile_create_view(element: CreateView, compiler: Any, **kw: Any) -> str:
    body = compiler.sql_compiler.process(element.select, literal_binds=True)
    verb = "CREATE OR REPLACE VIEW" if element.or_replace else "CREATE VIEW"
    return f"{verb} {compiler.preparer.quote(element.name)} AS {body}"


@compiles(DropView)
def _compile_drop_view(element: DropView, compiler: Any, **kw: Any) -> str:
    return f"DROP VIEW IF EXISTS {compiler.preparer.quote(element.name)}"
