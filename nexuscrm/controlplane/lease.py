"""The fenced control-plane lease.

Temporal's one-workflow-id-per-database rule replaces the seed's
``GET_LOCK('nexuscrm_controlplane_apply')``; this row adds the fence the
advisory lock's keepalive gave: each control-plane workflow run takes a new
epoch first, and every mutating activity checks that epoch with a locking
read in the transaction of the write it guards, so a zombie activity of a
terminated run fails closed (``LeaseLostError``) and never writes after a
newer run took the lease.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, select, update

from nexuscrm.clock import utcnow
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import dialect_name
from nexuscrm.errors import LeaseLostError

LEASE_KEY = "controlplane"


def acquire(engine: Engine, holder: str, operation: str) -> int:
    """Take the lease for ``holder`` (a workflow run id) and return its epoch.

    Idempotent per holder: if ``holder`` already holds the current epoch (an
    activity retry), that epoch is returned unchanged; otherwise the epoch is
    incremented, fencing out every earlier holder.
    """
    with engine.begin() as conn:
        row = (
            conn.execute(
                select(t.controlplane_lease).where(t.controlplane_lease.c.LeaseKey == LEASE_KEY)
            )
            .mappings()
            .first()
        )
        if row is None:
            conn.execute(
                t.controlplane_lease.insert().values(
                    LeaseKey=LEASE_KEY,
                    Epoch=1,
                    Holder=holder,
                    Operation=operation,
                    AcquiredDate=utcnow(),
                )
            )
            return 1
        if row["Holder"] == holder:
            return int(row["Epoch"])
        epoch = int(row["Epoch"]) + 1
        # Compare-and-set on the old epoch: two racing acquirers cannot both win.
        result = conn.execute(
            t.controlplane_lease.update()
            .where(t.controlplane_lease.c.LeaseKey == LEASE_KEY)
            .where(t.controlplane_lease.c.Epoch == row["Epoch"])
            .values(Epoch=epoch, Holder=holder, Operation=operation, AcquiredDate=utcnow())
        )
        if result.rowcount != 1:
            raise LeaseLostError(f"control-plane lease changed while {holder} acquired it")
        return epoch


def require(conn: Connection, epoch: int | None) -> None:
    """Fail closed unless ``epoch`` is still the current lease epoch; hold it until commit.

    A locking read in the caller's transaction, so the check and the write it
    guards are atomic: MySQL family ``SELECT ... FOR UPDATE`` on the lease row;
    SQLite takes the database write lock first (a no-op ``UPDATE`` of the lease
    row, the effect of ``BEGIN IMMEDIATE``). A newer run's :func:`acquire`
    therefore waits until this transaction ends, and a zombie activity of a
    terminated run that checks after it is refused. Call it first in the
    transaction of each guarded write. (DDL on the MySQL family commits
    implicitly, so a check before DDL only guards up to that statement.)

    ``epoch=None`` means the caller runs outside a workflow (a direct call
    from tests or tools) and skips the fence. Raises ``LeaseLostError``.
    """
    if epoch is None:
        return
    lt = t.controlplane_lease
    query = select(lt.c.Epoch).where(lt.c.LeaseKey == LEASE_KEY)
    if dialect_name(conn) == "sqlite":
        conn.execute(update(lt).where(lt.c.LeaseKey == LEASE_KEY).values(Epoch=lt.c.Epoch))
    else:
        query = query.with_for_update()
    current = conn.execute(query).scalar_one_or_none()
    if current != epoch:
        raise LeaseLostError(
            f"control-plane lease epoch is {current}, this run holds {epoch}: "
            "a newer control-plane run owns the database; refusing to write"
        )
