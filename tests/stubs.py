"""Workflow stand-ins shared by test modules.

Kept apart from :mod:`tests.builders`: the workflow sandbox re-imports the
module defining a workflow (and what that module imports), so this module
imports only temporalio and the workflow contracts.
"""

from __future__ import annotations

from temporalio import workflow

from nexuscrm.contracts import InboundWorkerConfig


@workflow.defn(name="InboundWorker")
class DrainableWorker:
    """``InboundWorker`` stand-in: runs until drained."""

    @workflow.init
    def __init__(self, config: InboundWorkerConfig) -> None:
        self.draining = False

    @workflow.signal
    def drain(self) -> None:
        self.draining = True

    @workflow.signal
    def wake(self) -> None:
        pass

    @workflow.run
    async def run(self, config: InboundWorkerConfig) -> str:
        await workflow.wait_condition(lambda: self.draining)
        return "drained"
