"""Global references in formulas: ``$CustomMetadata``, ``$Label`` and the ones a view
cannot hold.

- ``$CustomMetadata.Type__mdt.Record.Field__c`` reads the installed record of
  the custom metadata type (``DeveloperName = 'Record'``) as a scalar
  subquery, so the view follows what the last ApplyAll installed.
- ``$Label.Name`` is the custom label's value from the project's ``labels/``
  (``FormulaContext.labels``), compiled as a literal.
- ``$User``, ``$Profile``, ``$UserRole``, ``$Permission`` (the acting user),
  ``$Organization``, ``$Setup``, ``$Api`` and ``$System`` are refused with the
  reason: a formula view is one SQL definition shared by every reader, with
  no session, organization record, custom-setting hierarchy or API endpoint
  to read from (MariaDB does not allow session variables in a view).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa

from .dialects import Expr, str_lit
from .syntax import Ref
from .values import Kind, Reject, Value, kind_of_field_type

if TYPE_CHECKING:
    from .compiler import FormulaCompiler

_UNSUPPORTED = {
    "$user": "the acting user is not known to a database view (one definition serves every "
    "reader; MariaDB allows no session variable in a view)",
    "$profile": "the acting user's profile is not known to a database view",
    "$userrole": "the acting user's role is not known to a database view",
    "$permission": "the acting user's permissions are not known to a database view",
    "$organization": "this platform stores no organization record for a view to read",
    "$setup": "custom settings hierarchies (org, profile, user) are not installed by this platform",
    "$api": "API endpoints and session ids exist only inside Salesforce",
    "$system": "$System.OriginDateTime is not supported; use a date literal",
    "$recordtype": "this platform does not store record types",
}


def global_value(c: FormulaCompiler, node: Ref) -> Value:
    """The value of ``$…`` reference ``node``; ``Reject`` with a reason otherwise."""
    head = node.parts[0].lower()
    if head == "$custommetadata":
        return _custom_metadata(c, node)
    if head == "$label":
        if len(node.parts) != 2:
            raise Reject(f"{node.dotted!r}: write $Label.<LabelName>")
        labels = {k.lower(): v for k, v in c.context.labels.items()}
        value = labels.get(node.parts[1].lower())
        if value is None:
            raise Reject(f"custom label {node.parts[1]!r} is not defined in the project's labels/")
        return Value(Kind.TEXT, str_lit(value), nonnull=True, const_text=value)
    reason = _UNSUPPORTED.get(head)
    if reason is not None:
        raise Reject(f"global variable {node.dotted!r} is not supported: {reason}")
    raise Reject(f"unknown global variable {node.parts[0]!r} in {node.dotted!r}")


def _custom_metadata(c: FormulaCompiler, node: Ref) -> Value:
    if len(node.parts) != 4:
        raise Reject(f"{node.dotted!r}: write $CustomMetadata.<Type__mdt>.<Record>.<Field__c>")
    _, type_name, record, field_name = node.parts
    target = c.context.objects(type_name)
    if target is None or not type_name.lower().endswith("__mdt"):
        raise Reject(f"{node.dotted!r}: no installed custom metadata type {type_name}")
    spec = next((f for f in target.spec.fields if f.api_name.lower() == field_name.lower()), None)
    if spec is None:
        raise Reject(f"{node.dotted!r}: {type_name} has no field {field_name}")
    kind = kind_of_field_type(spec.type)
    if kind is None or spec.formula is not None or not spec.column_names():
        raise Reject(f"{node.dotted!r}: field {field_name} cannot be read in a formula")
    if type_name.lower() == c.obj.api_name.lower():
        raise Reject(f"{node.dotted!r}: a custom metadata type cannot read its own records")
    c.joins.counter[0] += 1
    rows = target.table.alias(f"m{c.joins.counter[0]}")
    column = rows.c[spec.column_names()[0]]
    sql: Expr = (
        sa.select(column).where(rows.c.DeveloperName == str_lit(record)).limit(1).scalar_subquery()
    )
    if kind == Kind.NUMBER:
        sql = c.ops.number(sql)
    elif kind == Kind.BOOLEAN:
        return Value(kind, sa.func.coalesce(sql, 0) == 1)
    return Value(kind, sql)
