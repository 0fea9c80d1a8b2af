"""The control-plane queue: one ``ControlPlane`` entity workflow per database.

Port of the seed's ``withControlPlaneApplyLockScope`` (``GET_LOCK`` with a
600 s wait) and of the way ``ApplyAllIfNeededWithOptionsAndRunnerOptions``
re-classifies after the wait, as a Temporal entity (the pattern of
temporalio/samples-python ``message_passing/safe_message_handlers``):

- The entity runs under ``controlplane/<database id>``. Every mutating
  control-plane operation (ApplyAll, RunRepair, RebuildDerived,
  EnsureIndexes, ApplyPacks, InitL0, ApplySourceConvergence, RemovePack)
  arrives by the ``submit`` update and runs, one at a time in arrival order,
  as a child workflow ``controlplane/<database id>/<operation>/<request id>``.
- A queued request waits for its turn up to its ``wait_seconds`` (the
  caller's ``NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS``, 600 s by default);
  past it, it is dropped (``expired``) and never runs.
- ``no_queue`` requests are rejected by the update's validator while anything
  runs or waits (a rejected update leaves no trace in the history).
- An ``auto_start`` ApplyAll joins an identical request (same operation,
  policy and input) that is still queued; a request with ``coalesce``
  (``--attach``) also joins an identical one that runs. Everyone who joined
  gets that one child's result. It never joins
  another operation: behind a RunRepair it waits for its own turn and then
  classifies again, as the seed does after its lock wait.
- ``status`` (query) lists what runs, what waits and the last finished.
- Between two operations, when the server suggests it (or after
  ``continue_as_new_after`` events), the entity continues as new carrying the
  queue. The ``submit`` handler never awaits, so nothing is in flight then.

Callers start the entity with update-with-start (``USE_EXISTING``): see
``nexusctl.controlplane_queue``.
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from activities.controlplane import ControlPlaneActivities
    from nexuscrm.contracts import ApplyAllResult
    from nexuscrm.contracts.controlplane_queue import (
        QUEUED_OPERATIONS,
        ControlPlaneEntityInput,
        ControlPlaneQueueStatus,
        ControlPlaneRequest,
        ControlPlaneTicket,
        QueueEntry,
        RemovePackInput,
        RemovePackRequest,
        bounded_queue_wait,
        place,
        queue_wait_problem,
        request_size_problem,
    )

from workflows.apply_all_gates import POLICIES
from workflows.common import brief
from workflows.controlplane import DATABASE_KEY, OPERATION_KEY, _PhaseRunner

# Auto-start joins a queued identical request only, never a running one.
AUTO_START_JOINS_QUEUED_PATCH = "controlplane-queue-auto-start-joins-queued"

# An operation's workflow task timeout follows its heartbeat timeout (2 to 10 s).
CHILD_TASK_TIMEOUT_PATCH = "controlplane-child-task-timeout"

CHILD_TASK_TIMEOUT_RANGE_S = (2.0, 10.0)
"""Bounds of an operation's workflow task timeout, in seconds (10 s is Temporal's default)."""

# Finished entries kept for ``status`` (and for callers that look up their result late).
RECENT_KEPT = 50


_NO_REQUEST = ControlPlaneRequest(operation="")
"""``submit`` without an argument (``temporal workflow update execute`` without
``--input``): its validator refuses it, naming what is missing."""


def _key(req: ControlPlaneRequest) -> tuple[Any, ...]:
    """What makes two requests identical (coalescing): operation, policy and input."""
    if req.apply_all is not None:
        a = req.apply_all
        return (req.operation, a.policy, tuple(sorted(a.app_pack_sources)), a.include_dev_sample)
    if req.operation_input is not None:
        o = req.operation_input
        return (req.operation, tuple(sorted(o.app_pack_sources)), o.include_dev_sample)
    if req.remove_pack is not None:
        return (req.operation, req.remove_pack.name)
    return (req.operation,)


def _coalesces(req: ControlPlaneRequest) -> bool:
    """Auto-start ApplyAll always coalesces; other requests when they ask (``--attach``)."""
    auto = req.apply_all is not None and req.apply_all.policy == "auto_start"
    return req.coalesce or auto


def _child_arg(req: ControlPlaneRequest) -> Any:
    return req.apply_all or req.operation_input or req.remove_pack


def child_task_timeout(req: ControlPlaneRequest) -> timedelta:
    """Workflow task timeout of ``req``'s operation: its heartbeat timeout, within
    :data:`CHILD_TASK_TIMEOUT_RANGE_S`.

    ApplyAll's short phases run as local activities inside a workflow task, so a
    worker that dies in one is noticed when that task times out, not by a
    heartbeat: an operator who asked for a 3 s heartbeat timeout gets a 3 s
    failover there too. Never under 2 s (a loaded worker's task would time out
    and run again) nor over Temporal's default 10 s. The heartbeat timeout is
    range-checked before the request is queued.
    """
    lo, hi = CHILD_TASK_TIMEOUT_RANGE_S
    seconds = getattr(_child_arg(req), "heartbeat_timeout_seconds", hi)
    if not isinstance(seconds, int | float) or seconds != seconds:
        seconds = hi
    return timedelta(seconds=min(hi, max(lo, float(seconds))))


def _failure_message(err: BaseException) -> str:
    """The innermost failure message of a child (what its phase raised)."""
    while getattr(err, "cause", None) is not None:
        err = err.cause  # type: ignore[attr-defined]
    return str(err)


@workflow.defn(name="ControlPlane")
class ControlPlaneEntity:
    """The per-database control-plane queue (see the module docstring).

    Update ``submit(ControlPlaneRequest) -> ControlPlaneTicket`` (rejected:
    not one request object, unknown operation or policy, missing input, a
    request over ``MAX_REQUEST_CHARS`` of JSON, a wait that is not a finite
    number of seconds above 0 and at most 7 days, or ``no_queue`` while
    busy; an unusable heartbeat timeout fails its child at once); query
    ``status() -> ControlPlaneQueueStatus``.
    Never completes on its own; continues as new between operations.
    """

    @workflow.init
    def __init__(self, inp: ControlPlaneEntityInput) -> None:
        self.database_id = inp.database_id
        self.queued: list[QueueEntry] = list(inp.queued)
        self.recent: list[QueueEntry] = list(inp.recent)
        self.running: QueueEntry | None = None
        self.changes = 0  # bumped on every queue change (wakes the deadline wait)

    @workflow.run
    async def run(self, inp: ControlPlaneEntityInput) -> None:
        """Run queued operations one at a time, forever (continuing as new)."""
        workflow.upsert_search_attributes(
            [
                OPERATION_KEY.value_set("ControlPlane"),
                DATABASE_KEY.value_set(self.database_id),
            ]
        )
        while True:
            await workflow.wait_condition(lambda: bool(self.queued))
            self._expire()
            if not self.queued:
                continue
            await self._run_entry(self.queued.pop(0))
            info = workflow.info()
            if info.is_continue_as_new_suggested() or (
                inp.continue_as_new_after
                and info.get_current_history_length() >= inp.continue_as_new_after
            ):
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    ControlPlaneEntityInput(
                        self.database_id,
                        self.queued,
                        self.recent[-RECENT_KEPT:],
                        inp.continue_as_new_after,
                    )
                )

    # -- the queue ------------------------------------------------------------------

    async def _run_entry(self, entry: QueueEntry) -> None:
        # "starting" until the server has the child: a caller must not look it up before.
        entry.state = "starting"
        self.running = entry
        task_timeout = (
            child_task_timeout(entry.request)
            if workflow.patched(CHILD_TASK_TIMEOUT_PATCH)
            else None
        )
        try:
            child = await workflow.start_child_workflow(
                entry.operation,
                _child_arg(entry.request),
                id=entry.workflow_id,
                task_queue=workflow.info().task_queue,
                task_timeout=task_timeout,
                result_type=ApplyAllResult,
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(DATABASE_KEY, self.database_id)]
                ),
            )
        except Exception as err:  # e.g. the id is taken: the entry fails, the queue goes on
            self._finish(entry, "failed", f"could not start {entry.workflow_id}: {err}")
            return
        entry.state, entry.started_at = "running", workflow.now().isoformat()
        self.changes += 1
        # While it runs, queued entries past their deadline are dropped.
        while not child.done():
            seen = self.changes
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda seen=seen: child.done() or self.changes != seen,  # type: ignore[misc]
                    timeout=self._next_deadline(),
                )
            self._expire()
        try:
            result: ApplyAllResult = child.result()
        except ChildWorkflowError as err:
            self._finish(entry, "failed", _failure_message(err))
            return
        self._finish(entry, "completed", f"{result.status}: {result.reason}")

    def _finish(self, entry: QueueEntry, state: str, outcome: str) -> None:
        entry.state, entry.outcome = state, outcome
        entry.finished_at = workflow.now().isoformat()
        if self.running is entry:
            self.running = None
        self.recent = [*self.recent, entry][-RECENT_KEPT:]
        self.changes += 1

    def _next_deadline(self) -> timedelta | None:
        if not self.queued:
            return None
        first = min(datetime.fromisoformat(e.deadline) for e in self.queued)
        return max(first - workflow.now(), timedelta(seconds=1))

    def _expire(self) -> None:
        now = workflow.now()
        for entry in [e for e in self.queued if datetime.fromisoformat(e.deadline) <= now]:
            self.queued.remove(entry)
            behind = self.running.workflow_id if self.running else "the queue"
            waited = (now - datetime.fromisoformat(entry.enqueued_at)).total_seconds()
            self._finish(
                entry,
                "expired",
                f"not started: waited {waited:.0f} s for its turn behind {behind} "
                f"(bound {entry.request.wait_seconds:g} s)",
            )

    def _joinable(self, req: ControlPlaneRequest) -> QueueEntry | None:
        if not _coalesces(req):
            return None
        key = _key(req)
        candidates = [e for e in (self.running, *self.queued) if e is not None]
        if not req.coalesce and workflow.patched(AUTO_START_JOINS_QUEUED_PATCH):
            # An auto-start joins only a request that has not started: the
            # entity learns of a child's end a moment after its callers do, so
            # a "running" entry may already have answered, from before this
            # caller's turn (the seed classifies again after its lock wait).
            candidates = list(self.queued)
        for entry in candidates:
            if _key(entry.request) == key:
                return entry
        return None

    def _ticket(self, entry: QueueEntry, coalesced: bool) -> ControlPlaneTicket:
        position, ahead = place(entry, self.running, self.queued)
        return ControlPlaneTicket(entry, coalesced, position, ahead)

    def _busy(self) -> str:
        parts = []
        if self.running is not None:
            parts.append(f"{self.running.operation} running ({self.running.workflow_id})")
        if self.queued:
            parts.append(
                f"{len(self.queued)} queued ({', '.join(e.operation for e in self.queued)})"
            )
        return "; ".join(parts)

    # -- messages -------------------------------------------------------------------

    @workflow.update
    def submit(self, req: ControlPlaneRequest = _NO_REQUEST) -> ControlPlaneTicket:
        """Queue ``req`` (or join an identical queued/running one); return its ticket.

        The default only lets the validator name a missing request."""
        now = workflow.now()
        # The validator refuses an unusable wait; the clamp only guards requests
        # accepted before it did (their deadline must not overflow a date).
        deadline = now + timedelta(seconds=bounded_queue_wait(req.wait_seconds))
        joined = self._joinable(req)
        if joined is not None:
            joined.waiters += 1
            if joined.state == "queued" and deadline > datetime.fromisoformat(joined.deadline):
                joined.deadline = deadline.isoformat()
                self.changes += 1
            return self._ticket(joined, coalesced=True)
        request_id = workflow.uuid4().hex[:12]
        entry = QueueEntry(
            request_id=request_id,
            workflow_id=f"controlplane/{self.database_id}/{req.operation}/{request_id}",
            operation=req.operation,
            request=req,
            enqueued_at=now.isoformat(),
            deadline=deadline.isoformat(),
        )
        self.queued.append(entry)
        self.changes += 1
        return self._ticket(entry, coalesced=False)

    @submit.validator
    def _validate_submit(self, req: ControlPlaneRequest = _NO_REQUEST) -> None:
        """Refuse an unusable request before it is accepted (no trace in the history).

        A request of the wrong shape (not an object, a field of the wrong
        type, no ``operation``) is refused by the SDK's decoding, naming the
        field; two arguments by Python's call of this validator.
        """
        if req is _NO_REQUEST or not isinstance(req, ControlPlaneRequest):
            raise ApplicationError(
                "submit takes one argument, a request object such as "
                '{"operation": "RunRepair", "operation_input": {}}; got '
                + ("none" if req is _NO_REQUEST else brief(req)),
                type="BadRequest",
            )
        if req.operation not in QUEUED_OPERATIONS:
            raise ApplicationError(
                f"unknown control-plane operation {req.operation!r}: one of "
                + ", ".join(QUEUED_OPERATIONS),
                type="BadRequest",
            )
        child_arg = _child_arg(req)
        if child_arg is None:
            field_name = {"ApplyAll": "apply_all", "RemovePack": "remove_pack"}.get(
                req.operation, "operation_input"
            )
            raise ApplicationError(
                f"{req.operation} request without input: set {field_name} ({{}} for the defaults)",
                type="BadRequest",
            )
        size_problem = request_size_problem(req)
        if size_problem:
            raise ApplicationError(size_problem, type="BadRequest")
        if req.apply_all is not None and req.apply_all.policy not in POLICIES:
            raise ApplicationError(
                f"unknown ApplyAll policy {req.apply_all.policy!r}: one of {', '.join(POLICIES)}",
                type="BadRequest",
            )
        wait_problem = queue_wait_problem(req.wait_seconds)
        if wait_problem:
            raise ApplicationError(wait_problem, type="BadRequest")
        if req.no_queue and (self.running is not None or self.queued):
            raise ApplicationError(
                f"the control plane of database {self.database_id} is busy: {self._busy()}; "
                f"{req.operation} not queued (--no-queue)",
                type="ControlPlaneBusy",
            )

    @workflow.query
    def status(self) -> ControlPlaneQueueStatus:
        """What runs, what waits (in order) and the last finished entries."""
        return ControlPlaneQueueStatus(
            self.database_id, self.running, list(self.queued), list(self.recent)
        )


@workflow.defn(name="RemovePack")
class RemovePackWorkflow(_PhaseRunner):
    """``nexusctl packs remove NAME`` through the queue.

    acquire-lease, then one fenced transaction that retires the pack and
    invalidates the ApplyAll marker, then the connector fleet is told to
    reconcile (it drains the pack's pool).
    """

    operation = "RemovePack"

    @workflow.init
    def __init__(self, inp: RemovePackInput) -> None:
        self._init_phases(["acquire-lease", "remove-pack"])

    @workflow.run
    async def run(self, inp: RemovePackInput) -> ApplyAllResult:
        """Run it; fails (``PhaseFailed``) for an unknown, platform or depended-on pack."""
        await self._start(inp.heartbeat_timeout_seconds)
        previous = await self._phase(
            "remove-pack",
            ControlPlaneActivities.remove_pack,
            RemovePackRequest(self.run_id, self.epoch, inp.name),
        )
        await self._notify_connectors()
        return self._result(
            "completed", f"removed {inp.name} (was {previous}); ApplyAll marker invalidated"
        )


QUEUE_WORKFLOWS = [ControlPlaneEntity, RemovePackWorkflow]
