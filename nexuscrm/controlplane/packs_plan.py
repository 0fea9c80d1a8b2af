"""Plan validation of packs against the catalog: every problem of a plan at once.

The one function plan-packs (ApplyAll's plan phase) and ``nexusctl packs
import-sfdx`` both call (:func:`plan_problems`), and the resolution rules
apply-packs follows (:func:`resolve_object`), so the dry run, the plan and the
apply never disagree.

Rules for one pack, checked against the catalog as the earlier packs of the
plan would leave it:

- an object the pack defines must not be owned by another pack;
- an object it extends (a standard object, or a ``__c`` folder without an
  object file) must be defined by an earlier pack or the catalog; a
  namespaced object (``ns__X__c``, ``package_namespace`` set) nobody defines
  is provided by the pack itself (a table it owns, with the fields it
  declares), unless a pack it depends on declares that namespace (then that
  pack must define it);
- a lookup must point at a known object;
- a field must not be owned by another pack, nor change type family, nor
  shrink its stored column (a shorter Text length, fewer Number digits);
- a customization (a standard field declared in source) merges into the field
  an earlier pack defines (a system column or a compound address is a no-op);
  a field nobody defines becomes the pack's own when the file gives its type,
  else it is a problem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nexuscrm import catalog
from nexuscrm.db.dialect import column_type, size_change
from nexuscrm.errors import PackProblems, Problem
from nexuscrm.packs.model import (
    NUMERIC_TYPES,
    STANDARD_COLUMNS,
    TEXT_TYPES,
    FieldCustomization,
    FieldSpec,
    FieldType,
    ObjectSpec,
    PackManifest,
)
from nexuscrm.packs.sfdx import walk_object_folders

# Field types whose stored columns are interchangeable; a change across
# families would need a data migration, so apply refuses it (fails closed).
TYPE_FAMILIES: dict[FieldType, str] = {
    **{t_: "text" for t_ in TEXT_TYPES},
    **{t_: "number" for t_ in NUMERIC_TYPES},
    FieldType.Checkbox: "checkbox",
    FieldType.Date: "date",
    FieldType.DateTime: "datetime",
    FieldType.Time: "time",
    FieldType.Lookup: "reference",
    FieldType.MasterDetail: "reference",
    FieldType.Location: "location",
    FieldType.Summary: "summary",
}

_SYSTEM_COLUMNS = frozenset(c.lower() for c in STANDARD_COLUMNS)


@dataclass
class PlanState:
    """What the catalog would hold after the packs checked so far."""

    objects: dict[str, str]  # object lower -> owning pack ('' discovered)
    fields: dict[tuple[str, str], str]  # (object, field) lower -> owning pack
    stored: dict[tuple[str, str], FieldSpec]  # stored fields (catalog and planned)
    namespaces: dict[str, str] = field(default_factory=dict)  # pack -> namespace

    @classmethod
    def of(cls, cat: catalog.Catalog) -> PlanState:
        """The state of a live catalog."""
        stored = {
            (o.api_name.lower(), f.api_name.lower()): f
            for o in cat.objects.values()
            for f in o.fields
            if f.is_stored
        }
        objects = {k: o.pack_name for k, o in cat.objects.items()}
        return cls(objects, dict(cat.field_owners), stored)


@dataclass(frozen=True)
class ObjectResolution:
    """How apply treats one object of a pack.

    ``own``: the pack creates / owns the object (its ``_System_Object`` row);
    ``fields``: the fields the pack owns on it (declared ones plus
    customizations that became its own); ``merges``: customizations merged
    into fields other packs define (system columns and compound addresses left
    out: nothing to write).
    """

    own: bool
    fields: tuple[FieldSpec, ...]
    merges: tuple[FieldCustomization, ...]


def _is_compound(obj_key: str, name: str, state: PlanState) -> bool:
    """``MailingAddress`` when ``MailingStreet`` exists (a compound address field)."""
    lower = name.lower()
    return lower.endswith("address") and (obj_key, lower[:-7] + "street") in state.fields


def resolve_object(pack: PackManifest, o: ObjectSpec, state: PlanState) -> ObjectResolution:
    """Decide ownership and customizations of ``o`` against ``state`` (no checks)."""
    key = o.api_name.lower()
    owner = state.objects.get(key)
    own = not o.extends or (
        o.package_namespace is not None
        and owner in (None, pack.name)
        and not _provider(pack, o, state)
    )
    fields = list(o.fields)
    merges: list[FieldCustomization] = []
    for c in o.customizations:
        fkey = (key, c.api_name.lower())
        if c.api_name.lower() in _SYSTEM_COLUMNS or _is_compound(key, c.api_name, state):
            continue
        if state.fields.get(fkey) not in (None, pack.name):
            merges.append(c)
        elif c.spec is not None:
            fields.append(c.spec)
    return ObjectResolution(own, tuple(fields), tuple(merges))


def _provider(pack: PackManifest, o: ObjectSpec, state: PlanState) -> str | None:
    """A pack ``pack`` depends on that declares ``o``'s namespace, if any."""
    for dep in pack.depends_on:
        if o.package_namespace and state.namespaces.get(dep) == o.package_namespace:
            return dep
    return None


