"""structlog setup: readable console lines on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is now (test runners swap it and close the old one)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: str = "auto", level: str = "INFO") -> None:
    """Configure structlog and stdlib logging once per process.

    ``fmt``: ``auto`` picks console rendering when stderr is a TTY, else JSON.
    """
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    # Lines of the libraries' stdlib loggers (temporalio's workflow and activity
    # loggers, the SDK core's forwarded lines, SQLAlchemy) are rendered like ours:
    # one JSON object a line, with the logger's name, when the format is JSON.
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    if not root.handlers:  # as logging.basicConfig: a test runner's handlers stay
        setattr(handler, _OURS, True)
        root.addHandler(handler)
        root.setLevel(level.upper())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


_OURS = "_nexus_handler"
"""Marks the stdlib handler :func:`configure_logging` installed (replaced on a second call)."""

log = structlog.get_logger("nexuscrm")


@contextmanager
def logged_phase(operation: str, phase: str, **fields: Any) -> Iterator[None]:
    """Log phase start / done / failed with elapsed seconds.

    Port of the seed's ``runLoggedControlPlanePhase``; re-raises whatever the
    body raises after logging it.
    """
    start = time.monotonic()
    log.info("controlplane phase start", operation=operation, phase=phase, **fields)
    try:
        yield
    except BaseException as exc:
        log.error(
            "controlplane phase failed",
            operation=operation,
            phase=phase,
            elapsed=round(time.monotonic() - start, 3),
            err=str(exc),
            **fields,
        )
        raise
    log.info(
        "controlplane phase done",
        operation=operation,
        phase=phase,
        elapsed=round(time.monotonic() - start, 3),
        **fields,
    )


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return (result, elapsed seconds)."""
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start
