"""Operator surfaces of the connector runtime: prune update, `connectors status`."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text
from typer.testing import CliRunner

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetStatus
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.cli import app
from nexusctl.temporal import running_supervisors, start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    SF_SYNC,
    cli_env,
    connector_settings,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
    wait_pools,
)


async def hook_pack_with_a_bad_event(
    temporal_env: Any, settings: Settings, hook: Any, tmp_path: Path
) -> tuple[Settings, Engine]:
    """A webhook pack installed (a connector queue of its own) and three events
    queued, ``ok1``, ``ok2`` and ``bad`` (its endpoint answers ``bad`` with 400):
    the settings and the database's engine."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    hook.script = {"bad": [400]}
    queue.enqueue(engine, hook_events(pack.install_id, ["ok1", "ok2", "bad"]))
    return settings, engine


async def test_prune_drains_one_incarnation_and_status_shows_the_pack(
    temporal_env,
    settings,
    hook,
    tmp_path,
):
    settings, engine = await hook_pack_with_a_bad_event(temporal_env, settings, hook, tmp_path)
    env = {**os.environ, **cli_env(settings, temporal_env)}
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        (pool,) = await wait_pools(fleet, 1)
        await wait_drained(engine)
        result = await asyncio.to_thread(CliRunner().invoke, app, ["connectors", "status"], env=env)
        assert result.exit_code == 0, result.output
        assert "hook-pack" in result.output
        assert "8 (0 restarts)" in result.output  # eight workers, none restarted
        assert "succeeded/default=2" in result.output
        assert "webhook-http-400=1" in result.output
        # prune: the incarnation's pool drains now, without waiting for a reconcile.
        (pack,) = list_connector_packs(engine)
        assert await fleet.execute_update("prune", args=["hook-pack", pack.install_id]) is True
        assert await fleet.execute_update("prune", args=["hook-pack", "nope"]) is False
        supervisor = temporal_env.client.get_workflow_handle(pool.supervisor_workflow_id)
        assert await supervisor.result() == "drained"
        await fleet.signal("stop")
        await fleet.result()


async def test_status_and_enqueue_fail_with_one_line_when_they_cannot_do_their_job(
    temporal_env, settings, tmp_path
):
    """`connectors status` against an unreachable Temporal still prints the queue
    table but exits 1 naming the problem (never a silent "not running"); with no
    fleet it says so and exits 0; `events enqueue` of a missing file is one
    `error:` line."""
    from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    env = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "COLUMNS": "300",
    }
    runner = CliRunner()
    ok = await asyncio.to_thread(runner.invoke, app, ["connectors", "status"], env=env)
    assert ok.exit_code == 0, ok.output
    assert "no connector fleet runs" in ok.output
    down = {**env, "NEXUS_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    bad = await asyncio.to_thread(runner.invoke, app, ["connectors", "status"], env=down)
    assert bad.exit_code == 1, bad.output
    assert "salesforce-sync" in bad.output  # the database part is still shown
    assert "cannot query the connector fleet" in bad.output
    assert "cannot reach Temporal" in bad.output
    missing = tmp_path / "nope.jsonl"
    res = await asyncio.to_thread(runner.invoke, app, ["events", "enqueue", str(missing)], env=env)
    assert res.exit_code == 1
    assert f"events file {missing}" in res.output and "Traceback" not in res.output


async def test_status_of_a_fleet_no_worker_runs_names_the_task_queue(temporal_env, settings):
    """A fleet started while no worker polls its task queue cannot answer its
    status query: the one error line says that no worker polls the queue (the
    cause), not only that the query timed out."""
    from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
    env = {**os.environ, **cli_env(settings, temporal_env)}
    try:
        res = await asyncio.to_thread(CliRunner().invoke, app, ["connectors", "status"], env=env)
        assert res.exit_code == 1, res.output
        assert "salesforce-sync" in res.output
        assert f"no worker polls task queue {settings.connector_task_queue}" in res.output
    finally:
        await fleet.terminate("test over")


async def test_status_right_after_the_worker_stopped_says_so_not_the_transport(
    temporal_env, settings
):
    """The fleet's worker has just stopped: the server still lists its poller
    (~90 s), so "no worker polls" cannot be said yet, and the status query times
    out. The error line says what that means, not only ``Timeout expired
    (CANCELLED)`` (a new user's trial, right after a SIGKILL)."""
    from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR

    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(CONNECTOR_PACKS_DIR / "salesforce-sync")])
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        await fleet.query("status", result_type=FleetStatus)
    env = {**os.environ, **cli_env(settings, temporal_env), "COLUMNS": "400"}
    try:
        res = await asyncio.to_thread(CliRunner().invoke, app, ["connectors", "status"], env=env)
        assert res.exit_code == 1, res.output
        out = " ".join(res.output.split())
        assert "no answer in time" in out and "`nexusctl worker` runs" in out, out
    finally:
        await fleet.terminate("test over")


