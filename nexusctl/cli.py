"""``nexusctl``: run the worker and the embedded stack, start and watch
control-plane workflows, inspect a database. Settings come from NEXUS_* env.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import pydantic
import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from sqlalchemy import Engine, select
from sqlalchemy import exc as sa_exc
from sqlalchemy import text as sa_text
from sqlalchemy.engine import make_url
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import PollerInfo, TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)
from temporalio.service import RPCError, RPCStatusCode
from typer.core import TyperGroup

from nexuscrm.catalog import object_table
from nexuscrm.connectors import handoff, serving, workqueue
from nexuscrm.connectors.importer import events_from_sfdx_plan
from nexuscrm.connectors.routes import ConnectorPackRow, list_connector_packs
from nexuscrm.contracts import (
    ApplyAllInput,
    ApplyAllResult,
    FleetStatus,
    OperationInput,
    PhaseReport,
    SupervisorStatus,
)
from nexuscrm.controlplane import markers
from nexuscrm.controlplane.packs_apply import remove_pack
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.db.engine import make_engine, redacted
from nexuscrm.errors import NexusError
from nexuscrm.formulas import build_view_select, view_name
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR, platform_packs
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.packs.model import ObjectSpec, PackManifest
from nexuscrm.packs.ordering import order_packs
from nexuscrm.settings import Settings, default_database_url
from nexusctl.cli_identity import waits, wake_app
from nexusctl.devserver import dev_server, stop_server, ui_port
from nexusctl.temporal import (
    ControlPlaneBusyError,
    connect,
    fleet_workflow_id,
    signal_fleet,
    start_controlplane,
    start_fleet,
)
from nexusctl.worker import run_worker

T = TypeVar("T")

# Seconds: a progress query without a worker to answer it fails after this
# (instead of the server's ~30 s), and a worker gets this long to stop.
QUERY_TIMEOUT = timedelta(seconds=3)
SHUTDOWN_GRACE_S = 10.0
# A live poller re-polls at least every ~60 s; older entries are history.
POLLER_FRESH_S = 90.0
STATE_DIR = Path(".nexus")


class NexusGroup(TyperGroup):
    """The ``nexusctl`` command group: expected failures become one ``error:`` line.

    Wraps every invocation (the console script and ``CliRunner`` alike): an
    exception :func:`expected_failure` recognizes (bad settings, an
    unreachable database or Temporal server, a ``NexusError`` ...) is printed
    as ``error: <one line>`` on stderr and exits 1. Anything else is a bug
    and keeps its traceback.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        _RUN.reset()
        try:
            return super().main(
                args, prog_name, complete_var, standalone_mode, windows_expand_args, **extra
            )
        except Exception as exc:
            message = expected_failure(exc)
            if message is None:
                raise
            _error_line(message)
            if standalone_mode:
                sys.exit(1)
            return 1


app = typer.Typer(
    help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False, cls=NexusGroup
)
packs_app = typer.Typer(help="Pack tools.", no_args_is_help=True)
app.add_typer(packs_app, name="packs")
connectors_app = typer.Typer(help="Connector inbound runtime.", no_args_is_help=True)
app.add_typer(connectors_app, name="connectors")
app.add_typer(wake_app, name="wake")
connectors_app.command("waits")(waits)
events_app = typer.Typer(help="Inbound connector events.", no_args_is_help=True)
app.add_typer(events_app, name="events")
console = Console()
err_console = Console(stderr=True)

AppPack = Annotated[
    list[str] | None,
    typer.Option("--app-pack", help="App pack source: SFDX project folder or pack.yaml (repeat)."),
]
DevSample = Annotated[
    bool | None,
    typer.Option("--dev-sample/--no-dev-sample", help="Default: on unless NEXUS_ENV=production."),
]


@dataclass
class _RunState:
    """What the running command knows, for its error and interrupt messages."""

    settings: Settings | None = None
    workflow: str | None = None
    workflow_id: str | None = None
    live: Live | None = None
    # The event loop and callback that Ctrl-C / SIGTERM go to (see _interrupts).
    interrupt: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None

    def reset(self) -> None:
        self.settings = None
        self.workflow = self.workflow_id = None
        self.live = None
        self.interrupt = None


_RUN = _RunState()


def _settings(quiet: bool = False) -> Settings:
    settings = Settings()
    _RUN.settings = settings
    # A live progress display and log lines on one terminal do not mix.
    level = "WARNING" if quiet and "NEXUS_LOG_LEVEL" not in os.environ else settings.log_level
    configure_logging(settings.log_format, level)
    return settings


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _error_line(message: str) -> None:
    err_console.print(f"[red]error:[/red] {escape(_one_line(message))}", soft_wrap=True)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {escape(_one_line(message))}", soft_wrap=True)


def _fail(message: str) -> NoReturn:
    _error_line(message)
    raise typer.Exit(1)


def safe_url(url: str) -> str:
    """``url`` with its password masked, even when SQLAlchemy cannot parse it."""
    try:
        return redacted(url)
    except Exception:
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _database_url() -> str:
    if _RUN.settings is not None:
        return _RUN.settings.database_url
    return os.environ.get("NEXUS_DATABASE_URL") or default_database_url()


def _temporal_address() -> str:
    if _RUN.settings is not None:
        return _RUN.settings.temporal_address
    return os.environ.get("NEXUS_TEMPORAL_ADDRESS") or "127.0.0.1:7233"


def _driver_message(exc: sa_exc.DBAPIError) -> str:
    orig = exc.orig
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int):  # PyMySQL: (1045, "Access denied ...")
        return f"{args[1]} ({args[0]})"
    return str(orig) if orig is not None else str(exc)


