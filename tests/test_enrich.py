"""Batch-read enrichment against a real local HTTP server."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from nexuscrm.connectors import queue
from nexuscrm.connectors.enrich import (
    DrainOnlyContext,
    EnrichmentError,
    HttpBatchReadClient,
    NoopBatchReadClient,
    PackInactiveError,
    client_for_profiles,
    plan_batch,
    resolve_credential,
    resolve_credential_for,
)
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db.engine import make_engine
from nexuscrm.packs.model import CalloutProfile
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


class RemoteApi:
    """A Salesforce-shaped batch-read endpoint on 127.0.0.1."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.status = 200
        self.delay = 0.0
        self.trickle = 0.0
        self.body: Any = None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), **req}
                )
                time.sleep(outer.delay)
                body = (
                    outer.body
                    if outer.body is not None
                    else {
                        "records": {
                            i: {"Title__c": f"remote {i}"} for i in req["ids"] if i != "gone"
                        }
                    }
                )
                data = json.dumps(body).encode()
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if outer.trickle:  # each byte well within a read timeout
                    for i in range(len(data)):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(outer.trickle)
                else:
                    self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api() -> Iterator[RemoteApi]:
    server = RemoteApi()
    yield server
    server.server.shutdown()


def profile(api: RemoteApi, cred: str | None = "sf-prod") -> CalloutProfile:
    return CalloutProfile(
        name="batch",
        endpoint=api.url + "/services",
        credential_ref=cred,
        object_path_map={"Broker__c": "/records/Broker__c"},
    )


ENV = {"NEXUS_CREDENTIAL_SF_PROD": "s3cret"}


def test_one_call_per_object_kind_with_bearer_credential(api):
    client = HttpBatchReadClient(profile(api), httpx.Client(), deadline=None, env=ENV)
    got = client.batch_read("salesforce", "Broker__c", ["b1", "b2", "gone"])
    assert got == {"b1": {"Title__c": "remote b1"}, "b2": {"Title__c": "remote b2"}}
    assert api.calls == [
        {"path": "/services/records/Broker__c", "auth": "Bearer s3cret",
         "namespace": "salesforce", "ids": ["b1", "b2", "gone"]}
    ]  # fmt: skip
    # A kind the profile does not map is not read at all.
    assert client.batch_read("salesforce", "Property__c", ["p1"]) == {}
    assert len(api.calls) == 1


def test_errors_are_classified(api):
    client = HttpBatchReadClient(profile(api), httpx.Client(), deadline=None, env=ENV)
    api.status = 503
    with pytest.raises(EnrichmentError) as info:
        client.batch_read("salesforce", "Broker__c", ["b1"])
    assert info.value.retriable and "503" in str(info.value)
    api.status = 404
    with pytest.raises(EnrichmentError) as info:
        client.batch_read("salesforce", "Broker__c", ["b1"])
    assert not info.value.retriable
    api.status, api.body = 200, {"nope": 1}
    with pytest.raises(EnrichmentError, match="malformed"):
        client.batch_read("salesforce", "Broker__c", ["b1"])


def test_flow_deadline_bounds_the_batch_read(api):
    api.delay = 1.0
    client = HttpBatchReadClient(
        profile(api), httpx.Client(), deadline=timedelta(milliseconds=200), env=ENV
    )
    with pytest.raises(EnrichmentError) as info:
        client.batch_read("salesforce", "Broker__c", ["b1"])
    assert info.value.retriable and "timed out" in str(info.value)


def test_flow_deadline_bounds_the_whole_batch_read_not_each_socket_read(api):
    api.trickle = 0.05  # ~60 bytes: about 3 s in all, 50 ms between bytes
    client = HttpBatchReadClient(
        profile(api), httpx.Client(), deadline=timedelta(milliseconds=500), env=ENV
    )
    with pytest.raises(EnrichmentError) as info:
        client.batch_read("salesforce", "Broker__c", ["b1"])
    assert info.value.retriable and "flow deadline" in str(info.value)


def test_missing_credential_fails_when_the_pool_is_built(api):
    with pytest.raises(EnrichmentError, match="NEXUS_CREDENTIAL_SF_PROD is not set"):
        client_for_profiles([profile(api)], httpx.Client(), deadline=None, env={})
    assert resolve_credential("sf-prod", ENV) == "s3cret"


