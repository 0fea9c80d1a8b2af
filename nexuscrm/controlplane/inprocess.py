"""ApplyAll's phases in this process, without Temporal: the baseline of
``bench/bench_apply_all.py``.

:func:`apply_all_in_process` calls, in the workflow's order, the same
``nexuscrm`` functions with the same arguments as the activities of an
``always_apply`` ApplyAll (``workflows.controlplane.ApplyAllWorkflow`` with
its gate steps, ``activities.controlplane`` and
``activities.controlplane_gates``); :func:`auto_start_in_process` does the same
for an ``auto_start`` one (entry gate, classification, then skip or the full
apply). What Temporal adds is left out: the control-plane queue, workflow
tasks, activity scheduling, heartbeats, retries and the connector-fleet
signal. Each phase is timed, so a run compares phase by phase with the
workflow's ``progress`` report.

It is a mirror, not the production path: a change to an activity's calls
belongs here too. The bench checks both paths report the same phases and
leave the same tables and ``_System_*`` row counts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import Engine

from nexuscrm import catalog
from nexuscrm.contracts import PlannedPackInfo
from nexuscrm.controlplane import (
    candidate,
    derived,
    gates,
    indexes,
    lease,
    markers,
    metadata,
    packs_apply,
    release,
    repair,
    rowsize,
    verify,
)
from nexuscrm.cutover import CUTOVER_COMPLETED, CUTOVER_RECEIPT_KEY, ensure_cutover_receipt
from nexuscrm.errors import FatalError, VerifyError
from nexuscrm.log import logged_phase
from nexuscrm.packs.model import PackManifest

APPLY_PHASES: tuple[str, ...] = (
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
    "final-verify",
    *gates.COMPLETION_GATES,
    "mark-completed",
)
"""The phases an ``always_apply`` ApplyAll completes, in its order (no defer, no candidate)."""

AUTO_START_SKIP_PHASES: tuple[str, ...] = ("rebuild-debt-entry-gate", "classify", "final-verify")
"""The phases an ``auto_start`` ApplyAll completes when it decides to skip."""


@dataclass
class InProcessRun:
    """What one in-process run did: its status, the seconds of each phase in run order,
    the plan (as the workflow records it) and the formula problems rebuild-derived left."""

    status: str
    reason: str
    phases: dict[str, float] = field(default_factory=dict)
    packs: list[PlannedPackInfo] = field(default_factory=list)
    formula_problems: list[str] = field(default_factory=list)


@dataclass
class FinalVerifyHook:
    """The final-verify hook as a worker's settings give it (``NEXUS_FINAL_VERIFY_*``)."""

    command: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0

    def run(self, path: str) -> str:
        """Run the hook for ``path`` (``skip``, ``apply``); a no-op without a command."""
        if not self.command:
            return "no final-verify hook configured"
        with logged_phase("ApplyAll", "final-verify", path=path):
            return candidate.run_final_verify(
                self.command, {**self.env, "NEXUS_FINAL_VERIFY_PATH": path}, self.timeout_s
            )


class _Timer:
    def __init__(self, run: InProcessRun) -> None:
        self.run = run

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.run.phases[name] = time.perf_counter() - start


def _plan(engine: Engine, sources: Sequence[str], dev: bool) -> list[PackManifest]:
    return packs_apply.load_plan(engine, sources, dev)


def auto_start_decision(
    engine: Engine, app_pack_sources: Sequence[str], include_dev_sample: bool
) -> tuple[str, str]:
    """Auto-start's classification (``controlplane.classify_auto_start``), read-only.

    Returns ``(action, reason)``, action one of ``skip``, ``apply``,
    ``halt_for_migration``: the marker's classification, then the
    completed-marker preflight, rebuild debt and pack drift.
    """
    decision = markers.classify_auto_start(engine)
    if decision.action != markers.AutoStartAction.skip:
        return decision.action.value, decision.reason
    preflight = release.completed_marker_preflight(engine)
    if preflight:
        return "apply", f"completed marker not trusted by this release: {'; '.join(preflight[:3])}"
    if markers.rebuild_owed(engine):
        return (
            "halt_for_migration",
            "formula view rebuild owed from a deferred apply; run rebuild-derived first",
        )
    plan = _plan(engine, app_pack_sources, include_dev_sample)
    drift = verify.verify_packs(engine, verify.expected(plan))
    if drift:
        return "apply", f"completed marker, but packs changed: {'; '.join(drift[:3])}"
    return "skip", decision.reason


def _rebuild_debt_gate(engine: Engine, where: str) -> str:
    """``controlplane.rebuild_debt_gate``: refuse while a formula-view rebuild is owed."""
    if not markers.rebuild_owed(engine):
        return "no formula view rebuild owed"
    raise FatalError(f"formula view rebuild owed ({where} gate); run `nexusctl rebuild-derived`")


def apply_all_in_process(
    engine: Engine,
    app_pack_sources: Sequence[str],
    include_dev_sample: bool,
    *,
    run_id: str | None = None,
    final_verify: FinalVerifyHook | None = None,
    operation: str = "ApplyAll",
) -> InProcessRun:
    """Run an ``always_apply`` ApplyAll's phases (:data:`APPLY_PHASES`) here, in order.

    Each phase makes the calls its activity makes, fenced by the epoch this
    run takes (``run_id``: the lease holder, a new one by default).
    ``include_dev_sample`` is what the worker resolves (``True`` outside
    production). A failure after ``mark-running`` stamps the ``failed``
    marker, as the workflow does, and propagates; verify findings raise
    ``VerifyError``. Returns the completed run with its phase timings.
    """
    run = InProcessRun("completed", "ApplyAll converged")
    _apply(engine, list(app_pack_sources), include_dev_sample, run, run_id, final_verify, operation)
    return run


