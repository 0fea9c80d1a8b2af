"""Claim fences: which pool generation of a pack may claim, finish and extend its items.

Each installed pack has at most one ``_System_ConnectorClaimFence`` row: the
``Generation`` and ``FencingToken`` of the pool that owns the pack's claims
(the seed's ``WorkItemGeneration`` / ``WorkItemSchedulerFencingToken`` of the
worker config, with the scheduler owner id). A pool that starts takes the
fence (:func:`take_fence`): a pool of the fence's owner (the same fleet, which
stands for the seed's supervisor process) keeps it; another owner takes the
next generation, and from that commit on:

* a claim under any other fence is refused (:class:`FenceSuperseded`), checked
  by the claim's first read, which locks the fence row shared until the claim
  commits (the take-over locks it exclusively), so a claim and a take-over
  never interleave while the claims of one fence run side by side;
* every lease of an older fence is revoked in the take-over's transaction
  (the item is ``pending`` again, an ``abandoned`` attempt with cause
  ``fence-superseded``), so a superseded worker still running cannot keep an
  item: its finish, extension or release no longer matches (``LeaseLost``,
  nothing written), and the new pool claims the item at once;
* each claim stamps ``FencingToken`` and ``Generation`` on the items it takes,
  and every finish / extension / release is a compare-and-set on the lease
  token *and* the fencing token.

The database is fenced, not the outside world: an external call a superseded
worker has in flight at the take-over may repeat under the new pool (external
effects are at-least-once); its batch starts no further item once it sees the
fence moved (``fence_holds``, asked between items).

A pack without a fence row (nothing took one yet: pools started before
fencing, or claims outside a pool) admits only unfenced claims (generation 0);
a claim naming a generation above 0 that was never taken fails closed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, select

from nexuscrm.connectors.queue.leases import _attempt_row, _insert_attempts
from nexuscrm.connectors.queue.locking import _claim_lock_name, _serialized, _tidb
from nexuscrm.connectors.queue.vocabulary import (
    _KEY_LEN,
    OUTCOME_ABANDONED,
    STATE_PENDING,
    STATE_PROCESSING,
    _now,
    _w,
    fence_value,
)
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import dialect_name
from nexuscrm.errors import FatalError

FENCE_SUPERSEDED_CAUSE = "fence-superseded"
"""``CauseCode`` of the abandoned attempt a take-over writes for each revoked lease."""

_f = t.connector_claim_fence


class FenceSuperseded(FatalError):
    """A claim named a fence that is not the pack's current one (permanent for that worker).

    The worker belongs to a superseded pool generation (or names a generation
    never taken): it must stop; the pool that holds the current fence claims
    the pack's items. ``FatalError``: the claim activity fails non-retryable.
    """


def current_fence(
    conn: Connection, installed_pack_id: str, *, lock: bool = False
) -> tuple[int, str] | None:
    """The pack's fence ``(generation, stored fencing token)``, ``None`` when none was taken.

    ``lock`` (a claim's read): on the MySQL family the read is a locking one
    that holds until the transaction ends — a shared lock (``LOCK IN SHARE
    MODE``), so the claims of one fence run side by side while a
    :func:`take_fence` (``FOR UPDATE``) waits for the claims in flight and
    the claims after it read the new fence; on TiDB (no usable shared lock)
    ``FOR UPDATE``. SQLite: a plain read (the claim holds the write lock).
    """
    stmt = select(_f.c.Generation, _f.c.FencingToken).where(
        _f.c.InstalledPackId == installed_pack_id
    )
    if lock and dialect_name(conn) == "mysql":
        stmt = stmt.with_for_update(read=not _tidb(conn))
    row = conn.execute(stmt).first()
    return None if row is None else (int(row.Generation), row.FencingToken)


def check_claim_fence(
    conn: Connection, installed_pack_id: str, generation: int, fencing_token: str
) -> None:
    """Refuse a claim whose fence is not the pack's current one (first read of the claim).

    Reads the fence with :func:`current_fence` ``lock=True``: the claim's
    transaction keeps it, so no fence take-over commits between this check
    and the claim's own commit (the take-over's revoke then sees the claim's
    leases).

    Admitted: the pack's fence row names exactly ``generation`` and
    ``fencing_token``; or the pack has no fence row and ``generation`` is 0
    (an unfenced claim). Raises :class:`FenceSuperseded` naming both fences
    otherwise; ``ValueError`` for a negative generation.
    """
    if generation < 0:
        raise ValueError(f"claim fence generation must be >= 0, got {generation}")
    current = current_fence(conn, installed_pack_id, lock=True)
    if current is None:
        if generation == 0:
            return
        raise FenceSuperseded(
            f"work queue claim for {installed_pack_id}: fence generation {generation} "
            "was never taken (no claim fence for this pack)"
        )
    cur_gen, cur_token = current
    if cur_gen == generation and cur_token == fence_value(fencing_token):
        return
    raise FenceSuperseded(
        f"work queue claim for {installed_pack_id}: fence generation {generation} "
        f"({fencing_token!r}) is superseded by generation {cur_gen} ({cur_token!r})"
    )


def fence_holds(
    engine: Engine, installed_pack_id: str, generation: int, fencing_token: str
) -> bool:
    """True while ``(generation, fencing_token)`` may still claim the pack's items.

    Read-only; the rule of :func:`check_claim_fence`. For a batch that checks,
    between items, whether its pool was superseded (then it stops starting
    items: their leases are revoked already).
    """
    with engine.connect() as conn:
        current = current_fence(conn, installed_pack_id)
    if current is None:
        return generation == 0
    return current == (generation, fence_value(fencing_token))


def take_fence(
    engine: Engine,
    installed_pack_id: str,
    scheduler_owner_id: str,
    fencing_token: str,
    *,
    now: datetime | None = None,
) -> tuple[int, str]:
    """Take the pack's claim fence for a pool that starts; returns ``(generation, token)``.

    Under the pack's fence lock (serializing take-overs of one pack), in one
    transaction that reads the fence row ``FOR UPDATE`` (MySQL family): it
    waits for the claims in flight, which hold a shared lock on that row,
    and the claims after it read the new fence. When the current fence
    already names ``fencing_token`` (a pool of the same owner, e.g. a rebuild
    by the same fleet: its old and new pools share the fence and coordinate
    through leases, as the seed's supervisor process does), nothing is
    written and the current fence is returned. Otherwise the generation is
    the current one + 1 (1 for the first), the fence row names
    ``fencing_token``, and every lease of the pack held under another fence
    is revoked: ``State='pending'``, lease cleared, an ``abandoned`` attempt
    row with ``CauseCode='fence-superseded'`` (claimable at once; ``Attempt``
    and ``FailureCount`` unchanged, as in ``release_leases``). Parked rows
    (no lease) are left alone.

    The token returned is the stored one (``fence_value``: over 191
    characters it is shortened with its sha1), which the pool's workers claim
    with. Raises ``ValueError`` for a blank token, ``QueueLockTimeout`` when
    the fence lock is busy; database errors propagate (nothing is written).
    """
    when = _now(now)
    stored = fence_value(fencing_token)
    if stored is None:
        raise ValueError(f"claim fence for {installed_pack_id}: blank fencing token")
    with _serialized(engine, _claim_lock_name(installed_pack_id)) as conn:
        stmt = select(_f.c.Generation, _f.c.FencingToken).where(
            _f.c.InstalledPackId == installed_pack_id
        )
        if dialect_name(conn) == "mysql":
            stmt = stmt.with_for_update()
        row = conn.execute(stmt).first()
        if row is not None and row.FencingToken == stored:
            return int(row.Generation), stored
        generation = (int(row.Generation) if row is not None else 0) + 1
        values: dict[str, Any] = {
            "Generation": generation,
            "SchedulerOwnerId": scheduler_owner_id.strip()[:_KEY_LEN],
            "FencingToken": stored,
            "LastModifiedDate": when,
        }
        if row is None:
            conn.execute(
                _f.insert().values(InstalledPackId=installed_pack_id, CreatedDate=when, **values)
            )
        else:
            conn.execute(
                _f.update().where(_f.c.InstalledPackId == installed_pack_id).values(**values)
            )
        _revoke_leases(conn, installed_pack_id, stored, when)
    return generation, stored


def _revoke_leases(conn: Connection, installed_pack_id: str, keep: str, when: datetime) -> int:
    """Hand back every lease of the pack not held under ``keep``; returns how many."""
    rows = conn.execute(
        select(_w.c.WorkId, _w.c.LeaseToken, _w.c.Attempt, _w.c.EventId).where(
            _w.c.InstalledPackId == installed_pack_id,
            _w.c.State == STATE_PROCESSING,
            _w.c.LeaseToken.is_not(None),
            (_w.c.FencingToken.is_(None)) | (_w.c.FencingToken != keep),
        )
    ).all()
    revoked = []
    for r in rows:
        res = conn.execute(
            _w.update()
            .where(
                _w.c.WorkId == r.WorkId,
                _w.c.LeaseToken == r.LeaseToken,
                _w.c.State == STATE_PROCESSING,
            )
            .values(
                State=STATE_PENDING,
                LeaseOwner=None,
                LeaseToken=None,
                LeaseUntil=None,
                LastModifiedDate=when,
            )
        )
        if res.rowcount == 1:
            revoked.append(r)
    if revoked:
        _insert_attempts(
            conn,
            [
                _attempt_row(
                    r.WorkId,
                    int(r.Attempt),
                    r.EventId,
                    OUTCOME_ABANDONED,
                    when,
                    failure_class=FENCE_SUPERSEDED_CAUSE,
                    retriable=True,
                )
                for r in revoked
            ],
            ignore_existing=True,
        )
    return len(revoked)
