"""``NEXUSCRM_CONNECTOR_*`` env knobs, queue profiles, restart backoff and fingerprints.

Port of the connector inbound Supervisor's tuning surface (seed
``000_20f34d33fdfcfdd6.txt``, package ``connectors``):

* the constants at the top of the seed file;
* ``connectorInboundWorkersPerPackFromEnv`` -> :func:`workers_per_pack`;
* ``connectorInboundMaxProcessingRowsFromEnv`` -> :func:`max_processing_rows`
  (with ``connector_inbound.MaxProcessingRowsForWorkers``, which the seed only
  calls, decided here as :func:`max_processing_rows_for_workers`);
* ``connectorInboundQueueProfileModeFromEnv`` -> :func:`queue_profile_mode`;
* ``connectorInboundWorkerQueueProfile`` / ``connectorInboundWorkItemWorkerQueueProfile``
  -> :func:`worker_queue_profile` / :func:`work_item_worker_queue_profile`;
* ``connectorInboundStageTimingFromEnv`` -> :func:`stage_timing`;
* ``connectorFlowDeadlineFromEnv`` -> :func:`flow_deadline`;
* ``connectorInboundRestartBackoff`` -> :class:`RestartBackoff`;
* ``workerKey`` / ``workerFingerprint`` -> :func:`worker_key` / :func:`worker_fingerprint`.

Same env var names, defaults, clamps and warning wording as the seed; the
seed's ``log.Printf`` lines become structlog warnings on ``nexuscrm.log.log``
whose event is the seed's sentence, plus the values as separate fields.

This module is pure (no I/O but env reads and logging) and never imports
temporalio, so workflows can call it. Everything a workflow keeps in its
state (:class:`RestartBackoff`, :class:`ConnectorKnobs`, :class:`QueueProfile`)
is a dataclass of JSON-native fields (no ``timedelta``), because Temporal's
default JSON payload converter cannot encode ``timedelta``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from nexuscrm.log import log

# --- constants (seed: top of file) -------------------------------------------

DEFAULT_WORKER_DRAIN_TIMEOUT = timedelta(seconds=30)
"""Seed ``defaultConnectorInboundWorkerDrainTimeout``."""
DEFAULT_BACKLOG_RECONCILE_INTERVAL = timedelta(seconds=5)
"""Seed ``defaultConnectorInboundBacklogReconcileInterval``."""

DEFAULT_WORKERS_PER_PACK = 8
"""Seed ``defaultConnectorInboundWorkersPerPack``."""
SAFE_WORKERS_PER_PACK = 8
"""Seed ``safeConnectorInboundWorkersPerPack``: above it a warning is logged."""
MAX_WORKERS_PER_PACK = 128
"""Seed ``maxConnectorInboundWorkersPerPack``: hard clamp."""
MAX_PROCESSING_ROWS = 512
"""Seed ``maxConnectorInboundMaxProcessingRows``: hard clamp of the per-pack budget."""

ENV_WORKERS_PER_PACK = "NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK"
ENV_MAX_PROCESSING_ROWS = "NEXUSCRM_CONNECTOR_INBOUND_MAX_PROCESSING_ROWS"
ENV_QUEUE_PROFILE = "NEXUSCRM_CONNECTOR_INBOUND_QUEUE_PROFILE"
ENV_STAGE_TIMING = "NEXUSCRM_CONNECTOR_INBOUND_STAGE_TIMING"
ENV_FLOW_DEADLINE_MS = "NEXUSCRM_CONNECTOR_FLOW_DEADLINE_MS"
"""Per-event deadline (ms) bounding each post-claim external call (flow execution
and each heartbeated post-claim BatchRead). Unset / invalid -> 10 min; ``0`` or
negative disables; ``> 0`` is a custom bound. Independent of stale reclaim: the
heartbeat, not this deadline, keeps an alive call from being reclaimed."""

QUEUE_PROFILE_RESERVED = "reserved"
"""Seed ``connectorInboundQueueProfileReserved`` (the default mode)."""
QUEUE_PROFILE_DEFAULT_HEAVY = "default-heavy"
"""Seed ``connectorInboundQueueProfileDefaultHeavy``."""
QUEUE_PROFILE_MODES = (QUEUE_PROFILE_RESERVED, QUEUE_PROFILE_DEFAULT_HEAVY)

WORK_ITEM_FIRST_PEEK_GRACE = timedelta(minutes=2)
"""Seed ``connectorInboundWorkItemFirstPeekGrace``."""

RESTART_BACKOFF_MIN = timedelta(seconds=1)
"""Seed ``connectorInboundRestartBackoffMin``."""
RESTART_BACKOFF_MAX = timedelta(seconds=30)
"""Seed ``connectorInboundRestartBackoffMax``."""
RESTART_HEALTHY_RUN_THRESHOLD = RESTART_BACKOFF_MAX
"""Seed ``connectorInboundRestartHealthyRunThreshold``: a run that outlived the
longest backoff window was not a tight crash loop, so the next restart resets
to the minimum backoff."""

DEFAULT_FLOW_DEADLINE = timedelta(minutes=10)
"""Seed ``defaultConnectorFlowDeadline``: a protective bound above normal
connector runtimes; a hung flow must not pin its lane forever."""

# Queue classes (seed: ``connector_inbound_routing.QueueClass*``).
QUEUE_CLASS_INTERACTIVE = "interactive"
QUEUE_CLASS_DEFAULT = "default"
QUEUE_CLASS_BULK = "bulk"
QUEUE_CLASSES = (QUEUE_CLASS_INTERACTIVE, QUEUE_CLASS_DEFAULT, QUEUE_CLASS_BULK)

_LOG_PREFIX = "connector inbound supervisor: "
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# Largest millisecond count a Go time.Duration (int64 nanoseconds) can hold; the
# seed's ``time.Duration(ms) * time.Millisecond`` silently overflows beyond it.
_GO_DURATION_MAX_MS = _INT64_MAX // 1_000_000
_ATOI_RE = re.compile(r"[+-]?[0-9]+")
# unicode.IsSpace, i.e. what Go's strings.TrimSpace removes (str.strip() would
# also remove \x1c-\x1f, which Go keeps).
_GO_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_PARSE_BOOL = {
    "1": True,
    "t": True,
    "T": True,
    "TRUE": True,
    "true": True,
    "True": True,
    "0": False,
    "f": False,
    "F": False,
    "FALSE": False,
    "false": False,
    "False": False,
}


def go_trim_space(value: str) -> str:
    """``strings.TrimSpace``: strip leading/trailing Unicode white space (Go's set)."""
    return value.strip(_GO_SPACE)


def _go_quote(value: str) -> str:
    """Approximation of Go's ``%q`` for the warning messages (double-quoted, escaped)."""
    return json.dumps(value, ensure_ascii=False)


def _go_duration(value: timedelta) -> str:
    """Go's ``Duration.String()`` for whole-second durations (``10m0s``); enough for logs."""
    total = int(value.total_seconds())
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def _atoi(raw: str) -> int | None:
    """``strconv.Atoi`` on a 64-bit platform: optional sign, ASCII digits, int64 range.

    Returns ``None`` where Atoi returns an error (syntax or range), e.g. for
    ``"1_0"``, ``" 1"``, ``"1.0"`` or ``"99999999999999999999"`` (all of which
    Python's ``int()`` would treat differently).
    """
    if not _ATOI_RE.fullmatch(raw):
        return None
    value = int(raw)
    if value < _INT64_MIN or value > _INT64_MAX:
        return None
    return value


def normalize_queue_class(raw: str) -> str:
    """Lower-case and trim a queue class name; it must be one of :data:`QUEUE_CLASSES`.

    Raises ``ValueError`` naming the value (``unknown queue class 'x' ...``).
    """
    value = go_trim_space(raw).lower()
    if value not in QUEUE_CLASSES:
        raise ValueError(
            f"unknown queue class {raw!r} (expected one of {', '.join(QUEUE_CLASSES)})"
        )
    return value


# --- env knobs ----------------------------------------------------------------


def workers_per_pack(env: Mapping[str, str] = os.environ) -> int:
    """Workers started per selected pack, from ``NEXUSCRM_CONNECTOR_INBOUND_WORKERS_PER_PACK``.

    Port of ``connectorInboundWorkersPerPackFromEnv``. Unset/blank -> 8. Not an
    integer (Atoi semantics) or < 1 -> 8 with an ``invalid`` warning. > 128 ->
    128 with a ``clamping`` warning. 9..128 is kept but logs the ``unsafe high``
    warning (the processing budget, not the worker count, bounds load).
    """
    raw = go_trim_space(env.get(ENV_WORKERS_PER_PACK, ""))
    if raw == "":
        return DEFAULT_WORKERS_PER_PACK
    value = _atoi(raw)
    if value is None or value < 1:
        log.warning(
            f"{_LOG_PREFIX}invalid {ENV_WORKERS_PER_PACK}={_go_quote(raw)}; "
            f"using default {DEFAULT_WORKERS_PER_PACK}",
            env=ENV_WORKERS_PER_PACK,
            value=raw,
            default=DEFAULT_WORKERS_PER_PACK,
        )
        return DEFAULT_WORKERS_PER_PACK
    if value > MAX_WORKERS_PER_PACK:
        log.warning(
            f"{_LOG_PREFIX}{ENV_WORKERS_PER_PACK}={value} exceeds max "
            f"{MAX_WORKERS_PER_PACK}; clamping",
            env=ENV_WORKERS_PER_PACK,
            value=value,
            max=MAX_WORKERS_PER_PACK,
        )
        return MAX_WORKERS_PER_PACK
    if value > SAFE_WORKERS_PER_PACK:
        log.warning(
            f"{_LOG_PREFIX}unsafe high {ENV_WORKERS_PER_PACK}={value} exceeds conservative "
            f"default {SAFE_WORKERS_PER_PACK}; worker count is preserved for compatibility, "
            f"and processing budget remains controlled by {ENV_MAX_PROCESSING_ROWS}",
            env=ENV_WORKERS_PER_PACK,
            value=value,
            safe=SAFE_WORKERS_PER_PACK,
        )
    return value


def max_processing_rows_for_workers(worker_count: int) -> int:
    """Derived per-pack processing-row budget for ``worker_count`` workers.

    Stands in for ``connector_inbound.MaxProcessingRowsForWorkers``, which the
    seed calls but does not contain. Rule: room for ONE FULL BATCH PER WORKER
    under the default ``reserved`` queue profile, capped at
    :data:`MAX_PROCESSING_ROWS` (512); ``worker_count < 1`` counts as 1::

        sum(worker_queue_profile(n, i, "reserved").batch_size for i in range(n))

    which gives 1 -> 100, 2 -> 105, 3 -> 130, 4 -> 155, 8 -> 310, 12 -> 465,
    16 -> 620 capped to 512 (and 512 for every larger pool). It grows with the
    pool (never decreases when a worker is added).

    The budget, derived or explicit, is GLOBAL PER PACK: the seed builds one
    claim limiter per pack and hands it to all of that pack's workers, so the
    number bounds the rows all workers of the pack hold in processing together,
    not each worker's share.
    """
    # Why this rule: the only per-worker sizes the seed defines are the queue
    # profiles' batch sizes (5 latency / 100 bulk / 25 all-class, 100 for a lone
    # worker) and the only bound is 512. A derived default should not throttle a
    # default-configured pool below one batch per worker (a lone worker's batch
    # of 100 would otherwise be clipped to 25 by a flat n*25 rule), and the
    # seed's "legacy derived processing budget" warning for >8 workers says the
    # derived value is coupled to worker fan-out, so it must grow with n. The
    # reserved layout is used because it is the default mode and needs more
    # rows than default-heavy (310 vs 160 at 8 workers), so one number serves
    # both modes; 512 stays the ceiling exactly as for an explicit budget.
    n = max(1, worker_count)
    total = sum(
        worker_queue_profile(n, ordinal, QUEUE_PROFILE_RESERVED).batch_size for ordinal in range(n)
    )
    return min(MAX_PROCESSING_ROWS, total)


def max_processing_rows(worker_count: int, env: Mapping[str, str] = os.environ) -> tuple[int, bool]:
    """Per-pack processing-row budget and whether it was set explicitly.

    Port of ``connectorInboundMaxProcessingRowsFromEnv``; reads
    ``NEXUSCRM_CONNECTOR_INBOUND_MAX_PROCESSING_ROWS``. Returns ``(rows, explicit)``:

    * unset/blank -> ``(max_processing_rows_for_workers(worker_count), False)``,
      warning (``legacy derived processing budget``) when ``worker_count > 8``;
    * invalid (Atoi semantics) or < 1 -> the derived default, ``False``, warning;
    * > 512 -> ``(512, True)`` with a ``clamping`` warning;
    * else ``(value, True)``.

    The explicit budget is global per pack (one limiter shared by all the pack's
    workers; the seed passes ``explicit`` as ``GlobalProcessingBudget``); the
    derived default is a per-pack total as well (see
    :func:`max_processing_rows_for_workers`).
    """
    default_budget = max_processing_rows_for_workers(worker_count)
    raw = go_trim_space(env.get(ENV_MAX_PROCESSING_ROWS, ""))
    if raw == "":
        if worker_count > SAFE_WORKERS_PER_PACK:
            log.warning(
                f"{_LOG_PREFIX}unsafe high {ENV_WORKERS_PER_PACK}={worker_count} is using "
                f"legacy derived processing budget {default_budget}; set "
                f"{ENV_MAX_PROCESSING_ROWS} explicitly to decouple worker fan-out from "
                "processing budget",
                env=ENV_MAX_PROCESSING_ROWS,
                workers=worker_count,
                default=default_budget,
            )
        return default_budget, False
    value = _atoi(raw)
    if value is None or value < 1:
        log.warning(
            f"{_LOG_PREFIX}invalid {ENV_MAX_PROCESSING_ROWS}={_go_quote(raw)}; "
            f"using default {default_budget}",
            env=ENV_MAX_PROCESSING_ROWS,
            value=raw,
            default=default_budget,
        )
        return default_budget, False
    if value > MAX_PROCESSING_ROWS:
        log.warning(
            f"{_LOG_PREFIX}{ENV_MAX_PROCESSING_ROWS}={value} exceeds max "
            f"{MAX_PROCESSING_ROWS}; clamping",
            env=ENV_MAX_PROCESSING_ROWS,
            value=value,
            max=MAX_PROCESSING_ROWS,
        )
        return MAX_PROCESSING_ROWS, True
    return value, True


def queue_profile_mode(env: Mapping[str, str] = os.environ) -> str:
    """Queue profile mode from ``NEXUSCRM_CONNECTOR_INBOUND_QUEUE_PROFILE``.

    Port of ``connectorInboundQueueProfileModeFromEnv``: trimmed and
    lower-cased; unset/``reserved`` -> ``"reserved"``; ``default-heavy`` ->
    ``"default-heavy"``; anything else -> ``"reserved"`` with a warning.
    """
    raw = go_trim_space(env.get(ENV_QUEUE_PROFILE, "")).lower()
    if raw in ("", QUEUE_PROFILE_RESERVED):
        return QUEUE_PROFILE_RESERVED
    if raw == QUEUE_PROFILE_DEFAULT_HEAVY:
        return QUEUE_PROFILE_DEFAULT_HEAVY
    log.warning(
        f"{_LOG_PREFIX}invalid {ENV_QUEUE_PROFILE}={_go_quote(raw)}; "
        f"using {QUEUE_PROFILE_RESERVED}",
        env=ENV_QUEUE_PROFILE,
        value=raw,
        default=QUEUE_PROFILE_RESERVED,
    )
    return QUEUE_PROFILE_RESERVED


def stage_timing(env: Mapping[str, str] = os.environ) -> bool:
    """Whether per-stage timing logs are on, from ``NEXUSCRM_CONNECTOR_INBOUND_STAGE_TIMING``.

    Port of ``connectorInboundStageTimingFromEnv`` with ``strconv.ParseBool``
    semantics: ``1 t T TRUE true True`` -> on, ``0 f F FALSE false False`` ->
    off, unset -> off, anything else -> off with a warning.
    """
    raw = go_trim_space(env.get(ENV_STAGE_TIMING, ""))
    if raw == "":
        return False
    value = _PARSE_BOOL.get(raw)
    if value is None:
        log.warning(
            f"{_LOG_PREFIX}invalid {ENV_STAGE_TIMING}={_go_quote(raw)}; stage timing disabled",
            env=ENV_STAGE_TIMING,
            value=raw,
        )
        return False
    return value


def flow_deadline(env: Mapping[str, str] = os.environ) -> timedelta | None:
    """Per-event flow deadline from ``NEXUSCRM_CONNECTOR_FLOW_DEADLINE_MS``; ``None`` = disabled.

    Port of ``connectorFlowDeadlineFromEnv``: unset/blank -> 10 min; not an
    integer (Atoi semantics) -> 10 min with a warning; ``0`` or negative ->
    ``None`` (the seed's zero duration, i.e. no deadline); else that many ms.

    One deviation: a positive value above ``2**63-1`` ns (~106,751 days), which
    overflows Go's ``time.Duration`` in the seed, is treated as invalid (10 min
    with the same warning) instead of wrapping around.
    """
    raw = go_trim_space(env.get(ENV_FLOW_DEADLINE_MS, ""))
    if raw == "":
        return DEFAULT_FLOW_DEADLINE
    ms = _atoi(raw)
    if ms is None or ms > _GO_DURATION_MAX_MS:
        log.warning(
            f"{_LOG_PREFIX}invalid {ENV_FLOW_DEADLINE_MS}={_go_quote(raw)}; "
            f"using default flow deadline {_go_duration(DEFAULT_FLOW_DEADLINE)}",
            env=ENV_FLOW_DEADLINE_MS,
            value=raw,
            default_ms=int(DEFAULT_FLOW_DEADLINE.total_seconds() * 1000),
        )
        return DEFAULT_FLOW_DEADLINE
    if ms <= 0:
        return None  # explicit 0 or negative disables the deadline
    return timedelta(milliseconds=ms)


# --- queue profiles -------------------------------------------------------------


@dataclass(frozen=True)
class QueueProfile:
    """Which queue classes one worker claims from, which it prefers, and its batch size.

    Port of ``connectorInboundQueueProfile``. ``queue_classes`` empty means
    "all classes" (the seed's lone-worker profile; logged as ``all``);
    ``preferred_queue_classes`` empty means no affinity (logged as ``none``).
    """

    queue_classes: tuple[str, ...]
    preferred_queue_classes: tuple[str, ...]
    batch_size: int

    @property
    def effective_queue_classes(self) -> tuple[str, ...]:
        """``queue_classes``, or all of :data:`QUEUE_CLASSES` when it is empty."""
        return self.queue_classes or QUEUE_CLASSES

    @property
    def queue_classes_label(self) -> str:
        """Comma-joined classes, ``"all"`` when empty (the seed's worker-profile log)."""
        return ",".join(self.queue_classes) or "all"

    @property
    def preferred_queue_classes_label(self) -> str:
        """Comma-joined preferred classes, ``"none"`` when empty (the seed's log)."""
        return ",".join(self.preferred_queue_classes) or "none"


_LATENCY_CLASSES = (QUEUE_CLASS_INTERACTIVE, QUEUE_CLASS_DEFAULT)


def _check_ordinal(worker_count: int, ordinal: int) -> None:
    if not 0 <= ordinal < max(1, worker_count):
        raise ValueError(f"ordinal {ordinal} is outside 0..{max(1, worker_count) - 1}")


def worker_queue_profile(worker_count: int, ordinal: int, mode: str) -> QueueProfile:
    """Queue profile of worker ``ordinal`` (0-based) in a pool of ``worker_count``.

    Port of ``connectorInboundWorkerQueueProfile`` (same numbers). With
    ``latency = max(1, n // 4)``:

    * ``n <= 1``: all classes, batch 100;
    * ``default-heavy``: ordinals ``< latency`` take interactive+default, batch 5;
      the rest take all three classes, batch 25;
    * any other mode (``reserved``): ``bulk = max(1, n // 4)`` (shrunk to
      ``n - latency`` if needed); ordinals ``< latency`` -> interactive+default,
      batch 5; the next ``bulk`` -> bulk only, batch 100; the rest -> all three,
      batch 25.

    Raises ``ValueError`` if ``ordinal`` is outside ``0..max(1, n)-1`` (the seed
    never asks for one).
    """
    _check_ordinal(worker_count, ordinal)
    if worker_count <= 1:
        return QueueProfile((), (), 100)
    latency_workers = max(1, worker_count // 4)
    if mode == QUEUE_PROFILE_DEFAULT_HEAVY:
        if ordinal < latency_workers:
            return QueueProfile(_LATENCY_CLASSES, (), 5)
        return QueueProfile(QUEUE_CLASSES, (), 25)
    bulk_workers = max(1, worker_count // 4)
    if latency_workers + bulk_workers > worker_count:
        bulk_workers = max(0, worker_count - latency_workers)
    if ordinal < latency_workers:
        return QueueProfile(_LATENCY_CLASSES, (), 5)
    if ordinal < latency_workers + bulk_workers:
        return QueueProfile((QUEUE_CLASS_BULK,), (), 100)
    return QueueProfile(QUEUE_CLASSES, (), 25)


def work_item_worker_queue_profile(worker_count: int, ordinal: int, mode: str) -> QueueProfile:
    """:func:`worker_queue_profile` plus the WorkItem preferred-class affinity.

    Port of ``connectorInboundWorkItemWorkerQueueProfile``. Only in
    ``default-heavy`` mode, for a pool of 2+ and an all-class worker:

    * ``n == 2``: the all-class worker prefers interactive+default;
    * otherwise the last ``max(1, n // 4)`` ordinals prefer bulk (a bulk
      liveness floor) and the middle stays affinity-free. With 16 workers:
      4 latency-only, 8 affinity-free, 4 bulk-preferred.
    """
    profile = worker_queue_profile(worker_count, ordinal, mode)
    if mode != QUEUE_PROFILE_DEFAULT_HEAVY or worker_count <= 1 or len(profile.queue_classes) != 3:
        return profile
    if worker_count == 2:
        return QueueProfile(profile.queue_classes, _LATENCY_CLASSES, profile.batch_size)
    bulk_preferred_workers = max(1, worker_count // 4)
    if ordinal >= worker_count - bulk_preferred_workers:
        return QueueProfile(profile.queue_classes, (QUEUE_CLASS_BULK,), profile.batch_size)
    return profile


# --- restart backoff --------------------------------------------------------------


@dataclass
class RestartBackoff:
    """Bounded-exponential restart schedule for a worker that exited unexpectedly.

    Port of ``connectorInboundRestartBackoff`` / ``newConnectorInboundRestartBackoff``:
    starts at ``min``, doubles per crash up to ``max``, and resets to ``min``
    after a run that lasted at least ``healthy_run_threshold`` (an isolated
    crash, not a crash loop). With the defaults the waits are
    1, 2, 4, 8, 16, 30, 30, ... s.

    Durations are float seconds (not ``timedelta``) so the object round-trips
    through Temporal's JSON converter or ``dataclasses.asdict`` when a workflow
    keeps it in its state; ``current_seconds`` is the next wait (0 on
    construction means "start at min"). Constructor normalization as in the
    seed: ``min <= 0`` -> 1 s, ``max < min`` -> ``max = min``.
    """

    min_seconds: float = RESTART_BACKOFF_MIN.total_seconds()
    max_seconds: float = RESTART_BACKOFF_MAX.total_seconds()
    healthy_run_threshold_seconds: float = RESTART_HEALTHY_RUN_THRESHOLD.total_seconds()
    current_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.min_seconds <= 0:
            self.min_seconds = RESTART_BACKOFF_MIN.total_seconds()
        if self.max_seconds < self.min_seconds:
            self.max_seconds = self.min_seconds
        if self.current_seconds <= 0:
            self.current_seconds = self.min_seconds

    def next(self, ran_for: timedelta) -> timedelta:
        """Wait before the next restart given how long the exited run lasted; advances.

        A threshold ``<= 0`` disables the healthy-run reset, as in the seed.
        """
        threshold = self.healthy_run_threshold_seconds
        if threshold > 0 and ran_for.total_seconds() >= threshold:
            self.current_seconds = self.min_seconds
        sleep = self.current_seconds
        self.current_seconds = min(self.current_seconds * 2, self.max_seconds)
        return timedelta(seconds=sleep)


# --- worker identity ------------------------------------------------------------


def worker_key(namespace: str, install_id: str) -> str:
    """``<namespace>/<install id>`` (both trimmed); port of ``workerKey``."""
    return f"{go_trim_space(namespace)}/{go_trim_space(install_id)}"


def _go_bool(value: bool) -> str:
    return "true" if value else "false"


def worker_fingerprint(
    namespace: str,
    install_id: str,
    status: str,
    payload_hash: str,
    drain_only: bool,
    projection_fingerprint: str,
    worker_count: int,
    max_processing_rows: int,
    explicit_budget: bool,
    queue_profile_mode: str,
    generation: int = 0,
    scheduler_owner_id: str = "",
    fencing_token: str = "",
) -> str:
    """Fingerprint of one pack pool's configuration; a change means rebuild the pool.

    Port of ``workerFingerprint``: the seed's fields, trimmed (strings) or
    formatted as Go's ``%t`` / ``Itoa``, joined with NUL, in the seed's order::

        namespace, install_id, status, payload_hash, drain_only,
        projection_fingerprint, worker_count, max_processing_rows,
        explicit_budget, queue_profile_mode

    followed ALWAYS by ``generation``, ``scheduler_owner_id`` and
    ``fencing_token`` (trimmed): the second-pass issue asks that the claimable
    WorkItem generation, the scheduler owner id and its fencing token be part
    of the fingerprint, so a new generation or a new fence rebuilds the pool.
    Returns the sha256 hex digest (64 chars) of that string, so no raw
    identity or token appears in logs. Stage timing and the flow deadline are
    not inputs, as in the seed.
    """
    material = "\x00".join(
        [
            go_trim_space(namespace),
            go_trim_space(install_id),
            go_trim_space(status),
            go_trim_space(payload_hash),
            _go_bool(drain_only),
            go_trim_space(projection_fingerprint),
            str(worker_count),
            str(max_processing_rows),
            _go_bool(explicit_budget),
            go_trim_space(queue_profile_mode),
            str(generation),
            go_trim_space(scheduler_owner_id),
            go_trim_space(fencing_token),
        ]
    )
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


# --- bundle ---------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorKnobs:
    """All ``NEXUSCRM_CONNECTOR_*`` knobs, read once, for a supervisor to carry.

    JSON-native fields only (Temporal workflow arguments/state):
    ``flow_deadline_ms`` is ``0`` when the deadline is disabled (the seed's zero
    duration); :attr:`flow_deadline` gives it as ``timedelta | None``.
    ``max_processing_rows`` is the per-pack budget shared by all the pack's
    workers; ``explicit_processing_budget`` says it came from the env.
    """

    workers_per_pack: int = DEFAULT_WORKERS_PER_PACK
    max_processing_rows: int = max_processing_rows_for_workers(DEFAULT_WORKERS_PER_PACK)
    explicit_processing_budget: bool = False
    queue_profile_mode: str = QUEUE_PROFILE_RESERVED
    stage_timing: bool = False
    flow_deadline_ms: int = int(DEFAULT_FLOW_DEADLINE.total_seconds() * 1000)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ConnectorKnobs:
        """Read every knob through its function above (warnings logged once each)."""
        workers = workers_per_pack(env)
        rows, explicit = max_processing_rows(workers, env)
        deadline = flow_deadline(env)
        return cls(
            workers_per_pack=workers,
            max_processing_rows=rows,
            explicit_processing_budget=explicit,
            queue_profile_mode=queue_profile_mode(env),
            stage_timing=stage_timing(env),
            flow_deadline_ms=0 if deadline is None else deadline // timedelta(milliseconds=1),
        )

    @property
    def flow_deadline(self) -> timedelta | None:
        """The per-event flow deadline, ``None`` when disabled."""
        if self.flow_deadline_ms <= 0:
            return None
        return timedelta(milliseconds=self.flow_deadline_ms)

    def queue_profiles(self) -> tuple[QueueProfile, ...]:
        """:func:`work_item_worker_queue_profile` of every ordinal of the pool, in order."""
        return tuple(
            work_item_worker_queue_profile(self.workers_per_pack, ordinal, self.queue_profile_mode)
            for ordinal in range(max(1, self.workers_per_pack))
        )

    def fingerprint(
        self,
        namespace: str,
        install_id: str,
        status: str,
        payload_hash: str,
        drain_only: bool,
        projection_fingerprint: str = "",
        generation: int = 0,
        scheduler_owner_id: str = "",
        fencing_token: str = "",
    ) -> str:
        """:func:`worker_fingerprint` with this bundle's worker count, budget and mode."""
        return worker_fingerprint(
            namespace,
            install_id,
            status,
            payload_hash,
            drain_only,
            projection_fingerprint,
            self.workers_per_pack,
            self.max_processing_rows,
            self.explicit_processing_budget,
            self.queue_profile_mode,
            generation,
            scheduler_owner_id,
            fencing_token,
        )


__all__ = [
    "DEFAULT_BACKLOG_RECONCILE_INTERVAL",
    "DEFAULT_FLOW_DEADLINE",
    "DEFAULT_WORKERS_PER_PACK",
    "DEFAULT_WORKER_DRAIN_TIMEOUT",
    "ENV_FLOW_DEADLINE_MS",
    "ENV_MAX_PROCESSING_ROWS",
    "ENV_QUEUE_PROFILE",
    "ENV_STAGE_TIMING",
    "ENV_WORKERS_PER_PACK",
    "MAX_PROCESSING_ROWS",
    "MAX_WORKERS_PER_PACK",
    "QUEUE_CLASSES",
    "QUEUE_CLASS_BULK",
    "QUEUE_CLASS_DEFAULT",
    "QUEUE_CLASS_INTERACTIVE",
    "QUEUE_PROFILE_DEFAULT_HEAVY",
    "QUEUE_PROFILE_MODES",
    "QUEUE_PROFILE_RESERVED",
    "RESTART_BACKOFF_MAX",
    "RESTART_BACKOFF_MIN",
    "RESTART_HEALTHY_RUN_THRESHOLD",
    "SAFE_WORKERS_PER_PACK",
    "WORK_ITEM_FIRST_PEEK_GRACE",
    "ConnectorKnobs",
    "QueueProfile",
    "RestartBackoff",
    "flow_deadline",
    "go_trim_space",
    "max_processing_rows",
    "max_processing_rows_for_workers",
    "normalize_queue_class",
    "queue_profile_mode",
    "stage_timing",
    "work_item_worker_queue_profile",
    "worker_fingerprint",
    "worker_key",
    "workers_per_pack",
]
