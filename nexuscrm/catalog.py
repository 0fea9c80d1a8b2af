"""Object/field metadata rows <-> manifest specs, physical tables, and the
metadata cache validated by a version stamp.

``_System_Object`` / ``_System_Field`` are the authority; a pack's specs are
written into them and read back from them, so an admin's customization
(``IsCustomized``) survives pack reapply.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Date,
    DateTime,
    Engine,
    Integer,
    MetaData,
    Numeric,
    String,
    Table,
    Text,
    Time,
    inspect,
    select,
)
from sqlalchemy.types import TypeEngine

from nexuscrm.clock import utcnow
from nexuscrm.db import rowsize
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import column_type, upsert
from nexuscrm.db.session import session_user_available
from nexuscrm.formulas.relations import FormulaContext, ObjectRef
from nexuscrm.packs.model import (
    STANDARD_COLUMNS,
    CustomLabel,
    FieldSpec,
    FieldType,
    ObjectSpec,
    SummarySpec,
)


def object_id(api_name: str) -> str:
    """Canonical ``_System_Object.Id`` for an API name (the seed's GenerateObjectID)."""
    return "obj_" + hashlib.sha256(api_name.lower().encode()).hexdigest()[:24]


def field_id(object_api_name: str, field_api_name: str) -> str:
    """Canonical ``_System_Field.Id`` for (object, field)."""
    key = f"{object_api_name.lower()}.{field_api_name.lower()}"
    return "fld_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def table_type_for(spec: ObjectSpec) -> str:
    """``event`` for platform events, ``custom`` for ``__c`` / ``__mdt``, else ``standard``."""
    if spec.kind == "event":
        return "event"
    return "custom" if spec.api_name.endswith(("__c", "__mdt")) else "standard"


def standard_columns() -> list[Column[Any]]:
    """The columns every table object has, ahead of its fields."""
    return [
        Column("Id", String(36), primary_key=True),
        Column("Name", String(255), nullable=True),
        Column("OwnerId", String(36), nullable=True),
        Column("CreatedDate", DateTime, nullable=True),
        Column("LastModifiedDate", DateTime, nullable=True),
        Column("IsDeleted", Boolean(create_constraint=False), nullable=False, default=False),
    ]


def object_table(spec: ObjectSpec, dialect: str, metadata: MetaData | None = None) -> Table:
    """A SQLAlchemy ``Table`` for a table object: standard columns plus stored fields.

    On MySQL/MariaDB/TiDB the text-like fields of a wide object beyond half
    the row-size limits are ``TEXT`` (:func:`nexuscrm.db.rowsize.mysql_text_columns`).
    """
    md = metadata if metadata is not None else MetaData()
    cols: list[Column[Any]] = standard_columns()
    text = (
        rowsize.mysql_text_columns(spec, [c.type for c in cols])
        if dialect == "mysql"
        else frozenset()
    )
    for f in spec.fields:
        for name in f.column_names():
            type_ = Text() if name.lower() in text else column_type(f, dialect)
            cols.append(Column(name, type_, nullable=True))
    return Table(spec.api_name, md, *cols)


def field_row(obj_api: str, f: FieldSpec, pack: str) -> dict[str, Any]:
    """The ``_System_Field`` row for one field spec."""
    now = utcnow()
    return {
        "Id": field_id(obj_api, f.api_name),
        "ObjectId": object_id(obj_api),
        "ObjectApiName": obj_api,
        "ApiName": f.api_name,
        "Label": f.label or f.api_name,
        "FieldType": f.type.value,
        "ColumnNames": ",".join(f.column_names()),
        "Length": f.length,
        "Precision": f.precision,
        "Scale": f.scale,
        "Required": f.required,
        "IsUnique": f.unique,
        "IsExternalId": f.external_id,
        "DefaultValue": f.default_value,
        "ReferenceTo": f.reference_to,
        "RelationshipName": f.relationship_name,
        "PicklistValues": json.dumps(list(f.picklist_values)) if f.picklist_values else None,
        "IsRestricted": f.restricted,
        "Formula": f.formula,
        "FormulaTreatBlanksAs": f.formula_treat_blanks_as if f.formula else None,
        "SummarySpec": f.summary.model_dump_json() if f.summary else None,
        "Description": f.description or None,
        "IsCustomized": False,
        "PackName": pack,
        "Createable": f.is_stored and f.type != FieldType.AutoNumber,
        "Updateable": f.is_stored and f.type != FieldType.AutoNumber,
        "CreatedDate": now,
        "LastModifiedDate": now,
    }


FIELD_UPDATE_COLUMNS = [
    "ObjectId", "Label", "FieldType", "ColumnNames", "Length", "Precision", "Scale", "Required",
    "IsUnique", "IsExternalId", "DefaultValue", "ReferenceTo", "RelationshipName",
    "PicklistValues", "IsRestricted", "Formula", "FormulaTreatBlanksAs", "SummarySpec",
    "Description", "PackName", "Createable", "Updateable", "LastModifiedDate",
]  # fmt: skip


def object_row(spec: ObjectSpec, pack: str, table_type: str | None = None) -> dict[str, Any]:
    """The ``_System_Object`` row for one object spec."""
    now = utcnow()
    return {
        "Id": object_id(spec.api_name),
        "ApiName": spec.api_name,
        "Label": spec.label or spec.api_name,
        "PluralLabel": spec.plural_label or pluralize(spec.label or spec.api_name),
        "TableName": spec.api_name,
        "TableType": table_type or table_type_for(spec),
        "NameFieldType": spec.name_field_type,
        "Description": spec.description or None,
        "IsCustomized": False,
        "PackName": pack,
        "CreatedDate": now,
        "LastModifiedDate": now,
    }


OBJECT_UPDATE_COLUMNS = [
    "Label", "PluralLabel", "TableName", "TableType", "NameFieldType", "Description",
    "PackName", "LastModifiedDate",
]  # fmt: skip


def pluralize(label: str) -> str:
    """English plural of a label's last word (``Opportunity`` -> ``Opportunities``).

    The canonical rule MigrateLegacyNaivePlurals converges rows to.
    """
    if not label:
        return label
    lower = label.lower()
    if lower.endswith("y") and len(label) > 1 and lower[-2] not in "aeiou":
        return label[:-1] + "ies"
    if lower.endswith(("s", "x", "z", "ch", "sh")):
        return label + "es"
    return label + "s"


def field_from_row(row: Any) -> FieldSpec:
    """Rebuild a ``FieldSpec`` from a ``_System_Field`` row."""
    picklist = tuple(json.loads(row["PicklistValues"])) if row["PicklistValues"] else ()
    summary = SummarySpec.model_validate_json(row["SummarySpec"]) if row["SummarySpec"] else None
    return FieldSpec(
        api_name=row["ApiName"],
        label=row["Label"],
        type=FieldType(row["FieldType"]),
        description=row["Description"] or "",
        length=row["Length"],
        precision=row["Precision"],
        scale=row["Scale"],
        required=bool(row["Required"]),
        unique=bool(row["IsUnique"]),
        external_id=bool(row["IsExternalId"]),
        default_value=row["DefaultValue"],
        reference_to=row["ReferenceTo"],
        relationship_name=row["RelationshipName"],
        picklist_values=picklist,
        restricted=bool(row.get("IsRestricted")) and bool(picklist),
        formula=row["Formula"],
        formula_treat_blanks_as=row["FormulaTreatBlanksAs"] or "BlankAsZero",
        summary=summary,
    )


def infer_field_type(type_: TypeEngine[Any]) -> FieldType:
    """Best field type for a reflected column (DiscoverAndRegisterPhysicalTables)."""
    if isinstance(type_, Boolean):
        return FieldType.Checkbox
    if isinstance(type_, DateTime):
        return FieldType.DateTime
    if isinstance(type_, Date):
        return FieldType.Date
    if isinstance(type_, Time):
        return FieldType.Time
    if isinstance(type_, Integer | BigInteger | Numeric):
        return FieldType.Number
    if isinstance(type_, Text):
        return FieldType.LongTextArea
    if isinstance(type_, String) and (type_.length or 0) > 255:
        return FieldType.TextArea
    return FieldType.Text


@dataclass(frozen=True)
class CatalogObject:
    """One ``_System_Object`` row with its fields, as the cache holds it."""

    api_name: str
    table_name: str
    table_type: str
    label: str
    plural_label: str
    is_customized: bool
    pack_name: str
    fields: tuple[FieldSpec, ...]

    @property
    def has_table(self) -> bool:
        """True for objects backed by a physical table (not events, not system rows)."""
        return self.table_type in {"standard", "custom", "discovered"}

    def spec(self) -> ObjectSpec:
        """The object as an ``ObjectSpec`` (standard columns excluded)."""
        std = {c.lower() for c in STANDARD_COLUMNS}
        return ObjectSpec(
            api_name=self.api_name,
            label=self.label,
            plural_label=self.plural_label,
            kind="event" if self.table_type == "event" else "table",
            fields=tuple(f for f in self.fields if f.api_name.lower() not in std),
        )


@dataclass
class Catalog:
    """Snapshot of all object metadata at one version."""

    version: int
    objects: dict[str, CatalogObject] = field(default_factory=dict)
    # (object lower, field lower) -> owning pack name ('' for discovered/system)
    field_owners: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, api_name: str) -> CatalogObject | None:
        """Case-insensitive lookup by API name."""
        return self.objects.get(api_name.lower())


