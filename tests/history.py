"""Reading a workflow's history in tests: what it scheduled and what its passes returned.

Counted from the server's event history (the source of truth), never from the
workflow's own ``status`` query.
"""

from __future__ import annotations

from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.converter import DataConverter

from nexuscrm.contracts import PeriodicOutcome


async def activity_types(handle: WorkflowHandle[Any, Any]) -> list[str]:
    """Activity type names in the order the workflow scheduled them."""
    history = await handle.fetch_history()
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


async def periodic_outcomes(handle: WorkflowHandle[Any, Any]) -> list[PeriodicOutcome]:
    """The results of a fleet's ``connectors.periodic`` passes, from its history."""
    history = await handle.fetch_history()
    scheduled = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    converter = DataConverter.default.payload_converter
    out: list[PeriodicOutcome] = []
    for e in history.events:
        if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            continue
        done = e.activity_task_completed_event_attributes
        if scheduled.get(done.scheduled_event_id) == "connectors.periodic":
            (result,) = converter.from_payloads(done.result.payloads, [PeriodicOutcome])
            out.append(result)
    return out
