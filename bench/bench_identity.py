"""Benchmark: identity-convergence wakes, IdentityWait workflows against the seed's polling.

Usage:
    python bench/bench_identity.py [--modes steady,bulk,parked] [--designs waits,poll]
        [--n 1000] [--parked-n 10000] [--rate 20] [--poll-seconds 5]
        [--idle 60] [--idle-after 70] [--settle 20] [--watch-ms 20] [--phase-timeout 900]
        [--repeat 1] [--backends sqlite,mysql] [--mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test]
        [--out bench/results/identity.json]

A fresh local Temporal dev server (in-memory) for each run: a run of a series
does not pay for the executions an earlier run left in the server's memory
(one shared server grew ~550 MiB a run of 10,000 waits and its idle CPU
2 -> 5 -> 8 %); each run records the server it ran on. For every backend
(SQLite; MariaDB/MySQL with ``--mysql-url``), mode and design: a fresh
database, ApplyAll of the salesforce-sync pack, the connector worker in this
process and the ConnectorFleet (``FleetInput`` defaults: 5 s worker idle
timer, 5 s reconcile; drain 5 s). N Contact events ``c<k>`` are enqueued,
each looking up its parent Account ``a<k>`` that is not linked yet (every
enqueue is followed by the fleet ``wake`` signal, as ``nexusctl events
enqueue`` sends it); the run waits until all N are *parked*: ``blocked`` in
the database and, in the ``waits`` design, N ``IdentityWait`` workflows
running.

Modes:

* ``steady``: the N parents are enqueued one at a time at ``--rate`` parents/s
  (a fixed schedule, ``k / rate`` s after the first; up to
  ``ENQUEUES_IN_FLIGHT`` enqueues at once, so that a slow one does not hold
  the schedule back; the rate achieved and each enqueue call's duration are
  reported). Latency per child = its parent's remote link committed -> the
  child ``succeeded``. Neither moment is read from a timestamp column: the
  link's ``CreatedDate`` is the clock the batch read *before* its writes, not
  its commit, and ``DATETIME`` is whole seconds on MariaDB (so is
  ``TerminalAt``). A watcher instead polls the
  database every ``--watch-ms`` (20) ms, by primary key: the remote link
  rows of the parents enqueued and not seen yet, then the state of their
  children. A SELECT sees what committed before it started, so each moment
  is *first seen*, the start of the first watcher query that returned it:
  the commit lies in (previous query start, this query start]. Each end
  carries one watcher tick of resolution (20 ms plus the query), the
  difference +/- one tick. Also reported: link -> child woken (first seen
  out of ``blocked``), parent enqueued -> its link (the parent's own
  processing, not part of the latency) and the rate achieved.
* ``bulk``: the same, with the N parents enqueued all at once (the earlier
  bench), plus the time from that enqueue to all N children succeeded.
* ``parked`` (N = ``--parked-n``, default ``--n``, so that one run writes
  every mode): the seconds to park all N (enqueue -> N blocked and, waits
  design, N waits running); then ``--idle-after`` seconds (default 70: past
  the 60 s block grace, so fleet recovery has looked at every blocked row,
  and the waits' probe intervals, 5 s doubling, have grown to 40-60 s), then
  ``--idle`` s of idle: CPU in % of one core and RSS of the worker (this
  process: the worker, its activities, the poll loop of the poll design)
  and of the dev server (a child process of this one, else the process on
  its port), the database server's CPU on MariaDB/MySQL (shared: it counts
  whatever else runs on it), the probes and recovery signal-with-starts run
  in this process; the dev server's RSS growth since before the children
  were enqueued; then all N parents enqueued at once: the seconds until all
  N children succeeded (counted in the database) and how many are left
  ``blocked``.

``--repeat N`` runs each mode and design N times in a row, each on a fresh
database (a *series*, for "none left behind, ten runs in a row"): the results
file keeps the first run in full and every run's headline figures under
``series`` (park, wake all, left blocked, idle CPU), and the verdict
``parked_series_all_woken_in_time`` holds when every run woke all within the
target and left none blocked.

Every mode also counts, at its end, the children left ``blocked`` whose
parent's link exists (``left_blocked_linked``): a lost wake, a runtime bug;
and in the waits design the ``IdentityWait`` workflows still running when the
last child was done, and the seconds until none runs (at most ``--settle``):
each was woken and should complete (see :func:`finish`).

Designs:

* ``waits``: the runtime as shipped (the parent's batch wakes its blocked
  children right after its commit and signals their waits).
* ``poll``: the seed's polled design over the same rows. In this process
  only, while the design runs: no IdentityWait is started or signalled
  (``activities.identity_client`` ``start_wait`` / ``signal_wake`` are no-ops, the
  notify's direct wake is off), the batch's post-commit wakes
  (``wake_linked`` / ``wake_resolved`` as the processor calls them) are
  off, and the fleet runs without identity recovery. This script scans
  every ``--poll-seconds`` for blocked rows whose remote link exists, wakes
  them in one transaction and signals the fleet ``wake``. No runtime file
  changes.

A run that fails (e.g. its children never all park within ``--phase-timeout``)
is recorded as ``{"error": ...}`` and the others go on.

Figures go to ``--out`` (``bench/results/identity.json``): ``backends.<backend>.
<mode>.<design>``, with ``machine`` (cores, memory, load average at the start
and the end, database version), ``command``, ``date``, ``settings``,
``targets``, ``verdicts`` (the waits design against the targets) and
``previous`` (each figure against the results file this run overwrites, see
:func:`compare_with_previous`). Units are in the key names: ``*_ms``
milliseconds, ``*_s`` seconds, ``*_cpu_pct`` % of one core over the idle
stretch, ``*_mib`` MiB. Latency figures (``latency_ms``, ``link_to_woken_ms``,
``enqueue_to_link_ms``, ``enqueue_call_ms``) hold count, median, p90, p99
(nearest rank) and max. No figure is a test: a smoke test runs this at a tiny
size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Engine, and_, exists, func, select, text
from sqlalchemy.engine import make_url
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

import activities.identity as identity_acts
import activities.identity_client as wait_client
import nexuscrm.connectors.processor as processor_mod
from bench.machine import machine
from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.finishing import BatchOutcome
from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import BlockedWait, FleetInput
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, signal_fleet, start_fleet, temporal_binary
from nexusctl.worker import build_connector_worker
from tests.builders import children_and_parents, free_port, install

RESULTS = Path(__file__).resolve().parent / "results" / "identity.json"
MODES = ("steady", "bulk", "parked")
DESIGNS = ("waits", "poll")
BACKENDS = ("sqlite", "mysql")
TARGETS = {
    "steady_median_ms": 300.0,
    "steady_p99_ms": 1000.0,
    "parked_idle_cpu_pct_of_core": 2.0,
    "parked_worker_rss_mib": 1024.0,
    "parked_wake_all_s": 60.0,
}
"""What the ``waits`` design is judged against (``verdicts`` in the JSON)."""

_CHUNK = 500
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="bench")
PROGRESS_S = 30.0
ENQUEUES_IN_FLIGHT = 3
"""Steady mode: parent enqueues running at once, so that a slow one does not
hold back the schedule (the bench's own threads, see :func:`off_loop`)."""

_T = TypeVar("_T")


async def off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in the bench's own threads: the worker in this process runs its
    async activities' blocking calls in the loop's default executor, which the
    bench's reads and enqueues must not crowd."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


# -- database reads ----------------------------------------------------------


def count_items(engine: Engine, install_id: str, state: str) -> int:
    """Work items of the pack in ``state`` (one count on the claim index)."""
    w = t.connector_work_item
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).where(w.c.InstalledPackId == install_id, w.c.State == state)
            ).scalar_one()
        )


