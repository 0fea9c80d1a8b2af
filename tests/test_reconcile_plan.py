"""Issue 5 rules 4, 5, 6, 7: one fleet reconcile as a typed plan, on real databases.

Each test builds real installed packs (metadata, RunRepair for the cutover
receipt, ApplyPacks) and calls ``plan_reconcile`` as the fleet's activity
does. Read errors are real where the database can produce them (a renamed
table); the few that cannot be provoked are injected through the seed's
injectable resolvers (``Resolvers``), which is what the seed's tests do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine, delete, text, update

from nexuscrm import catalog, cutover
from nexuscrm.connectors import admission, reconcile
from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.desired import DesiredSet, desired_packs
from nexuscrm.connectors.knobs import ConnectorKnobs
from nexuscrm.connectors.reconcile import (
    ACTION_KEEP,
    ACTION_PRESERVE,
    ACTION_START,
    ACTION_STOP,
    Resolvers,
    plan_reconcile,
)
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.connectors.serving import RuntimeServingSelection
from nexuscrm.contracts import ReconcileDecision, ReconcileOutcome
from nexuscrm.controlplane import metadata, packs_apply, repair
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from tests.builders import connector_pack_doc, event, webhook_route

KNOBS = ConnectorKnobs()
ENV = {"NEXUS_CREDENTIAL_CRM_API": "s3cret"}


def profile(name: str = "batch", kinds: tuple[str, ...] = ("User",), **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "endpoint": "http://127.0.0.1:9/api",
        "credential_ref": "crm-api",
        "object_path_map": {k: f"/records/{k}" for k in kinds},
        **kw,
    }


def pack_doc(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    return connector_pack_doc("hook-pack", [webhook_route()], profiles)


def install(engine: Engine, tmp_path: Path, profiles: list[dict[str, Any]]) -> str:
    path = tmp_path / f"pack-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(pack_doc(profiles)))
    packs_apply.apply_packs(engine, packs_apply.load_plan(engine, [str(path)], False))
    (row,) = [r for r in list_connector_packs(engine) if r.status == "active"]
    return f"{row.namespace}/{row.install_id}"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    metadata.apply_metadata(eng)
    catalog.CACHE.invalidate()
    repair.run_repair(eng)  # writes the WorkItem-only cutover receipt
    yield eng
    eng.dispose()


def plan(
    engine: Engine,
    mode: str,
    running: dict[str, str] | None = None,
    *,
    env: dict[str, str] = ENV,
    selection: RuntimeServingSelection | None = None,
    resolvers: Resolvers | None = None,
) -> ReconcileOutcome:
    return plan_reconcile(
        engine,
        selection=selection,
        knobs=KNOBS,
        mode=mode,
        running=running or {},
        fleet_epoch="run-1",
        env=env,
        resolvers=resolvers,
    )


def only(p: ReconcileOutcome) -> ReconcileDecision:
    (d,) = p.decisions
    return d


def running_of(p: ReconcileOutcome) -> dict[str, str]:
    return {d.key: d.pack.fingerprint for d in p.decisions if d.pack}


def selection_for(engine: Engine, **override: Any) -> RuntimeServingSelection:
    (row,) = [r for r in list_connector_packs(engine) if r.status == "active"]
    pack: dict[str, Any] = {
        "namespace": row.namespace,
        "installed_pack_id": row.install_id,
        "payload_digest": row.payload_hash,
        "inbound_routes": [{"event_kind": "hook.event", "route_version": 1}],
        "callout_profiles": [{"name": "batch", "credential_refs": ["crm-api"]}],
    }
    pack.update(override)
    return RuntimeServingSelection.model_validate({"packs": [pack]})


# --- rule 4: typed outcomes ------------------------------------------------------------


def test_admission_gaps_always_stop_the_pool_and_fail_closed(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    started = plan(engine, "startup")
    assert only(started).action == ACTION_START
    running = running_of(started)
    # Cutover gap: even the periodic reconcile (which preserves on read errors) stops it.
    with engine.begin() as conn:
        conn.execute(
            delete(t.bootstrap_state).where(
                t.bootstrap_state.c.StateKey == cutover.CUTOVER_RECEIPT_KEY
            )
        )
    d = only(plan(engine, "periodic", running))
    assert (d.action, d.gap) == (ACTION_STOP, "cutover")
    repair.run_repair(engine)
    # Schema gap: a missing claim column.
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE _System_ConnectorWorkItem DROP COLUMN ProjectionKey"))
    p = plan(engine, "periodic", running)
    assert (only(p).action, only(p).gap) == (ACTION_STOP, "schema")
    assert "ProjectionKey" in p.blocked[key] and "verify WorkItem readiness" in p.blocked[key]
    # At startup the same gap fails the whole fleet, starting nothing.
    p = plan(engine, "startup")
    assert p.fatal and p.decisions == [] and "ProjectionKey" in p.error


def test_a_transient_probe_error_keeps_a_running_pool_and_stops_nothing_else(engine, tmp_path):
    install(engine, tmp_path, [profile()])
    running = running_of(plan(engine, "startup"))

    def flaky(*args: Any) -> admission.Activation:
        raise cutover.AdmissionProbeError("verify work_item claim schema: lock wait timeout")

    flaky_probe = Resolvers(activation=flaky)
    for mode in ("all", "changed", "periodic"):
        assert only(plan(engine, mode, running, resolvers=flaky_probe)).action == ACTION_PRESERVE
    # Not running yet: nothing to keep, so the pack is stopped (blocked), and at startup fatal.
    assert only(plan(engine, "changed", {}, resolvers=flaky_probe)).action == ACTION_STOP
    assert plan(engine, "startup", {}, resolvers=flaky_probe).fatal


def test_periodic_projection_read_error_keeps_the_pool_except_under_a_selection(engine, tmp_path):
    install(engine, tmp_path, [profile(projection_fields=["Title"])])
    running = running_of(plan(engine, "startup"))
    sel = selection_for(engine)
    assert only(plan(engine, "periodic", running, selection=sel)).action == ACTION_KEEP
    with engine.begin() as conn:  # a real read error: the metadata table is gone
        conn.execute(text("ALTER TABLE _System_Field RENAME TO _System_Field_away"))
    try:
        assert only(plan(engine, "periodic", running)).action == ACTION_PRESERVE
        assert only(plan(engine, "changed", running)).action == ACTION_STOP
        d = only(plan(engine, "periodic", running, selection=sel))
        assert d.action == ACTION_STOP and "resolve projection fingerprint" in d.reason
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE _System_Field_away RENAME TO _System_Field"))


def test_periodic_profile_read_error_keeps_the_pool_except_under_a_selection(engine, tmp_path):
    install(engine, tmp_path, [profile()])
    running = running_of(plan(engine, "startup"))
    sel = selection_for(engine)

    def unreadable(*args: Any) -> list[Any]:
        raise OSError("profile store unreachable")

    r = Resolvers(load_profiles=unreadable)
    assert only(plan(engine, "periodic", running, resolvers=r)).action == ACTION_PRESERVE
    assert only(plan(engine, "periodic", running, resolvers=r, selection=sel)).action == (
        ACTION_STOP
    )


def test_a_listing_error_stops_every_pool_under_a_selection_and_fails_startup(engine, tmp_path):
    install(engine, tmp_path, [profile()])
    sel = selection_for(engine)

    def unlisted(*args: Any) -> DesiredSet:
        raise OSError("connection reset")

    r = Resolvers(list_packs=unlisted)
    p = plan(engine, "periodic", {"x/y": "fp"}, selection=sel, resolvers=r)
    assert p.stop_all and "connection reset" in p.error and not p.fatal
    p = plan(engine, "periodic", {"x/y": "fp"}, resolvers=r)
    assert not p.stop_all and p.error  # the seed keeps pools without a selection
    assert plan(engine, "startup", resolvers=r).fatal


# --- rule 5: activation carried in the fingerprint ---------------------------------------


def test_generation_owner_and_fence_are_part_of_the_pool_fingerprint(engine, tmp_path):
    """A pool to start takes the pack's claim fence (issue 11 item 9): generation and
    token are in its config and fingerprint; a rebuild by the same fleet keeps the
    fence; another fleet's fence supersedes it, and the pool is rebuilt on a newer one."""
    key = install(engine, tmp_path, [profile()])
    install_id = key.split("/")[1]
    first = only(plan(engine, "startup"))
    assert first.action == ACTION_START and first.pack is not None
    assert first.pack.generation == 1
    assert first.pack.scheduler_owner_id.endswith("-run-1#workitem-scheduler")
    assert first.pack.fencing_token.endswith("-run-1#workitem-scheduler-fence")
    assert admission.resolve_claim_generation(engine, install_id) == 1
    running = {key: first.pack.fingerprint}
    kept = only(plan(engine, "changed", running))
    assert kept.action == ACTION_KEEP and kept.pack is not None
    assert (kept.pack.generation, kept.pack.fingerprint) == (1, first.pack.fingerprint)
    rebuilt = only(plan(engine, "all", running))  # a forced rebuild by the same fleet
    assert rebuilt.action == ACTION_START and rebuilt.pack is not None
    assert (rebuilt.pack.generation, rebuilt.pack.fingerprint) == (1, first.pack.fingerprint)
    # A fleet of another epoch took the fence: this fleet's pool is rebuilt on a newer one.
    other = plan_reconcile(
        engine, selection=None, knobs=KNOBS, mode="startup", running={},
        fleet_epoch="run-2", env=ENV,
    )  # fmt: skip
    taken = only(other).pack
    assert taken is not None and taken.generation == 2
    d = only(plan(engine, "changed", running))
    assert d.action == ACTION_START and d.pack is not None and d.pack.generation == 3
    assert d.pack.fingerprint != first.pack.fingerprint


