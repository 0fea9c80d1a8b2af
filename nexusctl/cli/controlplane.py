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
from nexuscrm.controlplane.candidate import load_candidate
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
    warn,
)
from nexusctl.cli.retrying import with_retries
from nexusctl.temporal import ControlPlaneBusyError, connect, start_controlplane

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


async def _warn_if_no_worker(
    client: Client, settings: Settings, task_queue: str, what: str
) -> None:
    pollers = await active_pollers(client, task_queue, wait_s=2.0)
    if pollers == []:
        warn(
            f"no worker is polling task queue {task_queue}, so {what} waits until one does: "
            + _start_worker_hint(settings)
        )


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
        warn(
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
    warn(
        f"the running ApplyAll was started with other arguments (app packs: {started or 'none'}) "
        "and is not restarted: run this command again when it ends"
    )


async def run_operation(
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
        RUN.workflow, RUN.workflow_id = workflow, handle.id
        console.print(
            f"started {workflow}: workflow id [bold]{handle.id}[/bold] "
            f"(database {settings.database_id})"
        )
    except ControlPlaneBusyError as exc:
        if not attach:
            fail(f"{exc}" + (" (or pass --attach to wait for it)" if attach_hint else ""))
        wf_id = settings.controlplane_workflow_id
        running = await client.get_workflow_handle(wf_id).describe()
        handle = client.get_workflow_handle(
            wf_id, run_id=running.run_id, result_type=ApplyAllResult
        )
        task_queue = running.task_queue
        RUN.workflow, RUN.workflow_id = running.workflow_type, wf_id
        console.print(
            f"attached to the {running.workflow_type} already running on database "
            f"{settings.database_id}: workflow id [bold]{wf_id}[/bold] (run {running.run_id})"
        )
        await _warn_if_not_ours(client, handle, running.workflow_type, workflow, arg)
    if not wait:
        console.print(f"watch it: nexusctl progress (or temporal workflow describe -w {handle.id})")
        return None
    if not own_worker:
        await _warn_if_no_worker(client, settings, task_queue, f"{RUN.workflow} {handle.id}")
    try:
        result = await _watch(handle, f"{RUN.workflow} on {settings.database_id}")
    except WorkflowFailureError as exc:
        fail(str(exc.cause))
    except asyncio.CancelledError:  # Ctrl-C: only this client stops
        if not own_worker:
            err_console.print(
                f"interrupted: {RUN.workflow} {handle.id} keeps running; "
                "watch it with `nexusctl progress`",
                soft_wrap=True,
            )
        raise
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


def apply_all(
    app_pack: AppPack = None,
    dev_sample: DevSample = None,
    wait: Annotated[bool, typer.Option(help="Wait and show progress; exit 1 on failure.")] = False,
    policy: Annotated[
        str | None,
        typer.Option(
            help="always_apply, auto_start or exact_candidate (default: exact_candidate "
            "with --candidate, else always_apply)."
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
            help="If a control-plane workflow already runs on the database, wait for that one "
            "(with --wait) instead of failing."
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
) -> None:
    """Start ApplyAll on the configured database (a running worker does the work)."""
    settings = load_settings()
    _refuse_dev_sample_in_production(settings, dev_sample)
    spec = load_candidate(candidate) if candidate is not None else None
    if spec is not None and app_pack:
        fail("give the app packs either with --app-pack or in the --candidate file, not both")
    chosen = policy or ("exact_candidate" if spec is not None else "always_apply")
    arg = ApplyAllInput(
        sources(app_pack),
        chosen,
        dev_sample,
        heartbeat_timeout,
        defer_formula_view_rebuild=defer_formula_view_rebuild,
        candidate=spec,
    )
    asyncio.run(run_operation(settings, "ApplyAll", arg, wait, attach=attach, attach_hint=True))


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
    ) -> None:
        settings = load_settings()
        _refuse_dev_sample_in_production(settings, dev_sample)
        arg = OperationInput(sources(app_pack), dev_sample)
        result = asyncio.run(run_operation(settings, workflow, arg, wait))
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


def progress() -> None:
    """Show the phases of the latest control-plane workflow on this database."""
    settings = load_settings()
    wf_id = settings.controlplane_workflow_id

    async def go() -> None:
        client: Client = await connect(settings)
        handle = client.get_workflow_handle(wf_id, result_type=ApplyAllResult)
        try:
            running = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            fail(
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
                pollers = await active_pollers(client, running.task_queue)
                if pollers == []:
                    fail(
                        f"{running.workflow_type} {wf_id} ({status}) did not answer the progress "
                        f"query: no worker is polling task queue {running.task_queue}; "
                        + _start_worker_hint(settings)
                    )
                fail(
                    f"{running.workflow_type} {wf_id} ({status}) did not answer the progress "
                    f"query: {exc.message}"
                )
        title = f"{running.workflow_type} {wf_id} ({status}, run {running.run_id})"
        console.print(phase_table(phases, title))

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
    app.command()(status)
