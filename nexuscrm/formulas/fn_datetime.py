"""Date, date/time and time functions (Salesforce semantics, SQLite and MySQL SQL).

Storage is the one ``dialects`` documents (SQLite: ISO text; MySQL: DATE,
DATETIME, TIME), always GMT: a view has no user, so every conversion between
a date/time and text or a date is the GMT one Salesforce applies to a user in
GMT.  Invalid input (``DATE(2023, 2, 30)``, ``DATEVALUE("x")``) is a runtime
error: the field is blank for that row, as Salesforce shows ``#Error!``.
Salesforce's years run 1700 to 4000; ``DATE()`` outside them is an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.dialects.mysql import types as mysql_types

from nexuscrm.packs.model import FieldSpec

from .dialects import Expr, _IntervalDay, _IntervalMonth, _IntervalSecond, int_lit, str_lit
from .fnbase import Function
from .values import Kind, Pred, Value, errs_of, or_errs

if TYPE_CHECKING:
    from .compiler import FormulaCompiler


def _sqlite(c: FormulaCompiler) -> bool:
    return c.ops.name == "sqlite"


def _int(c: FormulaCompiler, x: Expr) -> Expr:
    """Truncate a number toward zero to an integer (both dialects agree)."""
    if _sqlite(c):
        return sa.cast(x, sa.Integer())
    return sa.cast(sa.func.truncate(x, int_lit(0)), sa.Integer())


def _part(c: FormulaCompiler, x: Expr, sqlite_fmt: str, mysql_fn: str) -> Expr:
    if _sqlite(c):
        return sa.cast(sa.func.strftime(str_lit(sqlite_fmt), x), sa.Integer())
    return getattr(sa.func, mysql_fn)(x)


def _date_part(fmt: str, mysql_fn: str) -> Function:
    def impl(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
        (d,) = args
        c.need(d, 1, Kind.DATE)
        return Value(Kind.NUMBER, c.ops.number(_part(c, d.sql, fmt, mysql_fn)), d.err)

    return Function(impl, 1, 1)


def _time_part(fmt: str, mysql_fn: str) -> Function:
    def impl(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
        (t,) = args
        c.need(t, 1, Kind.TIME)
        return Value(Kind.NUMBER, c.ops.number(_part(c, t.sql, fmt, mysql_fn)), t.err)

    return Function(impl, 1, 1)


def _fn_millisecond(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (t,) = args
    c.need(t, 1, Kind.TIME)
    if _sqlite(c):
        ms: Expr = sa.cast(
            sa.func.substr(sa.func.strftime(str_lit("%f"), t.sql), int_lit(4), int_lit(3)),
            sa.Integer(),
        )
    else:
        ms = sa.func.floor(sa.func.microsecond(t.sql) / int_lit(1000))
    return Value(Kind.NUMBER, c.ops.number(ms), t.err)


def _fn_weekday(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """1 = Sunday ... 7 = Saturday (Salesforce WEEKDAY)."""
    (d,) = args
    c.need(d, 1, Kind.DATE)
    if _sqlite(c):
        day = sa.cast(sa.func.strftime(str_lit("%w"), d.sql), sa.Integer()) + int_lit(1)
    else:
        day = sa.func.dayofweek(d.sql)
    return Value(Kind.NUMBER, c.ops.number(day), d.err)


def _iso_thursday(d: Expr) -> Expr:
    """SQLite: the Thursday of ``d``'s ISO week (it fixes the ISO year and week)."""
    back = (sa.cast(sa.func.strftime(str_lit("%w"), d), sa.Integer()) + int_lit(6)) % int_lit(7)
    # printf, not ||: SQLite's || binds tighter than % and -, SQLAlchemy's does not.
    modifier = sa.func.printf(str_lit("-%d days"), back)
    return sa.func.date(d, modifier, str_lit("+3 days"))


