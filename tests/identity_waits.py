"""Identity-wait test helpers shared by the identity test modules (issue 16).

A dependency, items blocked on it, a scripted resolver, a worker serving the
waits and ``RecoverOnce`` (one ``identity.recover``, as a fleet reconcile runs
it), and the link a parent's batch would write. Real databases and servers.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, update
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from activities.common import BatchLoad
from activities.identity import IdentityActivities
from activities.identity_client import start_wait
from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.identity import Dependency, wait_workflow_id
from nexuscrm.contracts import IdentityWaitConfig, WaitNotifyRequest
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from tests.builders import event, no_blocked_on_linked_after
from workflows.identity import IdentityWaitWorkflow


@pytest.fixture(autouse=True)
def no_blocked_on_linked(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse where imported: the test ends with no item blocked on a dependency
    that exists (issue 16)."""
    yield from no_blocked_on_linked_after(request)


DEP = Dependency.remote("salesforce-sync", "salesforce-sync", "Account", "acct-1")


@workflow.defn(name="RecoverOnce", sandboxed=False)
class RecoverOnce:
    @workflow.run
    async def run(self, database_id: str) -> int:
        return await workflow.execute_activity(
            "identity.recover",
            database_id,
            result_type=int,
            start_to_close_timeout=timedelta(seconds=120),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


@workflow.defn(name="NotifyOnce", sandboxed=False)
class NotifyOnce:
    """One ``identity.notify``, as an inbound batch runs it after its commit."""

    @workflow.run
    async def run(self, req: WaitNotifyRequest) -> None:
        await workflow.execute_activity(
            "identity.notify",
            req,
            start_to_close_timeout=timedelta(seconds=120),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


class Switch:
    """A scripted resolver: converged / unresolved / raise / hang."""

    def __init__(self, mode: str = "unresolved") -> None:
        self.mode = mode
        self.calls = 0

    def __call__(self, engine: Engine, dep: Dependency) -> bool:
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("owner unavailable")
        if self.mode == "hang":
            import time

            time.sleep(3)
        return self.mode == "converged"


def cfg(**kw: Any) -> IdentityWaitConfig:
    base: dict[str, Any] = {
        "probe_interval_seconds": 0.2,
        "max_probe_interval_seconds": 0.5,
        "probe_timeout_seconds": 1.0,
        "max_wait_seconds": 0,
        "liveness_grace_seconds": 5,
    }
    base.update(kw)
    return IdentityWaitConfig(**base)


def queue_db(settings: Settings) -> Engine:
    engine = make_engine(settings.database_url)
    t.system_metadata.create_all(engine)
    return engine


def link(engine: Engine, dep: Dependency = DEP, record_id: str = "001-parent") -> None:
    """The parent's remote link, written as another writer would: no wake sent."""
    with engine.begin() as conn:
        conn.execute(
            t.connector_remote_link.insert().values(
                ConnectorOwnerKey=dep.owner_key,
                Namespace=dep.namespace,
                DestinationObject=dep.object_api_name,
                RemoteId=dep.remote_id,
                RecordId=record_id,
                CreatedDate=utcnow(),
            )
        )


async def recover_once(client: Client, settings: Settings, queue: str) -> int:
    """One ``identity.recover`` (as a fleet reconcile runs it); returns waits started."""
    return await client.execute_workflow(
        RecoverOnce.run, settings.database_id, id=f"rec-{uuid.uuid4().hex}", task_queue=queue
    )


def block(engine: Engine, n: int, dep: Dependency = DEP, *, probe_after: Any = None) -> list[str]:
    """Enqueue and claim ``n`` items, block them on ``dep``; returns their work ids."""
    tag = uuid.uuid4().hex[:6]
    reqs = [
        event("inst-1", f"{tag}-{i}", namespace="salesforce-sync", obj="Contact") for i in range(n)
    ]
    wq.enqueue(engine, reqs)
    items = wq.claim(
        engine,
        wq.ClaimSpec(
            installed_pack_id="inst-1",
            queue_classes=[],
            batch_size=n,
            lease_owner="t",
            lease_seconds=60,
            max_processing_rows=1000,
        ),
    )
    with engine.begin() as conn:
        for item in items:
            wq.block_item(conn, item, dep, summary="parent not linked", probe_after=probe_after)
    return [i.work_id for i in items]


def states(engine: Engine, work_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    w = t.connector_work_item
    with engine.connect() as conn:
        rows = conn.execute(
            select(w.c.WorkId, w.c.State, w.c.FailureClass).where(w.c.WorkId.in_(work_ids))
        ).all()
    return {r.WorkId: (r.State, r.FailureClass) for r in rows}


def wait_worker(
    client: Client,
    settings: Settings,
    engine: Engine,
    resolver: Any,
    queue: str,
    config: IdentityWaitConfig | None = None,
    load: BatchLoad | None = None,
    close_pacing: tuple[float, float] | None = None,
) -> Worker:
    """A worker of the waits, ``RecoverOnce`` and ``NotifyOnce`` on ``queue``
    (``config``: :func:`cfg` by default; ``load``: the process's inbound
    batches the closer yields to, none by default; ``close_pacing``: seconds
    between closes while batches run, and how long a close may yield to them)."""
    from concurrent.futures import ThreadPoolExecutor

    acts = IdentityActivities(engine, settings, config or cfg(), resolver=resolver, load=load)
    if close_pacing is not None:
        acts.close_pause_busy_s, acts.close_max_defer_s = close_pacing
    return Worker(
        client,
        task_queue=queue,
        workflows=[IdentityWaitWorkflow, RecoverOnce, NotifyOnce],
        activities=acts.all(),
        activity_executor=ThreadPoolExecutor(4),
    )


async def begin(
    client: Client,
    settings: Settings,
    queue: str,
    ids: list[str],
    config: IdentityWaitConfig,
    dep: Dependency = DEP,
    probe_now: bool = True,
) -> Any:
    """Start the wait of ``dep`` with ``ids``; ``probe_now`` as recovery starts it."""
    await start_wait(
        client,
        database_id=settings.database_id,
        task_queue=queue,
        dependency=dep,
        work_ids=ids,
        config=config,
        probe_now=probe_now,
    )
    return client.get_workflow_handle(wait_workflow_id(settings.database_id, dep.key_hash))


async def set_blocked_at(env: Any, engine: Engine, work_ids: list[str], minutes_ago: float) -> None:
    """Blocked ``minutes_ago`` by the (time-skipping) server's clock, which earlier
    tests of the module may have moved ahead of the wall clock."""
    w = t.connector_work_item
    now = (await env.get_current_time()).astimezone(UTC).replace(tzinfo=None)
    when = now - timedelta(minutes=minutes_ago)
    with engine.begin() as conn:
        conn.execute(
            update(w)
            .where(w.c.WorkId.in_(work_ids))
            .values(DependencyBlockedAt=when.replace(microsecond=0))
        )
