"""Commands that run a worker in this process: ``worker``, ``dev`` (with the Temporal
dev server), ``demo`` and ``demo-sync`` (the embedded stack); and how they stop on
Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from sqlalchemy import text as sa_text

from nexuscrm.connectors import queue
from nexuscrm.connectors.importer import import_sfdx_plans, project_plans, upsert_route
from nexuscrm.contracts import ApplyAllInput, ApplyAllResult
from nexuscrm.errors import NexusError
from nexuscrm.log import log
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.cli.common import (
    RUN,
    SHUTDOWN_GRACE_S,
    STATE_DIR,
    AppPack,
    DevSample,
    active_pollers,
    check_database,
    load_settings,
    open_engine,
    safe_url,
    sources,
)
from nexusctl.cli.controlplane import run_operation
from nexusctl.cli.events import connector_pack, installed_catalog
from nexusctl.cli.render import (
    console,
    end_live_output,
    err_console,
    fail,
    print_status,
    usage_fail,
    warn,
)
from nexusctl.devserver import dev_server, stop_server, ui_port
from nexusctl.temporal import connect, signal_fleet, start_fleet
from nexusctl.worker import run_worker
from nexusctl.worker_processes import cores, run_processes

T = TypeVar("T")

# ---------------------------------------------------------------------------
# signals: Ctrl-C and SIGTERM


def _on_sigterm(_signum: int, _frame: object) -> None:
    interrupt = RUN.interrupt
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
    RUN.interrupt = (loop, callback)
    try:
        yield
    finally:
        RUN.interrupt = None
        if sigint:
            loop.remove_signal_handler(signal.SIGINT)


def _hard_exit(server: subprocess.Popen[bytes] | None, message: str) -> NoReturn:
    """Stop now: end the live display, print ``message``, stop our dev server, exit 130.

    Nothing is lost: workflow state is durable in Temporal, and the activity
    a stopped worker was running is retried when a worker runs again.
    """
    live = RUN.live
    if live is not None:
        RUN.live = None
        with contextlib.suppress(Exception):
            live.stop()
            end_live_output()
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
    if RUN.workflow_id is None:
        return "interrupted before ApplyAll started"
    where = (
        str(STATE_DIR / "temporal.db")
        if server is not None
        else f"the Temporal server at {settings.temporal_address}"
    )
    preposition = "in" if server is not None else "on"
    return (
        f"interrupted: {RUN.workflow} {RUN.workflow_id} keeps its state {preposition} {where} "
        "and resumes when a worker runs (`nexusctl dev` or `nexusctl demo`)"
    )


# ---------------------------------------------------------------------------
# workers


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
    pollers = await active_pollers(client, settings.controlplane_task_queue)
    if pollers:
        who = ", ".join(sorted({p.identity for p in pollers}))
        warn(
            f"{len(pollers)} worker(s) already poll task queue {settings.controlplane_task_queue} "
            f"there ({who}): they compete with this one for database {settings.database_id}'s "
            "work; stop them or run only one worker per database"
        )


async def _serve(
    settings: Settings, server: subprocess.Popen[bytes] | None, *, reused_server: bool = False
) -> None:
    """Run the worker until Ctrl-C / SIGTERM, then stop it gracefully: activities
    in flight get ``NEXUS_WORKER_SHUTDOWN_SECONDS`` (a batch hands back what it
    has not started), then the process exits at once if the worker has not
    stopped ``SHUTDOWN_GRACE_S`` after that.

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
                # a log line (JSON when the output is a file or a pipe), not a print
                log.info("stopping the worker", hint="Ctrl-C again to stop at once")
                grace = settings.worker_shutdown_seconds + SHUTDOWN_GRACE_S
                done, _ = await asyncio.wait({worker_task}, timeout=grace)
                if not done:
                    _hard_exit(server, f"the worker did not stop within {grace:.0f} s")
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
# commands


Processes = Annotated[
    str,
    typer.Option(
        "--processes",
        help="Worker processes on the same task queues: a count, or 'auto' for one per "
        "core (what we propose for inbound throughput). Default 1.",
    ),
]


def worker(processes: Processes = "1") -> None:
    """Run the worker (same as `python worker.py`); Ctrl-C or SIGTERM stops it."""
    count = cores() if processes.strip().lower() == "auto" else _count(processes)
    settings = load_settings()
    check_database(settings)
    if count > 1:
        with _sigterm_as_interrupt():
            raise typer.Exit(run_processes(count, settings.worker_shutdown_seconds))
    with _sigterm_as_interrupt(), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, None))


