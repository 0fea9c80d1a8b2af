"""One fleet reconcile as a plan: which pools to start, keep, preserve or stop.

Port of the seed's ``Supervisor.reconcile(ctx, startup, force,
preserveExistingOnReadError)``. The workflow cannot do I/O, so the database
work and every decision happen here (called by one activity) and the fleet
workflow only applies the returned ``ReconcileOutcome`` (``nexuscrm.contracts``):
typed outcomes, not a raised error. Each started or kept pool is a ``DesiredPack``
with the pool shape of ``knobs`` (worker count, processing budget, queue profile
mode), exactly what the fleet starts its supervisor from.

Modes (``mode``) and the seed's flags:

============  ========  =====  =========================  ===========================
mode          startup   force  preserve on read error     seed entry point
============  ========  =====  =========================  ===========================
``startup``   yes       yes    no                         ``StartContext``
``all``       no        yes    no                         ``Reconcile`` (signal)
``changed``   no        no     no                         ``ReconcileChanged`` (signal)
``periodic``  no        no     yes (not under selection)  ``reconcileBacklog`` (timer)
============  ========  =====  =========================  ===========================

Outcome per pack (in the order the seed checks):

* WorkItem admission (``nexuscrm.connectors.admission``): a schema,
  capability or cutover gap always stops the pool (fail closed); another
  readiness-probe error keeps an already-running pool (warning), else stops it;
* drain-only eligibility re-checked every reconcile: a drained queue stops
  the pool silently and retires an upgrade's replaced incarnation
  (``incarnations.retire_drained``); an eligibility read error blocks it;
* profiles and the projection fingerprint: a read error keeps the running
  pool in ``periodic`` mode, except under a serving selection (stop);
* unchanged fingerprint and not forced: keep (the fleet wakes it);
* startup contract (required kinds), credentials, then start;
* a pool to start takes the pack's claim fence once the whole plan is made
  (``admission.take_fence``; a rebuild by the same fleet keeps its fence):
  its generation and fencing token go into its config and fingerprint; a
  new owner's fence means the pack's older pools can no longer claim,
  finish or extend (their leases are revoked). A fence that cannot be taken
  keeps a running pool (preserve), else fails like any setup step.

Any failure of a drain-only incarnation is a blocked reason, never a fleet
failure, and an inactive drain-only pack is skipped. Outside startup a
failure stops that pool and records its blocked reason; at startup any
failure makes the whole plan ``fatal`` (nothing starts, the fleet fails).
A listing error stops every pool under a serving selection (the seed), and
keeps them otherwise (``error`` set; the seed returns the error). Under a
selection, a selection that does not verify (empty, a selected pack not an
active ready generation or of another digest, a selected route missing or of
an unsupported mode) is such a listing error with the seed's message: fatal
at startup (the runtime refuses to start), every pool stopped later.
Before listing, every reconcile fails the queued items of removed
incarnations ``pack-removed`` and reopens a retired incarnation that got a
replayed item (``incarnations.settle``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from nexuscrm.connectors import admission, queue
from nexuscrm.connectors.desired import DesiredSet, desired_packs
from nexuscrm.connectors.enrich import (
    DrainOnlyContext,
    EnrichmentError,
    PackInactiveError,
    plan_batch,
    validate_batch_credentials,
)
from nexuscrm.connectors.incarnations import retire_drained, settle
from nexuscrm.connectors.knobs import ConnectorKnobs, worker_key
from nexuscrm.connectors.routes import ConnectorPackRow, still_installed
from nexuscrm.connectors.serving import (
    RuntimeServingSelection,
    ServingSelectionError,
    selected_profiles,
)
from nexuscrm.contracts import DesiredPack, ReconcileDecision, ReconcileOutcome
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import describe_error
from nexuscrm.log import log
from nexuscrm.packs.model import CalloutProfile

MODE_STARTUP = "startup"
MODE_ALL = "all"
MODE_CHANGED = "changed"
MODE_PERIODIC = "periodic"
MODES = (MODE_STARTUP, MODE_ALL, MODE_CHANGED, MODE_PERIODIC)

ACTION_START = "start"
ACTION_KEEP = "keep"
ACTION_PRESERVE = "preserve"
ACTION_STOP = "stop"


def _msg(err: BaseException) -> str:
    # Driver message only: no SQL text or bound parameters in reasons.
    if isinstance(err, SQLAlchemyError):
        return describe_error(err)
    return str(err)


class _Fatal(Exception):
    """Internal: abort a startup plan."""


# --- resolvers (the seed's injectable lister / loaders) -------------------------------


def load_profiles(
    row: ConnectorPackRow, selection: RuntimeServingSelection | None
) -> list[CalloutProfile]:
    """The profiles a pool may use: :func:`nexuscrm.connectors.serving.selected_profiles`."""
    return selected_profiles(row, selection)


def projection_fingerprint(engine: Engine, profiles: Sequence[CalloutProfile]) -> str:
    """Fingerprint of the projected fields' current metadata (``resolveProjectionFP``).

    For every (object kind, projection field) of every profile: the field's
    ``FieldType`` and ``ColumnNames`` in ``_System_Field`` (``missing`` when
    absent); sha256 of the sorted lines. ``""`` when no profile projects.
    Database errors propagate (a read error, handled by the caller).
    """
    wanted = sorted(
        {(kind, f) for p in profiles for kind in p.object_path_map for f in p.projection_fields}
    )
    if not wanted:
        return ""
    fm = t.field_meta
    with engine.connect() as conn:
        rows = conn.execute(
            select(fm.c.ObjectApiName, fm.c.ApiName, fm.c.FieldType, fm.c.ColumnNames).where(
                fm.c.ObjectApiName.in_(sorted({k for k, _ in wanted}))
            )
        ).all()
    found = {(r.ObjectApiName, r.ApiName): f"{r.FieldType}:{r.ColumnNames}" for r in rows}
    lines = [f"{k}.{f}={found.get((k, f), 'missing')}" for k, f in wanted]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def drain_eligible(engine: Engine, row: ConnectorPackRow) -> bool:
    """A drain-only incarnation keeps a worker while its queue has non-terminal items."""
    w = t.connector_work_item
    with engine.connect() as conn:
        n = conn.execute(
            select(func.count()).where(
                w.c.InstalledPackId == row.install_id,
                w.c.State.in_(queue.NON_TERMINAL_STATES),
            )
        ).scalar()
    return bool(n)


@dataclass
class Resolvers:
    """The seed's injectable lister / loaders; defaults read the real database."""

    list_packs: Callable[[Engine, RuntimeServingSelection | None], DesiredSet] = desired_packs
    activation: Callable[[Engine, str, str, str], admission.Activation] = (
        admission.resolve_activation
    )
    drain_eligible: Callable[[Engine, ConnectorPackRow], bool] = drain_eligible
    load_profiles: Callable[
        [ConnectorPackRow, RuntimeServingSelection | None], list[CalloutProfile]
    ] = load_profiles
    projection_fingerprint: Callable[[Engine, Sequence[CalloutProfile]], str] = (
        projection_fingerprint
    )
    retire_drained: Callable[[Engine, str], bool] = retire_drained
    settle_incarnations: Callable[[Engine], None] = settle
    take_fence: Callable[[Engine, str, str, str], admission.Activation] = admission.take_fence
    stalled_pack: Callable[..., bool] = queue.stalled_pack


