"""``ConnectorFleetWorkflow``: the connector inbound runtime of one database.

Port of ``connectors.Supervisor``: desired vs running pack supervisors
(``workflows.pack_supervisor``), on a timer and on ``reconcile`` /
``reconcile_changed``. :data:`CONNECTOR_WORKFLOWS` lists the fleet and the
workflows it runs, for the connector worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import (
    RetryPolicy,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

from workflows.common import (
    HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW,
    PACK_KEY,
    WAKE_COALESCE,
    brief,
    is_not_found,
)
from workflows.controlplane import DATABASE_KEY
from workflows.inbound_worker import InboundWorkerWorkflow
from workflows.pack_supervisor import PackSupervisorWorkflow

with workflow.unsafe.imports_passed_through():
    from activities.connectors import ConnectorActivities
    from activities.fleet import PASS_HEARTBEAT_SLACK_S, FleetActivities
    from activities.identity import IdentityActivities
    from nexuscrm.connectors.reconcile import (
        ACTION_KEEP,
        ACTION_PRESERVE,
        ACTION_START,
        ACTION_STOP,
        MODE_ALL,
        MODE_CHANGED,
        MODE_PERIODIC,
        MODE_STARTUP,
    )
    from nexuscrm.contracts import (
        DesiredPack,
        FleetInput,
        FleetStatus,
        PeriodicRequest,
        ReconcileOutcome,
        ReconcileRequest,
        SupervisorConfig,
    )

# A fleet ``wake`` without an install id wakes every pool.
WAKE_ALL = "*"

BACKLOG_WAKE_PATCH = "backlog-wake"
"""Patch id: a periodic reconcile wakes each kept pool the plan flags ``stalled``
(claimable work while a worker holds no lease, ``queue.stalled_pack``): the seed's
backlog reconcile, now that idle workers back their timers off (``idle-backoff``)."""

PERIODIC_PASS_PATCH = "fleet-periodic-pass"
"""Patch id: a periodic reconcile's identity recovery, pool liveness check and plan run
as one activity (``connectors.periodic``, :mod:`activities.fleet`) that first waits out
the reconcile interval (no timer): one activity task and one workflow task per idle
pass instead of three activities, a timer and four workflow tasks (issue 16: the idle
fleet's passes were most of an idle server's CPU)."""


def supervisor_workflow_id(database_id: str, pack: DesiredPack, generation: int) -> str:
    """``connector/<db>/<pack>/<install>/supervisor-<fingerprint>-<n>``.

    ``n`` counts pools the fleet started, so a forced rebuild of an unchanged
    pack never collides with the old pool while it drains.
    """
    base = f"connector/{database_id}/{pack.namespace}/{pack.install_id}"
    return f"{base}/supervisor-{pack.fingerprint[:8]}-{generation}"


def _consume_outcome(fut: asyncio.Future[Any]) -> None:
    """Done callback of a detached pool's child handle: read its outcome, nothing else."""
    if not fut.cancelled():
        fut.exception()


