"""Native pack loader (one YAML or JSON manifest file) and the source dispatcher.

A native manifest is one document whose keys are the :class:`PackManifest`
fields (``name``, ``category``, ``version``, ``description``, ``depends_on``,
``objects`` with their ``fields``); ``packs/README.md`` documents every key.

YAML is read with every scalar kept as a string (only ``null``/``~`` and merge
keys are resolved), and the pydantic model converts strings to booleans and
integers where the schema asks for them. So ``Yes``, ``No``, ``1.0`` or
``2024-01-01`` mean the same text in a picklist, version or default value as
they do in Salesforce, with no quoting. Duplicate mapping keys are an error
(in JSON too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nexuscrm.errors import ManifestError, PackProblems, Problem
from nexuscrm.inputs import (
    DuplicateKeyError,
    JsonNumberError,
    UniqueKeyYamlLoader,
    int_limit_message,
    kind_of,
    strict_json_loads,
    unstorable_value,
)
from nexuscrm.packs.model import (
    PackManifest,
    field_name_problems,
    field_shape_problems,
    object_name_problems,
)

NATIVE_SUFFIXES = (".yaml", ".yml", ".json")
# File names that make a directory a native pack, in order of preference.
NATIVE_MANIFEST_NAMES = ("pack.yaml", "pack.yml", "pack.json")

_YAML_KEPT_TAGS = frozenset({"tag:yaml.org,2002:null", "tag:yaml.org,2002:merge"})


class _ManifestYamlLoader(UniqueKeyYamlLoader):
    """SafeLoader that keeps scalars as strings and refuses duplicate keys."""


# Only null and merge keys are resolved implicitly; everything else stays a string.
_ManifestYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag in _YAML_KEPT_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def format_validation_error(
    err: ValidationError, data: Any = None, root: yaml.Node | None = None
) -> str:
    """Render a pydantic ``ValidationError`` as readable ``; ``-separated lines.

    Each entry is ``<location>: <message>`` where the location is a path such
    as ``objects[2](Contact).fields[0](Email).type``: list indexes are shown
    with the ``api_name`` of the element found at that index in ``data`` (the
    raw document that was validated), when there is one. With ``root`` (the
    composed YAML document) the location ends in ``(line N)``: the line of
    the deepest node of the path the file has. Scalar inputs are echoed as
    ``(got ...)``.
    """
    return "; ".join(p.line() for p in validation_problems("", err, data, root))


_ECHO_MAX = 80
"""Most characters of a bad scalar echoed as ``(got ...)``."""


def validation_problems(
    file: str, err: ValidationError, data: Any = None, root: yaml.Node | None = None
) -> list[Problem]:
    """One :class:`Problem` per pydantic error: ``file``, the key path as the
    element (see :func:`format_validation_error`), the message with the bad
    scalar (cut to 80 characters) and, with ``root``, its line."""
    out: list[Problem] = []
    for e in err.errors(include_url=False):
        loc = _render_loc(e.get("loc", ()), data)
        msg = str(e.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        got = e.get("input")
        if e.get("type") != "missing" and (got is None or isinstance(got, str | int | float)):
            shown = repr(got)
            if len(shown) > _ECHO_MAX:
                shown = shown[:_ECHO_MAX] + "..."
            msg = f"{msg} (got {shown})"
        if root is not None:
            msg = f"{msg} (line {_line_of(root, e.get('loc', ()))})"
        out.append(Problem(file, loc, msg))
    return out


def _line_of(root: yaml.Node, loc: tuple[int | str, ...]) -> int:
    """1-based line of the deepest node on ``loc`` in the composed document ``root``."""
    node = root
    for part in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    # an unknown key is reported at the key itself
                    child = value if isinstance(value, yaml.CollectionNode) else key
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part >= 0:
            child = node.value[part] if part < len(node.value) else None
        if child is None:
            break
        node = child
    return int(node.start_mark.line) + 1


def _render_loc(loc: tuple[int | str, ...], data: Any) -> str:
    out = ""
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            if isinstance(node, list | tuple) and 0 <= part < len(node):
                node = node[part]
                if isinstance(node, dict) and isinstance(node.get("api_name"), str):
                    out += f"({node['api_name']})"
            else:
                node = None
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "(manifest)"


MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""Largest pack manifest file read (bytes); a larger one is refused before parsing."""
MAX_YAML_NODES = 1_000_000
"""Most YAML nodes a manifest may expand to through aliases (an alias bomb is refused)."""


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            str(path), f"larger than the limit of {MAX_MANIFEST_BYTES // (1024 * 1024)} MiB"
        )
    try:
        return data.decode("utf-8-sig")  # a leading byte order mark is not content
    except UnicodeDecodeError as exc:
        raise ManifestError(str(path), f"not UTF-8 text: {exc}") from exc


