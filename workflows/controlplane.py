"""Control-plane workflows: ApplyAll and its sibling operations.

The database's control-plane queue (``workflows.controlplane_queue``, the
seed's ``GET_LOCK('nexuscrm_controlplane_apply')``) runs each of them as its
child ``controlplane/<database id>/<operation>/<request id>``, one at a time;
a run started directly under ``controlplane/<database id>`` (before the
queue) still works. Each run first takes a new lease epoch; every mutating
activity checks it before it writes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TemporalTimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.controlplane import ControlPlaneActivities
    from nexuscrm.contracts import (
        ApplyAllInput,
        ApplyAllResult,
        ApplyPacksRequest,
        OperationInput,
        PhaseReport,
        PhaseRequest,
        PlannedPackInfo,
        PlanRequest,
        RepairRequest,
        VerifyRequest,
        heartbeat_timeout_problem,
    )
    from nexuscrm.contracts.gates import RebuildRequest
    from nexuscrm.controlplane.gates import COMPLETION_GATES

from workflows.apply_all_gates import POLICIES, ApplyAllGateSteps, apply_all_phases

PHASE_KEY = SearchAttributeKey.for_keyword("NexusPhase")
DATABASE_KEY = SearchAttributeKey.for_keyword("NexusDatabase")
OPERATION_KEY = SearchAttributeKey.for_keyword("NexusOperation")

# Transient database faults retry with backoff; FatalErrors arrive non-retryable.
PHASE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=8,
)

SHORT = timedelta(seconds=60)
# start-to-close per phase: generous upper bounds; heartbeats catch dead workers sooner.
PHASE_TIMEOUTS: dict[str, timedelta] = {
    "plan-packs": timedelta(minutes=5),
    "apply-metadata": timedelta(minutes=15),
    "run-repair": timedelta(minutes=30),
    "runner-init": timedelta(minutes=5),
    "apply-packs": timedelta(minutes=60),
    "rebuild-derived": timedelta(minutes=30),
    "ensure-indexes": timedelta(hours=2),
    "verify": timedelta(minutes=30),
}


def database_id_of(workflow_id: str) -> str:
    """The database id a control-plane workflow id names.

    ``controlplane/<database id>`` (the queue entity, or a run started
    directly) or ``controlplane/<database id>/<operation>/<request id>`` (an
    operation the queue runs as its child); database ids never hold ``/``.
    """
    return workflow_id.removeprefix("controlplane/").split("/")[0]


_LOCAL_FAILURES = (ApplicationError, TemporalTimeoutError)
"""How a local phase's failure arrives (a remote one's is an ``ActivityError``)."""


def _cause(err: BaseException) -> str:
    """The innermost failure message (what the activity raised)."""
    while isinstance(err, ActivityError) and err.cause is not None:
        err = err.cause
    return str(err)


class _PhaseRunner:
    """Shared phase bookkeeping: progress report, search attribute, failure marker."""

    operation = "ApplyAll"

    # Inherited by every control-plane workflow (Temporal finds handlers on bases).
    @workflow.query
    def progress(self) -> list[PhaseReport]:
        """Phases with status, start, duration, error and detail."""
        return list(self.phases.values())

    def _init_phases(self, names: list[str]) -> None:
        self.phases: dict[str, PhaseReport] = {n: PhaseReport(name=n) for n in names}
        self.run_id = ""
        self.epoch = 0
        self.heartbeat = timedelta(seconds=30)
        self.packs: list[PlannedPackInfo] = []
        self.formula_problems: list[str] = []
        self.marks_failure = False

    async def _phase(self, name: str, fn: Any, arg: Any, **kw: Any) -> Any:
        report = self.phases.setdefault(name, PhaseReport(name=name))
        report.status = "running"
        start = workflow.now()
        report.started_at = start.isoformat()
        workflow.upsert_search_attributes([PHASE_KEY.value_set(name)])
        opts: dict[str, Any] = {
            "start_to_close_timeout": PHASE_TIMEOUTS.get(name, SHORT),
            "retry_policy": PHASE_RETRY,
        }
        # Every remote phase heartbeats (a ticker in the activity), so a dead
        # worker is noticed within the heartbeat timeout whatever the phase.
        opts["heartbeat_timeout"] = self.heartbeat
        opts.update(kw)
        try:
            if name in LOCAL_PHASES and workflow.patched(LOCAL_PHASES_PATCH):
                result = await self._local_first(name, fn, arg, opts)
            else:
                result = await workflow.execute_activity_method(fn, arg, **opts)
        except (ActivityError, *_LOCAL_FAILURES) as err:
            # A remote phase fails with an ActivityError around the cause; a
            # local one resolves with the cause itself (its ApplicationError, or
            # the timeout).
            report.status = "failed"
            report.error = _cause(err)
            report.duration_s = (workflow.now() - start).total_seconds()
            workflow.logger.error("phase failed: %s: %s", name, report.error)
            await self._fail(name, report.error)
            raise ApplicationError(
                f"{self.operation} failed in phase {name}: {report.error}",
                type="PhaseFailed",
                non_retryable=True,
            ) from err
        report.status = "completed"
        report.duration_s = (workflow.now() - start).total_seconds()
        if isinstance(result, str):
            report.detail = result
        return result

    async def _local_first(self, name: str, fn: Any, arg: Any, opts: dict[str, Any]) -> Any:
        """A short phase: one local attempt; if it fails and may be retried, the
        phase runs as an activity with the phase's retries (patch
        :data:`LOCAL_PHASES_PATCH`).

        The local attempt runs inside the workflow task: no server round trip,
        no heartbeat (a worker that dies in it is noticed by the workflow task's
        timeout and the next worker runs it again), and queries wait for it.
        Its retries would be invisible too, so a phase that fails is retried
        as a normal activity: its attempts and last error show in ``nexusctl
        progress`` and the Web UI as any phase's do. A non-retryable failure
        (a ``FatalError``) fails the phase at once.
        """
        try:
            return await workflow.execute_local_activity_method(
                fn,
                arg,
                start_to_close_timeout=opts["start_to_close_timeout"],
                retry_policy=LOCAL_ATTEMPT,
            )
        except _LOCAL_FAILURES as err:
            if isinstance(err, ApplicationError) and err.non_retryable:
                raise
            workflow.logger.warning(
                "phase %s: local attempt failed, retried as an activity: %s", name, err
            )
        return await workflow.execute_activity_method(fn, arg, **opts)

    async def _fail(self, phase: str, error: str) -> None:
        if not self.marks_failure or not self.epoch:
            return
        try:
            await workflow.execute_activity_method(
                ControlPlaneActivities.mark,
                PhaseRequest(
                    self.run_id, self.epoch, self.operation, "failed", f"{phase}: {error}"
                ),
                start_to_close_timeout=SHORT,
                retry_policy=PHASE_RETRY,
            )
        except ActivityError as err:  # the original failure matters more
            workflow.logger.error("could not persist failed marker: %s", _cause(err))

    async def _start(self, heartbeat_s: float) -> None:
        self._begin(heartbeat_s)
        await self._acquire()

    def _begin(self, heartbeat_s: float) -> None:
        """Run id, heartbeat timeout and search attributes: no activity, nothing written."""
        problem = heartbeat_timeout_problem(heartbeat_s)
        if problem:  # before any command: an unschedulable phase would hold the database
            raise ApplicationError(problem, non_retryable=True)
        self.run_id = workflow.info().run_id
        self.heartbeat = timedelta(seconds=heartbeat_s)
        database_id = database_id_of(workflow.info().workflow_id)
        workflow.upsert_search_attributes(
            [OPERATION_KEY.value_set(self.operation), DATABASE_KEY.value_set(database_id)]
        )

    async def _acquire(self) -> None:
        """acquire-lease: create the system schema if needed, take a new lease epoch."""
        self.epoch = await self._phase(
            "acquire-lease",
            ControlPlaneActivities.acquire_lease,
            PhaseRequest(workflow.info().run_id, 0, self.operation),
        )

    def _req(self, phase: str = "", error: str | None = None) -> PhaseRequest:
        return PhaseRequest(self.run_id, self.epoch, self.operation, phase, error)

    def _skip_rest(self) -> None:
        for report in self.phases.values():
            if report.status == "pending":
                report.status = "skipped"

    def _result(self, status: str, reason: str) -> ApplyAllResult:
        started = workflow.info().start_time
        return ApplyAllResult(
            status=status,
            reason=reason,
            phases=list(self.phases.values()),
            packs=self.packs,
            formula_problems=self.formula_problems,
            duration_s=(workflow.now() - started).total_seconds(),
        )

    async def _plan(self, sources: list[str], dev: bool | None) -> None:
        self.packs = await self._phase(
            "plan-packs", ControlPlaneActivities.plan_packs, PlanRequest(sources, dev)
        )

    async def _apply_packs(self, sources: list[str], dev: bool | None, l0: bool = False) -> None:
        await self._phase(
            "apply-packs",
            ControlPlaneActivities.apply_packs,
            ApplyPacksRequest(self.run_id, self.epoch, sources, dev, self.packs, l0),
        )

    async def _notify_connectors(self) -> None:
        """Ask the connector fleet to reconcile (packs may have changed); no-op when none runs."""
        database_id = database_id_of(workflow.info().workflow_id)
        handle = workflow.get_external_workflow_handle(f"connector-fleet/{database_id}")
        try:
            await handle.signal("reconcile")
        except Exception as err:  # no fleet running: it reconciles when it starts
            workflow.logger.info("connector fleet not signalled: %s", err)

    async def _verify_cutover(self) -> None:
        """The WorkItem-only cutover precondition after apply-packs (seed order), fail closed."""
        if workflow.patched(CUTOVER_PRECONDITION_PATCH):
            await self._phase("verify-cutover", ControlPlaneActivities.verify_cutover, self._req())
        elif "verify-cutover" in self.phases:
            self.phases["verify-cutover"].status = "skipped"

    async def _invalidate(self) -> None:
        """withControlPlaneMutationLock: a sibling mutation invalidates the completed marker."""
        await self._phase(
            "invalidate-marker", ControlPlaneActivities.mark, self._req("invalidated")
        )


# Patch ids (tests/test_replay.py replays histories recorded before them).
CLASSIFY_FIRST_PATCH = "controlplane-classify-before-lease"
"""auto_start classifies read-only before acquire-lease; the policy is checked first."""
CUTOVER_PRECONDITION_PATCH = "controlplane-cutover-precondition"
"""verify-cutover after apply-packs (ApplyAll, ApplySourceConvergence)."""

LOCAL_PHASES_PATCH = "controlplane-short-phases-local"
"""The short phases (:data:`LOCAL_PHASES`) run as local activities."""

LOCAL_ATTEMPT = RetryPolicy(maximum_attempts=1)
"""A local phase's one attempt; its retries run as an activity (``_local_first``)."""

