"""Cross-object references and roll-up summaries (issue 14 items 3 and 4).

Real tables on SQLite and MariaDB, built as ApplyAll builds them
(``catalog.object_table``), the view created from ``build_view_select`` and
read back; expected values follow Salesforce's documentation: a blank lookup
gives a blank parent value (0 under BlankAsZero), roll-ups count the
master-detail children meeting every filter criterion, SUM of none is 0,
MIN / MAX of none is blank. One end-to-end ApplyAll of an SFDX project with
both proves rebuild-derived and verify use the same views.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from nexuscrm import catalog
from nexuscrm.db.engine import make_engine
from nexuscrm.formulas import CreateView, build_view_select, view_name
from nexuscrm.packs.builtin import platform_packs
from nexuscrm.packs.model import CustomLabel, FieldSpec, ObjectSpec

BLANK_AS_BLANK = "BlankAsBlank"


def fld(api_name: str, type_: str, **kw: Any) -> FieldSpec:
    return FieldSpec.model_validate({"api_name": api_name, "type": type_, **kw})


def obj(api_name: str, *fields: FieldSpec) -> ObjectSpec:
    return ObjectSpec(api_name=api_name, label=api_name, fields=fields)


def user_object() -> ObjectSpec:
    core = platform_packs(include_dev_sample=False)[0]
    return next(o for o in core.objects if o.api_name == "User")


GRAND = obj(
    "Grand__c",
    fld("Region__c", "Text", length=40),
    fld("Score__c", "Number", precision=10, scale=2),
    fld("Label__c", "Text", formula='UPPER(Region__c) & "-" & Name'),
)
PARENT = obj(
    "Parent__c",
    fld("Grand__c", "Lookup", reference_to="Grand__c", relationship_name="Grand"),
    fld("Budget__c", "Currency", precision=12, scale=2),
    fld("Kickoff__c", "Date"),
)
CHILD = obj(
    "Child__c",
    fld("Parent__c", "Lookup", reference_to="Parent__c"),
    fld("Notes__c", "Text", length=80),
    fld("Grand_Region__c", "Text", formula="Parent__r.Grand__r.Region__c"),
    fld("Grand_Label__c", "Text", formula="Parent__r.Grand__r.Label__c & '/' & Name"),
    fld("Grand_Score__c", "Number", scale=2, formula="Parent__r.Grand__r.Score__c + 1"),
    fld(
        "Grand_Score_Blank__c",
        "Number",
        scale=2,
        formula="Parent__r.Grand__r.Score__c + 1",
        formula_treat_blanks_as=BLANK_AS_BLANK,
    ),
    fld("Owner_Name__c", "Text", formula="Owner:User.Username"),
    fld("Kickoff_Plus__c", "Date", formula="Parent__r.Kickoff__c + 7"),
)


def build(engine: Engine, specs: list[ObjectSpec], labels: tuple[CustomLabel, ...] = ()) -> None:
    """Create each table and view as ApplyAll would (views see every other object)."""
    dialect = engine.dialect.name
    context = catalog.spec_context(specs, dialect, labels)
    md = sa.MetaData()
    tables = {s.api_name: catalog.object_table(s, dialect, md) for s in specs}
    md.create_all(engine)
    with engine.begin() as conn:
        for s in specs:
            select, problems = build_view_select(s, tables[s.api_name], dialect, context)
            assert problems == [], problems
            conn.execute(CreateView(view_name(s.api_name), select))


def insert(engine: Engine, table: str, *rows: dict[str, Any]) -> None:
    with engine.begin() as conn:
        tbl = sa.Table(table, sa.MetaData(), autoload_with=conn)
        for r in rows:
            conn.execute(tbl.insert(), [{"IsDeleted": False, **r}])


def view_rows(engine: Engine, object_name: str) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT * FROM {view_name(object_name)}")).mappings()
        return {r["Id"]: dict(r) for r in rows}


def num(value: Any) -> Decimal | None:
    return None if value is None else Decimal(str(value)).quantize(Decimal("0.01"))


def day(value: Any) -> date | None:
    if value is None or isinstance(value, date):
        return value
    return date.fromisoformat(str(value)[:10])


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def test_paths_through_lookups_and_blanks_along_them(engine: Engine) -> None:
    build(engine, [user_object(), GRAND, PARENT, CHILD])
    insert(engine, "User", {"Id": "u1", "Name": "Ada", "Username": "ada@example.com"})
    insert(engine, "Grand__c", {"Id": "g1", "Name": "G1", "Region__c": "emea", "Score__c": 4.5})
    insert(
        engine,
        "Parent__c",
        {"Id": "p1", "Name": "P1", "Grand__c": "g1", "Kickoff__c": date(2024, 2, 26)},
        {"Id": "p2", "Name": "P2", "Grand__c": None},
    )
    insert(
        engine,
        "Child__c",
        {"Id": "c1", "Name": "C1", "Parent__c": "p1", "OwnerId": "u1"},
        {"Id": "c2", "Name": "C2", "Parent__c": "p2"},  # blank grandparent lookup
        {"Id": "c3", "Name": "C3", "Parent__c": None, "OwnerId": "nobody"},  # blank parent
    )
    rows = view_rows(engine, "Child__c")
    assert set(rows) == {"c1", "c2", "c3"}  # a blank lookup never drops the row
    c1, c2, c3 = rows["c1"], rows["c2"], rows["c3"]
    assert c1["Grand_Region__c"] == "emea"
    # The grandparent's own formula, evaluated on the grandparent's row.
    assert c1["Grand_Label__c"] == "EMEA-G1/C1"
    assert num(c1["Grand_Score__c"]) == Decimal("5.50")
    assert c1["Owner_Name__c"] == "ada@example.com"
    assert day(c1["Kickoff_Plus__c"]) == date(2024, 3, 4)
    for blank in (c2, c3):
        assert blank["Grand_Region__c"] is None
        # The grandparent's formula is blank without a grandparent (not "-").
        assert blank["Grand_Label__c"] == "/" + blank["Name"]
        assert num(blank["Grand_Score__c"]) == Decimal("1.00")  # BlankAsZero
        assert blank["Grand_Score_Blank__c"] is None  # BlankAsBlank
        assert blank["Kickoff_Plus__c"] is None
    assert c3["Owner_Name__c"] is None  # an owner id no user has


def test_standard_relationships_and_contact_account(engine: Engine) -> None:
    core = {o.api_name: o for o in platform_packs(include_dev_sample=False)[0].objects}
    contact = core["Contact"]
    contact = contact.model_copy(
        update={
            "fields": (
                *contact.fields,
                fld("Account_Name__c", "Text", formula="Account.Name"),
                fld("Account_Owner__c", "Text", formula="Account.Owner.Username"),
            )
        }
    )
    build(engine, [core["User"], core["Account"], contact])
    insert(engine, "User", {"Id": "u1", "Name": "Ada", "Username": "ada@example.com"})
    insert(engine, "Account", {"Id": "a1", "Name": "Acme", "OwnerId": "u1"})
    insert(
        engine,
        "Contact",
        {"Id": "k1", "Name": "K1", "LastName": "One", "AccountId": "a1"},
        {"Id": "k2", "Name": "K2", "LastName": "Two", "AccountId": None},
    )
    rows = view_rows(engine, "Contact")
    assert rows["k1"]["Account_Name__c"] == "Acme"
    assert rows["k1"]["Account_Owner__c"] == "ada@example.com"
    assert rows["k2"]["Account_Name__c"] is None


def refusal(specs: list[ObjectSpec], target: ObjectSpec, dialect: str = "sqlite") -> list[str]:
    context = catalog.spec_context(specs, dialect)
    table = catalog.object_table(target, dialect)
    _select, problems = build_view_select(target, table, dialect, context)
    return [f"{p.field_api_name}: {p.reason}" for p in problems]


def test_what_cannot_be_reached_is_refused_with_a_reason() -> None:
    odd = obj(
        "Odd__c",
        fld("Parent__c", "Lookup", reference_to="Parent__c"),
        fld("Nowhere__c", "Lookup", reference_to="Ghost__c"),
        fld("A__c", "Text", formula="RecordType.Name"),
        fld("B__c", "Text", formula="Nowhere__r.Name"),
        fld("C__c", "Text", formula="Parent__r.Missing__c"),
        fld("D__c", "Text", formula="Sibling__r.Name"),
        fld("E__c", "Text", formula="Owner:Queue.Name"),
    )
    problems = refusal([PARENT, odd], odd)
    assert problems == [
        "A__c: relationship 'RecordType': this platform does not store RecordTypeId on Odd__c",
        "B__c: Nowhere__r on Odd__c points to Ghost__c, which no installed pack defines",
        "C__c: unknown field 'Missing__c' on Parent__c",
        "D__c: Odd__c has no relationship 'Sibling__r'",
        "E__c: relationship 'Owner:Queue': record owners are users here (no Queue owners)",
    ]


def test_more_than_ten_hops_is_refused() -> None:
    chain = obj(
        "Node__c",
        fld("Up__c", "Lookup", reference_to="Node__c"),
        fld("Ten__c", "Text", formula=".".join(["Up__r"] * 10) + ".Name"),
        fld("Eleven__c", "Text", formula=".".join(["Up__r"] * 11) + ".Name"),
    )
    problems = refusal([chain], chain)
    assert len(problems) == 1 and problems[0].startswith("Eleven__c:"), problems
    assert "more than 10 relationships" in problems[0]


def test_cross_object_cycle_fails_closed_naming_it() -> None:
    a = obj(
        "A__c",
        fld("B__c", "Lookup", reference_to="B__c"),
        fld("X__c", "Number", formula="B__r.Y__c + 1"),
    )
    b = obj(
        "B__c",
        fld("A__c", "Lookup", reference_to="A__c"),
        fld("Y__c", "Number", formula="A__r.X__c + 1"),
    )
    (problem,) = refusal([a, b], a)
    assert "formula cycle: A__c.X__c -> B__c.Y__c -> A__c.X__c" in problem, problem


# --- roll-up summaries ------------------------------------------------------------


def rollup(op: str, fk: str, summarized: str | None = None, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"operation": op, "foreign_key_field": fk}
    if summarized:
        spec["summarized_field"] = summarized
    spec.update(kw)
    return {"summary": spec}


PROJECT = obj(
    "Project__c",
    fld("Program__c", "MasterDetail", reference_to="Program__c"),
    fld("Tasks__c", "Summary", **rollup("count", "Task__c.Project__c")),
    fld(
        "Closed_Tasks__c",
        "Summary",
        **rollup(
            "count",
            "Task__c.Project__c",
            filters=[
                {
                    "field": "Task__c.Status__c",
                    "operation": "equals",
                    "value": '"Completed", "Closed, not Completed"',
                }
            ],
        ),
    ),
    fld("Hours__c", "Summary", **rollup("sum", "Task__c.Project__c", "Task__c.Hours__c")),
    fld("Cost__c", "Summary", **rollup("sum", "Task__c.Project__c", "Task__c.Cost__c")),
    fld("First_Due__c", "Summary", **rollup("min", "Task__c.Project__c", "Task__c.Due__c")),
    fld("Last_Due__c", "Summary", **rollup("max", "Task__c.Project__c", "Task__c.Due__c")),
    fld(
        "Big_Hours__c",
        "Summary",
        **rollup(
            "sum",
            "Task__c.Project__c",
            "Task__c.Hours__c",
            filters=[{"field": "Task__c.Hours__c", "operation": "greaterThan", "value": "2"}],
        ),
    ),
    fld(
        "Percent_Closed__c",
        "Percent",
        scale=0,
        formula="IF(Tasks__c = 0, 0, Closed_Tasks__c / Tasks__c)",
    ),
)
TASK = obj(
    "Task__c",
    fld("Project__c", "MasterDetail", reference_to="Project__c"),
    fld("Status__c", "Picklist", picklist_values=("New", "Completed", "Closed, not Completed")),
    fld("Hours__c", "Number", precision=8, scale=2),
    fld("Rate__c", "Currency", precision=8, scale=2),
    fld("Cost__c", "Currency", scale=2, formula="Hours__c * Rate__c"),
    fld("Due__c", "Date"),
)
PROGRAM = obj(
    "Program__c",
    fld("All_Hours__c", "Summary", **rollup("sum", "Project__c.Program__c", "Project__c.Hours__c")),
    fld("Projects__c", "Summary", **rollup("count", "Project__c.Program__c")),
)


def test_rollups_count_sum_min_max_filters_formulas_and_rollups_of_rollups(
    engine: Engine,
) -> None:
    build(engine, [PROGRAM, PROJECT, TASK])
    insert(engine, "Program__c", {"Id": "m1", "Name": "M1"}, {"Id": "m2", "Name": "M2"})
    insert(
        engine,
        "Project__c",
        {"Id": "p1", "Name": "P1", "Program__c": "m1"},
        {"Id": "p2", "Name": "P2", "Program__c": "m1"},
        {"Id": "p3", "Name": "P3", "Program__c": "m2"},  # no tasks
    )
    insert(
        engine,
        "Task__c",
        {"Id": "t1", "Name": "t1", "Project__c": "p1", "Status__c": "Completed",
         "Hours__c": 3, "Rate__c": 10, "Due__c": date(2024, 5, 1)},
        {"Id": "t2", "Name": "t2", "Project__c": "p1", "Status__c": "Closed, not Completed",
         "Hours__c": 1.5, "Rate__c": 20, "Due__c": date(2024, 3, 1)},
        {"Id": "t3", "Name": "t3", "Project__c": "p1", "Status__c": "New",
         "Hours__c": None, "Rate__c": 5, "Due__c": None},
        {"Id": "t4", "Name": "t4", "Project__c": "p2", "Status__c": "closed",
         "Hours__c": 4, "Rate__c": 1, "Due__c": date(2025, 1, 1)},
    )  # fmt: skip
    # A deleted child is not counted.
    with engine.begin() as conn:
        tbl = sa.Table("Task__c", sa.MetaData(), autoload_with=conn)
        conn.execute(
            tbl.insert(),
            [{"Id": "t5", "Name": "t5", "Project__c": "p1", "IsDeleted": True, "Hours__c": 100}],
        )
    projects = view_rows(engine, "Project__c")
    p1, p2, p3 = projects["p1"], projects["p2"], projects["p3"]
    assert int(p1["Tasks__c"]) == 3 and int(p2["Tasks__c"]) == 1 and int(p3["Tasks__c"]) == 0
    # The filter value "Closed, not Completed" holds a comma; "closed" is neither value.
    assert int(p1["Closed_Tasks__c"]) == 2 and int(p2["Closed_Tasks__c"]) == 0
    assert num(p1["Hours__c"]) == Decimal("4.50")  # a blank amount is skipped
    assert num(p3["Hours__c"]) == Decimal("0.00")  # SUM of no children is 0
    assert num(p1["Cost__c"]) == Decimal("60.00")  # a formula of the child: 30 + 30 + blank
    assert day(p1["First_Due__c"]) == date(2024, 3, 1)
    assert day(p1["Last_Due__c"]) == date(2024, 5, 1)
    assert p3["First_Due__c"] is None and p3["Last_Due__c"] is None
    assert num(p1["Big_Hours__c"]) == Decimal("3.00")
    assert num(p1["Percent_Closed__c"]) == Decimal("67.00")  # 2/3 as a percent, scale 0
    assert num(p3["Percent_Closed__c"]) == Decimal("0.00")
    programs = view_rows(engine, "Program__c")
    assert num(programs["m1"]["All_Hours__c"]) == Decimal("8.50")  # a roll-up of roll-ups
    assert int(programs["m1"]["Projects__c"]) == 2
    assert num(programs["m2"]["All_Hours__c"]) == Decimal("0.00")


def test_rollup_refusals_name_the_field() -> None:
    bad = obj(
        "Bad__c",
        fld("Ghost__c", "Summary", **rollup("count", "Ghost__c.Bad__c")),
        fld("Not_Md__c", "Summary", **rollup("count", "Task__c.Status__c")),
        fld("Text_Sum__c", "Summary", **rollup("sum", "Task__c.Project__c", "Task__c.Status__c")),
    )
    problems = refusal([bad, PROJECT, TASK], bad)
    assert problems == [
        "Ghost__c: roll-up Bad__c.Ghost__c summarizes Ghost__c, which no installed pack defines",
        "Not_Md__c: roll-up Bad__c.Not_Md__c: Task__c.Status__c is not a master-detail field",
        "Text_Sum__c: roll-up Bad__c.Text_Sum__c: cannot sum a text field",
    ]


def test_rollup_cycle_fails_closed_naming_it() -> None:
    top = obj(
        "Top__c",
        fld("Total__c", "Summary", **rollup("sum", "Leaf__c.Top__c", "Leaf__c.Share__c")),
    )
    leaf = obj(
        "Leaf__c",
        fld("Top__c", "MasterDetail", reference_to="Top__c"),
        fld("Share__c", "Number", formula="Top__r.Total__c / 2"),
    )
    (problem,) = refusal([top, leaf], top)
    assert "formula cycle: Top__c.Total__c -> Leaf__c.Share__c -> Top__c.Total__c" in problem


# --- global references ----------------------------------------------------------

SETTING = obj(
    "Setting__mdt",
    fld("DeveloperName", "Text", length=40),
    fld("Start_Month__c", "Number", precision=2, scale=0),
    fld("Active__c", "Checkbox"),
)
USES = obj(
    "Uses__c",
    fld("Month__c", "Number", formula="$CustomMetadata.Setting__mdt.Default.Start_Month__c + 1"),
    fld("Missing__c", "Number", formula="$CustomMetadata.Setting__mdt.Other.Start_Month__c + 1"),
    fld("On__c", "Checkbox", formula="$CustomMetadata.Setting__mdt.Default.Active__c"),
    fld("Greeting__c", "Text", formula="$Label.Hello & ' ' & Name"),
)


def test_custom_metadata_and_labels_read_what_is_installed(engine: Engine) -> None:
    build(engine, [SETTING, USES], labels=(CustomLabel(name="hello", value="Hi"),))
    insert(engine, "Setting__mdt",
           {"Id": "s1", "Name": "Default", "DeveloperName": "Default", "Start_Month__c": 4,
            "Active__c": True})  # fmt: skip
    insert(engine, "Uses__c", {"Id": "u1", "Name": "Ada"})
    row = view_rows(engine, "Uses__c")["u1"]
    assert num(row["Month__c"]) == Decimal("5.00")
    assert num(row["Missing__c"]) == Decimal("1.00")  # no such record: blank, BlankAsZero
    assert int(row["On__c"]) == 1
    assert row["Greeting__c"] == "Hi Ada"  # $Label names are case-insensitive
    # The view follows the installed record, not a copy taken at build time.
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE Setting__mdt SET Start_Month__c = 10"))
    assert num(view_rows(engine, "Uses__c")["u1"]["Month__c"]) == Decimal("11.00")


def test_globals_a_view_cannot_hold_are_refused_with_the_reason() -> None:
    odd = obj(
        "Odd__c",
        fld("A__c", "Text", formula="$Profile.Name"),
        fld("B__c", "Text", formula="$Api.Partner_Server_URL_260"),
        fld("C__c", "Text", formula="$Organization.Favourite_Colour"),
        fld("D__c", "Text", formula="$Label.Nowhere"),
        fld("E__c", "Number", formula="$CustomMetadata.Ghost__mdt.Default.X__c"),
        fld("F__c", "Text", formula="$Nonsense.X"),
        fld("G__c", "Text", formula="$Setup.Setting__mdt.Start_Month__c"),
        fld("H__c", "Text", formula="$User.Email"),
    )
    problems = refusal([odd, SETTING], odd)
    assert [p.split(":")[0] for p in problems] == [
        "A__c", "B__c", "C__c", "D__c", "E__c", "F__c", "G__c", "H__c"
    ]  # fmt: skip
    assert "this platform stores no profiles" in problems[0]
    assert "API endpoints and session ids exist only inside Salesforce" in problems[1]
    assert "'Organization.Favourite_Colour' is not a formula global" in problems[2]
    assert "custom label 'Nowhere' is not defined in the project's labels/" in problems[3]
    assert "no installed custom metadata type Ghost__mdt" in problems[4]
    assert "unknown global variable '$Nonsense'" in problems[5]
    assert "Setting__mdt is not a hierarchy custom setting (it has no SetupOwnerId)" in problems[6]
    assert "no installed pack defines the User object (only $User.Id" in problems[7]


LIMITS = obj(
    "Limits__c",
    fld("SetupOwnerId", "Text", length=18),
    fld("Max__c", "Number", precision=4, scale=0),
)
TODO = obj(
    "Todo__c",
    fld("Mine__c", "Checkbox", formula="OwnerId = $User.Id"),
    fld("Me__c", "Text", formula="$User.Id"),
    fld("My_Login__c", "Text", formula="UPPER($User.Username)"),
    fld("Org__c", "Text", formula="$Organization.Name"),
    fld("Fiscal__c", "Number", precision=2, scale=0, formula="$Organization.FiscalYearStartMonth"),
    fld("Sandbox__c", "Checkbox", formula="$Organization.IsSandbox"),
    fld("Max__c", "Number", precision=4, scale=0, formula="$Setup.Limits__c.Max__c * 2"),
)


def test_user_organization_and_setup_are_read_when_the_view_is(engine: Engine) -> None:
    """$User.Id is the session's acting user, else the stored default, else blank;
    $User.<Field> reads that user's row; $Organization reads the stored globals;
    $Setup the acting user's hierarchy record, else the organization's. All at
    query time: setting a global or a session's user needs no view rebuild."""
    from nexuscrm.controlplane.metadata import ensure_system_schema
    from nexuscrm.db.session import acting_user
    from nexuscrm.formulas.globals import write_global

    ensure_system_schema(engine)
    build(engine, [user_object(), LIMITS, TODO])
    insert(engine, "User",
           {"Id": "u1", "Name": "Ada", "Username": "ada@example.com"},
           {"Id": "u2", "Name": "Bo", "Username": "bo@example.com"})  # fmt: skip
    insert(engine, "Limits__c",
           {"Id": "l1", "Name": "org", "SetupOwnerId": "00D000000000001", "Max__c": 10},
           {"Id": "l2", "Name": "bo", "SetupOwnerId": "u2", "Max__c": 20})  # fmt: skip
    insert(engine, "Todo__c",
           {"Id": "t1", "Name": "T1", "OwnerId": "u1"},
           {"Id": "t2", "Name": "T2", "OwnerId": "u2"})  # fmt: skip

    rows = view_rows(engine, "Todo__c")
    assert [int(rows[t]["Mine__c"]) for t in ("t1", "t2")] == [0, 0]
    assert rows["t1"]["Me__c"] is None and rows["t1"]["My_Login__c"] is None
    assert rows["t1"]["Org__c"] is None
    assert num(rows["t1"]["Fiscal__c"]) == 0  # blank, as zero (the field's default)
    assert int(rows["t1"]["Sandbox__c"]) == 0
    assert num(rows["t1"]["Max__c"]) == Decimal("20.00")  # the organization's record

    with engine.begin() as conn:
        write_global(conn, "user.id", "u1")  # names are case-insensitive
        write_global(conn, "Organization.Name", "Acme")
        write_global(conn, "Organization.FiscalYearStartMonth", "4")
        write_global(conn, "Organization.IsSandbox", "TRUE")
    rows = view_rows(engine, "Todo__c")
    assert [int(rows[t]["Mine__c"]) for t in ("t1", "t2")] == [1, 0]
    assert (rows["t2"]["Me__c"], rows["t2"]["My_Login__c"]) == ("u1", "ADA@EXAMPLE.COM")
    assert (rows["t1"]["Org__c"], num(rows["t1"]["Fiscal__c"])) == ("Acme", Decimal("4.00"))
    assert int(rows["t1"]["Sandbox__c"]) == 1
    assert num(rows["t1"]["Max__c"]) == Decimal("20.00")  # u1 has no record of its own

    with engine.connect() as conn:
        with acting_user(conn, "u2"):
            got = {r.Id: r for r in conn.execute(sa.text("SELECT * FROM v_Todo__c"))}
            assert [int(got[t].Mine__c) for t in ("t1", "t2")] == [0, 1]
            assert got["t1"].Me__c == "u2" and got["t1"].My_Login__c == "BO@EXAMPLE.COM"
            assert num(got["t1"].Max__c) == Decimal("40.00")  # Bo's own record
        # The session is reset on exit: the default acting user again.
        after = conn.execute(sa.text("SELECT Me__c FROM v_Todo__c WHERE Id = 't1'")).scalar()
        assert after == "u1"

    with engine.begin() as conn:
        with pytest.raises(ValueError, match=r"'Organization\.Bogus' is not a formula global"):
            write_global(conn, "Organization.Bogus", "x")
        with pytest.raises(ValueError, match="13' is not a month number 1-12"):
            write_global(conn, "Organization.FiscalYearStartMonth", "13")
        with pytest.raises(ValueError, match="'maybe' is not true or false"):
            write_global(conn, "Organization.IsSandbox", "maybe")
        write_global(conn, "User.Id", None)
    assert view_rows(engine, "Todo__c")["t1"]["Me__c"] is None


