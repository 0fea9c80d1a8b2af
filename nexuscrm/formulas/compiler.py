"""Salesforce formula -> SQLAlchemy Core expression, with Salesforce's semantics.

Every sub-expression compiles to a :class:`Value`: its formula type, its SQL,
and an optional *error predicate* that is true on rows where Salesforce would
raise a runtime error (division by zero, VALUE() of non-numeric text, an
undefined power).  The finished field is ``CASE WHEN <error> THEN NULL ELSE
<value> END``: an error blanks the whole field for that row, as Salesforce
shows ``#Error!``, instead of leaking a partial value through BLANKVALUE or
ISBLANK.  IF and CASE only count the errors of the branch they take, which is
what makes Salesforce's documented ``IF(x = 0, 0, y / x)`` idiom safe.

Booleans are SQL predicates inside an expression, with SQL's three-valued
logic for blanks (a comparison with a blank number is unknown, IF treats
unknown as false); a Checkbox result is always 0 or 1.

Blank handling follows Salesforce: with BlankAsZero a blank Number, Currency
or Percent reference reads as 0 (text, date and checkbox references never do);
blank text is '' everywhere (``&``, ``+``, comparisons, LEN) and a Text result
of '' reads as NULL.  Text comparison is case-sensitive.  A Percent field is a
fraction inside formulas (a stored 10 means 10% and reads as 0.1) and a
Percent result is stored back as a percentage; so is a roll-up of a Percent
(SUM / MIN / MAX), which Salesforce types like the field it summarizes.  Number results are rounded
half away from zero to the field's scale, when it has one; a formula field
referenced from another formula is inlined unrounded, the way Salesforce
inlines referenced formulas into the caller's compiled formula.
"""

from __future__ import annotations

import difflib
import sqlite3
from dataclasses import replace
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from nexuscrm.packs.model import (
    FieldSpec,
    FieldType,
    ObjectSpec,
)

from .dialects import DialectOps, Expr, int_lit, num_lit, ops_for, str_lit
from .fnbase import arity
from .functions import FUNCTIONS, PICKLIST_FUNCTIONS, SUPPORTED_FUNCTIONS
from .globals import global_value
from .relations import (
    MAX_HOPS,
    FormulaContext,
    JoinSet,
    ObjectRef,
    child_field_name,
    filter_predicate,
    find_relationship,
    summary_is_percent,
    summary_result_kind,
)
from .syntax import (
    BinOp,
    Bool,
    Call,
    FormulaSyntaxError,
    Node,
    Null,
    Num,
    Ref,
    Str,
    UnOp,
    parse,
    references,
)
from .values import (
    STANDARD_KINDS,
    ArgType,
    CompileFailure,
    Kind,
    Pred,
    Reject,
    Value,
    bool_value,
    errs_of,
    kind_of_field_type,
    or_errs,
    truthy,
)

__all__ = [
    "SUPPORTED_FUNCTIONS",
    "CompileFailure",
    "Kind",
    "Value",
    "compile_field",
    "dependencies",
]


# Roll-up operands read blanks as blanks (a blank amount is skipped, not 0).
_BLANK_AS_BLANK = FieldSpec(
    api_name="RollUpOperand",
    type=FieldType.Number,
    formula="0",
    formula_treat_blanks_as="BlankAsBlank",
)


#: The reason a formula SQLite's parser cannot hold is refused with (the view
#: then stages the formulas it references: nexuscrm.formulas.view).
SQLITE_TOO_DEEP = "the database cannot evaluate it here: parser stack overflow (SQLite)"


def sqlite_parser_overflows(expression_sql: str) -> bool:
    """Whether SQLite's parser overflows its stack on a view selecting
    ``expression_sql`` (``CREATE VIEW ... AS SELECT <expression_sql>``: the
    CREATE VIEW takes stack of its own).

    Parsed by this process's SQLite on an empty in-memory database: the parser
    runs before names are resolved, so the answer depends only on the text
    (and the SQLite library), and rebuild-derived and verify agree on it.
    """
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("EXPLAIN CREATE VIEW nx_probe AS SELECT " + expression_sql)
    except sqlite3.Error as exc:
        return "parser stack overflow" in str(exc)
    finally:
        conn.close()
    return False


