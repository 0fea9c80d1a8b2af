"""The suite's own MariaDB crashes (SIGKILL) and comes back (issue 17, restarts):
during ApplyAll, the same workflow completes and the database equals an
uninterrupted run; during inbound processing, every event is applied exactly
once and every record ends at its last version. Counted from the database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane, start_fleet
from nexusctl.worker import build_connector_worker, build_worker
from tests.builders import (
    SF_SYNC,
    account_versions,
    applied_twice,
    apply_all,
    connector_settings,
    corpus_project,
    fast_fleet,
    last_phones,
    snapshot,
    work_states,
)
from tests.faults.conftest import OwnMariaDB


def own_settings(own: OwnMariaDB) -> Settings:
    return Settings(
        database_url=own.database(),
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        env="development",
        NEXUS_DATABASE_ID=f"fault-{uuid.uuid4().hex[:8]}",
    )


async def test_mariadb_crash_during_applyall(temporal_env: Any, own_mariadb: OwnMariaDB) -> None:
    settings = own_settings(own_mariadb)
    sources = [str(SF_SYNC), str(corpus_project("dreamhouse-lwc"))]
    catalog.CACHE.invalidate()
    async with build_worker(temporal_env.client, settings):
        handle = await start_controlplane(
            temporal_env.client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources)
        )
        status: dict[str, str] = {}
        for _ in range(1200):
            status = {p["name"]: p["status"] for p in await handle.query("progress")}
            if status.get("apply-packs") == "running":
                break
            await asyncio.sleep(0.05)
        assert status.get("apply-packs") == "running", status
        await asyncio.to_thread(own_mariadb.restart, crash=True, down_seconds=2)
        result = await handle.result()
    assert result.status == "completed", result
    interrupted = snapshot(make_engine(settings.database_url))
    reference = own_settings(own_mariadb)
    catalog.CACHE.invalidate()
    await apply_all(temporal_env, reference, app_pack_sources=sources)
    assert interrupted == snapshot(make_engine(reference.database_url))


async def _succeeded(engine: Engine) -> int:
    """Succeeded work items; ``-1`` while the database does not answer."""
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(t.connector_work_item)
                    .where(t.connector_work_item.c.State == "succeeded")
                ).scalar_one()
            )
    except SQLAlchemyError:
        return -1


async def test_mariadb_crash_during_inbound_processing(
    temporal_env: Any, own_mariadb: OwnMariaDB
) -> None:
    settings = connector_settings(own_settings(own_mariadb))
    await apply_all(temporal_env, settings, app_pack_sources=[str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    # Enough that the crash lands mid-processing: a worker's stint of batches
    # runs thousands of events a second.
    records, versions = 800, 5
    events = account_versions(pack.install_id, pack.namespace, records, versions)
    queue.enqueue(engine, events)
    total = len(events)
    catalog.CACHE.invalidate()
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        for _ in range(3000):
            if await _succeeded(engine) >= total // 4:
                break
            await asyncio.sleep(0.05)
        crashed_at = await _succeeded(engine)
        assert 0 < crashed_at < total, crashed_at
        await asyncio.to_thread(own_mariadb.restart, crash=True, down_seconds=2)
        for _ in range(3000):
            if await _succeeded(engine) == total:
                break
            await asyncio.sleep(0.2)
        await fleet.signal("stop")
        await fleet.result()
    assert work_states(engine) == {"succeeded": total}
    assert applied_twice(engine) == []
    assert last_phones(engine) == {f"Account {k}": f"v{versions - 1}" for k in range(records)}
