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
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, Text, delete, inspect, or_, select, update

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.contracts import PlannedPackInfo
from nexuscrm.controlplane import lease, markers
from nexuscrm.controlplane.packs_plan import (
    TYPE_FAMILIES,
    PlanState,
    plan_problems,
    resolve_object,
    validate_plan,
)
from nexuscrm.controlplane.packs_records import merge_customizations, sync_records
from nexuscrm.controlplane.rowsize import rowsize_text_columns
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
    widens,
)
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.errors import (
    LeaseLostError,
    NexusError,
    PackError,
    PackProblems,
    Problem,
    problem_from,
)
from nexuscrm.log import log
from nexuscrm.packs.builtin import platform_packs
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.packs.model import (
    Category,
    FieldSpec,
    FieldType,
    ObjectSpec,
    PackManifest,
)

__all__ = ["TYPE_FAMILIES", "plan_problems", "validate_pack", "validate_plan"]
from nexuscrm.packs.ordering import plan_order

# Packs an operator installs (as opposed to the platform packs shipped with the
# product): they carry the installing -> active | failed lifecycle and are
# reapplied from their stored payload by every later ApplyAll.
INSTALLED_CATEGORIES = (Category.AppPack, Category.ConnectorPack)

# Statuses of ``_System_ConnectorPackIncarnation`` rows (earlier connector-pack incarnations).
INCARNATION_DRAINING = "draining"
INCARNATION_REMOVED = "removed"


@dataclass(frozen=True)
class PackApplyResult:
    """What applying one pack changed (all zero on a converged database)."""

    name: str
    tables_created: int
    columns_added: int
    rows_written: int
    columns_widened: int = 0


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
            # installing: applied by a run that failed before finalizing its
            # packs (they go active only after the whole loop); resumed here.
            .where(t.installed_pack.c.Status.in_(("active", "installing")))
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

    Raises ``PackProblems`` with every problem at once, each naming the file
    and element: of every given source (unknown field type, broken manifest
    ...), of the order (every dependency cycle, missing dependency, duplicate
    name) and, when there is any of those, of the plan checks run on the
    best-effort order (a lookup to an unknown object ...), so a missing
    dependency never hides the rest. ``PackError`` when a stored payload no
    longer validates.
    """
    packs = list(platform_packs(include_dev_sample))
    explicit: list[PackManifest] = []
    problems: list[Problem] = []
    for source in app_sources:
        try:
            pack = load_pack_source(source)
            if pack.category not in INSTALLED_CATEGORIES:
                # A platform or DevSample category would order it among (or
                # before) the shipped packs and never record it as installed.
                problems.append(
                    Problem(
                        pack.source or source,
                        "category",
                        f"pack {pack.name}: an app pack source must be of category "
                        f"{' or '.join(c.value for c in INSTALLED_CATEGORIES)}, not "
                        f"{pack.category.value}",
                    )
                )
            explicit.append(pack)
        except PackProblems as exc:
            problems.extend(exc.problems)
            if isinstance(exc.partial, PackManifest):
                explicit.append(exc.partial)
        except PackError as exc:
            problems.append(problem_from(exc))
    names = {p.name for p in explicit}
    stored = [p for p in stored_app_packs(engine) if p.name not in names] if engine else []
    plan, order_problems = plan_order(packs + explicit + stored)
    if not problems and not order_problems:
        return plan
    # Report the plan's problems of what did load too, in the best-effort
    # order that skips the faulty dependencies: every problem at once.
    problems.extend(order_problems)
    problems.extend(plan_problems(catalog_of(engine), plan))
    raise PackProblems(", ".join(app_sources), problems)


def catalog_of(engine: Engine | None) -> catalog.Catalog:
    """The database's metadata catalog, or an empty one when it has no metadata yet."""
    if engine is not None and t.object_meta.name in physical_tables(engine):
        return catalog.CACHE.get(engine)
    return catalog.Catalog(version=0)


def validate_against(engine: Engine, packs: Sequence[PackManifest]) -> None:
    """:func:`validate_plan` against the database's catalog (an empty one when the
    database has no metadata yet): what plan-packs and ``import-sfdx`` run.

    Raises ``PackProblems`` with every problem of the plan, grouped by file.
    """
    validate_plan(catalog_of(engine), packs)


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


def validate_pack(cat: catalog.Catalog, pack: PackManifest) -> None:
    """Check one pack against the catalog before anything of it is written.

    Raises ``PackProblems`` with every problem (see :mod:`packs_plan`): an
    extension of an object nobody defines; an object or field owned by another
    pack; a lookup to an unknown object; a stored field whose type changes
    family (Text -> Number); a typeless standard field nobody defines.
    """
    validate_plan(cat, [pack])


