"""Salesforce DX data plans as a user writes them (issue 13 items 10 and 11).

- a dangling ``@ref`` refuses only the records that use it (class
  ``unresolvable-reference``), the rest are enqueued; an ``@ref`` in a
  ``resolveRefs: false`` entry is refused at once instead of blocking;
- a changed record, re-imported, applies (its key carries a content digest);
- two projects whose referenceIds collide both land (keys and remote ids are
  scoped by project);
- field keys are case-insensitive, ISO datetimes fill Date fields and numbers
  written as strings fill Number fields;
- data-file errors say "data file", never "pack";
- ``demo-sync`` finds every plan of a project, in file-name order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from rich.console import Console
from sqlalchemy import select, text
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.connectors.importer import (
    MISSING_DATA_FILE,
    UNRESOLVABLE_REFERENCE,
    DataPlanError,
    import_sfdx_plans,
    project_plans,
)
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import PhaseReport
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.cli.events import report_refused
from nexusctl.cli.render import clip, phase_table
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker, build_worker
from tests.builders import (
    SF_SYNC,
    cli_env,
    connector_settings,
    corpus_project,
    fast_fleet,
    install,
    invoke,
    invoke_async,
    wait_drained,
)


def rec(type_: str, ref: str, **fields: Any) -> dict[str, Any]:
    return {"attributes": {"type": type_, "referenceId": ref}, **fields}


def write_project(root: Path, name: str, files: dict[str, list[dict[str, Any]]],
                  plan: list[dict[str, Any]]) -> Path:  # fmt: skip
    """``root/name/data/``: the data files and ``data-plan.json``; returns the plan."""
    data = root / name / "data"
    data.mkdir(parents=True, exist_ok=True)
    for file_name, records in files.items():
        (data / file_name).write_text(json.dumps({"records": records}))
    (data / "data-plan.json").write_text(json.dumps(plan))
    return data / "data-plan.json"


PLAN = [
    {"sobject": "Parent__c", "saveRefs": True, "files": ["parents.json"]},
    {"sobject": "Child__c", "resolveRefs": True, "files": ["children.json"]},
]


def test_refused_records_and_keys(tmp_path: Path) -> None:
    plan = write_project(
        tmp_path, "a",
        {
            "parents.json": [rec("Parent__c", "P1", Name="One")],
            "children.json": [
                rec("Child__c", "C1", Name="ok", Parent__c="@P1"),
                rec("Child__c", "C2", Name="dangling", Parent__c="@P9"),
            ],
            "later.json": [rec("Note__c", "N1", Name="x", Parent__c="@P1", Handle__c="@me")],
        },
        [*PLAN, {"sobject": "Note__c", "resolveRefs": False, "files": ["later.json"]}],
    )  # fmt: skip
    result = import_sfdx_plans([plan], installed_pack_id="p", scope="a")
    assert [e.source_id for e in result.events] == ["a.P1", "a.C1"]
    assert result.events[1].payload["references"] == {"Parent__c": "a.P1"}
    refused = {r.reference_id: r for r in result.refused}
    assert set(refused) == {"C2", "N1"}
    assert {r.failure_class for r in refused.values()} == {UNRESOLVABLE_REFERENCE}
    assert "@P9" in refused["C2"].reason and "children.json" in str(refused["C2"])
    assert "resolveRefs" in refused["N1"].reason
    # A changed record is a new event (same lane); an unchanged one the same key.
    again = import_sfdx_plans([plan], installed_pack_id="p", scope="a")
    assert [e.idempotency_key for e in again.events] == [e.idempotency_key for e in result.events]
    children = json.loads((plan.parent / "children.json").read_text())
    children["records"][0]["Name"] = "changed"
    (plan.parent / "children.json").write_text(json.dumps(children))
    changed = import_sfdx_plans([plan], installed_pack_id="p", scope="a")
    assert changed.events[0].idempotency_key == result.events[0].idempotency_key
    assert changed.events[1].idempotency_key != result.events[1].idempotency_key
    assert changed.events[1].source_id == result.events[1].source_id


def test_data_file_errors_say_data_file(tmp_path: Path) -> None:
    plan = write_project(tmp_path, "a", {}, [{"sobject": "A", "files": ["bad.json"]}])
    (plan.parent / "bad.json").write_text("{not json")
    with pytest.raises(DataPlanError) as info:
        import_sfdx_plans([plan], installed_pack_id="p")
    message = str(info.value)
    assert message.startswith("data file ") and "bad.json" in message, message
    assert "pack" not in message, message


def _parents_missing(tmp_path: Path) -> Path:
    """A plan whose parents.json does not exist; children.json has C1 (a child of
    P1) and C2."""
    return write_project(
        tmp_path, "a",
        {"children.json": [rec("Child__c", "C1", Parent__c="@P1"), rec("Child__c", "C2")]},
        PLAN,
    )  # fmt: skip


def test_missing_data_file_refuses_its_records_only(tmp_path: Path) -> None:
    result = import_sfdx_plans([_parents_missing(tmp_path)], installed_pack_id="p")
    assert [e.source_id for e in result.events] == ["C2"]
    assert [(r.failure_class, r.file.name) for r in result.refused] == [
        (MISSING_DATA_FILE, "parents.json"),
        (UNRESOLVABLE_REFERENCE, "children.json"),
    ]


def test_a_missing_data_file_is_named_with_the_other_problems(tmp_path: Path) -> None:
    """A truncated file and a missing one: both named at once (the missing one
    showed only after the JSON was mended, a new user's trial)."""
    plan = write_project(tmp_path, "a", {}, PLAN)
    (plan.parent / "children.json").write_text('{"records": [{"attributes": ')
    with pytest.raises(DataPlanError) as info:
        import_sfdx_plans([plan], installed_pack_id="p")
    message = str(info.value)
    assert "children.json" in message and "parents.json" in message, message
    assert MISSING_DATA_FILE in message, message


def test_refused_count_says_a_missing_file_is_every_record_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = import_sfdx_plans([_parents_missing(tmp_path)], installed_pack_id="p")
    with pytest.raises(typer.Exit):
        report_refused(result.refused)
    out = capsys.readouterr()
    text_out = out.out + out.err
    assert "1 record(s) and every record of 1 missing data file(s) refused" in text_out, text_out
    with pytest.raises(typer.Exit):
        report_refused(result.refused[:1])
    out = capsys.readouterr()
    assert "every record of 1 missing data file(s) refused" in out.out + out.err
    assert "record(s) and" not in out.out + out.err


def test_every_corpus_plan_imports_whole() -> None:
    for name in ("apex-recipes", "dreamhouse-lwc", "ebikes-lwc", "lwc-recipes"):
        plans = project_plans(corpus_project(name))
        result = import_sfdx_plans(plans, installed_pack_id="p", scope=name)
        assert result.refused == [] and result.events, name


def test_project_plans_in_file_name_order() -> None:
    plans = project_plans(corpus_project("apex-recipes"))
    assert [p.name for p in plans] == ["data-plan.json", "data-plan2.json"]
    assert [p.name for p in project_plans(corpus_project("dreamhouse-lwc"))] == [
        "sample-data-plan.json"
    ]


def write_app(path: Path) -> Path:
    doc = {
        "name": "plans-app",
        "category": "AppPack",
        "depends_on": ["platform-core"],
        "objects": [
            {"api_name": "Parent__c", "label": "Parent"},
            {
                "api_name": "Child__c",
                "label": "Child",
                "fields": [
                    {"api_name": "Parent__c", "type": "Lookup", "reference_to": "Parent__c"},
                    {"api_name": "Amount__c", "type": "Number", "precision": 18, "scale": 2},
                    {"api_name": "Day__c", "type": "Date"},
                ],
            },
        ],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_plans_sync_through_the_runtime(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(write_app(tmp_path / "app.yaml")), str(SF_SYNC)])
    child = {"Name": "kid", "parent__C": "@P1", "AMOUNT__c": "12.50",
             "day__c": "2024-03-01T10:00:00.000+0000"}  # fmt: skip
    plans = [
        write_project(
            tmp_path,
            name,
            {
                "parents.json": [rec("Parent__c", "P1", Name=f"{name} parent")],
                "children.json": [
                    rec("Child__c", "C1", **child),
                    rec("Child__c", "C2", Name="orphan", Parent__c="@Nope"),
                ],
            },
            PLAN,
        )
        for name in ("alpha", "beta")
    ]
    env = cli_env(settings, temporal_env)
    engine = make_engine(settings.database_url)
    try:
        (pack,) = list_connector_packs(engine)

        async def sync(plan: Path) -> str:
            result = await invoke_async(["events", "import-sfdx-data", str(plan)], env)
            # The dangling record is refused (exit 1), the rest enqueued.
            assert result.exit_code == 1, result.output
            assert "1 record(s) refused" in result.output and "@Nope" in result.output
            assert UNRESOLVABLE_REFERENCE in result.output
            return result.output

        for plan in plans:
            await sync(plan)
        catalog.CACHE.invalidate()
        async with (
            build_worker(temporal_env.client, settings),
            build_connector_worker(temporal_env.client, settings),
        ):
            fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
            states = await wait_drained(engine)
            assert states == {"succeeded": 4}, states
            # Change alpha's child and import again: the new value applies.
            data = plans[0].parent / "children.json"
            doc = json.loads(data.read_text())
            doc["records"][0]["AMOUNT__c"] = "99"
            data.write_text(json.dumps(doc))
            await sync(plans[0])
            states = await wait_drained(engine)
            assert states == {"succeeded": 5}, states
            await fleet.signal("stop")
            await fleet.result()
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT c.Name, c.Amount__c, c.Day__c, p.Name AS parent "
                    "FROM Child__c c JOIN Parent__c p ON p.Id = c.Parent__c ORDER BY p.Name"
                )
            ).all()
        assert [(r[0], float(r[1]), str(r[2])[:10], r[3]) for r in rows] == [
            ("kid", 99.0, "2024-03-01", "alpha parent"),
            ("kid", 12.5, "2024-03-01", "beta parent"),
        ]
        assert pack.namespace
    finally:
        engine.dispose()


