"""ApplyAll's gate steps, mixed into ``ApplyAllWorkflow`` (no workflow of its own).

Ports, each step a named phase (an activity) of the ApplyAll workflow:

- ``runApplyAllCompletionGates``: four gates, in the seed's order, before
  the completed marker; any unmet gate fails the run (``failed`` marker);
- the deferred formula-view rebuild: ``requireDeferFormulaViewPrecondition``
  (read-only, before any write), the write-ahead ``formula_view_rebuild_owed``
  receipt, its defense-in-depth re-stamp before ``completed``, and
  auto-start's rebuild-debt gates (at entry: refuse every action; after
  completion: refuse to report success while the debt is owed);
- exact candidates: classify (skip only on an exact digest match plus a
  whole-target verify, drift promotes to a full apply), the component-delta
  retry, and the final-verify hook on every path.

Commands these steps add are guarded by the patch :data:`GATES_PATCH`
(histories recorded before it replay on the old path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.controlplane import ControlPlaneActivities
    from activities.controlplane_gates import GateActivities
    from nexuscrm.contracts import ApplyAllInput, PhaseRequest, PlanRequest, VerifyRequest
    from nexuscrm.contracts.controlplane import APPLY_ALL_POLICIES
    from nexuscrm.contracts.gates import (
        CandidateDecisionInfo,
        CandidateRequest,
        DeltaRequest,
        FinalVerifyRequest,
        GateRequest,
        RebuildRequest,
    )
    from nexuscrm.controlplane.gates import COMPLETION_GATES

GATES_PATCH = "apply-all-gates-v1"
"""Patch id: completion gates, defer receipts, rebuild-debt gates, final-verify hook."""

POLICIES = APPLY_ALL_POLICIES

DEFER_PHASES = ["defer-precondition", "mark-rebuild-owed"]
FINAL_PHASES = ["final-verify", *COMPLETION_GATES]


def apply_all_phases(inp: ApplyAllInput, base: list[str]) -> list[str]:
    """The progress list of one ApplyAll: ``base`` plus the phases ``inp`` adds, in run order."""
    out: list[str] = []
    for name in base:
        if name == "classify":
            if inp.policy == "auto_start":
                out.append("rebuild-debt-entry-gate")
            out.append("classify-candidate" if inp.candidate is not None else "classify")
            continue
        if name == "mark-running" and inp.defer_formula_view_rebuild:
            out += DEFER_PHASES
        if name == "mark-completed":
            out += FINAL_PHASES
            if inp.defer_formula_view_rebuild:
                out.append("restamp-rebuild-owed")
        out.append(name)
        if name == "apply-packs" and inp.policy == "exact_candidate":
            out.append("apply-candidate-delta")
    if inp.policy == "auto_start":
        out.append("rebuild-debt-final-gate")
    return out


class ApplyAllGateSteps:
    """The steps; the host class provides ``_phase``, ``_fail``, ``_req``, ``phases``, ``packs``."""

    gated: bool = False
    phases: dict[str, Any]
    packs: list[Any]
    run_id: str
    epoch: int
    marks_failure: bool

    if TYPE_CHECKING:  # provided by _PhaseRunner (which follows this class in the MRO)

        async def _phase(self, name: str, fn: Any, arg: Any, **kw: Any) -> Any: ...

        async def _fail(self, phase: str, error: str) -> None: ...

        def _req(self, phase: str = "", error: str | None = None) -> PhaseRequest: ...

    def _gates_begin(self, inp: ApplyAllInput) -> list[str]:
        """Record the patch decision, validate the new inputs; return the app pack sources.

        Raises a non-retryable ``ApplicationError`` for an unknown policy,
        ``exact_candidate`` without a candidate, or sources given twice.
        """
        if inp.policy not in POLICIES:
            raise ApplicationError(f"unknown policy {inp.policy!r}", non_retryable=True)
        self.gated = workflow.patched(GATES_PATCH)
        if not self.gated:
            if inp.policy == "exact_candidate":
                raise ApplicationError(f"unknown policy {inp.policy!r}", non_retryable=True)
            for name in [*FINAL_PHASES, "rebuild-debt-entry-gate", "rebuild-debt-final-gate"]:
                self.phases.pop(name, None)
            return inp.app_pack_sources
        if inp.policy == "exact_candidate" and inp.candidate is None:
            raise ApplicationError(
                "policy exact_candidate requires a candidate (exact-candidate retry policy "
                "requires an offline candidate): pass --candidate FILE",
                type="BadInput",
                non_retryable=True,
            )
        if inp.candidate is None:
            return inp.app_pack_sources
        if inp.app_pack_sources:
            raise ApplicationError(
                "give app pack sources either as app_pack_sources or in the candidate, not both",
                type="BadInput",
                non_retryable=True,
            )
        return [p.source for p in inp.candidate.packs if p.source]

    async def _rebuild_debt_gate(self, where: str) -> None:
        """Auto-start's rebuild-debt gate: ``entry`` (before any action) or ``final``."""
        await self._phase(
            f"rebuild-debt-{where}-gate", GateActivities.rebuild_debt_gate, self._req(where)
        )

    async def _classify_candidate(self, inp: ApplyAllInput) -> CandidateDecisionInfo:
        assert inp.candidate is not None
        decision: CandidateDecisionInfo = await self._phase(
            "classify-candidate",
            GateActivities.classify_candidate,
            CandidateRequest(
                inp.candidate, inp.policy, inp.include_dev_sample, inp.defer_formula_view_rebuild
            ),
        )
        self.phases["classify-candidate"].detail = f"{decision.action}: {decision.reason}"
        return decision

    async def _final_verify(self, path: str) -> None:
        if self.gated:
            await self._phase("final-verify", GateActivities.final_verify, FinalVerifyRequest(path))

    async def _defer_entry(self) -> None:
        """Read-only precondition, then the write-ahead receipt (before the running marker)."""
        await self._phase("defer-precondition", GateActivities.defer_precondition, self._req())
        await self._phase("mark-rebuild-owed", GateActivities.mark_rebuild_owed, self._req())

    def _rebuild_request(self, inp: ApplyAllInput) -> RebuildRequest:
        return RebuildRequest(
            self.run_id,
            self.epoch,
            "ApplyAll",
            defer_formula_views=inp.defer_formula_view_rebuild,
            settle_rebuild_debt=not inp.defer_formula_view_rebuild,
        )

    def _verify_request(self, inp: ApplyAllInput) -> VerifyRequest:
        return VerifyRequest(
            {p.name: p.payload_hash for p in self.packs},
            views_deferred=inp.defer_formula_view_rebuild,
        )

    async def _check_planned(self, inp: ApplyAllInput) -> None:
        """The plan must be exactly the candidate (a source changed since classify: fail)."""
        if inp.candidate is None:
            return
        want = {p.name: p.digest for p in inp.candidate.packs}
        have = {p.name: p.payload_hash for p in self.packs}
        if want == have:
            return
        diff = sorted(set(want.items()) ^ set(have.items()))
        error = f"the plan no longer matches the exact candidate: {diff}"
        await self._fail("plan-packs", error)
        raise ApplicationError(
            f"ApplyAll failed in phase plan-packs: {error}", type="PhaseFailed", non_retryable=True
        )

    async def _before_completed(self, inp: ApplyAllInput, sources: list[str], path: str) -> None:
        """final-verify hook, completion gates in the seed's order, defer re-stamp."""
        if not self.gated:
            return
        await self._final_verify(path)
        for gate in COMPLETION_GATES:
            await self._phase(
                gate,
                GateActivities.completion_gate,
                GateRequest(self.run_id, self.epoch, gate, sources, inp.include_dev_sample),
            )
        if inp.defer_formula_view_rebuild:
            # Defense in depth: completed is never stamped with the debt invisible.
            await self._phase("restamp-rebuild-owed", GateActivities.mark_rebuild_owed, self._req())

    async def _after_completed(self, inp: ApplyAllInput) -> None:
        """Auto-start never reports success while rebuild debt is owed (marker stays completed)."""
        if self.gated and inp.policy == "auto_start":
            self.marks_failure = False
            await self._rebuild_debt_gate("final")

    async def _run_delta(self, inp: ApplyAllInput, sources: list[str], changed: list[str]) -> None:
        """Component delta: plan, runner init, re-apply only ``changed`` (the run goes on
        with rebuild-derived, ensure-indexes and the whole-target verify)."""
        for name in ("apply-metadata", "run-repair", "apply-packs"):
            self.phases[name].status = "skipped"
        self.packs = await self._phase(
            "plan-packs",
            ControlPlaneActivities.plan_packs,
            PlanRequest(sources, inp.include_dev_sample),
        )
        await self._check_planned(inp)
        await self._phase("runner-init", ControlPlaneActivities.runner_init, self._req())
        await self._phase(
            "apply-candidate-delta",
            GateActivities.apply_candidate_delta,
            DeltaRequest(
                self.run_id, self.epoch, sources, inp.include_dev_sample, self.packs, changed
            ),
        )
