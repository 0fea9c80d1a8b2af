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

FAILURE_PACK_REMOVED = "pack-removed"
"""Failure class of a work item whose connector-pack incarnation was removed before it ran."""


class RouteNotFoundError(NexusError):
    """No route for (pack, event kind, version) in the installed payload.

    ``failure_class``: what the item fails with (``route-not-found``).
    """

    failure_class = "route-not-found"


class PackRemovedError(RouteNotFoundError):
    """The item's incarnation was removed (``packs remove``): it fails ``pack-removed``.

    Not a wrong route: the same class the removal's sweep gives the pack's
    queued items (``incarnations.fail_removed_items``), for an item a worker
    prepares after the removal committed and before that sweep reached it.
    The seed stops a removed pack's pools and gives it no credential
    (``ErrConnectorPackInactive``); nothing of it runs once its routes are gone.
    """

    failure_class = FAILURE_PACK_REMOVED


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


def connector_pack_names(engine: Engine) -> dict[str, str]:
    """Pack name of every ConnectorPack incarnation the database knows, by install id.

    Every status (active, draining, retired, removed, failed): a metric or a
    report may name the pack of any work item. Empty when the system tables
    do not exist yet.
    """
    present = table_names(engine)
    ip, inc = t.installed_pack, t.connector_pack_incarnation
    out: dict[str, str] = {}
    with engine.connect() as conn:
        if inc.name in present:
            stmt = select(inc.c.PackInstallId, inc.c.Name).where(
                inc.c.Category == Category.ConnectorPack.value
            )
            out.update({str(i): str(n) for i, n in conn.execute(stmt).all()})
        if ip.name in present:
            stmt = select(ip.c.PackInstallId, ip.c.Name).where(
                ip.c.Category == Category.ConnectorPack.value
            )
            out.update({str(i): str(n) for i, n in conn.execute(stmt).all() if i})
    return out


def list_connector_packs(engine: Engine) -> list[ConnectorPackRow]:
    """Active and draining ConnectorPack incarnations, sorted by (namespace, install id).

    The current incarnation of each pack is its ``_System_InstalledPack`` row
    (``active``, or ``draining``); earlier incarnations an upgrade replaced
    while they had work are ``draining`` rows of
    ``_System_ConnectorPackIncarnation`` (served drain-only, through their own
    payload's routes, until their queue is empty).
    """
    present = table_names(engine)
    if t.installed_pack.name not in present:
        return []
    ip, inc = t.installed_pack, t.connector_pack_incarnation
    with engine.connect() as conn:
        rows = list(
            conn.execute(
                select(ip.c.Name, ip.c.PackInstallId, ip.c.Status, ip.c.PayloadHash, ip.c.Payload)
                .where(ip.c.Category == Category.ConnectorPack.value)
                .where(ip.c.Status.in_(["active", "draining"]))
            ).all()
        )
        if inc.name in present:
            rows += conn.execute(
                select(
                    inc.c.Name, inc.c.PackInstallId, inc.c.Status, inc.c.PayloadHash, inc.c.Payload
                )
                .where(inc.c.Category == Category.ConnectorPack.value)
                .where(inc.c.Status == "draining")
            ).all()
    rows.sort(key=lambda r: (r.Name, r.PackInstallId))
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


def removed_pack_name(engine: Engine, install_id: str) -> str | None:
    """The pack name of ``install_id`` when that incarnation was removed, else ``None``.

    Its current ``_System_InstalledPack`` row is ``removed``, or an earlier
    incarnation is recorded ``removed`` in ``_System_ConnectorPackIncarnation``.
    """
    ip, inc = t.installed_pack, t.connector_pack_incarnation
    with engine.connect() as conn:
        name = conn.execute(
            select(ip.c.Name).where(ip.c.PackInstallId == install_id, ip.c.Status == "removed")
        ).scalar()
        if name is None and inc.name in table_names(conn):
            name = conn.execute(
                select(inc.c.Name).where(
                    inc.c.PackInstallId == install_id, inc.c.Status == "removed"
                )
            ).scalar()
    return None if name is None else str(name)


def still_installed(engine: Engine, install_id: str) -> bool:
    """The incarnation ``install_id`` is still installed: ``active`` or ``draining``.

    Either the pack's current row (``_System_InstalledPack``) or an earlier
    incarnation still draining (``_System_ConnectorPackIncarnation``). A
    removed, retired or failed incarnation is not.
    """
    ip, inc = t.installed_pack, t.connector_pack_incarnation
    with engine.connect() as conn:
        status = conn.execute(select(ip.c.Status).where(ip.c.PackInstallId == install_id)).scalar()
        if status in ("active", "draining"):
            return True
        if inc.name not in table_names(conn):
            return False
        status = conn.execute(
            select(inc.c.Status).where(inc.c.PackInstallId == install_id)
        ).scalar()
    return status == "draining"


class RouteResolver:
    """Resolves routes by (installed pack id, event kind, version); caches per payload hash."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._packs: dict[str, ConnectorPackRow] = {}

    def pack(self, install_id: str) -> ConnectorPackRow:
        """The installed incarnation ``install_id``; raises ``RouteNotFoundError`` if gone.

        ``PackRemovedError`` (a ``RouteNotFoundError``) when it was removed.
        """
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
            name = removed_pack_name(self.engine, install_id)
            if name is not None:
                raise PackRemovedError(
                    f"connector pack {name} incarnation {install_id} was removed"
                )
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
