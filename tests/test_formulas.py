"""Formula compiler tests against real databases: SQLite always, MariaDB/MySQL
when ``NEXUS_TEST_MYSQL_URL`` is set.

Expected values come from Salesforce's documented formula behaviour (cited
next to the less obvious ones), not from whatever SQL happens to return.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import uuid
from collections.abc import Iterator
from decimal import Decimal, DivisionByZero, InvalidOperation, localcontext
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nexuscrm.db.sqlfuncs import install_sqlite_functions
from nexuscrm.errors import NexusError
from nexuscrm.formulas import (
    CreateView,
    DropView,
    FormulaError,
    FormulaProblem,
    build_view_select,
    compile_formula,
    formula_dependencies,
    view_name,
)
from nexuscrm.packs.model import STANDARD_COLUMNS, FieldSpec, FieldType, ObjectSpec

MYSQL_URL = os.environ.get("NEXUS_TEST_MYSQL_URL")
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "sfdx"

DIALECTS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "mysql",
        id="mysql",
        marks=[
            pytest.mark.mysql,
            pytest.mark.skipif(
                not MYSQL_URL, reason="NEXUS_TEST_MYSQL_URL is not set (MariaDB/MySQL tests)"
            ),
        ],
    ),
]


# --- database plumbing -------------------------------------------------------


def _mysql_engine() -> sa.Engine:
    assert MYSQL_URL
    url = sa.make_url(MYSQL_URL)
    database = url.database or "nexus_test"
    server = sa.create_engine(url.set(database=""))
    with server.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    server.dispose()
    return sa.create_engine(url.set(database=database))


_ENGINES: dict[str, sa.Engine] = {}


def engine_for(dialect: str) -> sa.Engine:
    if dialect not in _ENGINES:
        # One in-memory SQLite connection per thread, so the tables persist.
        if dialect == "sqlite":
            engine = sa.create_engine("sqlite://")
            # The nx_* functions make_engine registers (Unicode UPPER/LOWER ...).
            sa.event.listen(engine, "connect", lambda conn, _rec: install_sqlite_functions(conn))
        else:
            engine = _mysql_engine()
        _ENGINES[dialect] = engine
    return _ENGINES[dialect]


def column_type(dialect: str, f: FieldSpec) -> sa.types.TypeEngine[Any]:
    """Physical column types as the platform stores them (see DESIGN / dialects)."""
    sqlite = dialect == "sqlite"
    if f.type in (FieldType.Number, FieldType.Currency, FieldType.Percent):
        return sa.Numeric(f.precision or 18, f.scale or 0)
    if f.type == FieldType.Location:
        return sa.Numeric(9, 6)
    if f.type == FieldType.Checkbox:
        return sa.Integer() if sqlite else sa.Boolean()
    if f.type == FieldType.Time:
        return sa.Text() if sqlite else sa.Time()
    if f.type == FieldType.Date:
        return sa.Text() if sqlite else sa.Date()
    if f.type == FieldType.DateTime:
        return sa.Text() if sqlite else sa.DateTime()
    return sa.Text() if sqlite else sa.String(255)


def make_table(dialect: str, obj: ObjectSpec, metadata: sa.MetaData) -> sa.Table:
    sqlite = dialect == "sqlite"
    text = sa.Text() if sqlite else sa.String(255)
    stamp = sa.Text() if sqlite else sa.DateTime()
    standard: dict[str, Any] = {
        "Id": sa.String(18),
        "Name": text,
        "OwnerId": sa.String(18),
        "CreatedDate": stamp,
        "LastModifiedDate": stamp,
        "IsDeleted": sa.Integer() if sqlite else sa.Boolean(),
    }
    assert tuple(standard) == STANDARD_COLUMNS
    columns = [sa.Column(name, typ, primary_key=name == "Id") for name, typ in standard.items()]
    for f in obj.fields:
        for col in f.column_names():
            columns.append(sa.Column(col, column_type(dialect, f)))
    return sa.Table(obj.api_name, metadata, *columns)


class World:
    """A table plus its formula view, with rows, on one database."""

    def __init__(self, dialect: str, fields: list[FieldSpec], rows: list[dict[str, Any]]):
        self.dialect = dialect
        self.engine = engine_for(dialect)
        # Unique names: other test runs may share the MariaDB database.
        self.obj = ObjectSpec(api_name=f"T{uuid.uuid4().hex[:10]}__c", fields=tuple(fields))
        self.metadata = sa.MetaData()
        self.table = make_table(dialect, self.obj, self.metadata)
        self.select, self.problems = build_view_select(self.obj, self.table, dialect)
        self.view = view_name(self.obj.api_name)
        with self.engine.begin() as conn:
            self.metadata.create_all(conn)
            conn.execute(CreateView(self.view, self.select))
            if rows:
                full = [{c.name: None for c in self.table.c} | row for row in rows]
                conn.execute(self.table.insert(), full)

    def rows(self) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            result = conn.exec_driver_sql(f"SELECT * FROM {_quote(self.engine, self.view)}")
            return {row["Id"]: dict(row) for row in result.mappings()}

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(DropView(self.view))
            self.metadata.drop_all(conn)


def _quote(engine: sa.Engine, name: str) -> str:
    return str(engine.dialect.identifier_preparer.quote(name))


def norm(value: Any) -> Any:
    """DB value -> comparable Python value (Decimal -> float, dates -> ISO text)."""
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


# --- the kitchen-sink object -----------------------------------------------

TODAY = dt.datetime.now(dt.UTC).date()


def F(name: str, ftype: FieldType, formula: str | None = None, **kw: Any) -> FieldSpec:
    return FieldSpec(api_name=name, type=ftype, formula=formula, **kw)


STORED = [
    F("Date_Listed__c", FieldType.Date),
    F("Price__c", FieldType.Currency, precision=18, scale=2),
    F("Cost__c", FieldType.Currency, precision=18, scale=2),
    F("Picture__c", FieldType.Url),
    F("Title__c", FieldType.Text, length=80),
    F("Blank_Text__c", FieldType.Text, length=80),
    F("Qty__c", FieldType.Number, precision=18, scale=0),
    F("Rate__c", FieldType.Percent, precision=5, scale=2),
    F("Active__c", FieldType.Checkbox),
    F("Opened_At__c", FieldType.DateTime),
    F("Closed_At__c", FieldType.DateTime),
    F("Status__c", FieldType.Picklist, picklist_values=("Open", "Closed")),
    F("Num_Text__c", FieldType.Text),
    F("Starts__c", FieldType.Time),
    F("Loc__c", FieldType.Location),
]

ROWS: list[dict[str, Any]] = [
    {
        "Id": "1",
        "Date_Listed__c": (TODAY - dt.timedelta(days=10)).isoformat(),
        "Price__c": 100,
        "Cost__c": None,
        "Picture__c": "http://img/a.png",
        "Title__c": "Hello",
        "Qty__c": 3,
        "Rate__c": 10,  # stored as the API gives it: 10 means 10%
        "Active__c": 1,
        "Opened_At__c": "2024-01-01 00:00:00",
        "Closed_At__c": "2024-01-02 12:00:00",
        "Status__c": "Open",
        "Num_Text__c": "12.5",
        "Starts__c": "09:30:00",
        "Loc__Latitude__s": 37.5,
        "Loc__Longitude__s": -122.25,
    },
    {
        "Id": "2",
        "Price__c": 100,
        "Cost__c": 40,
        "Title__c": "",
        "Active__c": 0,
        "Status__c": "Closed",
        "Num_Text__c": "12abc",
    },
]

BAZ = "BlankAsZero"
BAB = "BlankAsBlank"
N, CUR, PCT, TXT, CHK = (
    FieldType.Number,
    FieldType.Currency,
    FieldType.Percent,
    FieldType.Text,
    FieldType.Checkbox,
)
DAY_MINUS_10 = (TODAY - dt.timedelta(days=10)).isoformat()
# Salesforce's IMAGE HTML: the size as a style, border="0", self-closed.
IMG_150 = (
    '<img src="http://img/a.png" alt="picture" style="height:150px; width:150px;" border="0"/>'
)

# (api_name, type, formula, extra FieldSpec kwargs, expected row 1, expected row 2)
CASES: list[tuple[str, FieldType, str, dict[str, Any], Any, Any]] = [
    # The corpus formula (dreamhouse Property__c.Days_On_Market__c): a blank date
    # is never zero-filled, so the difference is blank.
    ("Days_On_Market__c", N, "TODAY() - Date_Listed__c", {"scale": 0}, 10, None),
    # formulaTreatBlanksAs: BlankAsZero reads blank Cost as 0, BlankAsBlank propagates.
    ("Margin_Zero__c", CUR, "Price__c - Cost__c", {"scale": 2}, 100, 60),
    ("Margin_Blank__c", CUR, "Price__c - Cost__c", {"scale": 2, "ftb": BAB}, None, 60),
    # Blank text is '' in & and +; a Text result of '' reads blank.
    ("Concat_Blank__c", TXT, "'a' & Blank_Text__c", {}, "a", "a"),
    ("Plus_Text__c", TXT, 'Title__c + "!" + Blank_Text__c', {}, "Hello!", "!"),
    ("Empty_Text__c", TXT, "Blank_Text__c & ''", {}, None, None),
    ("Text_Eq_Empty__c", CHK, 'Blank_Text__c = ""', {}, 1, 1),
    # Division by zero is a runtime error: the field is blank, the query fine.
    ("Div_Zero__c", N, "1/0", {}, None, None),
    # IF only evaluates the branch it takes (Salesforce's own divide-by-zero idiom).
    ("Div_Safe__c", N, "IF(Qty__c = 0, 0, Price__c / Qty__c)", {"scale": 2}, 33.33, 0),
    # An error blanks the whole field: BLANKVALUE cannot swallow it.
    ("Blank_Err__c", N, "BLANKVALUE(Price__c / (Qty__c - Qty__c), 5)", {}, None, None),
    ("If_Text__c", TXT, 'IF(Qty__c > 2, "many", "few")', {}, "many", "few"),
    ("Case_Num__c", N, 'CASE(Status__c, "Open", 1, "Closed", 2, 0)', {}, 1, 2),
    ("Case_Else__c", TXT, 'CASE(Qty__c, 1, "one", 3, "three", "other")', {}, "three", "other"),
    (
        "And_Or__c",
        CHK,
        "AND(Active__c, NOT(ISBLANK(Picture__c))) || Qty__c > 5",
        {},
        1,
        0,
    ),
    ("Or_Fn__c", CHK, "OR(Active__c, Cost__c = 41)", {}, 1, 0),
    ("Not_Fn__c", CHK, "NOT(Active__c)", {}, 0, 1),
    ("Checkbox_Eq__c", CHK, "Active__c = TRUE", {}, 1, 0),
    # "ISBLANK with a numeric field returns TRUE only if the field has no value
    # and is not configured to treat blank fields as zeroes."
    ("Isblank_Num_Blank__c", CHK, "ISBLANK(Cost__c)", {"ftb": BAB}, 1, 0),
    ("Isblank_Num_Zero__c", CHK, "ISBLANK(Cost__c)", {}, 0, 0),
    ("Isblank_Text__c", CHK, "ISBLANK(Title__c)", {}, 0, 1),
    # "Text fields are never null, so ISNULL with a text field always returns false."
    ("Isnull_Text__c", CHK, "ISNULL(Blank_Text__c)", {}, 0, 0),
    ("Blankvalue_Text__c", TXT, 'BLANKVALUE(Title__c, "untitled")', {}, "Hello", "untitled"),
    (
        "Blankvalue_Date__c",
        FieldType.Date,
        "BLANKVALUE(Date_Listed__c, TODAY())",
        {},
        DAY_MINUS_10,
        TODAY.isoformat(),
    ),
    ("Nullvalue_Num__c", N, "NULLVALUE(Qty__c, -1)", {"ftb": BAB}, 3, -1),
    ("Text_Num__c", TXT, 'TEXT(Price__c) & "/" & TEXT(Qty__c)', {}, "100/3", "100/0"),
    ("Text_Date__c", TXT, "TEXT(Date_Listed__c)", {}, DAY_MINUS_10, None),
    ("Text_Datetime__c", TXT, "TEXT(Opened_At__c)", {}, "2024-01-01 00:00:00Z", None),
    ("Value__c", N, "VALUE(Num_Text__c) * 2", {"scale": 2}, 25, None),
    # ROUND rounds half away from zero; negative digits round left of the point.
    ("Round_Half__c", N, "ROUND(2.5, 0)", {}, 3, 3),
    ("Round_Neg_Half__c", N, "ROUND(-2.5, 0)", {}, -3, -3),
    ("Round_Two__c", N, "ROUND(1234.5678, 2)", {}, 1234.57, 1234.57),
    ("Round_Left__c", N, "ROUND(1250, -2)", {}, 1300, 1300),
    ("Round_Field__c", N, "ROUND(Price__c / 8, 1)", {}, 12.5, 12.5),
    ("Abs__c", N, "ABS(Cost__c - Price__c)", {}, 100, 60),
    ("Len__c", N, "LEN(Title__c) + LEN(Blank_Text__c)", {}, 5, 0),
    ("Upper_Lower__c", TXT, 'UPPER(Title__c) & LOWER("MiXeD")', {}, "HELLOmixed", "mixed"),
    # A blank URL still renders the tag (hence the corpus's ISBLANK guard below).
    (
        "Image__c",
        TXT,
        'IMAGE( Picture__c , "picture" , 150, 150)',
        {},
        IMG_150,
        IMG_150.replace("http://img/a.png", ""),
    ),
    (
        "Picture_IMG__c",
        TXT,
        "if(ISBLANK(Picture__c), '', IMAGE(Picture__c, \"Picture\"))",
        {},
        '<img src="http://img/a.png" alt="Picture" border="0"/>',
        None,
    ),
    (
        "Image_Height__c",
        TXT,
        'IMAGE("/img/samples/flag_green.gif", "", 20)',
        {},
        '<img src="/img/samples/flag_green.gif" alt="" style="height:20px;" border="0"/>',
        '<img src="/img/samples/flag_green.gif" alt="" style="height:20px;" border="0"/>',
    ),
    (
        "Hyperlink__c",
        TXT,
        'HYPERLINK("/" & Id, Title__c)',
        {},
        '<a href="/1" target="_blank">Hello</a>',
        '<a href="/2" target="_blank"></a>',
    ),
    (
        "Hyperlink_Escaped__c",
        TXT,
        'HYPERLINK("http://x/?a=1&b=2", "<b>", \'_self\')',
        {},
        '<a href="http://x/?a=1&amp;b=2" target="_self">&lt;b&gt;</a>',
        '<a href="http://x/?a=1&amp;b=2" target="_self">&lt;b&gt;</a>',
    ),
    ("Precedence__c", N, "2 + 3 * 4", {}, 14, 14),
    ("Power_Chain__c", N, "2 ^ 3 ^ 2", {}, 64, 64),
    ("Power_Mul__c", N, "2 * 2 ^ 3", {}, 16, 16),
    ("Unary_Power__c", N, "-2 ^ 2", {}, 4, 4),
    ("Left_Assoc__c", N, "20 - 5 - 3 + 8 / 4 / 2", {}, 13, 13),
    ("Concat_Prec__c", TXT, 'IF("a" & "b" = "ab", "yes", "no")', {}, "yes", "yes"),
    # Text comparison is exact: case and trailing spaces count.
    ("Case_Sensitive__c", CHK, '"a" = "A"', {}, 0, 0),
    ("Trailing_Space__c", CHK, '"a " = "a"', {}, 0, 0),
    ("Text_Less__c", CHK, '"B" < "a"', {}, 1, 1),
    (
        "Date_Add__c",
        FieldType.Date,
        "Date_Listed__c + 5",
        {},
        (TODAY - dt.timedelta(5)).isoformat(),
        None,
    ),
    (
        "Date_Sub__c",
        FieldType.Date,
        "Date_Listed__c - 1",
        {},
        (TODAY - dt.timedelta(11)).isoformat(),
        None,
    ),
    ("Date_Less__c", CHK, "Date_Listed__c < TODAY()", {}, 1, 0),
    ("Datetime_Diff__c", N, "Closed_At__c - Opened_At__c", {"scale": 2}, 1.5, None),
    # A blank operand makes a comparison unknown, and a Checkbox is never blank.
    ("Datetime_Less__c", CHK, "Opened_At__c < Closed_At__c", {}, 1, 0),
    ("Time_Text__c", TXT, "TEXT(Starts__c)", {}, "09:30:00.000Z", None),
    ("Time_Blank__c", CHK, "ISBLANK(Starts__c)", {}, 0, 1),
    ("Location_Sum__c", N, "Loc__Latitude__s + Loc__Longitude__s", {}, -84.75, 0),
    ("Datetime_Add__c", FieldType.DateTime, "Opened_At__c + 0.5", {}, "2024-01-01 12:00:00", None),
    # Percent fields are fractions inside formulas (10% reads as 0.1) ...
    ("Percent_Use__c", CUR, "Price__c * Rate__c", {"scale": 2}, 10, 0),
    # ... and a Percent result is stored as a percentage again.
    ("Percent_Out__c", PCT, "Rate__c / 2", {"scale": 2}, 5, 0),
    # Formula fields referencing formula fields are inlined.
    ("Inline__c", N, "Margin_Zero__c * 2", {}, 200, 120),
    ("Bool_Inline__c", CHK, "NOT(Not_Fn__c)", {}, 1, 0),
    ("Mixed_Case__c", TXT, "iF(isBlank(cost__C), 'none', 'some')", {"ftb": BAB}, "none", "some"),
    ("Ispickval__c", CHK, 'ISPICKVAL(Status__c, "Open")', {}, 1, 0),
    ("Std_Column__c", TXT, 'Id & "-" & TEXT(Status__c)', {}, "1-Open", "2-Closed"),
    ("Null_Literal__c", N, "IF(Active__c, NULL, 1)", {}, None, 1),
    ("Comment__c", N, "/* a comment */ 1 + /* another */ 1", {}, 2, 2),
]


def _formula_fields() -> list[FieldSpec]:
    out = []
    for name, ftype, formula, extra, _, _ in CASES:
        kw = dict(extra)
        ftb = kw.pop("ftb", BAZ)
        out.append(F(name, ftype, formula, formula_treat_blanks_as=ftb, **kw))
    return out


@pytest.fixture(scope="module", params=DIALECTS)
def sink(request: pytest.FixtureRequest) -> Iterator[tuple[World, dict[str, dict[str, Any]]]]:
    world = World(request.param, STORED + _formula_fields(), ROWS)
    try:
        yield world, world.rows()
    finally:
        world.drop()


def test_every_case_compiles(sink: tuple[World, dict[str, dict[str, Any]]]) -> None:
    world, _ = sink
    assert world.problems == []


@pytest.mark.parametrize(
    ("name", "row", "expected"),
    [pytest.param(c[0], "1", c[4], id=f"{c[0]}-row1") for c in CASES]
    + [pytest.param(c[0], "2", c[5], id=f"{c[0]}-row2") for c in CASES],
)
def test_formula_value(
    sink: tuple[World, dict[str, dict[str, Any]]], name: str, row: str, expected: Any
) -> None:
    _, rows = sink
    check(rows[row][name], expected)


def test_view_keeps_physical_columns(sink: tuple[World, dict[str, dict[str, Any]]]) -> None:
    world, rows = sink
    for col in world.table.c:
        assert col.name in rows["1"]
    assert norm(rows["1"]["Title__c"]) == "Hello"


# --- clock functions ---------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_today_and_now_are_utc(dialect: str) -> None:
    fields = [F("Today__c", FieldType.Date, "TODAY()"), F("Now__c", FieldType.DateTime, "NOW()")]
    world = World(dialect, fields, [{"Id": "1"}])
    try:
        row = world.rows()["1"]
    finally:
        world.drop()
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    assert norm(row["Today__c"]) in {
        (now - dt.timedelta(seconds=5)).date().isoformat(),
        now.date().isoformat(),
    }
    seen = dt.datetime.strptime(norm(row["Now__c"]), "%Y-%m-%d %H:%M:%S")
    assert abs((seen - now).total_seconds()) < 60


# --- compile errors ------------------------------------------------------------

ERROR_CASES = [
    ("Nope__c + 1", "unknown field 'Nope__c'"),
    ("FROB(1)", "unknown function FROB()"),
    ("Account.Name", "Acct__c has no relationship 'Account'"),
    ("Price__c + 'a'", "operator '+' cannot combine number and text"),
    ("Price__c & 'a'", "operator '&' cannot combine number and text"),
    ("Price__c = 'a'", "operator '=' cannot compare number and text"),
    ("IF(Price__c > 1, 1, 'x')", "IF() branches must have one type, got number, text"),
    ("IF(Price__c, 1, 2)", "IF() argument 1 must be boolean, got number"),
    ("IF(TRUE, 1)", "IF() takes 3 arguments, got 2"),
    ("ROUND(1)", "ROUND() takes 2 arguments, got 1"),
    ("CASE(1, 1, 2, 3, 4)", "CASE() takes an expression, value/result pairs"),
    ("TODAY() + TODAY()", "operator '+' cannot combine date and date"),
    ("TODAY() - NOW()", "operator '-' cannot combine date and datetime"),
    ("LEN(5)", "LEN() argument 1 must be text, got number"),
    ("TEXT(TRUE)", "TEXT() cannot convert a boolean"),
    ("'abc'", "formula returns text but field F__c is Number"),
    ("1 +", "syntax error"),
    ("1 @ 2", "syntax error at line 1, column 3"),
    ("$UserRole.Name", "global variable '$UserRole.Name' is not supported"),
    ("$Api", "global variable '$Api' is not supported"),
]


@pytest.mark.parametrize("dialect", ["sqlite", "mysql"])
@pytest.mark.parametrize(("formula", "reason"), ERROR_CASES)
def test_compile_errors(dialect: str, formula: str, reason: str) -> None:
    target = F("F__c", FieldType.Number, formula)
    obj = ObjectSpec(api_name="Acct__c", fields=(F("Price__c", CUR, scale=2), target))
    table = make_table(dialect, obj, sa.MetaData())
    with pytest.raises(FormulaError) as info:
        compile_formula(obj, target, table, dialect)
    err = info.value
    assert isinstance(err, NexusError)
    assert (err.object_api_name, err.field_api_name) == ("Acct__c", "F__c")
    assert reason in err.reason
    assert reason in str(err)


def test_formula_cycle_is_reported_with_its_path() -> None:
    a = F("A__c", N, "B__c + 1")
    b = F("B__c", N, "C__c * 2")
    c = F("C__c", N, "A__c - 1")
    ok = F("Ok__c", N, "1 + 1")
    obj = ObjectSpec(api_name="Loop__c", fields=(a, b, c, ok))
    table = make_table("sqlite", obj, sa.MetaData())
    with pytest.raises(FormulaError) as info:
        compile_formula(obj, a, table, "sqlite")
    assert info.value.reason == "formula cycle: A__c -> B__c -> C__c -> A__c"
    select, problems = build_view_select(obj, table, "sqlite")
    assert [p.field_api_name for p in problems] == ["A__c", "B__c", "C__c"]
    assert problems[1].reason == "formula cycle: B__c -> C__c -> A__c -> B__c"
    assert "Ok__c" in select.selected_columns


def test_self_reference_is_a_cycle() -> None:
    me = F("Me__c", N, "me__c + 1")
    obj = ObjectSpec(api_name="Self__c", fields=(me,))
    table = make_table("sqlite", obj, sa.MetaData())
    with pytest.raises(FormulaError, match=r"formula cycle: Me__c -> Me__c"):
        compile_formula(obj, me, table, "sqlite")


def test_broken_reference_names_the_referenced_formula() -> None:
    bad = F("Bad__c", N, "Nope__c")
    user = F("User__c", N, "Bad__c * 2")
    obj = ObjectSpec(api_name="Ref__c", fields=(bad, user))
    table = make_table("sqlite", obj, sa.MetaData())
    with pytest.raises(FormulaError) as info:
        compile_formula(obj, user, table, "sqlite")
    assert info.value.field_api_name == "User__c"
    assert (
        info.value.reason
        == "referenced formula field Bad__c fails: unknown field 'Nope__c' on Ref__c"
    )


@pytest.mark.parametrize("dialect", ["sqlite", "mysql"])
def test_too_deep_to_render_is_a_formula_error(dialect: str) -> None:
    deep = F("Deep__c", N, " + ".join(["Qty__c"] * 400))
    obj = ObjectSpec(api_name="Deep__c", fields=(F("Qty__c", N), deep))
    table = make_table(dialect, obj, sa.MetaData())
    with pytest.raises(FormulaError, match="nested too deeply"):
        compile_formula(obj, deep, table, dialect)


def test_formula_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(FormulaError("O__c", "F__c", "unknown function X()")))
    assert (err.object_api_name, err.field_api_name, err.reason) == (
        "O__c",
        "F__c",
        "unknown function X()",
    )


def test_unknown_dialect_is_a_value_error() -> None:
    f = F("X__c", N, "1")
    obj = ObjectSpec(api_name="D__c", fields=(f,))
    with pytest.raises(ValueError, match="unsupported dialect"):
        compile_formula(obj, f, make_table("sqlite", obj, sa.MetaData()), "oracle")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_failed_formulas_are_reported_not_dropped(dialect: str) -> None:
    fields = [
        F("Price__c", CUR, scale=2),
        F("Good__c", CUR, "Price__c * 2", scale=2),
        F("Bad_Field__c", N, "Missing__c + 1"),
        F("Bad_Type__c", TXT, "Price__c"),
    ]
    world = World(dialect, fields, [{"Id": "1", "Price__c": 21}])
    try:
        rows = world.rows()
    finally:
        world.drop()
    assert world.problems == [
        FormulaProblem(
            world.obj.api_name,
            "Bad_Field__c",
            f"unknown field 'Missing__c' on {world.obj.api_name}",
        ),
        FormulaProblem(
            world.obj.api_name,
            "Bad_Type__c",
            "formula returns number but field Bad_Type__c is Text (text)",
        ),
    ]
    check(rows["1"]["Good__c"], 42)
    assert "Bad_Field__c" not in rows["1"]


# --- API details ---------------------------------------------------------------


def test_view_name() -> None:
    assert view_name("Property__c") == "v_Property__c"


def test_formula_dependencies() -> None:
    obj = ObjectSpec(
        api_name="Dep__c",
        fields=(
            F("Price__c", CUR),
            F("Loc__c", FieldType.Location),
            F("A__c", N, "price__c + B__c + Loc__Latitude__s"),
            F("B__c", N, "IF(ISBLANK(createddate), 1, 2) + Account.Amount + Ghost__c"),
            F("C__c", N, "1 +"),
        ),
    )
    assert formula_dependencies(obj) == {
        "A__c": {"Price__c", "B__c", "Loc__Latitude__s"},
        "B__c": {"CreatedDate", "Ghost__c"},
        "C__c": set(),
    }


@pytest.mark.parametrize("dialect", DIALECTS)
def test_compiled_expression_runs_with_bound_parameters(dialect: str) -> None:
    """compile_formula's expression also works in an ordinary (parameterised) query."""
    fields = [F("Title__c", TXT), F("Shout__c", TXT, "UPPER(Title__c) & '!'")]
    world = World(dialect, fields, [{"Id": "1", "Title__c": "hi"}])
    try:
        expr = compile_formula(world.obj, fields[1], world.table, dialect)
        with world.engine.connect() as conn:
            got = conn.execute(sa.select(expr).where(world.table.c.Id == "1")).scalar_one()
    finally:
        world.drop()
    assert got == "HI!"


