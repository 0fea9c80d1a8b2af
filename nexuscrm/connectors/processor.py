"""Process one claimed batch: resolve each item's route, run its flow, finish it.

Port of the seed's ``connector_inbound.Worker`` per-event step. Each item ends
in one transaction together with the flow's own writes (record upsert and
remote link), so a crash leaves either nothing or everything; a lease lost to
a stale reclaim makes the finish a no-op (``LeaseLost``) and the other worker
owns the item.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from sqlalchemy import Engine

from nexuscrm.clock import utcnow
from nexuscrm.connectors import workqueue
from nexuscrm.connectors.flows import FlowError, post_webhook, upsert_record
from nexuscrm.connectors.routes import RouteNotFoundError, RouteResolver
from nexuscrm.controlplane import catalog
from nexuscrm.db.dialect import describe_error, is_transient
from nexuscrm.log import log

# A lookup whose parent is not linked yet is retried on this short, flat delay
# (the identity-convergence wait replaces this polling).
DEPENDENCY_RETRY = dt.timedelta(seconds=1)
MAX_ATTEMPTS = 8


@dataclass
class BatchOutcome:
    """Counts of one batch: succeeded, retried, failed, lost (lease taken over)."""

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    failure_classes: dict[str, int] = field(default_factory=dict)


class Processor:
    """Runs claimed items for one database.

    ``http`` is the client for webhook flows (one per process);
    ``flow_deadline`` bounds each external call (``None`` disables it).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        http: httpx.Client | None = None,
        flow_deadline: dt.timedelta | None = dt.timedelta(minutes=10),
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.engine = engine
        self.routes = RouteResolver(engine)
        self.http = http or httpx.Client()
        self.flow_deadline = flow_deadline
        self.max_attempts = max_attempts

    def process(
        self,
        items: Sequence[workqueue.ClaimedItem],
        *,
        on_item: Callable[[], None] | None = None,
    ) -> BatchOutcome:
        """Process ``items`` in claim order; ``on_item`` runs after each (heartbeat)."""
        outcome = BatchOutcome()
        cat = catalog.CACHE.get(self.engine)
        for item in items:
            try:
                self._one(item, cat, outcome)
            except workqueue.LeaseLost:
                outcome.lost += 1
            if on_item is not None:
                on_item()
        return outcome

    def _one(
        self, item: workqueue.ClaimedItem, cat: catalog.Catalog, outcome: BatchOutcome
    ) -> None:
        try:
            route = self.routes.resolve(item.installed_pack_id, item.event_kind, item.route_version)
            pack = self.routes.pack(item.installed_pack_id)
            if route.invocation_mode != "flow":
                raise FlowError(
                    "runtime-handoff-unavailable",
                    f"route {route.event_kind} v{route.route_version} hands off to a runtime "
                    "service; this supervisor runs local flows only",
                    retriable=False,
                )
            if route.flow == "webhook":
                timeout = self.flow_deadline.total_seconds() if self.flow_deadline else None
                post_webhook(
                    self.http,
                    str(route.webhook_url),
                    {"event_id": item.event_id, "kind": item.event_kind, "payload": item.payload},
                    timeout_s=timeout,
                )
                with self.engine.begin() as conn:
                    workqueue.finish_succeeded(conn, item)
            else:
                start = time.monotonic()
                with self.engine.begin() as conn:
                    upsert_record(
                        conn,
                        cat,
                        owner_key=pack.namespace,
                        namespace=item.namespace,
                        payload=item.payload,
                        destination_object=route.destination_object,
                        field_map=route.field_map,
                    )
                    if (
                        self.flow_deadline
                        and time.monotonic() - start > self.flow_deadline.total_seconds()
                    ):
                        raise FlowError(
                            "flow-deadline", "flow exceeded its deadline", retriable=True
                        )
                    workqueue.finish_succeeded(conn, item)
            outcome.succeeded += 1
        except RouteNotFoundError as exc:
            self._finish_failed(item, "route-not-found", str(exc), outcome)
        except FlowError as exc:
            if exc.retriable and (
                exc.failure_class == "dependency-unresolved" or item.attempt < self.max_attempts
            ):
                delay = (
                    DEPENDENCY_RETRY
                    if exc.failure_class == "dependency-unresolved"
                    else workqueue.retry_backoff(item.attempt)
                )
                self._finish_retry(item, exc.failure_class, str(exc), delay, outcome)
            else:
                self._finish_failed(item, exc.failure_class, str(exc), outcome)
        except workqueue.LeaseLost:
            raise
        except Exception as exc:
            if is_transient(exc) and item.attempt < self.max_attempts:
                delay = workqueue.retry_backoff(item.attempt)
                self._finish_retry(item, "transient-db", describe_error(exc), delay, outcome)
            else:
                log.error("flow raised", work_id=item.work_id, err=describe_error(exc))
                self._finish_failed(item, "flow-error", describe_error(exc), outcome)

    def _finish_retry(
        self,
        item: workqueue.ClaimedItem,
        failure_class: str,
        summary: str,
        delay: dt.timedelta,
        outcome: BatchOutcome,
    ) -> None:
        with self.engine.begin() as conn:
            workqueue.finish_retry(
                conn, item, run_after=utcnow() + delay, failure_class=failure_class, summary=summary
            )
        outcome.retried += 1
        outcome.failure_classes[failure_class] = outcome.failure_classes.get(failure_class, 0) + 1

    def _finish_failed(
        self, item: workqueue.ClaimedItem, failure_class: str, summary: str, outcome: BatchOutcome
    ) -> None:
        with self.engine.begin() as conn:
            workqueue.finish_failed(conn, item, failure_class=failure_class, summary=summary)
        outcome.failed += 1
        outcome.failure_classes[failure_class] = outcome.failure_classes.get(failure_class, 0) + 1
