"""What a formula reaches beyond its own row: parent records and child roll-ups.

- :class:`FormulaContext` tells the compiler which other objects exist
  (``objects``: API name -> :class:`ObjectRef`, the object's spec and its
  physical table). Without one, cross-object references and roll-ups are
  refused with a reason.
- :class:`JoinSet` collects the LEFT OUTER JOINs a view needs: one alias per
  relationship path (``Account``, ``Account.Owner`` ...), shared by every
  formula of the view, in first-use order so a view's definition is stable.
  A blank lookup joins nothing, so every parent column reads NULL (blank),
  never a failed row: Salesforce's rule for blanks along a path.
- :func:`find_relationship` resolves one hop (``Parent__r``, ``Account``,
  ``Owner:User``) to the lookup column and the target object.
- :func:`split_filter_values` / :func:`filter_predicate` turn a roll-up's
  filter criteria into SQL over the child's compiled field values.

Salesforce allows 10 relationships in one formula path; deeper paths are
refused (:data:`MAX_HOPS`).
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql import FromClause

from nexuscrm.packs.model import REFERENCE_TYPES, FieldSpec, FieldType, ObjectSpec, SummaryFilter

from .dialects import DialectOps, Expr, num_lit, str_lit
from .values import Kind, Pred, Reject, Value

MAX_HOPS = 10

# Standard relationships the platform's tables do not store (no column).
UNSTORED_RELATIONSHIPS = {
    "createdby": "CreatedById",
    "lastmodifiedby": "LastModifiedById",
    "recordtype": "RecordTypeId",
}


@dataclass(frozen=True)
class ObjectRef:
    """An object another formula may reach: its spec and physical table."""

    spec: ObjectSpec
    table: sa.Table


def _no_objects(api_name: str) -> ObjectRef | None:
    return None


@dataclass(frozen=True)
class FormulaContext:
    """What the compiler may reach beyond the object itself.

    ``objects(api_name)`` returns the object (case-insensitive name) or
    ``None`` when no installed pack defines it; ``labels`` the custom labels
    (``$Label.Name`` -> value) of the installed packs; ``session_user``
    whether the database has the ``nx_session_user()`` function.
    """

    objects: Callable[[str], ObjectRef | None] = _no_objects
    labels: Mapping[str, str] = field(default_factory=dict)
    #: Whether views may call ``nx_session_user()`` (false on TiDB: no stored
    #: functions; ``$User.Id`` is then the default acting user only).
    session_user: bool = True

    @staticmethod
    def of(
        specs: Mapping[str, ObjectRef], labels: Mapping[str, str] | None = None
    ) -> FormulaContext:
        """A context over a fixed map of objects (keys matched case-insensitively)."""
        by_lower = {k.lower(): v for k, v in specs.items()}
        return FormulaContext(lambda name: by_lower.get(name.lower()), dict(labels or {}))


@dataclass
class JoinSet:
    """The outer joins of one SELECT: ``base`` plus one alias per relationship path."""

    base: sa.Table | sa.sql.Alias
    prefix: str = "j"
    joins: dict[tuple[str, ...], tuple[Any, Pred]] = field(default_factory=dict)
    counter: list[int] = field(default_factory=lambda: [0])
    # Roll-ups already joined (path + field -> their value column).
    values: dict[tuple[str, ...], Value] = field(default_factory=dict)

    def join(self, path: tuple[str, ...], fk: Expr, target: ObjectRef) -> Any:
        """The alias of ``target`` joined on ``target.Id = fk`` for ``path`` (made once)."""
        found = self.joins.get(path)
        if found is not None:
            return found[0]
        self.counter[0] += 1
        alias = target.table.alias(f"{self.prefix}{self.counter[0]}")
        self.joins[path] = (alias, alias.c.Id == fk)
        return alias

    def mark(self) -> tuple[int, int, int]:
        """Where this set stands (for :meth:`reset` after a field fails to compile)."""
        return len(self.joins), len(self.values), self.counter[0]

    def reset(self, mark: tuple[int, int, int]) -> None:
        """Forget the joins, values and alias numbers added since ``mark``, so a
        view's definition does not depend on the fields it had to leave out."""
        joins, values, counter = mark
        for key in list(self.joins)[joins:]:
            del self.joins[key]
        for key in list(self.values)[values:]:
            del self.values[key]
        self.counter[0] = counter

    def sub_alias(self, target: ObjectRef) -> Any:
        """A fresh alias of ``target`` for a roll-up's aggregate (unique in the statement)."""
        self.counter[0] += 1
        return target.table.alias(f"s{self.counter[0]}")

    def from_clause(self) -> FromClause:
        """``base LEFT OUTER JOIN a1 ON ... LEFT OUTER JOIN a2 ON ...`` (or ``base``)."""
        out: FromClause = self.base
        for alias, onclause in self.joins.values():
            out = out.outerjoin(alias, onclause)
        return out


