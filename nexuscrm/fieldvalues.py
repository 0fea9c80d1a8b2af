"""Field values from JSON: what a column of a catalog field can store.

One rule for every entry point that writes a record's field from outside
input (``events import-sfdx-data`` checks it before enqueueing, the
``upsert_record`` flow before writing), so a value that does not fit its
field is refused the same way on SQLite and MariaDB, never left to the
driver (SQLite stores anything; MariaDB refuses with ``1406 Data too long``
or ``1264 Out of range``, and no driver binds a JSON object).

The seed's connector runtime (``000_*``) holds no field-mapping code to
port; like the rest of the runtime this fails closed: a value is converted
only when the conversion loses nothing but the digits past a number's scale
(rounded half up, as Salesforce does).
"""

from __future__ import annotations

import datetime as dt
import functools
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation, localcontext
from typing import Any

from sqlalchemy import Numeric

from nexuscrm.db.dialect import column_type
from nexuscrm.inputs import kind_of
from nexuscrm.packs.model import NUMERIC_TYPES, REFERENCE_TYPES, FieldSpec, FieldType

NAME_FIELD = FieldSpec(api_name="Name", type=FieldType.Text, length=255)
"""The standard ``Name`` column (``VARCHAR(255)``) as a field, for its values."""
OWNER_FIELD = FieldSpec(api_name="OwnerId", type=FieldType.Text, length=36)
"""The standard ``OwnerId`` column (``VARCHAR(36)``) as a field, for its values."""

MAX_REMOTE_ID_CHARS = 128
"""Longest remote id (``_System_ConnectorRemoteLink.RemoteId``): a record's own
or the parent a lookup names."""
LONG_TEXT_CHARS = 131_072
"""Longest value of a long text field without a length (Salesforce's Long Text
Area); the column is ``MEDIUMTEXT`` on MySQL."""
_TEXT_COLUMN_BYTES = 65_535  # MySQL TEXT: a Text field declared over 4,000 characters
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


class ValueProblem(ValueError):
    """Why a value cannot be stored in its field (the message is the reason only)."""


def text_limit(f: FieldSpec) -> int:
    """Most characters a text-like field's column holds (see ``column_type``)."""
    if f.type == FieldType.Phone:
        return 40
    if f.type == FieldType.AutoNumber:
        return 30
    if f.type in (FieldType.LongTextArea, FieldType.Html, FieldType.MultiselectPicklist):
        return f.length or LONG_TEXT_CHARS
    if f.type in REFERENCE_TYPES:
        return MAX_REMOTE_ID_CHARS
    return f.length or 255


