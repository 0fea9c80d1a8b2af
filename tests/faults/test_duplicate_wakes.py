"""Duplicate and premature wakes (issue 17 item 8): a wake never costs an item its life.

A wake of a dependency is the seed's post-commit bridge
(``WakeIdentityConvergence*``): it wakes the blocked rows and the flow re-reads
the dependency. Typed by hand (``nexusctl wake``) before the parent exists, the
child runs and blocks again; such attempts do not count toward
``MAX_ATTEMPTS`` (they used to: eight wakes failed the child
``attempts-exhausted``). A hundred concurrent duplicate wakes of a dependency
wake each blocked item once. Real dev server, real databases.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine, func, select

from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.identity import wake_identity_convergence_remote_identity
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    connector_settings,
    fast_fleet,
    install,
    record_upsert,
    wait_drained,
)
from tests.identity_waits import DEP, block, queue_db, states

_w, _a = t.connector_work_item, t.connector_work_attempt


def _child(engine: Engine) -> tuple[str, int]:
    with engine.connect() as conn:
        row = conn.execute(
            select(_w.c.State, _w.c.Attempt).where(_w.c.SourceLaneKey.like("%/Contact/c1"))
        ).one()
    return str(row.State), int(row.Attempt)


async def _blocked_past(engine: Engine, attempt: int) -> int:
    """Wait until the child is blocked at an attempt after ``attempt``; its attempt."""
    for _ in range(600):
        state, now = _child(engine)
        assert state != "failed", (state, now)
        if state == "blocked" and now > attempt:
            return now
        await asyncio.sleep(0.05)
    raise AssertionError(f"child not blocked again after attempt {attempt}: {_child(engine)}")


async def test_wakes_of_a_missing_parent_never_use_up_the_childs_attempts(temporal_env, settings):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    ns = pack.namespace
    child = record_upsert(
        pack.install_id, ns, "Contact", "c1", {"LastName": "C", "AccountId": "a1"},
        refs={"AccountId": "a1"},
    )  # fmt: skip
    parent = record_upsert(pack.install_id, ns, "Account", "a1", {"Name": "A"})
    dep = (ns, ns, "Account", "a1")
    client = temporal_env.client
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        wq.enqueue(engine, [child])
        attempt = await _blocked_past(engine, 0)
        for _ in range(wq.MAX_ATTEMPTS + 4):  # past the attempt budget
            # >= 1: a re-block that registers with the wait while it wakes is woken
            # again by the same wait (it cannot tell a premature wake).
            assert await wake_identity_convergence_remote_identity(client, settings, *dep) >= 1
            attempt = await _blocked_past(engine, attempt)
        # A hundred at once: each wake that finds it blocked wakes it; it never fails,
        # and no block is woken twice: every wake that reports a row woke one
        # blocked attempt of its own (a woken child runs, then blocks again).
        woken = await asyncio.gather(
            *(wake_identity_convergence_remote_identity(client, settings, *dep) for _ in range(100))
        )
        assert sum(woken) >= 1
        before = attempt
        attempt = await _blocked_past(engine, attempt)
        assert sum(woken) <= attempt - before, (woken, before, attempt)
        assert attempt > wq.MAX_ATTEMPTS
        wq.enqueue(engine, [parent])  # the parent arrives: the child converges
        states_by = await wait_drained(engine)
        await fleet.signal("stop")
        await fleet.result()
    assert states_by == {"succeeded": 2}, states_by
    with engine.connect() as conn:
        blocked_rows = conn.execute(
            select(func.count()).where(_a.c.OutcomeState == "blocked")
        ).scalar_one()
    assert blocked_rows > wq.MAX_ATTEMPTS
    engine.dispose()


async def test_a_hundred_concurrent_duplicate_wakes_wake_each_item_once(temporal_env, settings):
    """No wait runs: every wake goes to the rows; together they wake the five once."""
    engine = queue_db(settings)
    ids = block(engine, 5)
    args = (DEP.owner_key, DEP.namespace, DEP.object_api_name, DEP.remote_id)
    woken = await asyncio.gather(
        *(
            wake_identity_convergence_remote_identity(temporal_env.client, settings, *args)
            for _ in range(100)
        )
    )
    assert sum(woken) == 5, woken
    assert {s for s, _c in states(engine, ids).values()} == {"pending"}
    assert isinstance(DEP, Dependency)
