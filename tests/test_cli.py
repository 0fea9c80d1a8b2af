"""``nexusctl`` through typer's CliRunner, against the session's Temporal dev
server, a worker running in the test, and real databases.

The CLI calls ``asyncio.run`` itself, so commands that talk to Temporal run in
a thread (``asyncio.to_thread``) while the worker keeps running on the test's
event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
from sqlalchemy import delete, inspect, select
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner, Result

from nexuscrm.controlplane import catalog, markers, verify
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.settings import Settings
from nexusctl.cli import app
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.conftest import corpus_project
from tests.helpers import snapshot
from workflows.models import ApplyAllInput, ApplyAllResult

runner = CliRunner()


@pytest.fixture(autouse=True)
def _logging_on_real_stderr() -> Iterator[None]:
    """The CLI binds structlog to the runner's (then closed) streams; rebind it."""
    configure_logging("json", "WARNING")
    yield
    configure_logging("json", "WARNING")


def cli_env(
    settings: Settings | None = None, env: WorkflowEnvironment | None = None
) -> dict[str, str]:
    """NEXUS_* variables pointing the CLI at this test's database, server and queue."""
    out: dict[str, str] = {
        "NEXUS_ENV": "development",
        "NEXUS_LOG_FORMAT": "json",
        "NEXUS_LOG_LEVEL": "WARNING",
        "COLUMNS": "400",  # wide enough that rich never folds a path
    }
    if settings is not None:
        out |= {
            "NEXUS_DATABASE_URL": settings.database_url,
            "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
            "NEXUS_DATABASE_ID": settings.database_id,
        }
    if env is not None:
        out["NEXUS_TEMPORAL_ADDRESS"] = env.client.service_client.config.target_host
    return out


def invoke(args: Sequence[str], env: dict[str, str]) -> Result:
    try:
        return runner.invoke(app, list(args), env=env)
    finally:
        configure_logging("json", "WARNING")


async def invoke_async(args: Sequence[str], env: dict[str, str]) -> Result:
    """Run a CLI command in a thread (it runs its own event loop)."""
    return await asyncio.to_thread(invoke, args, env)


async def apply_all(env: WorkflowEnvironment, settings: Settings, **kw: object) -> ApplyAllResult:
    """ApplyAll through the Temporal client with a worker running."""
    async with build_worker(env.client, settings):
        handle = await start_controlplane(env.client, settings, "ApplyAll", ApplyAllInput(**kw))  # type: ignore[arg-type]
        return await handle.result()


async def latest_result(env: WorkflowEnvironment, settings: Settings) -> ApplyAllResult:
    handle = env.client.get_workflow_handle(
        settings.controlplane_workflow_id, result_type=ApplyAllResult
    )
    return await handle.result()


def write_app_pack(path: Path, fields: list[dict[str, str]]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "name": "gizmo-app",
                "category": "AppPack",
                "depends_on": ["platform-core"],
                "objects": [{"api_name": "Gizmo__c", "label": "Gizmo", "fields": fields}],
            }
        )
    )
    return path


def write_sfdx(root: Path, fields: dict[str, str]) -> Path:
    """A minimal SFDX project with object Gadget__c and the given field XML bodies."""
    base = root / "force-app" / "main" / "default" / "objects" / "Gadget__c"
    (base / "fields").mkdir(parents=True)
    (root / "sfdx-project.json").write_text(
        '{"name": "gadget-app", "packageDirectories": [{"path": "force-app"}]}'
    )
    (base / "Gadget__c.object-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomObject xmlns="http://soap.sforce.com/2006/04/metadata">'
        "<label>Gadget</label><pluralLabel>Gadgets</pluralLabel>"
        "<nameField><label>Name</label><type>Text</type></nameField></CustomObject>"
    )
    for name, body in fields.items():
        (base / "fields" / f"{name}.field-meta.xml").write_text(
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
            f"<fullName>{name}</fullName>{body}</CustomField>"
        )
    return root


