"""Issue 11 item 9: claims are fenced by the pool generation (real SQLite and MariaDB).

A pool that starts takes its pack's next claim fence (``queue.take_fence``);
from then on no claim, finish, lease extension or release under an older fence
succeeds, the older fence's leases are revoked, and two claimers under
different fencing tokens never both hold an item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from temporalio.client import WorkflowFailureError

from nexuscrm import cutover
from nexuscrm.connectors import admission
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import InboundWorkerConfig
from nexuscrm.controlplane import repair
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexusctl.temporal import start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import (
    connector_settings,
    event,
    fast_fleet,
    hook_events,
    hook_pack,
    install,
    wait_drained,
    wait_pools,
)
from workflows.inbound_worker import InboundWorkerWorkflow

PACK = "pack-1"
W = t.connector_work_item
A = t.connector_work_attempt


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    ensure_system_schema(eng)
    yield eng
    eng.dispose()


def enqueue(engine: Engine, n: int) -> None:
    wq.enqueue(engine, [event(PACK, f"k{i:04d}", payload={"n": i}) for i in range(n)])


def fence(engine: Engine, name: str) -> tuple[int, str]:
    """Take the pack's fence for the owner called ``name``."""
    return wq.take_fence(engine, PACK, f"owner-{name}", f"fence-{name}")


def spec(gen_token: tuple[int, str], owner: str, batch: int = 5) -> wq.ClaimSpec:
    return wq.ClaimSpec(
        installed_pack_id=PACK,
        queue_classes=(),
        batch_size=batch,
        lease_owner=owner,
        lease_seconds=60,
        max_processing_rows=1000,
        generation=gen_token[0],
        fencing_token=gen_token[1],
    )


def rows(engine: Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        return {r["WorkId"]: dict(r) for r in conn.execute(select(W)).mappings()}


def attempt_rows(engine: Engine) -> list[tuple[str, int, str, str | None]]:
    with engine.connect() as conn:
        return [
            (r.WorkId, int(r.Attempt), r.OutcomeState, r.CauseCode)
            for r in conn.execute(
                select(A.c.WorkId, A.c.Attempt, A.c.OutcomeState, A.c.CauseCode).order_by(
                    A.c.WorkId, A.c.Attempt
                )
            )
        ]


def test_two_claim_fences_never_both_hold_an_item(engine: Engine) -> None:
    """Old-generation claimers and new ones race over many items in threads.

    Counted from the WorkItem and attempt rows: every item succeeds exactly
    once; after the take-over no row is held under the old fence, the old
    claimers take nothing more, and what an old claimer still held when the
    new fence was taken is lost to it (its finish refused), never finished twice.
    """
    n = 240
    enqueue(engine, n)
    old = fence(engine, "old")
    assert old == (1, "fence-old")
    taken = threading.Event()
    holding = threading.Event()
    done = threading.Event()
    lock = threading.Lock()
    finished: dict[str, list[str]] = {"old": [], "new": []}
    lost_by_old: list[str] = []
    held_at_takeover: list[str] = []
    old_claims_after: list[int] = []
    refused: list[str] = []
    errors: list[BaseException] = []

    def finish(items: list[wq.ClaimedItem], who: str) -> None:
        try:
            with wq.write_transaction(engine) as conn:
                wq.finish_succeeded_many(conn, items)
        except wq.LeaseLost:
            with lock:
                lost_by_old.extend(i.work_id for i in items)
            return
        with lock:
            finished[who].extend(i.work_id for i in items)

    def old_claimer(name: str, holds: bool) -> None:
        try:
            batches = 0
            while not done.is_set():
                after = taken.is_set()
                try:
                    got = wq.claim(engine, spec(old, name))
                except wq.FenceSuperseded as exc:
                    with lock:
                        refused.append(str(exc))
                    return
                if after:
                    with lock:
                        old_claims_after.append(len(got))
                batches += 1
                if holds and batches == 3 and got:
                    # Hold a batch across the take-over, then try to finish it.
                    held_at_takeover.extend(i.work_id for i in got)
                    holding.set()
                    taken.wait(60)
                time.sleep(0.005)
                if got:
                    finish(got, "old")
        except BaseException as exc:
            errors.append(exc)

    def new_claimer(name: str, new: tuple[int, str]) -> None:
        try:
            while True:
                got = wq.claim(engine, spec(new, name))
                if got:
                    finish(got, "new")
                    continue
                with engine.connect() as conn:
                    left = conn.execute(
                        select(func.count()).where(W.c.State.in_(wq.NON_TERMINAL_STATES))
                    ).scalar()
                if not left:
                    done.set()
                    return
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)
            done.set()

    olds = [
        threading.Thread(target=old_claimer, args=(f"old-{k}", k == 0), daemon=True)
        for k in range(2)
    ]
    for th in olds:
        th.start()
    assert holding.wait(60)
    new = fence(engine, "new")
    taken.set()  # a claim an old claimer starts from here on must take nothing
    assert new == (2, "fence-new")
    # Right after the take-over commits, no row is held under the old fence.
    assert not [
        w for w, r in rows(engine).items() if r["State"] == "processing" and r["LeaseToken"]
    ]
    news = [
        threading.Thread(target=new_claimer, args=(f"new-{k}", new), daemon=True) for k in range(2)
    ]
    for th in news:
        th.start()
    for th in olds + news:
        th.join(120)
        assert not th.is_alive()
    assert not errors, errors

    final = rows(engine)
    assert all(r["State"] == "succeeded" for r in final.values())
    succeeded = Counter(w for w, _a, outcome, _c in attempt_rows(engine) if outcome == "succeeded")
    assert len(succeeded) == n and set(succeeded.values()) == {1}  # each applied once
    # Every item was finished by exactly one side, under the fence its row names.
    assert sorted(finished["old"] + finished["new"]) == sorted(final)
    assert {final[w]["FencingToken"] for w in finished["old"]} <= {"fence-old"}
    assert {final[w]["FencingToken"] for w in finished["new"]} == {"fence-new"}
    assert {final[w]["Generation"] for w in finished["new"]} == {2}
    # The batch held across the take-over was lost to the old claimer and redone once.
    assert held_at_takeover and set(held_at_takeover) <= set(lost_by_old)
    assert set(held_at_takeover) <= set(finished["new"])
    revoked = {w for w, _a, outcome, cause in attempt_rows(engine) if cause == "fence-superseded"}
    assert set(held_at_takeover) <= revoked
    # After the take-over the old claimers got nothing: each was refused.
    assert sum(old_claims_after) == 0
    assert len(refused) == 2 and all("superseded by generation 2" in m for m in refused)


