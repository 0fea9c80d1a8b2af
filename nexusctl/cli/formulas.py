"""``nexusctl formulas ...``: the values formula views read at query time.

``$User.Id`` is the acting user of the reading session (``SET @nexus_user_id``
on MariaDB/MySQL), else the default acting user stored here; ``$Organization``
fields are stored here. Views read them when queried: no rebuild is needed.
"""

from __future__ import annotations

from typing import Annotated

import sqlalchemy as sa
import typer
from rich.table import Table
from sqlalchemy import Engine

from nexuscrm.db.tables import formula_global
from nexuscrm.formulas.globals import GLOBAL_NAMES, read_globals, write_global
from nexusctl.cli.common import load_settings
from nexusctl.cli.render import console, fail, require_engine

formulas_app = typer.Typer(
    help="Values formula views read: the default acting user ($User.Id) and $Organization.",
    no_args_is_help=True,
)


def _engine() -> Engine:
    engine = require_engine(load_settings())
    if not sa.inspect(engine).has_table(formula_global.name):
        fail(f"{formula_global.name} does not exist yet: run apply-all on this database first")
    return engine


Name = Annotated[str, typer.Argument(help="User.Id or Organization.<Field>.")]


@formulas_app.command("globals")
def formulas_globals() -> None:
    """List the stored formula globals."""
    engine = _engine()
    with engine.connect() as conn:
        stored = read_globals(conn)
    table = Table(title="formula globals")
    table.add_column("name")
    table.add_column("value")
    for name in GLOBAL_NAMES:
        if name in stored:
            table.add_row(name, stored[name] or "")
    console.print(table if stored else "no formula globals are set")


@formulas_app.command("set-global")
def formulas_set_global(name: Name, value: str) -> None:
    """Set formula global NAME to VALUE (User.Id: the default acting user)."""
    engine = _engine()
    try:
        with engine.begin() as conn:
            canon = write_global(conn, name, value)
    except ValueError as exc:
        fail(str(exc))
    console.print(f"{canon} = {value.strip()}")


@formulas_app.command("unset-global")
def formulas_unset_global(name: Name) -> None:
    """Remove formula global NAME (formulas then read it as blank)."""
    engine = _engine()
    try:
        with engine.begin() as conn:
            canon = write_global(conn, name, None)
    except ValueError as exc:
        fail(str(exc))
    console.print(f"{canon} unset")
