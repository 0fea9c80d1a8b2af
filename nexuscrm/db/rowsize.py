"""Row-size budget of an object's table on MySQL, MariaDB and TiDB.

Two limits refuse a ``CREATE TABLE`` / ``ALTER TABLE ADD COLUMN`` with error
1118 (``Row size too large``):

- the server's 65,535 bytes, counting every ``VARCHAR(n)`` at its maximum
  (``4 * n`` bytes in utf8mb4, plus a 1- or 2-byte length) and a ``TEXT`` /
  ``MEDIUMTEXT`` at its length prefix plus an 8-byte pointer (10 / 11 bytes);
- InnoDB's worst-case record on a 16 KiB page, 8,126 bytes (``innodb_strict_mode``,
  ROW_FORMAT=DYNAMIC, the MariaDB and MySQL default): fixed-size columns at
  their size, a variable column shorter than 256 bytes in full (a
  ``VARCHAR(36)`` lookup counts 145 bytes), a longer one or a ``TEXT`` at its
  20-byte off-page pointer.

:func:`mysql_text_columns` picks which text-like columns of an object are
``TEXT`` instead of ``VARCHAR`` so that real wide objects fit; :func:`row_size`
measures a table; :func:`row_size_problem` is the plan-time refusal of what
cannot fit whatever the text columns are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Boolean, Date, DateTime, Integer, Numeric, String, Text, Time
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.types import TypeEngine

from nexuscrm.db.dialect import column_type
from nexuscrm.packs.model import FieldSpec, FieldType, ObjectSpec

SERVER_ROW_LIMIT = 65535
INNODB_ROW_LIMIT = 8126
# Text-like fields stay VARCHAR while the row stays within these budgets
# (half of each limit): room for fields a later pack version adds.
SERVER_VARCHAR_BUDGET = SERVER_ROW_LIMIT // 2
INNODB_VARCHAR_BUDGET = INNODB_ROW_LIMIT // 2

# Text-like types that may be stored as TEXT when the row needs the room.
_TEXT_LIKE = frozenset(
    {FieldType.Text, FieldType.Picklist, FieldType.Email, FieldType.Url, FieldType.TextArea}
)
_BYTES_PER_CHAR = 4  # utf8mb4
_OFF_PAGE_POINTER = 20
# Record header, DB_TRX_ID, DB_ROLL_PTR.
_INNODB_BASE = 5 + 6 + 7
_DECIMAL_LEFTOVER = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)


@dataclass(frozen=True)
class RowSize:
    """A row's worst case in bytes under each limit (see the module docstring)."""

    server: int
    innodb: int

    def fits(self) -> bool:
        """True when both the server and the InnoDB limit allow the row."""
        return self.server <= SERVER_ROW_LIMIT and self.innodb < INNODB_ROW_LIMIT

    def __add__(self, other: RowSize) -> RowSize:
        return RowSize(self.server + other.server, self.innodb + other.innodb)


def _decimal_bytes(precision: int, scale: int) -> int:
    def part(digits: int) -> int:
        return digits // 9 * 4 + _DECIMAL_LEFTOVER[digits % 9]

    return part(precision - scale) + part(scale)


def column_bytes(type_: TypeEngine[Any]) -> RowSize:
    """Worst-case bytes of one column of ``type_`` as MySQL/MariaDB stores it.

    ``type_`` may be a type of :func:`nexuscrm.db.dialect.column_type` (its
    ``mysql`` variant is used) or one reflected from the database.
    """
    type_ = getattr(type_, "_variant_mapping", {}).get("mysql", type_)
    if isinstance(type_, mysql_dialect.MEDIUMTEXT | mysql_dialect.LONGTEXT):
        return RowSize(11 if isinstance(type_, mysql_dialect.MEDIUMTEXT) else 12, 21)
    if isinstance(type_, Text):
        return RowSize(10, _OFF_PAGE_POINTER + 1)
    if isinstance(type_, String):
        n = (type_.length or 255) * _BYTES_PER_CHAR
        server = n + (1 if n <= 255 else 2)
        return RowSize(server, n + 1 if n < 256 else _OFF_PAGE_POINTER + 1)
    if isinstance(type_, Numeric) and not isinstance(type_, Integer | mysql_dialect.DOUBLE):
        precision = type_.precision or 10
        size = _decimal_bytes(precision, type_.scale or 0)
        return RowSize(size, size)
    if isinstance(type_, DateTime):
        return RowSize(8, 8)
    if isinstance(type_, Date | Time):
        return RowSize(3, 3)
    if isinstance(type_, Boolean | mysql_dialect.TINYINT):
        return RowSize(1, 1)
    # INT, BIGINT, DOUBLE and anything else fixed-size: 8 bytes is the upper bound.
    return RowSize(8, 8)


