"""Every dialect difference in one place: upsert, views, index introspection,
column types, transient-error classification, reconnect after DDL.

Supported: ``sqlite`` and ``mysql`` (MariaDB, MySQL 8, TiDB through PyMySQL).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    Boolean,
    Connection,
    Date,
    DateTime,
    Engine,
    Numeric,
    String,
    Table,
    Text,
    Time,
    inspect,
    text,
)
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.sql.expression import Select
from sqlalchemy.types import TypeEngine

from nexuscrm.formulas.view import CreateView, DropView
from nexuscrm.packs.model import FieldSpec, FieldType


def dialect_name(bind: Connection | Engine) -> str:
    """``'sqlite'`` or ``'mysql'`` (MariaDB and TiDB report ``mysql``)."""
    return bind.dialect.name


def upsert(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    update_columns: Iterable[str],
) -> None:
    """Insert ``rows``; on a primary/unique key conflict update ``update_columns``.

    One statement for the whole batch (executemany). No-op for no rows.
    """
    if not rows:
        return
    cols = list(update_columns)
    if dialect_name(conn) == "sqlite":
        stmt_s = sqlite_dialect.insert(table)
        pk = [c.name for c in table.primary_key.columns]
        stmt_s = stmt_s.on_conflict_do_update(
            index_elements=pk, set_={c: stmt_s.excluded[c] for c in cols}
        )
        conn.execute(stmt_s, list(rows))
    else:
        stmt_m = mysql_dialect.insert(table)
        stmt_m = stmt_m.on_duplicate_key_update({c: stmt_m.inserted[c] for c in cols})
        conn.execute(stmt_m, list(rows))


def quote(bind: Connection | Engine, identifier: str) -> str:
    """Quote an (already validated) identifier for raw DDL."""
    return bind.dialect.identifier_preparer.quote_identifier(identifier)


def create_or_replace_view(conn: Connection, name: str, select: Select[Any]) -> None:
    """Create or replace view ``name`` as ``select`` (literals inlined).

    MySQL family: ``CREATE OR REPLACE VIEW`` (atomic). SQLite has no OR
    REPLACE for views, so drop then create inside the caller's transaction.
    """
    if dialect_name(conn) == "sqlite":
        conn.execute(DropView(name))
        conn.execute(CreateView(name, select))
    else:
        conn.execute(CreateView(name, select, or_replace=True))


def drop_view(conn: Connection, name: str) -> None:
    """Drop view ``name`` if it exists."""
    conn.execute(text(f"DROP VIEW IF EXISTS {quote(conn, name)}"))


def table_names(bind: Connection | Engine) -> set[str]:
    """Physical base tables of the current database (views excluded)."""
    return set(inspect(bind).get_table_names())


def view_names(bind: Connection | Engine) -> set[str]:
    """Views of the current database."""
    return set(inspect(bind).get_view_names())


def column_names(bind: Connection | Engine, table: str) -> dict[str, dict[str, Any]]:
    """Columns of ``table`` keyed by name (each as SQLAlchemy's inspector reports it)."""
    return {c["name"]: dict(c) for c in inspect(bind).get_columns(table)}


def index_names(bind: Connection | Engine, table: str) -> set[str]:
    """Index names of ``table`` (unique constraints reported as indexes included)."""
    insp = inspect(bind)
    names = {str(i["name"]) for i in insp.get_indexes(table) if i.get("name")}
    names |= {str(u["name"]) for u in insp.get_unique_constraints(table) if u.get("name")}
    return names


def after_ddl(engine: Engine) -> None:
    """Drop pooled connections after DDL.

    TiDB caches the schema per session; the seed reconnects after every DDL
    phase (``database.NewConnection()``). Disposing the pool does the same
    for every engine, at the cost of one reconnect.
    """
    if engine.dialect.name == "mysql":
        engine.dispose()


_TRANSIENT_MYSQL_CODES = {
    1205,  # lock wait timeout
    1213,  # deadlock
    2002,  # can't connect
    2003,  # can't connect
    2006,  # server has gone away
    2013,  # lost connection during query
    8002,  # TiDB: write conflict (retryable)
    9007,  # TiDB: write conflict
    8028,  # TiDB: information schema changed
}


PACKET_SUSPECT_BYTES = 16 * 1024 * 1024
"""A statement whose text and parameters reach this many bytes (MariaDB's
default ``max_allowed_packet``) and that loses the connection (2006, 2013)
is taken as too large for the server's packet, not as a transient fault."""


def _statement_bytes(exc: BaseException) -> int:
    """Rough size of the failed statement: its text plus its string/bytes
    parameters (lists of parameter sets and dicts walked one level deep)."""
    total = len(str(getattr(exc, "statement", "") or ""))
    params = getattr(exc, "params", None)
    sets = params if isinstance(params, list | tuple) else [params]
    for one in sets:
        values = (
            one.values()
            if isinstance(one, dict)
            else (one if isinstance(one, list | tuple) else [one])
        )
        for v in values:
            if isinstance(v, str | bytes | bytearray):
                total += len(v)
    return total


def is_packet_too_large(exc: BaseException) -> bool:
    """True when ``exc`` is MySQL's ``ER_NET_PACKET_TOO_LARGE`` (1153), or a lost
    connection (2006, 2013) of a statement of :data:`PACKET_SUSPECT_BYTES` or
    more: the server dropped a packet larger than its ``max_allowed_packet``,
    and the same statement would be dropped again."""
    args = getattr(getattr(exc, "orig", None), "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    if code == 1153:
        return True
    return code in (2006, 2013) and _statement_bytes(exc) >= PACKET_SUSPECT_BYTES


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is a database fault worth retrying with backoff.

    Lock waits, deadlocks, lost connections, TiDB write conflicts, and
    SQLite ``database is locked``. Anything else (syntax, constraint, missing
    table) is treated as permanent, and so is a statement too large for the
    server's packet (:func:`is_packet_too_large`).
    """
    if isinstance(exc, OperationalError | DBAPIError):
        if is_packet_too_large(exc):
            return False
        orig = getattr(exc, "orig", None)
        args = getattr(orig, "args", ())
        if args and isinstance(args[0], int) and args[0] in _TRANSIENT_MYSQL_CODES:
            return True
        msg = str(orig or exc).lower()
        return "database is locked" in msg or ("connection" in msg and "lost" in msg)
    return isinstance(exc, ConnectionError | TimeoutError)


_LOCK_CONFLICT_MYSQL_CODES = {
    1205,  # lock wait timeout
    1213,  # deadlock
    8002,  # TiDB: write conflict (retryable)
    9007,  # TiDB: write conflict
}


def is_lock_conflict(exc: BaseException) -> bool:
    """True for a lock conflict between concurrent transactions: a deadlock
    (1213), a lock wait timeout (1205), a TiDB write conflict, SQLite
    ``database is locked``. Expected under concurrency and retried (a subset of
    :func:`is_transient`); a lost connection is not one."""
    if not isinstance(exc, OperationalError | DBAPIError):
        return False
    orig = getattr(exc, "orig", None)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0] in _LOCK_CONFLICT_MYSQL_CODES
    return "database is locked" in str(orig or exc).lower()


PERMANENT_DB_ERRORS = (IntegrityError, DataError)


# No retry fixes these: a wrong credential or name, SQL the server refuses
# (syntax, unknown column, illegal mix of collations, a row too large), or
# a value it cannot store.
_PERMANENT_MYSQL_CODES = {
    1044,  # access denied to the database
    1045,  # access denied for the user
    1049,  # unknown database
    1054,  # unknown column
    1064,  # SQL syntax
    1118,  # row size too large
    1264,  # out of range value
    1267,  # illegal mix of collations
    1271,  # illegal mix of collations (3 operands)
    1292,  # incorrect date/time value
    1366,  # incorrect string value (character set)
    1406,  # data too long
    1153,  # packet larger than max_allowed_packet
}


def is_permanent(exc: BaseException) -> bool:
    """True for database errors that repeat identically on retry (constraint,
    data, access denied, unknown database or column, SQL syntax, illegal mix
    of collations, row size too large, a value the column cannot store)."""
    if isinstance(exc, PERMANENT_DB_ERRORS) or is_packet_too_large(exc):
        return True
    args: tuple[Any, ...] = tuple(getattr(getattr(exc, "orig", None), "args", ()))
    return bool(args) and isinstance(args[0], int) and args[0] in _PERMANENT_MYSQL_CODES


def describe_error(exc: BaseException, limit: int = 2000, *, with_type: bool = True) -> str:
    """One readable line for an error: the driver's message, never bound parameters.

    SQLAlchemy errors otherwise carry the whole statement and its parameters
    (a pack payload can be megabytes) into markers and workflow failures.
    """
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        text_ = f"{type(exc.orig).__name__}: {exc.orig}" if with_type else str(exc.orig)
    else:
        text_ = f"{type(exc).__name__}: {exc}" if with_type else str(exc)
    return text_ if len(text_) <= limit else text_[: limit - 3] + "..."


def column_type(field: FieldSpec, dialect: str) -> TypeEngine[Any]:
    """Physical column type for one stored column of ``field``.

    Mapping (lengths in characters): Text/Picklist/Email/Url VARCHAR(length or
    255); Phone VARCHAR(40); TextArea VARCHAR(length or 255); LongTextArea,
    Html and MultiselectPicklist TEXT; Number/Currency/Percent DECIMAL(precision
    or 18, scale or 0/2/2); Checkbox BOOLEAN; Date, DateTime, Time; Lookup and
    MasterDetail VARCHAR(36) (record ids); Location DECIMAL(11, scale or 7)
    per coordinate column; AutoNumber VARCHAR(30).

    Raises ``ValueError`` for formula or Summary fields (they store nothing).
    """
    t = field.type
    if not field.is_stored:
        raise ValueError(f"field {field.api_name} is computed and has no column")
    if t in (
        FieldType.Text,
        FieldType.Picklist,
        FieldType.Email,
        FieldType.Url,
        FieldType.TextArea,
    ):
        n = field.length or 255
        return Text() if n > 4000 else String(n)
    if t == FieldType.Phone:
        return String(40)
    if t in (FieldType.LongTextArea, FieldType.Html, FieldType.MultiselectPicklist):
        # Salesforce allows 131,072 characters; MySQL TEXT holds 64 KiB.
        return Text().with_variant(mysql_dialect.MEDIUMTEXT(), "mysql")
    if t in (FieldType.Number, FieldType.Currency, FieldType.Percent):
        default_scale = 0 if t == FieldType.Number else 2
        scale = field.scale if field.scale is not None else default_scale
        precision = max(field.precision or 18, scale + 1)
        return Numeric(precision, scale, asdecimal=True)
    if t == FieldType.Checkbox:
        return Boolean(create_constraint=False)
    if t == FieldType.Date:
        return Date()
    if t == FieldType.DateTime:
        return DateTime()
    if t == FieldType.Time:
        return Time()
    if t in (FieldType.Lookup, FieldType.MasterDetail):
        return String(36)
    if t == FieldType.Location:
        return Numeric(11, field.scale if field.scale is not None else 7, asdecimal=True)
    if t == FieldType.AutoNumber:
        return String(30)
    raise ValueError(f"field {field.api_name}: no column type for {t}")


def render_type(bind: Connection | Engine, type_: TypeEngine[Any]) -> str:
    """The DDL spelling of ``type_`` on this dialect (for ALTER TABLE ADD COLUMN)."""
    return type_.compile(dialect=bind.dialect)


def size_change(have: TypeEngine[Any], want: TypeEngine[Any]) -> str | None:
    """How the declared column type ``want`` compares with ``have`` (MySQL family):
    ``"wider"``, ``"narrower"``, ``"same"``, or ``None`` for a pair of no common
    size (other type pairs, a ``DECIMAL`` or ``VARCHAR`` without its size).

    Text: a ``TEXT`` holds more than any ``VARCHAR``; a longer ``VARCHAR`` is
    wider. Decimal: wider when it has more integer digits or more decimals and
    neither fewer; narrower when it has fewer of either (more decimals but fewer
    integer digits is narrower: some stored values would not fit).
    """
    if isinstance(want, Numeric) and isinstance(have, Numeric):
        hp, hs, wp, ws = have.precision, have.scale, want.precision, want.scale
        if hp is None or hs is None or wp is None or ws is None:
            return None
        digits, decimals = (wp - ws) - (hp - hs), ws - hs
        if digits < 0 or decimals < 0:
            return "narrower"
        return "same" if (digits, decimals) == (0, 0) else "wider"
    if isinstance(have, String) and isinstance(want, String):
        had, wanted = _text_length(have), _text_length(want)
        if had is None or wanted is None:
            return None
        return "wider" if wanted > had else "narrower" if wanted < had else "same"
    return None


def _text_length(type_: String) -> float | None:
    if isinstance(type_, Text):
        return float("inf")
    return float(type_.length) if type_.length else None


def widens(have: TypeEngine[Any], want: TypeEngine[Any]) -> bool:
    """Whether the declared column type ``want`` holds more than the reflected ``have``
    (:func:`size_change` says ``"wider"``), so that the column must be widened in
    place. A narrower ``want`` is refused when the pack is planned
    (``nexuscrm.controlplane.packs_plan``); other type pairs are left alone."""
    return size_change(have, want) == "wider"