# --- the real corpus -------------------------------------------------------------


def _corpus_field(path: Path) -> FieldSpec:
    from defusedxml import ElementTree

    ns = {"m": "http://soap.sforce.com/2006/04/metadata"}
    root = ElementTree.parse(path).getroot()

    def text(tag: str) -> str | None:
        el = root.find(f"m:{tag}", ns)
        return None if el is None else el.text

    scale = text("scale")
    return FieldSpec(
        api_name=text("fullName") or "",
        type=FieldType(text("type") or ""),
        formula=text("formula"),
        formula_treat_blanks_as=text("formulaTreatBlanksAs") or BAZ,  # type: ignore[arg-type]
        scale=int(scale) if scale else None,
    )


@pytest.mark.parametrize("dialect", DIALECTS)
def test_dreamhouse_property_formulas(dialect: str) -> None:
    fields_dir = CORPUS / "dreamhouse-lwc/force-app/main/default/objects/Property__c/fields"
    if not fields_dir.is_dir():
        pytest.skip(f"corpus not found at {fields_dir}")
    fields = [
        F("Date_Listed__c", FieldType.Date),
        F("Picture__c", FieldType.Url),
        _corpus_field(fields_dir / "Days_On_Market__c.field-meta.xml"),
        _corpus_field(fields_dir / "Picture_IMG__c.field-meta.xml"),
    ]
    broker_dir = CORPUS / "dreamhouse-lwc/force-app/main/default/objects/Broker__c/fields"
    broker_img = _corpus_field(broker_dir / "Picture_IMG__c.field-meta.xml")
    fields.append(broker_img.model_copy(update={"api_name": "Broker_IMG__c"}))
    rows = [
        {
            "Id": "1",
            "Date_Listed__c": (TODAY - dt.timedelta(days=10)).isoformat(),
            "Picture__c": "https://s3/house.jpg",
        },
        {"Id": "2"},
    ]
    world = World(dialect, fields, rows)
    try:
        got = world.rows()
    finally:
        world.drop()
    assert world.problems == []
    check(got["1"]["Days_On_Market__c"], 10)
    check(got["2"]["Days_On_Market__c"], None)
    assert (
        got["1"]["Picture_IMG__c"] == '<img src="https://s3/house.jpg" alt="Picture" border="0"/>'
    )
    assert got["2"]["Picture_IMG__c"] is None
    assert got["1"]["Broker_IMG__c"] == (
        '<img src="https://s3/house.jpg" alt="picture" style="height:150px; width:150px;" '
        'border="0"/>'
    )


