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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError,
    CancelledError,
    ChildWorkflowError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.connectors import ConnectorActivities
    from activities.identity import IdentityActivities
    from nexuscrm.connectors.knobs import RestartBackoff, work_item_worker_queue_profile
    from workflows.models import ClaimRequest as _ClaimRequest
    from workflows.models import (
        DesiredPack,
        FleetInput,
        InboundWorkerConfig,
        ProcessRequest,
        SupervisorConfig,
        SupervisorStatus,
        WaitNotifyRequest,
        WorkerStatus,
    )

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
    """Port of ``Supervisor.Start`` / ``Reconcile`` / ``ReconcileChanged``.

    Each reconcile lists the desired packs (activity), starts a supervisor
    for each new (pack, fingerprint), drains supervisors whose pack was
    removed or whose fingerprint changed (the rebuild), and keeps the rest.
    Pools are started with ABANDON so they outlive this workflow's
    continue-as-new; the next run adopts them from its input.
    Signals: ``reconcile`` (rebuild every pool), ``reconcile_changed``,
    ``wake(install_id)``, ``stop`` (drain every pool and end). Update:
    ``prune(namespace, install_id)``. Query: ``status``.
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

    @workflow.signal
    def reconcile(self) -> None:
        """After a live pack apply or remove: rebuild every pool."""
        self.requested = "all"

    @workflow.signal
    def reconcile_changed(self) -> None:
        """Rebuild only pools whose fingerprint changed."""
        if self.requested != "all":
            self.requested = "changed"

    @workflow.signal
    def stop(self) -> None:
        """Drain every pool and end the fleet."""
        self.stopping = True

    @workflow.signal
    def wake(self, install_id: str) -> None:
        """Wake the pool serving ``install_id`` (a no-op when none runs; coalesced)."""
        self.wake_targets.add(install_id)

    async def _forward_wakes(self) -> None:
        while not self.stopping:
            await workflow.wait_condition(lambda: bool(self.wake_targets) or self.stopping)
            targets, self.wake_targets = self.wake_targets, set()
            for pack in list(self.running.values()):
                if pack.install_id in targets and not self.stopping:
                    await self._signal(pack, "wake")
            await workflow.sleep(WAKE_COALESCE)

    @workflow.update
    async def prune(self, namespace: str, install_id: str) -> bool:
        """Port of ``PruneWorkerIncarnation``: drain that pool now; True if one ran."""
        pack = self.running.pop(f"{namespace}/{install_id}", None)
        if pack is None:
            return False
        await self._signal(pack, "drain")
        return True

    @workflow.query
    def status(self) -> list[DesiredPack]:
        """The pools running now."""
        return list(self.running.values())

    async def _signal(self, pack: DesiredPack, name: str) -> None:
        handle = workflow.get_external_workflow_handle(pack.supervisor_workflow_id)
        try:
            await handle.signal(name)
        except Exception as err:  # pool already ended: nothing to wake or drain
            workflow.logger.info("signal %s to %s skipped: %s", name, pack.install_id, err)

    async def _start(self, pack: DesiredPack) -> None:
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
            return
        self.running[f"{pack.namespace}/{pack.install_id}"] = pack

    async def _reconcile(self, force: bool) -> None:
        desired = await workflow.execute_activity_method(
            ConnectorActivities.list_desired,
            self.inp.database_id,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_attempts=3),
        )
        wanted = {f"{p.namespace}/{p.install_id}": p for p in desired}
        for key in list(self.running):
            pack = self.running[key]
            new = wanted.get(key)
            if new is None or force or new.fingerprint != pack.fingerprint:
                del self.running[key]
                await self._signal(pack, "drain")
        for key, pack in wanted.items():
            if key not in self.running:
                await self._start(pack)
        if self.inp.identity_recovery:
            await self._recover_waits()

    async def _recover_waits(self) -> None:
        """Blocked rows without a live identity wait get one (paged, bounded; idempotent)."""
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

    @workflow.run
    async def run(self, inp: FleetInput) -> None:
        """Reconcile on start, on the timer and on signals; continue-as-new periodically."""
        forwarder = asyncio.ensure_future(self._forward_wakes())
        while not self.stopping:
            force = self.requested == "all"
            self.requested = None
            try:
                await self._reconcile(force)
                self.last_error = None
            except ActivityError as err:
                # A listing error keeps the running pools (the seed preserves on read errors).
                self.last_error = str(err.cause or err)
                workflow.logger.warning("reconcile failed, keeping running pools: %s", err)
            self.reconciles += 1
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self.requested is not None or self.stopping,
                    timeout=timedelta(seconds=inp.reconcile_interval_seconds),
                )
            if self.reconciles >= inp.reconciles_before_continue_as_new and not self.stopping:
                await workflow.wait_condition(workflow.all_handlers_finished)
                inp.running = list(self.running.values())
                workflow.continue_as_new(inp)
        await forwarder
        for pack in list(self.running.values()):
            await self._signal(pack, "drain")
        self.running.clear()
        await workflow.wait_condition(workflow.all_handlers_finished)


CONNECTOR_WORKFLOWS = [ConnectorFleetWorkflow, PackSupervisorWorkflow, InboundWorkerWorkflow]
