"""ApplyAll's completion gates and the deferred formula-view rebuild (issue 12 items 7, 8),
on a real Temporal dev server, SQLite and MariaDB.

One test per gate (each makes its condition unmet and expects the run to fail
in that gate's phase, never completed), the defense-in-depth re-stamp, the
post-completion rebuild-debt check, and the defer rules: precondition
refusals, no view created or replaced, the write-ahead receipt, auto-start
refusing while debt is owed (also after a failed defer apply), settlement
only by a fenced full rebuild.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine, text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllResult, OperationInput
from nexuscrm.controlplane import derived, markers
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import view_names
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import apply_all


def gizmo_pack(path: Path, factor: int, extra_object: bool = False) -> Path:
    """AppPack ``gizmo-app``: ``Gizmo__c`` with ``Scaled__c = Amount__c * factor``."""
    objects: list[dict[str, Any]] = [
        {
            "api_name": "Gizmo__c",
            "fields": [
                {"api_name": "Amount__c", "type": "Number", "precision": 18, "scale": 2},
                {"api_name": "Scaled__c", "type": "Number", "formula": f"Amount__c * {factor}"},
            ],
        }
    ]
    if extra_object:
        objects.append({"api_name": "Widget__c", "fields": []})
    path.write_text(
        yaml.safe_dump(
            {
                "name": "gizmo-app",
                "category": "AppPack",
                "depends_on": ["platform-core"],
                "objects": objects,
            }
        )
    )
    return path


async def failure(env: WorkflowEnvironment, settings: Settings, **kw: Any) -> str:
    """Run ApplyAll expecting it to fail; the failure message."""
    catalog.CACHE.invalidate()
    with pytest.raises(WorkflowFailureError) as info:
        await apply_all(env, settings, **kw)
    return str(info.value.cause)


async def converged(env: WorkflowEnvironment, settings: Settings, **kw: Any) -> ApplyAllResult:
    catalog.CACHE.invalidate()
    result = await apply_all(env, settings, **kw)
    assert result.status in ("completed", "skipped"), result
    return result


async def operation(env: WorkflowEnvironment, settings: Settings, workflow: str) -> None:
    catalog.CACHE.invalidate()
    async with build_worker(env.client, settings):
        handle = await start_controlplane(env.client, settings, workflow, OperationInput())
        await handle.result()


def status(engine: Engine, key: str = markers.APPLY_ALL_KEY) -> str | None:
    marker = markers.read(engine, key)
    return None if marker is None else marker.status


def scaled(engine: Engine) -> float:
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM Gizmo__c"))
        conn.execute(
            text("INSERT INTO Gizmo__c (Id, Name, Amount__c, IsDeleted) VALUES ('g', 'g', 10, 0)")
        )
        return float(conn.execute(text("SELECT Scaled__c FROM v_Gizmo__c")).scalar_one())


def hook(script: Path, code: str) -> str:
    """A final-verify hook: ``code`` written to ``script``, run by this Python.

    The hook runs with NEXUS_DATABASE_URL / NEXUS_FINAL_VERIFY_PATH set.
    """
    script.write_text(code)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


# --- completion gates ----------------------------------------------------------


def _event(conn: Any, event_id: str, ordinal: int) -> None:
    conn.execute(
        t.connector_event.insert().values(
            EventId=event_id,
            InstalledPackId="legacy-pack",
            EventKind="legacy.event",
            IdempotencyKey=event_id,
            EnqueueOrdinal=ordinal,
        )
    )


async def test_enqueue_ordinal_gate_refuses_completion(temporal_env, settings):
    await converged(temporal_env, settings)
    engine = make_engine(settings.database_url)
    with engine.begin() as conn:  # an old writer's event: no ordinal
        _event(conn, "legacy-ev-1", 0)
    message = await failure(temporal_env, settings)
    assert "connector-event-enqueue-ordinal-final-gate" in message
    assert "connector event enqueue ordinal backfill is not complete" in message
    assert "legacy-ev-1" in message
    assert status(engine) == "failed"
    with engine.begin() as conn:
        conn.execute(t.connector_event.update().values(EnqueueOrdinal=7))
    result = await converged(temporal_env, settings)
    assert "every connector event has an enqueue ordinal" in next(
        p.detail or ""
        for p in result.phases
        if p.name == "connector-event-enqueue-ordinal-final-gate"
    )
    assert status(engine) == "completed"


async def test_source_lane_gate_refuses_completion(temporal_env, settings):
    await converged(temporal_env, settings)
    engine = make_engine(settings.database_url)
    with engine.begin() as conn:
        _event(conn, "ev-lane-1", 1)
        conn.execute(
            t.connector_work_item.insert().values(
                WorkId="wi-lane-1",
                EventId="ev-lane-1",
                InstalledPackId="legacy-pack",
                WorkType="ConnectorEvent",
                State="pending",
                SourceLaneKey=None,
                LaneOrdinal=1,
            )
        )
    message = await failure(temporal_env, settings)
    assert "connector-event-source-lane-final-gate" in message
    assert "connector event source-lane backfill is not complete" in message
    assert "wi-lane-1" in message
    assert status(engine) == "failed"
    with engine.begin() as conn:
        conn.execute(t.connector_work_item.update().values(SourceLaneKey="legacy/Account/1"))
    await converged(temporal_env, settings)
    assert status(engine) == "completed"


async def test_listview_legacy_cutover_gate_refuses_completion(temporal_env, settings):
    await converged(temporal_env, settings)
    engine = make_engine(settings.database_url)
    with engine.begin() as conn:  # a migrated database's legacy list views, one without owner
        conn.execute(
            text("CREATE TABLE _System_ListView (Id VARCHAR(64) PRIMARY KEY, OwnerId VARCHAR(64))")
        )
        conn.execute(
            text("INSERT INTO _System_ListView (Id, OwnerId) VALUES ('lv1', NULL), ('lv2', 'u1')")
        )
    message = await failure(temporal_env, settings)
    assert "listview-legacy-cutover-final-gate" in message
    assert "list-view legacy cutover is not complete" in message
    assert "1 row(s) without an OwnerId" in message
    assert status(engine) == "failed"
    with engine.begin() as conn:
        conn.execute(text("UPDATE _System_ListView SET OwnerId = 'u1'"))
    await converged(temporal_env, settings)
    assert status(engine) == "completed"


async def test_source_revision_gate_refuses_a_source_that_moved_during_the_run(
    temporal_env, settings, tmp_path
):
    pack = gizmo_pack(tmp_path / "gizmo.yaml", 2)
    await converged(temporal_env, settings, app_pack_sources=[str(pack)])
    # The source advances after apply-packs (the final-verify hook runs just
    # before the gates): verify passes on what was planned, the gate does not.
    moving = settings.model_copy(
        update={
            "final_verify_command": hook(
                tmp_path / "move.py",
                "import pathlib\n"
                f"p = pathlib.Path({str(pack)!r})\n"
                "p.write_text(p.read_text().replace('Amount__c * 2', 'Amount__c * 5'))\n",
            )
        }
    )
    message = await failure(temporal_env, moving, app_pack_sources=[str(pack)])
    assert "source-revision-advance-final-gate" in message
    assert "1 pending source revision advance(s): pack gizmo-app: installed" in message
    engine = make_engine(settings.database_url)
    assert status(engine) == "failed"


# --- defer: precondition, no view replaced, receipts, settlement ---------------------


async def test_defer_precondition_refuses_before_any_write(temporal_env, settings, tmp_path):
    message = await failure(temporal_env, settings, defer_formula_view_rebuild=True)
    assert "defer-precondition" in message
    assert "DeferFormulaViewRebuild requires an already-bootstrapped database" in message
    engine = make_engine(settings.database_url)
    assert status(engine) is None  # no running marker, no failed marker
    assert status(engine, markers.REBUILD_OWED_KEY) is None

    await converged(temporal_env, settings)
    with engine.begin() as conn:
        conn.execute(text("DROP VIEW v_Account"))
    message = await failure(temporal_env, settings, defer_formula_view_rebuild=True)
    assert (
        "DeferFormulaViewRebuild precondition failed: object Account requires formula view "
        "v_Account but it does not exist"
    ) in message
    assert status(engine) == "completed"  # untouched: refused at entry
    assert status(engine, markers.REBUILD_OWED_KEY) is None


async def test_defer_keeps_old_views_until_a_fenced_rebuild_settles_the_debt(
    temporal_env, settings, tmp_path
):
    pack = gizmo_pack(tmp_path / "gizmo.yaml", 2)
    await converged(temporal_env, settings, app_pack_sources=[str(pack)])
    engine = make_engine(settings.database_url)
    assert scaled(engine) == 20

    gizmo_pack(pack, 3)  # the release changes the formula
    result = await converged(
        temporal_env, settings, app_pack_sources=[str(pack)], defer_formula_view_rebuild=True
    )
    assert result.status == "completed"
    assert scaled(engine) == 20  # the view old pods serve was not replaced
    assert status(engine) == "completed"
    assert status(engine, markers.REBUILD_OWED_KEY) == "pending"
    names = [p.name for p in result.phases]
    assert names.index("defer-precondition") < names.index("mark-rebuild-owed")
    assert names.index("mark-rebuild-owed") < names.index("mark-running")

    # Auto-start refuses every action while the debt is owed (no skip, no apply).
    message = await failure(temporal_env, settings, policy="auto_start")
    assert "rebuild-debt-entry-gate" in message
    assert "auto-start refuses every action while the debt is outstanding" in message
    assert status(engine) == "completed"

    # An unfenced rebuild (no lease) rebuilds but never settles the debt.
    catalog.CACHE.invalidate()
    derived.rebuild_derived(engine, settle_rebuild_debt=True)
    assert scaled(engine) == 30
    assert status(engine, markers.REBUILD_OWED_KEY) == "pending"

    # The deployment's fenced RebuildDerived settles it; then auto-start may skip.
    await operation(temporal_env, settings, "RebuildDerived")
    assert status(engine, markers.REBUILD_OWED_KEY) == "cleared"
    await converged(temporal_env, settings)  # RebuildDerived invalidated the marker
    skipped = await converged(temporal_env, settings, policy="auto_start")
    assert skipped.status == "skipped"


async def test_failed_defer_apply_leaves_the_debt_and_auto_start_refuses(
    temporal_env, settings, tmp_path
):
    pack = gizmo_pack(tmp_path / "gizmo.yaml", 2)
    await converged(temporal_env, settings, app_pack_sources=[str(pack)])
    engine = make_engine(settings.database_url)
    # The release introduces a new object: under defer its view cannot be made.
    gizmo_pack(pack, 2, extra_object=True)
    message = await failure(
        temporal_env, settings, app_pack_sources=[str(pack)], defer_formula_view_rebuild=True
    )
    assert "rebuild-derived" in message
    assert "formula view v_Widget__c for Widget__c is missing under DeferFormulaViewRebuild" in (
        message
    )
    assert status(engine) == "failed"
    # Stamped before any mutation, so the failed apply leaves it visible.
    assert status(engine, markers.REBUILD_OWED_KEY) == "pending"
    assert "v_Widget__c" not in view_names(engine)

    # failed marker + owed debt: auto-start refuses instead of applying.
    message = await failure(temporal_env, settings, policy="auto_start")
    assert "auto-start refuses every action while the debt is outstanding" in message
    assert status(engine) == "failed"

    # A standard (non-defer) ApplyAll is a fenced full rebuild: it settles the debt.
    await converged(temporal_env, settings, app_pack_sources=[str(pack)])
    assert status(engine, markers.REBUILD_OWED_KEY) == "cleared"
    assert "v_Widget__c" in view_names(engine)


async def test_defer_restamps_the_debt_before_completed(temporal_env, settings, tmp_path):
    pack = gizmo_pack(tmp_path / "gizmo.yaml", 2)
    await converged(temporal_env, settings, app_pack_sources=[str(pack)])
    # Something clears the receipt mid-run (the seed's window: a rebuild that
    # ran while this apply's lock session was lost). The final-verify hook runs
    # after rebuild-derived and before the gates.
    clearing = settings.model_copy(
        update={
            "final_verify_command": hook(
                tmp_path / "clear.py",
                "import os\n"
                "from sqlalchemy import create_engine, text\n"
                "with create_engine(os.environ['NEXUS_DATABASE_URL']).begin() as c:\n"
                "    c.execute(text(\"UPDATE _System_BootstrapState SET Status='cleared' \"\n"
                "                   \"WHERE StateKey='formula_view_rebuild_owed'\"))\n",
            )
        }
    )
    result = await converged(
        temporal_env, clearing, app_pack_sources=[str(pack)], defer_formula_view_rebuild=True
    )
    assert result.status == "completed"
    names = [p.name for p in result.phases]
    assert names.index("restamp-rebuild-owed") < names.index("mark-completed")
    engine = make_engine(settings.database_url)
    assert status(engine, markers.REBUILD_OWED_KEY) == "pending"


async def test_auto_start_never_succeeds_with_debt_owed_after_its_apply(
    temporal_env, settings, tmp_path
):
    pack = gizmo_pack(tmp_path / "gizmo.yaml", 2)
    await converged(temporal_env, settings, app_pack_sources=[str(pack)])
    await operation(temporal_env, settings, "RunRepair")  # marker invalidated: auto-start applies
    engine = make_engine(settings.database_url)
    assert status(engine) == "invalidated"
    message = await failure(
        temporal_env, settings, policy="auto_start", defer_formula_view_rebuild=True
    )
    assert "rebuild-debt-final-gate" in message
    assert "formula view rebuild owed after auto-start apply" in message
    # The apply itself completed (the marker says so); only serving is refused.
    assert status(engine) == "completed"
    assert status(engine, markers.REBUILD_OWED_KEY) == "pending"