LOCAL_PHASES = frozenset(
    {
        "classify",
        "classify-candidate",
        "acquire-lease",
        "mark-running",
        "runner-init",
        "verify-cutover",
        "final-verify",
        "defer-precondition",
        "mark-rebuild-owed",
        "restamp-rebuild-owed",
        "rebuild-debt-entry-gate",
        "rebuild-debt-final-gate",
        "invalidate-marker",
        "mark-completed",
        *COMPLETION_GATES,
    }
)
"""Phases that run as local activities (patch :data:`LOCAL_PHASES_PATCH`).

Each is a marker write, a lease, a read-only check or a cache load: a few
milliseconds of work whose round trip through the server (workflow task,
activity task, workflow task: about 16 ms each on a 2-core box) was most of
its cost; a chain of local activities runs inside one workflow task. One
local attempt, with the phase's start-to-close timeout; a failure that may
be retried runs the phase again as an activity with the phase's retry
policy (``_PhaseRunner._local_first``), so a retrying phase shows its
attempts as before. A local activity has no heartbeat: a worker that dies
in one is noticed by its workflow task's timeout and the phase runs again
on the next worker (every one of them is safe to repeat, as a retry is).
The phases that do the work (plan, metadata, repair, packs, derived,
indexes, verify) stay activities that heartbeat, on any worker of the task
queue.
"""

