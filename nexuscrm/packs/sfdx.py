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
  (``kind="event"``); ``Foo__mdt`` a custom metadata type (a table, its
  ``customMetadata/Foo.*.md-meta.xml`` records become its ``records``); a name
  without a ``__`` suffix (``Account``, ``Case``) is a standard object the
  pack extends (``extends=True``), and its standard fields (no ``__c``)
  become ``customizations``. A custom object folder with fields but no
  ``.object-meta.xml`` anywhere in the project also becomes ``extends=True``;
  a namespaced one (``hed__X__c``) carries ``package_namespace``. Other
  suffixes (``__x``, ``__b`` ...) are problems.
- Every problem of the project is collected (``PackProblems``), each naming
  its file and element.
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

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nexuscrm.errors import ManifestError, PackProblems, Problem, problem_from
from nexuscrm.inputs import InputLimitError, kind_of, parse_document, read_capped
from nexuscrm.packs.loader import format_validation_error
from nexuscrm.packs.model import (
    STANDARD_COLUMNS,
    Category,
    CustomLabel,
    FieldCustomization,
    FieldSpec,
    FieldType,
    ObjectSpec,
    PackManifest,
    RecordSpec,
    validate_identifier,
)
from nexuscrm.packs.sfdx_fields import (
    FIELD_SUFFIX,
    _field_spec,
    _parse_xml,
    _q,
    _text,
)
from nexuscrm.packs.sfdx_records import label_files, parse_labels, parse_record, record_files

SFDX_PROJECT_FILE = "sfdx-project.json"
OBJECT_SUFFIX = ".object-meta.xml"
DEFAULT_DEPENDS_ON = ("platform-core",)
SFDX_DESCRIPTION = "Imported from Salesforce DX source"

_SYSTEM_COLUMNS = frozenset(c.lower() for c in STANDARD_COLUMNS)
_SKIP_DIRS = frozenset({"node_modules", "__pycache__"})
_NAME_JUNK_RE = re.compile(r"[^a-z0-9._-]+")
_NAME_DASHES_RE = re.compile(r"-{2,}")


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


def walk_object_folders(base: Path) -> Iterator[Path]:
    """Yield every ``objects/<Object>`` folder under ``base``, sorted, pruned."""
    for dirpath, dirnames, _files in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        if Path(dirpath).name == "objects":
            for d in dirnames:
                yield Path(dirpath) / d
            dirnames[:] = []


def not_a_file(path: Path) -> str:
    """Why a metadata name (``X.field-meta.xml``) that is not a regular file is
    refused: a directory, a symlink to nothing, or another kind of file. Never
    skipped silently: its object or field would be missing from the pack."""
    if path.is_symlink() and not path.exists():
        what = f"a broken symlink (to {os.readlink(path)})"
    elif path.is_dir():
        what = "a directory"
    else:
        what = "not a regular file (a device, socket or pipe)"
    return f"a metadata file is expected here, found {what}"


def _has_metadata(folder: Path) -> bool:
    """An object folder with an object or field metadata name in it (a file, or
    something else by that name, which :func:`_collect_folder` then refuses)."""
    meta = folder / f"{folder.name}{OBJECT_SUFFIX}"
    if meta.exists() or meta.is_symlink():
        return True
    fields_dir = folder / "fields"
    return fields_dir.is_dir() and any(p.name.endswith(FIELD_SUFFIX) for p in fields_dir.iterdir())


def is_sfdx_source(root: Path) -> bool:
    """True when ``root`` is a directory holding ``sfdx-project.json`` or any
    ``objects/<Object>/<Object>.object-meta.xml`` / ``fields/*.field-meta.xml``."""
    root = Path(root)
    if not root.is_dir():
        return False
    if (root / SFDX_PROJECT_FILE).is_file():
        return True
    return any(_has_metadata(folder) for folder in walk_object_folders(root))


MAX_PROJECT_FILE_BYTES = 1024 * 1024
"""Largest ``sfdx-project.json`` read (1 MiB); it may nest at most
:data:`~nexuscrm.inputs.MAX_JSON_DEPTH` levels."""


