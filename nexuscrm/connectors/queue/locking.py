"""Queue locking: the enqueue lock, the fence lock, the claim transaction, the SQLite writer guard.

MySQL family: enqueue and replay serialize on the named lock
:data:`ENQUEUE_LOCK_NAME`, fence take-overs of one pack on a per-pack named
lock (:func:`_claim_lock_name`), each scoped to the database
(:func:`server_lock_name`: named locks are server-wide) and taken before its
transaction starts (see :func:`_serialized`). Claims take no named lock
(:func:`claim_transaction`): they run side by side and rely on row locks
(``SKIP LOCKED``) and compare-and-set updates. SQLite: ``BEGIN IMMEDIATE``
plus an in-process writer lock per database file (:func:`_sqlite_writer`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from nexuscrm.connectors.queue.vocabulary import QueueLockTimeout
from nexuscrm.db.dialect import dialect_name
from nexuscrm.db.engine import SQLITE_BUSY_TIMEOUT_MS

ENQUEUE_LOCK_NAME = "nexuscrm_connector_enqueue"
LOCK_WAIT_SECONDS = 10
"""Longest wait for a queue lock (``GET_LOCK`` on the MySQL family), in seconds.

Clearly shorter than the claim local activity's 30 s start-to-close
(``workflows.inbound_worker``): a claim that waits out the lock still has
time to fail with :class:`QueueLockTimeout` (transient, retried with backoff)
instead of being timed out by Temporal while its session still queues for
the lock (and may get it after the attempt was abandoned)."""

_SERVER_CACHE: weakref.WeakKeyDictionary[Engine, tuple[bool, bool]] = weakref.WeakKeyDictionary()


def _server_traits(conn: Connection) -> tuple[bool, bool]:
    """``(skip_locked, tidb)`` of a MySQL-family server, read once per engine.

    ``skip_locked``: ``FOR UPDATE SKIP LOCKED`` is supported (MariaDB 10.6+,
    MySQL 8.0.1+; not TiDB). ``tidb``: the server is TiDB (which reports a
    MySQL 8 version; detected by ``VERSION()``).
    """
    engine = conn.engine
    cached = _SERVER_CACHE.get(engine)
    if cached is not None:
        return cached
    version = str(conn.execute(text("SELECT VERSION()")).scalar_one()).lower()
    info = tuple(conn.dialect.server_version_info or ())
    tidb = "tidb" in version
    if tidb:
        ok = False
    elif getattr(conn.dialect, "is_mariadb", False):
        ok = info >= (10, 6)
    else:
        ok = info >= (8, 0, 1)
    _SERVER_CACHE[engine] = (ok, tidb)
    return ok, tidb


def _skip_locked(conn: Connection) -> bool:
    """True when the server supports ``FOR UPDATE SKIP LOCKED`` (MariaDB 10.6+, MySQL 8).

    TiDB (which reports a MySQL 8 version) is detected by ``VERSION()`` and excluded.
    """
    if dialect_name(conn) != "mysql":
        return False
    return _server_traits(conn)[0]


def _tidb(conn: Connection) -> bool:
    """True when ``conn`` is a TiDB server (a MySQL-family dialect reporting TiDB)."""
    return dialect_name(conn) == "mysql" and _server_traits(conn)[1]


_SQLITE_WRITERS: dict[str, threading.Lock] = {}
_SQLITE_WRITERS_GUARD = threading.Lock()


@contextmanager
def _sqlite_writer(engine: Engine, timeout: float | None = None) -> Iterator[None]:
    """SQLite: hold this process's writer lock of the database file; else nothing.

    SQLite admits one writer; a writer that finds the database locked sleeps
    in the busy handler's steps (up to 100 ms each) instead of waking when
    the lock frees, so concurrent claims and batch commits of one process
    queued behind each other for tens of milliseconds. Writers of one
    process (claims, enqueues, replays and batch finishes) now queue on an
    in-process lock first and start the moment the previous one commits;
    other processes still meet ``BEGIN IMMEDIATE`` and the busy timeout.

    ``timeout``: longest wait for the in-process lock in seconds (``None``:
    no limit); raises ``QueueLockTimeout`` when it passes.
    """
    url = engine.url
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        yield
        return
    key = os.path.realpath(str(url.database))
    with _SQLITE_WRITERS_GUARD:
        lock = _SQLITE_WRITERS.setdefault(key, threading.Lock())
    if not lock.acquire(timeout=-1 if timeout is None else timeout):
        raise QueueLockTimeout(f"SQLite writer lock not granted within {timeout:g} s")
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _serialized(engine: Engine, lock_name: str) -> Iterator[Connection]:
    """A write transaction serialized on ``lock_name``; commits on success.

    SQLite: ``BEGIN IMMEDIATE`` (the database write lock; ``lock_name`` is
    moot). MySQL family: ``GET_LOCK(lock_name)`` in its own short transaction,
    then a fresh transaction (so its snapshot follows the previous holder's
    commit), ``RELEASE_LOCK`` after commit or rollback. Raises
    ``QueueLockTimeout`` when the lock is not granted in ``LOCK_WAIT_SECONDS``
    (SQLite: the in-process writer lock, then ``BEGIN IMMEDIATE`` under a
    busy timeout of the time left, instead of the engine's 30 s).
    """
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    lock_name = server_lock_name(engine, lock_name)
    with _sqlite_writer(engine, LOCK_WAIT_SECONDS), engine.connect() as conn:
        mysql = dialect_name(conn) == "mysql"
        if mysql:
            got = conn.execute(
                text("SELECT GET_LOCK(:n, :w)"), {"n": lock_name, "w": LOCK_WAIT_SECONDS}
            ).scalar()
            conn.commit()
            if got != 1:
                raise QueueLockTimeout(
                    f"queue lock {lock_name!r} not granted within {LOCK_WAIT_SECONDS} s"
                )
        else:
            _begin_immediate(conn, deadline)
        try:
            with _committed(conn):
                yield conn
        finally:
            if mysql:
                try:
                    conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": lock_name})
                    conn.commit()
                except Exception:  # a dead session has released the lock already
                    conn.invalidate()


@contextmanager
def claim_transaction(engine: Engine) -> Iterator[Connection]:
    """The transaction of one claim; commits on success, rolls back on error.

    MySQL family: a READ COMMITTED transaction and no named lock, so the
    claims of one pack (every worker, every worker process) run side by side;
    what keeps them apart is row-level (see :mod:`nexuscrm.connectors.queue`).
    SQLite (one writer per database): as :func:`_serialized`, ``BEGIN
    IMMEDIATE`` after this process's writer lock, with the same
    ``LOCK_WAIT_SECONDS`` bound and ``QueueLockTimeout``.
    """
    if engine.url.get_backend_name() == "sqlite":
        with _serialized(engine, "claim") as conn:
            yield conn
        return
    with engine.connect() as conn:
        # READ COMMITTED: each statement reads the latest commit, so a claim
        # that lost candidates to another claim picks again past everything
        # claimed meanwhile (a REPEATABLE READ snapshot would offer the same
        # taken rows round after round) and its probes see finished lane heads.
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        with _committed(conn):
            yield conn


@contextmanager
def _committed(conn: Connection) -> Iterator[None]:
    """Commit ``conn``'s transaction when the block succeeds, roll it back when it raises."""
    try:
        yield
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


def _begin_immediate(conn: Connection, deadline: float) -> None:
    """``BEGIN IMMEDIATE`` waiting at most until ``deadline`` (``time.monotonic``).

    The connection's busy timeout is the time left for the BEGIN only, then
    back to the engine's 30 s. Raises ``QueueLockTimeout`` when the database
    stayed locked (by another process) until the deadline.
    """
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    conn.exec_driver_sql(f"PRAGMA busy_timeout={left_ms}")
    try:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    except OperationalError as exc:
        if "locked" in str(exc).lower():
            raise QueueLockTimeout(
                f"SQLite write lock not granted within {LOCK_WAIT_SECONDS} s"
            ) from exc
        raise
    finally:
        conn.exec_driver_sql(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A write transaction that commits on success and rolls back on error.

    SQLite: ``BEGIN IMMEDIATE``, so the database write lock is held from the
    first read (a deferred transaction that read first could not upgrade
    after another writer's commit: ``database is locked`` at once). MySQL
    family: an ordinary transaction.
    """
    with _sqlite_writer(engine), engine.connect() as conn:
        if dialect_name(conn) == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        with _committed(conn):
            yield conn


def server_lock_name(engine: Engine, lock_name: str) -> str:
    """``lock_name`` scoped to ``engine``'s database, as ``GET_LOCK`` takes it.

    ``GET_LOCK`` names are server-wide, not per database: two databases on one
    server (staging and production, or a test per database) would otherwise
    queue their enqueues and claims behind each other. ``<name>@<database>``
    when that fits MySQL's 64 characters, else ``nx_`` + a SHA-1 of it.
    """
    scoped = f"{lock_name}@{engine.url.database or ''}"
    if len(scoped) <= 64:
        return scoped
    digest = hashlib.sha1(scoped.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"nx_{digest}"


def _claim_lock_name(installed_pack_id: str) -> str:
    # MySQL lock names are limited to 64 characters.
    digest = hashlib.sha1(installed_pack_id.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"nexuscrm_claim_{digest[:40]}"
