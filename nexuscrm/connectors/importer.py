"""Salesforce DX data plans (``sfdx force:data:tree:import`` input) as inbound events.

A data plan (``data/sample-data-plan.json``) is a list of entries::

    [{"sobject": "Broker__c", "saveRefs": true, "files": ["brokers-data.json"]},
     {"sobject": "Property__c", "resolveRefs": true, "files": ["properties-data.json"]}]

and each named file (relative to the plan's folder) holds SObject tree records::

    {"records": [{"attributes": {"type": "Broker__c", "referenceId": "Broker__cRef1"},
                  "Name": "Caroline Kingsley", "Broker__c": "@Broker__cRef5", ...}]}

Every record becomes one :class:`~nexuscrm.connectors.queue.EnqueueRequest`
as if a connector had received it from Salesforce: the ``referenceId`` stands
for the remote (Salesforce) record id, and a lookup ``"@Ref"`` becomes the
referenced record's remote id, listed in ``payload["references"]`` so the flow
knows which fields are lookups by remote id.

Reference resolution follows the Salesforce CLI: values are resolved only in
entries with ``"resolveRefs": true``; elsewhere a string starting with ``@``
is kept verbatim as data (the corpus's ``resolveRefs: false`` entry, DreamHouse
``Contact``, has no ``@`` values at all). Unlike the CLI, a reference may name
any record of the plan (not only records of ``saveRefs`` entries, and also a
later one): referenceIds are remote ids here, and the connector runtime's
identity convergence orders parents and children. ``referenceId`` values must
be unique across the plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexuscrm.connectors.eventfile import EventFileError, load_json_file
from nexuscrm.connectors.queue import EnqueueRequest
from nexuscrm.errors import ManifestError

DEFAULT_NAMESPACE = "salesforce"
DEFAULT_EVENT_KIND = "salesforce.record.upsert"


@dataclass(frozen=True)
class _PlanRecord:
    sobject: str
    reference_id: str
    fields: dict[str, Any]
    resolve_refs: bool
    file: Path


def _load_json(path: Path) -> Any:
    """Parse ``path`` as JSON; ``ManifestError`` naming the file when it cannot be used.

    Missing or unreadable, a directory, over 64 MiB (``/dev/zero`` stops
    there), not UTF-8, malformed JSON (line and column) or nested deeper than
    64 levels (``eventfile.load_json_file``).
    """
    try:
        return load_json_file(path, "data plan file")
    except EventFileError as exc:
        reason = exc.problems[0].removeprefix(f"{path}: ")
        raise ManifestError(str(path), reason) from None


def _plan_entries(plan_path: Path, plan: Any) -> list[tuple[str | None, bool, list[Path]]]:
    """(sobject, resolveRefs, data files) of each plan entry, in plan order."""
    if not isinstance(plan, list):
        raise ManifestError(str(plan_path), "a data plan must be a JSON array of entries")
    entries: list[tuple[str | None, bool, list[Path]]] = []
    for i, entry in enumerate(plan):
        where = f"entry {i}"
        if not isinstance(entry, dict):
            raise ManifestError(str(plan_path), f"{where}: must be an object")
        sobject = entry.get("sobject")
        if sobject is not None and not isinstance(sobject, str):
            raise ManifestError(str(plan_path), f"{where}: 'sobject' must be a string")
        files = entry.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise ManifestError(
                str(plan_path), f"{where} ({sobject}): 'files' must be a non-empty list of names"
            )
        resolve = entry.get("resolveRefs", False)
        if not isinstance(resolve, bool):
            raise ManifestError(str(plan_path), f"{where} ({sobject}): 'resolveRefs' not boolean")
        entries.append((sobject, resolve, [plan_path.parent / f for f in files]))
    return entries


def _read_records(path: Path, sobject: str | None, resolve: bool) -> list[_PlanRecord]:
    """The records of one SObject tree file, validated."""
    doc = _load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        raise ManifestError(str(path), "expected an object with a 'records' array")
    out: list[_PlanRecord] = []
    for i, rec in enumerate(doc["records"]):
        where = f"record {i}"
        if not isinstance(rec, dict):
            raise ManifestError(str(path), f"{where}: must be an object")
        attrs = rec.get("attributes")
        if not isinstance(attrs, dict):
            raise ManifestError(str(path), f"{where}: missing 'attributes'")
        rtype = attrs.get("type")
        ref = attrs.get("referenceId")
        if not isinstance(rtype, str) or not rtype:
            raise ManifestError(str(path), f"{where}: missing attributes.type")
        if not isinstance(ref, str) or not ref:
            raise ManifestError(str(path), f"{where} ({rtype}): missing attributes.referenceId")
        if sobject is not None and rtype != sobject:
            raise ManifestError(
                str(path), f"{where} ({ref}): type {rtype} but the plan entry is {sobject}"
            )
        fields = {k: v for k, v in rec.items() if k != "attributes"}
        out.append(_PlanRecord(rtype, ref, fields, resolve, path))
    return out


def events_from_sfdx_plan(
    plan_path: Path,
    *,
    installed_pack_id: str,
    namespace: str = DEFAULT_NAMESPACE,
    event_kind: str = DEFAULT_EVENT_KIND,
    shuffle: bool = False,
    seed: int | None = None,
    queue_class: str = "default",
) -> list[EnqueueRequest]:
    """One upsert event per record of the data plan at ``plan_path``.

    Each request: ``source_object`` = ``target_object`` = the record's type,
    ``source_id`` = ``target_remote_id`` = its ``referenceId``,
    ``idempotency_key`` = ``"<type>:<referenceId>"``, and ``payload`` =
    ``{"sobject": type, "remote_id": referenceId, "fields": {...},
    "references": {field: referenced remote id}}`` where ``fields`` holds every
    key but ``attributes``, with ``@Ref`` lookups replaced by ``Ref``.

    Order: plan order (entries, their files, records in file order — parents
    first in a well-formed plan); ``shuffle=True`` permutes all events with
    ``random.Random(seed)`` (deterministic for a given seed).

    Raises ``ManifestError`` naming the file for: a missing or unreadable
    file, invalid JSON, a plan or record of the wrong shape (no
    ``attributes``, ``type`` or ``referenceId``; a type other than the entry's
    ``sobject``), a ``referenceId`` used twice in the plan, and an ``@ref``
    to a referenceId that is not in the plan.
    """
    plan_path = Path(plan_path)
    entries = _plan_entries(plan_path, _load_json(plan_path))
    records: list[_PlanRecord] = []
    seen: dict[str, Path] = {}
    for sobject, resolve, files in entries:
        for path in files:
            for rec in _read_records(path, sobject, resolve):
                if rec.reference_id in seen:
                    raise ManifestError(
                        str(path),
                        f"duplicate referenceId {rec.reference_id!r} "
                        f"(first defined in {seen[rec.reference_id].name})",
                    )
                seen[rec.reference_id] = path
                records.append(rec)

    events: list[EnqueueRequest] = []
    for rec in records:
        fields: dict[str, Any] = {}
        references: dict[str, str] = {}
        for key, value in rec.fields.items():
            if rec.resolve_refs and isinstance(value, str) and value.startswith("@"):
                target = value[1:]
                if target not in seen:
                    raise ManifestError(
                        str(rec.file),
                        f"record {rec.reference_id}: field {key} references {value}, "
                        "which is not a referenceId of the plan",
                    )
                fields[key] = target
                references[key] = target
            else:
                fields[key] = value
        events.append(
            EnqueueRequest(
                installed_pack_id=installed_pack_id,
                namespace=namespace,
                event_kind=event_kind,
                idempotency_key=f"{rec.sobject}:{rec.reference_id}",
                source_object=rec.sobject,
                source_id=rec.reference_id,
                payload={
                    "sobject": rec.sobject,
                    "remote_id": rec.reference_id,
                    "fields": fields,
                    "references": references,
                },
                queue_class=queue_class,
                target_object=rec.sobject,
                target_remote_id=rec.reference_id,
            )
        )
    if shuffle:
        random.Random(seed).shuffle(events)
    return events
