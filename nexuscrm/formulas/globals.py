"""Global references in formulas: ``$User``, ``$Organization``, ``$Setup``,
``$CustomMetadata``, ``$Label``, and the ones a view cannot hold.

- ``$User.Id`` is the acting user: the database session's own
  (``nx_session_user()``, see :mod:`nexuscrm.db.session`), else the default
  acting user (the ``User.Id`` row of ``_System_FormulaGlobal``), else blank.
  ``$User.<Field>`` reads that user's row of the installed ``User`` object
  (one LEFT OUTER JOIN per view), formulas and relationships included.
- ``$Organization.<Field>`` reads the ``Organization.<Field>`` row of
  ``_System_FormulaGlobal`` (``nexusctl formulas set-global``), at query time.
- ``$Setup.<Setting__c>.<Field__c>`` reads the hierarchy custom setting's
  record for the acting user (``SetupOwnerId`` = the user), else its
  organization-level record (``SetupOwnerId`` starting ``00D``); profile-level
  records are not consulted (this platform stores no profiles).
- ``$CustomMetadata.Type__mdt.Record.Field__c`` reads the installed record of
  the custom metadata type (``DeveloperName = 'Record'``) as a scalar
  subquery, so the view follows what the last ApplyAll installed.
- ``$Label.Name`` is the custom label's value from the project's ``labels/``
  (``FormulaContext.labels``), compiled as a literal.
- ``$Profile``, ``$UserRole``, ``$Permission``, ``$Api``, ``$System`` and
  ``$RecordType`` are refused with the reason (nothing here stores them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa

from nexuscrm.clock import utcnow
from nexuscrm.db.tables import formula_global
from nexuscrm.packs.model import FieldSpec

from .dialects import Expr, str_lit
from .syntax import Ref
from .values import Kind, Reject, Value, kind_of_field_type

if TYPE_CHECKING:
    from .compiler import FormulaCompiler

_UNSUPPORTED = {
    "$profile": "this platform stores no profiles",
    "$userrole": "this platform stores no user roles",
    "$permission": "this platform stores no custom permissions",
    "$api": "API endpoints and session ids exist only inside Salesforce",
    "$system": "$System.OriginDateTime is not supported; use a date literal",
    "$recordtype": "this platform does not store record types",
}

#: ``$Organization`` fields a formula may read, with their kinds (Salesforce's
#: Organization object; compound Address and the org's limits are left out).
ORGANIZATION_FIELDS: dict[str, Kind] = {
    name: Kind.TEXT
    for name in (
        "Id", "Name", "Division", "Street", "City", "State", "StateCode", "PostalCode",
        "Country", "CountryCode", "Phone", "Fax", "PrimaryContact", "DefaultLocaleSidKey",
        "LanguageLocaleKey", "TimeZoneSidKey", "OrganizationType", "InstanceName",
        "NamespacePrefix", "UiSkin",
    )
}  # fmt: skip
ORGANIZATION_FIELDS.update({"FiscalYearStartMonth": Kind.NUMBER, "IsSandbox": Kind.BOOLEAN})

#: Names ``_System_FormulaGlobal`` may hold: the default acting user and the
#: organization's fields.
GLOBAL_NAMES: tuple[str, ...] = ("User.Id", *(f"Organization.{n}" for n in ORGANIZATION_FIELDS))


def canonical_global_name(name: str) -> str:
    """``organization.name`` -> ``Organization.Name``; raises ``ValueError``
    naming the accepted names when ``name`` is none of :data:`GLOBAL_NAMES`."""
    by_lower = {n.lower(): n for n in GLOBAL_NAMES}
    found = by_lower.get(name.strip().lower())
    if found is None:
        raise ValueError(
            f"{name!r} is not a formula global; use User.Id or Organization.<Field> "
            f"({', '.join(ORGANIZATION_FIELDS)})"
        )
    return found


def _stored(c: FormulaCompiler, name: str) -> Expr:
    """``(SELECT Value FROM _System_FormulaGlobal WHERE Name = name)``."""
    c.joins.counter[0] += 1
    g = formula_global.alias(f"g{c.joins.counter[0]}")
    return sa.select(g.c.Value).where(g.c.Name == str_lit(name)).limit(1).scalar_subquery()


def acting_user(c: FormulaCompiler) -> Expr:
    """SQL for the acting user's Id: the session's, else the default one, else NULL."""
    default = _stored(c, "User.Id")
    if not c.context.session_user:
        return default
    return sa.func.coalesce(sa.func.nullif(sa.func.nx_session_user(), str_lit("")), default)


def global_value(c: FormulaCompiler, node: Ref, scope: FieldSpec) -> Value:
    """The value of ``$…`` reference ``node`` in formula field ``scope``;
    ``Reject`` with a reason otherwise."""
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
    if head == "$user":
        return _user(c, node, scope)
    if head == "$organization":
        return _organization(c, node)
    if head == "$setup":
        return _setup(c, node, scope)
    reason = _UNSUPPORTED.get(head)
    if reason is not None:
        raise Reject(f"global variable {node.dotted!r} is not supported: {reason}")
    raise Reject(f"unknown global variable {node.parts[0]!r} in {node.dotted!r}")


def _user(c: FormulaCompiler, node: Ref, scope: FieldSpec) -> Value:
    if len(node.parts) < 2:
        raise Reject(f"{node.dotted!r}: write $User.<Field>")
    if len(node.parts) == 2 and node.parts[1].lower() == "id":
        return Value(Kind.TEXT, acting_user(c))
    user = c.context.objects("User")
    if user is None:
        raise Reject(
            f"{node.dotted!r}: no installed pack defines the User object "
            "(only $User.Id is known without it)"
        )
    return c.joined(("$user",), acting_user(c), user, Ref(node.parts[1:]), scope)


def _organization(c: FormulaCompiler, node: Ref) -> Value:
    if len(node.parts) != 2:
        raise Reject(f"{node.dotted!r}: write $Organization.<Field>")
    try:
        name = canonical_global_name(f"Organization.{node.parts[1]}")
    except ValueError as exc:
        raise Reject(f"{node.dotted!r}: {exc}") from None
    kind = ORGANIZATION_FIELDS[name.partition(".")[2]]
    sql = _stored(c, name)
    if kind == Kind.NUMBER:
        return Value(kind, c.ops.number(sa.cast(sql, sa.Integer())))
    if kind == Kind.BOOLEAN:
        return Value(kind, sa.func.lower(sa.func.coalesce(sql, str_lit(""))).in_(["true", "1"]))
    return Value(kind, sql)


def _setup(c: FormulaCompiler, node: Ref, scope: FieldSpec) -> Value:
    if len(node.parts) != 3:
        raise Reject(f"{node.dotted!r}: write $Setup.<Setting__c>.<Field__c>")
    setting = c.context.objects(node.parts[1])
    if setting is None:
        raise Reject(f"{node.dotted!r}: no installed pack defines {node.parts[1]}")
    owner = setting.table.c.get("SetupOwnerId")
    if owner is None:
        raise Reject(
            f"{node.dotted!r}: {setting.spec.api_name} is not a hierarchy custom setting "
            "(it has no SetupOwnerId)"
        )
    c.joins.counter[0] += 1
    rows = setting.table.alias(f"s{c.joins.counter[0]}")
    user = acting_user(c)
    mine = rows.c.SetupOwnerId == user
    # The acting user's record, else the organization-level one.
    pick = (
        sa.select(rows.c.Id)
        .where(sa.or_(mine, rows.c.SetupOwnerId.like(str_lit("00D%"))))
        .order_by(sa.case((mine, 0), else_=1), rows.c.Id)
        .limit(1)
        .scalar_subquery()
    )
    path = ("$setup", setting.spec.api_name.lower())
    return c.joined(path, pick, setting, Ref(node.parts[2:]), scope)


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


def read_globals(conn: sa.Connection) -> dict[str, str | None]:
    """The formula globals stored in ``_System_FormulaGlobal`` (name -> value)."""
    g = formula_global
    rows = conn.execute(sa.select(g.c.Name, g.c.Value).order_by(g.c.Name))
    return {row.Name: row.Value for row in rows}


def write_global(conn: sa.Connection, name: str, value: str | None) -> str:
    """Store (``value`` None: remove) formula global ``name``; views read it at once.

    ``name`` is matched case-insensitively against :data:`GLOBAL_NAMES`;
    ``FiscalYearStartMonth`` must be 1-12 and ``IsSandbox`` true or false.
    Returns the canonical name. Raises ``ValueError`` naming the name or the
    value.
    """
    canon = canonical_global_name(name)
    g = formula_global
    conn.execute(sa.delete(g).where(g.c.Name == canon))
    if value is None:
        return canon
    field = canon.partition(".")[2]
    kind = ORGANIZATION_FIELDS.get(field) if canon.startswith("Organization.") else Kind.TEXT
    text = value.strip()
    if kind == Kind.NUMBER and not (text.isdigit() and 1 <= int(text) <= 12):
        raise ValueError(f"{canon}: {value!r} is not a month number 1-12")
    if kind == Kind.BOOLEAN:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{canon}: {value!r} is not true or false")
        text = text.lower()
    if not text:
        raise ValueError(f"{canon}: the value is blank (unset it instead)")
    if len(text) > 255:
        raise ValueError(f"{canon}: the value has {len(text)} characters (at most 255)")
    conn.execute(sa.insert(g).values(Name=canon, Value=text, LastModifiedDate=utcnow()))
    return canon
