"""The worker process's Prometheus endpoint (``NEXUS_METRICS_ADDRESS``).

One ``temporalio.runtime.Runtime`` per worker process with the SDK's
Prometheus exporter bound to the address; the process's client (and so every
worker built from it) uses that runtime, so the one endpoint serves the SDK's
metrics (``temporal_*``: workflow and activity tasks, polls, slots, latencies)
and the runtime's own ``nexus_*`` (``activities.metrics``), which are recorded
on the same runtime's ``metric_meter``.

Exporter options: counters end in ``_total`` and durations are float seconds
(``durations_as_seconds``), Prometheus conventions; the ``nexus_*`` histograms
get buckets of their own (``activities.metrics.HISTOGRAM_BUCKETS``).
"""

from __future__ import annotations

import logging

from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

from activities.metrics import HISTOGRAM_BUCKETS
from nexuscrm.errors import NexusError

CORE_LOGGER = "temporalio.core"
"""The stdlib logger the SDK's Rust core forwards its log lines to (WARN and up)."""


def core_logging() -> LoggingConfig:
    """The SDK core's own log lines (WARN and up: retried RPCs, failed polls) forwarded
    to the stdlib logger :data:`CORE_LOGGER`, so that they come out as the process's
    other lines do (JSON when ``NEXUS_LOG_FORMAT=json``), not as coloured text of
    their own on stderr."""
    return LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger(CORE_LOGGER)),
    )


def worker_runtime(metrics_address: str | None) -> Runtime:
    """The worker process's Temporal runtime: the core's logs forwarded
    (:func:`core_logging`) and, with ``metrics_address``, the Prometheus endpoint
    (:func:`metrics_runtime`; raises ``NexusError`` as it does)."""
    if metrics_address:
        return metrics_runtime(metrics_address)
    return Runtime(telemetry=TelemetryConfig(logging=core_logging()))


def metrics_runtime(address: str) -> Runtime:
    """A Temporal runtime exporting Prometheus metrics at ``http://<address>/metrics``.

    ``address``: a checked ``NEXUS_METRICS_ADDRESS`` (``<IP>:<port>``). The
    endpoint listens from here on, for the rest of the process. Raises
    ``NexusError`` naming the setting when the address cannot be bound (in
    use: two worker processes on one host need distinct ports).
    """
    try:
        return Runtime(
            telemetry=TelemetryConfig(
                logging=core_logging(),
                metrics=PrometheusConfig(
                    bind_address=address,
                    counters_total_suffix=True,
                    durations_as_seconds=True,
                    histogram_bucket_overrides=HISTOGRAM_BUCKETS,
                ),
            )
        )
    except (ValueError, RuntimeError) as exc:
        raise NexusError(
            f"NEXUS_METRICS_ADDRESS {address!r}: the metrics endpoint cannot listen there "
            f"({exc}); each worker process on a host needs a port of its own"
        ) from None