def _merged_spec(
    cat: catalog.Catalog, o: ObjectSpec, own: bool = False, extra: Sequence[FieldSpec] = ()
) -> ObjectSpec:
    """The object's full field list: what the catalog has plus what this pack adds
    (``o.fields`` and ``extra``); ``own`` when the pack owns the object."""
    existing = cat.get(o.api_name)
    fields: dict[str, FieldSpec] = {}
    if existing is not None:
        for f in existing.spec().fields:
            fields[f.api_name.lower()] = f
    for f in (*o.fields, *extra):
        fields[f.api_name.lower()] = f
    base = existing.spec() if (existing is not None and o.extends and not own) else o
    return base.model_copy(
        update={"fields": tuple(fields.values()), "extends": False, "customizations": (),
                "records": ()}
    )  # fmt: skip


def converge_table(
    engine: Engine, spec: ObjectSpec, epoch: int | None = None
) -> tuple[int, int, int]:
    """Create the object's table, add its missing columns and widen the columns a
    pack now declares wider; return (created, added, widened).

    Columns are only ever added (as the seed's additive schema bootstrap);
    a column a pack no longer declares is kept with its data. On the MySQL
    family a column whose declared size grew (a Text field's length, a
    Number's precision or scale: :func:`nexuscrm.db.dialect.widens`) is
    altered in place (``MODIFY COLUMN``), so that a value the new size allows
    is stored; a size that shrinks never reaches here (refused when the pack is
    planned). SQLite keeps any length in any column. The DDL runs after a
    lease check in its transaction (``LeaseLostError`` when fenced).
    """
    dialect = dialect_name(engine)
    if spec.api_name not in physical_tables(engine):
        with engine.begin() as conn:
            lease.require(conn, epoch)
            catalog.object_table(spec, dialect, MetaData()).create(conn)
        return 1, 0, 0
    reflected = {c["name"].lower(): c["type"] for c in inspect(engine).get_columns(spec.api_name)}
    text = rowsize_text_columns(engine, spec, reflected)
    added = widened = 0
    with engine.begin() as conn:
        lease.require(conn, epoch)
        for f in spec.fields:
            for col in f.column_names():
                type_ = Text() if col.lower() in text else column_type(f, dialect)
                table_q, col_q = quote(conn, spec.api_name), quote(conn, col)
                have = reflected.get(col.lower())
                if have is None:
                    type_sql = render_type(conn, type_)
                    conn.exec_driver_sql(f"ALTER TABLE {table_q} ADD COLUMN {col_q} {type_sql}")
                    added += 1
                elif dialect == "mysql" and widens(have, type_):
                    type_sql = render_type(conn, type_)
                    conn.exec_driver_sql(f"ALTER TABLE {table_q} MODIFY COLUMN {col_q} {type_sql}")
                    log.info(
                        "column widened",
                        table=spec.api_name,
                        column=col,
                        was=str(have),
                        now=type_sql,
                    )
                    widened += 1
    return 0, added, widened


def _keep_incarnation(conn: Connection, row: Any, status: str, replaced_by: str) -> None:
    """Keep connector-pack incarnation ``row`` (an ``_System_InstalledPack`` row) as ``status``."""
    now = utcnow()
    upsert(
        conn,
        t.connector_pack_incarnation,
        [
            {
                "PackInstallId": row.PackInstallId,
                "Name": row.Name,
                "Category": row.Category,
                "Version": row.Version,
                "Status": status,
                "PayloadHash": row.PayloadHash,
                "Payload": row.Payload,
                "Source": row.Source,
                "ReplacedByInstallId": replaced_by,
                "RetiredDate": now if status != INCARNATION_DRAINING else None,
                "CreatedDate": now,
                "LastModifiedDate": now,
            }
        ],
        ["Status", "ReplacedByInstallId", "RetiredDate", "LastModifiedDate"],
    )


