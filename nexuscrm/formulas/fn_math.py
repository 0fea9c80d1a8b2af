"""Math and the remaining logical functions (Salesforce semantics).

Rounding directions follow Salesforce's help: CEILING rounds away from zero
(``CEILING(-2.5)`` is -3), FLOOR toward zero (``FLOOR(-2.5)`` is -2), while
MCEILING / MFLOOR are the mathematical ceiling and floor (-2 and -3).  LN, LOG
and SQRT of a number outside their domain, and MOD by zero, are runtime
errors (the field is blank for that row).  MAX / MIN of a blank is blank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa

from nexuscrm.packs.model import FieldSpec

from .dialects import Expr, int_lit, num_lit
from .fnbase import Function
from .values import ArgType, Kind, Pred, Value, errs_of, or_errs

if TYPE_CHECKING:
    from .compiler import FormulaCompiler


def _num1(c: FormulaCompiler, args: list[Value]) -> tuple[Value, Expr]:
    (x,) = args
    c.need(x, 1, Kind.NUMBER)
    return x, c.ops.number(x.sql)


def _sign(x: Expr) -> Expr:
    return sa.case((x < int_lit(0), int_lit(-1)), else_=int_lit(1))


def _fn_ceiling(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    n = c.ops.decimal(n)
    return Value(Kind.NUMBER, c.ops.number(_sign(n) * sa.func.ceiling(sa.func.abs(n))), x.err)


def _fn_floor(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    n = c.ops.decimal(n)
    return Value(Kind.NUMBER, c.ops.number(_sign(n) * sa.func.floor(sa.func.abs(n))), x.err)


def _fn_mceiling(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    n = c.ops.decimal(n)
    return Value(Kind.NUMBER, c.ops.number(sa.func.ceiling(n)), x.err)


def _fn_mfloor(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    n = c.ops.decimal(n)
    return Value(Kind.NUMBER, c.ops.number(sa.func.floor(n)), x.err)


def _guarded(c: FormulaCompiler, x: Value, bad: Pred, fn: str, n: Expr) -> Value:
    # The guard sits in the value too: MySQL warns (strict INSERT ... SELECT
    # errors) on LN(0), and an enclosing error predicate may evaluate it.
    value = sa.case((bad, sa.null()), else_=getattr(sa.func, fn)(n))
    return Value(Kind.NUMBER, c.ops.number(value), or_errs(x.err, bad))


def _fn_exp(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    return _guarded(c, x, n > int_lit(690), "exp", n)


def _fn_ln(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    return _guarded(c, x, n <= int_lit(0), "ln", n)


def _fn_log(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    return _guarded(c, x, n <= int_lit(0), "log10", n)


def _fn_sqrt(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    x, n = _num1(c, args)
    return _guarded(c, x, n < int_lit(0), "sqrt", n)


def _fn_mod(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """MOD(n, d): the remainder with the sign of n; d = 0 is an error."""
    a, b = args
    c.need(a, 1, Kind.NUMBER)
    c.need(b, 2, Kind.NUMBER)
    n, d = c.ops.number(a.sql), c.ops.number(b.sql)
    zero = d == int_lit(0)
    if c.ops.name == "sqlite":
        quotient = sa.cast(sa.cast(n, sa.REAL()) / d, sa.Integer())
        rem: Expr = n - d * quotient
    else:
        # + 0: MariaDB's MOD(-25.00, 1) is a decimal -0.00 that compares below 0.
        rem = sa.func.mod(n, d) + int_lit(0)
    value = sa.case((zero, sa.null()), else_=rem)
    return Value(Kind.NUMBER, c.ops.number(value), or_errs(errs_of(a, b), zero))


def _extreme(greatest: bool) -> Function:
    def impl(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
        for i, a in enumerate(args, 1):
            c.need(a, i, Kind.NUMBER)
        nums = [c.ops.number(a.sql) for a in args]
        if len(nums) == 1:
            return Value(Kind.NUMBER, nums[0], args[0].err)
        if c.ops.name == "sqlite":
            name = "max" if greatest else "min"
        else:
            name = "greatest" if greatest else "least"
        value = getattr(sa.func, name)(*nums)
        return Value(Kind.NUMBER, c.ops.number(value), errs_of(*args))

    return Function(impl, 1, None)


def _fn_pi(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    return Value(Kind.NUMBER, num_lit("3.14159265358979"))


def _fn_trunc(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """TRUNC(n[, digits]): drop digits toward zero (digits default 0, may be negative)."""
    x = args[0]
    c.need(x, 1, Kind.NUMBER)
    digits: Expr = int_lit(0)
    errs = [x]
    if len(args) == 2:
        c.need(args[1], 2, Kind.NUMBER)
        digits = sa.cast(c.ops.number(args[1].sql), sa.Integer())
        errs.append(args[1])
    n = c.ops.decimal(c.ops.number(x.sql))
    if c.ops.name == "sqlite":
        scale = sa.func.power(int_lit(10), digits)
        # round(.., 9) first: a double's 1.15 * 100 is 114.999...
        shifted = sa.func.round(n * scale, int_lit(9))
        value: Expr = _sign(n) * sa.func.floor(sa.func.abs(shifted)) / scale
    else:
        value = sa.func.truncate(n, digits)
    return Value(Kind.NUMBER, c.ops.number(value), errs_of(*errs))


#: DISTANCE's Earth: a sphere of the mean radius (km); a mile is 1.609344 km.
EARTH_RADIUS_KM = "6371.0"
KM_PER_MILE = "1.609344"


def _fn_geolocation(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """GEOLOCATION(latitude, longitude): a location, only usable inside DISTANCE()."""
    lat, lon = args
    c.need(lat, 1, Kind.NUMBER)
    c.need(lon, 2, Kind.NUMBER)
    return Value(Kind.LOCATION, c.ops.number(lat.sql), errs_of(lat, lon), lon=c.ops.number(lon.sql))


def _fn_distance(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """DISTANCE(loc1, loc2, 'mi' | 'km'): great-circle (haversine) distance; blank
    when a coordinate is blank.  The unit must be a literal, as Salesforce requires."""
    a, b, unit = args
    for i, loc in ((1, a), (2, b)):
        if loc.kind != Kind.LOCATION or loc.lon is None:
            raise ArgType(f"argument {i} must be a location (GEOLOCATION() or a Location field)")
    if unit.kind != Kind.TEXT or unit.const_text not in ("mi", "km"):
        raise ArgType("argument 3 must be the text literal 'mi' or 'km'")
    assert a.lon is not None and b.lon is not None
    rad = num_lit("0.0174532925199433")  # pi / 180
    lat1, lat2 = a.sql * rad, b.sql * rad
    dlat = (b.sql - a.sql) * rad / int_lit(2)
    dlon = (b.lon - a.lon) * rad / int_lit(2)
    h = sa.func.power(sa.func.sin(dlat), int_lit(2)) + sa.func.cos(lat1) * sa.func.cos(
        lat2
    ) * sa.func.power(sa.func.sin(dlon), int_lit(2))
    # LEAST(1, h): rounding may push h a hair above 1, where ASIN is undefined.
    h = sa.case((h > int_lit(1), int_lit(1)), else_=h)
    km = int_lit(2) * num_lit(EARTH_RADIUS_KM) * sa.func.asin(sa.func.sqrt(h))
    value = km if unit.const_text == "km" else km / num_lit(KM_PER_MILE)
    return Value(Kind.NUMBER, c.ops.number(value), errs_of(a, b))


def _fn_false(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """ISNEW() / ISCLONE(): a stored record is never new and never a clone."""
    return Value(Kind.BOOLEAN, sa.false())


def _fn_isnumber(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """ISNUMBER(text): TRUE when VALUE() would read it; blank is not a number."""
    (a,) = args
    c.need(a, 1, Kind.TEXT)
    if a.kind == Kind.NULL:
        return Value(Kind.BOOLEAN, sa.false(), a.err)
    _, invalid = c.ops.text_to_number(a.sql)
    blank = c.ops.is_blank_text(a.sql)
    ok = sa.case((blank, int_lit(0)), (invalid, int_lit(0)), else_=int_lit(1)) == int_lit(1)
    return Value(Kind.BOOLEAN, ok, a.err)


MATH_FUNCTIONS: dict[str, Function] = {
    "CEILING": Function(_fn_ceiling, 1, 1),
    "FLOOR": Function(_fn_floor, 1, 1),
    "MCEILING": Function(_fn_mceiling, 1, 1),
    "MFLOOR": Function(_fn_mfloor, 1, 1),
    "EXP": Function(_fn_exp, 1, 1),
    "LN": Function(_fn_ln, 1, 1),
    "LOG": Function(_fn_log, 1, 1),
    "SQRT": Function(_fn_sqrt, 1, 1),
    "MOD": Function(_fn_mod, 2, 2),
    "MAX": _extreme(True),
    "MIN": _extreme(False),
    "PI": Function(_fn_pi, 0, 0),
    "TRUNC": Function(_fn_trunc, 1, 2),
    "GEOLOCATION": Function(_fn_geolocation, 2, 2),
    "DISTANCE": Function(_fn_distance, 3, 3),
    "ISNEW": Function(_fn_false, 0, 0),
    "ISCLONE": Function(_fn_false, 0, 0),
    "ISNUMBER": Function(_fn_isnumber, 1, 1),
}
