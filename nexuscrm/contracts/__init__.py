"""Contracts: the dataclasses that cross the Temporal boundary.

Start arguments, activity inputs and outputs, query results of the workflows
(``workflows``) and activities (``activities``); plain dataclasses, no
``temporalio``, so both sides and the domain (``nexuscrm``) import them from
here. Temporal's JSON payload converter serializes them by field name: class
names, field names and field order must not change (running workflows'
histories replay against them).
"""

from __future__ import annotations

from nexuscrm.contracts.connectors import (
    BatchResult,
    ClaimedLease,
    ClaimRequest,
    DesiredPack,
    FleetInput,
    FleetStatus,
    InboundWorkerConfig,
    PeriodicOutcome,
    PeriodicRequest,
    ProcessRequest,
    ReconcileDecision,
    ReconcileOutcome,
    ReconcileRequest,
    ReleaseRequest,
    SupervisorConfig,
    SupervisorStatus,
    WorkerStatus,
)
from nexuscrm.contracts.controlplane import (
    HEARTBEAT_TIMEOUT_RANGE_S,
    ApplyAllInput,
    ApplyAllResult,
    ApplyPacksRequest,
    AutoStartDecisionInfo,
    OperationInput,
    PhaseReport,
    PhaseRequest,
    PlannedPackInfo,
    PlanRequest,
    RepairRequest,
    VerifyRequest,
    heartbeat_timeout_problem,
)
from nexuscrm.contracts.identity import (
    BlockedWait,
    DependencySpec,
    ExpireRequest,
    IdentityWaitConfig,
    IdentityWaitInput,
    IdentityWaitStatus,
    ProbeRequest,
    ProbeResult,
    WaitItem,
    WaitNotifyRequest,
    WakeResult,
)

__all__ = [
    "HEARTBEAT_TIMEOUT_RANGE_S",
    "ApplyAllInput",
    "ApplyAllResult",
    "ApplyPacksRequest",
    "AutoStartDecisionInfo",
    "BatchResult",
    "BlockedWait",
    "ClaimRequest",
    "ClaimedLease",
    "DependencySpec",
    "DesiredPack",
    "ExpireRequest",
    "FleetInput",
    "FleetStatus",
    "IdentityWaitConfig",
    "IdentityWaitInput",
    "IdentityWaitStatus",
    "InboundWorkerConfig",
    "OperationInput",
    "PeriodicOutcome",
    "PeriodicRequest",
    "PhaseReport",
    "PhaseRequest",
    "PlanRequest",
    "PlannedPackInfo",
    "ProbeRequest",
    "ProbeResult",
    "ProcessRequest",
    "ReconcileDecision",
    "ReconcileOutcome",
    "ReconcileRequest",
    "ReleaseRequest",
    "RepairRequest",
    "SupervisorConfig",
    "SupervisorStatus",
    "VerifyRequest",
    "WaitItem",
    "WaitNotifyRequest",
    "WakeResult",
    "WorkerStatus",
    "heartbeat_timeout_problem",
]
