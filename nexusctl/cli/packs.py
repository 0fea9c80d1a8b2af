"""``nexusctl packs ...``: import a Salesforce DX project as an app pack, remove a pack."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.table import Table

from nexuscrm.catalog import object_table
from nexuscrm.contracts.controlplane_queue import RemovePackInput
from nexuscrm.errors import NexusError
from nexuscrm.formulas import build_view_select, view_name
from nexuscrm.packs.builtin import platform_packs
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.packs.model import ObjectSpec, PackManifest
from nexuscrm.packs.ordering import order_packs
from nexusctl.cli.common import load_settings
from nexusctl.cli.controlplane import run_operation
from nexusctl.cli.render import console, fail, require_engine, warn

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
    connector fleet to reconcile. Needs a running worker.
    """
    settings = load_settings()
    require_engine(settings)
    result = asyncio.run(
        run_operation(settings, "RemovePack", RemovePackInput(name), True, no_queue=no_queue)
    )
    if result is not None:
        console.print(result.reason)


@packs_app.command("import-sfdx")
def import_sfdx(
    path: Path,
    out: Annotated[Path | None, typer.Option(help="Write the native pack YAML here.")] = None,
) -> None:
    """Import a Salesforce DX project as an app pack: validate, summarize, optionally write YAML.

    Also compiles every formula (each one that would be left out of its view
    is a warning) and checks the pack's dependencies against the shipped
    platform packs (a missing one, or a pack depending on itself, is an error).
    """
    load_settings()
    try:
        pack = load_pack_source(path)
    except NexusError as exc:
        fail(str(exc))
    try:
        platform = platform_packs(True)
    except NexusError as exc:
        fail(f"cannot load the platform packs: {exc}")
    table = Table(title=f"{pack.name} {pack.version} ({pack.category.value}) from {path}")
    for col in ("object", "kind", "fields", "formulas"):
        table.add_column(col)
    for o in pack.objects:
        kind = "event" if o.kind == "event" else ("extends" if o.extends else "table")
        formulas = sum(1 for f in o.fields if f.formula)
        table.add_row(o.api_name, kind, str(len(o.fields)), str(formulas))
    console.print(table)
    for problem in _formula_problems(pack, platform):
        warn(problem)
    _check_dependencies(pack, platform)
    if out is not None:
        out.write_text(
            yaml.safe_dump(pack.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
        )
        console.print(f"wrote {out}")


def _formula_problems(pack: PackManifest, platform: list[PackManifest]) -> list[str]:
    """``Object.Field: reason`` for each formula of ``pack`` its view would leave out.

    Compiled as RebuildDerived does (SQLite dialect); an object that extends a
    platform object is compiled with that object's fields too.
    """
    base: dict[str, ObjectSpec] = {o.api_name.lower(): o for p in platform for o in p.objects}
    problems = []
    for obj in pack.objects:
        if obj.kind == "event" or not any(f.formula for f in obj.fields):
            continue
        spec = obj
        existing = base.get(obj.api_name.lower())
        if obj.extends and existing is not None:
            fields = {f.api_name.lower(): f for f in existing.fields}
            fields.update({f.api_name.lower(): f for f in obj.fields})
            spec = existing.model_copy(update={"fields": tuple(fields.values()), "extends": False})
        own = {f.api_name.lower() for f in obj.fields}
        _select, found = build_view_select(spec, object_table(spec, "sqlite"), "sqlite")
        for p in found:
            if p.field_api_name.lower() in own:
                problems.append(
                    f"{p.object_api_name}.{p.field_api_name}: {p.reason} "
                    f"(left out of view {view_name(p.object_api_name)})"
                )
    return problems


def _check_dependencies(pack: PackManifest, platform: list[PackManifest]) -> None:
    """Fail unless ``pack`` orders after the shipped platform packs (as plan-packs will)."""
    if pack.name in pack.depends_on:
        fail(f"pack {pack.name} depends on itself (depends_on: {', '.join(pack.depends_on)})")
    try:
        order_packs([*platform, pack])
    except NexusError as exc:
        fail(f"{exc} (checked against the shipped platform packs)")
