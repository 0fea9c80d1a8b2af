"""``nexusctl`` through typer's CliRunner, against the session's Temporal dev
server, a worker running in the test, and real databases.

The CLI calls ``asyncio.run`` itself, so commands that talk to Temporal run in
a thread (``asyncio.to_thread``) while the worker keeps running on the test's
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
from sqlalchemy import delete, inspect, select
from sqlalchemy.engine import make_url
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput, ApplyAllResult
from nexuscrm.contracts.controlplane_queue import ControlPlaneEntityInput
from nexuscrm.controlplane import markers, verify
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.settings import Settings
from nexusctl.cli import controlplane
from nexusctl.controlplane_queue import queue_status
from nexusctl.devserver import reachable
from nexusctl.worker import build_worker
from tests.builders import (
    apply_all,
    apply_all_entry,
    cli_env,
    corpus_project,
    invoke,
    invoke_async,
    snapshot,
    write_sfdx,
)
from tests.conftest import MYSQL_URL


@pytest.fixture(autouse=True)
def _logging_on_real_stderr() -> Iterator[None]:
    """The CLI binds structlog to the runner's (then closed) streams; rebind it."""
    configure_logging("json", "WARNING")
    yield
    configure_logging("json", "WARNING")


async def latest_result(env: WorkflowEnvironment, settings: Settings) -> ApplyAllResult:
    """The result of the control-plane queue's last operation (a worker must run)."""
    status = await queue_status(env.client, settings)
    last = status.running or status.recent[-1]
    handle = env.client.get_workflow_handle(last.workflow_id, result_type=ApplyAllResult)
    # The entity marks an entry running before its child workflow exists.
    for _ in range(100):
        try:
            return await handle.result()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            await asyncio.sleep(0.1)
    return await handle.result()


async def queue_without_worker(
    env: WorkflowEnvironment, settings: Settings, arg: ApplyAllInput
) -> str:
    """The queue entity started, no worker yet, with an ApplyAll waiting in it (as if
    submitted before the workers went away); the workflow id its child will have."""
    entry = apply_all_entry(
        settings,
        "before",
        arg,
        enqueued_at="2026-01-01T00:00:00+00:00",
        deadline="2999-01-01T00:00:00+00:00",
    )
    await env.client.start_workflow(
        "ControlPlane",
        ControlPlaneEntityInput(settings.database_id, queued=[entry]),
        id=settings.controlplane_workflow_id,
        task_queue=settings.controlplane_task_queue,
    )
    return entry.workflow_id


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


def sqlite_path(settings: Settings) -> Path | None:
    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    return Path(url.database)


def assert_no_text_after_table(output: str) -> None:
    """Each table's closing border ends its line: the next output starts a new one."""
    for line in output.splitlines():
        if "┘" in line:
            assert line.rstrip().endswith("┘"), output


