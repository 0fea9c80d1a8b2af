"""Salesforce formula functions, operators and output rules on SQLite and MariaDB.

Each case runs on both backends against a real row through the object's
formula view, with one expected value for both.  Every expected value comes
from a rule of Salesforce's formula documentation ("Formula Operators and
Functions", Salesforce Help), quoted or named in the comment above the case.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from nexuscrm.db.sqlfuncs import install_sqlite_functions
from nexuscrm.formulas import (
    CreateView,
    DropView,
    FormulaError,
    build_view_select,
    compile_formula,
    view_name,
)
from nexuscrm.packs.model import STANDARD_COLUMNS, FieldSpec, FieldType, ObjectSpec

MYSQL_URL = os.environ.get("NEXUS_TEST_MYSQL_URL")

DIALECTS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "mysql",
        id="mysql",
        marks=[
            pytest.mark.mysql,
            pytest.mark.skipif(not MYSQL_URL, reason="NEXUS_TEST_MYSQL_URL is not set"),
        ],
    ),
]

_ENGINES: dict[str, sa.Engine] = {}


def engine_for(dialect: str) -> sa.Engine:
    if dialect not in _ENGINES:
        if dialect == "sqlite":
            engine = sa.create_engine("sqlite://")
            sa.event.listen(engine, "connect", lambda conn, _rec: install_sqlite_functions(conn))
        else:
            assert MYSQL_URL
            url = sa.make_url(MYSQL_URL)
            server = sa.create_engine(url.set(database=""))
            with server.begin() as conn:
                conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{url.database}`")
            server.dispose()
            engine = sa.create_engine(url)
        _ENGINES[dialect] = engine
    return _ENGINES[dialect]


def column_type(dialect: str, f: FieldSpec) -> sa.types.TypeEngine[Any]:
    sqlite = dialect == "sqlite"
    if f.type in (FieldType.Number, FieldType.Currency, FieldType.Percent):
        return sa.Numeric(f.precision or 18, f.scale or 0)
    if f.type == FieldType.Location:
        return sa.Numeric(9, 6)
    if f.type == FieldType.Checkbox:
        return sa.Integer() if sqlite else sa.Boolean()
    if f.type == FieldType.Date:
        return sa.Text() if sqlite else sa.Date()
    if f.type == FieldType.DateTime:
        return sa.Text() if sqlite else sa.DateTime()
    if f.type == FieldType.Time:
        return sa.Text() if sqlite else sa.Time()
    return sa.Text() if sqlite else sa.String(255)


class World:
    """One object's table, its formula view and its rows, on one backend."""

    def __init__(self, dialect: str, fields: list[FieldSpec], rows: list[dict[str, Any]]):
        self.engine = engine_for(dialect)
        self.obj = ObjectSpec(api_name=f"F{uuid.uuid4().hex[:10]}__c", fields=tuple(fields))
        self.metadata = sa.MetaData()
        sqlite = dialect == "sqlite"
        text = sa.Text() if sqlite else sa.String(255)
        stamp = sa.Text() if sqlite else sa.DateTime()
        std: dict[str, Any] = {
            "Id": sa.String(18),
            "Name": text,
            "OwnerId": sa.String(18),
            "CreatedDate": stamp,
            "LastModifiedDate": stamp,
            "IsDeleted": sa.Integer() if sqlite else sa.Boolean(),
        }
        assert tuple(std) == STANDARD_COLUMNS
        cols = [sa.Column(n, t, primary_key=n == "Id") for n, t in std.items()]
        for f in fields:
            for c in f.column_names():
                cols.append(sa.Column(c, column_type(dialect, f)))
        self.table = sa.Table(self.obj.api_name, self.metadata, *cols)
        self.select, self.problems = build_view_select(self.obj, self.table, dialect)
        self.view = view_name(self.obj.api_name)
        with self.engine.begin() as conn:
            self.metadata.create_all(conn)
            conn.execute(CreateView(self.view, self.select))
            full = [{c.name: None for c in self.table.c} | row for row in rows]
            conn.execute(self.table.insert(), full)

    def rows(self) -> dict[str, dict[str, Any]]:
        quoted = self.engine.dialect.identifier_preparer.quote(self.view)
        with self.engine.connect() as conn:
            result = conn.exec_driver_sql(f"SELECT * FROM {quoted}")
            return {row["Id"]: dict(row) for row in result.mappings()}

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(DropView(self.view))
            self.metadata.drop_all(conn)


def norm(value: Any) -> Any:
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode()
    return value


def check(actual: Any, expected: Any) -> None:
    actual = norm(actual)
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        assert actual is not None, f"expected {expected}, got NULL"
        assert float(actual) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    else:
        assert actual == expected


