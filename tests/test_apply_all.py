"""ApplyAll end to end on a real Temporal dev server and real databases."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import inspect, select, text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput, ApplyAllResult
from nexuscrm.controlplane import markers
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import ControlPlaneBusyError, start_controlplane
from nexusctl.worker import build_worker
from tests.builders import apply_all, corpus_project, snapshot, write_sfdx

ROOT = Path(__file__).resolve().parents[1]


def phase(result: ApplyAllResult, name: str) -> str:
    return next(p.detail or "" for p in result.phases if p.name == name)


async def test_apply_all_installs_platform_and_corpus_packs(temporal_env, settings):
    dreamhouse = corpus_project("dreamhouse-lwc")
    ebikes = corpus_project("ebikes-lwc")
    result = await apply_all(
        temporal_env, settings, app_pack_sources=[str(dreamhouse), str(ebikes)]
    )
    assert result.status == "completed"
    # DreamHouse's Record_Link__c reads $Api.Partner_Server_URL_260, a Salesforce
    # server global that has no meaning here: reported by name, left out of the view.
    assert [p.split(":")[0] for p in result.formula_problems] == ["Property__c.Record_Link__c"]
    engine = make_engine(settings.database_url)
    insp = inspect(engine)
    tables = set(insp.get_table_names())
    for name in ["Account", "Contact", "Case", "Lead", "Opportunity", "User", "Broker__c",
                 "Property__c", "Product__c", "Product_Family__c", "Order__c", "Order_Item__c",
                 "Demo_Task__c"]:  # fmt: skip
        assert name in tables, name
    assert "Manufacturing_Event__e" not in tables  # platform events are metadata only
    prop_cols = {c["name"] for c in insp.get_columns("Property__c")}
    assert {"Location__Latitude__s", "Location__Longitude__s", "Broker__c"} <= prop_cols
    assert "Days_On_Market__c" not in prop_cols  # a formula is computed by the view
    # eBikes extends the standard Case object with its own fields.
    assert "Product__c" in {c["name"] for c in insp.get_columns("Case")}
    with engine.begin() as conn:
        event = conn.execute(
            select(t.object_meta.c.TableType).where(
                t.object_meta.c.ApiName == "Manufacturing_Event__e"
            )
        ).scalar_one()
        assert event == "event"
        listed = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=10)
        conn.execute(
            text(
                "INSERT INTO Property__c (Id, Name, Date_Listed__c, Price__c, IsDeleted) "
                "VALUES ('p1', 'Stucco', :d, 500000, 0)"
            ),
            {"d": listed},
        )
        conn.execute(text("INSERT INTO Property__c (Id, Name, IsDeleted) VALUES ('p2', 'x', 0)"))
        rows: dict[str, Any] = dict(
            conn.execute(text("SELECT Id, Days_On_Market__c FROM v_Property__c")).all()
        )
    assert float(rows["p1"]) == 10
    assert rows["p2"] is None or float(rows["p2"]) >= 0  # blank date: Salesforce gives blank
    idx = {i["name"] for i in insp.get_indexes("Property__c")}
    assert {"ix_Property__c_Name", "ix_Property__c_CreatedDate", "ix_Property__c_Broker__c"} <= idx
    with engine.connect() as conn:
        packs = dict(conn.execute(select(t.installed_pack.c.Name, t.installed_pack.c.Status)).all())
    assert packs["dreamhouse-lwc"] == "active" or any(
        k.startswith("dreamhouse") and v == "active" for k, v in packs.items()
    )
    assert all(v == "active" for v in packs.values()), packs
    marker = markers.read(engine)
    assert marker is not None and marker.status == "completed"

    # A second ApplyAll (sources remembered from the stored payloads) changes nothing.
    before = snapshot(engine)
    catalog.CACHE.invalidate()
    again = await apply_all(temporal_env, settings)
    assert again.status == "completed"
    assert phase(again, "apply-metadata") == "tables created 0, rows written 0"
    assert "tables created 0, columns added 0, rows 0" in phase(again, "apply-packs")
    assert "0 created" in phase(again, "ensure-indexes")
    assert snapshot(engine) == before


async def expect_failure(env: WorkflowEnvironment, settings: Settings, sources: list[str]) -> str:
    with pytest.raises(WorkflowFailureError) as info:
        await apply_all(env, settings, app_pack_sources=sources)
    return str(info.value.cause)


async def test_unknown_field_type_fails_and_names_the_file(temporal_env, settings, tmp_path):
    src = write_sfdx(
        tmp_path / "app",
        {"Good__c": "<label>Good</label><type>Text</type><length>20</length>",
         "Weird__c": "<label>Weird</label><type>Hologram</type>"},
        label="Gadget__c",
        project="broken-app",
    )  # fmt: skip
    message = await expect_failure(temporal_env, settings, [str(src)])
    assert "Weird__c.field-meta.xml" in message and "Hologram" in message
    engine = make_engine(settings.database_url)
    marker = markers.read(engine)
    assert marker is not None and marker.status == "failed"
    assert "Hologram" in (marker.last_error or "")
    assert "Gadget__c" not in inspect(engine).get_table_names()
    with engine.connect() as conn:
        assert (
            conn.execute(
                select(t.object_meta.c.Id).where(t.object_meta.c.ApiName == "Gadget__c")
            ).first()
            is None
        )


async def test_broken_manifest_and_dependency_cycle_fail_with_names(
    temporal_env, settings, tmp_path, caplog
):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad-pack\ncategory: AppPack\nobjects: [\n")
    with caplog.at_level(logging.DEBUG):
        message = await expect_failure(temporal_env, settings, [str(bad)])
    assert "bad.yaml" in message
    # The operator's mistake is one warning line in the worker's log, no traceback.
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]

    def pack(name: str, dep: str) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "name": name,
                    "category": "AppPack",
                    "depends_on": ["platform-core", dep],
                    "objects": [{"api_name": f"{name.title()}__c", "fields": []}],
                }
            )
        )
        return str(path)

    message = await expect_failure(
        temporal_env, settings, [pack("alpha", "beta"), pack("beta", "alpha")]
    )
    assert "alpha" in message and "beta" in message and "cycle" in message.lower()
    engine = make_engine(settings.database_url)
    assert "Alpha__c" not in inspect(engine).get_table_names()
    marker = markers.read(engine)
    assert marker is not None and marker.status == "failed"


async def test_second_start_on_same_database_is_refused(temporal_env, settings):
    async with build_worker(temporal_env.client, settings):
        first = await start_controlplane(temporal_env.client, settings, "ApplyAll", ApplyAllInput())
        with pytest.raises(ControlPlaneBusyError, match="is busy: ApplyAll running"):
            await start_controlplane(
                temporal_env.client, settings, "ApplyAll", ApplyAllInput(), no_queue=True
            )
        result = await first.result()
    assert result.status == "completed"
    runs = [
        w
        async for w in temporal_env.client.list_workflows(
            f"WorkflowId = '{settings.controlplane_workflow_id}'"
        )
    ]
    assert len(runs) == 1


def big_pack(path: Path, objects: int = 120, fields: int = 12) -> Path:
    """A native pack large enough that apply-packs takes a few seconds."""
    objs = []
    for i in range(objects):
        objs.append(
            {
                "api_name": f"Bulk{i:03d}__c",
                "label": f"Bulk {i}",
                "fields": [
                    {"api_name": f"F{j:02d}__c", "type": "Number" if j % 2 else "Text"}
                    for j in range(fields)
                ],
            }
        )
    path.write_text(
        yaml.safe_dump(
            {
                "name": "bulk-app",
                "category": "AppPack",
                "depends_on": ["platform-core"],
                "objects": objs,
            }
        )
    )
    return path


async def test_worker_killed_mid_apply_packs_resumes_to_same_result(
    temporal_env, settings, tmp_path
):
    pack_file = big_pack(tmp_path / "bulk.yaml")
    env = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
        "NEXUS_LOG_FORMAT": "json",
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)
    try:
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(pack_file)], heartbeat_timeout_seconds=3),
        )
        for _ in range(600):
            progress = await handle.query("progress")
            status = {p["name"]: p["status"] for p in progress}
            if status.get("apply-packs") == "running":
                break
            assert proc.poll() is None, "worker died before apply-packs"
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"apply-packs never started: {status}")
        await asyncio.sleep(0.5)  # let it get part-way through the packs
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    catalog.CACHE.invalidate()
    async with build_worker(temporal_env.client, settings):
        result = await handle.result()
    assert result.status == "completed"
    engine = make_engine(settings.database_url)
    interrupted = snapshot(engine)

    # Reference: the same ApplyAll, uninterrupted, on a fresh database of the same kind.
    ref_url = _sibling_database(settings.database_url, tmp_path)
    ref = Settings(
        database_url=ref_url,
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        NEXUS_DATABASE_ID=f"ref-{uuid.uuid4().hex[:8]}",
    )
    catalog.CACHE.invalidate()
    try:
        await apply_all(temporal_env, ref, app_pack_sources=[str(pack_file)])
        assert snapshot(make_engine(ref_url)) == interrupted
    finally:
        _drop_sibling(ref_url)


def _sibling_database(url: str, tmp_path: Path) -> str:
    if url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'reference.db'}"
    name = f"nexus_r_{uuid.uuid4().hex[:10]}"
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}`"))
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _drop_sibling(url: str) -> None:
    if url.startswith("sqlite"):
        return
    engine = make_engine(url)
    name = engine.url.database
    with engine.begin() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))


async def test_run_for_another_database_is_refused(temporal_env, settings):
    """A run whose workflow id names another database never touches this worker's database."""
    async with build_worker(temporal_env.client, settings):
        handle = await temporal_env.client.start_workflow(
            "ApplyAll",
            ApplyAllInput(),
            id="controlplane/some-other-database",
            task_queue=settings.controlplane_task_queue,
            result_type=ApplyAllResult,
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
    assert "refusing workflow controlplane/some-other-database" in str(info.value.cause)
    engine = make_engine(settings.database_url)
    assert markers.read(engine) is None  # nothing was marked, let alone applied
