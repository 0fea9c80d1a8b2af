"""Shared CLI helpers: run state, settings, database engines, Temporal pollers.

Neither rendering (see :mod:`nexusctl.cli.render`) nor a command group.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import PollerInfo, TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from nexuscrm.connectors import handoff, serving
from nexuscrm.connectors.desired import verify_serving_selection
from nexuscrm.db.engine import make_engine, redacted
from nexuscrm.errors import NexusError
from nexuscrm.log import configure_logging
from nexuscrm.settings import Settings

# Seconds: a progress query without a worker to answer it fails after this
# (instead of the server's ~30 s), and a worker gets this long to stop.
QUERY_TIMEOUT = timedelta(seconds=3)
SHUTDOWN_GRACE_S = 10.0
# A live poller re-polls at least every ~60 s; older entries are history.
POLLER_FRESH_S = 90.0
STATE_DIR = Path(".nexus")


def _app_packs(values: list[str] | None) -> list[str] | None:
    """Typer callback: an empty ``--app-pack`` ('' would resolve to the current
    folder and install it as a pack) or a path that does not exist here is a
    command-line mistake (exit 2), every such value named at once. The worker
    reads the same resolved path (:func:`sources`); a path missing here used
    to start ApplyAll, which failed in plan-packs with a traceback in the
    worker's log."""
    problems = []
    for value in values or ():
        if not value.strip():
            problems.append("an app pack source must be a path, got an empty value")
        elif not Path(value).expanduser().exists():
            problems.append(
                f"{value!r}: no such file or directory ({Path(value).expanduser().resolve()})"
            )
    if problems:
        raise typer.BadParameter("; ".join(problems))
    return values


AppPack = Annotated[
    list[str] | None,
    typer.Option(
        "--app-pack",
        help="App pack source: SFDX project folder or pack.yaml (repeat).",
        callback=_app_packs,
    ),
]
DevSample = Annotated[
    bool | None,
    typer.Option("--dev-sample/--no-dev-sample", help="Default: on unless NEXUS_ENV=production."),
]


@dataclass
class RunState:
    """What the running command knows, for its error and interrupt messages."""

    settings: Settings | None = None
    workflow: str | None = None
    workflow_id: str | None = None
    live: Live | None = None
    # The event loop and callback that Ctrl-C / SIGTERM go to (see dev._interrupts).
    interrupt: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None

    def reset(self) -> None:
        """Forget the previous command's state (a new invocation starts)."""
        self.settings = None
        self.workflow = self.workflow_id = None
        self.live = None
        self.interrupt = None


RUN = RunState()


def load_settings(quiet: bool = False) -> Settings:
    """Settings from NEXUS_* env, remembered for error messages; configures logging.

    ``quiet``: log warnings only (unless NEXUS_LOG_LEVEL is set), for commands
    that show a live progress display.
    """
    settings = Settings()
    RUN.settings = settings
    # A live progress display and log lines on one terminal do not mix.
    level = "WARNING" if quiet and "NEXUS_LOG_LEVEL" not in os.environ else settings.log_level
    configure_logging(settings.log_format, level)
    return settings


def safe_url(url: str) -> str:
    """``url`` with its password masked, even when SQLAlchemy cannot parse it."""
    try:
        return redacted(url)
    except Exception:
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def open_engine(settings: Settings) -> Engine:
    """``make_engine`` with its setup errors as one-line ``NexusError``s."""
    try:
        return make_engine(settings.database_url)
    except ImportError as exc:  # the URL's driver is not installed
        raise NexusError(
            f"cannot connect to database {safe_url(settings.database_url)}: {exc} "
            "(for MySQL/MariaDB/TiDB: pip install -e '.[mysql]')"
        ) from exc
    except ValueError as exc:  # a backend make_engine does not support
        raise NexusError(str(exc)) from exc


def _sqlite_path(settings: Settings) -> Path | None:
    """The SQLite file of the configured URL; None for other backends and ``:memory:``."""
    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser()


def existing_engine(settings: Settings) -> Engine | None:
    """The database's engine; None when it is a SQLite file that does not exist yet.

    Read-only commands use this so that looking does not create ``.nexus/nexus.db``.
    """
    path = _sqlite_path(settings)
    if path is not None and not path.exists():
        return None
    return open_engine(settings)


def no_database(settings: Settings) -> str:
    """The message for a SQLite database file that does not exist yet (and, when
    its folder does not exist either, that nothing can create it there)."""
    path = _sqlite_path(settings)
    folder = path.expanduser().parent if path is not None else None
    # The default folder (.nexus) is made by the commands that create the database.
    if folder is not None and folder not in (Path(""), STATE_DIR) and not folder.exists():
        return (
            f"no database at {path}, and its folder {folder} does not exist: check "
            "NEXUS_DATABASE_URL (SQLite creates the file, not its folder)"
        )
    return f"no database at {path} yet (`nexusctl demo` or `nexusctl apply-all` creates it)"


def check_database(settings: Settings) -> None:
    """Connect once, so a wrong URL or password fails before anything starts; and
    refuse to start the runtime on a serving selection that does not verify (the
    seed's ``StartContext`` checks): the handoff role without a selection, an
    empty selection (``Runtime serving route authority is unavailable``), and a
    selection the database does not admit (``desired.verify_serving_selection``:
    pack generation, digest, routes and their modes, profiles and credentials).
    Raises ``ServingSelectionError`` with the seed's message."""
    selection = serving.load(settings.serving_selection) if settings.serving_selection else None
    handoff.require_serving_selection(settings.connector_role, selection)
    engine = open_engine(settings)
    try:
        with engine.connect():
            pass
        if selection is not None:
            verify_serving_selection(
                engine, selection, supported_modes=handoff.supported_modes(settings.connector_role)
            )
    finally:
        engine.dispose()


def sources(app_pack: list[str] | None) -> list[str]:
    """The ``--app-pack`` sources as absolute paths."""
    # Resolve here: the worker may run in another working directory.
    return [str(Path(s).expanduser().resolve()) for s in (app_pack or [])]


async def active_pollers(
    client: Client, task_queue: str, wait_s: float = 0.0
) -> list[PollerInfo] | None:
    """Workers polling ``task_queue`` for workflow tasks (recently seen ones only).

    Waits up to ``wait_s`` for a first poller (a worker that just started may
    not have polled yet). None when the server cannot tell.
    """
    request = DescribeTaskQueueRequest(
        namespace=client.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    deadline = time.monotonic() + wait_s
    while True:
        try:
            response = await client.workflow_service.describe_task_queue(
                request, timeout=timedelta(seconds=5)
            )
        except RPCError:
            return None
        now = time.time()
        pollers = [
            p
            for p in response.pollers
            if not p.HasField("last_access_time")
            or now - p.last_access_time.ToSeconds() < POLLER_FRESH_S
        ]
        if pollers or time.monotonic() >= deadline:
            return pollers
        await asyncio.sleep(0.25)
