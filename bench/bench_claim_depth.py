"""Benchmark: one claim's statements at depth on MariaDB/MySQL or SQLite, timed and EXPLAINed.

Usage:
    python bench/bench_claim_depth.py --mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test
        [--queued 100000] [--claims 5] [--batch 100]
    python bench/bench_claim_depth.py --sqlite [--queued 100000] ...

Enqueues ``--queued`` events (one source record each) into a fresh database,
then runs ``--claims`` claims of ``--batch`` items (all classes, a budget
that never binds), capturing every statement with an SQLAlchemy event
listener: prints the time per claim, the statements per claim, each
statement's duration per claim, and MariaDB's EXPLAIN of each SELECT (locking
clauses stripped: EXPLAIN shows the plan, not the locks). Drops the database
at the end. Nothing is written under ``bench/results/``: the figures go to
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import event as sa_event
from sqlalchemy import text
from sqlalchemy.engine import make_url

from nexuscrm.connectors import queue
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db.engine import make_engine
from tests.builders import event


def main(argv: list[str] | None = None) -> None:
    """Run the claim-at-depth measurement (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mysql-url")
    parser.add_argument("--sqlite", action="store_true", help="a SQLite file instead of MariaDB")
    parser.add_argument(
        "--sqlite-analyze",
        action="store_true",
        help="run ANALYZE on the SQLite file first (nexusctl never does; MariaDB always is)",
    )
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--claims", type=int, default=5)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    if bool(args.mysql_url) == bool(args.sqlite):
        parser.error("give exactly one of --mysql-url URL and --sqlite")
    name = f"nexus_b_{uuid.uuid4().hex[:8]}"
    scratch = tempfile.TemporaryDirectory(prefix="claim-depth-")
    if args.sqlite:
        root = None
        engine = make_engine(f"sqlite:///{scratch.name}/{name}.db")
    else:
        root = make_engine(args.mysql_url)
        with root.begin() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        url = make_url(args.mysql_url).set(database=name)
        engine = make_engine(url.render_as_string(hide_password=False))
    explain = "EXPLAIN QUERY PLAN " if args.sqlite else "EXPLAIN "
    try:
        ensure_system_schema(engine)
        started = time.perf_counter()
        for first in range(0, args.queued, 5000):
            last = min(args.queued, first + 5000)
            queue.enqueue(engine, [event("pack-1", f"k{j}", f"S{j}") for j in range(first, last)])
        print(f"enqueued {args.queued} in {time.perf_counter() - started:.1f} s")
        if args.sqlite_analyze or not args.sqlite:
            with engine.connect() as conn:
                conn.exec_driver_sql(
                    "ANALYZE" if args.sqlite else "ANALYZE TABLE _System_ConnectorWorkItem"
                )
        spec = queue.ClaimSpec(
            installed_pack_id="pack-1",
            queue_classes=(),
            batch_size=args.batch,
            lease_owner="bench",
            lease_seconds=600,
            max_processing_rows=10**9,
        )
        queue.claim_leases(engine, spec)  # warm the pool and the statement caches
        captured: list[tuple[str, Any]] = []
        durations: dict[str, list[float]] = {}
        clock: list[float] = []

        def before(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _m: bool) -> None:
            captured.append((statement, params))
            clock.append(time.perf_counter())

        def after(_c: Any, _cur: Any, statement: str, _p: Any, _ctx: Any, _m: bool) -> None:
            key = " ".join(statement.split())[:70]
            durations.setdefault(key, []).append(round(1000 * (time.perf_counter() - clock[-1]), 2))

        sa_event.listen(engine, "before_cursor_execute", before)
        sa_event.listen(engine, "after_cursor_execute", after)
        times = []
        for _ in range(args.claims):
            t0 = time.perf_counter()
            queue.claim_leases(engine, spec)
            times.append(round(1000 * (time.perf_counter() - t0), 1))
        sa_event.remove(engine, "before_cursor_execute", before)
        sa_event.remove(engine, "after_cursor_execute", after)
        print(f"claim ms {times}; statements per claim {len(captured) // args.claims}")
        for key, ms in durations.items():
            print(f"  {ms} ms  {key}")
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert raw is not None
            for statement, params in captured[: len(captured) // args.claims]:
                head = " ".join(statement.split())[:100]
                if not statement.lstrip().upper().startswith("SELECT"):
                    continue
                plain = statement.replace(" FOR UPDATE SKIP LOCKED", "")
                plain = plain.replace(" LOCK IN SHARE MODE", "")
                cur = raw.cursor()
                cur.execute(explain + plain, params)
                print(f"{explain}{head}")
                for row in cur.fetchall():
                    print(f"    {row[:10]}")
    finally:
        engine.dispose()
        if root is not None:
            with root.begin() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        scratch.cleanup()


if __name__ == "__main__":
    main()
