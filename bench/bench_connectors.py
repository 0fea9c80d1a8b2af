"""Benchmark: connector inbound throughput, the Temporal pipeline against a direct loop.

Usage:
    python bench/bench_connectors.py [--events 20000] [--workers 8]
        [--direct-threads 1,8] [--mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test]
        [--out bench/results/connectors.json]

Per backend (SQLite always; MariaDB/MySQL with ``--mysql-url``), in one run:

- **pipeline**: a fresh database, ApplyAll with the salesforce-sync connector
  pack, ``--events`` Contact upsert events enqueued (batched, not timed), then
  the ConnectorFleet (``--workers`` inbound workers, the pack's default queue
  profile) on a local Temporal dev server, the worker in this process, until
  every event is ``succeeded``.
  With ``--worker-processes 0,2`` the pipeline runs again with two worker
  processes (``nexusctl worker --processes 2``) instead of the in-process
  worker; their CPU is the worker's.
- **direct loop**, once per ``--direct-threads`` count: the same fresh setup,
  then that many threads calling the same ``nexuscrm`` functions the
  activities call (``queue.claim`` with the pool's batch profile and budget,
  ``Processor.process``), without Temporal, until drained.

For each run: events/s from the first claim to the last event succeeded, and
CPU microseconds per event of this process (the worker or the loop), the
Temporal dev server (pipeline only) and the database server (``mariadbd`` /
``mysqld``; SQLite runs inside this process), read with psutil over the same
window. CPU of the shared database server includes whatever else runs on it.
The ratio pipeline / best direct loop is printed and written. No figure is a
test: a smoke test runs this at a tiny size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine, make_url
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.connectors import claim_size
from bench.machine import machine
from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.knobs import (
    ENV_WORKERS_PER_PACK,
    max_processing_rows_for_workers,
    queue_profile_mode,
    work_item_worker_queue_profile,
)
from nexuscrm.connectors.processor import Processor
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetInput
from nexuscrm.db import tables as tables
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.metrics import metrics_runtime
from nexusctl.temporal import SEARCH_ATTRIBUTES, start_fleet, temporal_binary
from nexusctl.worker import build_connector_worker
from tests.builders import install, record_upsert

RESULTS = Path(__file__).resolve().parent / "results" / "connectors.json"


@dataclass
class Run:
    """One measured run: ``mode`` is ``pipeline`` or ``direct-<n>``."""

    backend: str
    mode: str
    events: int
    seconds: float
    events_per_s: float
    cpu_us_per_event: dict[str, float] = field(default_factory=dict)
    queued: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """Pipeline runs: figures read from the workers' Prometheus endpoints
    (``NEXUS_METRICS_ADDRESS``) at the end of the run; see :func:`scrape`."""
    first_event_s: float | None = None
    """Seconds from the start (the fleet's start; the loop's first claim) to the
    first event done: the pipeline's includes starting the fleet, its pool and
    workers, which ``seconds`` counts too."""


class CpuWindow:
    """CPU seconds (user + system) of named processes between start and stop."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for name, p in self.procs.items():
            t = p.cpu_times()
            out[name] = t.user + t.system
        return out

    def per_event_us(self, events: int) -> dict[str, float]:
        """CPU microseconds per event of each process since the window opened."""
        end = self._read()
        return {k: round((end[k] - self.start[k]) * 1e6 / max(events, 1), 1) for k in end}


def database_server() -> psutil.Process | None:
    """The local MariaDB/MySQL server process, if one runs."""
    for p in psutil.process_iter(["name"]):
        if p.info["name"] in ("mariadbd", "mysqld"):
            return p
    return None


def temporal_server() -> psutil.Process | None:
    """The Temporal dev server this process started."""
    for p in psutil.Process().children(recursive=True):
        if p.name().startswith("temporal"):
            return p
    return None


def processes(backend: str, pipeline: bool) -> dict[str, psutil.Process]:
    procs = {"worker": psutil.Process()}
    server = temporal_server() if pipeline else None
    if server is not None:
        procs["temporal"] = server
    db = database_server() if backend == "mysql" else None
    if db is not None:
        procs["database"] = db
    return procs


async def prepare(env: WorkflowEnvironment, url: str, n: int) -> tuple[Settings, Engine, str]:
    """Install the pack on a fresh database and enqueue ``n`` upserts (not timed)."""
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
    for start in range(0, n, 5000):
        queue.enqueue(engine, events[start : start + 5000])
    return settings, engine, pack.install_id