def _linked() -> Any:
    """EXISTS: the remote link a work item's dependency waits on."""
    w, rl = t.connector_work_item, t.connector_remote_link
    return exists().where(
        and_(
            rl.c.ConnectorOwnerKey == w.c.DependencyConnectorOwnerKey,
            rl.c.Namespace == w.c.DependencyConnectorNamespace,
            rl.c.DestinationObject == w.c.DependencyDestinationSlotId,
            rl.c.RemoteId == w.c.DependencyConnectorRemoteId,
        )
    )


def leftovers(engine: Engine, install_id: str) -> dict[str, int]:
    """Children left ``blocked``, those of them whose parent's link exists (a lost
    wake), and items ``failed``: counted in the database."""
    w = t.connector_work_item
    mine = w.c.InstalledPackId == install_id
    with engine.connect() as conn:
        blocked = conn.execute(
            select(func.count()).where(mine, w.c.State == "blocked")
        ).scalar_one()
        linked = conn.execute(
            select(func.count()).where(mine, w.c.State == "blocked", _linked())
        ).scalar_one()
        failed = conn.execute(select(func.count()).where(mine, w.c.State == "failed")).scalar_one()
    return {"left_blocked": blocked, "left_blocked_linked": linked, "failed": failed}


def link_scope(engine: Engine, install_id: str) -> tuple[str, str, str]:
    """(owner key, namespace, destination object) of the links the children wait on."""
    w = t.connector_work_item
    with engine.connect() as conn:
        row = conn.execute(
            select(
                w.c.DependencyConnectorOwnerKey,
                w.c.DependencyConnectorNamespace,
                w.c.DependencyDestinationSlotId,
            )
            .where(w.c.InstalledPackId == install_id, w.c.State == "blocked")
            .limit(1)
        ).one()
    return str(row[0]), str(row[1]), str(row[2])


# -- the watcher ---------------------------------------------------------------


class Watcher:
    """First-seen moments (``time.perf_counter``) of parents' links and children's states.

    :meth:`expect` adds parents (by ordinal ``k``) before they are enqueued;
    each :meth:`tick` reads, by primary key, the links of the expected parents
    not seen yet (``link_seen``), then the state of their children not done
    yet (``woken``: first seen out of ``blocked``; ``done``: first seen
    ``succeeded``; ``failed``), each read in a transaction of its own. A moment
    is the start of the transaction whose first query returned it. A child
    seen done before its link (the link committed between the two reads of
    one tick) gets that read's start as its link.
    """

    def __init__(
        self, engine: Engine, scope: tuple[str, str, str], child_ids: dict[int, str]
    ) -> None:
        self.engine = engine
        self.scope = scope
        self.child_ids = child_ids
        self.by_work_id = {w: k for k, w in child_ids.items()}
        self.link_seen: dict[int, float] = {}
        self.woken: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.failed: set[int] = set()
        self.ticks = 0
        self.tick_seconds = 0.0
        self._links: set[int] = set()
        self._children: set[int] = set()
        self._lock = threading.Lock()

    def expect(self, ks: Sequence[int]) -> None:
        """Watch the parents ``ks`` (before they are enqueued)."""
        with self._lock:
            self._links.update(ks)
            self._children.update(ks)

    @property
    def outstanding(self) -> int:
        """Expected children neither done nor failed yet."""
        with self._lock:
            return len(self._children)

    def tick(self) -> None:
        """One round of reads (runs in a thread)."""
        owner, namespace, obj = self.scope
        rl, w = t.connector_remote_link, t.connector_work_item
        with self._lock:
            links = sorted(self._links)
            children = sorted(self._children)
        start = time.perf_counter()
        # Two transactions: one read snapshot each, taken at its first query.
        seen_links: list[str] = []
        with self.engine.connect() as conn:
            at_links = time.perf_counter()
            for i in range(0, len(links), _CHUNK):
                ids = [f"a{k}" for k in links[i : i + _CHUNK]]
                seen_links.extend(
                    conn.execute(
                        select(rl.c.RemoteId).where(
                            rl.c.ConnectorOwnerKey == owner,
                            rl.c.Namespace == namespace,
                            rl.c.DestinationObject == obj,
                            rl.c.RemoteId.in_(ids),
                        )
                    ).scalars()
                )
        states: list[tuple[str, str]] = []
        with self.engine.connect() as conn:
            at_children = time.perf_counter()
            for i in range(0, len(children), _CHUNK):
                ids = [self.child_ids[k] for k in children[i : i + _CHUNK]]
                states.extend(
                    (r[0], r[1])
                    for r in conn.execute(
                        select(w.c.WorkId, w.c.State).where(w.c.WorkId.in_(ids))
                    ).all()
                )
        with self._lock:
            for remote_id in seen_links:
                k = int(remote_id[1:])
                self.link_seen.setdefault(k, at_links)
                self._links.discard(k)
            for work_id, state in states:
                k = self.by_work_id[work_id]
                if state != "blocked":
                    self.woken.setdefault(k, at_children)
                if state in ("succeeded", "failed"):
                    self.link_seen.setdefault(k, at_children)
                    self._links.discard(k)
                    self._children.discard(k)
                    if state == "succeeded":
                        self.done[k] = at_children
                    else:
                        self.failed.add(k)
        self.ticks += 1
        self.tick_seconds += time.perf_counter() - start

    async def run(self, every: float, stop: asyncio.Event) -> None:
        """Tick every ``every`` seconds (start to start) until ``stop``."""
        while not stop.is_set():
            began = time.perf_counter()
            await off_loop(self.tick)
            await asyncio.sleep(max(0.0, every - (time.perf_counter() - began)))
        await off_loop(self.tick)


