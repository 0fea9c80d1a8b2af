"""Hostile values for the control plane's numeric inputs (issue 17 item 2), on both backends.

``--heartbeat-timeout`` of -1, 0, nan, inf or 1e300 used to start an ApplyAll
whose first activity could never be scheduled: ``--wait`` hung and every later
control-plane command on the database was refused as already running. The
CLI now refuses the value before anything starts; a workflow started with it
by hand (the ``temporal`` CLI, a client) fails at once, naming the value, and
leaves the database's control plane free.
"""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from nexuscrm.contracts import ApplyAllInput
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import apply_all, cli_env, executions, invoke_async

BAD = ["-1", "0", "nan", "inf", "1e300", "0.5"]


async def test_cli_refuses_unusable_heartbeat_timeouts_before_starting(
    temporal_env: Any, settings: Any
) -> None:
    env = cli_env(settings, temporal_env)
    for value in BAD:
        res = await invoke_async(["apply-all", "--heartbeat-timeout", value], env)
        assert res.exit_code == 2, (value, res.output)
        assert "heartbeat timeout must be 1 to 3600 seconds" in res.output, res.output
        assert "Traceback" not in res.output
        # one line, Click's usage exit code 2, naming the option, the value and help
        assert res.output.count("\n") == 1 and res.output.startswith("error: "), res.output
        assert "'--heartbeat-timeout'" in res.output and value in res.output
        assert "apply-all --help')" in res.output
    started = await executions(
        temporal_env.client, f"WorkflowId = '{settings.controlplane_workflow_id}'"
    )
    assert started == []


@pytest.mark.parametrize("value", [-1.0, float("nan"), 1e300])
async def test_a_workflow_started_by_hand_with_one_fails_at_once_and_frees_the_database(
    temporal_env: Any, settings: Any, value: float
) -> None:
    async with build_worker(temporal_env.client, settings):
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(heartbeat_timeout_seconds=value),
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
    assert "heartbeat timeout must be 1 to 3600 seconds" in str(info.value.cause)
    result = await apply_all(temporal_env, settings)  # the database is not held
    assert result.status == "completed"


async def test_unusable_temporal_address_and_out_path_are_one_line_errors(
    settings: Any, tmp_path: Any
) -> None:
    """``NEXUS_TEMPORAL_ADDRESS=garbage:::1`` and an ``--out`` in a missing folder
    used to end in tracebacks; each is one ``error:`` line naming the value."""
    from tests.builders import corpus_project

    env = {**cli_env(settings), "NEXUS_TEMPORAL_ADDRESS": "garbage:::1"}
    res = await invoke_async(["apply-all"], env)
    assert res.exit_code == 1, res.output
    assert "NEXUS_TEMPORAL_ADDRESS 'garbage:::1' is not a host:port address" in res.output
    assert "Traceback" not in res.output and not _crashed(res)
    out = tmp_path / "missing" / "dir" / "pack.yaml"
    res = await invoke_async(
        ["packs", "import-sfdx", str(corpus_project("ebikes-lwc")), "--out", str(out)],
        cli_env(settings),
    )
    assert res.exit_code == 1, res.output
    assert f"--out {out}: cannot write the pack" in res.output
    assert not _crashed(res)


def _crashed(res: Any) -> bool:
    return res.exception is not None and not isinstance(res.exception, SystemExit)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["events", "import-sfdx-data", "plan.json", "--seed", "-1e999"], "'-1e999'"),
        (["events", "import-sfdx-data", "plan.json", "--seed=nan"], "'nan'"),
        (["demo-sync", "p", "--seed", "1.5"], "'1.5'"),
        (["apply-all", "--heartbeat-timeout"], "requires an argument"),
        (["status", "--no-such-flag"], "No such option: --no-such-flag"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["events", "enqueue"], "Missing argument"),
        (["apply-all", "--policy", "bogus"], "'bogus' is not one of always_apply"),
        (["apply-all", "--app-pack", ""], "--app-pack"),
        (["apply-all", "--app-pack", ".", "--candidate", "c.yaml"], "not both"),
        (
            ["apply-all", "--app-pack", "no-such-pack", "--app-pack", "nor/this"],
            "'no-such-pack': no such file or directory",
        ),
        (["apply-all", "--app-pack", "no-such-pack", "--app-pack", "nor/this"], "'nor/this'"),
        (["candidate", "write", "--app-pack", "gone"], "'gone': no such file or directory"),
        (["packs", "import-sfdx", ".", "--out", "pack.yaml"], "inside the project being imported"),
    ],
)
async def test_command_line_mistakes_are_one_error_line_with_exit_2(
    settings: Any, argv: list[str], expected: str
) -> None:
    """A wrong option value, an unknown option or command, a missing argument:
    one ``error:`` line naming it (with the value typed, where the parser's
    message leaves it out) and where help is; exit 2 (a usage error, as Click
    and POSIX tools), before anything is read or started."""
    res = await invoke_async(argv, cli_env(settings))
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    assert expected in res.output, res.output
    assert "--help')" in res.output
    assert not _crashed(res)


async def test_a_bad_repeated_option_names_the_bad_value_only(settings: Any) -> None:
    """``--app-pack gone --app-pack .``: the error names 'gone', never the good
    value beside it as "got '.'" (a new user's trial quoted the good path)."""
    res = await invoke_async(
        ["apply-all", "--app-pack", "gone", "--app-pack", "."], cli_env(settings)
    )
    assert res.exit_code == 2, res.output
    assert "'gone': no such file or directory" in res.output, res.output
    assert "got" not in res.output, res.output


async def test_removing_a_pack_never_installed_is_refused_before_the_queue(
    temporal_env: Any, settings: Any
) -> None:
    """``packs remove nope`` used to take a turn in the control-plane queue and
    the lease before saying "not installed"; a 5,000-character work id was
    echoed whole by ``events replay``."""
    await apply_all(temporal_env, settings)
    env = cli_env(settings, temporal_env)
    res = await invoke_async(["packs", "remove", "nope"], env)
    assert res.exit_code == 1, res.output
    assert "pack nope is not installed (removable: none)" in res.output
    started = await executions(temporal_env.client, "WorkflowType = 'RemovePack'")
    assert started == []
    res = await invoke_async(["packs", "remove", "platform-core"], env)
    assert res.exit_code == 1 and "only app and connector packs" in res.output, res.output
    res = await invoke_async(["events", "replay", "w" * 5000], env)
    assert res.exit_code == 1, res.output
    assert "a work id has at most 64 characters, this one 5,000" in res.output
    assert len(res.output) < 400, res.output
