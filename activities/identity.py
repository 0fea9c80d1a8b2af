"""Identity-convergence activities: probe, expire, wake, register waits, recover.

The probe is the seed's ``resolveIdentityConvergenceBounded``: at most one
probe at a time per worker process (a semaphore shared by every instance),
bounded by the probe timeout. The resolver runs in a thread of its own; a
resolver that raises or hangs fails the activity (the wait reschedules), a
result that arrives after the deadline is not a fresh owner fact and is
discarded, and a hung resolver keeps the slot until it returns (later probes
time out waiting for it, never expire anything).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from temporalio import activity
from temporalio.api.workflowservice.v1 import ListWorkflowExecutionsRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.common import BatchLoad, quiet_lock_conflicts, shielded
from activities.metrics import NexusMetrics
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import (
    Dependency,
    from_spec,
    probe,
    resolved_blocked_keys,
    resolved_keys,
    to_spec,
    wait_workflow_id,
)
from nexuscrm.contracts import (
    DependencySpec,
    ExpireRequest,
    IdentityWaitConfig,
    IdentityWaitInput,
    ProbeRequest,
    ProbeResult,
    WaitItem,
    WaitNotifyRequest,
    WakeResult,
)
from nexuscrm.db.dialect import is_transient
from nexuscrm.log import log
from nexuscrm.settings import Settings

Resolver = Callable[[Engine, Dependency], bool]

ENV_PREFIX = "NEXUSCRM_CONNECTOR_IDENTITY_"

PROBE_FAILED = "identity convergence resolver failed"
PROBE_TIMED_OUT = "identity convergence probe timed out"

DIRECT_WAKE_ATTEMPTS = 8
"""In-place attempts of a notify's direct wake (lock conflicts: deadlock, busy)."""

SIGNAL_CONCURRENCY = 32
"""Signals (wakes, signal-with-starts) one notify keeps in flight at once."""

CLOSE_CONCURRENCY = 4
"""``wake`` signals the background closer of a worker process keeps in flight at
once: waits whose items a direct write already woke (see :meth:`IdentityActivities.notify`)."""

CLOSE_PAUSE_BUSY_S = 0.2
"""While inbound batches run in the process, the closer sends one ``wake`` at a
time, this long apart (at most 5 a second): completing a wait costs the
server a signal, a workflow task and the close, the same CPU the woken
children's batches need (issue 16: 3,000 waits woken at once took 13.1 s with
the closes at full pace, 6.8 s without them)."""

CLOSE_MAX_DEFER_S = 60.0
"""Longest a woken wait's completion waits for the process's batches: older
ones are signalled at full pace, so under a load that never ends the waits
left running stay about a minute's worth, not a growing backlog."""


def config_from_env(env: Mapping[str, str] = os.environ) -> IdentityWaitConfig:
    """``IdentityWaitConfig`` with ``NEXUSCRM_CONNECTOR_IDENTITY_*`` overrides (seconds).

    MAX_WAIT_SECONDS (1800; ``<= 0`` disables expiry), PROBE_INTERVAL_SECONDS
    (5), MAX_PROBE_INTERVAL_SECONDS (60), PROBE_TIMEOUT_SECONDS (5). An
    unparsable or non-finite value keeps the default (logged, as the seed's
    knobs do); a non-positive probe interval or timeout keeps the default.
    """
    cfg = IdentityWaitConfig()
    for name, attr in (
        ("MAX_WAIT_SECONDS", "max_wait_seconds"),
        ("PROBE_INTERVAL_SECONDS", "probe_interval_seconds"),
        ("MAX_PROBE_INTERVAL_SECONDS", "max_probe_interval_seconds"),
        ("PROBE_TIMEOUT_SECONDS", "probe_timeout_seconds"),
    ):
        raw = env.get(ENV_PREFIX + name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):  # inf overflows the timers; nan would disable expiry
            log.warning("identity wait setting ignored", name=ENV_PREFIX + name, value=raw)
            continue
        setattr(cfg, attr, value)
    if cfg.probe_timeout_seconds <= 0:
        cfg.probe_timeout_seconds = IdentityWaitConfig.probe_timeout_seconds
    if cfg.probe_interval_seconds <= 0:
        cfg.probe_interval_seconds = IdentityWaitConfig.probe_interval_seconds
    return cfg


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value else ""


