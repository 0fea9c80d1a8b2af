"""Contracts of ApplyAll's gates, deferred view rebuild and exact candidates.

No ``from __future__ import annotations`` (see ``nexuscrm.contracts.controlplane``).
"""

from dataclasses import dataclass, field

from nexuscrm.contracts.candidate import CandidateSpec
from nexuscrm.contracts.controlplane import PhaseRequest, PlannedPackInfo


@dataclass
class RebuildRequest(PhaseRequest):
    """rebuild-derived input (a ``PhaseRequest``, so earlier payloads still decode).

    defer_formula_views: create or replace no view; assert the required ones exist.
    settle_rebuild_debt: a full rebuild clears the rebuild-owed receipt
      (lease-holding paths: ApplyAll without defer, RebuildDerived,
      ApplySourceConvergence; not InitL0, whose rebuild stands for the seed's
      partial ``RebuildDerivedL0``).
    """

    defer_formula_views: bool = False
    settle_rebuild_debt: bool = True


@dataclass
class GateRequest:
    """One completion gate (``nexuscrm.controlplane.gates.COMPLETION_GATES``) of a run."""

    run_id: str
    epoch: int
    gate: str
    app_pack_sources: list[str]
    include_dev_sample: bool | None


@dataclass
class CandidateRequest:
    """classify-candidate input: the candidate, the run's policy and options."""

    candidate: CandidateSpec
    policy: str
    include_dev_sample: bool | None
    defer_formula_view_rebuild: bool = False


@dataclass
class CandidateDecisionInfo:
    """What an exact-candidate run does.

    action: ``skip`` (exact digest match and whole-target verify passed),
      ``delta`` (completed marker, only installed packs' digests changed:
      re-apply those), ``apply`` (full ApplyAll) or ``halt_for_migration``
      (auto-start on a legacy database).
    changed: the packs a ``delta`` re-applies.
    """

    action: str
    reason: str
    changed: list[str] = field(default_factory=list)


@dataclass
class DeltaRequest:
    """apply-candidate-delta input: the plan and the packs whose digest changed."""

    run_id: str
    epoch: int
    app_pack_sources: list[str]
    include_dev_sample: bool | None
    planned: list[PlannedPackInfo]
    changed: list[str]


@dataclass
class FinalVerifyRequest:
    """final-verify input: which path ran (``skip``, ``apply`` or ``delta``)."""

    path: str
