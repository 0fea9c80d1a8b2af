"""The durable connector work queue: enqueue, claim, lease, finish, replay, stats.

Port of the seed's ``connector/workqueue`` WorkItem path on the
``_System_ConnectorEvent`` / ``_System_ConnectorWorkItem`` /
``_System_ConnectorWorkAttempt`` tables (SQLAlchemy 2 Core, synchronous).

Life of an item::

    enqueue ──> pending ──claim──> processing ──finish_succeeded──> succeeded
                   ^                   │  │
                   └───finish_retry────┘  └──finish_failed──> failed ──replay──> (new pending item)

``blocked`` (parked on an identity dependency) is set by :mod:`.parking`; it is
non-terminal (it holds its source lane) and never claimable. The seed's other
parked shape — ``State='processing'`` with ``DependencyKind`` set and no lease —
is treated the same way: it is neither live nor stale.

Ordering rules enforced by :func:`claim` (:mod:`.claiming`, candidates in :mod:`.scan`):

* **source lanes** (``SourceLaneKey`` = ``namespace/source_object/source_id``):
  only the head of a lane — the non-terminal item with the smallest
  ``LaneOrdinal`` — is claimable, so the events of one remote record run one
  at a time, in enqueue order;
* **target mutation lanes** (``TargetMutationLaneKey``, default: the source
  lane): only the head of a target lane is claimable too (the mutations of
  one target record run one at a time, in enqueue order, whichever source
  lane they come from), and none whose key holds a live lease;
* **processing budget**: a pack's processing rows (leased, live or stale;
  parked rows excluded) never exceed ``max_processing_rows`` through new
  claims; reclaiming a stale row re-leases a row already counted.

Ordinals and ids. One sequence, allocated under the enqueue lock (below),
numbers every enqueued event and every work item: an event gets
``EventId = 'ev-<n:016d>'`` and ``EnqueueOrdinal = n``, its first work item
``WorkId = 'wi-<n:016d>'`` and ``LaneOrdinal = n``; a replay takes a fresh
``WorkId`` but keeps the replayed item's ``LaneOrdinal``. The next ``n`` is
read from the primary-key indexes (``MAX(EventId)`` / ``MAX(WorkId)`` within
the id prefix: two index probes, O(log rows)), so no counter table is needed
and ordinals are increasing — which makes them increasing within every lane.
A replay sits at its original position in its lane (a tie with its failed
original is broken by ``WorkId``) and is refused while a later event of its
record succeeded (see :func:`replay`). Sortable work ids also give
:func:`claim` a first-in-first-out scan straight off the claim index.

Locking. MySQL family: enqueue and replay serialize on the named lock
``GET_LOCK('nexuscrm_connector_enqueue')``, taken *before* the transaction
starts, so the transaction's REPEATABLE READ snapshot includes everything the
previous holder committed. Claims take no lock across the pack: the claims
of every worker and worker process run side by side, READ COMMITTED. A claim picks its
candidates by a plain read, then locks them by primary key with ``SELECT ... FOR UPDATE
SKIP LOCKED`` (MariaDB 10.6+, MySQL 8), which skips a row another claim
holds or took since its read (a locking read sees the latest commit),
and picks past what it lost (``CLAIM_ROUNDS``). Lane exclusivity needs no
lock: only the head of a source lane *and* of a target mutation lane is
claimable, and a head stays the head until it is terminal, so two claims
can only race for the same row, which row locks and the compare-and-set
UPDATE settle. The processing budget is read once per claim (claims at
the same moment can together pass it by their batches: it bounds pressure,
not safety). Every state change is a compare-and-set on (WorkId, State,
LeaseToken): finishes and lease extensions check the rowcount, a claim
batch is one UPDATE whose winners are read back by their fresh, unique
tokens. TiDB (no SKIP LOCKED): the compare-and-set alone. SQLite: ``BEGIN
IMMEDIATE`` takes the database write lock up front, which serializes the
same sections.

Claim fences (:mod:`.fencing`): each pack's claims belong to the pool generation
that took its current fence; a claim under another fence is refused, the take-over
revokes the older fence's leases, and every claim stamps ``FencingToken`` and
``Generation``; finishes, extensions and releases compare both tokens.

Scope: source and target lanes are global (the lane key starts with the
pack's namespace; ``ix_ConnectorWorkItem_Lane`` and ``_Target`` serve the
head probes); the live-lease check of target lanes and the budget look at
the claiming pack's rows (the claim index).

Times are naive UTC ``datetime`` with whole seconds (what DATETIME stores);
a ``now`` argument, when given, is truncated to whole seconds.

Modules (import from the package: it re-exports every public name)::

    vocabulary  states, work types, outcomes, id prefixes, errors, shared helpers
    shapes      EnqueueRequest, EnqueueResult, ClaimSpec, ClaimedItem, PackQueueStats, BlockedRow
    locking     the enqueue / fence locks, claim_transaction, the SQLite writer guard,
                write_transaction
    enqueueing  enqueue (sequence ids, companion freezing, validation) and replay
    claiming    claim, claim_leases, load_claimed, load_owned
    fencing     claim fences: take_fence, check_claim_fence, fence_holds, FenceSuperseded
    scan        the claim's candidate scan (lane heads, target lanes, budget)
    leases      extend_leases, hold_leases, release_leases, finish_*, retry_backoff,
                attempt rows
    parking     identity-convergence blocks: block_item, wake_*, expire, recovery
    stats       pack_queue_stats, processing_pressure, stalled_pack
"""

