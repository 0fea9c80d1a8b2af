"""Identity-wait recovery, run by the fleet's periodic pass: no blocked row without a wait.

The seed's ``reconcileBacklog`` recovery of parked rows in the Temporal form
(issue 16): blocked rows whose dependency resolved are woken by one write
(:meth:`IdentityRecovery._wake_resolved`); waits whose items were all woken
are asked to probe and end (:meth:`IdentityRecovery._sweep_orphan_waits`);
a blocked row whose wait does not run (asked of the server, never trusted
from a timestamp alone) gets its wait by signal-with-start
(:meth:`IdentityRecovery.recover`). A mixin of
:class:`activities.identity.IdentityActivities`, which supplies the engine,
the settings and the wake mechanics (``_wake_keys``, ``_close_later``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine
from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError

from activities import identity_client
from activities.common import quiet_lock_conflicts
from activities.identity_client import (
    SIGNAL_CONCURRENCY,
    list_running_waits,
    page_after,
    running_waits,
)
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import (
    Dependency,
    resolved_blocked_keys,
    resolved_keys,
    wait_workflow_id,
)
from nexuscrm.contracts import IdentityWaitConfig
from nexuscrm.contracts.visibility import running_waits_query
from nexuscrm.log import log
from nexuscrm.settings import Settings

RECOVERY_RECHECK = timedelta(minutes=5)
"""How long recovery trusts the server's "this wait runs" before asking again (at least)."""

RECOVERY_RECHECK_MAX = timedelta(hours=1)
"""The longest a full list of the running waits is trusted (:func:`recheck_interval`)."""


def recheck_interval(youngest_blocked_at: datetime | None, now: datetime) -> timedelta:
    """How long a full list of the running waits is trusted before the next one: as
    long as the youngest of the listed waits' rows has been blocked, between
    :data:`RECOVERY_RECHECK` (5 min) and :data:`RECOVERY_RECHECK_MAX` (1 h).

    A list costs the server a lookup per running wait (10,000 GetNamespace calls
    on the dev server, about 4 s of its CPU: an idle server's whole budget for
    minutes, issue 16). Waits parked long and listed again and again are
    listed less often: 5, 10, 20, 40 minutes, then every hour, while new
    blocks keep it at 5 minutes. A wait that ends without waking its rows
    (terminated by hand) is noticed that much later; its rows are still woken
    by the pass's own recheck of their dependency (a database read) as soon as
    it resolves. ``now`` and ``youngest_blocked_at``: naive UTC.
    """
    if youngest_blocked_at is None:
        return RECOVERY_RECHECK
    return min(RECOVERY_RECHECK_MAX, max(RECOVERY_RECHECK, now - youngest_blocked_at))


LIST_THRESHOLD = 50
"""Keys from which recovery lists the running waits instead of describing each."""


class _Census:
    """The keys rows are blocked on and the server's count of running waits, each
    read at most once per recovery pass (the sweep and the list share them)."""

    def __init__(self, engine: Engine, client: Client, query: str) -> None:
        self._engine, self._client, self._query = engine, client, query
        self._blocked: set[str] | None = None
        self._count: int | None = None

    async def blocked(self) -> set[str]:
        """Key hashes with a ``blocked`` row (one database read per pass)."""
        if self._blocked is None:
            self._blocked = await asyncio.to_thread(wq.blocked_key_set, self._engine)
        return self._blocked

    async def count(self) -> int:
        """The server's count of this database's running waits; ``-1`` when the
        count failed (one request per pass)."""
        if self._count is None:
            try:
                self._count = (await self._client.count_workflows(self._query)).count
            except RPCError:
                self._count = -1
        return self._count


