"""ApplyPacks: packs in category then dependency order, physical tables and
metadata rows converged per pack, AppPack lifecycle rows.

Port of the seed's ``ApplyPacksWithOptions``: AppPack rows go
``installing`` -> ``active``, or ``failed`` with the error and payload hash;
the metadata cache is refreshed between packs (here: every pack bumps the
version stamp and the next pack re-reads the catalog).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, MetaData, inspect, select, update

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.contracts import PlannedPackInfo
from nexuscrm.controlplane import lease, markers
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import (
    after_ddl,
    column_type,
    describe_error,
    dialect_name,
    is_transient,
    quote,
    render_type,
    upsert,
)
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.errors import LeaseLostError, NexusError, PackError
from nexuscrm.log import log
from nexuscrm.packs.builtin import platform_packs
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.packs.model import (
    NUMERIC_TYPES,
    TEXT_TYPES,
    Category,
    FieldSpec,
    FieldType,
    ObjectSpec,
    PackManifest,
)
from nexuscrm.packs.ordering import order_packs

# Packs an operator installs (as opposed to the platform packs shipped with the
# product): they carry the installing -> active | failed lifecycle and are
# reapplied from their stored payload by every later ApplyAll.
INSTALLED_CATEGORIES = (Category.AppPack, Category.ConnectorPack)


@dataclass(frozen=True)
class PackApplyResult:
    """What applying one pack changed (all zero on a converged database)."""

    name: str
    tables_created: int
    columns_added: int
    rows_written: int


def stored_app_packs(engine: Engine) -> list[PackManifest]:
    """Active AppPack rows rebuilt from their stored payload.

    Port of the seed's reconcile-active-installed-pack-sources: an app pack
    installed once stays converged by every later ApplyAll, even when the
    operator does not pass its source again.
    """
    if t.installed_pack.name not in physical_tables(engine):
        return []
    out: list[PackManifest] = []
    with engine.connect() as conn:
        rows = conn.execute(
            select(t.installed_pack.c.Name, t.installed_pack.c.Payload, t.installed_pack.c.Source)
            .where(t.installed_pack.c.Category.in_([c.value for c in INSTALLED_CATEGORIES]))
            .where(t.installed_pack.c.Status == "active")
        ).all()
    for row in rows:
        if not row.Payload:
            continue
        try:
            pack = PackManifest.model_validate_json(row.Payload)
        except ValueError as exc:
            raise PackError(row.Name, f"stored payload no longer validates: {exc}") from exc
        out.append(pack.model_copy(update={"source": row.Source or f"stored:{row.Name}"}))
    return out


def load_plan(
    engine: Engine | None, app_sources: Sequence[str], include_dev_sample: bool
) -> list[PackManifest]:
    """Every pack this ApplyAll applies, ordered (category, then dependencies).

    = shipped platform packs (+ DevSample outside production) + the given app
    pack sources + active app packs already installed (from their stored
    payload; an explicitly given source of the same name wins).

    Raises ``ManifestError`` / ``PackError`` naming the file or pack at fault
    (unknown field type, broken manifest, dependency cycle, missing
    dependency, duplicate names).
    """
    packs = list(platform_packs(include_dev_sample))
    explicit = [load_pack_source(s) for s in app_sources]
    names = {p.name for p in explicit}
    stored = [p for p in stored_app_packs(engine) if p.name not in names] if engine else []
    return order_packs(packs + explicit + stored)


def summarize(packs: Sequence[PackManifest]) -> list[PlannedPackInfo]:
    """The plan as ``PlannedPackInfo`` rows, exactly what the workflow records.

    One per pack in plan order: name, category (its value), version, payload
    hash (sha256 hex of the canonical payload), source and object count.
    """
    return [
        PlannedPackInfo(
            p.name, p.category.value, p.version, payload_hash(p), p.source, len(p.objects)
        )
        for p in packs
    ]


# Field types whose stored columns are interchangeable; a change across
# families would need a data migration, so apply refuses it (fails closed).
TYPE_FAMILIES: dict[FieldType, str] = {
    **{t_: "text" for t_ in TEXT_TYPES},
    **{t_: "number" for t_ in NUMERIC_TYPES},
    FieldType.Checkbox: "checkbox",
    FieldType.Date: "date",
    FieldType.DateTime: "datetime",
    FieldType.Time: "time",
    FieldType.Lookup: "reference",
    FieldType.MasterDetail: "reference",
    FieldType.Location: "location",
    FieldType.Summary: "summary",
}


@dataclass
class _PlanState:
    """What the catalog would hold after the packs checked so far."""

    objects: dict[str, str]  # object lower -> owning pack ('' discovered)
    fields: dict[tuple[str, str], str]  # (object, field) lower -> owning pack
    stored: dict[tuple[str, str], FieldSpec]  # stored fields of the live catalog

    @classmethod
    def of(cls, cat: catalog.Catalog) -> _PlanState:
        stored = {
            (o.api_name.lower(), f.api_name.lower()): f
            for o in cat.objects.values()
            for f in o.fields
            if f.is_stored
        }
        objects = {k: o.pack_name for k, o in cat.objects.items()}
        return cls(objects, dict(cat.field_owners), stored)


def _check(pack: PackManifest, state: _PlanState) -> None:
    own = {o.api_name.lower() for o in pack.objects if not o.extends}
    known = set(state.objects) | own
    for o in pack.objects:
        key = o.api_name.lower()
        if o.extends:
            if key not in known:
                raise PackError(
                    pack.name,
                    f"object {o.api_name} extends a standard object that no installed pack defines",
                )
        elif state.objects.get(key, "") not in ("", pack.name):
            raise PackError(
                pack.name, f"object {o.api_name} is already owned by pack {state.objects[key]}"
            )
        for f in o.fields:
            fkey = (key, f.api_name.lower())
            if f.reference_to and f.reference_to.lower() not in known:
                raise PackError(
                    pack.name,
                    f"field {o.api_name}.{f.api_name} references unknown object {f.reference_to}",
                )
            owner = state.fields.get(fkey)
            if owner not in (None, "", pack.name):
                raise PackError(
                    pack.name, f"field {o.api_name}.{f.api_name} is already owned by pack {owner}"
                )
            old = state.stored.get(fkey)
            if old is not None and f.is_stored and TYPE_FAMILIES[old.type] != TYPE_FAMILIES[f.type]:
                raise PackError(
                    pack.name,
                    f"field {o.api_name}.{f.api_name} changes type from {old.type} to {f.type}; "
                    "a stored column cannot change type family in place (migrate the data "
                    "to a new field instead)",
                )


def _record(pack: PackManifest, state: _PlanState) -> None:
    for o in pack.objects:
        if not o.extends:
            state.objects[o.api_name.lower()] = pack.name
        for f in o.fields:
            state.fields[(o.api_name.lower(), f.api_name.lower())] = pack.name


def validate_pack(cat: catalog.Catalog, pack: PackManifest) -> None:
    """Check a pack against the catalog before anything of it is written.

    Raises ``PackError`` for: an extension of an object nobody defines; an
    object or field owned by another pack; a lookup to an unknown object; a
    stored field whose type changes family (Text -> Number).
    """
    _check(pack, _PlanState.of(cat))


def validate_plan(cat: catalog.Catalog, packs: Sequence[PackManifest]) -> None:
    """``validate_pack`` for a whole ordered plan, before any pack is applied.

    Each pack is checked against the catalog as the earlier packs of the plan
    would leave it, so an ownership conflict or a dangling lookup fails
    plan-packs (read-only) instead of half-way through apply-packs.
    """
    state = _PlanState.of(cat)
    for pack in packs:
        _check(pack, state)
        _record(pack, state)


def _merged_spec(cat: catalog.Catalog, o: ObjectSpec) -> ObjectSpec:
    """The object's full field list: what the catalog has plus what this pack adds."""
    existing = cat.get(o.api_name)
    fields: dict[str, FieldSpec] = {}
    if existing is not None:
        for f in existing.spec().fields:
            fields[f.api_name.lower()] = f
    for f in o.fields:
        fields[f.api_name.lower()] = f
    base = existing.spec() if (existing is not None and o.extends) else o
    return base.model_copy(update={"fields": tuple(fields.values()), "extends": False})