def _text(f: FieldSpec, value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = str(value)
    elif f.type == FieldType.MultiselectPicklist and isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise ValueProblem("is a list holding more than strings; a multi-select holds strings")
        text = ";".join(value)
    else:
        raise ValueProblem(f"is {kind_of(value)}; a {f.type} field holds text")
    if f.restricted:
        _check_restricted(f, text)
    limit = text_limit(f)
    if len(text) > limit:
        raise ValueProblem(f"has {len(text):,} characters; the field holds at most {limit:,}")
    if limit > 4000 and f.type not in (FieldType.LongTextArea, FieldType.Html):
        size = len(text.encode("utf-8"))
        if size > _TEXT_COLUMN_BYTES:
            raise ValueProblem(
                f"is {size:,} bytes as UTF-8; the column holds at most {_TEXT_COLUMN_BYTES:,}"
            )
    return text


@functools.lru_cache(maxsize=4096)
def _allowed(f: FieldSpec) -> frozenset[str]:
    return frozenset(f.picklist_values)


def _check_restricted(f: FieldSpec, text: str) -> None:
    """A restricted picklist stores only its values (exactly, as Salesforce's API
    refuses a bad value for a restricted picklist); a multi-select, each of its
    ``;``-separated values."""
    picked = text.split(";") if f.type == FieldType.MultiselectPicklist else [text]
    bad = [v for v in picked if v not in _allowed(f)]
    if bad:
        shown = ", ".join(repr(v) for v in f.picklist_values[:10])
        more = f" and {len(f.picklist_values) - 10} more" if len(f.picklist_values) > 10 else ""
        raise ValueProblem(
            f"{', '.join(repr(v[:40]) for v in bad[:5])} is not a value of this restricted "
            f"picklist ({shown}{more})"
        )


@functools.lru_cache(maxsize=4096)
def _numeric_bounds(f: FieldSpec) -> tuple[int, int]:
    """(precision, scale) of a numeric field's column, built once per field
    (this runs for every numeric value of every inbound event)."""
    col = column_type(f, "sqlite")
    assert isinstance(col, Numeric) and col.precision is not None
    return col.precision, col.scale or 0


def _number(f: FieldSpec, value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueProblem(f"is {kind_of(value)}; a {f.type} field holds a number")
    try:
        number = Decimal(value.strip() if isinstance(value, str) else str(value))
    except InvalidOperation:
        raise ValueProblem(f"{str(value)[:40]!r} is not a number") from None
    if not number.is_finite():
        raise ValueProblem(f"{str(value)[:40]!r} is not a finite number")
    precision, scale = _numeric_bounds(f)
    whole = precision - scale
    too_big = ValueProblem(
        f"{str(value)[:40]} is out of range: the field holds {whole} digit(s) before the "
        f"point and {scale} after (precision {precision}, scale {scale})"
    )
    if number and number.adjusted() >= whole:
        raise too_big
    with localcontext() as ctx:
        ctx.prec = precision + 2
        rounded = number.quantize(Decimal(1).scaleb(-scale), rounding=ROUND_HALF_UP)
    if rounded and rounded.adjusted() >= whole:
        raise too_big
    return rounded


def _temporal(f: FieldSpec, value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueProblem(f"is {kind_of(value)}; a {f.type} field holds an ISO text")
    try:
        if f.type == FieldType.Date:
            return dt.date.fromisoformat(value[:10])
        if f.type == FieldType.DateTime:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            if parsed.tzinfo is not None:
                parsed = parsed.astimezone(dt.UTC).replace(tzinfo=None)
            return parsed
        return dt.time.fromisoformat(value.rstrip("Z"))
    except ValueError:
        raise ValueProblem(f"{value[:40]!r} is not a valid {f.type}") from None


def _checkbox(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower() if isinstance(value, str | int) else None
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    shown = repr(value[:40]) if isinstance(value, str) else kind_of(value)
    raise ValueProblem(f"is {shown}; a Checkbox holds true or false")


def stored_value(f: FieldSpec, value: Any) -> Any:
    """The value one column of ``f`` stores for the JSON ``value``.

    ``null`` and ``""`` store NULL. Text-like fields take a string (a number
    or boolean as its JSON text; a multi-select also a list of strings,
    joined by ``;``) of at most :func:`text_limit` characters. Number,
    Currency, Percent and a Location's coordinate take a number or a string
    holding one, finite, at most ``precision - scale`` digits before the
    point (digits past ``scale`` are rounded half up): a ``Decimal``.
    A restricted picklist takes only its values (a multi-select, each of
    them). Checkbox takes a boolean, or ``true/false/1/0/yes/no`` (any case). Date,
    DateTime (to naive UTC) and Time take ISO text (a datetime fills a Date).
    A lookup's value is the parent's remote id: a string or integer of at most
    :data:`MAX_REMOTE_ID_CHARS` characters, returned as text.

    Raises :class:`ValueProblem` with the reason (``is an object; a Text
    field holds text``, ``has 80 characters; the field holds at most 50``,
    ``123456789 is out of range ...``). Port of no seed function (see the
    module docstring).
    """
    if value is None or value == "":
        return None
    if f.type in NUMERIC_TYPES or f.type == FieldType.Location:
        return _number(f, value)
    if f.type == FieldType.Checkbox:
        return _checkbox(value)
    if f.type in (FieldType.Date, FieldType.DateTime, FieldType.Time):
        return _temporal(f, value)
    if f.type in REFERENCE_TYPES and isinstance(value, bool | float):
        raise ValueProblem(f"is {kind_of(value)}; a lookup holds the parent's remote id")
    return _text(f, value)


def value_problem(f: FieldSpec, value: Any) -> str | None:
    """:func:`stored_value`'s reason when ``value`` does not fit ``f``, else ``None``."""
    try:
        stored_value(f, value)
    except ValueProblem as exc:
        return str(exc)
    return None
