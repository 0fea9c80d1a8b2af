"""Pack upgrades and removals lose no in-flight event (issue 11, item 8).

An upgrade that changes a connector pack's payload gives it a new incarnation
and keeps the replaced one draining: its queued items run through *its* routes
(a route the upgrade dropped included) on a drain-only pool, and it is retired
once its queue is empty. ``packs remove`` fails the queued items of the pack
with class ``pack-removed`` (never ``route-not-found``, never stranded). A
drain-only incarnation's batch reads run in its drain-only context.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from sqlalchemy import Engine, select, update

from nexuscrm.connectors import queue
from nexuscrm.connectors.incarnations import FAILURE_PACK_REMOVED
from nexuscrm.connectors.processor import Processor
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetStatus
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker, build_worker
from tests.builders import (
    cli_env,
    connector_settings,
    event,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    invoke_async,
    write_connector_pack,
)


def other_events(install_id: str, keys: list[str]) -> list[queue.EnqueueRequest]:
    """``hook.other`` events of :func:`hook_pack` (``extra_route=True``)."""
    return [
        event(install_id, f"other:{k}", k, namespace="hook-pack", kind="hook.other", obj="Thing",
              payload={"key": k})
        for k in keys
    ]  # fmt: skip


def items(engine: Engine) -> dict[str, tuple[str, str, str | None]]:
    """``{work id: (installed pack id, state, failure class)}`` of every work item."""
    w = t.connector_work_item
    with engine.connect() as conn:
        return {
            r.WorkId: (r.InstalledPackId, r.State, r.FailureClass)
            for r in conn.execute(
                select(w.c.WorkId, w.c.InstalledPackId, w.c.State, w.c.FailureClass)
            )
        }


def incarnation_status(engine: Engine, install_id: str) -> str | None:
    inc = t.connector_pack_incarnation
    with engine.connect() as conn:
        return conn.execute(
            select(inc.c.Status).where(inc.c.PackInstallId == install_id)
        ).scalar_one_or_none()


async def eventually(check: Any, what: str, timeout: float = 120) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await check()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s")
        await asyncio.sleep(0.3)


async def test_upgrade_that_drops_a_route_drains_the_old_incarnation_through_its_routes(
    temporal_env, settings, hook, tmp_path
):
    settings = connector_settings(settings)
    source = tmp_path / "hook.yaml"
    await install(temporal_env, settings, [str(hook_pack(source, hook.url, extra_route=True))])
    engine = make_engine(settings.database_url)
    (old,) = list_connector_packs(engine)
    queue.enqueue(engine, hook_events(old.install_id, ["a1", "a2"]))
    queue.enqueue(engine, other_events(old.install_id, ["o1", "o2", "o3"]))

    # The upgrade drops hook.other while five items of the old payload are queued.
    await install(temporal_env, settings, [str(hook_pack(source, hook.url))])
    packs = {p.install_id: p for p in list_connector_packs(engine)}
    assert old.install_id in packs and packs[old.install_id].drain_only
    (new,) = [p for p in packs.values() if not p.drain_only]
    assert new.install_id != old.install_id
    assert [r.event_kind for r in new.pack.inbound_routes] == ["hook.event"]
    assert incarnation_status(engine, old.install_id) == "draining"
    queue.enqueue(engine, hook_events(new.install_id, ["n1"]))

    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        try:

            async def all_done() -> bool:
                return all(s in ("succeeded", "failed") for _p, s, _c in items(engine).values())

            await eventually(all_done, "every item finished")
            # Every item succeeded: the old ones through the old payload's routes.
            assert sorted((p, s, c) for p, s, c in items(engine).values()) == sorted(
                [(old.install_id, "succeeded", None)] * 5 + [(new.install_id, "succeeded", None)]
            )
            posted = sorted(b["payload"]["key"] for b in hook.received)
            assert posted == ["a1", "a2", "n1", "o1", "o2", "o3"]

            # The drained incarnation is retired and its pool stopped; the new one serves.
            async def retired() -> bool:
                return incarnation_status(engine, old.install_id) == "retired"

            await eventually(retired, "old incarnation retired")

            async def one_pool() -> bool:
                st = await fleet.query("status", result_type=FleetStatus)
                return [p.install_id for p in st.pools] == [new.install_id]

            await eventually(one_pool, "only the new incarnation's pool")
        finally:
            await fleet.signal("stop")
            await fleet.result()
    assert [p.install_id for p in list_connector_packs(engine)] == [new.install_id]


async def test_packs_remove_fails_queued_items_pack_removed(temporal_env, settings, hook, tmp_path):
    settings = connector_settings(settings)
    source = tmp_path / "hook.yaml"
    await install(temporal_env, settings, [str(hook_pack(source, hook.url, extra_route=True))])
    engine = make_engine(settings.database_url)
    (old,) = list_connector_packs(engine)
    queue.enqueue(engine, other_events(old.install_id, ["o1"]))
    # An upgrade leaves the old incarnation draining with its item, then the pack is removed.
    await install(temporal_env, settings, [str(hook_pack(source, hook.url))])
    (new,) = [p for p in list_connector_packs(engine) if not p.drain_only]
    queue.enqueue(engine, hook_events(new.install_id, ["n1", "n2"]))
    async with build_worker(temporal_env.client, settings):  # RemovePack runs through the queue
        result = await invoke_async(
            ["packs", "remove", "hook-pack"], cli_env(settings, temporal_env)
        )
    assert result.exit_code == 0, result.output
    assert "3 queued work item(s) failed pack-removed" in result.output
    got = sorted((p, s, c) for p, s, c in items(engine).values())
    assert got == sorted(
        [(old.install_id, "failed", FAILURE_PACK_REMOVED)]
        + [(new.install_id, "failed", FAILURE_PACK_REMOVED)] * 2
    )
    assert incarnation_status(engine, old.install_id) == "removed"
    assert list_connector_packs(engine) == []
    # A replay of either incarnation's item is refused, naming the pack: it
    # would only fail pack-removed again (a fresh-user trial saw it do so).
    for work_id in items(engine):
        res = await invoke_async(["events", "replay", work_id], cli_env(settings, temporal_env))
        assert res.exit_code == 1, res.output
        assert "its pack hook-pack" in res.output and "was removed" in res.output, res.output
    assert len(items(engine)) == 3  # nothing was added
    # A fleet started afterwards finds nothing stranded and serves nothing.
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        try:

            async def reconciled() -> bool:
                st = await fleet.query("status", result_type=FleetStatus)
                return st.reconciles >= 2

            await eventually(reconciled, "two reconciles")
            assert (await fleet.query("status", result_type=FleetStatus)).pools == []
        finally:
            await fleet.signal("stop")
            await fleet.result()
    assert hook.received == []


async def test_removal_mid_drain_is_swept_by_the_fleet_and_never_route_not_found(
    temporal_env, settings, hook, tmp_path
):
    """A removal made outside the CLI (``remove_pack`` alone): the fleet's reconcile fails
    the stranded items ``pack-removed``."""
    from nexuscrm.controlplane.packs_apply import remove_pack

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "h.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    queue.enqueue(engine, hook_events(pack.install_id, ["r1", "r2"]))
    remove_pack(engine, "hook-pack")
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        try:

            async def swept() -> bool:
                return all(s == "failed" for _p, s, _c in items(engine).values())

            await eventually(swept, "items failed")
        finally:
            await fleet.signal("stop")
            await fleet.result()
    assert {c for _p, _s, c in items(engine).values()} == {FAILURE_PACK_REMOVED}


def test_drain_only_batch_reads_run_in_the_drain_only_context(
    settings, hook, tmp_path, monkeypatch
):
    """Runtime batch reads of a drain-only incarnation check that it is still installed
    before every read: a removed incarnation's credential is never sent."""
    from nexuscrm import catalog
    from nexuscrm.controlplane import metadata, packs_apply

    monkeypatch.setenv("NEXUS_CREDENTIAL_CRM_API", "drain-secret")
    engine = make_engine(settings.database_url)
    metadata.apply_metadata(engine)
    catalog.CACHE.invalidate()
    profile = {
        "name": "batch",
        "endpoint": hook.url.rsplit("/", 1)[0],
        "credential_ref": "crm-api",
        "object_path_map": {"Thing": "/batch/Thing"},
    }
    path = write_connector_pack(
        tmp_path / "p.yaml", "hook-pack", [{"event_kind": "hook.event", "flow": "webhook",
                                            "webhook_url": hook.url}], [profile]
    )  # fmt: skip
    packs_apply.apply_packs(engine, packs_apply.load_plan(engine, [str(path)], False))
    (pack,) = list_connector_packs(engine)
    queue.enqueue(engine, hook_events(pack.install_id, ["d1", "d2"]))
    with engine.begin() as conn:  # the incarnation drains
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.PackInstallId == pack.install_id)
            .values(Status="draining")
        )
    processor = Processor(engine, http=httpx.Client())

    def claim_one() -> list[queue.ClaimedItem]:
        spec = queue.ClaimSpec(
            installed_pack_id=pack.install_id, queue_classes=[], batch_size=1,
            lease_owner="test", lease_seconds=60, max_processing_rows=10,
        )  # fmt: skip
        return queue.load_claimed(engine, queue.claim_leases(engine, spec))

    first = processor.process(claim_one())
    assert first.succeeded == 1
    reads = [b for b in hook.received if "ids" in b]
    assert len(reads) == 1  # the batch read, while installed
    with engine.begin() as conn:  # the incarnation is removed meanwhile
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.PackInstallId == pack.install_id)
            .values(Status="removed")
        )
    second = processor.process(claim_one())
    assert second.succeeded == 0 and second.retried == 1
    assert len([b for b in hook.received if "ids" in b]) == 1  # no read for a removed pack
    assert json.dumps(second.failure_classes) == json.dumps({"enrichment-failed": 1})