APPLY_ALL_PHASES = [
    "classify",
    "acquire-lease",
    "mark-running",
    "plan-packs",
    "apply-metadata",
    "run-repair",
    "runner-init",
    "apply-packs",
    "verify-cutover",
    "rebuild-derived",
    "ensure-indexes",
    "verify",
    "mark-completed",
]


@workflow.defn(name="ApplyAll")
class ApplyAllWorkflow(ApplyAllGateSteps, _PhaseRunner):
    """Port of ``ApplyAllWithOptions`` / ``ApplyAllIfNeededWithOptions``.

    Phases (activities): [rebuild-debt-entry-gate, classify |
    classify-candidate] (read-only, before the lease), acquire-lease,
    [defer-precondition, mark-rebuild-owed], mark-running, plan-packs,
    apply-metadata, run-repair (fail closed on convergence-critical steps),
    runner-init, apply-packs (or apply-candidate-delta), verify-cutover,
    rebuild-derived, ensure-indexes, verify,
    final-verify, the completion gates, [restamp-rebuild-owed],
    mark-completed, [rebuild-debt-final-gate]. Any phase failure stamps the
    failed marker with the error and fails the workflow (``PhaseFailed``).
    Query ``progress`` for phases. The gate steps live in
    ``workflows.apply_all_gates``.
    """

    operation = "ApplyAll"

    @workflow.init
    def __init__(self, inp: ApplyAllInput) -> None:
        self._init_phases(apply_all_phases(inp, APPLY_ALL_PHASES))

    @workflow.run
    async def run(self, inp: ApplyAllInput) -> ApplyAllResult:
        """Run ApplyAll; returns the report, or fails with the phase and error."""
        classify_first = workflow.patched(CLASSIFY_FIRST_PATCH)
        if classify_first:
            # Decide before writing: the policy first, then read-only gates and
            # classification; only an apply takes the lease (and creates schema).
            if inp.policy not in POLICIES:
                raise ApplicationError(
                    f"unknown policy {inp.policy!r} (use one of {', '.join(POLICIES)})",
                    type="UnknownPolicy",
                    non_retryable=True,
                )
            self._begin(inp.heartbeat_timeout_seconds)
        else:
            await self._start(inp.heartbeat_timeout_seconds)
        sources = self._gates_begin(inp)
        delta: list[str] | None = None
        if self.gated and inp.policy == "auto_start":
            await self._rebuild_debt_gate("entry")
        if self.gated and inp.candidate is not None:
            decision = await self._classify_candidate(inp)
            if decision.action == "skip" and inp.policy != "always_apply":
                await self._final_verify("skip")
                self._skip_rest()
                return self._result("skipped", decision.reason)
            if decision.action == "halt_for_migration":
                self._halt(decision.reason)
            if decision.action == "delta":
                delta = decision.changed
        elif inp.policy == "auto_start":
            decision = await self._phase(
                "classify",
                ControlPlaneActivities.classify_auto_start,
                PlanRequest(inp.app_pack_sources, inp.include_dev_sample),
            )
            self.phases["classify"].detail = f"{decision.action}: {decision.reason}"
            if decision.action == "skip":
                await self._final_verify("skip")
                self._skip_rest()
                return self._result("skipped", decision.reason)
            if decision.action == "halt_for_migration":
                self._halt(decision.reason)
        elif "classify" in self.phases:
            self.phases["classify"].status = "skipped"
        if classify_first:
            await self._acquire()
        if self.gated and inp.defer_formula_view_rebuild:
            await self._defer_entry()
        # Write-ahead: running is stamped before any mutation; from here on a
        # failure leaves a failed marker so the next auto-start re-applies.
        await self._phase("mark-running", ControlPlaneActivities.mark, self._req("running"))
        self.marks_failure = True
        if delta is not None:
            await self._run_delta(inp, sources, delta)
        else:
            await self._plan(sources, inp.include_dev_sample)
            if self.gated:
                await self._check_planned(inp)
            await self._phase("apply-metadata", ControlPlaneActivities.apply_metadata, self._req())
            await self._phase(
                "run-repair",
                ControlPlaneActivities.run_repair,
                RepairRequest(self.run_id, self.epoch, fail_closed_on_convergence=True),
            )
            await self._phase("runner-init", ControlPlaneActivities.runner_init, self._req())
            await self._apply_packs(sources, inp.include_dev_sample)
            await self._verify_cutover()
        self.formula_problems = await self._phase(
            "rebuild-derived",
            ControlPlaneActivities.rebuild_derived,
            self._rebuild_request(inp) if self.gated else self._req(),
        )
        if self.formula_problems:
            self.phases["rebuild-derived"].detail = (
                f"{len(self.formula_problems)} formula(s) left out: "
                + "; ".join(self.formula_problems)
            )
        await self._phase("ensure-indexes", ControlPlaneActivities.ensure_indexes, self._req())
        await self._phase("verify", ControlPlaneActivities.verify, self._verify_request(inp))
        await self._before_completed(inp, sources, "delta" if delta is not None else "apply")
        await self._phase("mark-completed", ControlPlaneActivities.mark, self._req("completed"))
        workflow.upsert_search_attributes([PHASE_KEY.value_set("completed")])
        await self._after_completed(inp)
        await self._notify_connectors()
        self._skip_rest()  # the phases of the path not taken (delta vs full)
        return self._result("completed", "ApplyAll converged")

    def _halt(self, reason: str) -> None:
        self._skip_rest()
        raise ApplicationError(
            "explicit control-plane migration required before auto start: "
            f"{reason}; run `nexusctl apply-all` once",
            type="HaltForMigration",
            non_retryable=True,
        )


