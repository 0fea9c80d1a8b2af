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

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nexuscrm.connectors.eventfile import EventFileError, load_json_file
from nexuscrm.connectors.queue import EnqueueRequest
from nexuscrm.db import tables as t
from nexuscrm.errors import FatalError, ManifestError

DEFAULT_NAMESPACE = "salesforce"
DEFAULT_EVENT_KIND = "salesforce.record.upsert"


class DataPlanError(ManifestError):
    """A data plan or data file cannot be used; the message names the file.

    A ``ManifestError`` (callers that catch those keep working) worded for
    data: ``data file <path>: <reason>``, never ``pack ...``.
    """

    def __init__(self, path: str, message: str) -> None:
        FatalError.__init__(self, f"data file {path}: {message}")
        self.pack = path


# Failure class of a record refused at import: an ``@ref`` that names no
# record of the plan, or one in an entry without ``resolveRefs``.
UNRESOLVABLE_REFERENCE = "unresolvable-reference"
# Failure class of a data file a plan names that does not exist.
MISSING_DATA_FILE = "missing-data-file"


@dataclass(frozen=True)
class RefusedRecord:
    """A plan record not enqueued: its file, type, referenceId, class and reason."""

    file: Path
    sobject: str
    reference_id: str
    failure_class: str
    reason: str

    def __str__(self) -> str:
        return (
            f"{self.file}: {self.sobject} {self.reference_id}: {self.failure_class}: {self.reason}"
        )


@dataclass
class PlanImport:
    """What :func:`import_sfdx_plans` made: the events and the records it refused."""

    events: list[EnqueueRequest] = field(default_factory=list)
    refused: list[RefusedRecord] = field(default_factory=list)


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
        raise DataPlanError(str(path), reason) from None


def _file_name_problem(path: Path) -> str | None:
    """Why the file system cannot even look ``path`` up (a NUL byte, a name or
    path too long ...), else ``None`` (a missing file is no problem here)."""
    if "\x00" in str(path):
        return "the name contains a NUL byte"
    try:
        path.exists()
    except (OSError, ValueError) as exc:
        return f"not a usable file name: {exc.strerror if isinstance(exc, OSError) else exc}"
    return None


def _plan_entries(plan_path: Path, plan: Any) -> list[tuple[str | None, bool, list[Path]]]:
    """(sobject, resolveRefs, data files) of each plan entry, in plan order."""
    if not isinstance(plan, list):
        raise DataPlanError(str(plan_path), "a data plan must be a JSON array of entries")
    entries: list[tuple[str | None, bool, list[Path]]] = []
    for i, entry in enumerate(plan):
        where = f"entry {i}"
        if not isinstance(entry, dict):
            raise DataPlanError(str(plan_path), f"{where}: must be an object")
        sobject = entry.get("sobject")
        if sobject is not None and not isinstance(sobject, str):
            raise DataPlanError(str(plan_path), f"{where}: 'sobject' must be a string")
        files = entry.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise DataPlanError(
                str(plan_path), f"{where} ({sobject}): 'files' must be a non-empty list of names"
            )
        for name in files:
            problem = _file_name_problem(plan_path.parent / name)
            if problem:
                raise DataPlanError(
                    str(plan_path), f"{where} ({sobject}): file {name[:80]!r}: {problem}"
                )
        resolve = entry.get("resolveRefs", False)
        if not isinstance(resolve, bool):
            raise DataPlanError(str(plan_path), f"{where} ({sobject}): 'resolveRefs' not boolean")
        entries.append((sobject, resolve, [plan_path.parent / f for f in files]))
    return entries


MAX_FIELD_VALUE_CHARS = 131_072
"""Longest field value of a data-plan record (characters; Salesforce's largest
field, a Long Text Area, holds 131,072). A value that is not a string counts its
JSON text."""
MAX_RECORD_BYTES = 1024 * 1024
"""Largest data-plan record (bytes of its fields as UTF-8 JSON): the largest
event payload, as for a line of ``events enqueue``."""
_SIZE_PROBLEMS_SHOWN = 20


def _size_problems(path: Path, records: list[_PlanRecord]) -> list[str]:
    """Every record over :data:`MAX_RECORD_BYTES` and field value over
    :data:`MAX_FIELD_VALUE_CHARS` of one data file, as ``record <ref>: ...``."""
    problems: list[str] = []
    for rec in records:
        for name, value in rec.fields.items():
            size = len(value) if isinstance(value, str) else len(json.dumps(value))
            if size > MAX_FIELD_VALUE_CHARS:
                problems.append(
                    f"record {rec.reference_id}: field {name} has {size:,} characters, over "
                    f"the limit of {MAX_FIELD_VALUE_CHARS:,}"
                )
        total = len(json.dumps(rec.fields, ensure_ascii=False).encode("utf-8"))
        if total > MAX_RECORD_BYTES:
            problems.append(
                f"record {rec.reference_id}: {total:,} bytes, over the limit of "
                f"{MAX_RECORD_BYTES:,} bytes a record"
            )
    return problems


