"""The formula view of an object: its table's columns plus one column per formula."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement
from sqlalchemy.sql import Select

from nexuscrm.packs.model import FieldSpec, ObjectSpec

from .compiler import CompileFailure, FormulaCompiler, compile_field
from .dialects import num_lit, ops_for
from .relations import FormulaContext, JoinSet, summary_is_percent
from .values import Kind, Value


def view_select(
    obj: ObjectSpec,
    table: sa.Table,
    dialect: str,
    context: FormulaContext | None = None,
    only: set[str] | None = None,
) -> tuple[Select[Any], list[tuple[str, str]]]:
    """SELECT every column of ``table`` plus each formula and roll-up that compiles.

    Roll-ups are computed first, in an inner stage (``SELECT <table>.*,
    <roll-up subqueries> FROM <table>``, aliased ``rollups``), each a
    correlated subquery over the children, so a query for a few parents
    aggregates only their children, and the formulas of the outer select read
    a roll-up as a column however often they use it. Cross-object references
    become LEFT OUTER JOINs of the parents (one per relationship path, shared
    by the view's formulas). ``context`` names the other objects; without it
    both are left out with a reason. ``only`` (lower-case API names): select
    just these computed fields (the others still inline where referenced).
    Returns the select and ``(field_api_name, reason)`` for each field left
    out.
    """
    problems: list[tuple[str, str]] = []
    taken = {c.name.lower() for c in table.c}
    wanted = [
        f
        for f in obj.fields
        if (f.is_formula or f.summary is not None) and (only is None or f.api_name.lower() in only)
    ]
    for f in wanted:
        if f.api_name.lower() in taken:
            problems.append((f.api_name, f"name collides with column {f.api_name} of the table"))
    wanted = [f for f in wanted if f.api_name.lower() not in taken]
    rollups = [f for f in obj.fields if f.summary is not None and f.api_name.lower() not in taken]
    base: Any = table
    staged: dict[str, tuple[FieldSpec, Value]] = {}
    if rollups:
        stage = JoinSet(table)
        inner: list[Any] = list(table.c)
        for f in rollups:
            mark = stage.mark()
            try:
                expr = compile_field(obj, f, table, dialect, context, stage)
            except CompileFailure as exc:
                stage.reset(mark)
                if any(w is f for w in wanted):
                    problems.append((exc.field_api_name, exc.reason))
                continue
            # Its raw value, from the stage's cache (compiled just above).
            value = FormulaCompiler(obj, table, dialect, context, stage).formula_value(f)
            inner.append(expr.label(f.api_name))
            staged[f.api_name] = (f, value)
        base = sa.select(*inner).select_from(stage.from_clause()).subquery("rollups")
    columns: list[Any] = [base.c[c.name] for c in table.c]
    joins = JoinSet(base)
    ops = ops_for(dialect)
    for name, (f, value) in staged.items():
        # Formulas read the stage's column (the finished, rounded value, as
        # Salesforce's formulas read a stored roll-up); a Percent roll-up is
        # shown as a percentage and read as a fraction, as a Percent field is.
        column: Any = base.c[name]
        if value.kind == Kind.NUMBER and summary_is_percent(f, context or FormulaContext()):
            column = ops.number(column) * num_lit("0.01")
        joins.values[("#" + name.lower(),)] = Value(value.kind, column)
    for f in wanted:
        if f.summary is not None:
            if f.api_name in staged:
                columns.append(base.c[f.api_name])
            continue
        mark = joins.mark()
        try:
            expr = compile_field(obj, f, base, dialect, context, joins)
        except CompileFailure as exc:
            joins.reset(mark)  # a field left out leaves no join behind
            problems.append((exc.field_api_name, exc.reason))
            continue
        columns.append(expr.label(f.api_name))
    select = sa.select(*columns)
    if joins.joins or base is not table:
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
