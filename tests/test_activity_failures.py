"""Sync activities under cancellation, slow phases and huge errors (issue 9's CI flake).

The flake: under load a control-plane phase outlived its heartbeat timeout,
the SDK raised its cancel exception into the activity's thread in the middle
of a PyMySQL read, the pooled connection came back ``(2014, 'Command Out of
Sync')``, and the next failure (a statement-sized message) was refused by the
server as ``Failure exceeds size limit``. Each step is reproduced here against
the real thing: MariaDB / SQLite, and the Temporal dev server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy import text
from temporalio import activity, workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from activities import common
from activities.common import (
    beat_interval,
    expect_progress,
    fatal_is_final,
    heartbeat,
    progress,
)
from nexuscrm.db.engine import make_engine
from nexusctl.failures import MAX_MESSAGE_CHARS, with_bounded_failures


def _busy_query(url: str) -> str:
    if url.startswith("sqlite"):
        return (
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) "
            "SELECT x, hex(randomblob(64)) FROM c"
        )
    return "SELECT REPEAT('x', 2000000) AS a, SLEEP(0.01)"


async def test_cancelled_sync_activity_never_breaks_a_pooled_connection(db_url):
    """Cancel a phase many times mid-query: every later use of the pool works,
    and the cancellation surfaces as a cancellation, not an application error."""
    engine = make_engine(db_url)
    query = _busy_query(db_url)

    @fatal_is_final
    def phase() -> int:
        n = 0
        for i in range(200):
            with engine.begin() as conn:
                n += len(conn.execute(text(query)).all())
            heartbeat(i)  # the phase's cancellation point, between transactions
        return n

    loop = asyncio.get_running_loop()
    cancelled = 0
    for i in range(12):
        env = ActivityEnvironment()
        fut = loop.run_in_executor(None, functools.partial(env.run, phase))
        await asyncio.sleep(0.05 + i * 0.013)
        env.cancel()
        try:
            await fut
        except CancelledError:
            cancelled += 1
        # The pool must hand out healthy connections after every cancellation.
        for _ in range(3):
            with engine.begin() as conn:
                assert conn.execute(text("SELECT 1")).scalar() == 1
    assert cancelled == 12
    engine.dispose()


def test_ticker_beats_within_the_heartbeat_timeout():
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=3))
    assert env.run(beat_interval) == pytest.approx(1.0)
    assert ActivityEnvironment().run(beat_interval) == 5.0  # no heartbeat timeout


@fatal_is_final
def _has_ticker() -> bool:
    heartbeat()  # a cancellation point only, in a local activity
    return common._TICKER.get() is not None


def test_no_ticker_for_local_activities():
    local = ActivityEnvironment()
    local.info = dataclasses.replace(local.info, is_local=True)
    assert local.run(_has_ticker) is False
    assert ActivityEnvironment().run(_has_ticker) is True
    assert _has_ticker() is False  # called directly, outside an activity


# --- against the dev server ----------------------------------------------------


@activity.defn(name="test.slow_phase")
@fatal_is_final
def slow_phase(seconds: float) -> str:
    """A phase that never heartbeats itself and outlives its heartbeat timeout."""
    time.sleep(seconds)
    return "done"


@activity.defn(name="test.hung_item")
@fatal_is_final
def hung_item(seconds: float) -> str:
    """A batch that makes progress twice, then hangs ``seconds`` on one item."""
    expect_progress(1.5)
    for _ in range(2):
        time.sleep(0.2)
        progress()
    time.sleep(seconds)
    return "done"


@activity.defn(name="test.huge_error")
@fatal_is_final
def huge_error(chars: int) -> str:
    """A phase whose (transient-looking) error text is a statement of ``chars`` characters."""
    raise RuntimeError("INSERT INTO t VALUES " + "(1, 'x')," * (chars // 9))


@workflow.defn(name="test.OnePhase")
class OnePhase:
    """Runs one activity once, with a short heartbeat timeout."""

    @workflow.run
    async def run(self, name: str, arg: float) -> str:
        return await workflow.execute_activity(
            name,
            arg,
            start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=1),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


async def _run(temporal_env, name: str, arg: float) -> str:
    queue = f"fail-{uuid.uuid4().hex[:8]}"
    client = with_bounded_failures(temporal_env.client)
    async with Worker(
        client,
        task_queue=queue,
        workflows=[OnePhase],
        activities=[slow_phase, hung_item, huge_error],
        activity_executor=ThreadPoolExecutor(2),
    ):
        return await temporal_env.client.execute_workflow(
            OnePhase.run,
            args=[name, arg],
            id=f"wf-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
            execution_timeout=timedelta(seconds=90),
        )


async def test_phase_longer_than_its_heartbeat_timeout_completes(temporal_env):
    """The ticker beats every third of the timeout: a 4 s phase with a 1 s
    heartbeat timeout completes on its first (and only) attempt."""
    assert await _run(temporal_env, "test.slow_phase", 4.0) == "done"


async def test_failure_larger_than_the_server_limit_arrives_bounded(temporal_env):
    """A 6 MB error message (over the server's blob limit) still reaches the
    workflow as the activity's failure, its head readable, cut and counted."""
    with pytest.raises(WorkflowFailureError) as info:
        await _run(temporal_env, "test.huge_error", 6_000_000)
    cause = info.value.cause
    assert isinstance(cause, ActivityError)
    app = cause.cause
    assert isinstance(app, ApplicationError)
    assert app.type == "RuntimeError"
    assert "INSERT INTO t VALUES (1, 'x')," in app.message
    assert len(app.message) < 2 * MAX_MESSAGE_CHARS
    # The original exception travels as the cause: cut by the failure converter.
    original = app.cause
    assert isinstance(original, ApplicationError)
    assert original.type == "RuntimeError"
    assert original.message.startswith("INSERT INTO t VALUES (1, 'x'),")
    assert original.message.endswith("more characters]")
    assert len(original.message) < 2 * MAX_MESSAGE_CHARS


async def test_ticker_stops_when_an_item_hangs(temporal_env):
    """A batch that stops making progress (no item boundary for longer than its
    1.5 s bound) is timed out by the server on its heartbeat timeout (1 s), not
    kept alive by the ticker until the item returns (8 s) or its start-to-close."""
    queue = f"fail-{uuid.uuid4().hex[:8]}"
    async with Worker(
        with_bounded_failures(temporal_env.client),
        task_queue=queue,
        workflows=[OnePhase],
        activities=[hung_item],
        activity_executor=ThreadPoolExecutor(2),
    ):
        start = time.monotonic()
        with pytest.raises(WorkflowFailureError) as info:
            await temporal_env.client.execute_workflow(
                OnePhase.run,
                args=["test.hung_item", 8.0],
                id=f"wf-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
                execution_timeout=timedelta(seconds=90),
            )
        failed_after = time.monotonic() - start
    cause = info.value.cause
    assert isinstance(cause, ActivityError)
    assert "heartbeat" in repr(cause.cause).lower(), repr(cause.cause)
    # Failed before the item would have returned (a ticker that kept it alive
    # would have let the batch finish at 8 s): an ordering, not a timing target.
    assert failed_after < 8.0, failed_after
