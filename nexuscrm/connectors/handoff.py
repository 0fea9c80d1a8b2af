"""The connector role, and the Runtime command handoff it may select.

Port of the seed's ``NewRuntimeSupervisor`` / ``NewRuntimeCommandHandoffWorker``
/ ``RuntimeCommandHandoffSupportsInvocationMode`` and the start check
"Runtime handoff requires a serving selection".

A connector worker process has one role (``NEXUS_CONNECTOR_ROLE``):

* ``local`` (default): routes with invocation mode ``flow`` run their flow in
  this process (``upsert_record``, ``webhook``).
* ``handoff``: the independent Integration execution role. Each item's
  business operation is written as a row of ``_System_RuntimeCommand`` for a
  separate runtime service, in the transaction that finishes the item. It
  serves only a frozen serving selection, refuses routes whose invocation
  mode the handoff does not support, never runs a local flow (no fallback),
  and does no identity recovery: the runtime owns the command's
  dependencies (seed: ``disableIdentityRecovery``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from nexuscrm.clock import utcnow
from nexuscrm.connectors.desired import LOCAL_FLOW_MODES
from nexuscrm.connectors.queue import ClaimedItem
from nexuscrm.connectors.serving import (
    RuntimeServingSelection,
    ServingSelectionError,
    require_route_authority,
)
from nexuscrm.db import tables as t
from nexuscrm.packs.model import InboundRoute

ROLE_LOCAL = "local"
ROLE_HANDOFF = "handoff"
ROLES = (ROLE_LOCAL, ROLE_HANDOFF)

HANDOFF_MODES = frozenset({"runtime_command_handoff"})
"""Invocation modes the Runtime command handoff carries."""

COMMAND_PENDING = "pending"


def runtime_command_handoff_supports_invocation_mode(mode: str) -> bool:
    """Port of ``RuntimeCommandHandoffSupportsInvocationMode``: True for handoff modes only."""
    return mode.strip().lower() in HANDOFF_MODES


def supported_modes(role: str) -> frozenset[str]:
    """Invocation modes a supervisor of ``role`` runs; ``ValueError`` for an unknown role."""
    if role == ROLE_LOCAL:
        return LOCAL_FLOW_MODES
    if role == ROLE_HANDOFF:
        return HANDOFF_MODES
    raise ValueError(f"connector role {role!r} must be one of {', '.join(ROLES)}")


def require_serving_selection(role: str, selection: RuntimeServingSelection | None) -> None:
    """Refuse a handoff role without a frozen serving selection (the seed's start check).

    Raises :class:`ServingSelectionError` ``connector inbound supervisor:
    Runtime handoff requires a serving selection`` (``NEXUS_SERVING_SELECTION``
    names the file) when ``role`` is ``handoff`` and ``selection`` is
    ``None``, and ``connector inbound supervisor: Runtime serving route
    authority is unavailable`` for a selection that selects no route
    (``serving.require_route_authority``, the seed's other pre-start check);
    ``ValueError`` for an unknown role.
    """
    supported_modes(role)
    if selection is not None:
        require_route_authority(selection)
    if role == ROLE_HANDOFF and selection is None:
        raise ServingSelectionError(
            "connector inbound supervisor: Runtime handoff requires a serving selection "
            "(NEXUS_CONNECTOR_ROLE=handoff: set NEXUS_SERVING_SELECTION to the frozen "
            "selection file)"
        )


@dataclass(frozen=True)
class RuntimeCommand:
    """One command row to write: the item, its route and its connector owner (pack namespace)."""

    item: ClaimedItem
    route: InboundRoute
    owner_key: str


def write_commands(conn: Connection, commands: Sequence[RuntimeCommand]) -> dict[str, str]:
    """Insert ``_System_RuntimeCommand`` rows in the caller's transaction.

    Port of the seed's Runtime command boundary (``RuntimeCommandHandoff``).
    One row per item, ``State='pending'``, with the route coordinate, its
    mode and operation (the route's flow name), the event's payload (as
    enriched) and frozen companion. Returns ``{work id: CommandId}``. A
    second command for the same WorkItem violates ``uq_RuntimeCommand_Work``
    (an IntegrityError: the caller's transaction rolls back).
    """
    if not commands:
        return {}
    now = utcnow()
    rows = []
    out: dict[str, str] = {}
    for cmd in commands:
        item, route = cmd.item, cmd.route
        command_id = uuid.uuid4().hex
        out[item.work_id] = command_id
        rows.append(
            {
                "CommandId": command_id,
                "WorkId": item.work_id,
                "EventId": item.event_id,
                "InstalledPackId": item.installed_pack_id,
                "ConnectorOwnerKey": cmd.owner_key,
                "Namespace": item.namespace,
                "EventKind": route.event_kind,
                "RouteVersion": route.route_version,
                "InvocationMode": route.invocation_mode,
                "Operation": route.flow,
                "DestinationObject": route.destination_object,
                "SourceObject": item.source_object,
                "SourceId": item.source_id,
                "Payload": json.dumps(item.payload, separators=(",", ":"), default=str),
                "CompanionPackInstallId": item.companion_pack_install_id,
                "State": COMMAND_PENDING,
                "CreatedDate": now,
                "LastModifiedDate": now,
            }
        )
    conn.execute(t.runtime_command.insert(), rows)
    return out
