"""Salesforce DX field files (``fields/<Field>.field-meta.xml``) and the XML helpers
the DX loader shares (split out of :mod:`nexuscrm.packs.sfdx`).

XML is parsed with ``defusedxml`` and any DTD is refused. A field file becomes a
:class:`FieldSpec`, or a :class:`FieldCustomization` for a standard field of a
standard object; every error is a ``ManifestError`` naming the file and element.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.etree.ElementTree import Element, ParseError

import defusedxml.ElementTree as safe_et
from defusedxml import DefusedXmlException
from pydantic import ValidationError

from nexuscrm.errors import ManifestError, PackProblems, Problem, problem_from
from nexuscrm.inputs import InputLimitError, read_capped
from nexuscrm.packs.model import (
    SUMMARY_FILTER_OPERATIONS,
    FieldCustomization,
    FieldSpec,
    FieldType,
    SummarySpec,
    validate_identifier,
)

METADATA_NS = "http://soap.sforce.com/2006/04/metadata"
FIELD_SUFFIX = ".field-meta.xml"

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
    "restricted": "valueSet",
    "formula": "formula",
    "formula_treat_blanks_as": "formulaTreatBlanksAs",
    "summary": "summaryOperation",
}


def _q(tag: str) -> str:
    return f"{{{METADATA_NS}}}{tag}"


MAX_METADATA_FILE_BYTES = 2 * 1024 * 1024
"""Largest Salesforce DX metadata file read (2 MiB; at most that much is read).

