"""Issue 10: "a week in an hour of CI" — the connector runtime under compressed time.

A dev server of this module's own runs with history limits scaled down by
``HISTORY_FACTOR`` (``--dynamic-config-value limit.historyCount.error=...``
and friends) and the fleet reconciles every ``INTERVAL`` seconds instead of
5 s: a minute of wall time then grows histories as ``COMPRESSION`` minutes of
production would. Through that the fleet lives the equivalent of a week of
periodic reconciles, forced rebuilds (``reconcile``, as ApplyAll/ApplyPacks
send) and a pack change (a second connector pack installed, then
``reconcile_changed``).

At the end everything is judged from the server, never from the runtime's own
account: every pool in the fleet's ``status`` has all its workers running
(counted from the server's list of running ``InboundWorker`` executions, by
parent supervisor), the ``status`` names exactly the running supervisors,
nothing was terminated, no history exceeded the limit, and a new event of
each pack is processed within seconds.

Only the public contract is used: the workflow types, the fleet's signals and
``status`` query, ``start_fleet``, the database tables, and workflow ids under
``connector/<database id>/`` (their format below that prefix is free).

The compression printed first is nominal (the reconcile interval as
configured); the one printed at the end is measured from the reconciles the
fleet really ran, which on a loaded machine take longer than ``INTERVAL``
(reconcile-plan activities over the fleet's runs; a diagnostic, not asserted).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetInput, FleetStatus
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import (
    SEARCH_ATTRIBUTES,
    fleet_workflow_id,
    start_fleet,
    temporal_binary,
)
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    HookServer,
    connector_settings,
    executions,
    history_length,
    hook_events,
    hook_pack,
    install,
    record_upsert,
    wait_drained,
)

# Temporal's defaults (server 1.2x-1.3x) and the fleet's default reconcile interval.
DEFAULT_COUNT_ERROR = 51_200
DEFAULT_COUNT_WARN = 10_240
DEFAULT_SIZE_ERROR = 50 * 1024 * 1024
DEFAULT_SIZE_WARN = 10 * 1024 * 1024
DEFAULT_INTERVAL = FleetInput(database_id="-").reconcile_interval_seconds
DEFAULT_RECONCILES_PER_RUN = FleetInput(database_id="-").reconciles_before_continue_as_new

HISTORY_FACTOR = 128  # every history limit divided by this
COUNT_ERROR = DEFAULT_COUNT_ERROR // HISTORY_FACTOR  # 400 events
COUNT_WARN = DEFAULT_COUNT_WARN // HISTORY_FACTOR
SIZE_ERROR = DEFAULT_SIZE_ERROR // HISTORY_FACTOR
SIZE_WARN = DEFAULT_SIZE_WARN // HISTORY_FACTOR
# The suggestion is kept at a quarter of the limit (Temporal's default is 8 %):
# 8 % of 400 would be less than a pool's own start-up, and every run would
# continue as new at once. A quarter still leaves 300 events' margin.
COUNT_SUGGEST = COUNT_ERROR // 4
SIZE_SUGGEST = SIZE_ERROR // 4

INTERVAL = 0.2  # s between periodic reconciles (default 5 s)
COMPRESSION = HISTORY_FACTOR * DEFAULT_INTERVAL / INTERVAL
WEEK = 7 * 24 * 3600
SOAK_SECONDS = 190.0  # wall time of the soak phase, per backend
FORCED_REBUILDS_AT = (0.2, 0.4, 0.8)  # fractions of SOAK_SECONDS
PACK_CHANGE_AT = 0.6
SETTLE_SECONDS = 45.0  # for draining pools to end and visibility to catch up
LATENCY_LIMIT = 10.0  # s for an event enqueued at the end

DYNAMIC_CONFIG = {
    "limit.historyCount.error": COUNT_ERROR,
    "limit.historyCount.warn": COUNT_WARN,
    "limit.historyCount.suggestContinueAsNew": COUNT_SUGGEST,
    "limit.historySize.error": SIZE_ERROR,
    "limit.historySize.warn": SIZE_WARN,
    "limit.historySize.suggestContinueAsNew": SIZE_SUGGEST,
}


def dev_server_args() -> list[str]:
    """``--dynamic-config-value KEY=VALUE`` pairs (values are JSON) for the limits."""
    args: list[str] = []
    for key, value in DYNAMIC_CONFIG.items():
        args += ["--dynamic-config-value", f"{key}={value}"]
    return args


@pytest.fixture(scope="module")
async def limited_env() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server of this module's own, with history limits ``HISTORY_FACTOR`` lower."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        dev_server_extra_args=dev_server_args(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


def soak_fleet(settings: Settings) -> FleetInput:
    """The fleet's input with its clocks and continue-as-new point compressed like history."""
    return FleetInput(
        database_id=settings.database_id,
        reconcile_interval_seconds=INTERVAL,
        reconciles_before_continue_as_new=max(
            1, DEFAULT_RECONCILES_PER_RUN * COUNT_ERROR // DEFAULT_COUNT_ERROR
        ),
        lease_seconds=10,
        idle_seconds=1.0,
        drain_timeout_seconds=5,
        restart_backoff_min_seconds=0.2,
        restart_backoff_max_seconds=1,
    )


