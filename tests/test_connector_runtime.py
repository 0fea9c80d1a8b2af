"""The connector inbound runtime end to end: real Temporal dev server, real databases."""

from __future__ import annotations

import asyncio
import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select, text
from temporalio.testing import WorkflowEnvironment

from nexuscrm.connectors import workqueue
from nexuscrm.connectors.importer import events_from_sfdx_plan
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.controlplane import catalog
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane, start_fleet
from nexusctl.worker import build_connector_worker, build_worker
from tests.conftest import corpus_project
from workflows.models import ApplyAllInput, FleetInput

ROOT = Path(__file__).resolve().parents[1]
SF_SYNC = ROOT / "packs" / "connectors" / "salesforce-sync"


def fast_fleet(settings: Settings) -> FleetInput:
    """Fleet timings short enough for tests."""
    return FleetInput(
        database_id=settings.database_id,
        reconcile_interval_seconds=1,
        lease_seconds=10,
        idle_seconds=0.5,
        drain_timeout_seconds=5,
        restart_backoff_min_seconds=0.2,
        restart_backoff_max_seconds=1,
    )


def connector_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"connector_task_queue": f"cn-{uuid.uuid4().hex[:8]}"})


async def install(env: WorkflowEnvironment, settings: Settings, sources: list[str]) -> None:
    async with build_worker(env.client, settings):
        handle = await start_controlplane(
            env.client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources)
        )
        await handle.result()


async def wait_drained(engine: Engine, timeout: float = 120) -> dict[str, int]:
    """Poll until no item is pending or processing; return counts by state."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = workqueue.pack_queue_stats(engine)
        by_state: dict[str, int] = {}
        for s in stats:
            for state, n in s.by_state().items():
                by_state[state] = by_state.get(state, 0) + n
        if not by_state.get("pending") and not by_state.get("processing"):
            return by_state
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"queue not drained in {timeout} s: {by_state}")
        await asyncio.sleep(0.3)


def data_records(plan: Path) -> list[dict[str, Any]]:
    records = []
    for entry in json.loads(plan.read_text()):
        for name in entry["files"]:
            records += json.loads((plan.parent / name).read_text())["records"]
    return records


async def test_corpus_data_plans_sync_shuffled(temporal_env, settings):
    settings = connector_settings(settings)
    dreamhouse = corpus_project("dreamhouse-lwc")
    ebikes = corpus_project("ebikes-lwc")
    await install(temporal_env, settings, [str(dreamhouse), str(ebikes), str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    plans = [
        dreamhouse / "data" / "sample-data-plan.json",
        ebikes / "data" / "sample-data-plan.json",
    ]
    events = []
    for plan in plans:
        events += events_from_sfdx_plan(
            plan, installed_pack_id=pack.install_id, namespace=pack.namespace, shuffle=True, seed=7
        )
    result = workqueue.enqueue(engine, events)
    assert result.inserted == len(events)
    catalog.CACHE.invalidate()
    async with (
        build_worker(temporal_env.client, settings),
        build_connector_worker(temporal_env.client, settings),
    ):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        states = await wait_drained(engine)
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": len(events)}, states

    records = [r for plan in plans for r in data_records(plan)]
    with engine.connect() as conn:
        links = {
            (r.DestinationObject, r.RemoteId): r.RecordId
            for r in conn.execute(select(t.connector_remote_link))
        }
        for rec in records:
            obj, ref = rec["attributes"]["type"], rec["attributes"]["referenceId"]
            record_id = links[(obj, ref)]
            row = (
                conn.execute(
                    text(f'SELECT * FROM "{obj}" WHERE "Id" = :id'.replace('"', "`"))
                    if engine.dialect.name == "mysql"
                    else text(f'SELECT * FROM "{obj}" WHERE "Id" = :id'),
                    {"id": record_id},
                )
                .mappings()
                .one()
            )
            for key, value in rec.items():
                if key == "attributes":
                    continue
                if isinstance(value, str) and value.startswith("@"):
                    parent_obj = catalog.CACHE.get(engine).get(obj)
                    assert parent_obj is not None
                    field = next(f for f in parent_obj.fields if f.api_name == key)
                    assert row[key] == links[(field.reference_to, value[1:])], (obj, ref, key)
                elif isinstance(value, bool):
                    assert bool(row[key]) == value
                elif isinstance(value, int | float):
                    assert Decimal(str(row[key])) == Decimal(str(value)), (obj, ref, key)
                elif value is not None:
                    assert str(row[key]) == str(value)[: len(str(row[key]))], (obj, ref, key)
        for obj in {r["attributes"]["type"] for r in records}:
            count = conn.execute(text(f"SELECT COUNT(*) FROM {obj}")).scalar_one()
            expected = sum(1 for r in records if r["attributes"]["type"] == obj)
            assert count == expected, obj  # once: never duplicated
