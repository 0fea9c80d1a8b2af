"""Leases of a batch in hand live as long as its activity works, and die with it.

Issue 11, items 1 and 10, against the real thing (dev server, SQLite and
MariaDB, a local HTTP endpoint):

* an external call (a webhook POST, a batch read) slower than the lease is
  made once per event, and while it runs no other item of its target record
  is claimed: the process activity's lease keeper extends the batch's leases
  every third of the lease, independent of item boundaries;
* a worker process killed mid-batch costs the heartbeat timeout, not the
  lease: the inbound worker workflow hands the leases of a batch whose
  activity failed or timed out back at once (``connectors.release``); every
  external call carries an ``Idempotency-Key`` (the work id for a webhook),
  equal on a repeat.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, text
from temporalio.testing import ActivityEnvironment

from activities.common import expect_progress, fatal_is_final, keep_alive, progress
from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue
from nexuscrm.connectors.lease_keeper import LeaseKeeper
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    HookCall,
    HookServer,
    abandoned_attempts,
    cli_env,
    connector_settings,
    event,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
    write_connector_pack,
)

ROOT = Path(__file__).resolve().parents[1]
LEASE_S = 6
"""A short lease, so a call of twice its length takes seconds. Not shorter: the
keeper extends every third of it, and on a machine loaded to 5-14 runnable
processes (the whole suite beside benchmarks) a 4 s lease once lapsed between
two extensions, so another worker reclaimed the item while its call ran."""


def test_keep_alive_runs_while_the_phase_progresses_and_stops_when_it_stalls():
    ticks: list[float] = []

    @fatal_is_final
    def phase() -> int:
        keep_alive(lambda: ticks.append(time.monotonic()), 0.1)
        expect_progress(1.0)
        for _ in range(4):  # 2 s of steps, each well within the bound
            time.sleep(0.5)
            progress()
        progressing = len(ticks)
        time.sleep(3.0)  # one step hangs past the bound: the chore stops
        return progressing

    start = time.monotonic()
    progressing = ActivityEnvironment().run(phase)
    assert progressing >= 8, ticks  # ran through the 2 s of progress
    assert ticks[-1] - start < 2.0 + 1.0 + 1.0, [t - start for t in ticks]
    assert len(ticks) - progressing <= 20, len(ticks) - progressing  # 30 if never stopped
    with pytest.raises(ValueError, match="every_seconds"):
        keep_alive(lambda: None, 0)


def test_lease_keeper_extends_held_leases_and_drops_ended_ones(db_url):
    engine = make_engine(db_url)
    ensure_system_schema(engine)
    queue.enqueue(engine, [event("pack-1", k) for k in ("a", "b", "c")])
    start = utcnow()
    spec = queue.ClaimSpec("pack-1", (), 10, "w", 30, 10, now=start)
    claimed = queue.claim(engine, spec)
    keeper = LeaseKeeper(engine, [(i.work_id, i.lease_token) for i in claimed], 30)
    assert keeper.every_seconds == 10
    a, b, c = claimed
    with engine.begin() as conn:
        queue.finish_succeeded(conn, a)  # finished: its lease ended
    queue.release_leases(engine, [b])  # handed back
    assert sorted(keeper.tick(start + timedelta(seconds=25))) == [a.work_id, b.work_id]
    assert keeper.held == [c.work_id]
    # c is held 30 s past the tick: a claim after its first lease expired finds nothing.
    later = queue.ClaimSpec("pack-1", (), 10, "x", 30, 10, now=start + timedelta(seconds=40))
    assert [i.work_id for i in queue.claim(engine, later)] == [b.work_id]
    assert keeper.tick(start + timedelta(seconds=50)) == []
    with pytest.raises(ValueError, match="lease_seconds"):
        LeaseKeeper(engine, [], 0)
    engine.dispose()


def _assert_one_at_a_time(calls: list[HookCall]) -> None:
    """The calls never overlapped: each started after the previous one ended."""
    spans = sorted((c.started, c.ended) for c in calls)
    for (_s1, e1), (s2, _e2) in itertools.pairwise(spans):
        assert e1 is not None and s2 >= e1, f"two calls for one record at once: {spans}"


async def _run_fleet(temporal_env, settings, engine) -> dict[str, int]:
    async with build_connector_worker(temporal_env.client, settings):
        inp = fast_fleet(settings)
        inp.lease_seconds = LEASE_S
        fleet = await start_fleet(temporal_env.client, settings, inp)
        states = await wait_drained(engine, timeout=120)
        await fleet.signal("stop")
        await fleet.result()
    return states


async def test_webhook_slower_than_the_lease_is_posted_once_and_holds_its_record(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    # Two events of one target record from two source records: only the
    # target lane (a live lease) keeps the second from running beside the first.
    events = [
        event(
            pack.install_id,
            f"hook:{k}",
            k,
            namespace="hook-pack",
            kind="hook.event",
            obj="Thing",
            payload={"key": k},
            target="T1",
        )
        for k in ("a", "b")
    ]
    queue.enqueue(engine, events)
    hook.delay = 2 * LEASE_S
    states = await _run_fleet(temporal_env, settings, engine)
    assert states == {"succeeded": 2}
    posts = Counter(c.body["payload"]["key"] for c in hook.calls)
    assert posts == {"a": 1, "b": 1}, posts
    _assert_one_at_a_time(hook.calls)
    a = t.connector_work_attempt
    with engine.connect() as conn:
        outcomes = conn.execute(select(a.c.OutcomeState)).scalars().all()
    assert sorted(outcomes) == ["succeeded", "succeeded"], outcomes  # nothing abandoned


async def test_batch_read_slower_than_the_lease_is_made_once_and_holds_its_record(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    slow = write_connector_pack(
        tmp_path / "slow-sync.yaml",
        "slow-sync",
        [{"event_kind": "salesforce.record.upsert"}],
        [{"name": "batch", "endpoint": hook.url, "object_path_map": {"Contact": "/records"}}],
    )
    await install(temporal_env, settings, [str(slow)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    # Contact c1, written by events of two source records (c1 itself and c1-alt).
    events = [
        event(
            pack.install_id,
            source,
            source,
            namespace=pack.namespace,
            kind="salesforce.record.upsert",
            obj="Contact",
            payload={
                "sobject": "Contact",
                "remote_id": "c1",
                "fields": {"FirstName": "F", "LastName": last},
            },
            target="c1",
        )
        for source, last in (("c1", "First"), ("c1-alt", "Second"))
    ]
    queue.enqueue(engine, events)
    hook.delay = 2 * LEASE_S
    states = await _run_fleet(temporal_env, settings, engine)
    assert states == {"succeeded": 2}
    reads = Counter(i for c in hook.calls for i in c.body["ids"])
    assert reads == {"c1": 1, "c1-alt": 1}, reads
    _assert_one_at_a_time(hook.calls)
    # Every read names its batch: the same key on a repeat of the same batch.
    assert all(c.headers.get("Idempotency-Key") for c in hook.calls), hook.calls
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM Contact")).scalar_one() == 1


async def test_worker_killed_mid_call_costs_the_heartbeat_timeout_not_the_lease(
    temporal_env, settings, hook: HookServer, tmp_path
):
    long_lease, heartbeat_s, count = 120, 5, 12
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    keys = [f"k{n:02d}" for n in range(count)]
    queue.enqueue(engine, hook_events(pack.install_id, keys))
    hook.delay = 1.0
    env = {
        **os.environ,
        **cli_env(settings, temporal_env),
        "NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK": "2",
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)
    try:
        inp = fast_fleet(settings)
        inp.lease_seconds = long_lease
        inp.heartbeat_timeout_seconds = heartbeat_s
        fleet = await start_fleet(temporal_env.client, settings, inp)
        await hook.in_flight()  # a POST (the server sleeps 1 s in it)
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    in_flight = {c.body["payload"]["key"] for c in hook.calls if c.ended is None}
    hook.delay = 0
    async with build_connector_worker(temporal_env.client, settings):
        states = await wait_drained(engine, timeout=long_lease / 2)
        done = time.monotonic() - killed
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": count}
    assert done < long_lease / 2, done  # the heartbeat timeout, not the lease
    released = [(wid, c) for _k, wid, c in abandoned_attempts(engine)]
    with engine.connect() as conn:
        work_ids = dict(
            conn.execute(
                select(t.connector_event.c.IdempotencyKey, t.connector_work_item.c.WorkId).join(
                    t.connector_work_item,
                    t.connector_work_item.c.EventId == t.connector_event.c.EventId,
                )
            ).all()
        )
    assert released and {c for _w, c in released} == {"activity-timeout"}, released
    # Every POST carries the item's work id as its idempotency key; the call
    # in flight at the kill was made again, with the same key.
    by_key: dict[str, set[str | None]] = {}
    for c in hook.calls:
        by_key.setdefault(c.body["payload"]["key"], set()).add(c.headers.get("Idempotency-Key"))
    assert by_key == {k: {work_ids[f"hook:{k}"]} for k in keys}, by_key
    posts = Counter(c.body["payload"]["key"] for c in hook.calls)
    assert in_flight and all(posts[k] == 2 for k in in_flight), (in_flight, posts)
    print(f"SIGKILL: all {count} done {done:.1f} s after the kill (lease {long_lease} s)")