def F(name: str, ftype: FieldType, formula: str | None = None, **kw: Any) -> FieldSpec:
    return FieldSpec(api_name=name, type=ftype, formula=formula, **kw)


STORED = [
    F("T__c", FieldType.Text),
    F("Blank__c", FieldType.Text),
    F("N__c", FieldType.Number, precision=18, scale=2),
    F("NB__c", FieldType.Number, precision=18, scale=2),
    F("D__c", FieldType.Date),
    F("DT__c", FieldType.DateTime),
    F("P__c", FieldType.Picklist, picklist_values=("Open", "Closed")),
    F("M__c", FieldType.MultiselectPicklist, picklist_values=("Red", "Green", "Blue")),
    F("Loc__c", FieldType.Location),
]

ROW = {
    "Id": "001D000000IRFma",
    "T__c": "Hello World",
    "N__c": Decimal("-2.5"),
    "D__c": "2024-01-31",
    "DT__c": "2024-03-10 13:45:30",
    "P__c": "Open",
    "M__c": "Red;Green",
    "Loc__Latitude__s": Decimal("0"),
    "Loc__Longitude__s": Decimal("1"),
}

N, TXT, CHK, DATE, DTM = (
    FieldType.Number,
    FieldType.Text,
    FieldType.Checkbox,
    FieldType.Date,
    FieldType.DateTime,
)