def read_version(conn: Connection) -> int:
    """Current metadata version stamp (0 when never bumped)."""
    v = conn.execute(
        select(t.metadata_version.c.Version).where(t.metadata_version.c.Id == 1)
    ).scalar_one_or_none()
    return int(v or 0)


def bump_version(conn: Connection) -> int:
    """Increment the stamp; every metadata writer calls this in its transaction."""
    version = read_version(conn) + 1
    upsert(
        conn,
        t.metadata_version,
        [{"Id": 1, "Version": version, "LastModifiedDate": utcnow()}],
        ["Version", "LastModifiedDate"],
    )
    return version


def load_catalog(conn: Connection) -> Catalog:
    """Read every object and field row into a ``Catalog`` (system objects excluded)."""
    catalog = Catalog(version=read_version(conn))
    system_names = {
        n.lower()
        for n in conn.execute(
            select(t.object_meta.c.ApiName).where(t.object_meta.c.TableType == "system")
        ).scalars()
    }
    fields_by_obj: dict[str, list[FieldSpec]] = {}
    for row in conn.execute(
        select(t.field_meta).order_by(t.field_meta.c.ObjectApiName, t.field_meta.c.ApiName)
    ).mappings():
        obj_key = row["ObjectApiName"].lower()
        catalog.field_owners[(obj_key, row["ApiName"].lower())] = row["PackName"]
        if obj_key in system_names:
            continue
        fields_by_obj.setdefault(obj_key, []).append(field_from_row(row))
    for row in conn.execute(select(t.object_meta).order_by(t.object_meta.c.ApiName)).mappings():
        if row["TableType"] == "system":
            continue
        catalog.objects[row["ApiName"].lower()] = CatalogObject(
            api_name=row["ApiName"],
            table_name=row["TableName"],
            table_type=row["TableType"],
            label=row["Label"],
            plural_label=row["PluralLabel"],
            is_customized=bool(row["IsCustomized"]),
            pack_name=row["PackName"],
            fields=tuple(fields_by_obj.get(row["ApiName"].lower(), ())),
        )
    return catalog