def free_port(count: int = 1) -> int:
    """A TCP port on 127.0.0.1 such that it and the ``count - 1`` after it are free now
    (metrics endpoints: worker process k of ``nexusctl worker --processes`` listens on
    the base port + k)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        try:
            for k in range(1, count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + k))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def scrape(addresses: list[str]) -> dict[str, float]:
    """The pipeline's figures from the workers' ``/metrics`` (summed over ``addresses``).

    ``events_processed`` (``nexus_events_processed_total``, every outcome),
    ``claims`` and ``claim_ms_mean`` (``nexus_claim_latency_seconds``),
    ``batches`` and ``batch_size_mean`` (``nexus_batch_size``: claims that
    leased at least one item), ``empty_claims`` (claims minus batches),
    ``activity_tasks`` (``temporal_activity_execution_latency`` count: local
    activities included) and ``workflow_tasks``
    (``temporal_workflow_task_execution_latency`` count). An endpoint that
    does not answer is left out.
    """
    sums: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    for address in addresses:
        try:
            body = httpx.get(f"http://{address}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                name, value = sample.name, float(sample.value)
                if name == "nexus_events_processed_total":
                    add("events_processed", value)
                elif name == "nexus_claim_latency_seconds_count":
                    add("claims", value)
                elif name == "nexus_claim_latency_seconds_sum":
                    add("claim_seconds", value)
                elif name == "nexus_batch_size_count":
                    add("batches", value)
                elif name == "nexus_batch_size_sum":
                    add("batch_items", value)
                elif name.startswith("temporal_activity_execution_latency") and name.endswith(
                    "_count"
                ):
                    add("activity_tasks", value)
                elif name.startswith("temporal_workflow_task_execution_latency") and (
                    name.endswith("_count")
                ):
                    add("workflow_tasks", value)
    out = {k: v for k, v in sums.items() if k not in ("claim_seconds", "batch_items")}
    if sums.get("claims"):
        out["claim_ms_mean"] = round(1000 * sums.get("claim_seconds", 0.0) / sums["claims"], 2)
        out["empty_claims"] = sums["claims"] - sums.get("batches", 0.0)
    if sums.get("batches"):
        out["batch_size_mean"] = round(sums.get("batch_items", 0.0) / sums["batches"], 1)
    return out


def done(engine: Engine, install_id: str) -> dict[str, int]:
    """Terminal items of the pack by state: one indexed count, cheap at any queue
    depth (the bench polls it; a GROUP BY over every row would be measured too)."""
    w = tables.connector_work_item
    with engine.connect() as conn:
        rows = conn.execute(
            select(w.c.State, func.count())
            .where(w.c.InstalledPackId == install_id, w.c.State.in_(("succeeded", "failed")))
            .group_by(w.c.State)
        ).all()
    return {state: int(n) for state, n in rows}


async def pipeline(
    env: WorkflowEnvironment,
    backend: str,
    url: str,
    n: int,
    workers: int,
    procs: int,
    measure: int,
) -> Run:
    """Events/s and CPU per event through the ConnectorFleet on Temporal.

    ``procs`` 0: the worker runs in this process; else ``procs`` worker
    processes (``nexusctl worker --processes procs``) serve the task queues and
    their CPU is counted as the worker's.
    """
    settings, engine, install_id = await prepare(env, url, n)
    port = free_port(max(procs, 1))
    settings = settings.model_copy(update={"metrics_address": f"127.0.0.1:{port}"})
    endpoints = [f"127.0.0.1:{port + k}" for k in range(max(procs, 1))]
    async with contextlib.AsyncExitStack() as stack:
        # Read when the worker's knobs are built (here or in the worker processes);
        # put back afterwards: a caller in the same process (the smoke test under
        # pytest) must not inherit this run's pool size.
        stack.enter_context(mock.patch.dict(os.environ, {ENV_WORKERS_PER_PACK: str(workers)}))
        if procs == 0:
            # A client on a runtime that exports metrics, as `nexusctl worker` has.
            client = await Client.connect(
                env.client.service_client.config.target_host,
                runtime=metrics_runtime(endpoints[0]),
            )
            await stack.enter_async_context(build_connector_worker(client, settings))
            watched = processes(backend, pipeline=True)
        else:
            children = await stack.enter_async_context(worker_processes(env, settings, procs))
            watched = processes(backend, pipeline=True)
            watched.pop("worker")
            watched.update({f"worker{k}": c for k, c in enumerate(children)})
        cpu = CpuWindow(watched)
        start = time.perf_counter()
        fleet = await start_fleet(
            env.client, settings, FleetInput(database_id=settings.database_id, idle_seconds=0.5)
        )
        first: float | None = None
        while True:
            stats = done(engine, install_id)
            finished = stats.get("succeeded", 0) + stats.get("failed", 0)
            if finished and first is None:
                first = time.perf_counter() - start
            if finished >= measure:
                break
            await asyncio.sleep(0.05 if first is None else 0.25)
        elapsed = time.perf_counter() - start
        per_event = cpu.per_event_us(measure)
        figures = await asyncio.to_thread(scrape, endpoints)
        await fleet.signal("stop")
        await fleet.result()
    engine.dispose()
    assert stats.get("failed", 0) == 0, stats
    if procs:
        per_event["worker"] = round(sum(v for k, v in per_event.items() if k[:6] == "worker"), 1)
    mode = "pipeline" if procs == 0 else f"pipeline-{procs}p"
    rate = round(measure / elapsed, 1)
    return Run(
        backend,
        mode,
        measure,
        round(elapsed, 2),
        rate,
        per_event,
        queued=n,
        metrics=figures,
        first_event_s=round(first, 2) if first is not None else None,
    )


@contextlib.asynccontextmanager
async def worker_processes(
    env: WorkflowEnvironment, settings: Settings, count: int
) -> AsyncIterator[list[psutil.Process]]:
    """``nexusctl worker --processes count`` on ``env``'s server; yields the children
    once each polls, stops them (SIGTERM) on exit."""
    environ = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
        "NEXUS_LOG_LEVEL": "ERROR",
    }
    if settings.metrics_address:  # the children listen on its port + k
        environ["NEXUS_METRICS_ADDRESS"] = settings.metrics_address
    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen(
        [sys.executable, "-m", "nexusctl.cli", "worker", "--processes", str(count)],
        env=environ,
        cwd=root,
    )
    try:
        children: list[psutil.Process] = []
        for _ in range(240):
            children = psutil.Process(parent.pid).children()
            if len(children) == count:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(3)  # imports and first polls
        yield children
    finally:
        parent.send_signal(signal.SIGTERM)
        parent.wait(60)


def direct_loop(engine: Engine, install_id: str, n: int, threads: int, workers: int) -> float:
    """Run ``threads`` claim/process loops until ``n`` events succeeded; seconds taken."""
    processor = Processor(engine)
    mode = queue_profile_mode()
    budget = max_processing_rows_for_workers(workers)
    errors: list[BaseException] = []
    finished = threading.Event()

    def loop(ordinal: int) -> None:
        profile = work_item_worker_queue_profile(threads, ordinal, mode)
        owner = f"direct-{ordinal}"
        try:
            while not finished.is_set():
                items = queue.claim(
                    engine,
                    queue.ClaimSpec(
                        installed_pack_id=install_id,
                        queue_classes=list(profile.queue_classes),
                        preferred_queue_classes=list(profile.preferred_queue_classes),
                        batch_size=claim_size(profile.batch_size),
                        lease_owner=owner,
                        lease_seconds=60,
                        max_processing_rows=budget,
                    ),
                )
                if not items:
                    time.sleep(0.05)
                    continue
                processor.process(items)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
            finished.set()

    pool = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    while not finished.is_set():
        stats = done(engine, install_id)
        if stats.get("succeeded", 0) + stats.get("failed", 0) >= n:
            break
        time.sleep(0.25)
    elapsed = time.perf_counter() - start
    finished.set()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return elapsed


async def direct(
    env: WorkflowEnvironment,
    backend: str,
    url: str,
    n: int,
    threads: int,
    workers: int,
    measure: int,
) -> Run:
    """Events/s and CPU per event of the same functions, called without Temporal."""
    _settings, engine, install_id = await prepare(env, url, n)
    cpu = CpuWindow(processes(backend, pipeline=False))
    elapsed = await asyncio.to_thread(direct_loop, engine, install_id, measure, threads, workers)
    per_event = cpu.per_event_us(measure)
    stats = done(engine, install_id)
    engine.dispose()
    assert stats.get("failed", 0) == 0, stats
    rate = round(measure / elapsed, 1)
    return Run(backend, f"direct-{threads}", measure, round(elapsed, 2), rate, per_event, queued=n)


def fresh_database(backend: str, mysql_url: str | None, tmp: str) -> tuple[str, Callable[[], None]]:
    """A new empty database of ``backend`` and a function that drops it."""
    if backend == "sqlite":
        path = Path(tmp) / f"bench-{uuid.uuid4().hex[:8]}.db"
        return f"sqlite:///{path}", lambda: path.unlink(missing_ok=True)
    assert mysql_url is not None
    name = f"nexus_bench_{uuid.uuid4().hex[:8]}"
    with make_engine(mysql_url).begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    url = make_url(mysql_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with make_engine(mysql_url).begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))

    return url, drop


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=8, help="inbound workers (pipeline)")
    parser.add_argument("--direct-threads", default="1,8", help="comma-separated thread counts")
    parser.add_argument("--mysql-url")
    parser.add_argument(
        "--measure",
        type=int,
        default=None,
        help="time the first N events processed (default: all); with --events 100000 "
        "--measure 10000 a deep queue is compared with a shallow one",
    )
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument(
        "--worker-processes",
        default="0",
        help="comma-separated pipeline runs: 0 = worker in this process, K = K worker "
        "processes (nexusctl worker --processes K)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.events < 1 or args.workers < 1:
        parser.error("--events and --workers must be at least 1")
    threads = [int(t) for t in args.direct_threads.split(",") if t.strip()]
    measure = min(args.measure or args.events, args.events)
    procs = [int(k) for k in args.worker_processes.split(",") if k.strip()]
    configure_logging("json", "ERROR")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    runs: list[Run] = []
    backends = ["sqlite"] + (["mysql"] if args.mysql_url else [])
    db_version = None
    try:
        tmp = tempfile.mkdtemp()
        for backend in backends:
            pipes = [] if args.no_pipeline else [f"p{k}" for k in procs]
            for mode in pipes + [f"d{t}" for t in threads]:
                url, drop = fresh_database(backend, args.mysql_url, tmp)
                try:
                    if backend == "mysql" and db_version is None:
                        with make_engine(url).connect() as conn:
                            db_version = conn.execute(text("SELECT VERSION()")).scalar()
                    if mode[0] == "p":
                        run = await pipeline(
                            env, backend, url, args.events, args.workers, int(mode[1:]), measure
                        )
                    else:
                        run = await direct(
                            env, backend, url, args.events, int(mode[1:]), 8, measure
                        )
                finally:
                    drop()
                runs.append(run)
                print(
                    f"{backend:<7} {run.mode:<10} {run.events:>7}/{run.queued} events "
                    f"{run.seconds:>8.2f} s "
                    + (f"(first {run.first_event_s:.2f} s) " if run.first_event_s else "")
                    + f"{run.events_per_s:>9,.0f} events/s  CPU us/event "
                    + " ".join(f"{k}={v:,.0f}" for k, v in run.cpu_us_per_event.items())
                    + (
                        "  /metrics: "
                        + " ".join(f"{k}={v:,.6g}" for k, v in sorted(run.metrics.items()))
                        if run.metrics
                        else ""
                    ),
                    flush=True,
                )
    finally:
        await env.shutdown()
    ratios = {}
    for backend in backends:
        mine = [r for r in runs if r.backend == backend]
        piped = max(
            (r for r in mine if r.mode.startswith("pipeline")),
            key=lambda r: r.events_per_s,
            default=None,
        )
        best = max((r for r in mine if r.mode.startswith("direct")), key=lambda r: r.events_per_s)
        if piped is not None:
            ratios[backend] = round(piped.events_per_s / best.events_per_s, 2)
            print(
                f"{backend}: best pipeline ({piped.mode}) / best direct loop ({best.mode}) "
                f"= {ratios[backend]}"
            )
    previous = compare_with_previous(args.out, runs, args.events, measure)
    result = {
        "bench": "connectors",
        "command": "python bench/bench_connectors.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {**machine(), "database": db_version},
        "events": args.events,
        "workers": args.workers,
        "runs": [asdict(r) for r in runs],
        "pipeline_over_best_direct": ratios,
        "previous": previous,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")
    return result


def compare_with_previous(
    path: Path, runs: list[Run], events: int, measure: int
) -> dict[str, Any] | None:
    """The regression guard: print each run's events/s against the results file's last figures.

    ``path`` is the results file this run is about to overwrite; when it holds
    a run of the same backend and mode over the same number of events (and
    measured events), the change is printed (``+12 %``) and returned as
    ``{"date", "command", "events_per_s": {"<backend>/<mode>": [before,
    now, change %]}}``; ``None`` when there is no earlier file or nothing
    comparable. A file that is not valid JSON is ignored.
    """
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    before = {
        f"{r['backend']}/{r['mode']}": float(r["events_per_s"])
        for r in old.get("runs", [])
        if old.get("events") == events and r.get("events") == measure
    }
    changes: dict[str, list[float]] = {}
    for run in runs:
        key = f"{run.backend}/{run.mode}"
        if key in before and before[key] > 0:
            pct = round(100 * (run.events_per_s / before[key] - 1), 1)
            changes[key] = [round(before[key], 1), round(run.events_per_s, 1), pct]
            print(
                f"against {old.get('date', '?')}: {key:<20} {before[key]:>9,.0f} -> "
                f"{run.events_per_s:>9,.0f} events/s ({pct:+.0f} %)"
            )
    if not changes:
        return None
    return {"date": old.get("date"), "command": old.get("command"), "events_per_s": changes}


if __name__ == "__main__":
    asyncio.run(main())
