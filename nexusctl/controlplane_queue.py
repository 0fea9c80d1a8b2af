"""Client side of the control-plane queue (``workflows.controlplane_queue``).

How a request reaches the entity: **update-with-start**
(``Client.execute_update_with_start_workflow``, temporalio >= 1.9; this
project pins 1.35) with ``WorkflowIDConflictPolicy.USE_EXISTING``: the server
starts ``ControlPlane`` under ``controlplane/<database id>`` if it does not
run, and delivers the ``submit`` update to it, in one call, so concurrent
first requests never race to create it. The update is answered once a worker
ran it (the caller warns first when no worker polls the task queue).

Then the caller waits for its turn by polling the entity's ``status`` query
(queries follow the entity across continue-as-new and worker restarts), up to
its bound; once its entry runs (or ran), it watches the child workflow
``controlplane/<database id>/<operation>/<request id>`` directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from datetime import timedelta
from typing import Any

from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
)
from temporalio.exceptions import ApplicationError

from nexuscrm.contracts import ApplyAllInput, ApplyAllResult, OperationInput
from nexuscrm.contracts.controlplane_queue import (
    ControlPlaneEntityInput,
    ControlPlaneQueueStatus,
    ControlPlaneRequest,
    ControlPlaneTicket,
    QueueEntry,
    RemovePackInput,
    place,
)
from nexuscrm.errors import NexusError
from nexuscrm.settings import Settings
from workflows.controlplane import DATABASE_KEY

ENTITY_TYPE = "ControlPlane"
STATUS_POLL_S = 0.5
STARTING_GRACE_S = 60.0
"""How long past its wait bound a caller follows an entry whose turn came
(``starting``: its child is being created) before it gives up with
``ControlPlaneQueueTimeout``; a start that the entity retries without end (no
worker, the server refusing) does not hold the caller for ever."""
QUERY_TIMEOUT = timedelta(seconds=10)


class ControlPlaneBusyError(NexusError):
    """The database's control plane is busy and the request was not queued (``--no-queue``),
    or a control-plane workflow started before the queue existed still runs under its id."""


class ControlPlaneQueueTimeout(NexusError):
    """A queued request did not get its turn within its bound; it was not run."""


def build_request(
    operation: str,
    arg: ApplyAllInput | OperationInput | RemovePackInput,
    settings: Settings,
    *,
    no_queue: bool = False,
    coalesce: bool = False,
) -> ControlPlaneRequest:
    """The ``submit`` request for ``operation`` with its start argument ``arg``.

    The wait bound is ``settings.controlplane_queue_wait_seconds``.
    """
    req = ControlPlaneRequest(
        operation=operation,
        no_queue=no_queue,
        coalesce=coalesce,
        wait_seconds=settings.controlplane_queue_wait_seconds,
        requester=f"{socket.gethostname()} pid {os.getpid()}",
    )
    if isinstance(arg, ApplyAllInput):
        req.apply_all = arg
    elif isinstance(arg, RemovePackInput):
        req.remove_pack = arg
    else:
        req.operation_input = arg
    return req


async def submit(
    client: Client, settings: Settings, req: ControlPlaneRequest, *, _retried: bool = False
) -> ControlPlaneTicket:
    """Send ``req`` to the database's entity (started if absent); return its ticket.

    Raises ``ControlPlaneBusyError`` (``no_queue`` while busy, or a
    control-plane workflow of the pre-queue kind runs under the entity's id;
    a ``no_queue`` refusal is checked once against the entity's ``status``
    and sent again when nothing runs or waits any more)
    and ``NexusError`` for a request the entity rejects (the message names
    the bad value).
    """
    wf_id = settings.controlplane_workflow_id
    start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
        ENTITY_TYPE,
        ControlPlaneEntityInput(settings.database_id),
        id=wf_id,
        task_queue=settings.controlplane_task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=TypedSearchAttributes(
            [SearchAttributePair(DATABASE_KEY, settings.database_id)]
        ),
    )
    try:
        ticket: ControlPlaneTicket = await client.execute_update_with_start_workflow(
            "submit", req, start_workflow_operation=start, result_type=ControlPlaneTicket
        )
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == "ControlPlaneBusy":
            if not _retried and await _idle_now(client, settings):
                # Refused behind an operation whose end reached the entity with
                # this request, in one workflow task (after a worker restart):
                # the validator ran before the entity recorded that end, so
                # "busy" was already false. Ask once more.
                return await submit(client, settings, req, _retried=True)
            raise ControlPlaneBusyError(cause.message) from exc
        if isinstance(cause, ApplicationError) and cause.type == "BadRequest":
            raise NexusError(cause.message) from exc
        running = await client.get_workflow_handle(wf_id).describe()
        if running.workflow_type != ENTITY_TYPE:
            raise ControlPlaneBusyError(
                f"a {running.workflow_type} started before the control-plane queue is running "
                f"on database {settings.database_id} (workflow id {wf_id}, run "
                f"{running.run_id}); wait for it (`temporal workflow result -w {wf_id}`) "
                "and start again when it ends"
            ) from exc
        raise NexusError(f"the control-plane queue refused {req.operation}: {cause}") from exc
    if ticket.ahead and not ticket.coalesced:
        # The entity answers an update before it applies the other news of the same
        # workflow task (after a worker restart: the end of the operation "ahead"),
        # so ask where the entry stands once that task is done.
        with contextlib.suppress(Exception):  # no answer: keep the update's
            ticket = current_ticket(await queue_status(client, settings), ticket)
    return ticket


def current_ticket(
    status: ControlPlaneQueueStatus, ticket: ControlPlaneTicket
) -> ControlPlaneTicket:
    """``ticket`` as ``status`` (the entity's ``status`` query, asked after the
    update) places its entry now: running (nothing ahead), queued behind what
    runs and what waits before it, or already finished. An entry ``status`` no
    longer shows keeps ``ticket``."""
    entry = find_entry(status, ticket.entry.request_id)
    if entry is None:
        return ticket
    if entry.state not in ("queued", "starting", "running"):  # it already ended
        return ControlPlaneTicket(entry, ticket.coalesced, 0, [])
    position, ahead = place(entry, status.running, status.queued)
    return ControlPlaneTicket(entry, ticket.coalesced, position, ahead)


async def _idle_now(client: Client, settings: Settings) -> bool:
    """The entity answers that nothing runs or waits (``False`` when it cannot answer)."""
    try:
        status = await queue_status(client, settings)
    except Exception:  # no worker answered: keep the refusal
        return False
    return status.running is None and not status.queued


async def queue_status(client: Client, settings: Settings) -> ControlPlaneQueueStatus:
    """The entity's ``status`` query (needs a worker; raises ``RPCError`` otherwise)."""
    handle = client.get_workflow_handle(settings.controlplane_workflow_id)
    status: ControlPlaneQueueStatus = await handle.query(
        "status", result_type=ControlPlaneQueueStatus, rpc_timeout=QUERY_TIMEOUT
    )
    return status