def test_superseded_fence_cannot_finish_extend_release_or_claim_and_writes_nothing(
    engine: Engine,
) -> None:
    enqueue(engine, 4)
    old = fence(engine, "old")
    leased = wq.claim(engine, spec(old, "w-old"))
    assert len(leased) == 4 and {i.fencing_token for i in leased} == {"fence-old"}
    new = fence(engine, "new")
    before = (rows(engine), attempt_rows(engine))
    # Revoked at the take-over: pending again, one abandoned attempt each.
    assert {r["State"] for r in before[0].values()} == {"pending"}
    assert [c for _w, _a, _o, c in before[1]] == ["fence-superseded"] * 4
    pairs = [(i.work_id, i.lease_token) for i in leased]

    assert wq.extend_leases(engine, pairs, 30, fencing_token=old[1]) == [w for w, _t in pairs]
    assert wq.release_leases(engine, leased) == []
    assert wq.load_claimed(engine, pairs, old[1]) == []
    dep = Dependency.remote("sf", "sf", "Account", "001")
    finishes: list[Any] = [
        lambda c, i: wq.finish_succeeded(c, i),
        lambda c, i: wq.finish_succeeded_many(c, [i]),
        lambda c, i: wq.finish_retry(c, i, run_after=i.lease_until, failure_class="x", summary="x"),
        lambda c, i: wq.finish_failed(c, i, failure_class="x", summary="x"),
        lambda c, i: wq.block_item(c, i, dep, summary="x"),
    ]
    for fn in finishes:
        with pytest.raises(wq.LeaseLost), wq.write_transaction(engine) as conn:
            assert wq.hold_leases(conn, leased) == []
            fn(conn, leased[0])
    for bad in (old, (0, ""), (3, "fence-new"), (2, "fence-other")):
        with pytest.raises(wq.FenceSuperseded):
            wq.claim(engine, spec(bad, "w-bad"))
    assert (rows(engine), attempt_rows(engine)) == before  # nothing was written

    # The new fence claims them at once (no lease expiry to wait for).
    got = wq.claim(engine, spec(new, "w-new"))
    assert sorted(i.work_id for i in got) == sorted(before[0])
    assert {(i.generation, i.fencing_token, i.attempt) for i in got} == {(2, "fence-new", 2)}


