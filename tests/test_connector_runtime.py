"""The connector inbound runtime end to end: real Temporal dev server, real databases."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Engine, select, text

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetStatus
from nexuscrm.controlplane.packs_apply import remove_pack
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    cli_env,
    connector_settings,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    record_upsert,
    sync_corpus_data_plans_shuffled,
    wait_drained,
    wait_pools,
    write_connector_pack,
)

ROOT = Path(__file__).resolve().parents[1]


async def test_corpus_data_plans_sync_shuffled(temporal_env, settings):
    await sync_corpus_data_plans_shuffled(temporal_env, settings)


def work_by_source(engine: Engine) -> dict[str, Any]:
    w, e = t.connector_work_item, t.connector_event
    with engine.connect() as conn:
        rows = conn.execute(
            select(w.c.WorkId, w.c.State, w.c.FailureClass, w.c.ReplayOfWorkId, e.c.SourceId)
            .join(e, e.c.EventId == w.c.EventId)
            .order_by(w.c.WorkId)
        ).all()
    return {r.SourceId: r for r in rows}


def attempts(engine: Engine, work_id: str) -> list[str]:
    a = t.connector_work_attempt
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(a.c.OutcomeState).where(a.c.WorkId == work_id).order_by(a.c.Attempt)
            ).scalars()
        )


async def test_same_record_events_apply_in_enqueue_order_with_8_workers(temporal_env, settings):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    events = [
        record_upsert(
            pack.install_id,
            pack.namespace,
            "Account",
            f"acct{k}",
            {"Name": f"Account {k}", "Phone": f"v{i:02d}"},
            key=f"acct{k}:v{i}",
        )
        for i in range(12)
        for k in range(6)
    ]
    queue.enqueue(engine, events)
    catalog.CACHE.invalidate()
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        states = await wait_drained(engine)
        status = (await fleet.query("status", result_type=FleetStatus)).pools
        await fleet.signal("stop")
        await fleet.result()
    assert status[0].worker_count == 8
    assert states == {"succeeded": len(events)}
    with engine.connect() as conn:
        phones: dict[str, str] = dict(conn.execute(text("SELECT Name, Phone FROM Account")).all())
    assert phones == {f"Account {k}": "v11" for k in range(6)}


async def test_flow_errors_retry_with_backoff_fail_with_class_and_replay(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    hook.script = {"flaky": [503, 503, 200], "broken": [400]}
    queue.enqueue(engine, hook_events(pack.install_id, ["flaky", "broken"]))
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        await wait_drained(engine)
        items = work_by_source(engine)
        assert items["flaky"].State == "succeeded"
        assert attempts(engine, items["flaky"].WorkId) == ["retry", "retry", "succeeded"]
        assert items["broken"].State == "failed"
        assert items["broken"].FailureClass == "webhook-http-400"
        hook.script = {}  # the endpoint is fixed
        new_id = queue.replay(engine, items["broken"].WorkId)
        await fleet.signal("wake", pack.install_id)
        await wait_drained(engine)
        await fleet.signal("stop")
        await fleet.result()
    with engine.connect() as conn:
        replayed = (
            conn.execute(
                select(t.connector_work_item).where(t.connector_work_item.c.WorkId == new_id)
            )
            .mappings()
            .one()
        )
    assert replayed["State"] == "succeeded"
    assert replayed["ReplayOfWorkId"] == items["broken"].WorkId


async def test_pack_change_rebuilds_pool_and_removal_drains_it(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    pack_file = hook_pack(tmp_path / "hook.yaml", hook.url)
    await install(temporal_env, settings, [str(pack_file)])
    engine = make_engine(settings.database_url)
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        first = await wait_pools(fleet, 1)
        # Reapply with a change: ApplyAll signals the fleet, which rebuilds the pool.
        await install(
            temporal_env, settings, [str(hook_pack(pack_file, hook.url, extra_route=True))]
        )
        second = await wait_pools(fleet, 1, not_fingerprint=first[0].fingerprint)
        old = temporal_env.client.get_workflow_handle(first[0].supervisor_workflow_id)
        assert await old.result() == "drained"
        # Remove the pack: the pool drains and stops.
        remove_pack(engine, "hook-pack")
        await fleet.signal("reconcile")
        await wait_pools(fleet, 0)
        current = temporal_env.client.get_workflow_handle(second[0].supervisor_workflow_id)
        assert await current.result() == "drained"
        await fleet.signal("stop")
        await fleet.result()


async def test_worker_process_killed_mid_batch_leases_expire_and_nothing_duplicates(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    # A connector whose batch read takes a second: a killed worker surely dies
    # holding leases on a batch in flight.
    slow = tmp_path / "slow-sync.yaml"
    write_connector_pack(
        slow,
        "slow-sync",
        [{"event_kind": "salesforce.record.upsert"}],
        [{"name": "batch", "endpoint": hook.url, "object_path_map": {"Contact": "/records"}}],
    )
    hook.delay = 1.0
    await install(temporal_env, settings, [str(slow)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    events = [
        record_upsert(
            pack.install_id,
            pack.namespace,
            "Contact",
            f"c{k}",
            {"FirstName": "F", "LastName": f"L{k}"},
            key=f"c{k}",
        )
        for k in range(400)
    ]
    queue.enqueue(engine, events)
    env = {
        **os.environ,
        **cli_env(settings, temporal_env),
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)
    try:
        inp = fast_fleet(settings)
        inp.lease_seconds = 3
        fleet = await start_fleet(temporal_env.client, settings, inp)
        for _ in range(600):  # until batches are claimed (their batch reads take 1 s)
            if queue.pack_queue_stats(engine)[0].by_state().get("processing", 0):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    hook.delay = 0
    async with build_connector_worker(temporal_env.client, settings):
        states = await wait_drained(engine, timeout=180)
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": len(events)}
    a = t.connector_work_attempt
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM Contact")).scalar_one() == len(events)
        abandoned = (
            conn.execute(select(a.c.WorkId).where(a.c.OutcomeState == "abandoned")).scalars().all()
        )
    assert abandoned, "no batch was in flight when the worker died"
    for work_id in abandoned[:5]:
        # the dead worker's attempt, then the one that finished it (a transient
        # lock in between may add a retry)
        history = attempts(engine, work_id)
        assert history[0] == "abandoned" and history[-1] == "succeeded", history


async def test_serving_selection_serves_selected_pack_and_stops_it_when_unverifiable(
    temporal_env, settings, hook, tmp_path
):
    pack_file = hook_pack(tmp_path / "hook.yaml", hook.url)
    await install(temporal_env, settings, [str(SF_SYNC), str(pack_file)])
    engine = make_engine(settings.database_url)
    row = next(r for r in list_connector_packs(engine) if r.namespace == "hook-pack")
    sel_file = tmp_path / "selection.yaml"
    sel_file.write_text(
        yaml.safe_dump(
            {
                "packs": [
                    {
                        "namespace": "hook-pack",
                        "installed_pack_id": row.install_id,
                        "payload_digest": row.payload_hash,
                        "inbound_routes": [{"event_kind": "hook.event", "route_version": 1}],
                    }
                ]
            }
        )
    )
    settings = connector_settings(settings).model_copy(update={"serving_selection": str(sel_file)})
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        (served,) = await wait_pools(fleet, 1)
        assert served.namespace == "hook-pack"  # salesforce-sync is installed but not selected
        # The pack changes under the frozen selection: its digest no longer verifies.
        await install(
            temporal_env, settings, [str(hook_pack(pack_file, hook.url, extra_route=True))]
        )
        await wait_pools(fleet, 0)
        stopped = temporal_env.client.get_workflow_handle(served.supervisor_workflow_id)
        assert await stopped.result() == "drained"
        await fleet.signal("stop")
        await fleet.result()
