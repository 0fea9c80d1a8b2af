"""Issue 5 on a real Temporal dev server: reconcile kinds, typed outcomes in the
fleet, the blocked / degraded status (query and CLI), and the bounded stop.

Packs are installed by a real ApplyAll (whose RunRepair writes the WorkItem
cutover receipt); the fleet runs the real activities against the database.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, update
from temporalio import activity
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.worker import Worker

from activities.fleet import PASS_HEARTBEAT_SLACK_S
from nexuscrm import cutover
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import (
    DesiredPack,
    FleetInput,
    FleetStatus,
    ReconcileDecision,
    ReconcileOutcome,
    ReconcileRequest,
)
from nexuscrm.controlplane import repair
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import running_supervisors, start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    cli_env,
    connector_settings,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    invoke_async,
    wait_drained,
    webhook_route,
    worker_process,
    write_connector_pack,
)
from tests.history import activity_types, periodic_outcomes
from tests.stubs import DrainableWorker
from workflows.fleet import ConnectorFleetWorkflow
from workflows.pack_supervisor import PackSupervisorWorkflow

CRED = "NEXUS_CREDENTIAL_FLEET_CRED"


def write_pack(path: Path, name: str, profiles: list[dict[str, Any]]) -> str:
    return str(write_connector_pack(path, name, [webhook_route()], profiles))


def profile(name: str = "batch", **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "endpoint": "http://127.0.0.1:9/api",
        "credential_ref": "fleet-cred",
        "object_path_map": {"User": "/records/User"},
        **kw,
    }


async def wait_status(
    fleet: WorkflowHandle[Any, Any], ok: Callable[[FleetStatus], bool], timeout: float = 60
) -> FleetStatus:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        st = await fleet.query("status", result_type=FleetStatus)
        if ok(st):
            return st
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"fleet status: {st}")
        await asyncio.sleep(0.2)


async def signal_names(client: Client, workflow_id: str) -> list[str]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return [
        e.workflow_execution_signaled_event_attributes.signal_name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    ]


async def test_reconcile_kinds_clear_the_blocked_map_and_status_shows_it(
    temporal_env, settings, tmp_path, monkeypatch
):
    """Rule 1 + status: changed keeps, reconcile rebuilds, periodic wakes; all clear blocked."""
    settings = connector_settings(settings)
    monkeypatch.setenv(CRED, "s3cret")
    await install(
        temporal_env, settings, [write_pack(tmp_path / "p.yaml", "cred-pack", [profile()])]
    )
    inp = fast_fleet(settings)
    inp.reconcile_interval_seconds = 3600  # only signals reconcile here
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, inp)
        await wait_status(fleet, lambda s: len(s.pools) == 1)
        monkeypatch.delenv(CRED)
        await fleet.signal("reconcile")  # rebuilds, so re-validates the credential
        st = await wait_status(fleet, lambda s: bool(s.blocked))
        ((key, reason),) = st.blocked.items()
        assert key.startswith("cred-pack/") and CRED in reason and st.pools == []
        out = await invoke_async(["connectors", "status"], cli_env(settings, temporal_env))
        assert out.exit_code == 0, out.output
        assert "not served or degraded" in out.output and "blocked" in out.output
        assert CRED in out.output

        monkeypatch.setenv(CRED, "s3cret")
        await fleet.signal("reconcile_changed")
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        assert st.blocked == {}  # reconcile_changed cleared it
        first = st.pools[0]

        n = st.reconciles
        await fleet.signal("reconcile_changed")
        st = await wait_status(fleet, lambda s: s.reconciles > n)
        assert [p.supervisor_workflow_id for p in st.pools] == [first.supervisor_workflow_id]

        await fleet.signal("reconcile")
        st = await wait_status(fleet, lambda s: s.reconciles > n + 1)
        (rebuilt,) = st.pools
        assert rebuilt.fingerprint == first.fingerprint
        assert rebuilt.supervisor_workflow_id != first.supervisor_workflow_id
        old = temporal_env.client.get_workflow_handle(first.supervisor_workflow_id)
        assert await old.result() == "drained"

        # A failure after start: the cutover receipt disappears -> the pool stops, fail closed.
        engine = make_engine(settings.database_url)
        with engine.begin() as conn:
            conn.execute(
                delete(t.bootstrap_state).where(
                    t.bootstrap_state.c.StateKey == cutover.CUTOVER_RECEIPT_KEY
                )
            )
        await fleet.signal("reconcile_changed")
        st = await wait_status(fleet, lambda s: s.pools == [] and bool(s.blocked))
        assert "cutover is not ready" in st.blocked[key]
        repair.run_repair(engine)
        await fleet.signal("reconcile")  # "reconcile" clears the blocked map too
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        assert st.blocked == {}
        await fleet.signal("stop")
        await fleet.result()


async def test_periodic_reconcile_recovers_identity_first_then_checks_unchanged_pools(
    temporal_env, settings, tmp_path, monkeypatch
):
    """Rule 1: the timer reconcile runs identity recovery, then checks and keeps the pool."""
    settings = connector_settings(settings)
    monkeypatch.setenv(CRED, "s3cret")
    await install(
        temporal_env, settings, [write_pack(tmp_path / "p.yaml", "cred-pack", [profile()])]
    )
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        pool = st.pools[0].supervisor_workflow_id
        monkeypatch.delenv(CRED)  # a periodic reconcile does not rebuild, so never re-checks it
        st = await wait_status(fleet, lambda s: s.reconciles >= 4)
        assert [p.supervisor_workflow_id for p in st.pools] == [pool] and st.blocked == {}
        await fleet.signal("stop")
        await fleet.result()
    types = await activity_types(fleet)
    plan, recover = "connectors.reconcile_plan", "identity.recover"
    # startup: orphaned pools drained, reconcile, then recovery
    assert types[:3] == ["connectors.drain_orphan_pools", plan, recover]
    periodic = types[3:]
    # patch fleet-periodic-pass: recovery, the pools' liveness check (issue 10: it
    # replaces the keep-wake; the seed rebuilds a pool whose handle is done) and the
    # plan run as one activity per pass, in that order (activities.fleet)
    assert len(periodic) >= 3 and periodic == ["connectors.periodic"] * len(periodic)
    passes = await periodic_outcomes(fleet)
    assert len(passes) >= len(periodic) - 1  # the stop cancels the pass in flight
    for out in passes:
        assert out.closed == [] and out.recovery_error == ""
        assert [(d.key, d.action, d.stalled) for d in out.plan.decisions] == [
            (f"{st.pools[0].namespace}/{st.pools[0].install_id}", "keep", False)
        ]
    # an unchanged pool is not woken through history
    assert "wake" not in await signal_names(temporal_env.client, pool)


async def test_startup_failure_fails_the_fleet_and_starts_nothing(
    temporal_env, settings, tmp_path, monkeypatch
):
    """Rule 4 + 7: at startup any error fails the fleet (all-or-nothing), naming the kinds."""
    settings = connector_settings(settings)
    monkeypatch.setenv(CRED, "s3cret")
    good = write_pack(tmp_path / "a.yaml", "good-pack", [profile()])
    bad = write_pack(
        tmp_path / "b.yaml", "bad-pack", [profile(required_object_kinds=["User", "Case"])]
    )
    await install(temporal_env, settings, [good, bad])
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        with pytest.raises(WorkflowFailureError) as info:
            await fleet.result()
    message = str(info.value.cause)
    assert "connector fleet startup failed" in message
    assert "bad-pack" in message and "requires batch coverage for Case" in message
    types = await activity_types(fleet)
    assert types == ["connectors.drain_orphan_pools", "connectors.reconcile_plan"]
    history = await fleet.fetch_history()
    assert not [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
    ]


async def test_duplicate_coverage_shows_the_pack_degraded(
    temporal_env, settings, tmp_path, monkeypatch
):
    """Rule 7 + status: duplicate coverage runs payload-only and is reported as degraded."""
    settings = connector_settings(settings)
    monkeypatch.delenv(CRED, raising=False)  # payload-only needs no credential
    dup = write_pack(tmp_path / "d.yaml", "dup-pack", [profile("one"), profile("two")])
    await install(temporal_env, settings, [dup])
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        ((key, reason),) = st.degraded.items()
        assert key.startswith("dup-pack/") and "User by one, two" in reason
        assert st.pools[0].degraded == reason and st.blocked == {}
        out = await invoke_async(["connectors", "status"], cli_env(settings, temporal_env))
        assert "degraded" in out.output and "duplicate batch object coverage" in out.output
        await fleet.signal("stop")
        await fleet.result()


# --- rule 10: stopping waits a bounded 5 s for the reconcile loop ------------------------


class HangingPlanner:
    """Stand-in reconcile activity: the first call starts one pool, later calls hang."""

    def __init__(self) -> None:
        self.calls = 0
        self.hanging = asyncio.Event()

    @activity.defn(name="connectors.reconcile_plan")
    async def plan(self, req: ReconcileRequest) -> ReconcileOutcome:
        self.calls += 1
        if self.calls == 1:
            pack = DesiredPack("hang-pack", "inst-1", "h", False, "f" * 64, 1, 10, "reserved")
            return ReconcileOutcome([ReconcileDecision("hang-pack/inst-1", "hang-pack", "inst-1",
                                                       "start", pack=pack)])  # fmt: skip
        self.hanging.set()
        await asyncio.sleep(3600)
        raise AssertionError("not reached")


@activity.defn(name="identity.recover")
async def recover(database_id: str) -> int:
    return 0


@activity.defn(name="connectors.drain_orphan_pools")
async def no_orphans(database_id: str) -> list[str]:
    return []


async def test_stop_waits_a_bounded_time_for_a_hung_reconcile_then_drains(temporal_env):
    queue = f"fleet-{uuid.uuid4().hex[:6]}"
    planner = HangingPlanner()
    inp = FleetInput(database_id=f"db-{uuid.uuid4().hex[:6]}", reconcile_interval_seconds=3600)
    async with Worker(
        temporal_env.client,
        task_queue=queue,
        workflows=[ConnectorFleetWorkflow, PackSupervisorWorkflow, DrainableWorker],
        activities=[planner.plan, recover, no_orphans],
    ):
        fleet = await temporal_env.client.start_workflow(
            ConnectorFleetWorkflow.run, inp, id=f"fleet-{uuid.uuid4()}", task_queue=queue
        )
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        await fleet.signal(ConnectorFleetWorkflow.reconcile)
        await asyncio.wait_for(planner.hanging.wait(), 30)
        await fleet.signal(ConnectorFleetWorkflow.stop)
        await fleet.result()
        pool = temporal_env.client.get_workflow_handle(st.pools[0].supervisor_workflow_id)
        assert await pool.result() == "drained"
    history = await fleet.fetch_history()
    kinds = [e.event_type for e in history.events]
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in kinds
    timers = [
        e.timer_started_event_attributes.start_to_fire_timeout.ToSeconds()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]
    assert inp.reconcile_stop_timeout_seconds == 5 and 5 in timers


async def test_drain_only_generation_is_served_until_its_queue_is_empty(
    temporal_env, settings, hook, tmp_path
):
    """Rule 6 end to end: a draining incarnation keeps a pool while it has work."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    wq.enqueue(engine, hook_events(pack.install_id, ["a", "b", "c"]))
    with engine.begin() as conn:
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.PackInstallId == pack.install_id)
            .values(Status="draining")
        )
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        st = await wait_status(fleet, lambda s: s.reconciles >= 1)
        states = await wait_drained(engine)
        assert states == {"succeeded": 3}
        # The next periodic reconcile finds the queue empty and stops the pool, silently.
        st = await wait_status(fleet, lambda s: s.pools == [])
        assert st.blocked == {}
        await fleet.signal("stop")
        await fleet.result()


