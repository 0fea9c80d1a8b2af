"""``PackSupervisorWorkflow``: one pack incarnation's pool of inbound workers.

One per pack incarnation and pool fingerprint, started by the fleet
(``workflows.fleet``): one ``InboundWorkerWorkflow`` child per worker
(``workflows.inbound_worker``), restart backoff, wake fan-out, drain then
cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import CancelledError, ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

from workflows.common import WAKE_COALESCE
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
