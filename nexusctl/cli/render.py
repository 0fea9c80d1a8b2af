"""Shared CLI rendering: the consoles, one-line ``error:``/``warning:`` output and
exits, the command group that turns expected failures into one ``error:`` line,
and the phase, summary and status tables.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import pydantic
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from sqlalchemy import Engine, select
from sqlalchemy import exc as sa_exc
from temporalio.service import RPCError, RPCStatusCode
from typer.core import TyperGroup

from nexuscrm.contracts import ApplyAllResult, PhaseReport
from nexuscrm.contracts.controlplane_queue import ControlPlaneQueueStatus
from nexuscrm.controlplane import derived, markers
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names
from nexuscrm.errors import NexusError, Problem, format_problems
from nexuscrm.settings import Settings, default_database_url
from nexusctl.cli.common import RUN, existing_engine, no_database, safe_url

console = Console()
err_console = Console(stderr=True)

# ---------------------------------------------------------------------------
# one-line errors and warnings


def one_line(message: str) -> str:
    """``message`` with its whitespace (newlines included) collapsed to single spaces."""
    return " ".join(message.split())


def error_line(message: str) -> None:
    """Print ``error: <message>`` (one line) on stderr."""
    err_console.print(f"[red]error:[/red] {escape(one_line(message))}", soft_wrap=True)


def warn(message: str) -> None:
    """Print ``warning: <message>`` (one line) on stderr."""
    err_console.print(f"[yellow]warning:[/yellow] {escape(one_line(message))}", soft_wrap=True)


def fail(message: str) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit 1."""
    error_line(message)
    raise typer.Exit(1)


def fail_lines(head: str, lines: list[str], shown: int = 20) -> NoReturn:
    """Print ``error: <head>`` and then one indented line per item of ``lines``
    (the first ``shown``, then how many more) on stderr, and exit 1: every
    problem readable on its own line, not folded into one (a new user's trial).
    One problem stays one ``error:`` line, as every other expected failure."""
    if len(lines) == 1:
        fail(f"{head} {lines[0]}")
    err_console.print(f"[red]error:[/red] {escape(one_line(head))}", soft_wrap=True)
    for line in lines[:shown]:
        err_console.print("  " + escape(one_line(line)), soft_wrap=True, highlight=False)
    if len(lines) > shown:
        err_console.print(f"  ... and {len(lines) - shown} more", soft_wrap=True)
    raise typer.Exit(1)


def print_problems(problems: list[Problem]) -> NoReturn:
    """Every problem grouped by file on stderr (``error: N problem(s) in M
    file(s)``, then :func:`format_problems`), then exit 1."""
    files = len({p.file for p in problems})
    err_console.print(
        f"[red]error:[/red] {len(problems)} problem(s) in {files} file(s)", soft_wrap=True
    )
    err_console.print(escape(format_problems(problems)), soft_wrap=True, highlight=False)
    raise typer.Exit(1)


def usage_fail(message: str, command: str) -> NoReturn:
    """A command-line mistake found in a command's body (options that exclude
    each other): print ``error: <message> (see 'nexusctl <command> --help')``
    on stderr and exit 2, as the parser's own usage errors do."""
    error_line(f"{message} (see 'nexusctl {command} --help')")
    raise typer.Exit(2)


def _database_url() -> str:
    if RUN.settings is not None:
        return RUN.settings.database_url
    return os.environ.get("NEXUS_DATABASE_URL") or default_database_url()


def _temporal_address() -> str:
    if RUN.settings is not None:
        return RUN.settings.temporal_address
    return os.environ.get("NEXUS_TEMPORAL_ADDRESS") or "127.0.0.1:7233"


def _driver_message(exc: sa_exc.DBAPIError) -> str:
    orig = exc.orig
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int):  # PyMySQL: (1045, "Access denied ...")
        return f"{args[1]} ({args[0]})"
    return str(orig) if orig is not None else str(exc)