from nexuscrm.connectors.queue.claiming import claim, claim_leases, load_claimed, load_owned
from nexuscrm.connectors.queue.enqueueing import enqueue, replay, superseding_items
from nexuscrm.connectors.queue.fencing import (
    FENCE_SUPERSEDED_CAUSE,
    FenceSuperseded,
    check_claim_fence,
    current_fence,
    fence_holds,
    take_fence,
)
from nexuscrm.connectors.queue.leases import (
    extend_leases,
    finish_failed,
    finish_retry,
    finish_succeeded,
    finish_succeeded_many,
    hold_leases,
    release_leases,
    retry_backoff,
)
from nexuscrm.connectors.queue.locking import (
    ENQUEUE_LOCK_NAME,
    LOCK_WAIT_SECONDS,
    write_transaction,
)
from nexuscrm.connectors.queue.parking import (
    RECOVERY_MAX_PAGES,
    RECOVERY_PAGE,
    WokenHook,
    block_item,
    blocked_key_set,
    blocked_keys,
    blocked_rows,
    convert_parked,
    expire_blocked,
    list_invalid_blocked,
    list_waitless_blocked,
    mark_wait_alive,
    mark_waits_alive,
    terminalize_invalid,
    wake_blocked,
    wake_blocked_by_pack,
    wake_blocked_keys,
)
from nexuscrm.connectors.queue.shapes import (
    BlockedRow,
    ClaimedItem,
    ClaimSpec,
    EnqueueRequest,
    EnqueueResult,
    PackQueueStats,
)
from nexuscrm.connectors.queue.stats import (
    FailedItem,
    failed_items,
    pack_queue_stats,
    processing_pressure,
    stalled_pack,
)
from nexuscrm.connectors.queue.vocabulary import (
    CLAIMABLE_WORK_TYPES,
    EVENT_ID_PREFIX,
    FAILURE_ATTEMPTS_EXHAUSTED,
    MAX_ATTEMPTS,
    NON_TERMINAL_STATES,
    OUTCOME_ABANDONED,
    OUTCOME_BLOCKED,
    OUTCOME_FAILED,
    OUTCOME_RETRY,
    OUTCOME_SUCCEEDED,
    RETRY_BACKOFF_BASE,
    RETRY_BACKOFF_CAP,
    STATE_BLOCKED,
    STATE_FAILED,
    STATE_PENDING,
    STATE_PROCESSING,
    STATE_SUCCEEDED,
    TERMINAL_STATES,
    WORK_ID_PREFIX,
    WORK_TYPE_CONNECTOR_EVENT,
    WORK_TYPE_WORKFLOW_ACTION_APPLY,
    ClaimSchemaMissing,
    IdempotencyConflict,
    InvalidWorkRequest,
    LeaseLost,
    QueueLockTimeout,
    fence_value,
    lane_key,
    normalize_queue_class,
)

__all__ = [
    "CLAIMABLE_WORK_TYPES",
    "ENQUEUE_LOCK_NAME",
    "EVENT_ID_PREFIX",
    "FAILURE_ATTEMPTS_EXHAUSTED",
    "FENCE_SUPERSEDED_CAUSE",
    "LOCK_WAIT_SECONDS",
    "MAX_ATTEMPTS",
    "NON_TERMINAL_STATES",
    "OUTCOME_ABANDONED",
    "OUTCOME_BLOCKED",
    "OUTCOME_FAILED",
    "OUTCOME_RETRY",
    "OUTCOME_SUCCEEDED",
    "RECOVERY_MAX_PAGES",
    "RECOVERY_PAGE",
    "RETRY_BACKOFF_BASE",
    "RETRY_BACKOFF_CAP",
    "STATE_BLOCKED",
    "STATE_FAILED",
    "STATE_PENDING",
    "STATE_PROCESSING",
    "STATE_SUCCEEDED",
    "TERMINAL_STATES",
    "WORK_ID_PREFIX",
    "WORK_TYPE_CONNECTOR_EVENT",
    "WORK_TYPE_WORKFLOW_ACTION_APPLY",
    "BlockedRow",
    "ClaimSchemaMissing",
    "ClaimSpec",
    "ClaimedItem",
    "EnqueueRequest",
    "EnqueueResult",
    "FailedItem",
    "FenceSuperseded",
    "IdempotencyConflict",
    "InvalidWorkRequest",
    "LeaseLost",
    "PackQueueStats",
    "QueueLockTimeout",
    "WokenHook",
    "block_item",
    "blocked_key_set",
    "blocked_keys",
    "blocked_rows",
    "check_claim_fence",
    "claim",
    "claim_leases",
    "convert_parked",
    "current_fence",
    "enqueue",
    "expire_blocked",
    "extend_leases",
    "failed_items",
    "fence_holds",
    "fence_value",
    "finish_failed",
    "finish_retry",
    "finish_succeeded",
    "finish_succeeded_many",
    "hold_leases",
    "lane_key",
    "list_invalid_blocked",
    "list_waitless_blocked",
    "load_claimed",
    "load_owned",
    "mark_wait_alive",
    "mark_waits_alive",
    "normalize_queue_class",
    "pack_queue_stats",
    "processing_pressure",
    "release_leases",
    "replay",
    "retry_backoff",
    "stalled_pack",
    "superseding_items",
    "take_fence",
    "terminalize_invalid",
    "wake_blocked",
    "wake_blocked_by_pack",
    "wake_blocked_keys",
    "write_transaction",
]