def find_relationship(obj: ObjectSpec, name: str) -> tuple[str, str]:
    """``(lookup column, target object)`` for relationship ``name`` on ``obj``.

    ``name`` is a custom relationship (``Parent__r``: the lookup whose
    relationship name or field name matches), a standard one (``Account``:
    the reference field ``AccountId``), or ``Owner`` (the standard
    ``OwnerId`` column; ``Owner:User`` names the polymorphic type). Raises
    ``Reject`` naming the relationship when ``obj`` has none such.
    """
    rel, _, poly = name.partition(":")
    lower = rel.lower()
    for f in obj.fields:
        if f.type not in REFERENCE_TYPES or not f.reference_to:
            continue
        names = {f.api_name.lower()}
        if f.relationship_name:
            names |= {f.relationship_name.lower(), f.relationship_name.lower() + "__r"}
        if f.api_name.lower().endswith("__c"):
            names.add(f.api_name.lower()[:-3] + "__r")
        if f.api_name.lower().endswith("id"):
            names.add(f.api_name.lower()[:-2])
        if lower in names and lower != f.api_name.lower():
            target = poly or f.reference_to.split(",")[0]
            return f.api_name, target
    if lower == "owner":
        if poly and poly.lower() != "user":
            raise Reject(f"relationship {name!r}: record owners are users here (no {poly} owners)")
        return "OwnerId", "User"
    if lower in UNSTORED_RELATIONSHIPS:
        raise Reject(
            f"relationship {rel!r}: this platform does not store "
            f"{UNSTORED_RELATIONSHIPS[lower]} on {obj.api_name}"
        )
    raise Reject(f"{obj.api_name} has no relationship {rel!r}")


def child_field_name(child: str, dotted: str) -> str:
    """``Child__c.Field__c`` -> ``Field__c`` (checking the object); bare names pass."""
    obj, dot, fld = dotted.partition(".")
    if not dot:
        return dotted
    if obj.lower() != child.lower():
        raise Reject(f"roll-up names {dotted!r}, which is not a field of {child}")
    return fld


def split_filter_values(value: str) -> list[str]:
    """A roll-up filter's value list: comma-separated, double quotes around a value
    that holds a comma (``"Completed", "Closed, not Completed"``)."""
    if not value.strip():
        return [""]
    row = next(csv.reader([value], skipinitialspace=True))
    return [v.strip() for v in row]


def _literal(kind: Kind, raw: str, where: str) -> Expr:
    try:
        if kind == Kind.NUMBER:
            return num_lit(str(Decimal(raw.replace(",", ""))))
        if kind == Kind.DATE:
            return sa.literal(date.fromisoformat(raw), sa.Date())
        if kind == Kind.DATETIME:
            return sa.literal(datetime.fromisoformat(raw.replace("Z", "+00:00")), sa.DateTime())
    except (InvalidOperation, ValueError):
        raise Reject(f"{where}: {raw!r} is not a {kind}") from None
    return str_lit(raw)


