"""The worker process: one Temporal worker serving the control-plane task queue."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine
from temporalio.client import Client
from temporalio.worker import Worker

from activities.connectors import ConnectorActivities
from activities.controlplane import ControlPlaneActivities
from activities.identity import IdentityActivities
from nexuscrm.connectors.knobs import ConnectorKnobs
from nexuscrm.db.engine import make_engine, redacted
from nexuscrm.log import log
from nexuscrm.settings import Settings
from nexusctl.failures import with_bounded_failures
from nexusctl.temporal import connect, ensure_search_attributes
from workflows.controlplane import CONTROLPLANE_WORKFLOWS
from workflows.fleet import CONNECTOR_WORKFLOWS
from workflows.identity import IDENTITY_WORKFLOWS


class WorkerGroup:
    """Several ``Worker``s run and stopped together (``async with``)."""

    def __init__(self, *workers: Worker) -> None:
        self.workers = workers
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> WorkerGroup:
        for worker in self.workers:
            await self._stack.enter_async_context(worker)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


def build_identity_worker(client: Client, settings: Settings, engine: Engine) -> Worker:
    """A ``Worker`` for identity-convergence waits on ``settings.identity_task_queue``.

    The waits' only remote activity is the probe, so the task queue's activity
    rate limit (``identity_probes_per_second``, enforced by the server across
    every worker) bounds the owner reads of all waits together, as the seed's
    25-rows-per-scan does; wake and expire run as local activities, unlimited.
    A queue of its own keeps a thousand sleeping waits from taking the inbound
    workers' slots.
    """
    identity = IdentityActivities(engine, settings)
    return Worker(
        with_bounded_failures(client),
        task_queue=settings.identity_task_queue,
        workflows=IDENTITY_WORKFLOWS,
        activities=identity.wait_activities(),
        activity_executor=ThreadPoolExecutor(max_workers=4),
        # Probes are single-flight per process (see IdentityActivities): more
        # slots would only park probes behind the semaphore.
        max_concurrent_activities=2,
        max_concurrent_local_activities=8,
        max_task_queue_activities_per_second=settings.identity_probes_per_second,
    )


def build_connector_worker(
    client: Client, settings: Settings, task_queue: str | None = None
) -> WorkerGroup:
    """Workers for the connector runtime (fleet, pack supervisors, inbound workers)
    and for its identity-convergence waits (:func:`build_identity_worker`).

    Knobs come from the ``NEXUSCRM_CONNECTOR_*`` environment (read once here).
    """
    engine = make_engine(settings.database_url)
    acts = ConnectorActivities(engine, settings, ConnectorKnobs.from_env())
    identity = IdentityActivities(engine, settings)
    connectors = Worker(
        with_bounded_failures(client),
        task_queue=task_queue or settings.connector_task_queue,
        workflows=CONNECTOR_WORKFLOWS,
        # notify and recover start and signal waits from the connector queue.
        activities=[*acts.all(), identity.notify, identity.recover],
        activity_executor=ThreadPoolExecutor(max_workers=16),
        max_concurrent_activities=16,
        max_concurrent_local_activities=16,
    )
    return WorkerGroup(connectors, build_identity_worker(client, settings, engine))


def build_worker(client: Client, settings: Settings, task_queue: str | None = None) -> Worker:
    """A ``Worker`` for the control-plane workflows and activities of ``settings``' database.

    Activities are synchronous (SQLAlchemy) and run on an 8-thread pool.
    """
    engine = make_engine(settings.database_url)
    acts = ControlPlaneActivities(engine, settings)
    return Worker(
        with_bounded_failures(client),
        task_queue=task_queue or settings.controlplane_task_queue,
        workflows=CONTROLPLANE_WORKFLOWS,
        activities=acts.all(),
        activity_executor=ThreadPoolExecutor(max_workers=8),
        max_concurrent_activities=8,
    )


def check_database(settings: Settings) -> None:
    """Connect once so a wrong URL or password fails at start, not in the first phase.

    Raises ``sqlalchemy.exc.OperationalError`` (the CLI prints it on one line).
    """
    engine = make_engine(settings.database_url)
    with engine.connect():
        pass
    engine.dispose()


async def run_worker(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Connect, register search attributes, and serve until ``stop`` is set (or forever)."""
    check_database(settings)
    client = await connect(settings)
    await ensure_search_attributes(client)
    worker = build_worker(client, settings)
    connector_worker = build_connector_worker(client, settings)
    log.info(
        "worker started",
        temporal=settings.temporal_address,
        namespace=settings.temporal_namespace,
        task_queue=settings.controlplane_task_queue,
        connector_task_queue=settings.connector_task_queue,
        identity_task_queue=settings.identity_task_queue,
        connector_role=settings.connector_role,
        database=redacted(settings.database_url),
        database_id=settings.database_id,
    )
    async with worker, connector_worker:
        if stop is None:
            await asyncio.Event().wait()
        else:
            await stop.wait()