def formula_context(conn: Connection, cat: Catalog) -> FormulaContext:
    """The objects a formula view may reach (parents, roll-up children), from ``cat``.

    Each table object whose table exists in ``conn``'s database, with its
    table reflected on first use (so discovered tables and real column types
    are what the view reads). Used by rebuild-derived and verify, so both
    compile the same view.
    """
    present = {n.lower() for n in inspect(conn).get_table_names()}
    cache: dict[str, ObjectRef | None] = {}

    def objects(api_name: str) -> ObjectRef | None:
        key = api_name.lower()
        if key not in cache:
            entry = cat.get(api_name)
            if entry is None or not entry.has_table or entry.table_name.lower() not in present:
                cache[key] = None
            else:
                table = Table(entry.table_name, MetaData(), autoload_with=conn)
                cache[key] = ObjectRef(entry.spec(), table)
        return cache[key]

    return FormulaContext(objects, installed_labels(conn), session_user_available(conn))


def installed_labels(conn: Connection) -> dict[str, str]:
    """Custom labels (``$Label.<name>`` -> value) of the installed packs' payloads.

    A pack being removed (``draining`` / ``removed``) contributes none; when
    two packs define a label, the one of the later pack name wins.
    """
    ip = t.installed_pack
    out: dict[str, str] = {}
    rows = conn.execute(
        select(ip.c.Name, ip.c.Payload)
        .where(ip.c.Status.not_in(("draining", "removed")))
        .order_by(ip.c.Name)
    )
    for row in rows:
        if not row.Payload:
            continue
        try:
            labels = json.loads(row.Payload).get("labels") or ()
        except ValueError:
            continue
        for label in labels:
            out[str(label["name"])] = str(label.get("value", ""))
    return out


