"""Identity-convergence waits: blocking, waking, expiry, recovery (real Temporal servers)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text, update
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.worker import Worker

from activities.identity import IdentityActivities
from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency, wait_workflow_id
from nexuscrm.contracts import IdentityWaitConfig, IdentityWaitStatus, WakeResult
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.identity import (
    wake_identity_convergence_record,
    wake_identity_convergence_remote_identity,
)
from nexusctl.temporal import SEARCH_ATTRIBUTES
from tests.builders import (
    connector_settings,
    fast_fleet,
    install,
    record_upsert,
    sync_corpus_data_plans_shuffled,
)
from tests.identity_waits import (
    DEP,
    RecoverOnce,
    Switch,
    begin,
    block,
    cfg,
    link,
    no_blocked_on_linked,  # noqa: F401 (autouse)
    queue_db,
    recover_once,
    set_blocked_at,
    states,
    wait_worker,
)
from workflows.identity import IdentityWaitWorkflow


async def test_wake_without_waiter_and_duplicate_wakes(temporal_env, settings):
    engine = queue_db(settings)
    ids = block(engine, 2)
    client = temporal_env.client
    args = (DEP.owner_key, DEP.namespace, DEP.object_api_name, DEP.remote_id)
    assert await wake_identity_convergence_remote_identity(client, settings, *args) == 2
    assert await wake_identity_convergence_remote_identity(client, settings, *args) == 0
    assert {s for s, _c in states(engine, ids).values()} == {"pending"}
    assert await wake_identity_convergence_record(client, settings, "Account", "nope") == 0


async def test_wait_converges_on_first_probe_and_on_wake(temporal_env, settings):
    engine = queue_db(settings)
    client = temporal_env.client
    queue = settings.identity_task_queue
    switch = Switch("converged")  # the link exists before the wait starts
    ids = block(engine, 2)
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(client, settings, queue, ids, cfg())
        assert await handle.result() == 2
        assert {s for s, _c in states(engine, ids).values()} == {"pending"}

        switch.mode = "unresolved"
        other = Dependency.record("Account", "001x")
        ids2 = block(engine, 3, other)
        handle = await begin(client, settings, queue, ids2, cfg(probe_interval_seconds=60), other)
        await asyncio.sleep(0.5)
        status = await handle.query(IdentityWaitWorkflow.status)
        assert isinstance(status, IdentityWaitStatus)
        assert status.items == sorted(ids2) and status.probes >= 1
        first, second = await asyncio.gather(
            wake_identity_convergence_record(client, settings, "Account", "001x"),
            wake_identity_convergence_record(client, settings, "Account", "001x"),
        )
        assert sorted([first, second]) == [0, 3]
        assert await handle.result() == 3
        assert await wake_identity_convergence_record(client, settings, "Account", "001x") == 0


async def test_invalid_and_recovery(temporal_env, settings):
    engine = queue_db(settings)
    client = temporal_env.client
    queue = settings.identity_task_queue
    ids = block(engine, 3)
    w = t.connector_work_item
    with engine.begin() as conn:  # one row lost its dependency; one is the seed's parked shape
        conn.execute(update(w).where(w.c.WorkId == ids[0]).values(DependencyKind=None))
        conn.execute(
            update(w)
            .where(w.c.WorkId == ids[1])
            .values(State="processing", DependencyKeyHash="seed-hash")
        )
    switch = Switch("unresolved")
    async with wait_worker(client, settings, engine, switch, queue):
        started = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert started == 1
        got = states(engine, ids)
        assert got[ids[0]] == ("failed", "identity-convergence-invalid")
        assert got[ids[1]][0] == "blocked" and got[ids[2]][0] == "blocked"
        handle = client.get_workflow_handle(wait_workflow_id(settings.database_id, DEP.key_hash))
        await asyncio.sleep(0.5)
        status = await handle.query(IdentityWaitWorkflow.status)
        assert set(status.items) == {ids[1], ids[2]}
        # a live wait marks its rows: a second recovery starts nothing
        again = await client.execute_workflow(
            RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
        )
        assert again == 0
        # The parent links without a wake: the parked wait is woken by the next
        # recovery's recheck, not by a probe of its own.
        link(engine)
        assert await recover_once(client, settings, queue) == 0
        # Recovery woke the rows itself (0 left for the wait), then ended the wait.
        assert await asyncio.wait_for(handle.result(), 30) == 0
        assert {s for s, _c in states(engine, ids[1:]).values()} == {"pending"}


async def test_wait_survives_worker_restart(temporal_env, settings):
    engine = queue_db(settings)
    client = temporal_env.client
    queue = settings.identity_task_queue
    switch = Switch("unresolved")
    ids = block(engine, 1)
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(
            client,
            settings,
            queue,
            ids,
            cfg(probe_interval_seconds=1, max_probe_interval_seconds=1),
        )
        await asyncio.sleep(0.5)
    # No worker while the wait is parked; the parent links meanwhile (no wake
    # sent). The next worker's recovery finds it and completes the same wait.
    link(engine)
    await asyncio.sleep(1.5)
    async with wait_worker(client, settings, engine, switch, queue):
        await recover_once(client, settings, queue)
        assert await asyncio.wait_for(handle.result(), 20) == 0  # recovery woke the row
    assert switch.calls == 1
    assert states(engine, ids)[ids[0]][0] == "pending"


async def test_expiry_only_after_fresh_unresolved_probe(skipping_env, settings):
    engine = queue_db(settings)
    client = skipping_env.client
    queue = settings.identity_task_queue
    ids = block(engine, 2)
    other = Dependency.record("Account", "never")
    ids_err = block(engine, 1, other)
    switch = Switch("unresolved")
    failing = Switch("raise")

    def resolver(engine: Engine, dep: Dependency) -> bool:
        return (failing if dep == other else switch)(engine, dep)

    config = cfg(
        probe_interval_seconds=5,
        max_probe_interval_seconds=60,
        max_wait_seconds=1800,
        search_attributes=False,  # the time-skipping server has none
    )
    async with wait_worker(client, settings, engine, resolver, queue):
        erring = await begin(client, settings, queue, ids_err, config, other)
        handle = await begin(client, settings, queue, ids, config)
        await skipping_env.sleep(timedelta(minutes=31))  # skipped time
        for _ in range(100):
            if set(states(engine, ids).values()) == {("failed", "identity-convergence-expired")}:
                break
            await asyncio.sleep(0.1)
        assert set(states(engine, ids).values()) == {("failed", "identity-convergence-expired")}
        assert await handle.result() == 0
        assert switch.calls >= 1  # expired only after a fresh unresolved probe
        # the erring probe never expires: still blocked after the same 30+ minutes
        assert states(engine, ids_err)[ids_err[0]][0] == "blocked"
        for _ in range(50):
            if failing.calls >= 2:
                break
            await asyncio.sleep(0.1)
        assert failing.calls >= 2
        assert states(engine, ids_err)[ids_err[0]][0] == "blocked"
        await erring.terminate()


class Gate:
    """A slow resolver: each call signals ``entered`` and blocks until ``release``
    (or ``hold`` seconds), then answers ``converged``. Thread-safe counters."""

    def __init__(self, converged: bool = False, hold: float = 30.0) -> None:
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()
        self.converged = converged
        self.hold = hold
        self.calls = 0

    def __call__(self, engine: Engine, dep: Dependency) -> bool:
        self.calls += 1
        self.entered.set()
        self.release.wait(self.hold)
        return self.converged


class CountingActivities(IdentityActivities):
    """``IdentityActivities`` counting the ``identity.wake`` runs and rows they woke."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.wake_runs = 0
        self.woken_rows = 0

    @activity.defn(name="identity.wake")
    def wake(self, key_hash: str) -> WakeResult:
        res = super().wake(key_hash)
        self.wake_runs += 1
        self.woken_rows += res.woken
        return res


