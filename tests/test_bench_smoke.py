"""Smoke tests of the benches (``bench/``): each runs at a tiny size, on SQLite only,
and must complete and write its JSON results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from temporalio.testing import WorkflowEnvironment

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
    assert written["pipeline_over_best_direct"]["sqlite"] > 0
