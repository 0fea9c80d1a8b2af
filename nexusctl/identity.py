"""Wake identity-convergence waits from Python (the seed's ``WakeIdentityConvergence*``).

Each call wakes the wait of one dependency through its ``wake_now`` update,
which returns how many items it woke; when no wait runs (none was started, or
it already completed), the blocked rows of that key are woken directly and
their packs' pools signalled. A key with nothing blocked returns 0, so
duplicate wakes wake once.
"""

from __future__ import annotations

import asyncio

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from nexuscrm.connectors import queue
from nexuscrm.connectors.identity import Dependency, wait_workflow_id
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import signal_fleet

WAKE_TIMEOUT_S = 30.0


async def wake_dependency(client: Client, settings: Settings, dep: Dependency) -> int:
    """Wake the items blocked on ``dep``; returns how many were woken."""
    handle = client.get_workflow_handle(wait_workflow_id(settings.database_id, dep.key_hash))
    try:
        return int(
            await asyncio.wait_for(
                handle.execute_update("wake_now", result_type=int), WAKE_TIMEOUT_S
            )
        )
    except (RPCError, WorkflowUpdateFailedError, TimeoutError):
        pass  # no wait runs (or none answers): wake the rows directly
    engine = make_engine(settings.database_url)
    try:
        by_pack = await asyncio.to_thread(queue.wake_blocked_by_pack, engine, dep.key_hash)
    finally:
        engine.dispose()
    for install_id in sorted(by_pack):
        await signal_fleet(client, settings, "wake", install_id)
    return sum(by_pack.values())


async def wake_identity_convergence_record(
    client: Client, settings: Settings, object_api_name: str, record_id: str
) -> int:
    """Items blocked on local record (object, record id) -> pending; returns the count."""
    return await wake_dependency(client, settings, Dependency.record(object_api_name, record_id))


async def wake_identity_convergence_remote_identity(
    client: Client,
    settings: Settings,
    owner_key: str,
    namespace: str,
    destination_object: str,
    remote_id: str,
) -> int:
    """Items blocked on the remote link (owner, namespace, object, remote id); returns the count."""
    dep = Dependency.remote(owner_key, namespace, destination_object, remote_id)
    return await wake_dependency(client, settings, dep)
