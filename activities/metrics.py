"""The connector runtime's own metrics (``nexus_*``), on the Temporal SDK's metric meter.

Recorded on the meter of the worker's ``temporalio.runtime.Runtime``, so they
are served by the same Prometheus endpoint as the SDK's own metrics
(``NEXUS_METRICS_ADDRESS``, see ``nexusctl.metrics``). Only activities and the
worker process record them, never a workflow: nothing here touches workflow
determinism or history. With a runtime without metrics the meter is the SDK's
no-op meter and every call here costs next to nothing.

Instruments (labels in brackets; units in the names):

* ``nexus_events_processed_total`` [pack, queue_class, outcome]: items whose
  attempt a batch of this process ended; ``outcome`` is ``succeeded``,
  ``failed`` (terminal), ``retried`` (back to pending after a backoff) or
  ``blocked`` (parked on an identity wait). Items handed back (shutdown) or
  lost to another worker are not counted.
* ``nexus_events_failed_total`` [pack, queue_class, failure_class]: the
  terminal failures among them.
* ``nexus_claim_latency_seconds`` [pack] (histogram): one claim's database
  time, the pack's claim lock wait included; every claim, empty ones too.
* ``nexus_batch_size`` [pack] (histogram): items leased by one claim that
  leased at least one.
* ``nexus_queue_depth`` [pack, state, queue_class] (gauge) and
  ``nexus_queue_oldest_pending_age_seconds`` [pack] (gauge, 0 when nothing is
  pending), ``nexus_queue_failed_items`` [pack, failure_class] (gauge): from
  ``queue.pack_queue_stats``, sampled by :func:`run_sampler`.
* ``nexus_identity_waits_parked`` (gauge): running ``IdentityWait`` workflows
  of the database, as the server counts them (:func:`run_sampler`).
* ``nexus_identity_wake_latency_seconds`` [pack, path] (histogram): per woken
  item, from its block's commit (``DependencyBlockedAt``) to the commit that
  set it pending again; ``path`` is who woke it (see :data:`WAKE_PATHS`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from temporalio.common import MetricMeter

from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import connector_pack_names
from nexuscrm.contracts.visibility import running_waits_query
from nexuscrm.db.dialect import describe_error
from nexuscrm.log import log

if TYPE_CHECKING:
    from temporalio.client import Client

    from nexuscrm.connectors.finishing import BatchOutcome

CLAIM_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""Seconds."""
BATCH_SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
"""Items."""
WAKE_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
"""Seconds."""

HISTOGRAM_BUCKETS: dict[str, Sequence[float]] = {
    "nexus_claim_latency_seconds": CLAIM_LATENCY_BUCKETS,
    "nexus_batch_size": BATCH_SIZE_BUCKETS,
    "nexus_identity_wake_latency_seconds": WAKE_LATENCY_BUCKETS,
}
"""Bucket boundaries of the ``nexus_*`` histograms (the exporter's
``histogram_bucket_overrides``)."""

WAKE_PATHS = ("batch", "self", "notify", "wait", "recovery")
"""Who woke an item: ``batch`` (the batch that linked its parent, right after
its commit), ``self`` (its own batch's re-read right after the block
committed: the parent linked meanwhile), ``notify`` (the notify activity after
the parent's batch), ``wait`` (its ``IdentityWait``: a ``wake`` signal, the
``wake_now`` update or a converged probe), ``recovery`` (fleet recovery found
its dependency resolved)."""

SAMPLE_SECONDS = 5.0
"""Least interval between two samples of the queue gauges by :func:`run_sampler`."""

NAMES_REFRESH_SECONDS = 5.0
"""Least interval between two reads of the pack names for an unknown install id."""


class PackNames:
    """Pack name of an install id (``connector_pack_names``), cached.

    An unknown id re-reads the names at most every :data:`NAMES_REFRESH_SECONDS`;
    an id still unknown (or a database error) is labelled with the id itself.
    Thread-safe.
    """

    def __init__(self, engine: Engine | None) -> None:
        self.engine = engine
        self._names: dict[str, str] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def __call__(self, install_id: str) -> str:
        """The pack name of ``install_id`` (the id itself when it is not known)."""
        name = self._names.get(install_id)
        if name is not None or self.engine is None:
            return name or install_id
        with self._lock:
            if install_id not in self._names and (
                time.monotonic() - self._read_at >= NAMES_REFRESH_SECONDS
            ):
                self._read_at = time.monotonic()
                try:
                    self._names = {**self._names, **connector_pack_names(self.engine)}
                except Exception as exc:  # a metric label never fails an activity
                    log.info("pack names not readable for metrics", error=describe_error(exc))
        return self._names.get(install_id, install_id)