def _apply(
    engine: Engine,
    sources: list[str],
    dev: bool,
    run: InProcessRun,
    run_id: str | None,
    final_verify: FinalVerifyHook | None,
    operation: str,
) -> None:
    phase = _Timer(run)
    run_id = run_id or uuid.uuid4().hex
    with phase("acquire-lease"):
        metadata.ensure_system_schema(engine)
        epoch = lease.acquire(engine, run_id, operation)

    def mark(status: markers.MarkerStatus, error: str | None = None) -> None:
        with engine.begin() as conn:
            lease.require(conn, epoch)
            proof = (
                release.release_fingerprint() if status == markers.MarkerStatus.completed else None
            )
            markers.mark(conn, status, run_id, operation, error, proof)

    with phase("mark-running"):
        mark(markers.MarkerStatus.running)
    current = "plan-packs"
    try:
        with phase(current), logged_phase("ApplyAll", current):
            plan = _plan(engine, sources, dev)
            packs_apply.validate_against(engine, plan)
            rowsize.check_row_sizes(engine, packs_apply.catalog_of(engine), plan)
            run.packs = packs_apply.summarize(plan)
        current = "apply-metadata"
        with phase(current), logged_phase(operation, current):
            metadata.apply_metadata(engine, epoch)
        current = "run-repair"
        with phase(current), logged_phase("RunRepair", current):
            repair.run_repair(engine, epoch=epoch, fail_closed_on_convergence=True)
        current = "runner-init"
        with phase(current), logged_phase(operation, current):
            catalog.CACHE.get(engine)
        current = "apply-packs"
        with phase(current), logged_phase("ApplyAll", current):
            plan = _plan(engine, sources, dev)
            now = {p.name: p.payload_hash for p in packs_apply.summarize(plan)}
            planned = {p.name: p.payload_hash for p in run.packs}
            if now != planned:
                changed = sorted(set(now.items()) ^ set(planned.items()))
                raise FatalError(f"packs changed since plan-packs: {changed}")
            packs_apply.apply_packs(engine, plan, epoch=epoch)
        current = "verify-cutover"
        with phase(current):
            _verify_cutover(engine, epoch)
        current = "rebuild-derived"
        with phase(current), logged_phase(operation, current):
            r = derived.rebuild_derived(engine, epoch, settle_rebuild_debt=True)
            run.formula_problems = [
                f"{p.object_api_name}.{p.field_api_name}: {p.reason}" for p in r.problems
            ]
        current = "ensure-indexes"
        with phase(current), logged_phase(operation, current, resume_at=0):
            indexes.ensure_indexes(engine, epoch)
        current = "verify"
        with phase(current), logged_phase("ApplyAll", current):
            findings = verify.verify(engine, {p.name: p.payload_hash for p in run.packs})
            if findings:
                raise VerifyError(findings)
        current = "final-verify"
        with phase(current):
            (final_verify or FinalVerifyHook()).run("apply")
        for gate in gates.COMPLETION_GATES:
            current = gate
            with phase(gate), logged_phase("ApplyAll", gate):
                gates.run_gate(engine, gate, lambda: _plan(engine, sources, dev))
        current = "mark-completed"
        with phase(current):
            mark(markers.MarkerStatus.completed)
    except Exception as exc:
        if current != "mark-completed":
            mark(markers.MarkerStatus.failed, f"{current}: {exc}")
        raise


def _verify_cutover(engine: Engine, epoch: int) -> None:
    """``controlplane.verify_cutover``: re-evaluate the receipt; fail closed while pending."""
    with engine.begin() as conn:
        lease.require(conn, epoch)
        ensure_cutover_receipt(conn)
        receipt = markers.read(conn, CUTOVER_RECEIPT_KEY)
    if receipt is None or receipt.status != CUTOVER_COMPLETED:
        why = receipt.last_error if receipt is not None else "no receipt"
        raise FatalError(
            f"WorkItem-only connector cutover is pending ({CUTOVER_RECEIPT_KEY}): {why}"
        )


def auto_start_in_process(
    engine: Engine,
    app_pack_sources: Sequence[str],
    include_dev_sample: bool,
    *,
    final_verify: FinalVerifyHook | None = None,
) -> InProcessRun:
    """Run an ``auto_start`` ApplyAll's phases here: the rebuild-debt entry gate and
    the classification, both read-only; then ``skipped`` (after the final-verify
    hook), a ``FatalError`` for a halt, or the full apply of
    :func:`apply_all_in_process` followed by the rebuild-debt final gate.
    """
    run = InProcessRun("skipped", "")
    phase = _Timer(run)
    with phase("rebuild-debt-entry-gate"):
        _rebuild_debt_gate(engine, "entry")
    with phase("classify"):
        action, reason = auto_start_decision(engine, app_pack_sources, include_dev_sample)
    run.reason = reason
    if action == "skip":
        with phase("final-verify"):
            (final_verify or FinalVerifyHook()).run("skip")
        return run
    if action == "halt_for_migration":
        raise FatalError(f"explicit control-plane migration required before auto start: {reason}")
    run.status = "completed"
    _apply(engine, list(app_pack_sources), include_dev_sample, run, None, final_verify, "ApplyAll")
    with phase("rebuild-debt-final-gate"):
        _rebuild_debt_gate(engine, "final")
    return run