def _project_data(project_file: Path) -> Any:
    """The parsed ``sfdx-project.json``; ``ManifestError`` naming the file when it
    cannot be read, is over :data:`MAX_PROJECT_FILE_BYTES`, is not UTF-8 or
    JSON, or nests too deeply."""
    try:
        return parse_document(read_capped(project_file, MAX_PROJECT_FILE_BYTES), "json")
    except OSError as exc:
        raise ManifestError(str(project_file), f"cannot read: {exc.strerror or exc}") from None
    except InputLimitError as exc:
        raise ManifestError(str(project_file), str(exc)) from None


def _read_project(root: Path) -> tuple[str | None, list[Path]]:
    """Return (project name, package directories) from ``sfdx-project.json``."""
    project_file = root / SFDX_PROJECT_FILE
    if not project_file.is_file():
        return None, [root]
    data = _project_data(project_file)
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
        if not isinstance(entry, dict):
            raise ManifestError(
                str(project_file),
                f"packageDirectories[{i}]: must be an object with a path, not {kind_of(entry)}",
            )
        rel = entry.get("path")
        if rel is None:
            raise ManifestError(str(project_file), f"packageDirectories[{i}].path: missing")
        if not isinstance(rel, str):
            raise ManifestError(
                str(project_file),
                f"packageDirectories[{i}].path: must be a string, not {kind_of(rel)}",
            )
        if not rel.strip():
            raise ManifestError(str(project_file), f"packageDirectories[{i}].path: is empty")
        try:
            pkg = (root / rel).resolve()
            outside = not pkg.is_relative_to(resolved_root)
            missing = outside or not pkg.is_dir()
            not_dir = missing and pkg.exists()
        except (OSError, ValueError) as exc:  # a NUL byte, a name too long ...
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ManifestError(
                str(project_file),
                f"packageDirectories[{i}].path: {rel[:80]!r} is not a usable path: {reason}",
            ) from None
        if outside:
            raise ManifestError(
                str(project_file),
                f"packageDirectories[{i}].path: {rel!r} points outside the project",
            )
        if not_dir:
            raise ManifestError(
                str(project_file),
                f"packageDirectories[{i}].path: {rel!r} is a file, not a folder",
            )
        if missing:
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


def _object_meta(path: Path, api_name: str) -> dict[str, Any]:
    root = _parse_xml(path, "CustomObject")
    if root.find(_q("fields")) is not None:
        raise ManifestError(
            str(path),
            "<fields> inside the object file is Metadata API format; convert the project "
            "to source format (sf project convert mdapi) so each field has its own file",
        )
    meta: dict[str, Any] = {}
    settings_type = _text(root, "customSettingsType")
    if settings_type:
        meta["custom_settings_type"] = settings_type
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


_UNSUPPORTED_SUFFIXES = {
    "__b": "big objects (__b) are not supported",
    "__x": "external objects (__x) are not supported",
    "__Share": "sharing objects (__Share) are not supported",
    "__History": "history objects (__History) are not supported",
    "__Feed": "feed objects (__Feed) are not supported",
    "__ChangeEvent": "change event objects (__ChangeEvent) are not supported",
}
_NAMESPACED_RE = re.compile(r"^([A-Za-z][A-Za-z0-9]*)__[A-Za-z0-9_]+__c$")


def namespace_of(api_name: str) -> str | None:
    """The package namespace of ``ns__Object__c`` (``hed``), else None."""
    m = _NAMESPACED_RE.fullmatch(api_name)
    return m.group(1) if m else None


def _object_kind(api_name: str, folder: Path) -> tuple[str, bool]:
    """Return (kind, is_custom) for an object API name, or raise for unsupported suffixes."""
    if api_name.endswith(("__c", "__mdt")):
        return "table", True
    if api_name.endswith("__e"):
        return "event", True
    if "__" in api_name:
        suffix = api_name[api_name.rindex("__") :]
        reason = _UNSUPPORTED_SUFFIXES.get(
            suffix,
            f"{suffix} objects are not supported (only custom objects __c, custom "
            "metadata types __mdt, platform events __e and standard objects)",
        )
        raise ManifestError(str(folder), f"object {api_name}: {reason}")
    return "table", False


FieldItem = FieldSpec | FieldCustomization


