"""A pack that fails half-way through apply-packs does not leave the database stuck
(issue 13 item 9).

A view squats on the name of the pack's second object, so apply-packs creates
``Alpha__c`` and then fails on ``Zeta__c``. The half-created ``Alpha__c``
belongs to the pack: the next run's table discovery does not register it with
inferred types (its lookup would read as Text and every later ApplyAll would
fail with "changes type from Text to Lookup").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from sqlalchemy import Engine, inspect, select, text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.controlplane import markers, packs_apply, verify
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import quote
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from tests.builders import apply_all, install


def write_pack(path: Path) -> Path:
    doc = {
        "name": "half-app",
        "category": "AppPack",
        "depends_on": ["platform-core"],
        "objects": [
            {
                "api_name": "Alpha__c",
                "label": "Alpha",
                "fields": [
                    {"api_name": "Ref__c", "type": "Lookup", "reference_to": "Account"},
                    {"api_name": "Note__c", "type": "Text", "length": 80},
                ],
            },
            {"api_name": "Zeta__c", "label": "Zeta"},
        ],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def pack_status(engine: Engine, name: str) -> str | None:
    with engine.connect() as conn:
        ip = t.installed_pack
        return conn.execute(select(ip.c.Status).where(ip.c.Name == name)).scalar_one_or_none()


async def test_failed_pack_removed_then_fixed_converges(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    pack = write_pack(tmp_path / "half.yaml")
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE VIEW {quote(conn, 'Zeta__c')} AS SELECT 1 AS x"))
        with pytest.raises(WorkflowFailureError):
            await install(temporal_env, settings, [str(pack)])
        assert pack_status(engine, "half-app") == "failed"
        assert "Alpha__c" in inspect(engine).get_table_names()  # half-created
        # Removed, the others (platform packs alone here) converge.
        packs_apply.remove_pack(engine, "half-app")
        result = await apply_all(temporal_env, settings)
        assert result.status == "completed", result
        # Fixed (the squatter is gone): the pack installs with its own types.
        with engine.begin() as conn:
            conn.execute(text(f"DROP VIEW {quote(conn, 'Zeta__c')}"))
        await install(temporal_env, settings, [str(pack)])
        assert pack_status(engine, "half-app") == "active"
        catalog.CACHE.invalidate()
        alpha = catalog.CACHE.get(engine).get("Alpha__c")
        assert alpha is not None and alpha.pack_name == "half-app"
        assert {f.api_name: str(f.type) for f in alpha.fields}["Ref__c"].endswith("Lookup")
        assert verify.verify(engine) == []
        again = await apply_all(temporal_env, settings, app_pack_sources=[str(pack)])
        assert again.status == "completed", again
        marker = markers.read(engine)
        assert marker is not None and marker.status == "completed"
    finally:
        engine.dispose()


async def test_failed_pack_fixed_converges_on_the_next_run(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    pack = write_pack(tmp_path / "half.yaml")
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE VIEW {quote(conn, 'Zeta__c')} AS SELECT 1 AS x"))
        with pytest.raises(WorkflowFailureError):
            await install(temporal_env, settings, [str(pack)])
        with engine.begin() as conn:
            conn.execute(text(f"DROP VIEW {quote(conn, 'Zeta__c')}"))
        await install(temporal_env, settings, [str(pack)])
        assert pack_status(engine, "half-app") == "active"
        assert {"Alpha__c", "Zeta__c"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