def _settings_message(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        info = Settings.model_fields.get(field)
        env_var = info.alias if info is not None and info.alias else f"NEXUS_{field.upper()}"
        msg = str(err["msg"]).removeprefix("Value error, ")
        # Never echo the input: a database URL may carry a password.
        parts.append(msg if env_var in msg else f"{env_var}: {msg}")
    return "invalid setting: " + "; ".join(parts)


def expected_failure(exc: BaseException) -> str | None:
    """The one-line message for an expected failure, or None for a bug.

    Expected: ``NexusError``; invalid ``NEXUS_*`` settings (named by their
    environment variable, value not echoed); a database URL SQLAlchemy cannot
    use or a database that refuses the connection (URL redacted, driver
    message); an unreachable Temporal server; a Temporal ``RPCError``.
    """
    if isinstance(exc, NexusError):
        return str(exc)
    if isinstance(exc, pydantic.ValidationError) and exc.title == Settings.__name__:
        return _settings_message(exc)
    if isinstance(exc, sa_exc.OperationalError):
        url = safe_url(_database_url())
        if exc.statement is None:
            return f"cannot connect to database {url}: {_driver_message(exc)}"
        return f"database {url}: {_driver_message(exc)}"
    # An unknown driver, or a URL SQLAlchemy cannot parse (other ArgumentErrors are bugs).
    if isinstance(exc, sa_exc.NoSuchModuleError) or (
        isinstance(exc, sa_exc.ArgumentError) and "URL" in str(exc)
    ):
        return f"cannot connect to database {safe_url(_database_url())}: {exc}"
    if isinstance(exc, RuntimeError) and str(exc).startswith("Failed client connect"):
        return f"cannot reach Temporal at {_temporal_address()} (start it with `nexusctl dev`)"
    if isinstance(exc, RPCError):
        return f"Temporal at {_temporal_address()}: {exc.message} ({exc.status.name})"
    return None


def _engine(settings: Settings) -> Engine:
    """``make_engine`` with its setup errors as one-line ``NexusError``s."""
    try:
        return make_engine(settings.database_url)
    except ImportError as exc:  # the URL's driver is not installed
        raise NexusError(
            f"cannot connect to database {safe_url(settings.database_url)}: {exc} "
            "(for MySQL/MariaDB/TiDB: pip install -e '.[mysql]')"
        ) from exc
    except ValueError as exc:  # a backend make_engine does not support
        raise NexusError(str(exc)) from exc


def _sqlite_path(settings: Settings) -> Path | None:
    """The SQLite file of the configured URL; None for other backends and ``:memory:``."""
    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser()


def _require_engine(settings: Settings) -> Engine:
    """The configured database's engine; exits with an error when it does not exist yet."""
    engine = _existing_engine(settings)
    if engine is None:
        _fail(_no_database(settings))
        raise AssertionError("unreachable")
    return engine


def _existing_engine(settings: Settings) -> Engine | None:
    """The database's engine; None when it is a SQLite file that does not exist yet.

    Read-only commands use this so that looking does not create ``.nexus/nexus.db``.
    """
    path = _sqlite_path(settings)
    if path is not None and not path.exists():
        return None
    return _engine(settings)


def _no_database(settings: Settings) -> str:
    return (
        f"no database at {_sqlite_path(settings)} yet "
        "(`nexusctl demo` or `nexusctl apply-all` creates it)"
    )


def _check_database(settings: Settings) -> None:
    """Connect once, so a wrong URL or password fails before anything starts; and
    refuse the Runtime handoff role without a serving selection (the seed's start check)."""
    selection = serving.load(settings.serving_selection) if settings.serving_selection else None
    handoff.require_serving_selection(settings.connector_role, selection)
    engine = _engine(settings)
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()


def _sources(app_pack: list[str] | None) -> list[str]:
    # Resolve here: the worker may run in another working directory.
    return [str(Path(s).expanduser().resolve()) for s in (app_pack or [])]


# ---------------------------------------------------------------------------
# signals: Ctrl-C and SIGTERM


def _on_sigterm(_signum: int, _frame: object) -> None:
    interrupt = _RUN.interrupt
    if interrupt is None:
        raise KeyboardInterrupt
    loop, callback = interrupt
    loop.call_soon_threadsafe(callback)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM does what Ctrl-C does.

    Without it SIGTERM kills the process on the spot, and the dev server it
    started (in a session of its own) keeps running. SIGTERM raises
    ``KeyboardInterrupt``, or calls the callback of :func:`_interrupts` while
    an event loop runs one. Main thread only; a no-op elsewhere (tests run
    commands in threads).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _interrupts(callback: Callable[[], None]) -> Iterator[None]:
    """While the block runs on the event loop, Ctrl-C and SIGTERM call ``callback`` there.

    Replaces asyncio's own Ctrl-C handling (which cancels the main task). A
    process started with SIGINT ignored (a background job) keeps ignoring it.
    """
    loop = asyncio.get_running_loop()
    sigint = False
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signal.SIGINT, callback)
            sigint = True  # only in the main thread
    _RUN.interrupt = (loop, callback)
    try:
        yield
    finally:
        _RUN.interrupt = None
        if sigint:
            loop.remove_signal_handler(signal.SIGINT)


def _end_live_output() -> None:
    # On a terminal rich ends the live display with a newline itself;
    # elsewhere the next line would start right after the table's border.
    if not console.is_terminal:
        console.line()


