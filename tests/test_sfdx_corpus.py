"""Every corpus Salesforce DX project installs unedited (issue 13, items 1-5).

One ApplyAll (and one converged re-run) per project per backend, on the real
Temporal dev server; ``import-sfdx`` agrees with plan-packs; hostile projects
report every problem at once, grouped by file.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, inspect, select
from temporalio.client import WorkflowFailureError

from nexuscrm import catalog
from nexuscrm.controlplane import packs_apply
from nexuscrm.controlplane.packs_plan import plan_problems
from nexuscrm.controlplane.packs_records import record_id
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import PackProblems
from nexuscrm.packs.loader import load_pack_source
from tests.builders import (
    CORPUS_PROJECTS,
    apply_all,
    cli_env,
    corpus_project,
    install_whole_corpus,
    invoke,
    snapshot,
    write_sfdx,
)

PROJECTS = CORPUS_PROJECTS


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
    _project_checks(project, engine)

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


async def test_all_corpus_projects_on_one_sqlite_database(temporal_env, tmp_path):
    """All seven projects, unedited, in one ApplyAll on SQLite; every view reads;
    a second ApplyAll writes nothing. (MariaDB, on every collation:
    ``tests/faults/test_database_defaults.py``.)"""
    from nexuscrm.settings import Settings

    db = Settings(
        database_url=f"sqlite:///{tmp_path / 'all.db'}",
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        env="development",
        NEXUS_DATABASE_ID=f"test-{uuid.uuid4().hex[:8]}",
    )
    views = await install_whole_corpus(temporal_env, db)
    assert len(views) >= len(PROJECTS)


def _row(engine: Engine, table: str, row_id: str) -> dict[str, Any]:
    entry = catalog.CACHE.get(engine).get(table)
    assert entry is not None, table
    tbl = catalog.object_table(entry.spec(), "sqlite")
    with engine.connect() as conn:
        row = conn.execute(select(tbl).where(tbl.c.Id == row_id)).mappings().one()
    return dict(row)


def _field_row(engine: Engine, obj: str, fld: str) -> dict[str, Any]:
    with engine.connect() as conn:
        row = (
            conn.execute(
                select(t.field_meta).where(t.field_meta.c.Id == catalog.field_id(obj, fld))
            )
            .mappings()
            .one()
        )
    return dict(row)


def _project_checks(project: str, engine: Engine) -> None:
    """What each project exercises: records as rows, merges, stand-ins, aliases."""
    if project == "apex-recipes":  # __mdt records; MetadataRelationship as API name text
        mdt = "Metadata_Driven_Trigger__mdt"
        row = _row(engine, mdt,
                   record_id(mdt, "MDTAccountTriggerHandler"))  # fmt: skip
        assert row["Object__c"] == "Account" and row["DeveloperName"] == "MDTAccountTriggerHandler"
        assert bool(row["Enabled__c"]) and float(row["Execution_Order__c"]) == 2
    if project == "project-management-tool":
        row = _row(engine, "PMT_Setting__mdt", record_id("PMT_Setting__mdt", "Default"))
        assert row["Holidays__c"] == "Sat;Sun" and bool(row["Allocation_Trigger_Status__c"])
    if project == "lwc-recipes":  # standard fields merge into platform-core's
        account = _field_row(engine, "Contact", "AccountId")
        assert account["PackName"] == "platform-core" and account["ReferenceTo"] == "Account"
        assert _field_row(engine, "Contact", "Jigsaw")["PackName"] == "platform-core"
    if project == "k12-architecture-kit":  # objects of package hed: stand-ins
        cat = catalog.CACHE.get(engine)
        for name in ("hed__Attribute__c", "hed__Term__c", "hed__Education_History__c"):
            entry = cat.get(name)
            assert entry is not None and entry.pack_name == "k12-architecture-kit", name
        attribute = cat.get("hed__Attribute__c")
        assert attribute is not None
        assert "Grade_Level__c" in {f.api_name for f in attribute.fields}
    if project == "eda":  # EncryptedText is stored as Text
        assert _field_row(engine, "Contact", "Social_Security_Number__c")["FieldType"] == "Text"


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


def _field_file(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.field-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
        f"<fullName>{name}</fullName>{body}</CustomField>"
    )


def test_namespaced_objects_extend_a_declared_provider_or_name_the_package(tmp_path: Path) -> None:
    """``hed__X__c`` without an object file: extended when the pack the project
    depends on (namespace ``hed``) defines it; a problem naming the package and
    that pack when it does not; a stand-in the project provides otherwise."""
    provider = tmp_path / "hed.yaml"
    provider.write_text(
        "name: hed-provider\ncategory: AppPack\nnamespace: hed\ndepends_on: [platform-core]\n"
        "objects:\n  - api_name: hed__Attribute__c\n    fields:\n"
        "      - {api_name: hed__Kind__c, type: Text, length: 40}\n"
    )
    project = tmp_path / "k12ish"
    (project / "force-app").mkdir(parents=True)
    (project / "sfdx-project.json").write_text(
        '{"name": "k12ish", "packageDirectories": [{"path": "force-app"}],'
        ' "plugins": {"nexusctl": {"dependsOn": ["hed-provider"]}}}'
    )
    objects = project / "force-app" / "objects"
    _field_file(objects / "hed__Attribute__c" / "fields", "Grade__c", "<type>Number</type>")
    _field_file(
        objects / "hed__Term__c" / "fields",
        "Week__c",
        "<type>Number</type><precision>2</precision>",
    )
    plan = packs_apply.load_plan(None, [str(provider), str(project)], False)
    problems = plan_problems(catalog.Catalog(version=0), plan)
    assert [(p.element, p.message) for p in problems] == [
        (
            "hed__Term__c",
            "object of package hed: pack hed-provider (namespace hed) does not define it",
        )
    ]
    assert problems[0].file.endswith("hed__Term__c")
    # Without the declared provider the project provides both objects itself.
    (project / "sfdx-project.json").write_text(
        '{"name": "k12ish", "packageDirectories": [{"path": "force-app"}]}'
    )
    plan = packs_apply.load_plan(None, [str(project)], False)
    assert plan_problems(catalog.Catalog(version=0), plan) == []
    result = invoke(["packs", "import-sfdx", str(project)], cli_env())
    assert result.exit_code == 0, result.output
    rows = _summary_rows(result.output)
    assert rows["hed__Attribute__c"][0] == rows["hed__Term__c"][0] == "stand-in (package hed)"


async def test_import_sfdx_agrees_with_plan_packs_on_installed_packs(
    temporal_env, settings, tmp_path
):
    """Ownership and type changes against installed packs fail the dry run as
    they fail plan-packs."""
    alpha = write_sfdx(
        tmp_path / "alpha",
        {"Color__c": "<label>Color</label><type>Text</type><length>20</length>"},
        project="alpha-app",
    )
    await apply_all(temporal_env, settings, app_pack_sources=[str(alpha)])
    beta = write_sfdx(
        tmp_path / "beta",
        {"Size__c": "<label>Size</label><type>Number</type><precision>5</precision>"},
        project="beta-app",
    )
    changed = write_sfdx(
        tmp_path / "alpha2",
        {"Color__c": "<label>Color</label><type>Number</type><precision>5</precision>"},
        project="alpha-app",
    )
    for src, expected in [
        (beta, "Gadget__c: is already owned by pack alpha-app"),
        (changed, "Gadget__c.Color__c: changes type from Text to Number"),
    ]:
        dry = invoke(["packs", "import-sfdx", str(src)], cli_env(settings))
        assert dry.exit_code == 1, dry.output
        assert expected in dry.output, dry.output
        with pytest.raises(WorkflowFailureError) as info:
            await apply_all(temporal_env, settings, app_pack_sources=[str(src)])
        assert expected in str(info.value.cause)
