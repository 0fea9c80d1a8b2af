"""The end of a connector-pack incarnation: retire it once drained, fail what a removal strands.

An upgrade that changes a connector pack's payload gives the pack a new
incarnation (``PackInstallId``) and keeps the replaced one as ``draining``
(``_System_ConnectorPackIncarnation``, written by ApplyAll's apply-packs).
The fleet serves a draining incarnation with a drain-only pool, through the
routes and callout profiles of its own payload, while it has non-terminal
work items (seed: drain-only generations, ``resolveDrainEligible``); once its
queue is empty the reconcile stops the pool and :func:`retire_drained` marks
the incarnation ``retired`` (a replayed item reopens it, :func:`reopen_retired`).

``packs remove`` marks the pack (and its draining incarnations) ``removed``.
A removed pack gets no credential and no pool (seed:
``ErrConnectorPackInactive``), so its queued items could never run: they are
failed with class :data:`FAILURE_PACK_REMOVED` by :func:`fail_removed_items`
(never left pending, never ``route-not-found``). ``nexusctl packs remove``
runs it right after the removal, and every fleet reconcile runs it again, so
an interrupted removal strands nothing. A worker that prepares an item of the
removed incarnation before a sweep reached it (its cached routes were dropped
meanwhile) fails it with the same class (``routes.PackRemovedError``). A
failed item can be replayed.
"""

from __future__ import annotations

from sqlalchemy import Engine, and_, select, update

from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue
from nexuscrm.connectors.routes import FAILURE_PACK_REMOVED as FAILURE_PACK_REMOVED
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.log import log
from nexuscrm.packs.model import Category

INCARNATION_DRAINING = "draining"
INCARNATION_RETIRED = "retired"
INCARNATION_REMOVED = "removed"


def removed_install_ids(engine: Engine) -> dict[str, str]:
    """``{install id: pack name}`` of every removed connector-pack incarnation.

    The current row of a removed pack (``_System_InstalledPack.Status =
    'removed'``) and earlier incarnations recorded ``removed``.
    """
    present = table_names(engine)
    if t.installed_pack.name not in present:
        return {}
    ip, inc = t.installed_pack, t.connector_pack_incarnation
    with engine.connect() as conn:
        out = {
            r.PackInstallId: r.Name
            for r in conn.execute(
                select(ip.c.PackInstallId, ip.c.Name).where(
                    ip.c.Category == Category.ConnectorPack.value,
                    ip.c.Status == "removed",
                    ip.c.PackInstallId != "",
                )
            )
        }
        if inc.name in present:
            for r in conn.execute(
                select(inc.c.PackInstallId, inc.c.Name).where(inc.c.Status == INCARNATION_REMOVED)
            ):
                out[r.PackInstallId] = r.Name
    return out


def fail_removed_items(engine: Engine) -> int:
    """Fail every non-terminal work item of a removed connector-pack incarnation.

    ``pending``, ``blocked`` and ``processing`` items alike become ``failed``
    with class ``pack-removed`` and a summary naming the pack and incarnation
    (``TerminalAt`` set, lease cleared, ``FailureCount`` + 1), in one UPDATE
    per incarnation. A worker still holding the lease of such an item loses
    it: its finish is a compare-and-set on the lease token, so nothing it was
    about to commit is written. Returns how many items were failed (0 when
    nothing is removed or nothing was queued).
    """
    removed = removed_install_ids(engine)
    if not removed:
        return 0
    w = t.connector_work_item
    failed = 0
    now = utcnow().replace(microsecond=0)
    with engine.begin() as conn:
        for install_id, name in sorted(removed.items()):
            res = conn.execute(
                update(w)
                .where(w.c.InstalledPackId == install_id, w.c.State.in_(queue.NON_TERMINAL_STATES))
                .values(
                    State=queue.STATE_FAILED,
                    TerminalAt=now,
                    FailureCount=w.c.FailureCount + 1,
                    LastFailureAt=now,
                    FailureClass=FAILURE_PACK_REMOVED,
                    FailureSummary=(
                        f"connector pack {name} incarnation {install_id} was removed "
                        "before this item ran"
                    ),
                    LeaseOwner=None,
                    LeaseToken=None,
                    LeaseUntil=None,
                    LastModifiedDate=now,
                )
            )
            failed += int(res.rowcount or 0)
    if failed:
        log.warning(
            "work items of removed connector packs failed",
            items=failed,
            failure_class=FAILURE_PACK_REMOVED,
        )
    return failed


def retire_drained(engine: Engine, install_id: str) -> bool:
    """Mark a draining earlier incarnation ``retired`` once it has no non-terminal item.

    One compare-and-set UPDATE (``Status='draining'`` and no ``pending`` /
    ``processing`` / ``blocked`` item of that ``InstalledPackId``), so an
    incarnation that still has work is never retired. True when it was
    retired now. A pack's current ``_System_InstalledPack`` row is never
    touched here.
    """
    inc, w = t.connector_pack_incarnation, t.connector_work_item
    if inc.name not in table_names(engine):
        return False
    pending = (
        select(w.c.WorkId)
        .where(and_(w.c.InstalledPackId == install_id, w.c.State.in_(queue.NON_TERMINAL_STATES)))
        .exists()
    )
    now = utcnow().replace(microsecond=0)
    with engine.begin() as conn:
        res = conn.execute(
            update(inc)
            .where(
                inc.c.PackInstallId == install_id,
                inc.c.Status == INCARNATION_DRAINING,
                ~pending,
            )
            .values(Status=INCARNATION_RETIRED, RetiredDate=now, LastModifiedDate=now)
        )
    done = bool(res.rowcount)
    if done:
        log.info("drained connector pack incarnation retired", install_id=install_id)
    return done


def reopen_retired(engine: Engine) -> int:
    """Set retired incarnations that have non-terminal items back to ``draining``.

    A failed item of a retired incarnation can be replayed (``events replay``):
    the new item belongs to the same incarnation and must run through its
    routes, so the incarnation drains again (and is retired again once
    empty). One UPDATE; returns how many incarnations were reopened.
    """
    inc, w = t.connector_pack_incarnation, t.connector_work_item
    if inc.name not in table_names(engine):
        return 0
    queued = (
        select(w.c.WorkId)
        .where(
            and_(
                w.c.InstalledPackId == inc.c.PackInstallId,
                w.c.State.in_(queue.NON_TERMINAL_STATES),
            )
        )
        .exists()
    )
    with engine.connect() as conn:  # nearly always none: no write transaction then
        if (
            conn.execute(
                select(inc.c.PackInstallId)
                .where(inc.c.Status == INCARNATION_RETIRED, queued)
                .limit(1)
            ).first()
            is None
        ):
            return 0
    now = utcnow().replace(microsecond=0)
    with engine.begin() as conn:
        res = conn.execute(
            update(inc)
            .where(inc.c.Status == INCARNATION_RETIRED, queued)
            .values(Status=INCARNATION_DRAINING, RetiredDate=None, LastModifiedDate=now)
        )
    reopened = int(res.rowcount or 0)
    if reopened:
        log.info("retired connector pack incarnations drain again", incarnations=reopened)
    return reopened


def settle(engine: Engine) -> None:
    """Every reconcile, before listing: :func:`fail_removed_items`, then :func:`reopen_retired`."""
    fail_removed_items(engine)
    reopen_retired(engine)