# --- the plan -------------------------------------------------------------------------


def plan_reconcile(
    engine: Engine,
    *,
    selection: RuntimeServingSelection | None,
    knobs: ConnectorKnobs,
    mode: str,
    running: Mapping[str, str],
    fleet_epoch: str,
    env: Mapping[str, str] = os.environ,
    resolvers: Resolvers | None = None,
    take_fences: bool = True,
) -> ReconcileOutcome:
    """Plan one reconcile (see the module docstring for every rule).

    ``running``: fingerprint per ``namespace/install id`` of the pools that
    run now. ``fleet_epoch``: stands for the seed's host+pid in the scheduler
    owner id and fencing token. Never raises for database errors: they are
    outcomes. Returns the ``ReconcileOutcome`` the reconcile activity hands
    the fleet: one ``ReconcileDecision`` per listed pack, ``pack`` set (a
    ``DesiredPack`` sized by ``knobs``) for start and keep; ``blocked`` /
    ``degraded``: reason per ``namespace/install id``; ``error``: a listing
    error or the startup failure; ``fatal``: startup failed (start nothing,
    fail the fleet); ``stop_all``: stop every pool (listing error under a
    serving selection). Raises ``ValueError`` for an unknown ``mode``.

    ``take_fences=False`` plans without taking any claim fence (a pool to
    start carries the fence as it was read, not one of its own): a look whose plan may be
    discarded (the fleet's periodic pass, :func:`starts_pool`) must not
    supersede a running pool; the caller plans again with fences before it
    starts anything.
    """
    if mode not in MODES:
        raise ValueError(f"unknown reconcile mode {mode!r} (expected one of {', '.join(MODES)})")
    r = resolvers or Resolvers()
    plan = ReconcileOutcome()
    startup = mode == MODE_STARTUP
    force = mode in (MODE_STARTUP, MODE_ALL)
    # A serving selection is exact authority: never preserve on a read error.
    preserve_on_read_error = mode == MODE_PERIODIC and selection is None
    try:
        # Removed incarnations get no pool: their queued items fail pack-removed;
        # a retired incarnation with a replayed item drains again.
        r.settle_incarnations(engine)
    except Exception as exc:  # the next reconcile tries again
        log.warning("settling connector pack incarnations failed", err=_msg(exc))
    try:
        desired = r.list_packs(engine, selection)
    except ServingSelectionError as exc:  # the seed's own message
        plan.error = str(exc)
        plan.fatal = startup
        plan.stop_all = not startup
        return plan
    except Exception as exc:
        plan.error = f"connector inbound supervisor: list connector packs: {describe_error(exc)}"
        plan.fatal = startup
        plan.stop_all = selection is not None and not startup
        return plan
    plan.blocked.update(desired.blocked)

    try:
        for row in desired.packs:
            _plan_row(engine, row, plan, r, selection, knobs, startup, force,
                      preserve_on_read_error, running, fleet_epoch, env)  # fmt: skip
        if take_fences:
            _take_fences(engine, plan, r, knobs, startup, running, fleet_epoch)
    except _Fatal as exc:
        return ReconcileOutcome(blocked=plan.blocked, error=str(exc), fatal=True)
    if mode == MODE_PERIODIC:
        _mark_stalled(engine, plan, r)
    return plan


