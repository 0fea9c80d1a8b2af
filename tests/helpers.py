"""Test helpers: run workers, snapshot a database's converged state."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

from sqlalchemy import Engine, inspect, select

from nexuscrm.db import tables as t
from nexuscrm.db.dialect import index_names


def snapshot(engine: Engine) -> dict[str, Any]:
    """Everything ApplyAll converges, minus timestamps and generated install ids.

    Tables with their columns and indexes, views, object/field metadata rows,
    installed packs (name, status, hash) and the ApplyAll marker status.
    """
    insp = inspect(engine)
    tables = {}
    for name in sorted(insp.get_table_names()):
        cols = sorted(c["name"] for c in insp.get_columns(name))
        tables[name] = {"columns": cols, "indexes": sorted(index_names(engine, name))}
    with engine.connect() as conn:
        objects = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.object_meta.c.Id,
                    t.object_meta.c.ApiName,
                    t.object_meta.c.TableType,
                    t.object_meta.c.PackName,
                    t.object_meta.c.Label,
                    t.object_meta.c.PluralLabel,
                )
            )
        )
        fields = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.field_meta.c.Id,
                    t.field_meta.c.ObjectId,
                    t.field_meta.c.FieldType,
                    t.field_meta.c.ColumnNames,
                    t.field_meta.c.PackName,
                    t.field_meta.c.Formula,
                )
            )
        )
        packs = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.installed_pack.c.Name,
                    t.installed_pack.c.Status,
                    t.installed_pack.c.PayloadHash,
                )
            )
        )
    return {
        "tables": tables,
        "views": sorted(insp.get_view_names()),
        "objects": objects,
        "fields": fields,
        "packs": packs,
    }


class HookServer:
    """A local HTTP endpoint for webhook flows: scripted statuses, optional delay."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.script: dict[str, list[int]] = {}  # idempotency source id -> statuses to answer
        self.delay = 0.0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.received.append(body)
                time.sleep(outer.delay)
                key = (body.get("payload") or {}).get("key", "")
                statuses = outer.script.get(key) or [200]
                status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
                # Also a valid batch-read answer (nothing to enrich), so the same
                # server can stand in for a slow callout endpoint.
                data = b'{"records": {}}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
