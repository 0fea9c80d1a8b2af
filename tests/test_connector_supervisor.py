"""PackSupervisor lifecycle rules on the time-skipping test server.

The child InboundWorker is replaced by stand-ins registered under the same
workflow type (one that always fails, one that waits for drain), so the
supervisor's own rules are exercised with real Temporal timers: a 30 s backoff
runs in milliseconds.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from nexuscrm.contracts import InboundWorkerConfig, SupervisorConfig, SupervisorStatus
from tests.stubs import DrainableWorker
from workflows.pack_supervisor import PackSupervisorWorkflow


@workflow.defn(name="InboundWorker")
class FailingWorker:
    """Fails right after it starts."""

    @workflow.run
    async def run(self, config: InboundWorkerConfig) -> str:
        await workflow.sleep(0.01)
        raise ApplicationError("worker crashed", non_retryable=True)


@workflow.defn(name="InboundWorker")
class StubbornWorker:
    """Ignores drain: only cancellation stops it."""

    @workflow.signal
    def drain(self) -> None:
        pass

    @workflow.run
    async def run(self, config: InboundWorkerConfig) -> str:
        await workflow.wait_condition(lambda: False)
        return "never"


def config(workers: int = 1) -> SupervisorConfig:
    return SupervisorConfig(
        database_id="db",
        namespace="salesforce-sync",
        install_id=f"inst-{uuid.uuid4().hex[:6]}",
        payload_hash="h",
        fingerprint=uuid.uuid4().hex,
        worker_count=workers,
        max_processing_rows=100,
        queue_profile_mode="reserved",
        drain_timeout_seconds=30,
    )


async def test_failing_worker_restarts_with_backoff_doubling_to_30s(skipping_env):
    queue = f"sup-{uuid.uuid4().hex[:6]}"
    async with Worker(
        skipping_env.client, task_queue=queue, workflows=[PackSupervisorWorkflow, FailingWorker]
    ):
        handle = await skipping_env.client.start_workflow(
            PackSupervisorWorkflow.run, config(), id=f"sup-{uuid.uuid4()}", task_queue=queue
        )
        seen: list[float] = []
        for _ in range(200):
            await skipping_env.sleep(timedelta(seconds=1))
            status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
            w = status.workers[0]
            if w.restarts > len(seen):  # one new restart since the last poll
                seen.append(w.next_backoff_s)
            if len(seen) >= 7:
                break
        assert seen[:7] == [1, 2, 4, 8, 16, 30, 30]
        await handle.signal(PackSupervisorWorkflow.drain)
        assert await handle.result() == "drained"


async def test_drain_stops_workers_and_they_are_not_restarted(skipping_env):
    queue = f"sup-{uuid.uuid4().hex[:6]}"
    async with Worker(
        skipping_env.client, task_queue=queue, workflows=[PackSupervisorWorkflow, DrainableWorker]
    ):
        handle = await skipping_env.client.start_workflow(
            PackSupervisorWorkflow.run, config(4), id=f"sup-{uuid.uuid4()}", task_queue=queue
        )
        await skipping_env.sleep(timedelta(seconds=2))
        status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
        assert [w.state for w in status.workers] == ["running"] * 4
        # the seed's reserved profile for 4 workers: latency, bulk, then all classes
        assert [w.batch_size for w in status.workers] == [5, 100, 25, 25]
        await handle.signal(PackSupervisorWorkflow.drain)
        assert await handle.result() == "drained"
        status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
        assert [w.state for w in status.workers] == ["drained"] * 4
        assert all(w.restarts == 0 for w in status.workers)


async def test_drain_timeout_cancels_workers_that_do_not_stop(skipping_env):
    queue = f"sup-{uuid.uuid4().hex[:6]}"
    async with Worker(
        skipping_env.client, task_queue=queue, workflows=[PackSupervisorWorkflow, StubbornWorker]
    ):
        cfg = config(2)
        handle = await skipping_env.client.start_workflow(
            PackSupervisorWorkflow.run, cfg, id=f"sup-{uuid.uuid4()}", task_queue=queue
        )
        await skipping_env.sleep(timedelta(seconds=2))
        await handle.signal(PackSupervisorWorkflow.drain)
        assert await handle.result() == "drained"
        status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
        assert {w.state for w in status.workers} <= {"cancelled", "stopped"}
        assert all(w.restarts == 0 for w in status.workers)


@workflow.defn(name="InboundWorker")
class ContinuingWorker:
    """Continues-as-new twice (counting down from the default 200), then returns cleanly."""

    @workflow.run
    async def run(self, config: InboundWorkerConfig) -> str:
        await workflow.sleep(0.01)
        if config.batches_before_continue_as_new > 198:
            config.batches_before_continue_as_new -= 1
            workflow.continue_as_new(config)
        return "drained"


async def test_clean_return_is_re_run_and_continue_as_new_is_not_a_restart(skipping_env):
    """The seed's claim-first ``superviseWorker`` re-runs a worker that returns cleanly at
    once (issue 10 item 3; this test asserted the lost capacity before): neither the
    re-run nor the worker's continue-as-new counts as a restart or backs off."""
    queue = f"sup-{uuid.uuid4().hex[:6]}"
    async with Worker(
        skipping_env.client, task_queue=queue, workflows=[PackSupervisorWorkflow, ContinuingWorker]
    ):
        handle = await skipping_env.client.start_workflow(
            PackSupervisorWorkflow.run, config(2), id=f"sup-{uuid.uuid4()}", task_queue=queue
        )
        starts: list[str] = []
        for _ in range(100):
            await skipping_env.sleep(timedelta(seconds=1))
            history = await handle.fetch_history()
            starts = [
                e.start_child_workflow_execution_initiated_event_attributes.workflow_id
                for e in history.events
                if e.HasField("start_child_workflow_execution_initiated_event_attributes")
            ]
            if len(starts) >= 6:
                break
        # each ordinal ran again after its clean return (three runs each, two of them CAN)
        assert {wf_id: starts.count(wf_id) for wf_id in set(starts)} == {
            f"{handle.id}/r0/worker-0": starts.count(f"{handle.id}/r0/worker-0"),
            f"{handle.id}/r0/worker-1": starts.count(f"{handle.id}/r0/worker-1"),
        }
        assert min(starts.count(f"{handle.id}/r0/worker-{n}") for n in (0, 1)) >= 2
        status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
        assert [(w.restarts, w.next_backoff_s) for w in status.workers] == [(0, 0.0), (0, 0.0)]
        await handle.signal(PackSupervisorWorkflow.drain)
        assert await handle.result() == "drained"


