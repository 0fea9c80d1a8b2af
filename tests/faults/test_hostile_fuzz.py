"""Hostile input, generated (issue 17 item 4): hypothesis at every parsing entry point.

The hand-picked cases of ``test_hostile_*.py`` say what a refusal looks like;
these properties throw arbitrary and mutated input at the same functions the
CLI calls and check the contract for every example: the input is accepted as
valid, or refused with the project's own error type naming the file (and the
line and field where there is one); never another exception (a traceback on
the CLI), never a ``RecursionError``.

- events files (``events enqueue``): :func:`read_event_file`;
- pack manifests (``--app-pack``, ApplyAll's plan-packs): :func:`load_pack_source`;
- formulas (RebuildDerived, ``packs import-sfdx``): :func:`compile_formula` and
  :func:`build_view_select`; a string literal of any text lands in the SQL
  escaped (read back through SQLite, and MariaDB when configured, verbatim);
- data plans (``events import-sfdx-data``): :func:`import_sfdx_plans`;
- Salesforce DX metadata and ``sfdx-project.json`` (``packs import-sfdx``):
  :func:`load_sfdx`.

Then a few of what it found, end to end through the real CLI on a fresh
SQLite database: exit 1, one ``error:`` line, no traceback, nothing written.

Derandomized and bounded (``max_examples`` per property below), so CI runs
the same examples every time; the module takes well under a minute.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from nexuscrm.catalog import object_table
from nexuscrm.connectors.eventfile import EventFileError, read_event_file
from nexuscrm.connectors.importer import DataPlanError, PlanImport, import_sfdx_plans
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import ManifestError, PackProblems
from nexuscrm.formulas import FormulaError, build_view_select, compile_formula
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.packs.model import FieldSpec, FieldType, ObjectSpec, PackManifest
from nexuscrm.packs.sfdx import load_sfdx
from nexuscrm.settings import Settings
from tests.builders import SF_SYNC, cli_env, install, invoke, invoke_async, write_sfdx

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(FUZZ, max_examples=60)  # the formula properties: ~0.1 s an example


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nexus-fuzz-") as d:
        yield Path(d)


def _fresh() -> Path:
    """A new empty folder (hypothesis examples cannot share function fixtures)."""
    return Path(tempfile.mkdtemp(prefix="nexus-fuzz-"))


# --------------------------------------------------------------------------------------
# strategies shared by the properties

# JSON scalars as a hostile sender writes them: huge and non-finite numbers too.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", " ", "default", "bulk", "urgent", "@AccountRef1", "\u0000", "é" * 200]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)

# Raw fragments that have broken JSON / YAML / XML readers before (or might).
HOSTILE_TEXT = [
    "NaN",
    "-Infinity",
    "Infinity",
    "1" * 5000,
    "1e99999",
    "-0",
    "[" * 200 + "]" * 200,
    '{"a":' * 100 + "1" + "}" * 100,
    "\ufeff",
    "\u2028",
    "\x00",
    '"\\ud800"',
    "'; DROP TABLE t; --",
    "`x`",
    "&a [*a]",
    "!!python/object/apply:os.system ['true']",
    "%TAG ! tag:x,2000:",
    "\t",
]


def _error_is_about(message: str, *names: str) -> bool:
    return all(n in message for n in names)


# --------------------------------------------------------------------------------------
# (1) events files: events enqueue

EVENT_FIELDS = [
    "event_kind",
    "idempotency_key",
    "source_object",
    "source_id",
    "payload",
    "route_version",
    "queue_class",
    "target_object",
    "target_remote_id",
]


def _good_event(n: int) -> dict[str, Any]:
    return {
        "event_kind": "salesforce.record.upsert",
        "idempotency_key": f"Account:f{n}",
        "source_object": "Account",
        "source_id": f"f{n}",
        "payload": {"sobject": "Account", "remote_id": f"f{n}", "fields": {"Name": f"F {n}"}},
    }


@st.composite
def event_lines(draw: st.DrawFn) -> tuple[dict[str, Any], str | None]:
    """A good event with one field replaced by (or added as) any JSON value."""
    line = _good_event(draw(st.integers(0, 10**6)))
    field = draw(st.sampled_from([*EVENT_FIELDS, "payloads", "", "Event_Kind"]))
    if draw(st.booleans()) and field in line:
        del line[field]
    else:
        line[field] = draw(json_values)
    return line, field


def _check_event_file(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        requests = read_event_file(path, installed_pack_id="pk-1", namespace="salesforce")
    except EventFileError as exc:
        assert exc.problems, "an EventFileError lists its problems"
        for problem in exc.problems:
            assert problem.startswith(f"{path}:"), problem  # the file, then the line
            assert re.match(rf"{re.escape(str(path))}:\d+: \S", problem), problem
        return
    for req in requests:  # accepted: every request can be stored and processed
        json.dumps(req.payload, allow_nan=False)
        assert isinstance(req.payload, dict)
        for name in ("event_kind", "idempotency_key", "source_object", "source_id"):
            value = getattr(req, name)
            assert isinstance(value, str) and 0 < len(value) <= 191, (name, value)
        assert 1 <= req.route_version <= 2**31 - 1


@FUZZ
@given(line=event_lines(), position=st.integers(0, 3))
@example(line=({**_good_event(1), "payload": {"x": math.nan}}, "payload"), position=1)
@example(line=({**_good_event(1), "payload": {"x": -math.inf}}, "payload"), position=0)
def test_an_event_line_with_any_field_value_is_accepted_or_named(
    line: tuple[dict[str, Any], str | None], position: int
) -> None:
    value, field = line
    rows = [_good_event(100 + i) for i in range(3)]
    rows.insert(position, value)
    data = b"\n".join(json.dumps(r).encode() for r in rows) + b"\n"
    path = _fresh() / "events.jsonl"
    _check_event_file(path, data)
    try:
        read_event_file(path, installed_pack_id="pk-1", namespace="salesforce")
    except EventFileError as exc:
        # Only the changed line is at fault, and the problem names it.
        assert all(p.startswith(f"{path}:{position + 1}:") for p in exc.problems), exc.problems
        if field and field in value and field in EVENT_FIELDS:
            assert any(field in p for p in exc.problems), exc.problems


@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            st.binary(max_size=60),
            st.text(max_size=60).map(str.encode),
            st.sampled_from(HOSTILE_TEXT).map(str.encode),
            st.builds(
                lambda good, cut: json.dumps(good).encode()[:cut],
                st.builds(_good_event, st.integers(0, 99)),
                st.integers(0, 300),
            ),
            st.sampled_from(HOSTILE_TEXT).map(
                lambda frag: json.dumps(_good_event(7)).replace('"f7"', frag, 1).encode()
            ),
        ),
        min_size=1,
        max_size=6,
    )
)
@example(lines=[b'{"payload": NaN}'])
@example(lines=[b"1" * 5000])
@example(lines=[json.dumps(_good_event(1)).replace('"F 1"', "1e99999").encode()])
@example(lines=[b"\xff\xfe\xfd", b"\xc3"])
def test_any_text_line_is_accepted_or_named_by_line(lines: list[bytes]) -> None:
    path = _fresh() / "events.jsonl"
    _check_event_file(path, b"\n".join(lines) + b"\n")


def test_non_finite_numbers_and_huge_integers_are_refused_naming_the_line(workdir: Path) -> None:
    """Found by the properties above: ``NaN``, ``Infinity`` and ``1e99999`` (a float
    overflowing to infinity) were accepted, stored as the non-JSON ``NaN`` text and
    written into Number columns by the flow; an integer of more than 4,300 digits was
    refused with Python's ``sys.set_int_max_str_digits()`` advice."""
    path = workdir / "events.jsonl"
    nan = json.dumps(_good_event(1)).replace('"F 1"', "NaN")
    big = json.dumps(_good_event(2)).replace('"F 2"', "1e99999")
    huge = json.dumps(_good_event(3)).replace('"F 3"', "9" * 5000)
    path.write_text("\n".join([nan, big, huge]) + "\n")
    with pytest.raises(EventFileError) as info:
        read_event_file(path, installed_pack_id="pk-1", namespace="salesforce")
    problems = info.value.problems
    assert problems[0] == f"{path}:1: invalid JSON: payload.fields.Name: NaN is not a JSON number"
    assert problems[1].startswith(f"{path}:2: invalid JSON: payload.fields.Name: Infinity is not")
    assert "out of range" in problems[1]
    assert problems[2] == f"{path}:3: invalid JSON: a number of more than 4,300 digits (5,000)"
    assert "set_int_max_str_digits" not in str(info.value)