class IdentityRecovery:
    """The ``identity.recover`` activity and its steps (mixin; see the module docstring)."""

    engine: Engine
    settings: Settings
    config: IdentityWaitConfig
    _last_sweep: dict[str, float]
    _last_full_list: dict[str, float]
    _sweep_candidates: dict[str, set[str]]

    async def _wake_keys(self, keys: list[str], path: str = "notify") -> dict[str, int]:
        raise NotImplementedError  # IdentityActivities

    def _close_later(self, client: Client, database_id: str, keys: list[str]) -> None:
        raise NotImplementedError  # IdentityActivities

    async def _wake_resolved(self, client: Client, database_id: str) -> int:
        """Wake every blocked item whose dependency exists now; complete their waits.

        The set-based recheck that replaces each parked wait's own probes
        (issue 16): one read for all blocked rows (:func:`resolved_blocked_keys`),
        then one wake write, the fleet's ``wake`` for the packs woken, and a
        background ``wake`` signal to the wait of each resolved key only
        (:meth:`_close_later`). Returns the number of keys resolved.
        """
        keys = sorted(await asyncio.to_thread(resolved_blocked_keys, self.engine))
        if not keys:
            return 0
        packs = await self._wake_keys(keys, path="recovery")
        fleet = client.get_workflow_handle(f"connector-fleet/{database_id}")
        for install_id in sorted(packs):
            try:
                await fleet.signal("wake", install_id)
            except RPCError:  # no fleet: the workers' idle timers find the work
                break
        self._close_later(client, database_id, keys)
        log.info(
            "identity recovery woke resolved rows",
            dependency_keys=len(keys),
            items=sum(packs.values()),
        )
        return len(keys)

    async def _sweep_orphan_waits(
        self, client: Client, database_id: str, census: _Census | None
    ) -> int:
        """Ask a probe of each running wait none of whose items has been blocked
        for two sweeps in a row.

        A wait whose items were woken directly and whose ``wake`` signal was
        lost (the batch died before its notify) would stay parked until its
        first due time; its probe now finds no item and it ends ``empty``. At
        most once per ``max_probe_interval_seconds`` per database and process;
        the server's count of running waits is read first and the waits are
        listed (ids only) only when it exceeds the blocked keys. A wait is
        asked only when the previous sweep found it without blocked items
        too: during a wake of thousands, their ``wake`` signals are merely on
        their way, and a probe each would double the work (issue 16).
        Returns waits asked.
        """
        now = time.monotonic()
        last = self._last_sweep.get(database_id)
        if last is not None and now - last < max(1.0, self.config.max_probe_interval_seconds):
            return 0
        self._last_sweep[database_id] = now
        if census is None:
            return 0
        blocked = await census.blocked()
        count = await census.count()
        if count < 0:
            return 0
        if count <= len(blocked):
            self._sweep_candidates.pop(database_id, None)
            return 0
        running = await list_running_waits(client, database_id)
        found = (running or set()) - blocked
        orphans = sorted(found & self._sweep_candidates.get(database_id, set()))
        self._sweep_candidates[database_id] = found - set(orphans)
        gate = asyncio.Semaphore(SIGNAL_CONCURRENCY)

        async def ask(key: str) -> None:
            async with gate:
                with contextlib.suppress(RPCError):  # it ended meanwhile
                    await client.get_workflow_handle(wait_workflow_id(database_id, key)).signal(
                        "register"
                    )

        await asyncio.gather(*(ask(key) for key in orphans))
        if orphans:
            log.info("identity waits without blocked items asked to probe", waits=len(orphans))
        return len(orphans)

    def _waitless_page(self, after: tuple[datetime, str] | None) -> list[wq.BlockedRow]:
        return wq.list_waitless_blocked(self.engine, after=after)

    @activity.defn(name="identity.recover")
    @quiet_lock_conflicts
    async def recover(self, database_id: str) -> int:
        """Give every blocked row without a live wait its wait; returns waits (re)started.

        Converts the seed's parked-processing rows to ``blocked`` and
        terminalizes invalid blocked rows first, then wakes every blocked row
        whose dependency resolved (:meth:`_wake_resolved`, the recheck parked
        waits rely on). Pages of 1000, at most 100.
        """
        if self.settings.connector_role == "handoff":
            # The Runtime owns the dependencies of handed-off work (issue 5 rule 9),
            # whatever the starter of the fleet asked for.
            log.info("identity recovery skipped: connector role is handoff")
            return 0
        client = activity.client()
        queue = self.settings.identity_task_queue
        await asyncio.to_thread(wq.convert_parked, self.engine)
        invalid = await asyncio.to_thread(wq.list_invalid_blocked, self.engine)
        if invalid:
            n = await asyncio.to_thread(wq.terminalize_invalid, self.engine, invalid)
            log.warning(
                "invalid identity convergence waits terminalized",
                items=n,
                failure_class="identity-convergence-invalid",
            )
        # Every blocked row whose dependency resolved without a wake (an owner
        # written outside this runtime, a wake lost with its batch) goes back
        # to pending here, once per reconcile: the parked waits never poll.
        await self._wake_resolved(client, database_id)
        query = running_waits_query(database_id)
        census = _Census(self.engine, client, query) if query is not None else None
        await self._sweep_orphan_waits(client, database_id, census)
        started = 0
        after: tuple[datetime, str] | None = None
        listed: set[str] | None = None  # the server's running waits, listed once per run
        for _page in range(wq.RECOVERY_MAX_PAGES):
            rows = await asyncio.to_thread(self._waitless_page, after)
            groups: dict[str, tuple[Dependency, list[str]]] = {}
            bad: list[str] = []
            for r in rows:
                if r.dependency is None:
                    bad.append(r.work_id)
                    continue
                groups.setdefault(r.dependency.key_hash, (r.dependency, []))[1].append(r.work_id)
            if bad:
                await asyncio.to_thread(wq.terminalize_invalid, self.engine, bad)
            # A wait that runs is never signal-with-started again (issue 16): its
            # rows are only marked so that recovery asks again after the recheck.
            if listed is None and len(groups) >= LIST_THRESHOLD:
                listed = await self._running_or_counted(client, database_id, census)
            live = await running_waits(client, database_id, sorted(groups), listed)
            if live:
                until = datetime.now(UTC).replace(tzinfo=None) + RECOVERY_RECHECK
                marks = {w: key for key in live for w in groups.pop(key)[1]}
                await asyncio.to_thread(wq.mark_waits_alive, self.engine, marks, until)
            # A row whose dependency resolved while nobody waited (its batch died
            # between its block and its notify, after the parent's wake had read
            # the blocked rows) is woken here (a database read per dependency, one write),
            # not handed to a wait whose probes may be starved (issue 16).
            resolved = await asyncio.to_thread(
                resolved_keys, self.engine, [dep for dep, _ in groups.values()]
            )
            if resolved:
                await self._wake_keys(sorted(resolved), path="recovery")
                for key in resolved:
                    groups.pop(key, None)
                log.info("identity recovery woke resolved rows", dependency_keys=len(resolved))
            for dep, work_ids in groups.values():
                await identity_client.start_wait(
                    client,
                    database_id=database_id,
                    task_queue=queue,
                    dependency=dep,
                    work_ids=work_ids,
                    config=self.config,
                    probe_now=True,
                )
                started += 1
            after = page_after(rows)
            if after is None:
                break
            # Only before a further page: a pass of one page (the idle fleet's, every
            # 5 s) sends no heartbeat, which would be a server call per pass.
            activity.heartbeat()
        else:
            log.warning(
                "identity convergence recovery stopped at its page bound",
                pages=wq.RECOVERY_MAX_PAGES,
            )
        if listed:
            await self._mark_listed_alive(listed)
        if started:
            log.info("identity waits recovered", waits=started)
        return started

    async def _running_or_counted(
        self, client: Client, database_id: str, census: _Census | None
    ) -> set[str]:
        """The key hashes of the running waits: from the server's count when it
        matches the blocked keys exactly, else (and at least once per
        :data:`RECOVERY_RECHECK_MAX` in this process) from a full list.

        A list costs the server a lookup per running wait (about 4 s of a dev
        server's CPU for 10,000); a count is one request. When the count of
        running waits equals the number of keys rows are blocked on, every
        blocked key is taken to have its wait: a wait that ended without its
        rows leaves the count short (or the sweep's orphan waits make it
        long), and the full list follows. Only a wait ending while another
        runs without blocked rows would cancel out; the hourly list covers it.
        """
        now = time.monotonic()
        last = self._last_full_list.get(database_id)
        fresh = last is not None and now - last < RECOVERY_RECHECK_MAX.total_seconds()
        if census is not None and fresh:
            blocked = await census.blocked()
            if await census.count() == len(blocked):
                return blocked
        listed = await list_running_waits(client, database_id)
        if listed is not None:
            self._last_full_list[database_id] = now
        return listed or set()

    async def _mark_listed_alive(self, listed: set[str]) -> int:
        """After a full list of the running waits: mark *every* blocked row of a
        listed wait alive until the next list (:func:`recheck_interval`), not
        only the rows whose mark had expired.

        Rows block one batch after another, so their marks expire one reconcile
        after another; each expiry of 50 keys or more lists every running wait
        again (10 pages for 10,000 waits, a namespace lookup per listed wait on
        the server: most of the dev server's idle CPU with 10,000 parked, issue
        16). Marked together, with one time, they are listed again together.
        Pages by primary key, as the recheck does. Returns the rows marked.
        """
        now = datetime.now(UTC).replace(tzinfo=None)
        horizon = now + RECOVERY_RECHECK_MAX
        marks: dict[str, str] = {}
        youngest: datetime | None = None
        after: tuple[datetime, str] | None = None
        for _page in range(wq.RECOVERY_MAX_PAGES):
            rows = await asyncio.to_thread(
                functools.partial(wq.list_waitless_blocked, self.engine, after=after, now=horizon)
            )
            for r in rows:
                if r.key_hash in listed and r.dependency:
                    marks[r.work_id] = r.key_hash
                    if r.blocked_at is not None and (youngest is None or r.blocked_at > youngest):
                        youngest = r.blocked_at
            activity.heartbeat()
            after = page_after(rows)
            if after is None:
                break
        until = now + recheck_interval(youngest, now)
        marked = 0
        ids = list(marks)
        for i in range(0, len(ids), wq.RECOVERY_PAGE):
            chunk = {w: marks[w] for w in ids[i : i + wq.RECOVERY_PAGE]}
            marked += await asyncio.to_thread(wq.mark_waits_alive, self.engine, chunk, until)
            activity.heartbeat()
        return marked