class _Locator:
    """File of an object / field of a Salesforce DX pack (else ``pack <name>``)."""

    def __init__(self, pack: PackManifest) -> None:
        self.pack = pack
        self.folders: dict[str, Path] = {}
        src = Path(pack.source) if pack.source and "://" not in pack.source else None
        if src is not None and src.is_dir():
            for folder in walk_object_folders(src):
                self.folders.setdefault(folder.name.lower(), folder)

    def where(self, obj: str, fld: str | None = None) -> str:
        folder = self.folders.get(obj.lower())
        if folder is None:
            return f"pack {self.pack.name}"
        if fld is not None:
            path = folder / "fields" / f"{fld}.field-meta.xml"
            if path.is_file():
                return str(path)
        meta = folder / f"{folder.name}.object-meta.xml"
        return str(meta) if meta.is_file() else str(folder)


def _check(pack: PackManifest, state: PlanState, problems: list[Problem]) -> None:
    loc = _Locator(pack)
    known = set(state.objects) | {o.api_name.lower() for o in pack.objects}

    def add(obj: str, fld: str | None, message: str) -> None:
        element = f"{obj}.{fld}" if fld else obj
        problems.append(Problem(loc.where(obj, fld), element, message))

    for o in pack.objects:
        key = o.api_name.lower()
        res = resolve_object(pack, o, state)
        owner = state.objects.get(key)
        if o.extends and not res.own:
            provider = _provider(pack, o, state)
            if owner is None and provider is not None:
                add(
                    o.api_name,
                    None,
                    f"object of package {o.package_namespace}: pack {provider} "
                    f"(namespace {o.package_namespace}) does not define it",
                )
            elif owner is None and o.api_name.endswith(("__c", "__mdt", "__e")):
                # A custom object folder with fields but no object file.
                add(
                    o.api_name,
                    None,
                    f"the object file is missing: no {o.api_name}.object-meta.xml defines "
                    f"this custom object (and no installed pack defines {o.api_name})",
                )
            elif owner is None:
                add(
                    o.api_name,
                    None,
                    "extends a standard object that neither the platform nor "
                    "an installed pack defines",
                )
        elif owner not in (None, "", pack.name):
            ns = f" (an object of package {o.package_namespace})" if o.package_namespace else ""
            add(o.api_name, None, f"is already owned by pack {owner}{ns}")
        for f in res.fields:
            _check_field(pack, o, f, state, known, add)
        for c in res.merges:
            old = state.stored.get((key, c.api_name.lower()))
            spec = c.spec
            if (
                spec is not None
                and spec.is_stored
                and old is not None
                and TYPE_FAMILIES[old.type] != TYPE_FAMILIES[spec.type]
            ):
                add(
                    o.api_name,
                    c.api_name,
                    f"declared as {spec.type}, but the field "
                    f"pack {state.fields[(key, c.api_name.lower())]} defines is {old.type}",
                )
        for c in o.customizations:
            fkey = (key, c.api_name.lower())
            if c.spec is None and c not in res.merges and fkey not in state.fields:
                if c.api_name.lower() in _SYSTEM_COLUMNS or _is_compound(key, c.api_name, state):
                    continue
                add(
                    o.api_name,
                    c.api_name,
                    "standard field that neither the platform nor an "
                    "installed pack defines, and its file gives no <type> (and <referenceTo>)",
                )


