"""Inbound event files (JSON lines) and JSON data files, read whole and checked first.

Used by ``nexusctl events enqueue`` (and, for :func:`load_json_file`, by the
Salesforce DX data-plan importer). Nothing is enqueued unless the whole file is
good: every problem of the file is collected, by line and field, and raised at
once as one :class:`EventFileError`. Limits are checked before anything is
parsed, so an endless or huge input (``/dev/zero``, a 100 MB line) fails at
once with the limit it broke, long before the database or Temporal sees it.

Limits (documented in the README's connector section):

* a file is at most :data:`MAX_FILE_BYTES` (64 MiB);
* one event line at most :data:`MAX_LINE_BYTES` (1 MiB, the largest payload
  an event may carry);
* JSON nesting at most :data:`MAX_JSON_DEPTH` (64) levels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from nexuscrm.catalog import Catalog
from nexuscrm.connectors.flows import upsert_mapping_problem, upsert_payload_problem
from nexuscrm.connectors.knobs import QUEUE_CLASSES
from nexuscrm.connectors.queue import EnqueueRequest, normalize_queue_class
from nexuscrm.connectors.routes import RouteNotFoundError, RouteResolver
from nexuscrm.db import tables as t
from nexuscrm.errors import NexusError
from nexuscrm.inputs import (
    MAX_JSON_DEPTH,
    DuplicateKeyError,
    JsonNumberError,
    bounded_int,
    int_limit_message,
    kind_of,
    nesting_problem,
    unique_keys,
    unstorable_value,
)

MAX_FILE_BYTES = 64 * 1024 * 1024
UTF8_BOM = b"\xef\xbb\xbf"
MAX_LINE_BYTES = 1024 * 1024
_SHOWN = 20  # problems listed before "... and N more"

_Name = Annotated[str, StringConstraints(min_length=1, max_length=128)]
_Key = Annotated[str, StringConstraints(min_length=1, max_length=t.KEY)]


class EventFileError(NexusError):
    """A file of events (or a JSON data file) that cannot be used, with every problem.

    ``problems`` are ``"<file>:<line>: <what>"`` strings (``"<file>: <what>"``
    for the whole file), in file order; the message lists the first 20 and
    counts the rest.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:_SHOWN]
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        head = f"{len(problems)} problem(s); nothing was enqueued"
        super().__init__(head + "\n  " + "\n  ".join(shown) + more)


class EventLine(BaseModel):
    """One line of an events file (strict JSON types: a number is not a string).

    ``event_kind``, ``source_object``, ``target_object``: 1-128 characters;
    ``idempotency_key``, ``source_id``, ``target_remote_id``: 1-191;
    ``payload``: a JSON object; ``route_version``: an integer >= 1;
    ``queue_class``: one of ``interactive``, ``default``, ``bulk``. Unknown
    keys are refused (a misspelt key would otherwise be dropped).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    event_kind: _Name
    idempotency_key: _Key
    source_object: _Name
    source_id: _Key
    payload: dict[str, Any]
    route_version: int = Field(default=1, ge=1, le=2**31 - 1)
    queue_class: str = "default"
    target_object: _Name | None = None
    target_remote_id: _Key | None = None


def read_bounded(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of ``path``, refusing more than ``max_bytes`` (read stops there).

    A leading UTF-8 byte order mark is dropped. Raises :class:`EventFileError`
    naming the file for a missing or unreadable file, a directory, or one over
    the limit (``/dev/zero`` too).
    """
    try:
        with path.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise EventFileError([f"{path}: file not found"]) from None
    except OSError as exc:
        raise EventFileError([f"{path}: cannot read {what}: {exc.strerror or exc}"]) from None
    if len(data) > max_bytes:
        raise EventFileError(
            [f"{path}: {what} is larger than the limit of {max_bytes // (1024 * 1024)} MiB"]
        )
    # A UTF-8 byte order mark (editors on Windows write one) is not content.
    return data.removeprefix(UTF8_BOM)


def json_depth_problem(value: Any) -> str | None:
    """A message when ``value`` nests deeper than :data:`MAX_JSON_DEPTH`, else ``None``
    (:func:`nexuscrm.inputs.nesting_problem`, the limit every reader shares)."""
    problem = nesting_problem(value, MAX_JSON_DEPTH)
    return f"JSON {problem}" if problem else None


