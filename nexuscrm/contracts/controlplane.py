"""Contracts of the control-plane workflows and activities (ApplyAll and siblings).

Plain dataclasses carried by Temporal's JSON payload converter: class, field
names and field order are the wire format of running workflows' histories.

No ``from __future__ import annotations``: the annotations must be real
types, not strings. Workflows decode these inside Temporal's sandbox, whose
``sys.modules`` lacks this module (``nexuscrm.contracts`` is passed through),
so string annotations could not be resolved there (``NameError`` while
decoding arguments).
"""

import math
from dataclasses import dataclass, field

from nexuscrm.contracts.candidate import CandidateSpec

HEARTBEAT_TIMEOUT_RANGE_S = (1.0, 3600.0)
"""Accepted heartbeat timeouts of the control-plane phases, in seconds (inclusive)."""


def heartbeat_timeout_problem(seconds: object) -> str | None:
    """Why ``seconds`` is not a usable phase heartbeat timeout (``None``: it is).

    It must be a finite number within :data:`HEARTBEAT_TIMEOUT_RANGE_S`: a
    negative, zero, NaN, infinite or huge value would start a workflow whose
    first activity can never be scheduled, holding the database's control
    plane until someone terminates it.
    """
    lo, hi = HEARTBEAT_TIMEOUT_RANGE_S
    ok = (
        isinstance(seconds, int | float)
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and lo <= seconds <= hi
    )
    if ok:
        return None
    return f"heartbeat timeout must be {lo:g} to {hi:g} seconds, got {seconds!r}"


APPLY_ALL_POLICIES = ("always_apply", "auto_start", "exact_candidate")
"""ApplyAll's policies: ``always_apply`` (full run), ``auto_start`` (container
start: classify, then skip / apply / halt), ``exact_candidate`` (skip only on
an exact candidate match)."""


@dataclass
class ApplyAllInput:
    """Start arguments of ``ApplyAllWorkflow``.

    policy: ``always_apply`` (operator / deploy pipeline: full run) or
      ``auto_start`` (container start: classify, then skip / apply / halt).
    app_pack_sources: paths (on the worker's machine) of app packs to install:
      a Salesforce DX project folder or a native ``pack.yaml``.
    include_dev_sample: ``None`` lets the worker decide (not in production).
    heartbeat_timeout_seconds: heartbeat timeout of the long phases; a worker
      that dies is noticed this fast.
    defer_formula_view_rebuild: the seed's ``DeferFormulaViewRebuild``: create
      or replace no view (old pods may still serve them); stamps the
      ``formula_view_rebuild_owed`` receipt before any mutation; the
      deployment settles it with RebuildDerived in its activation window.
    candidate: an exact candidate (every pack with its digest; app pack
      sources come from it); with policy ``exact_candidate`` the run skips
      only on an exact digest match plus a whole-target verify, re-applies
      only changed packs (component delta) or runs a full ApplyAll.
    """

    app_pack_sources: list[str] = field(default_factory=list)
    policy: str = "always_apply"
    include_dev_sample: bool | None = None
    heartbeat_timeout_seconds: float = 30.0
    defer_formula_view_rebuild: bool = False
    candidate: CandidateSpec | None = None


@dataclass
class OperationInput:
    """Start arguments of a sibling control-plane workflow (RunRepair, EnsureIndexes ...)."""

    app_pack_sources: list[str] = field(default_factory=list)
    include_dev_sample: bool | None = None
    heartbeat_timeout_seconds: float = 30.0


@dataclass
class PhaseReport:
    """One phase as the ``progress`` query shows it.

    status: pending | running | completed | failed | skipped.
    started_at: ISO-8601 UTC (workflow time); duration_s in seconds.
    """

    name: str
    status: str = "pending"
    started_at: str | None = None
    duration_s: float | None = None
    error: str | None = None
    detail: str | None = None


@dataclass
class PlannedPackInfo:
    """A pack of the plan: name, category, version, payload hash, source."""

    name: str
    category: str
    version: str
    payload_hash: str
    source: str
    objects: int


@dataclass
class PlanRequest:
    """What to plan: app pack sources and the DevSample choice."""

    app_pack_sources: list[str]
    include_dev_sample: bool | None


@dataclass
class PhaseRequest:
    """Common activity input: the run id and lease epoch that fence every write."""

    run_id: str
    epoch: int
    operation: str = "ApplyAll"
    phase: str = ""
    error: str | None = None


@dataclass
class ApplyPacksRequest:
    """apply-packs input: the plan to apply (hashes must still match the sources)."""

    run_id: str
    epoch: int
    app_pack_sources: list[str]
    include_dev_sample: bool | None
    planned: list[PlannedPackInfo]
    only_runtime_required: bool = False


@dataclass
class RepairRequest:
    """run-repair input; ``fail_closed_on_convergence`` is set on the ApplyAll path."""

    run_id: str
    epoch: int
    fail_closed_on_convergence: bool
    l0_only: bool = False


@dataclass
class VerifyRequest:
    """verify input: pack name -> payload hash this run planned."""

    expected_hashes: dict[str, str]
    check_indexes: bool = True
    # A defer apply: views are intentionally the previous generation (their
    # existence and readability are still verified, their definitions are not).
    views_deferred: bool = False


@dataclass
class AutoStartDecisionInfo:
    """auto_start classification: action (skip | apply | halt_for_migration) and reason."""

    action: str
    reason: str


@dataclass
class ApplyAllResult:
    """Outcome of an ApplyAll (or sibling) run.

    status: completed | skipped | partial (ApplySourceConvergence: converged
    but never marked completed; the CLI exits non-zero). A failed run fails
    the workflow instead.
    """

    status: str
    reason: str
    phases: list[PhaseReport]
    packs: list[PlannedPackInfo]
    formula_problems: list[str]
    duration_s: float
