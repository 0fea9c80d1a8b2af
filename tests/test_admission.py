"""Issue 5 rule 5: WorkItem claim admission before a pool starts (real databases)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, delete, text, update
from sqlalchemy.engine import make_url

from nexuscrm import cutover
from nexuscrm.connectors import admission
from nexuscrm.connectors import queue as wq
from nexuscrm.controlplane import markers, repair
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from tests.builders import event

PACK = "pack-1"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    ensure_system_schema(eng)
    yield eng
    eng.dispose()


def enqueue(engine: Engine, n: int) -> None:
    wq.enqueue(
        engine,
        [event(PACK, f"k{i}", f"a{i}") for i in range(n)],
    )


def receipt(engine: Engine) -> str | None:
    marker = markers.read(engine, cutover.CUTOVER_RECEIPT_KEY)
    return marker.status if marker else None


def test_cutover_receipt_is_written_by_repair_and_required_for_admission(engine):
    with pytest.raises(admission.CutoverGap, match="no connector_work_item_only_cutover"):
        admission.resolve_activation(engine, "sf", PACK, "epoch")
    # A legacy-owned event keeps the cutover pending, and says why.
    enqueue(engine, 1)
    with engine.begin() as conn:
        conn.execute(update(t.connector_event).values(ExecutionOwner="legacy_event"))
    repair.run_repair(engine)
    assert receipt(engine) == "pending"
    with pytest.raises(admission.CutoverGap, match=r"legacy_event=1.*for sf \(pack-1\)"):
        admission.resolve_activation(engine, "sf", PACK, "epoch")
    with engine.begin() as conn:
        conn.execute(update(t.connector_event).values(ExecutionOwner="work_item"))
    repair.run_repair(engine)
    assert receipt(engine) == "completed"
    act = admission.resolve_activation(engine, "sf", PACK, "epoch")
    assert act.generation == 0
    assert act.scheduler_owner_id == "connector-inbound-sf-pack-1-epoch#workitem-scheduler"
    assert act.fencing_token.endswith("#workitem-scheduler-fence")


def test_schema_probe_tells_a_missing_column_or_table_from_a_transient_error(engine, tmp_path):
    repair.run_repair(engine)
    cutover.probe_claim_schema(engine)  # complete schema: no error
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE _System_ConnectorWorkAttempt DROP COLUMN CauseElementName"))
    gap = r"_System_ConnectorWorkAttempt.*CauseElementName"
    with pytest.raises(cutover.SchemaGap, match=gap):
        admission.resolve_activation(engine, "sf", PACK, "epoch")
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE _System_ConnectorWorkAttempt"))
    with pytest.raises(cutover.SchemaGap, match="_System_ConnectorWorkAttempt"):
        cutover.probe_claim_schema(engine)
    # A database that cannot be reached is not a gap: a later reconcile retries.
    if engine.dialect.name == "sqlite":
        bad = make_engine(f"sqlite:///{tmp_path}")  # a directory: cannot be opened
    else:
        bad = make_engine(make_url(str(engine.url)).set(port=1).render_as_string(False))
    with pytest.raises(cutover.AdmissionProbeError) as info:
        admission.resolve_activation(bad, "sf", PACK, "epoch")
    assert not isinstance(info.value, admission.AdmissionGap)


def test_claim_takes_both_work_types_and_generation_is_the_pack_claim_fence(engine):
    """The claimable generation is the pack's claim fence (issue 11 item 9), not
    the items' lowest ``Generation``: each claim stamps its own generation there."""
    repair.run_repair(engine)
    enqueue(engine, 2)
    w = t.connector_work_item
    with engine.begin() as conn:
        conn.execute(
            update(w)
            .where(w.c.WorkId.like("%2"))
            .values(WorkType=wq.WORK_TYPE_WORKFLOW_ACTION_APPLY)
        )
    assert admission.resolve_claim_generation(engine, PACK) == 0
    act = admission.resolve_activation(engine, "sf", PACK, "e")
    assert (act.generation, act.fencing_token) == (0, admission.fencing_token("sf", PACK, "e"))
    taken = admission.take_fence(engine, "sf", PACK, "e")
    assert taken.generation == 1 and taken.fencing_token.endswith("-e#workitem-scheduler-fence")
    assert admission.resolve_claim_generation(engine, PACK) == 1
    assert admission.resolve_activation(engine, "sf", PACK, "e") == taken
    claimed = wq.claim(
        engine,
        wq.ClaimSpec(
            installed_pack_id=PACK,
            queue_classes=(),
            batch_size=10,
            lease_owner="o",
            lease_seconds=30,
            max_processing_rows=10,
            generation=taken.generation,
            fencing_token=taken.fencing_token,
        ),
    )
    assert len(claimed) == 2  # the ConnectorEvent and the WorkflowActionApply item
    assert {(i.generation, i.fencing_token) for i in claimed} == {(1, taken.fencing_token)}
    with pytest.raises(admission.CapabilityGap, match="WorkflowActionApply"):
        admission.require_capability((wq.WORK_TYPE_CONNECTOR_EVENT,))


def test_other_pack_generation_is_not_mixed_in(engine):
    repair.run_repair(engine)
    assert admission.resolve_claim_generation(engine, "other-pack") == 0


def test_auto_start_applies_a_completed_database_that_lacks_the_receipt(engine):
    """An upgraded database (completed before the receipt existed) gets one ApplyAll."""
    assert markers.CONNECTOR_CUTOVER_KEY == cutover.CUTOVER_RECEIPT_KEY
    repair.run_repair(engine)
    with engine.begin() as conn:
        markers.mark(conn, markers.MarkerStatus.completed, "run-1", "done")
    assert markers.classify_auto_start(engine).action == markers.AutoStartAction.skip
    with engine.begin() as conn:
        conn.execute(
            delete(t.bootstrap_state).where(
                t.bootstrap_state.c.StateKey == cutover.CUTOVER_RECEIPT_KEY
            )
        )
    decision = markers.classify_auto_start(engine)
    assert decision.action == markers.AutoStartAction.apply
    assert "connector_work_item_only_cutover receipt is missing" in decision.reason
