"""Control-plane commands: ``apply-all``, the single operations (``run-repair``,
``rebuild-derived``, ``ensure-indexes``, ``apply-packs``, ``init-l0``,
``apply-source-convergence``), ``progress`` and ``status``; and
:func:`run_operation`, which starts one and shows its live progress.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.text import Text
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)
from temporalio.service import RPCError, RPCStatusCode

from nexuscrm.contracts import (
    ApplyAllInput,
    ApplyAllResult,
    OperationInput,
    PhaseReport,
    heartbeat_timeout_problem,
)
from nexuscrm.contracts.controlplane import APPLY_ALL_POLICIES
from nexuscrm.contracts.controlplane_queue import (
    QUEUED_OPERATIONS,
    ControlPlaneTicket,
    RemovePackInput,
)
from nexuscrm.controlplane.candidate import load_candidate
from nexuscrm.errors import NexusError
from nexuscrm.settings import Settings
from nexusctl.cli.common import (
    QUERY_TIMEOUT,
    RUN,
    AppPack,
    DevSample,
    active_pollers,
    load_settings,
    safe_url,
    sources,
)
from nexusctl.cli.render import (
    console,
    end_live_output,
    err_console,
    fail,
    phase_table,
    print_status,
    print_summary,
    queue_table,
    usage_fail,
    warn,
)
from nexusctl.cli.retrying import with_retries
from nexusctl.controlplane_queue import (
    ENTITY_TYPE,
    ControlPlaneBusyError,
    build_request,
    operation_handle,
    queue_status,
    settled,
    submit,
    wait_turn,
)
from nexusctl.temporal import connect

# The single operations: workflow type and help text (the command is the
# workflow type in kebab case: RunRepair -> run-repair).
OPERATIONS = (
    ("RunRepair", "Start RunRepair (invalidates the ApplyAll marker first)."),
    ("RebuildDerived", "Start RebuildDerived: rebuild every formula view."),
    ("EnsureIndexes", "Start EnsureIndexes: create missing standard indexes."),
    ("ApplyPacks", "Start ApplyPacks alone."),
    ("InitL0", "Start InitL0: the application-neutral substrate only."),
    ("ApplySourceConvergence", "Start ApplySourceConvergence (partial operator path)."),
)

# ---------------------------------------------------------------------------
# workers and task queues


def _start_worker_hint(settings: Settings) -> str:
    return (
        "start `nexusctl worker` (or `nexusctl dev`) with the same "
        f"NEXUS_DATABASE_URL ({safe_url(settings.database_url)})"
    )


SUBMIT_NOTICE_S = 5.0
"""Seconds a request may wait for a worker to take it before the CLI says so."""


async def _warn_if_no_worker(
    client: Client, settings: Settings, task_queue: str, what: str
) -> bool:
    """Warn when no worker polls ``task_queue``; returns whether it warned."""
    pollers = await active_pollers(client, task_queue, wait_s=2.0)
    if pollers == []:
        warn(
            f"no worker is polling task queue {task_queue}, so {what} waits until one does: "
            + _start_worker_hint(settings)
        )
        return True
    return False


# ---------------------------------------------------------------------------
# running an operation


async def _query_progress(handle: WorkflowHandle[Any, Any]) -> list[PhaseReport]:
    phases = await handle.query(
        "progress", result_type=list[PhaseReport], rpc_timeout=QUERY_TIMEOUT
    )
    return await with_retries(handle, phases)


async def _watch(handle: WorkflowHandle[Any, ApplyAllResult], title: str) -> ApplyAllResult:
    """Show live progress until the workflow ends; return its result."""
    task = asyncio.ensure_future(handle.result())
    waiting = Text(f"waiting for {handle.id} to report progress ...")
    try:
        with Live(waiting, console=console, refresh_per_second=4) as live:
            RUN.live = live
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
            RUN.live = None
    finally:
        RUN.live = None
        if not task.done():
            task.cancel()
        end_live_output()
    return result


def _announce(settings: Settings, workflow: str, ticket: ControlPlaneTicket) -> None:
    """Say what became of the request: started, queued behind others, or joined."""
    entry = ticket.entry
    where = f"database {settings.database_id}"
    if ticket.coalesced:
        console.print(
            f"attached to the {entry.operation} already {entry.state} on {where}: workflow id "
            f"[bold]{entry.workflow_id}[/bold] ({entry.waiters} requests share its result)"
        )
    elif ticket.ahead:
        console.print(
            f"queued {workflow} on {where} behind {'; '.join(ticket.ahead)}: workflow id "
            f"[bold]{entry.workflow_id}[/bold] starts when its turn comes (dropped if it has "
            f"not started by {entry.deadline})"
        )
    else:
        console.print(f"started {workflow}: workflow id [bold]{entry.workflow_id}[/bold] ({where})")


async def run_operation(
    settings: Settings,
    workflow: str,
    arg: ApplyAllInput | OperationInput | RemovePackInput,
    wait: bool,
    *,
    attach: bool = False,
    no_queue: bool = False,
    own_worker: bool = False,
) -> ApplyAllResult | None:
    """Queue ``workflow`` on the database; with ``wait``, wait for its turn, show progress,
    return its result.

    Every operation goes through the database's control-plane queue
    (``nexusctl.controlplane_queue``): it runs now when the control plane is
    idle, else waits its turn up to ``NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS``
    (then fails with a timeout). ``no_queue``: fail at once while busy.
    ``attach``: join an identical request already queued or running (an
    ``auto_start`` ApplyAll always does). ``own_worker``: this process runs
    the worker (no poller check).
    """
    client = await connect(settings)
    task_queue = settings.controlplane_task_queue
    warned = own_worker
    if not own_worker:
        # The request is answered by a worker: say so before waiting for one.
        warned = await _warn_if_no_worker(
            client, settings, task_queue, f"{workflow} on the database"
        )
    req = build_request(workflow, arg, settings, no_queue=no_queue, coalesce=attach)
    sending = asyncio.ensure_future(submit(client, settings, req))
    await asyncio.wait({sending}, timeout=SUBMIT_NOTICE_S)
    if not sending.done() and not warned:
        # A worker that just stopped still looks alive to the server for ~90 s, so
        # no warning came above; and the request is not withdrawn when this command
        # is stopped (seen by a new user: a RunRepair given up on ran later).
        warn(
            f"no worker has taken {workflow} on the database yet (task queue {task_queue}); "
            "the server holds the request and it runs when a worker starts, even if this "
            "command is stopped: " + _start_worker_hint(settings)
        )
    try:
        ticket = await sending
    except ControlPlaneBusyError as exc:
        fail(str(exc))
    RUN.workflow, RUN.workflow_id = workflow, ticket.entry.workflow_id
    _announce(settings, workflow, ticket)
    if not wait:
        console.print(
            f"watch it: nexusctl queue, nexusctl progress "
            f"(or temporal workflow describe -w {ticket.entry.workflow_id})"
        )
        return None
    try:
        entry = await wait_turn(client, settings, ticket, req.wait_seconds)
    except NexusError as exc:
        fail(str(exc))
    handle = operation_handle(client, entry)
    try:
        result = await _watch(handle, f"{entry.operation} on {settings.database_id}")
    except WorkflowFailureError as exc:
        await settled(client, settings, entry.request_id)
        fail(str(exc.cause))
    except asyncio.CancelledError:  # Ctrl-C: only this client stops
        if not own_worker:
            err_console.print(
                f"interrupted: {entry.operation} {handle.id} keeps running (or waits its turn); "
                "watch it with `nexusctl queue` / `nexusctl progress`",
                soft_wrap=True,
            )
        raise
    await settled(client, settings, entry.request_id)
    print_summary(result)
    return result


# ---------------------------------------------------------------------------
# commands


def _heartbeat_timeout(value: float) -> float:
    """Typer callback: refuse an unusable ``--heartbeat-timeout`` before anything starts."""
    problem = heartbeat_timeout_problem(value)
    if problem:
        raise typer.BadParameter(problem)
    return value


def _policy(value: str | None) -> str | None:
    """Typer callback: refuse an unknown ``--policy`` before anything starts."""
    if value is not None and value not in APPLY_ALL_POLICIES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(APPLY_ALL_POLICIES)}")
    return value


NoQueue = Annotated[
    bool,
    typer.Option(
        "--no-queue",
        help="Refuse at once (exit 1) when another control-plane operation runs or waits on "
        "the database, instead of waiting for its turn.",
    ),
]


def apply_all(
    app_pack: AppPack = None,
    dev_sample: DevSample = None,
    wait: Annotated[bool, typer.Option(help="Wait and show progress; exit 1 on failure.")] = False,
    policy: Annotated[
        str | None,
        typer.Option(
            help="always_apply, auto_start or exact_candidate (default: exact_candidate "
            "with --candidate, else always_apply).",
            callback=_policy,
        ),
    ] = None,
    heartbeat_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a phase may go without a heartbeat (1 to 3600).",
            callback=_heartbeat_timeout,
        ),
    ] = 30.0,
    attach: Annotated[
        bool,
        typer.Option(
            help="Join an identical ApplyAll (same policy and packs) already queued or running "
            "instead of queueing another; never another operation (auto_start always joins)."
        ),
    ] = False,
    candidate: Annotated[
        Path | None,
        typer.Option(
            help="Exact candidate file (JSON/YAML: every pack with its digest, app packs with "
            "their source; `nexusctl candidate write` makes one). Skips only when exactly it "
            "is active and the whole target verifies; replaces --app-pack."
        ),
    ] = None,
    defer_formula_view_rebuild: Annotated[
        bool,
        typer.Option(
            help="Create or replace no view (old pods may still serve them); owes a rebuild "
            "that `nexusctl rebuild-derived` settles in the activation window."
        ),
    ] = False,
    no_queue: NoQueue = False,
) -> None:
    """Queue ApplyAll on the configured database (a running worker does the work).

    It runs when the database's earlier control-plane operations are done,
    waiting up to NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS (600) for its turn.
    """
    if candidate is not None and app_pack:
        usage_fail(
            "give the app packs either with --app-pack or in the --candidate file, not both",
            "apply-all",
        )
    settings = load_settings()
    _refuse_dev_sample_in_production(settings, dev_sample)
    spec = load_candidate(candidate) if candidate is not None else None
    chosen = policy or ("exact_candidate" if spec is not None else "always_apply")
    arg = ApplyAllInput(
        sources(app_pack),
        chosen,
        dev_sample,
        heartbeat_timeout,
        defer_formula_view_rebuild=defer_formula_view_rebuild,
        candidate=spec,
    )
    asyncio.run(run_operation(settings, "ApplyAll", arg, wait, attach=attach, no_queue=no_queue))


def _refuse_dev_sample_in_production(settings: Settings, dev_sample: bool | None) -> None:
    """``--dev-sample`` never forces the DevSample pack into production (fail closed)."""
    if dev_sample and settings.is_production:
        fail(
            f"--dev-sample is refused in production (NEXUS_ENV={settings.env}): "
            "the DevSample pack never applies there"
        )


def _operation(workflow: str, doc: str) -> Callable[..., None]:
    """The command that starts ``workflow`` (help text ``doc``)."""

    def command(
        app_pack: AppPack = None,
        dev_sample: DevSample = None,
        wait: Annotated[bool, typer.Option(help="Wait and show progress.")] = False,
        no_queue: NoQueue = False,
    ) -> None:
        settings = load_settings()
        _refuse_dev_sample_in_production(settings, dev_sample)
        arg = OperationInput(sources(app_pack), dev_sample)
        result = asyncio.run(run_operation(settings, workflow, arg, wait, no_queue=no_queue))
        if result is not None and result.status == "partial":
            # A partial apply is not a ready control plane (the seed's cmd/setup).
            fail(
                f"{workflow} is a partial apply: {result.reason}; run "
                "`nexusctl apply-all` before relying on auto start"
            )

    command.__doc__ = doc
    return command


def _command_name(workflow: str) -> str:
    """``RunRepair`` -> ``run-repair``."""
    return "".join("-" + c.lower() if c.isupper() else c for c in workflow).lstrip("-")


def _no_answer(
    settings: Settings, running: Any, what: str, exc: RPCError, pollers: list[Any] | None
) -> None:
    status = running.status.name.lower() if running.status else "unknown"
    head = f"{running.workflow_type} {running.id} ({status}) did not answer the {what} query"
    if pollers == []:
        fail(
            f"{head}: no worker is polling task queue {running.task_queue}; "
            + _start_worker_hint(settings)
        )
    fail(f"{head}: {exc.message}")


async def _latest_operation(client: Client, settings: Settings, entity: Any) -> str | None:
    """The child workflow id of the running (else the last started) queued operation."""
    try:
        queue = await queue_status(client, settings)
    except RPCError as exc:
        # No worker to answer: the server's list still knows a finished operation.
        types = ", ".join(f"'{op}'" for op in QUEUED_OPERATIONS)
        listed = [
            w
            async for w in client.list_workflows(
                f"NexusDatabase = '{settings.database_id}' AND WorkflowType IN ({types})"
            )
        ]
        latest = max(listed, key=lambda w: w.start_time, default=None)
        if latest is not None and latest.status != WorkflowExecutionStatus.RUNNING:
            return str(latest.id)
        pollers = await active_pollers(client, entity.task_queue)
        _no_answer(settings, entity, "status", exc, pollers)
    if queue.running is not None:
        return queue.running.workflow_id
    ran = [e for e in queue.recent if e.started_at]
    return ran[-1].workflow_id if ran else None


def progress() -> None:
    """Show the phases of the running (else the latest) control-plane operation on this database."""
    settings = load_settings()
    wf_id = settings.controlplane_workflow_id

    async def go() -> None:
        client: Client = await connect(settings)
        never = (
            f"no control-plane workflow has run on database {settings.database_id} yet "
            f"(workflow id {wf_id}); start one with `nexusctl apply-all`"
        )
        handle = client.get_workflow_handle(wf_id, result_type=ApplyAllResult)
        try:
            running = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            fail(never)
        if running.workflow_type == ENTITY_TYPE:  # the queue: show its latest operation
            child_id = await _latest_operation(client, settings, running)
            if child_id is None:
                fail(never)
            handle = client.get_workflow_handle(child_id, result_type=ApplyAllResult)
            running = await handle.describe()
        status = running.status.name.lower() if running.status else "unknown"
        if running.status == WorkflowExecutionStatus.COMPLETED:
            phases = (await handle.result()).phases  # no worker needed
        else:
            try:
                phases = await _query_progress(handle)
            except RPCError as exc:
                pollers = await active_pollers(client, running.task_queue)
                _no_answer(settings, running, "progress", exc, pollers)
        title = f"{running.workflow_type} {running.id} ({status}, run {running.run_id})"
        console.print(phase_table(phases, title))

    asyncio.run(go())


def queue() -> None:
    """Show the database's control-plane queue: what runs, what waits, the last finished."""
    settings = load_settings()

    async def go() -> None:
        client: Client = await connect(settings)
        wf_id = settings.controlplane_workflow_id
        try:
            entity = await client.get_workflow_handle(wf_id).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            fail(f"no control-plane operation was queued on database {settings.database_id} yet")
        if entity.workflow_type != ENTITY_TYPE:
            fail(f"{entity.workflow_type} {wf_id} runs outside the queue (started before it)")
        try:
            state = await queue_status(client, settings)
        except RPCError as exc:
            _no_answer(
                settings, entity, "status", exc, await active_pollers(client, entity.task_queue)
            )
        console.print(queue_table(state))

    asyncio.run(go())


def status() -> None:
    """Markers (with run id and last error) and installed packs of the configured database."""
    print_status(load_settings())


def register(app: typer.Typer) -> None:
    """Add the control-plane commands to ``app``, in help order."""
    app.command("apply-all")(apply_all)
    for workflow, doc in OPERATIONS:
        app.command(_command_name(workflow))(_operation(workflow, doc))
    app.command()(progress)
    app.command()(queue)
    app.command()(status)
