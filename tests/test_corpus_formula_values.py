"""Values of real corpus formula and roll-up fields, on SQLite and MariaDB.

``project-management-tool`` and ``eda`` are installed unedited by one ApplyAll
per backend (module scope); rows are inserted into the object tables and each
field is read back from its object's view. Every expected value is derived by
hand from Salesforce's documented formula semantics for the rows inserted
here (the derivation sits beside it), never from what the compiler returns:

- BlankAsZero reads a blank Number / Currency / Percent reference as 0; a
  blank date never becomes 0, so date arithmetic with one is blank;
- a Percent field is a fraction inside a formula (50 reads as 0.5) and a
  Percent result is shown as a percentage, rounded to the field's scale;
- blank text is '' in ``&`` / ``+``; a text result of '' is blank;
- roll-ups count / sum the non-deleted master-detail children meeting every
  filter; SUM of none is 0, MIN / MAX of none blank; a roll-up has the type of
  the field it summarizes (SUM of a Percent is a Percent);
- a runtime error (division by zero) shows ``#Error!``: blank here;
- a blank lookup gives blank values of the parent.

No corpus formula declares BlankAsBlank (project-management-tool's are all
BlankAsZero; PMT_Phase__c.Length__c declares neither and reads only dates), so
blank handling is checked on the BlankAsZero side: a blank Percent reads as 0,
a blank date stays blank.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import contextmanager
from datetime import date
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.db.engine import make_engine
from nexuscrm.db.session import acting_user
from nexuscrm.formulas import view_name
from nexuscrm.settings import Settings
from tests.builders import apply_all, corpus_project
from tests.conftest import BACKENDS, fresh_database_url

PROJECTS = ["project-management-tool", "eda"]

Record = dict[str, Any]
Rows = dict[str, dict[str, dict[str, Any]]]  # object -> Id -> view row

# --- the rows ----------------------------------------------------------------------
# project-management-tool: Program -> Project -> Phase -> Task (master-detail below
# Project), Resource Availability (per user) -> Resource Allocation <- Project.

USERS: list[Record] = [
    {"Id": "u1", "Name": "Ada Lovelace", "Username": "ada@example.com",
     "Email": "ada@example.com", "FirstName": "Ada", "LastName": "Lovelace"},
    {"Id": "u2", "Name": "Hopper", "Username": "hopper@example.com",
     "Email": "hopper@example.com", "FirstName": None, "LastName": "Hopper"},
]  # fmt: skip
PROGRAMS: list[Record] = [{"Id": "m1", "Name": "Apollo"}]
PROJECTS_ROWS: list[Record] = [
    {"Id": "p1", "Name": "Lunar Lander", "OwnerId": "u1", "Program__c": "m1",
     "Level_of_Effort__c": "Medium", "IsTemplate__c": False,
     "Initial_Start_Date__c": date(2024, 1, 2), "Initial_End_Date__c": date(2024, 12, 20)},
    # No program, no phase with dates: its kickoff and deadline are the initial dates.
    {"Id": "p2", "Name": "Solo", "OwnerId": "u2", "Program__c": None,
     "Level_of_Effort__c": None, "IsTemplate__c": False,
     "Initial_Start_Date__c": date(2023, 1, 10), "Initial_End_Date__c": date(2024, 1, 31)},
    {"Id": "p3", "Name": "Blueprint", "OwnerId": "u1", "IsTemplate__c": True},
]  # fmt: skip
PHASES: list[Record] = [
    {"Id": "f1", "Name": "Design", "Project__c": "p1"},
    # A child project's start date, set on the phase: P1's Start_Date_from_parent_phase__c.
    {"Id": "f2", "Name": "Build", "Project__c": "p1",
     "Start_date_from_child_project__c": date(2024, 1, 15)},
    {"Id": "f3", "Name": "Empty", "Project__c": "p2"},  # no tasks
    {"Id": "f5", "Name": "Template", "Project__c": "p3"},
]  # fmt: skip
TASKS: list[Record] = [
    # F1
    {"Id": "t1", "Name": "Wireframes", "Phase__c": "f1", "Status__c": "Completed",
     "Sign_off_status__c": "Approved", "Start_Date__c": date(2024, 2, 28),
     "Due_Date__c": date(2024, 3, 1), "Percentage_Completion__c": 50},
    {"Id": "t2", "Name": "Specs", "Phase__c": "f1", "Status__c": "In Progress",
     "Assigned_To1__c": "u2",
     "Start_Date__c": date(2024, 3, 5), "Due_Date__c": date(2024, 3, 24),
     "Percentage_Completion__c": 25},
    {"Id": "t3", "Name": "Review", "Phase__c": "f1", "Status__c": "Closed, not Completed",
     "Start_Date__c": date(2024, 3, 1), "Due_Date__c": date(2024, 3, 10),
     "Percentage_Completion__c": None},
    # Deleted: in no roll-up (it would move every F1 sum, minimum and maximum).
    {"Id": "t4", "Name": "Gone", "Phase__c": "f1", "Status__c": "Completed", "IsDeleted": True,
     "Start_Date__c": date(2020, 1, 1), "Due_Date__c": date(2030, 1, 1),
     "Percentage_Completion__c": 100},
    # F2
    {"Id": "t5", "Name": "Build it", "Phase__c": "f2", "Status__c": "Completed",
     "Assigned_To1__c": "u1",
     "Start_Date__c": date(2024, 4, 1), "Due_Date__c": date(2024, 4, 7),
     "Percentage_Completion__c": 100},
    {"Id": "t6", "Name": "Wait", "Phase__c": "f2", "Status__c": "On Hold",
     "Start_Date__c": date(2024, 4, 2), "Due_Date__c": date(2024, 4, 3),
     "Percentage_Completion__c": 0},
    # F5
    {"Id": "t9", "Name": "Copy", "Phase__c": "f5", "Status__c": "Not Started",
     "Start_Date__c": date(2024, 5, 6), "Due_Date__c": date(2024, 5, 6),
     "Percentage_Completion__c": 29},
    {"Id": "t10", "Name": "Undated", "Phase__c": "f5", "Status__c": "Not Started",
     "Start_Date__c": None, "Due_Date__c": date(2024, 5, 6), "Percentage_Completion__c": 40},
]  # fmt: skip
AVAILABILITIES: list[Record] = [
    {"Id": "av1", "Name": "Ada FY24", "User__c": "u1", "Fiscal_Year__c": "FY24", "Jan__c": 100},
    {"Id": "av2", "Name": "Hopper FY24", "User__c": "u2", "Fiscal_Year__c": "FY24",
     "Jan__c": None},
]  # fmt: skip
ALLOCATIONS: list[Record] = [
    {"Id": "ra1", "Name": "RA1", "Project__c": "p1", "Resource_Availability__c": "av1",
     "Jan__c": 60},
    {"Id": "ra2", "Name": "RA2", "Project__c": "p2", "Resource_Availability__c": "av1",
     "Jan__c": 30},
    {"Id": "ra3", "Name": "RA3", "Project__c": "p1", "Resource_Availability__c": "av1",
     "Jan__c": 50, "IsDeleted": True},
    {"Id": "ra4", "Name": "RA4", "Project__c": "p2", "Resource_Availability__c": "av2",
     "Jan__c": 30},
]  # fmt: skip
CASES: list[Record] = [
    {"Id": "c1", "Name": "00001", "PMT_Project__c": "p1"},
    {"Id": "c2", "Name": "00002", "PMT_Project__c": "p2"},  # project without a program
    {"Id": "c3", "Name": "00003", "PMT_Project__c": None},  # no project
]

# eda: Attendance Event -> Course Connection -> Course Offering -> Course; Contact; Address.
COURSES: list[Record] = [{"Id": "cr1", "Name": "Biology 101"}]
OFFERINGS: list[Record] = [{"Id": "co1", "Name": "BIO-101-A", "Course__c": "cr1"}]
ENROLLMENTS: list[Record] = [
    {"Id": "ce1", "Name": "CE1", "Course_Offering__c": "co1"},
    {"Id": "ce2", "Name": "CE2", "Course_Offering__c": None},
]
ATTENDANCE: list[Record] = [
    {"Id": "ae1", "Name": "AE1", "Course_Connection__c": "ce1"},
    {"Id": "ae2", "Name": "AE2", "Course_Connection__c": "ce2"},  # blank second hop
]
CONTACTS: list[Record] = [
    {"Id": "k1", "Name": "K1", "LastName": "One", "Primary_Address_Type__c": "Work",
     "MailingStreet": "1 Main St", "MailingCity": "Springfield", "MailingState": None,
     "MailingPostalCode": "62701", "MailingCountry": "USA"},
    {"Id": "k2", "Name": "K2", "LastName": "Two", "Primary_Address_Type__c": "Home",
     "Secondary_Address_Type__c": "Work", "MailingStreet": "9 Elm St",
     "OtherStreet": None, "OtherCity": "Boston", "OtherState": "MA",
     "OtherPostalCode": "02108", "OtherCountry": None},
    {"Id": "k3", "Name": "K3", "LastName": "Three", "Primary_Address_Type__c": "Home",
     "MailingStreet": "5 Oak St"},
]  # fmt: skip
ADDRESSES: list[Record] = [
    {"Id": "ad1", "Name": "AD1", "MailingStreet__c": "1 Main St", "MailingStreet2__c": "Apt 4",
     "MailingCity__c": "Springfield", "MailingState__c": "IL",
     "MailingPostalCode__c": "62701", "MailingCountry__c": None},
    {"Id": "ad2", "Name": "AD2", "MailingStreet__c": "221B Baker St", "MailingStreet2__c": None,
     "MailingCity__c": None, "MailingState__c": None, "MailingPostalCode__c": "NW1 6XE",
     "MailingCountry__c": "UK"},
]  # fmt: skip

INSERTS: list[tuple[str, list[Record]]] = [
    ("User", USERS),
    ("PMT_Program__c", PROGRAMS),
    ("PMT_Project__c", PROJECTS_ROWS),
    ("PMT_Phase__c", PHASES),
    ("PMT_Task__c", TASKS),
    ("PMT_Resource_Availability__c", AVAILABILITIES),
    ("PMT_Resource_Allocation__c", ALLOCATIONS),
    ("Case", CASES),
    ("Course__c", COURSES),
    ("Course_Offering__c", OFFERINGS),
    ("Course_Enrollment__c", ENROLLMENTS),
    ("Attendance_Event__c", ATTENDANCE),
    ("Contact", CONTACTS),
    ("Address__c", ADDRESSES),
]


@pytest.fixture(scope="module", params=BACKENDS)
async def views(
    request: pytest.FixtureRequest,
    temporal_env: WorkflowEnvironment,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Rows]:
    """One ApplyAll of both projects on a fresh database of the backend, the rows
    above inserted, and every inserted row read back from its object's view."""
    catalog.CACHE.invalidate()
    database = contextmanager(fresh_database_url)  # drops the MariaDB database after
    with database(request.param, tmp_path_factory.mktemp("corpus-values")) as url:
        settings = Settings(
            database_url=url,
            controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
            env="development",
            NEXUS_DATABASE_ID=f"test-{uuid.uuid4().hex[:8]}",
        )
        started = time.monotonic()
        sources = [str(corpus_project(p)) for p in PROJECTS]
        result = await apply_all(temporal_env, settings, app_pack_sources=sources)
        assert result.status == "completed", result.reason
        installed = time.monotonic() - started
        engine = make_engine(url)
        try:
            rows: Rows = {}
            with engine.begin() as conn:
                for table, records in INSERTS:
                    tbl = sa.Table(table, sa.MetaData(), autoload_with=conn)
                    for r in records:  # one by one: the rows set different columns
                        conn.execute(tbl.insert(), {"IsDeleted": False, **r})
            with engine.connect() as conn:
                for table, records in INSERTS:
                    ids = {r["Id"] for r in records}
                    found = conn.execute(sa.text(f"SELECT * FROM {view_name(table)}")).mappings()
                    rows[table] = {r["Id"]: dict(r) for r in found if r["Id"] in ids}
                # Read again as user u1 ($User.Id: the session's acting user).
                with acting_user(conn, "u1"):
                    for table in ("PMT_Task__c", "PMT_Resource_Allocation__c"):
                        mine = conn.execute(sa.text(f"SELECT * FROM {view_name(table)}"))
                        rows[f"as u1: {table}"] = {r["Id"]: dict(r) for r in mine.mappings()}
        finally:
            engine.dispose()
        print(f"\n[corpus values] {request.param}: applyall {installed:.1f}s")
        yield rows


