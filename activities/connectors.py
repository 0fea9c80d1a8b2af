"""Connector runtime activities: plan a reconcile, claim a batch, process it, release it.

``claim`` is short and runs as a local activity; ``process`` heartbeats and
keeps the batch's leases alive while it works (a lease keeper on the
ticker's chore thread, independent of item boundaries), so no item is reclaimed
while its call still runs; ``release`` hands back the leases of a batch whose
process failed or timed out (its worker died), so they are claimable at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from temporalio import activity
from temporalio.common import MetricMeter

from activities.common import (
    BatchLoad,
    expect_progress,
    fatal_is_final,
    keep_alive,
    progress,
    raise_if_cancelled,
    stop_requested,
)
from activities.metrics import NexusMetrics
from nexuscrm.connectors import handoff, knobs, queue, reconcile, serving
from nexuscrm.connectors.desired import desired_packs
from nexuscrm.connectors.finishing import BatchOutcome
from nexuscrm.connectors.lease_keeper import LeaseKeeper
from nexuscrm.connectors.processor import Processor
from nexuscrm.contracts import (
    BatchResult,
    ClaimedLease,
    ClaimRequest,
    InboundWorkerConfig,
    ProcessRequest,
    ReconcileOutcome,
    ReconcileRequest,
    ReleaseRequest,
)
from nexuscrm.contracts.visibility import running_supervisors_query
from nexuscrm.db.dialect import describe_error
from nexuscrm.errors import NexusError
from nexuscrm.log import log
from nexuscrm.settings import Settings

CLAIM_BATCHES = 4
"""Profile batches one claim takes at once (capped at :data:`CLAIM_MAX`).

