"""Smoke tests of the benches (``bench/``): each runs at a tiny size, on SQLite only,
and must complete and write its JSON results."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest
from temporalio.testing import WorkflowEnvironment

from nexuscrm.controlplane.inprocess import APPLY_PHASES, AUTO_START_SKIP_PHASES
from tests.builders import CORPUS_PROJECTS, corpus_project

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench(name: str) -> ModuleType:
    """A bench script as a module (``bench/`` is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def test_corpus_views_bench_smoke(temporal_env: WorkflowEnvironment, tmp_path: Path) -> None:
    # One small project keeps CI short; the whole corpus in one ApplyAll is
    # tests/test_sfdx_corpus.py's and tests/faults/test_database_defaults.py's.
    project = "dreamhouse-lwc"
    corpus_project(project)  # skips when ../shared/corpus is absent
    bench = _bench("bench_corpus_views")
    assert bench.CORPUS_PROJECTS == CORPUS_PROJECTS
    out = tmp_path / "results" / "corpus_views.json"
    args = bench.parse_args(["--rows", "200", "--projects", project, "--out", str(out)])
    result = await bench.run(temporal_env, args)

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"bench", "command", "date", "rows", "projects", "machine", "backends"} <= set(written)
    assert written["rows"] == 200
    assert {"cores", "memory_gib"} <= set(written["machine"])
    assert list(written["backends"]) == ["sqlite"]
    sqlite = written["backends"]["sqlite"]
    assert {
        "db_version",
        "apply_all_s",
        "views",
        "widest",
        "rows",
        "load_s",
        "timings",
        "projects",
        "left_out",
        "missing",
    } <= set(sqlite)
    assert sqlite["db_version"].startswith("SQLite ")
    widest = sqlite["widest"]
    assert {"object", "view", "columns", "formulas", "rollups", "joins"} <= set(widest)
    assert widest["pack"] == project
    assert widest["columns"] == sqlite["widest_corpus_views"][0]["columns"]
    assert sqlite["rows"]["object"] == 200
    timings = sqlite["timings"]
    for key in ("select_all_ms", "select_by_id_ms", "count_ms"):
        assert timings[key] > 0, key
    assert len(timings["select_all_runs_ms"]) == 3
    assert set(sqlite["projects"]) == {project}
    for counts in sqlite["projects"].values():
        assert counts["computed"] == counts["compiled"] + counts["left_out"] + counts["missing"]
    assert sum(c["compiled"] for c in sqlite["projects"].values()) > 0


async def test_connectors_bench_smoke(tmp_path: Path) -> None:
    """The inbound bench: the pipeline and two direct loops on SQLite, each
    draining its events, with CPU per event and the ratio written."""
    bench = _bench("bench_connectors")
    out = tmp_path / "results" / "connectors.json"
    argv = ["--events", "60", "--workers", "2", "--direct-threads", "1,2", "--out", str(out)]
    result = await bench.main(argv)

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"bench", "command", "date", "machine", "events", "runs"} <= set(written)
    assert [(r["backend"], r["mode"]) for r in written["runs"]] == [
        ("sqlite", "pipeline"),
        ("sqlite", "direct-1"),
        ("sqlite", "direct-2"),
    ]
    for run in written["runs"]:
        assert run["events"] == 60 and run["events_per_s"] > 0
        assert run["cpu_us_per_event"]["worker"] > 0
    assert "temporal" in written["runs"][0]["cpu_us_per_event"]
    # the pipeline's time to its first event (the fleet's start) is said apart
    assert 0 < written["runs"][0]["first_event_s"] <= written["runs"][0]["seconds"]
    assert written["pipeline_over_best_direct"]["sqlite"] > 0
    # read from the worker's /metrics: every event counted, and the claims behind them
    figures = written["runs"][0]["metrics"]
    assert figures["events_processed"] == 60
    assert figures["batches"] >= 1 and figures["claims"] >= figures["batches"]
    assert 0 < figures["batch_size_mean"] <= 60 and figures["claim_ms_mean"] > 0
    assert figures["activity_tasks"] >= figures["batches"] and figures["workflow_tasks"] > 0
    # the regression guard: a second run compares with the file the first one wrote
    again = await bench.main([*argv, "--no-pipeline"])
    assert set(again["previous"]["events_per_s"]) == {"sqlite/direct-1", "sqlite/direct-2"}


