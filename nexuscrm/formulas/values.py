"""The typed values a formula compiles to, and the small predicates over them.

:class:`Value` is one compiled sub-expression (formula type, SQL, error
predicate); :class:`Kind` the formula types; :class:`Reject` /
:class:`ArgType` the compiler's internal refusals, turned into
:class:`CompileFailure` for the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.elements import ColumnElement

from nexuscrm.packs.model import (
    NUMERIC_TYPES,
    REFERENCE_TYPES,
    TEXT_TYPES,
    FieldType,
)

from .dialects import Expr, int_lit

Pred = ColumnElement[Any]


class Kind(StrEnum):
    """Formula data types (Salesforce's, collapsed to what behaves differently)."""

    NUMBER = "number"
    TEXT = "text"
    BOOLEAN = "boolean"
    DATE = "date"
    DATETIME = "datetime"
    TIME = "time"
    LOCATION = "location"  # GEOLOCATION() or a Location field: sql is the latitude
    NULL = "null"  # the NULL literal: fits any type


class CompileFailure(Exception):
    """A formula cannot compile; ``field_api_name`` is the formula it belongs to."""

    def __init__(self, field_api_name: str, reason: str) -> None:
        super().__init__(reason)
        self.field_api_name = field_api_name
        self.reason = reason


class Reject(Exception):
    def __init__(self, reason: str, *, cycle: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.cycle = cycle


@dataclass(frozen=True, eq=False)  # eq=False: == on SQL expressions builds SQL
class Value:
    """A compiled sub-expression.

    ``sql`` is a predicate for BOOLEAN, a scalar otherwise.  ``err`` is true
    where evaluation fails at run time (None: cannot fail).  ``const`` holds a
    numeric literal's value so ROUND can fold its digits; ``nonnull`` marks
    text that is never NULL (literals, concatenations), which needs no
    COALESCE when concatenated.  ``picklist`` names the picklist field a raw
    picklist reference reads (Salesforce only lets a few functions take one);
    ``multiselect`` marks a multi-select picklist (INCLUDES' first argument).
    A LOCATION value's ``sql`` is its latitude and ``lon`` its longitude.
    """

    kind: Kind
    sql: Expr
    err: Pred | None = None
    const: Decimal | None = None
    nonnull: bool = False
    picklist: str | None = None
    multiselect: bool = False
    lon: Expr | None = None
    const_text: str | None = None


STANDARD_KINDS: dict[str, Kind] = {
    "Id": Kind.TEXT,
    "Name": Kind.TEXT,
    "OwnerId": Kind.TEXT,
    "CreatedDate": Kind.DATETIME,
    "LastModifiedDate": Kind.DATETIME,
    "IsDeleted": Kind.BOOLEAN,
}


def kind_of_field_type(ftype: FieldType) -> Kind | None:
    """The formula type a field of ``ftype`` reads as (None: not readable in a formula)."""
    if ftype in TEXT_TYPES or ftype in REFERENCE_TYPES:
        return Kind.TEXT
    if ftype in NUMERIC_TYPES:
        return Kind.NUMBER
    return {
        FieldType.Checkbox: Kind.BOOLEAN,
        FieldType.Date: Kind.DATE,
        FieldType.DateTime: Kind.DATETIME,
        FieldType.Time: Kind.TIME,
    }.get(ftype)


def or_errs(*errs: Pred | None) -> Pred | None:
    present = [e for e in errs if e is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else sa.or_(*present)


def errs_of(*values: Value) -> Pred | None:
    return or_errs(*(v.err for v in values))


def bool_value(p: Expr) -> Expr:
    """Predicate -> 1 / 0 / NULL (keeps 'unknown' unknown)."""
    return sa.case((p, int_lit(1)), (sa.not_(p), int_lit(0)), else_=sa.null())


def truthy(p: Expr) -> Pred:
    """Predicate -> never-NULL predicate (unknown counts as false, as a Checkbox does)."""
    return sa.case((p, int_lit(1)), else_=int_lit(0)) == int_lit(1)


class ArgType(Exception):
    """A function argument of the wrong type; the caller names the function."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
