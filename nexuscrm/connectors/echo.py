"""Outbound echo probe: recognise an inbound event that echoes the system's own write.

Port of the seed's ``connector_inbound.SQLOutboundEchoProbe`` (installed on
every worker by ``worker.SetOutboundEchoProbe``). When the CRM writes a record
to the remote system, the remote system emits a change event for that write,
which comes back inbound. Running its flow would rewrite what the CRM already
holds (and, with an outbound sync, ping-pong). The writer records each
outbound write in ``_System_ConnectorOutboundWrite`` (:func:`record_outbound_write`);
the processor probes claimed items against it before anything else and
finishes an echo as succeeded without running its flow.

Matching rule: same connector owner (the connector pack's namespace), event
namespace, remote object (the event's ``SourceObject``) and remote id (its
``SourceId``); the event's own ``fields`` (before enrichment) hash exactly to
the written fields (:func:`fields_hash`: keys lower-cased, canonical JSON);
the write has not expired (``ExpiresAt``) and has not matched an echo yet. A
match is consumed (``EchoWorkId``), so one write suppresses at most one
event: a later identical change is a real change and runs.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, select

from nexuscrm.clock import utcnow
from nexuscrm.db import tables as t

ECHO_WINDOW = dt.timedelta(minutes=15)
"""How long after an outbound write its echo is expected (default of ``record_outbound_write``)."""

_ow = t.connector_outbound_write


def fields_hash(fields: Mapping[str, Any]) -> str:
    """sha256 hex of ``fields`` with lower-cased keys, as sorted compact JSON.

    Remote field names are case-insensitive (Salesforce API names), values
    compare as JSON (non-JSON values by their ``str``).
    """
    canonical = {str(k).lower(): v for k, v in fields.items()}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def record_outbound_write(
    conn: Connection,
    *,
    owner_key: str,
    namespace: str,
    object_name: str,
    remote_id: str,
    fields: Mapping[str, Any],
    now: dt.datetime | None = None,
    window: dt.timedelta = ECHO_WINDOW,
) -> str:
    """Record one outbound write in the caller's transaction; return its ``WriteId``.

    ``owner_key`` is the connector pack's namespace, ``namespace`` the remote
    namespace the inbound events will carry, ``object_name``/``remote_id``
    the remote record, ``fields`` exactly what was written. Raises
    ``ValueError`` for a blank identity part or a non-positive ``window``.
    """
    for what, value in (
        ("owner_key", owner_key),
        ("object_name", object_name),
        ("remote_id", remote_id),
    ):
        if not value.strip():
            raise ValueError(f"record_outbound_write: {what} is blank")
    if window <= dt.timedelta(0):
        raise ValueError(f"record_outbound_write: window must be positive, got {window}")
    when = now or utcnow()
    write_id = uuid.uuid4().hex
    conn.execute(
        _ow.insert().values(
            WriteId=write_id,
            ConnectorOwnerKey=owner_key,
            Namespace=namespace,
            ObjectName=object_name,
            RemoteId=remote_id,
            FieldsHash=fields_hash(fields),
            WrittenAt=when,
            ExpiresAt=when + window,
            CreatedDate=when,
            LastModifiedDate=when,
        )
    )
    return write_id


@dataclass(frozen=True)
class EchoCandidate:
    """One claimed event as the probe sees it (``fields`` before enrichment)."""

    work_id: str
    owner_key: str
    namespace: str
    object_name: str
    remote_id: str
    fields: Mapping[str, Any]


class SQLOutboundEchoProbe:
    """Port of ``SQLOutboundEchoProbe{DB}``: outbound-write lookups for a batch.

    :meth:`probe` is a read (one query per batch); :meth:`consume` marks the
    matched writes in the caller's write transaction, compare-and-set, so
    two workers can never both suppress an event with the same write.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def probe(
        self, candidates: Sequence[EchoCandidate], *, now: dt.datetime | None = None
    ) -> dict[str, str]:
        """``{work id: WriteId}`` of the candidates that echo an unexpired, unconsumed write.

        Two candidates never share a write (the earlier in input order wins).
        Database errors propagate: running the items without the probe could
        replay an echo, so the batch fails and its leases expire.
        """
        if not candidates:
            return {}
        when = now or utcnow()
        remote_ids = sorted({c.remote_id for c in candidates if c.remote_id})
        if not remote_ids:
            return {}
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(
                    _ow.c.WriteId,
                    _ow.c.ConnectorOwnerKey,
                    _ow.c.Namespace,
                    _ow.c.ObjectName,
                    _ow.c.RemoteId,
                    _ow.c.FieldsHash,
                )
                .where(
                    _ow.c.RemoteId.in_(remote_ids),
                    _ow.c.EchoWorkId.is_(None),
                    _ow.c.ExpiresAt > when,
                )
                .order_by(_ow.c.WrittenAt, _ow.c.WriteId)
            ).all()
        if not rows:  # the usual case: nothing was written out to these records
            return {}
        writes: dict[tuple[str, str, str, str], dict[str, list[str]]] = {}
        for r in rows:
            key = (r.ConnectorOwnerKey, r.Namespace, r.ObjectName.lower(), r.RemoteId)
            writes.setdefault(key, {}).setdefault(r.FieldsHash, []).append(r.WriteId)
        out: dict[str, str] = {}
        for c in candidates:
            by_hash = writes.get((c.owner_key, c.namespace, c.object_name.lower(), c.remote_id))
            if not by_hash:
                continue  # hash only the fields of a record that was written out
            ids = by_hash.get(fields_hash(c.fields))
            if ids:
                out[c.work_id] = ids.pop(0)
        return out

    @staticmethod
    def consume(
        conn: Connection, work_id: str, write_id: str, *, now: dt.datetime | None = None
    ) -> bool:
        """Mark ``write_id`` echoed by ``work_id`` in ``conn``'s transaction; False if taken."""
        when = now or utcnow()
        res = conn.execute(
            _ow.update()
            .where(_ow.c.WriteId == write_id, _ow.c.EchoWorkId.is_(None))
            .values(EchoWorkId=work_id, EchoedAt=when, LastModifiedDate=when)
        )
        return res.rowcount == 1
