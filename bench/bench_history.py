"""Benchmark: history events per hour of an idle connector fleet, supervisor and worker.

Usage:
    python bench/bench_history.py [--minutes 3] [--warmup 30] [--mysql-url mysql+pymysql://...]

A fresh database (SQLite, or a fresh MariaDB/MySQL database on the server of
``--mysql-url``), ApplyAll with the salesforce-sync connector pack, nothing
enqueued; then the ConnectorFleet with the default input (``FleetInput``
defaults: reconcile every 5 s, idle 5 s, default worker count) runs for
``--minutes`` on an in-memory Temporal dev server with default limits and the
worker in this process.

For the fleet, one pack supervisor and one inbound worker it counts history
events over the whole execution chain (every run of the workflow id, so
continue-as-new runs are summed) after ``--warmup`` seconds and at the end,
and reports the steady rate extrapolated to events per hour, with the hours a
single run growing at that rate takes to reach Temporal's default
continue-as-new suggestion (4,096 events), its warning (10,240) and its hard
limit (51,200, where the server terminates the execution). The fleet's own
continue-as-new point (``reconciles_before_continue_as_new`` reconciles) is
printed too. The chains' runs so far are listed as ``runs`` and the events of
the current run as ``current``.
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
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.contracts import FleetInput
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.temporal import (
    SEARCH_ATTRIBUTES,
    fleet_workflow_id,
    start_fleet,
    temporal_binary,
)
from nexusctl.worker import build_connector_worker
from tests.builders import chain_events, executions, install

SUGGEST, WARN, LIMIT = 4_096, 10_240, 51_200  # Temporal's default event counts


async def pick(client: Client, database_id: str, workflow_type: str) -> str | None:
    """The id of one running ``workflow_type`` execution under ``connector/<db>/``."""
    found = await executions(
        client,
        f'WorkflowId STARTS_WITH "connector/{database_id}/" AND '
        f'WorkflowType = "{workflow_type}" AND ExecutionStatus = "Running"',
    )
    return min((wf.id for wf in found), default=None)


async def chain_totals(client: Client, ids: dict[str, str]) -> dict[str, tuple[int, int, int]]:
    """Per role: (events over all runs, runs, events of the newest run)."""
    out = {}
    for role, wf_id in ids.items():
        runs = await chain_events(client, wf_id)
        newest = (await client.get_workflow_handle(wf_id).describe()).run_id
        out[role] = (sum(runs.values()), len(runs), runs.get(newest, 0))
    return out


async def run(env: WorkflowEnvironment, url: str, minutes: float, warmup: float) -> None:
    """Install salesforce-sync, run the default fleet idle, print events/hour per role."""
    settings = Settings(database_url=url, NEXUS_DATABASE_ID=f"bench-{uuid.uuid4().hex[:8]}")
    catalog.CACHE.invalidate()
    await install(env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    inp = FleetInput(database_id=settings.database_id)
    client = env.client
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, inp)
        await asyncio.sleep(warmup)
        ids = {"fleet": fleet.id}
        for role, wf_type in (("supervisor", "PackSupervisor"), ("worker", "InboundWorker")):
            found = await pick(client, settings.database_id, wf_type)
            if found is None:
                print(f"no running {wf_type} after {warmup:.0f} s")
            else:
                ids[role] = found
        t0, before = time.monotonic(), await chain_totals(client, ids)
        await asyncio.sleep(max(0.0, minutes * 60 - warmup))
        elapsed, after = time.monotonic() - t0, await chain_totals(client, ids)
        await fleet.signal("stop")
        await fleet.result()
    print(
        f"{elapsed:.0f} s measured after {warmup:.0f} s warm-up; reconcile every "
        f"{inp.reconcile_interval_seconds} s, idle {inp.idle_seconds} s; fleet continues as "
        f"new every {inp.reconciles_before_continue_as_new} reconciles "
        f"(~{inp.reconciles_before_continue_as_new * inp.reconcile_interval_seconds / 3600:.2f} h)"
    )
    print(
        f"{'':11}{'events/h':>10}{'h to 4,096':>12}{'h to 10,240':>13}{'h to 51,200':>13}"
        f"{'runs':>6}{'current':>9}  id"
    )
    for role, wf_id in ids.items():
        total, runs, current = after[role]
        per_hour = (total - before[role][0]) * 3600 / elapsed
        hours = [f"{n / per_hour:.1f}" if per_hour else "never" for n in (SUGGEST, WARN, LIMIT)]
        print(
            f"{role:11}{per_hour:>10,.0f}{hours[0]:>12}{hours[1]:>13}{hours[2]:>13}"
            f"{runs:>6}{current:>9}  {wf_id}"
        )
    assert fleet_workflow_id(settings.database_id) == ids["fleet"]


async def main() -> None:
    """Parse arguments, start a dev server, run the measurement per backend."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before counting")
    parser.add_argument("--mysql-url")
    args = parser.parse_args()
    configure_logging("json", "ERROR")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        urls = {"sqlite": f"sqlite:///{tempfile.mkdtemp()}/bench.db"}
        if args.mysql_url:
            name = f"nexus_bh_{uuid.uuid4().hex[:8]}"
            with make_engine(args.mysql_url).begin() as conn:
                conn.execute(text(f"CREATE DATABASE `{name}`"))
            urls["mysql"] = (
                make_url(args.mysql_url).set(database=name).render_as_string(hide_password=False)
            )
        for backend, url in urls.items():
            print(f"== {backend}")
            try:
                await run(env, url, args.minutes, min(args.warmup, args.minutes * 30))
            finally:
                if backend == "mysql":
                    with make_engine(url).begin() as conn:
                        conn.execute(text(f"DROP DATABASE IF EXISTS `{make_url(url).database}`"))
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