def _check_field(
    pack: PackManifest,
    o: ObjectSpec,
    f: FieldSpec,
    state: PlanState,
    known: set[str],
    add: Callable[[str, str | None, str], None],
) -> None:
    key = o.api_name.lower()
    fkey = (key, f.api_name.lower())
    if f.reference_to and f.reference_to.lower() not in known:
        add(
            o.api_name,
            f.api_name,
            f"references unknown object {f.reference_to} (neither the "
            "platform nor an installed pack defines it)",
        )
    owner = state.fields.get(fkey)
    if owner not in (None, "", pack.name):
        add(o.api_name, f.api_name, f"is already owned by pack {owner}")
    old = state.stored.get(fkey)
    if old is not None and f.is_stored and TYPE_FAMILIES[old.type] != TYPE_FAMILIES[f.type]:
        add(
            o.api_name,
            f.api_name,
            f"changes type from {old.type} to {f.type}; a stored "
            "column cannot change type family in place (migrate the data to a new field "
            "instead)",
        )
    elif old is not None and f.is_stored:
        shrink = _shrink(old, f)
        if shrink:
            add(
                o.api_name,
                f.api_name,
                f"{shrink}; a stored column cannot shrink in place (values already stored "
                "may not fit): keep the size, or migrate the data to a new field",
            )


def _size(f: FieldSpec) -> str:
    """A stored field's declared size as the user wrote it: a length or precision/scale."""
    type_ = column_type(f, "mysql")
    precision, scale = getattr(type_, "precision", None), getattr(type_, "scale", None)
    if precision is not None:
        return f"precision {precision}, scale {scale}"
    return f"length {getattr(type_, 'length', None) or 'TEXT'}"


def _shrink(old: FieldSpec, new: FieldSpec) -> str:
    """``"<size> shrinks to <size>"`` when ``new``'s column holds less than ``old``'s
    (:func:`nexuscrm.db.dialect.size_change`), else ``""``."""
    if size_change(column_type(old, "mysql"), column_type(new, "mysql")) != "narrower":
        return ""
    return f"{_size(old)} shrinks to {_size(new)}"


def record_pack(pack: PackManifest, state: PlanState) -> None:
    """Update ``state`` with what applying ``pack`` would own."""
    if pack.namespace:
        state.namespaces[pack.name] = pack.namespace
    for o in pack.objects:
        key = o.api_name.lower()
        res = resolve_object(pack, o, state)
        if res.own:
            state.objects[key] = pack.name
        for f in res.fields:
            state.fields[(key, f.api_name.lower())] = pack.name
            if f.is_stored:
                state.stored.setdefault((key, f.api_name.lower()), f)


def plan_problems(cat: catalog.Catalog, packs: Sequence[PackManifest]) -> list[Problem]:
    """Every problem of an ordered plan, each naming file (or pack) and element.

    Each pack is checked against the catalog as the earlier packs of the plan
    would leave it. Empty when the plan can be applied.
    """
    state = PlanState.of(cat)
    problems: list[Problem] = []
    for pack in packs:
        _check(pack, state, problems)
        record_pack(pack, state)
    return problems


def validate_plan(cat: catalog.Catalog, packs: Sequence[PackManifest]) -> None:
    """Raise ``PackProblems`` (every problem, grouped by file) unless the plan applies."""
    problems = plan_problems(cat, packs)
    if problems:
        raise PackProblems(_packs_with(packs, problems), problems)


def _packs_with(packs: Sequence[PackManifest], problems: list[Problem]) -> str:
    """The names of the packs a problem names a file of (its source, a file under
    it, or ``pack <name>``), for the error's head; every app pack of the plan when
    none matches. It used to list every pack of the plan, the faulty one among a
    dozen (a new user's trial)."""
    files = {p.file for p in problems}

    def named(pack: PackManifest) -> bool:
        src = pack.source.rstrip("/")
        if f"pack {pack.name}" in files or pack.name in files:
            return True
        return bool(src) and any(f == src or f.startswith(src + "/") for f in files)

    hit = [p.name for p in packs if named(p)]
    apps = [p.name for p in packs if p.category.rank >= 4]
    return ", ".join(dict.fromkeys(hit or apps)) or "plan"
