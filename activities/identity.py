"""Identity-convergence activities: probe, expire, wake, register waits, recover.

The probe is the seed's ``resolveIdentityConvergenceBounded``: at most one
probe at a time per worker process (a semaphore shared by every instance),
bounded by the probe timeout. The resolver runs in a thread of its own; a
resolver that raises or hangs fails the activity (the wait reschedules), a
result that arrives after the deadline is not a fresh owner fact and is
discarded, and a hung resolver keeps the slot until it returns (later probes
time out waiting for it, never expire anything).

The fleet's recovery (``identity.recover``) is the mixin
:class:`activities.identity_recovery.IdentityRecovery`; the client side of the
waits (signal-with-start, ``wake``, which waits run) is
:mod:`activities.identity_client`.
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
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from temporalio import activity
from temporalio.client import Client
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities import identity_client
from activities.common import BatchLoad, quiet_lock_conflicts, shielded
from activities.identity_client import (  # re-exported: the waits' client side
    SIGNAL_CONCURRENCY,
)
from activities.identity_recovery import IdentityRecovery
from activities.metrics import NexusMetrics
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import (
    Dependency,
    from_spec,
    probe,
)
from nexuscrm.contracts import (
    DependencySpec,
    ExpireRequest,
    IdentityWaitConfig,
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
CLOSER_STOP_GRACE_S = 5.0
"""Seconds a stopping worker gives the background closer before it cancels it."""
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


class IdentityActivities(IdentityRecovery):
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
        # Monotonic time of the last full list of the running waits per database.
        self._last_full_list: dict[str, float] = {}
        # Waits to complete in the background (database id -> key hashes), and
        # the task signalling them (see _close_later).
        self._to_close: dict[str, dict[str, float]] = {}  # key -> monotonic time queued
        # Pace of closes while batches run, and how long one may wait for them.
        self.close_pause_busy_s = CLOSE_PAUSE_BUSY_S
        self.close_max_defer_s = CLOSE_MAX_DEFER_S
        self._closer: asyncio.Task[None] | None = None
        self._closing: set[tuple[str, str]] = set()  # taken by the closer, not signalled yet
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
                if not await identity_client.signal_wake(client, req.database_id, key):
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
                await identity_client.start_wait(
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

    async def stop_closer(self, grace_s: float = CLOSER_STOP_GRACE_S) -> int:
        """The worker stops: let the background closer (:meth:`_close_later`) finish
        for up to ``grace_s`` seconds, then cancel it and drop what it had queued.
        Returns the waits left unsignalled: each still runs without blocked items,
        and recovery's sweep asks it to probe and it ends, as for a key lost with
        the process. Without this the closer outlived its worker in a process that
        goes on (a bench's next run, a test), retrying signals to a server that
        may be gone. Never raises."""
        task = self._closer
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), grace_s)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        left = sum(len(keys) for keys in self._to_close.values()) + len(self._closing)
        self._to_close.clear()
        self._closing.clear()
        self._closer = None
        if left:
            log.info("identity waits not signalled at shutdown; recovery's sweep will", waits=left)
        return left

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
                self._closing.discard((database_id, key))

        async def signal(database_id: str, key: str) -> None:
            nonlocal missing
            try:
                if not await identity_client.signal_wake(client, database_id, key):
                    missing += 1  # it ended, or never ran: its rows are woken
            except Exception as err:  # the client closed with the worker
                log.info("identity wait not completed; recovery's sweep will", error=str(err))

        while self._to_close:
            database_id, keys = self._to_close.popitem()
            self._closing.update((database_id, k) for k in keys)
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

    def wait_activities(self) -> list[Callable[..., Any]]:
        """The activities an IdentityWait runs (probe; wake and expire as local activities)."""
        return [self.probe, self.expire, self.wake]

    def all(self) -> list[Callable[..., Any]]:
        """Every activity method, for ``Worker(activities=...)``."""
        return [*self.wait_activities(), self.notify, self.recover]
