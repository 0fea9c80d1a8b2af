"""Entry point: ``python worker.py`` runs the nexusctl worker (settings from NEXUS_* env).

The same as ``nexusctl worker``: bad settings print one ``error:`` line and
exit 1, Ctrl-C or SIGTERM stops the worker.
"""

from __future__ import annotations

import sys

from nexusctl.cli import main as cli_main


def main() -> None:
    """Run ``nexusctl worker`` with this script's arguments."""
    sys.argv = ["nexusctl", "worker", *sys.argv[1:]]
    cli_main()


if __name__ == "__main__":
    main()