def test_a_plan_without_fences_supersedes_no_running_pool(engine, tmp_path):
    """The fleet's periodic pass plans with ``take_fences=False`` (its plan may be
    discarded by a request or a prune): a pool it would start takes no fence, so the
    pool that runs under the current fence keeps claiming; ``starts_pool`` tells the
    fleet to plan again with fences before it starts anything."""
    key = install(engine, tmp_path, [profile()])
    install_id = key.split("/")[1]
    first = only(plan(engine, "startup")).pack
    assert first is not None and admission.resolve_claim_generation(engine, install_id) == 1
    holds = (install_id, first.generation, first.fencing_token)
    assert wq.fence_holds(engine, *holds)
    for running in ({}, {key: "stale-fingerprint"}):  # a missing pool, a changed one
        p = plan_reconcile(
            engine, selection=None, knobs=KNOBS, mode="periodic", running=running,
            fleet_epoch="run-2", env=ENV, take_fences=False,
        )  # fmt: skip
        d = only(p)
        assert d.action == ACTION_START and d.pack is not None
        assert reconcile.starts_pool(p)
        assert admission.resolve_claim_generation(engine, install_id) == 1
    assert wq.fence_holds(engine, *holds)  # the running pool may still claim and finish
    kept = plan_reconcile(
        engine, selection=None, knobs=KNOBS, mode="periodic",
        running={key: first.fingerprint}, fleet_epoch="run-1", env=ENV, take_fences=False,
    )  # fmt: skip
    assert only(kept).action == ACTION_KEEP and not reconcile.starts_pool(kept)
    # Planned with fences (what the fleet does next), the other epoch supersedes it.
    taken = plan_reconcile(
        engine, selection=None, knobs=KNOBS, mode="periodic", running={},
        fleet_epoch="run-2", env=ENV,
    )  # fmt: skip
    assert only(taken).pack.generation == 2  # type: ignore[union-attr]
    assert not wq.fence_holds(engine, *holds)


