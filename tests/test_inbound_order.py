"""Once and in order per record, at the processor: deadline overruns, replays, the
attempt cap and concurrent batches (issue 11, items 3-6), on SQLite and MariaDB.

The pack is installed by a real ApplyAll (dev server); the batches are claimed
and processed with the real ``nexuscrm`` functions, several at once in threads
where concurrency is the point.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, text, update

from nexuscrm import catalog
from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue
from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.processor import Processor
from nexuscrm.connectors.routes import ConnectorPackRow, list_connector_packs
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import dialect_name
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import NexusError
from tests.builders import SF_SYNC, children_and_parents, install, record_upsert

W = t.connector_work_item


@pytest.fixture
async def synced(temporal_env: Any, settings: Any) -> tuple[Engine, ConnectorPackRow]:
    """The salesforce-sync pack installed by ApplyAll; its engine and pack row."""
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    catalog.CACHE.invalidate()
    (pack,) = list_connector_packs(engine)
    return engine, pack


def claim(engine: Engine, pack: ConnectorPackRow, **kw: Any) -> list[queue.ClaimedItem]:
    spec: dict[str, Any] = {
        "installed_pack_id": pack.install_id,
        "queue_classes": (),
        "batch_size": 100,
        "lease_owner": "test",
        "lease_seconds": 60,
        "max_processing_rows": 1000,
    }
    spec.update(kw)
    return queue.claim(engine, queue.ClaimSpec(**spec))


def phone(engine: Engine, name: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT Phone FROM Account WHERE Name = :n"), {"n": name}
        ).scalar_one_or_none()


def attempts(engine: Engine, work_id: str) -> list[tuple[str, str | None]]:
    a = t.connector_work_attempt
    with engine.connect() as conn:
        return [
            (r.OutcomeState, r.CauseCode)
            for r in conn.execute(
                select(a.c.OutcomeState, a.c.CauseCode)
                .where(a.c.WorkId == work_id)
                .order_by(a.c.Attempt)
            )
        ]


def row(engine: Engine, work_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(W).where(W.c.WorkId == work_id)).mappings().one()


def versions(pack: ConnectorPackRow, remote_id: str, n: int) -> list[queue.EnqueueRequest]:
    """``n`` upserts of one Account, Phone ``v0`` .. ``v<n-1>`` (enqueue order = version)."""
    return [
        record_upsert(
            pack.install_id,
            pack.namespace,
            "Account",
            remote_id,
            {"Name": f"Account {remote_id}", "Phone": f"v{i}"},
            key=f"{remote_id}:v{i}",
        )
        for i in range(n)
    ]


def fail(engine: Engine, item: queue.ClaimedItem) -> None:
    """End ``item``'s attempt as failed (what a broken endpoint or flow does)."""
    with engine.begin() as conn:
        queue.finish_failed(conn, item, failure_class="webhook-http-503", summary="down")


# --- item 3: a flow-deadline overrun applies once -----------------------------------


@contextlib.contextmanager
def write_blocked(engine: Engine, work_ids: list[str], seconds: float) -> Iterator[None]:
    """Another session holds a lock the chunk's transaction needs, for ``seconds``.

    SQLite: the database write lock (``BEGIN IMMEDIATE``); MariaDB: the work
    item rows (``SELECT ... FOR UPDATE``), which the chunk's lease hold waits on.
    """
    ready = threading.Event()

    def hold() -> None:
        with engine.connect() as conn:
            if dialect_name(conn) == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.begin()
                conn.execute(select(W.c.WorkId).where(W.c.WorkId.in_(work_ids)).with_for_update())
            ready.set()
            time.sleep(seconds)
            conn.rollback()

    thread = threading.Thread(target=hold)
    thread.start()
    assert ready.wait(30)
    try:
        yield
    finally:
        thread.join()


