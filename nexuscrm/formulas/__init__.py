"""Salesforce formula fields compiled to SQL views (SQLite and MySQL/MariaDB/TiDB).

Semantics are Salesforce's, not plain SQL's; see ``nexuscrm.formulas.compiler``
for the rules (blank handling, runtime errors, booleans, percents, rounding)
and ``nexuscrm.formulas.syntax`` for operator precedence.  ``TODAY()`` and
``NOW()`` are UTC on both dialects (see ``nexuscrm.formulas.dialects``).

Supported: field references of the same object (case-insensitive, plus the
standard columns), cross-object references through lookups and
master-detail (``Parent__r.Field__c``, ``Account.Name``, ``Owner:User.X``;
``nexuscrm.formulas.relations``), roll-up summary fields (COUNT, SUM, MIN,
MAX with filter criteria), number / string / TRUE / FALSE / NULL literals,
``+ - * / ^``, unary ``-``, ``= == != <> < <= > >=``, ``&``, ``&&``, ``||``,
and the functions in ``SUPPORTED_FUNCTIONS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql import Select
from sqlalchemy.sql.elements import ColumnElement

from nexuscrm.errors import FatalError
from nexuscrm.packs.model import FieldSpec, ObjectSpec

from .compiler import SUPPORTED_FUNCTIONS, CompileFailure, compile_field, dependencies
from .relations import FormulaContext, ObjectRef
from .view import CreateView, DropView, view_select

__all__ = [
    "SUPPORTED_FUNCTIONS",
    "CreateView",
    "DropView",
    "FormulaContext",
    "FormulaError",
    "FormulaProblem",
    "ObjectRef",
    "build_view_select",
    "compile_formula",
    "formula_dependencies",
    "view_name",
]


class FormulaError(FatalError):
    """A formula field cannot be compiled (a NexusError; fatal: retrying cannot fix it).

    ``reason`` says why: a syntax error, an unknown field or function, a
    cross-object reference, a wrong argument count, a type error, or a cycle
    between formula fields (``formula cycle: A__c -> B__c -> A__c``).
    """

    def __init__(self, object_api_name: str, field_api_name: str, reason: str) -> None:
        super().__init__(f"formula {object_api_name}.{field_api_name}: {reason}")
        self.object_api_name = object_api_name
        self.field_api_name = field_api_name
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle by constructor arguments (the default would pass only the message).
        return (type(self), (self.object_api_name, self.field_api_name, self.reason))


@dataclass(frozen=True)
class FormulaProblem:
    """A formula field left out of a view, and why (same fields as ``FormulaError``)."""

    object_api_name: str
    field_api_name: str
    reason: str


def compile_formula(
    obj: ObjectSpec, field: FieldSpec, table: sa.Table, dialect: str
) -> ColumnElement[Any]:
    """Compile formula ``field`` of ``obj`` to one SQL expression over ``table``.

    ``table`` has the physical columns (``FieldSpec.column_names()`` plus the
    standard columns); ``dialect`` is ``'sqlite'`` or ``'mysql'`` (MariaDB and
    TiDB: ``'mysql'``).  The result is unlabeled and evaluates, per row, to
    the value the field shows: NULL for blank and for a runtime error
    (division by zero ...), 0/1 for Checkbox.  Formula fields it references
    are inlined.

    Raises ``FormulaError`` if the field cannot compile, and ``ValueError``
    for an unknown dialect name.
    """
    try:
        return compile_field(obj, field, table, dialect)
    except CompileFailure as exc:
        raise FormulaError(obj.api_name, exc.field_api_name, exc.reason) from None


def build_view_select(
    obj: ObjectSpec,
    table: sa.Table,
    dialect: str,
    context: FormulaContext | None = None,
    only: set[str] | None = None,
) -> tuple[Select[Any], list[FormulaProblem]]:
    """SELECT for ``obj``'s formula view, and the formulas left out of it.

    The select has every column of ``table`` followed by one column per
    formula or roll-up summary field that compiles, labeled with the field's
    ``api_name``, in declaration order.  ``context`` (``FormulaContext``)
    names the other objects: cross-object references (``Parent__r.Name``,
    up to 10 hops) become LEFT OUTER JOINs of the parents' tables, roll-ups
    correlated subqueries over the children's tables; without a context both
    are left out with a reason.  ``only`` (lower-case API names) selects just
    those computed fields (others still inline where referenced).  Each field
    that does not compile is
    returned as a ``FormulaProblem`` instead (never silently dropped).
    Create the view with
    ``connection.execute(CreateView(view_name(obj.api_name), select))``.

    Raises ``ValueError`` for an unknown dialect name; never ``FormulaError``.
    """
    select, problems = view_select(obj, table, dialect, context, only)
    return select, [FormulaProblem(obj.api_name, name, reason) for name, reason in problems]


def view_name(object_api_name: str) -> str:
    """Name of the formula view of an object: ``"v_" + object_api_name``."""
    return "v_" + object_api_name


def formula_dependencies(obj: ObjectSpec) -> dict[str, set[str]]:
    """Map each formula field's api_name to the same-object names it references directly.

    Referenced names are spelled as declared (fields, standard columns,
    Location ``__Latitude__s``/``__Longitude__s`` columns) or as written when
    unknown; cross-object (dotted) and ``$`` references are left out.  A
    formula that does not parse maps to an empty set.  Raises nothing.
    """
    return dependencies(obj)
