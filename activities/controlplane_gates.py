"""ApplyAll's gate activities: completion gates, the deferred view rebuild's
receipt and checks, exact candidates and the final-verify hook.

Thin adapters over ``nexuscrm.controlplane.gates``, ``derived``, ``markers``
and ``candidate``; every write is fenced by the lease epoch, every check is
read-only. Domain ``FatalError``s become non-retryable failures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sqlalchemy import Engine
from temporalio import activity

from activities.common import fatal_is_final, heartbeat
from nexuscrm.contracts import PhaseRequest
from nexuscrm.contracts.gates import (
    CandidateDecisionInfo,
    CandidateRequest,
    DeltaRequest,
    FinalVerifyRequest,
    GateRequest,
)
from nexuscrm.controlplane import candidate, derived, gates, lease, markers, packs_apply
from nexuscrm.errors import FatalError
from nexuscrm.log import logged_phase
from nexuscrm.packs.model import PackManifest
from nexuscrm.settings import Settings


class RebuildDebtOwedError(FatalError):
    """Auto-start met an outstanding formula-view rebuild debt."""


class GateActivities:
    """The gate activities for one database (``engine``)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings

    def _dev_sample(self, requested: bool | None) -> bool:
        return (not self.settings.is_production) if requested is None else requested

    def _plan(self, sources: list[str], dev: bool | None) -> list[PackManifest]:
        return packs_apply.load_plan(self.engine, sources, self._dev_sample(dev))

    @activity.defn(name="controlplane.completion_gate")
    @fatal_is_final
    def completion_gate(self, req: GateRequest) -> str:
        """One gate of ``runApplyAllCompletionGates`` (read-only); returns its summary."""
        with logged_phase("ApplyAll", req.gate):
            return gates.run_gate(
                self.engine,
                req.gate,
                lambda: self._plan(req.app_pack_sources, req.include_dev_sample),
            )

    @activity.defn(name="controlplane.defer_precondition")
    @fatal_is_final
    def defer_precondition(self, req: PhaseRequest) -> str:
        """``requireDeferFormulaViewPrecondition``: read-only; refuses with the seed's message."""
        with logged_phase("ApplyAll", "defer-precondition"):
            derived.require_defer_precondition(self.engine)
        return "every required view exists and is readable"

    @activity.defn(name="controlplane.mark_rebuild_owed")
    @fatal_is_final
    def mark_rebuild_owed(self, req: PhaseRequest) -> str:
        """Stamp the ``formula_view_rebuild_owed`` receipt (write-ahead or re-stamp), fenced."""
        with self.engine.begin() as conn:
            lease.require(conn, req.epoch)
            markers.mark_rebuild_owed(conn, req.run_id)
        return "formula_view_rebuild_owed=pending"

    @activity.defn(name="controlplane.rebuild_debt_gate")
    @fatal_is_final
    def rebuild_debt_gate(self, req: PhaseRequest) -> str:
        """Auto-start's rebuild-debt check, at entry (``phase='entry'``) or after completion.

        Raises ``RebuildDebtOwedError`` with the seed's message while the
        receipt is ``pending``.
        """
        if not markers.rebuild_owed(self.engine):
            return "no formula view rebuild owed"
        if req.phase == "entry":
            raise RebuildDebtOwedError(
                "formula view rebuild owed from a deferred apply; auto-start refuses every "
                "action while the debt is outstanding — run `nexusctl rebuild-derived` (inside "
                "the deployment's quiesced window) to settle it"
            )
        raise RebuildDebtOwedError(
            "formula view rebuild owed after auto-start apply; run `nexusctl rebuild-derived` "
            "to rebuild views and settle the receipt before serving"
        )

    @activity.defn(name="controlplane.classify_candidate")
    @fatal_is_final
    def classify_candidate(self, req: CandidateRequest) -> CandidateDecisionInfo:
        """Check the candidate against its sources, then classify (skip / delta / apply / halt).

        Read-only. ``CandidateError`` / ``CandidateMismatchError`` refuse the
        run before it writes anything.
        """
        with logged_phase("ApplyAll", "classify-candidate"):
            spec = candidate.validate_spec(req.candidate)
            plan = self._plan(candidate.sources(spec), req.include_dev_sample)
            candidate.check_plan(spec, plan)
            action, reason, changed = candidate.classify(
                self.engine, spec, req.policy, req.defer_formula_view_rebuild
            )
        return CandidateDecisionInfo(action, reason, changed)

    @activity.defn(name="controlplane.apply_candidate_delta")
    @fatal_is_final
    def apply_candidate_delta(self, req: DeltaRequest) -> str:
        """Component delta: re-apply only ``req.changed`` of the planned packs; heartbeats per pack.

        Fails closed (non-retryable) when a source changed since plan-packs.
        """
        with logged_phase("ApplyAll", "apply-candidate-delta"):
            plan = self._plan(req.app_pack_sources, req.include_dev_sample)
            now = {p.name: p.payload_hash for p in packs_apply.summarize(plan)}
            planned = {p.name: p.payload_hash for p in req.planned}
            if now != planned:
                changed = sorted(set(now.items()) ^ set(planned.items()))
                raise FatalError(f"packs changed since plan-packs: {changed}")
            unknown = sorted(set(req.changed) - set(now))
            if unknown:
                raise FatalError(f"component delta names packs not in the plan: {unknown}")
            delta = [p for p in plan if p.name in set(req.changed)]

            def beat(result: packs_apply.PackApplyResult) -> None:
                heartbeat(asdict(result))

            results = packs_apply.apply_packs(self.engine, delta, epoch=req.epoch, on_pack=beat)
        return f"{len(results)} changed pack(s) re-applied: {', '.join(p.name for p in delta)}"

    @activity.defn(name="controlplane.final_verify")
    @fatal_is_final
    def final_verify(self, req: FinalVerifyRequest) -> str:
        """The final-verify hook (``NEXUS_FINAL_VERIFY_COMMAND``); a no-op when unset.

        The command gets ``NEXUS_DATABASE_URL``, ``NEXUS_DATABASE_ID`` and
        ``NEXUS_FINAL_VERIFY_PATH`` (``skip``, ``apply`` or ``delta``).
        """
        command = self.settings.final_verify_command
        if not command:
            return "no final-verify hook configured"
        with logged_phase("ApplyAll", "final-verify", path=req.path):
            return candidate.run_final_verify(
                command,
                {
                    "NEXUS_DATABASE_URL": self.settings.database_url,
                    "NEXUS_DATABASE_ID": self.settings.database_id,
                    "NEXUS_FINAL_VERIFY_PATH": req.path,
                },
                self.settings.final_verify_timeout_seconds,
            )

    def all(self) -> list[Callable[..., Any]]:
        """Every activity method, for ``Worker(activities=...)``."""
        return [
            self.completion_gate,
            self.defer_precondition,
            self.mark_rebuild_owed,
            self.rebuild_debt_gate,
            self.classify_candidate,
            self.apply_candidate_delta,
            self.final_verify,
        ]