@dataclass
class _Collected:
    objects: dict[str, _ObjectParts] = field(default_factory=dict)
    customizations: dict[str, dict[str, tuple[Path, FieldCustomization]]] = field(
        default_factory=dict
    )
    records: dict[str, list[tuple[Path, RecordSpec]]] = field(default_factory=dict)
    labels: list[CustomLabel] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def fail(self, exc: ManifestError) -> None:
        self.problems.append(problem_from(exc))


def _collect_folder(folder: Path, out: _Collected) -> None:
    api_name = folder.name
    try:
        validate_identifier(api_name, "object api_name")
        _kind, is_custom = _object_kind(api_name, folder)
    except ValueError as exc:
        out.problems.append(Problem(str(folder), "", str(exc)))
        return
    except ManifestError as exc:
        out.fail(exc)
        return
    parts = out.objects.setdefault(api_name, _ObjectParts(api_name))
    parts.folders.append(folder)
    meta_file = folder / f"{api_name}{OBJECT_SUFFIX}"
    if meta_file.is_file():
        if parts.meta_path is not None:
            out.problems.append(
                Problem(
                    str(meta_file), "", f"object {api_name} is also defined in {parts.meta_path}"
                )
            )
        else:
            parts.meta_path = meta_file
            try:
                parts.meta = _object_meta(meta_file, api_name)
            except ManifestError as exc:
                out.fail(exc)
    elif meta_file.exists() or meta_file.is_symlink():
        out.problems.append(Problem(str(meta_file), "", not_a_file(meta_file)))
    fields_dir = folder / "fields"
    if not fields_dir.is_dir():
        return
    custom = out.customizations.setdefault(api_name, {})
    for field_file in sorted(fields_dir.iterdir()):
        if not field_file.name.endswith(FIELD_SUFFIX):
            continue
        if not field_file.is_file():
            out.problems.append(Problem(str(field_file), "", not_a_file(field_file)))
            continue
        try:
            item = _field_spec(field_file, standard_object=not is_custom)
        except PackProblems as exc:
            out.problems.extend(exc.problems)
            continue
        except ManifestError as exc:
            out.fail(exc)
            continue
        prior_path = (parts.fields.get(item.api_name) or custom.get(item.api_name) or (None,))[0]
        if prior_path is not None:
            out.problems.append(
                Problem(
                    str(field_file),
                    "",
                    f"field {api_name}.{item.api_name} is also defined in {prior_path}",
                )
            )
        elif isinstance(item, FieldSpec) and item.api_name.lower() in _SYSTEM_COLUMNS:
            # Refused here, alone: the object and its other fields are still checked.
            out.problems.append(
                Problem(
                    str(field_file),
                    "<fullName>",
                    f"{item.api_name} collides with the system column every object has "
                    f"({', '.join(STANDARD_COLUMNS)}); rename the field",
                )
            )
        elif isinstance(item, FieldCustomization):
            custom[item.api_name] = (field_file, item)
        else:
            parts.fields[item.api_name] = (field_file, item)


def _collect(package_dirs: list[Path]) -> _Collected:
    out = _Collected()
    for base in package_dirs:
        for folder in walk_object_folders(base):
            if _has_metadata(folder):
                _collect_folder(folder, out)
        for record_file in record_files(base):
            if not record_file.is_file():
                out.problems.append(Problem(str(record_file), "", not_a_file(record_file)))
                continue
            parsed = parse_record(record_file)
            if isinstance(parsed, Problem):
                out.problems.append(parsed)
            else:
                out.records.setdefault(parsed[0], []).append((record_file, parsed[1]))
        for labels_file in label_files(base):
            if not labels_file.is_file():
                out.problems.append(Problem(str(labels_file), "", not_a_file(labels_file)))
                continue
            labels = parse_labels(labels_file)
            if isinstance(labels, Problem):
                out.problems.append(labels)
                continue
            for label in labels:
                if label.name.lower() in {x.name.lower() for x in out.labels}:
                    out.problems.append(
                        Problem(str(labels_file), label.name, "custom label defined twice")
                    )
                else:
                    out.labels.append(label)
    return out


