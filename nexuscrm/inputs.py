"""Bounded reads of operator-supplied files: a size cap, then a nesting cap.

Shared by the control plane (candidate files), the connector runtime (events,
data plans, serving selections) and the pack loader (``sfdx-project.json``,
Salesforce DX metadata), so every reader refuses an endless or hostile file
the same way: at most ``cap + 1`` bytes are read (``/dev/zero`` ends there),
and a document nested deeper than :data:`MAX_JSON_DEPTH` is refused, whether
the parser itself gives up (``RecursionError``) or not.

Errors are :class:`InputLimitError` (a ``ValueError``) whose message does not
name the file: each caller wraps it in its own error naming the file.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import yaml

MAX_JSON_DEPTH = 64
"""Deepest JSON/YAML nesting read (levels: a scalar at the top is 1)."""


class InputLimitError(ValueError):
    """A file over its size cap, not UTF-8, unparsable, or nested too deeply."""


class JsonNumberError(ValueError):
    """A number strict JSON cannot carry: ``NaN``, ``Infinity``, a float that
    overflows to infinity, an integer longer than Python converts."""


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice (``json.loads`` keeps the last one
    silently; every reader here refuses it instead). ``key`` is the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key[:80]!r} appears twice in one object")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that builds a dict, raising :class:`DuplicateKeyError`
    when a key repeats (``{"a": 1, "a": 2}``)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


class UniqueKeyYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python tags) that refuses a mapping naming one key
    twice (PyYAML keeps the last silently), with the line of the second."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r}",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def kind_of(value: Any) -> str:
    """What a parsed JSON/YAML value is, in the file's terms, for messages:
    ``null``, ``a boolean``, ``a number``, ``a string``, ``a list``, ``an
    object`` (``a <Python type>`` for anything else, such as a YAML date)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _no_constant(name: str) -> Any:
    raise JsonNumberError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonNumberError(f"number {text[:40]} is out of range (it overflows to infinity)")
    return value


def bounded_int(text: str) -> int:
    """``int(text)``; :class:`JsonNumberError` naming the size when ``text`` has more
    digits than Python converts (``sys.get_int_max_str_digits()``, 4,300)."""
    limit = sys.get_int_max_str_digits() or 4300
    digits = len(text.lstrip("-"))
    if digits > limit:
        raise JsonNumberError(f"a number of more than {limit:,} digits ({digits:,})")
    return int(text)


def _non_finite_message(node: float, path: str) -> str:
    what = "NaN" if math.isnan(node) else ("-" if node < 0 else "") + "Infinity"
    extra = "" if what == "NaN" else " (a number out of range, such as 1e999, reads as it)"
    return f"{path or '(value)'}: {what} is not a JSON number{extra}"


def _lone_surrogate(text: str) -> str | None:
    """The first lone UTF-16 surrogate of ``text`` as its escape (``\\udc80``), else ``None``."""
    for ch in text:
        if "\ud800" <= ch <= "\udfff":
            return f"\\u{ord(ch):04x}"
    return None


