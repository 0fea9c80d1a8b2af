"""Hostile candidate, serving-selection and ``sfdx-project.json`` files (issue 17,
audit items 2, 3 and 4).

``apply-all --candidate /dev/zero`` grew to 21 GB; a serving selection that is
``/dev/zero`` ended in a ``MemoryError``; 50,000-deep JSON/YAML in any of these
files ended in a ``RecursionError`` traceback (in ApplyAll: a failure naming
no file); ``candidate write --out`` into a missing folder in a
``FileNotFoundError`` traceback. Each is now one ``error:`` line naming the
file and the limit, read with memory bounded, and ApplyAll fails such a
project at once, without retrying.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from nexuscrm.contracts import ApplyAllInput
from nexuscrm.controlplane.candidate import MAX_CANDIDATE_BYTES
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import (
    cli_env,
    db_state,
    executions,
    installed_state,
    invoke,
    invoke_async,
    write_sfdx,
    write_small_pack,
)

DEEP = 50_000


def _crashed(res: Any) -> bool:
    return res.exception is not None and not isinstance(res.exception, SystemExit)


def _one_error_line(res: Any) -> str:
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _deep_files(tmp_path: Path, stem: str) -> list[Path]:
    deep_json = tmp_path / f"{stem}.json"
    deep_json.write_text("[" * DEEP + "]" * DEEP)
    deep_yaml = tmp_path / f"{stem}.yaml"
    deep_yaml.write_text("packs: " + "[" * DEEP + "]" * DEEP + "\n")
    return [deep_json, deep_yaml]


async def test_candidate_from_dev_zero_is_refused_at_the_limit(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    before = _peak_rss_mib()
    zero = tmp_path / "candidate.yaml"
    zero.symlink_to("/dev/zero")
    for path in ["/dev/zero", str(zero)]:
        res = await invoke_async(
            ["apply-all", "--candidate", path], cli_env(settings, temporal_env)
        )
        line = _one_error_line(res)
        assert f"candidate {path}: larger than the limit of 1 MiB" in line, line
    assert _peak_rss_mib() - before < 3 * MAX_CANDIDATE_BYTES / 2**20 + 50
    started = await executions(
        temporal_env.client, f"WorkflowId = '{settings.controlplane_workflow_id}'"
    )
    assert started == []


def test_deep_candidate_files_are_refused_naming_the_file(settings: Any, tmp_path: Path) -> None:
    for path in _deep_files(tmp_path, "deep-candidate"):
        res = invoke(["apply-all", "--candidate", str(path)], cli_env(settings))
        line = _one_error_line(res)
        assert f"candidate {path}: nested deeper than 64 levels" in line, line


def test_serving_selection_from_dev_zero_or_deep_is_refused_naming_the_file(
    settings: Any, tmp_path: Path
) -> None:
    zero = tmp_path / "selection.json"
    zero.symlink_to("/dev/zero")
    before = _peak_rss_mib()
    res = invoke(["worker"], cli_env(settings) | {"NEXUS_SERVING_SELECTION": str(zero)})
    line = _one_error_line(res)
    assert f"Runtime serving selection file {zero}: larger than the limit of 4 MiB" in line
    assert _peak_rss_mib() - before < 100
    for path in _deep_files(tmp_path, "deep-selection"):
        res = invoke(["worker"], cli_env(settings) | {"NEXUS_SERVING_SELECTION": str(path)})
        line = _one_error_line(res)
        assert f"Runtime serving selection file {path}: nested deeper than 64" in line, line


def _deep_project(root: Path) -> Path:
    write_sfdx(root, {"Size__c": "<label>Size</label><type>Number</type>"})
    (root / "sfdx-project.json").write_text("[" * DEEP + "]" * DEEP)
    return root


def test_import_sfdx_refuses_a_deep_project_file_naming_it(settings: Any, tmp_path: Path) -> None:
    project = _deep_project(tmp_path / "deep-app")
    res = invoke(["packs", "import-sfdx", str(project)], cli_env(settings))
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    assert "RecursionError" not in res.output
    assert str(project / "sfdx-project.json") in res.output
    assert "nested deeper than 64 levels" in res.output


async def test_applyall_fails_a_deep_project_at_once_naming_the_file(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    project = _deep_project(tmp_path / "deep-app")
    engine, before = await installed_state(temporal_env, settings, tmp_path)
    good = write_small_pack(tmp_path / "good.yaml", "good-app", "Good__c")
    async with build_worker(temporal_env.client, settings):
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(good), str(project)]),
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
    cause = str(info.value.cause)
    assert str(project / "sfdx-project.json") in cause and "nested deeper than 64" in cause
    assert "RecursionError" not in cause
    attempts = [
        e.activity_task_started_event_attributes.attempt
        async for e in handle.fetch_history_events()
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert attempts and max(attempts) == 1, attempts  # no phase was retried
    # nothing half-applied: the good pack of the run neither
    try:
        assert db_state(engine) == before
    finally:
        engine.dispose()


def test_candidate_write_into_a_missing_folder_is_one_line(settings: Any, tmp_path: Path) -> None:
    out = tmp_path / "nonexistent" / "dir" / "x.yaml"
    res = invoke(["candidate", "write", "--out", str(out)], cli_env(settings))
    line = _one_error_line(res)
    assert f"--out {out}: cannot write the candidate: No such file or directory" in line, line
    assert not out.parent.exists()


def test_yaml_aliases_are_measured_once_and_a_recursive_one_is_refused(tmp_path: Path) -> None:
    """A candidate of shared aliases (10^9 items once expanded) is walked in
    linear time; an alias that contains itself never ends, so it is refused."""
    from nexuscrm.controlplane.candidate import CandidateError, load_candidate

    bomb = tmp_path / "bomb.yaml"
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 10)]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(CandidateError, match="expected a mapping with exactly one key 'packs'"):
        load_candidate(bomb)
    loop = tmp_path / "loop.yaml"
    loop.write_text("packs: &p [*p]\n")
    with pytest.raises(CandidateError, match=r"loop\.yaml: nested without end"):
        load_candidate(loop)


def test_a_candidate_file_names_every_bad_entry_at_once(tmp_path: Path) -> None:
    """Two bad entries and a duplicate: each named by its index, in one error."""
    from nexuscrm.controlplane.candidate import CandidateError, load_candidate

    path = tmp_path / "candidate.yaml"
    path.write_text(
        "packs:\n"
        "  - {name: a, digest: nothex}\n"
        "  - {name: b, digest: '" + "0" * 64 + "', extra: 1}\n"
        "  - {name: a, digest: '" + "0" * 64 + "', source: 5}\n"
    )
    with pytest.raises(CandidateError) as info:
        load_candidate(path)
    text = str(info.value)
    assert str(path) in text and "4 problem(s)" in text, text
    for part in ("packs[0] (a): 'digest'", "packs[1]: unknown key(s) ['extra']",
                 "packs[2] (a): 'source'", "packs[2]: pack a is listed twice"):  # fmt: skip
        assert part in text, text