async def test_the_readme_events_file_example_is_enqueued_and_applied(
    temporal_env, settings, tmp_path
):
    """The README's events-file line (a Contact with a lookup to its Account's remote
    id), with the Account's own event after it, through ``events enqueue`` and the
    fleet: both records stored, the Contact's AccountId the Account's record id.
    Enqueued while no fleet runs, the command warns that they wait for one."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Events files", 1)[1]
    example = json.loads(section.split("```json\n", 1)[1].split("\n```", 1)[0])
    parent = {
        "event_kind": "salesforce.record.upsert",
        "idempotency_key": "Account:a1",
        "source_object": "Account",
        "source_id": "a1",
        "payload": {"sobject": "Account", "remote_id": "a1", "fields": {"Name": "Acme"}},
    }
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(example) + "\n" + json.dumps(parent) + "\n")
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    env = {**os.environ, **cli_env(settings, temporal_env)}
    res = await asyncio.to_thread(
        CliRunner().invoke, app, ["events", "enqueue", str(path)], env=env
    )
    assert res.exit_code == 0, res.output
    assert "enqueued 2 event(s)" in res.output
    # no fleet runs yet: stored, and the user is told they wait for one
    said = " ".join(res.output.split())
    assert f"warning: no connector fleet runs for database {settings.database_id}" in said, said
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        assert await wait_drained(engine) == {"succeeded": 2}
        again = await asyncio.to_thread(
            CliRunner().invoke, app, ["events", "enqueue", str(path)], env=env
        )
        assert again.exit_code == 0 and "2 duplicate(s) skipped" in again.output, again.output
        assert "warning" not in again.output, again.output  # the fleet took the wake
        await fleet.signal("stop")
        await fleet.result()
    with engine.connect() as conn:
        account = conn.execute(text("SELECT Id FROM Account WHERE Name = 'Acme'")).scalar_one()
        contact = conn.execute(text("SELECT LastName, Email, AccountId FROM Contact")).one()
    assert tuple(contact) == ("Ng", "ng@example.com", account)


async def test_status_of_a_terminated_fleet_says_so_and_shows_the_pools_it_left(
    temporal_env, settings, hook, tmp_path
):
    """An operator terminates the fleet (or the server's history limit does): a
    closed fleet still answers its status query from its history, so `connectors
    status` showed its last pools as running and exited 0. It now says the fleet
    is not running, how and when it ended, and how to start it; the pack's pool,
    which outlives the fleet, is shown from the server's list of running
    supervisors; the command fails (exit 1)."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    env = {**os.environ, **cli_env(settings, temporal_env)}
    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        (pool,) = await wait_pools(fleet, 1)
        await fleet.terminate("by an operator")
        res = await asyncio.to_thread(CliRunner().invoke, app, ["connectors", "status"], env=env)
        supervisor = temporal_env.client.get_workflow_handle(pool.supervisor_workflow_id)
        await supervisor.terminate("test over")
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert f"the connector fleet {fleet.id} is not running: it terminated at" in out, out
    assert "nexusctl connectors start" in out and "1 pool(s) it left still run" in out, out
    assert "hook-pack" in out and "8 (0 restarts)" in out, out  # the orphaned pool's workers


async def test_failed_events_are_listed_with_their_reason_and_the_id_to_replay(
    temporal_env, settings, hook, tmp_path
):
    """`events failed` lists the failed work items not replayed yet, with the id
    `events replay` takes, the event's kind and source, the failure class and its
    summary; `--class` and `--pack` narrow it; once replayed, an item is not listed.
    The database's rows are the reference."""
    settings, engine = await hook_pack_with_a_bad_event(temporal_env, settings, hook, tmp_path)
    env = {**os.environ, **cli_env(settings, temporal_env), "COLUMNS": "400"}

    def cli(*args: str) -> Any:
        return CliRunner().invoke(app, ["events", *args], env=env)

    async with build_connector_worker(temporal_env.client, settings):
        fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
        await wait_drained(engine)
        await fleet.signal("stop")
        await fleet.result()
    with engine.connect() as conn:
        (work_id,) = conn.execute(
            text("SELECT WorkId FROM _System_ConnectorWorkItem WHERE State = 'failed'")
        ).scalars()
    listed = await asyncio.to_thread(cli, "failed")
    assert listed.exit_code == 0, listed.output
    out = " ".join(listed.output.split())
    assert work_id in out and "webhook-http-400" in out and "hook-pack" in out, out
    assert "1 failed item(s) not replayed" in out and "nexusctl events replay WORK_ID" in out
    narrowed = await asyncio.to_thread(cli, "failed", "--class", "value-invalid")
    assert "no failed work item waits for a replay" in narrowed.output, narrowed.output
    by_pack = await asyncio.to_thread(cli, "failed", "--pack", "hook-pack", "--limit", "1")
    assert work_id in by_pack.output, by_pack.output
    assert (await asyncio.to_thread(cli, "failed", "--limit", "0")).exit_code == 2
    replayed = await asyncio.to_thread(cli, "replay", work_id)
    assert replayed.exit_code == 0, replayed.output
    after = await asyncio.to_thread(cli, "failed")
    assert "no failed work item waits for a replay" in after.output, after.output


async def test_connectors_stop_drains_the_pools_and_ends_the_fleet(
    temporal_env, settings, hook, tmp_path
):
    """`connectors stop` signals the fleet's stop and waits until the server runs
    neither the fleet nor any of its pools; again, it says no fleet runs."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    env = {**os.environ, **cli_env(settings, temporal_env), "COLUMNS": "400"}
    client = temporal_env.client
    running = (
        f"ExecutionStatus = 'Running' AND WorkflowId STARTS_WITH 'connector/{settings.database_id}'"
    )
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        (pool,) = await wait_pools(fleet, 1)
        assert [wf.id async for wf in client.list_workflows(running)]
        res = await asyncio.to_thread(
            CliRunner().invoke, app, ["connectors", "stop", "--timeout", "60"], env=env
        )
        assert res.exit_code == 0, res.output
        assert f"connector fleet {fleet.id} stopped; every pool drained" in res.output
        assert [wf.id async for wf in client.list_workflows(running)] == []
        supervisor = client.get_workflow_handle(pool.supervisor_workflow_id)
        assert await supervisor.result() == "drained"
    again = await asyncio.to_thread(CliRunner().invoke, app, ["connectors", "stop"], env=env)
    assert again.exit_code == 0 and "no connector fleet runs" in again.output, again.output


async def test_connectors_stop_drains_the_pools_a_terminated_fleet_left(
    temporal_env, settings, hook, tmp_path
):
    """A fleet terminated by an operator leaves its pools running (ABANDON):
    `connectors stop` says no fleet runs, drains those pools by their own signal
    and waits until the server lists none; with --timeout 0 it names them as
    still draining and exits 1."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    env = {**os.environ, **cli_env(settings, temporal_env), "COLUMNS": "400"}
    client = temporal_env.client

    def stop(*args: str) -> Any:
        return CliRunner().invoke(app, ["connectors", "stop", *args], env=env)

    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        (pool,) = await wait_pools(fleet, 1)
        await fleet.terminate("operator")
        assert await running_supervisors(client, settings.database_id) == [
            pool.supervisor_workflow_id
        ]
        hurried = await asyncio.to_thread(stop, "--timeout", "0")
        assert hurried.exit_code == 1, hurried.output
        out = " ".join(hurried.output.split())
        assert "no connector fleet runs" in out, out
        assert "1 pool(s) outlived it and were signalled to drain; 0 ended" in out, out
        assert "1 pool(s) still draining after 0 s" in out and pool.supervisor_workflow_id in out
        res = await asyncio.to_thread(stop, "--timeout", "60")
        assert res.exit_code == 0, res.output
        assert await running_supervisors(client, settings.database_id) == []
        supervisor = client.get_workflow_handle(pool.supervisor_workflow_id)
        assert await supervisor.result() == "drained"


async def test_connectors_start_refuses_a_database_that_does_not_exist(
    temporal_env, settings, tmp_path
):
    """An unset or mistyped NEXUS_DATABASE_URL (a SQLite file that does not exist)
    starts no fleet: exit 1 naming the file, nothing created, nothing on the server."""
    missing = tmp_path / "typo" / "nexus.db"
    settings = connector_settings(settings).model_copy(
        update={"database_url": f"sqlite:///{missing}"}
    )
    env = {**os.environ, **cli_env(settings, temporal_env), "COLUMNS": "400"}
    res = await asyncio.to_thread(CliRunner().invoke, app, ["connectors", "start"], env=env)
    assert res.exit_code == 1, res.output
    assert f"no database at {missing}" in " ".join(res.output.split()), res.output
    assert not missing.exists()
    fleets = temporal_env.client.list_workflows(
        f"WorkflowType = 'ConnectorFleet' AND TaskQueue = '{settings.connector_task_queue}'"
    )
    assert [wf.id async for wf in fleets] == []


async def test_connectors_stop_without_a_worker_says_nothing_can_stop_it(temporal_env, settings):
    """A fleet no worker runs cannot stop: `connectors stop` says that no worker
    polls its task queue (exit 1), not that it stopped."""
    settings = connector_settings(settings)  # a task queue no worker ever polled
    env = {**os.environ, **cli_env(settings, temporal_env), "COLUMNS": "400"}
    fleet = await start_fleet(temporal_env.client, settings, fast_fleet(settings))
    try:
        res = await asyncio.to_thread(
            CliRunner().invoke, app, ["connectors", "stop", "--timeout", "1"], env=env
        )
        out = " ".join(res.output.split())
        assert res.exit_code == 1, out
        assert f"no worker polls task queue {settings.connector_task_queue}" in out, out
        assert "stopped; every pool drained" not in out, out
    finally:
        await fleet.terminate("test cleanup")
