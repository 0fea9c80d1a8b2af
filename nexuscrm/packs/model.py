"""The pack manifest model (pydantic v2).

A pack is a named, versioned bundle of object and field metadata. Its shape is
the same whichever loader produced it (native YAML/JSON or Salesforce DX
source), so ordering, hashing and apply never care where it came from.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Identifiers reach DDL, so they are validated here, before anything else sees them.
# Salesforce API names: a letter, then letters/digits/underscores, no double
# underscore except the namespace/suffix separators (__c, __e, __r, __s, ns__X__c).
IDENTIFIER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")
PACK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def validate_identifier(value: str, what: str) -> str:
    """Return ``value`` if it is a safe SQL identifier; else ``ValueError`` naming ``what``."""
    if not IDENTIFIER_RE.fullmatch(value) or "___" in value or value.endswith("_"):
        raise ValueError(f"{what} {value!r} is not a valid API name")
    return value


# Column sizes of the metadata tables (``nexuscrm/db/tables.py``) a manifest's
# strings are written to: every one is checked at load, naming the file and
# field, so apply never fails with a bare "Data too long for column".
LABEL_MAX_CHARS = 255
"""``Label`` / ``PluralLabel`` of ``_System_Object`` and ``_System_Field`` (VARCHAR(255))."""
NAME_MAX_CHARS = 128
"""``RelationshipName`` and other name columns (VARCHAR(128))."""
VERSION_MAX_CHARS = 64
"""``_System_Pack.Version`` (VARCHAR(64))."""
TEXT_COLUMN_MAX_BYTES = 65_535
"""A TEXT column on MySQL/MariaDB (``Description``, ``DefaultValue``, ``Formula``,
``PicklistValues`` as JSON, ``SummarySpec`` as JSON): bytes of UTF-8."""
MDT_NAME_MAX_CHARS = 40
"""A custom metadata record's ``DeveloperName`` (Salesforce's limit; its column's length)."""
MAX_NUMBER_PRECISION = 18
"""Salesforce's largest precision (total digits) of a Number, Currency or Percent."""
MAX_TEXT_LENGTH = 255
"""Salesforce's longest Text (and TextArea) field."""
LONG_TEXT_LENGTH = (256, 131_072)
"""Salesforce's length bounds of a LongTextArea / Html (rich text area) field."""


def check_chars(value: str, limit: int) -> str:
    """``value`` if it has at most ``limit`` characters; else ``ValueError``
    saying how long it is and what the column holds."""
    if len(value) > limit:
        raise ValueError(f"is {len(value):,} characters long; at most {limit:,} fit its column")
    return value


def check_text_bytes(value: str | None, what: str = "") -> str | None:
    """``value`` if its UTF-8 form fits a TEXT column (:data:`TEXT_COLUMN_MAX_BYTES`);
    else ``ValueError`` giving its size (``what`` names a derived form, e.g. as JSON)."""
    if value is not None:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > TEXT_COLUMN_MAX_BYTES:
            raise ValueError(
                f"is {size:,} bytes{what} of UTF-8; "
                f"at most {TEXT_COLUMN_MAX_BYTES:,} fit its column"
            )
    return value


def _none_is_absent(value: object) -> object:
    """YAML ``key:`` with nothing after it (null) means the key is not set."""
    return () if value is None else value


def _label_fits(value: str) -> str:
    return check_chars(value, LABEL_MAX_CHARS)


def _text_fits(value: str) -> str:
    return check_text_bytes(value) or ""


NULL_IS_NOT_SET = BeforeValidator(_none_is_absent)
"""On a list field: a YAML null (``fields:`` with nothing after it) is the empty list."""
Label = Annotated[str, AfterValidator(_label_fits)]
"""A label written to a ``Label``-sized column (:data:`LABEL_MAX_CHARS`)."""
TextColumn = Annotated[str, AfterValidator(_text_fits)]
"""A string written to a TEXT column (:data:`TEXT_COLUMN_MAX_BYTES` of UTF-8)."""


class Category(StrEnum):
    """Pack categories, in apply order (the seed's ``packs.Category``)."""

    PlatformCore = "PlatformCore"
    PlatformTenant = "PlatformTenant"
    PlatformConfig = "PlatformConfig"
    PlatformUX = "PlatformUX"
    AppPack = "AppPack"
    ConnectorPack = "ConnectorPack"
    DevSample = "DevSample"

    @property
    def rank(self) -> int:
        """Position in apply order: PlatformCore first, DevSample last."""
        return list(Category).index(self)