# ---------------------------------------------------------------------------
# packs import-sfdx


def test_import_sfdx_summarizes_and_writes_equivalent_yaml(tmp_path: Path) -> None:
    dreamhouse = corpus_project("dreamhouse-lwc")
    out = tmp_path / "dreamhouse.yaml"
    result = invoke(["packs", "import-sfdx", str(dreamhouse), "--out", str(out)], cli_env())
    assert result.exit_code == 0, result.output
    original = load_pack_source(dreamhouse)
    rows = {
        cells[0]: cells[1:]
        for line in result.output.splitlines()
        if (cells := [c.strip() for c in line.split("│")[1:-1]])
    }
    for obj in original.objects:  # object, kind, fields, formulas
        formulas = sum(1 for f in obj.fields if f.formula)
        assert rows[obj.api_name] == ["table", str(len(obj.fields)), str(formulas)], rows
    assert f"wrote {out}" in result.output
    written = load_pack_source(out)
    assert written.name == original.name == "dreamhouse-lwc"
    assert payload_hash(written) == payload_hash(original)


def test_import_sfdx_broken_field_file_exits_1_naming_it(tmp_path: Path) -> None:
    src = write_sfdx(
        tmp_path / "gadget",
        {"Good__c": "<label>Good</label><type>Text</type><length>20</length>",
         "Broken__c": "<label>Broken</label><type>Text</type><length>20"},
    )  # fmt: skip
    out = tmp_path / "never.yaml"
    result = invoke(["packs", "import-sfdx", str(src), "--out", str(out)], cli_env())
    assert result.exit_code == 1, result.output
    assert "Broken__c.field-meta.xml" in result.output
    assert not out.exists()


# ---------------------------------------------------------------------------
# status