# --------------------------------------------------------------------------------------
# (2) pack manifests

MANIFEST_KEYS = [
    "name",
    "category",
    "version",
    "description",
    "depends_on",
    "namespace",
    "objects",
    "inbound_routes",
    "callout_profiles",
    "labels",
    "source",
    "Name",
    "",
]
FIELD_KEYS = [
    "api_name",
    "type",
    "length",
    "precision",
    "scale",
    "required",
    "reference_to",
    "picklist_values",
    "formula",
    "summary",
    "formula_treat_blanks_as",
]

# What YAML can say: scalars (as text: the loader keeps them strings), nulls, nesting.
yaml_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["AppPack", "Text", "Number", "Lookup", "yes", "~", "1.0", "Id", "x" * 300]),
)
yaml_values = st.recursive(
    yaml_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.text(max_size=10), st.sampled_from(FIELD_KEYS)), inner, max_size=4
        ),
    ),
    max_leaves=15,
)


@st.composite
def manifests(draw: st.DrawFn) -> dict[Any, Any]:
    """A valid manifest with some keys (top level, object, field) given any value."""
    doc: dict[Any, Any] = {
        "name": "fuzz-app",
        "category": "AppPack",
        "version": "1.0.0",
        "objects": [
            {
                "api_name": "Gadget__c",
                "fields": [
                    {"api_name": "Size__c", "type": "Number", "precision": 18, "scale": 2},
                    {"api_name": "Twice__c", "type": "Number", "formula": "Size__c * 2"},
                ],
            }
        ],
    }
    for key in draw(st.lists(st.sampled_from(MANIFEST_KEYS), max_size=2)):
        doc[key] = draw(yaml_values)
    if isinstance(doc.get("objects"), list) and doc["objects"] and draw(st.booleans()):
        obj = doc["objects"][0]
        if isinstance(obj, dict) and isinstance(obj.get("fields"), list):
            field = obj["fields"][draw(st.integers(0, 1))]
            for key in draw(st.lists(st.sampled_from(FIELD_KEYS), min_size=1, max_size=3)):
                field[key] = draw(yaml_values)
    if draw(st.booleans()):
        doc[draw(st.sampled_from([None, 1, True]))] = draw(yaml_scalars)
    return doc