@workflow.defn(name="ConnectorFleet")
class ConnectorFleetWorkflow:
    """Port of ``Supervisor.StartContext`` / ``Reconcile`` / ``ReconcileChanged`` / ``Stop``.

    Every reconcile asks one activity for a typed plan
    (``nexuscrm.connectors.reconcile``) and applies it: start a supervisor per
    new (pack, fingerprint), drain pools to stop or rebuild, wake pools kept
    unchanged, keep preserved ones. Kinds of reconcile:

    * startup (first run): all-or-nothing; any error fails the fleet;
    * ``reconcile`` signal (after a live pack apply/remove): rebuild every pool;
    * ``reconcile_changed`` signal: rebuild only pools whose fingerprint changed;
    * periodic (timer): due identity recovery first, then, unless a lifecycle
      operation (``prune``) is in progress, a reconcile that wakes unchanged
      pools and preserves running ones on read errors.

    Each clears the ``blocked`` map (packs not served, with the reason) and
    refills it from the plan.

    Under patch ``fleet-lifecycle-v2``: a periodic reconcile first asks
    ``connectors.closed_pools`` (a describe per pool) which pools closed and
    drops them, so the plan starts them again (the seed rebuilds a pool whose
    handle is done); unchanged pools are no longer woken through history
    (workers have idle timers; ``wake`` still reaches them when work is
    enqueued); a signal that finds no workflow drops the pool and requests a
    reconcile, any other signal failure is recorded in ``last_error``; pools
    carry the ``NexusDatabase`` / ``NexusPack`` search attributes; the fleet
    continues-as-new when the server suggests it or the history passes
    ``HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW``. Under patch ``backlog-wake``: a
    periodic reconcile wakes the kept pools the plan flags ``stalled``.
    ``prune`` and every reconcile hold one lock (samples-python
    ``safe_message_handlers``), so a paused reconcile never restarts a pool
    prune just removed.

    Pools are started with ABANDON so they outlive this workflow's
    continue-as-new; the next run adopts them from its input.
    ``stop`` waits at most ``reconcile_stop_timeout_seconds`` (5 s) for an
    in-flight reconcile, cancels it, then drains every pool (each pool waits
    its drain timeout, 30 s, then cancels its workers).
    Signals: ``reconcile``, ``reconcile_changed``, ``wake(install_id)``,
    ``stop``. Update: ``prune(namespace, install_id)``. Query: ``status``
    (:class:`FleetStatus`).
    """

    @workflow.init
    def __init__(self, inp: FleetInput) -> None:
        self.inp = inp
        self.running: dict[str, DesiredPack] = {
            f"{p.namespace}/{p.install_id}": p for p in inp.running
        }
        self.requested: str | None = None
        self.stopping = False
        self.wake_targets: set[str] = set()
        self.reconciles = 0
        self.last_error: str | None = None
        self.blocked: dict[str, str] = dict(inp.blocked)
        self.degraded: dict[str, str] = dict(inp.degraded)
        self.lifecycle_busy = 0
        self.lock = asyncio.Lock()  # prune and reconcile, one at a time
        self.v2 = False
        self.backlog_wake = False
        self.periodic_pass = False
        self.cancellable = False  # a periodic pass or its interval timer runs: a request cancels it
        self.lifecycle_changes = 0  # prunes so far: a pass planned before one is not applied

    @workflow.signal
    def reconcile(self) -> None:
        """After a live pack apply or remove: rebuild every pool."""
        self.requested = MODE_ALL

    @workflow.signal
    def reconcile_changed(self) -> None:
        """Rebuild only pools whose fingerprint changed."""
        if self.requested != MODE_ALL:
            self.requested = MODE_CHANGED

    @workflow.signal
    def stop(self) -> None:
        """Drain every pool and end the fleet."""
        self.stopping = True

    @workflow.signal
    def wake(self, *args: Any) -> None:
        """Wake the pool serving install id ``args[0]`` (a no-op when none runs; coalesced).

        Without an argument (a hand-typed ``temporal workflow signal`` without
        ``--input``), every pool is woken. A signal must never fail the fleet:
        the arguments arrive undecoded (``*args`` has no type hint, so the SDK
        calls the handler with whatever was sent instead of failing the
        workflow task on two of them), and anything but one string is logged
        and ignored.
        """
        if len(args) > 1 or (args and not isinstance(args[0], str)):
            workflow.logger.warning(
                "wake ignored: it takes one install id (a string), got %s", brief(list(args))
            )
            return
        self.wake_targets.add((args[0] if args else "") or WAKE_ALL)

    async def _forward_wakes(self) -> None:
        while not self.stopping:
            await workflow.wait_condition(lambda: bool(self.wake_targets) or self.stopping)
            targets, self.wake_targets = self.wake_targets, set()
            for key, pack in list(self.running.items()):
                wanted = pack.install_id in targets or WAKE_ALL in targets
                if wanted and not self.stopping and not await self._signal(pack, "wake"):
                    self._drop_closed(key, pack)
            await workflow.sleep(WAKE_COALESCE)

    @workflow.update
    async def prune(self, namespace: str = "", install_id: str = "") -> bool:
        """Port of ``PruneWorkerIncarnation``: drain that pool now; True if one ran.

        The defaults only let the validator name a missing argument."""
        self.lifecycle_busy += 1
        try:
            async with self.lock:
                key = f"{namespace}/{install_id}"
                self.blocked.pop(key, None)
                pack = self.running.pop(key, None)
                self.lifecycle_changes += 1
                if pack is None:
                    return False
                await self._signal(pack, "drain")
                return True
        finally:
            self.lifecycle_busy -= 1

    @prune.validator
    def _validate_prune(self, namespace: str = "", install_id: str = "") -> None:
        """Refuse a ``prune`` that is not two non-empty strings (before it is
        accepted: a rejected update leaves no trace in the history).

        A wrong type is refused by the SDK's decoding, naming it. A wrong count
        of arguments arrives undecoded (the SDK uses type hints only when the
        counts match): one or none used to be accepted and then fail the
        workflow task on every attempt when the handler was called with it,
        wedging the fleet and the caller; three are refused by Python itself.
        """
        if not (isinstance(namespace, str) and namespace) or not (
            isinstance(install_id, str) and install_id
        ):
            raise ApplicationError(
                "prune takes two non-empty strings, the pack's namespace and its install id "
                f"(--input '\"<namespace>\"' --input '\"<install id>\"'), got "
                f"{brief([a for a in (namespace, install_id) if a != ''])}",
                type="BadRequest",
            )

    @workflow.query
    def status(self) -> FleetStatus:
        """Running pools, blocked and degraded packs with their reasons."""
        return FleetStatus(
            pools=list(self.running.values()),
            blocked=dict(self.blocked),
            degraded=dict(self.degraded),
            last_error=self.last_error,
            reconciles=self.reconciles,
            stopping=self.stopping,
        )

    async def _signal(self, pack: DesiredPack, name: str) -> bool:
        """Signal a pool; False when it is gone ("not found", the only expected failure).

        Any other failure is recorded in ``last_error`` and logged as an error
        (v2); it is never silent, and never fails the fleet.
        """
        handle = workflow.get_external_workflow_handle(pack.supervisor_workflow_id)
        try:
            await handle.signal(name)
        except ApplicationError as err:
            if self.v2 and not is_not_found(err):
                self.last_error = f"signal {name} to {pack.supervisor_workflow_id} failed: {err}"
                workflow.logger.error(self.last_error)
                return True
            workflow.logger.info("signal %s to %s skipped: %s", name, pack.install_id, err)
            return False
        return True

    def _drop_closed(self, key: str, pack: DesiredPack) -> None:
        """A pool that closed on its own: forget it and rebuild it at the next reconcile (v2)."""
        if self.v2 and self.running.get(key) is pack:
            workflow.logger.warning("pool %s closed; rebuilding", pack.supervisor_workflow_id)
            del self.running[key]
            if self.requested is None:
                self.requested = MODE_CHANGED

    async def _drop_closed_pools(self) -> None:
        """Periodic liveness check: drop every pool whose supervisor is not running."""
        if not self.running:
            return
        ids = {p.supervisor_workflow_id: k for k, p in self.running.items()}
        try:
            closed = await workflow.execute_activity_method(
                ConnectorActivities.closed_pools,
                list(ids),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:  # the next reconcile checks again
            workflow.logger.warning("pool liveness check failed: %s", err)
            return
        self._forget_closed({k: wf_id for wf_id, k in ids.items()}, closed)

    def _forget_closed(self, keys: dict[str, str], closed: list[str]) -> None:
        """Forget the pools whose supervisor is in ``closed`` (the liveness check's
        answer), so that the plan starts them again; ``keys``: pack key -> the
        supervisor workflow id the check asked about. A key whose pool was
        replaced meanwhile (another supervisor id) is kept."""
        gone = set(closed)
        for key, wf_id in keys.items():
            pool = self.running.get(key)
            if wf_id in gone and pool is not None and pool.supervisor_workflow_id == wf_id:
                workflow.logger.warning("pool %s closed; rebuilding", wf_id)
                self.running.pop(key, None)

    async def _stop_pool(self, key: str) -> None:
        pack = self.running.pop(key, None)
        if pack is not None:
            await self._signal(pack, "drain")

    async def _start(self, pack: DesiredPack) -> bool:
        config = SupervisorConfig(
            database_id=self.inp.database_id,
            namespace=pack.namespace,
            install_id=pack.install_id,
            payload_hash=pack.payload_hash,
            fingerprint=pack.fingerprint,
            worker_count=pack.worker_count,
            max_processing_rows=pack.max_processing_rows,
            queue_profile_mode=pack.queue_profile_mode,
            drain_only=pack.drain_only,
            lease_seconds=self.inp.lease_seconds,
            idle_seconds=self.inp.idle_seconds,
            drain_timeout_seconds=self.inp.drain_timeout_seconds,
            restart_backoff_min_seconds=self.inp.restart_backoff_min_seconds,
            restart_backoff_max_seconds=self.inp.restart_backoff_max_seconds,
            generation=pack.generation,
            scheduler_owner_id=pack.scheduler_owner_id,
            fencing_token=pack.fencing_token,
            heartbeat_timeout_seconds=self.inp.heartbeat_timeout_seconds,
            idle_max_seconds=self.inp.idle_max_seconds,
        )
        self.inp.pools_started += 1
        pack.supervisor_workflow_id = supervisor_workflow_id(
            self.inp.database_id, pack, self.inp.pools_started
        )
        config.pool_id = pack.supervisor_workflow_id
        try:
            handle = await workflow.start_child_workflow(
                PackSupervisorWorkflow.run,
                config,
                id=pack.supervisor_workflow_id,
                parent_close_policy=ParentClosePolicy.ABANDON,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                search_attributes=(
                    TypedSearchAttributes(
                        [
                            SearchAttributePair(DATABASE_KEY, self.inp.database_id),
                            SearchAttributePair(PACK_KEY, pack.namespace),
                        ]
                    )
                    if self.v2
                    else None
                ),
            )
        except WorkflowAlreadyStartedError as err:  # next reconcile tries again
            workflow.logger.warning("pool %s not started: %s", pack.supervisor_workflow_id, err)
            return False
        # The pool is detached (ABANDON); its end is noticed by the liveness check
        # of the next reconcile. Retrieve the handle's outcome so a terminated or
        # failed pool is not logged as "exception was never retrieved" (no command).
        handle.add_done_callback(_consume_outcome)
        self.running[f"{pack.namespace}/{pack.install_id}"] = pack
        return True

    async def _plan(self, mode: str) -> ReconcileOutcome:
        return await workflow.execute_activity_method(
            ConnectorActivities.reconcile_plan,
            ReconcileRequest(
                self.inp.database_id,
                mode,
                {k: p.fingerprint for k, p in self.running.items()},
                self.inp.fleet_epoch,
            ),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_attempts=3),
        )

    async def _reconcile(self, mode: str) -> None:
        """Plan and apply one reconcile; raises ``ApplicationError`` when startup fails."""
        startup = mode == MODE_STARTUP
        self.blocked = {}  # every kind of reconcile clears the blocked map (seed)
        self.degraded = {}
        try:
            out = await self._plan(mode)
        except ActivityError as err:
            cause = str(err.cause or err)
            if startup:
                raise ApplicationError(
                    f"connector fleet startup failed: {cause}", non_retryable=True
                ) from err
            self.last_error = cause
            workflow.logger.warning("reconcile failed, keeping running pools: %s", cause)
            return
        await self._apply(out, startup)

    async def _periodic(self) -> None:
        """One periodic pass as one activity (patch ``fleet-periodic-pass``).

        The activity (:meth:`activities.fleet.FleetActivities.periodic`) waits
        out the reconcile interval, then runs identity recovery, the pools'
        liveness check and the plan; this forgets the closed pools and applies
        the plan, as the timer and the three activities of a pass did before.
        A plan that would start or replace a pool took no claim fence (``replan``):
        it is made again with fences under the lock (``connectors.reconcile_plan``)
        and that plan is applied, so a discarded pass never supersedes a pool.
        A request or a stop while the activity runs cancels it (the run loop);
        a ``prune`` meanwhile discards its plan (the seed's TryLock: a pass
        never applies over a lifecycle change), and so does a busy lifecycle.
        A pass whose worker began shutting down returns ``skipped`` at once;
        the rest of the interval is then a timer, and the next pass runs on a
        worker that stays.
        """
        lifecycle = self.lifecycle_changes
        keys = {k: p.supervisor_workflow_id for k, p in self.running.items()}
        delay = max(0.0, self.inp.reconcile_interval_seconds)
        self.cancellable = True
        try:
            out = await workflow.execute_activity_method(
                FleetActivities.periodic,
                PeriodicRequest(
                    self.inp.database_id,
                    {k: p.fingerprint for k, p in self.running.items()},
                    keys,
                    self.inp.fleet_epoch,
                    identity_recovery=self.inp.identity_recovery,
                    delay_seconds=delay,
                ),
                # the delay, then the recovery's bounds (paged, heartbeating) and the plan
                start_to_close_timeout=timedelta(seconds=delay) + timedelta(minutes=11),
                # a killed worker's pass is retried this long after its interval
                heartbeat_timeout=timedelta(seconds=delay + PASS_HEARTBEAT_SLACK_S),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:  # the next pass tries again, after the interval
            if isinstance(err.cause, CancelledError):  # by a request or a stop (run loop)
                return
            self.last_error = str(err.cause or err)
            workflow.logger.warning("reconcile failed, keeping running pools: %s", self.last_error)
            await self._interval(delay)
            return
        finally:
            self.cancellable = False
        if out.skipped:  # its worker shut down: the rest of the interval as a timer
            await self._interval(delay)
            return
        if out.recovery_error:
            workflow.logger.warning("identity wait recovery failed: %s", out.recovery_error)
        if self.lifecycle_busy or self.lock.locked() or lifecycle != self.lifecycle_changes:
            workflow.logger.info("periodic reconcile skipped: lifecycle busy")
            return
        async with self.lock:
            self._forget_closed(keys, out.closed)
            if out.replan:
                # The pass's plan starts a pool: it took no claim fence (it could
                # have been discarded). Plan again with fences, under the lock,
                # and apply that plan (a request now waits for it, as before).
                await self._reconcile(MODE_PERIODIC)  # clears the blocked map too
                return
            self.blocked = {}  # every kind of reconcile clears the blocked map (seed)
            self.degraded = {}
            await self._apply(out.plan, startup=False)

    async def _interval(self, seconds: float) -> None:
        """The reconcile interval as a timer, when a periodic pass could not wait it out
        (it failed, or its worker shut down): the next pass does not start at once. A
        request or a stop cuts it short (the run loop cancels it)."""
        self.cancellable = True
        try:
            await workflow.sleep(timedelta(seconds=seconds))
        finally:
            self.cancellable = False

    async def _apply(self, out: ReconcileOutcome, startup: bool) -> None:
        """Apply one typed plan; raises ``ApplicationError`` when startup fails."""
        self.blocked = dict(out.blocked)
        self.degraded = dict(out.degraded)
        if out.fatal:  # the plan starts nothing when it is fatal
            raise ApplicationError(
                f"connector fleet startup failed: {out.error}", non_retryable=True
            )
        if out.stop_all:
            self.last_error = out.error
            workflow.logger.error("listing failed under a serving selection: %s", out.error)
            for key in list(self.running):
                await self._stop_pool(key)
            return
        if out.error:
            self.last_error = out.error
            workflow.logger.warning("listing failed, keeping running pools: %s", out.error)
            return
        listed: set[str] = set()
        started: list[str] = []
        for d in out.decisions:
            listed.add(d.key)
            if d.action == ACTION_STOP:
                await self._stop_pool(d.key)
            elif d.action == ACTION_START and d.pack is not None:
                await self._stop_pool(d.key)  # a rebuild drains the old pool first
                if await self._start(d.pack):
                    started.append(d.key)
                elif startup:  # all-or-nothing: stop what started, fail the fleet
                    for key in started:
                        await self._stop_pool(key)
                    raise ApplicationError(
                        f"connector fleet startup failed: pool for {d.key} did not start",
                        non_retryable=True,
                    )
            elif d.action == ACTION_KEEP:
                pack = self.running.get(d.key)
                if pack is not None:
                    if d.pack is not None:
                        pack.degraded = d.pack.degraded
                    # v2: a kept pool is woken through history only when the plan
                    # flags it stalled (backlog-wake); its workers have idle timers.
                    if not self.v2 or (self.backlog_wake and d.stalled):
                        await self._signal(pack, "wake")
            elif d.action == ACTION_PRESERVE:
                workflow.logger.warning("pool %s preserved: %s", d.key, d.reason)
        for key in list(self.running):
            if key not in listed:  # removed, or no longer served
                await self._stop_pool(key)
        self.last_error = None

    async def _recover_waits(self) -> None:
        """Blocked rows without a live identity wait get one (paged, bounded; idempotent).

        Not in the Runtime handoff role: the runtime owns those dependencies.
        """
        if not self.inp.identity_recovery:
            return
        try:
            await workflow.execute_activity_method(
                IdentityActivities.recover,
                self.inp.database_id,
                start_to_close_timeout=timedelta(minutes=10),
                heartbeat_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=2),
            )
        except ActivityError as err:  # the next reconcile tries again
            workflow.logger.warning("identity wait recovery failed: %s", err)

    def _done_or_stopping(self, task: asyncio.Future[None]) -> Callable[[], bool]:
        # a periodic pass's activity (mostly its interval) gives way to a request too
        return lambda: (
            task.done() or self.stopping or (self.cancellable and self.requested is not None)
        )

    async def _cycle(self, mode: str) -> None:
        if mode == MODE_STARTUP:
            if not self.running:  # a fresh fleet: pools of an earlier one still run
                await workflow.execute_activity_method(
                    ConnectorActivities.drain_orphan_pools,
                    self.inp.database_id,
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(maximum_attempts=3),
                )
            async with self.lock:
                await self._reconcile(mode)
            # Startup recovery is not a readiness gate (the seed defers its errors).
            await self._recover_waits()
        elif mode == MODE_PERIODIC and self.periodic_pass:
            await self._periodic()  # its activity waits out the interval first
        elif mode == MODE_PERIODIC:
            await self._recover_waits()  # due identity recovery first (reconcileBacklog)
            # the seed's TryLock: never wait on a busy lifecycle
            if self.lifecycle_busy or self.lock.locked():
                workflow.logger.info("periodic reconcile skipped: lifecycle busy")
                return
            async with self.lock:
                if self.v2:
                    await self._drop_closed_pools()
                await self._reconcile(mode)
        else:
            async with self.lock:
                await self._reconcile(mode)

    def _continue_as_new_due(self) -> bool:
        if self.reconciles >= self.inp.reconciles_before_continue_as_new:
            return True
        info = workflow.info()
        return self.v2 and (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW
        )

    @workflow.run
    async def run(self, inp: FleetInput) -> None:
        """Reconcile on start, on signals and on the timer; continue-as-new periodically.

        Raises ``ApplicationError`` (the fleet fails) when the startup
        reconcile fails; nothing is left running then.
        """
        self.v2 = workflow.patched("fleet-lifecycle-v2")
        self.backlog_wake = workflow.patched(BACKLOG_WAKE_PATCH)
        self.periodic_pass = self.v2 and workflow.patched(PERIODIC_PASS_PATCH)
        if not inp.fleet_epoch:
            inp.fleet_epoch = workflow.info().first_execution_run_id
        forwarder = asyncio.ensure_future(self._forward_wakes())
        while not self.stopping:
            mode = MODE_STARTUP if not inp.started else self.requested or MODE_PERIODIC
            self.requested = None
            task = asyncio.ensure_future(self._cycle(mode))
            await workflow.wait_condition(self._done_or_stopping(task))
            if not task.done() and self.cancellable:
                # A request or a stop while a periodic pass's activity runs: cancel
                # it (its plan is not applied; the activity's work is idempotent).
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                continue
            if not task.done():
                # Stop during a reconcile: bounded wait, then cancel it (the seed's 5 s).
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        task.done,
                        timeout=timedelta(seconds=inp.reconcile_stop_timeout_seconds),
                    )
                if not task.done():
                    workflow.logger.warning("reconcile did not stop within the bounded timeout")
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ActivityError):
                        await task
                    break
            await task  # re-raises a startup failure
            inp.started = True
            self.reconciles += 1
            if not self.periodic_pass:  # else the next periodic pass waits out the interval
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self.requested is not None or self.stopping,
                        timeout=timedelta(seconds=inp.reconcile_interval_seconds),
                    )
            if self._continue_as_new_due() and not self.stopping:
                await workflow.wait_condition(workflow.all_handlers_finished)
                inp.running = list(self.running.values())
                inp.blocked, inp.degraded = self.blocked, self.degraded
                workflow.continue_as_new(inp)
        self.stopping = True
        await forwarder
        for key in list(self.running):
            await self._stop_pool(key)
        await workflow.wait_condition(workflow.all_handlers_finished)


CONNECTOR_WORKFLOWS = [ConnectorFleetWorkflow, PackSupervisorWorkflow, InboundWorkerWorkflow]
"""The connector worker's workflows: the fleet, its pack supervisors, their inbound workers."""