def _count(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        usage_fail(f"--processes: {raw!r} is not a whole number or 'auto'", "worker")
    if not 1 <= value <= 256:
        usage_fail(f"--processes: {value} is out of range (1-256)", "worker")
    return value


def dev() -> None:
    """Start the Temporal dev server (with Web UI) and a worker; Ctrl-C or SIGTERM stops both."""
    settings = load_settings()
    check_database(settings)
    with _sigterm_as_interrupt(), dev_server(settings) as server:
        _announce_server(settings, server)
        console.print(f"worker for database {safe_url(settings.database_url)}; Ctrl-C to stop")
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(settings, server, reused_server=server is None))


def demo(app_pack: AppPack = None, dev_sample: DevSample = None) -> None:
    """Embedded stack (dev server + worker), then ApplyAll with live progress, then a summary.

    When a control-plane workflow already runs on the database, waits for that one.
    Ctrl-C stops at once; ApplyAll resumes when a worker runs again.
    """
    settings = load_settings(quiet=True)
    check_database(settings)
    arg = ApplyAllInput(app_pack_sources=sources(app_pack), include_dev_sample=dev_sample)
    with _sigterm_as_interrupt(), dev_server(settings) as server:
        _announce_server(settings, server)

        async def body() -> ApplyAllResult | None:
            return await run_operation(
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
    print_status(settings)


def demo_sync(
    project: Annotated[Path, typer.Argument(help="SFDX project with data plans in data/.")],
    shuffle: Annotated[bool, typer.Option(help="Shuffle: children may come first.")] = True,
    seed: Annotated[int | None, typer.Option(help="Shuffle seed.")] = None,
    plan: Annotated[
        list[Path] | None,
        typer.Option(help="A data plan to sync (repeatable; default: every data/*plan*.json)."),
    ] = None,
) -> None:
    """Embedded stack: install PROJECT and the salesforce-sync connector, sync its sample data.

    The plans run in the order given, by default every ``data/*plan*.json``
    of the project sorted by file name; remote ids are scoped by the
    project's folder name.
    """
    settings = load_settings(quiet=True)
    project = project.expanduser().resolve()
    plans = [p.expanduser().resolve() for p in plan] if plan else project_plans(project)
    if not plans:
        fail(f"{project / 'data'} has no data plan (*plan*.json): pass --plan FILE")
    for p in plans:
        if not p.is_file():
            fail(f"data plan {p} not found")
    sources = [str(project), str(CONNECTOR_PACKS_DIR / "salesforce-sync")]
    check_database(settings)

    async def body() -> None:
        await run_operation(
            settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources), wait=True,
            attach=True, own_worker=True,
        )  # fmt: skip
        engine = open_engine(settings)
        row = connector_pack(settings, "salesforce-sync")
        console.print("data plans, in order: " + ", ".join(p.name for p in plans))
        route = upsert_route(row.pack)
        imported = import_sfdx_plans(
            plans, installed_pack_id=row.install_id, namespace=row.namespace,
            shuffle=shuffle, seed=seed, scope=project.name,
            catalog=installed_catalog(settings) if route else None,
            destination_object=route.destination_object if route else None,
            field_map=route.field_map if route else None,
        )  # fmt: skip
        for refused in imported.refused:
            warn(f"record refused, not synced: {refused}")
        requests = imported.events
        result = queue.enqueue(engine, requests)
        console.print(f"enqueued {result.inserted} events ({result.duplicates} already there)")
        client = await connect(settings)
        await start_fleet(client, settings)
        start = time.monotonic()
        try:
            with Live(console=console, refresh_per_second=4) as live:
                RUN.live = live
                while True:
                    stats = queue.pack_queue_stats(engine, row.install_id)
                    states = stats[0].by_state() if stats else {}
                    live.update(sync_line(states, time.monotonic() - start))
                    # blocked items wait for their parents (identity convergence)
                    busy = ("pending", "processing", "blocked")
                    if not any(states.get(k) for k in busy):
                        break
                    await asyncio.sleep(0.25)
        finally:
            RUN.live = None
            end_live_output()
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


def sync_line(states: dict[str, int], seconds: float) -> str:
    """demo-sync's progress line: the work items by state (none at zero), in the
    queue's order, and the seconds so far: ``sync: pending 3, succeeded 10 (2.5 s)``."""
    order = ("pending", "processing", "blocked", "succeeded", "failed")
    known = [(k, states[k]) for k in order if states.get(k)]
    other = [(k, n) for k, n in sorted(states.items()) if k not in order and n]
    counts = ", ".join(f"{k} {n}" for k, n in known + other)
    return f"sync: {counts or 'nothing queued'} ({seconds:.1f} s)"


def _print_synced(engine: Any, requests: list[queue.EnqueueRequest]) -> None:
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


def register(app: typer.Typer) -> None:
    """Add ``worker``, ``dev``, ``demo`` and ``demo-sync`` to ``app``, in help order."""
    app.command()(worker)
    app.command()(dev)
    app.command()(demo)
    app.command("demo-sync")(demo_sync)