def test_finish_and_extension_compare_the_fence_as_well_as_the_lease_token(
    engine: Engine,
) -> None:
    """A lease token alone is not enough: the write must name the item's fence."""
    enqueue(engine, 2)
    mine = fence(engine, "a")
    a, b = wq.claim(engine, spec(mine, "w"))
    stranger = dataclasses.replace(a, fencing_token="fence-b")
    with pytest.raises(wq.LeaseLost), wq.write_transaction(engine) as conn:
        wq.finish_succeeded(conn, stranger)
    assert wq.release_leases(engine, [stranger]) == []
    assert wq.extend_leases(engine, [(a.work_id, a.lease_token)], 30, fencing_token="x") == [
        a.work_id
    ]
    assert wq.load_claimed(engine, [(a.work_id, a.lease_token)], "x") == []
    assert rows(engine)[a.work_id]["State"] == "processing"
    with wq.write_transaction(engine) as conn:
        wq.finish_succeeded_many(conn, [a, b])  # the real fence finishes
    assert {r["State"] for r in rows(engine).values()} == {"succeeded"}


def test_the_same_owner_keeps_its_fence_and_another_owner_supersedes_it(engine: Engine) -> None:
    """A rebuild by the same fleet keeps the fence (and its leases); another fleet's
    pool takes the next generation; the first fleet coming back gets a newer one."""
    enqueue(engine, 2)
    a = fence(engine, "a")
    (held,) = wq.claim(engine, spec(a, "w-a", batch=1))
    assert fence(engine, "a") == a == (1, "fence-a")
    assert rows(engine)[held.work_id]["LeaseToken"] == held.lease_token  # not revoked
    assert fence(engine, "b") == (2, "fence-b")
    assert rows(engine)[held.work_id]["LeaseToken"] is None
    assert fence(engine, "a") == (3, "fence-a")
    with pytest.raises(wq.FenceSuperseded, match=r"generation 1 .* superseded by generation 3"):
        wq.claim(engine, spec(a, "w-a"))  # the same token under an older generation
    assert len(wq.claim(engine, spec((3, "fence-a"), "w-a"))) == 2


def test_unfenced_claims_only_while_the_pack_has_no_fence(engine: Engine) -> None:
    """Pools started before fencing claim unfenced (generation 0) until a pool takes one."""
    enqueue(engine, 2)
    (first,) = wq.claim(engine, spec((0, "legacy"), "w", batch=1))
    assert (first.generation, first.fencing_token) == (0, "legacy")
    with pytest.raises(wq.FenceSuperseded, match="never taken"):
        wq.claim(engine, spec((1, "fence-x"), "w"))
    fence(engine, "x")
    with pytest.raises(wq.FenceSuperseded, match="superseded by generation 1"):
        wq.claim(engine, spec((0, "legacy"), "w"))
    got = wq.claim(engine, spec((1, "fence-x"), "w"))
    assert sorted(i.work_id for i in got) == sorted(rows(engine))  # the legacy lease revoked


def test_fence_column_and_table_reach_an_older_database(engine: Engine) -> None:
    """An older database: RunRepair adds ``FencingToken``; the schema probe fails closed
    until then; ensure_system_schema creates the fence table."""
    repair.run_repair(engine)
    enqueue(engine, 1)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE _System_ConnectorWorkItem DROP COLUMN FencingToken"))
        conn.execute(text("DROP TABLE _System_ConnectorClaimFence"))
    with pytest.raises(cutover.SchemaGap, match=r"FencingToken|_System_ConnectorClaimFence"):
        admission.resolve_activation(engine, "sf", PACK, "e")
    ensure_system_schema(engine)
    report = repair.run_repair(engine)
    assert not report.failed()
    act = admission.resolve_activation(engine, "sf", PACK, "e")
    assert act.generation == 0
    taken = admission.take_fence(engine, "sf", PACK, "e")
    (item,) = wq.claim(engine, spec((taken.generation, taken.fencing_token), "w"))
    assert item.fencing_token == taken.fencing_token


