"""Exact candidates and the final-verify hook (issue 12 item 9), on a real Temporal
dev server, SQLite and MariaDB.

A candidate pins every pack with its digest. Paths: skip only on an exact
digest match plus a whole-target verify; live drift promotes to a full
apply; a candidate that its sources do not build is refused before any
write; a revision of installed packs takes the component delta; the
final-verify hook runs on every path and fails the run (never completed,
non-zero exit) when it fails. Also the same input from the ``temporal`` CLI
(a plain JSON workflow input) and ``nexusctl apply-all --candidate``.
"""

from __future__ import annotations

import shlex
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine, inspect, select, text
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllResult
from nexuscrm.contracts.candidate import CandidatePack, CandidateSpec
from nexuscrm.controlplane import candidate, markers, packs_apply
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import view_names
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.worker import build_worker
from tests.builders import apply_all, cli_env, invoke_async


def gizmo_pack(path: Path, fields: int = 1) -> Path:
    """AppPack ``gizmo-app`` with ``fields`` Number fields on ``Gizmo__c``."""
    path.write_text(
        yaml.safe_dump(
            {
                "name": "gizmo-app",
                "category": "AppPack",
                "depends_on": ["platform-core"],
                "objects": [
                    {
                        "api_name": "Gizmo__c",
                        "fields": [
                            {"api_name": f"F{i}__c", "type": "Number"} for i in range(fields)
                        ],
                    }
                ],
            }
        )
    )
    return path


def spec_of(settings: Settings, sources: list[str]) -> CandidateSpec:
    """The exact candidate of ``sources`` on this database (``nexusctl candidate write``)."""
    engine = make_engine(settings.database_url)
    doc = candidate.from_plan(packs_apply.load_plan(engine, sources, True), sources)
    return candidate.parse_candidate(doc, "test")


async def run(env: WorkflowEnvironment, settings: Settings, **kw: Any) -> ApplyAllResult:
    catalog.CACHE.invalidate()
    return await apply_all(env, settings, **kw)


async def failure(env: WorkflowEnvironment, settings: Settings, **kw: Any) -> str:
    catalog.CACHE.invalidate()
    with pytest.raises(WorkflowFailureError) as info:
        await apply_all(env, settings, **kw)
    return str(info.value.cause)


def statuses(result: ApplyAllResult) -> dict[str, str]:
    return {p.name: p.status for p in result.phases}


def marker(engine: Engine) -> str | None:
    m = markers.read(engine)
    return None if m is None else m.status


def recording_hook(tmp_path: Path, exit_code: int = 0) -> tuple[str, Path]:
    """A final-verify hook appending NEXUS_FINAL_VERIFY_PATH to a log; exits ``exit_code``."""
    log = tmp_path / f"hook-{uuid.uuid4().hex[:6]}.log"
    script = tmp_path / f"hook-{uuid.uuid4().hex[:6]}.py"
    script.write_text(
        "import os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(os.environ['NEXUS_FINAL_VERIFY_PATH'] + '\\n')\n"
        f"print('checked', os.environ['NEXUS_FINAL_VERIFY_PATH'])\n"
        f"sys.exit({exit_code})\n"
    )
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}", log