RECURSIVE = -1
"""What :func:`_expanded_nodes` returns for a document with a recursive alias."""


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for once every alias is expanded (capped).

    Aliases make the composed document a graph: counted with a memo per node,
    in time linear in the file, so a 15 KB alias bomb is measured, never built.
    Stops counting past :data:`MAX_YAML_NODES`. A node that contains itself
    (a recursive alias, ``&d [*d]``) stands for no end of nodes: :data:`RECURSIVE`.
    """
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # expanded, not yet sized: the path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if not done:
            if id(node) in open_:  # met again inside itself: a recursive alias
                return RECURSIVE
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        open_.discard(id(node))
        sizes[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(sizes.get(id(c), 1) for c in children))
    return sizes[id(root)]


def _load_yaml(path: Path, text: str) -> Any:
    """Compose, measure (:func:`_expanded_nodes`), then construct one YAML document."""
    loader = _ManifestYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_nodes(node)
        if expanded == RECURSIVE:
            raise ManifestError(
                str(path),
                "a recursive YAML alias (an anchor used inside itself) nests without end; "
                "write the values out instead",
            )
        if expanded > MAX_YAML_NODES:
            raise ManifestError(
                str(path),
                f"expands to more than {MAX_YAML_NODES:,} YAML nodes through aliases "
                "(an alias bomb?); write the values out instead",
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _parse_document(path: Path) -> Any:
    """The manifest's document; a value no database can store is refused here,
    naming its path (a lone surrogate, which a later write could not encode)."""
    data = _parse_raw(path)
    problem = unstorable_value(data)
    if problem:
        raise ManifestError(str(path), problem)
    return data


def _parse_raw(path: Path) -> Any:
    text = _read_text(path)
    if path.suffix.lower() == ".json":
        try:
            return strict_json_loads(text)
        except RecursionError:
            raise ManifestError(str(path), "JSON nested too deeply to read") from None
        except json.JSONDecodeError as exc:
            raise ManifestError(
                str(path), f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from exc
        except DuplicateKeyError as exc:
            raise ManifestError(str(path), f"JSON error: found duplicate key {exc.key!r}") from exc
        except JsonNumberError as exc:
            raise ManifestError(str(path), f"JSON error: {exc}") from None
        except ValueError as exc:
            raise ManifestError(str(path), f"JSON error: {int_limit_message(exc)}") from None
    try:
        # A SafeLoader subclass: no Python object tags are constructed.
        return _load_yaml(path, text)
    except RecursionError:
        raise ManifestError(str(path), "YAML nested too deeply to read") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context = exc.context
        cmark = exc.context_mark
        if context and cmark is not None and cmark is not mark:
            context = f"{context} (from line {cmark.line + 1}, column {cmark.column + 1})"
        what = "; ".join(p for p in (context, exc.problem) if p)
        raise ManifestError(str(path), f"YAML syntax error{where}: {what}") from exc
    except yaml.YAMLError as exc:
        raise ManifestError(str(path), f"YAML syntax error: {exc}") from exc


def _compose(path: Path) -> yaml.Node | None:
    """The composed node graph of a YAML manifest that already parsed (for lines)."""
    loader = _ManifestYamlLoader(_read_text(path))
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def load_native(path: Path) -> PackManifest:
    """Load one native manifest file (``.yaml``, ``.yml`` or ``.json``).

    Returns the validated :class:`PackManifest` with ``source`` set to the
    resolved file path.

    Raises:
        ManifestError: the file is missing, unreadable or not UTF-8; has an
            unsupported suffix; is not valid YAML/JSON (message gives line and
            column); or is not a mapping. The error's ``pack`` is the file path.
        PackProblems: (a ``ManifestError``) the document fails validation:
            one problem per error, all at once, each naming the key path,
            e.g. ``objects[0](Contact).fields[3](Email).type``.
    """
    path = Path(path)
    if path.suffix.lower() not in NATIVE_SUFFIXES:
        raise ManifestError(
            str(path),
            f"unsupported manifest file type {path.suffix or '(none)'!r}; "
            f"expected one of {', '.join(NATIVE_SUFFIXES)}",
        )
    if not path.is_file():
        raise ManifestError(str(path), "no such manifest file")
    data = _parse_document(path)
    if data is None:
        raise ManifestError(str(path), "manifest is empty")
    if not isinstance(data, dict):
        raise ManifestError(
            str(path), f"manifest must be a mapping of pack fields, not {kind_of(data)}"
        )
    if "source" in data:
        raise ManifestError(str(path), "source: is set by the loader and may not be declared")
    resolved = str(path.resolve())
    try:
        return PackManifest.model_validate({**data, "source": resolved})
    except ValidationError as exc:
        root = None if path.suffix.lower() == ".json" else _compose(path)
        problems = validation_problems(str(path), exc, data, root)
        raise PackProblems(
            str(path), problems + _held_back(str(path), data, root, problems)
        ) from exc


def _named(items: Any) -> list[tuple[int, str, dict[str, Any]]]:
    """``(index, api_name, item)`` of the raw list's mappings with a text ``api_name``."""
    if not isinstance(items, list):
        return []
    return [
        (i, x["api_name"], x)
        for i, x in enumerate(items)
        if isinstance(x, dict) and isinstance(x.get("api_name"), str)
    ]


