"""A record with two unresolved lookups waits on each in turn (issue 11 item 2).

Woken from the wait of its first lookup's parent, the item blocks again on
the second lookup's parent. A late probe of the first wait must leave it
alone: only a row that lost its own dependency columns is
``identity-convergence-invalid`` (the seed's rule); an item blocked on
another dependency belongs to that dependency's wait.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

import activities.identity_client as wait_client
from activities.identity import IdentityActivities
from activities.identity_client import start_wait
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import FAILURE_CLASS_INVALID, Dependency, wait_workflow_id
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import IdentityWaitConfig
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    assert_no_blocked_on_linked,
    connector_settings,
    event,
    fast_fleet,
    install,
    record_upsert,
    wait_drained,
)
from tests.identity_waits import no_blocked_on_linked  # noqa: F401 (autouse)
from workflows.identity import IdentityWaitWorkflow

NS = "salesforce-sync"
DEP_A = Dependency.remote(NS, NS, "Account", "a1")
DEP_B = Dependency.remote(NS, NS, "Contact", "c0")
_w = t.connector_work_item


def _claim_one(engine: Engine) -> wq.ClaimedItem:
    (item,) = wq.claim(
        engine,
        wq.ClaimSpec(
            installed_pack_id="inst-1",
            queue_classes=[],
            batch_size=1,
            lease_owner="t",
            lease_seconds=60,
            max_processing_rows=1000,
        ),
    )
    return item


def _block(engine: Engine, item: wq.ClaimedItem, dep: Dependency) -> None:
    with engine.begin() as conn:
        wq.block_item(conn, item, dep, summary="parent not linked")


def _row(engine: Engine, work_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(_w.c.State, _w.c.FailureClass, _w.c.DependencyKeyHash).where(
                _w.c.WorkId == work_id
            )
        ).one()


async def _parked(handle: WorkflowHandle[Any, Any], timeout: float = 60) -> None:
    """Wait until the wait ``handle`` runs and is parked (``sleeping``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if (await handle.query(IdentityWaitWorkflow.status)).state == "sleeping":
                return
        except Exception:  # not started yet
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"wait {handle.id} never parked")
        await asyncio.sleep(0.1)