async def test_wake_during_probe_wakes_once(temporal_env, settings):
    """A ``wake`` signal that arrives while a (slow, unresolved) probe runs is not
    lost and does not wait for the probe: the wait wakes its items exactly once
    and completes while the probe still hangs, and never probes again."""
    from concurrent.futures import ThreadPoolExecutor

    engine = queue_db(settings)
    client = temporal_env.client
    queue = settings.identity_task_queue
    gate = Gate(converged=False)
    acts = CountingActivities(engine, settings, cfg(), resolver=gate)
    ids = block(engine, 3)
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[IdentityWaitWorkflow],
        activities=acts.all(),
        activity_executor=ThreadPoolExecutor(4),
    )
    # Only a wake can complete this wait: probes say unresolved, the next one is a minute away.
    config = cfg(probe_interval_seconds=60, max_probe_interval_seconds=60, probe_timeout_seconds=20)
    async with worker:
        handle = await begin(client, settings, queue, ids, config)
        assert await asyncio.to_thread(gate.entered.wait, 10), "first probe never ran"
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.state == "probing"
        await handle.signal(IdentityWaitWorkflow.wake)  # lands while the probe is in flight
        assert await asyncio.wait_for(handle.result(), 20) == 3
        assert not gate.release.is_set()  # the probe was still hanging
        assert {s for s, _c in states(engine, ids).values()} == {"pending"}
        assert (acts.wake_runs, acts.woken_rows) == (1, 3)
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.state == "woken" and status.woken == 3
        gate.release.set()
        await asyncio.sleep(0.5)
        assert gate.calls == 1  # no probe after the wake
    args = (DEP.owner_key, DEP.namespace, DEP.object_api_name, DEP.remote_id)
    assert await wake_identity_convergence_remote_identity(client, settings, *args) == 0