def _fn_isoweek(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (d,) = args
    c.need(d, 1, Kind.DATE)
    if _sqlite(c):
        doy = sa.cast(sa.func.strftime(str_lit("%j"), _iso_thursday(d.sql)), sa.Integer())
        week: Expr = sa.cast((doy - int_lit(1)) / int_lit(7), sa.Integer()) + int_lit(1)
    else:
        week = sa.func.week(d.sql, int_lit(3))
    return Value(Kind.NUMBER, c.ops.number(week), d.err)


def _fn_isoyear(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (d,) = args
    c.need(d, 1, Kind.DATE)
    if _sqlite(c):
        year: Expr = sa.cast(sa.func.strftime(str_lit("%Y"), _iso_thursday(d.sql)), sa.Integer())
    else:
        year = sa.func.floor(sa.func.yearweek(d.sql, int_lit(3)) / int_lit(100))
    return Value(Kind.NUMBER, c.ops.number(year), d.err)


def make_date(c: FormulaCompiler, y: Expr, m: Expr, d: Expr) -> tuple[Expr, Pred]:
    """(date, invalid) from year, month, day numbers; invalid when no such day."""
    yi, mi, di = _int(c, y), _int(c, m), _int(c, d)
    if _sqlite(c):
        first = sa.func.printf(str_lit("%04d-%02d-01"), yi, mi)
        last_day: Expr = sa.cast(
            sa.func.strftime(
                str_lit("%d"), sa.func.date(first, str_lit("+1 month"), str_lit("-1 day"))
            ),
            sa.Integer(),
        )
        value: Expr = sa.func.printf(str_lit("%04d-%02d-%02d"), yi, mi, di)
    else:
        first = sa.func.date_add(sa.func.makedate(yi, int_lit(1)), _month_interval(mi - 1))
        last_day = sa.func.day(sa.func.last_day(first))
        value = sa.func.date_add(first, _day_interval(di - 1))
    in_range = sa.and_(
        yi.between(int_lit(1700), int_lit(4000)),
        mi.between(int_lit(1), int_lit(12)),
        di >= int_lit(1),
    )
    # The day check only runs for a valid year and month (no warnings on MySQL).
    valid = sa.case((in_range, di <= last_day), else_=sa.false())
    invalid = sa.and_(y.is_not(None), m.is_not(None), d.is_not(None), sa.not_(valid == sa.true()))
    return sa.case((valid == sa.true(), value), else_=sa.null()), invalid


def _month_interval(n: Expr) -> Expr:
    return _IntervalMonth(n)


def _day_interval(n: Expr) -> Expr:
    return _IntervalDay(n)


def _fn_date(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    for i, a in enumerate(args, 1):
        c.need(a, i, Kind.NUMBER)
    y, m, d = (c.ops.number(a.sql) for a in args)
    value, invalid = make_date(c, y, m, d)
    return Value(Kind.DATE, value, or_errs(errs_of(*args), invalid))


def _fn_addmonths(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Salesforce: keeps the day of month if possible; the last day of a month,
    or a day the resulting month lacks, gives the resulting month's last day."""
    d, n = args
    c.need(d, 1, Kind.DATE)
    c.need(n, 2, Kind.NUMBER)
    months = _int(c, c.ops.number(n.sql))
    if _sqlite(c):
        mod = sa.func.printf(str_lit("%d months"), months)
        start = sa.func.date(d.sql, str_lit("start of month"), mod)
        last = sa.func.date(start, str_lit("+1 month"), str_lit("-1 day"))
        dom = sa.cast(sa.func.strftime(str_lit("%d"), d.sql), sa.Integer())
        last_dom = sa.cast(sa.func.strftime(str_lit("%d"), last), sa.Integer())
        is_last = sa.func.strftime(
            str_lit("%d"), sa.func.date(d.sql, str_lit("+1 day"))
        ) == str_lit("01")
        shifted = sa.func.date(start, sa.func.printf(str_lit("%d days"), dom - int_lit(1)))
        value = sa.case((sa.or_(is_last, dom >= last_dom), last), else_=shifted)
    else:
        target = sa.func.date_add(d.sql, _month_interval(months))
        value = sa.case((d.sql == sa.func.last_day(d.sql), sa.func.last_day(target)), else_=target)
    return Value(Kind.DATE, value, errs_of(d, n))


_DATE_RE = "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
_DATE_GLOB = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]"


def _matches(c: FormulaCompiler, t: Expr, regex: str, glob: str) -> Pred:
    if _sqlite(c):
        return t.op("GLOB")(str_lit(glob))
    return sa.cast(t, sa.LargeBinary()).op("REGEXP", is_comparison=True)(str_lit(regex))


def _text_date(c: FormulaCompiler, t: Expr) -> tuple[Expr, Pred]:
    """'YYYY-MM-DD' text -> (date, invalid)."""
    ok = _matches(c, t, _DATE_RE, _DATE_GLOB)

    def sub(start: int, length: int) -> Expr:
        piece = sa.func.substr(t, int_lit(start), int_lit(length))
        return sa.case((ok, c.ops.number(sa.cast(piece, sa.Integer()))), else_=int_lit(0))

    value, bad = make_date(c, sub(1, 4), sub(6, 2), sub(9, 2))
    invalid = sa.and_(t.is_not(None), t != str_lit(""), sa.or_(sa.not_(ok), bad))
    return sa.case((ok, value), else_=sa.null()), invalid


def _fn_datevalue(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Date from a date/time (its GMT date) or from 'YYYY-MM-DD' text."""
    (a,) = args
    c.need(a, 1, Kind.TEXT, Kind.DATE, Kind.DATETIME)
    if a.kind in (Kind.DATE, Kind.NULL):
        return Value(Kind.DATE, a.sql, a.err)
    if a.kind == Kind.DATETIME:
        return Value(Kind.DATE, sa.func.date(a.sql), a.err)
    t = sa.func.trim(a.sql)
    # A date/time text keeps only its date part, as Salesforce's DATEVALUE does.
    head = sa.func.substr(t, int_lit(1), int_lit(10))
    value, invalid = _text_date(c, head)
    bad_tail = sa.and_(
        sa.func.length(t) > int_lit(10),
        sa.not_(
            _matches(
                c,
                t,
                "^.{10} [0-9]{2}:[0-9]{2}:[0-9]{2}$",
                "?????????? [0-9][0-9]:[0-9][0-9]:[0-9][0-9]",
            )
        ),
    )
    return Value(Kind.DATE, value, or_errs(a.err, sa.or_(invalid, bad_tail)))


_TIME_RE = "^[0-9]{2}:[0-9]{2}:[0-9]{2}([.][0-9]{1,3})?$"


def _text_time(c: FormulaCompiler, t: Expr) -> tuple[Expr, Pred]:
    """'HH:MM:SS[.mmm]' text -> (time, invalid)."""
    if _sqlite(c):
        shape = sa.or_(
            t.op("GLOB")(str_lit("[0-9][0-9]:[0-9][0-9]:[0-9][0-9]")),
            t.op("GLOB")(str_lit("[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9]")),
            t.op("GLOB")(str_lit("[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9]")),
            t.op("GLOB")(str_lit("[0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9]")),
        )
    else:
        shape = sa.cast(t, sa.LargeBinary()).op("REGEXP", is_comparison=True)(str_lit(_TIME_RE))

    def sub(start: int) -> Expr:
        return sa.cast(sa.func.substr(t, int_lit(start), int_lit(2)), sa.Integer())

    ok = sa.and_(shape, sub(1) < int_lit(24), sub(4) < int_lit(60), sub(7) < int_lit(60))
    ok = sa.case((shape, ok), else_=sa.false()) == sa.true()
    if _sqlite(c):
        value: Expr = sa.func.strftime(str_lit("%H:%M:%f"), t)
    else:
        value = sa.cast(t, mysql_types.TIME(fsp=3))
    invalid = sa.and_(t.is_not(None), t != str_lit(""), sa.not_(ok))
    return sa.case((ok, value), else_=sa.null()), invalid


def _fn_timevalue(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Time from a date/time (its GMT time of day) or from 'HH:MM:SS.MS' text."""
    (a,) = args
    c.need(a, 1, Kind.TEXT, Kind.DATETIME)
    if a.kind == Kind.NULL:
        return Value(Kind.TIME, sa.null(), a.err)
    if a.kind == Kind.DATETIME:
        if _sqlite(c):
            return Value(Kind.TIME, sa.func.strftime(str_lit("%H:%M:%f"), a.sql), a.err)
        return Value(Kind.TIME, sa.func.time(a.sql), a.err)
    value, invalid = _text_time(c, sa.func.trim(a.sql))
    return Value(Kind.TIME, value, or_errs(a.err, invalid))


def _fn_datetimevalue(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Date/time (GMT) from a date (midnight) or 'YYYY-MM-DD[ HH:MM:SS]' text."""
    (a,) = args
    c.need(a, 1, Kind.TEXT, Kind.DATE, Kind.DATETIME)
    if a.kind in (Kind.DATETIME, Kind.NULL):
        return Value(Kind.DATETIME, a.sql, a.err)
    sqlite = _sqlite(c)
    if a.kind == Kind.DATE:
        if sqlite:
            return Value(Kind.DATETIME, sa.func.datetime(a.sql), a.err)
        return Value(Kind.DATETIME, sa.func.timestamp(a.sql), a.err)
    t = sa.func.trim(a.sql)
    day, bad_day = _text_date(c, sa.func.substr(t, int_lit(1), int_lit(10)))
    clock = sa.func.substr(t, int_lit(12), int_lit(8))
    tm, bad_time = _text_time(c, clock)
    has_time = sa.func.length(t) > int_lit(10)
    bad_sep = sa.and_(
        has_time,
        sa.or_(
            sa.func.substr(t, int_lit(11), int_lit(1)) != str_lit(" "),
            sa.func.length(t) != int_lit(19),
        ),
    )
    if sqlite:
        joined: Expr = sa.func.datetime(
            sa.type_coerce(day, sa.String())
            .concat(str_lit(" "))
            .concat(sa.case((has_time, clock), else_=str_lit("00:00:00")))
        )
    else:
        joined = sa.func.timestamp(day, sa.case((has_time, tm), else_=str_lit("00:00:00")))
    invalid = sa.or_(bad_day, sa.and_(has_time, bad_time), bad_sep)
    return Value(Kind.DATETIME, joined, or_errs(a.err, invalid))


def _fn_timenow(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    if _sqlite(c):
        return Value(Kind.TIME, sa.func.strftime(str_lit("%H:%M:%f"), str_lit("now")))
    return Value(Kind.TIME, sa.func.utc_time(int_lit(3)))


def _fn_unixtimestamp(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Seconds since 1970-01-01 00:00:00 GMT for a date or date/time; seconds
    since midnight for a time (Salesforce UNIXTIMESTAMP)."""
    (a,) = args
    c.need(a, 1, Kind.DATE, Kind.DATETIME, Kind.TIME)
    if a.kind == Kind.NULL:
        return Value(Kind.NUMBER, sa.null(), a.err)
    if _sqlite(c):
        x = a.sql
        if a.kind == Kind.TIME:
            x = str_lit("1970-01-01 ").concat(sa.func.strftime(str_lit("%H:%M:%S"), x))
        secs: Expr = sa.cast(sa.func.strftime(str_lit("%s"), x), sa.Integer())
    elif a.kind == Kind.TIME:
        secs = sa.func.floor(sa.func.time_to_sec(a.sql))
    else:
        epoch = sa.func.timestamp(str_lit("1970-01-01 00:00:00"))
        secs = sa.func.timestampdiff(sa.literal_column("SECOND"), epoch, a.sql)
    return Value(Kind.NUMBER, c.ops.number(secs), a.err)


def _fn_fromunixtime(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Date/time (GMT) of a number of seconds since 1970-01-01 (fraction dropped)."""
    (n,) = args
    c.need(n, 1, Kind.NUMBER)
    secs = sa.func.floor(c.ops.number(n.sql))
    if _sqlite(c):
        value: Expr = sa.func.datetime(sa.cast(secs, sa.Integer()), str_lit("unixepoch"))
    else:
        value = sa.func.date_add(
            sa.func.timestamp(str_lit("1970-01-01 00:00:00")), _IntervalSecond(secs)
        )
    return Value(Kind.DATETIME, value, n.err)


DATETIME_FUNCTIONS: dict[str, Function] = {
    "YEAR": _date_part("%Y", "year"),
    "MONTH": _date_part("%m", "month"),
    "DAY": _date_part("%d", "dayofmonth"),
    "DAYOFYEAR": _date_part("%j", "dayofyear"),
    "WEEKDAY": Function(_fn_weekday, 1, 1),
    "ISOWEEK": Function(_fn_isoweek, 1, 1),
    "ISOYEAR": Function(_fn_isoyear, 1, 1),
    "HOUR": _time_part("%H", "hour"),
    "MINUTE": _time_part("%M", "minute"),
    "SECOND": _time_part("%S", "second"),
    "MILLISECOND": Function(_fn_millisecond, 1, 1),
    "DATE": Function(_fn_date, 3, 3),
    "ADDMONTHS": Function(_fn_addmonths, 2, 2),
    "DATEVALUE": Function(_fn_datevalue, 1, 1),
    "DATETIMEVALUE": Function(_fn_datetimevalue, 1, 1),
    "TIMEVALUE": Function(_fn_timevalue, 1, 1),
    "TIMENOW": Function(_fn_timenow, 0, 0),
    "UNIXTIMESTAMP": Function(_fn_unixtimestamp, 1, 1),
    "FROMUNIXTIME": Function(_fn_fromunixtime, 1, 1),
}
