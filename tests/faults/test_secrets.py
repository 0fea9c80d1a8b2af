"""A planted credential never leaks (issue 17, secrets): not into logs, CLI output,
database rows or workflow histories, through three kinds of failing callout (an
endpoint that answers 500 echoing the request's headers, one that refuses the
connection, one slower than the flow deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import inspect, select, text

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    cli_env,
    connector_settings,
    fast_fleet,
    install,
    invoke_async,
    record_upsert,
    write_connector_pack,
)

SECRET = "pl4nted-S3CRET-value-9f8e7d"


class _Echo(BaseHTTPRequestHandler):
    """500 with every request header in the body; or a slow 200 on /slow."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path.startswith("/slow"):
            time.sleep(3)
            body = b'{"records": {}}'
            self.send_response(200)
        else:
            body = json.dumps({"error": "boom", "headers": dict(self.headers)}).encode()
            self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a caller that gave up
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_planted_credential_never_leaks(
    temporal_env: Any,
    settings: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("NEXUS_CREDENTIAL_PLANTED", SECRET)
    monkeypatch.setenv("NEXUSCRM_CONNECTOR_FLOW_DEADLINE_MS", "1000")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    endpoints = {
        "echo-500": f"{base}/echo",
        "refused": f"http://127.0.0.1:{_closed_port()}/x",
        "slow": f"{base}/slow",
    }
    settings = connector_settings(settings)
    packs = [
        str(
            write_connector_pack(
                tmp_path / f"{name}.yaml",
                f"secret-{name}",
                [{"event_kind": "salesforce.record.upsert"}],
                [
                    {
                        "name": "batch",
                        "endpoint": url,
                        "credential_ref": "PLANTED",
                        "object_path_map": {"Contact": "/records"},
                    }
                ],
            )
        )
        for name, url in endpoints.items()
    ]
    try:
        await install(temporal_env, settings, packs)
        engine = make_engine(settings.database_url)
        rows = list_connector_packs(engine)
        assert len(rows) == 3
        queue.enqueue(
            engine,
            [
                record_upsert(p.install_id, p.namespace, "Contact", f"c{k}", {"LastName": "L"})
                for p in rows
                for k in range(3)
            ],
        )
        a = t.connector_work_attempt
        async with build_connector_worker(temporal_env.client, settings):
            fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
            for _ in range(600):  # every pack's items failed at least once
                with engine.connect() as conn:
                    failed = conn.execute(
                        select(a.c.WorkId).where(a.c.CauseCode == "enrichment-failed")
                    ).all()
                if len({w for (w,) in failed}) == 9:
                    break
                await asyncio.sleep(0.2)
            assert len({w for (w,) in failed}) == 9, failed
            status = await invoke_async(["connectors", "status"], cli_env(settings, temporal_env))
            await fleet.signal("stop")
            await fleet.result()
        histories = [
            json.dumps((await temporal_env.client.get_workflow_handle(wf.id, run_id=wf.run_id)
                        .fetch_history()).to_json_dict())
            async for wf in temporal_env.client.list_workflows(
                f"TaskQueue = '{settings.connector_task_queue}' OR "
                f"TaskQueue = '{settings.controlplane_task_queue}'"
            )
        ]  # fmt: skip
    finally:
        server.shutdown()
    out, err = capfd.readouterr()
    assert histories, "no workflow history was listed"
    leaks = [name for name, h in enumerate(histories) if SECRET in h]
    assert leaks == [], f"{len(leaks)} histories carry the credential"
    assert SECRET not in out and SECRET not in err, "the credential reached the logs"
    assert SECRET not in status.output
    insp = inspect(engine)
    with engine.connect() as conn:
        for table in insp.get_table_names():
            for row in conn.execute(select(text("*")).select_from(sa.table(table))):
                assert SECRET not in repr(tuple(row)), f"table {table} stores the credential"
