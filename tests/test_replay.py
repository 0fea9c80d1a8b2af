"""Replay: today's workflow code must replay the histories of the code that ran before.

Long-lived workflows (ConnectorFleet, PackSupervisor, InboundWorker,
IdentityWait) and a running ApplyAll are picked up by a new worker build in
the middle of their history; a change to the commands a workflow issues, to
a wire dataclass' fields or to a name makes that replay fail with a
non-determinism error and wedges the workflow. Every history under
``tests/histories/`` (gzipped JSON, as ``temporal workflow show --output json``
writes it) was recorded from a released build; this test replays each against
the workflows the worker registers now.

Add histories whenever a workflow's commands change, recorded from the build
*before* the change (on a dev server: ``temporal workflow show -w <id>
--output json | gzip -9 > tests/histories/<Type>-<id>.json.gz``), and keep
the old ones until no workflow started by that build can still be running.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from nexusctl.failures import DATA_CONVERTER
from workflows.controlplane import CONTROLPLANE_WORKFLOWS
from workflows.controlplane_queue import QUEUE_WORKFLOWS
from workflows.fleet import CONNECTOR_WORKFLOWS
from workflows.identity import IDENTITY_WORKFLOWS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json.gz"))


def test_every_long_lived_workflow_type_has_a_history() -> None:
    types = {p.name.split("-", 1)[0] for p in HISTORIES}
    assert {"ApplyAll", "ConnectorFleet", "PackSupervisor", "InboundWorker", "IdentityWait"} <= (
        types
    )


@pytest.mark.parametrize(
    "path", HISTORIES, ids=[p.name.removesuffix(".json.gz") for p in HISTORIES]
)
async def test_recorded_history_replays_on_todays_code(path: Path) -> None:
    history = WorkflowHistory.from_json(path.name, gzip.decompress(path.read_bytes()).decode())
    replayer = Replayer(
        workflows=[
            *CONTROLPLANE_WORKFLOWS,
            *QUEUE_WORKFLOWS,
            *CONNECTOR_WORKFLOWS,
            *IDENTITY_WORKFLOWS,
        ],
        data_converter=DATA_CONVERTER,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure!r}"