# Standard fields every custom metadata type has besides Name (= its label).
_MDT_FIELDS = (
    FieldSpec(api_name="DeveloperName", label="Custom Metadata Record Name", type=FieldType.Text,
              length=40),
    FieldSpec(api_name="MasterLabel", label="Label", type=FieldType.Text, length=40),
)  # fmt: skip


_SETUP_OWNER = FieldSpec(
    api_name="SetupOwnerId", label="Location", type=FieldType.Text, length=18,
    description="The user, profile or organization (00D...) this setting applies to.",
)  # fmt: skip


def _records_of(
    parts: _ObjectParts, found: list[tuple[Path, RecordSpec]], out: _Collected
) -> tuple[RecordSpec, ...]:
    declared = {k.lower() for k in parts.fields}
    good: list[RecordSpec] = []
    for path, rec in found:
        unknown = sorted(f for f in rec.values if f.lower() not in declared)
        if unknown:
            out.problems.append(
                Problem(
                    str(path), "<values><field>",
                    f"{', '.join(unknown)} not declared on {parts.api_name}",
                )
            )  # fmt: skip
            continue
        good.append(rec)
    return tuple(sorted(good, key=lambda r: r.developer_name))


def _object_spec(parts: _ObjectParts, out: _Collected) -> ObjectSpec | None:
    kind, is_custom = _object_kind(parts.api_name, parts.folders[0])
    extends = not is_custom or parts.meta_path is None
    fields = [spec for _path, spec in sorted(parts.fields.values(), key=lambda x: x[1].api_name)]
    records: tuple[RecordSpec, ...] = ()
    if parts.api_name.endswith("__mdt"):
        have = {f.api_name.lower() for f in fields}
        fields = [f for f in _MDT_FIELDS if f.api_name.lower() not in have] + fields
        records = _records_of(parts, out.records.pop(parts.api_name, []), out)
    meta = dict(parts.meta)
    # Salesforce's hierarchy custom settings hold one record per user, profile
    # or the organization, named by SetupOwnerId ($Setup reads it).
    hierarchy = meta.pop("custom_settings_type", None) == "Hierarchy"
    if hierarchy and all(f.api_name.lower() != "setupownerid" for f in fields):
        fields = [_SETUP_OWNER, *fields]
    customizations = tuple(
        c for _p, c in sorted(out.customizations.get(parts.api_name, {}).values(),
                              key=lambda x: x[1].api_name)
    )  # fmt: skip
    namespace = namespace_of(parts.api_name) if parts.meta_path is None else None
    try:
        return ObjectSpec.model_validate(
            {
                "api_name": parts.api_name,
                "kind": kind,
                "extends": extends,
                **meta,
                "fields": tuple(fields),
                "customizations": customizations,
                "records": records,
                "package_namespace": namespace,
            }
        )
    except ValidationError as exc:
        where = parts.meta_path or parts.folders[0]
        out.problems.append(Problem(str(where), "", format_validation_error(exc)))
        return None


def _referenced_namespaced(specs: list[ObjectSpec]) -> list[ObjectSpec]:
    """Stub specs (``extends``, no fields) for namespaced objects the project's
    lookups point at but does not hold (``hed__Term__c``)."""
    have = {o.api_name.lower() for o in specs}
    out: dict[str, ObjectSpec] = {}
    for o in specs:
        for f in o.fields:
            target = f.reference_to
            ns = namespace_of(target) if target else None
            if target and ns and target.lower() not in have and target.lower() not in out:
                out[target.lower()] = ObjectSpec(
                    api_name=target, extends=True, package_namespace=ns
                )
    return list(out.values())


def _read_plugin(root: Path) -> tuple[str | None, tuple[str, ...]]:
    """(namespace, extra depends_on) from ``sfdx-project.json``: the standard
    ``namespace`` key and ``plugins.nexusctl.dependsOn`` (a list of pack names)."""
    project_file = root / SFDX_PROJECT_FILE
    if not project_file.is_file():
        return None, ()
    data = _project_data(project_file)
    if not isinstance(data, dict):
        raise ManifestError(str(project_file), "must be a JSON object")
    namespace = data.get("namespace") or None
    if namespace is not None and not isinstance(namespace, str):
        raise ManifestError(str(project_file), "namespace: must be a string")
    plugins = data.get("plugins") or {}
    if not isinstance(plugins, dict):
        raise ManifestError(
            str(project_file), f"plugins: must be an object, not {kind_of(plugins)}"
        )
    plugin = plugins.get("nexusctl") or {}
    deps = plugin.get("dependsOn") if isinstance(plugin, dict) else None
    if deps is None:
        return namespace, ()
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise ManifestError(
            str(project_file), "plugins.nexusctl.dependsOn: must be a list of names"
        )
    return namespace, tuple(deps)


