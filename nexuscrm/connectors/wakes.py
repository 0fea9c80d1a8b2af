"""Wakes that cannot be lost: done by the batch, right after its own commits (issue 16).

Both halves of the race between a child blocking and its parent linking:
the parent's batch wakes the children it can see blocked right after its
links commit (:func:`wake_linked`), and a child re-reads its dependency right
after its block commits and wakes itself if the parent linked meanwhile
(:func:`wake_resolved`). Whichever commits last sees the other. Neither waits
for the notify activity, so a batch cancelled after its commit loses no wake.
"""

from __future__ import annotations

from sqlalchemy import Engine

from nexuscrm.connectors import queue
from nexuscrm.connectors.finishing import BatchOutcome
from nexuscrm.connectors.flows import RemoteIdentity
from nexuscrm.connectors.identity import Dependency, from_spec, resolved_keys
from nexuscrm.contracts import BlockedWait
from nexuscrm.db.dialect import describe_error
from nexuscrm.log import log


def wake_linked(
    engine: Engine,
    created: list[RemoteIdentity],
    outcome: BatchOutcome,
    on_woken: queue.WokenHook | None = None,
) -> None:
    """Right after links commit: their blocked children -> ``pending`` (issue 16).

    Here, not in the notify after the batch: a batch whose activity is
    cancelled or times out after this commit (a heartbeat missed under
    load) never returns its outcome, and its children would wait for a
    probe. The keys that had children go to ``wake_keys`` (the notify
    completes their waits); a wake that fails leaves them to the notify.
    ``on_woken``: see ``queue.wake_blocked_keys``.
    """
    if not created:
        return
    hashes = {
        Dependency.remote(i.owner_key, i.namespace, i.destination_object, i.remote_id).key_hash
        for i in created
    }
    keys = queue.blocked_keys(engine, sorted(hashes))
    if not keys:
        return
    outcome.wake_keys |= keys
    try:
        queue.wake_blocked_keys(engine, sorted(keys), on_woken=on_woken)
    except Exception as exc:
        log.warning("post-commit wake failed; left to the notify", err=describe_error(exc))


def wake_resolved(
    engine: Engine,
    blocked: list[BlockedWait],
    outcome: BatchOutcome,
    on_woken: queue.WokenHook | None = None,
) -> list[BlockedWait]:
    """Right after a block commits: wake the items whose dependency resolved meanwhile.

    A parent whose link committed after the item's lookup read, and whose
    batch read the blocked rows to wake before the block committed, wakes
    nobody (issue 16: the lost wakes). This re-read, after the block's own
    commit, sees that link: the items go back to ``pending`` at once (the
    worker's next claim takes them) and need no wait. Returns the items
    still blocked; a wake that fails leaves its keys to the notify.
    ``on_woken``: see ``queue.wake_blocked_keys``.
    """
    if not blocked:
        return blocked
    keys = resolved_keys(engine, [from_spec(b.dependency) for b in blocked])
    if not keys:
        return blocked
    try:
        queue.wake_blocked_keys(engine, sorted(keys), on_woken=on_woken)
    except Exception as exc:
        log.warning("post-block wake failed; left to the notify", err=describe_error(exc))
        outcome.wake_keys |= keys
    return [b for b in blocked if b.key_hash not in keys]