@dataclass
class ServerView:
    """The connector executions of one database as the server lists them."""

    fleets: list[Any] = field(default_factory=list)
    supervisors: list[Any] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)
    workers_by_parent: Counter[str] = field(default_factory=Counter)


def prefix_query(database_id: str, extra: str) -> str:
    """Visibility query for executions under ``connector/<database id>/`` plus ``extra``."""
    return f'WorkflowId STARTS_WITH "connector/{database_id}/" AND {extra}'


async def running_view(client: Client, database_id: str) -> ServerView:
    """Running fleet, supervisors and workers of ``database_id``, from the server's list."""
    view = ServerView()
    view.fleets = await executions(
        client,
        f'WorkflowId = "{fleet_workflow_id(database_id)}" AND ExecutionStatus = "Running"',
    )
    view.supervisors = await executions(
        client,
        prefix_query(
            database_id, 'WorkflowType = "PackSupervisor" AND ExecutionStatus = "Running"'
        ),
    )
    view.workers = await executions(
        client,
        prefix_query(database_id, 'WorkflowType = "InboundWorker" AND ExecutionStatus = "Running"'),
    )
    view.workers_by_parent = Counter(w.parent_id or "" for w in view.workers)
    return view


def disagreements(status: FleetStatus, view: ServerView) -> list[str]:
    """What differs between the fleet's ``status`` and the server's running executions."""
    problems: list[str] = []
    if len(view.fleets) != 1:
        problems.append(f"{len(view.fleets)} running ConnectorFleet executions")
    claimed = {p.supervisor_workflow_id for p in status.pools}
    running = {s.id for s in view.supervisors}
    if claimed != running:
        problems.append(f"status pools {sorted(claimed)} != running supervisors {sorted(running)}")
    for pool in status.pools:
        n = view.workers_by_parent.get(pool.supervisor_workflow_id, 0)
        if n != pool.worker_count:
            problems.append(
                f"pool {pool.namespace}/{pool.install_id} ({pool.supervisor_workflow_id}): "
                f"{n} running workers of {pool.worker_count}"
            )
    strays = {p: n for p, n in view.workers_by_parent.items() if p not in claimed}
    if strays:
        problems.append(f"running workers outside the fleet's pools (by parent): {strays}")
    return problems


async def reconciles_done(client: Client, database_id: str) -> int:
    """Diagnostic only: reconcile-plan activities scheduled over the fleet's whole chain."""
    total = 0
    for wf in await executions(client, f'WorkflowId = "{fleet_workflow_id(database_id)}"'):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        for event in history.events:
            if event.HasField("activity_task_scheduled_event_attributes"):
                name = event.activity_task_scheduled_event_attributes.activity_type.name
                total += name.endswith("reconcile_plan")
    return total