async def _probes(handle: WorkflowHandle[Any, Any], at_least: int, timeout: float = 60) -> int:
    """Wait until the wait ``handle`` probed ``at_least`` times; returns its probe count."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            status = await handle.query(IdentityWaitWorkflow.status)
            if status.probes >= at_least:
                return int(status.probes)
        except Exception:  # not started yet, or closed: the caller's next step tells
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"wait {handle.id} did not probe {at_least} times")
        await asyncio.sleep(0.1)


async def test_late_probe_of_the_first_wait_leaves_the_reblocked_item_alone(
    temporal_env: Any, settings: Settings
) -> None:
    """Woken from wait A (its wake signal lost), re-blocked on B: wait A's next
    probe (asked by ``register()`` without items, as recovery's sweep of waits
    without blocked items asks it) ends wait A and leaves the item blocked on
    B, never failed invalid."""
    engine = make_engine(settings.database_url)
    t.system_metadata.create_all(engine)
    client: Client = temporal_env.client
    queue = settings.identity_task_queue
    wq.enqueue(engine, [event("inst-1", f"c-{uuid.uuid4().hex[:6]}", namespace=NS, obj="Contact")])
    item = _claim_one(engine)
    _block(engine, item, DEP_A)
    config = IdentityWaitConfig(
        probe_interval_seconds=0.3,
        max_probe_interval_seconds=0.5,
        probe_timeout_seconds=5,
        max_wait_seconds=0,
        search_attributes=False,
    )
    acts = IdentityActivities(engine, settings, config)  # the real owner read
    async with Worker(
        client,
        task_queue=queue,
        workflows=[IdentityWaitWorkflow],
        activities=acts.wait_activities(),
        activity_executor=ThreadPoolExecutor(4),
    ):
        await start_wait(
            client,
            database_id=settings.database_id,
            task_queue=queue,
            dependency=DEP_A,
            work_ids=[item.work_id],
            config=config,
            probe_now=True,
        )
        handle = client.get_workflow_handle(wait_workflow_id(settings.database_id, DEP_A.key_hash))
        await _probes(handle, 1)
        # Parent A linked: its batch woke the item directly (the wake signal to
        # wait A was lost), and the item's next attempt blocked on parent B.
        assert wq.wake_blocked_keys(engine, [DEP_A.key_hash]) == {"inst-1": 1}
        again = _claim_one(engine)
        assert again.work_id == item.work_id
        _block(engine, again, DEP_B)
        # Wait A is parked; asked to probe, it finds none of its own items and ends.
        await handle.signal(IdentityWaitWorkflow.register)
        assert await asyncio.wait_for(handle.result(), 60) == 0
        status = await handle.query(IdentityWaitWorkflow.status)
        assert status.state == "empty"
    row = _row(engine, item.work_id)
    assert (row.State, row.FailureClass, row.DependencyKeyHash) == (
        "blocked",
        "dependency-unresolved",
        DEP_B.key_hash,
    )


@pytest.mark.parametrize("first", ["account", "contact"])
async def test_two_lookups_converge_with_parents_late_in_either_order(
    temporal_env: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """A Contact looking up an Account and a Contact, both parents arriving late
    (after the child blocked and after its wait probed), in either order, with
    every wake signal to a wait lost (recovery's recheck and its sweep of waits
    without blocked items must cover it): the child
    converges once with both lookups, no item fails, no attempt is invalid,
    and no item stays blocked on a parent that is linked."""
    # Waits without blocked items are swept every 3 s (the max probe interval).
    monkeypatch.setenv("NEXUSCRM_CONNECTOR_IDENTITY_PROBE_INTERVAL_SECONDS", "3")
    monkeypatch.setenv("NEXUSCRM_CONNECTOR_IDENTITY_MAX_PROBE_INTERVAL_SECONDS", "3")

    async def lost(*_args: object) -> bool:
        return False

    monkeypatch.setattr(wait_client, "signal_wake", lost)
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    child = record_upsert(
        pack.install_id,
        pack.namespace,
        "Contact",
        "c1",
        {"LastName": "Child", "AccountId": "a1", "ReportsToId": "c0"},
        refs={"AccountId": "a1", "ReportsToId": "c0"},
    )
    parents = {
        "account": record_upsert(pack.install_id, pack.namespace, "Account", "a1", {"Name": "A"}),
        "contact": record_upsert(
            pack.install_id, pack.namespace, "Contact", "c0", {"LastName": "B"}
        ),
    }
    second = "contact" if first == "account" else "account"
    client: Client = temporal_env.client
    wait_a = client.get_workflow_handle(wait_workflow_id(settings.database_id, DEP_A.key_hash))
    wait_b = client.get_workflow_handle(wait_workflow_id(settings.database_id, DEP_B.key_hash))

    lane = f"{pack.namespace}/Contact/c1"

    async def child_blocked_on(dep: Dependency) -> None:
        for _ in range(600):
            with engine.connect() as conn:
                row = conn.execute(
                    select(_w.c.State, _w.c.DependencyKeyHash).where(_w.c.SourceLaneKey == lane)
                ).first()
            if row is not None and (row.State, row.DependencyKeyHash) == ("blocked", dep.key_hash):
                return
            assert row is None or row.State != "failed", row
            await asyncio.sleep(0.1)
        raise AssertionError(f"child not blocked on {dep.object_api_name}: {row}")

    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        wq.enqueue(engine, [child])
        await child_blocked_on(DEP_A)  # AccountId is the first lookup
        await _parked(wait_a)  # late: after the wait parked
        await asyncio.sleep(1)
        wq.enqueue(engine, [parents[first]])
        if first == "account":
            await child_blocked_on(DEP_B)
            # Wait A's wake was lost: the sweep asks it to probe; it finds its
            # item blocked on B and ends without touching it.
            assert await asyncio.wait_for(wait_a.result(), 60) == 0
            await child_blocked_on(DEP_B)
            await _parked(wait_b)
        else:
            await asyncio.sleep(4)  # a sweep and a recheck later: still waiting on A
            await child_blocked_on(DEP_A)
        await assert_no_blocked_on_linked(engine)
        wq.enqueue(engine, [parents[second]])
        states = await wait_drained(engine)
        await assert_no_blocked_on_linked(engine)
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": 3}, states
    with engine.connect() as conn:
        invalid = conn.execute(
            select(t.connector_work_attempt.c.WorkId).where(
                t.connector_work_attempt.c.CauseCode == FAILURE_CLASS_INVALID
            )
        ).all()
        links = {
            (r.DestinationObject, r.RemoteId): r.RecordId
            for r in conn.execute(select(t.connector_remote_link))
        }
        row = (
            conn.execute(
                text("SELECT AccountId, ReportsToId FROM Contact WHERE Id = :id"),
                {"id": links[("Contact", "c1")]},
            )
            .mappings()
            .one()
        )
    assert invalid == []
    assert (row["AccountId"], row["ReportsToId"]) == (
        links[("Account", "a1")],
        links[("Contact", "c0")],
    )