def find_entry(status: ControlPlaneQueueStatus, request_id: str) -> QueueEntry | None:
    """The entry ``request_id`` wherever it is (running, queued, recently finished)."""
    for entry in [status.running, *status.queued, *reversed(status.recent)]:
        if entry is not None and entry.request_id == request_id:
            return entry
    return None


async def _child_exists(client: Client, workflow_id: str) -> bool:
    """Whether the server has an execution ``workflow_id`` (a describe: no worker needed)."""
    if not workflow_id:
        return False
    try:
        await client.get_workflow_handle(workflow_id).describe(rpc_timeout=QUERY_TIMEOUT)
    except Exception:
        return False
    return True


async def wait_turn(
    client: Client, settings: Settings, ticket: ControlPlaneTicket, wait_seconds: float
) -> QueueEntry:
    """Wait until the ticket's entry runs or has run; return it.

    Raises ``ControlPlaneQueueTimeout`` when the entity dropped it (its
    deadline passed), it is still queued ``wait_seconds`` after this call
    (a coalesced caller's own bound), or its turn came and its child was not
    started :data:`STARTING_GRACE_S` after that bound; ``NexusError`` when its
    child could not be started.
    """
    entry = ticket.entry
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            found = find_entry(await queue_status(client, settings), entry.request_id)
        except Exception:  # no worker answered in time: ask again until the bound
            found = entry if entry.state in ("queued", "starting") else None
            if (
                found is not None
                and found.state == "starting"
                and await _child_exists(client, found.workflow_id)
            ):
                # Its child was started (the server says so, no worker needed): the
                # caller follows the child. Without this a worker lost right after
                # the start (no one answers the query) held this loop for ever.
                found.state = "running"
        if found is None:  # trimmed from the recent list: it ran long ago
            entry.state = "completed"
            return entry
        entry = found
        if entry.state == "expired":
            raise ControlPlaneQueueTimeout(_timeout_message(settings, entry, wait_seconds))
        if entry.state == "failed" and entry.outcome.startswith("could not start"):
            raise NexusError(entry.outcome)
        if entry.state == "starting":  # its turn came: the child is being created
            if time.monotonic() > deadline + STARTING_GRACE_S:
                raise ControlPlaneQueueTimeout(
                    _timeout_message(settings, entry, wait_seconds + STARTING_GRACE_S)
                )
            await asyncio.sleep(STATUS_POLL_S / 5)
            continue
        if entry.state != "queued":
            return entry
        if time.monotonic() > deadline:
            raise ControlPlaneQueueTimeout(_timeout_message(settings, entry, wait_seconds))
        await asyncio.sleep(STATUS_POLL_S)