def _check_manifest(path: Path) -> None:
    try:
        pack = load_pack_source(path)
    except ManifestError as exc:
        assert str(path) in str(exc), str(exc)  # names the file
        assert exc.detail.strip(), "says why"
        return
    assert isinstance(pack, PackManifest)


@FUZZ
@given(doc=manifests(), as_json=st.booleans())
@example(doc={None: "x", "name": "a", "category": "AppPack"}, as_json=False)
@example(doc={"name": "a", "category": "AppPack", "objects": [{"api_name": None}]}, as_json=False)
def test_a_manifest_with_any_values_loads_or_is_refused_naming_the_file(
    doc: dict[Any, Any], as_json: bool
) -> None:
    folder = _fresh()
    if as_json:
        path = folder / "pack.json"
        try:
            text = json.dumps(doc)
        except TypeError:  # a non-string key JSON cannot carry
            text = json.dumps({str(k): v for k, v in doc.items()})
    else:
        path = folder / "pack.yaml"
        text = yaml.safe_dump(doc, allow_unicode=True)
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _check_manifest(path)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.lists(st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=20)), max_size=8).map(
            " ".join
        ),
        st.lists(
            st.sampled_from(
                [
                    "a: ",
                    "- ",
                    "[",
                    "{",
                    "]",
                    "}",
                    "&x ",
                    "*x ",
                    "? ",
                    "\n  ",
                    "name: app",
                    "\ncategory: AppPack",
                    "!!binary ",
                    "<<: *x",
                ]
            ),
            max_size=20,
        ).map("".join),
    ),
    suffix=st.sampled_from([".yaml", ".json"]),
)
@example(text="? [a, b]\n: c\n", suffix=".yaml")
@example(text="name: &n app\ncategory: AppPack\nobjects: *n\n", suffix=".yaml")
@example(text='{"name": 1' + "0" * 5000 + "}", suffix=".json")
def test_any_manifest_text_loads_or_is_refused_naming_the_file(text: str, suffix: str) -> None:
    path = _fresh() / f"pack{suffix}"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    _check_manifest(path)


# --------------------------------------------------------------------------------------
# (3) formulas

