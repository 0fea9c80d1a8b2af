"""``PackSupervisorWorkflow``: one pack incarnation's pool of inbound workers.

One per pack incarnation and pool fingerprint, started by the fleet
(``workflows.fleet``): one ``InboundWorkerWorkflow`` child per worker
(``workflows.inbound_worker``), restart backoff, wake fan-out, drain then
cancel.

Continue-as-new (patch ``pool-lifecycle-v2``): **drain, then restart at the
boundary with new ids.** When the server suggests it (or the history passes
``HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW``), the supervisor drains its workers
exactly as a stop does (``drain`` signal, wait at most the drain timeout,
then cancel and wait for the cancellation to land), and only then continues
as new with ``incarnation + 1``; the new run starts every worker again under
``<supervisor id>/r<incarnation>/worker-<n>``. Chosen over ABANDON + re-adopt
because a child started by this run is the only kind whose close the
supervisor learns of without polling (its handle resolves): re-adopted
children would need an activity (a describe per worker) on a timer, i.e.
history growth to watch liveness, and a window where a dead worker is
reported running. The cost is one drain (a batch, seconds) per continue-as-
new, which with no keep-wakes in history happens rarely (restarts and real
wakes are the only events). No worker is lost (every ordinal is started again
by the new run) and no two workers of one ordinal claim at once (the old one
has closed before the new run starts; ids differ, so no start collides).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import (
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

from workflows.common import HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW, WAKE_COALESCE, is_not_found
from workflows.inbound_worker import InboundWorkerWorkflow, worker_workflow_id

with workflow.unsafe.imports_passed_through():
    from nexuscrm.connectors.knobs import RestartBackoff, work_item_worker_queue_profile
    from nexuscrm.contracts import (
        InboundWorkerConfig,
        SupervisorConfig,
        SupervisorStatus,
        WorkerStatus,
    )


@dataclass
class _Slot:
    config: InboundWorkerConfig
    backoff: RestartBackoff
    handle: workflow.ChildWorkflowHandle[InboundWorkerWorkflow, str] | None = None
    state: str = "starting"
    restarts: int = 0
    next_backoff_s: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    workflow_id: str = ""


@workflow.defn(name="PackSupervisor")
class PackSupervisorWorkflow:
    """Port of the Supervisor's per-pack pool (``superviseWorker`` and friends).

    Starts one InboundWorker child per worker with the seed's queue profiles;
    a child that fails is restarted after 1 s doubling to 30 s, reset after a
    run of 30 s or more; a child stopped by drain or cancellation is never
    restarted. Under patch ``pool-lifecycle-v2`` (see the module docstring):
    a worker that returns cleanly is re-run at once (the seed's claim-first
    ``superviseWorker``; not a restart), a start that fails (the id still
    taken) goes through the same backoff and counts as a restart, a slot
    task's failure fails the workflow task (visible, retried), and the pool
    continues-as-new by draining first. Signals: ``wake`` (fanned out to every
    running worker, coalesced), ``drain``. Query: ``status`` (a worker is
    ``running`` only between its start and its close).
    """

    @workflow.init
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.draining = False
        self.rolling = False  # draining for continue-as-new (v2)
        self.v2 = False
        self.wake_pending = False
        self.slots: list[_Slot] = []

    def _stopping(self) -> bool:
        return self.draining or self.rolling

    @workflow.signal
    def wake(self) -> None:
        """Central claim scheduler wake: every live worker is signalled (coalesced)."""
        self.wake_pending = True

    async def _forward_wakes(self) -> None:
        # A burst of wakes (one per woken identity wait) becomes one fan-out per
        # WAKE_COALESCE: the workers only need to know that work may be there.
        while not self._stopping():
            await workflow.wait_condition(lambda: self.wake_pending or self._stopping())
            if self._stopping():
                return
            self.wake_pending = False
            for slot in self.slots:
                if slot.handle is not None and slot.state == "running":
                    await self._signal_worker(slot, "wake")
            await workflow.sleep(WAKE_COALESCE)

    async def _signal_worker(self, slot: _Slot, name: str) -> None:
        """Signal a worker; one that just closed is expected (its slot task sees it)."""
        assert slot.handle is not None
        try:
            await slot.handle.signal(name)
        except ApplicationError as err:
            if self.v2 and not is_not_found(err):
                raise
            workflow.logger.info("%s of worker %s skipped: %s", name, slot.config.ordinal, err)

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
                    workflow_id=s.workflow_id or worker_workflow_id(s.config),
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
            heartbeat_timeout_seconds=c.heartbeat_timeout_seconds,
            idle_max_seconds=c.idle_max_seconds,
            # the old pool of a rebuild drains for up to its drain timeout
            idle_backoff_grace_seconds=2 * c.drain_timeout_seconds,
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

    def _worker_id(self, ordinal: int) -> str:
        """``<supervisor id>/r<incarnation>/worker-<n>``: unique per pool and per run.

        The supervisor id is ``config.pool_id`` (set by the fleet), so replaying a
        recorded history under another id names the workers alike; a supervisor
        started without one (tests, by hand) uses its own workflow id.
        """
        base = self.config.pool_id or workflow.info().workflow_id
        return f"{base}/r{self.config.incarnation}/worker-{ordinal}"

    async def _supervise_v2(self, slot: _Slot) -> None:
        """Port of ``superviseWorker`` (claim-first): re-run a clean return, back off a failure."""
        while not self._stopping():
            started = workflow.now()
            slot.state = "starting"
            failure: BaseException
            try:
                slot.handle = await workflow.start_child_workflow(
                    InboundWorkerWorkflow.run,
                    slot.config,
                    id=slot.workflow_id,
                    parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
                    search_attributes=workflow.info().typed_search_attributes,
                )
            except WorkflowAlreadyStartedError as err:  # the id is still taken: back off
                failure = err
            else:
                slot.state = "running"
                try:
                    if self._stopping():  # drain arrived while it started
                        await self._signal_worker(slot, "drain")
                    await slot.handle
                    slot.state = "drained"
                    continue  # a clean return is re-run at once (claim-first), not a restart
                except ChildWorkflowError as err:
                    if self._stopping() or isinstance(err.cause, CancelledError):
                        slot.state = "stopped"
                        return
                    failure = err
                finally:
                    slot.handle = None
            ran_for = workflow.now() - started
            sleep = slot.backoff.next(ran_for)
            slot.restarts += 1
            slot.next_backoff_s = sleep.total_seconds()
            slot.state = "backoff"
            workflow.logger.warning(
                "inbound worker %s failed (%s); restarting in %s",
                slot.config.ordinal,
                failure,
                sleep,
            )
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(self._stopping, timeout=sleep)
        if slot.state not in ("drained", "cancelled"):
            slot.state = "stopped"

    def _continue_as_new_due(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW
        )

    async def _run_v2(self, config: SupervisorConfig) -> str:
        for ordinal in range(config.worker_count):
            slot = _Slot(self._worker_config(ordinal), self._backoff(config))
            slot.workflow_id = self._worker_id(ordinal)
            if ordinal < len(config.restarts):
                slot.restarts = config.restarts[ordinal]
            self.slots.append(slot)
            slot.task = asyncio.ensure_future(self._supervise_v2(slot))
        tasks = [s.task for s in self.slots if s.task is not None]
        forwarder = asyncio.ensure_future(self._forward_wakes())
        await workflow.wait_condition(
            lambda: self.draining or self._continue_as_new_due() or any(t.done() for t in tasks)
        )
        for t in tasks:
            if t.done():
                t.result()  # a slot task that raised fails this workflow task: visible
        self.rolling = not self.draining
        await forwarder
        await self._drain_workers(config, tasks)
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self.rolling:
            config.incarnation += 1
            config.restarts = [s.restarts for s in self.slots]
            workflow.continue_as_new(config)
        return "drained"

    async def _drain_workers(
        self, config: SupervisorConfig, tasks: list[asyncio.Task[None]]
    ) -> None:
        """Drain signal, the drain timeout, then cancel; returns once every slot task ended."""
        for slot in self.slots:
            if slot.handle is not None and slot.state == "running":
                await self._signal_worker(slot, "drain")
        timeout = timedelta(seconds=config.drain_timeout_seconds)
        try:
            await workflow.wait_condition(lambda: all(t.done() for t in tasks), timeout=timeout)
        except TimeoutError:
            for slot in self.slots:
                if slot.handle is not None and slot.state == "running":
                    slot.handle.cancel()
                    slot.state = "cancelled"
            with contextlib.suppress(TimeoutError):  # bounded: never wedge on a lost cancel
                await workflow.wait_condition(lambda: all(t.done() for t in tasks), timeout=timeout)

    @staticmethod
    def _backoff(config: SupervisorConfig) -> RestartBackoff:
        return RestartBackoff(
            min_seconds=config.restart_backoff_min_seconds,
            max_seconds=config.restart_backoff_max_seconds,
            healthy_run_threshold_seconds=config.restart_backoff_max_seconds,
        )

    @workflow.run
    async def run(self, config: SupervisorConfig) -> str:
        """Run the pool until drained (returns ``"drained"``) or cancelled.

        Continues-as-new (v2) when the history grows; see the module docstring.
        """
        self.v2 = workflow.patched("pool-lifecycle-v2")
        if self.v2:
            return await self._run_v2(config)
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
