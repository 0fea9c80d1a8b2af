"""Every corpus Salesforce DX project installs unedited (issue 13, items 1-5).

One ApplyAll (and one converged re-run) per project per backend, on the real
Temporal dev server; ``import-sfdx`` agrees with plan-packs; hostile projects
report every problem at once, grouped by file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select
from temporalio.client import WorkflowFailureError

from nexuscrm import catalog
from nexuscrm.controlplane.packs_records import record_id
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import PackProblems
from nexuscrm.packs.loader import load_pack_source
from tests.builders import apply_all, cli_env, corpus_project, invoke, snapshot, write_sfdx

PROJECTS = [
    "apex-recipes",
    "dreamhouse-lwc",
    "ebikes-lwc",
    "eda",
    "k12-architecture-kit",
    "lwc-recipes",
    "project-management-tool",
]


def _summary_rows(output: str) -> dict[str, list[str]]:
    """``object -> [kind, fields, customized, records, formulas]`` from the table."""
    return {
        cells[0]: cells[1:]
        for line in output.splitlines()
        if (cells := [c.strip() for c in line.split("│")[1:-1]]) and cells[0] != "object"
    }


@pytest.mark.parametrize("project", PROJECTS)
async def test_corpus_project_installs_unedited(temporal_env, settings, project, capsys):
    src = corpus_project(project)
    # The dry run (fresh database: platform packs only) lists what it will install.
    dry = invoke(["packs", "import-sfdx", str(src)], cli_env(settings))
    assert dry.exit_code == 0, dry.output
    rows = _summary_rows(dry.output)
    pack = load_pack_source(src)
    assert set(rows) == {o.api_name for o in pack.objects}

    started = time.monotonic()
    result = await apply_all(temporal_env, settings, app_pack_sources=[str(src)])
    fresh = time.monotonic() - started
    assert result.status == "completed"

    engine = make_engine(settings.database_url)
    catalog.CACHE.invalidate()
    tables = {n.lower() for n in inspect(engine).get_table_names()}
    with engine.connect() as conn:
        status = conn.execute(
            select(t.installed_pack.c.Status).where(t.installed_pack.c.Name == pack.name)
        ).scalar_one()
        owned_objects = conn.execute(
            select(func.count()).where(t.object_meta.c.PackName == pack.name)
        ).scalar_one()
        owned_fields = conn.execute(
            select(func.count()).where(t.field_meta.c.PackName == pack.name)
        ).scalar_one()
    assert status == "active"
    # What import-sfdx said agrees with what ApplyAll installed.
    listed_fields = 0
    for name, (kind, fields, _customized, records, _formulas) in rows.items():
        listed_fields += int(fields)
        if kind != "event":
            assert name.lower() in tables, name
        entry = catalog.CACHE.get(engine).get(name)
        assert entry is not None, name
        if kind.startswith(("table", "stand-in", "custom metadata")):
            assert entry.pack_name == pack.name, name
        if int(records):
            obj = next(o for o in pack.objects if o.api_name == name)
            with engine.connect() as conn:
                tbl = catalog.object_table(entry.spec(), "sqlite")
                ids = set(conn.execute(select(tbl.c.Id)).scalars())
            assert {record_id(name, r.developer_name) for r in obj.records} <= ids
    assert owned_fields == listed_fields

    # A second ApplyAll (sources from the stored payload) writes nothing.
    before = snapshot(engine)
    catalog.CACHE.invalidate()
    started = time.monotonic()
    again = await apply_all(temporal_env, settings)
    converged = time.monotonic() - started
    assert again.status == "completed"
    detail = next(p.detail or "" for p in again.phases if p.name == "apply-packs")
    assert "tables created 0, columns added 0, rows 0" in detail
    assert snapshot(engine) == before
    backend = settings.database_url.split(":", 1)[0]
    with capsys.disabled():
        print(
            f"\n[corpus] {project} {backend}: objects {owned_objects} fields {owned_fields} "
            f"problems 0 applyall {fresh:.1f}s converged {converged:.1f}s"
        )


def _hostile_project(root: Path) -> Path:
    """Three problems in three files: an unknown type, a big object, a dangling lookup."""
    src = write_sfdx(
        root,
        {"Weird__c": "<label>Weird</label><type>Hologram</type>",
         "Owner__c": "<label>O</label><type>Lookup</type><referenceTo>Nowhere__c</referenceTo>",
         "Size__c": "<label>Size</label><type>Number</type><precision>5</precision>"},
        project="hostile-app",
    )  # fmt: skip
    big = src / "force-app" / "main" / "default" / "objects" / "Archive__b" / "fields"
    big.mkdir(parents=True)
    (big / "When__c.field-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
        "<fullName>When__c</fullName><type>DateTime</type></CustomField>"
    )
    return src


def _expect_all_three(text: str) -> None:
    assert "Weird__c.field-meta.xml" in text and "Hologram" in text, text
    assert "Archive__b" in text and "big objects" in text, text
    assert "Owner__c.field-meta.xml" in text and "Nowhere__c" in text, text
    assert "3 problem(s) in 3 file(s)" in text, text


def test_hostile_project_gives_every_problem_by_file(tmp_path: Path) -> None:
    src = _hostile_project(tmp_path / "hostile")
    with pytest.raises(PackProblems) as info:
        load_pack_source(src)
    # The loader alone sees the two file problems; the partial pack is kept.
    assert {Path(p.file).name for p in info.value.problems} == {
        "Weird__c.field-meta.xml",
        "Archive__b",
    }
    assert info.value.partial is not None
    result = invoke(["packs", "import-sfdx", str(src)], cli_env())
    assert result.exit_code == 1, result.output
    _expect_all_three(result.output)
    lines = result.output.splitlines()
    # Grouped: each file line is followed by its problems.
    heads = [i for i, line in enumerate(lines) if line.endswith(":") and "/" in line]
    assert len(heads) == 3, result.output
    assert all(lines[i + 1].startswith("  - ") for i in heads)


async def test_hostile_project_fails_plan_packs_with_every_problem(
    temporal_env, settings, tmp_path
):
    src = _hostile_project(tmp_path / "hostile")
    with pytest.raises(WorkflowFailureError) as info:
        await apply_all(temporal_env, settings, app_pack_sources=[str(src)])
    _expect_all_three(str(info.value.cause))


def test_standard_field_customization_and_typeless_unknown(tmp_path: Path) -> None:
    """A typeless standard field the platform does not ship is a problem; one the
    platform ships merges (no conflict), with or without its implied target."""
    root = tmp_path / "custom"
    base = root / "force-app" / "objects" / "Contact" / "fields"
    base.mkdir(parents=True)
    head = '<?xml version="1.0"?><CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
    (base / "AccountId.field-meta.xml").write_text(
        f"{head}<fullName>AccountId</fullName><type>Lookup</type>"
        "<referenceTo>Account</referenceTo><label>Company</label></CustomField>"
    )
    (base / "Email.field-meta.xml").write_text(f"{head}<fullName>Email</fullName></CustomField>")
    (base / "Zodiac.field-meta.xml").write_text(f"{head}<fullName>Zodiac</fullName></CustomField>")
    result = invoke(["packs", "import-sfdx", str(root)], cli_env())
    assert result.exit_code == 1, result.output
    assert "1 problem(s) in 1 file(s)" in result.output
    assert "Zodiac.field-meta.xml" in result.output and "Contact.Zodiac" in result.output
    assert "already owned" not in result.output
