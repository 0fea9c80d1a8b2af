"""RunRepair: a registry of repair steps, each fatal or best-effort.

Port of the seed's ``RunRepairWithOptionsAndRunnerOptions`` (``trackStep`` /
``trackStepFatal``) and its end-of-repair marker-honesty gate
(``convergenceCriticalRepairSteps`` under ``FailClosedOnConvergenceRepairs``).
One-time steps are stamped in ``_System_Migration`` so a re-run skips them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine, delete, inspect, select, update

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.controlplane import lease, metadata
from nexuscrm.cutover import ensure_cutover_receipt
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import after_ddl, describe_error
from nexuscrm.errors import LeaseLostError, RepairError
from nexuscrm.log import log
from nexuscrm.packs.model import STANDARD_COLUMNS, FieldSpec, validate_identifier


@dataclass(frozen=True)
class RepairStep:
    """One registered step.

    ``run(conn)`` does the work inside one transaction and returns how many
    rows or objects it changed. ``once`` steps are stamped in
    ``_System_Migration`` under ``name`` and skipped afterwards.
    """

    name: str
    run: Callable[[Connection], int]
    fatal: bool
    once: bool = False
    convergence_critical: bool = False
    ddl: bool = False


@dataclass
class StepOutcome:
    """How one step went: ``completed``, ``skipped`` (stamped), or ``failed``."""

    name: str
    status: str
    changed: int = 0
    error: str | None = None
    elapsed: float = 0.0


@dataclass
class RepairReport:
    """All step outcomes of one RunRepair, in order."""

    steps: list[StepOutcome] = field(default_factory=list)

    def failed(self, only: set[str] | None = None) -> list[str]:
        """Names of failed steps (restricted to ``only`` when given)."""
        return [
            s.name for s in self.steps if s.status == "failed" and (only is None or s.name in only)
        ]


# --- steps ------------------------------------------------------------------


def discover_and_register_physical_tables(conn: Connection) -> int:
    """Register physical tables that have no ``_System_Object`` row.

    A table made outside the control plane (a restore, a manual CREATE) is
    inventoried as ``TableType='discovered'`` with fields inferred from its
    columns, so metadata describes every table. System tables, views and
    names that are not valid API names are left alone.

    A table an installed pack declares but never finished installing (its
    row ``failed``, ``installing`` or ``removed`` before it became active: a
    pack that failed half-way through apply-packs) belongs to that pack, not
    to discovery: it is not registered (the pack registers it, with its
    declared types, when it applies), and a ``discovered`` registration of
    it left by an earlier release is withdrawn, so fixing or removing the
    pack converges instead of failing on inferred types.
    """
    unfinished = unfinished_pack_tables(conn)
    changed = _release_discovered(conn, unfinished)
    known = {r.lower() for r in conn.execute(select(t.object_meta.c.TableName)).scalars()}
    insp = inspect(conn)
    std = {c.lower() for c in STANDARD_COLUMNS}
    for name in sorted(insp.get_table_names()):
        if name.lower() in known or name.startswith("_System_"):
            continue
        if name.lower() in unfinished:
            log.info(
                "repair: table left to its pack (never finished installing)",
                table=name, pack=unfinished[name.lower()],
            )  # fmt: skip
            continue
        if not _valid_name(name):
            log.warning("repair: physical table not registered: not a valid API name", table=name)
            continue
        rows = [catalog.object_row_raw(name, name, "discovered", pack="")]
        fields = []
        for col in insp.get_columns(name):
            if col["name"].lower() in std:
                continue
            if not _valid_name(col["name"]):
                log.warning("repair: column not registered", table=name, column=col["name"])
                continue
            spec = FieldSpec(api_name=col["name"], type=catalog.infer_field_type(col["type"]))
            fields.append(catalog.field_row(name, spec, pack=""))
        changed += catalog.sync_rows(conn, t.object_meta, rows)
        changed += catalog.sync_rows(conn, t.field_meta, fields)
        log.info("repair: registered physical table", table=name, fields=len(fields))
    return changed


def unfinished_pack_tables(conn: Connection) -> dict[str, str]:
    """Lower-cased table name -> pack, for the tables of app/connector packs that
    are not active (their stored payload's own objects, not extensions)."""
    ip = t.installed_pack
    out: dict[str, str] = {}
    rows = conn.execute(
        select(ip.c.Name, ip.c.Payload).where(
            ip.c.Status.in_(("failed", "installing", "removed")),
            ip.c.Category.in_(("AppPack", "ConnectorPack")),
        )
    ).all()
    for name, payload in rows:
        try:
            objects = json.loads(payload or "{}").get("objects") or []
        except ValueError:
            continue
        for o in objects:
            if isinstance(o, dict) and not o.get("extends") and o.get("kind", "table") == "table":
                out.setdefault(str(o.get("api_name", "")).lower(), str(name))
    return out


def _release_discovered(conn: Connection, unfinished: dict[str, str]) -> int:
    """Withdraw ``discovered`` registrations of tables an unfinished pack declares."""
    om, fm = t.object_meta, t.field_meta
    changed = 0
    rows = conn.execute(
        select(om.c.Id, om.c.ApiName, om.c.TableName).where(
            om.c.TableType == "discovered", om.c.PackName == ""
        )
    ).all()
    for row in rows:
        pack = unfinished.get(str(row.TableName).lower())
        if pack is None:
            continue
        conn.execute(delete(fm).where(fm.c.ObjectApiName == row.ApiName, fm.c.PackName == ""))
        conn.execute(delete(om).where(om.c.Id == row.Id))
        log.info("repair: discovered table handed back to its pack", table=row.TableName, pack=pack)
        changed += 1
    if changed:
        catalog.bump_version(conn)
    return changed


def _valid_name(name: str) -> bool:
    try:
        validate_identifier(name, "name")
    except ValueError:
        return False
    return True


def reconcile_managed_table_columns(conn: Connection) -> int:
    """Add system-table columns and indexes an older release did not have (warm upgrade).

    The same reconcile ``ensure_system_schema`` runs (ApplyMetadata); kept as
    a step so a RunRepair alone converges the columns and indexes too.
    Returns how many were added.
    """
    return metadata.add_missing_system_columns(conn) + metadata.add_missing_system_indexes(conn)


def migrate_pack_install_id_backfill(conn: Connection) -> int:
    """Give every ``_System_InstalledPack`` row with ``PackInstallId=''`` a fresh UUID.

    Connector state is keyed per incarnation on PackInstallId; a blank value
    would collapse all incarnations into one scope (the seed's rationale).
    """
    ids = (
        conn.execute(select(t.installed_pack.c.Id).where(t.installed_pack.c.PackInstallId == ""))
        .scalars()
        .all()
    )
    for pack_id in ids:
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.Id == pack_id)
            .where(t.installed_pack.c.PackInstallId == "")
            .values(PackInstallId=str(uuid.uuid4()), LastModifiedDate=utcnow())
        )
    return len(ids)


