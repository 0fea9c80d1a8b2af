"""Benchmark: identity-convergence wake latency, IdentityWait workflows vs a 5 s poll.

Usage:
    python bench/bench_identity.py [--n 1000] [--poll-seconds 5] [--mysql-url mysql+pymysql://...]
        [--idle 60] [--idle-after 70] [--designs waits,poll]

Per backend and per design, a fresh database with the salesforce-sync pack and
the connector fleet (in this process, in-memory Temporal dev server):

1. enqueue N Contact events, each looking up its own parent Account (remote id
   ``a<k>``) that is not linked yet; wait until all N are ``blocked`` (and, in
   the wait design, N ``IdentityWait`` workflows run);
2. enqueue the N parent Account events;
3. a watcher polls the work items every 50 ms and records when each item is
   first seen ``succeeded`` (``TerminalAt`` is whole seconds on MariaDB, so
   the bench times rows itself); latency = child seen succeeded - its parent
   seen succeeded (the parent's link commits in the batch that succeeds it).

Designs: ``waits`` is the runtime as shipped (the parent batch signals ``wake``
to the child's wait). ``poll`` disables the IdentityWait path (``start_wait`` /
``signal_wake`` are no-ops in this process) and runs the seed's polled design
in this script: every ``--poll-seconds`` it scans blocked rows whose remote
link now exists, sets them pending and signals the fleet ``wake``.
Prints median and p99 per design; both figures carry the 50 ms watcher
resolution.

``--idle S`` (waits design): with the N waits parked, wait ``--idle-after``
seconds (default 70, past the block grace), then measure S seconds of idle:
fleet recovery's signal-with-starts per second (counted in this process), the
worker's (this process) and the dev server's CPU and RSS. ``--designs waits``
skips the poll design.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Engine, and_, exists, select, text
from sqlalchemy.engine import make_url
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

import activities.identity as identity_acts
from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetInput
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.temporal import (
    SEARCH_ATTRIBUTES,
    signal_fleet,
    start_fleet,
    temporal_binary,
)
from nexusctl.worker import build_connector_worker
from tests.builders import children_and_parents, install

WATCH_S = 0.05
PHASE_TIMEOUT_S = 150.0


def count_state(engine: Engine, state: str) -> int:
    w = t.connector_work_item
    with engine.connect() as conn:
        return len(conn.execute(select(w.c.WorkId).where(w.c.State == state)).all())


@contextmanager
def waits_disabled() -> Iterator[None]:
    """The polled design: no IdentityWait is started or signalled in this process."""

    async def no_start(*_a: object, **_k: object) -> None:
        return None

    async def no_wake(*_a: object, **_k: object) -> bool:
        return False

    saved = identity_acts.start_wait, identity_acts.signal_wake
    identity_acts.start_wait, identity_acts.signal_wake = no_start, no_wake
    # no post-commit wake either: only the poll loop wakes rows
    identity_acts.IdentityActivities.direct_wake = False
    try:
        yield
    finally:
        identity_acts.start_wait, identity_acts.signal_wake = saved
        identity_acts.IdentityActivities.direct_wake = True


async def poll_loop(engine: Engine, client: Client, settings: Settings, every: float) -> None:
    """The seed's polled scan: blocked rows whose remote link now exists -> pending."""
    w, rl = t.connector_work_item, t.connector_remote_link
    linked = exists().where(
        and_(
            rl.c.ConnectorOwnerKey == w.c.DependencyConnectorOwnerKey,
            rl.c.Namespace == w.c.DependencyConnectorNamespace,
            rl.c.DestinationObject == w.c.DependencyDestinationSlotId,
            rl.c.RemoteId == w.c.DependencyConnectorRemoteId,
        )
    )
    query = select(w.c.DependencyKeyHash).where(w.c.State == "blocked", linked).distinct()
    while True:
        await asyncio.sleep(every)

        def scan() -> set[str]:
            with engine.connect() as conn:
                keys = [r[0] for r in conn.execute(query)]
            return set(queue.wake_blocked_keys(engine, keys))  # one transaction

        for install_id in sorted(await asyncio.to_thread(scan)):
            await signal_fleet(client, settings, "wake", install_id)


