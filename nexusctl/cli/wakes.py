"""CLI commands for identity-convergence waits: ``nexusctl wake ...``, ``connectors waits``.

Mounted by ``nexusctl/cli/__init__.py`` and ``nexusctl/cli/connectors.py``::

    app.add_typer(wake_app, name="wake")
    connectors_app.command("waits")(waits)
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import typer
from rich.console import Console
from rich.table import Table

from nexuscrm.settings import Settings
from nexusctl.identity import (
    wake_identity_convergence_record,
    wake_identity_convergence_remote_identity,
)
from nexusctl.temporal import connect

wake_app = typer.Typer(help="Wake identity-convergence waits.", no_args_is_help=True)
console = Console()


@wake_app.command("record")
def wake_record(object_api_name: str, record_id: str) -> None:
    """Wake items waiting on local record OBJECT RECORD_ID; prints how many woke."""
    settings = Settings()

    async def go() -> int:
        client = await connect(settings)
        return await wake_identity_convergence_record(client, settings, object_api_name, record_id)

    console.print(f"woken: {asyncio.run(go())}")


@wake_app.command("remote")
def wake_remote(owner: str, namespace: str, object_api_name: str, remote_id: str) -> None:
    """Wake items waiting on remote link OWNER NAMESPACE OBJECT REMOTE_ID; prints how many."""
    settings = Settings()

    async def go() -> int:
        client = await connect(settings)
        return await wake_identity_convergence_remote_identity(
            client, settings, owner, namespace, object_api_name, remote_id
        )

    console.print(f"woken: {asyncio.run(go())}")


async def list_waits(settings: Settings) -> list[tuple[str, str, float]]:
    """Running waits of the database: (workflow id, dependency object, age in seconds)."""
    client = await connect(settings)
    query = (
        f"WorkflowType = 'IdentityWait' AND ExecutionStatus = 'Running' "
        f"AND NexusDatabase = '{settings.database_id}'"
    )
    now = datetime.now(UTC)
    out = []
    async for wf in client.list_workflows(query):
        obj = wf.search_attributes.get("NexusDependencyObject") or ["?"]
        age = (now - wf.start_time).total_seconds()
        out.append((wf.id, str(obj[0]), age))
    return out


def waits() -> None:
    """Identity waits by dependency object: count and oldest age."""
    settings = Settings()
    rows = asyncio.run(list_waits(settings))
    by_obj: dict[str, tuple[int, float]] = {}
    for _id, obj, age in rows:
        n, oldest = by_obj.get(obj, (0, 0.0))
        by_obj[obj] = (n + 1, max(oldest, age))
    table = Table(title=f"identity waits on {settings.database_id}")
    table.add_column("object")
    table.add_column("waits", justify="right")
    table.add_column("oldest", justify="right")
    for obj in sorted(by_obj):
        n, oldest = by_obj[obj]
        table.add_row(obj, str(n), f"{oldest:.0f} s")
    console.print(table)
    if not rows:
        console.print("no identity wait runs")