@workflow.defn(name="RunRepair")
class RunRepairWorkflow(_PhaseRunner):
    """Port of ``RunRepairWithLock``: invalidate the marker, then RunRepair (no gate)."""

    operation = "RunRepair"

    @workflow.init
    def __init__(self, inp: OperationInput) -> None:
        self._init_phases(["acquire-lease", "invalidate-marker", "run-repair"])

    @workflow.run
    async def run(self, inp: OperationInput) -> ApplyAllResult:
        """Run the operation."""
        await self._start(inp.heartbeat_timeout_seconds)
        await self._invalidate()
        await self._phase(
            "run-repair",
            ControlPlaneActivities.run_repair,
            RepairRequest(self.run_id, self.epoch, fail_closed_on_convergence=False),
        )
        return self._result("completed", "RunRepair done; run ApplyAll before auto-start trusts it")


@workflow.defn(name="RebuildDerived")
class RebuildDerivedWorkflow(_PhaseRunner):
    """Port of ``RebuildDerivedWithLock``: runner init, full view rebuild (settles rebuild debt)."""

    operation = "RebuildDerived"

    @workflow.init
    def __init__(self, inp: OperationInput) -> None:
        self._init_phases(["acquire-lease", "invalidate-marker", "runner-init", "rebuild-derived"])

    @workflow.run
    async def run(self, inp: OperationInput) -> ApplyAllResult:
        """Run the operation."""
        await self._start(inp.heartbeat_timeout_seconds)
        await self._invalidate()
        await self._phase("runner-init", ControlPlaneActivities.runner_init, self._req())
        self.formula_problems = await self._phase(
            "rebuild-derived", ControlPlaneActivities.rebuild_derived, self._req()
        )
        return self._result("completed", "views rebuilt")


