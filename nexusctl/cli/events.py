"""``nexusctl events ...``: enqueue inbound connector events, import a Salesforce DX
data plan as events, replay a failed work item.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from nexuscrm.catalog import Catalog, load_catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.eventfile import EventFileError, read_event_file
from nexuscrm.connectors.importer import (
    MISSING_DATA_FILE,
    RefusedRecord,
    import_sfdx_plans,
    project_scope,
    upsert_route,
)
from nexuscrm.connectors.routes import ConnectorPackRow, RouteResolver, list_connector_packs
from nexuscrm.errors import NexusError
from nexuscrm.settings import Settings
from nexusctl.cli.common import load_settings, open_engine
from nexusctl.cli.render import console, err_console, fail, fail_lines, require_engine
from nexusctl.temporal import connect, signal_fleet

events_app = typer.Typer(help="Inbound connector events.", no_args_is_help=True)

PackName = Annotated[str, typer.Option("--pack", help="Connector pack name.")]


def connector_pack(settings: Settings, name: str) -> ConnectorPackRow:
    """The installed, active connector pack ``name``; exits with an error otherwise."""
    engine = require_engine(settings)
    for row in list_connector_packs(engine):
        if row.namespace == name and not row.drain_only:
            return row
    installed = ", ".join(r.namespace for r in list_connector_packs(engine)) or "none"
    fail(f"connector pack {name!r} is not installed and active (installed: {installed})")


def installed_catalog(settings: Settings) -> Catalog:
    """The installed objects and fields (what a data plan's records are checked against)."""
    with require_engine(settings).connect() as conn:
        return load_catalog(conn)


async def _wake(settings: Settings, install_id: str) -> str | None:
    """Wake the fleet's pool of ``install_id``; a warning when no fleet was reached
    (none runs, or Temporal does not answer): the events wait in the queue."""
    waiting = "the events wait in the queue until a fleet serves it"
    try:
        if await signal_fleet(await connect(settings), settings, "wake", install_id):
            return None
    except Exception as exc:  # the events are stored; only the wake is missing
        return (
            f"warning: Temporal at {settings.temporal_address} did not take the wake "
            f"({type(exc).__name__}: {exc}); {waiting}"
        )
    return (
        f"warning: no connector fleet runs for database {settings.database_id}; {waiting} "
        "(`nexusctl connectors start`, with a `nexusctl worker` running)"
    )


def _enqueue(
    settings: Settings, requests: list[queue.EnqueueRequest], install_id: str, source: str
) -> None:
    engine = open_engine(settings)
    try:
        result = queue.enqueue(engine, requests)
    except queue.InvalidWorkRequest as exc:
        fail(f"{source}: {exc}")
    console.print(f"enqueued {result.inserted} event(s), {result.duplicates} duplicate(s) skipped")
    warning = asyncio.run(_wake(settings, install_id))
    if warning:
        err_console.print(escape(warning), soft_wrap=True)


@events_app.command("enqueue")
def events_enqueue(file: Path, pack: PackName = "salesforce-sync") -> None:
    """Enqueue events from a JSON-lines FILE (one event object per line).

    Keys: event_kind, idempotency_key, source_object, source_id, payload (an
    object), and optionally route_version, queue_class (interactive, default,
    bulk), target_object, target_remote_id. The whole file is checked first,
    an upsert's payload against the installed objects and fields too: any
    problem (listed by line) enqueues nothing. A key already stored is
    skipped as a duplicate when its event is the same, and refused (exit 1,
    nothing enqueued) when its content differs: one key is one event. Limits: 64 MiB a file, 1 MiB
    a line, 64 levels of JSON nesting.
    """
    settings = load_settings()
    row = connector_pack(settings, pack)
    engine = require_engine(settings)
    try:
        requests = read_event_file(
            file,
            installed_pack_id=row.install_id,
            namespace=row.namespace,
            resolver=RouteResolver(engine),
            catalog=installed_catalog(settings),
        )
    except EventFileError as exc:
        fail_lines(
            f"events file {file}: {len(exc.problems)} problem(s); nothing was enqueued",
            exc.problems,
        )
    _enqueue(settings, requests, row.install_id, f"events file {file}")


@events_app.command("import-sfdx-data")
def events_import_sfdx_data(
    plans: Annotated[list[Path], typer.Argument(help="Data plan(s), imported in this order.")],
    pack: PackName = "salesforce-sync",
    shuffle: Annotated[bool, typer.Option(help="Shuffle: children may arrive first.")] = False,
    seed: Annotated[int | None, typer.Option(help="Shuffle seed.")] = None,
    scope: Annotated[
        str | None,
        typer.Option(help="Prefix of remote ids and keys (default: the project's folder name)."),
    ] = None,
) -> None:
    """Turn Salesforce DX data plans (sample-data-plan.json) into inbound events.

    Every problem of every plan and data file (shape, paths outside the
    plan's folder, objects, fields and values the installed catalog cannot
    store) is listed at once and nothing is enqueued. Records whose ``@ref``
    cannot resolve are listed (class unresolvable-reference) and not
    enqueued; the rest are, then the command exits 1 when any was refused.
    """
    settings = load_settings()
    row = connector_pack(settings, pack)
    route = upsert_route(row.pack)
    try:
        result = import_sfdx_plans(
            plans, installed_pack_id=row.install_id, namespace=row.namespace, shuffle=shuffle,
            seed=seed, scope=scope or project_scope(plans[0]),
            catalog=installed_catalog(settings) if route else None,
            destination_object=route.destination_object if route else None,
            field_map=route.field_map if route else None,
        )  # fmt: skip
    except NexusError as exc:
        fail(str(exc))
    _enqueue(settings, result.events, row.install_id, "data plan(s) " + ", ".join(map(str, plans)))
    report_refused(result.refused)


def report_refused(refused: list[RefusedRecord]) -> None:
    """List the records an import refused (one line each) and exit 1; no-op when none.

    A missing data file is one line for every record of it: the count says
    so (``2 record(s) and every record of 1 missing data file refused``),
    never "1 record" for a file of many."""
    if not refused:
        return
    files = sum(1 for r in refused if r.failure_class == MISSING_DATA_FILE)
    parts = [f"{len(refused) - files} record(s)"] if len(refused) > files else []
    if files:
        parts.append(f"every record of {files} missing data file(s)")
    fail_lines(
        f"{' and '.join(parts)} refused, the rest enqueued:", [str(r) for r in refused], shown=50
    )


@events_app.command("replay")
def events_replay(work_id: str) -> None:
    """Replay a failed work item: a new item for the same event (ReplayOfWorkId set)."""
    settings = load_settings()
    engine = require_engine(settings)
    try:
        new_id = queue.replay(engine, work_id)
    except NexusError as exc:
        fail(str(exc))
    console.print(f"replayed {work_id} as {new_id}")


@events_app.command("failed")
def events_failed(
    pack: Annotated[
        str | None, typer.Option("--pack", help="Only this connector pack (its name).")
    ] = None,
    failure_class: Annotated[
        str | None, typer.Option("--class", help="Only this failure class (e.g. value-invalid).")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Most items listed.")] = 50,
) -> None:
    """List failed work items not replayed yet, newest first: the id to replay, the
    event (kind, source object and id), the failure class, count and summary."""
    settings = load_settings()
    engine = require_engine(settings)
    install_id = connector_pack(settings, pack).install_id if pack else None
    items, total = queue.failed_items(engine, install_id, failure_class, limit)
    if not items:
        console.print("no failed work item waits for a replay")
        return
    table = Table(title=f"failed work items ({settings.database_id})")
    for col in ("work id", "pack", "event", "source", "class", "failures", "last failure",
                "summary"):  # fmt: skip
        table.add_column(col, overflow="fold")
    for it in items:
        when = f"{it.last_failure_at:%Y-%m-%d %H:%M:%S}" if it.last_failure_at else ""
        summary = it.failure_summary if len(it.failure_summary) <= 200 else (
            it.failure_summary[:200] + "..."
        )  # fmt: skip
        table.add_row(
            it.work_id, it.namespace, it.event_kind, f"{it.source_object} {it.source_id}".strip(),
            it.failure_class, str(it.failure_count), when, escape(summary),
        )  # fmt: skip
    console.print(table)
    shown = f" (the newest {len(items)} shown)" if total > len(items) else ""
    console.print(
        f"{total} failed item(s) not replayed{shown}; replay one with "
        "`nexusctl events replay WORK_ID`"
    )