async def test_hung_probe_times_out_never_expires(skipping_env, settings):
    """A probe hung past the probe timeout counts as a failed probe: the wait
    reschedules and never expires its items, even far past the max wait; the
    worker keeps serving (a second wait converges by probe once the hang ends)."""
    engine = queue_db(settings)
    client = skipping_env.client
    queue = settings.identity_task_queue
    hung = Gate(converged=False, hold=120.0)  # unresolved, but only after the timeout
    fine = Switch("converged")
    other = Dependency.record("Account", "later")

    def resolver(engine: Engine, dep: Dependency) -> bool:
        return (fine if dep == other else hung)(engine, dep)

    ids = block(engine, 2)
    config = cfg(
        probe_interval_seconds=5,
        max_probe_interval_seconds=60,
        probe_timeout_seconds=0.2,  # each timed-out probe costs real time: keep it short
        max_wait_seconds=300,
        search_attributes=False,
    )
    try:
        async with wait_worker(client, settings, engine, resolver, queue):
            handle = await begin(client, settings, queue, ids, config)
            assert await asyncio.to_thread(hung.entered.wait, 10)
            await skipping_env.sleep(timedelta(minutes=15))  # 3x the max wait, skipped
            status = None
            for _ in range(100):
                status = await handle.query(IdentityWaitWorkflow.status)
                if status.probes >= 2 and status.state == "probe-failed":
                    break
                await asyncio.sleep(0.1)
            assert status is not None
            assert status.state == "probe-failed", status
            assert status.probes >= 2  # the timed-out probe was counted and rescheduled
            assert sorted(status.items) == sorted(ids)
            assert hung.calls == 1  # later probes timed out waiting for the held slot
            assert {s for s, _c in states(engine, ids).values()} == {"blocked"}
            desc = await handle.describe()
            assert desc.status == WorkflowExecutionStatus.RUNNING

            # The hang ends; the worker is healthy: a second wait converges by probe.
            hung.release.set()
            ids2 = block(engine, 1, other)
            second = await begin(client, settings, queue, ids2, config, other)
            assert await asyncio.wait_for(second.result(), 30) == 1
            assert fine.calls >= 1
            assert states(engine, ids2)[ids2[0]][0] == "pending"
            assert {s for s, _c in states(engine, ids).values()} == {"blocked"}
            await handle.terminate()
    finally:
        hung.release.set()