def filter_predicate(ops: DialectOps, item: SummaryFilter, value: Value, where: str) -> Pred:
    """SQL that is true for a child row meeting ``item`` (``value``: the child field).

    Text criteria compare case-insensitively, as Salesforce's filter criteria
    do; a blank value in the list matches a blank field.
    """
    values = split_filter_values(item.value)
    op = item.operation
    kind = value.kind
    if kind == Kind.BOOLEAN:
        wanted = [v.lower() in ("true", "1") for v in values]
        return sa.or_(*[value.sql if w else sa.not_(value.sql) for w in wanted])
    if kind == Kind.TEXT:
        col: Expr = sa.func.lower(sa.func.coalesce(value.sql, str_lit("")))
        lowered = [v.lower() for v in values]
        if op in ("includes", "excludes"):
            padded = ops.concat([str_lit(";"), col, str_lit(";")])
            hits = [padded.contains(f";{v};", autoescape=True) for v in lowered]
        elif op in ("contains", "notContain"):
            hits = [col.contains(v, autoescape=True) for v in lowered]
        elif op == "startsWith":
            hits = [col.startswith(v, autoescape=True) for v in lowered]
        elif op in ("equals", "notEqual"):
            hits = [col == str_lit(v) for v in lowered]
        else:
            (raw,) = lowered[:1]
            return _ordered(op, col, str_lit(raw))
        anyhit = sa.or_(*hits)
        positive = op in ("equals", "includes", "contains", "startsWith")
        return anyhit if positive else sa.not_(anyhit)
    if op in ("contains", "notContain", "startsWith", "includes", "excludes"):
        raise Reject(f"{where}: {op} needs a text field, not {kind}")
    if op in ("equals", "notEqual"):
        hits = [
            (value.sql.is_(None) if v == "" else value.sql == _literal(kind, v, where))
            for v in values
        ]
        anyhit = sa.or_(*hits)
        return anyhit if op == "equals" else sa.not_(anyhit)
    (raw,) = values[:1]
    return _ordered(op, value.sql, _literal(kind, raw, where))


def _ordered(op: str, col: Expr, lit: Expr) -> Pred:
    compare = {
        "lessThan": col < lit,
        "greaterThan": col > lit,
        "lessOrEqual": col <= lit,
        "greaterOrEqual": col >= lit,
    }
    return compare[op]


def summary_result_kind(f: FieldSpec, summarized: Value | None) -> Kind:
    """COUNT and SUM are numbers; MIN / MAX take the summarized field's kind."""
    assert f.summary is not None
    if f.summary.operation in ("count", "sum") or summarized is None:
        return Kind.NUMBER
    return summarized.kind


def summary_is_percent(f: FieldSpec, context: FormulaContext) -> bool:
    """Whether roll-up ``f`` is a Percent, as Salesforce types a roll-up: like the
    field it summarizes. SUM, MIN or MAX of a Percent field (stored or formula),
    or of a roll-up that is itself one, is a Percent; COUNT is a number.

    Inside formulas a roll-up reads as a fraction, as every Percent does; the
    view shows a Percent roll-up as a percentage (``nexuscrm.formulas.view``).
    """
    seen: set[tuple[str, str]] = set()
    while f.summary is not None and f.summary.operation != "count":
        summary = f.summary
        child_name = (summary.foreign_key_field or "").partition(".")[0]
        child = context.objects(child_name) if child_name else None
        if child is None or not summary.summarized_field:
            return False
        name = summary.summarized_field.rpartition(".")[2].lower()
        key = (child.spec.api_name.lower(), name)
        if key in seen:  # a roll-up cycle (refused elsewhere)
            return False
        seen.add(key)
        target = next((x for x in child.spec.fields if x.api_name.lower() == name), None)
        if target is None:
            return False
        if target.type == FieldType.Percent:
            return True
        f = target
    return False
