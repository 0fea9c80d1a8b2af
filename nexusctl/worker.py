"""The worker process: one Temporal worker serving the control-plane task queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.worker import Worker

from activities.common import BatchLoad
from activities.connectors import ConnectorActivities
from activities.controlplane import ControlPlaneActivities
from activities.controlplane_gates import GateActivities
from activities.fleet import FleetActivities
from activities.identity import IdentityActivities
from activities.metrics import NexusMetrics, run_sampler
from nexuscrm.connectors.knobs import ConnectorKnobs
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.connectors.sizing import WorkerSizing, worker_sizing
from nexuscrm.db.engine import make_engine, redacted
from nexuscrm.log import log
from nexuscrm.settings import Settings
from nexusctl.failures import with_bounded_failures
from nexusctl.metrics import worker_runtime
from nexusctl.temporal import connect, ensure_search_attributes
from workflows.controlplane import CONTROLPLANE_WORKFLOWS
from workflows.controlplane_queue import QUEUE_WORKFLOWS
from workflows.fleet import CONNECTOR_WORKFLOWS
from workflows.identity import IDENTITY_WORKFLOWS

IDENTITY_THREADS = 4
"""Threads of the identity worker (:func:`build_identity_worker`), sharing the engine."""


class WorkerGroup:
    """Several ``Worker``s run and stopped together (``async with``).

    Stopping shuts them all down at once (each gets its graceful shutdown
    timeout side by side, not one after the other). ``sizing``: the connector
    worker's :class:`WorkerSizing` when the group holds one. ``background``:
    coroutine functions run as tasks while the group runs (the metrics
    sampler), cancelled when it stops. ``on_stop``: coroutine functions awaited
    after the workers stopped (the identity closer's bounded drain).
    """

    def __init__(
        self,
        *workers: Worker,
        sizing: WorkerSizing | None = None,
        background: tuple[Callable[[], Coroutine[Any, Any, None]], ...] = (),
        on_stop: tuple[Callable[[], Coroutine[Any, Any, Any]], ...] = (),
    ) -> None:
        self.workers = workers
        self.sizing = sizing
        self.background = background
        self.on_stop = on_stop
        self._tasks: list[asyncio.Task[None]] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> WorkerGroup:
        for worker in self.workers:
            await self._stack.enter_async_context(worker)
        self._tasks = [asyncio.create_task(run()) for run in self.background]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Worker.shutdown is safe to call again: the stack's exits then return at once.
        await asyncio.gather(*(w.shutdown() for w in self.workers), return_exceptions=True)
        await self._stack.aclose()
        for stop in self.on_stop:
            await stop()


def _shutdown_timeout(settings: Settings) -> timedelta:
    return timedelta(seconds=settings.worker_shutdown_seconds)


def _sticky_timeout(settings: Settings) -> timedelta:
    return timedelta(seconds=settings.sticky_queue_timeout_seconds)


def client_metrics(client: Client, engine: Engine | None = None) -> NexusMetrics:
    """The ``nexus_*`` metrics on the meter of ``client``'s runtime (no-op when that
    runtime exports no metrics, e.g. the SDK's default runtime)."""
    runtime = client.service_client.config.runtime or Runtime.default()
    return NexusMetrics(runtime.metric_meter, engine)


def build_identity_worker(
    client: Client, settings: Settings, engine: Engine, metrics: NexusMetrics | None = None
) -> Worker:
    """A ``Worker`` for identity-convergence waits on ``settings.identity_task_queue``.

    The waits' only remote activity is the probe, so the task queue's activity
    rate limit (``identity_probes_per_second``, enforced by the server across
    every worker) bounds the owner reads of all waits together, as the seed's
    25-rows-per-scan does; wake and expire run as local activities, unlimited.
    A queue of its own keeps a thousand sleeping waits from taking the inbound
    workers' slots. ``metrics``: see :func:`client_metrics` (its default).
    """
    identity = IdentityActivities(
        engine, settings, metrics=metrics or client_metrics(client, engine)
    )
    return Worker(
        with_bounded_failures(client),
        task_queue=settings.identity_task_queue,
        workflows=IDENTITY_WORKFLOWS,
        activities=identity.wait_activities(),
        activity_executor=ThreadPoolExecutor(max_workers=IDENTITY_THREADS),
        graceful_shutdown_timeout=_shutdown_timeout(settings),
        sticky_queue_schedule_to_start_timeout=_sticky_timeout(settings),
        # Probes are single-flight per process (see IdentityActivities): more
        # slots would only park probes behind the semaphore.
        max_concurrent_activities=2,
        max_concurrent_local_activities=8,
        max_task_queue_activities_per_second=settings.identity_probes_per_second,
    )


def installed_pack_count(engine: Engine) -> int:
    """Connector packs installed in the database now; 0 when it cannot be read
    (not migrated yet, database down: the worker then sizes for the allowance)."""
    try:
        return len(list_connector_packs(engine))
    except SQLAlchemyError as exc:
        log.warning("installed connector packs not readable; sizing for the allowance", error=exc)
        return 0


def connector_sizing(settings: Settings, config: ConnectorKnobs, packs: int) -> WorkerSizing:
    """:func:`worker_sizing` for ``max(packs, settings.connector_pack_allowance)`` packs
    of ``config.workers_per_pack`` workers, capped at ``connector_max_activity_slots``."""
    return worker_sizing(
        config.workers_per_pack,
        max(packs, settings.connector_pack_allowance),
        max_slots=settings.connector_max_activity_slots,
        extra_threads=IDENTITY_THREADS,
    )


def build_connector_worker(
    client: Client, settings: Settings, task_queue: str | None = None
) -> WorkerGroup:
    """Workers for the connector runtime (fleet, pack supervisors, inbound workers)
    and for its identity-convergence waits (:func:`build_identity_worker`).

    Knobs come from the ``NEXUSCRM_CONNECTOR_*`` environment (read once here).
    Slots, threads and the database pool follow :func:`connector_sizing`
    (installed packs read once, at start); ``graceful_shutdown_timeout`` is
    ``NEXUS_WORKER_SHUTDOWN_SECONDS``. When ``client``'s runtime exports
    metrics (``NEXUS_METRICS_ADDRESS``), the activities record the ``nexus_*``
    metrics on it and the group samples the queue gauges every
    ``activities.metrics.SAMPLE_SECONDS`` while it runs.
    """
    config = ConnectorKnobs.from_env()
    probe = make_engine(settings.database_url)
    sizing = connector_sizing(settings, config, installed_pack_count(probe))
    probe.dispose()
    engine = make_engine(
        settings.database_url, pool_size=sizing.pool_size, max_overflow=sizing.max_overflow
    )
    metrics = client_metrics(client, engine)
    # The identity closer yields to this process's inbound batches.
    load = BatchLoad()
    acts = ConnectorActivities(engine, settings, config, metrics=metrics, load=load)
    identity = IdentityActivities(engine, settings, metrics=metrics, load=load)
    connectors = Worker(
        with_bounded_failures(client),
        task_queue=task_queue or settings.connector_task_queue,
        workflows=CONNECTOR_WORKFLOWS,
        # notify and recover start and signal waits from the connector queue;
        # the fleet's periodic pass runs recovery, liveness and plan in one.
        activities=[
            *acts.all(),
            identity.notify,
            identity.recover,
            FleetActivities(acts, identity).periodic,
        ],
        activity_executor=ThreadPoolExecutor(max_workers=sizing.threads),
        max_concurrent_activities=sizing.activities,
        max_concurrent_local_activities=sizing.local_activities,
        # A batch goes to whichever process polls for it, not to the process
        # that runs its inbound worker's workflow (eager dispatch): workflows
        # stay on the process that first ran them (sticky), so a process that
        # joins later would otherwise never get a batch.
        disable_eager_activity_execution=True,
        graceful_shutdown_timeout=_shutdown_timeout(settings),
        sticky_queue_schedule_to_start_timeout=_sticky_timeout(settings),
    )
    background: tuple[Callable[[], Coroutine[Any, Any, None]], ...] = ()
    if metrics.enabled:
        background = (lambda: run_sampler(metrics, client, settings.database_id),)
    return WorkerGroup(
        connectors,
        build_identity_worker(client, settings, engine, metrics),
        sizing=sizing,
        background=background,
        on_stop=(identity.stop_closer,),
    )


def build_worker(client: Client, settings: Settings, task_queue: str | None = None) -> Worker:
    """A ``Worker`` for the control-plane workflows and activities of ``settings``' database.

    Activities are synchronous (SQLAlchemy) and run on an 8-thread pool.
    """
    engine = make_engine(settings.database_url)
    acts = ControlPlaneActivities(engine, settings)
    return Worker(
        with_bounded_failures(client),
        task_queue=task_queue or settings.controlplane_task_queue,
        workflows=[*CONTROLPLANE_WORKFLOWS, *QUEUE_WORKFLOWS],
        activities=[*acts.all(), *GateActivities(engine, settings).all()],
        activity_executor=ThreadPoolExecutor(max_workers=8),
        max_concurrent_activities=8,
        graceful_shutdown_timeout=_shutdown_timeout(settings),
        sticky_queue_schedule_to_start_timeout=_sticky_timeout(settings),
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
    """Connect, register search attributes, and serve until ``stop`` is set (or forever).

    The process's Temporal runtime forwards the SDK core's log lines to the
    process's logging; with ``NEXUS_METRICS_ADDRESS`` its Prometheus endpoint
    listens before anything connects (``nexusctl.metrics.worker_runtime``;
    raises ``NexusError`` when the address cannot be bound).
    """
    check_database(settings)
    runtime = worker_runtime(settings.metrics_address)
    client = await connect(settings, runtime)
    await ensure_search_attributes(client)
    worker = build_worker(client, settings)
    connector_worker = build_connector_worker(client, settings)
    sizing = connector_worker.sizing
    assert sizing is not None
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
        packs=sizing.packs,
        workers_per_pack=sizing.workers_per_pack,
        activity_slots=sizing.activities,
        local_activity_slots=sizing.local_activities,
        activity_threads=sizing.threads,
        db_pool_size=sizing.pool_size,
        db_max_overflow=sizing.max_overflow,
        capped=sizing.capped,
        shutdown_seconds=settings.worker_shutdown_seconds,
        metrics_address=settings.metrics_address,
    )
    group = WorkerGroup(worker, *connector_worker.workers, background=connector_worker.background)
    async with group:
        if stop is None:
            await asyncio.Event().wait()
        else:
            await stop.wait()
