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

from nexuscrm.catalog import Catalog
from nexuscrm.connectors.eventfile import EventFileError, load_json_file
from nexuscrm.connectors.flows import field_problems
from nexuscrm.connectors.queue import EnqueueRequest
from nexuscrm.db import tables as t
from nexuscrm.errors import FatalError, ManifestError
from nexuscrm.fieldvalues import MAX_REMOTE_ID_CHARS
from nexuscrm.inputs import kind_of
from nexuscrm.packs.model import InboundRoute, PackManifest

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


_PROBLEMS_SHOWN = 50


class DataPlanProblems(DataPlanError):
    """Every problem of the data plans at once, each ``(file, message)``.

    One problem reads as :class:`DataPlanError` (``data file <path>:
    <reason>``); more are listed one a line, grouped by file in the order
    found (at most 50 shown, then how many more). Nothing of the plans is
    enqueued.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        order: dict[str, int] = {}
        for path, _message in problems:
            order.setdefault(path, len(order))
        problems = sorted(problems, key=lambda p: order[p[0]])  # stable: grouped by file
        self.problems = problems
        if len(problems) == 1:
            DataPlanError.__init__(self, *problems[0])
            return
        shown = [f"data file {path}: {message}" for path, message in problems[:_PROBLEMS_SHOWN]]
        if len(problems) > _PROBLEMS_SHOWN:
            shown.append(f"and {len(problems) - _PROBLEMS_SHOWN} more")
        FatalError.__init__(
            self,
            f"{len(problems)} problems in the data plans, nothing enqueued:\n  "
            + "\n  ".join(shown),
        )
        self.pack = problems[0][0]


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
    index: int = 0

    @property
    def where(self) -> str:
        """``record <index> (<referenceId>)``: the record in its file's terms."""
        return f"record {self.index} ({self.reference_id[:60]})"


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


def _plan_entries(
    plan_path: Path, plan: Any, problems: list[tuple[str, str]]
) -> list[tuple[int, str, bool, list[Path]]]:
    """(index, sobject, resolveRefs, data files) of each usable plan entry, in plan order.

    Every problem of the plan is appended to ``problems`` as ``(plan path,
    message)``: not a list, an entry not an object, ``sobject`` missing or
    not a string, ``files`` not a non-empty list of strings, a file name the
    file system cannot look up, an absolute name or one that leads out of
    the plan's folder (``..``, a symlink; as sfdx-project.json refuses
    package directories outside the project), ``resolveRefs`` not boolean.
    """
    where_plan = str(plan_path)
    if not isinstance(plan, list):
        problems.append((where_plan, "a data plan must be a JSON array of entries"))
        return []
    folder = plan_path.parent
    entries: list[tuple[int, str, bool, list[Path]]] = []
    for i, entry in enumerate(plan):
        where = f"entry {i}"
        if not isinstance(entry, dict):
            problems.append((where_plan, f"{where}: must be an object, not {kind_of(entry)}"))
            continue
        found = len(problems)
        sobject = entry.get("sobject")
        if sobject is None:
            problems.append((where_plan, f"{where}: missing 'sobject' (the object of its records)"))
        elif not isinstance(sobject, str):
            problems.append(
                (where_plan, f"{where}: 'sobject' must be a string, not {kind_of(sobject)}")
            )
        elif not sobject:
            problems.append((where_plan, f"{where}: 'sobject' is empty"))
        else:
            where = f"{where} ({sobject})"
        files = entry.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            problems.append((where_plan, f"{where}: 'files' must be a non-empty list of names"))
            files = []
        for name in files:
            problem = _file_name_problem(folder / name) or _outside_problem(folder, name)
            if problem:
                problems.append((where_plan, f"{where}: file {name[:80]!r}: {problem}"))
        resolve = entry.get("resolveRefs", False)
        if not isinstance(resolve, bool):
            problems.append((where_plan, f"{where}: 'resolveRefs' must be true or false"))
        if len(problems) == found and isinstance(sobject, str):
            entries.append((i, sobject, bool(resolve), [folder / f for f in files]))
    return entries


def _outside_problem(folder: Path, name: str) -> str | None:
    """Why the data file ``name`` of a plan in ``folder`` is not the plan's own:
    an absolute path, or one that leads out of the folder (``..``, a symlink)."""
    if Path(name).is_absolute():
        return "an absolute path; name data files relative to the plan's folder"
    try:
        inside = (folder / name).resolve().is_relative_to(folder.resolve())
    except (OSError, ValueError, RuntimeError) as exc:
        return f"not a usable file name: {exc}"
    return None if inside else "points outside the plan's folder"


