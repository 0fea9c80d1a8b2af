"""Data shapes of the work queue: requests, results, claimed items, stats, blocked rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nexuscrm.connectors.identity import Dependency
from nexuscrm.connectors.queue.vocabulary import MAX_ATTEMPTS


@dataclass
class EnqueueRequest:
    """One inbound connector event to enqueue.

    ``idempotency_key`` is unique per ``installed_pack_id``: enqueuing the same
    key again is a no-op. ``payload`` must be JSON-serializable. The source lane
    is ``namespace/source_object/source_id``; the target mutation lane is
    ``namespace/target_object/target_remote_id`` when both are given, else the
    source lane. ``queue_class`` is stored trimmed and lower-cased.
    """

    installed_pack_id: str
    namespace: str
    event_kind: str
    idempotency_key: str
    source_object: str
    source_id: str
    payload: dict[str, Any]
    route_version: int = 1
    queue_class: str = "default"
    target_object: str | None = None
    target_remote_id: str | None = None
    companion_pack_install_id: str | None = None
    """Frozen companion AppPack incarnation of a cross-pack event. ``None``:
    frozen by :func:`enqueue` from the route's ``companion_pack`` (the active
    AppPack of that name now, ``''`` when none is active: the event then
    fails its companion check); a string: recorded as given."""


@dataclass
class EnqueueResult:
    """What :func:`enqueue` did.

    ``work_ids`` is parallel to the requests: the new item's id, or for a
    duplicate the id of the event's current work item (the newest replay, if
    the event was replayed; ``''`` for an event some other writer stored
    without a work item).
    """

    inserted: int
    duplicates: int
    work_ids: list[str]


@dataclass
class ClaimedItem:
    """A work item leased to one worker, with its event.

    ``attempt`` is this attempt's number (1 for the first claim);
    ``lease_token`` fences every finish; ``lease_until`` is naive UTC.
    """

    work_id: str
    event_id: str
    installed_pack_id: str
    namespace: str
    event_kind: str
    route_version: int
    queue_class: str
    source_object: str
    source_id: str
    payload: dict[str, Any]
    attempt: int
    lease_owner: str
    lease_token: str
    lease_until: datetime
    source_lane_key: str
    target_mutation_lane_key: str
    replay_of_work_id: str | None
    companion_pack_install_id: str | None = None
    """The event's frozen companion AppPack incarnation (``None``: not cross-pack
    at enqueue; ``''``: cross-pack, but no companion was active then)."""
    lane_ordinal: int = 0
    """The item's position in its source lane (``LaneOrdinal``; a replay keeps
    the replayed item's)."""
    fencing_token: str | None = None
    """The claim fence the item is held under (its ``FencingToken``; ``None``:
    an unfenced claim). Every finish, extension and release compares it."""
    generation: int = 0
    """The fence generation of the claim (its ``Generation``)."""
    blocked_attempts: int = 0
    """Earlier attempts of the item that ended ``blocked`` on an identity
    dependency (attempt rows); they do not count toward ``MAX_ATTEMPTS``."""

    @property
    def budget_attempt(self) -> int:
        """This attempt's number among those that count toward ``MAX_ATTEMPTS``:
        ``attempt`` less the earlier attempts that ended ``blocked`` (a wake of a
        dependency that is still missing runs the item, which blocks again)."""
        return self.attempt - self.blocked_attempts


@dataclass(frozen=True)
class ClaimSpec:
    """What one :func:`~nexuscrm.connectors.queue.claim` asks for.

    ``installed_pack_id``: the pack whose items are claimed (claims of one
    pack serialize on its claim lock). ``queue_classes``: the classes to claim
    from (normalized like ``normalize_queue_class``; empty = every class).
    ``batch_size``: at most this many items (``<= 0``: the claim takes
    nothing). ``lease_owner``: recorded as each item's ``LeaseOwner``.
    ``lease_seconds``: lease length in seconds (must be positive: the claim
    raises ``ValueError`` otherwise). ``max_processing_rows``: the pack's
    processing budget, the most processing rows new claims may bring it to
    (``<= 0``: the claim takes nothing). ``preferred_queue_classes``: taken
    first, in this order. ``now``: naive UTC (``None``: the clock),
    truncated to whole seconds by the claim. ``max_attempts``: an item that
    has used this many attempts (however they ended) is failed
    ``attempts-exhausted`` by the claim instead of leased again. ``generation`` and
    ``fencing_token``: the claimer's pool fence (the worker config's); the
    claim is refused unless it is the pack's current fence (0 and blank:
    unfenced, admitted only while the pack has no fence; see
    :mod:`nexuscrm.connectors.queue.fencing`), and stamps both on the items.
    ``claim_key``: names one logical claim (blank: none). Its lease tokens are
    derived from the key and the work id, so the claim run again with the same
    key and owner (a worker died after it committed and before its result was
    recorded, and the workflow re-ran it) returns the items it leased, whose
    leases are still live, instead of leaving them to expire (only
    :func:`~nexuscrm.connectors.queue.claiming.claim_leases`).

    Immutable: the two class lists are stored as tuples. Nothing is checked
    here; the claim validates, so a bad spec fails where it is used.
    """

    installed_pack_id: str
    queue_classes: Sequence[str]
    batch_size: int
    lease_owner: str
    lease_seconds: float
    max_processing_rows: int
    preferred_queue_classes: Sequence[str] = ()
    now: datetime | None = None
    max_attempts: int = MAX_ATTEMPTS
    generation: int = 0
    fencing_token: str = ""
    claim_key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "queue_classes", tuple(self.queue_classes))
        object.__setattr__(self, "preferred_queue_classes", tuple(self.preferred_queue_classes))


@dataclass
class PackQueueStats:
    """Queue numbers of one installed pack.

    ``counts`` maps ``(state, queue_class)`` to a number of work items;
    ``oldest_pending_age_s`` is the age in seconds of the oldest pending item
    (by ``CreatedDate``), ``None`` when nothing is pending;
    ``failures_by_class`` counts terminal ``failed`` items by ``FailureClass``
    (``'unknown'`` when unset).
    """

    installed_pack_id: str
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_pending_age_s: float | None = None
    failures_by_class: dict[str, int] = field(default_factory=dict)

    def by_state(self) -> dict[str, int]:
        """Counts summed over queue classes, keyed by state."""
        out: dict[str, int] = {}
        for (state, _qc), n in self.counts.items():
            out[state] = out.get(state, 0) + n
        return out


@dataclass
class BlockedRow:
    """A ``blocked`` item: its dependency (``None`` when its columns are incomplete)."""

    work_id: str
    installed_pack_id: str
    key_hash: str | None
    blocked_at: datetime | None
    probe_after: datetime | None
    dependency: Dependency | None
