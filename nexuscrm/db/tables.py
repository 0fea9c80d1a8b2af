"""The ``_System_*`` tables (SQLAlchemy Core), with the seeds' table and column names.

Connector tables are created now (ApplyMetadata owns all system DDL) so the
connector runtime only adds behaviour. Column lists of the three WorkItem
tables match the seed's claim-schema probe
(``connectorInboundWorkItemClaimSchemaColumns`` and friends) exactly.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql

system_metadata = MetaData()

# Payloads and errors can exceed TEXT's 64 KiB on MySQL.
LongText = Text().with_variant(mysql.LONGTEXT(), "mysql")

# VARCHAR(191) keeps utf8mb4 index keys under MySQL's 767-byte limit.
KEY = 191

WORK_ID = 64
"""Longest ``ConnectorWorkItem.WorkId`` (characters)."""


def _audit() -> list[Column[object]]:
    return [
        Column("CreatedDate", DateTime, nullable=True),
        Column("LastModifiedDate", DateTime, nullable=True),
    ]


bootstrap_state = Table(
    "_System_BootstrapState",
    system_metadata,
    Column("StateKey", String(KEY), primary_key=True),
    Column("RunID", String(KEY), nullable=False, default=""),
    Column("Phase", String(KEY), nullable=False, default=""),
    Column("Status", String(32), nullable=False, default=""),
    Column("LastError", Text, nullable=True),
    # The completed ApplyAll marker's proof: the release fingerprint (system
    # schema + repair steps) it converged to (nexuscrm.controlplane.release).
    Column("Proof", Text, nullable=True),
    *_audit(),
)

migration = Table(
    "_System_Migration",
    system_metadata,
    Column("MigrationKey", String(KEY), primary_key=True),
    Column("AppliedDate", DateTime, nullable=False),
    Column("Detail", Text, nullable=True),
)

installed_pack = Table(
    "_System_InstalledPack",
    system_metadata,
    Column("Id", String(64), primary_key=True),
    Column("Name", String(128), nullable=False, unique=True),
    Column("Category", String(32), nullable=False),
    Column("Version", String(64), nullable=False, default=""),
    # Upgrade-time default is '' (the seed's MigratePackInstallIdBackfill heals it).
    Column("PackInstallId", String(64), nullable=False, default=""),
    # installing | active | failed | removed (| draining: serve its queue, no new work)
    Column("Status", String(32), nullable=False),
    Column("PayloadHash", String(64), nullable=False, default=""),
    Column("Payload", LongText, nullable=True),
    Column("Source", Text, nullable=True),
    Column("LastError", Text, nullable=True),
    Column("InstalledDate", DateTime, nullable=True),
    *_audit(),
)

# Earlier incarnations of a connector pack (``_System_InstalledPack`` holds one
# row per name, the current one): an upgrade keeps the replaced incarnation
# here as ``draining`` (its payload, so its pending items still resolve their
# routes) until its queue is empty, then ``retired``; ``packs remove`` marks it
# ``removed``. Keyed by the incarnation's PackInstallId.
connector_pack_incarnation = Table(
    "_System_ConnectorPackIncarnation",
    system_metadata,
    Column("PackInstallId", String(64), primary_key=True),
    Column("Name", String(128), nullable=False),
    Column("Category", String(32), nullable=False),
    Column("Version", String(64), nullable=False, default=""),
    Column("Status", String(32), nullable=False),  # draining | retired | removed
    Column("PayloadHash", String(64), nullable=False, default=""),
    Column("Payload", LongText, nullable=True),
    Column("Source", Text, nullable=True),
    Column("ReplacedByInstallId", String(64), nullable=True),
    Column("RetiredDate", DateTime, nullable=True),
    *_audit(),
    Index("ix_ConnectorPackIncarnation_Name", "Name", "Status"),
)

object_meta = Table(
    "_System_Object",
    system_metadata,
    Column("Id", String(64), primary_key=True),
    Column("ApiName", String(128), nullable=False, unique=True),
    Column("Label", String(255), nullable=False, default=""),
    Column("PluralLabel", String(255), nullable=False, default=""),
    Column("TableName", String(128), nullable=False),
    # standard | custom | event | system | discovered
    Column("TableType", String(32), nullable=False),
    Column("NameFieldType", String(16), nullable=False, default="Text"),
    Column("Description", Text, nullable=True),
    Column("IsCustomized", Boolean, nullable=False, default=False),
    Column("PackName", String(128), nullable=False, default=""),
    *_audit(),
)

field_meta = Table(
    "_System_Field",
    system_metadata,
    Column("Id", String(64), primary_key=True),
    Column("ObjectId", String(64), nullable=False),
    Column("ObjectApiName", String(128), nullable=False),
    Column("ApiName", String(128), nullable=False),
    Column("Label", String(255), nullable=False, default=""),
    Column("FieldType", String(32), nullable=False),
    Column("ColumnNames", String(255), nullable=False, default=""),
    Column("Length", Integer, nullable=True),
    Column("Precision", Integer, nullable=True),
    Column("Scale", Integer, nullable=True),
    Column("Required", Boolean, nullable=False, default=False),
    Column("IsUnique", Boolean, nullable=False, default=False),
    Column("IsExternalId", Boolean, nullable=False, default=False),
    Column("DefaultValue", Text, nullable=True),
    Column("ReferenceTo", String(128), nullable=True),
    Column("RelationshipName", String(128), nullable=True),
    Column("PicklistValues", Text, nullable=True),
    # A restricted picklist stores only its values (an inbound value outside is refused).
    Column("IsRestricted", Boolean, nullable=False, default=False),
    Column("Formula", Text, nullable=True),
    Column("FormulaTreatBlanksAs", String(16), nullable=True),
    Column("SummarySpec", Text, nullable=True),
    Column("Description", Text, nullable=True),
    Column("IsCustomized", Boolean, nullable=False, default=False),
    Column("PackName", String(128), nullable=False, default=""),
    Column("Createable", Boolean, nullable=False, default=True),
    Column("Updateable", Boolean, nullable=False, default=True),
    *_audit(),
    UniqueConstraint("ObjectApiName", "ApiName", name="uq_System_Field_Object_Api"),
)

# Bumped by every metadata writer; every process validates its cache against it.
metadata_version = Table(
    "_System_MetadataVersion",
    system_metadata,
    Column("Id", Integer, primary_key=True, autoincrement=False),
    Column("Version", BigInteger, nullable=False),
    Column("LastModifiedDate", DateTime, nullable=True),
)

# The fenced lease behind the one-workflow-id-per-database rule.
controlplane_lease = Table(
    "_System_ControlPlaneLease",
    system_metadata,
    Column("LeaseKey", String(64), primary_key=True),
    Column("Epoch", BigInteger, nullable=False),
    Column("Holder", String(KEY), nullable=False, default=""),
    Column("Operation", String(64), nullable=False, default=""),
    Column("AcquiredDate", DateTime, nullable=True),
)

connector_event = Table(
    "_System_ConnectorEvent",
    system_metadata,
    Column("EventId", String(64), primary_key=True),
    Column("InstalledPackId", String(64), nullable=False),
    Column("Namespace", String(128), nullable=False, default=""),
    Column("EventKind", String(128), nullable=False),
    Column("RouteVersion", Integer, nullable=False, default=1),
    Column("IdempotencyKey", String(KEY), nullable=False),
    Column("SourceObject", String(128), nullable=False, default=""),
    Column("SourceId", String(KEY), nullable=False, default=""),
    Column("Payload", LongText, nullable=True),
    Column("ExecutionOwner", String(32), nullable=False, default="work_item"),
    Column("EnqueueOrdinal", BigInteger, nullable=False, default=0),
    # Cross-pack events: the companion AppPack incarnation (its PackInstallId)
    # frozen at enqueue; on the event, not the WorkItem, so a replay keeps it.
    Column("CompanionPackInstallId", String(64), nullable=True),
    *_audit(),
    UniqueConstraint("InstalledPackId", "IdempotencyKey", name="uq_ConnectorEvent_Idem"),
)

connector_work_item = Table(
    "_System_ConnectorWorkItem",
    system_metadata,
    Column("WorkId", String(WORK_ID), primary_key=True),
    Column("EventId", String(64), nullable=False),
    Column("InstalledPackId", String(64), nullable=False),
    Column("WorkType", String(64), nullable=False),
    Column("QueueClass", String(64), nullable=False, default="default"),
    Column("State", String(32), nullable=False),
    Column("RunAfter", DateTime, nullable=True),
    Column("Attempt", Integer, nullable=False, default=0),
    Column("OwnershipEpoch", BigInteger, nullable=False, default=0),
    Column("FailureCount", Integer, nullable=False, default=0),
    Column("FailureClass", String(64), nullable=True),
    Column("FailureSummary", Text, nullable=True),
    Column("LastFailureAt", DateTime, nullable=True),
    Column("ReplayedAt", DateTime, nullable=True),
    Column("ReplayOfWorkId", String(WORK_ID), nullable=True),
    Column("LeaseOwner", String(KEY), nullable=True),
    Column("LeaseToken", String(64), nullable=True),
    Column("LeaseUntil", DateTime, nullable=True),
    Column("SourceLaneKey", String(KEY), nullable=True),
    Column("TargetMutationLaneKey", String(KEY), nullable=True),
    Column("Generation", BigInteger, nullable=False, default=0),
    Column("LaneOrdinal", BigInteger, nullable=False, default=0),
    Column("ProjectionKey", String(KEY), nullable=True),
    Column("ProjectionActiveKey", String(KEY), nullable=True),
    Column("DependencyKind", String(32), nullable=True),
    Column("DependencyObjectAPIName", String(128), nullable=True),
    Column("DependencyRecordId", String(64), nullable=True),
    Column("DependencyKeyHash", String(64), nullable=True),
    Column("DependencyConnectorOwnerKey", String(KEY), nullable=True),
    Column("DependencyConnectorNamespace", String(128), nullable=True),
    Column("DependencyConnectorSourceObject", String(128), nullable=True),
    Column("DependencyDestinationSlotId", String(128), nullable=True),
    Column("DependencyConnectorRemoteId", String(KEY), nullable=True),
    Column("DependencyBlockedAt", DateTime, nullable=True),
    Column("DependencyProbeAfter", DateTime, nullable=True),
    Column("TerminalAt", DateTime, nullable=True),
    # The claim fence the item was last claimed under (the claimer's fencing
    # token; ``Generation`` carries its fence generation). Finishes, lease
    # extensions and releases are conditional on it as well as on LeaseToken.
    Column("FencingToken", String(KEY), nullable=True),
    *_audit(),
    Index("ix_ConnectorWorkItem_Claim", "InstalledPackId", "State", "QueueClass", "RunAfter"),
    Index("ix_ConnectorWorkItem_Lane", "SourceLaneKey", "LaneOrdinal"),
    Index("ix_ConnectorWorkItem_Target", "TargetMutationLaneKey", "LaneOrdinal"),
    Index("ix_ConnectorWorkItem_Dependency", "DependencyKeyHash"),
)

# The current claim fence of each installed pack (one row per PackInstallId):
# the generation and fencing token of the pools that own the pack's claims.
# A pool of another owner (fleet) that starts takes the next generation
# (nexuscrm.connectors.queue.fencing); claims under any other fence are refused.
connector_claim_fence = Table(
    "_System_ConnectorClaimFence",
    system_metadata,
    Column("InstalledPackId", String(64), primary_key=True),
    Column("Generation", BigInteger, nullable=False, default=0),
    Column("SchedulerOwnerId", String(KEY), nullable=False, default=""),
    Column("FencingToken", String(KEY), nullable=False, default=""),
    *_audit(),
)

connector_work_attempt = Table(
    "_System_ConnectorWorkAttempt",
    system_metadata,
    Column("WorkId", String(64), nullable=False),
    Column("Attempt", Integer, nullable=False),
    Column("EventId", String(64), nullable=False),
    Column("FlowExecutionId", String(64), nullable=True),
    Column("OutcomeState", String(32), nullable=False),
    Column("PresentedErrorCode", String(64), nullable=True),
    Column("CauseCode", String(64), nullable=True),
    Column("CauseCategory", String(64), nullable=True),
    Column("CauseElementType", String(64), nullable=True),
    Column("CauseElementName", String(128), nullable=True),
    Column("Retriable", Boolean, nullable=False, default=False),
    *_audit(),
    PrimaryKeyConstraint("WorkId", "Attempt"),
)

connector_remote_link = Table(
    "_System_ConnectorRemoteLink",
    system_metadata,
    Column("ConnectorOwnerKey", String(128), nullable=False),
    Column("Namespace", String(128), nullable=False),
    Column("DestinationObject", String(128), nullable=False),
    Column("RemoteId", String(128), nullable=False),
    Column("RecordId", String(64), nullable=False),
    *_audit(),
    PrimaryKeyConstraint("ConnectorOwnerKey", "Namespace", "DestinationObject", "RemoteId"),
)

# The system's own outbound writes to a remote system, read by the outbound
# echo probe (seed SQLOutboundEchoProbe): an inbound event for the same remote
# record carrying exactly the fields written (FieldsHash) before ExpiresAt is
# that write's echo, finished without running its flow. EchoWorkId marks the
# row consumed, so one write suppresses at most one echo.
connector_outbound_write = Table(
    "_System_ConnectorOutboundWrite",
    system_metadata,
    Column("WriteId", String(64), primary_key=True),
    Column("ConnectorOwnerKey", String(128), nullable=False),
    Column("Namespace", String(128), nullable=False),
    Column("ObjectName", String(128), nullable=False),
    Column("RemoteId", String(KEY), nullable=False),
    Column("FieldsHash", String(64), nullable=False),
    Column("WrittenAt", DateTime, nullable=False),
    Column("ExpiresAt", DateTime, nullable=False),
    Column("EchoWorkId", String(64), nullable=True),
    Column("EchoedAt", DateTime, nullable=True),
    *_audit(),
    Index("ix_ConnectorOutboundWrite_Remote", "RemoteId", "ObjectName"),
)

# Runtime command handoff: one row per handed-off WorkItem, for the separate
# runtime service (which owns the business operation and its dependencies).
runtime_command = Table(
    "_System_RuntimeCommand",
    system_metadata,
    Column("CommandId", String(64), primary_key=True),
    Column("WorkId", String(64), nullable=False),
    Column("EventId", String(64), nullable=False),
    Column("InstalledPackId", String(64), nullable=False),
    Column("ConnectorOwnerKey", String(128), nullable=False),
    Column("Namespace", String(128), nullable=False, default=""),
    Column("EventKind", String(128), nullable=False),
    Column("RouteVersion", Integer, nullable=False),
    Column("InvocationMode", String(64), nullable=False),
    Column("Operation", String(64), nullable=False),
    Column("DestinationObject", String(128), nullable=True),
    Column("SourceObject", String(128), nullable=False, default=""),
    Column("SourceId", String(KEY), nullable=False, default=""),
    Column("Payload", LongText, nullable=True),
    Column("CompanionPackInstallId", String(64), nullable=True),
    Column("State", String(32), nullable=False),  # pending (the runtime moves it on)
    *_audit(),
    UniqueConstraint("WorkId", name="uq_RuntimeCommand_Work"),
    Index("ix_RuntimeCommand_State", "State", "CreatedDate"),
)

# The definition each formula view was built with: the hash of the compiler's
# SQL and the definition the database stored (read back right after CREATE),
# so verify can tell a view replaced by hand from the one the compiler builds.
derived_view = Table(
    "_System_DerivedView",
    system_metadata,
    Column("ViewName", String(KEY), primary_key=True),
    Column("SourceHash", String(64), nullable=False),
    Column("Definition", LongText, nullable=True),
    Column("LastModifiedDate", DateTime, nullable=True),
)

# Values formulas read at query time (``$User.Id``'s default acting user,
# ``$Organization.<Field>``): one row per name, set with ``nexusctl formulas
# set-global``; a view reads them with a scalar subquery, so a change needs no
# view rebuild.
formula_global = Table(
    "_System_FormulaGlobal",
    system_metadata,
    Column("Name", String(KEY), primary_key=True),
    Column("Value", Text, nullable=True),
    Column("LastModifiedDate", DateTime, nullable=True),
)

SYSTEM_TABLES: tuple[Table, ...] = tuple(system_metadata.sorted_tables)
