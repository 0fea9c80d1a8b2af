"""Text functions (Salesforce semantics; searches are case-sensitive).

Blank text is '' (``LEN`` 0, ``FIND`` 0).  Positions count characters, not
bytes, on both dialects.  SQLite's own ``upper``/``lower`` fold ASCII only, so
SQLite views call the ``nx_*`` functions of :mod:`nexuscrm.db.sqlfuncs`
(registered on every connection of :func:`nexuscrm.db.engine.make_engine`).
URLENCODE percent-encodes the ASCII characters RFC 3986 reserves; other
characters pass through unchanged on both dialects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from nexuscrm.packs.model import FieldSpec

from .dialects import Expr, html_escape, int_lit, str_lit
from .fnbase import Function
from .values import ArgType, Kind, Value, errs_of, or_errs

if TYPE_CHECKING:
    from .compiler import FormulaCompiler


class _Utf8Bin(FunctionElement[Any]):
    """MySQL: ``CONVERT(<expr> USING utf8mb4) COLLATE utf8mb4_bin`` (case-sensitive)."""

    name = "utf8_bin"
    inherit_cache = True


@compiles(_Utf8Bin)
def _compile_utf8_bin(element: _Utf8Bin, compiler: Any, **kw: Any) -> str:
    return f"CONVERT({compiler.process(element.clauses, **kw)} USING utf8mb4) COLLATE utf8mb4_bin"


class _ChrUtf32(FunctionElement[Any]):
    """MySQL: the character of a code point, ``CONVERT(CHAR(n USING utf32) USING utf8mb4)``."""

    name = "chr_utf32"
    inherit_cache = True


@compiles(_ChrUtf32)
def _compile_chr(element: _ChrUtf32, compiler: Any, **kw: Any) -> str:
    arg = compiler.process(element.clauses, **kw)
    return f"CONVERT(CHAR({arg} USING utf32) USING utf8mb4)"


class _Utf32(FunctionElement[Any]):
    """MySQL: ``CONVERT(<expr> USING utf32)`` (one 4-byte code unit per character)."""

    name = "utf32"
    inherit_cache = True


@compiles(_Utf32)
def _compile_utf32(element: _Utf32, compiler: Any, **kw: Any) -> str:
    return f"CONVERT({compiler.process(element.clauses, **kw)} USING utf32)"


#: MySQL/MariaDB INITCAP handles texts up to this many characters (MySQL's
#: default cte_max_recursion_depth is 1000); longer text is a runtime error.
INITCAP_MAX_CHARS = 1000


class _InitcapMysql(FunctionElement[Any]):
    """MySQL: INITCAP as a scalar subquery over the character positions."""

    name = "initcap_mysql"
    inherit_cache = True


@compiles(_InitcapMysql)
def _compile_initcap(element: _InitcapMysql, compiler: Any, **kw: Any) -> str:
    x = compiler.process(element.clauses, **kw)
    # (*UCP): [[:alnum:]] covers every Unicode letter and digit, as Python's isalnum().
    return (
        f"(WITH RECURSIVE nx_pos(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM nx_pos "
        f"WHERE i < {INITCAP_MAX_CHARS}) "
        f"SELECT GROUP_CONCAT(IF(i = 1 OR SUBSTR({x}, i - 1, 1) NOT REGEXP "
        f"'(*UCP)^[[:alnum:]]$', UPPER(SUBSTR({x}, i, 1)), LOWER(SUBSTR({x}, i, 1))) "
        f"ORDER BY i SEPARATOR '') FROM nx_pos WHERE i <= CHAR_LENGTH({x}))"
    )


def _sqlite(c: FormulaCompiler) -> bool:
    return c.ops.name == "sqlite"


def _txt(c: FormulaCompiler, v: Value) -> Expr:
    """Text with blank as ''."""
    return c.text_piece(v)


def _bin(c: FormulaCompiler, x: Expr) -> Expr:
    return x if _sqlite(c) else _Utf8Bin(x)


def _texts(c: FormulaCompiler, args: list[Value], n: int) -> None:
    for i, a in enumerate(args[:n], 1):
        c.need(a, i, Kind.TEXT)


def _count(c: FormulaCompiler, v: Value) -> Expr:
    """A character count argument: truncated, negative as 0 (Salesforce)."""
    n = sa.cast(c.ops.number(v.sql), sa.Integer()) if _sqlite(c) else sa.func.truncate(v.sql, 0)
    return sa.case((n < int_lit(0), int_lit(0)), else_=n)


def _fn_begins(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    t, s = args
    _texts(c, args, 2)
    head = sa.func.substr(_txt(c, t), int_lit(1), c.ops.length(_txt(c, s)))
    pred = c.ops.text_cmp_operand(head) == c.ops.text_cmp_operand(_txt(c, s))
    return Value(Kind.BOOLEAN, pred, errs_of(t, s))


def _position(c: FormulaCompiler, needle: Expr, hay: Expr) -> Expr:
    if _sqlite(c):
        return sa.func.instr(hay, needle)
    return sa.func.locate(_bin(c, needle), _bin(c, hay))


def _fn_contains(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    t, s = args
    _texts(c, args, 2)
    pred = _position(c, _txt(c, s), _txt(c, t)) > int_lit(0)
    return Value(Kind.BOOLEAN, pred, errs_of(t, s))


def _fn_find(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """FIND(search, text[, start]): 1-based position, 0 when absent or search blank."""
    _texts(c, args, 2)
    s, t = _txt(c, args[0]), _txt(c, args[1])
    start: Expr = int_lit(1)
    if len(args) == 3:
        c.need(args[2], 3, Kind.NUMBER)
        start = sa.func.coalesce(_count(c, args[2]), int_lit(1))
        start = sa.case((start < int_lit(1), int_lit(1)), else_=start)
    found = _position(c, s, sa.func.substr(t, start))
    pos = sa.case(
        (c.ops.length(s) == int_lit(0), int_lit(0)),
        (found == int_lit(0), int_lit(0)),
        else_=found + start - int_lit(1),
    )
    return Value(Kind.NUMBER, c.ops.number(pos), errs_of(*args))


def _fn_left(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    t, n = args
    c.need(t, 1, Kind.TEXT)
    c.need(n, 2, Kind.NUMBER)
    return Value(Kind.TEXT, sa.func.substr(t.sql, int_lit(1), _count(c, n)), errs_of(t, n))


def _fn_right(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    t, n = args
    c.need(t, 1, Kind.TEXT)
    c.need(n, 2, Kind.NUMBER)
    k = _count(c, n)
    length = c.ops.length(t.sql)
    start = sa.case((k >= length, int_lit(1)), else_=length - k + int_lit(1))
    value = sa.case((k == int_lit(0), str_lit("")), else_=sa.func.substr(t.sql, start))
    return Value(Kind.TEXT, value, errs_of(t, n))


def _fn_mid(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    t, start, n = args
    c.need(t, 1, Kind.TEXT)
    c.need(start, 2, Kind.NUMBER)
    c.need(n, 3, Kind.NUMBER)
    s = _count(c, start)
    s = sa.case((s < int_lit(1), int_lit(1)), else_=s)
    return Value(Kind.TEXT, sa.func.substr(t.sql, s, _count(c, n)), errs_of(*args))


def _pad(left: bool) -> Function:
    def impl(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
        """LPAD/RPAD(text, length[, pad]): pad with spaces by default; text longer
        than length is cut to length from the right (Salesforce)."""
        t, n = args[0], args[1]
        c.need(t, 1, Kind.TEXT)
        c.need(n, 2, Kind.NUMBER)
        pad: Expr = str_lit(" ")
        if len(args) == 3:
            c.need(args[2], 3, Kind.TEXT)
            pad = sa.func.coalesce(sa.func.nullif(args[2].sql, str_lit("")), str_lit(" "))
        text, k = _txt(c, t), _count(c, n)
        if _sqlite(c):
            missing = k - sa.func.length(text)
            fill = sa.func.substr(
                sa.func.replace(sa.func.hex(sa.func.zeroblob(k)), str_lit("00"), pad),
                int_lit(1),
                missing,
            )
            padded = fill.concat(text) if left else text.concat(fill)
            value: Expr = sa.case((missing <= int_lit(0), sa.func.substr(text, 1, k)), else_=padded)
        else:
            value = (sa.func.lpad if left else sa.func.rpad)(text, k, pad)
        value = sa.case((n.sql.is_(None), sa.null()), else_=value)
        return Value(Kind.TEXT, value, errs_of(*args))

    return Function(impl, 2, 3)


def _fn_substitute(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    _texts(c, args, 3)
    t, old, new = (_txt(c, a) for a in args)
    value = sa.case((c.ops.length(old) == int_lit(0), t), else_=sa.func.replace(t, old, new))
    return Value(Kind.TEXT, value, errs_of(*args))


def _fn_trim(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """TRIM: spaces and tabs off both ends."""
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    return Value(Kind.TEXT, c.ops.trim_blanks(t.sql), t.err)


def _case_fn(sqlite_name: str, mysql_name: str) -> Function:
    def impl(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
        (t,) = args
        c.need(t, 1, Kind.TEXT)
        name = sqlite_name if _sqlite(c) else mysql_name
        return Value(Kind.TEXT, getattr(sa.func, name)(t.sql), t.err)

    return Function(impl, 1, 1)


def _fn_initcap(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    """INITCAP: "the text as lowercase with the first character of each word in
    uppercase"; a word starts after any character that is not a letter or digit."""
    if _sqlite(c):
        return Value(Kind.TEXT, sa.func.nx_initcap(t.sql), t.err)
    too_long = c.ops.length(t.sql) > int_lit(INITCAP_MAX_CHARS)
    value = sa.case((too_long, sa.null()), else_=_InitcapMysql(t.sql))
    return Value(Kind.TEXT, value, or_errs(t.err, too_long))