def num(value: Any, places: str = "0.01") -> Decimal | None:
    return None if value is None else Decimal(str(value)).quantize(Decimal(places))


def day(value: Any) -> date | None:
    if value is None or isinstance(value, date):
        return value
    return date.fromisoformat(str(value)[:10])


def field(rows: Rows, obj: str, field_name: str) -> dict[str, Any]:
    """``Id -> value`` of one field (it must be a column of the view)."""
    table = rows[obj]
    some = next(iter(table.values()))
    assert field_name in some, f"{obj}.{field_name} is not in {view_name(obj)}"
    return {i: r[field_name] for i, r in table.items()}


# --- cross-object references ------------------------------------------------------


def test_program_text_through_a_lookup(views: Rows) -> None:
    """PMT_Project__c.Program_Text__c: ``Program__r.Name`` (Text)."""
    v = field(views, "PMT_Project__c", "Program_Text__c")
    assert v["p1"] == "Apollo"  # Program__c = m1, named Apollo
    assert v["p2"] is None  # blank lookup: the parent's name is blank


def test_case_program_two_hops(views: Rows) -> None:
    """Case.PMT_Program__c: ``PMT_Project__r.Program__r.Name`` (Text)."""
    v = field(views, "Case", "PMT_Program__c")
    assert v["c1"] == "Apollo"  # c1 -> p1 -> m1 "Apollo"
    assert v["c2"] is None  # c2 -> p2, whose Program__c is blank
    assert v["c3"] is None  # no project at all