class NexusMetrics:
    """The ``nexus_*`` instruments on ``meter`` (see the module docstring).

    ``engine`` names packs (install id -> pack name) and feeds the queue
    samples; ``None`` labels packs by install id and samples nothing. Every
    method is safe from any thread and never raises for a metric.
    """

    def __init__(self, meter: MetricMeter, engine: Engine | None = None) -> None:
        self.meter = meter
        self.engine = engine
        self.enabled = meter is not MetricMeter.noop
        self.pack_name = PackNames(engine)
        self.events_processed = meter.create_counter(
            "nexus_events_processed",
            "Work items whose attempt a batch of this process ended, by outcome",
        )
        self.events_failed = meter.create_counter(
            "nexus_events_failed",
            "Work items a batch of this process failed (terminal), by failure class",
        )
        self.claim_latency = meter.create_histogram_float(
            "nexus_claim_latency_seconds",
            "Database time of one claim (SQLite: its write-lock wait included)",
            "s",
        )
        self.batch_size = meter.create_histogram(
            "nexus_batch_size", "Items leased by one claim that leased at least one"
        )
        self.queue_depth = meter.create_gauge(
            "nexus_queue_depth", "Work items of the pack by state and queue class (sampled)"
        )
        self.oldest_pending_age = meter.create_gauge_float(
            "nexus_queue_oldest_pending_age_seconds",
            "Age of the pack's oldest pending work item (0: none pending; sampled)",
            "s",
        )
        self.queue_failed = meter.create_gauge(
            "nexus_queue_failed_items",
            "Terminally failed work items of the pack by failure class (sampled)",
        )
        self.waits_parked = meter.create_gauge(
            "nexus_identity_waits_parked",
            "Running IdentityWait workflows of the database, as the server counts them (sampled)",
        )
        self.wake_latency = meter.create_histogram_float(
            "nexus_identity_wake_latency_seconds",
            "Per woken item: from its block's commit to the commit that set it pending again",
            "s",
        )
        # Label sets a sample set before: set to 0 when a later sample lacks them.
        self._depth_seen: set[tuple[str, str, str]] = set()
        self._failed_seen: set[tuple[str, str]] = set()
        self._age_seen: set[str] = set()

    # -- recorded by activities ------------------------------------------------

    def claimed(self, install_id: str, seconds: float, items: int) -> None:
        """One claim of ``install_id``'s items: its duration (seconds) and items leased."""
        if not self.enabled:
            return
        pack = {"pack": self.pack_name(install_id)}
        self.claim_latency.record(max(0.0, seconds), pack)
        if items > 0:
            self.batch_size.record(items, pack)

    def batch_ended(self, items: Sequence[queue.ClaimedItem], outcome: BatchOutcome) -> None:
        """Count how the attempts of a processed batch's ``items`` ended (``outcome.ended``)."""
        if not self.enabled:
            return
        for item in items:
            ended = outcome.ended.get(item.work_id)
            if ended is None:  # handed back or lost to another worker
                continue
            how, failure_class = ended
            pack = self.pack_name(item.installed_pack_id)
            labels = {"pack": pack, "queue_class": item.queue_class}
            self.events_processed.add(1, {**labels, "outcome": how})
            if how == "failed":
                self.events_failed.add(1, {**labels, "failure_class": failure_class or "unknown"})

    def woken(self, path: str, install_id: str, seconds: float) -> None:
        """One item woken by ``path`` (:data:`WAKE_PATHS`) after ``seconds`` parked."""
        if not self.enabled:
            return
        self.wake_latency.record(
            max(0.0, seconds), {"pack": self.pack_name(install_id), "path": path}
        )

    def woken_hook(self, path: str) -> queue.WokenHook | None:
        """:meth:`woken` bound to ``path``, for ``queue.wake_blocked_keys(on_woken=...)``;
        ``None`` when metrics are off."""
        if not self.enabled:
            return None
        return lambda install_id, seconds: self.woken(path, install_id, seconds)

    # -- sampled ---------------------------------------------------------------

    def sample_queue(self) -> None:
        """Set the queue gauges from one ``queue.pack_queue_stats`` read (three grouped queries).

        Incarnations of one pack are added up under its name (oldest age: the
        largest). A label set of an earlier sample that is absent now is set to 0.
        Raises what the database raises.
        """
        if not self.enabled or self.engine is None:
            return
        depth: dict[tuple[str, str, str], int] = {}
        failed: dict[tuple[str, str], int] = {}
        age: dict[str, float] = {}
        for stats in queue.pack_queue_stats(self.engine):
            pack = self.pack_name(stats.installed_pack_id)
            for (state, qc), n in stats.counts.items():
                depth[(pack, state, qc)] = depth.get((pack, state, qc), 0) + n
            for fclass, n in stats.failures_by_class.items():
                failed[(pack, fclass)] = failed.get((pack, fclass), 0) + n
            age[pack] = max(age.get(pack, 0.0), stats.oldest_pending_age_s or 0.0)
        for key in self._depth_seen - depth.keys():
            depth[key] = 0
        for fkey in self._failed_seen - failed.keys():
            failed[fkey] = 0
        for pack in self._age_seen - age.keys():
            age[pack] = 0.0
        for (pack, state, qc), n in depth.items():
            self.queue_depth.set(n, {"pack": pack, "state": state, "queue_class": qc})
        for (pack, fclass), n in failed.items():
            self.queue_failed.set(n, {"pack": pack, "failure_class": fclass})
        for pack, seconds in age.items():
            self.oldest_pending_age.set(seconds, {"pack": pack})
        self._depth_seen = set(depth)
        self._failed_seen = set(failed)
        self._age_seen = set(age)


async def run_sampler(
    metrics: NexusMetrics, client: Client, database_id: str, every: float = SAMPLE_SECONDS
) -> None:
    """Sample the queue gauges and the parked waits every ``every`` seconds, until cancelled.

    Queue: :meth:`NexusMetrics.sample_queue` in a thread. Waits:
    ``client.count_workflows`` of ``running_waits_query`` (one count on
    the server's visibility store; it lags a start or a completion by about a
    second). A failed sample is logged (once per distinct error) and retried
    at the next tick; it never stops the worker.
    """
    query = running_waits_query(database_id)
    last_error = ""
    while True:
        try:
            await asyncio.to_thread(metrics.sample_queue)
            if query is not None:
                count = await client.count_workflows(query)
                metrics.waits_parked.set(count.count)
            last_error = ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = describe_error(exc)
            if error != last_error:
                log.warning("metrics sample failed; retried", error=error)
            last_error = error
        await asyncio.sleep(every)
