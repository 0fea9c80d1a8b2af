"""Per-dialect SQL for the operations plain SQL spells differently.

Storage the compiler expects (DESIGN.md's conventions):

========  ===================================  ======================
type      SQLite                               MySQL / MariaDB / TiDB
========  ===================================  ======================
Date      TEXT ``'YYYY-MM-DD'``                DATE
DateTime  TEXT ``'YYYY-MM-DD HH:MM:SS'`` (UTC)  DATETIME (UTC)
Time      TEXT ``'HH:MM:SS[.fff]'``             TIME
Checkbox  INTEGER 0/1                          BOOLEAN (TINYINT 0/1)
Number    NUMERIC (REAL/INTEGER)               DECIMAL or DOUBLE
========  ===================================  ======================

``TODAY()`` and ``NOW()`` are the current UTC date and timestamp on both
dialects: a view has no user, so there is no user time zone to apply, and the
server's local zone differs between hosts while UTC does not.

SQLite needs a build with the math functions (``power``, ``log10``), which
every SQLite >= 3.35 that Python ships has.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

Expr = ColumnElement[Any]


class _IntervalDay(FunctionElement[Any]):
    """``INTERVAL <expr> DAY`` for MySQL ``DATE_ADD`` (SQLAlchemy has no construct)."""

    name = "interval_day"
    inherit_cache = True


class _IntervalSecond(FunctionElement[Any]):
    """``INTERVAL <expr> SECOND``."""

    name = "interval_second"
    inherit_cache = True


class _IntervalMonth(FunctionElement[Any]):
    """``INTERVAL <expr> MONTH``."""

    name = "interval_month"
    inherit_cache = True


@compiles(_IntervalMonth)
def _compile_interval_month(element: _IntervalMonth, compiler: Any, **kw: Any) -> str:
    return f"INTERVAL {compiler.process(element.clauses, **kw)} MONTH"


@compiles(_IntervalDay)
def _compile_interval_day(element: _IntervalDay, compiler: Any, **kw: Any) -> str:
    return f"INTERVAL {compiler.process(element.clauses, **kw)} DAY"


@compiles(_IntervalSecond)
def _compile_interval_second(element: _IntervalSecond, compiler: Any, **kw: Any) -> str:
    return f"INTERVAL {compiler.process(element.clauses, **kw)} SECOND"


class _TrimTrailingZeros(FunctionElement[Any]):
    """``TRIM(TRAILING '0' FROM <expr>)`` (MySQL syntax, no SQLAlchemy construct)."""

    name = "trim_trailing_zeros"
    inherit_cache = True


class _TrimTrailingDot(FunctionElement[Any]):
    """``TRIM(TRAILING '.' FROM <expr>)``."""

    name = "trim_trailing_dot"
    inherit_cache = True


@compiles(_TrimTrailingZeros)
def _compile_trim_zeros(element: _TrimTrailingZeros, compiler: Any, **kw: Any) -> str:
    return f"TRIM(TRAILING '0' FROM {compiler.process(element.clauses, **kw)})"


@compiles(_TrimTrailingDot)
def _compile_trim_dot(element: _TrimTrailingDot, compiler: Any, **kw: Any) -> str:
    return f"TRIM(TRAILING '.' FROM {compiler.process(element.clauses, **kw)})"


def num_lit(text: str) -> Expr:
    """A numeric literal from validated digits (rendered verbatim, never a bind)."""
    return sa.literal_column(text, sa.Numeric())


def int_lit(value: int) -> Expr:
    """An integer literal rendered inline."""
    return sa.literal_column(str(int(value)), sa.Integer())


def str_lit(value: str) -> Expr:
    """A string literal; the dialect escapes it when rendered with literal_binds."""
    return sa.literal(value, sa.String())


def html_escape(x: Expr) -> Expr:
    """Escape ``& " < >`` so field data cannot break out of an HTML attribute."""
    out = sa.func.replace(x, str_lit("&"), str_lit("&amp;"))
    out = sa.func.replace(out, str_lit('"'), str_lit("&quot;"))
    out = sa.func.replace(out, str_lit("<"), str_lit("&lt;"))
    return sa.func.replace(out, str_lit(">"), str_lit("&gt;"))


