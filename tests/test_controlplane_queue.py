"""The control-plane queue (issue 12 items 1, 2 and the serialization of 10).

One ``ControlPlane`` entity per database runs every mutating operation as a
child, one at a time: concurrent auto-starts coalesce, an operator ApplyAll
waits behind a RunRepair, ``--no-queue`` refuses while busy, a waiter past
its bound times out, ``packs remove`` waits its turn and invalidates the
marker. Real dev server, real worker, SQLite and MariaDB; the real CLI (ten
auto-starts are separate OS processes). An operation is held mid-run by a
gate in front of one real activity, released when the test has seen what it
needs, so nothing depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import select
from temporalio import activity
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.controlplane import ControlPlaneActivities
from activities.controlplane_gates import GateActivities
from nexuscrm.contracts import ApplyAllInput, OperationInput
from nexuscrm.contracts.controlplane_queue import ControlPlaneEntityInput
from nexuscrm.controlplane import markers
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.controlplane_queue import build_request, queue_status, submit
from nexusctl.worker import build_worker
from tests.builders import apply_all, apply_all_entry, cli_env, executions, invoke_async
from workflows.controlplane import CONTROLPLANE_WORKFLOWS
from workflows.controlplane_queue import QUEUE_WORKFLOWS

ROOT = Path(__file__).resolve().parent.parent


def gated_worker(client: Client, settings: Settings, gated: str, gate: threading.Event) -> Worker:
    """The control-plane worker, with activity method ``gated`` held until ``gate`` is set.

    The held activity heartbeats while it waits, then runs the real one.
    """
    engine = make_engine(settings.database_url)
    acts = ControlPlaneActivities(engine, settings)
    activities: list[Callable[..., Any]] = []
    for real in [*acts.all(), *GateActivities(engine, settings).all()]:
        if real.__name__ != gated:
            activities.append(real)
            continue

        def held(req: Any, real: Callable[..., Any] = real) -> Any:
            while not gate.wait(0.5):
                activity.heartbeat()
            return real(req)

        wrapped = functools.wraps(real, updated=())(held)
        activities.append(activity.defn(name=f"controlplane.{gated}")(wrapped))
    return Worker(
        client,
        task_queue=settings.controlplane_task_queue,
        workflows=[*CONTROLPLANE_WORKFLOWS, *QUEUE_WORKFLOWS],
        activities=activities,
        activity_executor=ThreadPoolExecutor(max_workers=8),
        max_concurrent_activities=8,
    )


async def eventually(probe: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    """Await ``probe()`` until it returns something truthy; its value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await probe()
        except Exception as exc:  # e.g. the entity has not answered yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}: last {last!r}")


async def listed(client: Client, settings: Settings, wf_type: str, count: int) -> list[Any]:
    """The server's executions of ``wf_type`` on this database, once it lists ``count``."""
    query = f"WorkflowType = '{wf_type}' AND NexusDatabase = '{settings.database_id}'"

    async def probe() -> list[Any]:
        found = await executions(client, query)
        return found if len(found) >= count else []

    found: list[Any] = await eventually(probe, f"{count} {wf_type} executions")
    return found


async def running_entry(client: Client, settings: Settings, operation: str) -> Any:
    """The queue's running entry once ``operation`` runs."""

    async def probe() -> Any:
        status = await queue_status(client, settings)
        running = status.running
        return (
            running
            if running and (running.operation, running.state) == (operation, "running")
            else None
        )

    return await eventually(probe, f"{operation} running")


def one_line(text: str) -> str:
    return " ".join(text.split())


def write_pack(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "name": "gizmo-app",
                "category": "AppPack",
                "depends_on": ["platform-core"],
                "objects": [
                    {
                        "api_name": "Gizmo__c",
                        "label": "Gizmo",
                        "fields": [{"api_name": "Size__c", "type": "Number"}],
                    }
                ],
            }
        )
    )
    return path


@contextmanager
def released(gate: threading.Event) -> Iterator[threading.Event]:
    """Set ``gate`` on the way out whatever happens (a held worker must shut down)."""
    try:
        yield gate
    finally:
        gate.set()


