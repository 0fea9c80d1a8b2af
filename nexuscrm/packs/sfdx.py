"""Salesforce DX source loader: object and field metadata into a PackManifest.

Reads, under each package directory of the project (``packageDirectories`` in
``sfdx-project.json``, else the whole folder):

- ``**/objects/<Object>/<Object>.object-meta.xml`` (``<CustomObject>``), and
- ``**/objects/<Object>/fields/<Field>.field-meta.xml`` (``<CustomField>``).

XML is parsed with ``defusedxml`` and any DTD is refused, so entity expansion
("billion laughs") and external entities never run. ``node_modules`` and hidden
folders are not searched. Everything else in the project (layouts, LWC, Apex,
list views ...) is ignored.

Mapping rules:

- ``Foo__c`` is a custom object the pack owns; ``Foo__e`` a platform event
  (``kind="event"``); a name without a ``__`` suffix (``Account``, ``Case``) is
  a standard object the pack extends (``extends=True``). A custom object folder
  with fields but no ``.object-meta.xml`` anywhere in the project also becomes
  ``extends=True`` (the object is owned elsewhere). Other suffixes (``__mdt``,
  ``__x``, ``__b`` ...) are refused.
- A formula field keeps its ``<type>`` (the return type) and its ``<formula>``.
- ``default_value`` is the ``<defaultValue>`` formula expression as written
  (``1``, ``TODAY() - 10``, ``"text"``); a picklist without one but with
  ``<default>true</default>`` values gets those values as a quoted text
  literal (``"Draft"``, several joined by ``;``).
- A global value set reference (``<valueSetName>``) leaves the values empty.
- The same object may be split across package directories; its fields merge,
  and a field or object definition found twice is an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree.ElementTree import Element, ParseError

import defusedxml.ElementTree as safe_et
from defusedxml import DefusedXmlException
from pydantic import ValidationError

from nexuscrm.errors import ManifestError
from nexuscrm.packs.loader import format_validation_error
from nexuscrm.packs.model import (
    Category,
    FieldSpec,
    FieldType,
    ObjectSpec,
    PackManifest,
    SummarySpec,
    validate_identifier,
)

METADATA_NS = "http://soap.sforce.com/2006/04/metadata"
SFDX_PROJECT_FILE = "sfdx-project.json"
OBJECT_SUFFIX = ".object-meta.xml"
FIELD_SUFFIX = ".field-meta.xml"
DEFAULT_DEPENDS_ON = ("platform-core",)
SFDX_DESCRIPTION = "Imported from Salesforce DX source"

_SKIP_DIRS = frozenset({"node_modules", "__pycache__"})
_NAME_JUNK_RE = re.compile(r"[^a-z0-9._-]+")
_NAME_DASHES_RE = re.compile(r"-{2,}")
_SUMMARY_OPERATIONS = ("count", "sum", "min", "max")

# FieldSpec attribute -> the XML element it comes from (for error messages).
_FIELD_ELEMENTS = {
    "api_name": "fullName",
    "label": "label",
    "type": "type",
    "description": "description",
    "length": "length",
    "precision": "precision",
    "scale": "scale",
    "required": "required",
    "unique": "unique",
    "external_id": "externalId",
    "default_value": "defaultValue",
    "reference_to": "referenceTo",
    "relationship_name": "relationshipName",
    "picklist_values": "valueSet",
    "formula": "formula",
    "formula_treat_blanks_as": "formulaTreatBlanksAs",
    "summary": "summaryOperation",
}


def _q(tag: str) -> str:
    return f"{{{METADATA_NS}}}{tag}"


@dataclass
class _ObjectParts:
    """Everything found for one object across the project's package directories."""

    api_name: str
    folders: list[Path] = field(default_factory=list)
    meta_path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, tuple[Path, FieldSpec]] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# discovery


def _walk_object_folders(base: Path) -> Iterator[Path]:
    """Yield every ``objects/<Object>`` folder under ``base``, sorted, pruned."""
    for dirpath, dirnames, _files in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        if Path(dirpath).name == "objects":
            for d in dirnames:
                yield Path(dirpath) / d
            dirnames[:] = []


def _has_metadata(folder: Path) -> bool:
    if (folder / f"{folder.name}{OBJECT_SUFFIX}").is_file():
        return True
    fields_dir = folder / "fields"
    return fields_dir.is_dir() and any(
        p.name.endswith(FIELD_SUFFIX) for p in fields_dir.iterdir() if p.is_file()
    )