def logged(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


async def test_exact_candidate_skips_only_on_exact_match_and_whole_target_verify(
    temporal_env, settings, tmp_path
):
    pack = gizmo_pack(tmp_path / "gizmo.yaml")
    command, log = recording_hook(tmp_path)
    hooked = settings.model_copy(update={"final_verify_command": command})
    spec = spec_of(settings, [str(pack)])
    first = await run(temporal_env, hooked, policy="exact_candidate", candidate=spec)
    assert first.status == "completed"  # fresh database: full apply
    assert statuses(first)["apply-packs"] == "completed"
    engine = make_engine(settings.database_url)
    assert marker(engine) == "completed"

    again = await run(temporal_env, hooked, policy="exact_candidate", candidate=spec)
    assert again.status == "skipped"
    assert "exact candidate is active and the whole target verifies" in again.reason
    assert statuses(again)["mark-running"] == "skipped"
    assert logged(log) == ["apply", "skip"]  # the hook ran on both paths

    # Live drift under an exact digest match: the whole-target verify finds it
    # and the run promotes to a full apply, which heals it.
    with engine.begin() as conn:
        conn.execute(text("DROP VIEW v_Gizmo__c"))
    healed = await run(temporal_env, hooked, policy="exact_candidate", candidate=spec)
    assert healed.status == "completed"
    detail = next(p.detail or "" for p in healed.phases if p.name == "classify-candidate")
    assert detail.startswith("apply: exact already-active candidate failed whole-target")
    assert "v_Gizmo__c is missing" in detail
    assert "v_Gizmo__c" in view_names(engine)
    assert logged(log) == ["apply", "skip", "apply"]


async def test_candidate_its_sources_do_not_build_is_refused_before_any_write(
    temporal_env, settings, tmp_path
):
    pack = gizmo_pack(tmp_path / "gizmo.yaml")
    spec = spec_of(settings, [str(pack)])
    await run(temporal_env, settings, policy="exact_candidate", candidate=spec)
    engine = make_engine(settings.database_url)
    gizmo_pack(pack, fields=2)  # the source moved; the candidate still pins the old digest
    message = await failure(temporal_env, settings, policy="exact_candidate", candidate=spec)
    assert "classify-candidate" in message
    assert "exact candidate does not match its sources, refusing before any write" in message
    assert "pack gizmo-app: its source builds" in message
    assert marker(engine) == "completed"  # untouched
    assert "F1__c" not in {c["name"] for c in inspect(engine).get_columns("Gizmo__c")}

    wrong = CandidateSpec([*spec.packs, CandidatePack("ghost-pack", "0" * 64)])
    message = await failure(temporal_env, settings, policy="exact_candidate", candidate=wrong)
    assert "candidate pack ghost-pack is not in the plan" in message
    message = await failure(temporal_env, settings, policy="exact_candidate")
    assert "policy exact_candidate requires a candidate" in message


async def test_candidate_revision_takes_the_component_delta(temporal_env, settings, tmp_path):
    pack = gizmo_pack(tmp_path / "gizmo.yaml")
    command, log = recording_hook(tmp_path)
    hooked = settings.model_copy(update={"final_verify_command": command})
    await run(
        temporal_env, hooked, policy="exact_candidate", candidate=spec_of(settings, [str(pack)])
    )
    engine = make_engine(settings.database_url)
    gizmo_pack(pack, fields=2)
    spec = spec_of(settings, [str(pack)])
    result = await run(temporal_env, hooked, policy="exact_candidate", candidate=spec)
    assert result.status == "completed"
    phases = statuses(result)
    # Only the changed pack is re-applied: no schema, repair or platform replay.
    for skipped in ("apply-metadata", "run-repair", "apply-packs"):
        assert phases[skipped] == "skipped", skipped
    for ran in ("apply-candidate-delta", "rebuild-derived", "verify", "final-verify",
                "source-revision-advance-final-gate", "mark-completed"):  # fmt: skip
        assert phases[ran] == "completed", ran
    detail = next(p.detail for p in result.phases if p.name == "apply-candidate-delta")
    assert detail == "1 changed pack(s) re-applied: gizmo-app"
    assert "F1__c" in {c["name"] for c in inspect(engine).get_columns("Gizmo__c")}
    with engine.connect() as conn:
        digest = conn.execute(
            select(t.installed_pack.c.PayloadHash).where(t.installed_pack.c.Name == "gizmo-app")
        ).scalar_one()
    assert digest == candidate.digests(spec)["gizmo-app"]
    assert marker(engine) == "completed"
    assert logged(log) == ["apply", "delta"]
    # always_apply with the same candidate never takes the delta nor skips.
    full = await run(temporal_env, hooked, policy="always_apply", candidate=spec)
    assert statuses(full)["apply-packs"] == "completed"


async def test_failing_final_verify_hook_never_completes(temporal_env, settings, tmp_path):
    pack = gizmo_pack(tmp_path / "gizmo.yaml")
    spec = spec_of(settings, [str(pack)])
    await run(temporal_env, settings, policy="exact_candidate", candidate=spec)
    engine = make_engine(settings.database_url)
    command, log = recording_hook(tmp_path, exit_code=3)
    failing = settings.model_copy(update={"final_verify_command": command})
    # Skip path: the exact candidate is active, but the hook refuses it.
    message = await failure(temporal_env, failing, policy="exact_candidate", candidate=spec)
    assert "final-verify" in message and "exited 3" in message
    assert marker(engine) == "completed"  # a skip writes nothing
    # Apply path: the run fails before mark-completed and stamps failed.
    message = await failure(temporal_env, failing, policy="always_apply", candidate=spec)
    assert "ApplyAll failed in phase final-verify" in message
    assert marker(engine) == "failed"
    assert logged(log) == ["skip", "apply"]


async def test_candidate_from_the_temporal_cli_and_nexusctl(temporal_env, settings, tmp_path):
    pack = gizmo_pack(tmp_path / "gizmo.yaml")
    spec = spec_of(settings, [str(pack)])
    # The `temporal workflow start --input '<json>'` shape: a plain JSON object.
    raw = {
        "policy": "exact_candidate",
        "candidate": {
            "packs": [{"name": p.name, "digest": p.digest, "source": p.source} for p in spec.packs]
        },
    }
    async with build_worker(temporal_env.client, settings):
        handle = await temporal_env.client.start_workflow(
            "ApplyAll",
            raw,
            id=settings.controlplane_workflow_id,
            task_queue=settings.controlplane_task_queue,
            result_type=ApplyAllResult,
        )
        result = await handle.result()
    assert result.status == "completed"
    assert [p.name for p in result.packs if p.name == "gizmo-app"] == ["gizmo-app"]

    env = cli_env(settings, temporal_env)
    written = tmp_path / "candidate.yaml"
    out = await invoke_async(
        ["candidate", "write", "--app-pack", str(pack), "--dev-sample", "--out", str(written)], env
    )
    assert out.exit_code == 0, out.output
    async with build_worker(temporal_env.client, settings):
        cli = await invoke_async(["apply-all", "--wait", "--candidate", str(written)], env)
        assert cli.exit_code == 0, cli.output
        assert "skipped" in cli.output
        gizmo_pack(pack, fields=3)  # the candidate file no longer matches its source
        bad = await invoke_async(["apply-all", "--wait", "--candidate", str(written)], env)
    assert bad.exit_code == 1
    assert "exact candidate does not match its sources" in bad.output
    both = await invoke_async(
        ["apply-all", "--candidate", str(written), "--app-pack", str(pack)], env
    )
    assert both.exit_code == 2  # a command-line mistake: Click's usage exit code
    assert "either with --app-pack or in the --candidate file" in both.output


async def test_interrupted_run_is_finished_by_a_full_apply_not_a_recovery(
    temporal_env, settings, tmp_path
):
    """No finalization-ready state: a run stopped before mark-completed leaves
    ``running``; the exact-candidate retry neither skips nor takes the delta."""
    pack = gizmo_pack(tmp_path / "gizmo.yaml")
    spec = spec_of(settings, [str(pack)])
    await run(temporal_env, settings, policy="exact_candidate", candidate=spec)
    engine = make_engine(settings.database_url)
    with engine.begin() as conn:  # a run that died after verify, before mark-completed
        markers.mark(conn, markers.MarkerStatus.running, "dead-run", "ApplyAll")
    assert "finalization_ready" not in {s.value for s in markers.MarkerStatus}
    retry = await run(temporal_env, settings, policy="exact_candidate", candidate=spec)
    assert retry.status == "completed"
    assert statuses(retry)["apply-packs"] == "completed"
    assert statuses(retry)["apply-candidate-delta"] == "skipped"
    assert marker(engine) == "completed"