def _echoable(info: Any) -> bool:
    """Whether a bad value of this setting may be echoed: numbers and flags only.

    Never a text setting: a database URL or a hook's environment may carry a
    password.
    """
    annotation = getattr(info, "annotation", None)
    return annotation in (int, float, bool, int | None, float | None)


def _shown(value: object) -> str:
    """``value`` as an error shows it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _settings_message(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        info = Settings.model_fields.get(field)
        env_var = info.alias if info is not None and info.alias else f"NEXUS_{field.upper()}"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if env_var not in msg and _echoable(info):
            msg = f"{_shown(err.get('input'))}: {msg}"
        parts.append(msg if env_var in msg else f"{env_var}: {msg}")
    return "invalid setting: " + "; ".join(parts)


def expected_failure(exc: BaseException) -> str | None:
    """The one-line message for an expected failure, or None for a bug.

    Expected: ``NexusError``; invalid ``NEXUS_*`` settings (named by their
    environment variable, value not echoed); a database URL SQLAlchemy cannot
    use or a database that refuses the connection (URL redacted, driver
    message); an unreachable Temporal server; a Temporal ``RPCError``.
    """
    if isinstance(exc, NexusError):
        return str(exc)
    if isinstance(exc, pydantic.ValidationError) and exc.title == Settings.__name__:
        return _settings_message(exc)
    # A database the server refuses at connect (a name it rejects, e.g. with a
    # trailing space in NEXUS_DATABASE_URL: ProgrammingError 1102) is a setting
    # to fix, not a bug.
    if isinstance(exc, sa_exc.OperationalError) or (
        isinstance(exc, sa_exc.DBAPIError) and exc.statement is None
    ):
        url = safe_url(_database_url())
        if exc.statement is None:
            return f"cannot connect to database {url}: {_driver_message(exc)}"
        return f"database {url}: {_driver_message(exc)}"
    # An unknown driver, or a URL SQLAlchemy cannot parse (other ArgumentErrors are bugs).
    if isinstance(exc, sa_exc.NoSuchModuleError) or (
        isinstance(exc, sa_exc.ArgumentError) and "URL" in str(exc)
    ):
        return f"cannot connect to database {safe_url(_database_url())}: {exc}"
    if isinstance(exc, RuntimeError) and str(exc).startswith("Failed client connect"):
        return f"cannot reach Temporal at {_temporal_address()} (start it with `nexusctl dev`)"
    if isinstance(exc, RPCError):
        if _unanswered(exc):
            return (
                f"Temporal at {_temporal_address()}: no answer in time ({exc.message}, "
                f"{exc.status.name}): a workflow's query needs a worker to answer it, and a "
                "worker stopped in the last ~90 s still looks alive to the server; check that "
                "`nexusctl worker` runs, then run this again"
            )
        return f"Temporal at {_temporal_address()}: {exc.message} ({exc.status.name})"
    return None


def _unanswered(exc: RPCError) -> bool:
    """A call that ran out of time or lost its stream: what a query to a workflow
    whose worker was just killed meets (``Timeout expired``, ``CANCELLED``;
    ``h2 protocol error``), seen by a new user right after a SIGKILL."""
    return exc.status in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED) or (
        "h2 protocol error" in exc.message
    )


def _given_value(exc: Exception, args: Sequence[str]) -> str | None:
    """The text given on the command line for the option a ``BadParameter``
    names (``--x v`` or ``--x=v``; the last one wins, as the parser reads it)."""
    param = getattr(exc, "param", None)
    if getattr(param, "param_type_name", None) != "option":
        return None
    if getattr(param, "multiple", False):
        return None  # a repeated option: its callback names the values it refuses
    found = None
    for i, arg in enumerate(args):
        for opt in getattr(param, "opts", ()):
            if arg == opt and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(opt + "="):
                found = arg[len(opt) + 1 :]
    return found


def usage_message(exc: typer.TyperException, args: Sequence[str]) -> str:
    """One line for a command-line mistake: the parser's message, the value
    given when the message leaves it out (``Input should be a valid integer
    (got '-1e999')``), and where help is (``see 'nexusctl events --help'``)."""
    message = exc.format_message()
    given = _given_value(exc, args)
    if given is not None and given not in message:
        message = f"{message} (got {given!r})"
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or "nexusctl"
    return f"{message} (see '{path} --help')"


class NexusGroup(TyperGroup):
    """The ``nexusctl`` command group: expected failures become one ``error:`` line.

    Wraps every invocation (the console script and ``CliRunner`` alike): an
    exception :func:`expected_failure` recognizes (bad settings, an
    unreachable database or Temporal server, a ``NexusError`` ...) is printed
    as ``error: <one line>`` on stderr and exits 1. Anything else is a bug
    and keeps its traceback.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the command; an expected failure prints one ``error:`` line and exits 1;
        a command-line mistake (unknown option, a value of the wrong type or out
        of range) prints one ``error:`` line and exits 2, Click's usage code."""
        RUN.reset()
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.Exit as exc:
            code = exc.exit_code
        except typer.Abort:
            error_line("aborted")
            code = 1
        except typer.TyperException as exc:  # the parser's errors (Typer vendors Click)
            code = int(getattr(exc, "exit_code", 2))
            # NoArgsIsHelpError: the group's help is already printed.
            if type(exc).__name__ != "NoArgsIsHelpError":
                error_line(usage_message(exc, argv) if code == 2 else exc.format_message())
        except Exception as exc:
            message = expected_failure(exc)
            if message is None:
                raise
            error_line(message)
            code = 1
        else:
            # Not standalone, Click returns a command's exit code (typer.Exit,
            # --help) or its return value (None when it ran to its end).
            if not standalone_mode:
                return rv
            code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def require_engine(settings: Settings) -> Engine:
    """The configured database's engine; exits with an error when it does not exist yet."""
    engine = existing_engine(settings)
    if engine is None:
        fail(no_database(settings))
        raise AssertionError("unreachable")
    return engine


