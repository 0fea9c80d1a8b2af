"""Identity-convergence waits as workflows (port of the seed's polled dependency scan).

``IdentityWaitWorkflow``, id ``identity/<database id>/<key hash>``, one per
dependency: started by signal-with-start (``register(work_ids)``) from the
activity that registered blocked items, so several items share one wait. It
parks at once: no probe (the batch re-read the dependency after its block
committed, which closes the race with a link finalized meanwhile) and no
timer but the one to its first item's expiry, so ten thousand parked waits
cost nothing while idle (issue 16). What wakes it: the ``wake`` signal (or the ``wake_now`` update
that returns the count) sent by the batch that finalized the dependency, or
by the fleet's identity recovery, whose one set-based recheck per reconcile
finds every blocked row whose dependency resolved some other way (the seed's
per-row 5 s poll, for all rows at once). ``register()`` without items asks
for a probe now. On a wake or a converged probe it wakes its items (blocked
-> pending), signals the fleet ``wake(install_id)`` for their packs, and
completes.

Rules (the seed's): an item expires (``identity-convergence-expired``) only
when its own ``DependencyBlockedAt`` plus the max wait has passed *and* a
fresh probe just said the dependency is still unresolved; a probe that fails
or times out never expires anything, it reschedules (probe interval doubling
to its max). Items whose dependency columns were lost are terminalized as
invalid by the probe activity.

Histories recorded before the ``identity-wait-parked`` patch replay the
earlier loop, which probed at once and then on every interval while it waited.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.identity import IdentityActivities
    from nexuscrm.contracts import (
        ExpireRequest,
        IdentityWaitInput,
        IdentityWaitStatus,
        ProbeRequest,
        ProbeResult,
    )
    from workflows.common import brief
    from workflows.controlplane import DATABASE_KEY

DEPENDENCY_OBJECT_KEY = SearchAttributeKey.for_keyword("NexusDependencyObject")

PARKED_PATCH = "identity-wait-parked"
"""Patch id: a wait probes only when due to expire or asked, not at start and per interval."""

WAKE_NOW_PASS_PATCH = "identity-wake-now-pass"
"""Patch id: a ``wake_now`` that arrives while the wait wakes runs one more wake pass.

Before it, an update that arrived after the pass had read the rows (woken by a
``wake`` signal) was told that pass's count, and an item blocked in between
stayed blocked with nothing waiting for it (seen in CI, 2026-12-04)."""

_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
)


MAX_WORK_ID_CHARS = 64
"""Longest work id (``ConnectorWorkItem.WorkId`` is ``String(64)``)."""


def _work_ids(args: tuple[Any, ...]) -> list[str] | None:
    """The work ids of a ``register`` signal's raw arguments; ``None``: not a registration."""
    if len(args) > 1:
        return None
    ids = args[0] if args else None
    if ids is None:
        return []
    if isinstance(ids, list) and all(
        isinstance(i, str) and 0 < len(i) <= MAX_WORK_ID_CHARS for i in ids
    ):
        return ids
    return None


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).replace(tzinfo=None).isoformat()