async def test_every_worker_config_carries_generation_owner_and_fence(skipping_env):
    queue = f"sup-{uuid.uuid4().hex[:6]}"
    async with Worker(
        skipping_env.client, task_queue=queue, workflows=[PackSupervisorWorkflow, DrainableWorker]
    ):
        cfg = config(3)
        cfg.generation, cfg.scheduler_owner_id, cfg.fencing_token = 7, "owner-x", "fence-x"
        handle = await skipping_env.client.start_workflow(
            PackSupervisorWorkflow.run, cfg, id=f"sup-{uuid.uuid4()}", task_queue=queue
        )
        await skipping_env.sleep(timedelta(seconds=2))
        status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
        seen = []
        for w in status.workers:
            history = await skipping_env.client.get_workflow_handle(w.workflow_id).fetch_history()
            started = history.events[0].workflow_execution_started_event_attributes
            arg = json.loads(started.input.payloads[0].data)
            seen.append((arg["generation"], arg["scheduler_owner_id"], arg["fencing_token"]))
        assert seen == [(7, "owner-x", "fence-x")] * 3
        await handle.signal(PackSupervisorWorkflow.drain)
        assert await handle.result() == "drained"


async def test_supervisor_never_finalizes_an_item_a_worker_held(skipping_env):
    """The supervisor restarts a failed worker but runs no activity of its own: the
    crashed worker's leases are left to expire and be reclaimed (the seed's rule that
    the supervising frame holds no claim token and must not finalize)."""
    queue = f"sup-{uuid.uuid4().hex[:6]}"
    async with Worker(
        skipping_env.client, task_queue=queue, workflows=[PackSupervisorWorkflow, FailingWorker]
    ):
        handle = await skipping_env.client.start_workflow(
            PackSupervisorWorkflow.run, config(), id=f"sup-{uuid.uuid4()}", task_queue=queue
        )
        await skipping_env.sleep(timedelta(seconds=10))
        status = await handle.query(PackSupervisorWorkflow.status, result_type=SupervisorStatus)
        assert status.workers[0].restarts >= 2
        await handle.signal(PackSupervisorWorkflow.drain)
        assert await handle.result() == "drained"
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.HasField("activity_task_scheduled_event_attributes")]
    markers = [
        e.marker_recorded_event_attributes.marker_name
        for e in history.events
        if e.HasField("marker_recorded_event_attributes")
    ]
    assert set(markers) <= {"core_patch"}  # no local activity; a workflow.patched() marker only
