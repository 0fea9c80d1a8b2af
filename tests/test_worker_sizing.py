"""Connector worker sizing, the database pool, and the claim's permanent schema error."""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.connectors import ConnectorActivities
from nexuscrm.connectors.knobs import ConnectorKnobs
from nexuscrm.connectors.queue import LOCK_WAIT_SECONDS
from nexuscrm.connectors.sizing import CONTROL_ACTIVITIES, POOL_OVERFLOW, worker_sizing
from nexuscrm.contracts import ClaimRequest, InboundWorkerConfig
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.worker import IDENTITY_THREADS, connector_sizing


def test_sizing_follows_packs_times_workers_per_pack():
    s = worker_sizing(8, 4, extra_threads=IDENTITY_THREADS)
    assert (s.demand, s.local_activities, s.activities) == (32, 32, 32 + CONTROL_ACTIVITIES)
    assert s.threads == s.activities + s.local_activities == 64 + CONTROL_ACTIVITIES
    assert (s.pool_size, s.max_overflow) == (s.threads + IDENTITY_THREADS, POOL_OVERFLOW)
    assert not s.capped
    assert worker_sizing(0, 0).demand == 1  # at least one worker


def test_sizing_is_capped():
    s = worker_sizing(128, 4, max_slots=128)
    assert s.capped and s.demand == 512
    assert (s.local_activities, s.activities) == (128, 128 + CONTROL_ACTIVITIES)
    assert s.threads == 256 + CONTROL_ACTIVITIES
    with pytest.raises(ValueError):
        worker_sizing(8, 1, max_slots=0)


def test_connector_sizing_uses_installed_packs_over_the_allowance(tmp_path):
    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/x.db",
        connector_pack_allowance=2,
        connector_max_activity_slots=64,
    )
    knobs = ConnectorKnobs(workers_per_pack=16)
    assert connector_sizing(settings, knobs, 0).demand == 32  # the allowance
    big = connector_sizing(settings, knobs, 10)
    assert big.demand == 160 and big.capped and big.local_activities == 64
    assert settings.worker_shutdown_seconds == 30.0
    with pytest.raises(ValueError):
        Settings(database_url=f"sqlite:///{tmp_path}/x.db", worker_shutdown_seconds=-1)


def test_engine_pool_is_sized(db_url):
    engine = make_engine(db_url, pool_size=17, max_overflow=3)
    assert engine.pool.size() == 17  # type: ignore[attr-defined]
    assert engine.pool._max_overflow == 3  # type: ignore[attr-defined]
    engine.dispose()
    assert make_engine("sqlite://", pool_size=5).pool.__class__.__name__ == "NullPool"


def test_claim_on_missing_schema_fails_non_retryable(db_url):
    """The claim local activity: a missing column is permanent, not retried forever."""
    assert LOCK_WAIT_SECONDS < 30  # the claim's start-to-close (workflows.inbound_worker)
    engine = make_engine(db_url)
    ensure_system_schema(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE _System_ConnectorWorkItem DROP COLUMN LeaseOwner")
    acts = ConnectorActivities(engine, Settings(database_url=db_url), ConnectorKnobs())
    config = InboundWorkerConfig("db", "ns", "pack-1", 0, [], [], 5, 10)
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, is_local=True)
    with pytest.raises(ApplicationError) as err:
        env.run(acts.claim, ClaimRequest(config, "owner"))
    assert err.value.non_retryable and err.value.type == "ClaimSchemaMissing"
    assert "schema missing" in err.value.message
    engine.dispose()