async def test_no_wait_left_running_after_sync(temporal_env, settings):
    """The shuffled DreamHouse + eBikes sync converges; no identity wait is left open."""
    await sync_corpus_data_plans_shuffled(temporal_env, settings)
    query = f"WorkflowType = 'IdentityWait' AND NexusDatabase = '{settings.database_id}'"
    seen = 0
    for _ in range(300):  # waits close on their own wake; a loaded machine is slow
        running = 0
        seen = 0
        async for wf in temporal_env.client.list_workflows(query):
            seen += 1
            running += wf.status == WorkflowExecutionStatus.RUNNING
        if running == 0:
            break
        await asyncio.sleep(0.2)
    assert running == 0
    # Children arrived before parents: items were blocked. A child whose parent
    # linked in its own batch is woken there and needs no wait (issue 16).
    a = t.connector_work_attempt
    with make_engine(settings.database_url).connect() as conn:
        blocks = conn.execute(
            select(func.count()).select_from(a).where(a.c.OutcomeState == "blocked")
        ).scalar_one()
    assert blocks > 0 and seen >= 0


_ = SEARCH_ATTRIBUTES


# --- issue 5: expiry clock per item (rule 3) and identity-probe edges (rule 11) ----


async def until_state(engine: Engine, ids: list[str], want: set[tuple[str, str | None]]) -> None:
    for _ in range(100):
        if set(states(engine, ids).values()) == want:
            return
        await asyncio.sleep(0.1)
    assert set(states(engine, ids).values()) == want


async def test_expiry_clock_is_per_item(skipping_env, settings):
    """Two items of one wait: the one blocked 25 minutes ago expires at its own 30
    minutes (after a fresh unresolved probe); the one blocked now stays blocked."""
    engine = queue_db(settings)
    client = skipping_env.client
    queue = settings.identity_task_queue
    old = block(engine, 1)
    await set_blocked_at(skipping_env, engine, old, 25)
    new = block(engine, 1)
    await set_blocked_at(skipping_env, engine, new, 0)
    switch = Switch("unresolved")
    config = cfg(
        probe_interval_seconds=30,
        max_probe_interval_seconds=60,
        max_wait_seconds=1800,
        search_attributes=False,
    )
    async with wait_worker(client, settings, engine, switch, queue):
        handle = await begin(client, settings, queue, old + new, config)
        await skipping_env.sleep(timedelta(minutes=8))
        await until_state(engine, old, {("failed", "identity-convergence-expired")})
        assert states(engine, new)[new[0]][0] == "blocked"
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.items == new and status.state in {"sleeping", "probing"}
        await handle.terminate()


async def test_max_wait_zero_and_no_resolver_never_expire(skipping_env, settings):
    """``max_wait <= 0`` disables expiry (the wait parks after one unresolved
    probe, with no timer); with no resolver every probe fails and reschedules,
    so nothing expires even far past the max wait."""
    engine = queue_db(settings)
    client = skipping_env.client
    queue = settings.identity_task_queue
    ids = block(engine, 1)
    await set_blocked_at(skipping_env, engine, ids, 600)
    other = Dependency.record("Account", "no-resolver")
    ids2 = block(engine, 1, other)
    await set_blocked_at(skipping_env, engine, ids2, 600)
    switch = Switch("unresolved")
    slow = {"probe_interval_seconds": 60, "max_probe_interval_seconds": 300}
    no_expiry = cfg(**slow, max_wait_seconds=0, search_attributes=False)
    expiring = cfg(**slow, max_wait_seconds=60, search_attributes=False)
    from concurrent.futures import ThreadPoolExecutor

    with_resolver = IdentityActivities(engine, settings, cfg(), resolver=switch)
    without = IdentityActivities(engine, settings, cfg(), resolver=None)
    queue2 = f"{queue}-none"
    workers = [
        Worker(
            client,
            task_queue=queue,
            workflows=[IdentityWaitWorkflow],
            activities=with_resolver.all(),
            activity_executor=ThreadPoolExecutor(2),
        ),
        Worker(
            client,
            task_queue=queue2,
            workflows=[IdentityWaitWorkflow],
            activities=without.all(),
            activity_executor=ThreadPoolExecutor(2),
        ),
    ]
    async with workers[0], workers[1]:
        handle = await begin(client, settings, queue, ids, no_expiry)
        handle2 = await begin(client, settings, queue2, ids2, expiring, other)
        await skipping_env.sleep(timedelta(minutes=20))
        for _ in range(100):
            s1 = await handle.query(IdentityWaitWorkflow.status)
            s2 = await handle2.query(IdentityWaitWorkflow.status)
            if s1.probes >= 1 and s2.probes >= 3:
                break
            await asyncio.sleep(0.1)
        assert s1.probes == 1 and switch.calls == 1  # parked, unresolved
        assert s1.state == "sleeping" and s1.next_probe is None
        assert s2.probes >= 3 and s2.state == "probe-failed"
        assert states(engine, ids)[ids[0]][0] == "blocked"
        assert states(engine, ids2)[ids2[0]][0] == "blocked"
        await handle.terminate()
        await handle2.terminate()