def starts_pool(plan: ReconcileOutcome) -> bool:
    """True when ``plan`` starts (or replaces) a pool: applied, it needs the claim fences
    that a plan made with ``take_fences=False`` did not take."""
    return any(d.action == ACTION_START and d.pack is not None for d in plan.decisions)


def _mark_stalled(engine: Engine, plan: ReconcileOutcome, r: Resolvers) -> None:
    """Periodic reconcile: flag kept pools with claimable work and a worker without a lease.

    The fleet wakes them (the seed's backlog reconcile; workers back their idle
    timers off). A read error leaves the pool unflagged: its workers' idle
    timers still run, and the next reconcile looks again.
    """
    for d in plan.decisions:
        if d.action != ACTION_KEEP or d.pack is None:
            continue
        try:
            d.stalled = r.stalled_pack(
                engine,
                d.install_id,
                d.pack.worker_count,
                d.pack.max_processing_rows,
                generation=d.pack.generation,
            )
        except SQLAlchemyError as exc:
            log.warning("stalled-pool check failed", pack=d.key, err=describe_error(exc))


def _take_fences(
    engine: Engine,
    plan: ReconcileOutcome,
    r: Resolvers,
    knobs: ConnectorKnobs,
    startup: bool,
    running: Mapping[str, str],
    fleet_epoch: str,
) -> None:
    """Each pool to start takes its pack's claim fence; its config and fingerprint follow.

    Taken only once every row is planned, so a fatal plan takes none of them.
    A failure keeps a running pool (preserve: it still holds the current
    fence); otherwise it is a setup failure (drain-only: blocked; startup:
    fatal; else stopped and blocked).
    """
    for i, d in enumerate(plan.decisions):
        pack = d.pack
        if d.action != ACTION_START or pack is None:
            continue
        try:
            act = r.take_fence(engine, pack.namespace, pack.install_id, fleet_epoch)
        except Exception as exc:
            label = f"{pack.namespace} ({pack.install_id})"
            if running.get(d.key):
                reason = f"preserving running pool after take claim fence failed: {_msg(exc)}"
                log.warning("connector pack pool preserved", pack=d.key, reason=reason)
                plan.decisions[i] = ReconcileDecision(
                    d.key, d.namespace, d.install_id, ACTION_PRESERVE, reason
                )
                continue
            if startup and not pack.drain_only:
                raise _Fatal(
                    f"connector inbound supervisor: take claim fence for {label}: {_msg(exc)}"
                ) from exc
            reason = f"take claim fence: {_msg(exc)}"
            log.error("connector pack pool stopped", pack=d.key, reason=reason)
            plan.blocked[d.key] = reason
            plan.decisions[i] = ReconcileDecision(
                d.key, d.namespace, d.install_id, ACTION_STOP, reason
            )
            continue
        pack.generation = act.generation
        pack.scheduler_owner_id = act.scheduler_owner_id
        pack.fencing_token = act.fencing_token
        pack.fingerprint = knobs.fingerprint(
            pack.namespace, pack.install_id, pack.status, pack.payload_hash, pack.drain_only,
            pack.projection_fingerprint, act.generation, act.scheduler_owner_id,
            act.fencing_token,
        )  # fmt: skip