async def test_flow_deadline_overrun_rolls_the_chunk_back_and_applies_once(synced) -> None:
    """A chunk that outlasts the flow deadline (here: it waited on a lock for longer)
    writes nothing; its items are redone one by one within the deadline, so each
    event is applied once and succeeds on its first attempt: never committed and
    then retried (which re-applied the event up to 8 times)."""
    engine, pack = synced
    queue.enqueue(engine, [versions(pack, f"d{k}", 1)[0] for k in range(5)])
    items = claim(engine, pack)
    assert len(items) == 5
    proc = Processor(engine, flow_deadline=timedelta(seconds=1.5))
    with write_blocked(engine, [i.work_id for i in items], seconds=3):
        outcome = proc.process(items)
    assert (outcome.succeeded, outcome.retried, outcome.failed) == (5, 0, 0)
    for item in items:
        assert row(engine, item.work_id)["State"] == "succeeded"
        assert attempts(engine, item.work_id) == [("succeeded", None)]
    assert {phone(engine, f"Account d{k}") for k in range(5)} == {"v0"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM Account")).scalar_one() == 5


# --- item 4: a replay keeps its record's order ---------------------------------------


async def test_replay_runs_in_its_original_position_before_later_events(synced) -> None:
    """v0 fails while v1 waits behind it; its replay runs before v1 (the record ends
    at v1), never after it (which left the record at the older v0)."""
    engine, pack = synced
    queue.enqueue(engine, versions(pack, "r1", 2))
    (v0,) = claim(engine, pack)  # the lane head only
    fail(engine, v0)
    replay_id = queue.replay(engine, v0.work_id)
    proc = Processor(engine, flow_deadline=None)
    (first,) = claim(engine, pack)
    assert first.work_id == replay_id
    assert proc.process([first]).succeeded == 1
    (second,) = claim(engine, pack)
    assert second.work_id != replay_id
    assert proc.process([second]).succeeded == 1
    assert phone(engine, "Account r1") == "v1"


async def test_replay_is_refused_while_a_later_event_of_the_record_succeeded(synced) -> None:
    """Replaying v0 after v1 succeeded would put v0's values over v1's: refused,
    naming v1; the record keeps v1. Likewise while v1 is running."""
    engine, pack = synced
    queue.enqueue(engine, versions(pack, "r2", 2))
    proc = Processor(engine, flow_deadline=None)
    (v0,) = claim(engine, pack)
    fail(engine, v0)
    (v1,) = claim(engine, pack)
    with pytest.raises(NexusError, match=f"{v1.work_id} \\(processing\\)"):
        queue.replay(engine, v0.work_id)
    assert proc.process([v1]).succeeded == 1
    with pytest.raises(NexusError, match=f"overwrite newer data.*{v1.work_id} \\(succeeded\\)"):
        queue.replay(engine, v0.work_id)
    assert row(engine, v0.work_id)["ReplayedAt"] is None
    assert phone(engine, "Account r2") == "v1"


async def test_replay_superseded_after_it_was_queued_fails_without_writing(synced) -> None:
    """The processor checks the rule again: a replay whose record got a newer
    applied event after the replay was queued (a claim that raced the replay)
    fails ``replay-superseded`` and writes nothing."""
    engine, pack = synced
    queue.enqueue(engine, versions(pack, "r3", 2))
    proc = Processor(engine, flow_deadline=None)
    (v0,) = claim(engine, pack)
    fail(engine, v0)
    replay_id = queue.replay(engine, v0.work_id)
    # v1 was applied by a worker whose claim read the lane before the replay existed
    v1_id = next(w for w in _lane_ids(engine, "r3") if w not in (v0.work_id, replay_id))
    with engine.begin() as conn:
        conn.execute(update(W).where(W.c.WorkId == v1_id).values(State="succeeded"))
    (replayed,) = claim(engine, pack)
    assert replayed.work_id == replay_id
    outcome = proc.process([replayed])
    assert (outcome.failed, outcome.failure_classes) == (1, {"replay-superseded": 1})
    failed = row(engine, replay_id)
    assert failed["FailureClass"] == "replay-superseded"
    assert v1_id in failed["FailureSummary"]
    assert phone(engine, "Account r3") is None  # v0's values were not written


def _lane_ids(engine: Engine, remote_id: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(W.c.WorkId).where(W.c.SourceLaneKey.like(f"%/Account/{remote_id}"))
            ).scalars()
        )


# --- item 5: the attempt cap covers every way an attempt ends ------------------------


