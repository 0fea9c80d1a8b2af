"""``nexusctl candidate write``: the exact candidate of the current sources.

Prints (or writes) the candidate file ``nexusctl apply-all --candidate``
takes: every pack ApplyAll would apply now (the release's platform packs,
the given ``--app-pack`` sources, app packs already installed in the
configured database) with its payload digest; app packs with their source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from nexuscrm.controlplane import candidate, packs_apply
from nexuscrm.controlplane.packs_plan import validate_plan
from nexuscrm.errors import PackProblems
from nexusctl.cli.common import AppPack, DevSample, existing_engine, load_settings, sources
from nexusctl.cli.render import console, fail, print_problems

candidate_app = typer.Typer(
    help="Exact candidates for `apply-all --candidate`.", no_args_is_help=True
)


@candidate_app.command("write")
def write(
    app_pack: AppPack = None,
    dev_sample: DevSample = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the candidate here (default: stdout).")
    ] = None,
) -> None:
    """Write the exact candidate (YAML) of the given app packs on the configured database."""
    settings = load_settings(quiet=True)
    srcs = sources(app_pack)
    dev = (not settings.is_production) if dev_sample is None else dev_sample
    engine = existing_engine(settings)
    try:
        plan = packs_apply.load_plan(engine, srcs, dev)
        # What plan-packs would refuse is no candidate (a lookup to an object
        # nobody defines, an object owned by another pack ...).
        validate_plan(packs_apply.catalog_of(engine), plan)
    except PackProblems as exc:
        print_problems(exc.problems)
    text = yaml.safe_dump(candidate.from_plan(plan, srcs), sort_keys=False)
    if out is None:
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"--out {out}: cannot write the candidate: {exc.strerror or exc}")
    console.print(f"wrote the exact candidate of {len(plan)} packs to {out}")
