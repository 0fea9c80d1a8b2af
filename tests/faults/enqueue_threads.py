"""Enqueue one events file from many threads of one process at once (a test aid).

``python tests/faults/enqueue_threads.py FILE THREADS`` with the ``NEXUS_*``
settings of a database where the salesforce-sync pack is installed: reads
FILE as ``nexusctl events enqueue`` does, starts THREADS threads that each
enqueue all of it at the same moment (a barrier), and prints one line per
thread: ``inserted <n> duplicates <m>``. Used by ``test_races.py``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nexuscrm.connectors import queue
from nexuscrm.connectors.eventfile import read_event_file
from nexuscrm.connectors.routes import RouteResolver, list_connector_packs
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings


def main(path: Path, threads: int) -> None:
    """Enqueue ``path`` from ``threads`` threads at once; print each one's counts."""
    engine = make_engine(Settings().database_url, pool_size=threads, max_overflow=0)
    (pack,) = [p for p in list_connector_packs(engine) if p.namespace == "salesforce-sync"]
    requests = read_event_file(
        path,
        installed_pack_id=pack.install_id,
        namespace=pack.namespace,
        resolver=RouteResolver(engine),
    )
    start = threading.Barrier(threads)
    lines: list[str] = []

    def run() -> None:
        start.wait()
        result = queue.enqueue(engine, requests)
        lines.append(f"inserted {result.inserted} duplicates {result.duplicates}")

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    print("\n".join(lines))
    if len(lines) != threads:
        raise SystemExit(f"{threads - len(lines)} thread(s) failed")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