FORMULA_OBJECT = ObjectSpec(
    api_name="Gadget__c",
    fields=(
        FieldSpec(api_name="Amount__c", type=FieldType.Number, precision=18, scale=2),
        FieldSpec(api_name="Title__c", type=FieldType.Text, length=80),
        FieldSpec(api_name="Flag__c", type=FieldType.Checkbox),
        FieldSpec(api_name="Day__c", type=FieldType.Date),
        FieldSpec(api_name="Kind__c", type=FieldType.Picklist, picklist_values=("a", "b")),
    ),
)

TOKENS = [
    *("1", "0", "3.14", ".5", "1e5", "99999999999999999999999999999"),
    *("'x'", '"y"', "'a\\'b'", "'\\\\'", "''", "'\\n'", "'%s'", "'%'"),
    *("Amount__c", "Title__c", "Flag__c", "Day__c", "Kind__c", "Name", "Id", "Nope__c"),
    *("Owner.Name", "Parent__r.Name", "$User.Id", "$Organization.Name", "$Label.X", "$Setup"),
    *("TRUE", "FALSE", "NULL", "IF(", "CASE(", "TEXT(", "VALUE(", "LEN(", "ABS(", "ISPICKVAL("),
    *("BLANKVALUE(", "DATE(", "TODAY()", "NOW()", "MID(", "SUBSTITUTE(", "REGEX(", "HYPERLINK("),
    *("(", ")", ",", "+", "-", "*", "/", "^", "&", "&&", "||", "!", "=", "==", "<>", "<", ">="),
    *(" ", "\n", "/*", "*/", ";", "--", "#", "`", "`x`", "\\", "'", '"', "$", ":", "."),
    *("SELECT 1", "DROP TABLE Gadget__c", "UNION SELECT", "' OR '1'='1", "0x41", "@nexus_user_id"),
]

formula_texts = st.one_of(
    st.text(max_size=80),
    st.lists(st.sampled_from(TOKENS), max_size=25).map(" ".join),
    st.lists(st.sampled_from(TOKENS), max_size=25).map("".join),
    st.builds(lambda n: "(" * n + "1" + ")" * n, st.integers(1, 3000)),
    st.builds(lambda n: "-" * n + "1", st.integers(1, 3000)),
    st.builds(lambda n: "ABS(" * n + "1" + ")" * n, st.integers(1, 1500)),
    st.builds(lambda n: "1" + " + 1" * n, st.integers(1, 1500)),
    st.builds(lambda n: "IF(TRUE, " * n + "1" + ", 0)" * n, st.integers(1, 800)),
    st.builds(lambda n: "'" + "\\" * n + "'", st.integers(0, 9)),
)
formula_types = st.sampled_from(
    [FieldType.Number, FieldType.Text, FieldType.Checkbox, FieldType.Date, FieldType.Percent]
)


def _formula_object(formula: str, type_: FieldType, referenced: bool) -> ObjectSpec:
    fields = [*FORMULA_OBJECT.fields, FieldSpec(api_name="F__c", type=type_, formula=formula)]
    if referenced:  # another formula reads it: the MySQL view stages it (a CTE)
        fields.append(FieldSpec(api_name="G__c", type=type_, formula="F__c"))
    return FORMULA_OBJECT.model_copy(update={"fields": tuple(fields)})


@settings(FUZZ, max_examples=100)
@given(formula=formula_texts, type_=formula_types, dialect=st.sampled_from(["sqlite", "mysql"]))
@example(formula="(" * 5000 + "1" + ")" * 5000, type_=FieldType.Number, dialect="mysql")
@example(formula="IF(TRUE, " * 2000 + "1" + ", 0)" * 2000, type_=FieldType.Text, dialect="sqlite")
@example(formula="-" * 5000 + "1", type_=FieldType.Number, dialect="sqlite")
def test_any_formula_text_compiles_or_is_a_formula_error(
    formula: str, type_: FieldType, dialect: str
) -> None:
    if not formula.strip():
        formula = formula + "0"
    obj = _formula_object(formula, type_, referenced=False)
    field = obj.fields[-1]
    table = object_table(obj, dialect)
    try:
        expr = compile_formula(obj, field, table, dialect)
    except FormulaError as exc:
        assert exc.field_api_name == "F__c" and exc.reason, exc
        assert str(exc).startswith("formula Gadget__c.F__c: ")
        return
    assert expr is not None


