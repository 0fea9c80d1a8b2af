"""The Temporal server crashes (SIGKILL) and comes back with its state (issue 17,
restarts): during inbound processing and while identity waits are parked,
everything resumes and finishes without loss. Counted from the database."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import connect, start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    account_versions,
    applied_twice,
    apply_all,
    children_and_parents,
    connector_settings,
    fast_fleet,
    last_phones,
    work_states,
)
from tests.faults.conftest import OwnTemporal


@dataclass
class _Env:
    """The part of a ``WorkflowEnvironment`` the builders use: its client."""

    client: Any


def states(engine: Engine) -> dict[str, int]:
    """Work items by state; ``{}`` while the database does not answer."""
    try:
        return work_states(engine)
    except SQLAlchemyError:
        return {}


async def wait_for(engine: Engine, done: Any, timeout: float, poll: float = 0.2) -> dict[str, int]:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        now = states(engine)
        if done(now):
            return now
        await asyncio.sleep(poll)
    return states(engine)


async def setup(own: OwnTemporal, settings: Settings) -> tuple[Settings, Any, Engine, Any]:
    settings = connector_settings(settings).model_copy(update={"temporal_address": own.address})
    client = await connect(settings)
    catalog.CACHE.invalidate()
    await apply_all(_Env(client), settings, app_pack_sources=[str(SF_SYNC)])  # type: ignore[arg-type]
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    return settings, client, engine, pack


async def test_server_crash_during_inbound_processing(
    own_temporal: OwnTemporal, settings: Settings
) -> None:
    settings, client, engine, pack = await setup(own_temporal, settings)
    # Enough for the crash to land mid-processing: a worker's stint of batches
    # ran 600 events in one 0.2 s poll (CI, 2026-12-04).
    records, versions = 1500, 4
    queue.enqueue(engine, account_versions(pack.install_id, pack.namespace, records, versions))
    total = records * versions
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        before = await wait_for(engine, lambda s: s.get("succeeded", 0) >= 1, 300, poll=0.02)
        assert 0 < before.get("succeeded", 0) < total, before
        await asyncio.to_thread(own_temporal.restart, 2.0)
        after = await wait_for(engine, lambda s: s.get("succeeded", 0) == total, 300)
        await fleet.signal("stop")
        await fleet.result()
    assert after == {"succeeded": total}
    assert applied_twice(engine) == []
    assert last_phones(engine) == {f"Account {k}": f"v{versions - 1}" for k in range(records)}


async def test_server_crash_while_identity_waits_are_parked(
    own_temporal: OwnTemporal, settings: Settings
) -> None:
    settings, client, engine, pack = await setup(own_temporal, settings)
    n = 60
    children, parents = children_and_parents(pack.install_id, pack.namespace, n)
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        queue.enqueue(engine, children)
        parked = await wait_for(engine, lambda s: s.get("blocked", 0) == n, 300)
        assert parked == {"blocked": n}, parked
        await asyncio.to_thread(own_temporal.restart, 2.0)
        queue.enqueue(engine, parents)
        after = await wait_for(engine, lambda s: s.get("succeeded", 0) == 2 * n, 300)
        await fleet.signal("stop")
        await fleet.result()
    assert after == {"succeeded": 2 * n}
    with engine.connect() as conn:
        linked = conn.execute(
            text(
                "SELECT COUNT(*) FROM Contact c JOIN Account a ON a.Id = c.AccountId "
                "WHERE c.LastName LIKE 'Child %'"
            )
        ).scalar_one()
    assert linked == n