# (formula, result type, expected); None expected = blank (or a runtime error: #Error!).
CASES: list[tuple[str, FieldType, Any]] = [
    # --- date and time ------------------------------------------------------
    # YEAR/MONTH/DAY: "Returns the year / month (1-12) / day of the month (1-31)".
    ("YEAR(D__c)", N, 2024),
    ("MONTH(D__c)", N, 1),
    ("DAY(D__c)", N, 31),
    # DAYOFYEAR: "the day of the calendar year (1-366)"; 2024 is a leap year.
    ("DAYOFYEAR(DATE(2024, 3, 1))", N, 61),
    # WEEKDAY: "1 for Sunday, 2 for Monday ... 7 for Saturday"; 2024-01-31 is a Wednesday.
    ("WEEKDAY(D__c)", N, 4),
    # ISOWEEK/ISOYEAR: ISO 8601 weeks start on Monday; 2021-01-01 (a Friday)
    # is in week 53 of ISO year 2020, 2024-12-30 (a Monday) in week 1 of 2025.
    ("ISOWEEK(DATE(2021, 1, 1))", N, 53),
    ("ISOYEAR(DATE(2021, 1, 1))", N, 2020),
    ("ISOWEEK(DATE(2024, 12, 30))", N, 1),
    ("ISOYEAR(DATE(2024, 12, 30))", N, 2025),
    # ADDMONTHS: "If the date is the last day of the month, or the resulting
    # month has fewer days, the result is the last day of the resulting month."
    ("ADDMONTHS(D__c, 1)", DATE, "2024-02-29"),
    ("ADDMONTHS(DATE(2024, 2, 29), 1)", DATE, "2024-03-31"),
    ("ADDMONTHS(DATE(2024, 1, 15), -2)", DATE, "2023-11-15"),
    ("ADDMONTHS(D__c, 13)", DATE, "2025-02-28"),
    # DATE(year, month, day); an impossible day is an error (#Error!).
    ("DATE(2024, 2, 29)", DATE, "2024-02-29"),
    ("DATE(2023, 2, 29)", DATE, None),
    ("DATE(2023, 13, 1)", DATE, None),
    # DATEVALUE: a date from "YYYY-MM-DD" text or from a date/time (GMT).
    ('DATEVALUE("2024-05-06")', DATE, "2024-05-06"),
    ("DATEVALUE(DT__c)", DATE, "2024-03-10"),
    ('DATEVALUE("2024-02-30")', DATE, None),
    ('DATEVALUE("May 6")', DATE, None),
    # DATETIMEVALUE: "YYYY-MM-DD HH:MM:SS" text in GMT; a date is its midnight.
    ('DATETIMEVALUE("2024-05-06 07:08:09")', DTM, "2024-05-06 07:08:09"),
    ("DATETIMEVALUE(DATE(2024, 5, 6))", DTM, "2024-05-06 00:00:00"),
    ('DATETIMEVALUE("2024-05-06 25:00:00")', DTM, None),
    # TIMEVALUE: a time from "HH:MM:SS.MS" text or a date/time's GMT time;
    # HOUR/MINUTE/SECOND/MILLISECOND read it back.
    ('TEXT(TIMEVALUE("07:08:09.123"))', TXT, "07:08:09.123Z"),
    ('MILLISECOND(TIMEVALUE("07:08:09.123"))', N, 123),
    ("HOUR(TIMEVALUE(DT__c))", N, 13),
    ("MINUTE(TIMEVALUE(DT__c))", N, 45),
    ("SECOND(TIMEVALUE(DT__c))", N, 30),
    ('TIMEVALUE("24:00:00")', FieldType.Time, None),
    # UNIXTIMESTAMP: "the number of seconds since 1 Jan 1970 for the given
    # date or datetime, or number of seconds in the day for a time".
    ("UNIXTIMESTAMP(DATE(1970, 1, 2))", N, 86400),
    ("UNIXTIMESTAMP(DT__c)", N, 1710078330),
    ('UNIXTIMESTAMP(TIMEVALUE("01:00:01"))', N, 3601),
    # FROMUNIXTIME: the GMT date/time of a number of seconds since 1970.
    ("FROMUNIXTIME(1710078330)", DTM, "2024-03-10 13:45:30"),
    ("ISBLANK(TIMENOW())", CHK, 0),
    # Function names are case-insensitive.
    ('If(Today() > Date(2000, 1, 1), "later", "earlier")', TXT, "later"),
    # "When calculating dates using fractions, Salesforce ignores any numbers
    # beyond the decimal": TODAY() + 1.7 is TODAY() + 1, TODAY() + (-1.8) is
    # TODAY() - 1, and TODAY() + 0.5 + 0.5 is TODAY() + 0.
    ("D__c + 1.7", DATE, "2024-02-01"),
    ("D__c + (-1.8)", DATE, "2024-01-30"),
    ("D__c - 1.8", DATE, "2024-01-30"),
    ("D__c + 0.5 + 0.5", DATE, "2024-01-31"),
    ("D__c + (0.5 + 0.5)", DATE, "2024-02-01"),
    # Time arithmetic is in milliseconds: 9:00 PM - 8:00 PM is 3600000, and a
    # time plus milliseconds wraps around midnight (Time holds no date).
    ('TIMEVALUE("21:00:00") - TIMEVALUE("20:00:00")', N, 3600000),
    ('TEXT(TIMEVALUE("23:59:59.500") + 1500)', TXT, "00:00:01.000Z"),
    ('TEXT(TIMEVALUE("00:00:00.250") - 500)', TXT, "23:59:59.750Z"),
    # --- logical --------------------------------------------------------------
    # "! ... NOT: Returns FALSE for TRUE and TRUE for FALSE."
    ("!(1 > 2)", CHK, 1),
    ("!ISBLANK(T__c)", CHK, 1),
    ("!ISBLANK(Blank__c) || FALSE", CHK, 0),
    # ISNEW / ISCLONE: a stored record (what a view row is) is neither new nor a clone.
    ("ISNEW()", CHK, 0),
    ("ISCLONE()", CHK, 0),
    # ISNUMBER: "Determines if a text value is a number".
    ('ISNUMBER("12.5")', CHK, 1),
    ('ISNUMBER("-3")', CHK, 1),
    ('ISNUMBER("12abc")', CHK, 0),
    ("ISNUMBER(Blank__c)", CHK, 0),
    # --- math -----------------------------------------------------------------
    # CEILING: "Rounds a number up to the nearest integer, away from zero if negative."
    ("CEILING(2.5)", N, 3),
    ("CEILING(N__c)", N, -3),
    # FLOOR: "Returns a number rounded down to the nearest integer, towards zero if negative."
    ("FLOOR(2.5)", N, 2),
    ("FLOOR(N__c)", N, -2),
    # MCEILING / MFLOOR: the mathematical ceiling and floor.
    ("MCEILING(N__c)", N, -2),
    ("MFLOOR(N__c)", N, -3),
    # Decimal arithmetic (Salesforce's): 0.29 * 100 is 29 and 0.07 * 100 is 7,
    # though a double holds 28.999999999999996 and 7.000000000000001.
    ("FLOOR(0.29 * 100)", N, 29),
    ("MFLOOR(0.29 * 100)", N, 29),
    ("TRUNC(0.29 * 100)", N, 29),
    ("CEILING(0.07 * 100)", N, 7),
    ("MCEILING(0.07 * 100)", N, 7),
    ("FLOOR(28.9999)", N, 28),
    ("EXP(1)", N, 2.718281828459045),
    ("LN(EXP(2))", N, 2),
    ("LOG(1000)", N, 3),
    ("LN(0)", N, None),
    ("SQRT(16)", N, 4),
    ("SQRT(-1)", N, None),
    # MOD: "the remainder after a number is divided by a divisor".
    ("MOD(7, 3)", N, 1),
    ("MOD(-7, 3)", N, -1),
    ("MOD(7.5, 2)", N, 1.5),
    ("MOD(1, 0)", N, None),
    ("MAX(1, 5, 3)", N, 5),
    ("MIN(1, N__c, 3)", N, -2.5),
    ("MAX(7)", N, 7),
    ("PI()", N, 3.14159265358979),
    # DISTANCE of GEOLOCATIONs or Location fields, in 'km' or 'mi': one degree
    # of longitude on the equator is 2 * pi * 6371 / 360 km.
    ("DISTANCE(GEOLOCATION(0, 0), GEOLOCATION(0, 1), 'km')", N, 111.19492664455873),
    ("DISTANCE(Loc__c, GEOLOCATION(0, 0), 'mi')", N, 111.19492664455873 / 1.609344),
    # TRUNC: "Truncates a number to a specified number of digits."
    ("TRUNC(1.98)", N, 1),
    ("TRUNC(-1.98)", N, -1),
    ("TRUNC(1.15, 2)", N, 1.15),
    ("TRUNC(1289, -2)", N, 1200),
    # --- text -------------------------------------------------------------------
    # BEGINS / CONTAINS / FIND are case-sensitive.
    ('BEGINS(T__c, "Hell")', CHK, 1),
    ('BEGINS(T__c, "hell")', CHK, 0),
    ('CONTAINS(T__c, "World")', CHK, 1),
    ('CONTAINS(T__c, "world")', CHK, 0),
    # FIND: "Returns the position of the search_text string in text"; 0 if absent.
    ('FIND("o", T__c)', N, 5),
    ('FIND("o", T__c, 6)', N, 8),
    ('FIND("z", T__c)', N, 0),
    ("LEFT(T__c, 5)", TXT, "Hello"),
    ("RIGHT(T__c, 5)", TXT, "World"),
    ("MID(T__c, 7, 3)", TXT, "Wor"),
    # "If num_chars is less than zero, Salesforce replaces it with zero": empty = blank.
    ("LEFT(T__c, -1)", TXT, None),
    # LPAD/RPAD: pad to padded_length; longer text is truncated
    # ("RPAD('my_company.com', 14, 'z') returns my_company.com").
    ('LPAD("abc", 5, "xy")', TXT, "xyabc"),
    ('RPAD("abc", 6, "xy")', TXT, "abcxyx"),
    ('RPAD("my_company.com", 14, "z")', TXT, "my_company.com"),
    ('RPAD("my_company.com", 15, "z")', TXT, "my_company.comz"),
    ('LPAD("abcdef", 3)', TXT, "abc"),
    ('SUBSTITUTE("a-b-c", "-", "+")', TXT, "a+b+c"),
    ('TRIM("  x  ") & "|"', TXT, "x|"),
    # LOWER / UPPER convert all letters, not only ASCII.
    ('UPPER("éàü ñ")', TXT, "ÉÀÜ Ñ"),
    ('LOWER("ÀÉÎ Ø")', TXT, "àéî ø"),
    ('REVERSE("äbc")', TXT, "cbä"),
    # INITCAP: "Returns the text as lowercase with the first character of each
    # word in uppercase."
    ('INITCAP("xéla übER o\'neil 3d")', TXT, "Xéla Über O'Neil 3d"),
    # HTMLENCODE replaces HTML-reserved characters with entities.
    ("HTMLENCODE(\"<a href='x'>&\")", TXT, "&lt;a href=&#39;x&#39;&gt;&amp;"),
    # JSENCODE inserts a backslash before unsafe JavaScript characters.
    ('JSENCODE("it\'s \\"x\\"")', TXT, 'it\\\'s \\"x\\"'),
    # JSINHTMLENCODE(x) "is equivalent to JSENCODE(HTMLENCODE(x))".
    ('JSINHTMLENCODE("<it\'s>")', TXT, "&lt;it&#39;s&gt;"),
    # URLENCODE: "blank spaces are replaced with %20, and exclamation points with %21".
    ('URLENCODE("a b!")', TXT, "a%20b%21"),
    ("BR()", TXT, "<br>"),
    # CASESAFEID: the 18-character form of a 15-character Id.
    ("CASESAFEID(Id)", TXT, "001D000000IRFmaIAH"),
    # INCLUDES: "Determines if any value selected in a multi-select picklist field
    # equals a text literal you specify" (exact match).
    ('INCLUDES(M__c, "Red")', CHK, 1),
    ('INCLUDES(M__c, "Blue")', CHK, 0),
    ('INCLUDES(M__c, "red")', CHK, 0),
    ('ISPICKVAL(P__c, "Open")', CHK, 1),
    ('CASE(P__c, "Open", 1, 2)', N, 1),
    ('ASCII("A")', N, 65),
    ('ASCII("é")', N, 233),
    ("CHR(65)", TXT, "A"),
    ("CHR(233)", TXT, "é"),
    # VALUE: "If the text in a VALUE function is a non-numerical/invalid format,
    # the formula isn't calculated and resolves to a blank value": 1 + VALUE(x)
    # is 124 for "123", blank for blank, "$123" and "EUR123".
    ('1 + VALUE("123")', N, 124),
    ("1 + VALUE(Blank__c)", N, None),
    ('1 + VALUE("$123")', N, None),
    ('1 + VALUE("EUR123")', N, None),
    ('VALUE("-12.5")', N, -12.5),
    ('BLANKVALUE(VALUE("$123"), 0)', N, None),
    # TEXT of a blank date or date/time is blank.
    ("TEXT(DATEVALUE(Blank__c))", TXT, None),
    ("TEXT(DATETIMEVALUE(Blank__c))", TXT, None),
    # TEXT(number): plain decimal notation, trailing zeros dropped, at most 15
    # significant digits on both backends.
    ("TEXT(N__c)", TXT, "-2.5"),
    ("TEXT(1/3)", TXT, "0.333333333333333"),
    ("TEXT(0.000001)", TXT, "0.000001"),
    ("TEXT(SQRT(2))", TXT, "1.4142135623731"),
    ("TEXT(1234567.125)", TXT, "1234567.125"),
    ("TEXT(100.50)", TXT, "100.5"),
    ("TEXT(0)", TXT, "0"),
    # --- output rules -----------------------------------------------------------
    # A Text result is trimmed; what is left empty is blank.
    ('"  x  "', TXT, "x"),
    ('"   "', TXT, None),
    ('LPAD("abc", 5)', TXT, "abc"),
]