def converge_table(engine: Engine, spec: ObjectSpec) -> tuple[int, int]:
    """Create the object's table or add its missing columns; return (created, added).

    Columns are only ever added (as the seed's additive schema bootstrap);
    a column a pack no longer declares is kept with its data.
    """
    dialect = dialect_name(engine)
    if spec.api_name not in physical_tables(engine):
        catalog.object_table(spec, dialect, MetaData()).create(engine)
        return 1, 0
    have = {c["name"].lower() for c in inspect(engine).get_columns(spec.api_name)}
    added = 0
    with engine.begin() as conn:
        for f in spec.fields:
            for col in f.column_names():
                if col.lower() in have:
                    continue
                type_sql = render_type(conn, column_type(f, dialect))
                table_q, col_q = quote(conn, spec.api_name), quote(conn, col)
                conn.exec_driver_sql(f"ALTER TABLE {table_q} ADD COLUMN {col_q} {type_sql}")
                added += 1
    return 0, added


def _set_pack_row(
    conn: Connection, pack: PackManifest, status: str, digest: str, error: str | None
) -> None:
    now = utcnow()
    existing = conn.execute(
        select(t.installed_pack.c.PackInstallId).where(t.installed_pack.c.Name == pack.name)
    ).scalar_one_or_none()
    install_id = existing or str(uuid.uuid4())
    upsert(
        conn,
        t.installed_pack,
        [
            {
                "Id": f"pack_{pack.name}",
                "Name": pack.name,
                "Category": pack.category.value,
                "Version": pack.version,
                "PackInstallId": install_id,
                "Status": status,
                "PayloadHash": digest,
                "Payload": pack.model_dump_json(),
                "Source": pack.source,
                "LastError": error,
                "InstalledDate": now,
                "CreatedDate": now,
                "LastModifiedDate": now,
            }
        ],
        ["Category", "Version", "PackInstallId", "Status", "PayloadHash", "Payload", "Source",
         "LastError", "InstalledDate", "LastModifiedDate"],
    )  # fmt: skip


