"""The connector fleet's periodic pass as one activity (patch ``fleet-periodic-pass``).

Every ``reconcile_interval_seconds`` (5 s, the seed's backlog reconcile) the
fleet ran three activities in a row: identity-wait recovery, the pools'
liveness check and the reconcile plan; four workflow tasks and three activity
tasks per pass, most of an idle dev server's CPU (issue 16: 2.1 % of a core
of 2.4 %, from the server's request counters). :meth:`FleetActivities.periodic`
runs the three in one activity, in the same order and with the same
outcomes, after waiting out the interval itself (the activity is the timer):
an idle pass costs one activity task and one workflow task.
"""

from __future__ import annotations

import asyncio
import functools

from temporalio import activity

from activities.connectors import ConnectorActivities
from activities.identity import IdentityActivities
from nexuscrm.connectors.reconcile import MODE_PERIODIC, starts_pool
from nexuscrm.contracts import PeriodicOutcome, PeriodicRequest, ReconcileRequest
from nexuscrm.log import log


async def _interval(seconds: float) -> bool:
    """Wait out the reconcile interval, as a workflow timer would; False when the
    worker began shutting down meanwhile (the wait ends at once).

    No heartbeat meanwhile (each is a server call): a cancel (a request or a
    stop reached the fleet) is seen only at the recovery's first heartbeat,
    and the fleet does not wait for it (it drops the plan). A shutting-down
    worker is not held for the rest of the interval: the pass returns
    ``skipped`` and the fleet waits the rest as a timer, so that the next
    pass runs on a worker that stays.
    """
    if activity.is_worker_shutdown():
        return False
    sleep = asyncio.ensure_future(asyncio.sleep(seconds))
    down = asyncio.ensure_future(activity.wait_for_worker_shutdown())
    try:
        await asyncio.wait({sleep, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleep.cancel()
        down.cancel()
    return not activity.is_worker_shutdown()


BUSY_HEARTBEAT_S = 5.0
"""A pass that works longer than this after its interval heartbeats this often; the
fleet's heartbeat timeout is the interval plus :data:`PASS_HEARTBEAT_SLACK_S`."""

PASS_HEARTBEAT_SLACK_S = 15.0
"""Heartbeat timeout of a pass beyond its interval: a pass on a worker that was
killed (SIGKILL, OOM) is retried elsewhere this long after its interval, not a
minute later. An idle pass (well under :data:`BUSY_HEARTBEAT_S` of work) sends
no heartbeat at all."""


async def _beat_while_busy(every: float = BUSY_HEARTBEAT_S) -> None:
    """Heartbeat every ``every`` seconds until cancelled (the pass ended); none in the
    first ``every`` seconds, so a quick pass costs no server call."""
    while True:
        await asyncio.sleep(every)
        activity.heartbeat()


class FleetActivities:
    """The fleet's combined periodic activity over one database's connector and
    identity activities (the same instances the worker registers)."""

    def __init__(self, connectors: ConnectorActivities, identity: IdentityActivities) -> None:
        self.connectors = connectors
        self.identity = identity

    @activity.defn(name="connectors.periodic")
    async def periodic(self, req: PeriodicRequest) -> PeriodicOutcome:
        """One periodic pass: recovery, liveness, plan (the seed's ``reconcileBacklog``
        then ``Reconcile(periodic)``), after ``req.delay_seconds``; ``skipped``
        (nothing ran) when the worker began shutting down before the pass.

        1. Identity-wait recovery (``identity.recover``) when
           ``req.identity_recovery``; its failure is logged and returned as
           ``recovery_error`` (the next pass tries again), as the fleet did.
        2. The liveness of ``req.pools`` (``connectors.closed_pools``); an RPC
           failure is logged and counts as none closed (the next pass checks
           again).
        3. The reconcile plan (``connectors.reconcile_plan``, mode ``periodic``)
           over ``req.running`` without the closed pools, so that the plan
           starts them again. Database errors are outcomes in the plan; a bad
           pack that is fatal raises as that activity does. The plan takes no
           claim fence: when it would start (or replace) a pool, it is not
           returned and ``replan`` is set; the fleet then plans again with
           fences under its lock (``connectors.reconcile_plan``) and applies
           that plan, so that a discarded pass never supersedes a running pool.
        """
        if req.delay_seconds > 0 and not await _interval(req.delay_seconds):
            return PeriodicOutcome(skipped=True)
        ticker = asyncio.ensure_future(_beat_while_busy())
        try:
            return await self._pass(req)
        finally:
            ticker.cancel()

    async def _pass(self, req: PeriodicRequest) -> PeriodicOutcome:
        out = PeriodicOutcome()
        if req.identity_recovery:
            try:
                out.recovered = await self.identity.recover(req.database_id)
            except Exception as err:  # logged; the fleet keeps its pools
                out.recovery_error = str(err) or type(err).__name__
                log.warning("identity wait recovery failed", error=out.recovery_error)
        if req.pools:
            try:
                out.closed = await self.connectors.closed_pools(sorted(req.pools.values()))
            except Exception as err:  # the next pass checks again
                log.warning("pool liveness check failed", error=str(err))
        closed = set(out.closed)
        running = {k: fp for k, fp in req.running.items() if req.pools.get(k) not in closed}
        plan = await asyncio.to_thread(
            functools.partial(self.connectors.plan, take_fences=False),
            ReconcileRequest(req.database_id, MODE_PERIODIC, running, req.fleet_epoch),
        )
        if starts_pool(plan):
            # Starting a pool takes its pack's claim fence, which supersedes the
            # pack's running pool: never in a plan the fleet may still discard (a
            # request or a prune meanwhile). The fleet plans again under its lock.
            out.replan = True
        else:
            out.plan = plan
        return out