def is_sfdx_source(root: Path) -> bool:
    """True when ``root`` is a directory holding ``sfdx-project.json`` or any
    ``objects/<Object>/<Object>.object-meta.xml`` / ``fields/*.field-meta.xml``."""
    root = Path(root)
    if not root.is_dir():
        return False
    if (root / SFDX_PROJECT_FILE).is_file():
        return True
    return any(_has_metadata(folder) for folder in _walk_object_folders(root))


def _read_project(root: Path) -> tuple[str | None, list[Path]]:
    """Return (project name, package directories) from ``sfdx-project.json``."""
    project_file = root / SFDX_PROJECT_FILE
    if not project_file.is_file():
        return None, [root]
    try:
        data = json.loads(project_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(str(project_file), f"cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(
            str(project_file),
            f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}",
        ) from exc
    if not isinstance(data, dict):
        raise ManifestError(str(project_file), "must be a JSON object")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise ManifestError(str(project_file), "name: must be a string")
    entries = data.get("packageDirectories")
    if entries is None:
        return name, [root]
    if not isinstance(entries, list) or not entries:
        raise ManifestError(str(project_file), "packageDirectories: must be a non-empty list")
    resolved_root = root.resolve()
    dirs: list[Path] = []
    for i, entry in enumerate(entries):
        rel = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(rel, str) or not rel.strip():
            raise ManifestError(str(project_file), f"packageDirectories[{i}].path: missing")
        pkg = (root / rel).resolve()
        if not pkg.is_relative_to(resolved_root):
            raise ManifestError(
                str(project_file),
                f"packageDirectories[{i}].path: {rel!r} points outside the project",
            )
        if not pkg.is_dir():
            raise ManifestError(
                str(project_file), f"packageDirectories[{i}].path: {rel!r} does not exist"
            )
        if pkg not in dirs:
            dirs.append(pkg)
    return name, dirs


def sanitize_pack_name(raw: str) -> str:
    """Lower-case ``raw`` and squeeze it into the pack-name pattern.

    Runs of characters outside ``[a-z0-9._-]`` become ``-``; leading and
    trailing separators are dropped; at most 63 characters. Returns "" when
    nothing usable is left.
    """
    s = _NAME_JUNK_RE.sub("-", raw.strip().lower())
    s = _NAME_DASHES_RE.sub("-", s).strip("._-")
    return s[:63].rstrip("._-")


# ---------------------------------------------------------------------------
# XML helpers


def _parse_xml(path: Path, root_tag: str) -> Element:
    try:
        tree = safe_et.parse(str(path), forbid_dtd=True)
    except DefusedXmlException as exc:
        raise ManifestError(
            str(path), f"refused: DTD / entity declarations are not allowed in metadata ({exc})"
        ) from exc
    except ParseError as exc:
        raise ManifestError(str(path), f"XML does not parse: {exc}") from exc
    except OSError as exc:
        raise ManifestError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    root: Element = tree.getroot()
    if root.tag != _q(root_tag):
        raise ManifestError(
            str(path), f'root element is <{root.tag}>, expected <{root_tag} xmlns="{METADATA_NS}">'
        )
    return root


def _text(el: Element, tag: str) -> str | None:
    child = el.find(_q(tag))
    if child is None:
        return None
    return (child.text or "").strip()


def _required_text(el: Element, tag: str, path: Path) -> str:
    value = _text(el, tag)
    if not value:
        raise ManifestError(str(path), f"<{tag}> is missing or empty")
    return value


def _bool(el: Element, tag: str, path: Path) -> bool:
    value = _text(el, tag)
    if value is None or value == "":
        return False
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ManifestError(str(path), f"<{tag}>: {value!r} is not true or false")


def _int(el: Element, tag: str, path: Path) -> int | None:
    value = _text(el, tag)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ManifestError(str(path), f"<{tag}>: {value!r} is not an integer") from None


# ---------------------------------------------------------------------------
# objects and fields


def _object_meta(path: Path, api_name: str) -> dict[str, Any]:
    root = _parse_xml(path, "CustomObject")
    if root.find(_q("fields")) is not None:
        raise ManifestError(
            str(path),
            "<fields> inside the object file is Metadata API format; convert the project "
            "to source format (sf project convert mdapi) so each field has its own file",
        )
    meta: dict[str, Any] = {}
    for tag, key in (
        ("label", "label"),
        ("pluralLabel", "plural_label"),
        ("description", "description"),
    ):
        value = _text(root, tag)
        if value:
            meta[key] = value
    name_field = root.find(_q("nameField"))
    if name_field is not None:
        nf_type = _text(name_field, "type")
        if nf_type:
            if nf_type not in ("Text", "AutoNumber"):
                raise ManifestError(
                    str(path), f"<nameField><type>: {nf_type!r} is not Text or AutoNumber"
                )
            meta["name_field_type"] = nf_type
        nf_label = _text(name_field, "label")
        if nf_label:
            meta["name_field_label"] = nf_label
    return meta