async def test_a_new_generation_while_an_old_worker_runs_applies_every_event_once(
    temporal_env, settings, hook, tmp_path
):
    """End to end (real dev server): the fleet is terminated and started again (a new
    epoch, so its pool takes the next fence generation) while a worker of the old
    pool still runs (its drain never arrived). The old worker takes nothing; every
    event is applied exactly once, by the new generation."""
    settings = connector_settings(settings)
    await install(temporal_env, settings, [str(hook_pack(tmp_path / "hook.yaml", hook.url))])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    client = temporal_env.client
    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        (first,) = await wait_pools(fleet, 1)
        old_worker = await client.start_workflow(
            InboundWorkerWorkflow.run,
            InboundWorkerConfig(
                database_id=settings.database_id,
                namespace=first.namespace,
                install_id=first.install_id,
                ordinal=0,
                queue_classes=[],
                preferred_queue_classes=[],
                batch_size=5,
                max_processing_rows=first.max_processing_rows,
                lease_seconds=10,
                idle_seconds=0.2,
                fingerprint=first.fingerprint,
                generation=first.generation,
                scheduler_owner_id=first.scheduler_owner_id,
                fencing_token=first.fencing_token,
            ),
            id=f"old-worker-{uuid.uuid4().hex[:8]}",
            task_queue=settings.connector_task_queue,
        )
        await fleet.terminate()
        fleet = await start_fleet(client, settings, fast_fleet(settings))
        (second,) = await wait_pools(fleet, 1, not_fingerprint=first.fingerprint)
        keys = [f"k{n:03d}" for n in range(120)]
        wq.enqueue(engine, hook_events(pack.install_id, keys))
        states = await wait_drained(engine, timeout=120)
        assert states == {"succeeded": len(keys)}
        # Every event applied once: one webhook call per key.
        calls = Counter((r.get("payload") or {}).get("key") for r in hook.received)
        assert calls == Counter(dict.fromkeys(keys, 1)), calls.most_common(3)
        # The old worker ran no batch: its claims were refused, and it failed saying so.
        history = await old_worker.fetch_history()
        batches = [
            e
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.activity_type.name
            == "connectors.process"
        ]
        assert batches == []
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(old_worker.result(), 60)
        chain: list[str] = []
        err: BaseException | None = failed.value.cause
        while err is not None:
            chain.append(str(err))
            err = err.__cause__
        assert any("FenceSuperseded" in m for m in chain), chain
        # Counted from the WorkItem rows: all taken under the new generation's fence.
        final = rows(engine)
        assert {(r["Generation"], r["FencingToken"]) for r in final.values()} == {
            (second.generation, second.fencing_token)
        }
        assert second.generation == first.generation + 1
        await fleet.signal("stop")
        await fleet.result()


def test_a_stint_whose_next_claim_is_refused_returns_the_batch_it_ran(
    engine: Engine, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stint (issue 15) whose next claim meets a superseded fence (a new
    pool generation took it between two batches) ends there and returns the
    batch it ran, instead of failing the activity and losing that batch's result
    (its waits and wakes); the worker's own next claim then fails the worker."""
    from temporalio.testing import ActivityEnvironment

    import activities.connectors as connector_activities
    from activities.connectors import ConnectorActivities
    from nexuscrm.connectors.knobs import ConnectorKnobs
    from nexuscrm.contracts import ClaimedLease, ProcessRequest
    from nexuscrm.settings import Settings

    enqueue(engine, 3)
    (first,) = wq.claim(engine, spec((0, "legacy"), "w", batch=1))
    taken: list[tuple[int, str]] = []

    def fence_taken_after_the_item() -> None:  # the batch's per-item progress note
        if not taken:
            taken.append(fence(engine, "x"))

    monkeypatch.setattr(connector_activities, "progress", fence_taken_after_the_item)
    acts = ConnectorActivities(engine, Settings(database_url=db_url), ConnectorKnobs())
    config = InboundWorkerConfig(
        database_id="db",
        namespace="sf",
        install_id=PACK,
        ordinal=0,
        queue_classes=[],
        preferred_queue_classes=[],
        batch_size=1,
        max_processing_rows=1000,
        generation=0,
        fencing_token="legacy",
    )
    request = ProcessRequest(config, [ClaimedLease(first.work_id, first.lease_token)], "w")
    result = ActivityEnvironment().run(acts.process, request)
    assert taken, "the batch ran no item"
    assert result.succeeded + result.retried + result.failed + result.lost == 1, result
    with pytest.raises(wq.FenceSuperseded):  # what the worker's own claim meets next
        wq.claim(engine, spec((0, "legacy"), "w"))