# -- figures -------------------------------------------------------------------


def stats_ms(seconds: Sequence[float]) -> dict[str, Any]:
    """Count, median, p90 and p99 (nearest rank) and max of ``seconds``, in milliseconds."""
    if not seconds:
        return {"count": 0, "median": None, "p90": None, "p99": None, "max": None}
    ms = sorted(x * 1000 for x in seconds)

    def rank(p: int) -> float:
        return round(ms[min(len(ms) - 1, max(0, -(-p * len(ms) // 100) - 1))], 1)

    return {
        "count": len(ms),
        "median": round(statistics.median(ms), 1),
        "p90": rank(90),
        "p99": rank(99),
        "max": round(ms[-1], 1),
    }


def _rss_mib(proc: psutil.Process | None) -> float | None:
    return None if proc is None else round(proc.memory_info().rss / 2**20, 1)


def _cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return float(times.user + times.system)


def temporal_server(env: WorkflowEnvironment) -> psutil.Process | None:
    """The Temporal dev server of ``env``: a child of this process named ``temporal*``
    (the one ``WorkflowEnvironment.start_local`` runs), else the process listening
    on ``env``'s port; ``None`` when neither is found."""
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("temporal"):
                return p
    port = int(env.client.service_client.config.target_host.rsplit(":", 1)[1])
    with contextlib.suppress(psutil.Error):
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
    return None


def database_server() -> psutil.Process | None:
    """The local MariaDB/MySQL server process, if one runs (shared with other users)."""
    for p in psutil.process_iter(["name"]):
        if p.info["name"] in ("mariadbd", "mysqld"):
            return p
    return None


SERVER_COUNTERS = ("service_requests", "persistence_requests")
"""The dev server's request counters read around the idle window (by operation)."""


def server_counters(metrics_url: str | None) -> dict[str, float]:
    """``{"<counter>:<operation>": total}`` of :data:`SERVER_COUNTERS` from the dev
    server's Prometheus endpoint (``--metrics-port``); empty when it does not answer."""
    if not metrics_url:
        return {}
    try:
        body = httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in SERVER_COUNTERS:
                key = f"{name}:{sample.labels.get('operation', '?')}"
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def counter_rates(
    before: dict[str, float], after: dict[str, float], seconds: float, top: int = 12
) -> dict[str, float]:
    """The ``top`` largest per-second rates of the counters between two reads."""
    rates = {k: (v - before.get(k, 0.0)) / seconds for k, v in after.items()}
    ranked = sorted(((r, k) for k, r in rates.items() if r > 0), reverse=True)[:top]
    return {k: round(r, 3) for r, k in ranked}


class _Counting:
    """Counts the probes (``IdentityActivities._resolve_bounded``) and recovery's
    signal-with-starts (``start_wait``) run in this process while entered."""

    def __init__(self) -> None:
        self.probes = 0
        self.starts = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        real_resolve = identity_acts.IdentityActivities._resolve_bounded
        real_start = wait_client.start_wait

        def resolve(
            inner: identity_acts.IdentityActivities, dep: Dependency, timeout: float
        ) -> bool:
            with self._lock:
                self.probes += 1
            return real_resolve(inner, dep, timeout)

        async def start(*args: Any, **kw: Any) -> None:
            self.starts += 1
            await real_start(*args, **kw)

        identity_acts.IdentityActivities._resolve_bounded = resolve  # type: ignore[method-assign,assignment]
        wait_client.start_wait = start
        try:
            yield
        finally:
            identity_acts.IdentityActivities._resolve_bounded = real_resolve  # type: ignore[method-assign]
            wait_client.start_wait = real_start


# -- designs -------------------------------------------------------------------


@contextlib.contextmanager
def poll_design() -> Iterator[None]:
    """The seed's polled design in this process: no wait is started or signalled, no
    wake by the notify or by the batch after its commits (only the poll loop wakes)."""

    async def no_start(*_a: object, **_k: object) -> None:
        return None

    async def no_signal(*_a: object, **_k: object) -> bool:
        return False

    def no_wake_linked(*_a: object, **_k: object) -> None:
        return None

    def no_wake_resolved(
        engine: Engine,
        blocked: list[BlockedWait],
        outcome: BatchOutcome,
        on_woken: queue.WokenHook | None = None,
    ) -> list[BlockedWait]:
        return blocked

    saved = (
        wait_client.start_wait,
        wait_client.signal_wake,
        processor_mod.wake_linked,
        processor_mod.wake_resolved,
    )
    wait_client.start_wait = no_start
    wait_client.signal_wake = no_signal
    processor_mod.wake_linked = no_wake_linked
    processor_mod.wake_resolved = no_wake_resolved
    identity_acts.IdentityActivities.direct_wake = False
    try:
        yield
    finally:
        (
            wait_client.start_wait,
            wait_client.signal_wake,
            processor_mod.wake_linked,
            processor_mod.wake_resolved,
        ) = saved
        identity_acts.IdentityActivities.direct_wake = True


async def poll_loop(engine: Engine, client: Client, settings: Settings, every: float) -> None:
    """The seed's polled scan, every ``every`` s: blocked rows whose remote link now
    exists -> ``pending`` (one transaction), then the fleet ``wake`` for their packs."""
    w = t.connector_work_item
    query = select(w.c.DependencyKeyHash).where(w.c.State == "blocked", _linked()).distinct()

    def scan() -> set[str]:
        with engine.connect() as conn:
            keys = [r[0] for r in conn.execute(query)]
        return set(queue.wake_blocked_keys(engine, keys)) if keys else set()

    while True:
        await asyncio.sleep(every)
        for install_id in sorted(await off_loop(scan)):
            await signal_fleet(client, settings, "wake", install_id)


# -- one run -------------------------------------------------------------------


@dataclass
class Ctx:
    """One (backend, mode, design) run's database, pack and events."""

    env: WorkflowEnvironment
    args: argparse.Namespace
    backend: str
    design: str
    settings: Settings
    engine: Engine
    install_id: str
    children: list[queue.EnqueueRequest]
    parents: list[queue.EnqueueRequest]
    child_ids: dict[int, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.children)

    def waits_query(self) -> str:
        return (
            f"WorkflowType = 'IdentityWait' AND NexusDatabase = '{self.settings.database_id}'"
            " AND ExecutionStatus = 'Running'"
        )

    async def running_waits(self) -> int:
        return (await self.env.client.count_workflows(self.waits_query())).count


async def until(
    desc: str, pred: Callable[[], Awaitable[bool]], timeout: float, every: float = 0.1
) -> bool:
    """Await ``pred()`` every ``every`` s until true; False (printed) after ``timeout`` s.

    Prints a line every :data:`PROGRESS_S` seconds while it waits."""
    start = time.perf_counter()
    report = start + PROGRESS_S
    while not await pred():
        now = time.perf_counter()
        if now > start + timeout:
            print(f"  timed out after {timeout:.0f} s waiting for {desc}", flush=True)
            return False
        if now > report:
            print(f"  still waiting for {desc} ({now - start:.0f} s)", flush=True)
            report = now + PROGRESS_S
        await asyncio.sleep(every)
    return True


async def park(ctx: Ctx) -> float:
    """Enqueue the N children; seconds until all are blocked and (waits) N waits run."""
    start = time.perf_counter()
    await enqueue(ctx, ctx.children)
    w = t.connector_work_item
    lanes = {
        queue.lane_key(e.namespace, e.source_object, e.source_id): k
        for k, e in enumerate(ctx.children)
    }
    with ctx.engine.connect() as conn:
        for work_id, lane in conn.execute(
            select(w.c.WorkId, w.c.SourceLaneKey).where(w.c.InstalledPackId == ctx.install_id)
        ):
            if lane in lanes:
                ctx.child_ids[lanes[lane]] = work_id
    timeout = ctx.args.phase_timeout

    async def all_blocked() -> bool:
        n = await off_loop(count_items, ctx.engine, ctx.install_id, "blocked")
        return n >= ctx.n

    async def all_waiting() -> bool:
        return await ctx.running_waits() >= ctx.n

    ok = await until(f"{ctx.n} blocked", all_blocked, timeout)
    if ok and ctx.design == "waits":
        ok = await until(f"{ctx.n} waits running", all_waiting, timeout, every=0.25)
    if not ok:
        raise TimeoutError(f"{ctx.backend} {ctx.design}: the {ctx.n} children never all parked")
    return time.perf_counter() - start


def enqueue_all(engine: Engine, events: list[queue.EnqueueRequest]) -> None:
    """Enqueue ``events`` in transactions of 5000."""
    for start in range(0, len(events), 5000):
        queue.enqueue(engine, events[start : start + 5000])


async def enqueue(ctx: Ctx, events: list[queue.EnqueueRequest]) -> None:
    """Enqueue ``events``, then signal the fleet ``wake`` as ``nexusctl events enqueue`` does."""
    await off_loop(enqueue_all, ctx.engine, events)
    await signal_fleet(ctx.env.client, ctx.settings, "wake", ctx.install_id)


async def finish(ctx: Ctx) -> dict[str, Any]:
    """:func:`leftovers`, and (waits design) how the waits end once their children
    are done: each was woken, so each should complete.

    ``waits_running_at_done``: waits running when the last child was seen done;
    ``waits_done_after_s``: seconds from then until none runs (``None`` when
    some still run after ``--settle`` s); ``waits_left_running``: running at
    the end of that wait (server visibility, which lags a little).
    """
    out: dict[str, Any] = await off_loop(leftovers, ctx.engine, ctx.install_id)
    if ctx.design == "waits":
        start = time.perf_counter()
        out["waits_running_at_done"] = running = await ctx.running_waits()
        while running and time.perf_counter() - start < ctx.args.settle:
            await asyncio.sleep(0.5)
            running = await ctx.running_waits()
        out["waits_done_after_s"] = None if running else round(time.perf_counter() - start, 1)
        out["waits_left_running"] = running
    return out


async def latency_mode(ctx: Ctx, mode: str) -> dict[str, Any]:
    """``steady`` or ``bulk``: parents enqueued, link -> child succeeded per child."""
    args = ctx.args
    park_s = await park(ctx)
    watcher = Watcher(ctx.engine, link_scope(ctx.engine, ctx.install_id), ctx.child_ids)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(args.watch_ms / 1000, stop))
    enqueued: dict[int, float] = {}
    start = time.perf_counter()
    calls: list[float] = []
    if mode == "steady":
        gate = asyncio.Semaphore(ENQUEUES_IN_FLIGHT)

        async def one(k: int) -> None:
            async with gate:
                watcher.expect([k])
                enqueued[k] = time.perf_counter()
                await enqueue(ctx, [ctx.parents[k]])
                calls.append(time.perf_counter() - enqueued[k])

        tasks = []
        for k in range(ctx.n):
            await asyncio.sleep(max(0.0, start + k / args.rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(k)))
        await asyncio.gather(*tasks)
        enqueue_s = max(enqueued.values()) - start
    else:
        watcher.expect(range(ctx.n))
        enqueued = dict.fromkeys(range(ctx.n), start)
        await enqueue(ctx, ctx.parents)
        enqueue_s = time.perf_counter() - start

    async def all_done() -> bool:
        return watcher.outstanding == 0

    complete = await until(f"{ctx.n} children succeeded", all_done, args.phase_timeout)
    all_done_s = time.perf_counter() - start
    stop.set()
    await task
    done = watcher.done
    lat = [done[k] - watcher.link_seen[k] for k in done]
    wake = [
        watcher.woken[k] - watcher.link_seen[k] for k in watcher.woken if k in watcher.link_seen
    ]
    parent = [watcher.link_seen[k] - enqueued[k] for k in watcher.link_seen if k in enqueued]
    out: dict[str, Any] = {
        "n": ctx.n,
        "park_s": round(park_s, 2),
        "latency_ms": stats_ms(lat),
        "link_to_woken_ms": stats_ms(wake),
        "enqueue_to_link_ms": stats_ms(parent),
        "complete": complete,
        "children_done": len(done),
        "watch_tick_ms": round(1000 * watcher.tick_seconds / max(1, watcher.ticks), 2),
    }
    if mode == "steady":
        out["rate"] = args.rate
        out["achieved_rate"] = round((ctx.n - 1) / enqueue_s, 2) if ctx.n > 1 else None
        out["enqueue_call_ms"] = stats_ms(calls)
    else:
        out["enqueue_s"] = round(enqueue_s, 2)
        out["all_done_s"] = round(all_done_s, 2) if complete else None
    out.update(await finish(ctx))
    return out


async def parked_mode(ctx: Ctx) -> dict[str, Any]:
    """``parked``: park N, idle, then wake all N at once."""
    args = ctx.args
    server = temporal_server(ctx.env)
    db = database_server() if ctx.backend == "mysql" else None
    me = psutil.Process()
    rss_before = _rss_mib(server)
    park_s = await park(ctx)
    rss_parked = _rss_mib(server)
    print(f"  parked in {park_s:.1f} s; idle window in {args.idle_after:.0f} s", flush=True)
    await asyncio.sleep(args.idle_after)
    counter = _Counting()
    print(f"  idle window: {args.idle:.0f} s (pid {os.getpid()})", flush=True)
    # the dev server main() started reports its counters (none when run() is given one)
    metrics_url = getattr(args, "server_metrics_url", None)
    with counter.counting():
        counts0 = await off_loop(server_counters, metrics_url)
        cpu0 = (_cpu_s(me), _cpu_s(server), _cpu_s(db))
        t0 = time.perf_counter()
        await asyncio.sleep(args.idle)
        cpu1 = (_cpu_s(me), _cpu_s(server), _cpu_s(db))
        wall = time.perf_counter() - t0
        counts1 = await off_loop(server_counters, metrics_url)
    running = await ctx.running_waits() if ctx.design == "waits" else 0

    procs = (me, server, db)

    def pct(i: int) -> float | None:
        return None if procs[i] is None else round(100 * (cpu1[i] - cpu0[i]) / wall, 2)

    idle: dict[str, Any] = {
        "seconds": round(wall, 1),
        "after_s": args.idle_after,
        "worker_cpu_pct": pct(0),
        "server_cpu_pct": pct(1),
        "worker_rss_mib": _rss_mib(me),
        "server_rss_mib": _rss_mib(server),
        "probes": counter.probes,
        "probes_per_s": round(counter.probes / wall, 2),
        "recovery_starts": counter.starts,
        "waits_running": running,
        # The dev server's busiest request kinds over the window, per second.
        "server_requests_per_s": counter_rates(counts0, counts1, wall),
    }
    if db is not None:
        idle["database_cpu_pct"] = pct(2)
    rss_idle = idle["server_rss_mib"]
    print(f"  waking all {ctx.n}: parents enqueued", flush=True)
    start = time.perf_counter()
    await enqueue(ctx, ctx.parents)

    def terminal() -> int:
        return sum(count_items(ctx.engine, ctx.install_id, s) for s in ("succeeded", "failed"))

    async def all_terminal() -> bool:
        return await off_loop(terminal) >= 2 * ctx.n

    await until(f"{2 * ctx.n} items terminal", all_terminal, args.phase_timeout, 0.25)
    wake_all_s = time.perf_counter() - start
    succeeded = await off_loop(count_items, ctx.engine, ctx.install_id, "succeeded")
    complete = succeeded >= 2 * ctx.n
    out: dict[str, Any] = {
        "n": ctx.n,
        "park_s": round(park_s, 2),
        "server_rss_before_mib": rss_before,
        "server_rss_parked_mib": rss_parked,
        "server_rss_growth_mib": (
            round(rss_idle - rss_before, 1) if rss_idle is not None and rss_before else None
        ),
        "idle": idle,
        "wake_all_s": round(wake_all_s, 2) if complete else None,
        "complete": complete,
        "worker_rss_after_mib": _rss_mib(me),
    }
    out.update(await finish(ctx))
    return out


def mode_n(args: argparse.Namespace, mode: str) -> int:
    """Children (and parents) of a ``mode`` run: ``--parked-n`` for ``parked``, else ``--n``."""
    return int(args.parked_n if mode == "parked" else args.n)


async def one_run(
    env: WorkflowEnvironment,
    args: argparse.Namespace,
    backend: str,
    url: str,
    mode: str,
    design: str,
) -> dict[str, Any]:
    """Install, start the worker and fleet (and the poll loop), run ``mode``, stop."""
    settings = Settings(database_url=url, NEXUS_DATABASE_ID=f"bi-{uuid.uuid4().hex[:8]}")
    catalog.CACHE.invalidate()
    await install(env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    engine = make_engine(url)
    (pack,) = list_connector_packs(engine)
    n = mode_n(args, mode)
    children, parents = children_and_parents(pack.install_id, pack.namespace, n)
    ctx = Ctx(env, args, backend, design, settings, engine, pack.install_id, children, parents)
    fleet_input = FleetInput(
        database_id=settings.database_id,
        drain_timeout_seconds=5,
        identity_recovery=design == "waits",
    )
    try:
        with poll_design() if design == "poll" else contextlib.nullcontext():
            async with build_connector_worker(env.client, settings):
                fleet = await start_fleet(env.client, settings, fleet_input)
                poller = (
                    asyncio.create_task(poll_loop(engine, env.client, settings, args.poll_seconds))
                    if design == "poll"
                    else None
                )
                try:
                    if mode == "parked":
                        return await parked_mode(ctx)
                    return await latency_mode(ctx, mode)
                finally:
                    if poller is not None:
                        poller.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await poller
                    await fleet.signal("stop")
                    await fleet.result()
    finally:
        engine.dispose()


@contextlib.asynccontextmanager
async def fresh_database(
    backend: str, mysql_url: str | None, tmp: str
) -> AsyncIterator[tuple[str, str | None]]:
    """A new empty database of ``backend`` (``nexus_b_<random>`` on MySQL), dropped
    afterwards; yields its URL and server version."""
    if backend == "sqlite":
        path = Path(tmp) / f"bench-{uuid.uuid4().hex[:8]}.db"
        try:
            yield f"sqlite:///{path}", None
        finally:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    assert mysql_url is not None
    name = f"nexus_b_{uuid.uuid4().hex[:10]}"
    admin = make_engine(mysql_url)
    try:
        with admin.begin() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
            version = str(conn.execute(text("SELECT VERSION()")).scalar())
        try:
            yield (
                make_url(mysql_url).set(database=name).render_as_string(hide_password=False),
                version,
            )
        finally:
            with admin.begin() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
    finally:
        admin.dispose()


async def timed_run(
    env: WorkflowEnvironment,
    args: argparse.Namespace,
    backend: str,
    mode: str,
    design: str,
    tmp: str,
    result: dict[str, Any],
) -> dict[str, Any]:
    """One run of ``mode`` / ``design`` on a fresh database of ``backend``; a failure
    is recorded as ``error`` (the other runs go on); ``run_s``: its wall time."""
    async with fresh_database(backend, args.mysql_url, tmp) as (url, version):
        if version:
            result["machine"]["database"] = version
        began = time.perf_counter()
        try:
            r = await one_run(env, args, backend, url, mode, design)
        except Exception as exc:  # recorded; the other runs go on
            r = {"n": mode_n(args, mode), "error": f"{type(exc).__name__}: {exc}"}
    r["run_s"] = round(time.perf_counter() - began, 1)
    return r


SERIES_FIGURES = ("park_s", "wake_all_s", "all_done_s", "left_blocked", "left_blocked_linked")
"""The figures of each run of a ``--repeat`` series kept in the results file."""


def series_entry(r: dict[str, Any]) -> dict[str, Any]:
    """One run of a series: its headline figures (and its error, if it failed)."""
    out = {k: r[k] for k in (*SERIES_FIGURES, "error", "run_s", "server") if k in r}
    if isinstance(r.get("idle"), dict):
        out["idle_worker_cpu_pct"] = r["idle"].get("worker_cpu_pct")
        out["idle_server_cpu_pct"] = r["idle"].get("server_cpu_pct")
    return out


def describe_series(series: list[dict[str, Any]]) -> str:
    """One line over a series: runs, failures, the worst wake and what was left behind."""
    wakes = [x["wake_all_s"] for x in series if x.get("wake_all_s") is not None]
    failed = sum(1 for x in series if "error" in x or x.get("wake_all_s", 0) is None)
    left = sum(int(x.get("left_blocked") or 0) for x in series)
    worst = f"{max(wakes):.1f} s" if wakes else "n/a"
    return (
        f"  series of {len(series)}: {failed} failed or incomplete, wake all worst {worst}, "
        f"left blocked {left} in all"
    )


# -- report --------------------------------------------------------------------


def describe(backend: str, mode: str, design: str, r: dict[str, Any]) -> str:
    """One line of a run's headline figures."""
    head = f"{backend:<6} {mode:<6} {design:<5} n={r['n']}"
    if "error" in r:
        return f"{head}: failed: {r['error']}"
    if mode == "parked":
        i = r["idle"]
        db = f", database {i['database_cpu_pct']} %" if "database_cpu_pct" in i else ""
        growth = r["server_rss_growth_mib"]
        grew = "n/a" if growth is None else f"{growth:+.1f}"
        return (
            f"{head}: park {r['park_s']:.1f} s; idle {i['seconds']:.0f} s: CPU worker "
            f"{i['worker_cpu_pct']} %, server {i['server_cpu_pct']} %{db} of a core, "
            f"RSS worker {i['worker_rss_mib']} MiB, server {i['server_rss_mib']} MiB "
            f"({grew} MiB since before parking), probes "
            f"{i['probes_per_s']}/s; wake all {r['wake_all_s']} s; left blocked "
            f"{r['left_blocked']}"
            + (
                "; server requests/s in the idle window: "
                + ", ".join(f"{k} {v}" for k, v in list(i["server_requests_per_s"].items())[:6])
                if i.get("server_requests_per_s")
                else ""
            )
        )
    lat, wake = r["latency_ms"], r["link_to_woken_ms"]
    extra = (
        f"rate {r['achieved_rate']}/s"
        if mode == "steady"
        else f"all done {r['all_done_s']} s after the enqueue"
    )
    return (
        f"{head}: link -> child succeeded median {lat['median']} ms, p99 {lat['p99']} ms, "
        f"max {lat['max']} ms (-> woken median {wake['median']} ms); {extra}; "
        f"left blocked {r['left_blocked']}"
    )


def verdicts(runs: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The ``waits`` design of one backend against :data:`TARGETS`."""
    out: dict[str, bool] = {}
    steady = runs.get("steady", {}).get("waits")
    if steady and "error" not in steady and steady["latency_ms"]["count"]:
        out["steady_median"] = steady["latency_ms"]["median"] < TARGETS["steady_median_ms"]
        out["steady_p99"] = steady["latency_ms"]["p99"] < TARGETS["steady_p99_ms"]
    parked = runs.get("parked", {}).get("waits")
    if parked and "error" not in parked:
        cap = TARGETS["parked_idle_cpu_pct_of_core"]
        for who in ("worker", "server"):
            cpu = parked["idle"][f"{who}_cpu_pct"]
            if cpu is not None:
                out[f"parked_{who}_idle_cpu"] = cpu < cap
        rss = parked["idle"]["worker_rss_mib"]
        out["parked_worker_rss"] = rss < TARGETS["parked_worker_rss_mib"]
        wake = parked["wake_all_s"]
        out["parked_all_woken_in_time"] = (
            wake is not None and wake < TARGETS["parked_wake_all_s"] and parked["left_blocked"] == 0
        )
        if parked.get("series"):  # --repeat: every run of the series
            out["parked_series_all_woken_in_time"] = all(
                x.get("wake_all_s") is not None
                and x["wake_all_s"] < TARGETS["parked_wake_all_s"]
                and x.get("left_blocked") == 0
                for x in parked["series"]
            )
    return out


FIGURES = {
    "steady": ("latency_ms.median", "latency_ms.p99", "link_to_woken_ms.median"),
    "bulk": ("latency_ms.median", "latency_ms.p99", "all_done_s", "waits_done_after_s"),
    "parked": (
        "park_s",
        "idle.worker_cpu_pct",
        "idle.server_cpu_pct",
        "idle.worker_rss_mib",
        "idle.server_rss_mib",
        "server_rss_growth_mib",
        "wake_all_s",
        "waits_done_after_s",
    ),
}
"""The figures compared with the previous results file, per mode (dotted paths)."""


def _figure(run: dict[str, Any], path: str) -> float | None:
    value: Any = run
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return float(value) if isinstance(value, int | float) else None


def _comparable(old: dict[str, Any], new: dict[str, Any], mode: str) -> bool:
    if mode == "parked":
        keys: tuple[str, ...] = ("parked_n", "idle", "idle_after")
    elif mode == "steady":
        keys = ("n", "rate", "watch_ms")
    else:
        keys = ("n", "watch_ms")
    return all(old.get(k) == new.get(k) for k in keys)


def compare_with_previous(path: Path, result: dict[str, Any]) -> dict[str, Any] | None:
    """The regression guard: print each figure against the results file's last run.

    ``path`` is the results file this run is about to overwrite. A figure of
    :data:`FIGURES` is compared when the old file has the same backend, mode
    and design, run with the same settings: ``n`` and ``watch_ms`` (and
    ``rate`` for ``steady``); ``parked_n``, ``idle`` and ``idle_after`` for
    ``parked``. Returns ``{"date",
    "command", "figures": {"<backend>/<mode>/<design>/<figure>": [before, now,
    change %]}}``; ``None`` when there is no earlier file (or it is not valid
    JSON) or nothing comparable.
    """
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    changes: dict[str, list[float | None]] = {}
    for backend, modes in result["backends"].items():
        for mode, designs in modes.items():
            if not _comparable(old.get("settings", {}), result["settings"], mode):
                continue
            for design, run in designs.items():
                before_run = old.get("backends", {}).get(backend, {}).get(mode, {}).get(design)
                if not isinstance(before_run, dict):
                    continue
                for fig in FIGURES[mode]:
                    before, now = _figure(before_run, fig), _figure(run, fig)
                    if before is None or now is None:
                        continue
                    pct = round(100 * (now / before - 1), 1) if before else None
                    key = f"{backend}/{mode}/{design}/{fig}"
                    changes[key] = [before, now, pct]
                    change = f"{pct:+.0f} %" if pct is not None else "n/a"
                    print(
                        f"against {old.get('date', '?')}: {key:<44} {before:>10,.1f} -> "
                        f"{now:>10,.1f} ({change})"
                    )
    if not changes:
        return None
    return {"date": old.get("date"), "command": old.get("command"), "figures": changes}


# -- entry points --------------------------------------------------------------


def _csv(
    value: str, allowed: Sequence[str], flag: str, parser: argparse.ArgumentParser
) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        parser.error(f"{flag}: choose from {','.join(allowed)} (got {value!r})")
    return items


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); ``argv`` kept as ``args.argv``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--modes", "--mode", default="steady,bulk", help="comma-separated: steady,bulk,parked"
    )
    parser.add_argument("--designs", default="waits,poll", help="comma-separated: waits,poll")
    parser.add_argument("--n", type=int, default=1000, help="children (and parents)")
    parser.add_argument(
        "--parked-n", type=int, default=None, help="children of the parked mode (default: --n)"
    )
    parser.add_argument("--rate", type=float, default=20.0, help="steady: parents enqueued per s")
    parser.add_argument("--poll-seconds", type=float, default=5.0, help="poll design's interval")
    parser.add_argument("--watch-ms", type=float, default=20.0, help="watcher interval (ms)")
    parser.add_argument("--idle", type=float, default=60.0, help="parked: idle seconds measured")
    parser.add_argument(
        "--idle-after", type=float, default=70.0, help="parked: seconds parked before the idle"
    )
    parser.add_argument(
        "--phase-timeout", type=float, default=900.0, help="seconds per phase (park, wake)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="waits design: seconds to wait for the woken waits to complete at the end",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each mode and design in a row, each on a fresh database (a series)",
    )
    parser.add_argument("--backends", default=None, help="sqlite,mysql (mysql needs --mysql-url)")
    parser.add_argument("--mysql-url")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.modes = _csv(args.modes, MODES, "--modes", parser)
    args.designs = _csv(args.designs, DESIGNS, "--designs", parser)
    default_backends = "sqlite,mysql" if args.mysql_url else "sqlite"
    args.backends = _csv(args.backends or default_backends, BACKENDS, "--backends", parser)
    if "mysql" in args.backends and not args.mysql_url:
        parser.error("--backends mysql needs --mysql-url")
    if args.parked_n is None:
        args.parked_n = args.n
    if (
        args.n < 1
        or args.parked_n < 1
        or args.rate <= 0
        or args.poll_seconds <= 0
        or args.watch_ms <= 0
        or args.repeat < 1
    ):
        parser.error(
            "--n, --parked-n, --rate, --poll-seconds, --watch-ms and --repeat must be positive"
        )
    return args


ServerFactory = Callable[[argparse.Namespace], AbstractAsyncContextManager[WorkflowEnvironment]]
"""Starts (and on exit stops) the Temporal server of one run: :func:`dev_server`."""


@contextlib.asynccontextmanager
async def dev_server(args: argparse.Namespace) -> AsyncIterator[WorkflowEnvironment]:
    """A fresh local dev server (in memory, the project's search attributes) with a
    Prometheus port, whose ``/metrics`` URL is set as ``args.server_metrics_url``
    for the idle window's request counters; shut down on exit."""
    metrics_port = free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
        dev_server_extra_args=["--metrics-port", str(metrics_port)],
    )
    args.server_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        yield env
    finally:
        await env.shutdown()


async def run(
    env: WorkflowEnvironment | None,
    args: argparse.Namespace,
    fresh_server: ServerFactory | None = None,
) -> dict[str, Any]:
    """Every backend, mode and design; prints, writes and returns the JSON.

    Each run on ``env``, or, with ``fresh_server`` (:func:`dev_server`), on a
    server of its own started for it and stopped after it; each run's
    ``server`` is the address it ran on. Raises ``ValueError`` when given
    neither."""
    if env is None and fresh_server is None:
        raise ValueError("run needs a Temporal environment or a server factory")
    settings = {
        "n": args.n,
        "parked_n": args.parked_n,
        "rate": args.rate,
        "poll_seconds": args.poll_seconds,
        "watch_ms": args.watch_ms,
        "idle": args.idle,
        "idle_after": args.idle_after,
        "settle": args.settle,
        "repeat": args.repeat,
        "modes": args.modes,
        "designs": args.designs,
    }
    result: dict[str, Any] = {
        "bench": "identity",
        "command": " ".join(["python", "bench/bench_identity.py", *args.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": settings,
        "targets": TARGETS,
        "backends": {},
        "verdicts": {},
    }
    print(f"command: {result['command']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            runs: dict[str, dict[str, Any]] = {}
            for mode in args.modes:
                for design in args.designs:
                    series: list[dict[str, Any]] = []
                    for _ in range(args.repeat):
                        if fresh_server is not None:
                            async with fresh_server(args) as own:
                                r = await timed_run(own, args, backend, mode, design, tmp, result)
                                r["server"] = own.client.service_client.config.target_host
                        else:
                            assert env is not None
                            r = await timed_run(env, args, backend, mode, design, tmp, result)
                            r["server"] = env.client.service_client.config.target_host
                        series.append(r)
                        print(describe(backend, mode, design, r), flush=True)
                    r = series[0]
                    if args.repeat > 1:
                        r["series"] = [series_entry(x) for x in series]
                        print(describe_series(r["series"]), flush=True)
                    runs.setdefault(mode, {})[design] = r
                    if r.get("waits_running_at_done"):
                        print(
                            f"  {r['waits_running_at_done']} IdentityWait workflows ran when the "
                            f"last child was done; none after {r['waits_done_after_s']} s "
                            f"({r['waits_left_running']} left after the {args.settle:g} s cap)",
                            flush=True,
                        )
                    if r.get("left_blocked_linked"):
                        print(
                            f"  !! {r['left_blocked_linked']} children left blocked although "
                            "their parent's link exists (lost wake)",
                            flush=True,
                        )
            result["backends"][backend] = runs
            result["verdicts"][backend] = verdicts(runs)
            if result["verdicts"][backend]:
                print(f"{backend} waits vs targets: {result['verdicts'][backend]}", flush=True)
    result["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result["previous"] = compare_with_previous(args.out, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}", flush=True)
    return result


async def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """:func:`run`, each run on a fresh local dev server (:func:`dev_server`)."""
    args = parse_args(argv)
    configure_logging("json", "ERROR")
    return await run(None, args, fresh_server=dev_server)


if __name__ == "__main__":
    asyncio.run(main())
