"""Oversized records and metadata (issue 17, audit item 5), on both backends.

On MariaDB (``max_allowed_packet`` 16 MiB) a data file with one 50 MB field
value ended in ``MySQL server has gone away (2006)``; an SFDX field file with a
50 MB description passed ``packs import-sfdx`` and then ApplyAll retried for
110 s before failing with 2006. The sizes are now checked before the database
sees the data, each refusal naming the file and the limit; and a statement the
server drops for its packet size is never retried as a transient fault.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.exc import DBAPIError
from temporalio.client import WorkflowFailureError

from nexuscrm.connectors.importer import MAX_FIELD_VALUE_CHARS, MAX_RECORD_BYTES
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import is_permanent, is_transient
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import (
    SF_SYNC,
    cli_env,
    db_state,
    install,
    installed_state,
    invoke,
    invoke_async,
    write_sfdx,
    write_small_pack,
)

BIG = 50 * 1024 * 1024


def _crashed(res: Any) -> bool:
    return res.exception is not None and not isinstance(res.exception, SystemExit)


def _events(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(t.connector_event)).scalar_one())


def _record(ref: str, **fields: Any) -> dict[str, Any]:
    return {"attributes": {"type": "Account", "referenceId": ref}, **fields}


async def test_data_plan_with_oversized_values_and_records_is_refused_whole(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    records = [
        _record("AccountRef1", Name="fine"),
        _record("AccountRef2", Name="x" * BIG),
        _record("AccountRef3", Name="ok", Description="d" * MAX_FIELD_VALUE_CHARS),
        _record("AccountRef4", **{f"F{i}__c": "y" * 100_000 for i in range(12)}),
    ]
    data = tmp_path / "Account.json"
    data.write_text(json.dumps({"records": records}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"sobject": "Account", "files": ["Account.json"]}]))
    res = await invoke_async(
        ["events", "import-sfdx-data", str(plan)], cli_env(settings, temporal_env)
    )
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    assert "gone away" not in res.output
    assert f"data file {data}:" in res.output
    output = " ".join(res.output.split())
    assert (
        f"record 1 (AccountRef2): field Name has {BIG:,} characters, over the limit of "
        f"{MAX_FIELD_VALUE_CHARS:,}" in output
    )
    assert "record 3 (AccountRef4): 1,2" in output  # 12 x 100,000 bytes and keys
    assert f"over the limit of {MAX_RECORD_BYTES:,} bytes a record" in output
    # At the size limit, but over Account.Description's own length (32,000).
    assert (
        f"record 2 (AccountRef3): field Description: value has {MAX_FIELD_VALUE_CHARS:,} "
        "characters; the field holds at most 32,000" in output
    )
    assert "AccountRef1" not in output
    assert _events(engine) == 0  # nothing half-enqueued


def _big_description_project(root: Path) -> Path:
    write_sfdx(
        root,
        {
            "Size__c": "<label>Size</label><type>Number</type>"
            f"<description>{'z' * BIG}</description>",
        },
    )
    return root


def test_import_sfdx_refuses_an_oversized_metadata_file(settings: Any, tmp_path: Path) -> None:
    project = _big_description_project(tmp_path / "big-app")
    res = invoke(["packs", "import-sfdx", str(project)], cli_env(settings))
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    assert "Size__c.field-meta.xml" in res.output
    assert "metadata file larger than the limit of 2 MiB" in res.output


async def test_applyall_fails_an_oversized_metadata_file_at_once(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    project = _big_description_project(tmp_path / "big-app")
    engine, before = await installed_state(temporal_env, settings, tmp_path)
    good = write_small_pack(tmp_path / "good.yaml", "good-app", "Good__c")
    async with build_worker(temporal_env.client, settings):
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(good), str(project)]),
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
    cause = str(info.value.cause)
    assert "Size__c.field-meta.xml" in cause and "larger than the limit of 2 MiB" in cause
    attempts = [
        e.activity_task_started_event_attributes.attempt
        async for e in handle.fetch_history_events()
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert attempts and max(attempts) == 1, attempts  # no phase was retried
    # nothing half-applied: the good pack of the run neither
    try:
        assert db_state(engine) == before
    finally:
        engine.dispose()


@pytest.mark.mysql
def test_a_statement_over_max_allowed_packet_is_not_transient(settings: Any) -> None:
    if not settings.database_url.startswith("mysql"):
        pytest.skip("max_allowed_packet is a MySQL/MariaDB limit")
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            packet = int(conn.execute(text("SELECT @@max_allowed_packet")).scalar_one())
        # The server answers 1153 or drops the connection (2006 / 2013) mid-send.
        conn = engine.connect()
        try:
            with pytest.raises(DBAPIError) as info:
                conn.execute(text("SELECT LENGTH(:v)"), {"v": "p" * (packet + 1024)})
        finally:
            with contextlib.suppress(DBAPIError):
                conn.close()
        code = getattr(info.value.orig, "args", (None,))[0]
        assert code in (1153, 2006, 2013), info.value.orig
        assert not is_transient(info.value), info.value.orig
        assert is_permanent(info.value)
    finally:
        engine.dispose()