def test_task_is_template_two_hops(views: Rows) -> None:
    """PMT_Task__c.IsTemplate__c: ``Phase__r.Project__r.IsTemplate__c`` (Checkbox)."""
    v = field(views, "PMT_Task__c", "IsTemplate__c")
    assert int(v["t9"]) == 1  # t9 -> f5 -> p3, IsTemplate__c true
    assert int(v["t1"]) == 0  # t1 -> f1 -> p1, IsTemplate__c false


def test_course_name_three_hops(views: Rows) -> None:
    """eda Attendance_Event__c.Course_Name__c:
    ``Course_Connection__r.Course_Offering__r.Course__r.Name`` (Text)."""
    v = field(views, "Attendance_Event__c", "Course_Name__c")
    assert v["ae1"] == "Biology 101"  # ae1 -> ce1 -> co1 -> cr1 "Biology 101"
    assert v["ae2"] is None  # ce2 has no course offering: blank


def test_allocation_program_name_reads_the_parents_formula(views: Rows) -> None:
    """PMT_Resource_Allocation__c.Program_Name__c (Text): ``IF(ISBLANK(
    Project__r.Program_Text__c), 'Individual Projects', Project__r.Program_Text__c)``,
    the project's own formula ``Program__r.Name`` two hops from the allocation."""
    v = field(views, "PMT_Resource_Allocation__c", "Program_Name__c")
    assert v["ra1"] == "Apollo"  # ra1 -> p1 -> m1: not blank, so Program_Text__c
    assert v["ra2"] == "Individual Projects"  # ra2 -> p2, no program: ISBLANK is true


