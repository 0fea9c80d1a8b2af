"""A worker SIGKILLed right after its claim committed (issue 17, crashes; the
"one batch not handed back" of a crash): the claim is a local activity, so
its result was never recorded and the workflow re-runs it on another worker.
Keyed by the worker's run and claim number, the re-run returns the items the
first run leased instead of claiming others and leaving those to wait out the
lease (60 s by default). Measured: the time from the kill until the dead
worker's claimed items are done; every event applied once.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.queue import ClaimSpec, claim_leases
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    account_versions,
    applied_twice,
    apply_all,
    connector_settings,
    fast_fleet,
    last_phones,
    work_states,
    worker_process,
)

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 60.0


async def installed(temporal_env: Any, settings: Settings) -> tuple[Settings, Engine, Any]:
    settings = connector_settings(settings)
    catalog.CACHE.invalidate()
    await apply_all(temporal_env, settings, app_pack_sources=[str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    return settings, engine, pack


async def test_a_keyed_claim_run_again_returns_what_it_leased(
    temporal_env: Any, settings: Settings
) -> None:
    settings, engine, pack = await installed(temporal_env, settings)
    queue.enqueue(engine, account_versions(pack.install_id, pack.namespace, 30, 1))

    def spec(owner: str, key: str) -> ClaimSpec:
        return ClaimSpec(
            installed_pack_id=pack.install_id,
            queue_classes=(),
            batch_size=10,
            lease_owner=owner,
            lease_seconds=LEASE_S,
            max_processing_rows=1000,
            claim_key=key,
        )

    first = claim_leases(engine, spec("w/run1", "w/run1#1"))
    assert len(first) == 10
    again = claim_leases(engine, spec("w/run1", "w/run1#1"))
    assert sorted(again) == sorted(first)  # the same items and tokens, nothing more taken
    w = t.connector_work_item
    with engine.connect() as conn:
        rows = conn.execute(select(w.c.WorkId, w.c.Attempt).where(w.c.State == "processing"))
        assert {r.WorkId: r.Attempt for r in rows} == {work_id: 1 for work_id, _ in first}
    nxt = claim_leases(engine, spec("w/run1", "w/run1#2"))  # the next claim takes others
    assert len(nxt) == 10 and not {a for a, _ in nxt} & {a for a, _ in first}
    other = claim_leases(engine, spec("w/run2", "w/run1#1"))  # another owner adopts nothing
    assert not {a for a, _ in other} & {a for a, _ in first + nxt}
    unkeyed = claim_leases(engine, spec("w/run1", ""))
    assert not {a for a, _ in unkeyed} & {a for a, _ in first}


def crashing_worker(settings: Settings, temporal_env: Any) -> subprocess.Popen[bytes]:
    """A worker that SIGKILLs itself once an InboundWorker's claim has leased items."""
    return worker_process(
        settings,
        temporal_env,
        "tests/faults/crashing_worker.py",
        NEXUS_TEST_CRASH_WORKFLOW_TYPE="InboundWorker",
        NEXUS_TEST_CRASH_AFTER_ACTIVITY_TYPE="connectors.claim",
    )


def held_leases(engine: Engine) -> set[tuple[str, str]]:
    """``(work id, lease token)`` of every processing item, from the database."""
    w = t.connector_work_item
    with engine.connect() as conn:
        return {
            (r.WorkId, r.LeaseToken)
            for r in conn.execute(
                select(w.c.WorkId, w.c.LeaseToken).where(w.c.State == "processing")
            )
        }


@pytest.mark.slow
async def test_worker_killed_after_its_claim_committed_loses_no_lease_time(
    temporal_env: Any, settings: Settings
) -> None:
    settings, engine, pack = await installed(temporal_env, settings)
    records, versions = 500, 4
    total = records * versions
    queue.enqueue(engine, account_versions(pack.install_id, pack.namespace, records, versions))
    inp = fast_fleet(settings)
    inp.lease_seconds = LEASE_S  # the production default: an orphaned batch would wait it out
    inp.heartbeat_timeout_seconds = 5
    kills: list[tuple[float, set[tuple[str, str]]]] = []
    fleet = None
    for _ in range(2):  # killed twice, each time right after a claim committed
        proc = crashing_worker(settings, temporal_env)
        try:
            if fleet is None:
                fleet = await start_fleet(temporal_env.client, settings, inp)
            await asyncio.to_thread(proc.wait, 180)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        kills.append((time.monotonic(), held_leases(engine)))
    assert fleet is not None
    reclaim: list[float] = []
    async with build_connector_worker(temporal_env.client, settings):
        for killed_at, held in kills:
            while held & held_leases(engine):
                assert time.monotonic() - killed_at < 150, "a dead worker's claim never came back"
                await asyncio.sleep(0.2)
            reclaim.append(time.monotonic() - killed_at)
        while work_states(engine) != {"succeeded": total}:
            assert time.monotonic() - kills[-1][0] < 300, work_states(engine)
            await asyncio.sleep(0.5)
        await fleet.signal("stop")
        await fleet.result()
    print(f"reclaim after kill (s): {[round(r, 1) for r in reclaim]}")
    assert all(held for _, held in kills), "no claim was in hand at a kill"
    # The last kill's claim is back well within the lease it would otherwise wait out.
    assert reclaim[-1] < LEASE_S * 0.75, reclaim
    assert applied_twice(engine) == []
    assert last_phones(engine) == {f"Account {k}": f"v{versions - 1}" for k in range(records)}
