"""Connector runtime activities: list desired packs, claim a batch, process it.

``claim`` is short and runs as a local activity; ``process`` heartbeats and
extends the batch's leases while it runs, so a dead worker's leases expire
and another worker reclaims them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from temporalio import activity

from activities.controlplane import fatal_is_final
from nexuscrm.connectors import knobs, serving, workqueue
from nexuscrm.connectors.desired import desired_packs
from nexuscrm.connectors.processor import Processor
from nexuscrm.log import log
from nexuscrm.settings import Settings
from workflows.models import (
    BatchResult,
    ClaimedLease,
    ClaimRequest,
    DesiredPack,
    ProcessRequest,
)


class ConnectorActivities:
    """Activities of the connector runtime for one database."""

    def __init__(self, engine: Engine, settings: Settings, config: knobs.ConnectorKnobs) -> None:
        self.engine = engine
        self.settings = settings
        self.knobs = config
        self.processor = Processor(engine, flow_deadline=config.flow_deadline)
        # Frozen before the process starts, as the seed's SetRuntimeServingSelection.
        self.selection = (
            serving.load(settings.serving_selection) if settings.serving_selection else None
        )

    @activity.defn(name="connectors.list_desired")
    @fatal_is_final
    def list_desired(self, database_id: str) -> list[DesiredPack]:
        """Active and draining connector packs, each with its pool fingerprint."""
        k = self.knobs
        out = []
        desired = desired_packs(self.engine, self.selection)
        for key, reason in desired.blocked.items():
            log.error("connector pack not served", pack=key, reason=reason)
        for row in desired.packs:
            fingerprint = k.fingerprint(
                row.namespace, row.install_id, row.status, row.payload_hash, row.drain_only
            )
            out.append(
                DesiredPack(
                    namespace=row.namespace,
                    install_id=row.install_id,
                    payload_hash=row.payload_hash,
                    drain_only=row.drain_only,
                    fingerprint=fingerprint,
                    worker_count=k.workers_per_pack,
                    max_processing_rows=k.max_processing_rows,
                    queue_profile_mode=k.queue_profile_mode,
                )
            )
        self.processor.routes.forget()
        return out

    @activity.defn(name="connectors.claim")
    @fatal_is_final
    def claim(self, req: ClaimRequest) -> list[ClaimedLease]:
        """Claim one batch for the worker; returns (work id, lease token) pairs only."""
        c = req.config
        items = workqueue.claim(
            self.engine,
            installed_pack_id=c.install_id,
            queue_classes=c.queue_classes,
            preferred_queue_classes=c.preferred_queue_classes,
            batch_size=c.batch_size,
            lease_owner=req.lease_owner,
            lease_seconds=c.lease_seconds,
            max_processing_rows=c.max_processing_rows,
        )
        return [ClaimedLease(i.work_id, i.lease_token) for i in items]

    @activity.defn(name="connectors.process")
    @fatal_is_final
    def process(self, req: ProcessRequest) -> BatchResult:
        """Load the claimed items and run them; heartbeat and extend leases as it goes."""
        leases = [(lease.work_id, lease.lease_token) for lease in req.leases]
        items = workqueue.load_claimed(self.engine, leases)
        last_extend = time.monotonic()
        lease_s = req.config.lease_seconds

        def beat() -> None:
            nonlocal last_extend
            activity.heartbeat()
            if time.monotonic() - last_extend > lease_s / 3:
                workqueue.extend_leases(self.engine, leases, lease_s)
                last_extend = time.monotonic()

        outcome = self.processor.process(items, on_item=beat)
        return BatchResult(outcome.succeeded, outcome.retried, outcome.failed, outcome.lost)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity method, for ``Worker(activities=...)``."""
        return [self.list_desired, self.claim, self.process]