def _hard_exit(server: subprocess.Popen[bytes] | None, message: str) -> NoReturn:
    """Stop now: end the live display, print ``message``, stop our dev server, exit 130.

    Nothing is lost: workflow state is durable in Temporal, and the activity
    a stopped worker was running is retried when a worker runs again.
    """
    live = _RUN.live
    if live is not None:
        _RUN.live = None
        with contextlib.suppress(Exception):
            live.stop()
            _end_live_output()
    err_console.print(escape(message), soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # From here on the worker's core may log about the server going away: noise.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    if server is not None:
        stop_server(server)
    os._exit(130)


def _interrupted_message(settings: Settings, server: subprocess.Popen[bytes] | None) -> str:
    if _RUN.workflow_id is None:
        return "interrupted before ApplyAll started"
    where = (
        str(STATE_DIR / "temporal.db")
        if server is not None
        else f"the Temporal server at {settings.temporal_address}"
    )
    preposition = "in" if server is not None else "on"
    return (
        f"interrupted: {_RUN.workflow} {_RUN.workflow_id} keeps its state {preposition} {where} "
        "and resumes when a worker runs (`nexusctl dev` or `nexusctl demo`)"
    )


# ---------------------------------------------------------------------------
# workers and task queues


async def _active_pollers(
    client: Client, task_queue: str, wait_s: float = 0.0
) -> list[PollerInfo] | None:
    """Workers polling ``task_queue`` for workflow tasks (recently seen ones only).

    Waits up to ``wait_s`` for a first poller (a worker that just started may
    not have polled yet). None when the server cannot tell.
    """
    request = DescribeTaskQueueRequest(
        namespace=client.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    deadline = time.monotonic() + wait_s
    while True:
        try:
            response = await client.workflow_service.describe_task_queue(
                request, timeout=timedelta(seconds=5)
            )
        except RPCError:
            return None
        now = time.time()
        pollers = [
            p
            for p in response.pollers
            if not p.HasField("last_access_time")
            or now - p.last_access_time.ToSeconds() < POLLER_FRESH_S
        ]
        if pollers or time.monotonic() >= deadline:
            return pollers
        await asyncio.sleep(0.25)


def _start_worker_hint(settings: Settings) -> str:
    return (
        "start `nexusctl worker` (or `nexusctl dev`) with the same "
        f"NEXUS_DATABASE_URL ({safe_url(settings.database_url)})"
    )


async def _warn_if_no_worker(
    client: Client, settings: Settings, task_queue: str, what: str
) -> None:
    pollers = await _active_pollers(client, task_queue, wait_s=2.0)
    if pollers == []:
        _warn(
            f"no worker is polling task queue {task_queue}, so {what} waits until one does: "
            + _start_worker_hint(settings)
        )


def _announce_server(settings: Settings, server: subprocess.Popen[bytes] | None) -> None:
    if server is not None:
        console.print(
            f"Temporal dev server at {settings.temporal_address}, "
            f"Web UI http://127.0.0.1:{ui_port(settings)} (state in {STATE_DIR / 'temporal.db'})"
        )
    else:
        console.print(
            f"using the Temporal server already listening at {settings.temporal_address} "
            "(nexusctl did not start it, so it keeps running after this command)"
        )


async def _warn_competing_workers(settings: Settings) -> None:
    """On a server we did not start: another worker for this database would compete."""
    client = await connect(settings)
    pollers = await _active_pollers(client, settings.controlplane_task_queue)
    if pollers:
        who = ", ".join(sorted({p.identity for p in pollers}))
        _warn(
            f"{len(pollers)} worker(s) already poll task queue {settings.controlplane_task_queue} "
            f"there ({who}): they compete with this one for database {settings.database_id}'s "
            "work; stop them or run only one worker per database"
        )


async def _serve(
    settings: Settings, server: subprocess.Popen[bytes] | None, *, reused_server: bool = False
) -> None:
    """Run the worker until Ctrl-C / SIGTERM, then stop it (10 s grace, then at once).

    ``server``: the dev server this process started (stopped too on a hard
    exit). ``reused_server``: ``dev`` found a server it did not start.
    """
    stop = asyncio.Event()
    interrupts = 0

    def interrupted() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            _hard_exit(server, "stopped at once")
        stop.set()

    with _interrupts(interrupted):
        if reused_server:
            await _warn_competing_workers(settings)
        worker_task = asyncio.create_task(run_worker(settings, stop))
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({worker_task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not worker_task.done():
                console.print("stopping the worker (Ctrl-C again to stop at once)")
                done, _ = await asyncio.wait({worker_task}, timeout=SHUTDOWN_GRACE_S)
                if not done:
                    _hard_exit(server, f"the worker did not stop within {SHUTDOWN_GRACE_S:.0f} s")
        finally:
            stopping.cancel()
        worker_task.result()


async def _with_worker(
    settings: Settings,
    server: subprocess.Popen[bytes] | None,
    body: Callable[[], Coroutine[Any, Any, T]],
    on_interrupt: Callable[[], None],
) -> T:
    """Run ``body`` while this process runs a worker; a worker that fails fails the command."""
    with _interrupts(on_interrupt):
        if server is None:
            await _warn_competing_workers(settings)
        stop = asyncio.Event()
        worker_task = asyncio.create_task(run_worker(settings, stop))
        body_task = asyncio.create_task(body())
        try:
            await asyncio.wait({worker_task, body_task}, return_when=asyncio.FIRST_COMPLETED)
            if not body_task.done():  # the worker ended first: it failed
                body_task.cancel()
                with contextlib.suppress(BaseException):
                    await body_task
                worker_task.result()
                raise NexusError("the worker stopped unexpectedly")
            return body_task.result()
        finally:
            stop.set()
            if not worker_task.done():
                await worker_task


# ---------------------------------------------------------------------------
# control-plane operations


def phase_table(phases: list[PhaseReport], title: str) -> Table:
    """Rich table of phases: name, status, seconds, detail or error."""
    table = Table(title=title)
    for col in ("phase", "status", "seconds", "detail / error"):
        table.add_column(col)
    colors = {"completed": "green", "failed": "red", "running": "yellow", "skipped": "dim"}
    for p in phases:
        color = colors.get(p.status, "white")
        secs = f"{p.duration_s:.2f}" if p.duration_s is not None else ""
        note = p.error or p.detail or ""
        table.add_row(p.name, f"[{color}]{p.status}[/{color}]", secs, Text(note[:160]))
    return table


async def _query_progress(handle: WorkflowHandle[Any, Any]) -> list[PhaseReport]:
    return await handle.query("progress", result_type=list[PhaseReport], rpc_timeout=QUERY_TIMEOUT)


async def _watch(handle: WorkflowHandle[Any, ApplyAllResult], title: str) -> ApplyAllResult:
    """Show live progress until the workflow ends; return its result."""
    task = asyncio.ensure_future(handle.result())
    waiting = Text(f"waiting for {handle.id} to report progress ...")
    try:
        with Live(waiting, console=console, refresh_per_second=4) as live:
            _RUN.live = live
            while not task.done():
                with contextlib.suppress(Exception):  # no worker answered in time: try again
                    live.update(phase_table(await _query_progress(handle), title))
                await asyncio.wait([task], timeout=0.3)
            try:
                result = task.result()
            except WorkflowFailureError:
                with contextlib.suppress(Exception):
                    live.update(phase_table(await _query_progress(handle), title))
                raise
            live.update(phase_table(result.phases, title))
            _RUN.live = None
    finally:
        _RUN.live = None
        if not task.done():
            task.cancel()
        _end_live_output()
    return result


async def _started_with(client: Client, handle: WorkflowHandle[Any, Any]) -> ApplyAllInput | None:
    """The input a running ApplyAll was started with (None if it cannot be read)."""
    with contextlib.suppress(Exception):
        async for event in handle.fetch_history_events():
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            (value,) = await client.data_converter.decode(payloads, [ApplyAllInput])
            return value if isinstance(value, ApplyAllInput) else None
    return None


async def _warn_if_not_ours(
    client: Client,
    handle: WorkflowHandle[Any, Any],
    running_type: str,
    workflow: str,
    arg: ApplyAllInput | OperationInput,
) -> None:
    """Attached to a running workflow: say so when it is not the one this command asked for."""
    if running_type != workflow:
        _warn(
            f"the running workflow is {running_type}, not {workflow}: waiting for it; "
            f"start {workflow} again when it ends"
        )
        return
    if not isinstance(arg, ApplyAllInput):
        return
    theirs = await _started_with(client, handle)
    ours_packs, ours_sample = sorted(arg.app_pack_sources), arg.include_dev_sample
    # Asking for nothing (no --app-pack, no --dev-sample flag) is satisfied by any run.
    satisfied = (
        theirs is not None
        and (not ours_packs or sorted(theirs.app_pack_sources) == ours_packs)
        and (ours_sample is None or ours_sample == theirs.include_dev_sample)
    )
    if satisfied:
        return
    started = ", ".join(theirs.app_pack_sources) if theirs is not None else "unknown"
    _warn(
        f"the running ApplyAll was started with other arguments (app packs: {started or 'none'}) "
        "and is not restarted: run this command again when it ends"
    )


async def _run_operation(
    settings: Settings,
    workflow: str,
    arg: ApplyAllInput | OperationInput,
    wait: bool,
    *,
    attach: bool = False,
    attach_hint: bool = False,
    own_worker: bool = False,
) -> ApplyAllResult | None:
    """Start ``workflow`` on the database; with ``wait``, show progress and return its result.

    When a control-plane workflow already runs on the database: ``attach``
    waits for that one instead; otherwise fail with the busy message.
    ``own_worker``: this process runs the worker (no poller check).
    """
    client = await connect(settings)
    task_queue = settings.controlplane_task_queue
    try:
        handle = await start_controlplane(client, settings, workflow, arg)
        _RUN.workflow, _RUN.workflow_id = workflow, handle.id
        console.print(
            f"started {workflow}: workflow id [bold]{handle.id}[/bold] "
            f"(database {settings.database_id})"
        )
    except ControlPlaneBusyError as exc:
        if not attach:
            _fail(f"{exc}" + (" (or pass --attach to wait for it)" if attach_hint else ""))
        wf_id = settings.controlplane_workflow_id
        running = await client.get_workflow_handle(wf_id).describe()
        handle = client.get_workflow_handle(
            wf_id, run_id=running.run_id, result_type=ApplyAllResult
        )
        task_queue = running.task_queue
        _RUN.workflow, _RUN.workflow_id = running.workflow_type, wf_id
        console.print(
            f"attached to the {running.workflow_type} already running on database "
            f"{settings.database_id}: workflow id [bold]{wf_id}[/bold] (run {running.run_id})"
        )
        await _warn_if_not_ours(client, handle, running.workflow_type, workflow, arg)
    if not wait:
        console.print(f"watch it: nexusctl progress (or temporal workflow describe -w {handle.id})")
        return None
    if not own_worker:
        await _warn_if_no_worker(client, settings, task_queue, f"{_RUN.workflow} {handle.id}")
    try:
        result = await _watch(handle, f"{_RUN.workflow} on {settings.database_id}")
    except WorkflowFailureError as exc:
        _fail(str(exc.cause))
    except asyncio.CancelledError:  # Ctrl-C: only this client stops
        if not own_worker:
            err_console.print(
                f"interrupted: {_RUN.workflow} {handle.id} keeps running; "
                "watch it with `nexusctl progress`",
                soft_wrap=True,
            )
        raise
    _summary(result)
    return result


def _summary(result: ApplyAllResult) -> None:
    console.print(
        f"[bold green]{result.status}[/bold green] in {result.duration_s:.1f} s: {result.reason}"
    )
    if result.packs:
        packs = Table(title="packs")
        for col in ("pack", "category", "version", "objects", "payload hash"):
            packs.add_column(col)
        for p in result.packs:
            packs.add_row(p.name, p.category, p.version, str(p.objects), p.payload_hash[:12])
        console.print(packs)
    for problem in result.formula_problems:
        console.print(f"[yellow]formula left out of its view:[/yellow] {escape(problem)}")


@app.command()
def worker() -> None:
    """Run the worker (same as `python worker.py`); Ctrl-C or SIGTERM stops it."""
    settings = _settings()
    _check_database(settings)
    with _sigterm_as_interrupt(), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, None))


@app.command()
def dev() -> None:
    """Start the Temporal dev server (with Web UI) and a worker; Ctrl-C or SIGTERM stops both."""
    settings = _settings()
    _check_database(settings)
    with _sigterm_as_interrupt(), dev_server(settings) as server:
        _announce_server(settings, server)
        console.print(f"worker for database {safe_url(settings.database_url)}; Ctrl-C to stop")
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(settings, server, reused_server=server is None))


@app.command()
def demo(app_pack: AppPack = None, dev_sample: DevSample = None) -> None:
    """Embedded stack (dev server + worker), then ApplyAll with live progress, then a summary.

    When a control-plane workflow already runs on the database, waits for that one.
    Ctrl-C stops at once; ApplyAll resumes when a worker runs again.
    """
    settings = _settings(quiet=True)
    _check_database(settings)
    arg = ApplyAllInput(app_pack_sources=_sources(app_pack), include_dev_sample=dev_sample)
    with _sigterm_as_interrupt(), dev_server(settings) as server:
        _announce_server(settings, server)

        async def body() -> ApplyAllResult | None:
            return await _run_operation(
                settings, "ApplyAll", arg, wait=True, attach=True, own_worker=True
            )

        asyncio.run(
            _with_worker(
                settings,
                server,
                body,
                lambda: _hard_exit(server, _interrupted_message(settings, server)),
            )
        )
    _print_status(settings)


@app.command("demo-sync")
def demo_sync(
    project: Annotated[Path, typer.Argument(help="SFDX project with data/sample-data-plan.json.")],
    shuffle: Annotated[bool, typer.Option(help="Shuffle: children may come first.")] = True,
    seed: Annotated[int | None, typer.Option(help="Shuffle seed.")] = None,
) -> None:
    """Embedded stack: install PROJECT and the salesforce-sync connector, sync its sample data."""
    settings = _settings(quiet=True)
    project = project.expanduser().resolve()
    plan = project / "data" / "sample-data-plan.json"
    if not plan.is_file():
        _fail(f"{plan} not found: the project has no Salesforce DX data plan")
    sources = [str(project), str(CONNECTOR_PACKS_DIR / "salesforce-sync")]
    _check_database(settings)

    async def body() -> None:
        await _run_operation(
            settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources), wait=True,
            attach=True, own_worker=True,
        )  # fmt: skip
        engine = _engine(settings)
        row = _connector_pack(settings, "salesforce-sync")
        requests = events_from_sfdx_plan(
            plan, installed_pack_id=row.install_id, namespace=row.namespace,
            shuffle=shuffle, seed=seed,
        )  # fmt: skip
        result = workqueue.enqueue(engine, requests)
        console.print(f"enqueued {result.inserted} events ({result.duplicates} already there)")
        client = await connect(settings)
        await start_fleet(client, settings)
        start = time.monotonic()
        try:
            with Live(console=console, refresh_per_second=4) as live:
                _RUN.live = live
                while True:
                    stats = workqueue.pack_queue_stats(engine, row.install_id)
                    states = stats[0].by_state() if stats else {}
                    live.update(f"sync: {states}  ({time.monotonic() - start:.1f} s)")
                    # blocked items wait for their parents (identity convergence)
                    busy = ("pending", "processing", "blocked")
                    if not any(states.get(k) for k in busy):
                        break
                    await asyncio.sleep(0.25)
        finally:
            _RUN.live = None
            _end_live_output()
        await signal_fleet(client, settings, "stop")
        _print_synced(engine, requests)

    with _sigterm_as_interrupt(), dev_server(settings) as server:
        _announce_server(settings, server)
        asyncio.run(
            _with_worker(
                settings,
                server,
                body,
                lambda: _hard_exit(server, _interrupted_message(settings, server)),
            )
        )