def test_phase_details_are_not_cut_mid_word() -> None:
    detail = " ".join(f"Object{i}__c.Formula{i}__c: unsupported function" for i in range(12))
    assert len(detail) > 160
    out = Console(width=4000, record=True)
    out.print(phase_table([PhaseReport(name="rebuild-derived", detail=detail)], "t"))
    assert detail in out.export_text()
    long = clip("word " * 1000)
    assert long.endswith("word ...") and len(long) <= 2000


def test_demo_sync_names_the_plans_it_lacks(tmp_path: Path, settings: Settings) -> None:
    project = tmp_path / "bare"
    (project / "data").mkdir(parents=True)
    result = invoke(["demo-sync", str(project)], cli_env(settings))
    assert result.exit_code == 1 and "has no data plan" in result.output, result.output
    assert "--plan" in result.output
    result = invoke(
        ["demo-sync", str(project), "--plan", str(tmp_path / "x.json")], cli_env(settings)
    )
    assert result.exit_code == 1 and "x.json not found" in result.output, result.output


def write_value_app(path: Path) -> Path:
    doc = {
        "name": "values-app",
        "category": "AppPack",
        "depends_on": ["platform-core"],
        "objects": [
            {
                "api_name": "Broker__c",
                "label": "Broker",
                "fields": [
                    {"api_name": "Title__c", "type": "Text", "length": 50},
                    {"api_name": "Score__c", "type": "Number", "precision": 2, "scale": 0},
                    {"api_name": "Amount__c", "type": "Number", "precision": 18, "scale": 2},
                    {"api_name": "Notes__c", "type": "LongTextArea", "length": 500},
                    {"api_name": "Boss__c", "type": "Lookup", "reference_to": "Broker__c"},
                    {
                        "api_name": "Stage__c",
                        "type": "Picklist",
                        "restricted": True,
                        "picklist_values": ["Open", "Won"],
                    },
                    {
                        "api_name": "Tags__c",
                        "type": "MultiselectPicklist",
                        "restricted": True,
                        "picklist_values": ["a", "b", "c"],
                    },
                ],
            },
        ],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "object": ({"Name": {"a": 1}}, "Broker__c.Name: value is an object"),
    "list": ({"Title__c": ["a"]}, "Broker__c.Title__c: value is a list"),
    "too long": ({"Title__c": "x" * 80}, "Broker__c.Title__c: value has 80 characters"),
    "precision": ({"Score__c": 123456789}, "Broker__c.Score__c: value 123456789 is out of range"),
    "huge": ({"Amount__c": 1e300}, "Broker__c.Amount__c: value 1e+300 is out of range"),
    "long text": ({"Notes__c": "n" * 1000}, "Broker__c.Notes__c: value has 1,000 characters"),
    "restricted": (
        {"Stage__c": "Lost"},
        "Broker__c.Stage__c: value 'Lost' is not a value of this restricted picklist",
    ),
    "restricted case": (  # exact, as Salesforce's API
        {"Stage__c": "open"},
        "Broker__c.Stage__c: value 'open' is not a value of this restricted picklist",
    ),
    "restricted multi": (
        {"Tags__c": "a;zz"},
        "Broker__c.Tags__c: value 'zz' is not a value of this restricted picklist",
    ),
    # Fails at once, never blocked first on a parent that is not linked.
    "and a parent": (
        {"Boss__c": "nobody", "Title__c": "x" * 81},
        "Broker__c.Title__c: value has 81 characters",
    ),
}


