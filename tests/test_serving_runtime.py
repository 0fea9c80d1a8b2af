"""What runs under a Runtime serving selection is what the selection names (issue 11, item 7).

Enrichment builds its batch-read clients from the selected callout profiles
only, with only their authorized credentials (a real local HTTP server counts
the calls per endpoint and records the credential each carried); an empty or
broken selection refuses to start the runtime with the seed's message, both
as a process (``python worker.py``, the same as ``nexusctl worker``) and as a
fleet.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from temporalio.client import WorkflowFailureError

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import ConnectorPackRow, list_connector_packs
from nexuscrm.connectors.serving import ServingSelectionError
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    connector_settings,
    corpus_project,
    fast_fleet,
    install,
    record_upsert,
    wait_drained,
)

ROOT = Path(__file__).resolve().parents[1]
AUTHORITY = "connector inbound supervisor: Runtime serving route authority is unavailable"


class CountingApi:
    """Batch-read endpoints on 127.0.0.1: calls counted per path, credentials recorded."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.auth: dict[str, set[str]] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.calls[self.path] += 1
                    outer.auth.setdefault(self.path, set()).add(
                        self.headers.get("Authorization") or ""
                    )
                data = json.dumps(
                    {"records": {i: {"Title__c": f"remote {i}"} for i in req["ids"]}}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api() -> Iterator[CountingApi]:
    server = CountingApi()
    yield server
    server.server.shutdown()


def two_profile_pack(path: Path, api: CountingApi) -> Path:
    """A connector pack with two batch profiles on distinct kinds and credentials."""
    path.write_text(
        json.dumps(
            {
                "name": "enriched-sync",
                "category": "ConnectorPack",
                "depends_on": ["platform-core"],
                "inbound_routes": [{"event_kind": "salesforce.record.upsert"}],
                "callout_profiles": [
                    {
                        "name": "selected",
                        "endpoint": api.url + "/selected",
                        "credential_ref": "cred-selected",
                        "object_path_map": {"Broker__c": "/records/Broker__c"},
                    },
                    {
                        "name": "other",
                        "endpoint": api.url + "/other",
                        "credential_ref": "cred-other",
                        "object_path_map": {"Property__c": "/records/Property__c"},
                    },
                ],
            }
        )
    )
    return path


def write_selection(path: Path, row: ConnectorPackRow | None, **override: Any) -> Path:
    """A selection file: ``row`` with its salesforce.record.upsert route (``{}`` packs if None)."""
    packs: list[dict[str, Any]] = []
    if row is not None:
        pack: dict[str, Any] = {
            "namespace": row.namespace,
            "installed_pack_id": row.install_id,
            "payload_digest": row.payload_hash,
            "inbound_routes": [{"event_kind": "salesforce.record.upsert", "route_version": 1}],
            "callout_profiles": [{"name": "selected", "credential_refs": ["cred-selected"]}],
        }
        pack.update(override)
        packs.append(pack)
    path.write_text(json.dumps({"packs": packs}))
    return path


async def test_enrichment_under_a_selection_reaches_only_selected_endpoints_and_credentials(
    temporal_env, settings, api, tmp_path, monkeypatch
):
    monkeypatch.setenv("NEXUS_CREDENTIAL_CRED_SELECTED", "selected-secret")
    monkeypatch.setenv("NEXUS_CREDENTIAL_CRED_OTHER", "other-secret")
    settings = connector_settings(settings)
    pack = two_profile_pack(tmp_path / "enriched.json", api)
    await install(temporal_env, settings, [str(corpus_project("dreamhouse-lwc")), str(pack)])
    engine = make_engine(settings.database_url)
    (row,) = list_connector_packs(engine)
    selected = settings.model_copy(
        update={"serving_selection": str(write_selection(tmp_path / "sel.json", row))}
    )
    events = [
        record_upsert(
            row.install_id, row.namespace, sobject, f"{sobject[:2]}{k}",
            {"Name": f"{sobject} {k}", "Title__c": "stale"} if sobject == "Broker__c"
            else {"Name": f"{sobject} {k}"},
            targeted=False,
        )
        for sobject in ("Broker__c", "Property__c")
        for k in range(4)
    ]  # fmt: skip
    queue.enqueue(engine, events)
    async with build_connector_worker(temporal_env.client, selected):
        fleet = await start_fleet(temporal_env.client, selected, fast_fleet(selected))
        try:
            assert await wait_drained(engine) == {"succeeded": len(events)}
        finally:
            await fleet.signal("stop")
            await fleet.result()
    # Only the selected profile's endpoint was called, only with its credential.
    assert set(api.calls) == {"/selected/records/Broker__c"}, api.calls
    assert api.auth == {"/selected/records/Broker__c": {"Bearer selected-secret"}}
    with engine.connect() as conn:
        titles: dict[str, str] = dict(
            conn.execute(text("SELECT Name, Title__c FROM Broker__c")).all()
        )
    assert titles == {f"Broker__c {k}": f"remote Br{k}" for k in range(4)}


def run_worker_process(settings: Settings, selection: Path, tmp_path: Path) -> Any:
    """``python worker.py`` (= ``nexusctl worker``) on ``settings``' database with ``selection``;
    the Temporal address is unreachable: a refusal must come before any connection."""
    env = {
        "PATH": "/usr/bin:/bin",
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_SERVING_SELECTION": str(selection),
        "NEXUS_TEMPORAL_ADDRESS": "127.0.0.1:1",
        "NEXUS_LOG_FORMAT": "json",
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "worker.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


async def test_empty_selection_refuses_to_start_the_runtime(temporal_env, settings, tmp_path):
    empty = write_selection(tmp_path / "empty.json", None)
    proc = run_worker_process(settings, empty, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert AUTHORITY in proc.stderr and "Traceback" not in proc.stderr
    # The connector worker itself refuses too (the fleet never serves nothing silently).
    selected = settings.model_copy(update={"serving_selection": str(empty)})
    with pytest.raises(ServingSelectionError, match="route authority is unavailable"):
        build_connector_worker(temporal_env.client, selected)


async def test_broken_selection_refuses_to_start_the_runtime(
    temporal_env, settings, api, tmp_path, monkeypatch
):
    monkeypatch.setenv("NEXUS_CREDENTIAL_CRED_SELECTED", "selected-secret")
    settings = connector_settings(settings)
    pack = two_profile_pack(tmp_path / "enriched.json", api)
    await install(temporal_env, settings, [str(corpus_project("dreamhouse-lwc")), str(pack)])
    engine = make_engine(settings.database_url)
    (row,) = list_connector_packs(engine)
    stale = write_selection(tmp_path / "stale.json", row, payload_digest="0" * 64)
    proc = run_worker_process(settings, stale, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "connector inbound supervisor: selected Runtime serving pack" in proc.stderr
    assert "payload digest does not match" in proc.stderr and "Traceback" not in proc.stderr
    missing_route = write_selection(
        tmp_path / "route.json",
        row,
        inbound_routes=[{"event_kind": "salesforce.record.delete", "route_version": 1}],
    )
    proc = run_worker_process(settings, missing_route, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "verify Runtime serving route" in proc.stderr and "not found" in proc.stderr

    # A fleet started on a broken selection fails its startup, naming the reason,
    # instead of running without the pack.
    selected = settings.model_copy(update={"serving_selection": str(stale)})
    async with build_connector_worker(temporal_env.client, selected):
        fleet = await start_fleet(temporal_env.client, selected, fast_fleet(selected))
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(fleet.result(), 90)
    cause = str(info.value.cause)
    assert "connector fleet startup failed" in cause and "payload digest does not match" in cause