def _pack_row_current(conn: Connection, pack: PackManifest, digest: str) -> bool:
    row = conn.execute(
        select(
            t.installed_pack.c.Status, t.installed_pack.c.PayloadHash, t.installed_pack.c.Source
        ).where(t.installed_pack.c.Name == pack.name)
    ).first()
    return (
        row is not None
        and row.Status == "active"
        and row.PayloadHash == digest
        and (row.Source or "") == pack.source
    )


def apply_pack(engine: Engine, pack: PackManifest, epoch: int | None = None) -> PackApplyResult:
    """Converge one pack: validate, tables/columns, metadata rows, pack row.

    AppPack: marked ``installing`` (with payload hash) before any change, then
    ``active`` in the metadata transaction; on error ``failed`` with the error
    and hash, and the error is re-raised as ``PackError`` naming the pack.
    Raises ``LeaseLostError`` if a newer control-plane run owns the database.
    """
    digest = payload_hash(pack)
    is_app = pack.category in INSTALLED_CATEGORIES
    cat = catalog.CACHE.get(engine)
    try:
        validate_pack(cat, pack)
    except PackError as exc:
        if is_app:
            _mark_failed(engine, pack, digest, str(exc), epoch)
        raise
    if is_app:
        with engine.begin() as conn:
            lease.require(conn, epoch)
            if not _pack_row_current(conn, pack, digest):
                _set_pack_row(conn, pack, "installing", digest, None)
    try:
        created = added = 0
        with engine.connect() as conn:
            lease.require(conn, epoch)
        for o in pack.objects:
            if o.kind == "event":
                continue
            c, a = converge_table(engine, _merged_spec(cat, o))
            created += c
            added += a
        if created or added:
            after_ddl(engine)
        with engine.begin() as conn:
            lease.require(conn, epoch)
            written = 0
            for o in pack.objects:
                if not o.extends:
                    written += catalog.sync_rows(
                        conn, t.object_meta, [catalog.object_row(o, pack.name)]
                    )
                written += catalog.sync_rows(
                    conn,
                    t.field_meta,
                    [catalog.field_row(o.api_name, f, pack.name) for f in o.fields],
                )
            if not _pack_row_current(conn, pack, digest):
                _set_pack_row(conn, pack, "active", digest, None)
                written += 1
            if written:
                catalog.bump_version(conn)
    except Exception as exc:
        if is_app and not isinstance(exc, LeaseLostError):
            _mark_failed(engine, pack, digest, describe_error(exc), epoch)
        if isinstance(exc, NexusError) or is_transient(exc):
            raise  # transient faults stay retryable; domain errors already name the pack
        raise PackError(pack.name, describe_error(exc)) from exc
    log.info(
        "pack applied", pack=pack.name, category=pack.category.value, tables_created=created,
        columns_added=added, rows_written=written,
    )  # fmt: skip
    return PackApplyResult(pack.name, created, added, written)