def load_sfdx(root: Path, *, name: str | None = None, version: str = "1.0.0") -> PackManifest:
    """Load a Salesforce DX project folder as an ``AppPack`` manifest.

    ``name`` defaults to ``name`` in ``sfdx-project.json``, else the folder
    name, lower-cased and sanitized to the pack-name pattern. The pack depends
    on ``platform-core`` plus ``plugins.nexusctl.dependsOn`` of
    ``sfdx-project.json``; its ``namespace`` is that file's ``namespace``.
    Objects and fields are sorted by API name, so the result (and its payload
    hash) does not depend on directory order. ``source`` is the resolved
    folder path. Custom metadata records (``customMetadata/``) become the
    ``records`` of their ``__mdt`` object; namespaced objects the project's
    lookups point at but does not hold get a stub (``package_namespace``).

    Raises:
        PackProblems: every problem of the project at once, each naming the
            file (and XML element): an unreadable / invalid
            ``sfdx-project.json``; XML that does not parse or declares a DTD or
            entities; a wrong root element; a missing ``<fullName>`` or
            ``<type>`` (of a custom field); a ``<fullName>`` that differs from
            the file name; an unsupported ``<type>`` or object suffix (``__b``,
            ``__x`` ...); an invalid API name or number; an object or field
            defined twice; a record of an undefined ``__mdt`` or naming an
            undeclared field; no objects found; or an unusable pack name.
    """
    root = Path(root)
    where = str(root)
    if not root.is_dir():
        raise PackProblems(where, [Problem(where, "", "Salesforce DX source must be a directory")])
    try:
        project_name, package_dirs = _read_project(root)
        namespace, extra_deps = _read_plugin(root)
    except ManifestError as exc:
        raise PackProblems(where, [problem_from(exc)]) from exc
    found = _collect(package_dirs)
    specs = [
        spec
        for key in sorted(found.objects)
        if (spec := _object_spec(found.objects[key], found)) is not None
    ]
    for type_name, records in sorted(found.records.items()):
        for path, _rec in records:
            found.problems.append(
                Problem(str(path), "", f"custom metadata type {type_name} is not defined in the "
                        f"project (no objects/{type_name}/)")
            )  # fmt: skip
    specs = sorted(specs + _referenced_namespaced(specs), key=lambda o: o.api_name)
    if not specs and not found.problems:
        found.problems.append(
            Problem(where, "", "no objects/<Object>/<Object>.object-meta.xml or "
                    "fields/*.field-meta.xml found")
        )  # fmt: skip
    if name is None:
        raw = project_name or root.resolve().name
        name = sanitize_pack_name(raw)
        if not name:
            found.problems.append(
                Problem(
                    where,
                    "",
                    f'cannot derive a pack name from {raw!r}: set "name" in '
                    f"{SFDX_PROJECT_FILE} (letters, digits, '-'), or rename the folder",
                )
            )
    try:
        pack = PackManifest(
            # A name that could not be derived is already a problem; the
            # placeholder keeps it from being reported twice.
            name=name or "unnamed",
            category=Category.AppPack,
            version=version,
            description=SFDX_DESCRIPTION,
            depends_on=tuple(dict.fromkeys(DEFAULT_DEPENDS_ON + extra_deps)),
            namespace=namespace,
            objects=tuple(specs),
            labels=tuple(sorted(found.labels, key=lambda x: x.name.lower())),
            source=str(root.resolve()),
        )
    except ValidationError as exc:
        found.problems.append(Problem(where, "", format_validation_error(exc)))
        raise PackProblems(where, found.problems) from exc
    if found.problems:
        raise PackProblems(where, found.problems, partial=pack)
    return pack