Every batch costs a claim local activity, a process activity (~45 ms round
trip) and three workflow activations, whatever its size, while an item costs
well under a millisecond: the profile's 5 / 25 are sized for per-item
transactions. Claiming several of them at once keeps the profiles' ratios
and the per-pack processing budget, with a quarter of the round trips."""
CLAIM_MAX = 100
"""Largest claim a profile batch is scaled up to (a bulk worker's 100 stays 100)."""

FENCE_CHECK_EVERY_S = 1.0
"""Least interval between two reads of the pack's claim fence by one process activity."""


def claim_size(batch_size: int) -> int:
    """Items one claim asks for: ``CLAIM_BATCHES`` profile batches, at most ``CLAIM_MAX``."""
    return max(batch_size, min(batch_size * CLAIM_BATCHES, CLAIM_MAX))


def claim_spec(c: InboundWorkerConfig, lease_owner: str, claim_key: str = "") -> queue.ClaimSpec:
    """The claim of one batch for the worker ``c`` (its profile, budget and fence)
    under ``lease_owner``: the claim local activity's and each further claim of
    a process stint."""
    return queue.ClaimSpec(
        installed_pack_id=c.install_id,
        queue_classes=c.queue_classes,
        preferred_queue_classes=c.preferred_queue_classes,
        batch_size=claim_size(c.batch_size),
        lease_owner=lease_owner,
        lease_seconds=c.lease_seconds,
        max_processing_rows=c.max_processing_rows,
        generation=c.generation,
        fencing_token=c.fencing_token,
        claim_key=claim_key,
    )


class ConnectorActivities:
    """Activities of the connector runtime for one database."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        config: knobs.ConnectorKnobs,
        metrics: NexusMetrics | None = None,
        load: BatchLoad | None = None,
    ) -> None:
        self.engine = engine
        # The nexus_* metrics (no-op without a metrics endpoint).
        self.metrics = metrics or NexusMetrics(MetricMeter.noop)
        self.settings = settings
        self.knobs = config
        # Batches running in this process (background identity work yields to them).
        self.load = load or BatchLoad()
        # Frozen before the process starts, as the seed's SetRuntimeServingSelection.
        self.selection = (
            serving.load(settings.serving_selection) if settings.serving_selection else None
        )
        # The handoff role refuses to start without a selection (fail closed).
        handoff.require_serving_selection(settings.connector_role, self.selection)
        self.modes = handoff.supported_modes(settings.connector_role)
        # The role decides which invocation modes a selected route may use.
        self.resolvers = reconcile.Resolvers(
            list_packs=functools.partial(desired_packs, supported_modes=self.modes)
        )
        self.processor = Processor(
            engine,
            flow_deadline=config.flow_deadline,
            role=settings.connector_role,
            selection=self.selection,
            on_woken=self.metrics.woken if self.metrics.enabled else None,
        )

    @activity.defn(name="connectors.reconcile_plan")
    @fatal_is_final
    def reconcile_plan(self, req: ReconcileRequest) -> ReconcileOutcome:
        """One reconcile as typed outcomes (``nexuscrm.connectors.reconcile.plan_reconcile``).

        Database errors are outcomes, not raised; only a bad ``mode`` raises.
        """
        return self.plan(req, take_fences=True)

    def plan(self, req: ReconcileRequest, *, take_fences: bool) -> ReconcileOutcome:
        """:meth:`reconcile_plan`'s work; ``take_fences=False`` takes no claim fence
        (the fleet's periodic pass, whose plan may be discarded: ``activities.fleet``)."""
        plan = reconcile.plan_reconcile(
            self.engine,
            selection=self.selection,
            knobs=self.knobs,
            mode=req.mode,
            running=req.running,
            fleet_epoch=req.fleet_epoch,
            resolvers=self.resolvers,
            take_fences=take_fences,
        )
        for key, reason in plan.blocked.items():
            log.error("connector pack not served", pack=key, reason=reason)
        self.processor.forget()
        return plan

    @activity.defn(name="connectors.claim")
    @fatal_is_final
    def claim(self, req: ClaimRequest) -> list[ClaimedLease]:
        """Claim one batch for the worker; returns (work id, lease token) pairs only.

        Keyed (``req.claim_key``): run again after the worker died between the
        claim's commit and the recording of its result, it returns the same
        items (their leases still live) rather than claiming others and leaving
        those to wait out their lease.

        Nothing (``[]``) once the worker shuts down: a batch claimed now could
        not be processed here, and its leases would wait out their expiry.
        Claims under the config's fence (generation, fencing token). Raises
        ``ClaimSchemaMissing`` (non-retryable) on a missing table/column and
        ``FenceSuperseded`` (non-retryable) when the worker's pool generation
        was superseded: the worker fails and takes nothing.
        """
        if stop_requested():
            return []
        c = req.config
        started = time.monotonic()
        leases = queue.claim_leases(self.engine, claim_spec(c, req.lease_owner, req.claim_key))
        self.metrics.claimed(c.install_id, time.monotonic() - started, len(leases))
        return [ClaimedLease(work_id, token) for work_id, token in leases]

    @activity.defn(name="connectors.process")
    @fatal_is_final
    def process(self, req: ProcessRequest) -> BatchResult:
        """Load the claimed items and run them, keeping their leases alive meanwhile;
        then, given the worker's ``lease_owner``, claim and run further batches
        for up to ``NEXUS_CONNECTOR_STINT_SECONDS`` (a stint). Returns the sum of
        the batches' results.

        A stint ends at an empty claim, once its time is up (checked between
        batches: a batch started is run to its end), at worker shutdown or
        cancellation, when the worker's fence is superseded, or when its next
        claim fails (a database error, ``FenceSuperseded``, ``ClaimSchemaMissing``:
        the batches run are returned, and the worker's own claim meets the
        error next, to retry it or fail). Its further
        claims are the worker's own (:func:`claim_spec`: profile, budget,
        fence, owner), so the seed's one-batch-at-a-time worker is kept; only
        the round trips to the server between its batches go (about 100 ms of
        a 2-core box's wall time each, whatever the batch's size). A stint's
        blocked waits and wake keys are returned together at its end (the
        items a parent's link wakes are already ``pending`` then); a stint
        that fails has every lease its owner still holds handed back by the
        workflow (``connectors.release`` with the owner).

        The leases are extended every third of the lease from the ticker's
        chore thread (:class:`LeaseKeeper` via ``keep_alive``), whatever an item or an
        external call takes, for as long as the batch makes progress: an item
        or a batch read at least once per flow deadline plus a lease (the flow
        deadline bounds every external call; without one, the start-to-close
        bounds the batch). Past that, heartbeats and lease extension stop
        together and the server times the attempt out (``expect_progress``);
        the workflow then hands the leases back (``connectors.release``).

        Worker shutdown (or cancellation): no further item starts; the leases
        of the items not started are handed back at once (``released``), so
        they are claimed again now, not when the lease expires. Only items
        held under the worker's claim fence are loaded; leases are extended
        under it; once its pool generation is superseded (checked at most once
        a second, between items), no further item starts.
        """
        leases = [(lease.work_id, lease.lease_token) for lease in req.leases]
        c = req.config
        fence = c.fencing_token
        keeper = LeaseKeeper(self.engine, leases, c.lease_seconds, fencing_token=fence)
        keep_alive(keeper.tick, keeper.every_seconds)
        deadline = self.knobs.flow_deadline
        expect_progress(
            deadline.total_seconds() + keeper.lease_seconds if deadline is not None else None
        )
        started = time.monotonic()
        stint = self.settings.connector_stint_seconds if req.lease_owner else 0.0
        items = queue.load_claimed(self.engine, leases, fence)
        fenced = {"at": time.monotonic(), "out": False}

        def superseded() -> bool:
            # A newer pool generation took the pack's claim fence and revoked these
            # leases: start no further item (its flow would be refused at finish,
            # and an external call in it would repeat under the new pool).
            now = time.monotonic()
            if not fenced["out"] and now - fenced["at"] >= FENCE_CHECK_EVERY_S:
                fenced["at"] = now
                fenced["out"] = not queue.fence_holds(
                    self.engine, c.install_id, c.generation, c.fencing_token
                )
            return bool(fenced["out"])

        def stopping() -> bool:
            return stop_requested() or superseded()

        total: BatchOutcome | None = None
        while True:
            with self.load.batch():
                outcome = self.processor.process(items, on_item=progress, should_stop=stopping)
            self.metrics.batch_ended(items, outcome)
            if total is None:
                total = outcome
            else:
                total.merge(outcome)
            if outcome.released or time.monotonic() - started >= stint or stopping():
                break
            claimed_at = time.monotonic()
            try:
                items = queue.claim(self.engine, claim_spec(c, req.lease_owner))
            except (SQLAlchemyError, NexusError) as exc:
                # The batches run are committed: return them (their waits and wakes
                # notified); the worker's own claim meets this again, and retries it
                # or fails the worker (a superseded fence, a missing table).
                log.warning("stint ended: its next claim failed", error=describe_error(exc))
                break
            self.metrics.claimed(c.install_id, time.monotonic() - claimed_at, len(items))
            if not items:
                break
            keeper.add([(i.work_id, i.lease_token) for i in items])
            progress()
        if total.released:
            log.warning("batch cut short; leases handed back", released=total.released)
        raise_if_cancelled()  # the finished items are committed, the rest handed back
        return total.result()

    @activity.defn(name="connectors.release")
    @fatal_is_final
    def release(self, req: ReleaseRequest) -> int:
        """Hand back the leases of a batch whose process activity failed or timed out
        (with ``req.lease_owner``: every lease of the pack its worker still holds,
        the further batches of its stint too).

        Only leases still held by exactly these tokens are released
        (``queue.release_leases``: pending again, an ``abandoned`` attempt with
        ``CauseCode=req.cause_code``, as the stale reclaim records a dead
        worker's); finished or reclaimed items are left alone. Returns how
        many were released.
        """
        leases = [(lease.work_id, lease.lease_token) for lease in req.leases]
        items = queue.load_claimed(self.engine, leases)
        if req.lease_owner:  # and what its stint claimed under the worker's owner id
            known = {item.work_id for item in items}
            owned = queue.load_owned(self.engine, req.install_id, req.lease_owner)
            items += [item for item in owned if item.work_id not in known]
        return len(queue.release_leases(self.engine, items, cause_code=req.cause_code))

    @activity.defn(name="connectors.drain_orphan_pools")
    async def drain_orphan_pools(self, database_id: str) -> list[str]:
        """Drain every running PackSupervisor of ``database_id``; returns their ids.

        Run once when a fleet starts fresh (not after continue-as-new): pools
        outlive their fleet by design (ABANDON), so a fleet that was terminated
        and started again would otherwise serve each pack twice.
        """
        client = activity.client()
        query = running_supervisors_query(database_id)
        drained: list[str] = []
        if query is None:  # no pool of an unquotable id can run: ids are slugs
            return drained
        async for wf in client.list_workflows(query):
            await client.get_workflow_handle(wf.id, run_id=wf.run_id).signal("drain")
            drained.append(wf.id)
        if drained:
            log.warning("orphaned connector pools drained", pools=drained)
        return drained

    @activity.defn(name="connectors.closed_pools")
    async def closed_pools(self, workflow_ids: list[str]) -> list[str]:
        """The PackSupervisor ids among ``workflow_ids`` whose latest run is not running.

        One describe per id (strongly consistent, unlike a visibility list); an id
        the server does not know counts as closed. The fleet rebuilds these pools
        (the seed's reconcile rebuilds a pool whose handle is done).
        """
        from temporalio.client import WorkflowExecutionStatus
        from temporalio.service import RPCError, RPCStatusCode

        client = activity.client()
        closed: list[str] = []
        for wf_id in workflow_ids:
            try:
                desc = await client.get_workflow_handle(wf_id).describe()
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
                closed.append(wf_id)
                continue
            if desc.status != WorkflowExecutionStatus.RUNNING:
                closed.append(wf_id)
        if closed:
            log.warning("connector pools closed", pools=closed)
        return closed

    def all(self) -> list[Callable[..., Any]]:
        """Every activity method, for ``Worker(activities=...)``."""
        return [
            self.reconcile_plan,
            self.claim,
            self.process,
            self.release,
            self.drain_orphan_pools,
            self.closed_pools,
        ]