def _read_records(path: Path, sobject: str | None, resolve: bool) -> list[_PlanRecord]:
    """The records of one SObject tree file, validated.

    Raises ``DataPlanError`` naming the file: a malformed record (the first),
    or every record and field value over its size limit
    (:data:`MAX_RECORD_BYTES`, :data:`MAX_FIELD_VALUE_CHARS`) at once.
    """
    doc = _load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        raise DataPlanError(str(path), "expected an object with a 'records' array")
    out: list[_PlanRecord] = []
    for i, rec in enumerate(doc["records"]):
        where = f"record {i}"
        if not isinstance(rec, dict):
            raise DataPlanError(str(path), f"{where}: must be an object")
        attrs = rec.get("attributes")
        if not isinstance(attrs, dict):
            raise DataPlanError(str(path), f"{where}: missing 'attributes'")
        rtype = attrs.get("type")
        ref = attrs.get("referenceId")
        if not isinstance(rtype, str) or not rtype:
            raise DataPlanError(str(path), f"{where}: missing attributes.type")
        if not isinstance(ref, str) or not ref:
            raise DataPlanError(str(path), f"{where} ({rtype}): missing attributes.referenceId")
        if sobject is not None and rtype != sobject:
            raise DataPlanError(
                str(path), f"{where} ({ref}): type {rtype} but the plan entry is {sobject}"
            )
        fields = {k: v for k, v in rec.items() if k != "attributes"}
        out.append(_PlanRecord(rtype, ref, fields, resolve, path))
    too_big = _size_problems(path, out)
    if too_big:
        more = len(too_big) - _SIZE_PROBLEMS_SHOWN
        shown = "; ".join(too_big[:_SIZE_PROBLEMS_SHOWN]) + (
            f"; and {more} more" if more > 0 else ""
        )
        raise DataPlanError(str(path), shown)
    return out


def project_scope(plan_path: Path) -> str:
    """The default key scope of a plan: its project's folder name.

    ``<project>/data/plan.json`` -> ``<project>``; a plan elsewhere -> its
    folder's name.
    """
    folder = Path(plan_path).resolve().parent
    return folder.parent.name if folder.name == "data" else folder.name


def project_plans(project: Path) -> list[Path]:
    """Every data plan of an SFDX project: ``data/*plan*.json``, sorted by file name.

    That is the order ``demo-sync`` imports them in (a later plan may
    reference the records of an earlier one).
    """
    data = Path(project) / "data"
    if not data.is_dir():
        return []
    return sorted(p for p in data.glob("*.json") if "plan" in p.name.lower() and p.is_file())


MAX_OBJECT_CHARS = 128
"""Longest ``attributes.type`` (the event's source object column)."""


def _event_key_problem(sobject: str, key: str) -> str | None:
    """Why a record's type or (scoped) referenceId cannot make an event, else ``None``:
    the type is over :data:`MAX_OBJECT_CHARS`, or the idempotency key
    ``<type>:<remote id>:<digest>`` over the key column's 191 characters."""
    if len(sobject) > MAX_OBJECT_CHARS:
        return (
            f"attributes.type has {len(sobject):,} characters, over the limit of {MAX_OBJECT_CHARS}"
        )
    if len(key) > t.KEY:
        return (
            f"attributes.type and referenceId are too long: the event key "
            f"'<type>:<scope>.<referenceId>:<digest>' would have {len(key):,} characters, "
            f"over the limit of {t.KEY}"
        )
    return None