@workflow.defn(name="EnsureIndexes")
class EnsureIndexesWorkflow(_PhaseRunner):
    """Port of ``EnsureIndexesWithLock``."""

    operation = "EnsureIndexes"

    @workflow.init
    def __init__(self, inp: OperationInput) -> None:
        self._init_phases(["acquire-lease", "invalidate-marker", "ensure-indexes"])

    @workflow.run
    async def run(self, inp: OperationInput) -> ApplyAllResult:
        """Run the operation."""
        await self._start(inp.heartbeat_timeout_seconds)
        await self._invalidate()
        await self._phase("ensure-indexes", ControlPlaneActivities.ensure_indexes, self._req())
        return self._result("completed", "standard indexes ensured")


@workflow.defn(name="ApplyPacks")
class ApplyPacksWorkflow(_PhaseRunner):
    """Port of ``ApplyPacksWithLock``: plan, runner init, apply packs."""

    operation = "ApplyPacks"

    @workflow.init
    def __init__(self, inp: OperationInput) -> None:
        self._init_phases(
            ["acquire-lease", "invalidate-marker", "plan-packs", "runner-init", "apply-packs"]
        )

    @workflow.run
    async def run(self, inp: OperationInput) -> ApplyAllResult:
        """Run the operation."""
        await self._start(inp.heartbeat_timeout_seconds)
        await self._invalidate()
        await self._plan(inp.app_pack_sources, inp.include_dev_sample)
        await self._phase("runner-init", ControlPlaneActivities.runner_init, self._req())
        await self._apply_packs(inp.app_pack_sources, inp.include_dev_sample)
        await self._notify_connectors()
        return self._result("completed", "packs applied")