def test_replaying_an_item_of_a_retired_incarnation_drains_it_again(settings, hook, tmp_path):
    """Retire only when empty; a replayed item of a retired incarnation reopens it (draining),
    so it runs through its own routes instead of waiting forever."""
    from nexuscrm import catalog
    from nexuscrm.connectors.incarnations import reopen_retired, retire_drained
    from nexuscrm.controlplane import metadata, packs_apply

    engine = make_engine(settings.database_url)
    metadata.apply_metadata(engine)
    catalog.CACHE.invalidate()

    def apply(extra: bool) -> None:
        path = hook_pack(tmp_path / "h.yaml", hook.url, extra_route=extra)
        packs_apply.apply_packs(engine, packs_apply.load_plan(engine, [str(path)], False))

    apply(True)
    (old,) = list_connector_packs(engine)
    (work_id,) = queue.enqueue(engine, other_events(old.install_id, ["o1"])).work_ids
    apply(False)  # the upgrade: old drains
    assert incarnation_status(engine, old.install_id) == "draining"
    assert not retire_drained(engine, old.install_id)  # it still has its item
    w = t.connector_work_item
    with engine.begin() as conn:
        conn.execute(update(w).where(w.c.WorkId == work_id).values(State="failed"))
    assert retire_drained(engine, old.install_id)
    assert old.install_id not in {p.install_id for p in list_connector_packs(engine)}
    assert reopen_retired(engine) == 0
    queue.replay(engine, work_id)
    assert reopen_retired(engine) == 1
    assert incarnation_status(engine, old.install_id) == "draining"
    row = next(p for p in list_connector_packs(engine) if p.install_id == old.install_id)
    assert row.drain_only and [r.event_kind for r in row.pack.inbound_routes] == [
        "hook.event",
        "hook.other",
    ]
