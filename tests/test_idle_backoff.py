"""Idle workers back their timers off; the fleet's backlog reconcile wakes a stalled pool.

Patches ``idle-backoff`` (InboundWorker) and ``backlog-wake`` (ConnectorFleet),
issue 16's idle target: an idle pool costs next to nothing,
and work that arrives without a ``wake`` (a retry coming due, an item written
by another program) is still claimed within a reconcile interval, not one
backed-off idle timer. Real dev server, real databases (SQLite and MariaDB);
timings are read from the server's histories and the database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    connector_settings,
    event,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
)

PACK = "pack-idle"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    ensure_system_schema(eng)
    yield eng
    eng.dispose()


def _claim(
    engine: Engine, owner: str, n: int = 1, lease_seconds: float = 30
) -> list[wq.ClaimedItem]:
    return wq.claim(
        engine,
        wq.ClaimSpec(
            installed_pack_id=PACK,
            queue_classes=(),
            batch_size=n,
            lease_owner=owner,
            lease_seconds=lease_seconds,
            max_processing_rows=100,
        ),
    )


def _ev(key: str, source_id: str) -> wq.EnqueueRequest:
    return event(PACK, key, source_id, obj="Account", payload={"key": key})


def test_stalled_pack_flags_claimable_work_only_while_a_worker_holds_no_lease(engine):
    """The backlog reconcile's test: claimable by the claim's own scan, and a worker free."""
    assert not wq.stalled_pack(engine, PACK, 2, 100)  # nothing queued
    wq.enqueue(engine, [_ev("a", "r1"), _ev("b", "r2")])
    assert wq.stalled_pack(engine, PACK, 2, 100)  # claimable, nobody holds a lease
    (a,) = _claim(engine, "worker-1")
    assert wq.stalled_pack(engine, PACK, 2, 100)  # one of two workers free, b claimable
    assert not wq.stalled_pack(engine, PACK, 1, 100)  # the only worker is busy
    # ... unless its lease is an old pool's (another fence generation): a rebuilt
    # pool's workers are idle while the draining pool still holds leases.
    assert wq.stalled_pack(engine, PACK, 1, 100, generation=2)
    assert not wq.stalled_pack(engine, PACK, 2, 1)  # no room left under the budget
    (b,) = _claim(engine, "worker-2")
    assert not wq.stalled_pack(engine, PACK, 3, 100)  # nothing claimable is left
    # A retry not due yet is not claimable; once due it is.
    with engine.begin() as conn:
        wq.finish_retry(
            conn, a, run_after=utcnow() + timedelta(hours=1), failure_class="x", summary="y"
        )
    assert not wq.stalled_pack(engine, PACK, 3, 100)
    assert wq.stalled_pack(engine, PACK, 3, 100, now=utcnow() + timedelta(hours=2))
    # An item behind a blocked lane head is not claimable: no wake for it.
    wq.enqueue(engine, [_ev("b2", "r2")])  # behind b (processing, then blocked)
    with engine.begin() as conn:
        wq.block_item(conn, b, Dependency.record("Account", "001X"), summary="waits")
    assert not wq.stalled_pack(engine, PACK, 3, 100)
    # A stale lease (its worker died) is claimable again.
    wq.enqueue(engine, [_ev("c", "r3")])
    (c,) = _claim(engine, "worker-3", n=5, lease_seconds=1)
    assert not wq.stalled_pack(engine, PACK, 1, 100)  # worker-3's lease is live
    assert wq.stalled_pack(engine, PACK, 1, 100, now=utcnow() + timedelta(seconds=30))
    assert c.source_id == "r3"


async def _running_workers(client: Client, task_queue: str) -> list[str]:
    query = (
        f'WorkflowType="InboundWorker" AND TaskQueue="{task_queue}" AND ExecutionStatus="Running"'
    )
    return [wf.id async for wf in client.list_workflows(query)]


async def _idle_timers(client: Client, workflow_id: str) -> list[float]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]


async def _timers_until(
    client: Client, workflow_id: str, done: Callable[[list[float]], bool], timeout: float = 30
) -> list[float]:
    """The worker's idle timers (seconds, from its history) once ``done`` holds."""
    deadline = time.monotonic() + timeout
    while not done(timers := await _idle_timers(client, workflow_id)):
        assert time.monotonic() < deadline, timers
        await asyncio.sleep(0.3)
    return timers


async def test_idle_timers_double_up_to_the_cap_and_a_wake_resets_them(
    temporal_env, settings, tmp_path: Path, hook
):
    """Read from a worker's history: 0.2, 0.4, 0.8, then the 1 s cap; a wake restarts at 0.2."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    inp = fast_fleet(settings)
    inp.idle_seconds, inp.idle_max_seconds = 0.2, 1.0
    inp.drain_timeout_seconds = 0  # no backoff grace (2 x the drain timeout)
    inp.reconcile_interval_seconds = 3600  # no periodic reconcile here
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, inp)
        deadline = time.monotonic() + 60
        while not (
            workers := await _running_workers(temporal_env.client, settings.connector_task_queue)
        ):
            assert time.monotonic() < deadline, "no worker started"
            await asyncio.sleep(0.2)
        worker = workers[0]
        timers = await _timers_until(temporal_env.client, worker, lambda ts: len(ts) >= 5)
        assert timers[:5] == [0.2, 0.4, 0.8, 1.0, 1.0], timers
        await fleet.signal("wake")
        after = await _timers_until(
            temporal_env.client, worker, lambda ts: 0.2 in ts[len(timers) :]
        )
        assert after[len(timers) :].count(0.2) >= 1  # the wake reset the backoff
        await fleet.signal("stop")
        await fleet.result()


async def test_work_without_a_wake_is_claimed_within_a_reconcile_not_an_idle_timer(
    temporal_env, settings, tmp_path: Path, hook
):
    """Idle timers of 30 s: a retry coming due and an item enqueued without a ``wake``
    are both claimed within a few 1 s reconciles (the fleet wakes the stalled pool)."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    inp = fast_fleet(settings)
    inp.idle_seconds = inp.idle_max_seconds = 30.0
    hook.script = {"flaky": [503, 503, 200]}  # retries 1 s, then 2 s after
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, inp)
        started = time.monotonic()
        wq.enqueue(engine, hook_events(pack.install_id, ["flaky"]))  # no wake sent
        await wait_drained(engine, timeout=60)
        retried = time.monotonic() - started
        await asyncio.sleep(2)  # the workers sleep on their 30 s timers now
        started = time.monotonic()
        wq.enqueue(engine, hook_events(pack.install_id, ["late"]))  # no wake sent
        await wait_drained(engine, timeout=60)
        late = time.monotonic() - started
        await fleet.signal("stop")
        await fleet.result()
    w = t.connector_work_item
    with engine.connect() as conn:
        states = sorted(conn.execute(select(w.c.State)).scalars())
    assert states == ["succeeded", "succeeded"]
    # Without the backlog wake each would wait out a 30 s idle timer.
    assert retried < 20, retried
    assert late < 10, late
    engine.dispose()