def test_allocation_project_owner_through_owner_user(views: Rows) -> None:
    """PMT_Resource_Allocation__c.Project_Owner__c (Text):
    ``Project__r.Owner:User.FirstName + ' ' + Project__r.Owner:User.LastName``."""
    v = field(views, "PMT_Resource_Allocation__c", "Project_Owner__c")
    assert v["ra1"] == "Ada Lovelace"  # p1 owned by u1: "Ada" + " " + "Lovelace"
    # p2 owned by u2, no first name: blank text is "" in +, so "" + " " + "Hopper"
    # (whether the leading space survives in the shown value is not documented).
    assert v["ra2"] in (" Hopper", "Hopper")


# --- roll-ups and formulas over them ----------------------------------------------


def test_filtered_rollup_count(views: Rows) -> None:
    """PMT_Phase__c.Phases_with_completed_tasks__c: COUNT of PMT_Task__c where
    Status__c equals "Completed", "Closed, not Completed"."""
    v = field(views, "PMT_Phase__c", "Phases_with_completed_tasks__c")
    assert int(v["f1"]) == 2  # t1 Completed, t3 Closed, not Completed; t2 In Progress; t4 deleted
    assert int(v["f2"]) == 1  # t5 Completed; t6 On Hold
    assert int(v["f3"]) == 0  # no tasks: COUNT of none is 0
    count = field(views, "PMT_Phase__c", "Task_Count__c")  # the unfiltered COUNT
    assert [int(count[f]) for f in ("f1", "f2", "f3")] == [3, 2, 0]  # t4 is deleted