def _print_synced(engine: Any, requests: list[workqueue.EnqueueRequest]) -> None:
    objects = sorted({r.source_object for r in requests})
    table = Table(title="synced records")
    for col in ("object", "events", "rows in table"):
        table.add_column(col)
    with engine.connect() as conn:
        for obj in objects:
            events = sum(1 for r in requests if r.source_object == obj)
            q = conn.dialect.identifier_preparer.quote(obj)
            rows = conn.execute(sa_text(f"SELECT COUNT(*) FROM {q}")).scalar_one()
            table.add_row(obj, str(events), str(rows))
    console.print(table)


@app.command("apply-all")
def apply_all(
    app_pack: AppPack = None,
    dev_sample: DevSample = None,
    wait: Annotated[bool, typer.Option(help="Wait and show progress; exit 1 on failure.")] = False,
    policy: Annotated[str, typer.Option(help="always_apply or auto_start.")] = "always_apply",
    heartbeat_timeout: Annotated[float, typer.Option(help="Seconds.")] = 30.0,
    attach: Annotated[
        bool,
        typer.Option(
            help="If a control-plane workflow already runs on the database, wait for that one "
            "(with --wait) instead of failing."
        ),
    ] = False,
) -> None:
    """Start ApplyAll on the configured database (a running worker does the work)."""
    settings = _settings()
    arg = ApplyAllInput(_sources(app_pack), policy, dev_sample, heartbeat_timeout)
    asyncio.run(_run_operation(settings, "ApplyAll", arg, wait, attach=attach, attach_hint=True))


