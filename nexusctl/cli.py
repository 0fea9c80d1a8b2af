"""``nexusctl``: run the worker and the embedded stack, start and watch
control-plane workflows, inspect a database. Settings come from NEXUS_* env.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table
from sqlalchemy import select
from sqlalchemy import text as sa_text
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

from nexuscrm.connectors import workqueue
from nexuscrm.connectors.importer import events_from_sfdx_plan
from nexuscrm.connectors.routes import ConnectorPackRow, list_connector_packs
from nexuscrm.controlplane import markers
from nexuscrm.controlplane.packs_apply import remove_pack
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.db.engine import make_engine, redacted
from nexuscrm.errors import NexusError
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.settings import Settings
from nexusctl.devserver import dev_server, ui_port
from nexusctl.temporal import (
    ControlPlaneBusyError,
    connect,
    fleet_workflow_id,
    signal_fleet,
    start_controlplane,
    start_fleet,
)
from nexusctl.worker import run_worker
from workflows.models import (
    ApplyAllInput,
    ApplyAllResult,
    DesiredPack,
    OperationInput,
    PhaseReport,
    SupervisorStatus,
)

app = typer.Typer(help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False)
packs_app = typer.Typer(help="Pack tools.", no_args_is_help=True)
app.add_typer(packs_app, name="packs")
connectors_app = typer.Typer(help="Connector inbound runtime.", no_args_is_help=True)
app.add_typer(connectors_app, name="connectors")
events_app = typer.Typer(help="Inbound connector events.", no_args_is_help=True)
app.add_typer(events_app, name="events")
console = Console()

AppPack = Annotated[
    list[str] | None,
    typer.Option("--app-pack", help="App pack source: SFDX project folder or pack.yaml (repeat)."),
]
DevSample = Annotated[
    bool | None,
    typer.Option("--dev-sample/--no-dev-sample", help="Default: on unless NEXUS_ENV=production."),
]


def _settings(quiet: bool = False) -> Settings:
    settings = Settings()
    # A live progress display and log lines on one terminal do not mix.
    level = "WARNING" if quiet and "NEXUS_LOG_LEVEL" not in os.environ else settings.log_level
    configure_logging(settings.log_format, level)
    return settings


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


def _sources(app_pack: list[str] | None) -> list[str]:
    # Resolve here: the worker may run in another working directory.
    return [str(Path(s).expanduser().resolve()) for s in (app_pack or [])]


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
        table.add_row(p.name, f"[{color}]{p.status}[/{color}]", secs, note[:160])
    return table


async def _watch(handle: WorkflowHandle[Any, ApplyAllResult], title: str) -> ApplyAllResult:
    """Show live progress until the workflow ends; return its result."""
    task = asyncio.ensure_future(handle.result())
    with Live(console=console, refresh_per_second=4) as live:
        while not task.done():
            with contextlib.suppress(Exception):
                phases = await handle.query("progress", result_type=list[PhaseReport])
                live.update(phase_table(phases, title))
            await asyncio.wait([task], timeout=0.3)
        try:
            result = task.result()
        except WorkflowFailureError:
            phases = await handle.query("progress", result_type=list[PhaseReport])
            live.update(phase_table(phases, title))
            raise
        live.update(phase_table(result.phases, title))
    return result


async def _run_operation(
    settings: Settings, workflow: str, arg: ApplyAllInput | OperationInput, wait: bool
) -> ApplyAllResult | None:
    client = await connect(settings)
    try:
        handle = await start_controlplane(client, settings, workflow, arg)
    except ControlPlaneBusyError as exc:
        _fail(str(exc))
    console.print(
        f"started {workflow}: workflow id [bold]{handle.id}[/bold] "
        f"(database {settings.database_id})"
    )
    if not wait:
        console.print(f"watch it: temporal workflow describe -w {handle.id}")
        return None
    try:
        result = await _watch(handle, f"{workflow} on {settings.database_id}")
    except WorkflowFailureError as exc:
        _fail(str(exc.cause))
        return None
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
        console.print(f"[yellow]formula left out of its view:[/yellow] {problem}")


@app.command()
def worker() -> None:
    """Run the worker (same as `python worker.py`)."""
    settings = _settings()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_worker(settings))


@app.command()
def dev() -> None:
    """Start the Temporal dev server (with Web UI) and a worker; Ctrl-C stops both."""
    settings = _settings()
    with dev_server(settings) as server:
        if server is not None:
            console.print(
                f"Temporal dev server at {settings.temporal_address}, "
                f"Web UI http://127.0.0.1:{ui_port(settings)}"
            )
        else:
            console.print(f"using the Temporal server already at {settings.temporal_address}")
        console.print(f"worker for database {redacted(settings.database_url)}; Ctrl-C to stop")
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_worker(settings))


@app.command()
def demo(app_pack: AppPack = None, dev_sample: DevSample = None) -> None:
    """Embedded stack (dev server + worker), then ApplyAll with live progress, then a summary."""
    settings = _settings(quiet=True)

    async def go() -> ApplyAllResult | None:
        stop = asyncio.Event()
        worker_task = asyncio.create_task(run_worker(settings, stop))
        try:
            return await _run_operation(
                settings,
                "ApplyAll",
                ApplyAllInput(app_pack_sources=_sources(app_pack), include_dev_sample=dev_sample),
                wait=True,
            )
        finally:
            stop.set()
            await worker_task

    with dev_server(settings):
        asyncio.run(go())
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

    async def go() -> None:
        stop = asyncio.Event()
        worker_task = asyncio.create_task(run_worker(settings, stop))
        try:
            await _run_operation(
                settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources), wait=True
            )
            engine = make_engine(settings.database_url)
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
            with Live(console=console, refresh_per_second=4) as live:
                while True:
                    stats = workqueue.pack_queue_stats(engine, row.install_id)
                    states = stats[0].by_state() if stats else {}
                    live.update(f"sync: {states}  ({time.monotonic() - start:.1f} s)")
                    if not states.get("pending") and not states.get("processing"):
                        break
                    await asyncio.sleep(0.25)
            await signal_fleet(client, settings, "stop")
            _print_synced(engine, requests)
        finally:
            stop.set()
            await worker_task

    with dev_server(settings):
        asyncio.run(go())


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
) -> None:
    """Start ApplyAll on the configured database (a running worker does the work)."""
    settings = _settings()
    arg = ApplyAllInput(_sources(app_pack), policy, dev_sample, heartbeat_timeout)
    asyncio.run(_run_operation(settings, "ApplyAll", arg, wait))


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

    async def go() -> None:
        client: Client = await connect(settings)
        handle = client.get_workflow_handle(settings.controlplane_workflow_id)
        phases = await handle.query("progress", result_type=list[PhaseReport])
        console.print(phase_table(phases, settings.controlplane_workflow_id))

    asyncio.run(go())


def _print_status(settings: Settings) -> None:
    engine = make_engine(settings.database_url)
    if t.bootstrap_state.name not in table_names(engine):
        console.print(f"database {redacted(settings.database_url)} has no control-plane tables yet")
        return
    marks = Table(title=f"markers ({settings.database_id})")
    for col in ("key", "status", "phase", "run", "last error"):
        marks.add_column(col)
    with engine.connect() as conn:
        for row in conn.execute(select(t.bootstrap_state)).mappings():
            marks.add_row(
                row["StateKey"], row["Status"], row["Phase"], row["RunID"][:12],
                (row["LastError"] or "")[:100],
            )  # fmt: skip
        packs = Table(title="installed packs")
        for col in ("pack", "category", "version", "status", "payload hash", "error"):
            packs.add_column(col)
        for row in conn.execute(
            select(t.installed_pack).order_by(t.installed_pack.c.Name)
        ).mappings():
            packs.add_row(
                row["Name"], row["Category"], row["Version"], row["Status"],
                row["PayloadHash"][:12], (row["LastError"] or "")[:80],
            )  # fmt: skip
    console.print(
        f"database {settings.database_id}: control-plane workflow id "
        f"{settings.controlplane_workflow_id}, task queues {settings.controlplane_task_queue} "
        f"and {settings.connector_task_queue}"
    )
    console.print(marks)
    console.print(packs)
    marker = markers.read(engine)
    if marker is None or marker.status != markers.MarkerStatus.completed:
        console.print("[yellow]ApplyAll has not completed on this database[/yellow]")


@app.command()
def status() -> None:
    """Markers and installed packs of the configured database, as tables."""
    _print_status(_settings())


@packs_app.command("remove")
def packs_remove(name: str) -> None:
    """Remove an installed app or connector pack (its tables and data stay)."""
    settings = _settings()
    try:
        previous = remove_pack(make_engine(settings.database_url), name)
    except NexusError as exc:
        _fail(str(exc))
        return

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
    """Import a Salesforce DX project as an app pack: validate, summarize, optionally write YAML."""
    _settings()
    try:
        pack = load_pack_source(path)
    except NexusError as exc:
        _fail(str(exc))
        return
    table = Table(title=f"{pack.name} {pack.version} ({pack.category.value}) from {path}")
    for col in ("object", "kind", "fields", "formulas"):
        table.add_column(col)
    for o in pack.objects:
        kind = "event" if o.kind == "event" else ("extends" if o.extends else "table")
        formulas = sum(1 for f in o.fields if f.formula)
        table.add_row(o.api_name, kind, str(len(o.fields)), str(formulas))
    console.print(table)
    if out is not None:
        out.write_text(
            yaml.safe_dump(pack.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
        )
        console.print(f"wrote {out}")


def _connector_pack(settings: Settings, name: str) -> ConnectorPackRow:
    engine = make_engine(settings.database_url)
    for row in list_connector_packs(engine):
        if row.namespace == name and not row.drain_only:
            return row
    installed = ", ".join(r.namespace for r in list_connector_packs(engine)) or "none"
    _fail(f"connector pack {name!r} is not installed and active (installed: {installed})")
    raise AssertionError("unreachable")


async def _wake(settings: Settings, install_id: str) -> None:
    with contextlib.suppress(Exception):  # no fleet running: the idle timer finds the work
        await signal_fleet(await connect(settings), settings, "wake", install_id)


def _enqueue(settings: Settings, requests: list[workqueue.EnqueueRequest], install_id: str) -> None:
    engine = make_engine(settings.database_url)
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
    for n, line in enumerate(file.read_text().splitlines(), start=1):
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
    try:
        new_id = workqueue.replay(make_engine(settings.database_url), work_id)
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
    engine = make_engine(settings.database_url)
    packs = list_connector_packs(engine)
    if not packs:
        console.print("no connector pack is installed")
        return
    stats = {s.installed_pack_id: s for s in workqueue.pack_queue_stats(engine)}

    async def pools() -> dict[str, SupervisorStatus]:
        try:
            client = await connect(settings)
            handle = client.get_workflow_handle(fleet_workflow_id(settings.database_id))
            running = await handle.query("status", result_type=list[DesiredPack])
        except Exception:
            return {}
        out: dict[str, SupervisorStatus] = {}
        for pool in running:
            sup = client.get_workflow_handle(pool.supervisor_workflow_id)
            with contextlib.suppress(Exception):
                out[pool.install_id] = await sup.query("status", result_type=SupervisorStatus)
        return out

    running = asyncio.run(pools())
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


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
