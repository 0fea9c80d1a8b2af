"""Contracts of the control-plane queue: the per-database entity workflow
``ControlPlane`` (id ``controlplane/<database id>``) and ``RemovePack``.

A caller sends a :class:`ControlPlaneRequest` by the ``submit`` update and
gets a :class:`ControlPlaneTicket`; the ``status`` query returns a
:class:`ControlPlaneQueueStatus`. Plain dataclasses carried by Temporal's JSON
payload converter: class, field names and field order are the wire format of
running workflows' histories (new fields only at the end, with defaults).

No ``from __future__ import annotations`` (see ``contracts/controlplane.py``).
"""

import dataclasses
import json
import math
from dataclasses import dataclass, field

from nexuscrm.contracts.controlplane import ApplyAllInput, OperationInput

MAX_QUEUE_WAIT_SECONDS = 604_800.0
"""Longest a request may wait for its turn (7 days, in seconds); above 0 and at
most this, finite (``NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS`` and a request's
``wait_seconds`` alike)."""


def queue_wait_problem(seconds: object) -> str | None:
    """Why ``seconds`` is not a usable ``wait_seconds`` of a request (``None``: it is).

    A finite number above 0 and at most :data:`MAX_QUEUE_WAIT_SECONDS`; a
    huge one (``1e300``) cannot be added to a date, NaN or a negative never
    waits.
    """
    ok = (
        isinstance(seconds, int | float)
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and 0 < seconds <= MAX_QUEUE_WAIT_SECONDS
    )
    if ok:
        return None
    return (
        f"wait_seconds {seconds!r} must be a finite number of seconds above 0 "
        f"and at most {MAX_QUEUE_WAIT_SECONDS:,.0f}"
    )


def bounded_queue_wait(seconds: float) -> float:
    """``seconds`` clamped into ``[1, MAX_QUEUE_WAIT_SECONDS]`` (NaN: the bound).

    For a request already accepted (a history recorded before the update's
    validator refused such values): its deadline is computed from this, so
    it never overflows a date.
    """
    if not isinstance(seconds, int | float) or math.isnan(seconds):
        return MAX_QUEUE_WAIT_SECONDS
    return min(max(float(seconds), 1.0), MAX_QUEUE_WAIT_SECONDS)


MAX_REQUEST_CHARS = 16_384
"""Largest ``submit`` request, in characters of JSON. The entity keeps every
request in its queue, its last 50 in ``recent``, all of them in its status and
its continue-as-new input (the server refuses a payload over 2 MB); a real
request is a few hundred characters."""


def request_size_problem(req: "ControlPlaneRequest") -> str | None:
    """Why ``req`` is too large to queue (``None``: it is not), naming its largest field."""
    sizes = {
        name: len(json.dumps(value, default=str)) for name, value in dataclasses.asdict(req).items()
    }
    total = len(json.dumps(dataclasses.asdict(req), default=str))
    if total <= MAX_REQUEST_CHARS:
        return None
    largest = max(sizes, key=lambda name: sizes[name])
    return (
        f"request is {total:,} characters of JSON ({largest} {sizes[largest]:,}); "
        f"at most {MAX_REQUEST_CHARS:,}"
    )


# Workflow types the entity runs as children (the operation of a request).
QUEUED_OPERATIONS = (
    "ApplyAll",
    "RunRepair",
    "RebuildDerived",
    "EnsureIndexes",
    "ApplyPacks",
    "InitL0",
    "ApplySourceConvergence",
    "RemovePack",
)


@dataclass
class RemovePackInput:
    """Start arguments of ``RemovePack``: the installed app/connector pack to retire."""

    name: str = ""
    heartbeat_timeout_seconds: float = 30.0


@dataclass
class RemovePackRequest:
    """Input of the ``controlplane.remove_pack`` activity: run id, lease epoch, pack name."""

    run_id: str
    epoch: int
    name: str


@dataclass
class ControlPlaneRequest:
    """One control-plane operation asked of the entity (``submit`` update).

    operation: a workflow type of ``QUEUED_OPERATIONS``.
    apply_all / operation_input / remove_pack: the child's start argument
      (the one matching ``operation``; the others ``None``).
    no_queue: refuse at once (update rejected) when anything runs or is queued.
    coalesce: join an identical request (same operation, policy and input)
      that is queued or running instead of queueing another; always on for an
      ``auto_start`` ApplyAll. Never joins another operation type.
    wait_seconds: how long the request may wait for its turn; past it, a
      queued request is dropped (state ``expired``) and never runs.
    requester: free text shown by ``status`` (host, pid).
    """

    operation: str
    apply_all: ApplyAllInput | None = None
    operation_input: OperationInput | None = None
    remove_pack: RemovePackInput | None = None
    no_queue: bool = False
    coalesce: bool = False
    wait_seconds: float = 600.0
    requester: str = ""


@dataclass
class QueueEntry:
    """One operation of the queue, as ``status`` shows it.

    request_id: the entity's id for it; workflow_id: its child workflow id,
      ``controlplane/<database id>/<operation>/<request id>`` (fixed when it is
      queued, so a caller can watch it once it runs).
    state: queued | starting (its child is being started) | running | completed |
      failed | expired.
    waiters: requests answered by this entry (coalesced requests add one).
    enqueued_at / deadline / started_at / finished_at: ISO-8601 UTC (workflow time);
      deadline: when a still-queued entry is dropped.
    outcome: the child's result status and reason, or its error.
    """

    request_id: str
    workflow_id: str
    operation: str
    request: ControlPlaneRequest
    state: str = "queued"
    waiters: int = 1
    enqueued_at: str = ""
    deadline: str = ""
    started_at: str = ""
    finished_at: str = ""
    outcome: str = ""


@dataclass
class ControlPlaneTicket:
    """The ``submit`` update's answer.

    entry: the entry that will answer the request (a coalesced request gets
      the entry it joined); coalesced: it joined one; position: 0 when
      running, else 1-based place in the queue; ahead: what runs before it.
    """

    entry: QueueEntry
    coalesced: bool = False
    position: int = 0
    ahead: list[str] = field(default_factory=list)


def place(
    entry: QueueEntry, running: QueueEntry | None, queued: list[QueueEntry]
) -> tuple[int, list[str]]:
    """Where ``entry`` stands: ``(position, ahead)`` of a :class:`ControlPlaneTicket`,
    ``position`` 0 unless it waits in ``queued`` (then 1-based), ``ahead`` the
    ``running`` entry (when it is another) and the entries queued before it, each
    ``"<operation> <workflow id> (running|queued)"``."""
    ahead = (
        [f"{running.operation} {running.workflow_id} (running)"]
        if running is not None and running is not entry
        else []
    )
    if entry not in queued:
        return 0, ahead
    position = queued.index(entry) + 1
    return position, ahead + [
        f"{e.operation} {e.workflow_id} (queued)" for e in queued[: position - 1]
    ]


@dataclass
class ControlPlaneQueueStatus:
    """The ``status`` query: what runs, what waits (in order), the last finished entries."""

    database_id: str
    running: QueueEntry | None = None
    queued: list[QueueEntry] = field(default_factory=list)
    recent: list[QueueEntry] = field(default_factory=list)


@dataclass
class ControlPlaneEntityInput:
    """Start (and continue-as-new) arguments of the ``ControlPlane`` entity.

    queued / recent: carried across continue-as-new; continue_as_new_after:
    history events after which the entity continues as new between two
    operations (0: only when the server suggests it).
    """

    database_id: str
    queued: list[QueueEntry] = field(default_factory=list)
    recent: list[QueueEntry] = field(default_factory=list)
    continue_as_new_after: int = 0