def _operation(workflow: str, doc: str) -> None:
    def command(
        app_pack: AppPack = None,
        dev_sample: DevSample = None,
        wait: Annotated[bool, typer.Option(help="Wait and show progress.")] = False,
    ) -> None:
        settings = _settings()
        arg = OperationInput(_sources(app_pack), dev_sample)
        asyncio.run(_run_operation(settings, workflow, arg, wait))

    command.__doc__ = doc
    name = "".join("-" + c.lower() if c.isupper() else c for c in workflow).lstrip("-")
    app.command(name)(command)


_operation("RunRepair", "Start RunRepair (invalidates the ApplyAll marker first).")
_operation("RebuildDerived", "Start RebuildDerived: rebuild every formula view.")
_operation("EnsureIndexes", "Start EnsureIndexes: create missing standard indexes.")
_operation("ApplyPacks", "Start ApplyPacks alone.")
_operation("InitL0", "Start InitL0: the application-neutral substrate only.")
_operation("ApplySourceConvergence", "Start ApplySourceConvergence (partial operator path).")


@app.command()
def progress() -> None:
    """Show the phases of the latest control-plane workflow on this database."""
    settings = _settings()
    wf_id = settings.controlplane_workflow_id

    async def go() -> None:
        client: Client = await connect(settings)
        handle = client.get_workflow_handle(wf_id, result_type=ApplyAllResult)
        try:
            running = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            _fail(
                f"no control-plane workflow has run on database {settings.database_id} yet "
                f"(workflow id {wf_id}); start one with `nexusctl apply-all`"
            )
        status = running.status.name.lower() if running.status else "unknown"
        if running.status == WorkflowExecutionStatus.COMPLETED:
            phases = (await handle.result()).phases  # no worker needed
        else:
            try:
                phases = await _query_progress(handle)
            except RPCError as exc:
                pollers = await _active_pollers(client, running.task_queue)
                if pollers == []:
                    _fail(
                        f"{running.workflow_type} {wf_id} ({status}) did not answer the progress "
                        f"query: no worker is polling task queue {running.task_queue}; "
                        + _start_worker_hint(settings)
                    )
                _fail(
                    f"{running.workflow_type} {wf_id} ({status}) did not answer the progress "
                    f"query: {exc.message}"
                )
        title = f"{running.workflow_type} {wf_id} ({status}, run {running.run_id})"
        console.print(phase_table(phases, title))

    asyncio.run(go())


