"""Run several worker processes on the same task queues: ``nexusctl worker --processes N``.

One Python process runs its activities under one GIL, so CPU-bound inbound
work (claim, process, finish of many small events) stops scaling at about one
core per process. Temporal spreads workflow and activity tasks over every
worker polling a task queue, so N processes of the same worker use N cores
with nothing shared but the database and the server.

The parent starts N children (``python -m nexusctl.cli worker --processes 1``
with the same environment), each of which dies with the parent
(``PR_SET_PDEATHSIG``: a SIGKILL of the parent takes the children with it, as
a single worker process would die); SIGTERM or Ctrl-C of the parent is passed
on to each child, which shuts down as a single worker does. When one child
exits on its own, the others are stopped and the parent exits with that
child's code, so the service manager restarts the whole set. With
``NEXUS_METRICS_ADDRESS=host:port`` child k serves its metrics on port + k.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from nexuscrm.log import log

_PR_SET_PDEATHSIG = 1


def cores() -> int:
    """CPU cores this process may use (the proposed ``--processes``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec (Linux); elsewhere a no-op.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def child_environment(k: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of child ``k`` (0-based): the parent's, with
    ``NEXUS_METRICS_ADDRESS``'s port moved up by ``k`` (each process serves its
    own endpoint: ``host:9464`` gives 9464, 9465, ...)."""
    env = dict(os.environ if environ is None else environ)
    address = env.get("NEXUS_METRICS_ADDRESS", "").strip()
    host, sep, port = address.rpartition(":")
    if address and sep and port.isdigit():
        env["NEXUS_METRICS_ADDRESS"] = f"{host}:{int(port) + k}"
    return env


def run_processes(count: int, shutdown_seconds: float) -> int:
    """Run ``count`` worker processes until one exits or the parent is interrupted.

    Returns the exit code for the parent: 0 after an interrupt (SIGTERM or
    Ctrl-C, passed on to every child, each given ``shutdown_seconds`` + 15 s
    before it is killed), else the code of the child that exited first.
    Raises ``ValueError`` for ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"--processes must be at least 1, got {count}")
    command = [sys.executable, "-m", "nexusctl.cli", "worker", "--processes", "1"]
    children = [
        subprocess.Popen(command, env=child_environment(k), preexec_fn=_die_with_parent)
        for k in range(count)
    ]
    log.info("worker processes started", processes=count, pids=[c.pid for c in children])
    code = 0
    try:
        while True:
            ended = [c for c in children if c.poll() is not None]
            if ended:
                code = ended[0].returncode or 1
                log.error(
                    "worker process exited; stopping the others",
                    pid=ended[0].pid,
                    returncode=ended[0].returncode,
                )
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        code = 0
    _stop(children, shutdown_seconds + 15)
    return code


def _stop(children: list[subprocess.Popen[bytes]], grace: float) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