def end_live_output() -> None:
    """End a live display's output with a newline where rich does not."""
    # On a terminal rich ends the live display with a newline itself;
    # elsewhere the next line would start right after the table's border.
    if not console.is_terminal:
        console.line()


# ---------------------------------------------------------------------------
# tables


NOTE_LIMIT = 2000


def clip(note: str, limit: int = NOTE_LIMIT) -> str:
    """``note`` whole when it has at most ``limit`` characters; else cut at the last
    word boundary before it, ending in `` ...`` (never mid-word). The table wraps it."""
    if len(note) <= limit:
        return note
    cut = note[: limit - 4]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip() + " ..."


def phase_table(phases: list[PhaseReport], title: str) -> Table:
    """Rich table of phases: name, status, seconds, detail or error."""
    table = Table(title=title)
    for col in ("phase", "status", "seconds", "detail / error"):
        table.add_column(col)
    colors = {"completed": "green", "failed": "red", "running": "yellow", "skipped": "dim"}
    for p in phases:
        color = colors.get(p.status, "white")
        secs = f"{p.duration_s:.2f}" if p.duration_s is not None else ""
        note = clip(p.error or p.detail or "")
        table.add_row(p.name, f"[{color}]{p.status}[/{color}]", secs, Text(note))
    return table


def queue_table(state: ControlPlaneQueueStatus) -> Table:
    """Rich table of a control-plane queue: the running entry, the queued ones in order,
    then the last finished (newest last)."""
    table = Table(title=f"control-plane queue of {state.database_id}")
    for col in ("state", "operation", "workflow id", "waiters", "since", "deadline / outcome"):
        table.add_column(col)
    colors = {"completed": "green", "failed": "red", "running": "yellow", "expired": "red"}
    rows = [*state.recent[-10:], *([state.running] if state.running else []), *state.queued]
    for e in rows:
        color = colors.get(e.state, "white")
        since = e.finished_at or e.started_at or e.enqueued_at
        note = e.deadline if e.state == "queued" else e.outcome
        table.add_row(
            f"[{color}]{e.state}[/{color}]",
            e.operation,
            Text(e.workflow_id),
            str(e.waiters),
            since[:19],
            Text(note[:160]),
        )
    return table


