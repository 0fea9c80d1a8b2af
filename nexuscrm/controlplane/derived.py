"""RebuildDerived: one view per table object exposing its formula fields.

Port of the seed's ``rebuildDerived`` (``RebuildAllViews``: always CREATE OR
REPLACE, so a view broken by a restore is healed on every apply), of its
``deferFormulaViews`` mode with ``requireDeferFormulaViewPrecondition``, and
of the settlement of the ``formula_view_rebuild_owed`` receipt. A formula the
compiler cannot handle is reported by object, field and reason and left out
of its view, never silently.

Which views are required: the seed requires a formula view only for objects
with active formula fields; in this port every table object is served
through its ``v_<Object>`` (verify requires each), so every table object
whose table exists requires its view. Under defer a release therefore may
not introduce a new table object (ship it in a prior regular release), as
the seed says of active-formula objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine, MetaData, Table, func, inspect, select, text

from nexuscrm import catalog
from nexuscrm.controlplane import lease, markers, viewdefs
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import (
    create_or_replace_view,
    describe_error,
    dialect_name,
    is_transient,
    quote,
)
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.db.dialect import view_names as physical_views
from nexuscrm.errors import FatalError
from nexuscrm.formulas import build_view_select, view_name
from nexuscrm.log import log
from nexuscrm.packs.model import ObjectSpec


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
    refused: list[ViewRefusal] = field(default_factory=list)


@dataclass(frozen=True)
class ViewRefusal:
    """A view, or one formula of it, the database refused, and its reason.

    ``field_api_name`` is the refused formula field, or None when the
    database refused even the view of the object's columns alone.
    """

    object_api_name: str
    view: str
    field_api_name: str | None
    reason: str

    def __str__(self) -> str:
        what = f"formula {self.field_api_name}" if self.field_api_name else "its columns"
        return f"view {self.view} of {self.object_api_name} ({what}): {self.reason}"


class ViewRefusedError(FatalError):
    """The database refused views or formulas (every other view was built).

    Not retried: the refusal repeats. The message names each refused view by
    object, formula field and the database's reason.
    """

    def __init__(self, refused: list[ViewRefusal]) -> None:
        self.refused = refused
        super().__init__(
            f"the database refused {len(refused)} view(s) or formula(s); every other view "
            "was built: " + "; ".join(str(r) for r in refused)
        )


class DeferPreconditionError(FatalError):
    """A ``defer_formula_view_rebuild`` apply was refused at entry (nothing written)."""


class DeferredViewMissingError(FatalError):
    """Under defer, a required view is missing: the release introduced an object."""


def required_views(bind: Engine | Connection) -> dict[str, str]:
    """Object API name -> the view it requires (``v_<Object>``): every table object
    whose physical table exists (the objects ``rebuild_derived`` builds a view for)."""
    cat = catalog.CACHE.get(bind if isinstance(bind, Engine) else bind.engine)
    present = physical_tables(bind)
    return {
        obj.api_name: view_name(obj.api_name)
        for _key, obj in sorted(cat.objects.items())
        if obj.has_table and obj.table_name in present
    }


def _view_readable(conn: Connection, name: str) -> str | None:
    """``None`` if ``SELECT * FROM <view> LIMIT 1`` works, else the error."""
    try:
        conn.execute(text(f"SELECT * FROM {quote(conn, name)} LIMIT 1")).fetchall()
    except Exception as exc:
        return describe_error(exc)
    return None


def require_defer_precondition(engine: Engine) -> None:
    """Port of ``requireDeferFormulaViewPrecondition``: read-only entry gate of a defer apply.

    Raises ``DeferPreconditionError`` (the seed's messages) unless the
    database is already bootstrapped (metadata rows in ``_System_Object``:
    acquire-lease creates the system tables, so their existence proves
    nothing here), has an ApplyAll marker (a prior apply ran), and every
    required view exists and is readable. Idempotent, writes nothing.
    """
    with engine.connect() as conn:
        objects = conn.execute(select(func.count()).select_from(t.object_meta)).scalar_one()
    if not objects:
        raise DeferPreconditionError(
            "DeferFormulaViewRebuild requires an already-bootstrapped database; run a standard "
            "apply first (greenfield has no old-semantics serving to protect)"
        )
    if markers.read(engine) is None:
        raise DeferPreconditionError(
            "DeferFormulaViewRebuild requires a database that completed a prior apply "
            "(no control_plane_apply_all marker in _System_BootstrapState — the rebuild-owed "
            "receipt has no apply history to stand on); run a standard apply first"
        )
    views = physical_views(engine)
    with engine.connect() as conn:
        for obj, name in required_views(conn).items():
            if name not in views:
                raise DeferPreconditionError(
                    f"DeferFormulaViewRebuild precondition failed: object {obj} requires formula "
                    f"view {name} but it does not exist; either heal the inventory with a "
                    "standard apply (quiesce serving first if release metadata was already "
                    "partially applied), or this release wrongly introduces an active-formula "
                    "object under defer — cutover releases must not introduce such objects "
                    "(ship them in a prior regular release)"
                )
            problem = _view_readable(conn, name)
            if problem is not None:
                raise DeferPreconditionError(
                    f"DeferFormulaViewRebuild precondition failed: formula view {name} for "
                    f"object {obj} exists but is not readable ({problem}); heal the inventory "
                    "with a standard apply (quiesce serving first if needed) before applying "
                    "this release"
                )


def rebuild_derived(
    engine: Engine,
    epoch: int | None = None,
    *,
    defer_formula_views: bool = False,
    settle_rebuild_debt: bool = False,
) -> DerivedResult:
    """Rebuild every object's view (``v_<Object>``) from live metadata.

    Each view selects the physical columns (reflected, so discovered tables
    work too) plus each formula field that compiles. Each view is built in
    a transaction of its own: a view the database refuses (a permanent
    error) never takes the others down; its refused formulas are found one
    by one and left out, and after every other view is built the call
    raises ``ViewRefusedError`` naming each by object, field and reason.
    Raises ``LeaseLostError`` when fenced out; transient database errors
    propagate (the activity retries them).

    ``defer_formula_views`` (the seed's ``deferFormulaViews``): create or
    replace no view at all (old pods may still serve the old ones); assert
    every required view exists instead (``DeferredViewMissingError``).
    ``settle_rebuild_debt``: after a full rebuild, clear the
    ``formula_view_rebuild_owed`` receipt — honoured only on a fenced call
    (``epoch`` given: the caller holds the control-plane lease); an
    unfenced call (``epoch=None``) never settles, as the seed's unserialized
    exported ``RebuildDerived`` does not.
    """
    if defer_formula_views:
        return _assert_views_exist(engine, epoch)
    cat = catalog.CACHE.get(engine)
    dialect = dialect_name(engine)
    result = DerivedResult()
    present = physical_tables(engine)
    with engine.connect() as conn:
        lease.require(conn, epoch)
    for key in sorted(cat.objects):
        obj = cat.objects[key]
        if not obj.has_table or obj.table_name not in present:
            continue
        _build_view(engine, epoch, obj.spec(), obj.table_name, dialect, result)
    if result.refused:
        # Every other view is built; fail closed naming each refused one.
        raise ViewRefusedError(result.refused)
    with engine.begin() as conn:
        lease.require(conn, epoch)
        # A full rebuild settles deferred-rebuild debt by definition, but only
        # on a lease-holding (fenced) path.
        if settle_rebuild_debt and epoch is not None and markers.rebuild_owed(conn):
            markers.clear_rebuild_owed(conn)
            log.info("formula view rebuild debt settled", views=len(result.views))
    return result


def left_out_formulas(engine: Engine) -> list[FormulaIssue]:
    """Formula and roll-up fields no view can hold, by object, field and reason.

    Read-only: compiles every table object's view as rebuild-derived does
    (same object context), without touching the database. A field that
    compiles but is not a column of the live view was left out by the last
    rebuild because the database refused it (SQLite's parser depth, for
    example): it is listed too, with that reason, so ``status`` names every
    field the views do not hold.
    """
    cat = catalog.CACHE.get(engine)
    dialect = dialect_name(engine)
    present = physical_tables(engine)
    views = physical_views(engine)
    out: list[FormulaIssue] = []
    with engine.connect() as conn:
        context = catalog.formula_context(conn, cat)
        insp = inspect(conn)
        for key in sorted(cat.objects):
            obj = cat.objects[key]
            if not obj.has_table or obj.table_name not in present:
                continue
            spec = obj.spec()
            computed = [f for f in spec.fields if f.is_formula or f.summary is not None]
            if not computed:
                continue
            table = Table(obj.table_name, MetaData(), autoload_with=conn)
            _select, problems = build_view_select(spec, table, dialect, context)
            out += [FormulaIssue(p.object_api_name, p.field_api_name, p.reason) for p in problems]
            name = view_name(spec.api_name)
            if name not in views:
                continue  # no view at all: verify and rebuild-derived report it
            held = {c["name"].lower() for c in insp.get_columns(name)}
            compiler_left = {p.field_api_name.lower() for p in problems}
            out += [
                FormulaIssue(
                    spec.api_name,
                    f.api_name,
                    "not in the view: the database refused it at the last rebuild-derived "
                    "(its detail gives the database's reason)",
                )
                for f in computed
                if f.api_name.lower() not in held | compiler_left
            ]
    return out


def _try_view(
    engine: Engine,
    epoch: int | None,
    spec: ObjectSpec,
    table_name: str,
    dialect: str,
    only: set[str] | None = None,
) -> tuple[list[FormulaIssue], str | None]:
    """Create or replace ``spec``'s view in a transaction of its own.

    Returns the formulas the compiler left out and ``None``, or the
    database's reason when it refused the view (the old view, if any, stays).
    Transient errors and a lost lease propagate (the phase is retried or
    fenced out).
    """
    try:
        with engine.begin() as conn:
            lease.require(conn, epoch)
            table = Table(table_name, MetaData(), autoload_with=conn)
            context = catalog.formula_context(conn, catalog.CACHE.get(engine))
            select_, problems = build_view_select(spec, table, dialect, context, only)
            create_or_replace_view(conn, view_name(spec.api_name), select_)
            # What verify compares the view with (the last accepted build wins).
            viewdefs.record(conn, view_name(spec.api_name), select_)
    except FatalError:
        raise
    except Exception as exc:
        if is_transient(exc):
            raise
        return [], describe_error(exc, 500)
    return [FormulaIssue(p.object_api_name, p.field_api_name, p.reason) for p in problems], None


def _build_view(
    engine: Engine,
    epoch: int | None,
    spec: ObjectSpec,
    table_name: str,
    dialect: str,
    result: DerivedResult,
) -> None:
    """Build one object's view; on a refusal, find the formulas the database refuses.

    The view is then built with its columns and every formula the database
    accepts, each refused formula recorded in ``result.refused`` with the
    database's reason (``field_api_name`` None: even the columns alone were
    refused, and the object has no new view).
    """
    name = view_name(spec.api_name)
    problems, refused = _try_view(engine, epoch, spec, table_name, dialect)
    if refused is None:
        for issue in problems:
            result.problems.append(issue)
            log.warning(
                "formula left out of view",
                object=issue.object_api_name,
                field=issue.field_api_name,
                reason=issue.reason,
            )
        result.views.append(name)
        return
    computed = [f for f in spec.fields if f.is_formula or f.summary is not None]
    _, base_refused = _try_view(engine, epoch, spec, table_name, dialect, only=set())
    if base_refused is not None:
        result.refused.append(ViewRefusal(spec.api_name, name, None, base_refused))
        log.error("view refused", object=spec.api_name, view=name, reason=base_refused)
        return
    # Each computed field on its own, beside those accepted so far; the spec
    # keeps every field, so a formula that references a refused one is tried
    # (and refused) with the database's own reason, not "unknown field".
    accepted: set[str] = set()
    for f in computed:
        key = f.api_name.lower()
        left_out, reason = _try_view(
            engine, epoch, spec, table_name, dialect, only={*accepted, key}
        )
        own = [p for p in left_out if p.field_api_name == f.api_name]
        if reason is None and own:
            result.problems.extend(own)  # the compiler left it out, with its reason
            continue
        if reason is None:
            accepted.add(key)
            continue
        if _is_backend_limit(reason):
            # Not a defect of the database or of the compiler: this backend
            # cannot hold an expression this deep. Left out with the reason.
            issue = FormulaIssue(
                spec.api_name, f.api_name, f"the database cannot evaluate it here: {reason}"
            )
            result.problems.append(issue)
            log.warning("formula left out of view", object=spec.api_name, field=f.api_name,
                        reason=issue.reason)  # fmt: skip
            continue
        result.refused.append(ViewRefusal(spec.api_name, name, f.api_name, reason))
        log.error("formula refused", object=spec.api_name, field=f.api_name, reason=reason)
    # The view is left with the columns and the accepted fields: rebuild it so
    # (the last trial may have been refused).
    _try_view(engine, epoch, spec, table_name, dialect, only=accepted)
    result.views.append(name)


# Limits of a backend's SQL parser, not errors in the formula or the database.
_BACKEND_LIMITS = ("parser stack overflow", "Expression tree is too large")


def _is_backend_limit(reason: str) -> bool:
    return any(marker in reason for marker in _BACKEND_LIMITS)


def _assert_views_exist(engine: Engine, epoch: int | None) -> DerivedResult:
    result = DerivedResult()
    views = physical_views(engine)
    with engine.connect() as conn:
        lease.require(conn, epoch)
        for obj, name in required_views(conn).items():
            if name not in views:
                raise DeferredViewMissingError(
                    f"formula view {name} for {obj} is missing under DeferFormulaViewRebuild; "
                    "cutover releases must not introduce active-formula objects — ship the "
                    "object in a prior regular release (roll forward)"
                )
            result.views.append(name)
    log.info("formula view rebuild deferred; required views exist", views=len(result.views))
    return result