def unstorable_value(value: Any) -> str | None:
    """``<path>: ...`` for the first value of ``value`` no database can store,
    else ``None``: a NaN or infinite float (Python's JSON parser reads ``NaN``,
    ``Infinity`` and ``1e999``; strict JSON has none of them), or a
    string or key holding a lone UTF-16 surrogate (``"\\udc80"``, which JSON
    and YAML escapes can spell but UTF-8 cannot encode). Walked without
    recursion; a container met twice (YAML aliases) is walked once."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return _non_finite_message(node, path)
        if isinstance(node, str):
            bad = _lone_surrogate(node)
            if bad:
                where = path or "(value)"
                return f"{where}: {bad} is a lone surrogate, not text (UTF-8 cannot hold it)"
        elif isinstance(node, dict | list) and id(node) not in seen:
            seen.add(id(node))
            if isinstance(node, dict):
                for k, v in reversed(node.items()):
                    where = f"{path}.{k}" if path else str(k)
                    if isinstance(k, str) and _lone_surrogate(k):
                        return (
                            f"{where}: a key with a lone surrogate ({_lone_surrogate(k)}), not text"
                        )
                    stack.append((v, where))
            else:
                stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node))))
    return None


def strict_json_loads(
    text: str, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] = unique_keys
) -> Any:
    """``json.loads`` of strict JSON: ``NaN``, ``Infinity`` and ``-Infinity`` (which
    Python's parser accepts), a float overflowing to infinity (``1e99999``) and an
    integer of more digits than Python converts raise :class:`JsonNumberError`
    (a ``ValueError``, not a ``JSONDecodeError``) naming the number; a key named
    twice in one object raises :class:`DuplicateKeyError` (also a ``ValueError``);
    else as ``json.loads`` (``JSONDecodeError``, ``RecursionError``)."""
    return json.loads(
        text,
        parse_constant=_no_constant,
        parse_float=_finite_float,
        parse_int=bounded_int,
        object_pairs_hook=object_pairs_hook,
    )


def mib(n_bytes: int) -> str:
    """``16 MiB`` for a whole number of MiB, else ``<n> bytes``."""
    if n_bytes % (1024 * 1024) == 0:
        return f"{n_bytes // (1024 * 1024)} MiB"
    return f"{n_bytes:,} bytes"


def read_capped(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, reading at most ``max_bytes + 1`` of them.

    Raises ``OSError`` as the file system does (missing, unreadable, a
    directory) and :class:`InputLimitError` ``larger than the limit of N
    MiB`` when there is more than ``max_bytes``.
    """
    with Path(path).open("rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputLimitError(f"larger than the limit of {mib(max_bytes)}")
    return data


def nesting_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """A message when ``value`` nests deeper than ``max_depth`` levels, else ``None``.

    Walks dicts and lists without recursion. A container met again (YAML
    aliases share objects) is measured once; one that contains itself (a
    recursive YAML alias) counts as nested too deeply.
    """
    seen: dict[int, int] = {}  # id -> shallowest depth already walked
    stack: list[tuple[Any, int, tuple[int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        if not isinstance(node, dict | list):
            continue
        key = id(node)
        if key in path:
            return "nested without end (a recursive alias)"
        if seen.get(key, max_depth + 1) <= depth:
            continue
        seen[key] = depth
        children = node.values() if isinstance(node, dict) else node
        inner = (*path, key)  # shared by the children: one tuple per container
        stack.extend((c, depth + 1, inner) for c in children)
    return None


def parse_document(data: bytes, kind: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode ``data`` (UTF-8) and parse it as ``kind`` (``"json"`` or ``"yaml"``).

    YAML is read with :class:`UniqueKeyYamlLoader` (a SafeLoader: no Python
    tags). Raises :class:`InputLimitError`: not UTF-8 (byte offset), a syntax
    error (line and column), a key named twice in one object or mapping, a
    number strict JSON cannot carry (:func:`strict_json_loads`;
    in YAML an integer of more digits than Python converts), or nested deeper
    than ``max_depth`` levels.
    """
    try:
        text = data.decode("utf-8-sig")  # a leading byte order mark is not content
    except UnicodeDecodeError as exc:
        raise InputLimitError(f"not UTF-8 (byte {exc.start})") from None
    try:
        if kind == "json":
            value = strict_json_loads(text)
        else:
            value = yaml.load(text, Loader=UniqueKeyYamlLoader)
    except RecursionError:
        raise InputLimitError(f"nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise InputLimitError(
            f"not valid JSON: JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except yaml.YAMLError as exc:
        raise InputLimitError(f"not valid YAML: {' '.join(str(exc).split())}") from None
    except (JsonNumberError, DuplicateKeyError) as exc:
        raise InputLimitError(f"not valid JSON: {exc}") from None
    except ValueError as exc:  # a YAML integer of more digits than Python converts
        raise InputLimitError(f"not valid {kind.upper()}: {int_limit_message(exc)}") from None
    problem = nesting_problem(value, max_depth) or unstorable_value(value)
    if problem:
        raise InputLimitError(problem)
    return value


def int_limit_message(exc: ValueError) -> str:
    """``exc``'s message, with Python's integer-size error (which advises
    ``sys.set_int_max_str_digits()``) said in the operator's terms."""
    message = str(exc)
    if "integer string conversion" in message:
        limit = sys.get_int_max_str_digits() or 4300
        return f"a number of more than {limit:,} digits"
    return message


def load_document(path: Path, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """:func:`read_capped` then :func:`parse_document` (JSON for ``.json``, else YAML).

    Raises ``OSError`` (unreadable) and :class:`InputLimitError` (over
    ``max_bytes``, not UTF-8, a syntax error, too deep).
    """
    data = read_capped(path, max_bytes)
    kind = "json" if Path(path).suffix.lower() == ".json" else "yaml"
    return parse_document(data, kind, max_depth)