def _naive(iso: str) -> datetime:
    value = datetime.fromisoformat(iso)
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value


async def start_wait(
    client: Client,
    *,
    database_id: str,
    task_queue: str,
    dependency: Dependency,
    work_ids: list[str],
    config: IdentityWaitConfig,
    probe_now: bool = False,
) -> None:
    """Signal-with-start the wait of ``dependency`` with ``register(work_ids)`` (idempotent).

    ``probe_now``: also ask it to probe at once (``register`` without items),
    for items whose block may be old (recovery): a parked wait otherwise
    probes first at its registration plus the max wait.
    """
    key = dependency.key_hash
    handle = await client.start_workflow(
        "IdentityWait",
        IdentityWaitInput(
            database_id=database_id,
            key_hash=key,
            dependency=to_spec(dependency),
            config=config,
        ),
        id=wait_workflow_id(database_id, key),
        task_queue=task_queue,
        start_signal="register",
        start_signal_args=[sorted(work_ids)],
    )
    if probe_now:
        await handle.signal("register")


async def signal_wake(client: Client, database_id: str, key_hash: str) -> bool:
    """Signal ``wake`` to the wait of ``key_hash``; False when no wait runs."""
    try:
        await client.get_workflow_handle(wait_workflow_id(database_id, key_hash)).signal("wake")
    except RPCError:
        return False
    return True


RECOVERY_RECHECK = timedelta(minutes=5)
"""How long recovery trusts the server's "this wait runs" before asking again."""

LIST_THRESHOLD = 50
"""Keys from which recovery lists the running waits instead of describing each."""


def _running_query(database_id: str) -> str | None:
    if not database_id or any(c in database_id for c in "'\\\"\n"):
        return None
    return (
        "WorkflowType='IdentityWait' AND ExecutionStatus='Running' "
        f"AND NexusDatabase='{database_id}'"
    )


def _page_after(rows: list[wq.BlockedRow]) -> tuple[datetime, str] | None:
    """Keyset position (``DependencyBlockedAt``, ``WorkId``) after a full page of
    blocked rows; ``None`` after a short page (the last)."""
    if len(rows) < wq.RECOVERY_PAGE:
        return None
    last = rows[-1]
    assert last.blocked_at is not None
    return (last.blocked_at, last.work_id)


async def list_running_waits(client: Client, database_id: str) -> set[str] | None:
    """Key hashes of the database's running ``IdentityWait`` workflows (server visibility).

    One paged list by the search attribute ``NexusDatabase``; ``None`` when the
    server cannot answer it (attribute not registered, visibility error) or
    the database id cannot be quoted in a query.
    """
    query = _running_query(database_id)
    if query is None:
        return None
    prefix = wait_workflow_id(database_id, "")
    out: set[str] = set()
    # The raw list, workflow ids only: the client's list decodes every
    # execution's memo and search attributes, which for 10,000 waits took as
    # much of the worker's CPU as the inbound batches (issue 16).
    token = b""
    try:
        while True:
            page = await client.workflow_service.list_workflow_executions(
                ListWorkflowExecutionsRequest(
                    namespace=client.namespace, query=query, page_size=1000, next_page_token=token
                )
            )
            for info in page.executions:
                wid = info.execution.workflow_id
                if wid.startswith(prefix):
                    out.add(wid[len(prefix) :])
            token = page.next_page_token
            if not token:
                break
    except RPCError as err:
        log.info("running identity waits not listed", error=str(err))
        return None
    return out