# --- property: arithmetic agrees with Decimal semantics --------------------------

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


@st.composite
def arith(draw: st.DrawFn, depth: int = 0) -> tuple[str, int, Any]:
    """(formula text, precedence, tree); halves are exact in binary and decimal."""
    if depth >= 3 or draw(st.integers(0, 3)) == 0:
        value = Decimal(draw(st.integers(-40, 40))) / 2
        text = str(abs(value))
        if value < 0:
            return "-" + text, 3, ("neg", ("lit", abs(value)))
        return text, 4, ("lit", value)
    op = draw(st.sampled_from(sorted(_PREC)))
    left_text, left_prec, left = draw(arith(depth + 1))
    right_text, right_prec, right = draw(arith(depth + 1))
    prec = _PREC[op]
    # Minimal parentheses: the parser's precedence and left-associativity
    # must rebuild exactly this tree.
    if left_prec < prec:
        left_text = f"({left_text})"
    if right_prec <= prec:
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}", prec, (op, left, right)


class _DivZero(Exception):
    pass


def _evaluate(tree: Any, seen: list[Decimal]) -> Decimal:
    kind = tree[0]
    if kind == "lit":
        return Decimal(tree[1])
    if kind == "neg":
        return -_evaluate(tree[1], seen)
    a, b = _evaluate(tree[1], seen), _evaluate(tree[2], seen)
    if kind == "+":
        out = a + b
    elif kind == "-":
        out = a - b
    elif kind == "*":
        out = a * b
    else:
        if b == 0:
            raise _DivZero
        # A divisor that is zero in decimal but not in binary (or vice versa)
        # would be a float artefact, not a semantic difference.
        assume(abs(b) > Decimal("1e-6"))
        out = a / b
    seen.append(abs(out))
    return out


_SQLITE_PROBE = ObjectSpec(api_name="Probe__c", fields=(F("X__c", N, "1"),))
_SQLITE_TABLE = make_table("sqlite", _SQLITE_PROBE, sa.MetaData())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arith())
def test_arithmetic_matches_decimal_semantics(case: tuple[str, int, Any]) -> None:
    text, _, tree = case
    seen: list[Decimal] = [Decimal(1)]
    with localcontext() as ctx:
        ctx.prec = 40
        try:
            expected: Decimal | None = _evaluate(tree, seen)
        except (_DivZero, DivisionByZero, InvalidOperation):
            expected = None
    field = F("X__c", N, text, formula_treat_blanks_as=BAB)
    expr = compile_formula(_SQLITE_PROBE, field, _SQLITE_TABLE, "sqlite")
    with engine_for("sqlite").connect() as conn:
        got = conn.execute(sa.select(expr)).scalar_one()
    if expected is None:
        assert got is None, text
    else:
        assert got is not None, text
        # Doubles carry ~16 significant digits of the largest intermediate.
        tolerance = float(max(seen)) * 1e-12
        assert float(got) == pytest.approx(float(expected), abs=tolerance), text
