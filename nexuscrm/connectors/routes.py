"""Connector packs as installed, and route resolution.

Port of the seed's pack lister (``packstate`` connector rows) and route
resolver: a route is found by (installed pack id, event kind, route version)
in the exact payload the pack was installed with.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sqlalchemy import Engine, select

from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.errors import NexusError
from nexuscrm.packs.model import Category, InboundRoute, PackManifest


class RouteNotFoundError(NexusError):
    """No route for (pack, event kind, version) in the installed payload."""


@dataclass(frozen=True)
class ConnectorPackRow:
    """One installed connector pack incarnation.

    namespace: the pack name; install_id: ``PackInstallId`` (one incarnation);
    status: ``active`` or ``draining`` (drain-only: serve its queue, no new work).
    """

    namespace: str
    install_id: str
    status: str
    payload_hash: str
    pack: PackManifest

    @property
    def drain_only(self) -> bool:
        """True for an incarnation being drained."""
        return self.status == "draining"


def list_connector_packs(engine: Engine) -> list[ConnectorPackRow]:
    """Active and draining ConnectorPack incarnations, sorted by (namespace, install id)."""
    if t.installed_pack.name not in table_names(engine):
        return []
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                t.installed_pack.c.Name,
                t.installed_pack.c.PackInstallId,
                t.installed_pack.c.Status,
                t.installed_pack.c.PayloadHash,
                t.installed_pack.c.Payload,
            )
            .where(t.installed_pack.c.Category == Category.ConnectorPack.value)
            .where(t.installed_pack.c.Status.in_(["active", "draining"]))
            .order_by(t.installed_pack.c.Name, t.installed_pack.c.PackInstallId)
        ).all()
    return [
        ConnectorPackRow(
            r.Name,
            r.PackInstallId,
            r.Status,
            r.PayloadHash,
            PackManifest.model_validate_json(r.Payload),
        )
        for r in rows
        if r.Payload
    ]


class RouteResolver:
    """Resolves routes by (installed pack id, event kind, version); caches per payload hash."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._packs: dict[str, ConnectorPackRow] = {}

    def pack(self, install_id: str) -> ConnectorPackRow:
        """The installed incarnation ``install_id``; raises ``RouteNotFoundError`` if gone."""
        with self._lock:
            cached = self._packs.get(install_id)
        if cached is not None:
            return cached
        for row in list_connector_packs(self.engine):
            with self._lock:
                self._packs[row.install_id] = row
        with self._lock:
            found = self._packs.get(install_id)
        if found is None:
            raise RouteNotFoundError(f"connector pack install {install_id} is not installed")
        return found

    def resolve(self, install_id: str, event_kind: str, version: int) -> InboundRoute:
        """The route for this event; raises ``RouteNotFoundError`` naming all three."""
        pack = self.pack(install_id)
        kind = event_kind.strip().lower()
        for route in pack.pack.inbound_routes:
            if route.event_kind == kind and route.route_version == version:
                return route
        raise RouteNotFoundError(
            f"pack {pack.namespace} ({install_id}) has no route {kind} version {version}"
        )

    def forget(self) -> None:
        """Drop cached packs (after a pack apply or removal)."""
        with self._lock:
            self._packs.clear()