MAX_FIELD_VALUE_CHARS = 131_072
"""Longest field value of a data-plan record (characters; Salesforce's largest
field, a Long Text Area, holds 131,072). A value that is not a string counts its
JSON text."""
MAX_RECORD_BYTES = 1024 * 1024
"""Largest data-plan record (bytes of its fields as UTF-8 JSON): the largest
event payload, as for a line of ``events enqueue``."""


def _size_problems(path: Path, records: list[_PlanRecord]) -> list[str]:
    """Every record over :data:`MAX_RECORD_BYTES` and field value over
    :data:`MAX_FIELD_VALUE_CHARS` of one data file, as ``record <ref>: ...``."""
    problems: list[str] = []
    for rec in records:
        for name, value in rec.fields.items():
            size = len(value) if isinstance(value, str) else len(json.dumps(value))
            if size > MAX_FIELD_VALUE_CHARS:
                problems.append(
                    f"{rec.where}: field {name} has {size:,} characters, over "
                    f"the limit of {MAX_FIELD_VALUE_CHARS:,}"
                )
        total = len(json.dumps(rec.fields, ensure_ascii=False).encode("utf-8"))
        if total > MAX_RECORD_BYTES:
            problems.append(
                f"{rec.where}: {total:,} bytes, over the limit of "
                f"{MAX_RECORD_BYTES:,} bytes a record"
            )
    return problems


