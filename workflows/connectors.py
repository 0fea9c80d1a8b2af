"""Connector inbound runtime as workflows (port of ``connectors.Supervisor``).

- ``ConnectorFleetWorkflow`` (one per database): desired vs running pack
  supervisors, on a timer and on ``reconcile`` / ``reconcile_changed``.
- ``PackSupervisorWorkflow`` (one per pack incarnation and pool fingerprint):
  one ``InboundWorkerWorkflow`` child per worker, restart backoff, wake
  fan-out, drain then cancel.
- ``InboundWorkerWorkflow``: claim a batch, process it, sleep until ``wake``
  or the idle timer, continue-as-new before history grows large.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.connectors import ConnectorActivities
    from activities.identity import IdentityActivities
    from nexuscrm.connectors.knobs import RestartBackoff, work_item_worker_queue_profile
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
    from workflows.models import ClaimRequest as _ClaimRequest
    from workflows.models import (
        DesiredPack,
        FleetInput,
        FleetStatus,
        InboundWorkerConfig,
        ProcessRequest,
        ReconcileOutcome,
        ReconcileRequest,
        SupervisorConfig,
        SupervisorStatus,
        WaitNotifyRequest,
        WorkerStatus,
    )

# A fleet ``wake`` without an install id wakes every pool.
WAKE_ALL = "*"

# Wakes arriving within this window are forwarded as one.
WAKE_COALESCE = timedelta(milliseconds=200)

ACTIVITY_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)


def worker_workflow_id(config: InboundWorkerConfig) -> str:
    """``connector/<db>/<pack>/<install>/worker-<n>``: readable in the Web UI."""
    return (
        f"connector/{config.database_id}/{config.namespace}/{config.install_id}/"
        f"{config.fingerprint[:8]}/worker-{config.ordinal}"
    )


def supervisor_workflow_id(database_id: str, pack: DesiredPack, generation: int) -> str:
    """``connector/<db>/<pack>/<install>/supervisor-<fingerprint>-<n>``.

    ``n`` counts pools the fleet started, so a forced rebuild of an unchanged
    pack never collides with the old pool while it drains.
    """
    base = f"connector/{database_id}/{pack.namespace}/{pack.install_id}"
    return f"{base}/supervisor-{pack.fingerprint[:8]}-{generation}"


@workflow.defn(name="InboundWorker")
class InboundWorkerWorkflow:
    """Port of ``connector_inbound.Worker``: claim, process, wait, repeat.

    Signals: ``wake`` (work may be claimable now), ``drain`` (stop claiming;
    return once the current batch is done). Returns ``"drained"``.
    """

    @workflow.init
    def __init__(self, config: InboundWorkerConfig) -> None:
        self.woken = False
        self.draining = False
        self.batches = 0

    @workflow.signal
    def wake(self) -> None:
        """Claimable work may exist: cut the idle wait short."""
        self.woken = True

    @workflow.signal
    def drain(self) -> None:
        """Stop claiming; finish the batch in hand and return."""
        self.draining = True

    async def _notify(
        self, config: InboundWorkerConfig, blocked: list[Any], wake_keys: list[str]
    ) -> None:
        """After the batch committed: register its blocked items' waits, wake resolved waits.

        A failure is logged and left to recovery (a blocked row without a live
        wait gets one at the next fleet reconcile) and to the waits' own probes.
        """
        try:
            await workflow.execute_activity_method(
                IdentityActivities.notify,
                WaitNotifyRequest(config.database_id, blocked, wake_keys),
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
            )
        except ActivityError as err:
            workflow.logger.warning("identity wait notify failed; recovery covers it: %s", err)

    @workflow.run
    async def run(self, config: InboundWorkerConfig) -> str:
        """Loop until drained; continue-as-new every N batches or when history is large."""
        owner = f"{workflow.info().workflow_id}/{workflow.info().run_id}"
        while not self.draining:
            self.woken = False
            leases = await workflow.execute_local_activity_method(
                ConnectorActivities.claim,
                _ClaimRequest(config, owner),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=ACTIVITY_RETRY,
            )
            if leases:
                try:
                    result = await workflow.execute_activity_method(
                        ConnectorActivities.process,
                        ProcessRequest(config, leases),
                        start_to_close_timeout=timedelta(minutes=30),
                        heartbeat_timeout=timedelta(seconds=max(5.0, config.lease_seconds / 2)),
                        # Never retried with the same leases: if the process died, its
                        # leases expire and the stale reclaim records the abandoned attempt.
                        retry_policy=RetryPolicy(maximum_attempts=1),
                    )
                except ActivityError as err:
                    workflow.logger.warning("batch abandoned, leases will expire: %s", err)
                else:
                    if result.blocked or result.wake_keys:
                        await self._notify(config, result.blocked, result.wake_keys)
                self.batches += 1
            else:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self.woken or self.draining,
                        timeout=timedelta(seconds=config.idle_seconds),
                    )
            if (
                self.batches >= config.batches_before_continue_as_new
                or workflow.info().is_continue_as_new_suggested()
            ):
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(config)
        return "drained"


@dataclass
class _Slot:
    config: InboundWorkerConfig
    backoff: RestartBackoff
    handle: workflow.ChildWorkflowHandle[InboundWorkerWorkflow, str] | None = None
    state: str = "starting"
    restarts: int = 0
    next_backoff_s: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


@workflow.defn(name="PackSupervisor")
class PackSupervisorWorkflow:
    """Port of the Supervisor's per-pack pool (``superviseWorker`` and friends).

    Starts one InboundWorker child per worker with the seed's queue profiles;
    a child that fails is restarted after 1 s doubling to 30 s, reset after a
    run of 30 s or more; a child stopped by drain or cancellation is never
    restarted. Signals: ``wake`` (fanned out to every worker), ``drain``.
    Query: ``status``.
    """

    @workflow.init
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.draining = False
        self.wake_pending = False
        self.slots: list[_Slot] = []

    @workflow.signal
    def wake(self) -> None:
        """Central claim scheduler wake: every live worker is signalled (coalesced)."""
        self.wake_pending = True

    async def _forward_wakes(self) -> None:
        # A burst of wakes (one per woken identity wait) becomes one fan-out per
        # WAKE_COALESCE: the workers only need to know that work may be there.
        while not self.draining:
            await workflow.wait_condition(lambda: self.wake_pending or self.draining)
            if self.draining:
                return
            self.wake_pending = False
            for slot in self.slots:
                if slot.handle is not None and slot.state == "running":
                    try:
                        await slot.handle.signal(InboundWorkerWorkflow.wake)
                    except Exception:  # a worker between runs misses it; its idle timer covers it
                        workflow.logger.warning("wake of worker %s failed", slot.config.ordinal)
            await workflow.sleep(WAKE_COALESCE)

    @workflow.signal
    def drain(self) -> None:
        """Stop claiming; workers finish their batches; cancelled after the drain timeout."""
        self.draining = True

    @workflow.query
    def status(self) -> SupervisorStatus:
        """Workers, their profiles, restarts and states."""
        return SupervisorStatus(
            namespace=self.config.namespace,
            install_id=self.config.install_id,
            fingerprint=self.config.fingerprint,
            draining=self.draining,
            workers=[
                WorkerStatus(
                    ordinal=s.config.ordinal,
                    workflow_id=worker_workflow_id(s.config),
                    queue_classes=s.config.queue_classes,
                    batch_size=s.config.batch_size,
                    state=s.state,
                    restarts=s.restarts,
                    next_backoff_s=s.next_backoff_s,
                )
                for s in self.slots
            ],
        )

    def _worker_config(self, ordinal: int) -> InboundWorkerConfig:
        c = self.config
        profile = work_item_worker_queue_profile(c.worker_count, ordinal, c.queue_profile_mode)
        return InboundWorkerConfig(
            database_id=c.database_id,
            namespace=c.namespace,
            install_id=c.install_id,
            ordinal=ordinal,
            queue_classes=list(profile.queue_classes),
            preferred_queue_classes=list(profile.preferred_queue_classes),
            batch_size=profile.batch_size,
            max_processing_rows=c.max_processing_rows,
            lease_seconds=c.lease_seconds,
            idle_seconds=c.idle_seconds,
            fingerprint=c.fingerprint,
            generation=c.generation,
            scheduler_owner_id=c.scheduler_owner_id,
            fencing_token=c.fencing_token,
            drain_only=c.drain_only,
        )

    async def _supervise(self, slot: _Slot) -> None:
        while not self.draining:
            started = workflow.now()
            slot.state = "running"
            try:
                slot.handle = await workflow.start_child_workflow(
                    InboundWorkerWorkflow.run,
                    slot.config,
                    id=worker_workflow_id(slot.config),
                    parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
                )
                await slot.handle
                slot.state = "drained"
                return  # a clean return is drain: never restarted
            except ChildWorkflowError as err:
                if self.draining or isinstance(err.cause, CancelledError):
                    slot.state = "stopped"
                    return
                ran_for = workflow.now() - started
                sleep = slot.backoff.next(ran_for)
                slot.restarts += 1
                slot.next_backoff_s = sleep.total_seconds()
                slot.state = "backoff"
                workflow.logger.warning(
                    "inbound worker %s failed (%s); restarting in %s",
                    slot.config.ordinal,
                    err,
                    sleep,
                )
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(lambda: self.draining, timeout=sleep)
        slot.state = "stopped"

    @workflow.run
    async def run(self, config: SupervisorConfig) -> str:
        """Run the pool until drained (returns ``"drained"``) or cancelled."""
        for ordinal in range(config.worker_count):
            backoff = RestartBackoff(
                min_seconds=config.restart_backoff_min_seconds,
                max_seconds=config.restart_backoff_max_seconds,
                healthy_run_threshold_seconds=config.restart_backoff_max_seconds,
            )
            slot = _Slot(self._worker_config(ordinal), backoff)
            self.slots.append(slot)
            slot.task = asyncio.ensure_future(self._supervise(slot))
        forwarder = asyncio.ensure_future(self._forward_wakes())
        await workflow.wait_condition(lambda: self.draining)
        await forwarder
        for slot in self.slots:
            if slot.handle is not None and slot.state == "running":
                try:
                    await slot.handle.signal(InboundWorkerWorkflow.drain)
                except Exception:
                    workflow.logger.warning("drain of worker %s failed", slot.config.ordinal)
        tasks = [s.task for s in self.slots if s.task is not None]
        try:
            await workflow.wait_condition(
                lambda: all(t.done() for t in tasks),
                timeout=timedelta(seconds=config.drain_timeout_seconds),
            )
        except TimeoutError:
            for slot in self.slots:
                if slot.handle is not None and slot.state == "running":
                    slot.handle.cancel()
                    slot.state = "cancelled"
        await workflow.wait_condition(workflow.all_handlers_finished)
        return "drained"


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
    refills it from the plan. Pools are started with ABANDON so they outlive
    this workflow's continue-as-new; the next run adopts them from its input.
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
    def wake(self, install_id: str = "") -> None:
        """Wake the pool serving ``install_id`` (a no-op when none runs; coalesced).

        Without an argument (a hand-typed ``temporal workflow signal`` without
        ``--input``), every pool is woken: a signal must never fail the fleet.
        """
        self.wake_targets.add(install_id or WAKE_ALL)

    async def _forward_wakes(self) -> None:
        while not self.stopping:
            await workflow.wait_condition(lambda: bool(self.wake_targets) or self.stopping)
            targets, self.wake_targets = self.wake_targets, set()
            for pack in list(self.running.values()):
                if (pack.install_id in targets or WAKE_ALL in targets) and not self.stopping:
                    await self._signal(pack, "wake")
            await workflow.sleep(WAKE_COALESCE)

    @workflow.update
    async def prune(self, namespace: str, install_id: str) -> bool:
        """Port of ``PruneWorkerIncarnation``: drain that pool now; True if one ran."""
        self.lifecycle_busy += 1
        try:
            key = f"{namespace}/{install_id}"
            self.blocked.pop(key, None)
            pack = self.running.pop(key, None)
            if pack is None:
                return False
            await self._signal(pack, "drain")
            return True
        finally:
            self.lifecycle_busy -= 1

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

    async def _signal(self, pack: DesiredPack, name: str) -> None:
        handle = workflow.get_external_workflow_handle(pack.supervisor_workflow_id)
        try:
            await handle.signal(name)
        except Exception as err:  # pool already ended: nothing to wake or drain
            workflow.logger.info("signal %s to %s skipped: %s", name, pack.install_id, err)

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
        )
        self.inp.pools_started += 1
        pack.supervisor_workflow_id = supervisor_workflow_id(
            self.inp.database_id, pack, self.inp.pools_started
        )
        try:
            await workflow.start_child_workflow(
                PackSupervisorWorkflow.run,
                config,
                id=pack.supervisor_workflow_id,
                parent_close_policy=ParentClosePolicy.ABANDON,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            )
        except WorkflowAlreadyStartedError as err:  # next reconcile tries again
            workflow.logger.warning("pool %s not started: %s", pack.supervisor_workflow_id, err)
            return False
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
        """Apply one typed plan; raises ``ApplicationError`` when startup fails."""
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
        return lambda: task.done() or self.stopping

    async def _cycle(self, mode: str) -> None:
        if mode == MODE_STARTUP:
            if not self.running:  # a fresh fleet: pools of an earlier one still run
                await workflow.execute_activity_method(
                    ConnectorActivities.drain_orphan_pools,
                    self.inp.database_id,
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(maximum_attempts=3),
                )
            await self._reconcile(mode)
            # Startup recovery is not a readiness gate (the seed defers its errors).
            await self._recover_waits()
        elif mode == MODE_PERIODIC:
            await self._recover_waits()  # due identity recovery first (reconcileBacklog)
            if self.lifecycle_busy:  # the seed's TryLock: never wait on a busy lifecycle
                workflow.logger.info("periodic reconcile skipped: lifecycle busy")
                return
            await self._reconcile(mode)
        else:
            await self._reconcile(mode)

    @workflow.run
    async def run(self, inp: FleetInput) -> None:
        """Reconcile on start, on signals and on the timer; continue-as-new periodically.

        Raises ``ApplicationError`` (the fleet fails) when the startup
        reconcile fails; nothing is left running then.
        """
        if not inp.fleet_epoch:
            inp.fleet_epoch = workflow.info().first_execution_run_id
        forwarder = asyncio.ensure_future(self._forward_wakes())
        while not self.stopping:
            mode = MODE_STARTUP if not inp.started else self.requested or MODE_PERIODIC
            self.requested = None
            task = asyncio.ensure_future(self._cycle(mode))
            await workflow.wait_condition(self._done_or_stopping(task))
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
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self.requested is not None or self.stopping,
                    timeout=timedelta(seconds=inp.reconcile_interval_seconds),
                )
            if self.reconciles >= inp.reconciles_before_continue_as_new and not self.stopping:
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