def test_no_eligible_profile_is_the_payload_only_path(api):
    plain = CalloutProfile(name="other", endpoint=api.url)
    client = client_for_profiles([plain], httpx.Client(), deadline=None, env={})
    assert isinstance(client, NoopBatchReadClient)
    assert client.batch_read("salesforce", "Broker__c", ["b1"]) == {}
    assert api.calls == []


async def test_runtime_enriches_a_batch_with_one_read_per_object(
    temporal_env, settings, api, tmp_path
):
    pack = tmp_path / "enriched.yaml"
    pack.write_text(
        json.dumps(
            {
                "name": "enriched-sync",
                "category": "ConnectorPack",
                "depends_on": ["platform-core"],
                "inbound_routes": [{"event_kind": "salesforce.record.upsert"}],
                "callout_profiles": [
                    {
                        "name": "batch",
                        "endpoint": api.url,
                        "object_path_map": {"Broker__c": "/records/Broker__c"},
                    }
                ],
            }
        )
    )
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(corpus_project("dreamhouse-lwc")), str(pack)])
    engine = make_engine(settings.database_url)
    (row,) = list_connector_packs(engine)
    events = [
        record_upsert(
            row.install_id,
            row.namespace,
            "Broker__c",
            f"b{k}",
            {"Name": f"Broker {k}", "Title__c": "stale"},
            key=f"b{k}",
            targeted=False,
        )
        for k in range(6)
    ]
    queue.enqueue(engine, events)
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        assert await wait_drained(engine) == {"succeeded": 6}
        await fleet.signal("stop")
        await fleet.result()
    with engine.connect() as conn:
        titles: dict[str, str] = dict(
            conn.execute(text("SELECT Name, Title__c FROM Broker__c")).all()
        )
    assert titles == {f"Broker {k}": f"remote b{k}" for k in range(6)}
    # one read per claimed batch and object kind, never one per item
    assert len(api.calls) < len(events)
    assert sum(len(c["ids"]) for c in api.calls) == len(events)


def test_required_kinds_without_coverage_fail_naming_them(api):
    p = profile(api).model_copy(update={"required_object_kinds": ("Broker__c", "Property__c")})
    with pytest.raises(EnrichmentError, match="requires batch coverage for Property__c"):
        client_for_profiles([p], httpx.Client(), deadline=None, env=ENV)
    with pytest.raises(EnrichmentError, match="for pk \\(i1\\) requires"):
        plan_batch([p], "pk (i1)")


def test_duplicate_coverage_falls_back_to_payload_only(api):
    a, b = profile(api), profile(api).model_copy(update={"name": "second"})
    client = client_for_profiles([a, b], httpx.Client(), deadline=None, env={})
    assert isinstance(client, NoopBatchReadClient)
    assert "Broker__c by batch, second" in plan_batch([a, b]).degraded
    assert client.batch_read("salesforce", "Broker__c", ["b1"]) == {} and api.calls == []


def test_required_kinds_read_only_those_and_send_projection_fields(api):
    p = profile(api).model_copy(
        update={
            "object_path_map": {"Broker__c": "/records/Broker__c", "Other__c": "/o"},
            "required_object_kinds": ("Broker__c",),
            "projection_fields": ("Title__c",),
        }
    )
    client = client_for_profiles([p], httpx.Client(), deadline=None, env=ENV)
    assert client.batch_read("salesforce", "Other__c", ["o1"]) == {}
    client.batch_read("salesforce", "Broker__c", ["b1"])
    assert [c["path"] for c in api.calls] == ["/services/records/Broker__c"]
    assert api.calls[0]["fields"] == ["Title__c"]


def test_drain_only_context_resolves_no_credential_for_an_inactive_pack(api):
    installed = {"flag": True}
    ctx = DrainOnlyContext("salesforce", "i1", lambda: installed["flag"])
    assert resolve_credential_for("sf-prod", ENV, ctx) == "s3cret"
    installed["flag"] = False
    with pytest.raises(PackInactiveError, match=r"salesforce \(i1\) is inactive"):
        resolve_credential_for("sf-prod", ENV, ctx)
