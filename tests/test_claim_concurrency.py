"""Concurrent claims of one pack: no lock across the pack, and still no item twice,
no two live leases in one target lane, lanes in enqueue order.

Real concurrency against the real databases: threads (each with connections
of its own) and, on MariaDB, worker processes. The claim takes no named lock
on the MySQL family (``nexuscrm.connectors.queue.claiming``), so these are the
tests that would catch a lane or an item leased twice.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue as wq
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from tests.builders import event

PACK = "pack-1"
W = t.connector_work_item
A = t.connector_work_attempt


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    ensure_system_schema(eng)
    yield eng
    eng.dispose()


def spec(owner: str, **kw: Any) -> wq.ClaimSpec:
    args: dict[str, Any] = {
        "installed_pack_id": PACK,
        "queue_classes": (),
        "batch_size": 4,
        "lease_owner": owner,
        "lease_seconds": 60,
        "max_processing_rows": 100,
    }
    args.update(kw)
    return wq.ClaimSpec(**args)


def states(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(select(W.c.State, func.count()).group_by(W.c.State)).all()
    return {s: int(n) for s, n in rows}


def test_concurrent_claims_never_share_an_item_and_stay_near_the_budget(engine: Engine) -> None:
    wq.enqueue(engine, [event(PACK, f"k{i}") for i in range(60)])
    claimed: list[str] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def run(owner: str) -> None:
        try:
            while True:
                got = wq.claim(engine, spec(owner, max_processing_rows=40))
                if not got:
                    return
                with guard:
                    claimed.extend(i.work_id for i in got)
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(f"w{n}",)) for n in range(4)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors
    assert len(claimed) == len(set(claimed))  # no item twice
    # The budget is read from each claim's snapshot: four claims at one moment
    # can pass it by at most three batches of four, never more.
    assert 40 <= len(claimed) <= 40 + 3 * 4
    counts = states(engine)
    assert counts["processing"] == len(claimed)
    with engine.connect() as conn:
        assert conn.execute(select(func.max(W.c.Attempt))).scalar() == 1
    # once at the budget, a claim takes nothing new
    assert wq.claim(engine, spec("late", max_processing_rows=40)) == []


def test_concurrent_claims_keep_target_lanes_exclusive_and_in_order(engine: Engine) -> None:
    """Eight threads claim and finish 240 events of 60 source records that mutate
    6 target records, each through its own connections. A target lane must never
    hold two items at once, and its items must run in enqueue order."""
    reqs = []
    for i in range(240):
        source = f"S{i % 60}"
        target = f"T{i % 6}" if i % 5 else None  # some keep their source lane
        reqs.append(event(PACK, f"k{i}", source, target=target))
    res = wq.enqueue(engine, reqs)
    ordinal = {w: n for n, w in enumerate(res.work_ids)}
    holding: dict[str, str] = {}
    order: dict[str, list[str]] = defaultdict(list)
    overlaps: list[tuple[str, str, str]] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def run(owner: str) -> None:
        try:
            idle = 0
            while idle < 20:
                got = wq.claim(engine, spec(owner, batch_size=3))
                if not got:
                    idle += 1
                    time.sleep(0.02)
                    continue
                idle = 0
                with guard:
                    for item in got:
                        lanes = {item.target_mutation_lane_key, item.source_lane_key}
                        for lane in lanes:
                            if lane in holding:
                                overlaps.append((lane, holding[lane], item.work_id))
                            holding[lane] = item.work_id
                            order[lane].append(item.work_id)
                time.sleep(0.005)  # hold the leases a moment
                for item in got:
                    # Give the lanes up *before* the finish commits: an item of the
                    # same lane can only be claimed after that commit, so finding
                    # a lane still held means two items ran at once.
                    with guard:
                        for lane in {item.target_mutation_lane_key, item.source_lane_key}:
                            holding.pop(lane, None)
                    with engine.begin() as conn:
                        wq.finish_succeeded(conn, item)
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(f"w{n}",)) for n in range(8)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors
    assert overlaps == []
    assert states(engine) == {"succeeded": 240}
    for lane, ids in order.items():
        assert ids == sorted(ids, key=ordinal.__getitem__), lane
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(A)).scalar() == 240


def test_a_claim_does_not_wait_for_rows_another_claim_holds(engine: Engine) -> None:
    """MySQL family: rows locked by another transaction (a claim in flight) are
    skipped, not waited for; the claim takes the next items at once. SQLite has
    one writer: a held write lock makes the claim fail with QueueLockTimeout
    within LOCK_WAIT_SECONDS (tests/test_workqueue.py)."""
    if engine.dialect.name != "mysql":
        pytest.skip("row locks: MySQL family")
    res = wq.enqueue(engine, [event(PACK, f"k{i}") for i in range(6)])
    holder = engine.connect()
    try:
        held = res.work_ids[:3]
        for work_id in held:  # by primary key: row locks on these rows only
            holder.execute(select(W.c.WorkId).where(W.c.WorkId == work_id).with_for_update()).all()
        started = time.monotonic()
        got = wq.claim(engine, spec("w1", batch_size=6))
        assert time.monotonic() - started < 2
        assert [i.work_id for i in got] == res.work_ids[3:]
    finally:
        holder.rollback()
        holder.close()
    assert [i.work_id for i in wq.claim(engine, spec("w2", batch_size=6))] == held


def test_a_fence_take_over_waits_for_claims_in_flight(engine: Engine) -> None:
    """A claim holds the fence row shared until it commits: a take-over waits
    for it, then revokes what it leased (the claim's leases are not lost to
    the revoke's snapshot)."""
    if engine.dialect.name != "mysql":
        pytest.skip("row locks: MySQL family")
    gen, token = wq.take_fence(engine, PACK, "fleet-a", "token-a")
    wq.enqueue(engine, [event(PACK, f"k{i}") for i in range(4)])
    claimer = engine.connect()
    wq.check_claim_fence(claimer, PACK, gen, token)  # the claim's first read: fence locked
    took: list[tuple[int, str]] = []
    th = threading.Thread(target=lambda: took.append(wq.take_fence(engine, PACK, "b", "token-b")))
    th.start()
    time.sleep(0.5)
    assert took == []  # waiting for the claim in flight
    claimer.execute(
        W.update()
        .where(W.c.State == "pending")
        .values(State="processing", LeaseToken="x", LeaseUntil=utcnow(), FencingToken=token)
    )
    claimer.commit()
    claimer.close()
    th.join(10)
    assert took and took[0][0] == gen + 1
    assert states(engine) == {"pending": 4}  # the claim's leases were revoked


def _claim_and_finish(url: str, owner: str, out: Any) -> None:
    """Worker process: claim and finish until the queue stays empty; report what it ran."""
    eng = make_engine(url)
    ran: list[str] = []
    idle = 0
    while idle < 10:
        got = wq.claim(eng, spec(owner, batch_size=10))
        if not got:
            idle += 1
            time.sleep(0.05)
            continue
        idle = 0
        with eng.begin() as conn:
            for item in got:
                wq.finish_succeeded(conn, item)
        ran.extend(i.work_id for i in got)
    out.put((owner, ran))


def test_worker_processes_share_one_pack_without_a_lock(engine: Engine) -> None:
    """Four processes claim one pack's 2,000 events side by side: each runs some,
    none runs an item twice, every item succeeds on its first attempt."""
    if engine.dialect.name != "mysql":
        pytest.skip("side-by-side claims: MySQL family (SQLite has one writer)")
    wq.enqueue(engine, [event(PACK, f"k{i}", f"S{i % 400}") for i in range(2000)])
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    url = engine.url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_claim_and_finish, args=(url, f"p{n}", out)) for n in range(4)]
    for p in procs:
        p.start()
    ran = dict(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    flat = [w for ids in ran.values() for w in ids]
    assert len(flat) == len(set(flat)) == 2000
    assert all(len(ids) > 0 for ids in ran.values()), {o: len(i) for o, i in ran.items()}
    assert states(engine) == {"succeeded": 2000}
    with engine.connect() as conn:
        assert conn.execute(select(func.max(W.c.Attempt))).scalar() == 1


def test_sqlite_claim_lock_wait_is_shorter_than_the_claim_timeout(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite has one writer: a claim waits for another process's write lock at
    most LOCK_WAIT_SECONDS, well inside the claim local activity's 30 s."""
    if engine.dialect.name != "sqlite":
        pytest.skip("the MySQL family's claim takes no lock to wait for")
    assert wq.LOCK_WAIT_SECONDS <= 15
    from nexuscrm.connectors.queue import locking

    monkeypatch.setattr(locking, "LOCK_WAIT_SECONDS", 1)
    wq.enqueue(engine, [event(PACK, "a")])
    other = make_engine(str(engine.url))
    holder = other.connect()
    holder.exec_driver_sql("BEGIN IMMEDIATE")  # another process's writer
    started = time.monotonic()
    with pytest.raises(wq.QueueLockTimeout, match="within 1 s"):
        wq.claim(engine, spec("w1"))
    assert time.monotonic() - started < 5
    holder.rollback()
    holder.close()
    assert len(wq.claim(engine, spec("w1"))) == 1