async def settled(
    client: Client, settings: Settings, request_id: str, timeout_s: float = 10.0
) -> None:
    """Wait (briefly, best effort) until the entity has recorded ``request_id`` as finished.

    A caller that saw its operation's result returns only once the queue is
    free of it, so a following ``--no-queue`` command is not refused by it.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            entry = find_entry(await queue_status(client, settings), request_id)
        except Exception:
            return
        if entry is None or entry.state not in ("queued", "starting", "running"):
            return
        await asyncio.sleep(0.1)


def _timeout_message(settings: Settings, entry: QueueEntry, wait_seconds: float) -> str:
    why = f" ({entry.outcome})" if entry.outcome else ""
    if entry.state == "starting":
        return (
            f"timed out after {wait_seconds:g} s: the turn of {entry.operation} "
            f"{entry.workflow_id} came in the control-plane queue of database "
            f"{settings.database_id}, but the server has no such workflow yet and no "
            f"worker answered{why}; is a worker serving task queue "
            f"{settings.controlplane_task_queue}? See `nexusctl queue`, then try again"
        )
    return (
        f"timed out after {wait_seconds:g} s waiting for its turn in the control-plane queue "
        f"of database {settings.database_id}: {entry.operation} {entry.workflow_id} was not "
        f"started{why}; see `nexusctl queue`, then try again, or raise "
        "NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS"
    )


def operation_handle(client: Client, entry: QueueEntry) -> WorkflowHandle[Any, ApplyAllResult]:
    """The child workflow of ``entry`` (its progress query and its result)."""
    return client.get_workflow_handle(entry.workflow_id, result_type=ApplyAllResult)


async def run_queued(
    client: Client,
    settings: Settings,
    operation: str,
    arg: ApplyAllInput | OperationInput | RemovePackInput,
    *,
    no_queue: bool = False,
    coalesce: bool = False,
) -> WorkflowHandle[Any, ApplyAllResult]:
    """Submit, wait for the turn (bounded), return the running operation's handle.

    Raises what :func:`submit` and :func:`wait_turn` raise.
    """
    req = build_request(operation, arg, settings, no_queue=no_queue, coalesce=coalesce)
    ticket = await submit(client, settings, req)
    entry = await wait_turn(client, settings, ticket, req.wait_seconds)
    return operation_handle(client, entry)
