"""The durable connector work queue on a real database (SQLite, and MariaDB when configured)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, update

from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue as wq
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import FatalError, NexusError
from tests.builders import event

PACK = "pack-1"
W = t.connector_work_item


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    ensure_system_schema(eng)
    yield eng
    eng.dispose()


def req(
    key: str,
    source_id: str = "",
    *,
    obj: str = "Account",
    queue_class: str = "default",
    target: str | None = None,
    pack: str = PACK,
) -> wq.EnqueueRequest:
    """An upsert event for ``obj``/``source_id`` (default: the key)."""
    return event(
        pack,
        key,
        source_id or key,
        obj=obj,
        payload={"key": key, "n": 1},
        target=target,
        queue_class=queue_class,
    )


def claim(engine: Engine, now: datetime | None = None, **kw: Any) -> list[wq.ClaimedItem]:
    args: dict[str, Any] = {
        "installed_pack_id": PACK,
        "queue_classes": (),
        "batch_size": 100,
        "lease_owner": "worker-a",
        "lease_seconds": 30,
        "max_processing_rows": 100,
        "now": now,
    }
    args.update(kw)
    return wq.claim(engine, wq.ClaimSpec(**args))


def items(engine: Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        return {r["WorkId"]: dict(r) for r in conn.execute(select(W)).mappings()}


def attempts(engine: Engine, work_id: str) -> list[tuple[int, str, str | None, bool]]:
    a = t.connector_work_attempt
    with engine.connect() as conn:
        rows = conn.execute(
            select(a.c.Attempt, a.c.OutcomeState, a.c.CauseCode, a.c.Retriable)
            .where(a.c.WorkId == work_id)
            .order_by(a.c.Attempt)
        ).all()
    return [(int(r[0]), r[1], r[2], bool(r[3])) for r in rows]


def succeed(engine: Engine, item: wq.ClaimedItem, now: datetime | None = None) -> None:
    with engine.begin() as conn:
        wq.finish_succeeded(conn, item, now=now)


# --- enqueue -------------------------------------------------------------------


def test_enqueue_is_idempotent(engine: Engine) -> None:
    first = wq.enqueue(engine, [req("a"), req("b"), req("a")])
    assert (first.inserted, first.duplicates) == (2, 1)
    assert first.work_ids[0] == first.work_ids[2] != first.work_ids[1]
    again = wq.enqueue(engine, [req("b"), req("a"), req("c")])
    assert (again.inserted, again.duplicates) == (1, 2)
    assert again.work_ids[:2] == [first.work_ids[1], first.work_ids[0]]
    # the same key under another pack is another event
    other = wq.enqueue(engine, [req("a", pack="pack-2")])
    assert other.inserted == 1
    rows = items(engine)
    assert len(rows) == 4
    with engine.connect() as conn:
        events = conn.execute(select(t.connector_event)).mappings().all()
    assert len(events) == 4
    assert {e["ExecutionOwner"] for e in events} == {"work_item"}
    row = rows[first.work_ids[0]]
    assert (row["State"], row["Attempt"], row["WorkType"]) == ("pending", 0, "ConnectorEvent")
    assert row["SourceLaneKey"] == row["TargetMutationLaneKey"] == "sf/Account/a"


def test_enqueue_rejects_bad_requests_before_writing(engine: Engine) -> None:
    bad = req("x")
    bad.payload = {"when": object()}
    with pytest.raises(wq.InvalidWorkRequest, match="JSON"):
        wq.enqueue(engine, [req("ok"), bad])
    with pytest.raises(wq.InvalidWorkRequest, match="idempotency_key"):
        wq.enqueue(engine, [req("")])
    assert items(engine) == {}


def _stored(engine: Engine) -> dict[str, tuple[str, str]]:
    """Idempotency key -> (source id, payload text) of every stored event."""
    e = t.connector_event
    with engine.connect() as conn:
        rows = conn.execute(select(e.c.IdempotencyKey, e.c.SourceId, e.c.Payload)).all()
    return {r[0]: (r[1], r[2]) for r in rows}


def test_enqueue_refuses_a_key_reused_with_other_content(engine: Engine) -> None:
    wq.enqueue(engine, [req("a"), req("b"), req("c")])
    before = _stored(engine)
    other_payload = req("a")
    other_payload.payload = {"key": "a", "n": 2}
    other_source = req("b", "elsewhere")
    same_reordered = req("c")
    same_reordered.payload = {"n": 1, "key": "c"}  # the same JSON value: a duplicate
    with pytest.raises(wq.IdempotencyConflict) as info:
        wq.enqueue(engine, [req("d"), other_payload, other_source, same_reordered])
    message = str(info.value)
    assert "2 of 4 request(s) reuse an idempotency key with other content" in message
    assert "nothing enqueued" in message
    assert "idempotency_key 'a': payload differs from the stored" in message
    assert "idempotency_key 'b': source_id differs from the stored" in message
    assert "'c'" not in message
    assert info.value.inserted == 0 and len(info.value.conflicts) == 2
    assert _stored(engine) == before  # 'd' was not enqueued either
    # twice in one call with other content: refused, nothing written
    twice = "request 2: idempotency_key 'e': source_id differs"
    with pytest.raises(wq.IdempotencyConflict, match=twice):
        wq.enqueue(engine, [req("e"), req("e", "other")])
    assert _stored(engine) == before
    # the same content again, keys in another order, is a duplicate
    again = wq.enqueue(engine, [same_reordered, req("d")])
    assert (again.inserted, again.duplicates) == (1, 1)


def _race_for_keys(engine: Engine, writers: int, keys: int) -> tuple[dict[int, int], set[int]]:
    """``writers`` threads enqueue the same ``keys`` keys, each with its own
    payload and its own first key, in batches of 4, started together. Returns
    each writer's count of events it was told were kept (``inserted`` of its
    result or of its ``IdempotencyConflict``) and the writers not refused."""
    outcome: dict[int, int] = {}
    returned: set[int] = set()
    errors: list[BaseException] = []
    start = threading.Barrier(writers)

    def run(n: int) -> None:
        mine = []
        for i in range(keys):
            r = req(f"shared-{(i + n * keys // writers) % keys}")
            r.payload = {"writer": n}
            mine.append(r)
        start.wait()
        try:
            outcome[n] = wq.enqueue(engine, mine, batch_size=4).inserted
            returned.add(n)
        except wq.IdempotencyConflict as exc:
            outcome[n] = exc.inserted
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(n,)) for n in range(writers)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors
    return outcome, returned


def test_racing_enqueuers_of_one_key_with_other_content_each_learn_what_was_kept(
    engine: Engine,
) -> None:
    # Writers race for the same 40 keys with their own payloads, all at once:
    # each one's check before writing passes, then a batch meets another
    # writer's event. Whatever the interleaving, no event is dropped unseen: a
    # writer that was not refused stored all of its events, and a refused one
    # was told in IdempotencyConflict.inserted exactly how many of its events
    # were kept.
    writers, keys = 4, 40
    refused_after_writing = 0
    for trial in range(5):
        with engine.begin() as conn:
            conn.execute(t.connector_work_item.delete())
            conn.execute(t.connector_event.delete())
        outcome, returned = _race_for_keys(engine, writers, keys)
        kept = dict.fromkeys(range(writers), 0)
        for _source, payload in _stored(engine).values():
            kept[json.loads(payload)["writer"]] += 1
        assert kept == outcome, trial
        assert all(kept[n] == keys for n in returned), trial
        refused_after_writing += sum(1 for n in outcome if n not in returned and outcome[n])
        if refused_after_writing:
            break
    # the race this test is for happened: a batch met a key stored after the check
    assert refused_after_writing


def test_lane_ordinals_follow_enqueue_order(engine: Engine) -> None:
    # Small batches: ordinals must keep increasing across transactions too.
    reqs = [req(f"k{i}", f"rec{i % 2}", target="T1" if i == 4 else None) for i in range(6)]
    res = wq.enqueue(engine, reqs, batch_size=2)
    rows = items(engine)
    with engine.connect() as conn:
        ev = {
            r[0]: r[1]
            for r in conn.execute(
                select(t.connector_event.c.EventId, t.connector_event.c.EnqueueOrdinal)
            )
        }
    by_lane: dict[str, list[int]] = {}
    for wid in res.work_ids:
        by_lane.setdefault(rows[wid]["SourceLaneKey"], []).append(rows[wid]["LaneOrdinal"])
    assert set(by_lane) == {"sf/Account/rec0", "sf/Account/rec1"}
    for ordinals in by_lane.values():
        assert ordinals == sorted(ordinals) and len(set(ordinals)) == 3
    enqueue_ordinals = [ev[rows[w]["EventId"]] for w in res.work_ids]
    assert enqueue_ordinals == sorted(enqueue_ordinals) and len(set(enqueue_ordinals)) == 6
    assert rows[res.work_ids[4]]["TargetMutationLaneKey"] == "sf/Account/T1"
    assert rows[res.work_ids[4]]["QueueClass"] == "default"


def test_concurrent_enqueuers_keep_unique_ordinals(engine: Engine) -> None:
    threads, per_thread = 4, 60
    errors: list[BaseException] = []
    results: dict[int, wq.EnqueueResult] = {}

    def run(n: int) -> None:
        try:
            # shared lanes, private keys, plus keys every thread races for
            mine = [req(f"t{n}-{i}", f"lane{i % 3}") for i in range(per_thread)]
            shared = [req(f"shared-{i}", f"lane{i % 3}") for i in range(10)]
            results[n] = wq.enqueue(engine, mine + shared, batch_size=7)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors
    rows = items(engine)
    assert len(rows) == threads * per_thread + 10
    assert sum(r.inserted for r in results.values()) == len(rows)
    assert sum(r.duplicates for r in results.values()) == (threads - 1) * 10
    ordinals = [r["LaneOrdinal"] for r in rows.values()]
    assert len(set(ordinals)) == len(ordinals)
    # within a lane, each thread's events keep that thread's enqueue order
    for n, res in results.items():
        own = [rows[w] for w in res.work_ids[:per_thread]]
        for lane in ("sf/Account/lane0", "sf/Account/lane1", "sf/Account/lane2"):
            seq = [r["LaneOrdinal"] for r in own if r["SourceLaneKey"] == lane]
            assert seq == sorted(seq), (n, lane)
    # every thread got the one work id of each shared key
    shared_ids = {tuple(res.work_ids[per_thread:]) for res in results.values()}
    assert len(shared_ids) == 1


# --- claim ---------------------------------------------------------------------


def test_claim_takes_only_lane_heads(engine: Engine) -> None:
    res = wq.enqueue(engine, [req("a1", "A"), req("b1", "B"), req("a2", "A"), req("a3", "A")])
    a1, b1, a2, a3 = res.work_ids
    now = utcnow()
    got = claim(engine, now)
    assert [i.work_id for i in got] == [a1, b1]
    first = got[0]
    assert first.attempt == 1 and first.lease_owner == "worker-a"
    assert first.lease_until == now + timedelta(seconds=30)
    assert first.payload == {"key": "a1", "n": 1}
    assert (first.namespace, first.event_kind, first.source_id) == ("sf", "record.upsert", "A")
    assert first.source_lane_key == "sf/Account/A"
    assert claim(engine, now) == []  # a2 waits behind a1, which is processing
    succeed(engine, first, now)
    assert [i.work_id for i in claim(engine, now)] == [a2]
    # a blocked (parked) item holds its lane and is never claimed itself
    with engine.begin() as conn:
        conn.execute(
            update(W)
            .where(W.c.WorkId == a2)
            .values(State="blocked", LeaseOwner=None, LeaseToken=None, LeaseUntil=None)
        )
    later = now + timedelta(seconds=60)
    assert [i.work_id for i in claim(engine, later)] == [b1]  # only b1's stale lease
    assert items(engine)[a3]["State"] == "pending"


def test_target_lane_is_exclusive(engine: Engine) -> None:
    res = wq.enqueue(
        engine, [req("x", "S1", target="T"), req("y", "S2", target="T"), req("z", "S3")]
    )
    x, y, z = res.work_ids
    now = utcnow()
    got = claim(engine, now)
    assert [i.work_id for i in got] == [x, z]  # one per target lane per batch
    assert got[0].target_mutation_lane_key == "sf/Account/T"
    assert claim(engine, now) == []  # T holds a live lease
    succeed(engine, got[0], now)
    assert [i.work_id for i in claim(engine, now)] == [y]


def test_processing_budget(engine: Engine) -> None:
    wq.enqueue(engine, [req(f"k{i}") for i in range(5)])
    now = utcnow()
    got = claim(engine, now, max_processing_rows=3)
    assert len(got) == 3
    assert claim(engine, now, max_processing_rows=3) == []
    succeed(engine, got[0], now)
    assert len(claim(engine, now, max_processing_rows=3)) == 1
    assert len(claim(engine, now, max_processing_rows=10, batch_size=1)) == 1
    # a parked row (dependency set, no lease) holds no budget
    with engine.begin() as conn:
        conn.execute(
            update(W)
            .where(W.c.WorkId == got[1].work_id)
            .values(DependencyKind="identity", LeaseOwner=None, LeaseToken=None, LeaseUntil=None)
        )
    assert wq.processing_pressure(engine, PACK, [], now) == (3, 0)
    assert claim(engine, now, max_processing_rows=4) == []  # nothing left to claim
    # expired leases no longer count against the budget either
    later = now + timedelta(seconds=31)
    assert wq.processing_pressure(engine, PACK, [], later) == (3, 3)


def test_budget_counts_stale_rows_but_not_parked_ones(engine: Engine) -> None:
    """Issue 5 rule 2 (the seed's processing pressure): a processing row whose lease
    expired still holds budget (only its reclaim may take it), a parked row holds none."""
    wq.enqueue(engine, [req(f"s{i}") for i in range(5)])
    now = utcnow()
    first = claim(engine, now, max_processing_rows=3)
    assert len(first) == 3
    later = now + timedelta(seconds=31)  # all three leases expired, none finished
    assert wq.processing_pressure(engine, PACK, [], later) == (3, 3)
    again = claim(engine, later, max_processing_rows=3, batch_size=10)
    # the stale rows are re-leased; the two pending items stay pending
    assert sorted(i.work_id for i in again) == sorted(i.work_id for i in first)
    states = {r["WorkId"]: r["State"] for r in items(engine).values()}
    assert sorted(states.values()) == [
        "pending",
        "pending",
        "processing",
        "processing",
        "processing",
    ]
    # parking one of them frees exactly one row of budget
    with engine.begin() as conn:
        conn.execute(
            update(W)
            .where(W.c.WorkId == again[0].work_id)
            .values(DependencyKind="identity", LeaseOwner=None, LeaseToken=None, LeaseUntil=None)
        )
    assert len(claim(engine, later, max_processing_rows=3, batch_size=10)) == 1


def test_budget_is_per_pack_and_shared_by_its_workers(engine: Engine) -> None:
    """Issue 5 rule 12: an explicit (or derived) budget bounds all workers of one
    pack together, and is not global across packs."""
    wq.enqueue(
        engine, [req(f"a{i}") for i in range(6)] + [req(f"b{i}", pack="pack-2") for i in range(6)]
    )
    now = utcnow()
    first = claim(engine, now, max_processing_rows=4, batch_size=3, lease_owner="worker-0")
    second = claim(engine, now, max_processing_rows=4, batch_size=3, lease_owner="worker-1")
    assert (len(first), len(second)) == (3, 1)  # one budget of 4 for the pack's workers
    other = claim(engine, now, installed_pack_id="pack-2", max_processing_rows=4, batch_size=10)
    assert len(other) == 4  # another pack has a budget of its own


def test_queue_class_filter_and_preference(engine: Engine) -> None:
    res = wq.enqueue(
        engine,
        [
            req("b1", queue_class="bulk"),
            req("d1", queue_class="default"),
            req("i1", queue_class=" Interactive "),
            req("b2", queue_class="bulk"),
        ],
    )
    b1, d1, i1, b2 = res.work_ids
    now = utcnow()
    assert items(engine)[i1]["QueueClass"] == "interactive"
    assert [i.work_id for i in claim(engine, now, queue_classes=["BULK"], batch_size=1)] == [b1]
    got = claim(
        engine,
        now,
        queue_classes=["default", "interactive"],
        preferred_queue_classes=["interactive"],
    )
    assert [i.work_id for i in got] == [i1, d1]
    assert [i.queue_class for i in got] == ["interactive", "default"]
    assert [i.work_id for i in claim(engine, now)] == [b2]


def test_run_after_is_respected(engine: Engine) -> None:
    wq.enqueue(engine, [req("a")])
    now = utcnow()
    (item,) = claim(engine, now)
    with engine.begin() as conn:
        wq.finish_retry(
            conn,
            item,
            run_after=now + wq.retry_backoff(1) * 60,
            failure_class="remote-timeout",
            summary="timed out",
            now=now,
        )
    assert claim(engine, now + timedelta(seconds=59)) == []
    (again,) = claim(engine, now + timedelta(seconds=60))
    assert again.work_id == item.work_id and again.attempt == 2
    row = items(engine)[item.work_id]
    assert (row["FailureCount"], row["FailureClass"]) == (1, "remote-timeout")
    assert row["LastFailureAt"] == now


def test_stale_lease_is_reclaimed(engine: Engine) -> None:
    wq.enqueue(engine, [req("a"), req("b")])
    now = utcnow()
    first = claim(engine, now, lease_owner="dead-worker")
    assert len(first) == 2
    # not stale yet at exactly LeaseUntil
    assert claim(engine, now + timedelta(seconds=30), lease_owner="w2") == []
    later = now + timedelta(seconds=31)
    assert wq.processing_pressure(engine, PACK, [], later) == (2, 2)
    second = claim(engine, later, lease_owner="w2", batch_size=1)
    assert len(second) == 1
    item = second[0]
    assert item.work_id == first[0].work_id
    assert item.attempt == 2 and item.lease_token != first[0].lease_token
    assert attempts(engine, item.work_id) == [(1, "abandoned", "lease-expired", True)]
    with pytest.raises(wq.LeaseLost), engine.begin() as conn:
        wq.finish_succeeded(conn, first[0], now=later)
    succeed(engine, item, later)
    assert [a[:2] for a in attempts(engine, item.work_id)] == [(1, "abandoned"), (2, "succeeded")]
    assert items(engine)[item.work_id]["State"] == "succeeded"


def test_extend_leases(engine: Engine) -> None:
    wq.enqueue(engine, [req("a"), req("b")])
    now = utcnow()
    a, b = claim(engine, now)
    assert (
        wq.extend_leases(engine, [(a.work_id, a.lease_token)], 30, now + timedelta(seconds=20))
        == []
    )
    assert items(engine)[a.work_id]["LeaseUntil"] == now + timedelta(seconds=50)
    later = now + timedelta(seconds=40)
    got = claim(engine, later, lease_owner="w2")
    assert [i.work_id for i in got] == [b.work_id]  # a's lease is alive, b's went stale
    lost = wq.extend_leases(
        engine, [(a.work_id, a.lease_token), (b.work_id, b.lease_token)], 30, later
    )
    assert lost == [b.work_id]
    assert wq.extend_leases(engine, [(got[0].work_id, got[0].lease_token)], 30, later) == []


def test_finish_writes_attempts_and_fences_on_token(engine: Engine) -> None:
    res = wq.enqueue(engine, [req("ok"), req("retry"), req("fail")])
    now = utcnow()
    ok, retry, fail = claim(engine, now)
    with engine.begin() as conn:
        wq.finish_succeeded(conn, ok, flow_execution_id="flow-1", now=now)
        wq.finish_retry(
            conn, retry, run_after=now, failure_class="transient-db", summary="x" * 5000, now=now
        )
        wq.finish_failed(conn, fail, failure_class="mapping", summary="bad field", now=now)
    rows = items(engine)
    assert rows[ok.work_id]["State"] == "succeeded"
    assert rows[ok.work_id]["TerminalAt"] == now
    assert rows[ok.work_id]["LeaseToken"] is None
    assert rows[retry.work_id]["State"] == "pending"
    assert rows[retry.work_id]["LeaseUntil"] is None
    assert len(rows[retry.work_id]["FailureSummary"]) == 4000
    assert (rows[fail.work_id]["State"], rows[fail.work_id]["FailureClass"]) == (
        "failed",
        "mapping",
    )
    assert rows[fail.work_id]["TerminalAt"] == now
    assert attempts(engine, ok.work_id) == [(1, "succeeded", None, False)]
    assert attempts(engine, retry.work_id) == [(1, "retry", "transient-db", True)]
    assert attempts(engine, fail.work_id) == [(1, "failed", "mapping", False)]
    a = t.connector_work_attempt
    with engine.connect() as conn:
        flow_id = conn.execute(
            select(a.c.FlowExecutionId).where(a.c.WorkId == ok.work_id)
        ).scalar_one()
    assert flow_id == "flow-1"
    # a finish with a stale token changes nothing, and the caller's writes roll back
    for finish in (
        lambda c: wq.finish_succeeded(c, ok),
        lambda c: wq.finish_retry(c, fail, run_after=now, failure_class="x", summary="y"),
        lambda c: wq.finish_failed(c, retry, failure_class="x", summary="y"),
    ):
        with pytest.raises(wq.LeaseLost) as info, engine.begin() as conn:
            finish(conn)
        assert info.value.work_id in res.work_ids
    assert items(engine) == rows


def test_replay(engine: Engine) -> None:
    res = wq.enqueue(engine, [req("a", "L"), req("b", "L"), req("c", "M"), req("d", "M")])
    a_id, b_id, c_id, d_id = res.work_ids
    now = utcnow()
    a, c = claim(engine, now)
    with pytest.raises(NexusError, match="processing"):
        wq.replay(engine, a_id)
    with engine.begin() as conn:
        wq.finish_failed(conn, a, failure_class="flow-error", summary="boom", now=now)
        wq.finish_failed(conn, c, failure_class="flow-error", summary="boom", now=now)
    b, d = claim(engine, now)
    succeed(engine, b, now)
    with pytest.raises(NexusError, match="succeeded"):
        wq.replay(engine, b_id)
    with pytest.raises(NexusError, match="no such"):
        wq.replay(engine, "wi-missing")
    # a later event of L succeeded: replaying a would overwrite it
    with pytest.raises(NexusError, match=f"overwrite newer data.*{b_id} \\(succeeded\\)"):
        wq.replay(engine, a_id)
    # ... and of M one is running
    with pytest.raises(NexusError, match=f"{d_id} \\(processing\\)"):
        wq.replay(engine, c_id)
    wq.release_leases(engine, [d])
    new_id = wq.replay(engine, c_id, now=now)
    rows = items(engine)
    assert rows[c_id]["ReplayedAt"] == now
    assert rows[a_id]["ReplayedAt"] is None
    new = rows[new_id]
    assert (new["State"], new["Attempt"], new["ReplayOfWorkId"]) == ("pending", 0, c_id)
    assert new["EventId"] == rows[c_id]["EventId"]
    assert new["SourceLaneKey"] == "sf/Account/M"
    # its original position in the lane: before d, which still waits
    assert new["LaneOrdinal"] == rows[c_id]["LaneOrdinal"] < rows[d_id]["LaneOrdinal"]
    with pytest.raises(NexusError, match="replayed already"):
        wq.replay(engine, c_id)
    # enqueuing the event's key again points at the live replay
    assert wq.enqueue(engine, [req("c", "M")]).work_ids == [new_id]
    (again,) = claim(engine, now)
    assert (again.work_id, again.replay_of_work_id, again.attempt) == (new_id, c_id, 1)
    assert again.payload == {"key": "c", "n": 1}


def test_stats_and_pressure(engine: Engine) -> None:
    t0 = utcnow()
    wq.enqueue(engine, [req(f"d{i}") for i in range(4)], now=t0)
    wq.enqueue(engine, [req("b1", queue_class="bulk")], now=t0)
    wq.enqueue(engine, [req("o1", pack="pack-2")], now=t0)
    got = claim(engine, t0, queue_classes=["default"], batch_size=3)
    with engine.begin() as conn:
        wq.finish_failed(conn, got[0], failure_class="mapping", summary="m", now=t0)
        wq.finish_failed(conn, got[1], failure_class="", summary="?", now=t0)
    later = t0 + timedelta(seconds=90)
    (stats,) = wq.pack_queue_stats(engine, PACK, now=later)
    assert stats.counts == {
        ("failed", "default"): 2,
        ("processing", "default"): 1,
        ("pending", "default"): 1,
        ("pending", "bulk"): 1,
    }
    assert stats.by_state() == {"failed": 2, "processing": 1, "pending": 2}
    assert stats.oldest_pending_age_s == 90.0
    assert stats.failures_by_class == {"mapping": 1, "unknown": 1}
    everyone = wq.pack_queue_stats(engine, now=later)
    assert [s.installed_pack_id for s in everyone] == [PACK, "pack-2"]
    assert wq.pack_queue_stats(engine, "nobody") == [wq.PackQueueStats("nobody")]
    assert wq.processing_pressure(engine, PACK, ["default"], t0) == (1, 0)
    assert wq.processing_pressure(engine, PACK, ["bulk"], t0) == (0, 0)
    assert wq.processing_pressure(engine, PACK, [], t0 + timedelta(seconds=30)) == (1, 1)
    assert wq.processing_pressure(engine, "pack-2", [], t0) == (0, 0)


def test_retry_backoff() -> None:
    assert wq.retry_backoff(0) == timedelta(seconds=1)
    assert [wq.retry_backoff(n).total_seconds() for n in range(1, 6)] == [1, 2, 4, 8, 16]
    assert wq.retry_backoff(9) == timedelta(seconds=256)
    assert wq.retry_backoff(10) == wq.retry_backoff(1000) == timedelta(minutes=5)


def test_lane_key_stays_within_the_column() -> None:
    key = wq.lane_key("ns", "Obj", "x" * 300)
    assert len(key) == 191 and key.startswith("ns/Obj/xxx")
    assert key == wq.lane_key("ns", "Obj", "x" * 300) != wq.lane_key("ns", "Obj", "x" * 301)


def test_claim_pages_past_a_busy_target_lane(engine: Engine) -> None:
    # 40 events of different source lanes all mutate target T; the scan window
    # of a budget-1 claim is 18 rows, so reaching "other" needs keyset paging.
    reqs = [req(f"t{i}", f"S{i}", target="T") for i in range(40)] + [req("other")]
    res = wq.enqueue(engine, reqs)
    now = utcnow()
    (first,) = claim(engine, now, batch_size=1)
    assert first.work_id == res.work_ids[0]
    (second,) = claim(engine, now, batch_size=1)
    assert second.work_id == res.work_ids[-1]
    # WorkflowActionApply items are claimed too
    with engine.begin() as conn:
        conn.execute(
            update(W).where(W.c.WorkId == res.work_ids[1]).values(WorkType="WorkflowActionApply")
        )
    succeed(engine, first, now)
    (third,) = claim(engine, now, batch_size=5)
    assert third.work_id == res.work_ids[1]


def test_load_claimed_by_lease(engine: Engine) -> None:
    wq.enqueue(engine, [req("a"), req("b"), req("c")])
    now = utcnow()
    a, b, c = claim(engine, now)
    with engine.begin() as conn:
        wq.finish_succeeded(conn, b, now=now)
    leases = [(c.work_id, c.lease_token), (b.work_id, b.lease_token), (a.work_id, "stale")]
    leases.append(("wi-missing", "x"))
    assert wq.load_claimed(engine, leases) == [c]
    assert wq.load_claimed(engine, []) == []


# --- shutdown hand-back, claim errors -----------------------------------------


def test_release_leases_hands_items_back_at_once(engine: Engine) -> None:
    wq.enqueue(engine, [req("a"), req("b"), req("c")])
    now = utcnow()
    a, b, c = claim(engine, now, lease_seconds=3600)
    succeed(engine, a, now)
    stale_b = dataclasses.replace(b, lease_token="stale")
    # a is finished and b's token is not ours: only c is handed back
    assert wq.release_leases(engine, [a, stale_b, c], now=now) == [c.work_id]
    row = items(engine)[c.work_id]
    assert (row["State"], row["LeaseToken"], row["LeaseUntil"], row["LeaseOwner"]) == (
        "pending",
        None,
        None,
        None,
    )
    assert row["FailureCount"] == 0 and row["Attempt"] == 1
    assert attempts(engine, c.work_id) == [(1, "abandoned", "worker-shutdown", True)]
    # claimable at once (not after the hour-long lease), as the next attempt
    (again,) = claim(engine, now, lease_owner="w2")
    assert again.work_id == c.work_id and again.attempt == 2
    succeed(engine, again, now)
    assert [x[:2] for x in attempts(engine, c.work_id)] == [(1, "abandoned"), (2, "succeeded")]
    assert wq.release_leases(engine, [b], now=now) == [b.work_id]
    assert wq.release_leases(engine, [b], now=now) == []  # already handed back
    assert wq.release_leases(engine, []) == []


def test_claim_on_a_missing_column_is_permanent(engine: Engine) -> None:
    wq.enqueue(engine, [req("a")])
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE _System_ConnectorWorkItem DROP COLUMN LeaseOwner")
    with pytest.raises(wq.ClaimSchemaMissing, match="schema missing") as err:
        claim(engine)
    assert isinstance(err.value, FatalError)  # mapped to a non-retryable failure