# Not sandboxed: ten thousand parked waits are created, evicted from the worker's
# cache and replayed on their wake; the sandbox's per-instance module
# re-import was most of that CPU (issue 16). The code stays deterministic (no
# I/O, clocks or randomness but ``workflow.*``); the replay test guards it.
@workflow.defn(name="IdentityWait", sandboxed=False)
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
        self.wake_calls = 0
        self.wake_result: int | None = None
        self.probes = inp.probes
        self.state = "starting"
        self.next_probe: datetime | None = None
        self.probe_requested = False

    @workflow.signal
    def register(self, *args: Any) -> None:
        """Items blocked on this dependency (after their block committed): one
        argument, a list of work ids (or ``null``).

        Without items it asks for a probe now (a parked wait otherwise probes
        again only when its first item is due to expire). The argument arrives
        undecoded (``*args`` has no type hint): the SDK's decoding would read a
        hand-typed string as a list of its characters and an object as a list
        of its keys, and two arguments would fail the workflow task over and
        over. Anything but zero or one list of work ids (strings of at most
        :data:`MAX_WORK_ID_CHARS`) is logged and ignored.
        """
        work_ids = _work_ids(args)
        if work_ids is None:
            workflow.logger.warning(
                "register ignored: it takes one list of work ids (strings of at most %d "
                "characters) or none, got %s",
                MAX_WORK_ID_CHARS,
                brief(list(args)),
            )
            return
        self.items.update(work_ids)
        self.registrations += 1
        if not work_ids:
            self.probe_requested = True

    @workflow.signal
    def wake(self) -> None:
        """The dependency was finalized: wake the items now."""
        self.woken = True

    @workflow.update
    async def wake_now(self) -> int:
        """``wake``, returning how many items it woke (0 when an earlier wake took them).

        Every item blocked when the update is accepted is woken before it
        returns: one arriving while the wait wakes (a ``wake`` signal came
        first) has the wait run one more pass after its rows were read.
        Rejected (:meth:`_wake_now_accepted`) once the wait has woken: the
        caller wakes the rows itself, as when no wait runs.
        """
        first = not self.wake_claimed and self.wake_result is None
        self.wake_claimed = True
        self.wake_calls += 1
        self.woken = True
        await workflow.wait_condition(lambda: self.wake_result is not None)
        return (self.wake_result or 0) if first else 0

    @wake_now.validator
    def _wake_now_accepted(self) -> None:
        """Refuse a ``wake_now`` after the wait has woken, expired or emptied.

        Its pass is over: items blocked since then are nobody's but the rows'
        (their registration starts the next wait), so the caller's direct wake
        must take them (``nexusctl.identity.wake_dependency``). Raises
        ``ApplicationError`` (the update is rejected, nothing is recorded).
        """
        if self.wake_result is not None:
            raise ApplicationError(
                f"identity wait {self.inp.key_hash} is {self.state}: wake its rows directly",
                type="IdentityWaitDone",
                non_retryable=True,
            )

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
        again_for_updates = workflow.patched(WAKE_NOW_PASS_PATCH)
        total = 0
        while True:
            seen = self.registrations
            calls = self.wake_calls
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
            if self.registrations == seen and (not again_for_updates or self.wake_calls == calls):
                return total

    def _park_seconds(self, waiting_due: list[datetime], registered: bool) -> float | None:
        """How long a parked wait sleeps after a probe that said unresolved.

        Until the first waiting item is due to expire; items registered during
        the probe (their blocked time unknown) are due no earlier than the max
        wait from now. ``None``: expiry is off, sleep until a wake or a
        ``register()`` asking for a probe.
        """
        cfg = self.inp.config
        if cfg.max_wait_seconds <= 0:
            return None
        now = workflow.now()
        dues = [(d - now).total_seconds() for d in waiting_due]
        if registered or not dues:
            dues.append(cfg.max_wait_seconds)
        return max(0.001, min(dues))

    @workflow.run
    async def run(self, inp: IdentityWaitInput) -> int:
        """Probe, park, wake or expire; returns the number of items woken."""
        parked = workflow.patched(PARKED_PATCH)
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
        # A parked wait does not probe when it starts: the batch that blocked its
        # items re-read their dependency after the block committed, and recovery
        # rechecks every blocked row. Its first probe is at its first due time.
        skip_probe = parked
        while not self.woken:
            sleep: float | None
            if skip_probe:
                skip_probe = False
                failed = False
                sleep = self._park_seconds([], registered=True)
            else:
                self.state = "probing"
                self.probe_requested = False
                seen = self.registrations
                alive_until = workflow.now() + timedelta(
                    seconds=max_interval + cfg.liveness_grace_seconds
                )
                res = await self._probe_unless_woken(alive_until)
                probes_this_run += 1
                if self.woken or (res is not None and res.converged):
                    break
                failed = res is None
                # Jitter spreads the probes of waits that blocked together.
                sleep = interval * workflow.random().uniform(0.8, 1.2)
                if res is not None:
                    self.items = {i.work_id for i in res.items} | (
                        self.items if self.registrations != seen else set()
                    )
                    now = workflow.now()
                    waiting_due: list[datetime] = []
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
                        waiting_due = [
                            datetime.fromisoformat(i.blocked_at).replace(tzinfo=UTC) + max_wait
                            for i in res.items
                            if i.work_id not in due
                        ]
                        if waiting_due and not parked:
                            until_due = (min(waiting_due) - now).total_seconds()
                            sleep = max(0.001, min(sleep, until_due))
                    if not self.items and self.registrations == seen:
                        outcome = "expired" if res.items else "empty"
                        break
                    if parked:
                        sleep = self._park_seconds(waiting_due, self.registrations != seen)
            self.state = "probe-failed" if failed else "sleeping"
            self.next_probe = (
                workflow.now() + timedelta(seconds=sleep) if sleep is not None else None
            )
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    (lambda: self.woken or self.probe_requested)
                    if parked
                    else (lambda: self.woken),
                    timeout=timedelta(seconds=sleep) if sleep is not None else None,
                )
            if failed or not parked:
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