def _base(n_columns: int, id_type: TypeEngine[Any]) -> RowSize:
    nulls = (n_columns + 7) // 8
    return RowSize(nulls + 1, _INNODB_BASE + nulls) + column_bytes(id_type)


def row_size(columns: Sequence[TypeEngine[Any]]) -> RowSize:
    """Worst-case size of a row of ``columns`` (the first is the primary key ``Id``)."""
    total = _base(len(columns), columns[0])
    for type_ in columns[1:]:
        total = total + column_bytes(type_)
    return total


def _switchable(f: FieldSpec) -> bool:
    """A text-like field that may be TEXT: not indexed (external id, unique)."""
    return f.type in _TEXT_LIKE and not (f.external_id or f.unique)


def mysql_text_columns(
    spec: ObjectSpec,
    standard: Sequence[TypeEngine[Any]],
    existing: Mapping[str, TypeEngine[Any]] | None = None,
) -> frozenset[str]:
    """Lower-cased column names of ``spec`` to create as ``TEXT`` on MySQL.

    ``standard`` are the standard columns' types (``Id`` first); ``existing``
    maps lower-cased names of columns the table already has to their
    reflected types (they count as they are and are never changed). Every
    column that is not a text-like, unindexed field counts first; then the
    text-like fields, in declared order, stay ``VARCHAR`` while the row stays
    within half of each limit, and the rest become ``TEXT``. Deterministic
    for a spec and a table; objects of ordinary width are all ``VARCHAR``.
    """
    existing = existing or {}
    total = row_size(list(standard))
    candidates: list[tuple[str, RowSize]] = []
    n_columns = len(standard)
    for f in spec.fields:
        for col in f.column_names():
            n_columns += 1
            have = existing.get(col.lower())
            if have is not None:
                total = total + column_bytes(have)
            elif _switchable(f):
                candidates.append((col.lower(), column_bytes(column_type(f, "mysql"))))
            else:
                total = total + column_bytes(column_type(f, "mysql"))
    total = total + RowSize((n_columns + 7) // 8, (n_columns + 7) // 8)
    text: set[str] = set()
    for col, size in candidates:
        grown = total + size
        if grown.server <= SERVER_VARCHAR_BUDGET and grown.innodb <= INNODB_VARCHAR_BUDGET:
            total = grown
        else:
            text.add(col)
            total = total + column_bytes(Text())
    return frozenset(text)


def row_size_problem(
    spec: ObjectSpec,
    standard: Sequence[TypeEngine[Any]],
    existing: Mapping[str, TypeEngine[Any]] | None = None,
) -> str | None:
    """Why ``spec``'s table cannot exist on MySQL/MariaDB, or None when it fits.

    Measures the table as :func:`mysql_text_columns` would lay it out (with
    the ``existing`` columns as they are); the message names the object and
    its byte count against the limit it breaks.
    """
    existing = existing or {}
    text = mysql_text_columns(spec, standard, existing)
    types: list[TypeEngine[Any]] = list(standard)
    for f in spec.fields:
        for col in f.column_names():
            have = existing.get(col.lower())
            if have is not None:
                types.append(have)
            elif col.lower() in text:
                types.append(Text())
            else:
                types.append(column_type(f, "mysql"))
    size = row_size(types)
    if size.fits():
        return None
    if size.server > SERVER_ROW_LIMIT:
        what = f"{size.server} bytes, over the server's {SERVER_ROW_LIMIT}-byte row limit"
    else:
        what = (
            f"{size.innodb} bytes stored in the row, over InnoDB's {INNODB_ROW_LIMIT}-byte "
            "limit (each lookup counts 145 bytes, each number up to 17, each date 3 to 8, "
            "each long text 21)"
        )
    return (
        f"object {spec.api_name} cannot be created on MySQL/MariaDB: a row of its "
        f"{len(types)} columns needs {what}; split it into several objects"
    )