def _mark_failed(
    engine: Engine, pack: PackManifest, digest: str, error: str, epoch: int | None
) -> None:
    with engine.begin() as conn:
        lease.require(conn, epoch)
        _set_pack_row(conn, pack, "failed", digest, error)


def apply_packs(
    engine: Engine,
    packs: Sequence[PackManifest],
    *,
    epoch: int | None = None,
    on_pack: Callable[[PackApplyResult], None] | None = None,
) -> list[PackApplyResult]:
    """Apply ``packs`` (already ordered) one by one; ``on_pack`` after each (heartbeat).

    Stops at the first failing pack and raises its error.
    """
    results = []
    for pack in packs:
        result = apply_pack(engine, pack, epoch)
        results.append(result)
        if on_pack is not None:
            on_pack(result)
    return results


def mark_pack_status(engine: Engine, name: str, status: str) -> None:
    """Set one ``_System_InstalledPack`` row's status (used by tests and tools)."""
    with engine.begin() as conn:
        conn.execute(
            update(t.installed_pack).where(t.installed_pack.c.Name == name).values(Status=status)
        )


def remove_pack(
    engine: Engine,
    name: str,
    *,
    force: bool = False,
    epoch: int | None = None,
    run_id: str = "",
) -> str:
    """Mark an installed App/Connector pack ``removed``; return its previous status.

    Tables, columns and data stay (schema changes are additive, as in the
    seed); later ApplyAll runs no longer reapply the pack and the connector
    fleet drains its pool. In the same transaction the ApplyAll marker (when
    there is one) becomes ``invalidated`` (stamped with ``run_id``), so the
    next auto-start re-applies instead of trusting a marker that proved the
    old pack set (the seed's ``withControlPlaneMutationLock``). ``epoch``: the
    lease epoch of the ``RemovePack`` run, checked in that transaction
    (``None``: a direct call from a test or tool, unfenced). Raises
    ``PackError`` for an unknown or platform pack, or one that another
    installed pack depends on (unless ``force``: a host that removes the
    dependents next, or a test of what they do meanwhile); ``LeaseLostError``
    when a newer run took the lease.
    """
    with engine.begin() as conn:
        lease.require(conn, epoch)
        row = conn.execute(
            select(t.installed_pack.c.Category, t.installed_pack.c.Status).where(
                t.installed_pack.c.Name == name
            )
        ).first()
        if row is None:
            raise PackError(name, "is not installed")
        if row.Category not in {c.value for c in INSTALLED_CATEGORIES}:
            raise PackError(
                name, f"is a {row.Category} pack; only app and connector packs can be removed"
            )
        # A removed dependency would fail every later ApplyAll's plan: refuse now.
        ip = t.installed_pack
        dependents = sorted(
            other
            for other, payload in conn.execute(
                select(ip.c.Name, ip.c.Payload).where(
                    ip.c.Name != name, ip.c.Status.in_(("active", "installing", "draining"))
                )
            ).all()
            if name in (json.loads(payload or "{}").get("depends_on") or ())
        )
        if dependents and not force:
            raise PackError(
                name,
                f"is a dependency of installed pack(s) {', '.join(dependents)}; remove them first",
            )
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.Name == name)
            .values(Status="removed", LastModifiedDate=utcnow())
        )
        if markers.read(conn) is not None:
            markers.mark(conn, markers.MarkerStatus.invalidated, run_id, "RemovePack")
        return str(row.Status)