async def test_status_before_and_after_apply_all(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    empty = invoke(["status"], env)
    assert empty.exit_code == 0, empty.output
    assert "has no control-plane tables" in empty.output

    done = await apply_all(temporal_env, settings)
    assert done.status == "completed"
    result = invoke(["status"], env)
    assert result.exit_code == 0, result.output
    marker_line = next(line for line in result.output.splitlines() if markers.APPLY_ALL_KEY in line)
    assert "completed" in marker_line
    assert "platform-core" in result.output and "dev-sample" in result.output
    assert "has not completed" not in result.output


# ---------------------------------------------------------------------------
# apply-all --wait


async def test_apply_all_wait_converges_database(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    async with build_worker(temporal_env.client, settings):
        result = await invoke_async(["apply-all", "--wait"], env)
    assert result.exit_code == 0, result.output
    assert settings.controlplane_workflow_id in result.output
    assert "completed" in result.output
    engine = make_engine(settings.database_url)
    try:
        marker = markers.read(engine)
        assert marker is not None and marker.status == "completed"
        assert {"Account", "Contact", "Demo_Task__c"} <= set(inspect(engine).get_table_names())
        catalog.CACHE.invalidate()
        assert verify.verify(engine) == []
    finally:
        engine.dispose()


async def test_apply_all_wait_with_broken_manifest_exits_1(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad-pack\ncategory: AppPack\nobjects: [\n")
    env = cli_env(settings, temporal_env)
    async with build_worker(temporal_env.client, settings):
        result = await invoke_async(["apply-all", "--wait", "--app-pack", str(bad)], env)
    assert result.exit_code == 1, result.output
    assert "error" in result.output and str(bad) in result.output
    assert "plan-packs" in result.output
    engine = make_engine(settings.database_url)
    try:
        marker = markers.read(engine)
        assert marker is not None and marker.status == "failed"
        assert "bad.yaml" in (marker.last_error or "")
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------
# the auto_start policy


def phase_status(result: ApplyAllResult) -> dict[str, str]:
    return {p.name: p.status for p in result.phases}


async def test_auto_start_skips_applies_on_change_and_halts_on_legacy(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    pack_file = write_app_pack(tmp_path / "gizmo.yaml", [{"api_name": "Size__c", "type": "Number"}])
    first = await apply_all(temporal_env, settings, app_pack_sources=[str(pack_file)])
    assert first.status == "completed"
    engine = make_engine(settings.database_url)
    try:
        converged = snapshot(engine)
        marker = markers.read(engine)
        assert marker is not None and marker.status == "completed"

        # Converged and unchanged: the CLI's auto_start run skips and writes nothing.
        env = cli_env(settings, temporal_env)
        async with build_worker(temporal_env.client, settings):
            cli = await invoke_async(["apply-all", "--wait", "--policy", "auto_start"], env)
            skipped = await latest_result(temporal_env, settings)
        assert cli.exit_code == 0, cli.output
        assert skipped.status == "skipped"
        status = phase_status(skipped)
        assert status["classify"] == "completed"
        for name in ("mark-running", "apply-metadata", "apply-packs", "verify", "mark-completed"):
            assert status[name] == "skipped", (name, status)
        assert snapshot(engine) == converged
        assert markers.read(engine) == marker

        # The app pack gained a field: auto_start applies it.
        write_app_pack(
            pack_file,
            [
                {"api_name": "Size__c", "type": "Number"},
                {"api_name": "Weight__c", "type": "Number"},
            ],
        )
        applied = await apply_all(
            temporal_env, settings, app_pack_sources=[str(pack_file)], policy="auto_start"
        )
        assert applied.status == "completed"
        assert phase_status(applied)["apply-packs"] == "completed"
        cols = {c["name"] for c in inspect(engine).get_columns("Gizmo__c")}
        assert {"Size__c", "Weight__c"} <= cols

        # Metadata but no marker (a pre-marker legacy database): halt, change nothing.
        with engine.begin() as conn:
            conn.execute(delete(t.bootstrap_state))
        before = snapshot(engine)
        with pytest.raises(WorkflowFailureError) as info:
            await apply_all(temporal_env, settings, policy="auto_start")
        cause = info.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "HaltForMigration"
        assert "apply-all" in str(cause)
        assert snapshot(engine) == before
        assert markers.read(engine) is None
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------
# sibling operations


async def test_run_repair_invalidates_completed_marker(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    first = await apply_all(temporal_env, settings)
    assert first.status == "completed"
    env = cli_env(settings, temporal_env)
    async with build_worker(temporal_env.client, settings):
        result = await invoke_async(["run-repair", "--wait"], env)
    assert result.exit_code == 0, result.output
    engine = make_engine(settings.database_url)
    try:
        marker = markers.read(engine)
        assert marker is not None and marker.status == "invalidated"
    finally:
        engine.dispose()
    status = invoke(["status"], env)
    assert "ApplyAll has not completed" in status.output

    # An invalidated marker is not trusted: the next auto_start applies in full.
    again = await apply_all(temporal_env, settings, policy="auto_start")
    assert again.status == "completed"
    assert phase_status(again)["verify"] == "completed"


async def test_init_l0_initializes_a_fresh_database(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    async with build_worker(temporal_env.client, settings):
        result = await invoke_async(["init-l0", "--wait"], env)
    assert result.exit_code == 0, result.output
    engine = make_engine(settings.database_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert "Account" in tables and "Demo_Task__c" not in tables
    finally:
        engine.dispose()


async def test_init_l0_does_not_register_business_tables(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE Legacy_Widget__c (Id VARCHAR(36) PRIMARY KEY, Qty INTEGER)"
            )
        env = cli_env(settings, temporal_env)
        async with build_worker(temporal_env.client, settings):
            result = await invoke_async(["init-l0", "--wait"], env)
        assert result.exit_code == 0, result.output
        with engine.connect() as conn:
            names = set(conn.execute(select(t.object_meta.c.ApiName)).scalars())
        assert "Account" in names  # init-l0 did run
        assert "Legacy_Widget__c" not in names
    finally:
        engine.dispose()
