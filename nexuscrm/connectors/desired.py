"""Which connector pack incarnations the fleet serves (the seed's pack lister).

Without a serving selection: every active and draining ConnectorPack. With a
``RuntimeServingSelection`` (frozen by a deploy pipeline before the process
starts): exactly the selected packs, each admitted only if its installed row
is active (a drain-only generation is refused) with the selected payload
digest and every selected route resolves in that payload with an invocation
mode this supervisor can run; a pack that fails admission is not served, and
the reason is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from nexuscrm.connectors.routes import ConnectorPackRow, list_connector_packs
from nexuscrm.connectors.serving import (
    RuntimeServingSelection,
    ServingSelectionError,
    refuse_drain_only,
    require_route_authority,
    selected_profiles,
)

# Invocation modes a local-flow supervisor runs (the handoff role is separate).
LOCAL_FLOW_MODES = frozenset({"flow"})


@dataclass
class DesiredSet:
    """Packs to serve, and packs refused with the reason (keyed ``namespace/install id``)."""

    packs: list[ConnectorPackRow] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)


def desired_packs(
    engine: Engine,
    selection: RuntimeServingSelection | None,
    *,
    supported_modes: frozenset[str] = LOCAL_FLOW_MODES,
) -> DesiredSet:
    """The packs to serve now; see the module docstring for the selection rules.

    ``supported_modes``: invocation modes the supervisor's role runs (the
    handoff role passes ``handoff.HANDOFF_MODES``).

    Port of ``runtimeServingPackLister`` and ``verifyRuntimeServingRoutes``.
    Under a selection the listing is all-or-nothing, as the seed's lister: an
    empty selection (``Runtime serving route authority is unavailable``), a
    selected pack that is not an active ready generation (absent, or
    drain-only), whose payload digest differs, or whose selected route is
    missing or of an unsupported invocation mode raises
    :class:`ServingSelectionError` with the seed's message, so the runtime
    refuses to start (startup) or stops every pool (later reconciles) rather
    than silently serving a part of the selection. Database errors propagate
    (the fleet keeps running pools on read errors without a selection).
    """
    if selection is not None:
        require_route_authority(selection)
    rows = list_connector_packs(engine)
    if selection is None:
        return DesiredSet(packs=rows)
    out = DesiredSet()
    by_key = {(r.namespace, r.install_id): r for r in rows}
    for selected in selection.packs:
        row = by_key.get((selected.namespace, selected.installed_pack_id))
        selection.check_pack_row(
            selected.namespace,
            selected.installed_pack_id,
            row is not None,
            row.payload_hash if row else "",
        )
        assert row is not None
        # A selection is exact authority over one active generation.
        refuse_drain_only(row.drain_only)
        routes = {(r.event_kind, r.route_version): r for r in row.pack.inbound_routes}
        for coord in selected.inbound_routes:
            route = routes.get((coord.event_kind, coord.route_version))
            if route is None:
                raise ServingSelectionError(
                    f"connector inbound supervisor: verify Runtime serving route "
                    f"{selected.namespace}/{coord.event_kind} ({selected.installed_pack_id}) "
                    f"version {coord.route_version}: route not found in the installed payload"
                )
            if route.invocation_mode not in supported_modes:
                raise ServingSelectionError(
                    f"connector inbound supervisor: Runtime serving route "
                    f"{selected.namespace}/{coord.event_kind} ({selected.installed_pack_id}) "
                    f"version {coord.route_version} selects unsupported invocation mode "
                    f"{route.invocation_mode!r}"
                )
        out.packs.append(row)
    return out


def verify_serving_selection(
    engine: Engine,
    selection: RuntimeServingSelection,
    *,
    supported_modes: frozenset[str] = LOCAL_FLOW_MODES,
) -> list[ConnectorPackRow]:
    """The runtime's start check under a selection (seed ``StartContext``): refuse to start.

    :func:`desired_packs` (route authority, active ready generation, digest,
    every selected route and its mode) and every selected callout profile
    with its credential references (:func:`selected_profiles`). Run before
    the worker process starts serving (``nexusctl worker``); the fleet's
    startup reconcile repeats it. Returns the selected rows; raises
    :class:`ServingSelectionError` with the seed's message.
    """
    rows = desired_packs(engine, selection, supported_modes=supported_modes).packs
    for row in rows:
        selected_profiles(row, selection)
    return rows