async def test_apply_all_bench_smoke(temporal_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """ApplyAll through Temporal against the same phases in-process: one round of one
    small corpus project on SQLite, both paths doing the same work, the figures, the
    auto-start decision and the comparison with a previous run written."""
    project = corpus_project("dreamhouse-lwc")  # skips when ../shared/corpus is absent
    bench = _bench("bench_apply_all")
    out = tmp_path / "results" / "apply_all.json"
    args = bench.parse_args(["--app-pack", str(project), "--repeat", "1", "--out", str(out)])
    result = await bench.run(temporal_env, args)

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"bench", "command", "date", "target", "sources", "machine", "backends"} <= set(written)
    assert "previous" not in written  # nothing to compare with yet
    assert written["sources"] == ["dreamhouse-lwc"]
    assert {"cores", "memory_gib", "databases"} <= set(written["machine"])
    assert list(written["backends"]) == ["sqlite"]
    sqlite = written["backends"]["sqlite"]
    assert sqlite["db_version"].startswith("SQLite ")
    assert sqlite["equal"] == {"ok": True, "problems": []}
    for path in ("temporal", "in_process"):
        for kind in ("fresh", "converged"):
            figure = sqlite[path][kind]
            assert figure["median_s"] > 0 and len(figure["runs_s"]) == 1, (path, kind)
    assert set(sqlite["ratio"]) == {"fresh", "converged"}
    assert all(r > 0 for r in sqlite["ratio"].values())
    auto = sqlite["auto_start"]
    assert {"decision", "decision_phases", "in_process", "process"} <= set(auto)
    assert all(auto[k]["median_s"] > 0 for k in auto)
    assert set(sqlite["target_met"]) == {"ratio_fresh", "ratio_converged", "auto_start_decision"}
    phases = sqlite["phases"]
    assert list(phases["fresh"]) == list(phases["converged"]) == list(APPLY_PHASES)
    assert list(phases["auto_start"]) == list(AUTO_START_SKIP_PHASES)

    # The regression guard: every figure against the previous run's, in %.
    again = bench.compare(written, written)
    assert again["date"] == written["date"] and again["same_sources"]
    assert len(again["changes"]) == len(bench.figures(written)) == 10
    assert {c["change_pct"] for c in again["changes"].values()} == {0.0}


