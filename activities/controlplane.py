"""Control-plane activities. Each is idempotent (it may run twice) and fenced
by the lease epoch; domain ``FatalError``s become non-retryable failures.

They are synchronous (SQLAlchemy is), so the worker runs them on a thread
pool; long ones heartbeat so a dead worker is noticed within the heartbeat
timeout and the retry lands on a live one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sqlalchemy import Engine
from temporalio import activity

from activities.common import fatal_is_final, heartbeat
from nexuscrm import catalog
from nexuscrm.contracts import (
    ApplyPacksRequest,
    AutoStartDecisionInfo,
    PhaseRequest,
    PlannedPackInfo,
    PlanRequest,
    RepairRequest,
    VerifyRequest,
)
from nexuscrm.contracts.controlplane_queue import RemovePackRequest
from nexuscrm.contracts.gates import RebuildRequest
from nexuscrm.controlplane import (
    derived,
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
from nexuscrm.packs.model import Category
from nexuscrm.settings import Settings


class ControlPlaneActivities:
    """All control-plane activities for one database (``engine``)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings

    def _dev_sample(self, requested: bool | None) -> bool:
        """DevSample for this run: off in production, whatever was asked (fail closed)."""
        if requested and self.settings.is_production:
            raise FatalError(
                f"include_dev_sample=true (--dev-sample) is refused in production "
                f"(NEXUS_ENV={self.settings.env}): the DevSample pack never applies there"
            )
        return (not self.settings.is_production) if requested is None else requested

    def _require_this_database(self) -> None:
        """Refuse (non-retryable) a run whose workflow id names another database."""
        expected = self.settings.controlplane_workflow_id
        running = activity.info().workflow_id or ""
        # The queue's children run as controlplane/<database id>/<operation>/<request id>.
        if running != expected and not running.startswith(expected + "/"):
            raise FatalError(
                f"this worker serves database {self.settings.database_id} (workflow id "
                f"{expected}); refusing workflow {running}: start it with the id {expected}, "
                "or run a worker with that database's NEXUS_DATABASE_URL / NEXUS_DATABASE_ID"
            )

    @activity.defn(name="controlplane.acquire_lease")
    @fatal_is_final
    def acquire_lease(self, req: PhaseRequest) -> int:
        """Check this run is for this worker's database, then take a new lease epoch.

        The workflow id names the database (``controlplane/<database id>``); a
        run whose id names another database is refused (non-retryable) so it
        can never converge the wrong database. Creates the system schema first.
        """
        self._require_this_database()
        metadata.ensure_system_schema(self.engine)
        return lease.acquire(self.engine, req.run_id, req.operation)

    @activity.defn(name="controlplane.classify_auto_start")
    @fatal_is_final
    def classify_auto_start(self, req: PlanRequest) -> AutoStartDecisionInfo:
        """Port of ApplyAllIfNeeded's classification, plus pack drift and rebuild debt.

        Read-only (it runs before the lease is taken, so a halted or skipped
        auto-start writes nothing; a missing table reads as "not there"). A
        completed marker is trusted only when the completed-marker preflight
        passes (it proves this release, the system schema and stamped steps
        are complete, connector dependency identities and the WorkItem-only
        cutover hold: ``release.completed_marker_preflight``), no planned pack
        differs from what is installed (the seed's pending source-revision
        plan) and no formula-view rebuild is owed.
        """
        self._require_this_database()
        decision = markers.classify_auto_start(self.engine)
        if decision.action != markers.AutoStartAction.skip:
            return AutoStartDecisionInfo(decision.action.value, decision.reason)
        preflight = release.completed_marker_preflight(self.engine)
        if preflight:
            return AutoStartDecisionInfo(
                "apply", f"completed marker not trusted by this release: {'; '.join(preflight[:3])}"
            )
        if markers.rebuild_owed(self.engine):
            return AutoStartDecisionInfo(
                "halt_for_migration",
                "formula view rebuild owed from a deferred apply; run rebuild-derived first",
            )
        plan = packs_apply.load_plan(
            self.engine, req.app_pack_sources, self._dev_sample(req.include_dev_sample)
        )
        drift = verify.verify_packs(self.engine, verify.expected(plan))
        if drift:
            return AutoStartDecisionInfo(
                "apply", f"completed marker, but packs changed: {'; '.join(drift[:3])}"
            )
        return AutoStartDecisionInfo("skip", decision.reason)

    @activity.defn(name="controlplane.mark")
    @fatal_is_final
    def mark(self, req: PhaseRequest) -> None:
        """Write the ApplyAll marker: ``req.phase`` is the status (running, failed, ...)."""
        with self.engine.begin() as conn:
            lease.require(conn, req.epoch)
            status = markers.MarkerStatus(req.phase)
            # completed is written in the transaction that checks the lease: no
            # finalization-ready window to recover (see nexuscrm.controlplane.markers).
            # A completed marker records the release it proves (auto-start's preflight).
            proof = (
                release.release_fingerprint() if status == markers.MarkerStatus.completed else None
            )
            markers.mark(conn, status, req.run_id, req.operation, req.error, proof)

    @activity.defn(name="controlplane.verify_cutover")
    @fatal_is_final
    def verify_cutover(self, req: PhaseRequest) -> str:
        """WorkItem-only cutover precondition, fail closed (``VerifyConnectorExecutionProtocols``).

        Runs after apply-packs: re-evaluates the receipt (the packs may have
        completed the claim schema since RunRepair wrote it ``pending``) and
        raises ``FatalError`` naming the reason while it is not ``completed``,
        so ApplyAll never completes (and auto-start never skips) past it.
        """
        with self.engine.begin() as conn:
            lease.require(conn, req.epoch)
            ensure_cutover_receipt(conn)
            receipt = markers.read(conn, CUTOVER_RECEIPT_KEY)
        if receipt is None or receipt.status != CUTOVER_COMPLETED:
            why = receipt.last_error if receipt is not None else "no receipt"
            raise FatalError(
                f"WorkItem-only connector cutover is pending ({CUTOVER_RECEIPT_KEY}): {why}; "
                "not completing ApplyAll"
            )
        return "WorkItem-only cutover receipt completed"

    @activity.defn(name="controlplane.plan_packs")
    @fatal_is_final
    def plan_packs(self, req: PlanRequest) -> list[PlannedPackInfo]:
        """Load, validate and order every pack of this run (read-only)."""
        with logged_phase("ApplyAll", "plan-packs"):
            plan = packs_apply.load_plan(
                self.engine, req.app_pack_sources, self._dev_sample(req.include_dev_sample)
            )
            packs_apply.validate_against(self.engine, plan)
            rowsize.check_row_sizes(self.engine, packs_apply.catalog_of(self.engine), plan)
            return packs_apply.summarize(plan)

    @activity.defn(name="controlplane.apply_metadata")
    @fatal_is_final
    def apply_metadata(self, req: PhaseRequest) -> str:
        """ApplyMetadata; returns a one-line summary."""
        with logged_phase(req.operation, "apply-metadata"):
            r = metadata.apply_metadata(self.engine, req.epoch)
        return f"tables created {r.tables_created}, rows written {r.rows_written}"

    @activity.defn(name="controlplane.run_repair")
    @fatal_is_final
    def run_repair(self, req: RepairRequest) -> str:
        """RunRepair; returns step outcomes as one line (failed best-effort steps named)."""
        with logged_phase("RunRepair", "run-repair"):
            report = repair.run_repair(
                self.engine,
                epoch=req.epoch,
                fail_closed_on_convergence=req.fail_closed_on_convergence,
                steps=repair.L0_REPAIR_STEPS if req.l0_only else repair.REPAIR_STEPS,
            )
        parts = [
            f"{s.name}={s.status}" + (f"({s.changed})" if s.changed else "") for s in report.steps
        ]
        return ", ".join(parts)

    @activity.defn(name="controlplane.runner_init")
    @fatal_is_final
    def runner_init(self, req: PhaseRequest) -> str:
        """Load (or validate) the metadata cache against the version stamp."""
        with logged_phase(req.operation, "runner-init"):
            cat = catalog.CACHE.get(self.engine)
        return f"metadata version {cat.version}, {len(cat.objects)} objects"

    @activity.defn(name="controlplane.apply_packs")
    @fatal_is_final
    def apply_packs(self, req: ApplyPacksRequest) -> str:
        """ApplyPacks for the plan; heartbeats once per pack.

        Fails closed (non-retryable) when a source changed since plan-packs:
        the run must apply exactly what it planned and verified.
        """
        with logged_phase("ApplyAll", "apply-packs"):
            plan = packs_apply.load_plan(
                self.engine, req.app_pack_sources, self._dev_sample(req.include_dev_sample)
            )
            if req.only_runtime_required:
                plan = [p for p in plan if p.category == Category.PlatformCore]
            now = {p.name: p.payload_hash for p in packs_apply.summarize(plan)}
            planned = {p.name: p.payload_hash for p in req.planned}
            if now != planned:
                changed = sorted(set(now.items()) ^ set(planned.items()))
                raise FatalError(f"packs changed since plan-packs: {changed}")

            def beat(result: packs_apply.PackApplyResult) -> None:
                heartbeat(asdict(result))

            results = packs_apply.apply_packs(self.engine, plan, epoch=req.epoch, on_pack=beat)
        created = sum(r.tables_created for r in results)
        added = sum(r.columns_added for r in results)
        rows = sum(r.rows_written for r in results)
        widened = sum(r.columns_widened for r in results)
        more = f", columns widened {widened}" if widened else ""
        return (
            f"{len(results)} packs: tables created {created}, columns added {added}, "
            f"rows {rows}{more}"
        )

    @activity.defn(name="controlplane.rebuild_derived")
    @fatal_is_final
    def rebuild_derived(self, req: RebuildRequest) -> list[str]:
        """RebuildDerived; returns formula problems as ``Object.Field: reason`` lines.

        Under ``defer_formula_views`` no view is created or replaced (the
        required ones must exist); a full rebuild with ``settle_rebuild_debt``
        clears the rebuild-owed receipt (this activity is always fenced).
        """
        with logged_phase(req.operation, "rebuild-derived"):
            r = derived.rebuild_derived(
                self.engine,
                req.epoch,
                defer_formula_views=req.defer_formula_views,
                settle_rebuild_debt=req.settle_rebuild_debt,
            )
        return [f"{p.object_api_name}.{p.field_api_name}: {p.reason}" for p in r.problems]

    @activity.defn(name="controlplane.ensure_indexes")
    @fatal_is_final
    def ensure_indexes(self, req: PhaseRequest) -> str:
        """EnsureIndexes; heartbeats progress and resumes from the last heartbeat on retry."""
        details = activity.info().heartbeat_details
        start_at = int(details[0]) if details else 0

        def beat(done: int, total: int, name: str) -> None:
            heartbeat(done, total, name)

        with logged_phase(req.operation, "ensure-indexes", resume_at=start_at):
            r = indexes.ensure_indexes(self.engine, req.epoch, start_at=start_at, progress=beat)
        return f"{r.total} standard indexes: {r.created} created, {r.existing} present"

    @activity.defn(name="controlplane.verify")
    @fatal_is_final
    def verify(self, req: VerifyRequest) -> str:
        """Verify; any finding raises ``VerifyError`` (non-retryable) listing them."""
        with logged_phase("ApplyAll", "verify"):
            findings = verify.verify(
                self.engine,
                req.expected_hashes,
                check_indexes=req.check_indexes,
                check_view_definitions=not req.views_deferred,
            )
        if findings:
            raise VerifyError(findings)
        return "no findings"

    @activity.defn(name="controlplane.remove_pack")
    @fatal_is_final
    def remove_pack(self, req: RemovePackRequest) -> str:
        """``nexusctl packs remove``: retire the pack and invalidate the marker, fenced.

        One transaction: lease check, pack ``removed``, ApplyAll marker
        ``invalidated``. Returns the pack's previous status; ``PackError``
        (unknown, platform or depended-on pack) is final.
        """
        return packs_apply.remove_pack(self.engine, req.name, epoch=req.epoch, run_id=req.run_id)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity method, for ``Worker(activities=...)``."""
        return [
            self.acquire_lease,
            self.classify_auto_start,
            self.mark,
            self.verify_cutover,
            self.plan_packs,
            self.apply_metadata,
            self.run_repair,
            self.runner_init,
            self.apply_packs,
            self.rebuild_derived,
            self.ensure_indexes,
            self.verify,
            self.remove_pack,
        ]