async def test_hand_typed_signals_without_input_never_fail_the_fleet_or_a_wait(
    temporal_env, settings
):
    """``temporal workflow signal --name wake`` without ``--input`` (the README's
    identity-wait form, typed at the fleet) wakes every pool; the fleet keeps
    answering its ``status`` query and reconciling. A bare ``register`` to a
    wait is harmless too."""
    from nexuscrm.connectors.identity import Dependency, wait_workflow_id
    from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
    from workflows.identity import IdentityWaitWorkflow

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    client = temporal_env.client
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        for _ in range(100):
            if (await fleet.query(ConnectorFleetWorkflow.status)).pools:
                break
            await asyncio.sleep(0.1)
        before = await fleet.query(ConnectorFleetWorkflow.status)
        await fleet.signal("wake")  # no install id
        await fleet.signal("reconcile_changed")
        for _ in range(300):  # a reconcile is three activities: slow on a loaded box
            now = await fleet.query(ConnectorFleetWorkflow.status)
            if now.reconciles > before.reconciles:
                break
            await asyncio.sleep(0.1)
        assert now.reconciles > before.reconciles
        assert [p.install_id for p in now.pools] == [p.install_id for p in before.pools]

        dep = Dependency.record("Account", "hand-typed")
        from activities.identity_client import start_wait
        from nexuscrm.contracts import IdentityWaitConfig

        await start_wait(
            client,
            database_id=settings.database_id,
            task_queue=settings.identity_task_queue,
            dependency=dep,
            work_ids=[],
            config=IdentityWaitConfig(probe_interval_seconds=60),
        )
        wait = client.get_workflow_handle(wait_workflow_id(settings.database_id, dep.key_hash))
        await wait.signal("register")
        status = await wait.query(IdentityWaitWorkflow.status)
        assert status.items == []
        await wait.terminate()
        await fleet.signal("stop")
        await fleet.result()