async def test_an_item_whose_attempts_keep_being_abandoned_fails_at_the_cap(synced) -> None:
    """An attempt that ends without a result (the worker died, the batch raised)
    counts: after ``MAX_ATTEMPTS`` abandoned attempts the claim fails the item
    ``attempts-exhausted`` and the record's next event runs. Before, it was
    reclaimed forever and held the record's later events behind it."""
    engine, pack = synced
    queue.enqueue(engine, versions(pack, "x1", 2))
    first = claim(engine, pack, lease_seconds=1)
    for n in range(1, queue.MAX_ATTEMPTS):
        (again,) = claim(engine, pack, lease_seconds=1, now=utcnow() + timedelta(seconds=5 * n))
        assert again.work_id == first[0].work_id
        assert again.attempt == n + 1
    later = utcnow() + timedelta(minutes=5)
    # the claim that finds it exhausted fails it; the record's next event is the
    # lane head from then on
    (nxt,) = claim(engine, pack, now=later) or claim(engine, pack, now=later)
    assert nxt.work_id != first[0].work_id
    dead = row(engine, first[0].work_id)
    assert (dead["State"], dead["FailureClass"]) == ("failed", "attempts-exhausted")
    assert f"all {queue.MAX_ATTEMPTS} attempts" in dead["FailureSummary"]
    outcomes = [o for o, _c in attempts(engine, first[0].work_id)]
    assert outcomes == ["abandoned"] * (queue.MAX_ATTEMPTS - 1) + ["failed"]


async def test_a_poison_item_fails_alone_and_its_batch_mates_run(synced) -> None:
    """An event whose payload is not a JSON object made the whole batch raise
    (abandoned, reclaimed, abandoned again): it now fails ``payload-invalid`` at
    once, alone, and the batch's other items and the record's later events run."""
    engine, pack = synced
    good = [versions(pack, f"g{k}", 1)[0] for k in range(5)]
    poison, after = versions(pack, "p1", 2)
    res = queue.enqueue(engine, [*good[:2], poison, *good[2:], after])
    poison_id = res.work_ids[2]
    with engine.begin() as conn:
        ev = conn.execute(select(W.c.EventId).where(W.c.WorkId == poison_id)).scalar_one()
        conn.execute(
            update(t.connector_event)
            .where(t.connector_event.c.EventId == ev)
            .values(Payload='"just a string"')
        )
    proc = Processor(engine, flow_deadline=None)
    batch = claim(engine, pack)
    outcome = proc.process(batch)
    assert outcome.failure_classes == {"payload-invalid": 1}
    assert outcome.succeeded == 5
    bad = row(engine, poison_id)
    assert (bad["State"], bad["FailureClass"], bad["Attempt"]) == ("failed", "payload-invalid", 1)
    assert "payload is a string, not an object" in bad["FailureSummary"]
    (later,) = claim(engine, pack)
    assert proc.process([later]).succeeded == 1
    assert phone(engine, "Account p1") == "v1"


# --- item 6: per-batch state belongs to the batch ---------------------------------------


async def test_concurrent_batches_each_wake_their_own_children(synced) -> None:
    """Two batches run at once on one Processor (a worker runs up to 16): each
    batch's outcome names the waits its own new links resolve, so the worker
    wakes them at once. A shared list let one batch wipe the other's links, and
    those children waited for a probe instead."""
    engine, pack = synced
    children, parents = children_and_parents(pack.install_id, pack.namespace, 2)
    queue.enqueue(engine, children)
    proc = Processor(engine, flow_deadline=None)
    blocked = proc.process(claim(engine, pack))
    assert len(blocked.blocked) == 2
    queue.enqueue(engine, parents)
    batch_a = claim(engine, pack, batch_size=1)
    batch_b = claim(engine, pack, batch_size=1)
    assert len(batch_a) == len(batch_b) == 1
    barrier = threading.Barrier(2, timeout=60)
    outcomes: dict[str, Any] = {}

    def meet() -> None:
        barrier.wait()  # each batch finishes its chunk while the other one runs

    def run(name: str, items: list[queue.ClaimedItem]) -> None:
        outcomes[name] = proc.process(items, on_item=meet)

    started = time.monotonic()
    threads = [
        threading.Thread(target=run, args=("a", batch_a)),
        threading.Thread(target=run, args=("b", batch_b)),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert time.monotonic() - started < 60
    key = {
        p.source_id: Dependency.remote(pack.namespace, pack.namespace, "Account", p.source_id)
        for p in (batch_a[0], batch_b[0])
    }
    assert outcomes["a"].wake_keys == {key[batch_a[0].source_id].key_hash}
    assert outcomes["b"].wake_keys == {key[batch_b[0].source_id].key_hash}
