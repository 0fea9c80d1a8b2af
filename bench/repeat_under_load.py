"""Run pytest node ids N times in a row while other processes keep every core busy.

Usage:
    python bench/repeat_under_load.py [--runs 20] [--burners 2] [NODE_ID ...]

Without node ids it runs the worker-kill tests on both backends (SIGKILL of a
worker process mid apply-packs, and mid batch of the connector runtime).
``NEXUS_TEST_MYSQL_URL`` must be set for the MariaDB variants to run (else
they are skipped, and the script says how many were). Each run is one pytest
process; the script prints one line per run and a summary, and exits 1 if any
run failed. This is how "the worker-kill tests hold under load" is shown; it
is not part of ``.ci/run`` (20 runs take several minutes).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER_KILL_TESTS = [
    "tests/test_apply_all.py::test_worker_killed_mid_apply_packs_resumes_to_same_result",
    "tests/test_connector_runtime.py::"
    "test_worker_process_killed_mid_batch_leases_expire_and_nothing_duplicates",
]


def _burn(stop_at: float) -> None:
    """Spin one core until ``stop_at`` (time.monotonic)."""
    x = 0
    while time.monotonic() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, start the burners, run the tests ``--runs`` times; 0 if all passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    parser.add_argument("node_ids", nargs="*", default=WORKER_KILL_TESTS)
    args = parser.parse_args(argv)

    burners = [
        multiprocessing.Process(target=_burn, args=(time.monotonic() + 24 * 3600,), daemon=True)
        for _ in range(args.burners)
    ]
    for b in burners:
        b.start()
    failed = 0
    try:
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.node_ids],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            ok = proc.returncode == 0
            failed += not ok
            print(
                f"run {run:2d}/{args.runs}: {'pass' if ok else 'FAIL'} "
                f"in {time.monotonic() - started:5.1f} s  ({tail})",
                flush=True,
            )
            if not ok:
                print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
            if re.search(r"\d+ skipped", tail):
                print("  note: some were skipped (is NEXUS_TEST_MYSQL_URL set?)", flush=True)
    finally:
        for b in burners:
            b.terminate()
    print(f"{args.runs - failed}/{args.runs} runs passed with {args.burners} busy processes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