# --- end to end: an SFDX project through ApplyAll -----------------------------------


def field_xml(name: str, body: str) -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
        f"<fullName>{name}</fullName>{body}</CustomField>"
    )


def write_project(root: Path) -> Path:
    """Order__c (master) with Line__c children: a roll-up with a comma'd filter value,
    a formula on it, and a child formula reaching through its master to Account."""
    objects = root / "force-app" / "main" / "default" / "objects"
    files = {
        "Order__c/fields/Account__c": "<label>Account</label><type>Lookup</type>"
        "<referenceTo>Account</referenceTo><relationshipName>Orders</relationshipName>",
        "Order__c/fields/Lines__c": "<label>Lines</label><type>Summary</type>"
        "<summaryFilterItems><field>Line__c.Kind__c</field><operation>equals</operation>"
        "<value>&quot;A, B&quot;,C</value></summaryFilterItems>"
        "<summaryForeignKey>Line__c.Order__c</summaryForeignKey>"
        "<summaryOperation>count</summaryOperation>",
        "Order__c/fields/Total__c": "<label>Total</label><type>Summary</type>"
        "<summarizedField>Line__c.Amount__c</summarizedField>"
        "<summaryForeignKey>Line__c.Order__c</summaryForeignKey>"
        "<summaryOperation>sum</summaryOperation>",
        "Order__c/fields/Big__c": "<label>Big</label><type>Checkbox</type>"
        "<formula>Total__c &gt; 100</formula>",
        "Line__c/fields/Order__c": "<label>Order</label><type>MasterDetail</type>"
        "<referenceTo>Order__c</referenceTo><relationshipName>Lines</relationshipName>",
        "Line__c/fields/Kind__c": "<label>Kind</label><type>Text</type><length>10</length>",
        "Line__c/fields/Amount__c": "<label>Amount</label><type>Currency</type>"
        "<precision>10</precision><scale>2</scale>",
        "Line__c/fields/Account_Name__c": "<label>Account name</label><type>Text</type>"
        "<formula>Order__r.Account__r.Name</formula>",
        "Line__c/fields/Caption__c": "<label>Caption</label><type>Text</type>"
        "<formula>$Label.Line_Prefix &amp; Name</formula>",
        "Line__c/fields/Mine__c": "<label>Mine</label><type>Checkbox</type>"
        "<formula>OwnerId = $User.Id</formula>",
        "Line__c/fields/Cap__c": "<label>Cap</label><type>Number</type><precision>4</precision>"
        "<scale>0</scale><formula>$Setup.Line_Limits__c.Max_Lines__c</formula>",
        "Line__c/fields/Org__c": "<label>Org</label><type>Text</type>"
        "<formula>$Organization.Name</formula>",
        "Line__c/fields/Api__c": "<label>Api</label><type>Text</type>"
        "<formula>$Api.Partner_Server_URL_260</formula>",
        "Line_Limits__c/fields/Max_Lines__c": "<label>Max lines</label><type>Number</type>"
        "<precision>4</precision><scale>0</scale>",
    }
    for rel, body in files.items():
        path = objects / f"{rel}.field-meta.xml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(field_xml(path.name.split(".")[0], body))
    for name in ("Order__c", "Line__c"):
        (objects / name / f"{name}.object-meta.xml").write_text(
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<CustomObject xmlns="http://soap.sforce.com/2006/04/metadata">'
            f"<label>{name}</label><pluralLabel>{name}s</pluralLabel>"
            "<nameField><label>Name</label><type>Text</type></nameField>"
            "<deploymentStatus>Deployed</deploymentStatus><sharingModel>ReadWrite</sharingModel>"
            "</CustomObject>"
        )
    # A hierarchy custom setting: imported with its SetupOwnerId ($Setup reads it).
    (objects / "Line_Limits__c" / "Line_Limits__c.object-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomObject xmlns="http://soap.sforce.com/2006/04/metadata">'
        "<customSettingsType>Hierarchy</customSettingsType><label>Line limits</label>"
        "<visibility>Public</visibility></CustomObject>"
    )
    labels = root / "force-app" / "main" / "default" / "labels"
    labels.mkdir(parents=True)
    (labels / "CustomLabels.labels-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomLabels xmlns="http://soap.sforce.com/2006/04/metadata"><labels>'
        "<fullName>Line_Prefix</fullName><language>en_US</language><protected>false</protected>"
        "<shortDescription>Line prefix</shortDescription><value>Line #</value></labels>"
        "</CustomLabels>"
    )
    (root / "sfdx-project.json").write_text(
        '{"name": "orders-app", "packageDirectories": [{"path": "force-app", "default": true}]}'
    )
    return root