async def test_a_fleet_started_after_a_terminated_one_drains_its_orphaned_pools(
    temporal_env, settings
):
    """Pools outlive their fleet (ABANDON, for continue-as-new). When an operator
    terminates the fleet and starts it again, the new fleet drains the old pools
    before it starts its own: each pack is served by one pool, not two."""
    from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    client = temporal_env.client
    async with build_connector_worker(client, settings):
        first = await start_fleet(client, settings, fast_fleet(settings))
        for _ in range(100):
            old = await running_supervisors(client, settings.database_id)
            if old:
                break
            await asyncio.sleep(0.2)
        assert len(old) == 1
        await first.terminate("operator")
        second = await start_fleet(client, settings, fast_fleet(settings))
        now: list[str] = []
        for _ in range(100):
            now = await running_supervisors(client, settings.database_id)
            if len(now) == 1 and now != old:
                break
            await asyncio.sleep(0.2)
        assert len(now) == 1 and now != old, (old, now)
        assert await client.get_workflow_handle(old[0]).result() == "drained"
        await second.signal("stop")
        await second.result()


@pytest.fixture
async def cred_pack_fleet(
    temporal_env: Any, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Settings, FleetInput]:
    """``cred-pack`` installed (one profile, its credential set) and fast fleet timings
    for it: the connector settings and the fleet's input."""
    settings = connector_settings(settings)
    monkeypatch.setenv(CRED, "s3cret")
    await install(
        temporal_env, settings, [write_pack(tmp_path / "p.yaml", "cred-pack", [profile()])]
    )
    return settings, fast_fleet(settings)


