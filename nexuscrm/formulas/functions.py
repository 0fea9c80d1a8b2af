"""The formula functions: one implementation per Salesforce function, and the table.

Each implementation takes the compiler, the compiled arguments and the field
in scope, and returns a :class:`~nexuscrm.formulas.values.Value`; argument
counts are checked by the compiler from :data:`FUNCTIONS` before the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import sqlalchemy as sa

from nexuscrm.packs.model import FieldSpec

from .dialects import Expr, html_escape, int_lit, str_lit
from .fn_datetime import DATETIME_FUNCTIONS
from .fn_math import MATH_FUNCTIONS
from .fn_text import TEXT_FUNCTIONS
from .fnbase import Function
from .values import (
    ArgType,
    Kind,
    Pred,
    Value,
    bool_value,
    errs_of,
    or_errs,
)

if TYPE_CHECKING:
    from .compiler import FormulaCompiler

# -- function implementations ---------------------------------------------


def _fn_if(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    cond, then, other = args
    c.need(cond, 1, Kind.BOOLEAN)
    kind = c._unify([then.kind, other.kind], "IF() branches")
    sql = sa.case((cond.sql, c._as_kind(then, kind)), else_=c._as_kind(other, kind))
    branch_err = None
    if then.err is not None or other.err is not None:
        branch_err = sa.case(
            (cond.sql, then.err if then.err is not None else sa.false()),
            else_=other.err if other.err is not None else sa.false(),
        )
    return c._from_scalar(kind, sql, or_errs(cond.err, branch_err))


def _fn_case(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    if len(args) % 2 != 0:
        raise ArgType(
            "takes an expression, value/result pairs and an else result "
            f"(an even number of arguments), got {len(args)}"
        )
    subject, pairs, default = args[0], args[1:-1], args[-1]
    values, results = pairs[0::2], pairs[1::2]
    c._unify([subject.kind, *(v.kind for v in values)], "CASE() values")
    kind = c._unify([*(r.kind for r in results), default.kind], "CASE() results")
    whens = [
        (c._equals(subject, v), c._as_kind(r, kind)) for v, r in zip(values, results, strict=True)
    ]
    sql = sa.case(*whens, else_=c._as_kind(default, kind))
    branch_err = None
    if any(r.err is not None for r in results) or default.err is not None:
        branch_err = sa.case(
            *(
                (c._equals(subject, v), r.err if r.err is not None else sa.false())
                for v, r in zip(values, results, strict=True)
            ),
            else_=default.err if default.err is not None else sa.false(),
        )
    return c._from_scalar(kind, sql, or_errs(errs_of(subject, *values), branch_err))


def _fn_and(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    for i, a in enumerate(args, 1):
        c.need(a, i, Kind.BOOLEAN)
    return Value(Kind.BOOLEAN, sa.and_(*(a.sql for a in args)), errs_of(*args))


def _fn_or(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    for i, a in enumerate(args, 1):
        c.need(a, i, Kind.BOOLEAN)
    return Value(Kind.BOOLEAN, sa.or_(*(a.sql for a in args)), errs_of(*args))


def _fn_not(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (a,) = args
    c.need(a, 1, Kind.BOOLEAN)
    return Value(Kind.BOOLEAN, sa.not_(a.sql), a.err)


def _is_blank(c: FormulaCompiler, a: Value) -> Pred:
    if a.kind == Kind.TEXT:
        return c.ops.is_blank_text(a.sql)
    if a.kind == Kind.BOOLEAN:
        return bool_value(a.sql).is_(None)
    return a.sql.is_(None)


def _fn_isblank(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (a,) = args
    return Value(Kind.BOOLEAN, _is_blank(c, a), a.err)


def _fn_isnull(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (a,) = args
    if a.kind == Kind.TEXT:
        # Documented: "Text fields are never null, so using ISNULL with a text
        # field always returns false."
        return Value(Kind.BOOLEAN, sa.false(), a.err)
    return Value(Kind.BOOLEAN, _is_blank(c, a), a.err)


def _fn_blankvalue(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    a, alt = args
    kind = c._unify([a.kind, alt.kind], "BLANKVALUE() arguments")
    blank = _is_blank(c, a)
    sql = sa.case((blank, c._as_kind(alt, kind)), else_=c._as_kind(a, kind))
    alt_err = sa.case((blank, alt.err), else_=sa.false()) if alt.err is not None else None
    return c._from_scalar(kind, sql, or_errs(a.err, alt_err))


def _fn_nullvalue(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    a, alt = args
    kind = c._unify([a.kind, alt.kind], "NULLVALUE() arguments")
    if a.kind == Kind.TEXT:
        # Text is never null in Salesforce, so NULLVALUE returns it unchanged.
        return Value(Kind.TEXT, a.sql, a.err)
    null = _is_blank(c, a)
    sql = sa.case((null, c._as_kind(alt, kind)), else_=c._as_kind(a, kind))
    alt_err = sa.case((null, alt.err), else_=sa.false()) if alt.err is not None else None
    return c._from_scalar(kind, sql, or_errs(a.err, alt_err))


def _fn_today(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    return Value(Kind.DATE, c.ops.today())


def _fn_now(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    return Value(Kind.DATETIME, c.ops.now())


def _fn_text(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (a,) = args
    ops = c.ops
    converters: dict[Kind, Callable[[Expr], Expr]] = {
        Kind.NUMBER: ops.number_to_text,
        Kind.DATE: ops.date_to_text,
        Kind.DATETIME: ops.datetime_to_text,
        Kind.TIME: ops.time_to_text,
    }
    if a.kind == Kind.BOOLEAN:
        raise ArgType("cannot convert a boolean; use IF(x, 'true', 'false')")
    if a.kind in (Kind.TEXT, Kind.NULL):
        # Salesforce allows TEXT() on picklists; other text passes through unchanged.
        return Value(Kind.TEXT, a.sql, a.err)
    return Value(Kind.TEXT, converters[a.kind](a.sql), a.err)


def _fn_value(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (a,) = args
    c.need(a, 1, Kind.TEXT)
    if a.kind == Kind.NULL:
        return Value(Kind.NUMBER, sa.null(), a.err)
    value, invalid = c.ops.text_to_number(a.sql)
    return Value(Kind.NUMBER, c.ops.number(value), or_errs(a.err, invalid))


def _fn_round(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, digits = args
    c.need(x, 1, Kind.NUMBER)
    c.need(digits, 2, Kind.NUMBER)
    const = int(digits.const) if digits.const is not None else None
    sql = c.ops.round(x.sql, digits.sql, const)
    return Value(Kind.NUMBER, c.ops.number(sql), errs_of(x, digits))


def _fn_abs(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (x,) = args
    c.need(x, 1, Kind.NUMBER)
    return Value(Kind.NUMBER, c.ops.number(sa.func.abs(x.sql)), x.err)


def _fn_len(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (x,) = args
    c.need(x, 1, Kind.TEXT)
    length = sa.func.coalesce(c.ops.length(x.sql), int_lit(0))
    return Value(Kind.NUMBER, c.ops.number(length), x.err)


def _fn_ispickval(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    field_value, literal = args
    c.need(field_value, 1, Kind.TEXT)
    c.need(literal, 2, Kind.TEXT)
    return c.compare("=", field_value, literal)


def _fn_image(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    url, alt = args[0], args[1]
    c.need(url, 1, Kind.TEXT)
    c.need(alt, 2, Kind.TEXT)
    # Salesforce renders <img src="..." alt="..." border="0"/>, with
    # style="height:Hpx; width:Wpx;" when a size is given; the values are
    # HTML-escaped because they come from record data.
    pieces: list[Expr] = [
        str_lit('<img src="'),
        html_escape(c.text_piece(url)),
        str_lit('" alt="'),
        html_escape(c.text_piece(alt)),
        str_lit('"'),
    ]
    sizes = list(zip(("height", "width"), args[2:], strict=False))
    for position, (attr, dim) in enumerate(sizes, 3):
        c.need(dim, position, Kind.NUMBER)
        size = Value(Kind.TEXT, c.ops.number_to_text(dim.sql))
        lead = ' style="' if position == 3 else " "
        pieces += [str_lit(f"{lead}{attr}:"), c.text_piece(size), str_lit("px;")]
    if sizes:
        pieces.append(str_lit('"'))
    pieces.append(str_lit(' border="0"/>'))
    return Value(Kind.TEXT, c.ops.concat(pieces), errs_of(*args), nonnull=True)


def _fn_hyperlink(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    url, label = args[0], args[1]
    c.need(url, 1, Kind.TEXT)
    c.need(label, 2, Kind.TEXT)
    # No target: Salesforce opens the link in a new window (_blank).
    target: Expr = str_lit("_blank")
    if len(args) == 3:
        c.need(args[2], 3, Kind.TEXT)
        target = sa.func.coalesce(sa.func.nullif(args[2].sql, str_lit("")), str_lit("_blank"))
    pieces = [
        str_lit('<a href="'),
        html_escape(c.text_piece(url)),
        str_lit('" target="'),
        html_escape(target),
        str_lit('">'),
        html_escape(c.text_piece(label)),
        str_lit("</a>"),
    ]
    return Value(Kind.TEXT, c.ops.concat(pieces), errs_of(*args), nonnull=True)


FUNCTIONS: dict[str, Function] = {
    "IF": Function(_fn_if, 3, 3),
    "CASE": Function(_fn_case, 4, None),
    "AND": Function(_fn_and, 1, None),
    "OR": Function(_fn_or, 1, None),
    "NOT": Function(_fn_not, 1, 1),
    "ISBLANK": Function(_fn_isblank, 1, 1),
    "ISNULL": Function(_fn_isnull, 1, 1),
    "BLANKVALUE": Function(_fn_blankvalue, 2, 2),
    "NULLVALUE": Function(_fn_nullvalue, 2, 2),
    "TODAY": Function(_fn_today, 0, 0),
    "NOW": Function(_fn_now, 0, 0),
    "TEXT": Function(_fn_text, 1, 1),
    "VALUE": Function(_fn_value, 1, 1),
    "ROUND": Function(_fn_round, 2, 2),
    "ABS": Function(_fn_abs, 1, 1),
    "LEN": Function(_fn_len, 1, 1),
    "ISPICKVAL": Function(_fn_ispickval, 2, 2),
    "IMAGE": Function(_fn_image, 2, 4),
    "HYPERLINK": Function(_fn_hyperlink, 2, 3),
}
FUNCTIONS.update(DATETIME_FUNCTIONS)
FUNCTIONS.update(MATH_FUNCTIONS)
FUNCTIONS.update(TEXT_FUNCTIONS)

#: Functions that accept a raw picklist field (Salesforce refuses it elsewhere).
PICKLIST_FUNCTIONS = frozenset({"ISPICKVAL", "CASE", "TEXT", "ISBLANK", "ISNULL", "INCLUDES"})

SUPPORTED_FUNCTIONS: tuple[str, ...] = tuple(sorted(FUNCTIONS))
