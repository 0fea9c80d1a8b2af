"""The acting user of a database session, as formula views read it (``$User``).

A formula view is one SQL definition shared by every reader, so ``$User.Id``
compiles to ``COALESCE(nx_session_user(), <default acting user>)``:

- ``nx_session_user()`` is the acting user this session set with
  :func:`acting_user` (or by hand: ``SET @nexus_user_id = '005...'`` on
  MariaDB/MySQL, ``SELECT nx_set_session_user('005...')`` on SQLite), and
  NULL when it set none. On the MySQL family it is a stored function
  (``RETURN @nexus_user_id``: MariaDB and MySQL allow no user variable in a
  view, but a view may call a function that reads one); on SQLite it is an
  application function registered on every connection ``make_engine`` makes.
- The default acting user is the ``User.Id`` row of ``_System_FormulaGlobal``
  (``nexusctl formulas set-global User.Id 005...``), read when the view is.

TiDB has no stored functions: there ``$User.Id`` is the default acting user
only (``session_user_available`` is false and the compiler leaves the
function out).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from nexuscrm.log import log

SESSION_USER_FUNCTION = "nx_session_user"
"""The zero-argument SQL function a view calls for the session's acting user."""

SESSION_USER_VARIABLE = "nexus_user_id"
"""The MariaDB/MySQL user variable ``nx_session_user()`` returns (``@nexus_user_id``)."""


def _create_mysql(collation: str) -> str:
    """The function returns text of the connection's (the install's) collation, so
    that a view comparing a column with it mixes no collations."""
    return (
        f"CREATE FUNCTION {SESSION_USER_FUNCTION}() RETURNS VARCHAR(255) CHARSET utf8mb4 "
        f"COLLATE {collation} NOT DETERMINISTIC NO SQL SQL SECURITY INVOKER "
        f"RETURN @{SESSION_USER_VARIABLE}"
    )


def session_user_available(conn: Connection) -> bool:
    """Whether views on ``conn``'s database may call ``nx_session_user()``.

    Always on SQLite (registered per connection); on the MySQL family when
    the stored function exists in the current database.
    """
    if conn.dialect.name == "sqlite":
        return True
    found = conn.execute(
        sa.text(
            "SELECT COUNT(*) FROM information_schema.ROUTINES "
            "WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME = :name"
        ),
        {"name": SESSION_USER_FUNCTION},
    ).scalar()
    return bool(found)


def ensure_session_user_function(engine: Engine) -> bool:
    """Create ``nx_session_user()`` on the MySQL family when it is missing.

    Idempotent. Returns whether the function is available afterwards. A
    database that refuses stored functions (TiDB, or an account without
    CREATE ROUTINE) is logged, not raised: ``$User.Id`` then reads only the
    default acting user.
    """
    if engine.dialect.name == "sqlite":
        return True
    with engine.connect() as conn:
        if session_user_available(conn):
            return True
        try:
            collation = conn.execute(sa.text("SELECT @@collation_connection")).scalar_one()
            conn.execute(sa.text(_create_mysql(collation)))
            conn.commit()
        except sa.exc.DBAPIError as exc:
            # Another process may have created it meanwhile.
            if session_user_available(conn):
                return True
            log.warning(
                "formula session function not created; $User.Id reads the default acting user only",
                function=SESSION_USER_FUNCTION,
                error=str(exc.orig),
            )
            return False
    return True


@contextmanager
def acting_user(conn: Connection, user_id: str | None) -> Iterator[Connection]:
    """Make ``user_id`` the acting user (``$User``) of ``conn``'s session.

    Formula views read on ``conn`` inside the block see ``$User.Id`` =
    ``user_id`` (None: the default acting user). The session is reset on
    exit, so a pooled connection never carries one reader's user to the
    next.
    """
    _set(conn, user_id)
    try:
        yield conn
    finally:
        _set(conn, None)


def _set(conn: Connection, user_id: str | None) -> None:
    params: dict[str, Any] = {"v": user_id}
    if conn.dialect.name == "sqlite":
        conn.execute(sa.text("SELECT nx_set_session_user(:v)"), params)
    else:
        conn.execute(sa.text(f"SET @{SESSION_USER_VARIABLE} = :v"), params)