def _fields() -> list[FieldSpec]:
    return [F(f"C{i}__c", ftype, formula) for i, (formula, ftype, _) in enumerate(CASES)]


@pytest.fixture(scope="module", params=DIALECTS)
def evaluated(request: pytest.FixtureRequest) -> Iterator[tuple[World, dict[str, Any]]]:
    world = World(request.param, STORED + _fields(), [ROW])
    row_id = str(ROW["Id"])
    try:
        yield world, world.rows()[row_id]
    finally:
        world.drop()


def test_every_function_case_compiles(evaluated: tuple[World, dict[str, Any]]) -> None:
    world, _ = evaluated
    assert world.problems == []


@pytest.mark.parametrize(
    ("index", "expected"),
    [pytest.param(i, c[2], id=c[0]) for i, c in enumerate(CASES)],
)
def test_function_value(evaluated: tuple[World, dict[str, Any]], index: int, expected: Any) -> None:
    _, row = evaluated
    check(row[f"C{index}__c"], expected)


# --- compile errors that teach ---------------------------------------------------


def _compile(formula: str, dialect: str = "sqlite", ftype: FieldType = N) -> None:
    obj = ObjectSpec(api_name="Obj__c", fields=(*STORED, F("X__c", ftype, formula)))
    md = sa.MetaData()
    cols = [sa.Column(n, sa.Text()) for n in STANDARD_COLUMNS]
    cols += [sa.Column(c, sa.Text()) for f in STORED for c in f.column_names()]
    table = sa.Table("Obj__c", md, *cols)
    compile_formula(obj, obj.fields[-1], table, dialect)