def _probe_request(key: str, work_ids: list[str], timeout: float) -> Any:
    from nexuscrm.connectors.identity import to_spec
    from nexuscrm.contracts import ProbeRequest

    return ProbeRequest(
        key_hash=key,
        dependency=to_spec(DEP),
        work_ids=work_ids,
        alive_until=utcnow().isoformat(),
        timeout_seconds=timeout,
    )


def test_probe_edges_late_result_and_resolver_panic(settings):
    """A result that arrives after the probe deadline is a timeout, not a fresh fact;
    a resolver that raises becomes a fixed error carrying none of its message."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    engine = queue_db(settings)
    ids = block(engine, 1)

    def late(engine: Engine, dep: Dependency) -> bool:
        import time

        time.sleep(0.6)
        return True  # converged, but too late to count

    def panics(engine: Engine, dep: Dependency) -> bool:
        raise RuntimeError("host secret: password=hunter2")

    env = ActivityEnvironment()
    for resolver, kind in ((late, "timed out"), (panics, "failed")):
        acts = IdentityActivities(engine, settings, cfg(), resolver=resolver)
        try:
            env.run(acts.probe, _probe_request(DEP.key_hash, ids, 0.5))
        except ApplicationError as err:
            assert kind in str(err)
            assert "hunter2" not in str(err) and "secret" not in str(err)
            assert err.__cause__ is None  # nothing of the host error travels
        else:
            raise AssertionError(f"{resolver.__name__}: probe should have failed")
    assert states(engine, ids)[ids[0]][0] == "blocked"  # a failed probe changes nothing


async def test_woken_item_fails_closed_when_the_link_names_a_missing_record(temporal_env, settings):
    """A woken flow re-reads the authority: a remote link that names a record that
    is not there fails the item (``identity-convergence-conflict``), never retried,
    and writes no lookup to nothing."""
    from nexuscrm.connectors.flows import FAILURE_CLASS_CONFLICT
    from nexuscrm.connectors.routes import list_connector_packs
    from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
    from nexusctl.temporal import start_fleet
    from nexusctl.worker import build_connector_worker

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    child = record_upsert(
        pack.install_id,
        pack.namespace,
        "Contact",
        "c1",
        {"LastName": "Orphan", "AccountId": "a1"},
        refs={"AccountId": "a1"},
    )
    w = t.connector_work_item
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        wq.enqueue(engine, [child])
        for _ in range(200):
            with engine.connect() as conn:
                row = conn.execute(select(w.c.State, w.c.DependencyKeyHash)).one()
            if row.State == "blocked":
                break
            await asyncio.sleep(0.1)
        assert row.State == "blocked"
        # The authority now names a record that does not exist (deleted, or restored away).
        with engine.begin() as conn:
            conn.execute(
                t.connector_remote_link.insert().values(
                    ConnectorOwnerKey=pack.namespace,
                    Namespace=pack.namespace,
                    DestinationObject="Account",
                    RemoteId="a1",
                    RecordId="ghost00000000000001",
                    CreatedDate=utcnow(),
                    LastModifiedDate=utcnow(),
                )
            )
        woken = await wake_identity_convergence_remote_identity(
            temporal_env.client, settings, pack.namespace, pack.namespace, "Account", "a1"
        )
        if woken == 0:
            # On a loaded machine the wait's own probe can find the new link
            # first and wake the item itself; either way it must fail closed.
            with engine.connect() as conn:
                assert conn.execute(select(w.c.State)).scalar_one() != "blocked"
        else:
            assert woken == 1
        for _ in range(200):
            with engine.connect() as conn:
                row = conn.execute(select(w.c.State, w.c.FailureClass)).one()
            if row.State == "failed":
                break
            await asyncio.sleep(0.1)
        assert (row.State, row.FailureClass) == ("failed", FAILURE_CLASS_CONFLICT)
        with engine.connect() as conn:
            contacts = conn.execute(text("SELECT COUNT(*) FROM Contact")).scalar_one()
        assert contacts == 0
        await fleet.signal("stop")
        await fleet.result()


def test_wake_blocked_keys_wakes_every_key_once(settings):
    """The post-commit direct wake of a batch's new links: every key's items go
    pending in one call, counted per pack; a second wake of the same keys is a no-op."""
    engine = queue_db(settings)
    other = Dependency.record("Account", "second")
    ids = block(engine, 2)
    ids2 = block(engine, 1, other)
    bystander = block(engine, 1, Dependency.record("Account", "not-woken"))
    assert wq.wake_blocked_keys(engine, [DEP.key_hash, other.key_hash]) == {"inst-1": 3}
    assert {s for s, _c in states(engine, ids + ids2).values()} == {"pending"}
    assert states(engine, bystander)[bystander[0]][0] == "blocked"
    assert wq.wake_blocked_keys(engine, [DEP.key_hash, other.key_hash]) == {}
    assert wq.wake_blocked_keys(engine, []) == {}


@pytest.mark.parametrize("raw", ["0", "-5", "nan", "inf"])
def test_probe_rate_setting_must_be_positive(monkeypatch, raw):
    """A probe rate that would stop (or unbound) every wait's probes is refused, by name."""
    from pydantic import ValidationError

    monkeypatch.setenv("NEXUS_IDENTITY_PROBES_PER_SECOND", raw)
    with pytest.raises(ValidationError, match="NEXUS_IDENTITY_PROBES_PER_SECOND"):
        Settings()
    monkeypatch.setenv("NEXUS_IDENTITY_PROBES_PER_SECOND", "2.5")
    assert Settings().identity_probes_per_second == 2.5


def test_identity_env_settings_keep_defaults_for_unusable_values():
    """``inf`` would overflow a wait's timers and ``nan`` would silently disable
    expiry: both, like unparsable values, keep the default (and are logged)."""
    from activities.identity import ENV_PREFIX, config_from_env

    default = IdentityWaitConfig()
    env = {
        ENV_PREFIX + "PROBE_INTERVAL_SECONDS": "inf",
        ENV_PREFIX + "MAX_WAIT_SECONDS": "nan",
        ENV_PREFIX + "MAX_PROBE_INTERVAL_SECONDS": "abc",
        ENV_PREFIX + "PROBE_TIMEOUT_SECONDS": "-1",
    }
    got = config_from_env(env)
    assert got.probe_interval_seconds == default.probe_interval_seconds
    assert got.max_wait_seconds == default.max_wait_seconds
    assert got.max_probe_interval_seconds == default.max_probe_interval_seconds
    assert got.probe_timeout_seconds == default.probe_timeout_seconds
    assert config_from_env({ENV_PREFIX + "MAX_WAIT_SECONDS": "0"}).max_wait_seconds == 0
