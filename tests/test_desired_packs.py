"""Which packs the fleet serves, with and without a runtime serving selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import Engine

from nexuscrm import catalog
from nexuscrm.connectors.desired import desired_packs
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.connectors.serving import RuntimeServingSelection, ServingSelectionError
from nexuscrm.controlplane import metadata, packs_apply
from nexuscrm.db.engine import make_engine
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from tests.builders import webhook_route, write_connector_pack

ROOT = Path(__file__).resolve().parents[1]
SF_SYNC = CONNECTOR_PACKS_DIR / "salesforce-sync"


def write_pack(path: Path, mode: str = "flow") -> Path:
    return write_connector_pack(path, "hook-pack", [webhook_route(invocation_mode=mode)])


@pytest.fixture
def engine(db_url: str, tmp_path: Path) -> Engine:
    engine = make_engine(db_url)
    metadata.apply_metadata(engine)
    catalog.CACHE.invalidate()
    plan = packs_apply.load_plan(
        engine, [str(SF_SYNC), str(write_pack(tmp_path / "h.yaml"))], False
    )
    packs_apply.apply_packs(engine, plan)
    return engine


def selection(engine: Engine, **override: object) -> RuntimeServingSelection:
    row = next(r for r in list_connector_packs(engine) if r.namespace == "salesforce-sync")
    pack: dict[str, object] = {
        "namespace": row.namespace,
        "installed_pack_id": row.install_id,
        "payload_digest": row.payload_hash,
        "inbound_routes": [{"event_kind": "salesforce.record.upsert", "route_version": 1}],
    }
    pack.update(override)
    return RuntimeServingSelection.model_validate({"packs": [pack]})


def test_without_selection_every_active_connector_pack_is_served(engine):
    got = desired_packs(engine, None)
    assert sorted(p.namespace for p in got.packs) == ["hook-pack", "salesforce-sync"]
    assert got.blocked == {}


def test_selection_serves_exactly_the_selected_pack(engine):
    got = desired_packs(engine, selection(engine))
    assert [p.namespace for p in got.packs] == ["salesforce-sync"]
    assert got.blocked == {}


def test_selection_with_a_stale_digest_fails_the_listing(engine):
    # The seed's lister: the whole selection is refused, never one pack left out.
    with pytest.raises(ServingSelectionError, match="payload digest does not match"):
        desired_packs(engine, selection(engine, payload_digest="0" * 64))


def test_selection_of_a_pack_that_is_not_installed_fails_the_listing(engine):
    with pytest.raises(ServingSelectionError, match="is not an active ready generation"):
        desired_packs(engine, selection(engine, installed_pack_id="no-such-install"))


def test_empty_selection_has_no_route_authority(engine):
    with pytest.raises(ServingSelectionError, match="route authority is unavailable"):
        desired_packs(engine, RuntimeServingSelection())


def test_selected_route_missing_from_the_payload_fails_the_listing(engine):
    routes = [{"event_kind": "salesforce.record.delete", "route_version": 1}]
    with pytest.raises(ServingSelectionError, match=r"salesforce.record.delete.*not found"):
        desired_packs(engine, selection(engine, inbound_routes=routes))


def test_selected_handoff_route_is_refused_by_a_local_flow_supervisor(engine, tmp_path):
    plan = packs_apply.load_plan(
        engine, [str(write_pack(tmp_path / "h.yaml", "runtime_command_handoff"))], False
    )
    packs_apply.apply_packs(engine, plan)
    # The upgrade made a new incarnation (the replaced one drains).
    row = next(
        r for r in list_connector_packs(engine) if r.namespace == "hook-pack" and not r.drain_only
    )
    sel = RuntimeServingSelection.model_validate(
        {
            "packs": [
                {
                    "namespace": "hook-pack",
                    "installed_pack_id": row.install_id,
                    "payload_digest": row.payload_hash,
                    "inbound_routes": [{"event_kind": "hook.event", "route_version": 1}],
                }
            ]
        }
    )
    with pytest.raises(
        ServingSelectionError, match="unsupported invocation mode 'runtime_command_handoff'"
    ):
        desired_packs(engine, sel)


def test_selection_file_round_trip(engine, tmp_path):
    sel = selection(engine)
    path = tmp_path / "selection.json"
    path.write_text(json.dumps(sel.model_dump(mode="json")))
    assert desired_packs(engine, RuntimeServingSelection.load(path)).packs