def test_a_fence_that_cannot_be_taken_keeps_a_running_pool_and_fails_a_new_one(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    running = running_of(plan(engine, "startup"))

    def busy(*args: Any) -> admission.Activation:
        raise wq.QueueLockTimeout("queue lock not granted within 10 s")

    r = Resolvers(take_fence=busy)
    d = only(plan(engine, "all", running, resolvers=r))
    assert d.action == ACTION_PRESERVE and "take claim fence" in d.reason
    p = plan(engine, "all", {}, resolvers=r)
    assert only(p).action == ACTION_STOP and "take claim fence" in p.blocked[key]
    p = plan(engine, "startup", {}, resolvers=r)
    assert p.fatal and p.decisions == [] and "take claim fence" in p.error


# --- rule 6: drain-only generations ------------------------------------------------------


def drain(engine: Engine, key: str, status: str = "draining") -> None:
    with engine.begin() as conn:
        conn.execute(
            update(t.installed_pack)
            .where(t.installed_pack.c.PackInstallId == key.split("/")[1])
            .values(Status=status)
        )


def test_drain_only_generation_keeps_a_worker_until_its_queue_is_empty(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    install_id = key.split("/")[1]
    wq.enqueue(
        engine,
        [event(install_id, "k", "u1", namespace="hook-pack", kind="hook.event", obj="User")],
    )
    drain(engine, key)
    d = only(plan(engine, "startup"))
    assert d.action == ACTION_START and d.pack is not None and d.pack.drain_only
    running = running_of(plan(engine, "startup"))
    assert only(plan(engine, "periodic", running)).action == ACTION_KEEP
    with engine.begin() as conn:  # its queue drains
        conn.execute(update(t.connector_work_item).values(State="succeeded"))
    p = plan(engine, "periodic", running)
    assert only(p).action == ACTION_STOP and p.blocked == {}


def test_drain_only_setup_failure_is_a_blocked_reason_never_a_fleet_failure(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    install_id = key.split("/")[1]
    wq.enqueue(
        engine,
        [event(install_id, "k", "u1", namespace="hook-pack", kind="hook.event", obj="User")],
    )
    drain(engine, key)
    p = plan(engine, "startup", env={})  # its credential is not set
    assert not p.fatal and only(p).action == ACTION_STOP
    assert "NEXUS_CREDENTIAL_CRM_API" in p.blocked[key]
    assert "validate batch credentials" in p.blocked[key]
    # The pack is removed between the listing and the credential check: skipped, not blocked.
    snapshot = desired_packs(engine, None)
    drain(engine, key, "removed")
    # (The sweep of removed packs' items ran before the removal.)
    after_sweep = Resolvers(list_packs=lambda e, s: snapshot, settle_incarnations=lambda e: None)
    p = plan(engine, "startup", resolvers=after_sweep)
    assert only(p).action == ACTION_STOP and "inactive" in only(p).reason and p.blocked == {}


def test_serving_selection_refuses_a_drain_only_generation(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    sel = selection_for(engine)
    drain(engine, key)
    # The selection no longer verifies: every pool stops (the seed's lister
    # error), and a starting runtime refuses to start.
    p = plan(engine, "periodic", selection=sel)
    assert p.decisions == [] and p.stop_all and not p.fatal
    assert "cannot start a drain-only generation" in p.error
    p = plan(engine, "startup", selection=sel)
    assert p.fatal and "cannot start a drain-only generation" in p.error


# --- rule 7: enrichment contract ---------------------------------------------------------


def test_missing_required_batch_coverage_fails_the_pool_naming_the_kinds(engine, tmp_path):
    key = install(
        engine, tmp_path, [profile(kinds=("User",), required_object_kinds=["User", "Lead", "Case"])]
    )
    p = plan(engine, "startup")
    assert p.fatal and "requires batch coverage for Case, Lead" in p.error
    p = plan(engine, "all")
    assert only(p).action == ACTION_STOP
    assert "requires batch coverage for Case, Lead" in p.blocked[key]


def test_duplicate_coverage_degrades_to_payload_only_and_is_reported(engine, tmp_path):
    key = install(engine, tmp_path, [profile("a"), profile("b")])
    p = plan(engine, "startup", env={})  # payload-only reads nothing: no credential needed
    d = only(p)
    assert d.action == ACTION_START and d.pack is not None
    assert "duplicate batch object coverage" in p.degraded[key]
    assert "User by a, b" in d.pack.degraded


def test_no_eligible_profile_is_the_silent_payload_only_path(engine, tmp_path):
    install(engine, tmp_path, [{"name": "plain", "endpoint": "http://127.0.0.1:9/"}])
    p = plan(engine, "startup", env={})
    assert only(p).action == ACTION_START and p.degraded == {} and p.blocked == {}


def test_batch_credentials_are_validated_when_the_pool_is_built(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    assert plan(engine, "startup", env={}).fatal
    p = plan(engine, "all", env={})
    assert only(p).action == ACTION_STOP and "NEXUS_CREDENTIAL_CRM_API is not set" in p.blocked[key]


def test_selection_profiles_may_use_only_authorized_credentials(engine, tmp_path):
    key = install(engine, tmp_path, [profile()])
    sel = selection_for(engine, callout_profiles=[{"name": "batch", "credential_refs": ["other"]}])
    p = plan(engine, "changed", selection=sel)
    assert only(p).action == ACTION_STOP
    assert "credential is not authorized by its selection" in p.blocked[key]
    assert only(plan(engine, "changed", selection=selection_for(engine))).action == ACTION_START


def test_projection_fingerprint_is_part_of_the_pool_fingerprint(engine, tmp_path):
    key = install(engine, tmp_path, [profile(projection_fields=["Title"])])
    d = only(plan(engine, "startup"))
    assert d.pack is not None and d.pack.projection_fingerprint
    running = {key: d.pack.fingerprint}
    assert only(plan(engine, "changed", running)).action == ACTION_KEEP
    with engine.begin() as conn:
        conn.execute(
            update(t.field_meta)
            .where(t.field_meta.c.ObjectApiName == "User", t.field_meta.c.ApiName == "Title")
            .values(FieldType="LongTextArea")
        )
    assert only(plan(engine, "changed", running)).action == ACTION_START


def test_unknown_mode_is_refused(engine):
    with pytest.raises(ValueError, match="unknown reconcile mode 'sometimes'"):
        plan(engine, "sometimes")
    assert reconcile.MODES == ("startup", "all", "changed", "periodic")