def print_summary(result: ApplyAllResult) -> None:
    """A finished ApplyAll: status, duration and reason, its packs, its left-out formulas."""
    console.print(
        f"[bold green]{result.status}[/bold green] in {result.duration_s:.1f} s: {result.reason}"
    )
    if result.packs:
        packs = Table(title="packs")
        for col in ("pack", "category", "version", "objects", "payload hash"):
            packs.add_column(col)
        for p in result.packs:
            packs.add_row(p.name, p.category, p.version, str(p.objects), p.payload_hash[:12])
        console.print(packs)
    for problem in result.formula_problems:
        console.print(f"[yellow]formula left out of its view:[/yellow] {escape(problem)}")


ERROR_CHARS = 400


def _error_cell(error: str | None) -> Text:
    """Up to ``ERROR_CHARS`` of an error, as plain text (wrapped by the table)."""
    error = one_line(error or "")
    return Text(error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1] + "…")


def print_status(settings: Settings) -> None:
    """Markers (with run id and last error) and installed packs of the database."""
    engine = existing_engine(settings)
    if engine is None:
        console.print(no_database(settings))
        return
    if t.bootstrap_state.name not in table_names(engine):
        console.print(f"database {safe_url(settings.database_url)} has no control-plane tables yet")
        return
    # Key/value rows rather than a table: the full run id and a long error must
    # fit (wrapped) even on an 80-column terminal.
    marks = Table.grid(padding=(0, 2))
    marks.add_column(no_wrap=True)
    marks.add_column(overflow="fold")
    colors = {"completed": "green", "failed": "red"}
    with engine.connect() as conn:
        # Named columns: a database of an older release may lack newer ones.
        b = t.bootstrap_state.c
        for row in conn.execute(
            select(b.StateKey, b.RunID, b.Phase, b.Status, b.LastError)
        ).mappings():
            color = colors.get(row["Status"], "yellow")
            state = Text(row["Status"], style=color) + Text(f" (phase {row['Phase']})")
            marks.add_row(Text(row["StateKey"], style="bold"), state)
            marks.add_row("  run", row["RunID"])
            if row["LastError"]:
                marks.add_row("  last error", _error_cell(row["LastError"]))
        packs = Table(title="installed packs")
        for col in ("pack", "category", "version", "status", "payload hash"):
            packs.add_column(col)
        pack_errors = Table.grid(padding=(0, 2))
        pack_errors.add_column(no_wrap=True)
        pack_errors.add_column(overflow="fold")
        for row in conn.execute(
            select(t.installed_pack).order_by(t.installed_pack.c.Name)
        ).mappings():
            packs.add_row(
                row["Name"], row["Category"], row["Version"], row["Status"],
                row["PayloadHash"][:12],
            )  # fmt: skip
            if row["LastError"]:
                pack_errors.add_row(f"{row['Name']} error", _error_cell(row["LastError"]))
    console.print(
        f"database {settings.database_id}: control-plane workflow id "
        f"{settings.controlplane_workflow_id}, task queues {settings.controlplane_task_queue}, "
        f"{settings.connector_task_queue} and {settings.identity_task_queue}"
    )
    console.print(f"[bold]markers[/bold] ({settings.database_id})")
    console.print(marks)
    console.print(packs)
    if pack_errors.row_count:
        console.print(pack_errors)
    if t.object_meta.name in table_names(engine):
        left_out = derived.left_out_formulas(engine)
        if left_out:
            console.print(f"[yellow]{len(left_out)} formula(s) left out of their views:[/yellow]")
            for issue in left_out:
                console.print(
                    f"  {issue.object_api_name}.{issue.field_api_name}: {escape(issue.reason)}",
                    soft_wrap=True,
                )
    marker = markers.read(engine)
    if marker is None or marker.status != markers.MarkerStatus.completed:
        console.print("[yellow]ApplyAll has not completed on this database[/yellow]")