Salesforce's own limits keep real files far below it (a description is at most
1,000 characters, a formula 3,900); it keeps one value from reaching the
database larger than a MySQL/MariaDB packet (``max_allowed_packet``, 16 MiB
on MariaDB) can carry."""


def read_metadata_file(path: Path) -> bytes:
    """The bytes of one metadata file, at most :data:`MAX_METADATA_FILE_BYTES`.

    Raises ``ManifestError`` naming the file: unreadable, or larger than the
    limit (``/dev/zero`` included).
    """
    try:
        return read_capped(path, MAX_METADATA_FILE_BYTES)
    except OSError as exc:
        raise ManifestError(str(path), f"cannot read: {exc.strerror or exc}") from None
    except InputLimitError as exc:
        raise ManifestError(str(path), f"metadata file {exc}") from None


def _parse_xml(path: Path, root_tag: str) -> Element:
    data = read_metadata_file(path)
    try:
        root: Element = safe_et.fromstring(data, forbid_dtd=True)
    except DefusedXmlException as exc:
        raise ManifestError(
            str(path), f"refused: DTD / entity declarations are not allowed in metadata ({exc})"
        ) from exc
    except ParseError as exc:
        raise ManifestError(str(path), f"XML does not parse: {exc}") from exc
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


def _restricted(root: Element, path: Path) -> bool:
    """``<valueSet><restricted>true</restricted>``: the picklist takes only its values."""
    value_set = root.find(_q("valueSet"))
    return value_set is not None and bool(_bool(value_set, "restricted", path))


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
    filters = []
    for i, item in enumerate(root.findall(_q("summaryFilterItems")), start=1):
        operation = _text(item, "operation") or ""
        if operation not in SUMMARY_FILTER_OPERATIONS:
            raise ManifestError(
                str(path),
                f"<summaryFilterItems> #{i}: <operation> {operation!r} is not one of "
                + ", ".join(SUMMARY_FILTER_OPERATIONS),
            )
        filters.append(
            {
                "field": _required_text(item, "field", path),
                "operation": operation,
                "value": _text(item, "value") or "",
            }
        )
    return SummarySpec.model_validate(
        {
            "operation": op.lower(),
            "summarized_field": _text(root, "summarizedField") or None,
            "foreign_key_field": _text(root, "summaryForeignKey") or None,
            "filters": filters,
        }
    )


# Salesforce field types stored as another type (see the README table).
_TYPE_ALIASES = {"EncryptedText": FieldType.Text}
# MetadataRelationship targets: stored as the referenced API name, as text.
_METADATA_RELATIONSHIP = "MetadataRelationship"


def is_standard_field(api_name: str) -> bool:
    """True for a Salesforce standard field name (no ``__`` suffix: ``AccountId``)."""
    return "__" not in api_name


# Elements a field file holds at most once (``referenceTo`` may repeat on a
# polymorphic standard field, ``summaryFilterItems`` on a roll-up).
_SINGLE_ELEMENTS = frozenset(
    {*_FIELD_ELEMENTS.values(), "inlineHelpText", "trackHistory", "picklist",
     "summarizedField", "summaryForeignKey"} - {"referenceTo"}
)  # fmt: skip


def _repeated_elements(root: Element, path: Path) -> list[Problem]:
    """A problem for each single-valued element the file repeats (which one
    counts would be a guess)."""
    counts: dict[str, int] = {}
    for child in root:
        tag = child.tag.removeprefix(f"{{{METADATA_NS}}}")
        counts[tag] = counts.get(tag, 0) + 1
    return [
        Problem(str(path), f"<{tag}>", f"appears {n} times; a field has one")
        for tag, n in counts.items()
        if n > 1 and tag in _SINGLE_ELEMENTS
    ]


def _field_spec(path: Path, standard_object: bool = False) -> FieldSpec | FieldCustomization:
    """Parse one field file.

    A standard field (no ``__c``) of a standard object is a
    :class:`FieldCustomization` (its ``<type>`` may be absent and a lookup's
    target implied); every other field is a :class:`FieldSpec`.
    ``MetadataRelationship`` becomes Text (255) holding the referenced API name,
    ``EncryptedText`` Text (stored as plain text).

    Raises ``ManifestError`` naming the file and element when the file cannot
    be read or parsed, else ``PackProblems`` with every problem of the file at
    once (one per element: a repeated element, a bad type, number or boolean,
    an attribute its type cannot have, a value too long for its column ...).
    """
    root = _parse_xml(path, "CustomField")
    problems = _repeated_elements(root, path)

    def attempt(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ManifestError as exc:
            problems.append(problem_from(exc))
            return None

    full_name = attempt(_required_text, root, "fullName", path)
    expected = path.name[: -len(FIELD_SUFFIX)]
    if full_name is not None and full_name != expected:
        problems.append(
            Problem(
                str(path),
                "<fullName>",
                f"{full_name!r} does not match the file name {expected!r}",
            )
        )
        full_name = None
    if full_name is not None:
        try:
            validate_identifier(full_name, "field api_name")
        except ValueError as exc:
            problems.append(Problem(str(path), "<fullName>", str(exc)))
            full_name = None
    name = full_name or expected
    customization = standard_object and is_standard_field(name)
    type_name = _text(root, "type") or ""
    if not type_name and not customization:
        problems.append(Problem(str(path), "<type>", "is missing or empty"))
    reference_to = _text(root, "referenceTo") or None
    relationship_name = _text(root, "relationshipName") or None
    description = _text(root, "description") or ""
    length = attempt(_int, root, "length", path)
    if type_name == _METADATA_RELATIONSHIP:
        note = f"MetadataRelationship to {reference_to or '?'}, stored as the API name"
        description = f"{description} ({note})" if description else note
        type_name, length, reference_to, relationship_name = "Text", 255, None, None
    elif type_name in _TYPE_ALIASES:
        type_name = _TYPE_ALIASES[type_name].value
        length = length or 175
    if type_name and type_name not in FieldType.__members__:
        problems.append(
            Problem(
                str(path),
                "<type>",
                f"{type_name!r} is not a supported field type "
                f"(supported: {', '.join(t.value for t in FieldType)}, EncryptedText, "
                "MetadataRelationship)",
            )
        )
        type_name = ""
    blanks = _text(root, "formulaTreatBlanksAs")
    if blanks and blanks not in ("BlankAsZero", "BlankAsBlank"):
        problems.append(
            Problem(
                str(path),
                "<formulaTreatBlanksAs>",
                f"{blanks!r} is not BlankAsZero or BlankAsBlank",
            )
        )
        blanks = None
    picklist_values, picklist_defaults = attempt(_picklist_values, root, path) or ((), ())
    default_value = _text(root, "defaultValue") or None
    if default_value is None and picklist_defaults:
        default_value = formula_text_literal(";".join(picklist_defaults))
    data: dict[str, Any] = {
        "api_name": name,
        "label": _text(root, "label") or "",
        "type": type_name,
        "description": description,
        "length": length,
        "precision": attempt(_int, root, "precision", path),
        "scale": attempt(_int, root, "scale", path),
        "required": attempt(_bool, root, "required", path) or False,
        "unique": attempt(_bool, root, "unique", path) or False,
        "external_id": attempt(_bool, root, "externalId", path) or False,
        "default_value": default_value,
        "reference_to": reference_to,
        "relationship_name": relationship_name,
        "picklist_values": picklist_values,
        # <valueSet><restricted>: only its values are stored (a global value set's
        # values live in another file: nothing to check against, left open)
        "restricted": bool(picklist_values) and bool(attempt(_restricted, root, path)),
        "formula": _text(root, "formula"),
        "summary": attempt(_summary, root, path),
    }
    if blanks:
        data["formula_treat_blanks_as"] = blanks
    result: FieldSpec | FieldCustomization | None = None
    try:
        if customization:
            result = _customization(path, root, data)
        elif type_name:
            result = FieldSpec.model_validate(data)
    except ValidationError as exc:
        # The model checks the name again: a refused <fullName> is named once.
        problems.extend(p for p in _field_problems(path, exc) if p not in problems)
    if problems or result is None:
        raise PackProblems(str(path), problems)
    return result


def _customization(path: Path, root: Element, data: dict[str, Any]) -> FieldCustomization:
    spec: FieldSpec | None = None
    complete = bool(data["type"]) and (
        data["type"] not in ("Lookup", "MasterDetail") or data["reference_to"]
    )
    if complete:
        spec = FieldSpec.model_validate(data)
    return FieldCustomization.model_validate(
        {
            "api_name": data["api_name"],
            "label": data["label"],
            "description": data["description"],
            "help_text": _text(root, "inlineHelpText") or "",
            "track_history": _bool(root, "trackHistory", path),
            "picklist_values": data["picklist_values"],
            "spec": spec,
        }
    )


def _field_problems(path: Path, exc: ValidationError) -> list[Problem]:
    """One problem per validation error, naming the XML element it comes from."""
    out: list[Problem] = []
    for e in exc.errors(include_url=False):
        loc = e.get("loc", ())
        head = loc[0] if loc else None
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        element = "" if head is None else f"<{_FIELD_ELEMENTS.get(str(head), head)}>"
        out.append(Problem(str(path), element, msg))
    return out