@pytest.mark.parametrize("dialect", ["sqlite", "mysql"])
def test_syntax_error_shows_a_caret(dialect: str) -> None:
    with pytest.raises(FormulaError) as info:
        _compile("IF(N__c > 1,\n  N__c @ 2, 0)", dialect)
    assert info.value.reason.endswith("\n    N__c @ 2, 0)\n         ^")
    with pytest.raises(FormulaError) as info:
        _compile("ROUND(N__c, 2", dialect)
    assert info.value.reason.endswith("\n  ROUND(N__c, 2\n               ^")


def test_unknown_field_suggests_the_nearest_name() -> None:
    with pytest.raises(FormulaError) as info:
        _compile("NBB__c + 1")
    assert "unknown field 'NBB__c'" in info.value.reason
    assert "did you mean 'NB__c'?" in info.value.reason
    with pytest.raises(FormulaError) as info:
        _compile("ROUDN(1, 2)")
    assert "did you mean ROUND()?" in info.value.reason


PICKLIST_REFUSAL = (
    "Field P__c is a picklist field. Picklist fields are only supported in certain functions."
)


@pytest.mark.parametrize(
    ("formula", "ftype"),
    [('P__c = "Open"', CHK), ('P__c & "x"', TXT), ("LEN(P__c)", N), ('IF(TRUE, P__c, "")', TXT)],
)
def test_raw_picklist_is_refused_as_salesforce_refuses_it(formula: str, ftype: FieldType) -> None:
    with pytest.raises(FormulaError) as info:
        _compile(formula, ftype=ftype)
    assert info.value.reason == PICKLIST_REFUSAL


