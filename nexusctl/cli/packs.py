"""``nexusctl packs ...``: import a Salesforce DX project as an app pack, remove a pack."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.table import Table
from sqlalchemy import Engine

from nexuscrm import catalog
from nexuscrm.catalog import object_table, spec_context
from nexuscrm.connectors.incarnations import FAILURE_PACK_REMOVED, fail_removed_items
from nexuscrm.contracts.controlplane_queue import RemovePackInput
from nexuscrm.controlplane.packs_apply import load_plan, removal_problem
from nexuscrm.controlplane.packs_plan import PlanState, plan_problems, record_pack, resolve_object
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.errors import NexusError, PackProblems
from nexuscrm.formulas import build_view_select, view_name
from nexuscrm.packs.model import Category, ObjectSpec, PackManifest
from nexusctl.cli.common import existing_engine, load_settings
from nexusctl.cli.controlplane import run_operation
from nexusctl.cli.render import (
    console,
    fail,
    print_problems,
    require_engine,
    usage_fail,
    warn,
)

packs_app = typer.Typer(help="Pack tools.", no_args_is_help=True)


@packs_app.command("remove")
def packs_remove(
    name: str,
    no_queue: Annotated[
        bool,
        typer.Option(
            "--no-queue",
            help="Refuse at once when another control-plane operation runs or waits.",
        ),
    ] = False,
) -> None:
    """Remove an installed app or connector pack (its tables and data stay).

    Goes through the database's control-plane queue like every mutation: it
    waits its turn (NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS), then retires the
    pack and invalidates the ApplyAll marker in one transaction, and tells the
    connector fleet to reconcile. A connector pack's work items still queued
    (pending, processing, blocked) are failed with class ``pack-removed``
    (replayable), never left stranded. Needs a running worker.
    """
    settings = load_settings()
    engine = require_engine(settings)
    problem = removal_problem(engine, name)
    if problem:  # before taking a turn in the queue and the lease
        fail(problem)
    result = asyncio.run(
        run_operation(settings, "RemovePack", RemovePackInput(name), True, no_queue=no_queue)
    )
    # A removed connector pack gets no pool: its queued items fail pack-removed now
    # (every fleet reconcile sweeps them too).
    stranded = fail_removed_items(engine)
    if result is not None:
        swept = f"; {stranded} queued work item(s) failed {FAILURE_PACK_REMOVED}"
        console.print(result.reason + (swept if stranded else ""))


@packs_app.command("import-sfdx")
def import_sfdx(
    path: Path,
    out: Annotated[Path | None, typer.Option(help="Write the native pack YAML here.")] = None,
) -> None:
    """Import a Salesforce DX project as an app pack: validate, summarize, optionally write YAML.

    Runs the validation ApplyAll's plan-packs runs (the same functions:
    ``load_plan`` + ``validate_against``) against the platform packs and the
    packs installed on the configured database (none when it does not exist
    yet), lists what would be installed, then every problem at once, grouped
    by file, and exits 1 when there is any. Formulas its views would leave out
    are warnings.
    """
    if out is not None:
        target, source = out.expanduser().resolve(), path.expanduser().resolve()
        if target == source or (source.is_dir() and target.is_relative_to(source)):
            # It would overwrite the project's own files (or be read as one next time).
            usage_fail(
                f"--out {out} is inside the project being imported ({path})", "packs import-sfdx"
            )
    settings = load_settings()
    engine = existing_engine(settings)
    include_dev_sample = not settings.is_production
    try:
        plan = load_plan(engine, [str(path)], include_dev_sample)
    except PackProblems as exc:
        print_problems(exc.problems)
    except NexusError as exc:
        fail(f"{exc} (checked against the platform and installed packs)")
    target = path.resolve()
    found = [
        p for p in plan if p.source and "://" not in p.source and Path(p.source).resolve() == target
    ]
    if not found:
        fail(f"{path}: not found in the plan")
    pack = found[0]
    cat = catalog.CACHE.get(engine) if engine is not None and _has_catalog(engine) else None
    cat = cat or catalog.Catalog(version=0)
    state = PlanState.of(cat)
    for earlier in plan:
        if earlier.name == pack.name:
            break
        record_pack(earlier, state)
    _print_summary(pack, path, state)
    platform = [p for p in plan if p.category.rank < Category.AppPack.rank]
    for problem in _formula_problems(pack, platform):
        warn(problem)
    problems = plan_problems(cat, plan)
    if problems:
        print_problems(problems)
    if out is not None:
        text = yaml.safe_dump(pack.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
        try:
            out.write_text(text, encoding="utf-8")
        except OSError as exc:
            fail(f"--out {out}: cannot write the pack: {exc.strerror or exc}")
        console.print(f"wrote {out}")


def _has_catalog(engine: Engine) -> bool:
    return t.object_meta.name in table_names(engine)


def _print_summary(pack: PackManifest, path: Path, state: PlanState) -> None:
    """One row per object: what apply will make of it, fields, merges, records."""
    table = Table(title=f"{pack.name} {pack.version} ({pack.category.value}) from {path}")
    for col in ("object", "kind", "fields", "customized", "records", "formulas"):
        table.add_column(col)
    fields = merges = 0
    for o in pack.objects:
        res = resolve_object(pack, o, state)
        if o.kind == "event":
            kind = "event"
        elif o.package_namespace and res.own:
            kind = f"stand-in (package {o.package_namespace})"
        elif o.extends and not res.own:
            kind = "extends" + (f" (package {o.package_namespace})" if o.package_namespace else "")
        elif o.api_name.endswith("__mdt"):
            kind = "custom metadata"
        else:
            kind = "table"
        fields += len(res.fields)
        merges += len(res.merges)
        formulas = sum(1 for f in o.fields if f.formula)
        table.add_row(
            o.api_name, kind, str(len(res.fields)), str(len(res.merges)), str(len(o.records)),
            str(formulas),
        )  # fmt: skip
    console.print(table)
    console.print(f"{len(pack.objects)} objects, {fields} fields, {merges} customized fields")


def _formula_problems(pack: PackManifest, platform: list[PackManifest]) -> list[str]:
    """``Object.Field: reason`` for each formula or roll-up of ``pack`` its view would leave out.

    Compiled as RebuildDerived does (SQLite dialect), with the platform's
    objects and the pack's own to reach across; an object that extends a
    platform object is compiled with that object's fields too.
    """
    merged: dict[str, ObjectSpec] = {o.api_name.lower(): o for p in platform for o in p.objects}
    for obj in pack.objects:
        existing = merged.get(obj.api_name.lower())
        if obj.extends and existing is not None:
            fields = {f.api_name.lower(): f for f in existing.fields}
            fields.update({f.api_name.lower(): f for f in obj.fields})
            obj = existing.model_copy(update={"fields": tuple(fields.values()), "extends": False})
        merged[obj.api_name.lower()] = obj
    context = spec_context(merged.values(), "sqlite", pack.labels)
    problems = []
    for obj in pack.objects:
        if obj.kind == "event" or not any(f.formula or f.summary for f in obj.fields):
            continue
        spec = merged[obj.api_name.lower()]
        own = {f.api_name.lower() for f in obj.fields}
        _select, found = build_view_select(spec, object_table(spec, "sqlite"), "sqlite", context)
        for p in found:
            if p.field_api_name.lower() in own:
                problems.append(
                    f"{p.object_api_name}.{p.field_api_name}: {p.reason} "
                    f"(left out of view {view_name(p.object_api_name)})"
                )
    return problems