def _read_records(
    path: Path, sobject: str, resolve: bool, problems: list[tuple[str, str]]
) -> list[_PlanRecord]:
    """The well-formed records of one SObject tree file.

    Appends every problem of the file to ``problems`` as ``(path,
    message)``: unreadable or invalid JSON (then nothing else), not an
    object with a ``records`` array, each malformed record (not an object,
    ``attributes`` missing, ``type`` or ``referenceId`` missing or not a
    string, a type other than the entry's), each record and field value over
    its size limit (:data:`MAX_RECORD_BYTES`, :data:`MAX_FIELD_VALUE_CHARS`).
    """
    where_file = str(path)
    try:
        doc = _load_json(path)
    except DataPlanError as exc:
        problems.append((where_file, str(exc).removeprefix(f"data file {path}: ")))
        return []
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        problems.append((where_file, "expected an object with a 'records' array"))
        return []
    out: list[_PlanRecord] = []
    for i, rec in enumerate(doc["records"]):
        where = f"record {i}"
        if not isinstance(rec, dict):
            problems.append((where_file, f"{where}: must be an object, not {kind_of(rec)}"))
            continue
        attrs = rec.get("attributes")
        if not isinstance(attrs, dict):
            problems.append((where_file, f"{where}: missing 'attributes'"))
            continue
        rtype = attrs.get("type")
        ref = attrs.get("referenceId")
        bad = len(problems)
        if rtype is None or rtype == "":
            problems.append((where_file, f"{where}: missing attributes.type"))
        elif not isinstance(rtype, str):
            problems.append(
                (where_file, f"{where}: attributes.type must be a string, not {kind_of(rtype)}")
            )
        else:
            where = f"{where} ({rtype})"
        if ref is None or ref == "":
            problems.append((where_file, f"{where}: missing attributes.referenceId"))
        elif not isinstance(ref, str):
            problems.append(
                (
                    where_file,
                    f"{where}: attributes.referenceId must be a string, not {kind_of(ref)}",
                )
            )
        elif isinstance(rtype, str) and rtype and rtype != sobject:
            problems.append(
                (where_file, f"{where} ({ref}): type {rtype} but the plan entry is {sobject}")
            )
        if len(problems) > bad:
            continue
        fields = {k: v for k, v in rec.items() if k != "attributes"}
        out.append(_PlanRecord(str(rtype), str(ref), fields, resolve, path, i))
    problems.extend((where_file, p) for p in _size_problems(path, out))
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
    catalog: Catalog | None = None,
    destination_object: str | None = None,
    field_map: dict[str, str] | None = None,
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

    With ``catalog`` (the installed objects; ``destination_object`` and
    ``field_map`` of the route, :func:`upsert_route`) every record is checked
    as the ``upsert_record`` flow will map it (:func:`flows.field_problems`):
    the entry's object is installed, each field exists, each value fits its
    field (kind, text length, number precision and scale:
    :func:`nexuscrm.fieldvalues.stored_value`).

    Order: plan order (plans, entries, files, records); ``shuffle=True``
    permutes the events with ``random.Random(seed)``.

    Raises ``DataPlanProblems`` (a ``DataPlanError``) listing every problem
    of every plan and file at once, each naming its file (and entry, or
    record index and referenceId, and field); nothing is returned to
    enqueue: a missing plan, an unreadable file, invalid JSON (``NaN``,
    ``Infinity`` and numbers out of range included), a plan entry or record
    of the wrong shape (``sobject`` missing, ``referenceId`` not a string
    ...), a data file name the file system cannot look up (a NUL byte, too
    long), that is absolute or leads out of the plan's folder, a
    ``referenceId`` used twice, a record whose type (over 128 characters),
    event key (over 191) or remote id (over 128) cannot be stored, a record
    or value over its size limit, and with ``catalog`` an object, field or
    value the flow would refuse. A missing data file is listed among them
    too (it refuses records only when nothing else is wrong).
    """
    problems: list[tuple[str, str]] = []
    records: list[_PlanRecord] = []
    seen: dict[str, Path] = {}
    missing: list[RefusedRecord] = []
    for plan_path in plan_paths:
        plan_path = Path(plan_path)
        try:
            plan = _load_json(plan_path)
        except DataPlanError as exc:
            problems.append((str(plan_path), str(exc).removeprefix(f"data file {plan_path}: ")))
            continue
        for i, sobject, resolve, files in _plan_entries(plan_path, plan, problems):
            obj = catalog.get(sobject) if catalog is not None else None
            if catalog is not None and (obj is None or not obj.has_table):
                problems.append(
                    (str(plan_path), f"entry {i} ({sobject}): object {sobject} is not installed")
                )
            for path in files:
                if not path.exists():
                    # The entry's records cannot be read: refused, the rest imported.
                    missing.append(
                        RefusedRecord(path, sobject, "(every record of the file)",
                                      MISSING_DATA_FILE, f"named by {plan_path.name}, not found")
                    )  # fmt: skip
                    continue
                for rec in _read_records(path, sobject, resolve, problems):
                    if rec.reference_id in seen:
                        problems.append(
                            (str(path), f"{rec.where}: duplicate referenceId {rec.reference_id!r} "
                                        f"(first defined in {seen[rec.reference_id].name})")
                        )  # fmt: skip
                        continue
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
        remote_id = remote(rec.reference_id)
        key = f"{rec.sobject}:{remote_id}:{_digest(rec)}"
        too_long = _event_key_problem(rec.sobject, key)
        if too_long:
            problems.append((str(rec.file), f"{rec.where}: {too_long}"))
        elif len(remote_id) > MAX_REMOTE_ID_CHARS:
            problems.append(
                (str(rec.file), f"{rec.where}: the remote id '<scope>.<referenceId>' has "
                                f"{len(remote_id):,} characters, over the limit of "
                                f"{MAX_REMOTE_ID_CHARS}")
            )  # fmt: skip
        obj = catalog.get(rec.sobject) if catalog is not None else None
        if catalog is not None and obj is not None and obj.has_table:
            problems.extend(
                (str(rec.file), f"{rec.where}: {p}")
                for p in field_problems(
                    catalog, rec.sobject, fields, destination_object=destination_object,
                    field_map=field_map,
                )
            )  # fmt: skip
        if problem is not None:
            out.refused.append(
                RefusedRecord(rec.file, rec.sobject, rec.reference_id, UNRESOLVABLE_REFERENCE,
                              problem)
            )  # fmt: skip
            continue
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
    if problems:
        # Nothing is enqueued: a missing data file is one more thing to fix, named
        # with the rest (it used to show only after the others were mended).
        problems.extend((str(r.file), f"{r.failure_class}: {r.reason}") for r in missing)
        raise DataPlanProblems(problems)
    if shuffle:
        random.Random(seed).shuffle(out.events)
    return out


def upsert_route(pack: PackManifest, event_kind: str = DEFAULT_EVENT_KIND) -> InboundRoute | None:
    """The route (version 1) of ``pack`` that runs the plan's events through the
    local ``upsert_record`` flow, or ``None`` (a webhook or handoff route, or
    none): its ``destination_object`` and ``field_map`` are what
    :func:`import_sfdx_plans` checks the records' fields against."""
    kind = event_kind.strip().lower()
    for route in pack.inbound_routes:
        if (
            route.event_kind == kind
            and route.route_version == 1
            and route.invocation_mode == "flow"
            and route.flow == "upsert_record"
        ):
            return route
    return None


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