# ---------------------------------------------------------------------------


async def test_ten_concurrent_auto_starts_one_apply_ten_exits_0(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    """A rollout: ten containers auto-start at once. One applies (those that
    arrived before it started share it); the rest, arriving while it ran,
    share one queued request, which classifies again when its turn comes and
    skips (the seed's lock waiters re-classify). Nobody is refused, nobody
    gets an answer decided before it asked."""
    client = temporal_env.client
    gate = threading.Event()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXUS_")}
    env |= cli_env(settings, temporal_env)
    procs: list[subprocess.Popen[str]] = []
    async with gated_worker(client, settings, "classify_auto_start", gate):
        with released(gate):
            for i in range(10):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "nexusctl.cli", "apply-all", "--wait",
                         "--policy", "auto_start"],
                        cwd=tmp_path, env=env, text=True,
                        stdout=(tmp_path / f"out{i}.txt").open("w"),
                        stderr=subprocess.STDOUT,
                    )
                )  # fmt: skip
            # The first auto-start is held in classify until the others queued. Those
            # that arrived before it started joined it; the rest share one queued entry.
            first = await running_entry(client, settings, "ApplyAll")

            async def all_waiting() -> bool:
                status = await queue_status(client, settings)
                running = status.running
                return (
                    running is not None
                    and len(status.queued) <= 1
                    and running.waiters + sum(e.waiters for e in status.queued) == 10
                )

            await eventually(all_waiting, "ten requests on at most two entries", timeout=180)
            status = await queue_status(client, settings)
            assert status.running is not None
            joined_first = status.running.waiters
            second = status.queued[0] if status.queued else None
        codes = []
        for proc in procs:
            codes.append(await asyncio.to_thread(proc.wait, 300))
    outputs = [(tmp_path / f"out{i}.txt").read_text() for i in range(10)]
    assert codes == [0] * 10, "\n---\n".join(outputs)
    summaries = []
    for out in outputs:
        (summary,) = re.findall(r"^(?:completed|skipped) in [\d.]+ s: .*$", out, re.MULTILINE)
        summaries.append(re.sub(r" in [\d.]+ s", "", summary))
        ran = first if summary.startswith("completed") else second
        assert ran is not None and ran.workflow_id in out, out
    # One apply; everyone who queued behind it classified again and skipped.
    assert sorted(summaries) == ["completed: ApplyAll converged"] * joined_first + [
        "skipped: full ApplyAll marker is completed"
    ] * (10 - joined_first), summaries
    runs = [first.workflow_id] + ([second.workflow_id] if second else [])
    await listed(client, settings, "ApplyAll", len(runs))
    await asyncio.sleep(2)  # visibility settles: still exactly these runs
    applies = await executions(
        client, f"WorkflowType = 'ApplyAll' AND NexusDatabase = '{settings.database_id}'"
    )
    assert sorted(w.id for w in applies) == sorted(runs)
    marker = markers.read(make_engine(settings.database_url))
    assert marker is not None and marker.status == "completed"