async def watch(
    engine: Engine,
    lanes: dict[str, str],
    seen: dict[str, float],
    woken: dict[str, float],
    stop: asyncio.Event,
) -> None:
    """Record when each item (by source id) is first seen succeeded, and when each
    child is first seen out of ``blocked`` (woken), every 50 ms."""
    w = t.connector_work_item
    query = select(w.c.SourceLaneKey, w.c.State).where(w.c.State != "blocked")

    def rows() -> list[tuple[str, str]]:
        with engine.connect() as conn:
            return [(lanes[r[0]], r[1]) for r in conn.execute(query) if r[0] in lanes]

    while not stop.is_set():
        got = await asyncio.to_thread(rows)
        now = time.perf_counter()
        for sid, state in got:
            if sid.startswith("c"):
                woken.setdefault(sid, now)
            if state == "succeeded":
                seen.setdefault(sid, now)
        await asyncio.sleep(WATCH_S)


async def until(pred_desc: str, pred: object, timeout: float | None = None) -> None:
    deadline = time.perf_counter() + (PHASE_TIMEOUT_S if timeout is None else timeout)
    while not await asyncio.to_thread(pred):  # type: ignore[arg-type]
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out waiting for {pred_desc}")
        await asyncio.sleep(0.1)


async def run(
    env: WorkflowEnvironment,
    url: str,
    n: int,
    design: str,
    poll_s: float,
    idle_s: float = 0.0,
    idle_after_s: float = 0.0,
) -> list[float]:
    settings = Settings(database_url=url, NEXUS_DATABASE_ID=f"bi-{uuid.uuid4().hex[:8]}")
    catalog.CACHE.invalidate()
    await install(env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    engine = make_engine(url)
    (pack,) = list_connector_packs(engine)
    children, parents = children_and_parents(pack.install_id, pack.namespace, n)
    queue.enqueue(engine, children)
    seen: dict[str, float] = {}
    woken: dict[str, float] = {}
    stop = asyncio.Event()
    fleet_input = FleetInput(
        database_id=settings.database_id,
        reconcile_interval_seconds=5,
        idle_seconds=0.5,
        drain_timeout_seconds=5,
    )
    async with build_connector_worker(env.client, settings):
        fleet = await start_fleet(env.client, settings, fleet_input)
        await until(f"{n} blocked", lambda: count_state(engine, "blocked") >= n)
        if design == "waits":
            query = (
                f"WorkflowType = 'IdentityWait' AND NexusDatabase = '{settings.database_id}'"
                " AND ExecutionStatus = 'Running'"
            )
            deadline = time.perf_counter() + PHASE_TIMEOUT_S
            while (await env.client.count_workflows(query)).count < n:
                if time.perf_counter() > deadline:
                    raise TimeoutError("waits never all registered")
                await asyncio.sleep(0.2)
            if idle_s > 0:
                await measure_idle(env, query, idle_s, idle_after_s)
        poller = (
            asyncio.create_task(poll_loop(engine, env.client, settings, poll_s))
            if design == "poll"
            else None
        )
        lanes = {
            queue.lane_key(e.namespace, e.source_object, e.source_id): e.source_id
            for e in children + parents
        }
        watcher = asyncio.create_task(watch(engine, lanes, seen, woken, stop))
        queue.enqueue(engine, parents)
        await until(f"{2 * n} succeeded", lambda: count_state(engine, "succeeded") >= 2 * n)
        await asyncio.sleep(2 * WATCH_S)
        stop.set()
        await watcher
        if poller:
            poller.cancel()
        await fleet.signal("stop")
        await fleet.result()
    engine.dispose()
    wake = [woken[f"c{k}"] - seen[f"a{k}"] for k in range(n)]
    print(f"  (of which parent succeeded -> child woken: {summary(wake)})", flush=True)
    return [seen[f"c{k}"] - seen[f"a{k}"] for k in range(n)]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (Linux), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _server_pid() -> int:
    """The dev server: the child process of this one running the temporal binary."""
    me = str(os.getpid())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if stat[1] == me and "temporal" in Path(cmd).name:
            return int(proc.name)
    raise RuntimeError("dev server process not found")


class _Counter:
    """Counts ``identity_acts.start_wait`` calls (signal-with-starts) in this process."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = identity_acts.start_wait

    async def __call__(self, *args: Any, **kw: Any) -> None:
        self.calls += 1
        await self.real(*args, **kw)


async def measure_idle(env: WorkflowEnvironment, query: str, idle_s: float, after_s: float) -> None:
    """``idle_s`` seconds with N parked waits and nothing to do, after ``after_s`` seconds
    (past the 60 s block grace, so fleet recovery looks at every blocked row).

    Prints recovery's signal-with-starts per second (counted in this process),
    the worker's (this process) and the dev server's CPU in % of one core, RSS.
    """
    await asyncio.sleep(after_s)
    counter = _Counter()
    identity_acts.start_wait = counter
    server = _server_pid()
    try:
        w0, s0, t0 = time.process_time(), _cpu_seconds(server), time.perf_counter()
        await asyncio.sleep(idle_s)
        w1, s1, t1 = time.process_time(), _cpu_seconds(server), time.perf_counter()
    finally:
        identity_acts.start_wait = counter.real
    wall = t1 - t0
    running = (await env.client.count_workflows(query)).count
    print(
        f"  idle {wall:.0f} s with {running} running waits: recovery signal-with-starts "
        f"{counter.calls} ({counter.calls / wall:.2f}/s); CPU worker {100 * (w1 - w0) / wall:.1f} %"
        f", server {100 * (s1 - s0) / wall:.1f} % of a core; RSS worker "
        f"{_rss_mib(os.getpid()):.0f} MiB, server {_rss_mib(server):.0f} MiB",
        flush=True,
    )


def summary(lat: list[float]) -> str:
    ms = sorted(x * 1000 for x in lat)
    p99 = ms[min(len(ms) - 1, round(0.99 * len(ms)) - 1)]
    return f"median {statistics.median(ms):,.0f} ms, p99 {p99:,.0f} ms, max {ms[-1]:,.0f} ms"


async def main() -> None:
    global PHASE_TIMEOUT_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--poll-seconds", type=float, default=5.0)
    parser.add_argument("--mysql-url")
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="seconds of idle measurement with the N waits parked (waits design; 0: none)",
    )
    parser.add_argument(
        "--idle-after", type=float, default=70.0, help="seconds parked before the idle measurement"
    )
    parser.add_argument("--designs", default="waits,poll", help="comma-separated: waits,poll")
    parser.add_argument("--phase-timeout", type=float, default=150.0, help="seconds per phase")
    args = parser.parse_args()
    PHASE_TIMEOUT_S = args.phase_timeout
    configure_logging("json", "ERROR")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    try:
        tmp = tempfile.mkdtemp()
        backends = ["sqlite"] + (["mysql"] if args.mysql_url else [])
        for backend in backends:
            for design in args.designs.split(","):
                if backend == "sqlite":
                    url = f"sqlite:///{tmp}/bench-{design}.db"
                else:
                    name = f"nexus_bi_{uuid.uuid4().hex[:8]}"
                    with make_engine(args.mysql_url).begin() as conn:
                        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
                    url = (
                        make_url(args.mysql_url)
                        .set(database=name)
                        .render_as_string(hide_password=False)
                    )
                start = time.perf_counter()
                try:
                    if design == "poll":
                        with waits_disabled():
                            lat = await run(env, url, args.n, design, args.poll_seconds)
                    else:
                        lat = await run(
                            env, url, args.n, design, args.poll_seconds, args.idle, args.idle_after
                        )
                finally:
                    if backend == "mysql":
                        with make_engine(url).begin() as conn:
                            conn.execute(
                                text(f"DROP DATABASE IF EXISTS `{make_url(url).database}`")
                            )
                label = (
                    "IdentityWait wake" if design == "waits" else f"{args.poll_seconds:g} s poll"
                )
                print(
                    f"{backend}: {args.n} children, {label}: parent succeeded -> child succeeded "
                    f"{summary(lat)} (run {time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
