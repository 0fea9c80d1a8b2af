"""Entry point: ``python worker.py`` runs the nexusctl worker (settings from NEXUS_* env)."""

from __future__ import annotations

import asyncio
import contextlib

from nexuscrm.log import configure_logging
from nexuscrm.settings import Settings
from nexusctl.worker import run_worker


def main() -> None:
    """Configure logging from settings and run the worker until interrupted."""
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_worker(settings))


if __name__ == "__main__":
    main()
