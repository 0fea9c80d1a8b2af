"""Control-plane domain functions on real databases (SQLite, and MariaDB/MySQL
when NEXUS_TEST_MYSQL_URL is set): repair steps, the lease fence, pack apply,
index resume, verify, and the database id.

No Temporal here and no mocks: each test prepares the legacy state it needs
with real DDL and rows, then calls the phase function the activity calls.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, delete, insert, select, text, update
from sqlalchemy.engine import make_url

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.controlplane import (
    derived,
    indexes,
    lease,
    metadata,
    packs_apply,
    repair,
    verify,
)
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import index_names, quote, table_names, view_names
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import LeaseLostError, PackError, PackProblems, RepairError
from nexuscrm.packs.builtin import platform_packs
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.model import FieldSpec, FieldType, ObjectSpec, PackManifest
from nexuscrm.settings import Settings, database_id_for_url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on the fresh database; disposed before the database is dropped."""
    eng = make_engine(db_url)
    try:
        yield eng
    finally:
        eng.dispose()


# ---------------------------------------------------------------------------
# helpers


def app_pack(
    name: str = "gizmo-app",
    fields: list[dict[str, Any]] | None = None,
    obj: str = "Gizmo__c",
) -> PackManifest:
    """A small native AppPack with one custom object."""
    if fields is None:
        fields = [
            {"api_name": "Size__c", "label": "Size", "type": "Number"},
            {"api_name": "Color__c", "label": "Color", "type": "Text", "length": 40},
        ]
    return PackManifest.model_validate(
        {
            "name": name,
            "category": "AppPack",
            "depends_on": ["platform-core"],
            "objects": [{"api_name": obj, "label": "Gizmo", "fields": fields}],
        }
    )


def platform_core() -> PackManifest:
    return next(p for p in platform_packs(False) if p.name == "platform-core")


def with_platform(engine: Engine) -> None:
    """System schema plus the platform-core pack (no app packs, no indexes)."""
    metadata.apply_metadata(engine)
    packs_apply.apply_packs(engine, [platform_core()])


def step_outcome(report: repair.RepairReport, name: str) -> repair.StepOutcome:
    return next(s for s in report.steps if s.name == name)


def object_rows(conn: Connection) -> dict[str, dict[str, Any]]:
    return {r["ApiName"]: dict(r) for r in conn.execute(select(t.object_meta)).mappings().all()}


def field_rows(conn: Connection, obj: str) -> dict[str, dict[str, Any]]:
    rows = conn.execute(select(t.field_meta).where(t.field_meta.c.ObjectApiName == obj))
    return {r["ApiName"]: dict(r) for r in rows.mappings().all()}


def pack_row(conn: Connection, name: str) -> dict[str, Any] | None:
    row = (
        conn.execute(select(t.installed_pack).where(t.installed_pack.c.Name == name))
        .mappings()
        .first()
    )
    return dict(row) if row is not None else None


def install_ids(conn: Connection) -> dict[str, str]:
    rows = conn.execute(select(t.installed_pack.c.Name, t.installed_pack.c.PackInstallId))
    return {r.Name: r.PackInstallId for r in rows}


def metadata_version(engine: Engine) -> int:
    with engine.connect() as conn:
        return catalog.read_version(conn)


def insert_object(conn: Connection, api_name: str, **values: Any) -> None:
    row = catalog.object_row(ObjectSpec(api_name=api_name), pack="legacy-app")
    row.update(values)
    conn.execute(insert(t.object_meta).values(**row))


def insert_field(conn: Connection, obj: str, field: str, **values: Any) -> None:
    row = catalog.field_row(obj, FieldSpec(api_name=field, type=FieldType.Text), "legacy-app")
    row.update(values)
    conn.execute(insert(t.field_meta).values(**row))


def drop_index(engine: Engine, table: str, name: str) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql(f"DROP INDEX {quote(conn, name)}")
        else:
            conn.exec_driver_sql(f"DROP INDEX {quote(conn, name)} ON {quote(conn, table)}")


# ---------------------------------------------------------------------------
# 1. repair steps


