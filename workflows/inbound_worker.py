"""``InboundWorkerWorkflow``: one worker of a pack's pool (port of ``connector_inbound.Worker``).

Claim a batch (local activity), process it (activity, heartbeating and
keeping the batch's leases alive; under patch ``process-stint`` it claims and
runs further batches itself for up to ``NEXUS_CONNECTOR_STINT_SECONDS``),
notify identity waits of what it blocked or resolved (beside the next claim,
patch ``notify-beside-claim``), sleep until ``wake`` or the idle timer
(backed off while claims come back empty, patch ``idle-backoff``),
continue-as-new before history grows large.
A batch whose process activity failed or timed out (its worker died) has its
leases handed back at once (``connectors.release``), so a crash costs the
heartbeat timeout, not the lease. Started as a child by
``PackSupervisorWorkflow`` (``workflows.pack_supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from activities.connectors import ConnectorActivities
    from activities.identity import IdentityActivities
    from nexuscrm.contracts import ClaimRequest as _ClaimRequest
    from nexuscrm.contracts import (
        InboundWorkerConfig,
        ProcessRequest,
        ReleaseRequest,
        WaitNotifyRequest,
    )

ACTIVITY_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)


CLAIM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
)
"""The claim's bounded retries (~15 s of backoff): a claim that keeps failing fails the
worker, and the supervisor restarts it with backoff (visible as a restart). Local
activities record only their result, so this policy is free to change (no patch)."""


RELEASE_PATCH = "release-abandoned-batch"
"""Patch id: a batch whose process activity failed hands its leases back at once
(``connectors.release``)."""


NOTIFY_BESIDE_PATCH = "notify-beside-claim"
"""Patch id: a batch's identity notify runs beside the next claim, not before it, so
the children its links woke (already ``pending``) are claimed without waiting for it."""

IDLE_BACKOFF_PATCH = "idle-backoff"
"""Patch id: each further empty claim doubles the idle timer, from ``idle_seconds`` up
to ``idle_max_seconds``; a claimed batch or a ``wake`` resets it. The fleet's periodic
reconcile wakes a pool with claimable work and an idle worker (``backlog-wake``)."""

STINT_PATCH = "process-stint"
"""Patch id: the process activity gets the worker's lease owner id, so it may claim
and run further batches itself for up to ``NEXUS_CONNECTOR_STINT_SECONDS`` (fewer
round trips per event); a failed one has every lease of that owner handed back."""

NOTIFIES_IN_FLIGHT = 2
"""Notifies one worker keeps running beside its claims; the next waits for the oldest."""


def process_heartbeat_timeout(config: InboundWorkerConfig) -> timedelta:
    """The process activity's heartbeat timeout: the config's, or (when that is not
    positive) ``max(5 s, lease / 2)``."""
    seconds = config.heartbeat_timeout_seconds
    if seconds <= 0:
        seconds = max(5.0, config.lease_seconds / 2)
    return timedelta(seconds=seconds)


def worker_workflow_id(config: InboundWorkerConfig) -> str:
    """``connector/<db>/<pack>/<install>/<fp8>/worker-<n>``: ids of the previous build.

    Kept for histories recorded before patch ``pool-lifecycle-v2``; a v2
    supervisor names its workers ``<supervisor id>/r<incarnation>/worker-<n>``
    (unique per pool generation).
    """
    return (
        f"connector/{config.database_id}/{config.namespace}/{config.install_id}/"
        f"{config.fingerprint[:8]}/worker-{config.ordinal}"
    )


# Not sandboxed: the sandbox's work on each activation (its import hooks and
# restricted proxies, and decoding the claim's leases through them) is paid
# per batch, two activations a batch. Unsandboxed, the worker's CPU per event
# fell 7-8 % in back-to-back runs (docs/benchmarks.md). The code stays
# deterministic (no I/O, clocks or randomness but ``workflow.*``); the replay
# test guards it, as for IdentityWait.
@workflow.defn(name="InboundWorker", sandboxed=False)
class InboundWorkerWorkflow:
    """Port of ``connector_inbound.Worker``: claim, process, wait, repeat.

    Signals: ``wake`` (work may be claimable now), ``drain`` (stop claiming;
    return once the current batch is done). Returns ``"drained"``.
    """

    @workflow.init
    def __init__(self, config: InboundWorkerConfig) -> None:
        self.woken = False
        self.draining = False
        self.batches = 0
        self.empty_claims = 0  # in a row; the idle timer doubles with each (idle-backoff)
        self.notifies: list[asyncio.Task[None]] = []

    @workflow.signal
    def wake(self) -> None:
        """Claimable work may exist: cut the idle wait short (and its backoff)."""
        self.woken = True
        self.empty_claims = 0

    def idle_timeout(self, config: InboundWorkerConfig, backoff: bool) -> timedelta:
        """The idle timer after an empty claim: ``idle_seconds``, doubled per earlier
        empty claim in a row up to ``idle_max_seconds`` (``backoff``, patch
        ``idle-backoff``), once the run is ``idle_backoff_grace_seconds`` old (a
        rebuilt pool's workers keep polling while the old pool drains); counts
        this empty claim."""
        seconds = config.idle_seconds
        age = (workflow.now() - workflow.info().start_time).total_seconds()
        if backoff and age >= config.idle_backoff_grace_seconds:
            cap = max(config.idle_seconds, config.idle_max_seconds)
            seconds = min(cap, config.idle_seconds * 2 ** min(self.empty_claims, 30))
            self.empty_claims += 1
        return timedelta(seconds=seconds)

    @workflow.signal
    def drain(self) -> None:
        """Stop claiming; finish the batch in hand and return."""
        self.draining = True

    async def _release(
        self, leases: list[Any], err: ActivityError, install_id: str = "", owner: str = ""
    ) -> None:
        """Hand back the leases of a batch whose process activity ended without a result.

        The attempt failed or timed out (its worker died: the heartbeat timeout),
        so its items are claimable now instead of when their leases expire. Only
        leases still held by these tokens are released (an item the batch
        finished, or another worker reclaimed, is left alone); each released
        item gets an ``abandoned`` attempt with ``CauseCode`` ``activity-timeout``
        or ``activity-failed``. With ``owner`` (patch ``process-stint``), every
        lease of the pack ``install_id`` still held by that owner id goes back
        too: the further batches the activity claimed. A failed release is
        logged: the leases then expire as before.
        """
        cause = "activity-timeout" if isinstance(err.cause, ActivityTimeout) else "activity-failed"
        try:
            released = await workflow.execute_activity_method(
                ConnectorActivities.release,
                ReleaseRequest(leases, cause, install_id, owner),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
            )
        except ActivityError as release_err:
            workflow.logger.warning("batch leases not handed back (they expire): %s", release_err)
        else:
            workflow.logger.warning(
                "batch abandoned (%s), %d leases handed back: %s", cause, released, err
            )

    async def _notify(
        self, config: InboundWorkerConfig, blocked: list[Any], wake_keys: list[str]
    ) -> None:
        """After the batch committed: register its blocked items' waits, wake resolved waits.

        A failure is logged and left to recovery (a blocked row without a live
        wait gets one at the next fleet reconcile) and to the waits' own probes.
        """
        try:
            await workflow.execute_activity_method(
                IdentityActivities.notify,
                WaitNotifyRequest(config.database_id, blocked, wake_keys),
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
            )
        except ActivityError as err:
            workflow.logger.warning("identity wait notify failed; recovery covers it: %s", err)

    async def _notify_beside(
        self, config: InboundWorkerConfig, blocked: list[Any], wake_keys: list[str]
    ) -> None:
        """Start the batch's notify and return: it runs beside the next claim.

        At most :data:`NOTIFIES_IN_FLIGHT` run at once (the oldest is awaited
        first); all are awaited before continue-as-new and before returning.
        """
        self.notifies = [n for n in self.notifies if not n.done()]
        if len(self.notifies) >= NOTIFIES_IN_FLIGHT:
            await self.notifies.pop(0)
        self.notifies.append(asyncio.ensure_future(self._notify(config, blocked, wake_keys)))

    async def _notifies_done(self) -> None:
        """Wait for the notifies still running (before continue-as-new or return)."""
        notifies, self.notifies = self.notifies, []
        for n in notifies:
            await n

    @workflow.run
    async def run(self, config: InboundWorkerConfig) -> str:
        """Loop until drained; continue-as-new every N batches or when history is large."""
        owner = f"{workflow.info().workflow_id}/{workflow.info().run_id}"
        backoff = workflow.patched(IDLE_BACKOFF_PATCH)
        claims = 0
        while not self.draining:
            self.woken = False
            claims += 1
            leases = await workflow.execute_local_activity_method(
                ConnectorActivities.claim,
                # Keyed: re-run on replay after a crash, it returns what it leased.
                _ClaimRequest(config, owner, f"{owner}#{claims}"),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=CLAIM_RETRY,
            )
            if leases:
                # The stint's owner id: blank before STINT_PATCH (one batch per activity).
                stint_owner = owner if workflow.patched(STINT_PATCH) else ""
                try:
                    result = await workflow.execute_activity_method(
                        ConnectorActivities.process,
                        ProcessRequest(config, leases, stint_owner),
                        start_to_close_timeout=timedelta(minutes=30),
                        heartbeat_timeout=process_heartbeat_timeout(config),
                        # Never retried with the same leases: if the process died, its
                        # leases are handed back (or, before RELEASE_PATCH, expire and
                        # the stale reclaim records the abandoned attempt).
                        retry_policy=RetryPolicy(maximum_attempts=1),
                    )
                except ActivityError as err:
                    # A cancelled batch is still running its item in hand and hands
                    # the rest back itself: only a failed or timed-out one is released.
                    if not isinstance(err.cause, CancelledError) and workflow.patched(
                        RELEASE_PATCH
                    ):
                        await self._release(leases, err, config.install_id, stint_owner)
                    else:
                        workflow.logger.warning("batch abandoned, leases will expire: %s", err)
                else:
                    if result.blocked or result.wake_keys:
                        if workflow.patched(NOTIFY_BESIDE_PATCH):
                            await self._notify_beside(config, result.blocked, result.wake_keys)
                        else:
                            await self._notify(config, result.blocked, result.wake_keys)
                self.batches += 1
                self.empty_claims = 0
            else:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self.woken or self.draining,
                        timeout=self.idle_timeout(config, backoff),
                    )
            if (
                self.batches >= config.batches_before_continue_as_new
                or workflow.info().is_continue_as_new_suggested()
            ):
                await self._notifies_done()
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(config)
        await self._notifies_done()
        return "drained"
