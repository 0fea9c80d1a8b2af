"""Identity-convergence dependencies: the key an item waits on, its hash, the probe.

An inbound item whose lookup points at a parent that is not linked yet is
``blocked`` on a *dependency* (port of the seed's ``IdentityConvergence``
dependency on the WorkItem row):

* ``remote_identity``: a remote link (owner key, namespace, destination
  object, remote id) in ``_System_ConnectorRemoteLink`` — what the reference
  flow waits on;
* ``record``: a local record (object, record id) that does not exist yet.

Its canonical key is the kind and the fields joined by U+001F; the key hash
(``DependencyKeyHash``) is the sha256 hex of that key. Items waiting on one
key share one ``IdentityWaitWorkflow``. :func:`probe` is the fresh owner read.

A :class:`Dependency` is the validated domain value (frozen, checked on
construction, with its key, key hash and WorkItem columns); on the wire it
travels as the plain ``nexuscrm.contracts.DependencySpec`` (same fields, same
order), converted by :func:`to_spec` and :func:`from_spec`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, and_, bindparam, func, select, text

from nexuscrm import catalog
from nexuscrm.contracts import DependencySpec
from nexuscrm.db import tables as t
from nexuscrm.errors import NexusError

KIND_REMOTE_IDENTITY = "remote_identity"
KIND_RECORD = "record"
KINDS = (KIND_REMOTE_IDENTITY, KIND_RECORD)

FAILURE_CLASS_EXPIRED = "identity-convergence-expired"
FAILURE_CLASS_INVALID = "identity-convergence-invalid"
FAILURE_CLASS_BLOCKED = "dependency-unresolved"


class InvalidDependency(NexusError, ValueError):
    """A dependency lacks a field its kind needs."""


@dataclass(frozen=True)
class Dependency:
    """What a blocked item waits on.

    ``object_api_name`` is the destination object for both kinds;
    ``record_id`` is set for ``record``; ``owner_key``, ``namespace`` and
    ``remote_id`` for ``remote_identity``.
    """

    kind: str
    object_api_name: str
    record_id: str = ""
    owner_key: str = ""
    namespace: str = ""
    remote_id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidDependency(f"unknown dependency kind {self.kind!r}")
        if not self.object_api_name:
            raise InvalidDependency("dependency lacks its object")
        if self.kind == KIND_RECORD and not self.record_id:
            raise InvalidDependency("record dependency lacks its record id")
        if self.kind == KIND_REMOTE_IDENTITY and not (
            self.owner_key and self.namespace and self.remote_id
        ):
            raise InvalidDependency("remote identity dependency lacks part of its tuple")

    @classmethod
    def remote(
        cls, owner_key: str, namespace: str, destination_object: str, remote_id: str
    ) -> Dependency:
        """A ``remote_identity`` dependency."""
        return cls(KIND_REMOTE_IDENTITY, destination_object, "", owner_key, namespace, remote_id)

    @classmethod
    def record(cls, object_api_name: str, record_id: str) -> Dependency:
        """A ``record`` dependency."""
        return cls(KIND_RECORD, object_api_name, record_id)

    @property
    def key(self) -> str:
        """The canonical key: kind and fields joined by U+001F."""
        if self.kind == KIND_RECORD:
            parts = [self.kind, self.object_api_name, self.record_id]
        else:
            parts = [self.kind, self.owner_key, self.namespace, self.object_api_name]
            parts.append(self.remote_id)
        return "\x1f".join(parts)

    @property
    def key_hash(self) -> str:
        """sha256 hex of :attr:`key` (``DependencyKeyHash``)."""
        return hashlib.sha256(self.key.encode("utf-8")).hexdigest()

    def columns(self) -> dict[str, Any]:
        """The WorkItem ``Dependency*`` column values (without BlockedAt / ProbeAfter)."""
        remote = self.kind == KIND_REMOTE_IDENTITY
        return {
            "DependencyKind": self.kind,
            "DependencyObjectAPIName": self.object_api_name,
            "DependencyRecordId": self.record_id or None,
            "DependencyKeyHash": self.key_hash,
            "DependencyConnectorOwnerKey": self.owner_key if remote else None,
            "DependencyConnectorNamespace": self.namespace if remote else None,
            "DependencyDestinationSlotId": self.object_api_name if remote else None,
            "DependencyConnectorRemoteId": self.remote_id if remote else None,
        }

    @classmethod
    def from_row(cls, row: Any) -> Dependency | None:
        """The dependency of a WorkItem row (mapping or Row); ``None`` when incomplete."""
        m = row if isinstance(row, dict) else row._mapping
        kind = m.get("DependencyKind")
        try:
            if kind == KIND_RECORD:
                return cls.record(
                    m.get("DependencyObjectAPIName") or "", m.get("DependencyRecordId") or ""
                )
            if kind == KIND_REMOTE_IDENTITY:
                return cls.remote(
                    m.get("DependencyConnectorOwnerKey") or "",
                    m.get("DependencyConnectorNamespace") or "",
                    m.get("DependencyDestinationSlotId") or m.get("DependencyObjectAPIName") or "",
                    m.get("DependencyConnectorRemoteId") or "",
                )
        except InvalidDependency:
            return None
        return None


def to_spec(dep: Dependency) -> DependencySpec:
    """``dep`` as wire data (``DependencySpec``, field by field)."""
    return DependencySpec(**asdict(dep))


def from_spec(spec: DependencySpec) -> Dependency:
    """Wire data back to a ``Dependency``; raises :class:`InvalidDependency` when invalid."""
    return Dependency(**asdict(spec))


def probe(engine: Engine, dep: Dependency) -> bool:
    """A fresh owner read: True when the dependency is there now (converged)."""
    with engine.connect() as conn:
        if dep.kind == KIND_REMOTE_IDENTITY:
            rl = t.connector_remote_link
            found = conn.execute(
                select(rl.c.RecordId).where(
                    rl.c.ConnectorOwnerKey == dep.owner_key,
                    rl.c.Namespace == dep.namespace,
                    rl.c.DestinationObject == dep.object_api_name,
                    rl.c.RemoteId == dep.remote_id,
                )
            ).first()
            return found is not None
        obj = catalog.CACHE.get(engine).get(dep.object_api_name)
        if obj is None or not obj.has_table:
            return False
        quote = conn.dialect.identifier_preparer.quote
        found = conn.execute(
            text(f"SELECT 1 FROM {quote(obj.table_name)} WHERE {quote('Id')} = :id"),
            {"id": dep.record_id},
        ).first()
        return found is not None


def resolved_keys(engine: Engine, deps: Iterable[Dependency]) -> set[str]:
    """Key hashes of ``deps`` that resolved (a fresh :func:`probe` each, one per key).

    The post-commit recheck of a batch's blocked items (issue 16): an item that
    read "no link" before its parent's batch committed the link, and committed
    its block after that batch read the blocked rows to wake, is woken by no
    one else. Its own recheck, after its commit, sees the link.
    """
    by_key = {d.key_hash: d for d in deps}
    return {key for key, dep in sorted(by_key.items()) if probe(engine, dep)}


RESOLVED_CHUNK = 500
"""Record ids per existence read of :func:`resolved_blocked_keys`."""


def resolved_blocked_keys(engine: Engine) -> set[str]:
    """Key hashes of every blocked item whose dependency exists now (one set-based recheck).

    The seed polls each blocked row every 5 s; here the fleet's identity
    recovery asks once for all of them (issue 16), so a parked wait needs no
    probes of its own while idle: one join of the blocked rows
    (``ix_ConnectorWorkItem_Dependency``) with the remote links by primary
    key, and for ``record`` dependencies, one ``Id IN (...)`` read per object
    and 500 ids. Rows whose columns are incomplete are left to the invalid
    sweep. Reads only.
    """
    w, rl = t.connector_work_item, t.connector_remote_link
    blocked = (w.c.DependencyKeyHash.is_not(None), w.c.State == "blocked")
    out: set[str] = set()
    with engine.connect() as conn:
        out.update(
            conn.execute(
                select(w.c.DependencyKeyHash)
                .join(
                    rl,
                    and_(
                        rl.c.ConnectorOwnerKey == w.c.DependencyConnectorOwnerKey,
                        rl.c.Namespace == w.c.DependencyConnectorNamespace,
                        rl.c.DestinationObject
                        == func.coalesce(
                            w.c.DependencyDestinationSlotId, w.c.DependencyObjectAPIName
                        ),
                        rl.c.RemoteId == w.c.DependencyConnectorRemoteId,
                    ),
                )
                .where(*blocked, w.c.DependencyKind == KIND_REMOTE_IDENTITY)
                .distinct()
            ).scalars()
        )
        records: dict[str, dict[str, set[str]]] = {}
        for key, obj, rid in conn.execute(
            select(w.c.DependencyKeyHash, w.c.DependencyObjectAPIName, w.c.DependencyRecordId)
            .where(*blocked, w.c.DependencyKind == KIND_RECORD)
            .distinct()
        ):
            if obj and rid:
                records.setdefault(obj, {}).setdefault(rid, set()).add(key)
        if not records:
            return out
        cat = catalog.CACHE.get(engine)
        quote = conn.dialect.identifier_preparer.quote
        for obj_name, by_id in sorted(records.items()):
            obj = cat.get(obj_name)
            if obj is None or not obj.has_table:
                continue
            ids = sorted(by_id)
            sql = text(
                f"SELECT {quote('Id')} FROM {quote(obj.table_name)} WHERE {quote('Id')} IN :ids"
            ).bindparams(bindparam("ids", expanding=True))
            for start in range(0, len(ids), RESOLVED_CHUNK):
                found = conn.execute(
                    sql,
                    {"ids": ids[start : start + RESOLVED_CHUNK]},
                ).scalars()
                for rid in found:
                    out.update(by_id.get(rid, ()))
    return out


def wait_workflow_id(database_id: str, key_hash: str) -> str:
    """``identity/<database id>/<key hash>``: the one wait of a dependency."""
    return f"identity/{database_id}/{key_hash}"