def _picklist_values(root: Element, path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return (values, default values) of a picklist field, in declared order."""
    values: list[str] = []
    defaults: list[str] = []

    def take(entries: list[Element], where: str) -> None:
        for i, v in enumerate(entries):
            name = _text(v, "fullName")
            if not name:
                raise ManifestError(str(path), f"{where}[{i}]: <fullName> missing")
            values.append(name)
            if _bool(v, "default", path):
                defaults.append(name)

    value_set = root.find(_q("valueSet"))
    if value_set is not None:
        if value_set.find(_q("valueSetName")) is not None:
            return (), ()  # global value set: values live in another file
        definition = value_set.find(_q("valueSetDefinition"))
        if definition is not None:
            take(definition.findall(_q("value")), "<valueSet><valueSetDefinition><value>")
    legacy = root.find(_q("picklist"))
    if legacy is not None:  # pre-API-38 shape
        take(legacy.findall(_q("picklistValues")), "<picklist><picklistValues>")
    return tuple(values), tuple(defaults)


def formula_text_literal(value: str) -> str:
    """Quote ``value`` as a formula text literal: ``Draft`` -> ``"Draft"``."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _summary(root: Element, path: Path) -> SummarySpec | None:
    op = _text(root, "summaryOperation")
    if not op:
        return None
    if op.lower() not in _SUMMARY_OPERATIONS:
        raise ManifestError(
            str(path), f"<summaryOperation>: {op!r} is not one of {', '.join(_SUMMARY_OPERATIONS)}"
        )
    return SummarySpec.model_validate(
        {
            "operation": op.lower(),
            "summarized_field": _text(root, "summarizedField") or None,
            "foreign_key_field": _text(root, "summaryForeignKey") or None,
        }
    )


def _field_spec(path: Path) -> FieldSpec:
    root = _parse_xml(path, "CustomField")
    full_name = _required_text(root, "fullName", path)
    expected = path.name[: -len(FIELD_SUFFIX)]
    if full_name != expected:
        raise ManifestError(
            str(path), f"<fullName> {full_name!r} does not match the file name {expected!r}"
        )
    try:
        validate_identifier(full_name, "field api_name")
    except ValueError as exc:
        raise ManifestError(str(path), f"<fullName>: {exc}") from None
    type_name = _required_text(root, "type", path)
    if type_name not in FieldType.__members__:
        raise ManifestError(
            str(path),
            f"<type>: {type_name!r} is not a supported field type "
            f"(supported: {', '.join(t.value for t in FieldType)})",
        )
    blanks = _text(root, "formulaTreatBlanksAs")
    if blanks and blanks not in ("BlankAsZero", "BlankAsBlank"):
        raise ManifestError(
            str(path), f"<formulaTreatBlanksAs>: {blanks!r} is not BlankAsZero or BlankAsBlank"
        )
    picklist_values, picklist_defaults = _picklist_values(root, path)
    default_value = _text(root, "defaultValue") or None
    if default_value is None and picklist_defaults:
        default_value = formula_text_literal(";".join(picklist_defaults))
    data: dict[str, Any] = {
        "api_name": full_name,
        "label": _text(root, "label") or "",
        "type": type_name,
        "description": _text(root, "description") or "",
        "length": _int(root, "length", path),
        "precision": _int(root, "precision", path),
        "scale": _int(root, "scale", path),
        "required": _bool(root, "required", path),
        "unique": _bool(root, "unique", path),
        "external_id": _bool(root, "externalId", path),
        "default_value": default_value,
        "reference_to": _text(root, "referenceTo") or None,
        "relationship_name": _text(root, "relationshipName") or None,
        "picklist_values": picklist_values,
        "formula": _text(root, "formula"),
        "summary": _summary(root, path),
    }
    if blanks:
        data["formula_treat_blanks_as"] = blanks
    try:
        return FieldSpec.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(str(path), _field_error_text(exc)) from exc


def _field_error_text(exc: ValidationError) -> str:
    parts: list[str] = []
    for e in exc.errors(include_url=False):
        loc = e.get("loc", ())
        head = loc[0] if loc else None
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if head is None:  # a whole-field rule; the message names the field
            parts.append(msg)
        else:
            parts.append(f"<{_FIELD_ELEMENTS.get(str(head), head)}>: {msg}")
    return "; ".join(parts)


def _object_kind(api_name: str, folder: Path) -> tuple[str, bool]:
    """Return (kind, is_custom) for an object API name, or raise for unsupported suffixes."""
    if api_name.endswith("__c"):
        return "table", True
    if api_name.endswith("__e"):
        return "event", True
    if "__" in api_name:
        suffix = api_name[api_name.rindex("__") :]
        raise ManifestError(
            str(folder),
            f"object {api_name}: {suffix} objects are not supported "
            "(only custom objects __c, platform events __e and standard objects)",
        )
    return "table", False


def _collect(package_dirs: list[Path]) -> dict[str, _ObjectParts]:
    objects: dict[str, _ObjectParts] = {}
    for base in package_dirs:
        for folder in _walk_object_folders(base):
            if not _has_metadata(folder):
                continue
            api_name = folder.name
            try:
                validate_identifier(api_name, "object api_name")
            except ValueError as exc:
                raise ManifestError(str(folder), str(exc)) from None
            _object_kind(api_name, folder)
            parts = objects.setdefault(api_name, _ObjectParts(api_name))
            parts.folders.append(folder)
            meta_file = folder / f"{api_name}{OBJECT_SUFFIX}"
            if meta_file.is_file():
                if parts.meta_path is not None:
                    raise ManifestError(
                        str(meta_file), f"object {api_name} is also defined in {parts.meta_path}"
                    )
                parts.meta_path = meta_file
                parts.meta = _object_meta(meta_file, api_name)
            fields_dir = folder / "fields"
            if not fields_dir.is_dir():
                continue
            for field_file in sorted(fields_dir.iterdir()):
                if not field_file.name.endswith(FIELD_SUFFIX) or not field_file.is_file():
                    continue
                spec = _field_spec(field_file)
                prior = parts.fields.get(spec.api_name)
                if prior is not None:
                    raise ManifestError(
                        str(field_file),
                        f"field {api_name}.{spec.api_name} is also defined in {prior[0]}",
                    )
                parts.fields[spec.api_name] = (field_file, spec)
    return objects


def _object_spec(parts: _ObjectParts) -> ObjectSpec:
    kind, is_custom = _object_kind(parts.api_name, parts.folders[0])
    extends = not is_custom or parts.meta_path is None
    fields = tuple(
        spec for _path, spec in sorted(parts.fields.values(), key=lambda x: x[1].api_name)
    )
    try:
        return ObjectSpec.model_validate(
            {
                "api_name": parts.api_name,
                "kind": kind,
                "extends": extends,
                **parts.meta,
                "fields": fields,
            }
        )
    except ValidationError as exc:
        where = parts.meta_path or parts.folders[0]
        raise ManifestError(str(where), format_validation_error(exc)) from exc


def load_sfdx(root: Path, *, name: str | None = None, version: str = "1.0.0") -> PackManifest:
    """Load a Salesforce DX project folder as an ``AppPack`` manifest.

    ``name`` defaults to ``name`` in ``sfdx-project.json``, else the folder
    name, lower-cased and sanitized to the pack-name pattern. The pack depends
    on ``platform-core``; objects and fields are sorted by API name, so the
    result (and its payload hash) does not depend on directory order. ``source``
    is the resolved folder path.

    Raises:
        ManifestError: naming the file (and XML element) at fault, for: a
            folder that is not a directory; an unreadable / invalid
            ``sfdx-project.json``; XML that does not parse or declares a DTD or
            entities; a wrong root element; a missing ``<fullName>`` or
            ``<type>``; a ``<fullName>`` that differs from the file name; a
            ``<type>`` outside :class:`FieldType`; an invalid API name or
            number; an object or field defined twice; no objects found; or an
            unusable pack name.
    """
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(str(root), "Salesforce DX source must be a directory")
    project_name, package_dirs = _read_project(root)
    objects = _collect(package_dirs)
    if not objects:
        raise ManifestError(
            str(root),
            "no objects/<Object>/<Object>.object-meta.xml or fields/*.field-meta.xml found",
        )
    if name is None:
        raw = project_name or root.resolve().name
        name = sanitize_pack_name(raw)
        if not name:
            raise ManifestError(str(root), f"cannot derive a pack name from {raw!r}; pass name=")
    specs = tuple(_object_spec(objects[key]) for key in sorted(objects))
    try:
        return PackManifest(
            name=name,
            category=Category.AppPack,
            version=version,
            description=SFDX_DESCRIPTION,
            depends_on=DEFAULT_DEPENDS_ON,
            objects=specs,
            source=str(root.resolve()),
        )
    except ValidationError as exc:
        raise ManifestError(str(root), format_validation_error(exc)) from exc