async def test_identity_bench_smoke(temporal_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """The identity bench: steady, bulk and parked, waits and poll, on SQLite; every
    child woken and done, the figures written, and compared with a previous file."""
    bench = _bench("bench_identity")
    out = tmp_path / "results" / "identity.json"
    argv = [
        "--n", "20", "--parked-n", "10", "--modes", "steady,bulk,parked", "--rate", "40",
        "--poll-seconds", "1", "--idle", "1", "--idle-after", "0", "--out", str(out),
    ]  # fmt: skip
    result = await bench.run(temporal_env, bench.parse_args(argv))

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {
        "bench",
        "command",
        "date",
        "machine",
        "settings",
        "targets",
        "backends",
        "verdicts",
        "previous",
    } <= set(written)
    assert written["previous"] is None
    assert written["command"].startswith("python bench/bench_identity.py --n 20")
    assert {"cores", "memory_gib", "load_average"} <= set(written["machine"])
    assert list(written["backends"]) == ["sqlite"]
    runs = written["backends"]["sqlite"]
    assert list(runs) == ["steady", "bulk", "parked"]
    for mode, designs in runs.items():
        assert list(designs) == ["waits", "poll"], mode
        for design, run in designs.items():
            assert "error" not in run, run
            assert run["n"] == (10 if mode == "parked" else 20) and run["complete"], (mode, design)
            assert run["left_blocked"] == run["left_blocked_linked"] == run["failed"] == 0
            assert run["park_s"] > 0
            waits = {"waits_running_at_done", "waits_done_after_s", "waits_left_running"}
            assert (waits <= set(run)) == (design == "waits"), (mode, design)
            if mode == "parked":
                assert run["wake_all_s"] > 0
                assert {"server_rss_before_mib", "server_rss_growth_mib"} <= set(run)
                idle = run["idle"]
                for key in ("worker_cpu_pct", "server_cpu_pct", "worker_rss_mib"):
                    assert idle[key] is not None, key
                assert idle["server_rss_mib"] > 0
                assert idle["waits_running"] == (10 if design == "waits" else 0)
            else:
                for key in ("latency_ms", "link_to_woken_ms", "enqueue_to_link_ms"):
                    assert run[key]["count"] == 20, (mode, design, key)
                    assert run[key]["median"] <= run[key]["p99"] <= run[key]["max"]
    assert written["settings"]["n"] == 20 and written["settings"]["parked_n"] == 10
    assert runs["steady"]["waits"]["rate"] == 40
    assert runs["bulk"]["poll"]["all_done_s"] > 0
    assert set(written["verdicts"]["sqlite"]) >= {"steady_median", "parked_worker_rss"}

    # The next run compares each figure with this file.
    previous = bench.compare_with_previous(out, result)
    assert previous is not None and previous["date"] == written["date"]
    key = "sqlite/steady/waits/latency_ms.median"
    before = runs["steady"]["waits"]["latency_ms"]["median"]
    assert previous["figures"][key] == [before, before, 0.0]


async def test_identity_bench_series_smoke(tmp_path: Path) -> None:
    """``--repeat``: the parked mode runs that many times in a row, each on a fresh
    database and a fresh dev server (as ``main`` runs it: no run pays for an earlier
    run's executions); every run is kept in the series and the series has its own
    verdict."""
    bench = _bench("bench_identity")
    out = tmp_path / "series.json"
    argv = [
        "--parked-n", "5", "--modes", "parked", "--designs", "waits", "--idle", "0.5",
        "--idle-after", "0", "--settle", "5", "--repeat", "2", "--out", str(out),
    ]  # fmt: skip
    result = await bench.run(None, bench.parse_args(argv), fresh_server=bench.dev_server)
    run = result["backends"]["sqlite"]["parked"]["waits"]
    assert len(run["series"]) == 2 and result["settings"]["repeat"] == 2
    for entry in run["series"]:
        assert "error" not in entry, entry
        assert entry["wake_all_s"] > 0 and entry["left_blocked"] == 0, entry
        assert entry["idle_server_cpu_pct"] is not None
    servers = [entry["server"] for entry in run["series"]]
    assert len(set(servers)) == 2, servers
    # each server was stopped with its run: nothing listens there any more
    for server in servers:
        host, port = server.rsplit(":", 1)
        with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
            pass
    assert result["verdicts"]["sqlite"]["parked_series_all_woken_in_time"] is True
    assert json.loads(out.read_text())["backends"]["sqlite"]["parked"]["waits"]["series"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0"])


def test_claim_depth_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The claim-at-depth bench on MariaDB at a tiny depth: claims timed, EXPLAIN printed,
    its database dropped."""
    url = os.environ.get("NEXUS_TEST_MYSQL_URL")
    if not url:
        pytest.skip("NEXUS_TEST_MYSQL_URL not set")
    bench = _bench("bench_claim_depth")
    bench.main(["--mysql-url", url, "--queued", "300", "--claims", "2", "--batch", "20"])
    out = capsys.readouterr().out
    assert "enqueued 300" in out and "statements per claim" in out
    assert "EXPLAIN SELECT" in out and "ix_ConnectorWorkItem_Claim" in out


@pytest.mark.parametrize("analyze", [False, True], ids=["no-stats", "analyzed"])
def test_claim_depth_bench_smoke_on_sqlite(
    capsys: pytest.CaptureFixture[str], analyze: bool
) -> None:
    """The claim-at-depth bench on a SQLite file, as nexusctl meets it (no ANALYZE) and
    after an ANALYZE taken while every item was pending (its statistics say one state
    per pack): claims timed, the query plans printed, each slice on the claim index."""
    bench = _bench("bench_claim_depth")
    extra = ["--sqlite-analyze"] if analyze else []
    bench.main(["--sqlite", "--queued", "300", "--claims", "2", "--batch", "20", *extra])
    out = capsys.readouterr().out
    assert "enqueued 300" in out and "statements per claim" in out
    assert "EXPLAIN QUERY PLAN SELECT" in out
    assert "SEARCH w USING INDEX ix_ConnectorWorkItem_Claim" in out
    assert "SCAN w" not in out  # no slice of the candidate scan reads the whole table