@FEW
@given(formula=formula_texts, type_=formula_types, dialect=st.sampled_from(["sqlite", "mysql"]))
@example(formula="(" * 5000 + "1" + ")" * 5000, type_=FieldType.Number, dialect="mysql")
@example(formula="-" * 3000 + "1", type_=FieldType.Number, dialect="mysql")
def test_a_view_over_any_formula_builds_and_names_what_it_leaves_out(
    formula: str, type_: FieldType, dialect: str
) -> None:
    """``build_view_select`` never raises (its contract): a formula that does not
    compile, and one referencing it, are left out with their reasons."""
    if not formula.strip():
        formula = formula + "0"
    obj = _formula_object(formula, type_, referenced=True)
    table = object_table(obj, dialect)
    select_, problems = build_view_select(obj, table, dialect)
    left_out = {p.field_api_name for p in problems}
    assert left_out <= {"F__c", "G__c"}, problems
    assert all(p.reason for p in problems)
    shown = {c.name for c in select_.selected_columns}
    assert {"F__c", "G__c"} - left_out <= shown


# Text a string literal may carry: SQL quoting, comments, backslashes, any script.
literal_texts = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
        st.sampled_from(["'", '"', "\\", "`", ";", "-", "/", "*", "#", "%", ":", "?", "\n"]),
    ),
    max_size=40,
)