ERROR_CHARS = 400


def _error_cell(error: str | None) -> Text:
    """Up to ``ERROR_CHARS`` of an error, as plain text (wrapped by the table)."""
    error = _one_line(error or "")
    return Text(error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1] + "…")


def _print_status(settings: Settings) -> None:
    engine = _existing_engine(settings)
    if engine is None:
        console.print(_no_database(settings))
        return
    if t.bootstrap_state.name not in table_names(engine):
        console.print(f"database {safe_url(settings.database_url)} has no control-plane tables yet")
        return
    # Key/value rows rather than a table: the full run id and a long error must
    # fit (wrapped) even on an 80-column terminal.
    marks = Table.grid(padding=(0, 2))
    marks.add_column(no_wrap=True)
    marks.add_column(overflow="fold")
    colors = {"completed": "green", "failed": "red"}
    with engine.connect() as conn:
        for row in conn.execute(select(t.bootstrap_state)).mappings():
            color = colors.get(row["Status"], "yellow")
            state = Text(row["Status"], style=color) + Text(f" (phase {row['Phase']})")
            marks.add_row(Text(row["StateKey"], style="bold"), state)
            marks.add_row("  run", row["RunID"])
            if row["LastError"]:
                marks.add_row("  last error", _error_cell(row["LastError"]))
        packs = Table(title="installed packs")
        for col in ("pack", "category", "version", "status", "payload hash"):
            packs.add_column(col)
        pack_errors = Table.grid(padding=(0, 2))
        pack_errors.add_column(no_wrap=True)
        pack_errors.add_column(overflow="fold")
        for row in conn.execute(
            select(t.installed_pack).order_by(t.installed_pack.c.Name)
        ).mappings():
            packs.add_row(
                row["Name"], row["Category"], row["Version"], row["Status"],
                row["PayloadHash"][:12],
            )  # fmt: skip
            if row["LastError"]:
                pack_errors.add_row(f"{row['Name']} error", _error_cell(row["LastError"]))
    console.print(
        f"database {settings.database_id}: control-plane workflow id "
        f"{settings.controlplane_workflow_id}, task queues {settings.controlplane_task_queue}, "
        f"{settings.connector_task_queue} and {settings.identity_task_queue}"
    )
    console.print(f"[bold]markers[/bold] ({settings.database_id})")
    console.print(marks)
    console.print(packs)
    if pack_errors.row_count:
        console.print(pack_errors)
    marker = markers.read(engine)
    if marker is None or marker.status != markers.MarkerStatus.completed:
        console.print("[yellow]ApplyAll has not completed on this database[/yellow]")


@app.command()
def status() -> None:
    """Markers (with run id and last error) and installed packs of the configured database."""
    _print_status(_settings())