def one_line(text: str) -> str:
    return " ".join(text.split())


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port whose +1000 (the dev server's Web UI port) is free too."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + 1000 < 65536 and _bindable(port + 1000):
            return port
    raise AssertionError("no free port pair found")


def dev_server_pids(port: int) -> list[int]:
    """Processes running ``temporal server start-dev ... --port <port>``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"start-dev" not in args or b"--port" not in args:
            continue
        if args[args.index(b"--port") + 1 :][:1] == [str(port).encode()]:
            pids.append(int(proc.name))
    return pids


class Spawned:
    """``python -m nexusctl.cli ARGS`` in a directory, its output in files."""

    def __init__(self, args: Sequence[str], env: dict[str, str], cwd: Path) -> None:
        self.out_path, self.err_path = cwd / "stdout.txt", cwd / "stderr.txt"
        base = {k: v for k, v in os.environ.items() if not k.startswith("NEXUS_")}
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nexusctl.cli", *args],
                cwd=cwd, env=base | cli_env() | env, stdout=out, stderr=err,
                # Ctrl-C must reach it even when pytest runs as a background job.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )  # fmt: skip

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    async def wait_for(self, predicate: object, timeout: float) -> None:
        """Poll ``predicate()`` (without blocking the event loop) until true."""
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}: {self.stdout}{self.stderr}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out: {self.stdout}{self.stderr}")
            await asyncio.sleep(0.1)

    async def wait(self, timeout: float) -> int:
        return await asyncio.to_thread(self.proc.wait, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def kill_dev_servers(port: int) -> None:
    """Clean up after a failed test: the dev servers this test's CLI started."""
    for pid in dev_server_pids(port):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


async def wait_for_poller(env: WorkflowEnvironment, task_queue: str) -> None:
    """Until a worker polls ``task_queue`` (as the server reports it)."""
    request = DescribeTaskQueueRequest(
        namespace=env.client.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    for _ in range(100):
        response = await env.client.workflow_service.describe_task_queue(request)
        if response.pollers:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no worker polls {task_queue}")


def big_pack(path: Path, objects: int = 80) -> Path:
    """An app pack with many objects, so ApplyAll runs long enough to interrupt."""
    fields = [{"api_name": f"F{n}__c", "type": "Text", "length": 40} for n in range(10)]
    specs = [{"api_name": f"Big{n}__c", "fields": fields} for n in range(objects)]
    path.write_text(
        yaml.safe_dump(
            {"name": "big-app", "category": "AppPack", "depends_on": ["platform-core"],
             "objects": specs}
        )
    )  # fmt: skip
    return path


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
    for obj in original.objects:  # object, kind, fields, customized, records, formulas
        formulas = sum(1 for f in obj.fields if f.formula)
        assert rows[obj.api_name] == ["table", str(len(obj.fields)), "0", "0", str(formulas)], rows
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


def test_import_sfdx_warns_of_each_formula_left_out(tmp_path: Path) -> None:
    number = "<type>Number</type><precision>18</precision><scale>0</scale>"
    src = write_sfdx(
        tmp_path / "gadget",
        {"Qty__c": f"<label>Qty</label>{number}",
         "Twice__c": f"<label>Twice</label>{number}<formula>Qty__c * 2</formula>",
         "Odd__c": f"<label>Odd</label>{number}<formula>NO_SUCH_FN(Qty__c)</formula>"},
    )  # fmt: skip
    result = invoke(["packs", "import-sfdx", str(src)], cli_env())
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.output
    assert warnings[0].startswith("warning: Gadget__c.Odd__c: ")
    assert "NO_SUCH_FN" in warnings[0] and "v_Gadget__c" in warnings[0]


@pytest.mark.parametrize(
    ("depends_on", "message"),
    [
        (["platform-core", "gizmo-app"], "dependency cycle: gizmo-app -> gizmo-app"),
        (["platform-core", "no-such-pack"], "depends on no-such-pack, which is not among"),
    ],
)
def test_import_sfdx_checks_dependencies_against_platform_packs(
    tmp_path: Path, depends_on: list[str], message: str
) -> None:
    src = write_app_pack(tmp_path / "gizmo.yaml", [{"api_name": "Size__c", "type": "Number"}])
    data = yaml.safe_load(src.read_text()) | {"depends_on": depends_on}
    src.write_text(yaml.safe_dump(data))
    out = tmp_path / "never.yaml"
    result = invoke(["packs", "import-sfdx", str(src), "--out", str(out)], cli_env())
    assert result.exit_code == 1, result.output
    assert message in one_line(result.output)
    assert not out.exists()


def test_import_sfdx_reports_every_dependency_and_plan_problem_at_once(tmp_path: Path) -> None:
    """A missing dependency hides nothing: the self-cycle, the missing pack and
    the lookup to an object nobody defines are all listed, naming the file."""
    src = write_app_pack(
        tmp_path / "gizmo.yaml",
        [
            {"api_name": "Size__c", "type": "Number"},
            {"api_name": "Owner__c", "type": "Lookup", "reference_to": "Nowhere__c"},
        ],
    )
    data = yaml.safe_load(src.read_text())
    data["depends_on"] = ["platform-core", "gizmo-app", "no-such-pack"]
    src.write_text(yaml.safe_dump(data))
    for argv in (
        ["packs", "import-sfdx", str(src)],
        ["candidate", "write", "--app-pack", str(src)],
    ):
        result = invoke(argv, cli_env())
        assert result.exit_code == 1, result.output
        text = one_line(result.output)
        assert "Traceback" not in result.output
        assert "dependency cycle: gizmo-app -> gizmo-app" in text, result.output
        assert "depends on no-such-pack, which is not among" in text, result.output
        assert "Nowhere__c" in text, result.output
        assert str(src) in result.output


def test_candidate_write_refuses_what_plan_packs_refuses(tmp_path: Path) -> None:
    """A lookup to an object nobody defines, and an app pack source that claims
    a platform category (it was ordered before platform-core and never
    recorded as installed): no candidate is written, every problem is named."""
    src = write_app_pack(
        tmp_path / "gizmo.yaml",
        [{"api_name": "Owner__c", "type": "Lookup", "reference_to": "Nowhere__c"}],
    )
    out = tmp_path / "candidate.yaml"
    result = invoke(["candidate", "write", "--app-pack", str(src), "--out", str(out)], cli_env())
    assert result.exit_code == 1, result.output
    assert "Nowhere__c" in result.output and not out.exists()
    data = yaml.safe_load(src.read_text()) | {"category": "PlatformCore", "depends_on": []}
    src.write_text(yaml.safe_dump(data))
    for argv in (
        ["candidate", "write", "--app-pack", str(src), "--out", str(out)],
        ["packs", "import-sfdx", str(src)],
    ):
        result = invoke(argv, cli_env())
        assert result.exit_code == 1, result.output
        assert "must be of category AppPack or ConnectorPack, not PlatformCore" in one_line(
            result.output
        )
        assert not out.exists()


# ---------------------------------------------------------------------------
# status


async def test_status_before_and_after_apply_all(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    sqlite_file = sqlite_path(settings)
    if sqlite_file is not None:  # looking does not create the database
        missing = invoke(["status"], env)
        assert missing.exit_code == 0, missing.output
        assert f"no database at {sqlite_file} yet" in missing.output
        assert not sqlite_file.exists()
        make_engine(settings.database_url).dispose()
        with sqlite3.connect(sqlite_file):
            pass
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


def test_status_says_when_the_databases_folder_does_not_exist(tmp_path: Path) -> None:
    """``sqlite:////no/such/dir/x.db``: no "apply-all creates it" (it cannot: SQLite
    creates the file, not its folder; a new user's trial)."""
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'x.db'}"
    result = invoke(["status"], {**cli_env(), "NEXUS_DATABASE_URL": url})
    text = " ".join(result.output.split())
    assert f"its folder {tmp_path / 'no' / 'such'} does not exist" in text, text
    assert "creates it" not in text and not (tmp_path / "no").exists()


def test_output_to_a_pipe_is_not_folded_at_80_columns(tmp_path: Path) -> None:
    """Piped (no terminal, no COLUMNS), lines and tables get 200 columns, not rich's
    80: a new user's piped ``connectors status`` cut ``salesforce-sync`` to
    ``salesfor…``. The real entry point, as a process."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["NEXUS_DATABASE_URL"] = f"sqlite:///{tmp_path / 'not-yet.db'}"
    res = subprocess.run(
        [sys.executable, "-m", "nexusctl.cli", "status"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and len(lines[0]) > 80, res.stdout
    assert lines[0].endswith("creates it)"), res.stdout


def test_status_in_a_new_directory_creates_no_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(["status"], {**cli_env(), "NEXUS_DATABASE_URL": None})
    assert result.exit_code == 0, result.output
    assert "no database at .nexus/nexus.db yet" in result.output
    assert not (tmp_path / ".nexus").exists()


async def test_status_shows_full_run_id_and_long_errors(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    bad = tmp_path / ("a-rather-long-folder-name-" * 4) / "bad.yaml"
    bad.parent.mkdir()
    bad.write_text("name: bad-pack\ncategory: AppPack\nobjects: [\n")
    with pytest.raises(WorkflowFailureError):
        await apply_all(temporal_env, settings, app_pack_sources=[str(bad)])
    engine = make_engine(settings.database_url)
    try:
        marker = markers.read(engine)
    finally:
        engine.dispose()
    assert marker is not None and marker.last_error is not None
    assert len(marker.last_error) > 160  # more than the table used to show
    result = invoke(["status"], cli_env(settings, temporal_env) | {"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    assert marker.run_id in result.output
    assert one_line(marker.last_error)[:399] in result.output


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
    assert "no worker is polling" not in result.output
    assert_no_text_after_table(result.output)
    assert any(line.startswith("completed in ") for line in result.output.splitlines())
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


# ---------------------------------------------------------------------------
# expected failures: one `error:` line, exit 1


def test_unknown_database_driver_is_one_error_line() -> None:
    url = "mysql+nosuchdriver://root:s3cret@127.0.0.1:3306/x"
    result = invoke(["status"], cli_env() | {"NEXUS_DATABASE_URL": url})
    assert result.exit_code == 1, result.output
    assert result.output == (
        "error: cannot connect to database mysql+nosuchdriver://root:***@127.0.0.1:3306/x: "
        "Can't load plugin: sqlalchemy.dialects:mysql.nosuchdriver\n"
    )


@pytest.mark.mysql
def test_wrong_mysql_password_is_one_error_line() -> None:
    if not MYSQL_URL:
        pytest.skip("NEXUS_TEST_MYSQL_URL is not set (MariaDB/MySQL tests are off)")
    url = make_url(MYSQL_URL).set(password="wrong-password")
    result = invoke(
        ["status"], cli_env() | {"NEXUS_DATABASE_URL": url.render_as_string(hide_password=False)}
    )
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    masked = url.render_as_string(hide_password=True)
    assert lines[0].startswith(f"error: cannot connect to database {masked}: Access denied")
    assert "wrong-password" not in result.output


@pytest.mark.mysql
def test_a_database_name_the_server_refuses_is_one_error_line() -> None:
    """A trailing space in NEXUS_DATABASE_URL's database name: the server refuses
    it at connect (ProgrammingError 1102); a new user got a 174-line traceback."""
    if not MYSQL_URL:
        pytest.skip("NEXUS_TEST_MYSQL_URL is not set (MariaDB/MySQL tests are off)")
    url = MYSQL_URL + " "
    result = invoke(["status"], cli_env() | {"NEXUS_DATABASE_URL": url})
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot connect to database"), lines
    assert "Incorrect database name" in lines[0] and "Traceback" not in result.output


def test_invalid_settings_name_their_variable_and_hide_the_value() -> None:
    env = cli_env() | {
        "NEXUS_DATABASE_URL": "postgresql://app:hunter2@db/crm",
        "NEXUS_LOG_FORMAT": "xml",
    }
    result = invoke(["status"], env)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid setting: "), result.output
    assert "NEXUS_DATABASE_URL" in lines[0] and "NEXUS_LOG_FORMAT" in lines[0]
    assert "hunter2" not in result.output


def test_unreachable_temporal_is_one_error_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = cli_env() | {
        "NEXUS_TEMPORAL_ADDRESS": address,
        "NEXUS_DATABASE_URL": f"sqlite:///{tmp_path / 'nexus.db'}",
    }
    result = invoke(["apply-all"], env)
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"error: cannot reach Temporal at {address} (start it with `nexusctl dev`)\n"
    )


async def test_temporal_rpc_error_is_one_error_line(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env) | {"NEXUS_TEMPORAL_NAMESPACE": "no-such-namespace"}
    result = await invoke_async(["apply-all"], env)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Temporal at "), result.output
    assert "no-such-namespace" in lines[0] and "NOT_FOUND" in lines[0]


def test_unexpected_exception_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(_settings: Settings) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(controlplane, "print_status", bug)
    result = invoke(["status"], cli_env())
    assert isinstance(result.exception, ZeroDivisionError)
    assert "error:" not in result.output


def test_console_script_entry_point_prints_error_on_stderr(tmp_path: Path) -> None:
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="nexusctl")
    assert entry.value == "nexusctl.cli:main"
    code = (
        "import importlib.metadata as m; "
        "(e,) = m.entry_points(group='console_scripts', name='nexusctl'); e.load()()"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXUS_")} | cli_env()
    env["NEXUS_DATABASE_URL"] = "mysql+nosuchdriver://root:s3cret@127.0.0.1:3306/x"
    done = subprocess.run(
        [sys.executable, "-c", code, "status"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith("error: cannot connect to database mysql+nosuchdriver://")
    assert "s3cret" not in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------
# no worker polling the task queue


async def test_apply_all_wait_warns_when_no_worker_polls(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    cli_run = asyncio.create_task(invoke_async(["apply-all", "--wait"], env))
    handle = temporal_env.client.get_workflow_handle(settings.controlplane_workflow_id)
    for _ in range(100):
        with contextlib.suppress(Exception):
            await handle.describe()
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(3)  # past the CLI's look for a worker
    async with build_worker(temporal_env.client, settings):
        result = await asyncio.wait_for(cli_run, 120)
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning:"))
    assert f"no worker is polling task queue {settings.controlplane_task_queue}" in warning
    assert "`nexusctl worker`" in warning and "NEXUS_DATABASE_URL" in warning
    assert "completed" in result.output


async def test_progress_without_worker_fails_fast_with_one_line(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    nothing = await invoke_async(["progress"], env)
    assert nothing.exit_code == 1, nothing.output
    assert "no control-plane workflow has run on database" in nothing.output

    await queue_without_worker(temporal_env, settings, ApplyAllInput())
    started = time.monotonic()
    stuck = await invoke_async(["progress"], env)
    assert time.monotonic() - started < 15
    assert stuck.exit_code == 1, stuck.output
    assert len(stuck.output.splitlines()) == 1, stuck.output
    assert f"no worker is polling task queue {settings.controlplane_task_queue}" in stuck.output

    async with build_worker(temporal_env.client, settings):
        assert (await latest_result(temporal_env, settings)).status == "completed"
        answered = await invoke_async(["progress"], env)
    assert answered.exit_code == 0, answered.output
    assert "mark-completed" in answered.output
    # Completed: the phases come from the result, no worker needed.
    done = await invoke_async(["progress"], env)
    assert done.exit_code == 0, done.output
    assert "(completed, run " in done.output and "mark-completed" in done.output


# ---------------------------------------------------------------------------
# a control-plane workflow already running: apply-all refuses, --attach and demo wait


async def test_apply_all_queues_joins_with_attach_and_no_queue_refuses(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    waiting = await queue_without_worker(temporal_env, settings, ApplyAllInput())
    env = cli_env(settings, temporal_env)
    pack = write_app_pack(tmp_path / "gizmo.yaml", [{"api_name": "Size__c", "type": "Number"}])
    async with build_worker(temporal_env.client, settings):
        # Identical (no packs asked): --attach joins the waiting ApplyAll.
        attached = await invoke_async(["apply-all", "--wait", "--attach"], env)
        # Other packs: not identical, so it gets (and waits for) its own turn.
        own = await invoke_async(["apply-all", "--wait", "--attach", "--app-pack", str(pack)], env)
    assert attached.exit_code == 0, attached.output
    # Queued, starting or running by the time it joined: the same entry.
    assert "attached to the ApplyAll already" in attached.output
    assert f"on database {settings.database_id}" in one_line(attached.output)
    assert waiting in attached.output and "started ApplyAll" not in attached.output
    assert own.exit_code == 0, own.output
    assert waiting not in own.output and "completed" in own.output
    engine = make_engine(settings.database_url)
    assert "Gizmo__c" in inspect(engine).get_table_names()


async def test_demo_on_a_running_server_attaches_to_the_running_apply_all(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    waiting = await queue_without_worker(temporal_env, settings, ApplyAllInput())
    env = cli_env(settings, temporal_env)
    result = await invoke_async(["demo"], env)
    assert result.exit_code == 0, result.output
    output = one_line(result.output)
    address = env["NEXUS_TEMPORAL_ADDRESS"]
    assert f"using the Temporal server already listening at {address}" in output
    assert "compete" not in output  # no other worker polls: nothing to warn of
    assert "attached to the ApplyAll already" in output and waiting in output
    assert "started ApplyAll" not in output
    handle = temporal_env.client.get_workflow_handle(waiting, result_type=ApplyAllResult)
    assert (await handle.result()).status == "completed"
    assert_no_text_after_table(result.output)
    assert "platform-core" in result.output  # the closing status tables


# ---------------------------------------------------------------------------
# signals: the dev server started by the CLI never outlives it


async def test_dev_stops_its_temporal_server_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    dev = Spawned(["dev"], {"NEXUS_TEMPORAL_ADDRESS": address}, tmp_path)
    try:
        await dev.wait_for(lambda: reachable(address) and "Ctrl-C to stop" in dev.stdout, 120)
        assert dev_server_pids(port)
        await asyncio.sleep(1)  # the worker is up
        dev.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        while reachable(address) and time.monotonic() - stopped < 15:
            await asyncio.sleep(0.1)
        assert not reachable(address), "the dev server still answers 15 s after SIGTERM"
        assert await dev.wait(30) == 0, dev.stderr
        assert dev_server_pids(port) == []
        assert "Traceback" not in dev.stderr
    finally:
        dev.kill()
        kill_dev_servers(port)


async def test_dev_on_a_running_server_warns_of_competing_worker_and_leaves_it_running(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    env = cli_env(settings, temporal_env)
    address = env["NEXUS_TEMPORAL_ADDRESS"]
    async with build_worker(temporal_env.client, settings):
        await wait_for_poller(temporal_env, settings.controlplane_task_queue)
        dev = Spawned(["dev"], env, tmp_path)
        try:
            await dev.wait_for(lambda: "Ctrl-C to stop" in dev.stdout, 60)
            await dev.wait_for(lambda: "compete" in dev.stderr, 30)
            dev.proc.send_signal(signal.SIGTERM)
            assert await dev.wait(30) == 0, dev.stderr
        finally:
            dev.kill()
    assert f"using the Temporal server already listening at {address}" in one_line(dev.stdout)
    warning = one_line(dev.stderr)
    assert f"already poll task queue {settings.controlplane_task_queue}" in warning
    assert "Traceback" not in dev.stderr
    assert reachable(address)  # not ours to stop


async def test_demo_ctrl_c_stops_at_once_and_apply_all_resumes_later(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    pack = big_pack(tmp_path / "big.yaml")
    env = {"NEXUS_TEMPORAL_ADDRESS": address}
    first = Spawned(["demo", "--app-pack", str(pack)], env, tmp_path)
    try:
        await first.wait_for(lambda: "started ApplyAll" in first.stdout, 120)
        await asyncio.sleep(0.7)  # into the phases (it takes ~2.5 s)
        first.proc.send_signal(signal.SIGINT)
        assert await first.wait(30) == 130, first.stdout + first.stderr
        assert dev_server_pids(port) == []
        assert not reachable(address)
    finally:
        first.kill()
        kill_dev_servers(port)
    stderr = one_line(first.stderr)
    assert "Traceback" not in stderr and "CancelledError" not in stderr, first.stderr
    assert "interrupted: ApplyAll controlplane/" in stderr
    assert (
        "keeps its state in .nexus/temporal.db and resumes when a worker runs "
        "(`nexusctl dev` or `nexusctl demo`)"
    ) in stderr
    assert (tmp_path / ".nexus" / "temporal.db").exists()

    # The next demo finds the interrupted ApplyAll and waits for it to finish.
    # Same directory: the same .nexus/ (database and Temporal state).
    second = Spawned(["demo", "--app-pack", str(pack)], env, tmp_path)
    try:
        assert await second.wait(300) == 0, second.stdout + second.stderr
    finally:
        second.kill()
        kill_dev_servers(port)
    out = one_line(second.stdout)
    # It joined the interrupted ApplyAll (running, or still queued if Ctrl-C came first).
    assert "attached to the ApplyAll already" in out, second.stdout + second.stderr
    assert "warning:" not in second.stderr  # the same app packs: nothing to warn about
    assert "completed in" in out and "big-app" in out
    assert dev_server_pids(port) == []