def test_task_duration_and_weighted_percentage(views: Rows) -> None:
    """PMT_Task__c.Duration__c (Number, scale 0, BlankAsZero):
    ``Due_Date__c - Start_Date__c+1``; Weighted_percentage__c (Number, scale 2,
    BlankAsZero): ``Duration__c * Percentage_Completion__c`` (a Percent field)."""
    d = field(views, "PMT_Task__c", "Duration__c")
    w = field(views, "PMT_Task__c", "Weighted_percentage__c")
    assert num(d["t1"]) == Decimal("3.00")  # 2024-02-28 .. 2024-03-01 is 2 days (leap) + 1
    assert num(d["t2"]) == Decimal("20.00")  # 03-05 .. 03-24: 19 + 1
    assert num(d["t3"]) == Decimal("10.00")  # 03-01 .. 03-10: 9 + 1
    # A blank date is never read as zero: date - blank is blank, blank + 1 blank.
    assert d["t10"] is None
    assert num(w["t1"]) == Decimal("1.50")  # 3 * 50% = 3 * 0.5
    assert num(w["t2"]) == Decimal("5.00")  # 20 * 0.25
    # BlankAsZero: the blank Percentage_Completion__c reads as 0: 10 * 0.
    assert num(w["t3"]) == Decimal("0.00")


def test_percent_rollup_keeps_the_percent_type(views: Rows) -> None:
    """PMT_Phase__c.Sum_Of_Task_Completion__c: SUM of PMT_Task__c.Percentage_Completion__c
    (Percent): a Percent roll-up, shown like the field it sums."""
    v = field(views, "PMT_Phase__c", "Sum_Of_Task_Completion__c")
    assert num(v["f1"]) == Decimal("75.00")  # 50% + 25% (t3 blank, skipped; t4 deleted)
    assert num(v["f2"]) == Decimal("100.00")  # 100% + 0%
    assert num(v["f3"]) == Decimal("0.00")  # SUM of none is 0
    # PMT_Project__c.Sum_of_sum_of_percentage_completion__c: SUM of that roll-up.
    project = field(views, "PMT_Project__c", "Sum_of_sum_of_percentage_completion__c")
    assert num(project["p1"]) == Decimal("175.00")  # f1 75% + f2 100%


def test_percent_formula_over_rollups(views: Rows) -> None:
    """PMT_Phase__c.Percentage_Completion_without_child__c (Percent, scale 0):
    ``Sum_Of_Task_Completion__c/Task_Count__c``."""
    v = field(views, "PMT_Phase__c", "Percentage_Completion_without_child__c")
    assert num(v["f1"]) == Decimal("25.00")  # 75% reads as 0.75; / 3 = 0.25 -> 25%
    assert num(v["f2"]) == Decimal("50.00")  # 1.00 / 2 = 0.5 -> 50%
    assert v["f3"] is None  # 0 / 0: division by zero is #Error!, blank


def test_phase_completion_floor_over_rollups(views: Rows) -> None:
    """PMT_Phase__c.Phase_Completion__c (Percent, scale 0, BlankAsZero):
    ``FLOOR((Sum_Weighted_perc__c / Sum_Task_Duration__c)*100)/100``, both SUM
    roll-ups of the tasks' formulas; and Phase_Weighted_Perc__c (Number, scale 2):
    ``Sum_Task_Duration__c * Phase_Completion__c``."""
    v = field(views, "PMT_Phase__c", "Phase_Completion__c")
    weighted = field(views, "PMT_Phase__c", "Phase_Weighted_Perc__c")
    duration = field(views, "PMT_Phase__c", "Sum_Task_Duration__c")
    summed = field(views, "PMT_Phase__c", "Sum_Weighted_perc__c")
    assert num(duration["f1"]) == Decimal("33.00")  # 3 + 20 + 10
    assert num(summed["f1"]) == Decimal("6.50")  # 1.50 + 5.00 + 0.00
    # 6.5 / 33 = 0.19696..; * 100 = 19.69..; FLOOR 19; / 100 = 0.19 -> 19%
    assert num(v["f1"]) == Decimal("19.00")
    assert num(weighted["f1"]) == Decimal("6.27")  # 33 * 0.19
    # f2: durations 7 + 2 = 9, weighted 7 * 1.00 + 2 * 0 = 7; FLOOR(77.77..) / 100 = 0.77
    assert num(v["f2"]) == Decimal("77.00")
    assert num(weighted["f2"]) == Decimal("6.93")  # 9 * 0.77
    assert v["f3"] is None  # no tasks: 0 / 0 is #Error!, blank