def normalize_object_ids(conn: Connection) -> int:
    """Rewrite non-canonical ``_System_Object.Id`` values to ``object_id(ApiName)``.

    Children are re-pointed in the same transaction; runs before
    ReconcileOrphanFieldObjectIds so no field is briefly orphaned.
    """
    changed = 0
    for row in conn.execute(select(t.object_meta.c.Id, t.object_meta.c.ApiName)).all():
        canonical = catalog.object_id(row.ApiName)
        if row.Id == canonical:
            continue
        conn.execute(update(t.object_meta).where(t.object_meta.c.Id == row.Id).values(Id=canonical))
        conn.execute(
            update(t.field_meta).where(t.field_meta.c.ObjectId == row.Id).values(ObjectId=canonical)
        )
        changed += 1
    return changed


def reconcile_orphan_field_object_ids(conn: Connection) -> int:
    """Repair ``_System_Field`` rows whose ``ObjectId`` names no object.

    A row whose ``ObjectApiName`` still names an object is re-attached to it;
    a row whose object is gone entirely is deleted (it describes nothing).
    """
    objects = {
        r.ApiName.lower(): r.Id
        for r in conn.execute(select(t.object_meta.c.Id, t.object_meta.c.ApiName)).all()
    }
    ids = set(objects.values())
    changed = 0
    for row in conn.execute(
        select(t.field_meta.c.Id, t.field_meta.c.ObjectId, t.field_meta.c.ObjectApiName)
    ).all():
        if row.ObjectId in ids:
            continue
        target = objects.get(row.ObjectApiName.lower())
        if target is not None:
            conn.execute(
                update(t.field_meta).where(t.field_meta.c.Id == row.Id).values(ObjectId=target)
            )
        else:
            conn.execute(delete(t.field_meta).where(t.field_meta.c.Id == row.Id))
        changed += 1
    return changed


_NAIVE_PLURAL = re.compile(r"^(?P<stem>.+)s$")