async def pending_activity_types(fleet: WorkflowHandle[Any, Any]) -> list[str]:
    """The fleet's activities in flight, from the server's describe."""
    desc = await fleet.describe()
    return [a.activity_type.name for a in desc.raw_description.pending_activities]


async def test_the_periodic_pass_waits_in_its_activity_and_a_stopping_worker_hands_it_on(
    temporal_env, cred_pack_fleet
):
    """Patch fleet-periodic-pass: the pass waits out the interval inside its activity (no
    timer in the fleet's history); a request cancels it at once; a worker that shuts down
    meanwhile ends it at once (``skipped``) instead of holding its shutdown for the
    interval, and the next pass runs on the next worker."""
    settings, inp = cred_pack_fleet
    client = temporal_env.client
    inp.reconcile_interval_seconds = 15

    async def pass_in_flight() -> None:
        for _ in range(100):
            if "connectors.periodic" in await pending_activity_types(fleet):
                return
            await asyncio.sleep(0.2)
        raise AssertionError("no periodic pass in flight")

    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, inp)
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        await pass_in_flight()
        kinds = [e.event_type for e in (await fleet.fetch_history()).events]
        assert EventType.EVENT_TYPE_TIMER_STARTED not in kinds
        # A request does not wait for the interval: it cancels the pass and runs now.
        await fleet.signal("reconcile_changed")
        st = await wait_status(fleet, lambda s: s.reconciles > st.reconciles, timeout=10)
        await pass_in_flight()
        stopping = asyncio.get_running_loop().time()
    shutdown_s = asyncio.get_running_loop().time() - stopping
    assert shutdown_s < 10, f"the worker's shutdown waited {shutdown_s:.1f} s for the pass"
    history = await fleet.fetch_history()
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in [
        e.event_type for e in history.events
    ]
    async with build_connector_worker(client, settings):
        # the skipped pass, the rest of its interval as a timer, then a pass here
        ran = len([o for o in await periodic_outcomes(fleet) if not o.skipped])
        # bound: the timer, a pass's interval, a pass lost in the shutdown (retried
        # after its heartbeat timeout, interval + 15 s), a dead sticky queue's 10 s
        deadline = asyncio.get_running_loop().time() + 4 * inp.reconcile_interval_seconds + 30
        while True:
            outcomes = await periodic_outcomes(fleet)
            if len([o for o in outcomes if not o.skipped]) > ran:
                break
            if asyncio.get_running_loop().time() > deadline:
                desc = (await fleet.describe()).raw_description
                pending = [
                    (a.activity_type.name, a.attempt, a.last_failure.message)
                    for a in desc.pending_activities
                ]
                names = [EventType.Name(e.event_type) for e in (await fleet.fetch_history()).events]
                raise AssertionError(
                    f"no pass ran on the next worker: {outcomes}; pending {pending}; "
                    f"last events {names[-10:]}"
                )
            await asyncio.sleep(0.2)
        # the pass the worker's shutdown cut short (and the one the request cancelled,
        # which kept waiting in that worker: a cancel reaches it only at a heartbeat)
        assert [o.skipped for o in outcomes].count(True) in (1, 2)
        after = await fleet.query("status", result_type=FleetStatus)
        assert [p.supervisor_workflow_id for p in after.pools] == [
            p.supervisor_workflow_id for p in st.pools
        ]
        assert after.last_error is None
        await fleet.signal("stop")
        await fleet.result()
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED not in [
        e.event_type for e in (await fleet.fetch_history()).events
    ]