def test_includes_needs_a_multiselect_picklist() -> None:
    with pytest.raises(FormulaError, match="INCLUDES\\(\\) argument 1 must be a multi-select"):
        _compile('INCLUDES(T__c, "a")', ftype=CHK)


# --- properties: both backends agree; text only ever travels as data -------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ALPHABET = st.sampled_from(list("abcXYZ019 '\"\\%_-.éÜñ;"))
_TEXTS = st.text(_ALPHABET, max_size=8)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


@st.composite
def _num(draw: st.DrawFn, depth: int = 0) -> str:
    leaves = [
        st.integers(-50, 50).map(str),
        st.decimals(-100, 100, places=2, allow_nan=False, allow_infinity=False).map(
            lambda d: f"({d})"
        ),
        st.just("N__c"),
        st.just("NB__c"),
    ]
    if depth >= 3:
        return draw(st.one_of(leaves))
    sub = _num(depth + 1)
    txt = _text(depth + 1)
    forms = [
        st.one_of(leaves),
        st.tuples(sub, st.sampled_from("+-*"), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(
            st.sampled_from(["ABS", "CEILING", "FLOOR", "MCEILING", "MFLOOR", "TRUNC"]), sub
        ).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(sub, st.integers(0, 2)).map(lambda t: f"ROUND({t[0]}, {t[1]})"),
        st.tuples(sub, sub).map(lambda t: f"MAX({t[0]}, {t[1]})"),
        st.tuples(sub, st.integers(1, 7)).map(lambda t: f"MOD({t[0]}, {t[1]})"),
        txt.map(lambda t: f"LEN({t})"),
        st.tuples(txt, txt).map(lambda t: f"FIND({t[0]}, {t[1]})"),
        st.tuples(_bool(depth + 1), sub, sub).map(lambda t: f"IF({t[0]}, {t[1]}, {t[2]})"),
    ]
    return draw(st.one_of(forms))


@st.composite
def _text(draw: st.DrawFn, depth: int = 0) -> str:
    leaves = [_TEXTS.map(_quote), st.just("T__c"), st.just("Blank__c")]
    if depth >= 3:
        return draw(st.one_of(leaves))
    sub = _text(depth + 1)
    small = st.integers(-1, 6)
    forms = [
        st.one_of(leaves),
        st.tuples(sub, sub).map(lambda t: f"({t[0]} & {t[1]})"),
        st.tuples(st.sampled_from(["LEFT", "RIGHT"]), sub, small).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"
        ),
        st.tuples(sub, small, small).map(lambda t: f"MID({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(
            st.sampled_from(["UPPER", "LOWER", "TRIM", "REVERSE", "HTMLENCODE", "URLENCODE"]), sub
        ).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(sub, sub, sub).map(lambda t: f"SUBSTITUTE({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(sub, small, _TEXTS.map(_quote)).map(lambda t: f"LPAD({t[0]}, {t[1]}, {t[2]})"),
    ]
    return draw(st.one_of(forms))


@st.composite
def _bool(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 3:
        return draw(st.sampled_from(["TRUE", "FALSE", "ISBLANK(T__c)"]))
    num, txt, sub = _num(depth + 1), _text(depth + 1), _bool(depth + 1)
    forms = [
        st.tuples(num, st.sampled_from(["<", "<=", "=", "<>", ">"]), num).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        st.tuples(txt, st.sampled_from(["=", "!="]), txt).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["BEGINS", "CONTAINS"]), txt, txt).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"
        ),
        txt.map(lambda t: f"ISBLANK({t})"),
        sub.map(lambda t: f"!{t}"),
        st.tuples(sub, sub).map(lambda t: f"AND({t[0]}, {t[1]})"),
        st.tuples(sub, sub).map(lambda t: f"({t[0]} || {t[1]})"),
    ]
    return draw(st.one_of(forms))


_ROWS = st.lists(
    st.fixed_dictionaries(
        {
            "T__c": st.one_of(st.none(), _TEXTS),
            "N__c": st.one_of(
                st.none(), st.decimals(-1000, 1000, places=2, allow_nan=False, allow_infinity=False)
            ),
        }
    ),
    min_size=1,
    max_size=3,
)