def test_discover_registers_hand_made_table_once(engine: Engine) -> None:
    with_platform(engine)
    with engine.connect() as conn:
        account_before = object_rows(conn)["Account"]
        account_fields = field_rows(conn, "Account")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE Legacy_Widget__c (Id VARCHAR(36) PRIMARY KEY, Name VARCHAR(255), "
            "CreatedDate DATETIME, Qty INTEGER, Price DECIMAL(10, 2), Code VARCHAR(20), "
            "Summary VARCHAR(1000), Notes TEXT, Due DATE, Seen_At DATETIME)"
        )
        conn.exec_driver_sql(
            f"CREATE TABLE {quote(conn, 'bad-name')} (Id VARCHAR(36) PRIMARY KEY, Qty INTEGER)"
        )
        conn.exec_driver_sql("CREATE TABLE _System_Scratch (Id VARCHAR(36) PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO Legacy_Widget__c (Id, Name, Qty) VALUES ('w1', 'x', 2)")

    report = repair.run_repair(engine)
    outcome = step_outcome(report, "DiscoverAndRegisterPhysicalTables")
    assert outcome.status == "completed" and outcome.changed > 0

    with engine.connect() as conn:
        objects = object_rows(conn)
        fields = field_rows(conn, "Legacy_Widget__c")
    widget = objects["Legacy_Widget__c"]
    assert widget["TableType"] == "discovered"
    assert widget["TableName"] == "Legacy_Widget__c"
    assert widget["Id"] == catalog.object_id("Legacy_Widget__c")
    assert {k: v["FieldType"] for k, v in fields.items()} == {
        "Qty": FieldType.Number,
        "Price": FieldType.Number,
        "Code": FieldType.Text,
        "Summary": FieldType.TextArea,
        "Notes": FieldType.LongTextArea,
        "Due": FieldType.Date,
        "Seen_At": FieldType.DateTime,
    }  # Id, Name, CreatedDate are the standard columns, not fields
    assert {v["ObjectId"] for v in fields.values()} == {widget["Id"]}
    assert "bad-name" not in objects and "_System_Scratch" not in objects
    assert {n for n, o in objects.items() if o["TableType"] == "discovered"} == {"Legacy_Widget__c"}
    # Tables that metadata already describes are left as they are.
    assert objects["Account"] == account_before
    with engine.connect() as conn:
        assert field_rows(conn, "Account") == account_fields

    # The discovered object is a first-class object: it gets its view.
    assert "v_Legacy_Widget__c" in derived.rebuild_derived(engine).views

    # A second run finds nothing to do and writes nothing.
    version = metadata_version(engine)
    again = repair.run_repair(engine)
    assert step_outcome(again, "DiscoverAndRegisterPhysicalTables").changed == 0
    with engine.connect() as conn:
        assert object_rows(conn) == objects
        assert field_rows(conn, "Legacy_Widget__c") == fields
    assert metadata_version(engine) == version