def _held_back(
    file: str, data: dict[str, Any], root: yaml.Node | None, found: list[Problem]
) -> list[Problem]:
    """The problems pydantic holds back while others stand, from the raw document:
    its checks of a whole object, field or pack run only once every part of it is
    valid, so that 12 mistakes took 5 rounds of fixing. Each is reported here
    unless ``found`` already says it: objects and fields declared twice, fields
    named like a system column, and each field's shape (:func:`field_shape_problems`)."""
    said = [p.message for p in found]
    out: list[Problem] = []

    def add(loc: tuple[int | str, ...], message: str) -> None:
        if any(message in m for m in said):
            return
        line = f" (line {_line_of(root, loc)})" if root is not None else ""
        out.append(Problem(file, _render_loc(loc, data), message + line))
        said.append(message)

    objects = _named(data.get("objects"))
    pack = data.get("name") if isinstance(data.get("name"), str) else "?"
    for i, msg in object_name_problems([name for _, name, _ in objects]):
        add(("objects", objects[i][0]), f"pack {pack}: {msg}")
    for oi, obj, spec in objects:
        fields = _named(spec.get("fields"))
        for j, msg in field_name_problems(obj, [name for _, name, _ in fields]):
            add(("objects", oi, "fields", fields[j][0]), msg)
        for fi, name, f in fields:
            formula, ref = f.get("formula"), f.get("reference_to")
            for msg in field_shape_problems(
                name,
                str(f.get("type")),
                ref if isinstance(ref, str) else None,
                f.get("summary") is not None,
                formula if isinstance(formula, str) else None,
            ):
                add(("objects", oi, "fields", fi), msg)
    return out


def find_native_manifest(directory: Path) -> Path | None:
    """Return the native manifest file of a pack directory, or None.

    Looks for ``pack.yaml``, ``pack.yml``, ``pack.json``.

    Raises:
        ManifestError: more than one of them exists (ambiguous).
    """
    found = [directory / n for n in NATIVE_MANIFEST_NAMES if (directory / n).is_file()]
    if len(found) > 1:
        raise ManifestError(
            str(directory), f"ambiguous: {', '.join(p.name for p in found)} all exist; keep one"
        )
    return found[0] if found else None


def load_pack_source(source: str | Path) -> PackManifest:
    """Load a pack from a path, picking the loader from what is there.

    - a directory holding ``sfdx-project.json`` or Salesforce DX object
      metadata (``**/objects/<Object>/...-meta.xml``): :func:`load_sfdx`;
    - a directory holding ``pack.yaml`` (or ``pack.yml`` / ``pack.json``):
      :func:`load_native` on that file;
    - a file: :func:`load_native`.

    ``source`` on the result, and every file a problem names, is the
    resolved path (absolute, symlinks followed), whatever the form given.

    Raises:
        ManifestError: the path does not exist, is a directory with neither
            kind of pack in it, or the chosen loader fails.
    """
    from nexuscrm.packs.sfdx import is_sfdx_source, load_sfdx

    # Resolved once here, so every problem of the source names its files the
    # same way (the plan's checks name them from the resolved ``source``).
    path = Path(source).expanduser().resolve()
    if path.is_dir():
        if is_sfdx_source(path):
            return load_sfdx(path)
        manifest = find_native_manifest(path)
        if manifest is not None:
            return load_native(manifest)
        raise ManifestError(
            str(path),
            "unknown pack source: the directory has no sfdx-project.json, no "
            "objects/<Object>/*-meta.xml and no pack.yaml",
        )
    if path.is_file():
        return load_native(path)
    if path.exists():
        raise ManifestError(
            str(path),
            "unknown pack source: not a folder nor a regular file (a device, socket or pipe)",
        )
    raise ManifestError(str(path), "unknown pack source: no such file or directory")