def _replace_all(x: Expr, pairs: list[tuple[str, str]]) -> Expr:
    for old, new in pairs:
        x = sa.func.replace(x, str_lit(old), str_lit(new))
    return x


def _fn_htmlencode(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    value = _replace_all(html_escape(t.sql), [("'", "&#39;")])
    return Value(Kind.TEXT, value, t.err)


_JS = [("\\", "\\\\"), ("'", "\\'"), ('"', '\\"'), ("\r", "\\r"), ("\n", "\\n")]


def _fn_jsencode(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    return Value(Kind.TEXT, _replace_all(t.sql, _JS), t.err)


def _fn_jsinhtmlencode(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Documented as JSENCODE(HTMLENCODE(text))."""
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    html = _replace_all(html_escape(t.sql), [("'", "&#39;")])
    return Value(Kind.TEXT, _replace_all(html, _JS), t.err)


# RFC 3986 unreserved characters stay; every other byte of the UTF-8 text is %XX.
_UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"


def _fn_urlencode(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Percent-encode as RFC 3986 says (Salesforce: spaces become %20, ! %21)."""
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    if _sqlite(c):
        return Value(Kind.TEXT, sa.func.nx_urlencode(t.sql), t.err)
    # Every byte as %XX (HEX of the utf8mb4 text), then the unreserved ones back:
    # '%' only starts a byte, so a replacement never straddles two bytes.
    encoded: Expr = sa.func.regexp_replace(
        sa.func.hex(_Utf8Bin(t.sql)),
        str_lit("(..)"),
        str_lit("%\\1"),
    )
    encoded = _replace_all(encoded, [(f"%{ord(ch):02X}", ch) for ch in _UNRESERVED])
    return Value(Kind.TEXT, encoded, t.err)


def _fn_br(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    return Value(Kind.TEXT, str_lit("<br>"), nonnull=True)


_SAFE_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ012345"


def _fn_casesafeid(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """15-character Id -> 18: each 5-character chunk adds one character whose
    index has bit i set when the chunk's character i is an upper-case letter."""
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    x = t.sql
    suffix: list[Expr] = []
    for chunk in range(3):
        bits: Expr = int_lit(0)
        for i in range(5):
            ch = sa.func.substr(x, int_lit(chunk * 5 + i + 1), int_lit(1))
            upper = sa.and_(
                c.ops.text_cmp_operand(ch) >= c.ops.text_cmp_operand(str_lit("A")),
                c.ops.text_cmp_operand(ch) <= c.ops.text_cmp_operand(str_lit("Z")),
            )
            bits = bits + sa.case((upper, int_lit(1 << i)), else_=int_lit(0))
        suffix.append(sa.func.substr(str_lit(_SAFE_ALPHABET), bits + int_lit(1), int_lit(1)))
    value = sa.case((c.ops.length(x) == int_lit(15), c.ops.concat([x, *suffix])), else_=x)
    return Value(Kind.TEXT, value, t.err)


def _fn_includes(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """INCLUDES(multiselect_field, "value"): the field's ';'-separated values hold it."""
    field, literal = args
    if not field.multiselect:
        raise ArgType("argument 1 must be a multi-select picklist field")
    c.need(literal, 2, Kind.TEXT)
    hay = c.ops.concat([str_lit(";"), _txt(c, field), str_lit(";")])
    needle = c.ops.concat([str_lit(";"), _txt(c, literal), str_lit(";")])
    pred = sa.and_(c.ops.length(_txt(c, literal)) > 0, _position(c, needle, hay) > int_lit(0))
    return Value(Kind.BOOLEAN, pred, errs_of(field, literal))


def _fn_ascii(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    """Code point of the first character; blank text gives blank."""
    (t,) = args
    c.need(t, 1, Kind.TEXT)
    first = sa.func.nullif(sa.func.substr(t.sql, int_lit(1), int_lit(1)), str_lit(""))
    if _sqlite(c):
        code: Expr = sa.func.unicode(first)
    else:
        code = sa.func.conv(sa.func.hex(_Utf32(first)), int_lit(16), int_lit(10))
    return Value(Kind.NUMBER, c.ops.number(code), t.err)


def _fn_chr(c: FormulaCompiler, args: list[Value], scope: FieldSpec) -> Value:
    (n,) = args
    c.need(n, 1, Kind.NUMBER)
    code = sa.cast(c.ops.number(n.sql), sa.Integer()) if _sqlite(c) else sa.func.truncate(n.sql, 0)
    value: Expr = sa.func.char(code) if _sqlite(c) else _ChrUtf32(code)
    return Value(Kind.TEXT, value, n.err)


TEXT_FUNCTIONS: dict[str, Function] = {
    "BEGINS": Function(_fn_begins, 2, 2),
    "CONTAINS": Function(_fn_contains, 2, 2),
    "FIND": Function(_fn_find, 2, 3),
    "LEFT": Function(_fn_left, 2, 2),
    "RIGHT": Function(_fn_right, 2, 2),
    "MID": Function(_fn_mid, 3, 3),
    "LPAD": _pad(True),
    "RPAD": _pad(False),
    "SUBSTITUTE": Function(_fn_substitute, 3, 3),
    "TRIM": Function(_fn_trim, 1, 1),
    "UPPER": _case_fn("nx_upper", "upper"),
    "LOWER": _case_fn("nx_lower", "lower"),
    "REVERSE": _case_fn("nx_reverse", "reverse"),
    "INITCAP": Function(_fn_initcap, 1, 1),
    "HTMLENCODE": Function(_fn_htmlencode, 1, 1),
    "JSENCODE": Function(_fn_jsencode, 1, 1),
    "JSINHTMLENCODE": Function(_fn_jsinhtmlencode, 1, 1),
    "URLENCODE": Function(_fn_urlencode, 1, 1),
    "BR": Function(_fn_br, 0, 0),
    "CASESAFEID": Function(_fn_casesafeid, 1, 1),
    "INCLUDES": Function(_fn_includes, 2, 2),
    "ASCII": Function(_fn_ascii, 1, 1),
    "CHR": Function(_fn_chr, 1, 1),
}
