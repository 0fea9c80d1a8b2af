"""Wide objects and the MySQL/MariaDB row-size limits (issue 13 item 6).

A real 172-field object (mostly text, with numbers, dates, checkboxes and
lookups) installs on SQLite and MariaDB, and grows by 30 more text fields on
a second run; an object that cannot fit a MariaDB row whatever its text
columns are (70 lookups) is refused at plan time with the object and its byte
count, before any table of it exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import MetaData, Table, inspect, text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.controlplane import markers, verify
from nexuscrm.db.dialect import dialect_name
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from tests.builders import install


def wide_fields(extra_text: int = 0) -> list[dict[str, Any]]:
    """172 fields in the mix of a real wide CRM object (+ ``extra_text`` Text fields)."""
    fields: list[dict[str, Any]] = []
    for i in range(90):
        fields.append({"api_name": f"Text{i}__c", "type": "Text", "length": 255})
    for i in range(20):
        fields.append({"api_name": f"Short{i}__c", "type": "Text", "length": 50})
    for i in range(10):
        fields.append({"api_name": f"Area{i}__c", "type": "TextArea"})
    for i in range(10):
        fields.append({"api_name": f"Pick{i}__c", "type": "Picklist", "picklist_values": ["A"]})
    for i in range(5):
        fields.append({"api_name": f"Mail{i}__c", "type": "Email"})
    for i in range(5):
        fields.append({"api_name": f"Long{i}__c", "type": "LongTextArea", "length": 32768})
    for i in range(12):
        fields.append({"api_name": f"Num{i}__c", "type": "Number", "precision": 18, "scale": 2})
    for i in range(6):
        fields.append({"api_name": f"Flag{i}__c", "type": "Checkbox"})
    for i in range(4):
        fields.append({"api_name": f"Day{i}__c", "type": "Date"})
    for i in range(4):
        fields.append({"api_name": f"When{i}__c", "type": "DateTime"})
    for i in range(5):
        fields.append({"api_name": f"Ref{i}__c", "type": "Lookup", "reference_to": "Account"})
    fields.append({"api_name": "Ext__c", "type": "Text", "length": 80, "external_id": True})
    for i in range(extra_text):
        fields.append({"api_name": f"More{i}__c", "type": "Text", "length": 255})
    return fields


def write_pack(path: Path, fields: list[dict[str, Any]], version: str = "1") -> Path:
    """A native app pack with one object ``Wide__c`` of ``fields``."""
    doc = {
        "name": "wide-app",
        "version": version,
        "category": "AppPack",
        "depends_on": ["platform-core"],
        "objects": [{"api_name": "Wide__c", "label": "Wide", "fields": fields}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_172_field_object_installs_and_grows(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    fields = wide_fields()
    assert len(fields) == 172
    pack = write_pack(tmp_path / "wide.yaml", fields)
    await install(temporal_env, settings, [str(pack)])
    write_pack(pack, wide_fields(extra_text=30), version="2")
    await install(temporal_env, settings, [str(pack)])
    engine = make_engine(settings.database_url)
    try:
        cols = {c["name"] for c in inspect(engine).get_columns("Wide__c")}
        assert {f["api_name"] for f in wide_fields(extra_text=30)} <= cols
        wide = Table("Wide__c", MetaData(), autoload_with=engine)
        with engine.begin() as conn:
            values: dict[str, Any] = {"Id": "w1", "Text89__c": "é" * 255, "More29__c": "ü" * 255}
            values["Ext__c"] = "x1"
            values["IsDeleted"] = False
            conn.execute(wide.insert().values(**values))
            row = conn.execute(text("SELECT * FROM v_Wide__c")).mappings().one()
        assert row["Text89__c"] == "é" * 255 and row["More29__c"] == "ü" * 255
        catalog.CACHE.invalidate()
        assert verify.verify(engine) == []
        marker = markers.read(engine)
        assert marker is not None and marker.status == "completed"
    finally:
        engine.dispose()


async def test_object_that_cannot_fit_is_refused_at_plan_time(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    fields = [
        {"api_name": f"Ref{i}__c", "type": "Lookup", "reference_to": "Account"} for i in range(70)
    ]
    pack = write_pack(tmp_path / "too-wide.yaml", fields)
    engine = make_engine(settings.database_url)
    try:
        if dialect_name(engine) != "mysql":
            # SQLite has no row-size limit: the same object installs.
            await install(temporal_env, settings, [str(pack)])
            assert "Wide__c" in inspect(engine).get_table_names()
            return
        with pytest.raises(WorkflowFailureError):
            await install(temporal_env, settings, [str(pack)])
        marker = markers.read(engine)
        assert marker is not None and marker.status == "failed"
        assert "plan-packs" in (marker.last_error or ""), marker
        error = marker.last_error or ""
        assert "object Wide__c cannot be created" in error, error
        assert "bytes" in error and "8126" in error, error
        assert "Wide__c" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