class FormulaCompiler:
    """Compiles the formula fields of one object; one instance per top-level compile."""

    def __init__(
        self,
        obj: ObjectSpec,
        table: Any,
        dialect: str,
        context: FormulaContext | None = None,
        joins: JoinSet | None = None,
        path: tuple[str, ...] = (),
        active: list[tuple[str, str]] | None = None,
    ) -> None:
        self.obj = obj
        self.table = table
        self.dialect = dialect
        self.ops: DialectOps = ops_for(dialect)
        self.context = context or FormulaContext()
        # The outer joins of the SELECT this formula lands in (shared by every
        # formula of a view), this compiler's relationship path from its base,
        # and the (object, field) formulas being compiled, across objects.
        self.joins = joins if joins is not None else JoinSet(table)
        self.path = path
        self.active = active if active is not None else []
        self.fields = {f.api_name.lower(): f for f in obj.fields}
        self.standard = {name.lower(): name for name in STANDARD_KINDS}
        # Location fields are read through their two numeric columns.
        self.location_columns: dict[str, str] = {}
        for f in obj.fields:
            if f.type == FieldType.Location:
                for col in f.column_names():
                    self.location_columns[col.lower()] = col
        self.stack: list[FieldSpec] = []
        self.done: dict[str, Value | Reject] = {}

    # -- entry points ------------------------------------------------------
    def compile_field(self, f: FieldSpec) -> Expr:
        """The finished column expression for formula field ``f``."""
        try:
            value = self.formula_value(f)
            out = self.finish(f, value)
            self._check_renders(out)
            return out
        except Reject as exc:
            raise CompileFailure(f.api_name, exc.reason) from None
        except RecursionError:
            raise CompileFailure(f.api_name, "formula is nested too deeply") from None

    def formula_value(self, f: FieldSpec) -> Value:
        """The raw (unrounded, unconverted) value of formula or roll-up field ``f``."""
        if f.formula is None and f.summary is None:
            raise Reject(f"field {f.api_name} is not a formula field")
        key = f.api_name.lower()
        if f.formula is not None:
            # Computed in an inner stage of the view (nexuscrm.formulas.view):
            # read as that stage's column, not inlined again at each use.
            staged = self.joins.values.get((*self.path, "#" + key))
            if staged is not None:
                return staged
        me = (self.obj.api_name, f.api_name)
        keys = [(o.lower(), n.lower()) for o, n in self.active]
        if (me[0].lower(), key) in keys:
            start = keys.index((me[0].lower(), key))
            chain = [f"{o}.{n}" for o, n in self.active[start:]] + [f"{me[0]}.{me[1]}"]
            if all(o.lower() == me[0].lower() for o, _ in self.active[start:]):
                chain = [n for _, n in self.active[start:]] + [f.api_name]
            raise Reject("formula cycle: " + " -> ".join(chain), cycle=True)
        cached = self.done.get(key)
        if isinstance(cached, Reject):
            raise cached
        if cached is not None:
            return cached
        self.stack.append(f)
        self.active.append(me)
        try:
            if f.summary is not None:
                value = self.summary_value(f)
            else:
                assert f.formula is not None
                try:
                    tree = parse(f.formula)
                except FormulaSyntaxError as exc:
                    raise Reject(str(exc)) from None
                value = self.expr(tree, f)
                self._check_result_kind(f, value)
        except Reject as exc:
            if not exc.cycle:
                self.done[key] = exc
            raise
        finally:
            self.stack.pop()
            self.active.pop()
        self.done[key] = value
        return value

    def _check_renders(self, out: Expr) -> None:
        # SQLAlchemy renders nested expressions recursively; a formula that
        # compiles but cannot be rendered would break the whole view's DDL.
        try:
            sql = out.compile(dialect=self.ops.sa_dialect(), compile_kwargs={"literal_binds": True})
        except RecursionError:
            raise Reject("formula is nested too deeply to render as SQL") from None
        if self.dialect == "sqlite" and sqlite_parser_overflows(str(sql)):
            raise Reject(SQLITE_TOO_DEEP)

    def _check_result_kind(self, f: FieldSpec, value: Value) -> None:
        want = kind_of_field_type(f.type)
        if want is None:
            raise Reject(f"a {f.type} field cannot hold a formula result")
        if value.kind not in (want, Kind.NULL):
            raise Reject(
                f"formula returns {value.kind} but field {f.api_name} is {f.type} ({want})"
            )

    def finish(self, f: FieldSpec, value: Value) -> Expr:
        """Convert a raw value to what the view column stores for ``f``'s type."""
        ops = self.ops
        want = value.kind if f.summary is not None else kind_of_field_type(f.type)
        out: Expr
        if value.kind == Kind.NULL:
            out = sa.null()
        elif want == Kind.TEXT:
            # Salesforce trims a text result; what is left empty is blank.
            out = ops.blank_to_null(ops.trim_blanks(value.sql))
        elif want == Kind.NUMBER:
            out = value.sql
            if f.type == FieldType.Percent or (
                f.summary is not None and summary_is_percent(f, self.context)
            ):
                # A Percent is a fraction inside formulas, a percentage when shown.
                out = ops.number(out) * int_lit(100)
            if f.scale is not None:
                out = ops.round(out, int_lit(f.scale), f.scale)
        elif want == Kind.BOOLEAN:
            out = sa.case((value.sql, int_lit(1)), else_=int_lit(0))
        else:
            out = value.sql
        if value.err is not None:
            out = sa.case((value.err, sa.null()), else_=out)
        return sa.type_coerce(out, self._result_type(want))

    def _result_type(self, kind: Kind | None) -> sa.types.TypeEngine[Any]:
        sqlite = self.ops.name == "sqlite"
        if kind == Kind.NUMBER:
            return sa.Float() if sqlite else sa.Numeric()
        if kind == Kind.BOOLEAN:
            return sa.Integer()
        if kind == Kind.DATE and not sqlite:
            return sa.Date()
        if kind == Kind.DATETIME and not sqlite:
            return sa.DateTime()
        if kind == Kind.TIME and not sqlite:
            return sa.Time()
        return sa.String()

    # -- expressions -------------------------------------------------------
    def expr(self, node: Node, scope: FieldSpec) -> Value:
        """Compile one AST node in the scope of formula field ``scope``."""
        if isinstance(node, Num):
            return Value(Kind.NUMBER, num_lit(node.text), const=Decimal(node.text))
        if isinstance(node, Str):
            return Value(Kind.TEXT, str_lit(node.value), nonnull=True, const_text=node.value)
        if isinstance(node, Bool):
            return Value(Kind.BOOLEAN, sa.true() if node.value else sa.false())
        if isinstance(node, Null):
            return Value(Kind.NULL, sa.null())
        if isinstance(node, Ref):
            return self.reference(node, scope)
        if isinstance(node, UnOp):
            return self.unary(node, scope)
        if isinstance(node, BinOp):
            return self.binary(node, scope)
        return self.call(node, scope)

    def reference(self, node: Ref, scope: FieldSpec) -> Value:
        """A same-object field reference (case-insensitive)."""
        name = node.parts[0]
        if name.startswith("$"):
            value = global_value(self, node, scope)
            if value.kind == Kind.NUMBER and scope.formula_treat_blanks_as == "BlankAsZero":
                value = Value(Kind.NUMBER, self.ops.number(sa.func.coalesce(value.sql, 0)))
            return value
        if len(node.parts) > 1:
            return self.across(node, scope)
        key = name.lower()
        blank_as_zero = scope.formula_treat_blanks_as == "BlankAsZero"
        if key in self.standard:
            col_name = self.standard[key]
            return self._column_value(col_name, STANDARD_KINDS[col_name], blank_as_zero)
        if key in self.location_columns:
            return self._column_value(self.location_columns[key], Kind.NUMBER, blank_as_zero)
        target = self.fields.get(key)
        if target is None:
            raise Reject(f"unknown field {name!r} on {self.obj.api_name}" + self._suggest(name))
        if target.is_formula:
            return self._inline(target, blank_as_zero)
        if target.type == FieldType.Location:
            lat_name, lon_name = target.column_names()
            lat = self._column_value(lat_name, Kind.NUMBER, False)
            lon = self._column_value(lon_name, Kind.NUMBER, False)
            return Value(Kind.LOCATION, lat.sql, lon=lon.sql)
        if target.type == FieldType.Summary:
            return self._inline(target, blank_as_zero)
        kind = kind_of_field_type(target.type)
        if kind is None:  # pragma: no cover - every stored type maps to a kind
            raise Reject(f"field {target.api_name} of type {target.type} cannot be used")
        value = self._column_value(target.api_name, kind, blank_as_zero)
        if target.type in (FieldType.Picklist, FieldType.MultiselectPicklist):
            multi = target.type == FieldType.MultiselectPicklist
            return Value(kind, value.sql, picklist=target.api_name, multiselect=multi)
        if target.type == FieldType.Percent:
            # Salesforce formulas see percents as fractions: 10 (%) reads as 0.1.
            value = Value(Kind.NUMBER, self.ops.number(value.sql) * num_lit("0.01"))
        return value

    def across(self, node: Ref, scope: FieldSpec) -> Value:
        """``Rel.Field`` (and deeper): join the parent on its lookup, read it there.

        The parent is LEFT OUTER JOINed once per path for the whole view, so
        a blank lookup reads every parent field as blank; a formula of the
        parent is compiled against the parent's row (its own references go
        further along the path).
        """
        rel = node.parts[0]
        if len(self.path) >= MAX_HOPS:
            raise Reject(
                f"{node.dotted!r}: more than {MAX_HOPS} relationships in one path "
                "(Salesforce's limit)"
            )
        fk, target_name = find_relationship(self.obj, rel)
        target = self.context.objects(target_name)
        if target is None:
            raise Reject(
                f"{rel} on {self.obj.api_name} points to {target_name}, "
                "which no installed pack defines"
            )
        fk_col = self.table.c.get(fk)
        if fk_col is None:
            raise Reject(f"column {fk} is missing from table {self.obj.api_name}")
        return self.joined((*self.path, rel.lower()), fk_col, target, Ref(node.parts[1:]), scope)

    def joined(
        self, path: tuple[str, ...], key: Expr, target: ObjectRef, rest: Ref, scope: FieldSpec
    ) -> Value:
        """``rest`` read on the row of ``target`` whose Id is ``key`` (a lookup
        column, or the acting user for ``$User``), LEFT OUTER JOINed once per
        ``path`` for the whole view; blank when there is no such row."""
        alias = self.joins.join(path, key, target)
        parent = FormulaCompiler(
            target.spec, alias, self.dialect, self.context, self.joins, path, self.active
        )
        value = parent.reference(rest, scope)
        # No parent row: every value through it is blank (a formula of the
        # parent is not evaluated over nothing), 0 under BlankAsZero, and a
        # checkbox false.
        missing = alias.c.Id.is_(None)
        err = None if value.err is None else sa.and_(sa.not_(missing), value.err)
        if value.kind == Kind.LOCATION:
            return value
        if value.kind == Kind.BOOLEAN:
            return replace(value, sql=sa.and_(sa.not_(missing), value.sql), err=err)
        sql: Expr = sa.case((missing, sa.null()), else_=value.sql)
        if value.kind == Kind.NUMBER and scope.formula_treat_blanks_as == "BlankAsZero":
            sql = self.ops.number(sa.func.coalesce(sql, int_lit(0)))
        return replace(value, sql=sql, err=err, const=None, nonnull=False)

    def summary_value(self, f: FieldSpec) -> Value:
        """A roll-up summary: a correlated subquery over the master-detail children.

        COUNT counts child rows meeting every filter; SUM of none is 0; MIN
        and MAX of none are blank. The summarized field may be a formula or a
        roll-up of the child (compiled against the child's row).
        """
        summary = f.summary
        assert summary is not None
        where = f"roll-up {self.obj.api_name}.{f.api_name}"
        if not summary.foreign_key_field:
            raise Reject(f"{where} names no master-detail field (summaryForeignKey)")
        child_name, dot, fk_name = summary.foreign_key_field.partition(".")
        if not dot:
            raise Reject(f"{where}: summaryForeignKey {child_name!r} is not Object.Field")
        child = self.context.objects(child_name)
        if child is None:
            raise Reject(f"{where} summarizes {child_name}, which no installed pack defines")
        fk = next((x for x in child.spec.fields if x.api_name.lower() == fk_name.lower()), None)
        if fk is None or fk.type not in (FieldType.MasterDetail, FieldType.Lookup):
            raise Reject(f"{where}: {summary.foreign_key_field} is not a master-detail field")
        key = (*self.path, "#" + f.api_name.lower())
        known = self.joins.values.get(key)
        if known is not None:
            return known
        alias = self.joins.sub_alias(child)
        sub_joins = JoinSet(alias, "j", counter=self.joins.counter)
        inner = FormulaCompiler(
            child.spec, alias, self.dialect, self.context, sub_joins, (), self.active
        )
        conditions: list[Any] = []
        if "IsDeleted" in alias.c:
            conditions.append(sa.func.coalesce(alias.c.IsDeleted, False) == sa.false())
        for item in summary.filters:
            fname = child_field_name(child.spec.api_name, item.field)
            value = inner.reference(Ref((fname,)), _BLANK_AS_BLANK)
            conditions.append(filter_predicate(self.ops, item, value, where))
        if summary.operation == "count":
            agg: Expr = sa.func.count()
            kind = Kind.NUMBER
        else:
            if not summary.summarized_field:
                raise Reject(f"{where}: {summary.operation} needs a summarized field")
            fname = child_field_name(child.spec.api_name, summary.summarized_field)
            value = inner.reference(Ref((fname,)), _BLANK_AS_BLANK)
            if value.kind not in (Kind.NUMBER, Kind.DATE, Kind.DATETIME) or (
                summary.operation == "sum" and value.kind != Kind.NUMBER
            ):
                raise Reject(f"{where}: cannot {summary.operation} a {value.kind} field")
            kind = summary_result_kind(f, value)
            operand = value.sql
            if value.err is not None:  # a child row in error counts as blank
                operand = sa.case((value.err, sa.null()), else_=operand)
            agg = getattr(sa.func, summary.operation)(operand)
        # A correlated subquery: computed only for the parent rows a query
        # reads (the master-detail column is indexed). A view computes its
        # own roll-ups once, in an inner stage (nexuscrm.formulas.view), so
        # its formulas read them as columns however often they use them.
        conditions.append(alias.c[fk.api_name] == self.table.c.Id)
        sub = sa.select(agg).select_from(sub_joins.from_clause()).where(*conditions)
        sql: Expr = sub.scalar_subquery()
        if summary.operation in ("sum", "count"):
            sql = sa.func.coalesce(sql, int_lit(0))
        out = Value(kind, sql)
        self.joins.values[key] = out
        return out

    def _suggest(self, name: str) -> str:
        """'; did you mean X?' with the nearest known field name (difflib), or ''."""
        names = [f.api_name for f in self.obj.fields]
        names += list(self.standard.values()) + list(self.location_columns.values())
        by_lower = {n.lower(): n for n in names}
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
        return f"; did you mean {by_lower[close[0]]!r}?" if close else ""

    def _column_value(self, col_name: str, kind: Kind, blank_as_zero: bool) -> Value:
        col = self.table.c.get(col_name)
        if col is None:
            raise Reject(f"column {col_name} is missing from table {self.table.name}")
        if kind == Kind.NUMBER:
            sql: Expr = self.ops.number(col)
            if blank_as_zero:
                sql = sa.func.coalesce(sql, int_lit(0))
            return Value(kind, self.ops.number(sql))
        if kind == Kind.BOOLEAN:
            # A checkbox is never blank: NULL storage reads as false.
            return Value(
                kind, sa.func.coalesce(sa.type_coerce(col, sa.Integer()), int_lit(0)) == int_lit(1)
            )
        return Value(kind, col)

    def _inline(self, target: FieldSpec, blank_as_zero: bool) -> Value:
        try:
            inner = self.formula_value(target)
        except Reject as exc:
            if exc.cycle:
                raise
            raise Reject(
                f"referenced formula field {target.api_name} fails: {exc.reason}"
            ) from None
        kind = inner.kind
        if kind == Kind.NULL:
            kind = kind_of_field_type(target.type) or Kind.NULL
        sql = inner.sql
        if kind == Kind.NUMBER and blank_as_zero:
            sql = self.ops.number(sa.func.coalesce(sql, int_lit(0)))
        elif kind == Kind.BOOLEAN:
            sql = truthy(sql)
        return Value(kind, sql, inner.err)

    # -- operators ---------------------------------------------------------
    def unary(self, node: UnOp, scope: FieldSpec) -> Value:
        """Unary minus / plus on a number, ``!`` (NOT) on a boolean."""
        if node.op == "&":
            raise Reject("syntax error: '&' needs a left operand")
        operand = self.expr(node.operand, scope)
        if node.op == "!":
            if operand.kind not in (Kind.BOOLEAN, Kind.NULL):
                raise Reject(f"operator '!' needs a boolean, got {operand.kind}")
            return Value(Kind.BOOLEAN, sa.not_(operand.sql), operand.err)
        self._no_picklist(operand)
        if operand.kind == Kind.NULL:
            return Value(Kind.NUMBER, sa.null())
        if operand.kind != Kind.NUMBER:
            raise Reject(f"unary {node.op!r} needs a number, got {operand.kind}")
        if node.op == "+":
            return operand
        const = -operand.const if operand.const is not None else None
        return Value(Kind.NUMBER, -self.ops.number(operand.sql), operand.err, const)

    def binary(self, node: BinOp, scope: FieldSpec) -> Value:
        """Binary operators: arithmetic, concatenation, comparison, && and ||."""
        left = self.expr(node.left, scope)
        right = self.expr(node.right, scope)
        op = node.op
        self._no_picklist(left)
        self._no_picklist(right)
        if op in ("&&", "||"):
            for side in (left, right):
                if side.kind not in (Kind.BOOLEAN, Kind.NULL):
                    raise Reject(f"operator {op!r} needs booleans, got {side.kind}")
            combine = sa.and_ if op == "&&" else sa.or_
            return Value(Kind.BOOLEAN, combine(left.sql, right.sql), errs_of(left, right))
        if op in ("=", "==", "!=", "<>", "<", "<=", ">", ">="):
            return self.compare(op, left, right)
        if op == "&":
            return self.concat(op, left, right)
        if op == "+" and Kind.TEXT in (left.kind, right.kind):
            return self.concat(op, left, right)
        return self.arithmetic(op, left, right)

    @staticmethod
    def _no_picklist(value: Value) -> None:
        """Refuse a raw picklist where Salesforce refuses it (operators, most functions),
        and a location anywhere but DISTANCE()."""
        if value.kind == Kind.LOCATION:
            raise Reject(
                "a location (GEOLOCATION() or a Location field) can only be used in DISTANCE()"
            )
        if value.picklist is not None:
            raise Reject(
                f"Field {value.picklist} is a picklist field. Picklist fields are only "
                "supported in certain functions."
            )

    def concat(self, op: str, left: Value, right: Value) -> Value:
        """Text concatenation; blank text is ''."""
        for side in (left, right):
            if side.kind not in (Kind.TEXT, Kind.NULL):
                raise Reject(
                    f"operator {op!r} cannot combine {left.kind} and {right.kind}"
                    + ("; use TEXT() to convert" if op == "&" else "")
                )
        sql = self.ops.concat([self.text_piece(left), self.text_piece(right)])
        return Value(Kind.TEXT, sql, errs_of(left, right), nonnull=True)

    def arithmetic(self, op: str, left: Value, right: Value) -> Value:
        """``+ - * / ^`` on numbers, and the date/datetime forms of ``+`` and ``-``."""
        ops = self.ops
        lk, rk = left.kind, right.kind
        err = errs_of(left, right)
        mismatch = Reject(f"operator {op!r} cannot combine {lk} and {rk}")
        temporal = (Kind.DATE, Kind.DATETIME)
        if op in ("+", "-") and Kind.TIME in (lk, rk):
            return self._time_arithmetic(op, left, right)
        if op in ("+", "-") and (lk in temporal or rk in temporal):
            if op == "+" and rk in temporal and lk in (Kind.NUMBER, Kind.NULL):
                left, right = right, left  # number + date == date + number
                lk, rk = rk, lk
            if lk in temporal and rk in (Kind.NUMBER, Kind.NULL):
                days = ops.number(right.sql)
                if op == "-":
                    days = -days
                if lk == Kind.DATE:
                    return Value(Kind.DATE, ops.date_add(left.sql, days), err)
                return Value(Kind.DATETIME, ops.datetime_add(left.sql, days), err)
            if op == "-" and lk == rk:
                if lk == Kind.DATE:
                    return Value(Kind.NUMBER, ops.date_diff(left.sql, right.sql), err)
                return Value(Kind.NUMBER, ops.datetime_diff(left.sql, right.sql), err)
            if op == "-" and lk in temporal and rk == Kind.NULL:
                return Value(Kind.NUMBER, sa.null(), err)
            raise mismatch
        for k in (lk, rk):
            if k not in (Kind.NUMBER, Kind.NULL):
                raise mismatch
        a, b = ops.number(left.sql), ops.number(right.sql)
        if op == "+":
            return Value(Kind.NUMBER, ops.number(a + b), err)
        if op == "-":
            return Value(Kind.NUMBER, ops.number(a - b), err)
        if op == "*":
            return Value(Kind.NUMBER, ops.number(a * b), err)
        if op == "/":
            # Division by zero is a Salesforce runtime error: blank field, not a failed query.
            return Value(Kind.NUMBER, ops.number(ops.divide(a, b)), or_errs(err, b == int_lit(0)))
        if op == "^":
            value, undefined = ops.power(a, b)
            return Value(Kind.NUMBER, ops.number(value), or_errs(err, undefined))
        raise Reject(f"unknown operator {op!r}")  # pragma: no cover - grammar limits ops

    def _time_arithmetic(self, op: str, left: Value, right: Value) -> Value:
        """Time +/- a number of milliseconds (wrapping around midnight), and
        Time - Time in milliseconds (Salesforce's Time arithmetic)."""
        lk, rk = left.kind, right.kind
        err = errs_of(left, right)
        if op == "+" and rk == Kind.TIME and lk in (Kind.NUMBER, Kind.NULL):
            left, right, lk, rk = right, left, rk, lk
        if lk == Kind.TIME and rk in (Kind.NUMBER, Kind.NULL):
            delta = self.ops.number(right.sql)
            if op == "-":
                delta = -delta
            return Value(Kind.TIME, self.ops.time_add_ms(left.sql, delta), err)
        if op == "-" and lk == Kind.TIME and rk in (Kind.TIME, Kind.NULL):
            diff = self.ops.time_ms(left.sql) - self.ops.time_ms(right.sql)
            return Value(Kind.NUMBER, self.ops.number(diff), err)
        raise Reject(f"operator {op!r} cannot combine {lk} and {rk}")

    def compare(self, op: str, left: Value, right: Value) -> Value:
        """Comparison of two values of the same type (NULL fits any)."""
        real = {left.kind, right.kind} - {Kind.NULL}
        if len(real) > 1:
            raise Reject(f"operator {op!r} cannot compare {left.kind} and {right.kind}")
        kind = real.pop() if real else Kind.NULL
        err = errs_of(left, right)
        if kind == Kind.BOOLEAN:
            if op not in ("=", "==", "!=", "<>"):
                raise Reject(f"operator {op!r} cannot compare booleans")
            a, b = bool_value(left.sql), bool_value(right.sql)
        elif kind == Kind.TEXT or kind == Kind.NULL:
            a, b = self.ops.text_cmp_operand(left.sql), self.ops.text_cmp_operand(right.sql)
        elif kind in (Kind.DATE, Kind.DATETIME, Kind.TIME):
            a = self.ops.temporal_cmp_operand(left.sql, kind.value)
            b = self.ops.temporal_cmp_operand(right.sql, kind.value)
        else:
            a, b = self.ops.number(left.sql), self.ops.number(right.sql)
        pred: Pred
        if op in ("=", "=="):
            pred = a == b
        elif op in ("!=", "<>"):
            pred = a != b
        elif op == "<":
            pred = a < b
        elif op == "<=":
            pred = a <= b
        elif op == ">":
            pred = a > b
        else:
            pred = a >= b
        return Value(Kind.BOOLEAN, pred, err)

    def _equals(self, left: Value, right: Value) -> Pred:
        return self.compare("=", left, right).sql

    @staticmethod
    def _unify(kinds: list[Kind], what: str) -> Kind:
        real = [k for k in kinds if k != Kind.NULL]
        if not real:
            return Kind.NULL
        if any(k != real[0] for k in real):
            shown = ", ".join(str(k) for k in kinds)
            raise Reject(f"{what} must have one type, got {shown}")
        return real[0]

    def _as_kind(self, value: Value, kind: Kind) -> Expr:
        """A value's SQL in 'scalar' form (booleans as 1/0/NULL) for CASE results."""
        if kind == Kind.BOOLEAN and value.kind == Kind.BOOLEAN:
            return bool_value(value.sql)
        return value.sql

    def _from_scalar(self, kind: Kind, sql: Expr, err: Pred | None) -> Value:
        if kind == Kind.BOOLEAN:
            return Value(kind, sql == int_lit(1), err)
        if kind == Kind.NUMBER:
            sql = self.ops.number(sql)
        return Value(kind, sql, err)

    # -- functions ---------------------------------------------------------
    def call(self, node: Call, scope: FieldSpec) -> Value:
        """A function call: checks the name and argument count, then dispatches."""
        spec = FUNCTIONS.get(node.name)
        if spec is None:
            close = difflib.get_close_matches(node.name, list(FUNCTIONS), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]}()?" if close else ""
            raise Reject(f"unknown function {node.name}(){hint}")
        n = len(node.args)
        if n < spec.min_args or (spec.max_args is not None and n > spec.max_args):
            raise Reject(f"{node.name}() takes {arity(spec)}, got {n}")
        args = [self.expr(a, scope) for a in node.args]
        if node.name == "DISTANCE":
            pass  # checks its own arguments
        elif node.name not in PICKLIST_FUNCTIONS:
            for a in args:
                self._no_picklist(a)
        elif node.name == "CASE":
            for a in args[1:]:
                self._no_picklist(a)
        try:
            return spec.impl(self, args, scope)
        except ArgType as exc:
            raise Reject(f"{node.name}() {exc.reason}") from None

    def need(self, value: Value, position: int, *kinds: Kind) -> None:
        """Check an argument's type (NULL always fits)."""
        if value.kind not in (*kinds, Kind.NULL):
            wanted = " or ".join(str(k) for k in kinds)
            raise ArgType(f"argument {position} must be {wanted}, got {value.kind}")

    @staticmethod
    def text_piece(value: Value) -> Expr:
        """A text value ready for concatenation: blank as ''."""
        if value.nonnull:
            return value.sql
        return sa.func.coalesce(value.sql, str_lit(""))