# SQLite only: what this soaks is the long-lived workflows' histories against
# the server's limits, which no database changes; MariaDB runs the same
# workflows in test_connector_runtime and tests/faults.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_week_of_reconciles_rebuilds_and_a_pack_change(
    limited_env: WorkflowEnvironment,
    settings: Settings,
    hook: HookServer,
    tmp_path: Path,
) -> None:
    """A compressed week: all pools fully staffed on the server, nothing terminated, fast events."""
    env, client = limited_env, limited_env.client
    settings = connector_settings(settings)
    db = settings.database_id
    hook_src = str(hook_pack(tmp_path / "hook.yaml", hook.url))
    await install(env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    catalog.CACHE.invalidate()
    simulated = SOAK_SECONDS * COMPRESSION
    print(
        f"\nsoak: history limits / {HISTORY_FACTOR} (count error {COUNT_ERROR}, warn "
        f"{COUNT_WARN}, suggest {COUNT_SUGGEST}; size error {SIZE_ERROR} B), reconcile every "
        f"{INTERVAL} s (default {DEFAULT_INTERVAL} s): compression x{COMPRESSION:.0f}; "
        f"{SOAK_SECONDS:.0f} s of wall time ~ {simulated / 86400:.1f} simulated days"
    )
    assert simulated >= WEEK

    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, soak_fleet(settings))
        start = time.monotonic()
        steps = sorted(
            [(at, "reconcile") for at in FORCED_REBUILDS_AT] + [(PACK_CHANGE_AT, "pack change")]
        )
        for at, step in steps:
            await asyncio.sleep(max(0.0, start + at * SOAK_SECONDS - time.monotonic()))
            if step == "reconcile":
                await fleet.signal("reconcile")
            else:  # ApplyAll signals ``reconcile`` itself; ``reconcile_changed`` on top
                await install(env, settings, [str(SF_SYNC), hook_src])
                catalog.CACHE.invalidate()
                await fleet.signal("reconcile_changed")
            print(f"soak: {step} at {time.monotonic() - start:.0f} s")
        await asyncio.sleep(max(0.0, start + SOAK_SECONDS - time.monotonic()))
        wall = time.monotonic() - start

        # The server's view must settle on the status' (old pools drain meanwhile).
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            status = await fleet.query("status", result_type=FleetStatus)
            view = await running_view(client, db)
            problems = disagreements(status, view)
            if not problems or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)

        # An event of each pack, enqueued now, is processed within seconds.
        packs = {p.namespace: p for p in list_connector_packs(engine)}
        sf, hk = packs["salesforce-sync"], packs["hook-pack"]
        t0 = time.monotonic()
        queue.enqueue(
            engine,
            [
                record_upsert(sf.install_id, sf.namespace, "Account", "soak1", {"Name": "Soak"}),
                *hook_events(hk.install_id, ["soak-end"]),
            ],
        )
        try:
            states = await wait_drained(engine, timeout=3 * LATENCY_LIMIT)
        except AssertionError as err:
            states = {"not drained": 1, "error": str(err)}  # type: ignore[dict-item]
        latency = time.monotonic() - t0
        reconciles = await reconciles_done(client, db)

        everything = await executions(client, f'WorkflowId STARTS_WITH "connector/{db}/"')
        everything += await executions(client, f'WorkflowId = "{fleet_workflow_id(db)}"')
        terminated = [wf for wf in everything if wf.status and wf.status.name == "TERMINATED"]
        lengths = {  # visibility has the length of closed runs; the server's describe, of open
            (wf.workflow_type, wf.id, wf.run_id): wf.history_length
            if wf.close_time
            else await history_length(client, wf.id, wf.run_id)
            for wf in everything
        }
        await fleet.signal("stop")
        await asyncio.wait_for(fleet.result(), 120)

    by_type = Counter(
        f"{wf.workflow_type}:{wf.status.name if wf.status else '?'}" for wf in everything
    )
    longest = {
        kind: max((n for (k, _, _), n in lengths.items() if k == kind), default=0)
        for kind in ("ConnectorFleet", "PackSupervisor", "InboundWorker")
    }
    print(
        f"soak: {wall:.0f} s of wall time; {reconciles} reconciles over the fleet's runs "
        f"(~{reconciles * DEFAULT_INTERVAL * HISTORY_FACTOR / 86400:.1f} simulated days of "
        f"reconciles at {DEFAULT_INTERVAL} s: measured compression "
        f"x{reconciles * DEFAULT_INTERVAL * HISTORY_FACTOR / wall:.0f}); "
        f"executions {dict(sorted(by_type.items()))}; "
        f"longest history per type {longest} (limit {COUNT_ERROR})"
    )
    print(
        f"soak: status pools "
        f"{[(p.namespace, p.supervisor_workflow_id, p.worker_count) for p in status.pools]}; "
        f"running supervisors {[s.id for s in view.supervisors]}; running workers by parent "
        f"{dict(view.workers_by_parent)}"
    )
    print(f"soak: end events {states} after {latency:.1f} s")
    print(f"soak: terminated {[(wf.workflow_type, wf.id) for wf in terminated]}")

    assert not terminated, f"terminated executions: {[(w.workflow_type, w.id) for w in terminated]}"
    too_long = {k: n for k, n in lengths.items() if n > COUNT_ERROR}
    assert not too_long, f"histories over the limit of {COUNT_ERROR}: {too_long}"
    assert {p.namespace for p in status.pools} == {"salesforce-sync", "hook-pack"}, status
    assert not problems, problems
    assert states == {"succeeded": 2}, states
    assert latency < LATENCY_LIMIT, f"end events took {latency:.1f} s"