async def test_a_pass_on_a_killed_worker_is_retried_after_its_interval_not_a_minute(
    temporal_env, cred_pack_fleet
):
    """The pass's activity sends no heartbeat while it waits out the interval, so a
    worker killed (SIGKILL) meanwhile is noticed by the heartbeat timeout: the interval
    plus ``PASS_HEARTBEAT_SLACK_S``, not the minute of the first version. The pass then
    runs on the next worker (its second attempt) and the fleet keeps its pool: the
    server still runs that one supervisor and no other."""
    settings, inp = cred_pack_fleet
    client = temporal_env.client
    inp.reconcile_interval_seconds = 3
    proc = worker_process(settings, temporal_env)
    try:
        fleet = await start_fleet(client, settings, inp)
        st = await wait_status(fleet, lambda s: len(s.pools) == 1)
        for _ in range(150):  # a pass running on that process
            desc = await fleet.describe()
            if any(
                p.activity_type.name == "connectors.periodic" and p.attempt == 1
                for p in desc.raw_description.pending_activities
            ):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("no periodic pass in flight on the worker process")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = asyncio.get_running_loop().time()
        before = len(await periodic_outcomes(fleet))
    finally:
        if proc.poll() is None:
            proc.kill()
    async with build_connector_worker(client, settings):
        for _ in range(600):
            if len(await periodic_outcomes(fleet)) > before:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no pass completed after the kill")
        resumed_s = asyncio.get_running_loop().time() - killed
        history = await fleet.fetch_history()
        retried = [
            e.activity_task_started_event_attributes
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
            and e.activity_task_started_event_attributes.attempt > 1
        ]
        assert retried, "the killed worker's pass was not retried"
        timeout = retried[0].last_failure.timeout_failure_info.timeout_type
        assert timeout == TimeoutType.TIMEOUT_TYPE_HEARTBEAT, retried[0].last_failure
        bound = inp.reconcile_interval_seconds + PASS_HEARTBEAT_SLACK_S
        # the timeout, then a workflow task and the pass on a worker of a loaded box
        assert resumed_s < bound + 20, f"the pass resumed {resumed_s:.1f} s after the kill"
        assert await running_supervisors(client, settings.database_id) == [
            p.supervisor_workflow_id for p in st.pools
        ]
        await fleet.signal("stop")
        await fleet.result()
