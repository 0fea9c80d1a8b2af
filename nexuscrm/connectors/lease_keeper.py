"""Keep the leases of a batch in hand alive while its process works on it.

The seed's lease heartbeat: while a batch is being processed (its items'
flows run, its external calls wait for an answer), its leases are extended
every third of the lease, whatever an item or a call takes, so no stale
reclaim takes an item whose call is still running (which would run the call
twice, and let a second item of its target record run beside it). The
flow deadline, not the lease, bounds a call (``knobs.flow_deadline``); the
caller stops ticking when the batch stops making progress for longer than
that, or returns.

:class:`LeaseKeeper` is the tick (one transaction); the thread that calls it
belongs to the caller (``activities.common.keep_alive``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Engine

from nexuscrm.connectors import queue


class LeaseKeeper:
    """Extends the leases of one batch, ``(work_id, lease_token)`` pairs, until they end.

    ``lease_seconds`` is the lease length each :meth:`tick` renews (the
    claim's). A lease that :meth:`tick` finds lost (finished: its token was
    cleared; handed back; reclaimed after it expired) is dropped and never
    extended again, so ticks cost nothing once the batch is done. Leases are
    extended in ``WorkId`` order, the order the batch's own transactions lock
    the rows in (``queue.hold_leases``), so a tick that meets a finishing
    chunk waits for it instead of deadlocking with it (MySQL family).

    Raises ``ValueError`` for a non-positive ``lease_seconds``. Thread-safe:
    ticks may come from any thread, one at a time.
    """

    def __init__(
        self,
        engine: Engine,
        leases: Sequence[tuple[str, str]],
        lease_seconds: float,
        fencing_token: str | None = None,
    ) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"lease keeper: lease_seconds must be positive, got {lease_seconds!r}")
        self.engine = engine
        self.fencing_token = fencing_token
        self.lease_seconds = float(lease_seconds)
        self._held = sorted(dict(leases).items())
        self._lock = threading.Lock()

    def add(self, leases: Sequence[tuple[str, str]]) -> None:
        """Extend ``leases`` too from the next :meth:`tick` on (a further batch the
        same process activity claimed); kept in ``WorkId`` order."""
        with self._lock:
            self._held = sorted({**dict(self._held), **dict(leases)}.items())

    @property
    def every_seconds(self) -> float:
        """Seconds between two ticks: a third of the lease (two may fail before it expires)."""
        return self.lease_seconds / 3

    @property
    def held(self) -> list[str]:
        """Work ids whose lease the keeper still extends, in ``WorkId`` order."""
        with self._lock:
            return [work_id for work_id, _token in self._held]

    def tick(self, now: datetime | None = None) -> list[str]:
        """Push every held lease to ``now + lease_seconds``; returns the work ids lost now.

        One transaction (``queue.extend_leases``). A database error propagates
        (the leases stay held: the next tick tries again).
        """
        with self._lock:
            if not self._held:
                return []
            lost = queue.extend_leases(
                self.engine, self._held, self.lease_seconds, now, fencing_token=self.fencing_token
            )
            if lost:
                gone = set(lost)
                self._held = [(w, t) for w, t in self._held if w not in gone]
            return lost
