"""One view the database refuses does not take the others down (issue 13 item 8).

A table squats on the name of ``Alpha__c``'s view (left by a restore, say):
the database refuses ``v_Alpha__c`` permanently. rebuild-derived still builds
every other view, fails at once (no retries), and names the refused view by
object and database reason.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest
import yaml
from sqlalchemy import text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm.contracts import ApplyAllInput
from nexuscrm.controlplane import derived, markers
from nexuscrm.db.dialect import quote, view_names
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import cli_env, install, invoke_async


def write_pack(path: Path) -> Path:
    """An app pack of two objects, each with a formula field."""
    objects = [
        {
            "api_name": name,
            "label": name,
            "fields": [
                {"api_name": "Amount__c", "type": "Number", "precision": 18, "scale": 2},
                {"api_name": "Double__c", "type": "Number", "formula": "Amount__c * 2"},
            ],
        }
        for name in ("Alpha__c", "Beta__c")
    ]
    doc = {"name": "views-app", "category": "AppPack", "depends_on": ["platform-core"]}
    path.write_text(yaml.safe_dump({**doc, "objects": objects}))
    return path


async def test_refused_view_is_named_and_the_others_are_built(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    pack = write_pack(tmp_path / "views.yaml")
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {quote(conn, 'v_Alpha__c')} (x INTEGER)"))
        started = time.monotonic()
        with pytest.raises(WorkflowFailureError):
            await install(temporal_env, settings, [str(pack)])
        # A permanent refusal is not retried (8 attempts took ~92 s before).
        assert time.monotonic() - started < 60
        marker = markers.read(engine)
        assert marker is not None and marker.status == "failed"
        error = marker.last_error or ""
        assert "rebuild-derived" in error and "ViewRefusedError" in error, error
        assert "view v_Alpha__c of Alpha__c" in error, error
        views = view_names(engine)
        assert {"v_Beta__c", "v_Account", "v_Contact"} <= views, views
        with engine.connect() as conn:
            conn.execute(text(f"SELECT Double__c FROM {quote(conn, 'v_Beta__c')}")).fetchall()
    finally:
        engine.dispose()


async def test_progress_shows_attempt_and_last_error_of_a_retrying_phase(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    """A phase retried with backoff shows its attempt and last error, not just running.

    acquire-lease is a short phase: its one local attempt waits out SQLite's
    30 s busy timeout, then the phase is retried as an activity, whose
    attempts ``progress`` shows (each waits 30 s too)."""
    if not settings.database_url.startswith("sqlite"):
        pytest.skip("the lock held here is SQLite's; the display is backend-independent")
    path = settings.database_url.removeprefix("sqlite:///")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # every phase write: 'database is locked', retried
    env = cli_env(settings, temporal_env)
    async with build_worker(temporal_env.client, settings):
        handle = await start_controlplane(
            temporal_env.client, settings, "ApplyAll", ApplyAllInput()
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                result = await invoke_async(["progress"], env)
                if "attempt 2 of 8" in result.output:
                    break
                assert time.monotonic() < deadline, result.output
                await asyncio.sleep(1)
            assert "database is locked" in result.output, result.output
        finally:
            if holder.in_transaction:
                holder.rollback()
            holder.close()
        done = await handle.result()
    assert done.status == "completed", done


def _deep(levels: int) -> str:
    """A formula nested ``levels`` IFs deep (a real project's long CASE ladders)."""
    formula = "Amount__c"
    for k in range(levels):
        formula = f"IF(Amount__c > {k}, {formula} + {k}, {k})"
    return formula


async def test_field_the_database_cannot_hold_is_named_by_status(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    """A formula too deep for SQLite's parser (and with no shared formula to
    stage) is found by the compiler asking SQLite to parse it: rebuild-derived
    leaves it out with the reason, the rest of the view is built, and
    ``status`` names it as well, with nothing left out silently."""
    if not settings.database_url.startswith("sqlite"):
        pytest.skip("SQLite's parser depth is the backend limit here")
    objects = [
        {
            "api_name": "Deep__c",
            "label": "Deep",
            "fields": [
                {"api_name": "Amount__c", "type": "Number", "precision": 18, "scale": 2},
                {"api_name": "Double__c", "type": "Number", "formula": "Amount__c * 2"},
                {"api_name": "Ladder__c", "type": "Number", "formula": _deep(40)},
            ],
        }
    ]
    doc = {"name": "deep-app", "category": "AppPack", "depends_on": ["platform-core"]}
    pack = tmp_path / "deep.yaml"
    pack.write_text(yaml.safe_dump({**doc, "objects": objects}))
    await install(temporal_env, settings, [str(pack)])
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            columns = conn.execute(text("SELECT * FROM v_Deep__c")).keys()
        assert "Double__c" in columns and "Ladder__c" not in columns
        left = derived.left_out_formulas(engine)
        assert [(i.object_api_name, i.field_api_name) for i in left] == [("Deep__c", "Ladder__c")]
        assert "the database cannot evaluate it here: parser stack overflow" in left[0].reason
    finally:
        engine.dispose()
    status = await invoke_async(["status"], cli_env(settings, temporal_env))
    assert "Deep__c.Ladder__c: the database cannot evaluate it here" in status.output, status.output
