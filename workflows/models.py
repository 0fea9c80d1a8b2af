"""Inputs and outputs of the control-plane workflows and activities.

Plain dataclasses (Temporal's default JSON converter handles them); shared by
workflows, activities, the worker and the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ApplyAllInput:
    """Start arguments of ``ApplyAllWorkflow``.

    policy: ``always_apply`` (operator / deploy pipeline: full run) or
      ``auto_start`` (container start: classify, then skip / apply / halt).
    app_pack_sources: paths (on the worker's machine) of app packs to install:
      a Salesforce DX project folder or a native ``pack.yaml``.
    include_dev_sample: ``None`` lets the worker decide (not in production).
    heartbeat_timeout_seconds: heartbeat timeout of the long phases; a worker
      that dies is noticed this fast.
    """

    app_pack_sources: list[str] = field(default_factory=list)
    policy: str = "always_apply"
    include_dev_sample: bool | None = None
    heartbeat_timeout_seconds: float = 30.0


@dataclass
class OperationInput:
    """Start arguments of a sibling control-plane workflow (RunRepair, EnsureIndexes ...)."""

    app_pack_sources: list[str] = field(default_factory=list)
    include_dev_sample: bool | None = None
    heartbeat_timeout_seconds: float = 30.0


@dataclass
class PhaseReport:
    """One phase as the ``progress`` query shows it.

    status: pending | running | completed | failed | skipped.
    started_at: ISO-8601 UTC (workflow time); duration_s in seconds.
    """

    name: str
    status: str = "pending"
    started_at: str | None = None
    duration_s: float | None = None
    error: str | None = None
    detail: str | None = None


@dataclass
class PlannedPackInfo:
    """A pack of the plan: name, category, version, payload hash, source."""

    name: str
    category: str
    version: str
    payload_hash: str
    source: str
    objects: int


@dataclass
class PlanRequest:
    """What to plan: app pack sources and the DevSample choice."""

    app_pack_sources: list[str]
    include_dev_sample: bool | None


@dataclass
class PhaseRequest:
    """Common activity input: the run id and lease epoch that fence every write."""

    run_id: str
    epoch: int
    operation: str = "ApplyAll"
    phase: str = ""
    error: str | None = None


@dataclass
class ApplyPacksRequest:
    """apply-packs input: the plan to apply (hashes must still match the sources)."""

    run_id: str
    epoch: int
    app_pack_sources: list[str]
    include_dev_sample: bool | None
    planned: list[PlannedPackInfo]
    only_runtime_required: bool = False


@dataclass
class RepairRequest:
    """run-repair input; ``fail_closed_on_convergence`` is set on the ApplyAll path."""

    run_id: str
    epoch: int
    fail_closed_on_convergence: bool
    l0_only: bool = False


@dataclass
class VerifyRequest:
    """verify input: pack name -> payload hash this run planned."""

    expected_hashes: dict[str, str]
    check_indexes: bool = True


@dataclass
class AutoStartDecisionInfo:
    """auto_start classification: action (skip | apply | halt_for_migration) and reason."""

    action: str
    reason: str


@dataclass
class ApplyAllResult:
    """Outcome of an ApplyAll (or sibling) run.

    status: completed | skipped. (A failed run fails the workflow instead.)
    """

    status: str
    reason: str
    phases: list[PhaseReport]
    packs: list[PlannedPackInfo]
    formula_problems: list[str]
    duration_s: float


@dataclass
class InboundWorkerConfig:
    """One inbound worker: its pack incarnation, queue profile and budget.

    lease_seconds: how long a claim is held without a heartbeat; idle_seconds:
    how long the worker sleeps when it found nothing (a ``wake`` cuts it short).
    """

    database_id: str
    namespace: str
    install_id: str
    ordinal: int
    queue_classes: list[str]
    preferred_queue_classes: list[str]
    batch_size: int
    max_processing_rows: int
    lease_seconds: float = 60.0
    idle_seconds: float = 5.0
    fingerprint: str = ""
    batches_before_continue_as_new: int = 200
    # WorkItem claim activation (issue 5 rule 5): resolved at admission, the
    # same for every worker of one pool, and part of the pool fingerprint.
    generation: int = 0
    scheduler_owner_id: str = ""
    fencing_token: str = ""
    drain_only: bool = False


@dataclass
class ClaimRequest:
    """claim activity input (the worker config plus its lease owner id)."""

    config: InboundWorkerConfig
    lease_owner: str


@dataclass
class ClaimedLease:
    """A claimed item as the workflow sees it: id and lease token only (no payload)."""

    work_id: str
    lease_token: str


@dataclass
class ProcessRequest:
    """process activity input: the claimed leases to run."""

    config: InboundWorkerConfig
    leases: list[ClaimedLease]


@dataclass
class DependencySpec:
    """What a blocked item waits on (``nexuscrm.connectors.identity.Dependency`` as data)."""

    kind: str
    object_api_name: str
    record_id: str = ""
    owner_key: str = ""
    namespace: str = ""
    remote_id: str = ""


@dataclass
class BlockedWait:
    """An item a batch blocked: its id, dependency and the dependency's key hash."""

    work_id: str
    key_hash: str
    dependency: DependencySpec


@dataclass
class BatchResult:
    """Counts of one processed batch.

    blocked: items blocked on a dependency (their waits are registered after
    commit); wake_keys: key hashes of waits whose remote link this batch
    finalized (signalled ``wake`` after commit).
    """

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    blocked: list[BlockedWait] = field(default_factory=list)
    wake_keys: list[str] = field(default_factory=list)


@dataclass
class IdentityWaitConfig:
    """Durations of an identity-convergence wait (seconds; settings, tests shorten them).

    probe_interval_seconds: first delay between probes, doubling up to
    max_probe_interval_seconds; probe_timeout_seconds bounds one probe;
    max_wait_seconds: an item still unresolved (by a fresh probe) this long
    after its own ``DependencyBlockedAt`` fails ``identity-convergence-expired``
    (``<= 0`` disables expiry); liveness_grace_seconds: how far past its next
    probe the wait marks its rows alive (recovery restarts waits of older marks).
    """

    probe_interval_seconds: float = 5.0
    max_probe_interval_seconds: float = 60.0
    probe_timeout_seconds: float = 5.0
    max_wait_seconds: float = 1800.0
    liveness_grace_seconds: float = 60.0
    probes_before_continue_as_new: int = 500
    search_attributes: bool = True  # off only on a server without them (the test server)


@dataclass
class IdentityWaitInput:
    """IdentityWaitWorkflow input (and its continue-as-new state)."""

    database_id: str
    key_hash: str
    dependency: DependencySpec
    config: IdentityWaitConfig = field(default_factory=IdentityWaitConfig)
    work_ids: list[str] = field(default_factory=list)
    started_at: str = ""
    probes: int = 0


@dataclass
class WaitNotifyRequest:
    """identity.notify input: waits to register (signal-with-start) and to wake."""

    database_id: str
    blocked: list[BlockedWait] = field(default_factory=list)
    wake_keys: list[str] = field(default_factory=list)


@dataclass
class WaitItem:
    """A blocked item of a wait: id, pack, blocked-at (ISO-8601, naive UTC)."""

    work_id: str
    installed_pack_id: str
    blocked_at: str


@dataclass
class ProbeRequest:
    """identity.probe input: the wait's key, dependency, registered items and liveness mark."""

    key_hash: str
    dependency: DependencySpec
    work_ids: list[str]
    alive_until: str
    timeout_seconds: float = 5.0


@dataclass
class ProbeResult:
    """A probe: converged or not, the items still blocked, invalid ones terminalized."""

    converged: bool
    items: list[WaitItem] = field(default_factory=list)
    invalid: int = 0


@dataclass
class ExpireRequest:
    """identity.expire input: due items of the wait, and the wait's now (ISO-8601 UTC)."""

    key_hash: str
    work_ids: list[str]
    now: str


@dataclass
class WakeResult:
    """identity.wake output: items woken and the packs that own them."""

    woken: int = 0
    install_ids: list[str] = field(default_factory=list)


@dataclass
class IdentityWaitStatus:
    """``status`` query of an identity wait."""

    key_hash: str
    kind: str
    object_api_name: str
    state: str
    items: list[str]
    probes: int
    next_probe: str | None
    started_at: str
    woken: int | None = None


@dataclass
class SupervisorConfig:
    """A pack supervisor: one incarnation, N workers, and their shared knobs.

    Durations are seconds (settings, so tests can run them short).
    """

    database_id: str
    namespace: str
    install_id: str
    payload_hash: str
    fingerprint: str
    worker_count: int
    max_processing_rows: int
    queue_profile_mode: str
    drain_only: bool = False
    lease_seconds: float = 60.0
    idle_seconds: float = 5.0
    drain_timeout_seconds: float = 30.0
    restart_backoff_min_seconds: float = 1.0
    restart_backoff_max_seconds: float = 30.0
    generation: int = 0
    scheduler_owner_id: str = ""
    fencing_token: str = ""


@dataclass
class WorkerStatus:
    """One worker of a supervisor, for the ``status`` query."""

    ordinal: int
    workflow_id: str
    queue_classes: list[str]
    batch_size: int
    state: str
    restarts: int
    next_backoff_s: float


@dataclass
class SupervisorStatus:
    """``status`` query of a pack supervisor."""

    namespace: str
    install_id: str
    fingerprint: str
    draining: bool
    workers: list[WorkerStatus]


@dataclass
class DesiredPack:
    """One pack incarnation the fleet should serve, with its pool fingerprint."""

    namespace: str
    install_id: str
    payload_hash: str
    drain_only: bool
    fingerprint: str
    worker_count: int
    max_processing_rows: int
    queue_profile_mode: str
    supervisor_workflow_id: str = ""
    status: str = "active"
    generation: int = 0
    scheduler_owner_id: str = ""
    fencing_token: str = ""
    projection_fingerprint: str = ""
    degraded: str = ""


@dataclass
class FleetInput:
    """ConnectorFleetWorkflow input: reconcile timer and supervisor timings (seconds)."""

    database_id: str
    reconcile_interval_seconds: float = 5.0
    lease_seconds: float = 60.0
    idle_seconds: float = 5.0
    drain_timeout_seconds: float = 30.0
    restart_backoff_min_seconds: float = 1.0
    restart_backoff_max_seconds: float = 30.0
    reconciles_before_continue_as_new: int = 500
    running: list[DesiredPack] = field(default_factory=list)
    pools_started: int = 0
    # False for the Runtime handoff role: the runtime owns command dependencies,
    # so the fleet starts no identity-wait recovery (seed disableIdentityRecovery).
    identity_recovery: bool = True
    # Bounded wait for an in-flight reconcile when the fleet stops (the seed's 5 s).
    reconcile_stop_timeout_seconds: float = 5.0
    # Set once the startup reconcile succeeded (carried across continue-as-new).
    started: bool = False
    # The fleet's first run id: stands for the seed's host+pid in scheduler ids.
    fleet_epoch: str = ""
    blocked: dict[str, str] = field(default_factory=dict)
    degraded: dict[str, str] = field(default_factory=dict)


@dataclass
class ReconcileRequest:
    """One fleet reconcile: ``mode`` is startup | all | changed | periodic.

    ``running``: pool fingerprint per ``namespace/install id``.
    """

    database_id: str
    mode: str
    running: dict[str, str]
    fleet_epoch: str


@dataclass
class ReconcileDecision:
    """Typed outcome for one pack: start | keep | preserve | stop (see reconcile.py)."""

    key: str
    namespace: str
    install_id: str
    action: str
    reason: str = ""
    gap: str = ""
    pack: DesiredPack | None = None


@dataclass
class ReconcileOutcome:
    """Typed result of the reconcile activity (never a raised database error).

    ``fatal``: startup failed (start nothing, fail the fleet); ``stop_all``: a
    listing error under a serving selection stops every pool.
    """

    decisions: list[ReconcileDecision] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)
    degraded: dict[str, str] = field(default_factory=dict)
    error: str = ""
    fatal: bool = False
    stop_all: bool = False


@dataclass
class FleetStatus:
    """``status`` query of the fleet: running pools, blocked and degraded packs.

    ``blocked``/``degraded``: reason per ``namespace/install id``;
    ``last_error``: the last reconcile's error, if any.
    """

    pools: list[DesiredPack] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)
    degraded: dict[str, str] = field(default_factory=dict)
    last_error: str | None = None
    reconciles: int = 0
    stopping: bool = False