class FieldType(StrEnum):
    """Supported field types (Salesforce metadata ``<type>`` names).

    A formula field carries its *return* type here and a non-empty ``formula``.
    """

    Text = "Text"
    TextArea = "TextArea"
    LongTextArea = "LongTextArea"
    Html = "Html"
    Number = "Number"
    Currency = "Currency"
    Percent = "Percent"
    Checkbox = "Checkbox"
    Date = "Date"
    DateTime = "DateTime"
    Time = "Time"
    Email = "Email"
    Phone = "Phone"
    Url = "Url"
    Picklist = "Picklist"
    MultiselectPicklist = "MultiselectPicklist"
    Lookup = "Lookup"
    MasterDetail = "MasterDetail"
    Location = "Location"
    AutoNumber = "AutoNumber"
    Summary = "Summary"


_NUMBER_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _is_expression(value: str) -> bool:
    """True when a default value is a formula expression, not a bare literal
    (it calls a function, reads a ``$`` global, or computes)."""
    return any(c in value for c in "($+*/&<>=") or "-" in value.strip()[1:]


def check_picklist(values: tuple[str, ...]) -> None:
    """``ValueError`` for a blank value, a value over :data:`LABEL_MAX_CHARS`,
    a value listed twice (case-insensitively, as Salesforce compares them), or
    a list whose JSON does not fit its TEXT column."""
    seen: set[str] = set()
    twice: list[str] = []
    for value in values:
        if not value.strip():
            raise ValueError("a picklist value is blank")
        if len(value) > LABEL_MAX_CHARS:
            raise ValueError(f"value {value[:40]!r}... is over {LABEL_MAX_CHARS} characters")
        if value.lower() in seen and value not in twice:
            twice.append(value)
        seen.add(value.lower())
    if twice:
        raise ValueError(f"{', '.join(repr(x) for x in twice)} listed twice")
    check_text_bytes(json.dumps(list(values)), " as JSON")


TEXT_TYPES = frozenset(
    {
        FieldType.Text,
        FieldType.TextArea,
        FieldType.LongTextArea,
        FieldType.Html,
        FieldType.Email,
        FieldType.Phone,
        FieldType.Url,
        FieldType.Picklist,
        FieldType.MultiselectPicklist,
        FieldType.AutoNumber,
    }
)
NUMERIC_TYPES = frozenset({FieldType.Number, FieldType.Currency, FieldType.Percent})
REFERENCE_TYPES = frozenset({FieldType.Lookup, FieldType.MasterDetail})


SummaryFilterOperation = Literal[
    "equals",
    "notEqual",
    "lessThan",
    "greaterThan",
    "lessOrEqual",
    "greaterOrEqual",
    "contains",
    "notContain",
    "startsWith",
    "includes",
    "excludes",
]
SUMMARY_FILTER_OPERATIONS: tuple[str, ...] = get_args(SummaryFilterOperation)


class SummaryFilter(BaseModel):
    """One filter criterion of a roll-up (Salesforce's ``summaryFilterItems``).

    ``field`` is ``Child__c.Field__c`` (or the bare child field name);
    ``value`` is as the metadata writes it: a comma-separated list for
    equals / notEqual / includes / excludes, where a value containing a comma
    is double-quoted (``"Closed, not Completed"``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str
    operation: SummaryFilterOperation
    value: str = ""


class SummarySpec(BaseModel):
    """Roll-up summary definition: computed in the parent's formula view.

    ``foreign_key_field`` (``Child__c.Parent__c``) names the master-detail
    field of the child object; ``summarized_field`` (``Child__c.Amount__c``)
    what SUM / MIN / MAX aggregate (none for COUNT); ``filters`` the
    criteria a child row must meet, all of them (Salesforce ANDs roll-up
    criteria; there is no filter logic for roll-ups).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    operation: Literal["count", "sum", "min", "max"]
    summarized_field: str | None = None
    foreign_key_field: str | None = None
    filters: tuple[SummaryFilter, ...] = ()


