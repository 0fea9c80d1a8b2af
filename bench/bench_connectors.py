"""Benchmark: connector inbound throughput (events/s) through the whole runtime.

Usage:
    python bench/bench_connectors.py [--events 10000] [--mysql-url mysql+pymysql://...]

Per backend: a fresh database, ApplyAll with the salesforce-sync connector
pack, N Contact upsert events enqueued (batched), then the ConnectorFleet with
the default knobs (8 workers per pack) processes them on an in-memory Temporal
dev server with the worker in this process. Reports enqueue rate and
end-to-end processing rate (fleet start -> queue drained).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text
from sqlalchemy.engine import make_url
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetInput
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, start_fleet, temporal_binary
from nexusctl.worker import build_connector_worker
from tests.builders import install, record_upsert


async def run(env: WorkflowEnvironment, url: str, n: int) -> tuple[float, float]:
    settings = Settings(database_url=url, NEXUS_DATABASE_ID=f"bench-{uuid.uuid4().hex[:8]}")
    catalog.CACHE.invalidate()
    await install(env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    engine = make_engine(url)
    (pack,) = list_connector_packs(engine)
    events = [
        record_upsert(
            pack.install_id,
            pack.namespace,
            "Contact",
            f"c{k}",
            {"FirstName": "Ada", "LastName": f"L{k}", "Email": f"a{k}@x.test"},
            key=f"c{k}",
        )
        for k in range(n)
    ]
    start = time.perf_counter()
    queue.enqueue(engine, events)
    enqueue_rate = n / (time.perf_counter() - start)
    async with build_connector_worker(env.client, settings):
        start = time.perf_counter()
        fleet = await start_fleet(
            env.client, settings, FleetInput(database_id=settings.database_id, idle_seconds=0.5)
        )
        while True:
            stats = queue.pack_queue_stats(engine, pack.install_id)[0].by_state()
            if stats.get("succeeded", 0) + stats.get("failed", 0) >= n:
                break
            await asyncio.sleep(0.2)
        elapsed = time.perf_counter() - start
        await fleet.signal("stop")
        await fleet.result()
    assert stats.get("failed", 0) == 0, stats
    return enqueue_rate, n / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--mysql-url")
    args = parser.parse_args()
    configure_logging("json", "ERROR")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        tmp = tempfile.mkdtemp()
        urls = {"sqlite": f"sqlite:///{tmp}/bench.db"}
        if args.mysql_url:
            name = f"nexus_bc_{uuid.uuid4().hex[:8]}"
            with make_engine(args.mysql_url).begin() as conn:
                conn.execute(text(f"CREATE DATABASE `{name}`"))
            urls["mysql"] = (
                make_url(args.mysql_url).set(database=name).render_as_string(hide_password=False)
            )
        for backend, url in urls.items():
            try:
                enq, rate = await run(env, url, args.events)
            finally:
                if backend == "mysql":
                    with make_engine(url).begin() as conn:
                        conn.execute(text(f"DROP DATABASE IF EXISTS `{make_url(url).database}`"))
            print(
                f"{backend}: {args.events} events: enqueue {enq:,.0f} events/s, "
                f"processed end to end {rate:,.0f} events/s"
            )
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