def test_phase_completion_is_decimal_arithmetic(views: Rows) -> None:
    """Phase_Completion__c where the ratio is exactly 0.29: Salesforce's formulas
    compute in decimal, so FLOOR(0.29 * 100) is 29 (binary floating point, as
    SQLite computes, gives 28.999999999999996; the SQLite view rounds FLOOR's
    argument to the 15 digits a double holds first)."""
    v = field(views, "PMT_Phase__c", "Phase_Completion__c")
    # f5: t9 lasts 1 day at 29% -> weighted 0.29; t10 (no start) has a blank
    # duration, skipped by SUM, and weighted blank-as-zero * 0.40 = 0.
    # Sum_Weighted_perc__c / Sum_Task_Duration__c = 0.29 / 1; * 100 = 29; FLOOR 29.
    assert num(v["f5"]) == Decimal("29.00")


def test_project_percentage_completion_rollup_of_rollups(views: Rows) -> None:
    """PMT_Project__c.Percentage_Completion__c (Percent, scale 0): ``IF(
    Sum_of_Task_Duration__c==0,0,FLOOR(( Sum_Wheigted_perc__c / Sum_of_Task_Duration__c
    )*100)/100)``: SUMs of the phases' roll-up and formula."""
    v = field(views, "PMT_Project__c", "Percentage_Completion__c")
    tasks = field(views, "PMT_Project__c", "Sum_of_tasks_count__c")
    assert int(tasks["p1"]) == 5  # SUM of Task_Count__c: 3 + 2
    # Sum_of_Task_Duration__c 33 + 9 = 42; Sum_Wheigted_perc__c 6.27 + 6.93 = 13.20;
    # 13.2 / 42 = 0.3142..; * 100 = 31.42..; FLOOR 31; / 100 = 0.31 -> 31%
    assert num(v["p1"]) == Decimal("31.00")
    assert num(v["p2"]) == Decimal("0.00")  # f3 has no tasks: the sum is 0, IF gives 0


def test_allocation_percent_rollup_and_remaining(views: Rows) -> None:
    """PMT_Resource_Availability__c.Jan_Allocation__c: SUM of the allocations'
    Jan__c (Percent); Jan_Remaining__c (Percent, scale 0, BlankAsZero):
    ``Jan__c - Jan_Allocation__c``."""
    allocated = field(views, "PMT_Resource_Availability__c", "Jan_Allocation__c")
    remaining = field(views, "PMT_Resource_Availability__c", "Jan_Remaining__c")
    assert num(allocated["av1"]) == Decimal("90.00")  # 60% + 30% (ra3 deleted)
    assert num(allocated["av2"]) == Decimal("30.00")
    assert num(remaining["av1"]) == Decimal("10.00")  # 1.00 - 0.90 = 0.10 -> 10%
    # BlankAsZero: the blank Jan__c reads as 0: 0 - 0.30 = -0.30 -> -30%
    # (under BlankAsBlank it would be blank).
    assert num(remaining["av2"]) == Decimal("-30.00")


# --- dates ------------------------------------------------------------------------


