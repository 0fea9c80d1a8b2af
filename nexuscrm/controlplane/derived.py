"""RebuildDerived: one view per table object exposing its formula fields.

Port of the seed's ``rebuildDerived`` (``RebuildAllViews``: always CREATE OR
REPLACE, so a view broken by a restore is healed on every apply) and the
settlement of the ``formula_view_rebuild_owed`` receipt. A formula the
compiler cannot handle is reported by object, field and reason and left out
of its view, never silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine, MetaData, Table

from nexuscrm import catalog
from nexuscrm.controlplane import lease, markers
from nexuscrm.db.dialect import create_or_replace_view, dialect_name
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.formulas import build_view_select, view_name
from nexuscrm.log import log


@dataclass(frozen=True)
class FormulaIssue:
    """A formula left out of its view, and why."""

    object_api_name: str
    field_api_name: str
    reason: str


@dataclass
class DerivedResult:
    """Views rebuilt and formulas left out."""

    views: list[str] = field(default_factory=list)
    problems: list[FormulaIssue] = field(default_factory=list)


def rebuild_derived(engine: Engine, epoch: int | None = None) -> DerivedResult:
    """Rebuild every object's view (``v_<Object>``) from live metadata.

    Each view selects the physical columns (reflected, so discovered tables
    work too) plus each formula field that compiles. Raises
    ``LeaseLostError`` when fenced out; database errors propagate (transient
    ones are retried by the activity).
    """
    cat = catalog.CACHE.get(engine)
    dialect = dialect_name(engine)
    result = DerivedResult()
    present = physical_tables(engine)
    with engine.begin() as conn:
        lease.require(conn, epoch)
        for key in sorted(cat.objects):
            obj = cat.objects[key]
            if not obj.has_table or obj.table_name not in present:
                continue
            table = Table(obj.table_name, MetaData(), autoload_with=conn)
            select, problems = build_view_select(obj.spec(), table, dialect)
            for p in problems:
                issue = FormulaIssue(p.object_api_name, p.field_api_name, p.reason)
                result.problems.append(issue)
                log.warning(
                    "formula left out of view",
                    object=issue.object_api_name,
                    field=issue.field_api_name,
                    reason=issue.reason,
                )
            name = view_name(obj.api_name)
            create_or_replace_view(conn, name, select)
            result.views.append(name)
        # A full rebuild settles any deferred-rebuild debt by definition.
        if markers.rebuild_owed(conn):
            markers.clear_rebuild_owed(conn)
    return result
