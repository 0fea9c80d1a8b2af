"""Hostile numeric settings and queue waits (issue 17, audit item 1).

``NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS=1e300`` used to fail the queue
entity's workflow task (``OverflowError``), ``NEXUS_WORKER_SHUTDOWN_SECONDS=1e300``
ended ``nexusctl worker`` in a traceback and ``NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS``
took nan, -5 and 1e300. Every numeric setting is now checked when the settings
load, all bad ones listed in one line; a request typed by hand with such a
wait is refused by the entity's update validator, and the entity goes on.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from nexuscrm.contracts import ApplyAllInput
from nexuscrm.errors import NexusError
from nexuscrm.settings import NUMERIC_RANGES, Settings
from nexusctl.controlplane_queue import build_request, submit
from nexusctl.worker import build_worker
from tests.builders import apply_all, cli_env, executions, invoke, invoke_async

BAD_NUMBERS = ["1e300", "nan", "inf", "-5"]


def _crashed(res: Any) -> bool:
    return res.exception is not None and not isinstance(res.exception, SystemExit)


@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_every_bad_numeric_setting_is_named_at_once_with_its_value(value: str) -> None:
    """Every numeric setting given ``value``: one line names each, with the value
    (integer settings included: their parse error used to drop it)."""
    env = cli_env() | {rng.env: value for rng in NUMERIC_RANGES.values()}
    res = invoke(["status"], env)
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and not _crashed(res), res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: invalid setting:"), res.output
    for rng in NUMERIC_RANGES.values():
        # Integer settings refuse "1e300" / "nan" while parsing; they are named too.
        assert rng.env in res.output, (rng.env, res.output)
        # ... each with the value it was given (a float as Python prints it)
        said = res.output.split(rng.env, 1)[1].split(";", 1)[0]
        assert value in said or repr(float(value)) in said, (rng.env, said)
    assert "NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS" in res.output


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NEXUS_WORKER_SHUTDOWN_SECONDS", "1e300"),
        ("NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS", "nan"),
        ("NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS", "-5"),
        ("NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS", "1e300"),
        ("NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS", "1e300"),
        ("NEXUS_IDENTITY_PROBES_PER_SECOND", "inf"),
        ("NEXUS_CONNECTOR_MAX_ACTIVITY_SLOTS", "99999999999"),
        ("NEXUS_CONNECTOR_STINT_SECONDS", "-1"),
        ("NEXUS_CONNECTOR_STINT_SECONDS", "nan"),
    ],
)
def test_worker_refuses_an_unusable_number_in_one_line(var: str, value: str) -> None:
    res = invoke(["worker"], cli_env() | {var: value})
    assert res.exit_code == 1, res.output
    assert not _crashed(res) and "Traceback" not in res.output, res.output
    assert res.output.count("\n") == 1, res.output
    shown = repr(float(value)) if var != "NEXUS_CONNECTOR_MAX_ACTIVITY_SLOTS" else value
    assert f"{var} {shown} must be a finite number" in res.output, res.output


def test_numbers_in_range_are_kept() -> None:
    from nexuscrm.settings import Settings

    s = Settings(
        worker_shutdown_seconds=0,
        final_verify_timeout_seconds=86_400,
        controlplane_queue_wait_seconds=604_800,
        identity_probes_per_second=0.5,
        connector_stint_seconds=0,
    )
    assert s.worker_shutdown_seconds == 0 and s.controlplane_queue_wait_seconds == 604_800
    assert s.connector_stint_seconds == 0


async def test_apply_all_with_a_huge_queue_wait_starts_nothing(
    temporal_env: Any, settings: Any
) -> None:
    env = cli_env(settings, temporal_env) | {"NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS": "1e300"}
    res = await invoke_async(["apply-all"], env)
    assert res.exit_code == 1 and not _crashed(res), res.output
    assert "NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS 1e+300 must be a finite number" in res.output
    started = await executions(
        temporal_env.client, f"WorkflowId = '{settings.controlplane_workflow_id}'"
    )
    assert started == []


@pytest.mark.parametrize("wait", [1e300, float("nan"), -1.0, float("inf")])
async def test_a_request_typed_by_hand_with_an_unusable_wait_is_refused_and_the_queue_goes_on(
    temporal_env: Any, settings: Any, wait: float
) -> None:
    """As the ``temporal`` CLI could send it: the update is rejected (no trace in
    the history, no failed workflow task) and the next request runs."""
    client = temporal_env.client
    async with build_worker(client, settings):
        req = build_request("ApplyAll", ApplyAllInput(), settings)
        req.wait_seconds = wait
        with pytest.raises(NexusError, match=r"wait_seconds .* must be a finite number"):
            await submit(client, settings, req)
    result = await apply_all(temporal_env, settings)
    assert result.status == "completed"
    handle = client.get_workflow_handle(settings.controlplane_workflow_id)
    failed = [
        e
        async for e in handle.fetch_history_events()
        if e.HasField("workflow_task_failed_event_attributes")
    ]
    assert failed == []


def test_an_accepted_wait_is_clamped_into_range() -> None:
    from nexuscrm.contracts.controlplane_queue import MAX_QUEUE_WAIT_SECONDS, bounded_queue_wait

    assert bounded_queue_wait(1e300) == MAX_QUEUE_WAIT_SECONDS
    assert bounded_queue_wait(float("nan")) == MAX_QUEUE_WAIT_SECONDS
    assert bounded_queue_wait(-3) == 1.0
    assert bounded_queue_wait(600) == 600.0


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_database_url_is_refused_not_taken_for_the_default(value: str) -> None:
    """``NEXUS_DATABASE_URL=$UNSET_VAR`` in a deploy script must not fall back
    to a local SQLite file: refused, saying what to give."""
    with pytest.raises(ValidationError, match="NEXUS_DATABASE_URL is set but empty"):
        Settings(database_url=value)