@packs_app.command("remove")
def packs_remove(name: str) -> None:
    """Remove an installed app or connector pack (its tables and data stay)."""
    settings = _settings()
    engine = _require_engine(settings)
    try:
        previous = remove_pack(engine, name)
    except NexusError as exc:
        _fail(str(exc))

    async def notify() -> bool:
        with contextlib.suppress(Exception):
            return await signal_fleet(await connect(settings), settings, "reconcile")
        return False

    signalled = asyncio.run(notify())
    console.print(
        f"removed {name} (was {previous})"
        + ("; connector fleet told to reconcile" if signalled else "")
    )


@packs_app.command("import-sfdx")
def import_sfdx(
    path: Path,
    out: Annotated[Path | None, typer.Option(help="Write the native pack YAML here.")] = None,
) -> None:
    """Import a Salesforce DX project as an app pack: validate, summarize, optionally write YAML.

    Also compiles every formula (each one that would be left out of its view
    is a warning) and checks the pack's dependencies against the shipped
    platform packs (a missing one, or a pack depending on itself, is an error).
    """
    _settings()
    try:
        pack = load_pack_source(path)
    except NexusError as exc:
        _fail(str(exc))
    try:
        platform = platform_packs(True)
    except NexusError as exc:
        _fail(f"cannot load the platform packs: {exc}")
    table = Table(title=f"{pack.name} {pack.version} ({pack.category.value}) from {path}")
    for col in ("object", "kind", "fields", "formulas"):
        table.add_column(col)
    for o in pack.objects:
        kind = "event" if o.kind == "event" else ("extends" if o.extends else "table")
        formulas = sum(1 for f in o.fields if f.formula)
        table.add_row(o.api_name, kind, str(len(o.fields)), str(formulas))
    console.print(table)
    for problem in _formula_problems(pack, platform):
        _warn(problem)
    _check_dependencies(pack, platform)
    if out is not None:
        out.write_text(
            yaml.safe_dump(pack.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
        )
        console.print(f"wrote {out}")


def _formula_problems(pack: PackManifest, platform: list[PackManifest]) -> list[str]:
    """``Object.Field: reason`` for each formula of ``pack`` its view would leave out.

    Compiled as RebuildDerived does (SQLite dialect); an object that extends a
    platform object is compiled with that object's fields too.
    """
    base: dict[str, ObjectSpec] = {o.api_name.lower(): o for p in platform for o in p.objects}
    problems = []
    for obj in pack.objects:
        if obj.kind == "event" or not any(f.formula for f in obj.fields):
            continue
        spec = obj
        existing = base.get(obj.api_name.lower())
        if obj.extends and existing is not None:
            fields = {f.api_name.lower(): f for f in existing.fields}
            fields.update({f.api_name.lower(): f for f in obj.fields})
            spec = existing.model_copy(update={"fields": tuple(fields.values()), "extends": False})
        own = {f.api_name.lower() for f in obj.fields}
        _select, found = build_view_select(spec, object_table(spec, "sqlite"), "sqlite")
        for p in found:
            if p.field_api_name.lower() in own:
                problems.append(
                    f"{p.object_api_name}.{p.field_api_name}: {p.reason} "
                    f"(left out of view {view_name(p.object_api_name)})"
                )
    return problems


def _check_dependencies(pack: PackManifest, platform: list[PackManifest]) -> None:
    """Fail unless ``pack`` orders after the shipped platform packs (as plan-packs will)."""
    if pack.name in pack.depends_on:
        _fail(f"pack {pack.name} depends on itself (depends_on: {', '.join(pack.depends_on)})")
    try:
        order_packs([*platform, pack])
    except NexusError as exc:
        _fail(f"{exc} (checked against the shipped platform packs)")


def _connector_pack(settings: Settings, name: str) -> ConnectorPackRow:
    engine = _require_engine(settings)
    for row in list_connector_packs(engine):
        if row.namespace == name and not row.drain_only:
            return row
    installed = ", ".join(r.namespace for r in list_connector_packs(engine)) or "none"
    _fail(f"connector pack {name!r} is not installed and active (installed: {installed})")


async def _wake(settings: Settings, install_id: str) -> None:
    with contextlib.suppress(Exception):  # no fleet running: the idle timer finds the work
        await signal_fleet(await connect(settings), settings, "wake", install_id)


def _enqueue(settings: Settings, requests: list[workqueue.EnqueueRequest], install_id: str) -> None:
    engine = _engine(settings)
    result = workqueue.enqueue(engine, requests)
    console.print(f"enqueued {result.inserted} event(s), {result.duplicates} duplicate(s) skipped")
    asyncio.run(_wake(settings, install_id))


PackName = Annotated[str, typer.Option("--pack", help="Connector pack name.")]


@events_app.command("enqueue")
def events_enqueue(file: Path, pack: PackName = "salesforce-sync") -> None:
    """Enqueue events from a JSON-lines FILE (one event object per line).

    Keys: event_kind, idempotency_key, source_object, source_id, payload, and
    optionally route_version, queue_class, target_object, target_remote_id.
    """
    settings = _settings()
    row = _connector_pack(settings, pack)
    requests = []
    try:
        lines = file.read_text().splitlines()
    except OSError as exc:
        _fail(f"events file {file}: {exc.strerror or exc}")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            requests.append(
                workqueue.EnqueueRequest(
                    installed_pack_id=row.install_id, namespace=row.namespace, **data
                )
            )
        except (ValueError, TypeError) as exc:
            _fail(f"{file}:{n}: {exc}")
    _enqueue(settings, requests, row.install_id)


@events_app.command("import-sfdx-data")
def events_import_sfdx_data(
    plan: Path,
    pack: PackName = "salesforce-sync",
    shuffle: Annotated[bool, typer.Option(help="Shuffle: children may arrive first.")] = False,
    seed: Annotated[int | None, typer.Option(help="Shuffle seed.")] = None,
) -> None:
    """Turn a Salesforce DX data plan (sample-data-plan.json) into inbound events."""
    settings = _settings()
    row = _connector_pack(settings, pack)
    try:
        requests = events_from_sfdx_plan(
            plan, installed_pack_id=row.install_id, namespace=row.namespace, shuffle=shuffle,
            seed=seed,
        )  # fmt: skip
    except NexusError as exc:
        _fail(str(exc))
    _enqueue(settings, requests, row.install_id)


@events_app.command("replay")
def events_replay(work_id: str) -> None:
    """Replay a failed work item: a new item for the same event (ReplayOfWorkId set)."""
    settings = _settings()
    engine = _require_engine(settings)
    try:
        new_id = workqueue.replay(engine, work_id)
    except NexusError as exc:
        _fail(str(exc))
    console.print(f"replayed {work_id} as {new_id}")


@connectors_app.command("start")
def connectors_start() -> None:
    """Start the database's ConnectorFleet (or attach to the running one)."""
    settings = _settings()

    async def go() -> str:
        handle = await start_fleet(await connect(settings), settings)
        return handle.id

    console.print(f"connector fleet running: workflow id {asyncio.run(go())}")


@connectors_app.command("status")
def connectors_status() -> None:
    """Per pack: workers, queue depth by state and class, oldest pending age, failures."""
    settings = _settings()
    engine = _existing_engine(settings)
    if engine is None:
        console.print(_no_database(settings))
        return
    packs = list_connector_packs(engine)
    if not packs:
        console.print("no connector pack is installed")
        return
    stats = {s.installed_pack_id: s for s in workqueue.pack_queue_stats(engine)}

    problem: str | None = None

    async def pools() -> tuple[dict[str, SupervisorStatus], FleetStatus | None]:
        nonlocal problem
        try:
            client = await connect(settings)
            handle = client.get_workflow_handle(fleet_workflow_id(settings.database_id))
            fleet = await handle.query("status", result_type=FleetStatus, rpc_timeout=QUERY_TIMEOUT)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                problem = expected_failure(exc) or str(exc)
            return {}, None
        except Exception as exc:  # the table is still worth printing; the command fails
            problem = expected_failure(exc) or f"{type(exc).__name__}: {exc}"
            return {}, None
        out: dict[str, SupervisorStatus] = {}
        for pool in fleet.pools:
            sup = client.get_workflow_handle(pool.supervisor_workflow_id)
            with contextlib.suppress(Exception):
                out[pool.install_id] = await sup.query(
                    "status", result_type=SupervisorStatus, rpc_timeout=QUERY_TIMEOUT
                )
        return out, fleet

    running, fleet = asyncio.run(pools())
    table = Table(title=f"connector packs ({settings.database_id})")
    for col in ("pack", "install", "status", "workers", "queue (state/class)", "oldest pending",
                "failures"):  # fmt: skip
        table.add_column(col)
    for row in packs:
        st = stats.get(row.install_id)
        depth = ", ".join(f"{s}/{c}={n}" for (s, c), n in sorted(st.counts.items())) if st else ""
        oldest = f"{st.oldest_pending_age_s:.0f} s" if st and st.oldest_pending_age_s else ""
        failures = ", ".join(f"{k}={v}" for k, v in st.failures_by_class.items()) if st else ""
        pool = running.get(row.install_id)
        workers = (
            f"{len(pool.workers)} ({sum(w.restarts for w in pool.workers)} restarts)"
            + (", draining" if pool.draining else "")
            if pool
            else "not running"
        )
        table.add_row(row.namespace, row.install_id[:8], row.status, workers, depth, oldest,
                      failures)  # fmt: skip
    console.print(table)
    if fleet is not None:
        _print_fleet_problems(fleet)
    elif problem is None:
        console.print(
            f"no connector fleet runs for database {settings.database_id} "
            "(start it with `nexusctl connectors start`)"
        )
    else:
        # "not running" above may be wrong: the fleet's own answer is unknown.
        _fail(
            f"cannot query the connector fleet {fleet_workflow_id(settings.database_id)}: {problem}"
        )


def _print_fleet_problems(fleet: FleetStatus) -> None:
    """The fleet's blocked packs (not served) and degraded packs, with their reasons."""
    if fleet.last_error:
        console.print(f"[yellow]last reconcile error:[/yellow] {fleet.last_error}")
    if not fleet.blocked and not fleet.degraded:
        return
    table = Table(title="connector packs not served or degraded")
    for col in ("pack", "install", "state", "reason"):
        table.add_column(col)
    problems = [(k, "blocked", r) for k, r in fleet.blocked.items()]
    problems += [(k, "degraded", r) for k, r in fleet.degraded.items()]
    for key, state, reason in sorted(problems):
        namespace, _, install_id = key.partition("/")
        color = "red" if state == "blocked" else "yellow"
        table.add_row(namespace, install_id[:8], f"[{color}]{state}[/{color}]", Text(reason))
    console.print(table)


def main() -> None:
    """Console-script entry point (``nexusctl = "nexusctl.cli:main"``).

    Runs the app in typer's standalone mode: usage errors print typer's
    message and exit 2, Ctrl-C exits 130, an expected failure prints
    ``error: <one line>`` on stderr and exits 1 (see :class:`NexusGroup`),
    and an unexpected exception is a bug and keeps its traceback.

    A finished command leaves with ``os._exit`` after flushing output and
    logging: the Temporal SDK's Rust threads can abort CPython's finalization
    ("PyGILState_Release ... Python runtime state: finalizing",
    temporalio/sdk-python#300), which would turn a success into a SIGABRT.
    """
    try:
        app(prog_name="nexusctl")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if not isinstance(code, int):  # sys.exit(None) or sys.exit("message")
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