@workflow.defn(name="ApplySourceConvergence")
class ApplySourceConvergenceWorkflow(_PhaseRunner):
    """Port of ``ApplySourceConvergence``: the operator's partial path.

    metadata, repair (no fail-closed gate), packs, rebuild, indexes; no verify
    and no completed marker (it invalidates it first).
    """

    operation = "ApplySourceConvergence"

    @workflow.init
    def __init__(self, inp: OperationInput) -> None:
        self._init_phases(
            ["acquire-lease", "invalidate-marker", "plan-packs", "apply-metadata", "run-repair",
             "runner-init", "apply-packs", "verify-cutover", "rebuild-derived", "ensure-indexes"]
        )  # fmt: skip

    @workflow.run
    async def run(self, inp: OperationInput) -> ApplyAllResult:
        """Run the operation."""
        await self._start(inp.heartbeat_timeout_seconds)
        await self._invalidate()
        await self._plan(inp.app_pack_sources, inp.include_dev_sample)
        await self._phase("apply-metadata", ControlPlaneActivities.apply_metadata, self._req())
        await self._phase(
            "run-repair",
            ControlPlaneActivities.run_repair,
            RepairRequest(self.run_id, self.epoch, fail_closed_on_convergence=False),
        )
        await self._phase("runner-init", ControlPlaneActivities.runner_init, self._req())
        await self._apply_packs(inp.app_pack_sources, inp.include_dev_sample)
        await self._verify_cutover()
        self.formula_problems = await self._phase(
            "rebuild-derived", ControlPlaneActivities.rebuild_derived, self._req()
        )
        await self._phase("ensure-indexes", ControlPlaneActivities.ensure_indexes, self._req())
        # A partial apply is never completed: the marker stays invalidated and
        # the CLI exits non-zero on this status (as the seed's cmd/setup does).
        return self._result("partial", "source convergence done; not marked bootstrapped")


@workflow.defn(name="InitL0")
class InitL0Workflow(_PhaseRunner):
    """Port of ``InitL0``: the application-neutral substrate only.

    System schema and metadata, repair, the runtime-required (PlatformCore)
    packs, their views, verify. No app pack, no DevSample, no broad indexes.
    """

    operation = "InitL0"

    @workflow.init
    def __init__(self, inp: OperationInput) -> None:
        self._init_phases(
            ["acquire-lease", "invalidate-marker", "plan-packs", "apply-metadata", "run-repair",
             "runner-init", "apply-packs", "rebuild-derived", "verify"]
        )  # fmt: skip

    @workflow.run
    async def run(self, inp: OperationInput) -> ApplyAllResult:
        """Run the operation."""
        await self._start(inp.heartbeat_timeout_seconds)
        await self._invalidate()
        await self._plan([], False)
        self.packs = [p for p in self.packs if p.category == "PlatformCore"]
        await self._phase("apply-metadata", ControlPlaneActivities.apply_metadata, self._req())
        await self._phase(
            "run-repair",
            ControlPlaneActivities.run_repair,
            RepairRequest(self.run_id, self.epoch, fail_closed_on_convergence=False, l0_only=True),
        )
        await self._phase("runner-init", ControlPlaneActivities.runner_init, self._req())
        await self._apply_packs([], False, l0=True)
        # The seed's RebuildDerivedL0 is partial: it never settles rebuild debt.
        self.formula_problems = await self._phase(
            "rebuild-derived",
            ControlPlaneActivities.rebuild_derived,
            RebuildRequest(self.run_id, self.epoch, self.operation, settle_rebuild_debt=False),
        )
        await self._phase(
            "verify",
            ControlPlaneActivities.verify,
            VerifyRequest({p.name: p.payload_hash for p in self.packs}, check_indexes=False),
        )
        return self._result("completed", "L0 substrate initialized")


CONTROLPLANE_WORKFLOWS = [
    ApplyAllWorkflow,
    RunRepairWorkflow,
    RebuildDerivedWorkflow,
    EnsureIndexesWorkflow,
    ApplyPacksWorkflow,
    ApplySourceConvergenceWorkflow,
    InitL0Workflow,
]
