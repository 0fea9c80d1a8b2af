"""Contracts of the connector inbound runtime: fleet, pack supervisors, inbound workers.

Plain dataclasses carried by Temporal's JSON payload converter: class, field
names and field order are the wire format of running workflows' histories.

No ``from __future__ import annotations``: the annotations must be real
types, not strings. Workflows decode these inside Temporal's sandbox, whose
``sys.modules`` lacks this module (``nexuscrm.contracts`` is passed through),
so string annotations could not be resolved there (``NameError`` while
decoding arguments).
"""

from dataclasses import dataclass, field

from nexuscrm.contracts.identity import BlockedWait


@dataclass
class InboundWorkerConfig:
    """One inbound worker: its pack incarnation, queue profile and budget.

    lease_seconds: how long a claim is held unless its batch extends it; idle_seconds:
    how long the worker sleeps when it found nothing (a ``wake`` cuts it short),
    doubled after each further empty claim up to idle_max_seconds;
    heartbeat_timeout_seconds: the process activity's heartbeat timeout, how
    long a dead worker's batch goes unnoticed before its leases are handed
    back (``<= 0``: ``max(5, lease_seconds / 2)``).
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
    # WorkItem claim activation (issue 5 rule 5): the pack's claim fence taken
    # when the pool started (issue 11 item 9), the same for every worker of one
    # pool, part of the pool fingerprint; every claim is fenced by it.
    generation: int = 0
    scheduler_owner_id: str = ""
    fencing_token: str = ""
    drain_only: bool = False
    heartbeat_timeout_seconds: float = 0.0
    # Under patch ``idle-backoff``: consecutive empty claims double the idle
    # timer from idle_seconds up to this (a ``wake`` or a claimed batch resets it).
    idle_max_seconds: float = 60.0
    # ... but not in a run's first idle_backoff_grace_seconds: a rebuilt pool's
    # workers keep polling while the old pool drains and hands its leases back.
    idle_backoff_grace_seconds: float = 60.0


@dataclass
class ClaimRequest:
    """claim activity input: the worker config, its lease owner id, and the claim's key.

    ``claim_key`` names this claim of the worker's run (``<owner>#<n>``); a
    claim re-run with it returns what its first run leased (see
    ``ClaimSpec.claim_key``). Blank: an unkeyed claim (histories from before it).
    """

    config: InboundWorkerConfig
    lease_owner: str
    claim_key: str = ""


@dataclass
class ClaimedLease:
    """A claimed item as the workflow sees it: id and lease token only (no payload)."""

    work_id: str
    lease_token: str


@dataclass
class ProcessRequest:
    """process activity input: the claimed leases to run.

    ``lease_owner``: the worker's lease owner id (``<workflow id>/<run id>``),
    set under patch ``process-stint``: the activity may then claim and run
    further batches under it for up to ``NEXUS_CONNECTOR_STINT_SECONDS``
    (blank: this batch only, as before).
    """

    config: InboundWorkerConfig
    leases: list[ClaimedLease]
    lease_owner: str = ""


@dataclass
class ReleaseRequest:
    """release activity input: the leases of a batch whose process activity ended
    without a result, and the ``CauseCode`` of the abandoned attempts it records.

    ``install_id`` and ``lease_owner`` (patch ``process-stint``): also every
    lease of that pack still held by the worker's owner id, i.e. the further
    batches the failed activity claimed itself (blank: the listed leases only).
    """

    leases: list[ClaimedLease]
    cause_code: str
    install_id: str = ""
    lease_owner: str = ""


@dataclass
class BatchResult:
    """Counts of one processed batch.

    blocked: items blocked on a dependency (their waits are registered after
    commit); wake_keys: key hashes of waits whose remote link this batch
    finalized (signalled ``wake`` after commit); released: items not started
    because the worker shut down, their leases handed back at once.
    """

    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    blocked: list[BlockedWait] = field(default_factory=list)
    wake_keys: list[str] = field(default_factory=list)
    released: int = 0


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
    # Carried across the supervisor's continue-as-new: which run of the pool
    # this is (part of its workers' ids) and each worker's restart count.
    incarnation: int = 0
    restarts: list[int] = field(default_factory=list)
    # The supervisor's workflow id as the fleet named it (the pool generation is part
    # of it); worker ids derive from it, from the input, so a replay names them alike.
    pool_id: str = ""
    # The workers' process heartbeat timeout (0: derived from the lease).
    heartbeat_timeout_seconds: float = 0.0
    # The workers' backed-off idle timer cap (InboundWorkerConfig.idle_max_seconds).
    idle_max_seconds: float = 60.0


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
    # The inbound workers' process heartbeat timeout: how long a dead worker's
    # batch holds its leases (0: max(5, lease_seconds / 2)).
    heartbeat_timeout_seconds: float = 0.0
    # The workers' backed-off idle timer cap (InboundWorkerConfig.idle_max_seconds);
    # the periodic reconcile wakes a stalled pool sooner (patch ``backlog-wake``).
    idle_max_seconds: float = 60.0


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
    # keep, periodic reconcile: claimable work while a worker holds no lease
    # (``queue.stalled_pack``); the fleet wakes the pool (patch ``backlog-wake``).
    stalled: bool = False


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
class PeriodicRequest:
    """One periodic fleet pass in one activity (patch ``fleet-periodic-pass``).

    ``running``: pool fingerprint per ``namespace/install id``; ``pools``: the
    pool's supervisor workflow id per the same key (their liveness is
    checked, v2); ``identity_recovery``: run identity-wait recovery first;
    ``delay_seconds``: wait this long before the pass.
    """

    database_id: str
    running: dict[str, str]
    pools: dict[str, str]
    fleet_epoch: str
    identity_recovery: bool = True
    # seconds the activity waits before the pass: the reconcile interval, so that
    # an idle pass costs one activity and one workflow task (no timer)
    delay_seconds: float = 0.0


@dataclass
class PeriodicOutcome:
    """What a periodic pass found: ``closed`` supervisor workflow ids (pools to
    forget and rebuild) and the ``plan`` over the pools still running;
    ``recovered`` waits (re)started by identity recovery, ``recovery_error`` its
    failure (logged, retried at the next pass); ``skipped``: the worker began
    shutting down during the interval and nothing ran; ``replan``: the plan
    would start or replace a pool, so it took no claim fence and ``plan`` is
    empty: the fleet plans again with fences before it starts anything."""

    closed: list[str] = field(default_factory=list)
    plan: ReconcileOutcome = field(default_factory=ReconcileOutcome)
    recovered: int = 0
    recovery_error: str = ""
    # the worker began shutting down during the interval: nothing ran
    skipped: bool = False
    # the plan would start or replace a pool: it took no claim fence and is not
    # returned; the fleet plans again with fences (connectors.reconcile_plan)
    replan: bool = False


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