def parse_json(text: str) -> Any:
    """``json.loads`` of strict JSON; ``ValueError`` saying ``invalid JSON at line L
    column C: why``, ``invalid JSON: payload.x: NaN is not a JSON number`` (naming
    where: Infinity and numbers out of range alike), ``invalid JSON: a number of
    more than 4,300 digits``, or that it nests too deep for the parser."""
    try:
        # NaN and Infinity parse here so unstorable_value names where they are.
        value = json.loads(text, parse_int=bounded_int, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (JsonNumberError, DuplicateKeyError) as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"invalid JSON: {int_limit_message(exc)}") from None
    problem = unstorable_value(value)
    if problem:
        raise ValueError(f"invalid JSON: {problem}")
    return value


def load_json_file(path: Path, what: str = "data file") -> Any:
    """Parse ``path`` as one JSON document (UTF-8, at most :data:`MAX_FILE_BYTES`).

    Raises :class:`EventFileError` naming the file: unreadable, too large,
    not UTF-8 (with the byte offset), invalid JSON (line and column), or
    nested deeper than :data:`MAX_JSON_DEPTH`.
    """
    data = read_bounded(path, MAX_FILE_BYTES, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EventFileError([f"{path}: not UTF-8 (byte {exc.start})"]) from None
    try:
        value = parse_json(text)
    except ValueError as exc:
        raise EventFileError([f"{path}: {exc}"]) from None
    problem = json_depth_problem(value)
    if problem:
        raise EventFileError([f"{path}: {problem}"])
    return value


def _field_problems(where: str, exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(line)"
        given = err.get("input")
        shown = repr(given)[:60] if err["type"] != "missing" else ""
        out.append(f"{where}: {loc}: {err['msg']}" + (f" (got {shown})" if shown else ""))
    return out


_KIND = TypeAdapter(EventLine.model_fields["event_kind"].rebuild_annotation())
_VERSION = TypeAdapter(EventLine.model_fields["route_version"].rebuild_annotation())
"""``EventLine``'s own types of the two routing fields, for a line that failed validation."""


def _routing_fields(
    line: EventLine | None, value: dict[str, Any]
) -> tuple[str | None, int, dict[str, Any] | None]:
    """(event kind, route version, payload) of a line for its route and payload checks:
    from the validated ``line``, else from the raw object where those fields are
    themselves valid by ``EventLine``'s types (kind ``None``: no route to check;
    payload ``None``: no payload to check)."""
    if line is not None:
        return line.event_kind, line.route_version, line.payload
    payload = value.get("payload")
    try:
        kind = _KIND.validate_python(value.get("event_kind"), strict=True)
        version = _VERSION.validate_python(value.get("route_version", 1), strict=True)
    except ValidationError:
        kind, version = None, 1
    return kind, version, payload if isinstance(payload, dict) else None


def _request(
    line: EventLine,
    where: str,
    n: int,
    installed_pack_id: str,
    namespace: str,
    keys: dict[str, tuple[int, str]],
    problems: list[str],
) -> EnqueueRequest | None:
    """The request of a valid line; ``None`` (its problem appended) for an unknown
    queue class or an idempotency key an earlier line used with other content."""
    queue_class = normalize_queue_class(line.queue_class)
    if queue_class not in QUEUE_CLASSES:
        problems.append(
            f"{where}: queue_class: {line.queue_class!r} is not a queue class a worker "
            f"claims (one of {', '.join(QUEUE_CLASSES)})"
        )
        return None
    fields = line.model_dump(exclude={"queue_class"})
    request = EnqueueRequest(
        installed_pack_id=installed_pack_id,
        namespace=namespace,
        queue_class=queue_class,
        **fields,
    )
    # The same key twice is one event (the second is skipped as a duplicate);
    # with other content, the second line's event would be lost unseen.
    content = json.dumps([queue_class, fields], sort_keys=True, default=str)
    first = keys.setdefault(request.idempotency_key, (n, content))
    if first[1] != content:
        problems.append(
            f"{where}: idempotency_key {request.idempotency_key!r} is also on line "
            f"{first[0]} with other content: one key is one event, this one would be "
            "skipped as its duplicate"
        )
        return None
    return request


def read_event_file(
    path: Path,
    *,
    installed_pack_id: str,
    namespace: str,
    resolver: RouteResolver | None = None,
    catalog: Catalog | None = None,
) -> list[EnqueueRequest]:
    """Every event of the JSON-lines file ``path``, as requests for one pack.

    One JSON object per line (blank lines skipped), keys as
    :class:`EventLine`. The whole file is read and checked before anything
    is returned: raises :class:`EventFileError` listing every problem (file
    unreadable or over :data:`MAX_FILE_BYTES`, a line that is not UTF-8,
    longer than :data:`MAX_LINE_BYTES`, not JSON, nested deeper than
    :data:`MAX_JSON_DEPTH`, not an object, or with a missing, mistyped,
    too long or unknown field, or an unknown queue class). With ``resolver``,
    an event whose pack has no route for its kind and version is a problem
    too, named at the first line of each (kind, version) with the count of
    the other lines: such an event could only ever fail ``route-not-found``.
    A line's problems come out together: one with a bad field still has its
    route and its upsert payload checked, where its kind, version and payload
    are themselves valid. With ``catalog`` too, an upsert's payload is mapped
    as the flow maps it (:func:`~nexuscrm.connectors.flows.upsert_mapping_problem`:
    its object installed, its fields on it, its references lookups, its values
    fitting), so an event that could only fail is refused with its file.
    """
    data = read_bounded(path, MAX_FILE_BYTES, "events file")
    problems: list[str] = []
    requests: list[EnqueueRequest] = []
    no_route: dict[tuple[str, int], list[int]] = {}  # (kind, version) -> [problem index, lines]
    routed: set[tuple[str, int]] = set()
    # Routed to the local upsert_record flow: (destination object, field map).
    upserts: dict[tuple[str, int], tuple[str | None, dict[str, str] | None]] = {}
    keys: dict[str, tuple[int, str]] = {}  # idempotency key -> (first line, its content)
    for n, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{n}"
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            problems.append(
                f"{where}: line of {len(raw)} bytes is over the limit of {MAX_LINE_BYTES} bytes"
            )
            continue
        try:
            value = parse_json(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            problems.append(f"{where}: not UTF-8 (byte {exc.start} of the line)")
            continue
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        depth = json_depth_problem(value)
        if depth:
            problems.append(f"{where}: {depth}")
            continue
        if not isinstance(value, dict):
            problems.append(f"{where}: an event must be a JSON object, got {kind_of(value)}")
            continue
        try:
            line: EventLine | None = EventLine.model_validate(value)
        except ValidationError as exc:
            problems += _field_problems(where, exc)
            line = None
        # A line with a bad field still has its route and payload checked, so
        # that its problems come out together, not one round at a time.
        kind, version, payload = _routing_fields(line, value)
        if line is not None:
            request = _request(line, where, n, installed_pack_id, namespace, keys, problems)
            if request is not None:
                requests.append(request)
        if resolver is None or kind is None:
            continue
        route = (kind, version)
        if route in no_route:
            no_route[route].append(n)
            continue
        if route not in routed:
            try:
                resolved = resolver.resolve(installed_pack_id, *route)
            except RouteNotFoundError as exc:
                no_route[route] = [len(problems), n]
                problems.append(f"{where}: event_kind {route[0]!r} v{route[1]}: {exc}")
                continue
            routed.add(route)
            if resolved.invocation_mode == "flow" and resolved.flow == "upsert_record":
                upserts[route] = (resolved.destination_object, resolved.field_map)
        if route in upserts and payload is not None:
            shape = upsert_payload_problem(payload)
            if not shape and catalog is not None:
                destination, field_map = upserts[route]
                shape = upsert_mapping_problem(
                    catalog,
                    namespace=namespace,
                    payload=payload,
                    destination_object=destination,
                    field_map=field_map,
                )
            if shape:
                problems.append(f"{where}: {shape} (route {route[0]} v{route[1]}: upsert_record)")
    for index, *found in no_route.values():
        if len(found) > 1:
            problems[index] += f" (and {len(found) - 1} more line(s) of it: {found[1]}, ...)"
    if problems:
        raise EventFileError(problems)
    return requests