def spec_context(
    specs: Iterable[ObjectSpec], dialect: str, labels: Iterable[CustomLabel] = ()
) -> FormulaContext:
    """A formula context over object specs not yet installed (plan time, dry runs):
    tables as ``object_table`` would create them; ``labels`` for ``$Label``."""
    return FormulaContext.of(
        {s.api_name: ObjectRef(s, object_table(s, dialect)) for s in specs if s.kind != "event"},
        {label.name: label.value for label in labels},
    )


class MetadataCache:
    """Process-wide metadata cache validated by ``_System_MetadataVersion``.

    Port of the seed's ``Runner.RefreshCache``: workers are many processes, so
    each read checks the stamp (one indexed row) and reloads when another
    process bumped it. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._catalogs: dict[str, Catalog] = {}

    def get(self, engine: Engine) -> Catalog:
        """The current catalog for ``engine``'s database, reloaded if stale."""
        key = engine.url.render_as_string(hide_password=False)
        with engine.connect() as conn:
            version = read_version(conn)
            with self._lock:
                cached = self._catalogs.get(key)
                if cached is not None and cached.version == version:
                    return cached
            catalog = load_catalog(conn)
        with self._lock:
            self._catalogs[key] = catalog
        return catalog

    def invalidate(self) -> None:
        """Drop every cached catalog."""
        with self._lock:
            self._catalogs.clear()


CACHE = MetadataCache()


_VOLATILE = {"CreatedDate", "LastModifiedDate"}


def sync_rows(
    conn: Connection,
    table: Table,
    desired: list[dict[str, Any]],
    *,
    preserve_customized: bool = True,
) -> int:
    """Make ``table`` hold ``desired`` rows (keyed by ``Id``); return rows written.

    Only rows that differ (audit dates aside) are written, so a converged
    database sees no writes. A row whose existing ``IsCustomized`` is true is
    left alone when ``preserve_customized``: an admin's edit wins over pack
    reapply (the seed's preserveCustomized semantics).
    """
    if not desired:
        return 0
    ids = [r["Id"] for r in desired]
    existing: dict[str, Any] = {}
    for chunk_start in range(0, len(ids), 500):
        chunk = ids[chunk_start : chunk_start + 500]
        for old_row in conn.execute(select(table).where(table.c.Id.in_(chunk))).mappings():
            existing[old_row["Id"]] = old_row
    changed: list[dict[str, Any]] = []
    for row in desired:
        old = existing.get(row["Id"])
        if old is None:
            changed.append(row)
            continue
        if preserve_customized and "IsCustomized" in old and old["IsCustomized"]:
            continue
        skip = _VOLATILE | {"IsCustomized"}
        if any(_norm(old[k]) != _norm(v) for k, v in row.items() if k not in skip):
            changed.append(row)
    if changed:
        update_cols = [c for c in changed[0] if c not in {"Id", "CreatedDate", "IsCustomized"}]
        upsert(conn, table, changed, update_cols)
    return len(changed)


def _norm(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    return v


def object_row_raw(api_name: str, table_name: str, table_type: str, pack: str) -> dict[str, Any]:
    """An ``_System_Object`` row for a table that has no spec (system or discovered)."""
    now = utcnow()
    return {
        "Id": object_id(api_name),
        "ApiName": api_name,
        "Label": api_name,
        "PluralLabel": api_name,
        "TableName": table_name,
        "TableType": table_type,
        "NameFieldType": "Text",
        "Description": None,
        "IsCustomized": False,
        "PackName": pack,
        "CreatedDate": now,
        "LastModifiedDate": now,
    }
