"""``nexusctl``: run the worker and the embedded stack, start and watch
control-plane workflows, inspect a database. Settings come from NEXUS_* env.
"""

# This docstring is the ``nexusctl --help`` text. The commands live in one
# module per group: dev (worker, dev, demo, demo-sync), controlplane (apply-all,
# the single operations, progress, status), packs, connectors, wakes (wake and
# connectors waits) and events; shared rendering in render, shared helpers in
# common. Registration order below is the order ``--help`` lists them in.

from __future__ import annotations

import contextlib
import logging
import os
import sys

import typer

from nexusctl.cli import candidate, connectors, controlplane, dev, events, formulas, packs, wakes
from nexusctl.cli.common import safe_url
from nexusctl.cli.render import NexusGroup, console, err_console, expected_failure, phase_table

__all__ = ["NexusGroup", "app", "expected_failure", "main", "phase_table", "safe_url"]

app = typer.Typer(
    help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False, cls=NexusGroup
)
dev.register(app)
controlplane.register(app)
app.add_typer(packs.packs_app, name="packs")
app.add_typer(connectors.connectors_app, name="connectors")
app.add_typer(wakes.wake_app, name="wake")
app.add_typer(events.events_app, name="events")
app.add_typer(candidate.candidate_app, name="candidate")
app.add_typer(formulas.formulas_app, name="formulas")


PIPE_WIDTH = 200
"""Columns of a table written to a pipe or file (``COLUMNS`` wins when set)."""


def widen_for_pipes() -> None:
    """Output that is not a terminal gets :data:`PIPE_WIDTH` columns, not rich's 80:
    piped or logged tables kept cells like ``salesfor…`` cut (a new user's trial).
    A terminal keeps its own width; ``COLUMNS`` set keeps that."""
    if "COLUMNS" in os.environ:
        return
    for con in (console, err_console, wakes.console):
        if not con.is_terminal:
            con.width = PIPE_WIDTH


def main() -> None:
    """Console-script entry point (``nexusctl = "nexusctl.cli:main"``).

    Runs the app in typer's standalone mode: a command-line mistake prints
    one ``error:`` line and exits 2, Ctrl-C exits 130, an expected failure prints
    ``error: <one line>`` on stderr and exits 1 (see :class:`NexusGroup`),
    and an unexpected exception is a bug and keeps its traceback.

    A finished command leaves with ``os._exit`` after flushing output and
    logging: the Temporal SDK's Rust threads can abort CPython's finalization
    ("PyGILState_Release ... Python runtime state: finalizing",
    temporalio/sdk-python#300), which would turn a success into a SIGABRT.
    """
    widen_for_pipes()
    try:
        app(prog_name="nexusctl")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if not isinstance(code, int):  # sys.exit(None) or sys.exit("message")
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