async def test_values_that_do_not_fit_are_refused_at_import_and_fail_their_item_alone(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    """SQLite stores anything and MariaDB refuses (1406, 1264): both refuse at
    import naming file, record and field, and the flow fails each bad item
    alone (``value-invalid``), its batch-mates applied, never a driver error."""
    from nexuscrm.connectors import queue
    from nexuscrm.connectors.flows import VALUE_INVALID
    from nexuscrm.db import tables as t
    from tests.builders import record_upsert, work_states

    settings = connector_settings(settings)
    await install(
        temporal_env, settings, [str(write_value_app(tmp_path / "app.yaml")), str(SF_SYNC)]
    )
    env = cli_env(settings, temporal_env)
    engine = make_engine(settings.database_url)
    try:
        records = [
            rec("Broker__c", f"B{i}", **fields)
            for i, (fields, _m) in enumerate(BAD_VALUES.values())
        ]
        ok = rec("Broker__c", "ok", Name="fine", Stage__c="Won", Tags__c="a;c")
        files = {"brokers.json": [ok, *records]}
        plan = write_project(tmp_path, "v", files, [{"sobject": "Broker__c", "files": [*files]}])
        res = await invoke_async(["events", "import-sfdx-data", str(plan)], env)
        output = " ".join(res.output.split())
        assert res.exit_code == 1, res.output
        assert "Traceback" not in output and "nothing enqueued" in output, output
        for i, (_fields, message) in enumerate(BAD_VALUES.values()):
            field = message.split(":")[0].split(".")[1]
            assert f"brokers.json: record {i + 1} (B{i}): field {field}: value" in output, output
        assert work_states(engine) == {}
        # Past the importer (events enqueue, another program): each bad item fails alone.
        (pack,) = list_connector_packs(engine)
        good = {"Name": "ok", "Stage__c": "Won", "Tags__c": "a;c"}
        reqs = [record_upsert(pack.install_id, pack.namespace, "Broker__c", "ok", good)]
        reqs += [
            record_upsert(pack.install_id, pack.namespace, "Broker__c", name.replace(" ", "-"), f)
            for name, (f, _m) in BAD_VALUES.items()
        ]
        queue.enqueue(engine, reqs)
        catalog.CACHE.invalidate()
        async with (
            build_worker(temporal_env.client, settings),
            build_connector_worker(temporal_env.client, settings),
        ):
            fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
            states = await wait_drained(engine)
            await fleet.signal("stop")
            await fleet.result()
        assert states == {"succeeded": 1, "failed": len(BAD_VALUES)}, states
        w = t.connector_work_item
        with engine.connect() as conn:
            failed = conn.execute(
                select(w.c.FailureClass, w.c.FailureSummary, w.c.Attempt).where(
                    w.c.State == "failed"
                )
            ).all()
        assert {r[0] for r in failed} == {VALUE_INVALID}, failed
        summaries = " | ".join(str(r[1]) for r in failed)
        for _fields, message in BAD_VALUES.values():
            assert message in summaries, summaries
        assert all(r[2] == 1 for r in failed), failed  # at once, never retried
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT Name, Stage__c, Tags__c FROM Broker__c")).all()
            assert [tuple(r) for r in stored] == [("ok", "Won", "a;c")]
    finally:
        engine.dispose()


def test_demo_sync_progress_reads_as_counts_not_a_dict() -> None:
    """The progress line printed a Python dict (``{'pending': 3, ...}``); it reads
    ``sync: pending 3, blocked 2, succeeded 10 (2.5 s)``, zeros left out."""
    from nexusctl.cli.dev import sync_line

    line = sync_line({"succeeded": 10, "pending": 3, "blocked": 2, "failed": 0}, 2.46)
    assert line == "sync: pending 3, blocked 2, succeeded 10 (2.5 s)"
    assert sync_line({}, 0) == "sync: nothing queued (0.0 s)"
    assert "{" not in sync_line({"odd": 1, "pending": 1}, 1) and "odd 1" in sync_line({"odd": 1}, 1)
