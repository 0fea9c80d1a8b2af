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

from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from activities.metrics import HISTOGRAM_BUCKETS
from nexuscrm.errors import NexusError


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
                metrics=PrometheusConfig(
                    bind_address=address,
                    counters_total_suffix=True,
                    durations_as_seconds=True,
                    histogram_bucket_overrides=HISTOGRAM_BUCKETS,
                )
            )
        )
    except (ValueError, RuntimeError) as exc:
        raise NexusError(
            f"NEXUS_METRICS_ADDRESS {address!r}: the metrics endpoint cannot listen there "
            f"({exc}); each worker process on a host needs a port of its own"
        ) from None
