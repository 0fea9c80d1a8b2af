"""Salesforce DX data plans as inbound connector events."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from nexuscrm.connectors import queue as wq
from nexuscrm.connectors.importer import events_from_sfdx_plan
from nexuscrm.controlplane.metadata import ensure_system_schema
from nexuscrm.db.engine import make_engine
from nexuscrm.errors import ManifestError
from tests.builders import corpus_project, plan_records

PACK = "sf-pack"


def plan_of(project: str) -> Path:
    return corpus_project(project) / "data" / "sample-data-plan.json"


def records_by_type(plan: Path) -> tuple[Counter[str], list[dict[str, Any]]]:
    """Count records per type straight from the plan's JSON files (independent of the importer)."""
    records = plan_records(plan)
    return Counter(r["attributes"]["type"] for r in records), records


@pytest.mark.parametrize("project", ["dreamhouse-lwc", "ebikes-lwc"])
def test_one_event_per_record(project: str) -> None:
    plan = plan_of(project)
    expected, records = records_by_type(plan)
    events = events_from_sfdx_plan(plan, installed_pack_id=PACK)
    assert Counter(e.source_object for e in events) == expected
    assert len(events) == len(records)
    # plan order: the i-th event is the i-th record
    for ev, rec in zip(events, records, strict=True):
        ref = rec["attributes"]["referenceId"]
        assert ev.source_id == ev.target_remote_id == ref
        assert ev.source_object == ev.target_object == rec["attributes"]["type"]
        assert ev.idempotency_key.startswith(f"{ev.source_object}:{ref}:")  # + content digest
        assert (ev.namespace, ev.event_kind, ev.installed_pack_id) == (
            "salesforce",
            "salesforce.record.upsert",
            PACK,
        )
        assert ev.payload["sobject"] == ev.source_object
        assert ev.payload["remote_id"] == ref
        assert set(ev.payload["fields"]) == set(rec) - {"attributes"}


def test_dreamhouse_lookups_resolve_to_remote_ids() -> None:
    plan = plan_of("dreamhouse-lwc")
    events = events_from_sfdx_plan(plan, installed_pack_id=PACK)
    brokers = {e.source_id for e in events if e.source_object == "Broker__c"}
    properties = [e for e in events if e.source_object == "Property__c"]
    assert properties
    for ev in properties:
        broker = ev.payload["fields"]["Broker__c"]
        assert broker in brokers and not broker.startswith("@")
        assert ev.payload["references"] == {"Broker__c": broker}
    first = properties[0].payload["fields"]
    assert first["Broker__c"] == "CarolineBrookerRef"
    # parents come first in plan order
    kinds = [e.source_object for e in events]
    assert kinds.index("Property__c") > max(i for i, k in enumerate(kinds) if k == "Broker__c")
    for ev in events:
        if ev.source_object != "Property__c":
            assert ev.payload["references"] == {}


def test_ebikes_lookups_resolve_to_remote_ids() -> None:
    events = events_from_sfdx_plan(plan_of("ebikes-lwc"), installed_pack_id=PACK)
    families = {e.source_id for e in events if e.source_object == "Product_Family__c"}
    products = [e for e in events if e.source_object == "Product__c"]
    assert {p.payload["references"]["Product_Family__c"] for p in products} <= families
    assert all(
        p.payload["fields"]["Product_Family__c"] == p.payload["references"]["Product_Family__c"]
        for p in products
    )


def test_shuffle_is_a_deterministic_permutation() -> None:
    plan = plan_of("ebikes-lwc")
    ordered = events_from_sfdx_plan(plan, installed_pack_id=PACK)
    one = events_from_sfdx_plan(plan, installed_pack_id=PACK, shuffle=True, seed=7)
    two = events_from_sfdx_plan(plan, installed_pack_id=PACK, shuffle=True, seed=7)
    other = events_from_sfdx_plan(plan, installed_pack_id=PACK, shuffle=True, seed=8)
    keys = [e.idempotency_key for e in ordered]
    assert [e.idempotency_key for e in one] == [e.idempotency_key for e in two]
    assert [e.idempotency_key for e in one] != keys
    assert [e.idempotency_key for e in one] != [e.idempotency_key for e in other]
    assert sorted(e.idempotency_key for e in one) == sorted(keys)


