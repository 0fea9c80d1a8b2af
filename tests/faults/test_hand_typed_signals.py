"""Signals and updates typed by hand in the ``temporal`` CLI (issue 17 item 4).

Against real running workflows on the dev server, each served by a real
worker, wrong signals and updates are sent through the real ``temporal``
CLI (a subprocess): wrong JSON types (an int where a string goes, a list of
ints, an object where a list goes, a string where an object goes), extra
and missing arguments, unknown signal and update names, a 1 MB string,
NaN and 1e300 in the numeric fields of a control-plane request and an
unknown operation. Handlers: ConnectorFleet ``wake(install_id)`` and
``prune(namespace, install_id)``; IdentityWait ``register(work_ids)`` and
``wake_now``; ControlPlane ``submit(request)``.

What it proves, for every input:

- the workflow is still running and its history has no WorkflowTaskFailed
  event (two arguments to ``wake`` or ``register``, and one, none or an
  object to ``prune``, used to fail the workflow task on every attempt: the
  fleet or the wait was wedged and ``update execute`` hung);
- a wrong update is rejected: the CLI exits non-zero and its message names
  the problem, and the history keeps no trace of it;
- a wrong signal changes nothing (a string or an object sent as
  ``register``'s list used to be read as a list of its characters or keys
  and registered as work ids); a 1 MB requester is refused rather than
  queued into the entity's status and continue-as-new input;
- afterwards the right signal or update still works: the fleet wakes its
  pool and prunes it, then reconciles it back; the wait registers an item
  and wakes every item; the queue accepts and runs a valid request (after
  a request whose 1e300 heartbeat timeout fails its ApplyAll at once).

NaN cannot be typed: the CLI refuses it as JSON before sending anything.
SQLite only: the database plays no part in what a handler does with its input.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import FleetStatus, IdentityWaitStatus
from nexuscrm.contracts.controlplane_queue import ControlPlaneEntityInput
from nexuscrm.db.engine import make_engine
from nexusctl.controlplane_queue import queue_status
from nexusctl.temporal import start_fleet, temporal_binary
from nexusctl.worker import build_connector_worker, build_worker
from tests.builders import connector_settings, fast_fleet, hook_pack, install, wait_pools
from tests.identity_waits import Switch, begin, block, cfg, queue_db, states, wait_worker

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

MB = 1_000_000
FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
SIGNALED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
TASK_DONE = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
UPDATE_ACCEPTED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED


# --- the real CLI ----------------------------------------------------------------


async def temporal(env: WorkflowEnvironment, *args: str) -> tuple[int, str]:
    """``temporal workflow <args>`` against the test's dev server: exit code, output.

    Bounded: an update that wedges a workflow used to keep the CLI waiting."""
    address = env.client.service_client.config.target_host
    proc = await asyncio.to_thread(
        subprocess.run,
        [temporal_binary(), "workflow", *args, "--address", address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


def inputs(values: list[str]) -> list[str]:
    """``--input`` per value; ``@path`` is an ``--input-file`` (a 1 MB argument
    is over Linux's 128 KiB bound on one command-line argument; the CLI takes
    either kind, not both)."""
    out: list[str] = []
    for value in values:
        out += ["--input-file", value[1:]] if value.startswith("@") else ["--input", value]
    return out


async def signal(env: WorkflowEnvironment, wf_id: str, name: str, *values: str) -> None:
    code, output = await temporal(
        env, "signal", "--workflow-id", wf_id, "--name", name, *inputs(list(values))
    )
    assert (code, output) == (0, "Signal workflow succeeded"), (name, values, output)


async def update(env: WorkflowEnvironment, wf_id: str, name: str, *values: str) -> tuple[int, str]:
    return await temporal(
        env, "update", "execute", "--workflow-id", wf_id, "--name", name, *inputs(list(values))
    )


async def rejected(
    env: WorkflowEnvironment, wf_id: str, name: str, values: list[str], says: str
) -> None:
    """The update is refused: exit 1, the message names the problem."""
    code, output = await update(env, wf_id, name, *values)
    assert code == 1, (name, values, output)
    assert says in output, (name, values, output)
    assert "Traceback" not in output and len(output) < 2_000, output[:2_000]


# --- what a user sees of the workflow ------------------------------------------------


async def events(handle: WorkflowHandle[Any, Any]) -> list[Any]:
    return [e async for e in handle.fetch_history_events()]


async def settled(handle: WorkflowHandle[Any, Any], timeout: float = 20) -> None:
    """Wait until a workflow task completed after the last signal; never a failed one."""
    deadline = time.monotonic() + timeout
    while True:
        history = await events(handle)
        failed = [e for e in history if e.event_type == FAILED]
        assert not failed, failed[0].workflow_task_failed_event_attributes.failure.message
        last = max((i for i, e in enumerate(history) if e.event_type == SIGNALED), default=-1)
        if any(e.event_type == TASK_DONE for e in history[last + 1 :]):
            return
        assert time.monotonic() < deadline, f"no workflow task after the signal: {history[-3:]}"
        await asyncio.sleep(0.1)


async def healthy(handle: WorkflowHandle[Any, Any]) -> None:
    """Running, and not one workflow task failed in its history."""
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    failed = [e for e in await events(handle) if e.event_type == FAILED]
    assert not failed, failed[0].workflow_task_failed_event_attributes.failure.message


async def eventually(probe: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def json_file(tmp_path: Path, value: Any) -> str:
    path = tmp_path / f"big-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(value))
    return f"@{path}"


# --- ConnectorFleet ------------------------------------------------------------------


async def test_fleet_wake_and_prune_typed_wrongly(temporal_env, settings, tmp_path):
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "h.yaml", "http://x/"))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    engine.dispose()
    ns, iid = json.dumps(pack.namespace), json.dumps(pack.install_id)
    client, env = temporal_env.client, temporal_env
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        (pool,) = await wait_pools(fleet, 1)
        supervisor = client.get_workflow_handle(pool.supervisor_workflow_id)

        async def wakes() -> int:
            history = await events(supervisor)
            return sum(
                e.workflow_execution_signaled_event_attributes.signal_name == "wake"
                for e in history
                if e.event_type == SIGNALED
            )

        # Signals: nothing to refuse with, so nothing may fail and nothing is woken.
        for values in (
            ["5"],  # an int for the install id
            ["[1, 2]"],
            ['{"install_id": "x"}'],
            [iid, '"extra"'],  # two arguments: used to fail every workflow task
            [json_file(tmp_path, "x" * MB)],  # names no pool
        ):
            await signal(env, fleet.id, "wake", *values)
            await settled(fleet)
        await signal(env, fleet.id, "wakeup", iid)  # no such signal
        await settled(fleet)
        await asyncio.sleep(0.5)  # past the wake coalescing window
        assert await wakes() == 0
        await healthy(fleet)

        # Updates: refused before they are accepted, each saying why.
        wrong = "prune takes two non-empty strings, the pack's namespace and its install id"
        for values, says in (
            (["1", iid], "Expected value to be str, was <class 'int'>"),
            ([ns], f"{wrong} (--input '\"<namespace>\"' --input '\"<install id>\"'), got ['"),
            ([], f"{wrong} (--input '\"<namespace>\"' --input '\"<install id>\"'), got []"),
            ([json.dumps({"namespace": pack.namespace, "install_id": pack.install_id})], wrong),
            (['""', '""'], wrong),
            ([ns, iid, '"extra"'], "takes from 1 to 3 positional arguments but 4 were given"),
        ):
            await rejected(env, fleet.id, "prune", values, says)
        # Two strings are a prune: a 1 MB install id names no pool, so it prunes nothing.
        ns_file = json_file(tmp_path, pack.namespace)  # the CLI takes files or --input, not both
        code, output = await update(env, fleet.id, "prune", ns_file, json_file(tmp_path, "x" * MB))
        assert code == 0 and "Result false" in output, output[:500]
        await rejected(env, fleet.id, "prunes", [ns, iid], "Update handler for 'prunes'")
        await healthy(fleet)
        status = await fleet.query("status", result_type=FleetStatus)
        assert [p.supervisor_workflow_id for p in status.pools] == [supervisor.id]

        # The right ones still work: wake reaches the pool; prune drains it, and
        # the next reconcile starts it again.
        await signal(env, fleet.id, "wake", iid)
        await eventually(lambda: _at_least(wakes, 1), "the pool's wake")
        code, output = await update(env, fleet.id, "prune", ns, iid)
        assert code == 0 and "Result true" in output, output
        assert await supervisor.result() == "drained"
        (again,) = await wait_pools(fleet, 1, timeout=30)
        assert again.supervisor_workflow_id != supervisor.id
        await healthy(fleet)
        await fleet.signal("stop")
        await fleet.result()


async def _at_least(count: Any, n: int) -> bool:
    return bool(await count() >= n)


# --- IdentityWait --------------------------------------------------------------------


async def test_identity_wait_register_and_wake_now_typed_wrongly(temporal_env, settings, tmp_path):
    engine = queue_db(settings)
    ids = block(engine, 3)
    queue = f"iw-{uuid.uuid4().hex[:8]}"
    client, env = temporal_env.client, temporal_env
    async with wait_worker(client, settings, engine, Switch("unresolved"), queue):
        wait = await begin(client, settings, queue, ids, cfg(), probe_now=False)

        async def items() -> list[str]:
            return (await wait.query("status", result_type=IdentityWaitStatus)).items

        assert await items() == sorted(ids)
        for values in (
            ['"abc"'],  # used to register work ids "a", "b" and "c"
            ['{"w1": 1, "w2": 2}'],  # used to register work ids "w1" and "w2"
            ["[1, 2]"],
            ['["w1"]', '"extra"'],  # two arguments: used to fail every workflow task
            [json_file(tmp_path, "y" * MB)],  # used to register "y"
            [json_file(tmp_path, ["y" * MB])],  # no work id is over 64 characters
            ["true"],
        ):
            await signal(env, wait.id, "register", *values)
            await settled(wait)
            assert await items() == sorted(ids), values
        await signal(env, wait.id, "registr", "[]")  # no such signal
        await settled(wait)
        await rejected(env, wait.id, "wakenow", [], "Update handler for 'wakenow'")
        await healthy(wait)
        assert await items() == sorted(ids)
        assert {s for s, _ in states(engine, ids).values()} == {"blocked"}

        # The right ones still work: register one more item, then wake all four.
        (late,) = block(engine, 1)
        await signal(env, wait.id, "register", json.dumps([late]))
        await settled(wait)
        assert await items() == sorted([*ids, late])
        code, output = await update(env, wait.id, "wake_now")
        assert code == 0 and "Result 4" in output, output
        assert await wait.result() == 4
        assert {s for s, _ in states(engine, [*ids, late]).values()} == {"pending"}

        # wake_now takes nothing: the SDK drops a hand-typed argument, so it wakes as asked.
        other = Dependency.remote("salesforce-sync", "salesforce-sync", "Account", "acct-2")
        (item,) = block(engine, 1, other)
        wait2 = await begin(client, settings, queue, [item], cfg(), dep=other, probe_now=False)
        code, output = await update(env, wait2.id, "wake_now", '{"force": true}')
        assert code == 0 and "Result 1" in output, output
        assert await wait2.result() == 1
    assert not [e for e in await events(wait) if e.event_type == FAILED]
    engine.dispose()


# --- ControlPlane ----------------------------------------------------------------------


async def test_controlplane_submit_typed_wrongly(temporal_env, settings, tmp_path):
    client, env = temporal_env.client, temporal_env
    wf_id = settings.controlplane_workflow_id

    def req(**fields: Any) -> str:
        return json.dumps({"operation": "ApplyAll", "apply_all": {}, **fields})

    decoding = "Failed decoding arguments"
    not_dict = "Cannot convert to dataclass <class 'nexuscrm.contracts.controlplane_queue"
    async with build_worker(client, settings):
        entity = await client.start_workflow(
            "ControlPlane",
            ControlPlaneEntityInput(settings.database_id),
            id=wf_id,
            task_queue=settings.controlplane_task_queue,
        )
        huge = json_file(
            tmp_path, {"operation": "RunRepair", "operation_input": {}, "requester": "z" * MB}
        )
        for values, says in (
            (["1"], f"{decoding} (type: RuntimeError, retryable: true): {not_dict}"),
            (['"ApplyAll"'], "value is <class 'str'> not dict"),
            (['[{"operation": "ApplyAll"}]'], "value is <class 'list'> not dict"),
            ([], 'submit takes one argument, a request object such as {"operation": "RunRepair"'),
            ([req(), '"extra"'], "takes from 1 to 2 positional arguments but 3 were given"),
            (['{"apply_all": {}}'], "missing 1 required positional argument: 'operation'"),
            (
                ['{"operation": "DropDatabase", "operation_input": {}}'],
                "unknown control-plane operation 'DropDatabase': one of ApplyAll, RunRepair",
            ),
            (['{"operation": "RunRepair"}'], "RunRepair request without input: set operation_in"),
            ([req(apply_all={"policy": "yolo"})], "unknown ApplyAll policy 'yolo'"),
            ([req(apply_all={"policy": 5})], "Failed converting field apply_all"),
            ([req(wait_seconds="600")], "Failed converting field wait_seconds"),
            ([req(wait_seconds=1e300)], "wait_seconds 1e+300 must be a finite number of seconds"),
            ([req(wait_seconds=-1)], "wait_seconds -1.0 must be a finite number of seconds"),
            ([req(no_queue="yes")], "Failed converting field no_queue"),
            ([huge], "request is 1,000,2"),  # used to be queued, kept in status and carried
            # NaN is not JSON: the CLI refuses it before anything is sent.
            ([req().replace("{}", '{"heartbeat_timeout_seconds": NaN}')], "is not valid JSON"),
        ):
            await rejected(env, wf_id, "submit", values, says)
        code, output = await update(env, wf_id, "submit", json_file(tmp_path, "z" * MB))
        assert code == 1 and "value is <class 'str'> not dict" in output, output[:500]
        await rejected(env, wf_id, "submitt", [req()], "Update handler for 'submitt'")
        await signal(env, wf_id, "submit", req())  # an update sent as a signal: no handler
        await settled(entity)
        await healthy(entity)
        history = await events(entity)
        assert not [e for e in history if e.event_type == UPDATE_ACCEPTED]
        status = await queue_status(client, settings)
        assert (status.running, status.queued, status.recent) == (None, [], [])

        # A 1e300 heartbeat timeout is queued; its ApplyAll fails at once, naming it
        # (tests/faults/test_hostile_cli.py), and the queue goes on.
        code, output = await update(
            env, wf_id, "submit", req(apply_all={"heartbeat_timeout_seconds": 1e300})
        )
        assert code == 0 and "heartbeat_timeout_seconds:1e+300" in output, output

        # The right one still works: queued, run, finished.
        ok = json.dumps({"operation": "RunRepair", "operation_input": {}, "requester": "me"})
        code, output = await update(env, wf_id, "submit", ok)
        assert code == 0 and "operation:RunRepair" in output, output

        async def finished() -> list[Any]:
            recent = (await queue_status(client, settings)).recent
            return recent if len(recent) == 2 else []

        hb, entry = await eventually(finished, "both to finish", timeout=60)
        assert hb.state == "failed", hb
        assert "heartbeat timeout must be 1 to 3600 seconds, got 1e+300" in hb.outcome, hb
        assert entry.operation == "RunRepair" and entry.request.requester == "me"
        assert entry.state in ("completed", "failed"), entry
        await healthy(entity)
        await entity.terminate("test over")