def compile_field(
    obj: ObjectSpec,
    f: FieldSpec,
    table: sa.Table,
    dialect: str,
    context: FormulaContext | None = None,
    joins: JoinSet | None = None,
) -> Expr:
    """Compile formula or roll-up field ``f`` of ``obj`` against ``table`` for ``dialect``.

    ``context`` names the other objects (cross-object references, roll-ups);
    the outer joins the result needs are added to ``joins`` (select FROM
    ``joins.from_clause()``). Raises ``CompileFailure`` (wrapped as
    ``FormulaError`` by the package API).
    """
    return FormulaCompiler(obj, table, dialect, context, joins).compile_field(f)


def dependencies(obj: ObjectSpec) -> dict[str, set[str]]:
    """Formula field -> same-object names it references directly.

    Names are canonical (as declared) when they resolve, as written otherwise;
    dotted and ``$`` references are left out; an unparseable formula maps to
    an empty set (compiling it reports the syntax error).
    """
    canonical: dict[str, str] = {name.lower(): name for name in STANDARD_KINDS}
    for f in obj.fields:
        canonical[f.api_name.lower()] = f.api_name
        if f.type == FieldType.Location:
            for col in f.column_names():
                canonical[col.lower()] = col
    out: dict[str, set[str]] = {}
    for f in obj.fields:
        if f.formula is None:
            continue
        try:
            tree = parse(f.formula)
        except (FormulaSyntaxError, RecursionError):
            out[f.api_name] = set()
            continue
        names = set()
        for ref in references(tree):
            if len(ref.parts) != 1 or ref.parts[0].startswith("$"):
                continue
            names.add(canonical.get(ref.parts[0].lower(), ref.parts[0]))
        out[f.api_name] = names
    return out
