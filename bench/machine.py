"""The machine block every bench writes into its results file.

Imported by the bench scripts as ``from bench.machine import machine`` (each
script puts the repository root on ``sys.path`` first).
"""

from __future__ import annotations

import os
import platform
from typing import Any


def machine() -> dict[str, Any]:
    """Cores, memory (GiB), platform, Python and the 1/5/15 min load average
    when the run started (``load_average``; ``load_average_1m_at_start`` is its
    first figure, kept for results files written before)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    load = [round(x, 2) for x in os.getloadavg()]
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": load,
        "load_average_1m_at_start": load[0],
    }