def _formula_literal(value: str) -> str:
    """``value`` as a formula string literal (backslash escapes, as Salesforce writes)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _literal_view_sql(value: str, dialect: str) -> str:
    obj = FORMULA_OBJECT.model_copy(
        update={
            "fields": (
                *FORMULA_OBJECT.fields,
                FieldSpec(
                    api_name="F__c",
                    type=FieldType.Text,
                    formula=_formula_literal("<" + value + ">"),
                ),
            )
        }
    )
    expr = compile_formula(obj, obj.fields[-1], object_table(obj, dialect), dialect)
    sa_dialect: Any
    if dialect == "sqlite":
        from sqlalchemy.dialects import sqlite

        sa_dialect = sqlite.dialect()
    else:
        from sqlalchemy.dialects import mysql

        sa_dialect = mysql.dialect()
    return str(
        sa.select(expr.label("v")).compile(
            dialect=sa_dialect, compile_kwargs={"literal_binds": True}
        )
    )


@pytest.fixture(scope="module")
def mariadb() -> Iterator[Engine | None]:
    url = os.environ.get("NEXUS_TEST_MYSQL_URL")
    if not url:
        yield None
        return
    engine = make_engine(url)
    yield engine
    engine.dispose()


@FUZZ
@given(value=literal_texts)
@example(value="'); DROP TABLE Gadget__c; --")
@example(value="\\'; SELECT 1; -- \\")
@example(value="`x` %s %(a)s :name ?")
def test_a_string_literal_of_any_text_reaches_the_sql_escaped(
    value: str, mariadb: Engine | None
) -> None:
    """The compiled SQL, run as is, gives back exactly the literal's text: nothing of
    it was read as SQL (SQLite, and MariaDB when ``NEXUS_TEST_MYSQL_URL`` is set)."""
    sql = _literal_view_sql(value, "sqlite")
    lite = sqlite3.connect(":memory:")
    try:
        got = lite.execute(sql).fetchone()
    finally:
        lite.close()
    assert got == ("<" + value + ">",), (sql, got)
    if mariadb is not None:
        sql = _literal_view_sql(value, "mysql")
        with mariadb.connect() as conn:  # as CreateView runs: the driver sees no parameters
            row = conn.exec_driver_sql(sql).fetchone()
        assert tuple(row or ()) == ("<" + value + ">",), (sql, row)


# --------------------------------------------------------------------------------------
# (4) data plans and Salesforce DX metadata

GOOD_RECORDS = {
    "records": [
        {"attributes": {"type": "Account", "referenceId": "AccountRef1"}, "Name": "A"},
        {
            "attributes": {"type": "Account", "referenceId": "AccountRef2"},
            "Name": "B",
            "ParentId": "@AccountRef1",
        },
    ]
}
PLAN_KEYS = ["sobject", "files", "resolveRefs", "saveRefs"]
RECORD_KEYS = ["attributes", "type", "referenceId", "Name", "ParentId"]


@st.composite
def data_plans(draw: st.DrawFn) -> tuple[Any, Any]:
    """(plan, records document): valid ones with parts replaced by any JSON value."""
    plan: Any = [{"sobject": "Account", "resolveRefs": True, "files": ["records.json"]}]
    records: Any = json.loads(json.dumps(GOOD_RECORDS))
    where = draw(st.sampled_from(["plan", "entry", "records", "record", "attributes", "none"]))
    value = draw(json_values)
    if where == "plan":
        plan = value
    elif where == "entry":
        plan[0][draw(st.sampled_from(PLAN_KEYS))] = value
    elif where == "records":
        records = value if draw(st.booleans()) else {"records": value}
    elif where == "record":
        records["records"][draw(st.integers(0, 1))][draw(st.sampled_from(RECORD_KEYS))] = value
    elif where == "attributes":
        records["records"][draw(st.integers(0, 1))]["attributes"][
            draw(st.sampled_from(["type", "referenceId", "extra"]))
        ] = value
    return plan, records


def _check_plan(folder: Path, plan_path: Path) -> None:
    files = {str(p) for p in folder.rglob("*")}
    try:
        result = import_sfdx_plans([plan_path], installed_pack_id="pk-1", scope="fuzz")
    except DataPlanError as exc:
        message = str(exc)
        for path, _reason in getattr(exc, "problems", [(exc.pack, "")]):
            assert path in files, message
        assert message.startswith(("data file ", f"{len(getattr(exc, 'problems', ''))} problems"))
        return
    assert isinstance(result, PlanImport)
    for ev in result.events:  # accepted: strict JSON and within the columns
        json.dumps(ev.payload, allow_nan=False)
        assert len(ev.idempotency_key) <= 191 and len(ev.source_object) <= 128, ev


@FUZZ
@given(plan_records=data_plans())
@example(plan_records=([{"sobject": "Account", "files": ["x" * 300 + ".json"]}], GOOD_RECORDS))
@example(plan_records=([{"sobject": "Account", "files": ["a\x00.json"]}], GOOD_RECORDS))
@example(
    plan_records=(
        [{"sobject": "Account", "files": ["records.json"]}],
        {"records": [{"attributes": {"type": "Account", "referenceId": "R1"}, "Amount": math.nan}]},
    )
)
@example(
    plan_records=(
        [{"sobject": "A" * 300, "files": ["records.json"]}],
        {"records": [{"attributes": {"type": "A" * 300, "referenceId": "R" * 300}}]},
    )
)
def test_a_data_plan_with_any_values_imports_or_is_refused_naming_the_file(
    plan_records: tuple[Any, Any],
) -> None:
    plan, records = plan_records
    folder = _fresh()
    (folder / "records.json").write_text(json.dumps(records))
    plan_path = folder / "plan.json"
    plan_path.write_text(json.dumps(plan))
    _check_plan(folder, plan_path)


@FUZZ
@given(
    which=st.sampled_from(["plan", "records"]),
    cut=st.integers(0, 400),
    junk=st.binary(max_size=12),
    keep_tail=st.booleans(),
)
def test_a_truncated_or_mutated_data_file_is_refused_naming_it(
    which: str, cut: int, junk: bytes, keep_tail: bool
) -> None:
    folder = _fresh()
    plan = json.dumps(
        [{"sobject": "Account", "resolveRefs": True, "files": ["records.json"]}]
    ).encode()
    records = json.dumps(GOOD_RECORDS).encode()
    data = plan if which == "plan" else records
    data = data[:cut] + junk + (data[cut + len(junk) :] if keep_tail else b"")
    (folder / "plan.json").write_bytes(data if which == "plan" else plan)
    (folder / "records.json").write_bytes(data if which == "records" else records)
    _check_plan(folder, folder / "plan.json")


FIELD_XML = {
    "Size__c": "<label>Size</label><type>Number</type><precision>18</precision><scale>2</scale>",
    "Note__c": "<label>Note</label><type>Text</type><length>80</length>",
    "Twice__c": "<label>Twice</label><type>Number</type><formula>Size__c * 2</formula>",
}
XML_ELEMENTS = [
    "fullName",
    "label",
    "type",
    "length",
    "precision",
    "scale",
    "required",
    "unique",
    "externalId",
    "defaultValue",
    "referenceTo",
    "relationshipName",
    "formula",
    "summaryOperation",
    "valueSet",
    "deleteConstraint",
]
xml_texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "",
            "-1",
            "0",
            "99999999999999999999",
            "1" * 5000,
            "1e5",
            "NaN",
            "Lookup",
            "Summary",
            "Text",
            "Number",
            "true",
            "TRUE",
            "maybe",
            "Gadget__c",
            "Nope__c",
            "Account",
            "<![CDATA[x]]>",
            "&amp;",
            "&lt;x&gt;",
            "(((1)))",
            "Size__c /",
            "x__b",
        ]
    ),
)


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _check_sfdx(root: Path) -> None:
    files = {str(p) for p in root.rglob("*")} | {str(root)}
    try:
        pack = load_sfdx(root)
    except PackProblems as exc:
        assert exc.problems
        for problem in exc.problems:
            assert problem.file in files, (problem, sorted(files))
            assert problem.message.strip(), problem
        return
    assert isinstance(pack, PackManifest)


@FUZZ
@given(
    target=st.sampled_from([*FIELD_XML, "object"]),
    mutation=st.sampled_from(["element", "truncate", "splice", "raw-element"]),
    element=st.sampled_from(XML_ELEMENTS),
    text=xml_texts,
    cut=st.integers(0, 600),
    junk=st.binary(max_size=16),
)
@example(
    target="Size__c", mutation="element", element="precision", text="1" * 5000, cut=0, junk=b""
)
@example(
    target="object",
    mutation="splice",
    element="label",
    text="",
    cut=40,
    junk=b'<!DOCTYPE x [<!ENTITY a "b">]>',
)
def test_truncated_or_mutated_sfdx_metadata_is_refused_naming_the_file(
    target: str, mutation: str, element: str, text: str, cut: int, junk: bytes
) -> None:
    root = write_sfdx(_fresh() / "app", FIELD_XML)
    base = root / "force-app" / "main" / "default" / "objects" / "Gadget__c"
    path = (
        base / "Gadget__c.object-meta.xml"
        if target == "object"
        else base / "fields" / f"{target}.field-meta.xml"
    )
    data = path.read_bytes()
    if mutation == "element":
        tag = f"<{element}>{_xml_escape(text)}</{element}>".encode("utf-8", "surrogatepass")
        data = re.sub(rb"<%s>.*?</%s>" % (element.encode(), element.encode()), b"", data)
        data = data.replace(b"</Custom", tag + b"</Custom", 1)
    elif mutation == "raw-element":
        data = data.replace(b"</Custom", text.encode("utf-8", "surrogatepass") + b"</Custom", 1)
    elif mutation == "truncate":
        data = data[:cut]
    else:
        data = data[:cut] + junk + data[cut:]
    path.write_bytes(data)
    _check_sfdx(root)


@FUZZ
@given(
    project=st.one_of(
        json_values,
        st.fixed_dictionaries(
            {},
            optional={
                "name": json_values,
                "namespace": json_values,
                "packageDirectories": st.one_of(
                    json_values,
                    st.lists(st.fixed_dictionaries({"path": json_values}), max_size=3),
                    st.lists(
                        st.fixed_dictionaries(
                            {
                                "path": st.sampled_from(
                                    [
                                        "force-app",
                                        "..",
                                        "/",
                                        "x\x00",
                                        "a" * 300,
                                        "force-app/../force-app",
                                        " ",
                                    ]
                                )
                            }
                        ),
                        max_size=2,
                    ),
                ),
                "plugins": st.one_of(
                    json_values,
                    st.fixed_dictionaries(
                        {"nexusctl": st.fixed_dictionaries({"dependsOn": json_values})}
                    ),
                ),
            },
        ),
    )
)
@example(project={"packageDirectories": [{"path": "force-app\x00"}]})
@example(project={"plugins": [1]})
@example(project={"packageDirectories": [{"path": "p" * 300}]})
@example(project={"name": "x", "plugins": {"nexusctl": {"dependsOn": [None, 1, "Bad Name"]}}})
def test_any_sfdx_project_json_loads_or_is_refused_naming_it(project: Any) -> None:
    root = write_sfdx(_fresh() / "app", FIELD_XML)
    (root / "sfdx-project.json").write_text(json.dumps(project))
    _check_sfdx(root)


def test_sfdx_project_json_with_a_huge_number_is_refused_naming_it(workdir: Path) -> None:
    """Found by the properties: a number of more than 4,300 digits in
    ``sfdx-project.json`` (or a candidate file) ended in a ``ValueError`` traceback."""
    root = write_sfdx(workdir / "app", FIELD_XML)
    (root / "sfdx-project.json").write_text('{"name": "app", "x": ' + "7" * 5000 + "}")
    with pytest.raises(PackProblems) as info:
        load_sfdx(root)
    (problem,) = info.value.problems
    assert problem.file == str(root / "sfdx-project.json")
    assert "more than 4,300 digits" in problem.message


# --------------------------------------------------------------------------------------
# end to end through the CLI, on a fresh SQLite database


def _crashed(res: Any) -> bool:
    return res.exception is not None and not isinstance(res.exception, SystemExit)


def _one_error_line(res: Any) -> str:
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, res.output
    return errors[0]


@pytest.fixture
def sqlite_settings(tmp_path: Path) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'nexus.db'}",
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        env="development",
        NEXUS_DATABASE_ID=f"fuzz-{uuid.uuid4().hex[:8]}",
    )


def _counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        events = conn.execute(select(func.count()).select_from(t.connector_event)).scalar_one()
        items = conn.execute(select(func.count()).select_from(t.connector_work_item)).scalar_one()
    return int(events), int(items)


def test_cli_import_sfdx_refuses_hostile_project_files_and_creates_no_database(
    sqlite_settings: Settings, tmp_path: Path
) -> None:
    db_file = Path(sqlite_settings.database_url.removeprefix("sqlite:///"))
    cases = {
        "nul-path": '{"packageDirectories": [{"path": "force-app\\u0000"}]}',
        "long-path": '{"packageDirectories": [{"path": "' + "p" * 300 + '"}]}',
        "huge-number": '{"name": "app", "x": ' + "7" * 5000 + "}",
    }
    for name, text in cases.items():
        root = write_sfdx(tmp_path / name, FIELD_XML)
        (root / "sfdx-project.json").write_text(text)
        res = invoke(["packs", "import-sfdx", str(root)], cli_env(sqlite_settings))
        _one_error_line(res)  # then the problems, grouped by file
        assert f"{root / 'sfdx-project.json'}:\n  - " in res.output, (name, res.output)
        assert "packageDirectories[0].path" in res.output or "4,300 digits" in res.output
    assert not db_file.exists()  # nothing created, let alone written


async def test_cli_refuses_hostile_event_and_plan_files_whole(
    temporal_env: Any, sqlite_settings: Settings, tmp_path: Path
) -> None:
    await install(temporal_env, sqlite_settings, [str(SF_SYNC)])
    engine = make_engine(sqlite_settings.database_url)
    env = cli_env(sqlite_settings, temporal_env)
    # 600 good events (more than one enqueue batch of 500) and then a NaN
    events = tmp_path / "events.jsonl"
    rows = [json.dumps(_good_event(i)) for i in range(600)]
    rows.append(json.dumps(_good_event(600)).replace('"F 600"', "NaN"))
    events.write_text("\n".join(rows) + "\n")
    res = await invoke_async(["events", "enqueue", str(events)], env)
    line = _one_error_line(res)
    assert f"{events}:601: invalid JSON: payload.fields.Name: NaN is not a JSON number" in line
    assert _counts(engine) == (0, 0)
    # a plan naming a data file whose name is too long for the file system
    plan = tmp_path / "plan.json"
    (tmp_path / "records.json").write_text(json.dumps(GOOD_RECORDS))
    plan.write_text(
        json.dumps([{"sobject": "Account", "files": ["records.json"]},
                    {"sobject": "Account", "files": ["x" * 300 + ".json"]}])
    )  # fmt: skip
    res = await invoke_async(["events", "import-sfdx-data", str(plan)], env)
    line = _one_error_line(res)
    assert f"data file {plan}: entry 1 (Account): file 'xxx" in line, line
    assert "File name too long" in line, line
    assert _counts(engine) == (0, 0)
    # a record whose type and referenceId make an event key over 191 characters
    records = tmp_path / "long.json"
    long_ref = {"attributes": {"type": "Account", "referenceId": "R" * 200}, "Name": "L"}
    records.write_text(json.dumps({"records": [*GOOD_RECORDS["records"], long_ref]}))
    plan.write_text(
        json.dumps([{"sobject": "Account", "files": ["long.json"], "resolveRefs": True}])
    )
    res = await invoke_async(["events", "import-sfdx-data", str(plan)], env)
    line = _one_error_line(res)
    assert f"data file {records}: record 2 (RRR" in line and "over the limit of 191" in line, line
    assert _counts(engine) == (0, 0)
    engine.dispose()
