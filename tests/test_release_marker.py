"""The completed marker proves the release; auto-start decides before it writes;
the WorkItem-only cutover is fail-closed; packs go active after the whole loop;
the lease check holds against a zombie; partial applies and DevSample in
production are refused (issue 12 items 3-6 and parts of 10).

Real Temporal dev server, SQLite and MariaDB.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Connection, Engine, delete, insert, inspect, select, text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm.clock import utcnow
from nexuscrm.contracts import ApplyAllInput, ApplyAllResult, OperationInput
from nexuscrm.controlplane import lease, markers, release, repair
from nexuscrm.cutover import CUTOVER_RECEIPT_KEY
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import quote, table_names
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import LeaseLostError, NexusError
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import apply_all, cli_env, invoke_async

DROPPED = ("_System_RuntimeCommand", "CompanionPackInstallId")


def statuses(result: ApplyAllResult) -> dict[str, str]:
    return {p.name: p.status for p in result.phases}


def proof(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return release.recorded_proof(conn)


def columns(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


async def failure(env: WorkflowEnvironment, settings: Settings, **kw: Any) -> str:
    with pytest.raises(WorkflowFailureError) as info:
        await apply_all(env, settings, **kw)
    cause: BaseException | None = info.value.cause
    messages = []
    while cause is not None:
        messages.append(str(cause))
        cause = cause.__cause__
    return " | ".join(messages)


# --- item 3: the marker proves the release ---------------------------------


async def test_release_adding_a_system_column_is_applied_by_auto_start(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    assert (await apply_all(temporal_env, settings)).status == "completed"
    engine = make_engine(settings.database_url)
    try:
        assert proof(engine) == release.release_fingerprint()
        assert (await apply_all(temporal_env, settings, policy="auto_start")).status == "skipped"

        # The database was completed by a release without this column.
        table, column = DROPPED
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"ALTER TABLE {quote(conn, table)} DROP COLUMN {quote(conn, column)}"
            )
        assert column not in columns(engine, table)

        result = await apply_all(temporal_env, settings, policy="auto_start")
        assert result.status == "completed", result.reason
        classify = next(p for p in result.phases if p.name == "classify")
        assert f"system column {table}.{column} is missing" in (classify.detail or "")
        assert column in columns(engine, table)
        marker = markers.read(engine)
        assert marker is not None and marker.status == "completed"
        assert (await apply_all(temporal_env, settings, policy="auto_start")).status == "skipped"
    finally:
        engine.dispose()


async def test_release_adding_an_index_is_applied_by_auto_start(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    """A database converged by a release without ``ix_ConnectorWorkItem_Target`` (the
    claim's target-lane probe reads it): the fingerprint covers indexes, so the first
    auto-start of this release applies and creates it; then auto-start skips."""
    assert (await apply_all(temporal_env, settings)).status == "completed"
    engine = make_engine(settings.database_url)
    w = t.connector_work_item
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "DROP INDEX ix_ConnectorWorkItem_Target"
                + (f" ON {quote(conn, w.name)}" if conn.dialect.name == "mysql" else "")
            )
            # The older release's proof: this release's fingerprint without the index.
            (target,) = [i for i in w.indexes if i.name == "ix_ConnectorWorkItem_Target"]
            w.indexes.discard(target)
            try:
                older = release.release_fingerprint()
            finally:
                w.indexes.add(target)
            assert older != release.release_fingerprint()
            conn.execute(
                t.bootstrap_state.update()
                .where(t.bootstrap_state.c.StateKey == markers.APPLY_ALL_KEY)
                .values(Proof=older)
            )
        assert "ix_ConnectorWorkItem_Target" not in {
            i["name"] for i in inspect(engine).get_indexes(w.name)
        }
        result = await apply_all(temporal_env, settings, policy="auto_start")
        assert result.status == "completed", result.reason
        assert "ix_ConnectorWorkItem_Target" in {
            i["name"] for i in inspect(engine).get_indexes(w.name)
        }
        assert proof(engine) == release.release_fingerprint()
        assert (await apply_all(temporal_env, settings, policy="auto_start")).status == "skipped"
    finally:
        engine.dispose()


async def test_release_adding_a_repair_step_is_applied_by_auto_start(
    temporal_env: WorkflowEnvironment, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (await apply_all(temporal_env, settings)).status == "completed"
    engine = make_engine(settings.database_url)
    try:
        old = release.release_fingerprint()
        # The next release ships a one-time migration (test-only).
        step = repair.RepairStep(
            "TestOnlyNextReleaseMigration", lambda conn: 0, fatal=True, once=True
        )
        monkeypatch.setattr(repair, "REPAIR_STEPS", (*repair.REPAIR_STEPS, step))
        assert release.release_fingerprint() != old

        result = await apply_all(temporal_env, settings, policy="auto_start")
        assert result.status == "completed", result.reason
        assert statuses(result)["run-repair"] == "completed"
        with engine.connect() as conn:
            stamped = set(conn.execute(select(t.migration.c.MigrationKey)).scalars())
        assert "TestOnlyNextReleaseMigration" in stamped
        assert proof(engine) == release.release_fingerprint()
        assert (await apply_all(temporal_env, settings, policy="auto_start")).status == "skipped"
    finally:
        engine.dispose()


# --- item 4: classification reads before it writes -------------------------


async def test_auto_start_on_a_legacy_database_halts_having_written_nothing(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    engine = make_engine(settings.database_url)
    try:
        t.object_meta.create(engine)
        with engine.begin() as conn:
            conn.execute(
                insert(t.object_meta).values(
                    Id="o1", ApiName="Legacy__c", TableName="Legacy__c", TableType="custom"
                )
            )
        before = table_names(engine)
        message = await failure(temporal_env, settings, policy="auto_start")
        assert "explicit control-plane migration required" in message
        assert table_names(engine) == before == {"_System_Object"}
    finally:
        engine.dispose()


async def test_unknown_policy_is_rejected_before_any_ddl(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    # Refused at submit, before the queue takes it: no workflow, no DDL.
    with pytest.raises(NexusError, match="unknown ApplyAll policy 'sometimes'"):
        await apply_all(temporal_env, settings, policy="sometimes")
    engine = make_engine(settings.database_url)
    try:
        assert table_names(engine) == set()
    finally:
        engine.dispose()


# --- item 5: the WorkItem-only cutover is fail-closed ----------------------


def legacy_owned_event(engine: Engine) -> None:
    """An event owned by a pre-WorkItem execution path, and no receipt yet."""
    with engine.begin() as conn:
        conn.execute(
            insert(t.connector_event).values(
                EventId="ev-legacy",
                InstalledPackId="pack-x",
                EventKind="thing.upsert",
                IdempotencyKey="k1",
                ExecutionOwner="legacy_event",
            )
        )
        conn.execute(
            delete(t.bootstrap_state).where(t.bootstrap_state.c.StateKey == CUTOVER_RECEIPT_KEY)
        )


async def test_pending_cutover_keeps_apply_all_from_completing_and_auto_start_from_skipping(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    assert (await apply_all(temporal_env, settings)).status == "completed"
    engine = make_engine(settings.database_url)
    try:
        legacy_owned_event(engine)
        message = await failure(temporal_env, settings)
        assert "verify-cutover" in message and "legacy_event=1" in message
        marker = markers.read(engine)
        assert marker is not None and marker.status == "failed"
        receipt = markers.read(engine, CUTOVER_RECEIPT_KEY)
        assert receipt is not None and receipt.status == "pending"

        # A database an older release marked completed over the pending receipt:
        # auto-start does not skip (it applies, and fails closed again).
        with engine.begin() as conn:
            markers.mark(
                conn,
                markers.MarkerStatus.completed,
                "old-run",
                "ApplyAll",
                proof=release.release_fingerprint(),
            )
        message = await failure(temporal_env, settings, policy="auto_start")
        assert "verify-cutover" in message and "legacy_event=1" in message
        marker = markers.read(engine)
        assert marker is not None and marker.status == "failed"
    finally:
        engine.dispose()


# --- item 6: packs go active after the whole loop ---------------------------


def write_pack(path: Path, name: str, obj: str, depends_on: list[str]) -> str:
    path.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "category": "AppPack",
                "depends_on": ["platform-core", *depends_on],
                "objects": [
                    {
                        "api_name": obj,
                        "label": obj,
                        "fields": [{"api_name": "Size__c", "type": "Number"}],
                    }
                ],
            }
        )
    )
    return str(path)


def pack_status(engine: Engine) -> dict[str, str]:
    ip = t.installed_pack
    with engine.connect() as conn:
        return {r.Name: r.Status for r in conn.execute(select(ip.c.Name, ip.c.Status))}


async def test_failed_apply_all_leaves_no_earlier_pack_of_the_run_active(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    alpha = write_pack(tmp_path / "alpha.yaml", "alpha-app", "Alpha__c", [])
    beta = write_pack(tmp_path / "beta.yaml", "beta-app", "Beta__c", ["alpha-app"])
    engine = make_engine(settings.database_url)
    try:
        # A view squatting on Beta__c makes the later pack fail mid-apply.
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE VIEW {quote(conn, 'Beta__c')} AS SELECT 1 AS x")
        message = await failure(temporal_env, settings, app_pack_sources=[alpha, beta])
        assert "apply-packs" in message and "Beta__c" in message
        status = pack_status(engine)
        assert status["beta-app"] == "failed"
        assert status["alpha-app"] == "installing", status  # applied, never served

        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP VIEW {quote(conn, 'Beta__c')}")
        result = await apply_all(temporal_env, settings, app_pack_sources=[alpha, beta])
        assert result.status == "completed"
        status = pack_status(engine)
        assert status["alpha-app"] == status["beta-app"] == "active"
    finally:
        engine.dispose()


# --- item 10: the lease check is a locking read -----------------------------


def lease_epoch(engine: Engine) -> int | None:
    with engine.connect() as conn:
        return conn.execute(select(t.controlplane_lease.c.Epoch)).scalar_one_or_none()


async def test_zombie_activity_of_a_terminated_run_cannot_write_after_a_newer_run_took_the_lease(
    temporal_env: WorkflowEnvironment, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Terminate ApplyAll while a repair step is inside its guarded transaction
    (lease checked, write pending); a new run takes the lease; then the zombie
    writes. Each zombie write records the lease epoch current (read on another
    connection) when it wrote: none may have written under a newer epoch."""
    engine = make_engine(settings.database_url)
    paused, go = threading.Event(), threading.Event()

    def zombie_write(key: str, conn: Connection) -> int:
        if key == "zombie-1":
            paused.set()
            go.wait(180)
        current = lease_epoch(engine)
        conn.execute(
            insert(t.migration).values(
                MigrationKey=key, AppliedDate=utcnow(), Detail=f"epoch={current}"
            )
        )
        return 1

    steps = (
        repair.RepairStep("ZombieWrite1", lambda c: zombie_write("zombie-1", c), fatal=True),
        repair.RepairStep("ZombieWrite2", lambda c: zombie_write("zombie-2", c), fatal=True),
    )
    monkeypatch.setattr(repair, "REPAIR_STEPS", (*repair.REPAIR_STEPS, *steps))
    client = temporal_env.client
    try:
        async with build_worker(client, settings):
            zombie = await start_controlplane(client, settings, "ApplyAll", ApplyAllInput())
            assert await asyncio.to_thread(paused.wait, 180), "repair never reached the step"
            zombie_epoch = lease_epoch(engine)
            await zombie.terminate("test: the run dies mid-phase")
            newer = await start_controlplane(client, settings, "EnsureIndexes", OperationInput())
            # Let the newer run take the lease if it can (without the locking read
            # it can at once; with it, it waits for the zombie's transaction).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and lease_epoch(engine) == zombie_epoch:
                await asyncio.sleep(0.2)
            go.set()
            assert (await newer.result()).status == "completed"
        assert lease_epoch(engine) != zombie_epoch
        with engine.connect() as conn:
            rows = {
                r.MigrationKey: r.Detail
                for r in conn.execute(
                    select(t.migration.c.MigrationKey, t.migration.c.Detail).where(
                        t.migration.c.MigrationKey.like("zombie-%")
                    )
                )
            }
        assert all(detail == f"epoch={zombie_epoch}" for detail in rows.values()), rows
        # And any later guarded write of the zombie is refused.
        with engine.begin() as conn, pytest.raises(LeaseLostError):
            lease.require(conn, zombie_epoch)
    finally:
        go.set()
        engine.dispose()


# --- item 10: partial applies and DevSample in production -------------------


async def test_apply_source_convergence_exits_non_zero(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env)
    async with build_worker(temporal_env.client, settings):
        cli = await invoke_async(["apply-source-convergence", "--wait"], env)
    assert cli.exit_code != 0, cli.output
    assert "partial apply" in cli.output
    engine = make_engine(settings.database_url)
    try:
        marker = markers.read(engine)
        assert marker is not None and marker.status == "invalidated"
    finally:
        engine.dispose()


async def test_dev_sample_is_refused_in_production(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    env = cli_env(settings, temporal_env) | {"NEXUS_ENV": "production"}
    production = settings.model_copy(update={"env": "production"})
    async with build_worker(temporal_env.client, production):
        cli = await invoke_async(["apply-all", "--dev-sample", "--wait"], env)
    assert cli.exit_code == 1, cli.output
    assert "--dev-sample" in cli.output and "NEXUS_ENV=production" in cli.output

    # The same input from the temporal CLI: the worker refuses it.
    message = await failure(temporal_env, production, include_dev_sample=True)
    assert "NEXUS_ENV=production" in message and "--dev-sample" in message
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            names = conn.execute(text(f"SELECT Name FROM {quote(conn, '_System_InstalledPack')}"))
            assert "dev-sample" not in set(names.scalars())
    finally:
        engine.dispose()