def _values(dialect: str, fields: list[FieldSpec], rows: list[dict[str, Any]]) -> tuple[Any, ...]:
    world = World(dialect, STORED + fields, [{"Id": str(i)} | r for i, r in enumerate(rows)])
    try:
        got = world.rows()
        problems = {p.field_api_name: p.reason for p in world.problems}
    finally:
        world.drop()
    out = []
    for f in fields:
        if f.api_name in problems:
            out.append(("refused", problems[f.api_name]))
            continue
        for i in range(len(rows)):
            value = norm(got[str(i)][f.api_name])
            if isinstance(value, float | int) and not isinstance(value, bool):
                value = round(float(value), 6)
            out.append(value)
    return tuple(out)


@pytest.mark.mysql
@pytest.mark.skipif(not MYSQL_URL, reason="NEXUS_TEST_MYSQL_URL is not set")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    formulas=st.tuples(_num(), _text(), _bool()),
    rows=_ROWS,
)
def test_random_formulas_agree_on_sqlite_and_mariadb(
    formulas: tuple[str, str, str], rows: list[dict[str, Any]]
) -> None:
    """Random well-typed formulas over random rows: one value (or one refusal) on both."""
    num, txt, boolean = formulas
    fields = [
        F("PN__c", N, num, scale=4),
        F("PT__c", TXT, txt),
        F("PB__c", CHK, boolean),
    ]
    assert _values("sqlite", fields, rows) == _values("mysql", fields, rows)


@settings(max_examples=80, deadline=None)
@given(
    text=st.text(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from(" \t\n"),
        max_size=20,
    )
)
def test_random_text_is_only_ever_a_bound_parameter(text: str) -> None:
    """A text literal's characters never become SQL: compiled with parameters,
    the statement is the same whatever the text holds (quotes, comment markers,
    backslashes), and the text is one of the bound values."""

    def compiled(literal: str, dialect: str) -> sa.engine.Compiled:
        formula = _quote(literal) + " & T__c"
        obj = ObjectSpec(api_name="Obj__c", fields=(*STORED, F("X__c", TXT, formula)))
        md = sa.MetaData()
        cols = [sa.Column(n, sa.Text()) for n in STANDARD_COLUMNS]
        cols += [sa.Column(c, sa.Text()) for f in STORED for c in f.column_names()]
        table = sa.Table("Obj__c", md, *cols)
        expr = compile_formula(obj, obj.fields[-1], table, dialect)
        sa_dialect = (
            sa.dialects.sqlite.dialect() if dialect == "sqlite" else sa.dialects.mysql.dialect()
        )
        return expr.compile(dialect=sa_dialect)

    for dialect in ("sqlite", "mysql"):
        got, reference = compiled(text, dialect), compiled("x", dialect)
        assert str(got) == str(reference)
        assert text in got.params.values()


@pytest.mark.parametrize("dialect", DIALECTS)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from(" \t\n"),
        max_size=20,
    )
)
def test_random_text_literal_round_trips_through_the_view(dialect: str, text: str) -> None:
    """The view's inlined literal is escaped by the dialect: the field shows the
    text itself, trimmed (a Text result is trimmed, empty is blank)."""
    world = World(dialect, [F("X__c", TXT, _quote(text))], [{"Id": "1"}])
    try:
        got = norm(world.rows()["1"]["X__c"])
    finally:
        world.drop()
    expected = text.strip(" \t\n") or None
    assert got == expected


# --- a corpus formula, spot-checked --------------------------------------------------

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "sfdx"
PMT_PROJECT = CORPUS / "project-management-tool/force-app/main/default/objects/PMT_Project__c"


@pytest.mark.skipif(not PMT_PROJECT.is_dir(), reason="corpus not present")
@pytest.mark.parametrize("dialect", DIALECTS)
def test_pmt_release_quarter(dialect: str) -> None:
    """project-management-tool PMT_Project__c.Release_Qtr__c: fiscal year and
    quarter from a date with ``Year(``, MONTH, MOD, CASE and TEXT.  January is
    Q4 of the fiscal year named by the calendar year; May is Q2 of the next
    one.  A blank date makes MONTH/YEAR blank, TEXT of blank is '' and ``+``
    reads blank text as '', so the result is "FY-"."""
    from defusedxml import ElementTree

    ns = {"m": "http://soap.sforce.com/2006/04/metadata"}
    root = ElementTree.parse(PMT_PROJECT / "fields/Release_Qtr__c.field-meta.xml").getroot()
    formula = root.find("m:formula", ns)
    assert formula is not None and formula.text
    fields = [F("Release_Date__c", DATE), F("Release_Qtr__c", TXT, formula.text)]
    rows = [
        {"Id": "jan", "Release_Date__c": "2024-01-15"},
        {"Id": "may", "Release_Date__c": "2024-05-01"},
        {"Id": "dec", "Release_Date__c": "2099-12-31"},
        {"Id": "blank"},
    ]
    world = World(dialect, fields, rows)
    try:
        got = {k: norm(v["Release_Qtr__c"]) for k, v in world.rows().items()}
    finally:
        world.drop()
    assert world.problems == []
    assert got == {"jan": "FY24-Q4", "may": "FY25-Q2", "dec": "FY100-Q4", "blank": "FY-"}