def test_project_kickoff_deadline_duration(views: Rows) -> None:
    """PMT_Project__c.Kickoff_formula__c / Deadline_formula__c (Date): the
    phases' MIN / MAX date roll-ups, or Initial_*_Date__c when both are blank;
    Duration__c (Number, scale 0): ``Deadline_formula__c - Kickoff_formula__c+1``."""
    kickoff = field(views, "PMT_Project__c", "Kickoff_formula__c")
    deadline = field(views, "PMT_Project__c", "Deadline_formula__c")
    duration = field(views, "PMT_Project__c", "Duration__c")
    # p1: Start_Date_Rollup__c = MIN(f1 2024-02-28, f2 2024-04-01) = 2024-02-28 and
    # Start_Date_from_parent_phase__c = MIN(f2's 2024-01-15) both set: the earlier.
    assert day(kickoff["p1"]) == date(2024, 1, 15)
    # Deadline__c = MAX(f1 2024-03-24, f2 2024-04-07); Deadline_parent_phase__c blank.
    assert day(deadline["p1"]) == date(2024, 4, 7)
    assert num(duration["p1"]) == Decimal("84.00")  # 2024-01-15 .. 2024-04-07: 83 + 1
    # p2: its only phase has no tasks, every roll-up is blank: the initial dates.
    assert day(kickoff["p2"]) == date(2023, 1, 10)
    assert day(deadline["p2"]) == date(2024, 1, 31)
    assert num(duration["p2"]) == Decimal("387.00")  # 365 + 21 days, + 1


def test_phase_kickoff_falls_back_to_the_projects_formula(views: Rows) -> None:
    """PMT_Phase__c.Kickoff_formula__c (Date): ``IF(ISNULL(Start_Date_Rollup__c),
    IF(ISNULL(Start_date_from_child_project__c), Project__r.Kickoff_formula__c,
    Start_date_from_child_project__c), Start_Date_Rollup__c)``."""
    v = field(views, "PMT_Phase__c", "Kickoff_formula__c")
    assert day(v["f1"]) == date(2024, 2, 28)  # MIN(t1..t3 starts); t4 (2020) is deleted
    assert day(v["f2"]) == date(2024, 4, 1)  # its roll-up wins over the child-project date
    assert day(v["f3"]) == date(2023, 1, 10)  # no tasks: p2's Kickoff_formula__c


def test_project_months_and_fiscal_quarters(views: Rows) -> None:
    """PMT_Project__c text formulas over dates, the fiscal year starting in month 2
    (``$CustomMetadata.PMT_Setting__mdt.Default.Start_Month_of_Fiscal_Year__c``,
    installed from the project's customMetadata)."""
    end_month = field(views, "PMT_Project__c", "Project_End_Month__c")
    start_month = field(views, "PMT_Project__c", "Project_Start_Month__c")
    qtr = field(views, "PMT_Project__c", "Qtr_of_Completion__c")
    start_fy = field(views, "PMT_Project__c", "Start_Fiscal_Year__c")
    end_fy = field(views, "PMT_Project__c", "End_Fiscal_Year__c")
    # TEXT(YEAR(Deadline_formula__c)) + "." + TEXT(MONTH(Deadline_formula__c))
    assert end_month["p1"] == "2024.4"
    assert start_month["p1"] == "2024.1"  # kickoff 2024-01-15
    # "FY" + IF(MONTH - 2 < 0, TEXT(MOD(YEAR,100)), TEXT(MOD(YEAR,100)+1)) + "-" +
    # CASE(MOD(MONTH - 2 + 12, 12), 0..2 "Q1", 3..5 "Q2", ...)
    assert qtr["p1"] == "FY25-Q1"  # April: 4-2 = 2 >= 0 -> 24+1; MOD(14,12) = 2 -> Q1
    assert qtr["p2"] == "FY24-Q4"  # January: 1-2 < 0 -> 24; MOD(11,12) = 11 -> Q4
    # IF(2 != 1 && MONTH(d) >= 2, 'FY' & RIGHT(TEXT(YEAR(d)+1),2), 'FY' & RIGHT(TEXT(YEAR(d)),2))
    assert start_fy["p1"] == "FY24"  # January 2024: month 1 < 2
    assert end_fy["p1"] == "FY25"  # April 2024: 2025 -> "25"
    assert start_fy["p2"] == "FY23"  # January 2023
    assert end_fy["p2"] == "FY24"  # January 2024


# --- text: TEXT / CASE / IF / ISPICKVAL ------------------------------------------


def test_project_size_ispickval(views: Rows) -> None:
    """PMT_Project__c.Project_Size__c (Number, scale 0): nested
    ``IF(ISPICKVAL(Level_of_Effort__c,"Small"),1, IF(.."Medium"),2, IF(.."Large"),3,0)))``."""
    v = field(views, "PMT_Project__c", "Project_Size__c")
    assert num(v["p1"]) == Decimal("2.00")  # Medium
    assert num(v["p2"]) == Decimal("0.00")  # blank picklist matches none: 0