async def test_apply_all_builds_rollups_and_paths_and_verify_agrees(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    from tests.builders import apply_all, cli_env, invoke

    src = write_project(tmp_path / "orders")
    result = await apply_all(temporal_env, settings, app_pack_sources=[str(src)])
    assert result.status == "completed", result.reason
    derived = next(p for p in result.phases if p.name == "rebuild-derived")
    # Only $Api is left out, and said so in the result and in `status`.
    assert "1 formula(s) left out: Line__c.Api__c" in (derived.detail or ""), derived.detail
    env = cli_env(settings)
    status = invoke(["status"], env)
    assert status.exit_code == 0, status.output
    assert "1 formula(s) left out of their views" in status.output
    assert "Line__c.Api__c: global variable '$Api.Partner_Server_URL_260' is not supported" in (
        status.output
    )
    # The acting user and the organization are set from the CLI; views read them.
    for name, value in (("User.Id", "005A"), ("Organization.Name", "Acme Ltd")):
        done = invoke(["formulas", "set-global", name, value], env)
        assert done.exit_code == 0, done.output
    bad = invoke(["formulas", "set-global", "Organization.Colour", "red"], env)
    assert bad.exit_code == 1 and "'Organization.Colour' is not a formula global" in bad.output
    listed = invoke(["formulas", "globals"], env)
    assert "Acme Ltd" in listed.output and "005A" in listed.output
    engine = make_engine(settings.database_url)
    try:
        insert(
            engine,
            "Line_Limits__c",
            {"Id": "s1", "Name": "org", "SetupOwnerId": "00D000000000AAA", "Max_Lines__c": 5},
        )
        insert(engine, "Line__c", {"Id": "l0", "Name": "l0", "OwnerId": "005A"})
        mine = view_rows(engine, "Line__c")["l0"]
        assert (int(mine["Mine__c"]), num(mine["Cap__c"]), mine["Org__c"]) == (
            1, Decimal("5.00"), "Acme Ltd"
        )  # fmt: skip
        insert(engine, "Account", {"Id": "a1", "Name": "Acme"})
        insert(engine, "Order__c", {"Id": "o1", "Name": "O1", "Account__c": "a1"})
        insert(
            engine,
            "Line__c",
            {"Id": "l1", "Name": "l1", "Order__c": "o1", "Kind__c": "A, B", "Amount__c": 90},
            {"Id": "l2", "Name": "l2", "Order__c": "o1", "Kind__c": "C", "Amount__c": 20},
            {"Id": "l3", "Name": "l3", "Order__c": "o1", "Kind__c": "A", "Amount__c": 1},
        )
        order = view_rows(engine, "Order__c")["o1"]
        assert int(order["Lines__c"]) == 2  # "A, B" and "C"; "A" alone is not a value
        assert num(order["Total__c"]) == Decimal("111.00")
        assert int(order["Big__c"]) == 1
        line = view_rows(engine, "Line__c")["l3"]
        assert line["Account_Name__c"] == "Acme"
        assert line["Caption__c"] == "Line #l3"
    finally:
        engine.dispose()
    # A converged re-run: verify compares the same view definitions, nothing changes.
    again = await apply_all(temporal_env, settings)
    assert again.status == "completed", again.reason


def test_shared_formulas_are_staged_not_inlined_at_every_use(engine: Engine) -> None:
    """A formula referenced by others is computed once, in a stage of its level,
    and read as a column above: a ladder of 14 formulas, each using the one
    below twice (and an error, a checkbox, a date and a text along the way),
    keeps the view's SQL linear in the formulas (inlined, it doubles per rung:
    2^14 copies) and gives Salesforce's values on every backend."""
    # SQLite inlines (its reads are faster so, see nexuscrm.formulas.view) until
    # its parser cannot hold a field: 10 rungs inline are 2^10 copies, more than
    # it can parse, so there the fields above the ladder are built staged too.
    sqlite = engine.dialect.name == "sqlite"
    rungs = 10 if sqlite else 14
    fields = [
        fld("Amount__c", "Number", precision=18, scale=2),
        fld("Start__c", "Date"),
        fld(
            "R0__c",
            "Number",
            scale=2,
            formula="Amount__c / 2",
            formula_treat_blanks_as="BlankAsZero",
        ),
    ]
    for k in range(1, rungs + 1):
        prev = f"R{k - 1}__c"
        fields.append(fld(f"R{k}__c", "Number", scale=2, formula=f"({prev} + {prev}) / 2 + 1"))
    top = f"R{rungs}__c"
    fields += [
        fld("Big__c", "Checkbox", formula=f"{top} > 100"),
        fld("Flag__c", "Text", formula=f'IF(Big__c, "big", "small") & "/" & TEXT(FLOOR({top}))'),
        fld("Due__c", "Date", formula=f"Start__c + {top}"),
        fld("Ratio__c", "Number", scale=2, formula=f"{top} / (Amount__c - 10)"),
        fld("Ratio2__c", "Number", scale=2, formula="Ratio__c * 2"),
    ]
    ladder = obj("Ladder__c", *fields)
    build(engine, [ladder])
    with engine.connect() as conn:
        table = sa.Table("Ladder__c", sa.MetaData(), autoload_with=conn)
    select, _ = build_view_select(ladder, table, engine.dialect.name, None)
    sql = str(select.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True}))
    assert sql.startswith("WITH"), sql[:200]  # staged, on every backend
    assert len(sql) < 40_000, len(sql)  # inlined: millions of characters
    insert(
        engine,
        "Ladder__c",
        {"Id": "a", "Name": "A", "Amount__c": 10, "Start__c": date(2024, 2, 20)},
        {"Id": "b", "Name": "B", "Amount__c": 300, "Start__c": None},
        {"Id": "c", "Name": "C", "Amount__c": None, "Start__c": date(2024, 1, 1)},
    )
    rows = view_rows(engine, "Ladder__c")
    # Each rung adds 1 to the one below: R<n> = Amount / 2 + n (blank Amount as 0).
    a, b, c = 5 + rungs, 150 + rungs, rungs
    assert [num(rows[i][top]) for i in "abc"] == [Decimal(f"{v}.00") for v in (a, b, c)]
    assert [bool(rows[i]["Big__c"]) for i in "abc"] == [False, True, False]
    assert [rows[i]["Flag__c"] for i in "abc"] == [f"small/{a}", f"big/{b}", f"small/{c}"]
    # 2024-02-20 + a days, across the leap day.
    assert day(rows["a"]["Due__c"]) == date(2024, 2, 20) + timedelta(days=a)
    assert rows["b"]["Due__c"] is None
    # Amount 10: division by zero is #Error!, blank, and so is the formula reading it.
    assert rows["a"]["Ratio__c"] is None and rows["a"]["Ratio2__c"] is None
    # b / 290 rounded to 2 places (Ratio__c's scale), then * 2 unrounded, rounded.
    assert num(rows["b"]["Ratio2__c"]) == (Decimal(b) / 290 * 2).quantize(Decimal("0.01"))