class DialectOps:
    """SQL spellings shared by both dialects; subclasses override the rest."""

    name = ""

    def sa_dialect(self) -> sa.engine.Dialect:
        """A SQLAlchemy dialect object for rendering checks (no connection needed)."""
        raise NotImplementedError

    # -- text ------------------------------------------------------------
    def concat(self, pieces: list[Expr]) -> Expr:
        """Concatenate pieces that are never NULL (the caller coalesces blanks to '')."""
        out: Expr = sa.type_coerce(pieces[0], sa.String())
        for piece in pieces[1:]:
            out = out.concat(piece)
        return out

    def length(self, x: Expr) -> Expr:
        """Character length; blank text has length 0."""
        raise NotImplementedError

    def text_cmp_operand(self, x: Expr) -> Expr:
        """Text prepared for a case-sensitive comparison, blank as ''."""
        return sa.func.coalesce(x, str_lit(""))

    def blank_to_null(self, x: Expr) -> Expr:
        """A text result: '' reads as NULL (blank)."""
        return sa.func.nullif(x, str_lit(""))

    def is_blank_text(self, x: Expr) -> ColumnElement[bool]:
        """True when the text is NULL or has no characters (never NULL itself)."""
        return sa.func.coalesce(self.length(x), int_lit(0)) == int_lit(0)

    def trim_blanks(self, x: Expr) -> Expr:
        """Text without leading/trailing spaces, tabs, CRs and LFs (Salesforce TRIM
        and the trimming of every Text result)."""
        raise NotImplementedError

    def number_to_text(self, x: Expr) -> Expr:
        """TEXT(number): plain decimal notation (never an exponent), at most 15
        significant digits (what a double holds exactly, so both dialects agree),
        no trailing zeros."""
        raise NotImplementedError

    def date_to_text(self, x: Expr) -> Expr:
        """TEXT(date): ``YYYY-MM-DD``."""
        raise NotImplementedError

    def datetime_to_text(self, x: Expr) -> Expr:
        """TEXT(datetime): ``YYYY-MM-DD HH:MM:SSZ`` in GMT, as Salesforce renders it."""
        raise NotImplementedError

    def time_to_text(self, x: Expr) -> Expr:
        """TEXT(time): ``HH:MM:SS.sssZ``."""
        raise NotImplementedError

    def text_to_number(self, x: Expr) -> tuple[Expr, ColumnElement[bool]]:
        """VALUE(text): (number or NULL, predicate true when the text is not a number)."""
        raise NotImplementedError

    # -- numbers ---------------------------------------------------------
    def number(self, x: Expr) -> Expr:
        """Mark an expression numeric so SQLAlchemy picks arithmetic operators."""
        return sa.type_coerce(x, sa.Numeric())

    def decimal(self, x: Expr) -> Expr:
        """``x`` as the decimal number Salesforce computes, before a function that
        cuts at a digit (FLOOR, CEILING, TRUNC): the MySQL family computes in
        DECIMAL already, so ``x`` itself."""
        return x

    def divide(self, a: Expr, b: Expr) -> Expr:
        """a / b, NULL when b is 0 (the caller also reports it as an error)."""
        raise NotImplementedError

    def power(self, a: Expr, b: Expr) -> tuple[Expr, ColumnElement[bool]]:
        """(a ^ b, error predicate) - errors where the result is undefined or overflows."""
        undefined = sa.case(
            (a == int_lit(0), b < int_lit(0)),
            (a < int_lit(0), b != sa.func.floor(b)),
            else_=b * sa.func.log10(sa.func.abs(a)) > int_lit(300),
        )
        # The guard sits in the value too: MySQL raises (not NULLs) on overflow,
        # and an enclosing error predicate may evaluate this value.
        value = sa.case((undefined, sa.null()), else_=sa.func.power(a, b))
        return value, undefined

    def round(self, x: Expr, digits: Expr, digits_const: int | None) -> Expr:
        """ROUND half away from zero, negative digits round left of the point."""
        raise NotImplementedError

    # -- dates -----------------------------------------------------------
    def today(self) -> Expr:
        """Current UTC date."""
        raise NotImplementedError

    def now(self) -> Expr:
        """Current UTC timestamp."""
        raise NotImplementedError

    def date_diff(self, a: Expr, b: Expr) -> Expr:
        """a - b for dates: whole days."""
        raise NotImplementedError

    def date_add(self, d: Expr, days: Expr) -> Expr:
        """date + days (fraction truncated: a date has no time of day)."""
        raise NotImplementedError

    def datetime_diff(self, a: Expr, b: Expr) -> Expr:
        """a - b for datetimes: days with a fraction."""
        raise NotImplementedError

    def datetime_add(self, d: Expr, days: Expr) -> Expr:
        """datetime + days (fraction allowed, rounded to whole seconds)."""
        raise NotImplementedError

    def time_ms(self, t: Expr) -> Expr:
        """Milliseconds since midnight of a time."""
        raise NotImplementedError

    def time_add_ms(self, t: Expr, ms: Expr) -> Expr:
        """A time plus a number of milliseconds (fraction dropped), modulo 24 hours."""
        raise NotImplementedError

    def temporal_cmp_operand(self, x: Expr, kind: str) -> Expr:
        """A date/datetime/time operand normalised for comparison (kind: date|datetime|time)."""
        return x