def test_task_status_icon_name(views: Rows) -> None:
    """PMT_Task__c.Status_Icon_Name__c (Text): ``IF(AND(Days_Late__c >0,TEXT(Status__c)
    <> "On Hold"),"utility:warning", IF(TEXT(Sign_off_status__c) = "Approved",
    "utility:approval", CASE(TEXT(Status__c), "Not Started", "utility:routing_offline",
    "In Progress", "utility:clock", "On Hold","utility:error", "utility:success")))``,
    Days_Late__c being ``IF(ISPICKVAL(Status__c,'Completed') || ISPICKVAL(Status__c,
    'Closed, not Completed'),0, Today() - Due_Date__c)``."""
    v = field(views, "PMT_Task__c", "Status_Icon_Name__c")
    assert v["t1"] == "utility:approval"  # Completed: 0 days late; signed off Approved
    assert v["t2"] == "utility:warning"  # In Progress, due 2024-03-24: late
    assert v["t3"] == "utility:success"  # Closed: 0 days late, no sign-off, CASE's else
    assert v["t6"] == "utility:error"  # late but On Hold: CASE "On Hold"


def test_contact_work_address(views: Rows) -> None:
    """eda Contact.Work_Address__c (Text): the Mailing address when
    ``ISPICKVAL(Primary_Address_Type__c,"Work")``, else the Other address when the
    secondary type is Work, else ""; each part ``if(ISBLANK(x), "", x & ", ")``."""
    v = field(views, "Contact", "Work_Address__c")
    # "1 Main St, " & "Springfield, " & "" (no state) & "62701" & ", USA"
    assert v["k1"] == "1 Main St, Springfield, 62701, USA"
    # Other address: "" (no street) & "Boston, " & "MA " & "02108" & "" (no country)
    assert v["k2"] == "Boston, MA 02108"
    assert v["k3"] is None  # neither type is Work: "" is blank


def test_address_formula_with_line_breaks(views: Rows) -> None:
    """eda Address__c.Formula_MailingAddress__c (Text): ``MailingStreet__c & BR() &
    IF(ISBLANK(MailingStreet2__c), "", MailingStreet2__c & BR()) & IF(ISBLANK(
    MailingCity__c), "", MailingCity__c & ", ") & MailingState__c & " " &
    MailingPostalCode__c & IF(ISBLANK(MailingCountry__c), "", BR() & MailingCountry__c)``."""
    v = field(views, "Address__c", "Formula_MailingAddress__c")
    assert v["ad1"] == "1 Main St<br>Apt 4<br>Springfield, IL 62701"
    # No street 2 and no city: skipped; the blank state is "" before " ".
    assert v["ad2"] == "221B Baker St<br> NW1 6XE<br>UK"


# --- the acting user ($User) ------------------------------------------------------


def test_my_task_and_allocated_to_me_follow_the_acting_user(views: Rows) -> None:
    """PMT_Task__c.My_Task__c: ``IF(Assigned_To1__c = $User.Id, "me", "")`` and
    PMT_Resource_Allocation__c.Is_Allocated_to_Me__c:
    ``Resource_Availability__r.User__r.Id = $User.Id``, read by a session whose
    acting user is u1, and by one with no acting user (none is stored)."""
    mine = field(views, "as u1: PMT_Task__c", "My_Task__c")
    assert mine["t5"] == "me"  # assigned to u1
    assert mine["t2"] is None  # assigned to u2: "" is blank
    assert mine["t1"] is None  # assigned to nobody
    # No acting user: $User.Id is blank, and blank text equals blank text in a
    # formula, so only the unassigned task is "mine".
    nobody = field(views, "PMT_Task__c", "My_Task__c")
    assert (nobody["t5"], nobody["t2"], nobody["t1"]) == (None, None, "me")
    allocated = field(views, "as u1: PMT_Resource_Allocation__c", "Is_Allocated_to_Me__c")
    assert int(allocated["ra1"]) == 1  # av1 is u1's availability
    assert int(allocated["ra4"]) == 0  # av2 is u2's
