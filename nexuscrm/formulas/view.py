"""The formula view of an object: its table's columns plus one column per formula."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement
from sqlalchemy.sql import Select

from nexuscrm.packs.model import FieldSpec, ObjectSpec

from .compiler import SQLITE_TOO_DEEP, CompileFailure, FormulaCompiler, compile_field
from .dialects import int_lit, num_lit, ops_for
from .relations import FormulaContext, JoinSet, summary_is_percent
from .syntax import FormulaSyntaxError, Node, parse, references
from .values import Kind, Reject, Value


def view_select(
    obj: ObjectSpec,
    table: sa.Table,
    dialect: str,
    context: FormulaContext | None = None,
    only: set[str] | None = None,
    stage_for: set[str] | None = None,
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
    out. ``stage_for`` (lower-case names): the fields whose shared formulas are
    staged (default: every wanted field on the MySQL family, none on SQLite;
    on SQLite a field its parser cannot hold inlined is then built again with
    its shared formulas staged).
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
    counter = [0]  # alias numbers, unique across the stages
    # Values later stages read as columns: field key -> (value from a base).
    carried: dict[str, Callable[[Any], Value]] = {}
    staged: set[str] = set()
    if rollups:
        stage = JoinSet(table, counter=counter)
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
            staged.add(f.api_name)
            # Formulas read the stage's column (the finished, rounded value, as
            # Salesforce's formulas read a stored roll-up); a Percent roll-up is
            # shown as a percentage and read as a fraction, as a Percent field is.
            percent = value.kind == Kind.NUMBER and summary_is_percent(
                f, context or FormulaContext()
            )
            carried[f.api_name.lower()] = _rollup_reader(f.api_name, value.kind, percent, dialect)
        base = sa.select(*inner).select_from(stage.from_clause()).subquery("rollups")
    # Formulas other formulas of this object reference: each computed once, in
    # a stage of its own level (after those it references), and read as a
    # column by the stages above. Inlined at every use instead, a formula
    # referenced by several others grows the view's SQL exponentially with the
    # depth of references (1 MB for one corpus object: MariaDB spent 2.5 s
    # parsing it for every read, and SQLite's parser overflowed). The stages
    # are CTEs, not nested subqueries (a WITH list is flat). MySQL family only:
    # SQLite flattens the stages back into one expression per use and re-runs
    # the roll-up subqueries under them (PMT_Project__c, 2,000 rows: 24.7 s
    # staged against 3.4 s inlined), so SQLite keeps inlining and leaves out,
    # with the reason, what its parser cannot hold.
    wanted_keys = {f.api_name.lower() for f in wanted}
    if stage_for is None:
        stage_for = wanted_keys if dialect != "sqlite" else set()
    levels = shared_formula_levels(obj, taken, stage_for) if stage_for else []
    for level, fields in enumerate(levels, 1):
        stage = JoinSet(base, counter=counter)
        _seed(stage, carried, base)
        inner = list(base.c)
        added = False
        for f in fields:
            mark = stage.mark()
            try:
                value = FormulaCompiler(obj, base, dialect, context, stage).formula_value(f)
            except (Reject, RecursionError):
                stage.reset(mark)  # left to the final select, which names the reason
                continue
            reader = _stage_value(value, f"nx{level}_{len(inner)}", inner)
            if reader is None:
                stage.reset(mark)
                continue
            carried[f.api_name.lower()] = reader
            added = True
        if added:
            base = sa.select(*inner).select_from(stage.from_clause()).cte(f"formulas{level}")
    columns: list[Any] = [base.c[c.name] for c in table.c]
    joins = JoinSet(base, counter=counter)
    _seed(joins, carried, base)
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
    too_deep = {name.lower() for name, reason in problems if reason == SQLITE_TOO_DEEP}
    if too_deep and not stage_for:
        # SQLite's parser cannot hold these inlined: stage what they reference
        # (only theirs: staged stages are slower to read on SQLite, see above).
        return view_select(obj, table, dialect, context, only, too_deep)
    return select, problems


# Kinds a stage can carry as one column (a LOCATION is two; a raw picklist or a
# literal keeps properties a column would lose, and is cheap to inline).
_STAGE_KINDS = {Kind.NUMBER, Kind.TEXT, Kind.DATE, Kind.DATETIME, Kind.TIME, Kind.BOOLEAN}


def _refs(node: Node) -> set[str]:
    """Same-object field names (lower case) formula tree ``node`` references."""
    return {
        r.parts[0].lower()
        for r in references(node)
        if len(r.parts) == 1 and not r.parts[0].startswith("$")
    }


def shared_formula_levels(
    obj: ObjectSpec, taken: set[str], wanted: set[str]
) -> list[list[FieldSpec]]:
    """The formula fields of ``obj`` that another of its formulas references,
    among those the ``wanted`` fields (lower-case names) reach, grouped by
    level: level 1 references none of the others, level n only those of lower
    levels. Fields in a cycle, or that do not parse, are not staged (the
    compiler refuses them with the reason). ``taken``: the table's column
    names (lower case), whose formulas are never built."""
    formulas = {
        f.api_name.lower(): f
        for f in obj.fields
        if f.formula is not None and f.api_name.lower() not in taken
    }
    refs: dict[str, set[str]] = {}
    for key, f in formulas.items():
        try:
            refs[key] = _refs(parse(f.formula or "")) & formulas.keys()
        except FormulaSyntaxError:
            refs[key] = set()
    needed: set[str] = set()
    todo = [k for k in wanted if k in formulas]
    while todo:
        key = todo.pop()
        if key not in needed:
            needed.add(key)
            todo.extend(refs[key])
    shared = set().union(*(refs[k] for k in needed)) if needed else set()
    levels: dict[str, int | None] = {}

    def level_of(key: str, seen: frozenset[str]) -> int | None:
        if key in levels:
            return levels[key]
        if key in seen:
            return None
        below = [level_of(d, seen | {key}) for d in sorted(refs[key] & shared)]
        out = None if any(b is None for b in below) else 1 + max((b or 0 for b in below), default=0)
        levels[key] = out
        return out

    grouped: dict[int, list[FieldSpec]] = {}
    for key in sorted(shared):
        lv = level_of(key, frozenset())
        if lv is not None:
            grouped.setdefault(lv, []).append(formulas[key])
    return [grouped[lv] for lv in sorted(grouped)]


def _stage_value(value: Value, name: str, inner: list[Any]) -> Callable[[Any], Value] | None:
    """Add ``value`` (and its error flag) to stage columns ``inner`` as ``name``;
    returns how a later stage reads it back, or None when it cannot be staged."""
    if (
        value.kind not in _STAGE_KINDS
        or value.const is not None
        or value.const_text is not None
        or value.picklist is not None
        or value.multiselect
        or value.lon is not None
    ):
        return None
    kind = value.kind
    sql: Any = value.sql
    if kind == Kind.BOOLEAN:  # a predicate: 1, 0 or NULL, read back as "= 1"
        sql = sa.case((value.sql, int_lit(1)), (sa.not_(value.sql), int_lit(0)))
    inner.append(sql.label(name))
    err_name = None
    if value.err is not None:
        err_name = name + "e"
        inner.append(sa.case((value.err, int_lit(1)), else_=int_lit(0)).label(err_name))

    def read(base: Any) -> Value:
        col: Any = base.c[name]
        out = col == int_lit(1) if kind == Kind.BOOLEAN else col
        err = base.c[err_name] == int_lit(1) if err_name else None
        return Value(kind, out, err)

    return read


def _rollup_reader(name: str, kind: Kind, percent: bool, dialect: str) -> Callable[[Any], Value]:
    ops = ops_for(dialect)

    def read(base: Any) -> Value:
        column: Any = base.c[name]
        if percent:
            column = ops.number(column) * num_lit("0.01")
        return Value(kind, column)

    return read


def _seed(joins: JoinSet, carried: dict[str, Callable[[Any], Value]], base: Any) -> None:
    """Make ``joins``' compilers read the carried values as columns of ``base``."""
    for key, read in carried.items():
        joins.values[("#" + key,)] = read(base)


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
