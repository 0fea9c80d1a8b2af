"""The worker's Prometheus endpoint (``NEXUS_METRICS_ADDRESS``): SDK metrics and ``nexus_*``.

A real ``python worker.py`` process with the endpoint on a free port serves two
connector packs on the test's dev server: a webhook pack (three events
succeed, one fails with HTTP 400) and salesforce-sync (two Contacts parked on
identity waits until their Accounts arrive). The endpoint is scraped over
HTTP; every value asserted is also what the database says.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import NexusError
from nexuscrm.settings import Settings
from nexusctl.metrics import metrics_runtime
from nexusctl.temporal import start_fleet
from tests.builders import (
    SF_SYNC,
    Samples,
    children_and_parents,
    cli_env,
    connector_settings,
    fast_fleet,
    free_port,
    hook_events,
    hook_pack,
    install,
    scrape_until,
    value,
    wait_drained,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "address",
    ["localhost:9464", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "0.0.0.0:http", "::1:9464"],
)
def test_bad_metrics_address_is_refused_naming_the_setting(address, monkeypatch):
    monkeypatch.setenv("NEXUS_METRICS_ADDRESS", address)
    with pytest.raises(ValidationError) as err:
        Settings()
    assert "NEXUS_METRICS_ADDRESS" in str(err.value)


@pytest.mark.parametrize(
    ("address", "expected"),
    [("0.0.0.0:9464", "0.0.0.0:9464"), (" [::1]:9464 ", "[::1]:9464"), ("", None)],
)
def test_metrics_address_accepted(address, expected, monkeypatch):
    monkeypatch.setenv("NEXUS_METRICS_ADDRESS", address)
    assert Settings().metrics_address == expected


def test_metrics_port_in_use_is_an_error_naming_the_setting():
    address = f"127.0.0.1:{free_port()}"
    first = metrics_runtime(address)
    with pytest.raises(NexusError, match=r"NEXUS_METRICS_ADDRESS .*port of its own"):
        metrics_runtime(address)
    del first


async def wait_state(engine, state: str, n: int, timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        by_state: dict[str, int] = {}
        for s in queue.pack_queue_stats(engine):
            for st, k in s.by_state().items():
                by_state[st] = by_state.get(st, 0) + k
        if by_state.get(state, 0) >= n:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not {n} {state} in {timeout} s: {by_state}")
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_worker_serves_sdk_and_nexus_metrics(temporal_env, settings, hook, tmp_path):
    settings = connector_settings(settings)
    await install(
        temporal_env, settings, [str(SF_SYNC), str(hook_pack(tmp_path / "hook.yaml", hook.url))]
    )
    engine = make_engine(settings.database_url)
    packs = {p.namespace: p for p in list_connector_packs(engine)}
    hook_id, sf = packs["hook-pack"].install_id, packs["salesforce-sync"]
    hook.script = {"broken": [400]}
    children, parents = children_and_parents(sf.install_id, sf.namespace, 2)
    queue.enqueue(engine, [*hook_events(hook_id, ["a", "b", "c", "broken"]), *children])
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = {
        **os.environ,
        **cli_env(settings, temporal_env),
        "NEXUS_METRICS_ADDRESS": f"127.0.0.1:{port}",
        "NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK": "2",
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=ROOT)
    try:
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        # The Contacts park on their Accounts' identity waits.
        await wait_state(engine, "blocked", 2)
        parked = await scrape_until(url, lambda s: value(s, "nexus_identity_waits_parked") == 2)
        blocked = value(
            parked,
            "nexus_queue_depth",
            pack="salesforce-sync",
            state="blocked",
            queue_class="default",
        )
        assert blocked == 2
        queue.enqueue(engine, parents)
        states = await wait_drained(engine)
        assert states == {"succeeded": 7, "failed": 1}

        def ready(s: Samples) -> bool:
            return (
                value(s, "nexus_identity_waits_parked") == 0
                and value(
                    s,
                    "nexus_queue_depth",
                    pack="hook-pack",
                    state="failed",
                    queue_class="default",
                )
                == 1
            )

        samples = await scrape_until(url, ready)
        await fleet.signal("stop")
        await fleet.result()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    names = {name for name, _labels in samples}
    # The SDK's own metrics, on the same endpoint.
    assert any(n.startswith("temporal_workflow_task_execution_latency") for n in names), names
    assert any(n.startswith("temporal_activity_execution_latency") for n in names), names
    assert any(n.startswith("temporal_request") for n in names), names
    # Events processed and failed, by pack and queue class.
    hook_labels = {"pack": "hook-pack", "queue_class": "default"}
    sf_labels = {"pack": "salesforce-sync", "queue_class": "default"}
    processed = "nexus_events_processed_total"
    assert value(samples, processed, **hook_labels, outcome="succeeded") == 3
    assert value(samples, processed, **hook_labels, outcome="failed") == 1
    assert value(samples, processed, **sf_labels, outcome="succeeded") == 4
    assert value(samples, processed, **sf_labels, outcome="blocked") == 2
    failed = "nexus_events_failed_total"
    assert value(samples, failed, **hook_labels, failure_class="webhook-http-400") == 1
    assert not any(n == failed and ("pack", "salesforce-sync") in ls for n, ls in samples)
    # Claims: every item was leased once (the blocked children twice).
    assert value(samples, "nexus_batch_size_sum", pack="hook-pack") == 4
    assert value(samples, "nexus_batch_size_sum", pack="salesforce-sync") == 6
    claims = value(samples, "nexus_claim_latency_seconds_count", pack="hook-pack")
    assert claims is not None and claims >= 1
    assert value(samples, "nexus_claim_latency_seconds_bucket", pack="hook-pack", le="+Inf") == (
        claims
    )
    # Queue gauges, sampled from the database.
    for state, n in (("succeeded", 3), ("failed", 1)):
        assert value(samples, "nexus_queue_depth", **hook_labels, state=state) == n
    assert value(samples, "nexus_queue_depth", **sf_labels, state="succeeded") == 4
    assert value(samples, "nexus_queue_depth", **sf_labels, state="blocked") == 0
    assert (
        value(
            samples, "nexus_queue_failed_items", pack="hook-pack", failure_class="webhook-http-400"
        )
        == 1
    )
    assert value(samples, "nexus_queue_oldest_pending_age_seconds", pack="hook-pack") == 0
    # Both children woke: parked from their block to the wake, by whichever path woke them.
    woken = sum(
        v
        for (n, ls), v in samples.items()
        if n == "nexus_identity_wake_latency_seconds_count" and ("pack", "salesforce-sync") in ls
    )
    assert woken == 2
