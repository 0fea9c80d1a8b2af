"""Engine factory for SQLite (embedded default) and the MySQL family via PyMySQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from .ddl import speak_install_collation
from .sqlfuncs import install_sqlite_functions

SQLITE_BUSY_TIMEOUT_MS = 30000
"""SQLite: how long a statement waits for another connection's lock (ms)."""


def make_engine(
    url: str, *, pool_size: int | None = None, max_overflow: int | None = None
) -> Engine:
    """Create an engine for ``url``.

    ``pool_size`` / ``max_overflow``: the connection pool's size (connections
    kept) and overflow (extra connections opened under load); SQLAlchemy's 5
    and 10 when not given. A worker sizes them to its threads
    (``nexuscrm.connectors.sizing``). Ignored for an in-memory SQLite database
    (no pool).

    SQLite: creates the parent folder of the file, enables WAL and foreign
    keys, and a 30 s busy timeout so a worker and the CLI can share the file.
    MySQL/MariaDB/TiDB: ``mysql+pymysql://`` (a bare ``mysql://`` is upgraded to
    PyMySQL), ``pool_pre_ping`` so a connection dropped by a proxy or a TiDB
    DDL is replaced instead of failing the phase; each connection speaks the
    install's collation and tables are created with it
    (:func:`nexuscrm.db.ddl.speak_install_collation`).

    Raises ``ValueError`` for a backend other than sqlite or mysql.
    """
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        memory = u.database in (None, "", ":memory:")
        engine = create_engine(
            u,
            connect_args={"timeout": 30, "check_same_thread": False},
            poolclass=NullPool if memory else None,
            **({} if memory else _pool_args(pool_size, max_overflow)),
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.close()
            install_sqlite_functions(dbapi_conn)

        return engine
    if backend == "mysql":
        if u.drivername == "mysql":
            u = u.set(drivername="mysql+pymysql")
        query = dict(u.query)
        query.setdefault("charset", "utf8mb4")
        u = u.set(query=query)
        engine = create_engine(
            u, pool_pre_ping=True, pool_recycle=3600, **_pool_args(pool_size, max_overflow)
        )

        @event.listens_for(engine, "connect")
        def _install_collation(dbapi_conn: Any, _record: Any) -> None:
            speak_install_collation(dbapi_conn, engine.dialect)

        return engine
    raise ValueError(
        f"database URL {u.render_as_string(hide_password=True)!r}: backend {backend!r} is not "
        "supported (use sqlite:///path or mysql+pymysql://user@host:port/db)"
    )


def _pool_args(pool_size: int | None, max_overflow: int | None) -> dict[str, int]:
    args: dict[str, int] = {}
    if pool_size is not None:
        args["pool_size"] = pool_size
    if max_overflow is not None:
        args["max_overflow"] = max_overflow
    return args


def redacted(url: str) -> str:
    """``url`` with its password masked, for logs and errors."""
    return make_url(url).render_as_string(hide_password=True)