class SqliteOps(DialectOps):
    """SQLite: dates as ISO text, julianday()/date() arithmetic, REAL numbers."""

    name = "sqlite"

    def sa_dialect(self) -> sa.engine.Dialect:
        return sqlite_dialect.dialect()

    def length(self, x: Expr) -> Expr:
        return sa.func.length(x)

    def trim_blanks(self, x: Expr) -> Expr:
        return sa.func.trim(x, sa.func.char(int_lit(32), int_lit(9), int_lit(10), int_lit(13)))

    def number_to_text(self, x: Expr) -> Expr:
        # Whole numbers print without ".0"; others with 15 significant digits
        # in fixed notation (nexuscrm.db.sqlfuncs.number_text).
        return sa.func.nx_number_text(x)

    def date_to_text(self, x: Expr) -> Expr:
        return sa.func.strftime(str_lit("%Y-%m-%d"), x)

    def datetime_to_text(self, x: Expr) -> Expr:
        return sa.func.strftime(str_lit("%Y-%m-%d %H:%M:%SZ"), x)

    def time_to_text(self, x: Expr) -> Expr:
        return sa.func.strftime(str_lit("%H:%M:%f"), x).concat(str_lit("Z"))

    def text_to_number(self, x: Expr) -> tuple[Expr, ColumnElement[bool]]:
        # nx_text_number: digits with at most one '.' and one leading sign,
        # surrounding spaces ignored; anything else is NULL (and an error
        # unless blank). One call each: inline checks repeated the argument
        # six times, too deep for SQLite's parser inside bigger formulas.
        return sa.func.nx_text_number(x), sa.func.nx_text_number_invalid(x) == int_lit(1)

    def number(self, x: Expr) -> Expr:
        return sa.type_coerce(x, sa.Float())

    def decimal(self, x: Expr) -> Expr:
        # SQLite computes in binary floating point: 0.29 * 100 is
        # 28.999999999999996 and FLOOR would give 28 where Salesforce's decimal
        # arithmetic gives 29. nx_decimal keeps 15 significant digits (all a
        # double holds exactly), which drops such artifacts and nothing else.
        return self.number(sa.func.nx_decimal(x))

    def divide(self, a: Expr, b: Expr) -> Expr:
        # CAST to REAL: SQLite divides two integers with truncation (7/2 = 3).
        return sa.case(
            (b == int_lit(0), sa.null()),
            else_=sa.cast(a, sa.REAL()) / b,
        )

    def round(self, x: Expr, digits: Expr, digits_const: int | None) -> Expr:
        # SQLite's round() is half away from zero (Salesforce's rule) but treats
        # negative digits as 0, so those scale through a power of ten.
        if digits_const is not None and digits_const >= 0:
            return sa.func.round(x, int_lit(digits_const))
        if digits_const is not None:
            scale = num_lit(str(10 ** (-digits_const)))
            return sa.func.round(x / scale) * scale
        d = sa.cast(digits, sa.Integer())
        scale_expr = sa.func.power(int_lit(10), -d)
        return sa.case(
            (d >= int_lit(0), sa.func.round(x, d)),
            else_=sa.func.round(x / scale_expr) * scale_expr,
        )

    def today(self) -> Expr:
        return sa.func.date(str_lit("now"))

    def now(self) -> Expr:
        return sa.func.datetime(str_lit("now"))

    def date_diff(self, a: Expr, b: Expr) -> Expr:
        return sa.cast(
            sa.func.julianday(sa.func.date(a)) - sa.func.julianday(sa.func.date(b)),
            sa.Integer(),
        )

    def date_add(self, d: Expr, days: Expr) -> Expr:
        # "N days" modifier: exact calendar arithmetic; NULL days -> NULL date.
        modifier = sa.type_coerce(sa.cast(days, sa.Integer()), sa.String()).concat(str_lit(" days"))
        return sa.func.date(d, modifier)

    def datetime_diff(self, a: Expr, b: Expr) -> Expr:
        # Whole seconds / 86400.0: exact, where julianday() differences drift.
        secs_a = sa.cast(sa.func.strftime(str_lit("%s"), a), sa.Integer())
        secs_b = sa.cast(sa.func.strftime(str_lit("%s"), b), sa.Integer())
        return (secs_a - secs_b) / num_lit("86400.0")

    def datetime_add(self, d: Expr, days: Expr) -> Expr:
        secs = sa.cast(sa.func.round(days * int_lit(86400)), sa.Integer())
        modifier = sa.type_coerce(secs, sa.String()).concat(str_lit(" seconds"))
        return sa.func.datetime(d, modifier)

    def time_ms(self, t: Expr) -> Expr:
        def part(fmt: str) -> Expr:
            return sa.cast(sa.func.strftime(str_lit(fmt), t), sa.Integer())

        frac = sa.cast(
            sa.func.round(sa.func.strftime(str_lit("%f"), t) * int_lit(1000)), sa.Integer()
        )
        return part("%H") * int_lit(3600000) + part("%M") * int_lit(60000) + frac

    def time_add_ms(self, t: Expr, ms: Expr) -> Expr:
        day = int_lit(86400000)
        total = (self.time_ms(t) + sa.cast(ms, sa.Integer())) % day
        total = (total + day) % day
        return sa.func.printf(
            str_lit("%02d:%02d:%02d.%03d"),
            total // int_lit(3600000),
            (total // int_lit(60000)) % int_lit(60),
            (total // int_lit(1000)) % int_lit(60),
            total % int_lit(1000),
        )

    def temporal_cmp_operand(self, x: Expr, kind: str) -> Expr:
        # julianday() makes '2024-01-01 00:00:00' and '2024-01-01T00:00:00.000'
        # compare equal; text comparison would not.
        if kind == "time":
            return sa.func.strftime(str_lit("%H:%M:%f"), x)
        return sa.func.julianday(x)


class MysqlOps(DialectOps):
    """MySQL / MariaDB / TiDB: DATE/DATETIME columns, DECIMAL arithmetic."""

    name = "mysql"

    def sa_dialect(self) -> sa.engine.Dialect:
        return mysql_dialect.dialect()

    def concat(self, pieces: list[Expr]) -> Expr:
        # One flat CONCAT(); MySQL's || is logical OR unless PIPES_AS_CONCAT.
        return sa.func.concat(*pieces)

    def length(self, x: Expr) -> Expr:
        return sa.func.char_length(x)

    def trim_blanks(self, x: Expr) -> Expr:
        return sa.func.regexp_replace(x, str_lit("^[ \t\r\n]+|[ \t\r\n]+$"), str_lit(""))

    def text_cmp_operand(self, x: Expr) -> Expr:
        # BINARY: Salesforce text comparison is case-sensitive and counts trailing
        # spaces; MySQL's default collations are neither.
        return sa.cast(sa.func.coalesce(x, str_lit("")), sa.LargeBinary())

    def blank_to_null(self, x: Expr) -> Expr:
        # A binary '' makes the comparison binary: PAD SPACE collations would
        # otherwise take '  ' for ''.
        return sa.func.nullif(x, sa.cast(str_lit(""), sa.LargeBinary()))

    def number_to_text(self, x: Expr) -> Expr:
        # Rounded to 15 significant digits as DECIMAL (a DOUBLE would print
        # with an exponent), then trailing zeros dropped.
        magnitude = sa.func.floor(sa.func.log10(sa.func.abs(x)))
        decimals = sa.func.least(int_lit(30), sa.func.greatest(int_lit(0), int_lit(14) - magnitude))
        rounded = sa.func.round(sa.cast(x, sa.Numeric(65, 30)), decimals)
        # CONCAT(n), not CAST(n AS CHAR): MariaDB stores a view's CAST AS CHAR as
        # ``cast(.. as char charset utf8mb4)``, which reads back in utf8mb4's default
        # collation (general_ci), not the install's, and mixes with the columns beside
        # it (1267/1270 on a ``unicode_ci`` database). CONCAT keeps the view's
        # connection collation as a coercible value, which the columns' collation wins.
        s = sa.func.concat(sa.case((x == int_lit(0), int_lit(0)), else_=rounded))
        return sa.case(
            (sa.func.locate(str_lit("."), s) > int_lit(0), _TrimTrailingDot(_TrimTrailingZeros(s))),
            else_=s,
        )

    def date_to_text(self, x: Expr) -> Expr:
        return sa.func.date_format(x, str_lit("%Y-%m-%d"))

    def datetime_to_text(self, x: Expr) -> Expr:
        return sa.func.date_format(x, str_lit("%Y-%m-%d %H:%i:%sZ"))

    def time_to_text(self, x: Expr) -> Expr:
        return sa.func.concat(
            sa.func.left(sa.func.time_format(x, str_lit("%H:%i:%s.%f")), int_lit(12)),
            str_lit("Z"),
        )

    def text_to_number(self, x: Expr) -> tuple[Expr, ColumnElement[bool]]:
        t = sa.func.trim(x)
        valid = t.op("REGEXP")(str_lit("^[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)$"))
        invalid = sa.and_(t != str_lit(""), sa.not_(valid))
        # Guarded: CAST('12abc' AS DECIMAL) warns, and strict INSERT ... SELECT
        # turns that warning into an error.
        value = sa.case((valid, sa.cast(t, sa.Numeric(65, 30))), else_=sa.null())
        return value, invalid

    def divide(self, a: Expr, b: Expr) -> Expr:
        # DECIMAL(65,30): MySQL's default division scale (+4 digits) would make
        # 1/3 = 0.3333.  The CASE keeps x/0 out of strict-mode INSERT ... SELECT.
        return sa.case(
            (b == int_lit(0), sa.null()),
            else_=sa.cast(a, sa.Numeric(65, 30)) / b,
        )

    def round(self, x: Expr, digits: Expr, digits_const: int | None) -> Expr:
        # DECIMAL first: MySQL rounds DOUBLE half-to-even (ROUND(2.5e0) = 2),
        # DECIMAL half away from zero as Salesforce does.
        d = int_lit(digits_const) if digits_const is not None else sa.cast(digits, sa.Integer())
        return sa.func.round(sa.cast(x, sa.Numeric(65, 30)), d)

    def today(self) -> Expr:
        return sa.func.utc_date()

    def now(self) -> Expr:
        return sa.func.utc_timestamp()

    def date_diff(self, a: Expr, b: Expr) -> Expr:
        return sa.func.datediff(a, b)

    def date_add(self, d: Expr, days: Expr) -> Expr:
        return sa.func.date_add(d, _IntervalDay(sa.func.truncate(days, int_lit(0))))

    def datetime_diff(self, a: Expr, b: Expr) -> Expr:
        secs = sa.func.timestampdiff(sa.literal_column("SECOND"), b, a)
        return sa.cast(secs, sa.Numeric(65, 30)) / int_lit(86400)

    def datetime_add(self, d: Expr, days: Expr) -> Expr:
        return sa.func.date_add(d, _IntervalSecond(sa.func.round(days * int_lit(86400))))

    def time_ms(self, t: Expr) -> Expr:
        return (
            sa.func.hour(t) * int_lit(3600000)
            + sa.func.minute(t) * int_lit(60000)
            + sa.func.second(t) * int_lit(1000)
            + sa.func.floor(sa.func.microsecond(t) / int_lit(1000))
        )

    def time_add_ms(self, t: Expr, ms: Expr) -> Expr:
        day = int_lit(86400000)
        total = sa.func.mod(
            sa.func.mod(self.time_ms(t) + sa.func.truncate(ms, int_lit(0)), day) + day, day
        )
        return sa.cast(
            sa.func.sec_to_time(sa.cast(total, sa.Numeric(20, 0)) / int_lit(1000)),
            mysql_dialect.TIME(fsp=3),
        )


def ops_for(dialect: str) -> DialectOps:
    """The operations for ``'sqlite'`` or ``'mysql'`` (MariaDB and TiDB are ``'mysql'``).

    Raises ``ValueError`` for any other name.
    """
    key = dialect.lower()
    if key == "sqlite":
        return SqliteOps()
    if key in ("mysql", "mariadb", "tidb"):
        return MysqlOps()
    raise ValueError(f"unsupported dialect {dialect!r}: expected 'sqlite' or 'mysql'")