# --- roll-ups of Percent fields ------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_percent_rollup_is_a_percent(dialect: str) -> None:
    """A roll-up has the type of the field it summarizes ("Roll-Up Summary Field",
    Salesforce Help): SUM / MAX of a Percent field, and a SUM of that roll-up, are
    Percents, shown as percentages (50% + 25% is 75) like a stored Percent; inside a
    formula they read as fractions, like every Percent (75% / 3 is 0.25, shown 25 as
    a Percent result). COUNT is a number. (project-management-tool's
    PMT_Phase__c.Sum_Of_Task_Completion__c showed 0.75.)"""
    from nexuscrm import catalog

    tag = uuid.uuid4().hex[:8]
    top, mid, leaf = f"Top{tag}__c", f"Mid{tag}__c", f"Leaf{tag}__c"

    def rollup(op: str, child: str, fk: str, summed: str | None = None) -> dict[str, Any]:
        spec = {"operation": op, "foreign_key_field": f"{child}.{fk}"}
        return {"summary": spec | ({"summarized_field": f"{child}.{summed}"} if summed else {})}

    leaf_spec = ObjectSpec(
        api_name=leaf,
        fields=(
            F("Mid__c", FieldType.MasterDetail, reference_to=mid),
            F("Done__c", FieldType.Percent, precision=5, scale=0),
        ),
    )
    mid_spec = ObjectSpec(
        api_name=mid,
        fields=(
            F("Top__c", FieldType.MasterDetail, reference_to=top),
            F("Done_Sum__c", FieldType.Summary, **rollup("sum", leaf, "Mid__c", "Done__c")),
            F("Done_Max__c", FieldType.Summary, **rollup("max", leaf, "Mid__c", "Done__c")),
            F("Leaves__c", FieldType.Summary, **rollup("count", leaf, "Mid__c")),
            F("Average__c", FieldType.Percent, "Done_Sum__c / Leaves__c", scale=0),
            F("Average_Num__c", N, "Done_Sum__c / Leaves__c", scale=2),
        ),
    )
    top_spec = ObjectSpec(
        api_name=top,
        fields=(
            F("All_Done__c", FieldType.Summary, **rollup("sum", mid, "Top__c", "Done_Sum__c")),
        ),
    )
    specs = [top_spec, mid_spec, leaf_spec]
    engine = engine_for(dialect)
    context = catalog.spec_context(specs, dialect)
    md = sa.MetaData()
    tables = {s.api_name: catalog.object_table(s, dialect, md) for s in specs}
    views = [view_name(s.api_name) for s in specs]
    try:
        with engine.begin() as conn:
            md.create_all(conn)
            for s in specs:
                select, problems = build_view_select(s, tables[s.api_name], dialect, context)
                assert problems == []
                conn.execute(CreateView(view_name(s.api_name), select))
            conn.execute(tables[top].insert(), [{"Id": "t1", "IsDeleted": False}])
            conn.execute(tables[mid].insert(), [{"Id": "m1", "Top__c": "t1", "IsDeleted": False}])
            conn.execute(
                tables[leaf].insert(),
                [
                    {"Id": f"l{i}", "Mid__c": "m1", "Done__c": done, "IsDeleted": False}
                    for i, done in enumerate([50, 25, None])
                ],
            )
        quote = engine.dialect.identifier_preparer.quote
        with engine.connect() as conn:
            m1 = conn.exec_driver_sql(f"SELECT * FROM {quote(view_name(mid))}").mappings().one()
            t1 = conn.exec_driver_sql(f"SELECT * FROM {quote(view_name(top))}").mappings().one()
    finally:
        with engine.begin() as conn:
            for v in views:
                conn.execute(DropView(v))
            md.drop_all(conn)
    check(m1["Done_Sum__c"], 75)  # 50% + 25% (the blank is skipped)
    check(m1["Done_Max__c"], 50)
    check(m1["Leaves__c"], 3)
    check(m1["Average__c"], 25)  # 0.75 / 3 = 0.25, a Percent result: 25
    check(m1["Average_Num__c"], 0.25)  # the same fraction as a Number
    check(t1["All_Done__c"], 75)  # a SUM of the Percent roll-up is a Percent too
