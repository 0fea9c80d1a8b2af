"""Work-queue vocabulary: states, work types, outcomes, ids, errors, shared helpers.

Everything here is shared by the other modules of :mod:`nexuscrm.connectors.queue`.
The underscore names (table handles ``_w`` / ``_e`` / ``_a``, ``_now``,
``_truncate``, ``_parked`` ...) are internal to the package: its modules import
them from here; callers outside it use the public names the package exports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func
from sqlalchemy.sql.elements import ColumnElement

from nexuscrm.clock import utcnow
from nexuscrm.db import tables as t
from nexuscrm.errors import FatalError, NexusError

STATE_PENDING = "pending"
STATE_PROCESSING = "processing"
STATE_BLOCKED = "blocked"
STATE_SUCCEEDED = "succeeded"
STATE_FAILED = "failed"
NON_TERMINAL_STATES: tuple[str, ...] = (STATE_PENDING, STATE_PROCESSING, STATE_BLOCKED)
TERMINAL_STATES: tuple[str, ...] = (STATE_SUCCEEDED, STATE_FAILED)

WORK_TYPE_CONNECTOR_EVENT = "ConnectorEvent"
WORK_TYPE_WORKFLOW_ACTION_APPLY = "WorkflowActionApply"
CLAIMABLE_WORK_TYPES: tuple[str, ...] = (WORK_TYPE_CONNECTOR_EVENT, WORK_TYPE_WORKFLOW_ACTION_APPLY)


OUTCOME_SUCCEEDED = "succeeded"
OUTCOME_RETRY = "retry"
OUTCOME_FAILED = "failed"
OUTCOME_ABANDONED = "abandoned"
OUTCOME_BLOCKED = "blocked"

EVENT_ID_PREFIX = "ev-"
WORK_ID_PREFIX = "wi-"
_SEQ_WIDTH = 16

MAX_ATTEMPTS = 8
"""Attempts a work item gets, however each ends (finished, retried, abandoned by a
dead or failed worker, handed back), except attempts that ended ``blocked`` on an
identity dependency (their dependency's wait bounds them, by its max wait): the
processor fails a retriable error on the last one, and the claim fails an item
that has used them all (``attempts-exhausted``) instead of leasing it again. A
wake of a dependency that does not exist yet, repeated by hand, so never uses
up an item's attempts."""
FAILURE_ATTEMPTS_EXHAUSTED = "attempts-exhausted"

RETRY_BACKOFF_BASE = timedelta(seconds=1)
RETRY_BACKOFF_CAP = timedelta(minutes=5)

_KEY_LEN = t.KEY  # VARCHAR(191) lane / idempotency key columns
_SUMMARY_LIMIT = 4000
_CODE_LIMIT = 64

_w = t.connector_work_item
_e = t.connector_event
_a = t.connector_work_attempt


# --- errors -------------------------------------------------------------------


class LeaseLost(NexusError):
    """A finish or lease extension found that ``work_id``'s lease token changed.

    Another worker reclaimed the item after this worker's lease went stale (or
    the item was finished already); the caller must discard its result and
    roll back its own writes of the same transaction.
    """

    def __init__(self, work_id: str) -> None:
        super().__init__(f"work item {work_id}: lease lost (token no longer matches)")
        self.work_id = work_id


class InvalidWorkRequest(FatalError, ValueError):
    """An enqueue request is malformed (empty key, unserializable payload ...)."""


class IdempotencyConflict(InvalidWorkRequest):
    """An idempotency key is reused with other content than its stored event.

    One key is one event: enqueuing a key again is a no-op only when the event
    is the same (kind, route version, source object and id, namespace,
    payload). Otherwise the new event would be dropped unseen as a duplicate,
    so :func:`~nexuscrm.connectors.queue.enqueueing.enqueue` refuses it.
    ``conflicts`` lists one line per key; ``inserted`` counts the events that
    earlier batches of the same call committed before a concurrent writer's
    event was found (0 when the check before writing found it).
    """

    def __init__(self, message: str, conflicts: list[str], inserted: int = 0) -> None:
        super().__init__(message)
        self.conflicts = conflicts
        self.inserted = inserted


class QueueLockTimeout(NexusError, TimeoutError):
    """A queue lock (enqueue or per-pack claim) was not granted in time.

    Subclasses ``TimeoutError``, so ``nexuscrm.db.dialect.is_transient`` treats
    it as retryable.
    """


class ClaimSchemaMissing(FatalError):
    """The claim found a table or column of the work queue missing (permanent).

    A schema error repeats identically on every retry, so it is a
    ``FatalError``: the claim activity fails at once, non-retryable, naming
    the driver's message (the seed's ``workItemClaimSchemaMissing``; detected
    with ``nexuscrm.cutover.schema_missing``). Run ``nexusctl migrate``.
    """


# --- small helpers ------------------------------------------------------------


def _now(now: datetime | None) -> datetime:
    """``now`` (or the clock) as naive UTC with whole seconds."""
    value = utcnow() if now is None else now
    if value.tzinfo is not None:
        raise ValueError("now must be a naive UTC datetime")
    return value.replace(microsecond=0)


def _lease_until(now: datetime, lease_seconds: float) -> datetime:
    if lease_seconds <= 0:
        raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
    return (now + timedelta(seconds=lease_seconds)).replace(microsecond=0)


def normalize_queue_class(raw: str) -> str:
    """Trimmed, lower-cased queue class (``''`` for a blank one)."""
    return raw.strip().lower()


def _normalize_classes(raw: Sequence[str]) -> list[str]:
    """Normalized, de-duplicated, blanks dropped, order kept."""
    out: list[str] = []
    for value in raw:
        qc = normalize_queue_class(value)
        if qc and qc not in out:
            out.append(qc)
    return out


def lane_key(namespace: str, object_name: str, record_id: str) -> str:
    """``namespace/object/id``; longer than 191 characters -> 150-char prefix + ``#sha1``.

    Deterministic, so every enqueue of one remote record lands in one lane.
    """
    raw = f"{namespace}/{object_name}/{record_id}"
    if len(raw) <= _KEY_LEN:
        return raw
    digest = hashlib.sha1(raw.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"{raw[:150]}#{digest}"


def _seq_id(prefix: str, n: int) -> str:
    return f"{prefix}{n:0{_SEQ_WIDTH}d}"


def _parse_seq(prefix: str, value: str | None) -> int:
    if not value or not value.startswith(prefix):
        return 0
    digits = value[len(prefix) : len(prefix) + _SEQ_WIDTH]
    return int(digits) if digits.isdigit() else 0


def _truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def fence_value(token: str) -> str | None:
    """``token`` as stored in ``FencingToken`` (``None`` for a blank one).

    Tokens longer than the 191-character column keep a 150-character prefix
    plus ``#`` and the sha1 of the whole token (deterministic, like lane keys).
    """
    token = token.strip()
    if not token:
        return None
    if len(token) <= _KEY_LEN:
        return token
    digest = hashlib.sha1(token.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"{token[:150]}#{digest}"


def _parked(w: Any) -> ColumnElement[bool]:
    """The seed's parked-processing shape: a dependency and no lease at all."""
    return and_(
        w.c.DependencyKind.is_not(None),
        w.c.LeaseOwner.is_(None),
        w.c.LeaseToken.is_(None),
        w.c.LeaseUntil.is_(None),
    )


def _in_processing(w: Any, sqlite: bool) -> ColumnElement[bool]:
    """``w.State = 'processing'``, marked rare for SQLite's planner.

    Few rows are ``processing`` (the processing budget bounds them), but an
    ``ANALYZE`` taken while every row of a pack was pending records one state
    per pack, and SQLite then reads the whole table instead of the claim index
    (27 ms against 0.2 ms per claim at 100,000 queued,
    ``bench/bench_claim_depth.py --sqlite --sqlite-analyze``). ``unlikely()``
    keeps the index whatever the statistics say; MySQL gets the plain term.
    """
    term: ColumnElement[bool] = w.c.State == STATE_PROCESSING
    # No Boolean type on the function: SQLAlchemy would compare it "= 1",
    # which hides the term from the planner again.
    return func.unlikely(term) if sqlite else term


def _case(cond: ColumnElement[bool]) -> Any:
    return case((cond, 1), else_=0)