class FieldSpec(BaseModel):
    """One field of an object.

    ``api_name`` is also the physical column name, except for Location fields,
    which store ``<Name>__Latitude__s`` / ``<Name>__Longitude__s`` (Salesforce's
    compound-field columns), and formula / Summary fields, which store nothing.
    Lengths are characters; precision and scale are digits.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_name: str
    label: Label = ""
    type: FieldType
    description: TextColumn = ""
    length: int | None = Field(default=None, ge=1, le=131072)
    precision: int | None = Field(default=None, ge=1, le=MAX_NUMBER_PRECISION)
    scale: int | None = Field(default=None, ge=0, le=18)
    required: bool = False
    unique: bool = False
    external_id: bool = False
    default_value: str | None = None
    reference_to: str | None = None
    relationship_name: str | None = None
    picklist_values: Annotated[tuple[str, ...], NULL_IS_NOT_SET] = ()
    restricted: bool = False
    formula: str | None = None
    formula_treat_blanks_as: Literal["BlankAsZero", "BlankAsBlank"] = "BlankAsZero"
    summary: SummarySpec | None = None

    @field_validator("api_name")
    @classmethod
    def _api_name(cls, v: str) -> str:
        return validate_identifier(v, "field api_name")

    @field_validator("formula")
    @classmethod
    def _text_column(cls, v: str | None) -> str | None:
        return check_text_bytes(v)

    @field_validator("length")
    @classmethod
    def _length(cls, v: int | None, info: ValidationInfo) -> int | None:
        t = info.data.get("type")
        if v is None or t is None:
            return v
        if t not in TEXT_TYPES:
            raise ValueError(f"a {t} field has no length")
        if t in (FieldType.Text, FieldType.TextArea) and v > MAX_TEXT_LENGTH:
            raise ValueError(f"{v} is over {MAX_TEXT_LENGTH}, the longest {t} field")
        low, high = LONG_TEXT_LENGTH
        if t in (FieldType.LongTextArea, FieldType.Html) and not low <= v <= high:
            raise ValueError(f"{v} is not between {low:,} and {high:,}, the bounds of {t}")
        return v

    @field_validator("precision")
    @classmethod
    def _precision(cls, v: int | None, info: ValidationInfo) -> int | None:
        t = info.data.get("type")
        if v is None or t is None:
            return v
        if t not in NUMERIC_TYPES:
            raise ValueError(f"a {t} field has no precision")
        return v

    @field_validator("scale")
    @classmethod
    def _scale(cls, v: int | None, info: ValidationInfo) -> int | None:
        t = info.data.get("type")
        if v is None or t is None:
            return v
        if t not in NUMERIC_TYPES | {FieldType.Location}:
            raise ValueError(f"a {t} field has no scale")
        precision = info.data.get("precision")
        if precision is not None and v > precision:
            raise ValueError(f"{v} is more than the precision {precision} (digits in all)")
        return v

    @field_validator("default_value")
    @classmethod
    def _default(cls, v: str | None, info: ValidationInfo) -> str | None:
        check_text_bytes(v)
        t = info.data.get("type")
        if v is None or t is None or _is_expression(v):
            return v
        if t == FieldType.Checkbox and v.strip().lower() not in ("true", "false"):
            raise ValueError(f"{v!r} is not true or false (a Checkbox default)")
        if t in NUMERIC_TYPES and not _NUMBER_RE.fullmatch(v.strip()):
            raise ValueError(f"{v!r} is not a number (a {t} default)")
        return v

    @field_validator("reference_to")
    @classmethod
    def _reference_to(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        t = info.data.get("type")
        if t is not None and t not in REFERENCE_TYPES:
            raise ValueError(f"a {t} field references nothing (only Lookup and MasterDetail do)")
        return validate_identifier(v, "reference_to")

    @field_validator("relationship_name")
    @classmethod
    def _relationship_name(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        t = info.data.get("type")
        if t is not None and t not in REFERENCE_TYPES:
            raise ValueError(f"a {t} field has no relationship (only Lookup and MasterDetail do)")
        return check_chars(v, NAME_MAX_CHARS)

    @field_validator("picklist_values")
    @classmethod
    def _picklist(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if not v:
            return v
        t = info.data.get("type")
        if t is not None and t not in (FieldType.Picklist, FieldType.MultiselectPicklist):
            raise ValueError(f"a {t} field has no picklist values")
        check_picklist(v)
        return v

    @field_validator("restricted")
    @classmethod
    def _restricted(cls, v: bool, info: ValidationInfo) -> bool:
        t = info.data.get("type")
        if not v or t is None:
            return v
        if t not in (FieldType.Picklist, FieldType.MultiselectPicklist):
            raise ValueError(f"a {t} field cannot be restricted (only a picklist is)")
        if "picklist_values" not in info.data:
            return v  # its values failed validation: that problem is reported, not this one
        if not info.data["picklist_values"]:
            raise ValueError("a restricted picklist needs its picklist_values")
        return v

    @field_validator("summary")
    @classmethod
    def _summary(cls, v: SummarySpec | None, info: ValidationInfo) -> SummarySpec | None:
        t = info.data.get("type")
        if v is not None and t is not None and t != FieldType.Summary:
            raise ValueError(f"a {t} field has no roll-up summary (only a Summary field does)")
        if v is not None:
            check_text_bytes(v.model_dump_json(), " as JSON")
        return v

    @model_validator(mode="after")
    def _shape(self) -> FieldSpec:
        problems = field_shape_problems(
            self.api_name, self.type, self.reference_to, self.summary is not None, self.formula
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def is_formula(self) -> bool:
        """True when the value is computed by the formula view, not stored."""
        return self.formula is not None

    @property
    def is_stored(self) -> bool:
        """True when the field has physical column(s)."""
        return self.formula is None and self.type != FieldType.Summary

    def column_names(self) -> tuple[str, ...]:
        """Physical column names, in order (empty for formula and Summary fields)."""
        if not self.is_stored:
            return ()
        if self.type == FieldType.Location:
            base = self.api_name.removesuffix("__c")
            return (f"{base}__Latitude__s", f"{base}__Longitude__s")
        return (self.api_name,)


class FieldCustomization(BaseModel):
    """A customization of a field another pack defines (a Salesforce standard field
    declared in source: ``Contact/fields/Email.field-meta.xml`` without ``<type>``).

    Merged into that field's ``_System_Field`` row at apply (label, description,
    picklist values added after the existing ones); ``help_text`` and
    ``track_history`` are kept in the pack payload only. ``type`` /
    ``reference_to`` are what the file says, if anything: when no pack defines
    the field and the type is complete, the field becomes the pack's own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_name: str
    label: Label = ""
    description: TextColumn = ""
    help_text: str = ""
    track_history: bool = False
    picklist_values: Annotated[tuple[str, ...], NULL_IS_NOT_SET] = ()
    spec: FieldSpec | None = None

    @field_validator("api_name")
    @classmethod
    def _api_name(cls, v: str) -> str:
        return validate_identifier(v, "field api_name")

    @field_validator("picklist_values")
    @classmethod
    def _picklist(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        check_picklist(v)
        return v


class RecordSpec(BaseModel):
    """One custom metadata record (``customMetadata/<Type>.<Name>.md-meta.xml``).

    Becomes one row of its ``__mdt`` table: ``Id`` derived from the object and
    ``developer_name``, ``Name`` = ``label``, ``DeveloperName`` / ``MasterLabel``
    columns, and ``values`` (field API name -> the text written in the file,
    ``None`` for ``xsi:nil``) converted to each column's type at apply.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    developer_name: str
    label: Label = ""
    values: dict[str, str | None] = Field(default_factory=dict)

    @field_validator("developer_name")
    @classmethod
    def _developer_name(cls, v: str) -> str:
        return check_chars(v, MDT_NAME_MAX_CHARS)


class ObjectSpec(BaseModel):
    """One object (a table), or a platform event (``kind='event'``: metadata only).

    ``extends`` is True when this spec adds fields to a standard object another
    pack owns (e.g. an app's custom fields on Contact); apply merges the fields
    into that object instead of creating a new one.

    ``package_namespace`` names the Salesforce package of a namespaced object
    (``hed`` for ``hed__Term__c``) that the project extends or references but
    does not define: an earlier pack that defines it is extended; when none
    does, the pack itself provides it (a table it owns, with the fields it
    declares). ``customizations`` merge into fields other packs define;
    ``records`` are the rows of a custom metadata type (``__mdt``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_name: str
    label: Label = ""
    plural_label: Label = ""
    kind: Literal["table", "event"] = "table"
    extends: bool = False
    name_field_type: Literal["Text", "AutoNumber"] = "Text"
    name_field_label: Label = "Name"
    description: TextColumn = ""
    fields: Annotated[tuple[FieldSpec, ...], NULL_IS_NOT_SET] = ()
    customizations: Annotated[tuple[FieldCustomization, ...], NULL_IS_NOT_SET] = ()
    records: Annotated[tuple[RecordSpec, ...], NULL_IS_NOT_SET] = ()
    package_namespace: str | None = None

    @field_validator("api_name")
    @classmethod
    def _api_name(cls, v: str) -> str:
        return validate_identifier(v, "object api_name")

    @model_validator(mode="after")
    def _unique_fields(self) -> ObjectSpec:
        problems = field_name_problems(self.api_name, [f.api_name for f in self.fields])
        if problems:
            raise ValueError("; ".join(msg for _, msg in problems))
        return self


class InboundRoute(BaseModel):
    """A ConnectorPack's inbound route: how one event kind becomes CRM work.

    Resolved by (installed pack id, event kind, route version), as the seed's
    route resolver does. ``invocation_mode`` ``flow`` runs ``flow`` locally;
    ``runtime_command_handoff`` hands the business operation to a separate
    runtime service. ``flow`` names a registered flow: ``upsert_record``
    (map the event's fields onto ``destination_object`` — or the event's
    ``sobject`` when unset — and upsert by remote id) or ``webhook`` (POST the
    event to ``webhook_url``). ``field_map`` renames remote fields to local
    ones; unmapped fields keep their names.

    ``companion_pack`` (optional) makes the route cross-pack: it names the
    AppPack whose objects the route writes. Enqueue freezes that pack's
    current incarnation (``PackInstallId``) on the event, and the processor
    checks it is still installed and active before the event runs (seed
    ``companionInstallStillInstalledChecker``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_kind: str
    route_version: int = Field(default=1, ge=1)
    invocation_mode: Literal["flow", "runtime_command_handoff"] = "flow"
    queue_class: Literal["interactive", "default", "bulk"] = "default"
    flow: Literal["upsert_record", "webhook"] = "upsert_record"
    destination_object: str | None = None
    field_map: dict[str, str] = Field(default_factory=dict)
    webhook_url: str | None = None
    companion_pack: str | None = None

    @field_validator("event_kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        v = v.strip().lower()
        if not v:
            raise ValueError("inbound route event_kind is blank")
        return v

    @model_validator(mode="after")
    def _shape(self) -> InboundRoute:
        if self.flow == "webhook" and not self.webhook_url:
            raise ValueError(f"route {self.event_kind}: the webhook flow needs webhook_url")
        if self.destination_object is not None:
            validate_identifier(self.destination_object, "destination_object")
        if self.companion_pack is not None and not PACK_NAME_RE.fullmatch(self.companion_pack):
            raise ValueError(
                f"route {self.event_kind}: companion_pack {self.companion_pack!r} "
                "is not a pack name"
            )
        return self


class CalloutProfile(BaseModel):
    """A batch-read callout profile: enrich events from a remote API.

    ``object_path_map`` maps an object kind to the endpoint path that reads a
    batch of its records (``{"Broker__c": "/records/Broker__c"}``); the
    credential is named by reference only (its value lives elsewhere).
    ``required_object_kinds``: kinds the pack cannot run without enrichment
    for (a pool without batch coverage for one of them does not start);
    ``projection_fields``: the fields each batch read asks for.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    endpoint: str
    credential_ref: str | None = None
    object_path_map: dict[str, str] = Field(default_factory=dict)
    required_object_kinds: tuple[str, ...] = ()
    # Fields each batch read asks for (the seed's batch projection body field);
    # their metadata is part of the pool fingerprint (projection fingerprint).
    projection_fields: tuple[str, ...] = ()


# Every table object gets these columns, ahead of its own fields.
STANDARD_COLUMNS = ("Id", "Name", "OwnerId", "CreatedDate", "LastModifiedDate", "IsDeleted")


class CustomLabel(BaseModel):
    """A custom label of a Salesforce DX project (``labels/*.labels-meta.xml``):
    what ``$Label.<name>`` reads in a formula."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    value: str = ""


class PackManifest(BaseModel):
    """A pack: name, category, version, dependencies, objects.

    ``source`` records where it was loaded from (a path or ``builtin:<name>``);
    it is informational and is left out of the payload hash. ``namespace`` is
    the Salesforce namespace prefix of the package this pack provides (its
    namespaced objects ``ns__X__c`` may be extended by packs depending on it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    category: Category
    version: str = "1.0.0"
    description: str = ""
    depends_on: Annotated[tuple[str, ...], NULL_IS_NOT_SET] = ()
    namespace: str | None = None
    objects: Annotated[tuple[ObjectSpec, ...], NULL_IS_NOT_SET] = ()
    inbound_routes: Annotated[tuple[InboundRoute, ...], NULL_IS_NOT_SET] = ()
    callout_profiles: Annotated[tuple[CalloutProfile, ...], NULL_IS_NOT_SET] = ()
    labels: Annotated[tuple[CustomLabel, ...], NULL_IS_NOT_SET] = ()
    source: str = Field(default="", exclude=True)

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return check_chars(v, VERSION_MAX_CHARS)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not PACK_NAME_RE.fullmatch(v):
            raise ValueError(f"pack name {v!r} must be lower-case letters, digits, '.', '_' or '-'")
        return v

    @model_validator(mode="after")
    def _unique_objects(self) -> PackManifest:
        problems = [msg for _, msg in object_name_problems([o.api_name for o in self.objects])]
        if (
            self.inbound_routes or self.callout_profiles
        ) and self.category != Category.ConnectorPack:
            problems.append("inbound_routes and callout_profiles need category ConnectorPack")
        routes: set[tuple[str, int]] = set()
        for r in self.inbound_routes:
            if (r.event_kind, r.route_version) in routes:
                problems.append(f"route {r.event_kind} v{r.route_version} is declared twice")
            routes.add((r.event_kind, r.route_version))
            if r.companion_pack is not None and r.companion_pack not in self.depends_on:
                # Apply order: the companion's objects exist before the route writes them.
                problems.append(
                    f"route {r.event_kind} v{r.route_version} names "
                    f"companion_pack {r.companion_pack}, which is not in depends_on"
                )
        if problems:
            raise ValueError("; ".join(f"pack {self.name}: {p}" for p in problems))
        return self


def field_shape_problems(
    name: str, type_: str, reference_to: str | None, has_summary: bool, formula: str | None
) -> list[str]:
    """Every problem of one field's shape (all at once): a Lookup or MasterDetail
    without ``reference_to``, a Summary without its definition, an empty formula,
    a formula on a type that cannot be one. Used by :class:`FieldSpec` and, for a
    field that failed other checks, by the loader on the raw document."""
    problems = []
    if type_ in REFERENCE_TYPES and not reference_to:
        problems.append(f"field {name}: {type_} needs reference_to")
    if type_ == FieldType.Summary and not has_summary:
        problems.append(f"field {name}: Summary needs a summary definition")
    if formula is not None and not formula.strip():
        problems.append(f"field {name}: formula is empty")
    if formula is not None and type_ in (
        REFERENCE_TYPES | {FieldType.Summary, FieldType.Location, FieldType.AutoNumber}
    ):
        problems.append(f"field {name}: a {type_} field cannot be a formula")
    return problems


def field_name_problems(obj: str, names: list[str]) -> list[tuple[int, str]]:
    """``(index, problem)`` for each field of object ``obj`` (``names`` in order)
    declared twice or named like a system column (case-insensitive), all at once."""
    system = {c.lower() for c in STANDARD_COLUMNS}
    seen: set[str] = set()
    out: list[tuple[int, str]] = []
    for i, name in enumerate(names):
        key = name.lower()
        if key in seen:
            out.append((i, f"object {obj}: field {name} is declared twice"))
        elif key in system:
            out.append((i, f"object {obj}: field {name} collides with a system column"))
        seen.add(key)
    return out


def object_name_problems(names: list[str]) -> list[tuple[int, str]]:
    """``(index, problem)`` for each object of a pack declared twice (case-insensitive)."""
    seen: set[str] = set()
    out: list[tuple[int, str]] = []
    for i, name in enumerate(names):
        if name.lower() in seen:
            out.append((i, f"object {name} is declared twice"))
        seen.add(name.lower())
    return out