def _install_id_for(conn: Connection, pack: PackManifest, digest: str) -> str:
    """The ``PackInstallId`` the pack's row gets now (one incarnation per connector payload).

    An AppPack keeps its id. A ConnectorPack whose installed payload changes
    (an upgrade) gets a new incarnation: the replaced one is kept in
    ``_System_ConnectorPackIncarnation`` as ``draining``, so the fleet serves
    its pending items through its own routes with a drain-only pool until its
    queue is empty, then retires it. A ConnectorPack re-installed after
    ``packs remove`` gets a new incarnation too (the removed one is recorded
    ``removed``).
    """
    ip = t.installed_pack
    row = conn.execute(select(ip).where(ip.c.Name == pack.name)).first()
    if row is None or not row.PackInstallId:
        return str(uuid.uuid4())
    if pack.category is not Category.ConnectorPack or row.Category != pack.category.value:
        return str(row.PackInstallId)
    if row.Status in ("active", "draining") and row.PayloadHash != digest:
        status = INCARNATION_DRAINING
    elif row.Status == "removed":
        status = INCARNATION_REMOVED
    else:
        return str(row.PackInstallId)
    install_id = str(uuid.uuid4())
    _keep_incarnation(conn, row, status, install_id)
    log.info(
        "connector pack incarnation replaced", pack=pack.name, old=row.PackInstallId,
        new=install_id, old_status=status,
    )  # fmt: skip
    return install_id


def _set_pack_row(
    conn: Connection, pack: PackManifest, status: str, digest: str, error: str | None
) -> None:
    now = utcnow()
    install_id = _install_id_for(conn, pack, digest)
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


def apply_pack(
    engine: Engine, pack: PackManifest, epoch: int | None = None, *, finalize: bool = True
) -> PackApplyResult:
    """Converge one pack: validate, tables/columns, metadata rows, pack row.

    AppPack: marked ``installing`` (with payload hash) before any change, then
    ``active`` in the metadata transaction when ``finalize`` (``apply_packs``
    passes False and finalizes every pack after the whole loop); on error
    ``failed`` with the error and hash, and the error is re-raised as
    ``PackError`` naming the pack. Raises ``LeaseLostError`` if a newer
    control-plane run owns the database.
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
    state = PlanState.of(cat)
    resolved = [(o, resolve_object(pack, o, state)) for o in pack.objects]
    try:
        created = added = widened = 0
        with engine.connect() as conn:
            lease.require(conn, epoch)
        for o, res in resolved:
            if o.kind == "event":
                continue
            extra = res.fields[len(o.fields) :]
            c, a, w = converge_table(engine, _merged_spec(cat, o, res.own, extra), epoch)
            created += c
            added += a
            widened += w
        if created or added or widened:
            after_ddl(engine)
        with engine.begin() as conn:
            lease.require(conn, epoch)
            written = 0
            for o, res in resolved:
                if res.own:
                    row_spec = o.model_copy(update={"extends": False})
                    written += catalog.sync_rows(
                        conn, t.object_meta, [catalog.object_row(row_spec, pack.name)]
                    )
                written += catalog.sync_rows(
                    conn,
                    t.field_meta,
                    [catalog.field_row(o.api_name, f, pack.name) for f in res.fields],
                )
                written += merge_customizations(conn, o.api_name, res.merges)
                if o.records:
                    written += sync_records(
                        conn, _merged_spec(cat, o, res.own, res.fields), o.records
                    )
            declared = {
                (o.api_name.lower(), f.api_name.lower()) for o, r in resolved for f in r.fields
            }
            written += drop_computed_fields(conn, pack.name, keep=declared)
            # App/connector packs of an apply_packs loop are finalized after it.
            if (finalize or not is_app) and not _pack_row_current(conn, pack, digest):
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
        columns_added=added, columns_widened=widened, rows_written=written,
    )  # fmt: skip
    return PackApplyResult(pack.name, created, added, written, widened)


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

    Port of the seed's ``ApplyPacksWithOptions`` order: app and connector
    packs stay ``installing`` while the loop runs and are finalized ``active``
    together only after every pack applied (``finalizeAppliedAppPacks``), so
    a failed run never leaves an earlier pack of it served. Stops at the first
    failing pack and raises its error.
    """
    results = []
    for pack in packs:
        result = apply_pack(engine, pack, epoch, finalize=False)
        results.append(result)
        if on_pack is not None:
            on_pack(result)
    finalize_applied_packs(engine, packs, epoch)
    return results


def finalize_applied_packs(
    engine: Engine, packs: Sequence[PackManifest], epoch: int | None = None
) -> int:
    """Port of ``finalizeAppliedAppPacks``: every applied app/connector pack -> ``active``.

    One transaction, fenced by the lease; a row is finalized only when it is
    still ``installing`` with this run's payload hash. Returns rows changed.
    """
    ip = t.installed_pack
    changed = 0
    with engine.begin() as conn:
        lease.require(conn, epoch)
        for pack in packs:
            if pack.category not in INSTALLED_CATEGORIES:
                continue
            changed += conn.execute(
                update(ip)
                .where(ip.c.Name == pack.name)
                .where(ip.c.Status == "installing")
                .where(ip.c.PayloadHash == payload_hash(pack))
                .values(Status="active", LastError=None, LastModifiedDate=utcnow())
            ).rowcount
        if changed:
            catalog.bump_version(conn)
    return changed


