"""``nexusctl connectors ...``: start the connector fleet, show its status, list
identity waits (``waits``, from :mod:`nexusctl.cli.wakes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetStatus, SupervisorStatus
from nexusctl.cli.common import (
    QUERY_TIMEOUT,
    active_pollers,
    existing_engine,
    load_settings,
    no_database,
)
from nexusctl.cli.render import console, expected_failure, fail
from nexusctl.cli.wakes import waits
from nexusctl.temporal import connect, fleet_workflow_id, running_supervisors, start_fleet

connectors_app = typer.Typer(help="Connector inbound runtime.", no_args_is_help=True)
connectors_app.command("waits")(waits)


@connectors_app.command("start")
def connectors_start() -> None:
    """Start the database's ConnectorFleet (or attach to the running one). Exit 1
    when the configured SQLite database does not exist (an unset or mistyped
    ``NEXUS_DATABASE_URL``): a fleet for it would serve nothing."""
    settings = load_settings()
    engine = existing_engine(settings)
    if engine is None:
        fail(no_database(settings))
    else:
        engine.dispose()

    async def go() -> str:
        handle = await start_fleet(await connect(settings), settings)
        return handle.id

    console.print(f"connector fleet running: workflow id {asyncio.run(go())}")


@connectors_app.command("stop")
def connectors_stop(
    timeout: Annotated[
        float, typer.Option(min=0, help="Seconds to wait for the pools to drain (0: do not).")
    ] = 120.0,
) -> None:
    """Stop the database's ConnectorFleet: every pool drains (its batches in flight
    finish, its leases are handed back), then the fleet ends; waits up to
    --timeout seconds for the pools to end (from the server's list). Pools that
    outlived a fleet that no longer runs (terminated, or lost) are drained too,
    each by its ``drain`` signal, as a fleet's start would. Exit 1 when pools did
    not end in time (they go on draining), or when the fleet or its pools did not
    end and no worker polls the connector task queue (nothing can end them until
    one runs); a fleet that does not run, with no pool left, is said and is no
    error."""
    settings = load_settings()

    async def go() -> tuple[bool, list[str], list[str], bool]:
        client = await connect(settings)
        handle = client.get_workflow_handle(fleet_workflow_id(settings.database_id))
        try:
            desc = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
            running = desc.status == WorkflowExecutionStatus.RUNNING
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            running = False
        deadline = time.monotonic() + timeout
        orphans: list[str] = []
        fleet_ended = True  # its run ended (or none ran)
        if running:
            await handle.signal("stop")
            try:
                await asyncio.wait_for(handle.result(), timeout=max(timeout, 0.1))
            except TimeoutError:
                fleet_ended = False
            except Exception:  # it ended otherwise (failed, terminated): not ours to judge
                pass
        else:
            orphans = await running_supervisors(client, settings.database_id)
            for wf_id in orphans:
                with contextlib.suppress(RPCError):  # it ended meanwhile
                    await client.get_workflow_handle(wf_id).signal("drain")
        left = await running_supervisors(client, settings.database_id)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            left = await running_supervisors(client, settings.database_id)
        # Nothing drains without a worker: say so rather than "still draining".
        stuck = bool(left) or not fleet_ended
        unserved = stuck and await active_pollers(client, settings.connector_task_queue) == []
        return running, orphans, left, unserved

    try:
        stopped, orphans, left, unserved = asyncio.run(go())
    except Exception as exc:
        fail(f"cannot stop the connector fleet: {expected_failure(exc) or exc}")
    fleet_id = fleet_workflow_id(settings.database_id)
    if stopped and not left and not unserved:
        console.print(f"connector fleet {fleet_id} stopped; every pool drained")
    elif not stopped:
        console.print(f"no connector fleet runs for database {settings.database_id} ({fleet_id})")
        if orphans:
            ended = sorted(set(orphans) - set(left))
            console.print(
                f"{len(orphans)} pool(s) outlived it and were signalled to drain; "
                f"{len(ended)} ended: {', '.join(ended) or '-'}"
            )
    if unserved:
        fail(
            f"the fleet and {len(left)} pool(s) were told to stop, but no worker polls "
            f"task queue {settings.connector_task_queue}: they end once a worker runs "
            f"(start `nexusctl worker`){': ' + ', '.join(left) if left else ''}"
        )
    if left:
        fail(
            f"{len(left)} pool(s) still draining after {timeout:g} s (they finish their "
            f"batches and end; only a running `nexusctl worker` on task queue "
            f"{settings.connector_task_queue} can drain them, and a worker stopped in the "
            f"last ~90 s still looks alive to the server): {', '.join(left)}"
        )


@connectors_app.command("status")
def connectors_status() -> None:
    """Per pack: workers, queue depth by state and class, oldest pending age, failures."""
    settings = load_settings()
    engine = existing_engine(settings)
    if engine is None:
        console.print(no_database(settings))
        return
    packs = list_connector_packs(engine)
    if not packs:
        console.print("no connector pack is installed")
        return
    stats = {s.installed_pack_id: s for s in queue.pack_queue_stats(engine)}

    problem: str | None = None
    closed: str | None = None  # the fleet's execution ended: how and when

    async def unserved(client: Client | None) -> str | None:
        """When the fleet did not answer: say so if no worker polls its task queue."""
        if client is None:
            return None
        pollers = await active_pollers(client, settings.connector_task_queue)
        if pollers == []:
            return (
                f"no worker polls task queue {settings.connector_task_queue}: the fleet "
                "exists but nothing runs it (start `nexusctl worker`)"
            )
        return None

    async def pools() -> tuple[dict[str, SupervisorStatus], FleetStatus | None]:
        nonlocal problem, closed
        client: Client | None = None
        try:
            client = await connect(settings)
            handle = client.get_workflow_handle(fleet_workflow_id(settings.database_id))
            desc = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
            if desc.status != WorkflowExecutionStatus.RUNNING:
                # A closed fleet still answers queries (from its history): its last
                # pools would read as running. Say it ended; list the pools that
                # outlived it from the server (supervisors are abandoned, not ended).
                how = desc.status.name.lower() if desc.status else "closed"
                at = f" at {desc.close_time:%Y-%m-%d %H:%M:%S} UTC" if desc.close_time else ""
                closed = f"{how}{at}"
                return await _orphaned_pools(client, settings.database_id), None
            fleet = await handle.query("status", result_type=FleetStatus, rpc_timeout=QUERY_TIMEOUT)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                problem = await unserved(client) or expected_failure(exc) or str(exc)
            return {}, None
        except Exception as exc:  # the table is still worth printing; the command fails
            problem = (
                await unserved(client) or expected_failure(exc) or f"{type(exc).__name__}: {exc}"
            )
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
            # only workers whose execution runs now: never a slot in backoff or starting
            f"{_running(pool)} ({sum(w.restarts for w in pool.workers)} restarts)"
            + (
                f", {len(pool.workers) - _running(pool)} not running"
                if _running(pool) < len(pool.workers)
                else ""
            )
            + (", draining" if pool.draining else "")
            if pool
            else "not running"
        )
        table.add_row(row.namespace, row.install_id[:8], row.status, workers, depth, oldest,
                      failures)  # fmt: skip
    console.print(table)
    if fleet is not None:
        _print_fleet_problems(fleet)
    elif closed is not None:
        fail(
            f"the connector fleet {fleet_workflow_id(settings.database_id)} is not running: "
            f"it {closed}; start it again with `nexusctl connectors start`"
            + (f" ({len(running)} pool(s) it left still run)" if running else "")
        )
    elif problem is None:
        console.print(
            f"no connector fleet runs for database {settings.database_id} "
            "(start it with `nexusctl connectors start`)"
        )
    else:
        # "not running" above may be wrong: the fleet's own answer is unknown.
        fail(
            f"cannot query the connector fleet {fleet_workflow_id(settings.database_id)}: {problem}"
        )


async def _orphaned_pools(client: Client, database_id: str) -> dict[str, SupervisorStatus]:
    """The database's pack supervisors that still run (from the server's list), by
    install id, each with its status (one that does not answer is left out)."""
    out: dict[str, SupervisorStatus] = {}
    for wf_id in await running_supervisors(client, database_id):
        with contextlib.suppress(Exception):
            st = await client.get_workflow_handle(wf_id).query(
                "status", result_type=SupervisorStatus, rpc_timeout=QUERY_TIMEOUT
            )
            out[st.install_id] = st
    return out


def _running(pool: SupervisorStatus) -> int:
    """Workers of ``pool`` whose execution runs now (state ``running``)."""
    return sum(w.state == "running" for w in pool.workers)


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