async def test_operator_apply_all_waits_behind_run_repair_and_no_queue_refuses(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    client = temporal_env.client
    await apply_all(temporal_env, settings)  # a converged database
    gate = threading.Event()
    env = cli_env(settings, temporal_env)
    async with gated_worker(client, settings, "run_repair", gate):
        with released(gate):
            req = build_request("RunRepair", OperationInput(), settings)
            await submit(client, settings, req)
            repair = await running_entry(client, settings, "RunRepair")
            operator = asyncio.create_task(invoke_async(["apply-all", "--wait"], env))

            async def queued() -> bool:
                return bool((await queue_status(client, settings)).queued)

            await eventually(queued, "the operator ApplyAll queued")
            refused = await invoke_async(["apply-all", "--wait", "--no-queue"], env)
            assert refused.exit_code == 1, refused.output
            message = one_line(refused.output)
            assert f"the control plane of database {settings.database_id} is busy" in message
            assert f"RunRepair running ({repair.workflow_id})" in message
            assert "1 queued (ApplyAll)" in message and "not queued (--no-queue)" in message
            assert not operator.done()
        result = await asyncio.wait_for(operator, 300)
    assert result.exit_code == 0, result.output
    assert "queued ApplyAll on database" in one_line(result.output)
    assert f"behind RunRepair {repair.workflow_id} (running)" in one_line(result.output)
    (run_repair,) = await listed(client, settings, "RunRepair", 1)
    applies = await listed(client, settings, "ApplyAll", 2)  # the install, then the operator's
    assert len(applies) == 2  # the refused one never ran
    last = max(applies, key=lambda w: w.start_time)
    assert run_repair.close_time is not None and run_repair.close_time <= last.start_time
    marker = markers.read(make_engine(settings.database_url))
    assert marker is not None and marker.status == "completed"


async def test_auto_start_behind_run_repair_gets_its_own_turn_and_converges(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    client = temporal_env.client
    await apply_all(temporal_env, settings)
    gate = threading.Event()
    env = cli_env(settings, temporal_env)
    async with gated_worker(client, settings, "run_repair", gate):
        with released(gate):
            await submit(client, settings, build_request("RunRepair", OperationInput(), settings))
            await running_entry(client, settings, "RunRepair")
            auto = asyncio.create_task(
                invoke_async(["apply-all", "--wait", "--policy", "auto_start", "--attach"], env)
            )

            async def queued() -> bool:
                return bool((await queue_status(client, settings)).queued)

            await eventually(queued, "the auto-start queued, not attached to RunRepair")
        result = await asyncio.wait_for(auto, 300)
    assert result.exit_code == 0, result.output
    assert "attached to the RunRepair" not in result.output
    # RunRepair invalidated the marker; the auto-start classified again and applied.
    marker = markers.read(make_engine(settings.database_url))
    assert marker is not None and marker.status == "completed"
    (run_repair,) = await listed(client, settings, "RunRepair", 1)
    applies = await listed(client, settings, "ApplyAll", 2)
    last = max(applies, key=lambda w: w.start_time)
    assert run_repair.close_time is not None and run_repair.close_time <= last.start_time


async def test_a_waiter_past_its_bound_gets_the_timeout_error_and_never_runs(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    client = temporal_env.client
    await apply_all(temporal_env, settings)
    gate = threading.Event()
    env = cli_env(settings, temporal_env) | {"NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS": "3"}
    async with gated_worker(client, settings, "run_repair", gate):
        with released(gate):
            await submit(client, settings, build_request("RunRepair", OperationInput(), settings))
            repair = await running_entry(client, settings, "RunRepair")
            late = await invoke_async(["apply-all", "--wait"], env)
            assert late.exit_code == 1, late.output
            message = one_line(late.output)
            assert "timed out after 3 s waiting for its turn in the control-plane queue" in message
            assert "was not started" in message
            assert "NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS" in message

            async def expired() -> Any:
                status = await queue_status(client, settings)
                return [e for e in status.recent if e.state == "expired"]

            (dropped,) = await eventually(expired, "the entry dropped by the entity")
            assert dropped.operation == "ApplyAll" and repair.workflow_id in dropped.outcome
        await eventually(
            lambda: _finished(client, settings, repair.workflow_id), "RunRepair finished"
        )
    applies = await executions(
        client, f"WorkflowType = 'ApplyAll' AND NexusDatabase = '{settings.database_id}'"
    )
    assert len(applies) == 1  # only the install: the dropped request never ran


async def _finished(client: Client, settings: Settings, workflow_id: str) -> bool:
    status = await queue_status(client, settings)
    return any(e.workflow_id == workflow_id for e in status.recent) and status.running is None


async def test_packs_remove_waits_behind_a_running_apply_all_and_invalidates_the_marker(
    temporal_env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> None:
    client = temporal_env.client
    pack = str(write_pack(tmp_path / "gizmo.yaml"))
    await apply_all(temporal_env, settings, app_pack_sources=[pack])
    engine = make_engine(settings.database_url)

    def pack_status() -> str:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    select(t.installed_pack.c.Status).where(t.installed_pack.c.Name == "gizmo-app")
                ).scalar_one()
            )

    gate = threading.Event()
    env = cli_env(settings, temporal_env)
    async with gated_worker(client, settings, "apply_packs", gate):
        with released(gate):
            req = build_request("ApplyAll", ApplyAllInput(app_pack_sources=[pack]), settings)
            await submit(client, settings, req)
            apply = await running_entry(client, settings, "ApplyAll")
            remove = asyncio.create_task(invoke_async(["packs", "remove", "gizmo-app"], env))

            async def queued() -> bool:
                return bool((await queue_status(client, settings)).queued)

            await eventually(queued, "packs remove queued")
            assert pack_status() == "active"  # not removed under the running ApplyAll
        result = await asyncio.wait_for(remove, 300)
    assert result.exit_code == 0, result.output
    assert f"behind ApplyAll {apply.workflow_id} (running)" in one_line(result.output)
    assert "removed gizmo-app (was active); ApplyAll marker invalidated" in one_line(result.output)
    assert pack_status() == "removed"
    marker = markers.read(engine)
    assert marker is not None and marker.status == "invalidated"
    (removal,) = await listed(client, settings, "RemovePack", 1)
    applies = await listed(client, settings, "ApplyAll", 2)
    held = next(w for w in applies if w.id == apply.workflow_id)
    assert held.close_time is not None and held.close_time <= removal.start_time


async def test_the_entity_continues_as_new_carrying_its_queue(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    client = temporal_env.client
    await client.start_workflow(
        "ControlPlane",
        ControlPlaneEntityInput(settings.database_id, continue_as_new_after=1),
        id=settings.controlplane_workflow_id,
        task_queue=settings.controlplane_task_queue,
    )
    gate = threading.Event()
    async with gated_worker(client, settings, "run_repair", gate):
        with released(gate):
            for op in ("RunRepair", "EnsureIndexes", "RunRepair"):
                await submit(client, settings, build_request(op, OperationInput(), settings))
            await running_entry(client, settings, "RunRepair")

            async def two_queued() -> bool:
                return len((await queue_status(client, settings)).queued) == 2

            await eventually(two_queued, "two queued behind RunRepair")

        async def all_done() -> Any:
            status = await queue_status(client, settings)
            done = [e.operation for e in status.recent if e.state == "completed"]
            return done if len(done) == 3 and not status.queued else None

        done = await eventually(all_done, "the three operations completed", timeout=300)
    assert done == ["RunRepair", "EnsureIndexes", "RunRepair"]
    runs = await executions(client, f"WorkflowId = '{settings.controlplane_workflow_id}'")
    assert len(runs) >= 3  # continued as new after each operation, queue carried


async def test_the_queue_survives_a_worker_restart(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    client = temporal_env.client
    gate = threading.Event()
    async with gated_worker(client, settings, "run_repair", gate):
        with released(gate):
            await submit(client, settings, build_request("RunRepair", OperationInput(), settings))
            await running_entry(client, settings, "RunRepair")
            await submit(
                client, settings, build_request("EnsureIndexes", OperationInput(), settings)
            )

            async def queued() -> bool:
                return bool((await queue_status(client, settings)).queued)

            await eventually(queued, "EnsureIndexes queued")
    # That worker is gone; a new process's worker replays the entity from its history.
    async with build_worker(client, settings):

        async def all_done() -> Any:
            status = await queue_status(client, settings)
            done = [e.operation for e in status.recent if e.state == "completed"]
            return done if len(done) == 2 and not status.queued and not status.running else None

        done = await eventually(all_done, "both operations completed", timeout=300)
    assert done == ["RunRepair", "EnsureIndexes"]
    (repair,) = await listed(client, settings, "RunRepair", 1)
    (indexes,) = await listed(client, settings, "EnsureIndexes", 1)
    assert repair.close_time is not None and repair.close_time <= indexes.start_time


def test_an_operations_task_timeout_follows_its_heartbeat_timeout_within_2_to_10_s() -> None:
    """A worker that dies in a local phase is noticed by the task timeout: the
    operator's heartbeat timeout, never under 2 s nor over Temporal's 10 s."""
    from datetime import timedelta

    from nexuscrm.contracts import ApplyAllInput
    from nexuscrm.contracts.controlplane_queue import ControlPlaneRequest, RemovePackInput
    from workflows.controlplane_queue import child_task_timeout

    def apply_all(hb: float) -> ControlPlaneRequest:
        return ControlPlaneRequest(
            operation="ApplyAll", apply_all=ApplyAllInput(heartbeat_timeout_seconds=hb)
        )

    assert child_task_timeout(apply_all(1)) == timedelta(seconds=2)
    assert child_task_timeout(apply_all(3.5)) == timedelta(seconds=3.5)
    assert child_task_timeout(apply_all(30)) == timedelta(seconds=10)
    assert child_task_timeout(apply_all(float("nan"))) == timedelta(seconds=10)
    remove = ControlPlaneRequest(
        operation="RemovePack", remove_pack=RemovePackInput("p", heartbeat_timeout_seconds=4)
    )
    assert child_task_timeout(remove) == timedelta(seconds=4)


async def test_no_queue_after_a_worker_restart_sees_the_end_that_arrived_with_it(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    """While no worker ran, the running operation ended (here: terminated); the
    next ``--no-queue`` request reaches the entity in the same workflow task as
    that end. The update's validator runs before the entity records the end,
    so the request was refused as busy behind an operation that had finished
    (a fresh-user trial saw it after a SIGKILL). ``submit`` checks a refusal
    once against the entity's status: the request is accepted and runs."""
    client = temporal_env.client
    await apply_all(temporal_env, settings)
    gate = threading.Event()
    with released(gate):
        async with gated_worker(client, settings, "run_repair", gate):
            await submit(client, settings, build_request("RunRepair", OperationInput(), settings))
            repair = await running_entry(client, settings, "RunRepair")
            gate.set()  # the held activity may finish: its worker is shutting down
    # no worker polls now: the child's end waits in the entity's history
    await client.get_workflow_handle(repair.workflow_id).terminate("the operator stopped it")
    req = build_request("RunRepair", OperationInput(), settings, no_queue=True)
    ticket = asyncio.create_task(submit(client, settings, req))
    await asyncio.sleep(1.0)  # the update is with the server, waiting for a worker
    assert not ticket.done()
    async with build_worker(client, settings):
        accepted = await asyncio.wait_for(ticket, 60)
        assert accepted.entry.operation == "RunRepair" and not accepted.ahead, accepted
        handle = client.get_workflow_handle(accepted.entry.workflow_id)

        async def completed() -> bool:
            status = (await handle.describe()).status
            return status is not None and status.name == "COMPLETED"

        await eventually(completed, "the accepted RunRepair completed")
    runs = await listed(client, settings, "RunRepair", 2)
    assert sorted(r.status.name for r in runs) == ["COMPLETED", "TERMINATED"]


async def test_a_caller_whose_turn_came_follows_the_child_or_gives_up_past_its_bound(
    temporal_env, settings, monkeypatch
):
    """With no worker to answer the queue's status query, a caller whose entry is
    ``starting`` follows the child once the server has it (a describe, no worker
    needed), and otherwise gives up STARTING_GRACE_S past its own wait bound with
    an error naming the operation and the task queue; it never waits for ever."""
    from nexuscrm.contracts.controlplane_queue import ControlPlaneTicket
    from nexusctl import controlplane_queue as cq

    monkeypatch.setattr(cq, "STARTING_GRACE_S", 1.0)
    client = temporal_env.client
    lost = apply_all_entry(settings, "r-lost", state="starting")
    began = time.monotonic()
    with pytest.raises(cq.ControlPlaneQueueTimeout) as raised:
        await cq.wait_turn(client, settings, ControlPlaneTicket(entry=lost), 0.5)
    assert 1.5 <= time.monotonic() - began < 30
    said = str(raised.value)
    assert lost.workflow_id in said and settings.controlplane_task_queue in said, said

    started = apply_all_entry(settings, "r-started", state="starting")
    child = await client.start_workflow(
        "NoWorkerServesThis", id=started.workflow_id, task_queue="nobody-polls"
    )
    try:
        entry = await cq.wait_turn(client, settings, ControlPlaneTicket(entry=started), 0.5)
        assert entry.state == "running" and entry.workflow_id == started.workflow_id
    finally:
        await child.terminate("test over")


def test_a_ticket_is_placed_again_by_the_status_the_entity_gives_after_the_update() -> None:
    """The entity answers ``submit`` before it applies the rest of the same workflow
    task: after a worker restart, the end of the operation "ahead" (a new user saw
    "queued ApplyAll ... behind EnsureIndexes ... (running)" for an operation ended
    ten minutes before, while the ApplyAll had started). The CLI places the ticket
    again by the ``status`` it asks next."""
    from nexuscrm.contracts.controlplane_queue import ControlPlaneQueueStatus, ControlPlaneTicket
    from nexusctl.controlplane_queue import current_ticket
    from tests.builders import apply_all_entry

    settings = Settings(database_url="sqlite:///unused.db")
    old = apply_all_entry(settings, "old", state="running")
    mine = apply_all_entry(settings, "mine")
    other = apply_all_entry(settings, "other")
    stale = ControlPlaneTicket(mine, False, 1, [f"ApplyAll {old.workflow_id} (running)"])
    db = settings.database_id
    running_now = apply_all_entry(settings, "mine", state="running")
    started = current_ticket(ControlPlaneQueueStatus(db, running_now, [], [old]), stale)
    assert (started.entry.state, started.position, started.ahead) == ("running", 0, [])
    behind = current_ticket(ControlPlaneQueueStatus(db, old, [other, mine], []), stale)
    assert (behind.position, behind.ahead) == (
        2,
        [f"ApplyAll {old.workflow_id} (running)", f"ApplyAll {other.workflow_id} (queued)"],
    )
    done = apply_all_entry(settings, "mine", state="completed")
    ended = current_ticket(ControlPlaneQueueStatus(db, None, [], [done]), stale)
    assert (ended.entry.state, ended.ahead) == ("completed", [])
    gone = current_ticket(ControlPlaneQueueStatus(db, None, [], []), stale)
    assert gone is stale


async def test_a_request_no_worker_took_is_announced_and_runs_when_one_starts(
    temporal_env: WorkflowEnvironment, settings: Settings
) -> None:
    """The worker has just stopped (the server still lists its poller, so no
    warning comes before the request is sent); ``run-repair`` waits for a worker
    to take it. After a few seconds the CLI says so, and that stopping it does
    not withdraw the request; stopped, the request runs once a worker starts
    (a new user gave up on such a command, and its RunRepair ran unseen later)."""
    await apply_all(temporal_env, settings)  # its worker stops when it returns
    env = {**os.environ, **cli_env(settings, temporal_env)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nexusctl.cli", "run-repair",
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said = ""
    try:
        async with asyncio.timeout(120):
            while "no worker has taken RunRepair" not in said:
                line = await proc.stderr.readline()
                assert line, f"the command ended without the notice: {said}"
                said += line.decode()
    finally:
        proc.terminate()
        await proc.wait()
    text = " ".join(said.split())
    assert "even if this command is stopped" in text and "nexusctl worker" in text, text
    async with build_worker(temporal_env.client, settings):
        for _ in range(600):
            ran = await executions(
                temporal_env.client,
                "WorkflowType = 'RunRepair' AND WorkflowId STARTS_WITH "
                f"'{settings.controlplane_workflow_id}/'",
            )
            if ran and all(wf.status is not None and wf.status.name == "COMPLETED" for wf in ran):
                break
            await asyncio.sleep(0.1)
    assert len(ran) == 1 and ran[0].status is not None, ran
    assert ran[0].status.name == "COMPLETED", ran