def test_options_are_passed_through() -> None:
    events = events_from_sfdx_plan(
        plan_of("dreamhouse-lwc"),
        installed_pack_id=PACK,
        namespace="sfdc",
        event_kind="sf.upsert",
        queue_class="bulk",
    )
    assert {(e.namespace, e.event_kind, e.queue_class) for e in events} == {
        ("sfdc", "sf.upsert", "bulk")
    }


# --- errors --------------------------------------------------------------------


def write_plan(tmp_path: Path, files: dict[str, Any], plan: Any = None) -> Path:
    for name, doc in files.items():
        (tmp_path / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    if plan is None:  # one entry a file, of its first record's type
        plan = [{"sobject": _first_type(doc), "resolveRefs": True, "files": [name]}
                for name, doc in files.items()]  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _first_type(doc: Any) -> str:
    try:
        return str(doc["records"][0]["attributes"]["type"])
    except (KeyError, IndexError, TypeError):
        return "A"


def rec(rtype: str, ref: str, **fields: Any) -> dict[str, Any]:
    return {"attributes": {"type": rtype, "referenceId": ref}, **fields}


@pytest.mark.parametrize(
    ("files", "file_at_fault", "message"),
    [
        ({"a.json": "{not json"}, "a.json", "invalid JSON"),
        ({"a.json": {"records": [{"Name": "x"}]}}, "a.json", "attributes"),
        ({"a.json": {"records": [{"attributes": {"referenceId": "R"}}]}}, "a.json", "type"),
        ({"a.json": {"records": [{"attributes": {"type": "A"}}]}}, "a.json", "referenceId"),
        ({"a.json": {"rows": []}}, "a.json", "records"),
        (
            {"a.json": {"records": [rec("A", "R1", Parent__c="@Nope")]}},
            "a.json",
            "@Nope",
        ),
        (
            {
                "a.json": {"records": [rec("A", "R1")]},
                "b.json": {"records": [rec("B", "R1")]},
            },
            "b.json",
            "duplicate referenceId 'R1'",
        ),
    ],
)
def test_errors_name_the_file(
    tmp_path: Path, files: dict[str, Any], file_at_fault: str, message: str
) -> None:
    plan = write_plan(tmp_path, files)
    with pytest.raises(ManifestError, match=message) as info:
        events_from_sfdx_plan(plan, installed_pack_id=PACK)
    assert str(tmp_path / file_at_fault) in str(info.value)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not found") as info:
        events_from_sfdx_plan(tmp_path / "nope.json", installed_pack_id=PACK)
    assert "nope.json" in str(info.value)
    plan = write_plan(tmp_path, {}, plan=[{"sobject": "A", "files": ["gone.json"]}])
    with pytest.raises(ManifestError, match="not found") as info:
        events_from_sfdx_plan(plan, installed_pack_id=PACK)
    assert "gone.json" in str(info.value)
    bad_plan = write_plan(tmp_path, {}, plan={"sobject": "A"})
    with pytest.raises(ManifestError, match="array") as info:
        events_from_sfdx_plan(bad_plan, installed_pack_id=PACK)
    assert "plan.json" in str(info.value)


def test_refs_stay_verbatim_without_resolve_refs(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path,
        {"a.json": {"records": [rec("A", "R1", Handle__c="@someone")]}},
        plan=[{"sobject": "A", "resolveRefs": False, "files": ["a.json"]}],
    )
    (ev,) = events_from_sfdx_plan(plan, installed_pack_id=PACK)
    assert ev.payload["fields"] == {"Handle__c": "@someone"}
    assert ev.payload["references"] == {}


def test_entry_type_mismatch_is_refused(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path,
        {"a.json": {"records": [rec("B", "R1")]}},
        plan=[{"sobject": "A", "files": ["a.json"]}],
    )
    with pytest.raises(ManifestError, match="type B but the plan entry is A"):
        events_from_sfdx_plan(plan, installed_pack_id=PACK)


# --- into the queue ------------------------------------------------------------


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    ensure_system_schema(eng)
    yield eng
    eng.dispose()


def test_plan_events_enqueue_idempotently(engine: Engine) -> None:
    events = events_from_sfdx_plan(
        plan_of("dreamhouse-lwc"), installed_pack_id=PACK, shuffle=True, seed=1
    )
    first = wq.enqueue(engine, events, batch_size=10)
    assert (first.inserted, first.duplicates) == (len(events), 0)
    again = wq.enqueue(engine, events)
    assert (again.inserted, again.duplicates) == (0, len(events))
    assert again.work_ids == first.work_ids
    got = wq.claim(
        engine,
        wq.ClaimSpec(
            installed_pack_id=PACK,
            queue_classes=[],
            batch_size=100,
            lease_owner="w",
            lease_seconds=30,
            max_processing_rows=100,
        ),
    )
    assert len(got) == len(events)  # every record is its own lane
    assert {g.payload["remote_id"] for g in got} == {e.source_id for e in events}


# --- every problem at once; values checked against the catalog ------------------


def broker_catalog() -> Any:
    from nexuscrm.catalog import Catalog, CatalogObject
    from nexuscrm.packs.model import FieldSpec, FieldType

    fields = (
        FieldSpec(api_name="Title__c", type=FieldType.Text, length=50),
        FieldSpec(api_name="Score__c", type=FieldType.Number, precision=2, scale=0),
        FieldSpec(api_name="Amount__c", type=FieldType.Currency),
        FieldSpec(api_name="Notes__c", type=FieldType.LongTextArea, length=500),
        FieldSpec(api_name="Active__c", type=FieldType.Checkbox),
        FieldSpec(api_name="Day__c", type=FieldType.Date),
    )
    obj = CatalogObject("Broker__c", "Broker__c", "custom", "Broker", "Brokers", False, "app",
                        fields)  # fmt: skip
    return Catalog(version=1, objects={"broker__c": obj})


def problems_of(plan: Path, **kw: Any) -> str:
    from nexuscrm.connectors.importer import DataPlanProblems, import_sfdx_plans

    with pytest.raises(DataPlanProblems) as info:
        import_sfdx_plans([plan], installed_pack_id=PACK, **kw)
    return str(info.value)


def test_values_that_do_not_fit_their_field_are_refused_all_at_once(tmp_path: Path) -> None:
    good = rec("Broker__c", "B0", Name="ok", Title__c="x" * 50, Score__c=99, Amount__c="12.345",
               Notes__c="n" * 500, Active__c="TRUE", Day__c="2024-03-01T10:00:00Z")  # fmt: skip
    bad = [
        rec("Broker__c", "B1", Name={"a": 1}),
        rec("Broker__c", "B2", Title__c="x" * 80, Score__c=123456789),
        rec("Broker__c", "B3", Amount__c=1e300, Notes__c="n" * 1000),
        rec("Broker__c", "B4", Active__c="maybe", Day__c=20240301, Nope__c="x"),
        rec("Broker__c", "B5", Title__c=["a"], Score__c="NaN"),
    ]
    plan = write_plan(tmp_path, {"brokers.json": {"records": [good, *bad]}})
    message = problems_of(plan, catalog=broker_catalog())
    where = str(tmp_path / "brokers.json")
    expected = [
        "record 1 (B1): field Name: value is an object; a Text field holds text",
        "record 2 (B2): field Title__c: value has 80 characters; the field holds at most 50",
        "record 2 (B2): field Score__c: value 123456789 is out of range",
        "record 3 (B3): field Amount__c: value 1e+300 is out of range",
        "record 3 (B3): field Notes__c: value has 1,000 characters; the field holds at most 500",
        "record 4 (B4): field Active__c: value is 'maybe'; a Checkbox holds true or false",
        "record 4 (B4): field Day__c: value is a number; a Date field holds an ISO text",
        "record 4 (B4): field Nope__c: Broker__c has no field Nope__c",
        "record 5 (B5): field Title__c: value is a list",
        "record 5 (B5): field Score__c: value 'NaN' is not a finite number",
    ]
    for line in expected:
        assert f"data file {where}: {line}" in message, (line, message)
    assert "record 0 " not in message
    assert "10 problems in the data plans, nothing enqueued" in message
    # The good record alone imports, its values as the flow will store them.
    plan = write_plan(tmp_path, {"brokers.json": {"records": [good]}})
    (ev,) = events_from_sfdx_plan(plan, installed_pack_id=PACK)
    assert ev.payload["fields"]["Amount__c"] == "12.345"


def test_unknown_object_is_refused_at_import(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, {"x.json": {"records": [rec("Ghost__c", "G1", Name="g")]}})
    message = problems_of(plan, catalog=broker_catalog())
    assert f"data file {plan}: entry 0 (Ghost__c): object Ghost__c is not installed" in message


def test_every_problem_of_every_file_and_plan_at_once(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(
        json.dumps({"records": [{"Name": "x"}, {"attributes": {"type": "Broker__c"}},
                                rec("Broker__c", 5), 7]})  # type: ignore[arg-type]
    )  # fmt: skip
    (tmp_path / "b.json").write_text("[1]")
    (tmp_path / "plan.json").write_text(
        json.dumps([
            {"sobject": "Broker__c", "files": ["a.json", "b.json"]},
            {"files": ["a.json"]},
            {"sobject": "Broker__c", "files": ["/etc/passwd", "../elsewhere/x.json"]},
            {"sobject": "Broker__c", "files": ["a.json"], "resolveRefs": "yes"},
        ])
    )  # fmt: skip
    (tmp_path / "plan2.json").write_text('{"sobject": "Broker__c"}')
    from nexuscrm.connectors.importer import DataPlanProblems, import_sfdx_plans

    with pytest.raises(DataPlanProblems) as info:
        import_sfdx_plans([tmp_path / "plan.json", tmp_path / "plan2.json"],
                          installed_pack_id=PACK)  # fmt: skip
    message = str(info.value)
    a, b, plan, plan2 = (str(tmp_path / n) for n in ("a.json", "b.json", "plan.json", "plan2.json"))
    for line in [
        f"{a}: record 0: missing 'attributes'",
        f"{a}: record 1 (Broker__c): missing attributes.referenceId",
        f"{a}: record 2 (Broker__c): attributes.referenceId must be a string, not a number",
        f"{a}: record 3: must be an object, not a number",
        f"{b}: expected an object with a 'records' array",
        f"{plan}: entry 1: missing 'sobject'",
        f"{plan}: entry 2 (Broker__c): file '/etc/passwd': an absolute path",
        f"{plan}: entry 2 (Broker__c): file '../elsewhere/x.json': points outside the plan's",
        f"{plan}: entry 3 (Broker__c): 'resolveRefs' must be true or false",
        f"{plan2}: a data plan must be a JSON array of entries",
    ]:
        assert f"data file {line}" in message, (line, message)


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [
        ("Amount__c", "12.345", "12.35"),  # rounded half up to the scale
        ("Amount__c", 0.005, "0.01"),
        ("Score__c", "99", "99"),
        ("Active__c", "No", False),
        ("Active__c", 1, True),
        ("Title__c", 7, "7"),
        ("Title__c", True, "true"),
        ("Title__c", "", None),
    ],
)
def test_stored_values(field: str, value: Any, stored: Any) -> None:
    from decimal import Decimal

    from nexuscrm.fieldvalues import stored_value

    spec = next(f for f in broker_catalog().get("Broker__c").fields if f.api_name == field)
    got = stored_value(spec, value)
    assert (str(got) if isinstance(got, Decimal) else got) == stored


def test_the_flow_fails_a_value_that_does_not_fit_before_any_io() -> None:
    """``value-invalid`` at once, naming Object.Field and why, for the record's
    own remote id over 128 characters and for a value, even beside a lookup
    whose parent would block (no connection is ever touched)."""
    from nexuscrm.connectors.flows import VALUE_INVALID, FlowError, upsert_record

    cases = [
        ({"sobject": "Broker__c", "remote_id": "r" * 129, "fields": {}}, "remote id has 129"),
        ({"sobject": "Broker__c", "remote_id": "r1", "fields": {"Score__c": 100}},
         "Broker__c.Score__c: value 100 is out of range"),
        ({"sobject": "Broker__c", "remote_id": "r1", "fields": {"Name": ["a"]}},
         "Broker__c.Name: value is a list"),
    ]  # fmt: skip
    for payload, message in cases:
        with pytest.raises(FlowError) as info:
            upsert_record(None, broker_catalog(), owner_key="o", namespace="n", payload=payload)  # type: ignore[arg-type]
        assert info.value.failure_class == VALUE_INVALID and not info.value.retriable
        assert message in str(info.value), str(info.value)


def test_a_non_lookup_field_under_references_fails_mapping_before_any_io() -> None:
    """A field named under ``references`` is a lookup whose value is the parent's
    remote id: one that is not a lookup fails ``mapping`` (it was skipped unseen
    when ``fields`` did not name it too). A lookup named only under
    ``references`` is set: the README's example, ``test_connector_ops.py``."""
    from nexuscrm.connectors.flows import FlowError, upsert_record

    for fields in ({}, {"Title__c": "x"}):
        payload = {"sobject": "Broker__c", "remote_id": "r1", "fields": fields,
                   "references": {"Title__c": "p1"}}  # fmt: skip
        with pytest.raises(FlowError) as info:
            upsert_record(None, broker_catalog(), owner_key="o", namespace="n", payload=payload)  # type: ignore[arg-type]
        assert info.value.failure_class == "mapping" and not info.value.retriable
        assert "Broker__c.Title__c: named under references but not a lookup" in str(info.value)


def test_an_upsert_payload_of_the_wrong_shape_fails_payload_invalid_before_any_io() -> None:
    """``fields`` or ``references`` that are not objects fail the item alone,
    ``payload-invalid``, naming the key (they raised AttributeError / ValueError
    inside the flow); ``events enqueue`` refuses such lines first
    (``test_hostile_events.py``)."""
    from nexuscrm.connectors.flows import PAYLOAD_INVALID, FlowError, upsert_record

    cases: list[tuple[dict[str, Any], str]] = [
        ({"fields": ["LastName"]}, "payload.fields must be a JSON object"),
        ({"references": ["AccountId", "a1"]}, "payload.references must be a JSON object"),
        ({"references": "a1"}, "got a string"),
        ({"references": {"Title__c": {"id": 1}}}, "payload.references.Title__c must be"),
    ]
    for extra, message in cases:
        payload = {"sobject": "Broker__c", "remote_id": "r1", **extra}
        with pytest.raises(FlowError) as info:
            upsert_record(None, broker_catalog(), owner_key="o", namespace="n", payload=payload)  # type: ignore[arg-type]
        assert info.value.failure_class == PAYLOAD_INVALID and not info.value.retriable
        assert message in str(info.value), str(info.value)


def test_a_data_file_symlinked_out_of_the_plan_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"records": [rec("Broker__c", "B1")]}))
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "link.json").symlink_to(outside)
    plan = write_plan(folder, {}, plan=[{"sobject": "Broker__c", "files": ["link.json"]}])
    assert "file 'link.json': points outside the plan's folder" in problems_of(plan)
