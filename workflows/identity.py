"""Identity-convergence waits as workflows (port of the seed's polled dependency scan).

``IdentityWaitWorkflow``, id ``identity/<database id>/<key hash>``, one per
dependency: started by signal-with-start (``register(work_ids)``) from the
activity that registered blocked items, so several items share one wait. It
probes the owner at once (closing the race with a link finalized between the
block and the wait), then on a timer (probe interval doubling to its max).
On ``wake`` (signal, or the ``wake_now`` update that returns the count) or a
converged probe it wakes its items (blocked -> pending), signals the fleet
``wake(install_id)`` for their packs, and completes.

Rules (the seed's): an item expires (``identity-convergence-expired``) only
when its own ``DependencyBlockedAt`` plus the max wait has passed *and* a
fresh probe just said the dependency is still unresolved; a probe that fails
or times out never expires anything, it reschedules. Items whose dependency
columns were lost are terminalized as invalid by the probe activity.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.identity import IdentityActivities
    from nexuscrm.contracts import (
        ExpireRequest,
        IdentityWaitInput,
        IdentityWaitStatus,
        ProbeRequest,
        ProbeResult,
    )
    from workflows.controlplane import DATABASE_KEY

DEPENDENCY_OBJECT_KEY = SearchAttributeKey.for_keyword("NexusDependencyObject")

_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).replace(tzinfo=None).isoformat()


@workflow.defn(name="IdentityWait")
class IdentityWaitWorkflow:
    """One identity-convergence wait. Signals ``register(work_ids)``, ``wake``;
    update ``wake_now`` (count woken; 0 for a duplicate); query ``status``.
    Returns how many items it woke."""

    @workflow.init
    def __init__(self, inp: IdentityWaitInput) -> None:
        self.inp = inp
        self.items: set[str] = set(inp.work_ids)
        self.registrations = 0
        self.woken = False
        self.wake_claimed = False
        self.wake_result: int | None = None
        self.probes = inp.probes
        self.state = "starting"
        self.next_probe: datetime | None = None

    @workflow.signal
    def register(self, work_ids: list[str] | None = None) -> None:
        """Items blocked on this dependency (after their block committed).

        Without an argument it only makes the next probe re-read the rows."""
        self.items.update(work_ids or [])
        self.registrations += 1

    @workflow.signal
    def wake(self) -> None:
        """The dependency was finalized: wake the items now."""
        self.woken = True

    @workflow.update
    async def wake_now(self) -> int:
        """``wake``, returning how many items it woke (0 when an earlier wake took them)."""
        first = not self.wake_claimed and self.wake_result is None
        self.wake_claimed = True
        self.woken = True
        await workflow.wait_condition(lambda: self.wake_result is not None)
        return (self.wake_result or 0) if first else 0

    @workflow.query
    def status(self) -> IdentityWaitStatus:
        """Items, key, probes, next probe and state."""
        dep = self.inp.dependency
        return IdentityWaitStatus(
            key_hash=self.inp.key_hash,
            kind=dep.kind,
            object_api_name=dep.object_api_name,
            state=self.state,
            items=sorted(self.items),
            probes=self.probes,
            next_probe=_iso(self.next_probe) if self.next_probe else None,
            started_at=self.inp.started_at,
            woken=self.wake_result,
        )

    async def _probe(self, alive_until: datetime) -> ProbeResult | None:
        cfg = self.inp.config
        try:
            return await workflow.execute_activity_method(
                IdentityActivities.probe,
                ProbeRequest(
                    key_hash=self.inp.key_hash,
                    dependency=self.inp.dependency,
                    work_ids=sorted(self.items),
                    alive_until=_iso(alive_until),
                    timeout_seconds=cfg.probe_timeout_seconds,
                ),
                start_to_close_timeout=timedelta(seconds=cfg.probe_timeout_seconds + 30),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError as err:
            workflow.logger.warning("identity probe failed, rescheduled: %s", err.cause or err)
            return None
        finally:
            self.probes += 1

    async def _probe_unless_woken(self, alive_until: datetime) -> ProbeResult | None:
        """The probe, abandoned when a wake arrives first.

        Probes are rate-limited per database, so one may sit in the task queue
        for a while; a wake must not wait for it.
        """
        task = asyncio.ensure_future(self._probe(alive_until))
        await workflow.wait_condition(lambda: self.woken or task.done())
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def _wake(self) -> int:
        self.state = "waking"
        total = 0
        while True:
            seen = self.registrations
            res = await workflow.execute_local_activity_method(
                IdentityActivities.wake,
                self.inp.key_hash,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=_RETRY,
            )
            total += res.woken
            fleet = workflow.get_external_workflow_handle(f"connector-fleet/{self.inp.database_id}")
            for install_id in res.install_ids:
                try:
                    await fleet.signal("wake", install_id)
                except Exception as err:  # no fleet: its workers' idle timers claim the items
                    workflow.logger.info("fleet wake skipped: %s", err)
            if self.registrations == seen:
                return total

    @workflow.run
    async def run(self, inp: IdentityWaitInput) -> int:
        """Probe, sleep, wake or expire; returns the number of items woken."""
        cfg = inp.config
        if cfg.search_attributes:
            workflow.upsert_search_attributes(
                [
                    DEPENDENCY_OBJECT_KEY.value_set(inp.dependency.object_api_name),
                    DATABASE_KEY.value_set(inp.database_id),
                ]
            )
        if not inp.started_at:
            inp.started_at = _iso(workflow.now())
        interval = max(0.001, cfg.probe_interval_seconds)
        max_interval = max(interval, cfg.max_probe_interval_seconds)
        probes_this_run = 0
        outcome = "woken"
        while not self.woken:
            self.state = "probing"
            seen = self.registrations
            alive_until = workflow.now() + timedelta(
                seconds=max_interval + cfg.liveness_grace_seconds
            )
            res = await self._probe_unless_woken(alive_until)
            probes_this_run += 1
            if self.woken or (res is not None and res.converged):
                break
            # Jitter spreads the probes of waits that blocked together.
            sleep = interval * workflow.random().uniform(0.8, 1.2)
            if res is not None:
                self.items = {i.work_id for i in res.items} | (
                    self.items if self.registrations != seen else set()
                )
                now = workflow.now()
                if cfg.max_wait_seconds > 0 and res.items:
                    max_wait = timedelta(seconds=cfg.max_wait_seconds)
                    due = [
                        i.work_id
                        for i in res.items
                        if datetime.fromisoformat(i.blocked_at).replace(tzinfo=UTC) + max_wait
                        <= now
                    ]
                    if due:
                        await workflow.execute_local_activity_method(
                            IdentityActivities.expire,
                            ExpireRequest(inp.key_hash, due, _iso(now)),
                            start_to_close_timeout=timedelta(seconds=60),
                            retry_policy=_RETRY,
                        )
                        self.items -= set(due)
                    waiting = [i for i in res.items if i.work_id not in due]
                    if waiting:
                        first_due = min(
                            datetime.fromisoformat(i.blocked_at).replace(tzinfo=UTC) + max_wait
                            for i in waiting
                        )
                        until_due = (first_due - now).total_seconds()
                        sleep = max(0.001, min(sleep, until_due))
                if not self.items and self.registrations == seen:
                    outcome = "expired" if res.items else "empty"
                    break
            self.state = "sleeping" if res is not None else "probe-failed"
            self.next_probe = workflow.now() + timedelta(seconds=sleep)
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self.woken, timeout=timedelta(seconds=sleep))
            interval = min(interval * 2, max_interval)
            if not self.woken and (
                probes_this_run >= cfg.probes_before_continue_as_new
                or workflow.info().is_continue_as_new_suggested()
            ):
                await workflow.wait_condition(workflow.all_handlers_finished)
                inp.work_ids = sorted(self.items)
                inp.probes = self.probes
                workflow.continue_as_new(inp)
        self.next_probe = None
        if outcome == "woken":
            self.wake_result = await self._wake()
            self.state = "woken"
        else:
            self.wake_result = 0
            self.state = outcome
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.wake_result


IDENTITY_WORKFLOWS = [IdentityWaitWorkflow]