def _plan_row(
    engine: Engine,
    row: ConnectorPackRow,
    plan: ReconcileOutcome,
    r: Resolvers,
    selection: RuntimeServingSelection | None,
    knobs: ConnectorKnobs,
    startup: bool,
    force: bool,
    preserve_on_read_error: bool,
    running: Mapping[str, str],
    fleet_epoch: str,
    env: Mapping[str, str],
) -> None:
    key = worker_key(row.namespace, row.install_id)
    label = f"{row.namespace} ({row.install_id})"
    current = running.get(key, "")

    def decide(
        action: str, reason: str = "", gap: str = "", pack: DesiredPack | None = None
    ) -> None:
        plan.decisions.append(
            ReconcileDecision(key, row.namespace, row.install_id, action, reason, gap, pack)
        )

    def fail(phase: str, err: BaseException, gap: str = "") -> None:
        # The seed: drain-only -> blockDrainOnlyWorker; startup -> stop what
        # started and fail; otherwise the pool is stopped and the error reported.
        reason = f"{phase}: {_msg(err)}"
        if row.drain_only:
            log.warning("connector inbound drain worker blocked", pack=key, reason=reason)
        elif startup:
            raise _Fatal(f"connector inbound supervisor: {phase} for {label}: {_msg(err)}")
        else:
            log.error("connector pack pool stopped", pack=key, reason=reason)
        plan.blocked[key] = reason
        decide(ACTION_STOP, reason, gap)

    def preserve(phase: str, err: BaseException) -> None:
        reason = f"preserving running pool after {phase} failed: {_msg(err)}"
        log.warning("connector pack pool preserved", pack=key, reason=reason)
        decide(ACTION_PRESERVE, reason)

    try:
        act = r.activation(engine, row.namespace, row.install_id, fleet_epoch)
    except admission.AdmissionGap as exc:
        fail("verify WorkItem readiness", exc, exc.kind)
        return
    except Exception as exc:  # a transient probe error keeps a running pool
        if not startup and current:
            preserve("WorkItem readiness probe", exc)
        else:
            fail("verify WorkItem readiness", exc)
        return

    if row.drain_only:
        try:
            eligible = r.drain_eligible(engine, row)
        except Exception as exc:
            fail("verify drain eligibility", exc)
            return
        if not eligible:
            # An upgrade's replaced incarnation is retired once drained.
            try:
                r.retire_drained(engine, row.install_id)
            except Exception as exc:  # retried at the next reconcile
                log.warning("retiring a drained incarnation failed", pack=key, err=_msg(exc))
            decide(ACTION_STOP, "drain-only generation has an empty queue")
            return

    try:
        profiles = r.load_profiles(row, selection)
    except ServingSelectionError as exc:
        fail("load profiles", exc)
        return
    except Exception as exc:
        if preserve_on_read_error and current:
            preserve("periodic profile read", exc)
        else:
            fail("load profiles", exc)
        return

    projection = ""
    if any(p.projection_fields for p in profiles):
        try:
            projection = r.projection_fingerprint(engine, profiles)
        except Exception as exc:
            if preserve_on_read_error and current:
                preserve("periodic projection fingerprint read", exc)
            else:
                fail("resolve projection fingerprint", exc)
            return

    try:
        batch = plan_batch(profiles, label)
    except EnrichmentError as exc:
        fail("resolve startup contract", exc)
        return
    if batch.degraded:
        log.warning("connector pack enrichment degraded", pack=key, reason=batch.degraded)
        plan.degraded[key] = batch.degraded

    fingerprint = knobs.fingerprint(
        row.namespace, row.install_id, row.status, row.payload_hash, row.drain_only,
        projection, act.generation, act.scheduler_owner_id, act.fencing_token,
    )  # fmt: skip
    pack = DesiredPack(
        namespace=row.namespace,
        install_id=row.install_id,
        payload_hash=row.payload_hash,
        drain_only=row.drain_only,
        fingerprint=fingerprint,
        worker_count=knobs.workers_per_pack,
        max_processing_rows=knobs.max_processing_rows,
        queue_profile_mode=knobs.queue_profile_mode,
        status=row.status,
        generation=act.generation,
        scheduler_owner_id=act.scheduler_owner_id,
        fencing_token=act.fencing_token,
        projection_fingerprint=projection,
        degraded=batch.degraded,
    )
    if not force and current == fingerprint:
        decide(ACTION_KEEP, pack=pack)
        return

    if not batch.degraded:  # the payload-only fallback reads nothing: no credential
        drain_ctx = (
            DrainOnlyContext(
                row.namespace, row.install_id, lambda: still_installed(engine, row.install_id)
            )
            if row.drain_only
            else None
        )
        try:
            validate_batch_credentials(batch, env, drain_ctx)
        except PackInactiveError as exc:
            if row.drain_only:
                decide(ACTION_STOP, str(exc))
                return
            fail("validate batch credentials", exc)
            return
        except EnrichmentError as exc:
            fail("validate batch credentials", exc)
            return
    decide(ACTION_START, pack=pack)