async def running_waits(
    client: Client, database_id: str, key_hashes: list[str], listed: set[str] | None = None
) -> set[str]:
    """The key hashes among ``key_hashes`` whose ``IdentityWait`` runs, asked of the server.

    ``listed``: the answer of :func:`list_running_waits` (trusted as is); a
    key not in it (visibility lags a start; waits without search attributes)
    is asked by ``describe`` (at most :data:`SIGNAL_CONCURRENCY` at once). A
    key whose describe fails counts as not running (recovery starts it:
    signal-with-start is idempotent). Reads only: no history event.
    """
    wanted = set(key_hashes)
    running = wanted & (listed or set())
    gate = asyncio.Semaphore(SIGNAL_CONCURRENCY)

    async def describe(key: str) -> None:
        async with gate:
            try:
                desc = await client.get_workflow_handle(
                    wait_workflow_id(database_id, key)
                ).describe()
            except RPCError:
                return
            if desc.status == WorkflowExecutionStatus.RUNNING:
                running.add(key)

    await asyncio.gather(*(describe(k) for k in sorted(wanted - running)))
    return running


class IdentityActivities:
    """Identity-wait activities of one database.

    ``resolver(engine, dependency) -> converged`` is the owner read
    (:func:`nexuscrm.connectors.identity.probe` by default; tests swap it;
    ``None`` is the seed's missing resolver: probes fail, nothing expires).
    """

    _probe_slot = threading.Semaphore(1)  # one probe at a time per worker process
    # Post-commit wake of a finalized link's waiters by one UPDATE (the wait
    # then only completes). False reproduces the polled design for benchmarks.
    direct_wake = True

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        config: IdentityWaitConfig | None = None,
        resolver: Resolver | None = probe,
        metrics: NexusMetrics | None = None,
        load: BatchLoad | None = None,
    ) -> None:
        self.engine = engine
        # The process's inbound batches: the closer yields to them (see _drain_closes).
        self.load = load or BatchLoad()
        # The nexus_* metrics (no-op without a metrics endpoint).
        self.metrics = metrics or NexusMetrics(MetricMeter.noop)
        self.settings = settings
        self.config = config or config_from_env()
        # Monotonic time of the last orphan-wait sweep per database (this process),
        # and the waits that sweep found without blocked items (asked at the next).
        self._last_sweep: dict[str, float] = {}
        self._sweep_candidates: dict[str, set[str]] = {}
        # Waits to complete in the background (database id -> key hashes), and
        # the task signalling them (see _close_later).
        self._to_close: dict[str, dict[str, float]] = {}  # key -> monotonic time queued
        # Pace of closes while batches run, and how long one may wait for them.
        self.close_pause_busy_s = CLOSE_PAUSE_BUSY_S
        self.close_max_defer_s = CLOSE_MAX_DEFER_S
        self._closer: asyncio.Task[None] | None = None
        # None: no owner authority (the seed's nil resolver): every probe fails,
        # so waits only reschedule and nothing ever expires; wakes still work.
        self.resolver: Resolver | None = resolver

    # -- probe -----------------------------------------------------------------

    def _resolve_bounded(self, dep: Dependency, timeout: float) -> bool:
        resolver = self.resolver
        if resolver is None:
            raise LookupError("no identity convergence resolver is configured")
        deadline = time.monotonic() + timeout
        if not self._probe_slot.acquire(timeout=timeout):
            raise TimeoutError(PROBE_TIMED_OUT)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["result"] = bool(resolver(self.engine, dep))
            except BaseException as exc:  # a resolver error is a retry, never the process
                outcome["error"] = exc
            finally:
                self._probe_slot.release()
                done.set()

        threading.Thread(target=run, name="identity-probe", daemon=True).start()
        finished = done.wait(max(0.0, deadline - time.monotonic()))
        # The deadline wins over a result that arrives with it: not a fresh fact.
        if not finished or time.monotonic() > deadline:
            raise TimeoutError(PROBE_TIMED_OUT)
        if "error" in outcome:
            # The seed's errConnectorInboundIdentityProbePanic: the resolver is host
            # code and its error may hold host data, so none of it travels on.
            raise RuntimeError(PROBE_FAILED)
        return bool(outcome["result"])

    @activity.defn(name="identity.probe")
    @shielded
    def probe(self, req: ProbeRequest) -> ProbeResult:
        """Terminalize invalid registered items, then probe.

        Invalid (``identity-convergence-invalid``): a row whose own dependency
        columns were lost. The wait's items are the blocked rows whose
        dependency is this wait's; a registered item blocked on another
        dependency is left alone (its own wait owns it). The probe is bounded
        by ``req.timeout_seconds``; raises (the wait reschedules) when it fails
        or times out.
        """
        rows = wq.blocked_rows(self.engine, req.key_hash, req.work_ids)
        # Invalid only when the row's own dependency columns were lost (the
        # seed's rule). A registered item now blocked on another dependency (it
        # was woken from this wait and blocked again on its next lookup) is not
        # this wait's any more: left alone, its own wait owns it.
        invalid = [
            r.work_id
            for r in rows
            if r.dependency is None or r.key_hash is None or r.blocked_at is None
        ]
        ours = [
            r
            for r in rows
            if r.work_id not in invalid
            and r.dependency is not None
            and r.dependency.key_hash == req.key_hash
        ]
        n_invalid = wq.terminalize_invalid(self.engine, invalid) if invalid else 0
        if n_invalid:
            log.warning(
                "invalid identity convergence wait terminalized",
                dependency_key_hash=req.key_hash,
                items=n_invalid,
                failure_class="identity-convergence-invalid",
            )
        # No liveness write here (issue 16): recovery asks the server which waits
        # run; ``req.alive_until`` is kept on the wire for recorded histories.
        items = [WaitItem(r.work_id, r.installed_pack_id, _iso(r.blocked_at)) for r in ours]
        try:
            converged = self._resolve_bounded(from_spec(req.dependency), req.timeout_seconds)
        except Exception as exc:
            # Resolver errors may carry selectors: log the fixed class and the hash only.
            message, kind, failure_class = (
                (PROBE_TIMED_OUT, "IdentityProbeTimeout", "probe_timeout")
                if isinstance(exc, TimeoutError)
                else (PROBE_FAILED, "IdentityProbeFailed", "resolver_error")
            )
            log.warning(message, dependency_key_hash=req.key_hash, failure_class=failure_class)
            raise ApplicationError(message, type=kind, non_retryable=True) from None
        return ProbeResult(converged=converged, items=items, invalid=n_invalid)

    @activity.defn(name="identity.expire")
    @shielded
    def expire(self, req: ExpireRequest) -> int:
        """Expire the due items (the wait probed unresolved just before)."""
        n = wq.expire_blocked(
            self.engine, req.work_ids, _naive(req.now).replace(microsecond=0), key_hash=req.key_hash
        )
        if n:
            log.warning(
                "unresolved identity convergence wait expired after fresh owner read",
                dependency_key_hash=req.key_hash,
                items=n,
                failure_class="identity-convergence-expired",
            )
        return n

    @activity.defn(name="identity.wake")
    @shielded
    def wake(self, key_hash: str) -> WakeResult:
        """Blocked items of ``key_hash`` -> pending; the packs to wake."""
        by_pack = wq.wake_blocked_by_pack(
            self.engine, key_hash, on_woken=self.metrics.woken_hook("wait")
        )
        return WakeResult(sum(by_pack.values()), sorted(by_pack))

    # -- registration and recovery (async: they use the worker's client) -------

    async def _wake_keys(self, keys: list[str], path: str = "notify") -> dict[str, int]:
        """:func:`wq.wake_blocked_keys`, a lock conflict retried in place (issue 16).

        ``path``: who wakes, for ``nexus_identity_wake_latency_seconds``
        (``notify`` or ``recovery``).

        This write is the wake that cannot be lost: a signal to a wait that is
        not registered yet reaches nobody. Raises the last error after
        :data:`DIRECT_WAKE_ATTEMPTS` (the activity is retried).
        """
        for attempt in range(1, DIRECT_WAKE_ATTEMPTS + 1):
            try:
                return await asyncio.to_thread(
                    functools.partial(
                        wq.wake_blocked_keys,
                        self.engine,
                        keys,
                        on_woken=self.metrics.woken_hook(path),
                    )
                )
            except Exception as exc:
                if attempt == DIRECT_WAKE_ATTEMPTS or not is_transient(exc):
                    raise
                activity.heartbeat()
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    @activity.defn(name="identity.notify")
    @quiet_lock_conflicts
    async def notify(self, req: WaitNotifyRequest) -> None:
        """After a batch committed: wake the waiters of its new links, register its blocked items.

        Order matters for latency: the woken rows go pending and their pools are
        woken first, then the new waits are registered (concurrently, at most
        :data:`SIGNAL_CONCURRENCY` at once); the woken waits are completed in
        the background (:meth:`_close_later`), never holding the batch. The
        direct wake is what no race can lose (a signal to a wait not yet
        registered reaches nobody): it is retried in place on a lock conflict,
        and a blocked item of this batch whose key it woke needs no wait. A
        wait registered here whose items another batch woke meanwhile is
        completed at once (:meth:`_close_unblocked`), never left parked.
        """
        client = activity.client()
        packs: set[str] = set()
        woke_directly = False
        if self.direct_wake and req.wake_keys:
            # The links are committed: their waiters go back to pending right here,
            # in one transaction, not a wait's probe-and-wake round trip each.
            packs.update(await self._wake_keys(req.wake_keys))
            woke_directly = True
        fleet = client.get_workflow_handle(f"connector-fleet/{req.database_id}")
        for install_id in sorted(packs):
            try:
                await fleet.signal("wake", install_id)
            except RPCError:  # no fleet running: the workers' idle timers find the work
                break
        gate = asyncio.Semaphore(SIGNAL_CONCURRENCY)

        async def wake_one(key: str) -> None:
            async with gate:
                if not await signal_wake(client, req.database_id, key):
                    # No wait runs: its rows were woken by the write above (or, with
                    # the direct wake off, its start is in flight: it probes at once).
                    log.info("wake of identity wait skipped: none runs", dependency_key_hash=key)

        groups: dict[str, tuple[DependencySpec, list[str]]] = {}
        woken_keys = set(req.wake_keys) if woke_directly else set()
        for b in req.blocked:
            if b.key_hash not in woken_keys:  # woken above: pending already, no wait needed
                groups.setdefault(b.key_hash, (b.dependency, []))[1].append(b.work_id)

        async def register(spec: DependencySpec, work_ids: list[str]) -> None:
            async with gate:
                await start_wait(
                    client,
                    database_id=req.database_id,
                    task_queue=self.settings.identity_task_queue,
                    dependency=from_spec(spec),
                    work_ids=work_ids,
                    config=self.config,
                )

        if woke_directly:
            # Their items are pending already: the waits only have to complete,
            # and that must not hold this batch's worker back (issue 16).
            self._close_later(client, req.database_id, req.wake_keys)
            await asyncio.gather(*(register(spec, ids) for spec, ids in groups.values()))
            await self._close_unblocked(client, req.database_id, sorted(groups))
            return
        # Not woken here: every wait must run before its wake is signalled, or a
        # wait started just after the signal would miss it (issue 16).
        await asyncio.gather(*(register(spec, ids) for spec, ids in groups.values()))
        await asyncio.gather(*(wake_one(key) for key in req.wake_keys))
        await self._close_unblocked(client, req.database_id, sorted(groups))

    def _close_later(self, client: Client, database_id: str, keys: list[str]) -> None:
        """Signal ``wake`` to the waits of ``keys`` in the background, not awaited.

        For waits whose items a direct write already woke: their wake is done,
        only the workflow's completion is left. A wake of ten thousand sent
        from the notifies themselves held each parent batch's worker behind
        its signals, while the children it had woken waited for the same two
        cores (issue 16). One task per process drains the keys,
        :data:`CLOSE_CONCURRENCY` signals at a time, or one every
        :data:`CLOSE_PAUSE_BUSY_S` while the process runs inbound batches
        (:class:`~activities.common.BatchLoad`) and the key was queued less
        than :data:`CLOSE_MAX_DEFER_S` ago: the children finish first, the
        bookkeeping after. A key queued twice is signalled once. A key lost
        with the process leaves its wait running without blocked items:
        recovery's sweep asks it to probe and it ends.
        """
        queued = self._to_close.setdefault(database_id, {})
        now = time.monotonic()
        for key in keys:
            queued.setdefault(key, now)
        if self._closer is None or self._closer.done():
            self._closer = asyncio.get_running_loop().create_task(self._drain_closes(client))

    async def _drain_closes(self, client: Client) -> None:
        gate = asyncio.Semaphore(CLOSE_CONCURRENCY)
        next_slot = 0.0  # monotonic time of the next paced close
        missing = 0

        async def close(database_id: str, key: str, queued_at: float) -> None:
            nonlocal next_slot
            async with gate:
                # While batches run, one close per CLOSE_PAUSE_BUSY_S, unless this
                # one has waited close_max_defer_s already (a backlog stays bounded).
                while self.load.busy() and time.monotonic() - queued_at < self.close_max_defer_s:
                    now = time.monotonic()
                    if now >= next_slot:
                        next_slot = now + self.close_pause_busy_s
                        break
                    await asyncio.sleep(min(next_slot - now, 0.1))  # busy and age move
                await signal(database_id, key)

        async def signal(database_id: str, key: str) -> None:
            nonlocal missing
            try:
                if not await signal_wake(client, database_id, key):
                    missing += 1  # it ended, or never ran: its rows are woken
            except Exception as err:  # the client closed with the worker
                log.info("identity wait not completed; recovery's sweep will", error=str(err))

        while self._to_close:
            database_id, keys = self._to_close.popitem()
            await asyncio.gather(*(close(database_id, k, at) for k, at in sorted(keys.items())))
        if missing:
            log.info("wake of identity waits skipped: none runs", waits=missing)

    async def _close_unblocked(self, client: Client, database_id: str, keys: list[str]) -> int:
        """Wake the just-registered waits none of whose items is blocked any more.

        The race this closes (a wait left parked until its max wait): this
        batch's item blocks and re-reads "no link"; the parent's batch links,
        wakes the item by its direct write and signals a wait that is not
        registered yet (nobody hears it); then this notify registers the
        wait. Read after the registrations, so whichever comes last sees the
        other: either the parent's signal finds the wait, or this read finds
        the item already woken and the wait is handed to the closer
        (:meth:`_close_later`; it wakes nothing and completes). One indexed
        read; returns the waits handed over.
        """
        if not keys:
            return 0
        still = await asyncio.to_thread(wq.blocked_keys, self.engine, keys)
        gone = [k for k in keys if k not in still]
        self._close_later(client, database_id, gone)
        if gone:
            log.info("identity waits registered after their items woke, completed", waits=len(gone))
        return len(gone)

    async def _wake_resolved(self, client: Client, database_id: str) -> int:
        """Wake every blocked item whose dependency exists now; complete their waits.

        The set-based recheck that replaces each parked wait's own probes
        (issue 16): one read for all blocked rows (:func:`resolved_blocked_keys`),
        then one wake write, the fleet's ``wake`` for the packs woken, and a
        background ``wake`` signal to the wait of each resolved key only
        (:meth:`_close_later`). Returns the number of keys resolved.
        """
        keys = sorted(await asyncio.to_thread(resolved_blocked_keys, self.engine))
        if not keys:
            return 0
        packs = await self._wake_keys(keys, path="recovery")
        fleet = client.get_workflow_handle(f"connector-fleet/{database_id}")
        for install_id in sorted(packs):
            try:
                await fleet.signal("wake", install_id)
            except RPCError:  # no fleet: the workers' idle timers find the work
                break
        self._close_later(client, database_id, keys)
        log.info(
            "identity recovery woke resolved rows",
            dependency_keys=len(keys),
            items=sum(packs.values()),
        )
        return len(keys)

    async def _sweep_orphan_waits(self, client: Client, database_id: str) -> int:
        """Ask a probe of each running wait none of whose items has been blocked
        for two sweeps in a row.

        A wait whose items were woken directly and whose ``wake`` signal was
        lost (the batch died before its notify) would stay parked until its
        first due time; its probe now finds no item and it ends ``empty``. At
        most once per ``max_probe_interval_seconds`` per database and process;
        the server's count of running waits is read first and the waits are
        listed (ids only) only when it exceeds the blocked keys. A wait is
        asked only when the previous sweep found it without blocked items
        too: during a wake of thousands, their ``wake`` signals are merely on
        their way, and a probe each would double the work (issue 16).
        Returns waits asked.
        """
        now = time.monotonic()
        last = self._last_sweep.get(database_id)
        if last is not None and now - last < max(1.0, self.config.max_probe_interval_seconds):
            return 0
        self._last_sweep[database_id] = now
        query = _running_query(database_id)
        if query is None:
            return 0
        blocked = await asyncio.to_thread(wq.blocked_key_set, self.engine)
        try:
            count = (await client.count_workflows(query)).count
        except RPCError:
            return 0
        if count <= len(blocked):
            self._sweep_candidates.pop(database_id, None)
            return 0
        running = await list_running_waits(client, database_id)
        found = (running or set()) - blocked
        orphans = sorted(found & self._sweep_candidates.get(database_id, set()))
        self._sweep_candidates[database_id] = found - set(orphans)
        gate = asyncio.Semaphore(SIGNAL_CONCURRENCY)

        async def ask(key: str) -> None:
            async with gate:
                with contextlib.suppress(RPCError):  # it ended meanwhile
                    await client.get_workflow_handle(wait_workflow_id(database_id, key)).signal(
                        "register"
                    )

        await asyncio.gather(*(ask(key) for key in orphans))
        if orphans:
            log.info("identity waits without blocked items asked to probe", waits=len(orphans))
        return len(orphans)

    def _waitless_page(self, after: tuple[datetime, str] | None) -> list[wq.BlockedRow]:
        return wq.list_waitless_blocked(self.engine, after=after)

    @activity.defn(name="identity.recover")
    @quiet_lock_conflicts
    async def recover(self, database_id: str) -> int:
        """Give every blocked row without a live wait its wait; returns waits (re)started.

        Converts the seed's parked-processing rows to ``blocked`` and
        terminalizes invalid blocked rows first, then wakes every blocked row
        whose dependency resolved (:meth:`_wake_resolved`, the recheck parked
        waits rely on). Pages of 1000, at most 100.
        """
        if self.settings.connector_role == "handoff":
            # The Runtime owns the dependencies of handed-off work (issue 5 rule 9),
            # whatever the starter of the fleet asked for.
            log.info("identity recovery skipped: connector role is handoff")
            return 0
        client = activity.client()
        queue = self.settings.identity_task_queue
        await asyncio.to_thread(wq.convert_parked, self.engine)
        invalid = await asyncio.to_thread(wq.list_invalid_blocked, self.engine)
        if invalid:
            n = await asyncio.to_thread(wq.terminalize_invalid, self.engine, invalid)
            log.warning(
                "invalid identity convergence waits terminalized",
                items=n,
                failure_class="identity-convergence-invalid",
            )
        # Every blocked row whose dependency resolved without a wake (an owner
        # written outside this runtime, a wake lost with its batch) goes back
        # to pending here, once per reconcile: the parked waits never poll.
        await self._wake_resolved(client, database_id)
        await self._sweep_orphan_waits(client, database_id)
        started = 0
        after: tuple[datetime, str] | None = None
        listed: set[str] | None = None  # the server's running waits, listed once per run
        for _page in range(wq.RECOVERY_MAX_PAGES):
            rows = await asyncio.to_thread(self._waitless_page, after)
            groups: dict[str, tuple[Dependency, list[str]]] = {}
            bad: list[str] = []
            for r in rows:
                if r.dependency is None:
                    bad.append(r.work_id)
                    continue
                groups.setdefault(r.dependency.key_hash, (r.dependency, []))[1].append(r.work_id)
            if bad:
                await asyncio.to_thread(wq.terminalize_invalid, self.engine, bad)
            # A wait that runs is never signal-with-started again (issue 16): its
            # rows are only marked so that recovery asks again after the recheck.
            if listed is None and len(groups) >= LIST_THRESHOLD:
                listed = await list_running_waits(client, database_id) or set()
            live = await running_waits(client, database_id, sorted(groups), listed)
            if live:
                until = datetime.now(UTC).replace(tzinfo=None) + RECOVERY_RECHECK
                marks = {w: key for key in live for w in groups.pop(key)[1]}
                await asyncio.to_thread(wq.mark_waits_alive, self.engine, marks, until)
            # A row whose dependency resolved while nobody waited (its batch died
            # between its block and its notify, after the parent's wake had read
            # the blocked rows) is woken here (a database read per dependency, one write),
            # not handed to a wait whose probes may be starved (issue 16).
            resolved = await asyncio.to_thread(
                resolved_keys, self.engine, [dep for dep, _ in groups.values()]
            )
            if resolved:
                await self._wake_keys(sorted(resolved), path="recovery")
                for key in resolved:
                    groups.pop(key, None)
                log.info("identity recovery woke resolved rows", dependency_keys=len(resolved))
            for dep, work_ids in groups.values():
                await start_wait(
                    client,
                    database_id=database_id,
                    task_queue=queue,
                    dependency=dep,
                    work_ids=work_ids,
                    config=self.config,
                    probe_now=True,
                )
                started += 1
            after = _page_after(rows)
            if after is None:
                break
            # Only before a further page: a pass of one page (the idle fleet's, every
            # 5 s) sends no heartbeat, which would be a server call per pass.
            activity.heartbeat()
        else:
            log.warning(
                "identity convergence recovery stopped at its page bound",
                pages=wq.RECOVERY_MAX_PAGES,
            )
        if listed:
            await self._mark_listed_alive(listed)
        if started:
            log.info("identity waits recovered", waits=started)
        return started

    async def _mark_listed_alive(self, listed: set[str]) -> int:
        """After a full list of the running waits: mark *every* blocked row of a
        listed wait alive until the recheck, not only the rows whose mark had
        expired.

        Rows block one batch after another, so their marks expire one reconcile
        after another; each expiry of 50 keys or more lists every running wait
        again (10 pages for 10,000 waits, a namespace lookup per listed wait on
        the server: most of the dev server's idle CPU with 10,000 parked, issue
        16). Marked together, they are listed again together, once per
        :data:`RECOVERY_RECHECK`. Pages by primary key, as the recheck does.
        Returns the rows marked.
        """
        until = datetime.now(UTC).replace(tzinfo=None) + RECOVERY_RECHECK
        marked = 0
        after: tuple[datetime, str] | None = None
        for _page in range(wq.RECOVERY_MAX_PAGES):
            rows = await asyncio.to_thread(
                functools.partial(wq.list_waitless_blocked, self.engine, after=after, now=until)
            )
            marks = {r.work_id: r.key_hash for r in rows if r.key_hash in listed and r.dependency}
            marked += await asyncio.to_thread(wq.mark_waits_alive, self.engine, marks, until)
            activity.heartbeat()
            after = _page_after(rows)
            if after is None:
                break
        return marked

    def wait_activities(self) -> list[Callable[..., Any]]:
        """The activities an IdentityWait runs (probe; wake and expire as local activities)."""
        return [self.probe, self.expire, self.wake]

    def all(self) -> list[Callable[..., Any]]:
        """Every activity method, for ``Worker(activities=...)``."""
        return [*self.wait_activities(), self.notify, self.recover]
