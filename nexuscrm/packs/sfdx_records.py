"""Custom metadata records of a Salesforce DX project (``customMetadata/*.md-meta.xml``).

A record file is named ``<Type>.<DeveloperName>.md-meta.xml`` (the type
without its ``__mdt`` suffix) and holds ``<CustomMetadata>`` with ``<label>``
and ``<values><field>F__c</field><value xsi:type="xsd:string">..</value></values>``
entries. Each becomes a :class:`RecordSpec` of object ``<Type>__mdt``; the
values are kept as the text written in the file (``None`` for ``xsi:nil``) and
converted to the column types when the pack is applied.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from xml.etree.ElementTree import Element, ParseError

import defusedxml.ElementTree as safe_et
from defusedxml import DefusedXmlException
from pydantic import ValidationError

from nexuscrm.errors import ManifestError, Problem, problem_from
from nexuscrm.packs.model import CustomLabel, RecordSpec, validate_identifier
from nexuscrm.packs.sfdx_fields import read_metadata_file

METADATA_NS = "http://soap.sforce.com/2006/04/metadata"
XSI_NS = "http://www.w3.org/2001/XMLSchema-instance"
RECORD_SUFFIX = ".md-meta.xml"
_SKIP_DIRS = frozenset({"node_modules", "__pycache__"})


def _q(tag: str) -> str:
    return f"{{{METADATA_NS}}}{tag}"


def _read_root(path: Path, tag: str) -> Element | Problem:
    """The root element of a metadata file, checked to be ``<tag>``, or the problem."""
    try:
        data = read_metadata_file(path)
    except ManifestError as exc:
        return problem_from(exc)
    try:
        root: Element = safe_et.fromstring(data, forbid_dtd=True)
    except DefusedXmlException as exc:
        return Problem(str(path), "", f"refused: DTD / entity declarations ({exc})")
    except ParseError as exc:
        return Problem(str(path), "", f"XML does not parse: {exc}")
    if root.tag != _q(tag):
        return Problem(str(path), "", f"root element is <{root.tag}>, expected <{tag}>")
    return root


def _files_in(base: Path, folder: str, suffix: str) -> Iterator[Path]:
    """Every ``<folder>/*<suffix>`` under ``base``, sorted; hidden and
    ``node_modules`` folders are not searched. A directory by such a name is
    yielded too (not searched), for the caller to refuse, not skip."""
    for dirpath, dirnames, files in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        if Path(dirpath).name == folder:
            named = [d for d in dirnames if d.endswith(suffix)]
            dirnames[:] = [d for d in dirnames if not d.endswith(suffix)]
            for name in sorted([*files, *named]):
                if name.endswith(suffix):
                    yield Path(dirpath) / name


def record_files(base: Path) -> Iterator[Path]:
    """Every ``customMetadata/*.md-meta.xml`` under ``base``, sorted."""
    return _files_in(base, "customMetadata", RECORD_SUFFIX)


# RecordSpec attribute -> where in a record file it comes from (for problems).
_RECORD_ELEMENTS = {"developer_name": "DeveloperName (in the file name)", "label": "<label>"}


def parse_record(path: Path) -> tuple[str, RecordSpec] | Problem:
    """Parse one record file: ``(object api name, record)`` or the :class:`Problem`.

    Problems: a file name that is not ``<Type>.<Name>.md-meta.xml``, XML that
    does not parse or declares a DTD, a root that is not ``<CustomMetadata>``,
    a ``<values>`` entry without ``<field>``, a DeveloperName or label longer
    than its column (every such problem of the file in one, naming where).
    """
    stem = path.name[: -len(RECORD_SUFFIX)]
    type_name, dot, developer_name = stem.partition(".")
    if not dot or not type_name or not developer_name:
        return Problem(str(path), "", "file name is not <Type>.<DeveloperName>.md-meta.xml")
    object_api = f"{type_name}__mdt"
    try:
        validate_identifier(object_api, "custom metadata type")
    except ValueError as exc:
        return Problem(str(path), "", str(exc))
    root = _read_root(path, "CustomMetadata")
    if isinstance(root, Problem):
        return root
    label_el = root.find(_q("label"))
    label = (label_el.text or "").strip() if label_el is not None else ""
    values: dict[str, str | None] = {}
    for i, entry in enumerate(root.findall(_q("values"))):
        field_el = entry.find(_q("field"))
        field_name = (field_el.text or "").strip() if field_el is not None else ""
        if not field_name:
            return Problem(str(path), f"<values>[{i}]", "<field> is missing")
        value_el = entry.find(_q("value"))
        if value_el is None or value_el.get(f"{{{XSI_NS}}}nil") == "true":
            values[field_name] = None
        else:
            values[field_name] = value_el.text or ""
    try:
        record = RecordSpec(
            developer_name=developer_name, label=label or developer_name, values=values
        )
    except ValidationError as exc:
        return _record_problem(path, exc)
    return object_api, record


def _record_problem(path: Path, exc: ValidationError) -> Problem:
    """One problem naming the file and each element at fault (``<label>`` ...)."""
    parts = []
    for e in exc.errors(include_url=False):
        head = str(e["loc"][0]) if e.get("loc") else ""
        where = _RECORD_ELEMENTS.get(head, head)
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return Problem(str(path), "", "; ".join(parts))


LABELS_SUFFIX = ".labels-meta.xml"


def label_files(base: Path) -> Iterator[Path]:
    """Every ``labels/*.labels-meta.xml`` under ``base``, sorted."""
    return _files_in(base, "labels", LABELS_SUFFIX)


def parse_labels(path: Path) -> list[CustomLabel] | Problem:
    """Custom labels of one ``<CustomLabels>`` file (``$Label.<fullName>`` -> ``<value>``).

    Problems: XML that does not parse or declares a DTD, another root element,
    a ``<labels>`` entry without ``<fullName>``.
    """
    root = _read_root(path, "CustomLabels")
    if isinstance(root, Problem):
        return root
    out = []
    for i, entry in enumerate(root.findall(_q("labels"))):
        name_el = entry.find(_q("fullName"))
        name = (name_el.text or "").strip() if name_el is not None else ""
        if not name:
            return Problem(str(path), f"<labels>[{i}]", "<fullName> is missing")
        value_el = entry.find(_q("value"))
        out.append(
            CustomLabel(name=name, value=(value_el.text or "") if value_el is not None else "")
        )
    return out