def mark_pack_status(engine: Engine, name: str, status: str) -> None:
    """Set one ``_System_InstalledPack`` row's status (used by tests and tools)."""
    with engine.begin() as conn:
        conn.execute(
            update(t.installed_pack).where(t.installed_pack.c.Name == name).values(Status=status)
        )


def removal_problem(engine: Engine, name: str) -> str | None:
    """Why ``nexusctl packs remove <name>`` cannot work, read before it queues
    (``None``: it may; :func:`remove_pack` checks again under the lease): not
    installed (naming the packs that are), or a platform pack."""
    ip = t.installed_pack
    with engine.connect() as conn:
        rows = conn.execute(select(ip.c.Name, ip.c.Category, ip.c.Status)).all()
    removable = {c.value for c in INSTALLED_CATEGORIES}
    row = next((r for r in rows if r.Name == name), None)
    if row is None:
        names = sorted(r.Name for r in rows if r.Category in removable and r.Status != "removed")
        return f"pack {name[:80]} is not installed (removable: {', '.join(names) or 'none'})"
    if row.Category not in removable:
        return f"pack {name} is a {row.Category} pack; only app and connector packs can be removed"
    return None


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
    fleet drains its pool. A connector pack's earlier incarnations still
    draining are marked ``removed`` with it; the work items still queued for
    them are failed ``pack-removed`` by the connector side
    (``nexuscrm.connectors.incarnations.fail_removed_items``, run by ``nexusctl
    packs remove`` and by every fleet reconcile). In the same transaction the
    ApplyAll marker (when there is one) becomes ``invalidated`` (stamped with
    ``run_id``), so the next auto-start re-applies instead of trusting a
    marker that proved the old pack set (the seed's
    ``withControlPlaneMutationLock``). ``epoch``: the lease epoch of the
    ``RemovePack`` run, checked in that transaction (``None``: a direct call
    from a test or tool, unfenced). Raises ``PackError`` for an unknown or
    platform pack, or one that another installed pack depends on (unless
    ``force``: a host that removes the dependents next, or a test of what
    they do meanwhile); ``LeaseLostError`` when a newer run took the lease.
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
        # Its earlier incarnations still draining are removed with it.
        inc = t.connector_pack_incarnation
        conn.execute(
            update(inc)
            .where(inc.c.Name == name, inc.c.Status == INCARNATION_DRAINING)
            .values(Status=INCARNATION_REMOVED, RetiredDate=utcnow(), LastModifiedDate=utcnow())
        )
        # Its formula and roll-up fields store nothing: they leave the views with it.
        if drop_computed_fields(conn, name, keep=set()):
            catalog.bump_version(conn)
        if markers.read(conn) is not None:
            markers.mark(conn, markers.MarkerStatus.invalidated, run_id, "RemovePack")
        return str(row.Status)


def drop_computed_fields(conn: Connection, pack_name: str, keep: set[tuple[str, str]]) -> int:
    """Delete the ``_System_Field`` rows of pack ``pack_name``'s formula and Summary
    fields that are not in ``keep`` (``(object, field)`` API names, lower-case):
    what the pack no longer declares, or all of them when it is removed. They
    store nothing (no column, no data), so the next view rebuild leaves them out;
    before, a formula deleted from the source (or a broken one of a removed pack)
    stayed in the catalog for ever and every status warned about it. Stored
    fields keep their row, column and data (schema changes are additive); a row
    an admin customized (``IsCustomized``) is kept. Returns the rows deleted."""
    f = t.field_meta
    rows = conn.execute(
        select(f.c.Id, f.c.ObjectApiName, f.c.ApiName).where(
            f.c.PackName == pack_name,
            or_(f.c.Formula.is_not(None), f.c.FieldType == FieldType.Summary.value),
            f.c.IsCustomized.is_(False),
        )
    ).all()
    gone = [r.Id for r in rows if (r.ObjectApiName.lower(), r.ApiName.lower()) not in keep]
    for start in range(0, len(gone), 500):
        conn.execute(delete(f).where(f.c.Id.in_(gone[start : start + 500])))
    if gone:
        log.info("computed fields dropped", pack=pack_name, fields=len(gone))
    return len(gone)