def _digest(rec: _PlanRecord) -> str:
    body = json.dumps(rec.fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def import_sfdx_plans(
    plan_paths: Sequence[Path],
    *,
    installed_pack_id: str,
    scope: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    event_kind: str = DEFAULT_EVENT_KIND,
    shuffle: bool = False,
    seed: int | None = None,
    queue_class: str = "default",
) -> PlanImport:
    """One upsert event per record of the data plans, in order; refused records apart.

    ``scope`` (e.g. the project's name, :func:`project_scope`) prefixes every
    remote id and idempotency key (``<scope>.<referenceId>``), so two
    projects whose plans both say ``AccountRef1`` never collide; without it
    remote ids are the bare referenceIds. The plans share one reference
    space (a later plan may name an earlier plan's records).

    Each request: ``source_object`` = ``target_object`` = the record's type,
    ``source_id`` = ``target_remote_id`` = its (scoped) referenceId,
    ``idempotency_key`` = ``"<type>:<remote id>:<content digest>"`` (a
    changed record is a new event in the same source lane, after the old
    one; an unchanged one is a duplicate), and ``payload`` = ``{"sobject",
    "remote_id", "fields", "references"}`` where ``fields`` holds every key
    but ``attributes``, with ``@Ref`` lookups replaced by the remote id.

    A record is refused (class ``unresolvable-reference``), and the rest
    still imported, when a value ``@X`` names no referenceId of the plans
    (in a ``resolveRefs`` entry), or names one in an entry without
    ``resolveRefs`` (the Salesforce CLI would store ``@X`` in a lookup:
    it can never resolve). Elsewhere ``@text`` is data. A data file the
    plan names that does not exist refuses its entry's records (class
    ``missing-data-file``); records referencing them are then refused too.

    Order: plan order (plans, entries, files, records); ``shuffle=True``
    permutes the events with ``random.Random(seed)``.

    Raises ``DataPlanError`` naming the file for a missing plan, an
    unreadable file, invalid JSON (``NaN``, ``Infinity`` and numbers out of
    range included, named by record and field), a plan or record of the wrong
    shape, a data file name the file system cannot look up (a NUL byte, too
    long), a ``referenceId`` used twice, and a record whose type (over 128
    characters) or event key (over 191) cannot be stored.
    """
    records: list[_PlanRecord] = []
    seen: dict[str, Path] = {}
    missing: list[RefusedRecord] = []
    for plan_path in plan_paths:
        plan_path = Path(plan_path)
        for sobject, resolve, files in _plan_entries(plan_path, _load_json(plan_path)):
            for path in files:
                if not path.exists():
                    # The entry's records cannot be read: refused, the rest imported.
                    missing.append(
                        RefusedRecord(path, sobject or "?", "(every record of the file)",
                                      MISSING_DATA_FILE, f"named by {plan_path.name}, not found")
                    )  # fmt: skip
                    continue
                for rec in _read_records(path, sobject, resolve):
                    if rec.reference_id in seen:
                        raise DataPlanError(
                            str(path),
                            f"duplicate referenceId {rec.reference_id!r} "
                            f"(first defined in {seen[rec.reference_id].name})",
                        )
                    seen[rec.reference_id] = path
                    records.append(rec)

    def remote(ref: str) -> str:
        return f"{scope}.{ref}" if scope else ref

    out = PlanImport(refused=missing)
    for rec in records:
        fields: dict[str, Any] = {}
        references: dict[str, str] = {}
        problem: str | None = None
        for key, value in rec.fields.items():
            if isinstance(value, str) and value.startswith("@") and problem is None:
                target = value[1:]
                if rec.resolve_refs and target not in seen:
                    problem = f"field {key} references {value}, which no record of the plan has"
                elif rec.resolve_refs:
                    fields[key] = references[key] = remote(target)
                    continue
                elif target in seen:
                    problem = (
                        f"field {key} is {value}, a referenceId, but its plan entry has no "
                        "resolveRefs: it can never resolve"
                    )
            fields[key] = value
        if problem is not None:
            out.refused.append(
                RefusedRecord(rec.file, rec.sobject, rec.reference_id, UNRESOLVABLE_REFERENCE,
                              problem)
            )  # fmt: skip
            continue
        remote_id = remote(rec.reference_id)
        key = f"{rec.sobject}:{remote_id}:{_digest(rec)}"
        too_long = _event_key_problem(rec.sobject, key)
        if too_long:
            raise DataPlanError(str(rec.file), f"record {rec.reference_id[:60]!r}: {too_long}")
        out.events.append(
            EnqueueRequest(
                installed_pack_id=installed_pack_id,
                namespace=namespace,
                event_kind=event_kind,
                idempotency_key=key,
                source_object=rec.sobject,
                source_id=remote_id,
                payload={
                    "sobject": rec.sobject,
                    "remote_id": remote_id,
                    "fields": fields,
                    "references": references,
                },
                queue_class=queue_class,
                target_object=rec.sobject,
                target_remote_id=remote_id,
            )
        )
    if shuffle:
        random.Random(seed).shuffle(out.events)
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
    scope: str | None = None,
) -> list[EnqueueRequest]:
    """:func:`import_sfdx_plans` of one plan, strict: any refused record raises.

    Raises ``DataPlanError`` naming the file of the first refused record
    (an ``@ref`` that cannot resolve), besides the errors of
    :func:`import_sfdx_plans`.
    """
    result = import_sfdx_plans(
        [plan_path], installed_pack_id=installed_pack_id, scope=scope, namespace=namespace,
        event_kind=event_kind, shuffle=shuffle, seed=seed, queue_class=queue_class,
    )  # fmt: skip
    if result.refused:
        first = result.refused[0]
        raise DataPlanError(str(first.file), f"record {first.reference_id}: {first.reason}")
    return result.events