def migrate_legacy_naive_plurals(conn: Connection) -> int:
    """Recompute naive ``Label + 's'`` plural labels (``Opportunitys`` -> ``Opportunities``).

    Guarded like the seed: only rows with ``IsCustomized=0`` whose stored
    plural is exactly the naive form and differs from the canonical one;
    admin overrides are never rewritten.
    """
    changed = 0
    for row in conn.execute(
        select(t.object_meta.c.Id, t.object_meta.c.Label, t.object_meta.c.PluralLabel).where(
            t.object_meta.c.IsCustomized.is_(False)
        )
    ).all():
        naive = f"{row.Label}s"
        canonical = catalog.pluralize(row.Label)
        if row.PluralLabel == naive and canonical != naive:
            conn.execute(
                update(t.object_meta)
                .where(t.object_meta.c.Id == row.Id)
                .values(PluralLabel=canonical, LastModifiedDate=utcnow())
            )
            changed += 1
    return changed


REPAIR_STEPS: tuple[RepairStep, ...] = (
    RepairStep(
        "ReconcileManagedTableColumns", reconcile_managed_table_columns, fatal=True, ddl=True
    ),
    RepairStep(
        "DiscoverAndRegisterPhysicalTables",
        discover_and_register_physical_tables,
        fatal=False,
        convergence_critical=True,
    ),
    RepairStep("MigratePackInstallIdBackfill", migrate_pack_install_id_backfill, fatal=True),
    RepairStep("NormalizeObjectIds", normalize_object_ids, fatal=False),
    RepairStep("ReconcileOrphanFieldObjectIds", reconcile_orphan_field_object_ids, fatal=False),
    RepairStep(
        "MigrateLegacyNaivePlurals",
        migrate_legacy_naive_plurals,
        fatal=False,
        once=True,
        convergence_critical=True,
    ),
    # Receipt of the WorkItem-only execution cutover: the connector fleet admits
    # no pool without it (nexuscrm.connectors.admission, nexuscrm.cutover).
    RepairStep("EnsureConnectorWorkItemCutover", ensure_cutover_receipt, fatal=False),
)

CONVERGENCE_CRITICAL_STEPS = frozenset(s.name for s in REPAIR_STEPS if s.convergence_critical)

# Port of RunL0Repair: only what is safe on a clean L0 database. Discovery and
# the broad metadata repairs stay out: they would reify or rewrite app/business
# metadata left in a reused database.
L0_REPAIR_STEPS: tuple[RepairStep, ...] = tuple(
    s
    for s in REPAIR_STEPS
    if s.name in {"ReconcileManagedTableColumns", "MigratePackInstallIdBackfill"}
)


def _stamped(conn: Connection, key: str) -> bool:
    return (
        conn.execute(
            select(t.migration.c.MigrationKey).where(t.migration.c.MigrationKey == key)
        ).first()
        is not None
    )


def run_repair(
    engine: Engine,
    *,
    epoch: int | None = None,
    fail_closed_on_convergence: bool = False,
    steps: tuple[RepairStep, ...] = REPAIR_STEPS,
) -> RepairReport:
    """Run every step in order; return the report.

    A fatal step's failure raises ``RepairError`` at once (after logging). A
    best-effort failure is recorded and repair goes on; with
    ``fail_closed_on_convergence`` (the ApplyAll path) any failed
    convergence-critical step raises ``RepairError`` at the end, so the
    completed marker is never stamped over unconverged state. Each step runs
    in its own transaction, after a lease check, and bumps the metadata
    version when it changed anything. ``LeaseLostError`` propagates.
    """
    report = RepairReport()
    for step in steps:
        start = time.monotonic()
        outcome = StepOutcome(step.name, "completed")
        try:
            with engine.begin() as conn:
                lease.require(conn, epoch)
                if step.once and _stamped(conn, step.name):
                    outcome.status = "skipped"
                else:
                    outcome.changed = step.run(conn)
                    if step.once:
                        conn.execute(
                            t.migration.insert().values(
                                MigrationKey=step.name,
                                AppliedDate=utcnow(),
                                Detail=f"changed={outcome.changed}",
                            )
                        )
                    if outcome.changed:
                        catalog.bump_version(conn)
            if step.ddl and outcome.changed:
                after_ddl(engine)
        except Exception as exc:
            if isinstance(exc, RepairError | LeaseLostError):
                raise
            outcome.status = "failed"
            outcome.error = describe_error(exc)
            log.warning("repair step failed", step=step.name, fatal=step.fatal, err=outcome.error)
            if step.fatal:
                outcome.elapsed = time.monotonic() - start
                report.steps.append(outcome)
                raise RepairError(f"repair step {step.name} failed: {outcome.error}") from exc
        outcome.elapsed = time.monotonic() - start
        report.steps.append(outcome)
        log.info("repair step", step=step.name, status=outcome.status, changed=outcome.changed)
    if fail_closed_on_convergence:
        failed = report.failed({s.name for s in steps if s.convergence_critical})
        if failed:
            raise RepairError(
                f"convergence-critical repair step(s) failed: {', '.join(failed)} — "
                "control plane not converged, not marking bootstrapped"
            )
    return report
