"""Identity waits seen from the worker's Temporal client: start, wake, ask which run.

Signal-with-start of an ``IdentityWait`` (:func:`start_wait`), its ``wake``
signal (:func:`signal_wake`) and the server's answer to "which waits run"
(:func:`list_running_waits` by the ``NexusDatabase`` search attribute,
:func:`running_waits` with ``describe`` for what the list does not show).
Used by the batch's notify (:mod:`activities.identity`) and the fleet's
recovery (:mod:`activities.identity_recovery`); callers reach these through
the module (``identity_client.start_wait``), so a benchmark that swaps them
swaps them for both.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from temporalio.api.workflowservice.v1 import ListWorkflowExecutionsRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency, to_spec, wait_workflow_id
from nexuscrm.contracts import IdentityWaitConfig, IdentityWaitInput
from nexuscrm.contracts.visibility import running_waits_query
from nexuscrm.log import log

SIGNAL_CONCURRENCY = 32
"""Signals (wakes, signal-with-starts, describes) one activity keeps in flight at once."""


async def start_wait(
    client: Client,
    *,
    database_id: str,
    task_queue: str,
    dependency: Dependency,
    work_ids: list[str],
    config: IdentityWaitConfig,
    probe_now: bool = False,
) -> None:
    """Signal-with-start the wait of ``dependency`` with ``register(work_ids)`` (idempotent).

    ``probe_now``: also ask it to probe at once (``register`` without items),
    for items whose block may be old (recovery): a parked wait otherwise
    probes first at its registration plus the max wait.
    """
    key = dependency.key_hash
    handle = await client.start_workflow(
        "IdentityWait",
        IdentityWaitInput(
            database_id=database_id,
            key_hash=key,
            dependency=to_spec(dependency),
            config=config,
        ),
        id=wait_workflow_id(database_id, key),
        task_queue=task_queue,
        start_signal="register",
        start_signal_args=[sorted(work_ids)],
    )
    if probe_now:
        await handle.signal("register")


async def signal_wake(client: Client, database_id: str, key_hash: str) -> bool:
    """Signal ``wake`` to the wait of ``key_hash``; False when no wait runs."""
    try:
        await client.get_workflow_handle(wait_workflow_id(database_id, key_hash)).signal("wake")
    except RPCError:
        return False
    return True


def page_after(rows: list[wq.BlockedRow]) -> tuple[datetime, str] | None:
    """Keyset position (``DependencyBlockedAt``, ``WorkId``) after a full page of
    blocked rows; ``None`` after a short page (the last)."""
    if len(rows) < wq.RECOVERY_PAGE:
        return None
    last = rows[-1]
    assert last.blocked_at is not None
    return (last.blocked_at, last.work_id)


async def list_running_waits(client: Client, database_id: str) -> set[str] | None:
    """Key hashes of the database's running ``IdentityWait`` workflows (server visibility).

    One paged list by the search attribute ``NexusDatabase``; ``None`` when the
    server cannot answer it (attribute not registered, visibility error) or
    the database id cannot be quoted in a query.
    """
    query = running_waits_query(database_id)
    if query is None:
        return None
    prefix = wait_workflow_id(database_id, "")
    out: set[str] = set()
    # The raw list, workflow ids only: the client's list decodes every
    # execution's memo and search attributes, which for 10,000 waits took as
    # much of the worker's CPU as the inbound batches (issue 16).
    token = b""
    try:
        while True:
            page = await client.workflow_service.list_workflow_executions(
                ListWorkflowExecutionsRequest(
                    namespace=client.namespace, query=query, page_size=1000, next_page_token=token
                )
            )
            for info in page.executions:
                wid = info.execution.workflow_id
                if wid.startswith(prefix):
                    out.add(wid[len(prefix) :])
            token = page.next_page_token
            if not token:
                break
    except RPCError as err:
        log.info("running identity waits not listed", error=str(err))
        return None
    return out


async def running_waits(
    client: Client, database_id: str, key_hashes: list[str], listed: set[str] | None = None
) -> set[str]:
    """The key hashes among ``key_hashes`` whose ``IdentityWait`` runs, asked of the server.

    ``listed``: the answer of :func:`list_running_waits` (trusted as is); a
    key not in it (visibility lags a start; waits without search attributes)
    is asked by ``describe`` (at most :data:`SIGNAL_CONCURRENCY` at once). A
    key whose describe fails counts as not running (recovery starts it:
    signal-with-start is idempotent). Reads only: no history event.
    """
    wanted = set(key_hashes)
    running = wanted & (listed or set())
    gate = asyncio.Semaphore(SIGNAL_CONCURRENCY)

    async def describe(key: str) -> None:
        async with gate:
            try:
                desc = await client.get_workflow_handle(
                    wait_workflow_id(database_id, key)
                ).describe()
            except RPCError:
                return
            if desc.status == WorkflowExecutionStatus.RUNNING:
                running.add(key)

    await asyncio.gather(*(describe(k) for k in sorted(wanted - running)))
    return running