def test_discover_leaves_table_with_invalid_api_name_alone(engine: Engine) -> None:
    with_platform(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE Old_Backup_ (Id VARCHAR(36) PRIMARY KEY, Qty INTEGER)")
    repair.run_repair(engine, fail_closed_on_convergence=True)
    with engine.connect() as conn:
        assert "Old_Backup_" not in object_rows(conn)
    # The catalog must stay usable for every later phase.
    packs_apply.apply_packs(engine, [platform_core(), app_pack()])
    derived.rebuild_derived(engine)


def test_discover_skips_column_with_invalid_api_name(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE Legacy_Gadget__c (Id VARCHAR(36) PRIMARY KEY, Qty INTEGER, "
            "Bad___Col INTEGER)"
        )
    report = repair.run_repair(engine, fail_closed_on_convergence=True)
    assert step_outcome(report, "DiscoverAndRegisterPhysicalTables").status == "completed"
    with engine.connect() as conn:
        assert set(field_rows(conn, "Legacy_Gadget__c")) == {"Qty"}


def test_pack_install_id_backfill(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    now = utcnow()
    with engine.begin() as conn:
        for name, install_id in [("old-a", ""), ("old-b", ""), ("kept", "keep-me-1234")]:
            conn.execute(
                insert(t.installed_pack).values(
                    Id=f"pack_{name}", Name=name, Category="AppPack", Status="active",
                    PackInstallId=install_id, CreatedDate=now, LastModifiedDate=now,
                )
            )  # fmt: skip

    report = repair.run_repair(engine)
    assert step_outcome(report, "MigratePackInstallIdBackfill").changed == 2
    with engine.connect() as conn:
        ids = install_ids(conn)
    assert ids["kept"] == "keep-me-1234"
    assert ids["old-a"] != ids["old-b"]
    for name in ("old-a", "old-b"):
        assert str(uuid.UUID(ids[name])) == ids[name]

    again = repair.run_repair(engine)
    assert step_outcome(again, "MigratePackInstallIdBackfill").changed == 0
    with engine.connect() as conn:
        assert install_ids(conn) == ids


def test_normalize_object_ids_and_reconcile_orphan_fields(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    canonical = catalog.object_id("Gizmo__c")
    with engine.begin() as conn:
        insert_object(conn, "Gizmo__c", Id="legacy-gizmo-17")
        insert_field(conn, "Gizmo__c", "Size__c", ObjectId="legacy-gizmo-17")
        insert_field(conn, "Gizmo__c", "Color__c", ObjectId="obj_stale_0000")
        insert_field(conn, "Gone__c", "Ghost__c", ObjectId=catalog.object_id("Gone__c"))

    report = repair.run_repair(engine)
    assert step_outcome(report, "NormalizeObjectIds").changed == 1
    assert step_outcome(report, "ReconcileOrphanFieldObjectIds").changed == 2

    with engine.connect() as conn:
        assert object_rows(conn)["Gizmo__c"]["Id"] == canonical
        assert (
            conn.execute(
                select(t.object_meta.c.Id).where(t.object_meta.c.Id == "legacy-gizmo-17")
            ).first()
            is None
        )
        fields = field_rows(conn, "Gizmo__c")
        assert {k: v["ObjectId"] for k, v in fields.items()} == {
            "Size__c": canonical,
            "Color__c": canonical,
        }
        assert field_rows(conn, "Gone__c") == {}
    gizmo = catalog.CACHE.get(engine).get("Gizmo__c")
    assert gizmo is not None
    assert {f.api_name for f in gizmo.fields} == {"Size__c", "Color__c"}

    again = repair.run_repair(engine)
    assert step_outcome(again, "NormalizeObjectIds").changed == 0
    assert step_outcome(again, "ReconcileOrphanFieldObjectIds").changed == 0


def test_legacy_naive_plurals_migrate_once(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    with engine.begin() as conn:
        insert_object(conn, "Opportunity__c", Label="Opportunity", PluralLabel="Opportunitys")
        insert_object(conn, "Box__c", Label="Box", PluralLabel="Boxs")
        insert_object(conn, "Person__c", Label="Person", PluralLabel="People")
        insert_object(
            conn, "Category__c", Label="Category", PluralLabel="Categorys", IsCustomized=True
        )

    report = repair.run_repair(engine)
    assert step_outcome(report, "MigrateLegacyNaivePlurals").status == "completed"
    assert step_outcome(report, "MigrateLegacyNaivePlurals").changed == 2
    with engine.connect() as conn:
        plurals = {k: v["PluralLabel"] for k, v in object_rows(conn).items()}
        stamp = conn.execute(
            select(t.migration.c.MigrationKey).where(
                t.migration.c.MigrationKey == "MigrateLegacyNaivePlurals"
            )
        ).scalar_one_or_none()
    assert plurals["Opportunity__c"] == "Opportunities"
    assert plurals["Box__c"] == "Boxes"
    assert plurals["Person__c"] == "People"
    assert plurals["Category__c"] == "Categorys"  # an admin's choice is never rewritten
    assert stamp == "MigrateLegacyNaivePlurals"

    # Stamped: the next run skips the step, so it no longer touches the data.
    with engine.begin() as conn:
        conn.execute(
            update(t.object_meta)
            .where(t.object_meta.c.ApiName == "Box__c")
            .values(PluralLabel="Boxs")
        )
    again = repair.run_repair(engine)
    assert step_outcome(again, "MigrateLegacyNaivePlurals").status == "skipped"
    with engine.connect() as conn:
        assert object_rows(conn)["Box__c"]["PluralLabel"] == "Boxs"


def _failing_writer(conn: Connection) -> int:
    """A step body that writes, then fails: its write must roll back."""
    conn.execute(
        insert(t.migration).values(MigrationKey="half-done", AppliedDate=utcnow(), Detail="x")
    )
    raise RuntimeError("disk on fire")


def _replace_run(name: str) -> tuple[repair.RepairStep, ...]:
    steps = tuple(
        dataclasses.replace(s, run=_failing_writer) if s.name == name else s
        for s in repair.REPAIR_STEPS
    )
    assert any(s.name == name for s in steps)
    return steps


def test_convergence_gate_fails_closed_on_critical_best_effort_step(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    steps = _replace_run("DiscoverAndRegisterPhysicalTables")
    with pytest.raises(RepairError, match="DiscoverAndRegisterPhysicalTables"):
        repair.run_repair(engine, fail_closed_on_convergence=True, steps=steps)

    # Without the gate (standalone RunRepair) the same run heals what it can.
    report = repair.run_repair(engine, fail_closed_on_convergence=False, steps=steps)
    assert report.failed() == ["DiscoverAndRegisterPhysicalTables"]
    failed = step_outcome(report, "DiscoverAndRegisterPhysicalTables")
    assert "disk on fire" in (failed.error or "")
    assert [s.name for s in report.steps] == [s.name for s in repair.REPAIR_STEPS]
    assert all(s.status in ("completed", "skipped") for s in report.steps if s is not failed)
    with engine.connect() as conn:  # the failed step's own write was rolled back
        assert (
            conn.execute(
                select(t.migration).where(t.migration.c.MigrationKey == "half-done")
            ).first()
            is None
        )


def test_convergence_gate_ignores_non_critical_best_effort_step(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    steps = _replace_run("NormalizeObjectIds")
    report = repair.run_repair(engine, fail_closed_on_convergence=True, steps=steps)
    assert report.failed() == ["NormalizeObjectIds"]


def test_convergence_gate_honours_custom_critical_step(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    steps = (
        repair.RepairStep(
            "BackfillWidgetInventory", _failing_writer, fatal=False, convergence_critical=True
        ),
    )
    with pytest.raises(RepairError, match="BackfillWidgetInventory"):
        repair.run_repair(engine, fail_closed_on_convergence=True, steps=steps)


def test_fatal_step_stops_repair_at_once(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    with engine.begin() as conn:  # work a later step would do
        insert_object(conn, "Box__c", Label="Box", PluralLabel="Boxs")
    steps = _replace_run("MigratePackInstallIdBackfill")
    with pytest.raises(RepairError, match=r"MigratePackInstallIdBackfill.*disk on fire"):
        repair.run_repair(engine, steps=steps)
    with engine.connect() as conn:
        assert object_rows(conn)["Box__c"]["PluralLabel"] == "Boxs"
        assert conn.execute(select(t.migration)).first() is None


# ---------------------------------------------------------------------------
# 2. lease fencing


def test_lease_epochs_fence_out_an_older_holder(engine: Engine) -> None:
    metadata.apply_metadata(engine)
    assert lease.acquire(engine, "run-A", "ApplyAll") == 1
    assert lease.acquire(engine, "run-A", "ApplyAll") == 1  # an activity retry
    assert lease.acquire(engine, "run-B", "RunRepair") == 2

    # Drift that apply-metadata would repair: a system table and its rows are gone.
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE _System_Migration")
        conn.execute(delete(t.object_meta).where(t.object_meta.c.ApiName == "_System_Migration"))
    version = metadata_version(engine)

    with pytest.raises(LeaseLostError, match="epoch is 2"):
        metadata.apply_metadata(engine, epoch=1)
    with pytest.raises(LeaseLostError):
        packs_apply.apply_pack(engine, platform_core(), epoch=1)
    with pytest.raises(LeaseLostError):
        packs_apply.apply_pack(engine, app_pack(), epoch=1)
    with pytest.raises(LeaseLostError):
        repair.run_repair(engine, epoch=1)

    tables = table_names(engine)
    assert "_System_Migration" not in tables
    assert "Account" not in tables and "Gizmo__c" not in tables
    with engine.connect() as conn:
        assert "_System_Migration" not in object_rows(conn)
        assert "Account" not in object_rows(conn)
        assert conn.execute(select(t.installed_pack)).first() is None
    assert metadata_version(engine) == version

    # The current holder writes normally.
    assert metadata.apply_metadata(engine, epoch=2).tables_created == 1
    assert packs_apply.apply_pack(engine, platform_core(), epoch=2).tables_created > 0


# ---------------------------------------------------------------------------
# 3. pack apply


def test_admin_customized_field_survives_pack_reapply(engine: Engine) -> None:
    with_platform(engine)
    packs_apply.apply_pack(engine, app_pack())
    with engine.begin() as conn:
        conn.execute(
            update(t.field_meta)
            .where(t.field_meta.c.Id == catalog.field_id("Gizmo__c", "Color__c"))
            .values(IsCustomized=True, Label="Colour (admin)")
        )
        conn.execute(
            update(t.object_meta)
            .where(t.object_meta.c.ApiName == "Gizmo__c")
            .values(IsCustomized=True, PluralLabel="Gizmoz")
        )

    packs_apply.apply_pack(engine, app_pack())
    v2 = app_pack(
        fields=[
            {"api_name": "Size__c", "label": "Size", "type": "Number"},
            {"api_name": "Color__c", "label": "Shade", "type": "Text", "length": 40},
            {"api_name": "Weight__c", "label": "Weight", "type": "Number"},
        ]
    )
    packs_apply.apply_pack(engine, v2)
    with engine.connect() as conn:
        fields = field_rows(conn, "Gizmo__c")
        assert fields["Color__c"]["Label"] == "Colour (admin)"
        assert fields["Weight__c"]["Label"] == "Weight"
        assert object_rows(conn)["Gizmo__c"]["PluralLabel"] == "Gizmoz"
        row = pack_row(conn, "gizmo-app")
    assert row is not None and row["Status"] == "active"
    assert row["PayloadHash"] == payload_hash(v2)


def test_object_owned_by_another_pack_is_refused(engine: Engine) -> None:
    with_platform(engine)
    packs_apply.apply_pack(engine, app_pack("alpha-app"))
    beta = app_pack("beta-app", fields=[{"api_name": "Beta__c", "type": "Text"}])
    with pytest.raises(PackError) as info:
        packs_apply.apply_pack(engine, beta)
    message = str(info.value)
    assert "beta-app" in message and "alpha-app" in message and "Gizmo__c" in message
    with engine.connect() as conn:
        assert object_rows(conn)["Gizmo__c"]["PackName"] == "alpha-app"
        assert "Beta__c" not in field_rows(conn, "Gizmo__c")
        beta_row = pack_row(conn, "beta-app")
    assert beta_row is not None and beta_row["Status"] == "failed"


def test_lookup_to_unknown_object_fails_and_records_failed_pack(engine: Engine) -> None:
    with_platform(engine)
    pack = app_pack(
        fields=[
            {"api_name": "Size__c", "type": "Number"},
            {"api_name": "Ref__c", "type": "Lookup", "reference_to": "Nowhere__c"},
        ]
    )
    with pytest.raises(PackError, match=r"Gizmo__c\.Ref__c.*Nowhere__c"):
        packs_apply.apply_pack(engine, pack)
    assert "Gizmo__c" not in table_names(engine)
    with engine.connect() as conn:
        assert "Gizmo__c" not in object_rows(conn)
        row = pack_row(conn, "gizmo-app")
    assert row is not None
    assert row["Status"] == "failed"
    assert "Ref__c" in (row["LastError"] or "")
    assert row["PayloadHash"] == payload_hash(pack)


def _block_with_view(engine: Engine, name: str) -> None:
    """A view squatting on the table name makes CREATE TABLE fail mid-apply."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE VIEW {quote(conn, name)} AS SELECT 1 AS x")


def test_app_pack_failing_mid_apply_is_recorded_failed(engine: Engine) -> None:
    with_platform(engine)
    _block_with_view(engine, "Gizmo__c")
    pack = app_pack()
    with pytest.raises(Exception, match="Gizmo__c"):
        packs_apply.apply_pack(engine, pack)
    with engine.connect() as conn:
        row = pack_row(conn, "gizmo-app")
        assert "Gizmo__c" not in object_rows(conn)
    assert row is not None
    assert row["Status"] == "failed"
    assert "Gizmo__c" in (row["LastError"] or "")
    assert row["PayloadHash"] == payload_hash(pack)


def test_app_pack_failing_mid_apply_raises_pack_error(engine: Engine) -> None:
    with_platform(engine)
    _block_with_view(engine, "Gizmo__c")
    with pytest.raises(PackError, match="gizmo-app"):
        packs_apply.apply_pack(engine, app_pack())


def test_new_field_adds_column_and_keeps_data(engine: Engine) -> None:
    with_platform(engine)
    packs_apply.apply_pack(engine, app_pack())
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO Gizmo__c (Id, Name, Size__c, Color__c, IsDeleted) "
            "VALUES ('g1', 'first', 3, 'red', 0)"
        )
    v2 = app_pack(
        fields=[
            {"api_name": "Size__c", "label": "Size", "type": "Number"},
            {"api_name": "Color__c", "label": "Color", "type": "Text", "length": 40},
            {"api_name": "Weight__c", "label": "Weight", "type": "Number", "scale": 2},
            {"api_name": "Spot__c", "label": "Spot", "type": "Location"},
        ]
    )
    result = packs_apply.apply_pack(engine, v2)
    assert (result.tables_created, result.columns_added) == (0, 3)
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT Name, Size__c, Color__c, Weight__c, Spot__Latitude__s FROM Gizmo__c")
        ).one()
        assert tuple(row) == ("first", 3, "red", None, None)
        assert set(field_rows(conn, "Gizmo__c")) == {"Size__c", "Color__c", "Weight__c", "Spot__c"}
        conn.exec_driver_sql("UPDATE Gizmo__c SET Weight__c = 1.25 WHERE Id = 'g1'")
        pack = pack_row(conn, "gizmo-app")
    assert pack is not None and pack["PayloadHash"] == payload_hash(v2)
    assert packs_apply.apply_pack(engine, v2) == packs_apply.PackApplyResult("gizmo-app", 0, 0, 0)

    # A field the pack no longer declares keeps its column and data.
    packs_apply.apply_pack(engine, app_pack(fields=[{"api_name": "Color__c", "type": "Text"}]))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT Size__c FROM Gizmo__c")).scalar_one() == 3


# ---------------------------------------------------------------------------
# 4. EnsureIndexes resume


class WorkerDied(Exception):
    """Raised from the progress callback: the activity died after a heartbeat."""


def test_ensure_indexes_resumes_from_heartbeat_and_is_idempotent(engine: Engine) -> None:
    with_platform(engine)
    specs = indexes.standard_indexes(engine)
    total = len(specs)
    assert total > 4
    k = total // 2

    def die_at_k(done: int, _total: int, _name: str) -> None:
        if done == k:
            raise WorkerDied

    with pytest.raises(WorkerDied):
        indexes.ensure_indexes(engine, progress=die_at_k)

    seen: list[tuple[int, int, str]] = []
    result = indexes.ensure_indexes(
        engine, start_at=k, progress=lambda d, n, name: seen.append((d, n, name))
    )
    assert seen == [(i + 1, total, specs[i].name) for i in range(k, total)]
    assert (result.created, result.existing, result.total) == (total - k, k, total)
    for spec in specs:
        assert spec.name in index_names(engine, spec.table), spec

    again = indexes.ensure_indexes(engine)
    assert (again.created, again.existing, again.total) == (0, total, total)


# ---------------------------------------------------------------------------
# 5. verify


def full_apply(engine: Engine) -> dict[str, str]:
    """The ApplyAll phases as domain calls; returns the planned hashes."""
    metadata.apply_metadata(engine)
    repair.run_repair(engine, fail_closed_on_convergence=True)
    plan = packs_apply.load_plan(engine, [], include_dev_sample=True)
    packs_apply.apply_packs(engine, plan)
    derived.rebuild_derived(engine)
    indexes.ensure_indexes(engine)
    return verify.expected(plan)


def test_verify_names_each_drift(engine: Engine) -> None:
    expected = full_apply(engine)
    assert set(expected) == {"platform-core", "dev-sample"}
    assert verify.verify(engine, expected) == []

    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP VIEW {quote(conn, 'v_Account')}")
    findings = verify.verify(engine, expected)
    assert len(findings) == 1 and "v_Account is missing" in findings[0], findings

    # A readable but wrong view is a finding too: verify compares its definition
    # with what the formula compiler builds now.
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE VIEW {quote(conn, 'v_Account')} AS SELECT 1 AS x")
    findings = verify.verify(engine, expected)
    assert len(findings) == 1 and "v_Account" in findings[0], findings
    assert "compiler" in findings[0] or "changed" in findings[0], findings
    derived.rebuild_derived(engine)
    assert verify.verify(engine, expected) == []

    drop_index(engine, "Contact", "ix_Contact_Name")
    findings = verify.verify(engine, expected)
    assert len(findings) == 1 and "ix_Contact_Name" in findings[0], findings
    indexes.ensure_indexes(engine)

    with engine.begin() as conn:
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.Name == "dev-sample")
            .values(PayloadHash="0" * 64)
        )
    findings = verify.verify(engine, expected)
    assert findings and all("dev-sample" in f for f in findings), findings
    # Even without a plan to compare with, the row no longer matches its payload.
    findings = verify.verify(engine)
    assert len(findings) == 1 and "dev-sample" in findings[0], findings

    # A planned pack that is missing from the database is a finding too.
    findings = verify.verify(engine, {**expected, "ghost-app": "f" * 64})
    assert any("ghost-app" in f for f in findings), findings


def test_verify_reports_missing_table_and_column(engine: Engine) -> None:
    full_apply(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP VIEW {quote(conn, 'v_Demo_Task__c')}")
        conn.exec_driver_sql(f"DROP TABLE {quote(conn, 'Demo_Task__c')}")
    findings = verify.verify(engine)
    assert any("Demo_Task__c" in f and "table" in f for f in findings), findings
    assert "v_Demo_Task__c" not in view_names(engine)


# ---------------------------------------------------------------------------
# 6. settings: the database id


def test_database_id_is_stable_distinct_and_secret_free(tmp_path: Path) -> None:
    a = f"sqlite:///{tmp_path / 'one' / 'nexus.db'}"
    b = f"sqlite:///{tmp_path / 'two' / 'nexus.db'}"
    assert database_id_for_url(a) == database_id_for_url(a)
    assert database_id_for_url(a) != database_id_for_url(b)
    assert re.fullmatch(r"[a-z0-9-]+", database_id_for_url(a))

    crm = "mysql+pymysql://nexus:Sup3rS3cret@db-host:3306/crm_eu"
    others = [
        "mysql+pymysql://nexus:Sup3rS3cret@db-host:3306/crm_staging",
        "mysql+pymysql://nexus:Sup3rS3cret@db-host:3306/crm-eu",  # same slug, other database
        "mysql+pymysql://nexus:Sup3rS3cret@db-host2:3306/crm_eu",
    ]
    ids = {database_id_for_url(u) for u in [crm, *others]}
    assert len(ids) == 4
    for db_id in ids:
        assert "sup3rs3cret" not in db_id.lower()
        assert re.fullmatch(r"[a-z0-9-]+", db_id)
    # The password is not part of the identity: rotating it keeps the workflow id.
    rotated = make_url(crm).set(password="an0ther").render_as_string(hide_password=False)
    assert database_id_for_url(rotated) == database_id_for_url(crm)


def test_database_id_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nexus.db'}"
    monkeypatch.setenv("NEXUS_DATABASE_URL", url)
    monkeypatch.delenv("NEXUS_DATABASE_ID", raising=False)
    assert Settings().database_id == database_id_for_url(url)
    monkeypatch.setenv("NEXUS_DATABASE_ID", "Prod EU 1")
    settings = Settings()
    assert settings.database_id == "prod-eu-1"
    assert settings.controlplane_workflow_id == "controlplane/prod-eu-1"


def test_plan_validation_catches_conflicts_before_any_pack_is_applied(engine: Engine) -> None:
    with_platform(engine)
    packs_apply.apply_pack(engine, app_pack("alpha-app"))
    catalog.CACHE.invalidate()
    beta = app_pack("beta-app", fields=[{"api_name": "Beta__c", "type": "Text"}])
    # Two packs of one plan claiming the same new object: caught from the plan alone.
    gamma = app_pack("gamma-app", obj="Widget__c")
    delta = app_pack("delta-app", obj="Widget__c")
    cat = catalog.CACHE.get(engine)
    with pytest.raises(PackError, match=r"(?s)beta-app.*Gizmo__c.*alpha-app"):
        packs_apply.validate_plan(cat, [beta])
    with pytest.raises(PackError, match=r"(?s)delta-app.*Widget__c.*gamma-app"):
        packs_apply.validate_plan(cat, [gamma, delta])
    # The head names the pack with the problem, not every pack of the plan.
    fine = app_pack("epsilon-app", obj="Sprocket__c")
    with pytest.raises(PackError) as info:
        packs_apply.validate_plan(cat, [fine, beta])
    head = str(info.value).split(":", 1)[0]
    assert "beta-app" in head and "epsilon-app" not in head, str(info.value)
    with engine.connect() as conn:
        assert pack_row(conn, "beta-app") is None  # nothing recorded: the plan is read-only
    assert "Widget__c" not in table_names(engine)


def test_stored_field_type_change_is_refused_and_verify_sees_column_drift(engine: Engine) -> None:
    with_platform(engine)
    packs_apply.apply_pack(engine, app_pack("alpha-app"))
    catalog.CACHE.invalidate()
    changed = app_pack(
        "alpha-app",
        fields=[
            {"api_name": "Size__c", "type": "Number"},
            {"api_name": "Color__c", "type": "Number"},
        ],
    )
    with pytest.raises(PackError, match=r"Color__c: changes type from Text to Number"):
        packs_apply.apply_pack(engine, changed)
    # Same family is fine: Text(40) -> TextArea.
    widened = app_pack(
        "alpha-app",
        fields=[
            {"api_name": "Size__c", "type": "Number"},
            {"api_name": "Color__c", "type": "TextArea"},
        ],
    )
    packs_apply.apply_pack(engine, widened)
    # Metadata edited behind the control plane's back: verify reports the column.
    with engine.begin() as conn:
        conn.execute(
            update(t.field_meta)
            .where(t.field_meta.c.ObjectApiName == "Gizmo__c", t.field_meta.c.ApiName == "Color__c")
            .values(FieldType="Date")
        )
        catalog.bump_version(conn)
    findings = verify.verify(engine, check_indexes=False)
    assert any("Gizmo__c.Color__c: column Color__c is" in f and "Date" in f for f in findings)


def test_a_wider_field_widens_its_column_and_a_narrower_one_is_refused(engine: Engine) -> None:
    """Columns were only ever added: a Text field whose length grew (10 -> 100) kept
    ``VARCHAR(10)`` on MariaDB, and a value the new length allows failed to store
    (1406 'Data too long'). A wider length, precision or scale now widens the column
    in place (``MODIFY COLUMN``, MySQL family; SQLite stores any length); a narrower
    one is refused with the pack's other problems (values already stored may not
    fit), naming the field and both sizes, and nothing of it is written."""
    mysql = engine.dialect.name == "mysql"

    def pack(code: int, precision: int, scale: int) -> PackManifest:
        return app_pack(
            fields=[
                {"api_name": "Code__c", "type": "Text", "length": code},
                {"api_name": "Amount__c", "type": "Number", "precision": precision,
                 "scale": scale},
            ]
        )  # fmt: skip

    with_platform(engine)
    packs_apply.apply_pack(engine, pack(10, 10, 2))
    wider = pack(100, 16, 4)
    result = packs_apply.apply_pack(engine, wider)
    assert (result.columns_added, result.columns_widened) == (0, 2 if mysql else 0)
    code, amount = "x" * 100, Decimal("123456789012.1234")
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO Gizmo__c (Id, Name, Code__c, Amount__c, IsDeleted) "
                 "VALUES ('g1', 'one', :c, :a, 0)"),
            {"c": code, "a": str(amount)},
        )  # fmt: skip
    with engine.connect() as conn:
        row = conn.execute(text("SELECT Code__c, Amount__c FROM Gizmo__c")).one()
    assert row[0] == code and Decimal(str(row[1])) == amount
    assert packs_apply.apply_pack(engine, wider) == packs_apply.PackApplyResult(
        "gizmo-app", 0, 0, 0, 0
    )
    # narrower: a shorter text, fewer decimals (even with more integer digits)
    for narrower, said in (
        (pack(50, 16, 4), "Gizmo__c.Code__c: length 100 shrinks to length 50"),
        (pack(100, 18, 2), "Gizmo__c.Amount__c: precision 16, scale 4 shrinks to precision 18"),
        (pack(100, 12, 4), "Gizmo__c.Amount__c: precision 16, scale 4 shrinks to precision 12"),
    ):
        with pytest.raises(PackProblems) as info:
            packs_apply.validate_against(engine, [narrower])
        report = [p.line() for p in info.value.problems]
        assert any(line.startswith(said) and "cannot shrink" in line for line in report), report
        assert len(report) == 1, report
    with engine.connect() as conn:
        lengths = conn.execute(
            select(t.field_meta.c.ApiName, t.field_meta.c.Length, t.field_meta.c.Precision)
            .where(t.field_meta.c.ObjectApiName == "Gizmo__c")
        ).all()  # fmt: skip
    assert {(n, ln, p) for n, ln, p in lengths} >= {("Code__c", 100, None), ("Amount__c", None, 16)}


def test_a_formula_field_no_longer_declared_leaves_the_catalog(engine: Engine) -> None:
    """Formula and Summary fields store nothing. One deleted from the pack's source,
    or every one of a removed pack, stayed in ``_System_Field`` for ever (a broken
    one warned at every status and could never go). Now the next apply drops the
    ones the pack no longer declares and ``packs remove`` drops the pack's; stored
    fields keep their row, column and data."""
    with_platform(engine)
    size = {"api_name": "Size__c", "type": "Number"}
    double = {"api_name": "Double__c", "type": "Number", "formula": "Size__c * 2"}
    label = {"api_name": "Label__c", "type": "Text", "formula": "TEXT(Size__c)"}
    packs_apply.apply_pack(engine, app_pack(fields=[size, double, label]))
    with engine.connect() as conn:
        assert set(field_rows(conn, "Gizmo__c")) == {"Size__c", "Double__c", "Label__c"}
    result = packs_apply.apply_pack(engine, app_pack(fields=[size, label]))
    assert result.rows_written >= 1
    with engine.connect() as conn:
        assert set(field_rows(conn, "Gizmo__c")) == {"Size__c", "Label__c"}
    # converged: nothing more to drop or write
    again = packs_apply.apply_pack(engine, app_pack(fields=[size, label]))
    assert again == packs_apply.PackApplyResult("gizmo-app", 0, 0, 0, 0)
    # a stored field the pack drops keeps its row (and column)
    packs_apply.apply_pack(engine, app_pack(fields=[label]))
    with engine.connect() as conn:
        assert set(field_rows(conn, "Gizmo__c")) == {"Size__c", "Label__c"}
    packs_apply.remove_pack(engine, "gizmo-app")
    with engine.connect() as conn:
        assert set(field_rows(conn, "Gizmo__c")) == {"Size__c"}
        conn.execute(text("SELECT Size__c FROM Gizmo__c")).all()


def test_a_restricted_picklist_takes_only_its_values(engine: Engine, tmp_path: Path) -> None:
    """Salesforce refuses a value outside a restricted picklist; the values were never
    checked here. ``restricted`` (native) or ``<valueSet><restricted>`` (SFDX: 60
    fields of the corpus) round-trips through ``_System_Field.IsRestricted``, and the
    value an inbound event stores (:func:`stored_value`, value-invalid otherwise) must
    be one of the values, each of a multi-select's. An unrestricted picklist takes
    any text; a pack that restricts nothing keeps its payload hash."""
    from nexuscrm.fieldvalues import ValueProblem, stored_value
    from nexuscrm.packs.hashing import canonical_payload
    from nexuscrm.packs.sfdx import load_sfdx
    from tests.builders import corpus_project

    stage = {"api_name": "Stage__c", "type": "Picklist", "picklist_values": ["Open", "Won"],
             "restricted": True}  # fmt: skip
    tags = {"api_name": "Tags__c", "type": "MultiselectPicklist",
            "picklist_values": ["a", "b", "c"], "restricted": True}  # fmt: skip
    free = {"api_name": "Free__c", "type": "Picklist", "picklist_values": ["x"]}
    with_platform(engine)
    packs_apply.apply_pack(engine, app_pack(fields=[stage, tags, free]))
    catalog.CACHE.invalidate()
    fields = {f.api_name: f for f in catalog.CACHE.get(engine).get("Gizmo__c").fields}  # type: ignore[union-attr]
    assert (fields["Stage__c"].restricted, fields["Tags__c"].restricted) == (True, True)
    assert fields["Free__c"].restricted is False
    assert stored_value(fields["Stage__c"], "Won") == "Won"
    assert stored_value(fields["Tags__c"], ["a", "c"]) == "a;c"
    assert stored_value(fields["Free__c"], "anything") == "anything"
    with pytest.raises(ValueProblem, match=r"'Lost' is not a value of this restricted picklist"):
        stored_value(fields["Stage__c"], "Lost")
    with pytest.raises(ValueProblem, match=r"'won' is not a value"):  # exact, as Salesforce
        stored_value(fields["Stage__c"], "won")
    with pytest.raises(ValueProblem, match=r"'d' is not a value"):
        stored_value(fields["Tags__c"], "a;d")
    # the manifest refuses a restriction that cannot hold
    for bad, said in (
        ({"api_name": "T__c", "type": "Text", "restricted": True}, "cannot be restricted"),
        ({"api_name": "P__c", "type": "Picklist", "restricted": True}, "needs its picklist_values"),
    ):
        with pytest.raises(ValueError, match=said):
            app_pack(fields=[bad])
    # hashes: restricted only where it is set
    assert "restricted" not in canonical_payload(app_pack(fields=[free]))
    assert '"restricted":true' in canonical_payload(app_pack(fields=[stage]))
    # SFDX: DreamHouse's Property__c.Status__c is restricted, and its values come along
    house = load_sfdx(corpus_project("dreamhouse-lwc"))
    prop = next(o for o in house.objects if o.api_name == "Property__c")
    status = next(f for f in prop.fields if f.api_name == "Status__c")
    assert status.restricted and "Available" in status.picklist_values
