"""Issue 5 rules 8 and 9: cross-pack companion check, outbound echo probe, Runtime handoff role.

Processor-level tests run the real processor against real databases (SQLite
and MariaDB); the identity-recovery test runs the real fleet on the Temporal
dev server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from sqlalchemy import Engine, select, update

from activities.connectors import ConnectorActivities
from nexuscrm import catalog, cutover
from nexuscrm.clock import utcnow
from nexuscrm.connectors import queue
from nexuscrm.connectors.desired import desired_packs
from nexuscrm.connectors.echo import record_outbound_write
from nexuscrm.connectors.handoff import HANDOFF_MODES
from nexuscrm.connectors.identity import Dependency, wait_workflow_id
from nexuscrm.connectors.knobs import ConnectorKnobs
from nexuscrm.connectors.processor import Processor
from nexuscrm.connectors.routes import ConnectorPackRow, list_connector_packs
from nexuscrm.connectors.serving import RuntimeServingSelection, ServingSelectionError
from nexuscrm.contracts import ReconcileRequest
from nexuscrm.controlplane import metadata, packs_apply
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import fleet_input, start_fleet
from nexusctl.worker import build_connector_worker
from tests.builders import HookServer, record_upsert

NS = "xsync"


def write_packs(tmp_path: Path, hook_url: str) -> list[str]:
    app = {
        "name": "gizmo-app",
        "category": "AppPack",
        "depends_on": ["platform-core"],
        "objects": [
            {
                "api_name": "Gizmo__c",
                "label": "Gizmo",
                "fields": [
                    {"api_name": "Size__c", "type": "Number"},
                    {"api_name": "Color__c", "type": "Text", "length": 40},
                ],
            }
        ],
    }
    routes: list[dict[str, Any]] = [
        {
            "event_kind": "gizmo.cross",
            "destination_object": "Gizmo__c",
            "companion_pack": "gizmo-app",
        },
        {"event_kind": "gizmo.plain", "destination_object": "Gizmo__c"},
        {
            "event_kind": "gizmo.handoff",
            "invocation_mode": "runtime_command_handoff",
            "destination_object": "Gizmo__c",
        },
        {"event_kind": "gizmo.hook", "flow": "webhook", "webhook_url": hook_url},
    ]
    connector = {
        "name": NS,
        "category": "ConnectorPack",
        "depends_on": ["platform-core", "gizmo-app"],
        "inbound_routes": routes,
    }
    paths = []
    for name, doc in (("app.yaml", app), ("conn.yaml", connector)):
        (tmp_path / name).write_text(yaml.safe_dump(doc))
        paths.append(str(tmp_path / name))
    return paths


@pytest.fixture
def engine(db_url: str, tmp_path: Path, hook: HookServer) -> Engine:
    engine = make_engine(db_url)
    metadata.apply_metadata(engine)
    catalog.CACHE.invalidate()
    packs_apply.apply_packs(
        engine, packs_apply.load_plan(engine, write_packs(tmp_path, hook.url), False)
    )
    with engine.begin() as conn:  # RunRepair's step, as ApplyAll runs it
        cutover.ensure_cutover_receipt(conn)
    catalog.CACHE.invalidate()
    return engine


def conn_pack(engine: Engine) -> ConnectorPackRow:
    return next(r for r in list_connector_packs(engine) if r.namespace == NS)


def app_install_id(engine: Engine) -> str:
    ip = t.installed_pack
    with engine.connect() as conn:
        return str(
            conn.execute(select(ip.c.PackInstallId).where(ip.c.Name == "gizmo-app")).scalar_one()
        )


def event(engine: Engine, kind: str, remote_id: str, **fields: Any) -> queue.EnqueueRequest:
    return record_upsert(
        conn_pack(engine).install_id,
        NS,
        "Gizmo__c",
        remote_id,
        fields,
        key=f"{kind}:{remote_id}:{uuid.uuid4().hex[:6]}",
        kind=kind,
        targeted=False,
    )


def run(engine: Engine, role: str = "local", n: int = 50) -> None:
    """Claim and process everything claimable once, with a processor of ``role``."""
    items = queue.claim(
        engine,
        queue.ClaimSpec(
            installed_pack_id=conn_pack(engine).install_id,
            queue_classes=[],
            batch_size=n,
            lease_owner="test",
            lease_seconds=60,
            max_processing_rows=1000,
        ),
    )
    assert items, "nothing claimed"
    Processor(engine, role=role, flow_deadline=None).process(items)


def item_state(engine: Engine, work_id: str) -> tuple[str, str | None]:
    w = t.connector_work_item
    with engine.connect() as conn:
        row = conn.execute(select(w.c.State, w.c.FailureClass).where(w.c.WorkId == work_id)).one()
    return row.State, row.FailureClass


def gizmos(engine: Engine) -> dict[str, Any]:
    """Gizmo__c records by remote id (through the remote-link table)."""
    link = t.connector_remote_link
    with engine.connect() as conn:
        rows = conn.execute(
            select(link.c.RemoteId, link.c.RecordId).where(link.c.DestinationObject == "Gizmo__c")
        ).all()
    return {r.RemoteId: r.RecordId for r in rows}


def last_attempt(engine: Engine, work_id: str) -> Any:
    a = t.connector_work_attempt
    with engine.connect() as conn:
        return conn.execute(
            select(a.c.OutcomeState, a.c.CauseCode, a.c.FlowExecutionId)
            .where(a.c.WorkId == work_id)
            .order_by(a.c.Attempt.desc())
        ).first()


def commands(engine: Engine) -> list[Any]:
    rc = t.runtime_command
    with engine.connect() as conn:
        return list(conn.execute(select(rc).order_by(rc.c.WorkId)).all())


# --- rule 8: cross-pack companion check -----------------------------------------


def test_cross_pack_event_freezes_its_companion_and_runs_while_it_is_active(engine):
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.cross", "G1", Size__c=1)]).work_ids
    e = t.connector_event
    with engine.connect() as conn:
        frozen = conn.execute(select(e.c.CompanionPackInstallId)).scalar_one()
    assert frozen == app_install_id(engine)
    run(engine)
    assert item_state(engine, work_id) == ("succeeded", None)
    assert "G1" in gizmos(engine)


@pytest.mark.parametrize("change", ["removed", "new-incarnation", "failed"])
def test_cross_pack_event_fails_when_its_frozen_companion_is_not_active(engine, change):
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.cross", "G1", Size__c=1)]).work_ids
    ip = t.installed_pack
    if change == "removed":
        packs_apply.remove_pack(engine, "gizmo-app", force=True)
    else:
        values = (
            {"PackInstallId": str(uuid.uuid4())}
            if change == "new-incarnation"
            else {"Status": "failed"}
        )
        with engine.begin() as conn:
            conn.execute(update(ip).where(ip.c.Name == "gizmo-app").values(**values))
    run(engine)
    assert item_state(engine, work_id) == ("failed", "companion-pack-inactive")
    assert gizmos(engine) == {}  # the flow never ran
    w = t.connector_work_item
    with engine.connect() as conn:
        summary = conn.execute(select(w.c.FailureSummary).where(w.c.WorkId == work_id)).scalar()
    assert "gizmo-app" in summary and "gizmo.cross" in summary


def test_cross_pack_event_retries_while_its_companion_is_being_applied(engine):
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.cross", "G1", Size__c=1)]).work_ids
    packs_apply.mark_pack_status(engine, "gizmo-app", "installing")
    run(engine)
    assert item_state(engine, work_id) == ("pending", "companion-pack-installing")
    assert gizmos(engine) == {}


def test_cross_pack_event_enqueued_without_an_active_companion_fails_closed(engine):
    packs_apply.remove_pack(engine, "gizmo-app", force=True)
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.cross", "G1", Size__c=1)]).work_ids
    packs_apply.mark_pack_status(engine, "gizmo-app", "active")  # back, but not frozen
    run(engine)
    assert item_state(engine, work_id) == ("failed", "companion-pack-inactive")


def test_route_without_companion_is_not_checked(engine):
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.plain", "G1", Size__c=1)]).work_ids
    packs_apply.remove_pack(engine, "gizmo-app", force=True)
    run(engine)
    assert item_state(engine, work_id) == ("succeeded", None)


def test_a_pack_others_depend_on_cannot_be_removed(engine):
    """Removing the companion AppPack while the connector pack depends on it would
    fail every later ApplyAll's plan: refused, naming the dependent."""
    from nexuscrm.errors import PackError

    with pytest.raises(PackError, match=r"dependency of installed pack\(s\) xsync; remove"):
        packs_apply.remove_pack(engine, "gizmo-app")
    ip = t.installed_pack
    with engine.connect() as conn:
        status = conn.execute(select(ip.c.Status).where(ip.c.Name == "gizmo-app")).scalar_one()
    assert status == "active"
    packs_apply.remove_pack(engine, "xsync")  # the dependent first, then it
    assert packs_apply.remove_pack(engine, "gizmo-app") == "active"


def test_companion_pack_must_be_a_dependency(tmp_path):
    from nexuscrm.packs.model import PackManifest

    with pytest.raises(
        ValidationError, match="companion_pack gizmo-app, which is not in depends_on"
    ):
        PackManifest.model_validate(
            {
                "name": "x",
                "category": "ConnectorPack",
                "inbound_routes": [{"event_kind": "a", "companion_pack": "gizmo-app"}],
            }
        )


# --- rule 8: outbound echo probe --------------------------------------------------


def test_echo_of_an_outbound_write_is_finished_without_running_the_flow(engine):
    with engine.begin() as conn:
        write_id = record_outbound_write(
            conn,
            owner_key=NS,
            namespace=NS,
            object_name="Gizmo__c",
            remote_id="G1",
            fields={"size__c": 3, "Color__c": "red"},
        )
    echo, other = queue.enqueue(
        engine,
        [
            event(engine, "gizmo.plain", "G1", Size__c=3, Color__c="red"),
            event(engine, "gizmo.plain", "G2", Size__c=3, Color__c="red"),
        ],
    ).work_ids
    run(engine)
    assert item_state(engine, echo) == ("succeeded", None)
    assert last_attempt(engine, echo).CauseCode == "outbound-echo"
    assert last_attempt(engine, echo).FlowExecutionId == f"echo:{write_id}"
    assert item_state(engine, other) == ("succeeded", None)
    assert last_attempt(engine, other).CauseCode is None
    assert sorted(gizmos(engine)) == ["G2"]  # the echo wrote nothing
    ow = t.connector_outbound_write
    with engine.connect() as conn:
        assert conn.execute(select(ow.c.EchoWorkId)).scalar_one() == echo


def test_echo_write_is_consumed_once_and_other_changes_still_run(engine):
    with engine.begin() as conn:
        record_outbound_write(
            conn, owner_key=NS, namespace=NS, object_name="Gizmo__c", remote_id="G1",
            fields={"Size__c": 3},
        )  # fmt: skip
        record_outbound_write(
            conn,
            owner_key=NS,
            namespace=NS,
            object_name="Gizmo__c",
            remote_id="G9",
            fields={"Size__c": 3},
            now=utcnow() - 2 * dt.timedelta(hours=1),
        )  # fmt: skip  (expired)
    changed, expired = queue.enqueue(
        engine,
        [
            event(engine, "gizmo.plain", "G1", Size__c=4),  # not what we wrote
            event(engine, "gizmo.plain", "G9", Size__c=3),  # write expired
        ],
    ).work_ids
    run(engine)
    assert last_attempt(engine, changed).CauseCode is None
    assert last_attempt(engine, expired).CauseCode is None
    (echo,) = queue.enqueue(engine, [event(engine, "gizmo.plain", "G1", Size__c=3)]).work_ids
    run(engine)
    assert last_attempt(engine, echo).CauseCode == "outbound-echo"
    (again,) = queue.enqueue(engine, [event(engine, "gizmo.plain", "G1", Size__c=3)]).work_ids
    run(engine)
    assert last_attempt(engine, again).CauseCode is None  # the write suppressed one echo only
    assert item_state(engine, again) == ("succeeded", None)


# --- rule 9: Runtime handoff role -------------------------------------------------


def test_handoff_role_writes_a_command_row_and_runs_no_flow(engine):
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.handoff", "G1", Size__c=5)]).work_ids
    run(engine, role="handoff")
    assert item_state(engine, work_id) == ("succeeded", None)
    (cmd,) = commands(engine)
    assert (cmd.WorkId, cmd.ConnectorOwnerKey, cmd.EventKind, cmd.RouteVersion) == (
        work_id, NS, "gizmo.handoff", 1,
    )  # fmt: skip
    assert (cmd.InvocationMode, cmd.Operation, cmd.DestinationObject, cmd.State) == (
        "runtime_command_handoff", "upsert_record", "Gizmo__c", "pending",
    )  # fmt: skip
    assert json.loads(cmd.Payload)["fields"] == {"Size__c": 5}
    attempt = last_attempt(engine, work_id)
    assert (attempt.CauseCode, attempt.FlowExecutionId) == (
        "runtime-command-handoff",
        cmd.CommandId,
    )
    assert gizmos(engine) == {}  # the business operation belongs to the runtime


def test_local_role_does_not_run_a_handoff_route(engine):
    (work_id,) = queue.enqueue(engine, [event(engine, "gizmo.handoff", "G1", Size__c=5)]).work_ids
    run(engine, role="local")
    assert item_state(engine, work_id) == ("failed", "runtime-handoff-unavailable")
    assert commands(engine) == [] and gizmos(engine) == {}


def test_handoff_role_refuses_flow_routes_with_no_local_fallback(engine, hook):
    plain, webhook = queue.enqueue(
        engine,
        [event(engine, "gizmo.plain", "G1", Size__c=5), event(engine, "gizmo.hook", "G2")],
    ).work_ids
    run(engine, role="handoff")
    for work_id in (plain, webhook):
        assert item_state(engine, work_id) == ("failed", "invocation-mode-unsupported")
    w = t.connector_work_item
    with engine.connect() as conn:
        summary = conn.execute(select(w.c.FailureSummary).where(w.c.WorkId == plain)).scalar()
    assert "gizmo.plain" in summary and NS in summary and "'flow'" in summary
    # No local fallback: no record, no webhook call, no command.
    assert gizmos(engine) == {} and hook.received == [] and commands(engine) == []


def test_handoff_redo_path_still_writes_commands_and_never_flows(engine):
    """A chunk that fails (here: a command row already exists for one item) is redone
    item by item; the redo path hands off too and never falls back to a local flow."""
    first, second = queue.enqueue(
        engine,
        [event(engine, "gizmo.handoff", "G1"), event(engine, "gizmo.handoff", "G2")],
    ).work_ids
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            t.runtime_command.insert().values(
                CommandId="pre", WorkId=first, EventId="x", InstalledPackId="x",
                ConnectorOwnerKey=NS, EventKind="k", RouteVersion=1, InvocationMode="m",
                Operation="o", State="pending", CreatedDate=now,
            )
        )  # fmt: skip
    run(engine, role="handoff")
    assert item_state(engine, second) == ("succeeded", None)
    assert item_state(engine, first)[0] != "succeeded"
    assert sorted(c.WorkId for c in commands(engine)) == [first, second]
    assert gizmos(engine) == {}


def selection_file(engine: Engine, tmp_path: Path, kinds: list[str]) -> Path:
    row = conn_pack(engine)
    path = tmp_path / "selection.json"
    path.write_text(
        json.dumps(
            {
                "packs": [
                    {
                        "namespace": row.namespace,
                        "installed_pack_id": row.install_id,
                        "payload_digest": row.payload_hash,
                        "inbound_routes": [{"event_kind": k, "route_version": 1} for k in kinds],
                    }
                ]
            }
        )
    )
    return path


def test_handoff_role_requires_a_serving_selection(engine, settings, tmp_path):
    handoff = settings.model_copy(update={"connector_role": "handoff"})
    with pytest.raises(ServingSelectionError, match="Runtime handoff requires a serving selection"):
        ConnectorActivities(engine, handoff, ConnectorKnobs())
    selected = handoff.model_copy(
        update={"serving_selection": str(selection_file(engine, tmp_path, ["gizmo.handoff"]))}
    )
    acts = ConnectorActivities(engine, selected, ConnectorKnobs())
    plan = acts.reconcile_plan(ReconcileRequest(settings.database_id, "startup", {}, "epoch-1"))
    assert (plan.error, plan.blocked) == ("", {})
    assert [(d.namespace, d.action) for d in plan.decisions] == [(NS, "start")]
    # The local role needs none.
    ConnectorActivities(engine, settings, ConnectorKnobs())


def test_connector_role_setting_is_validated(monkeypatch):
    monkeypatch.setenv("NEXUS_CONNECTOR_ROLE", " Handoff ")
    assert Settings().connector_role == "handoff"
    monkeypatch.setenv("NEXUS_CONNECTOR_ROLE", "remote")
    with pytest.raises(ValidationError, match="NEXUS_CONNECTOR_ROLE 'remote' must be local"):
        Settings()


def test_handoff_supervisor_refuses_a_selected_route_whose_mode_does_not_support_handoff(
    engine, tmp_path
):
    sel = RuntimeServingSelection.load(
        selection_file(engine, tmp_path, ["gizmo.handoff", "gizmo.plain"])
    )
    # The seed refuses the whole selection (the runtime does not start).
    with pytest.raises(ServingSelectionError) as info:
        desired_packs(engine, sel, supported_modes=HANDOFF_MODES)
    assert "gizmo.plain" in str(info.value)
    assert "unsupported invocation mode 'flow'" in str(info.value)
    ok = RuntimeServingSelection.load(selection_file(engine, tmp_path, ["gizmo.handoff"]))
    assert [
        p.namespace for p in desired_packs(engine, ok, supported_modes=HANDOFF_MODES).packs
    ] == [NS]


def block_waitless(engine: Engine) -> Dependency:
    """One blocked item whose wait is overdue: what fleet recovery would start a wait for."""
    queue.enqueue(engine, [event(engine, "gizmo.handoff", "G1")])
    (item,) = queue.claim(
        engine,
        queue.ClaimSpec(
            installed_pack_id=conn_pack(engine).install_id,
            queue_classes=[],
            batch_size=1,
            lease_owner="test",
            lease_seconds=60,
            max_processing_rows=10,
        ),
    )
    dep = Dependency.remote(NS, NS, "Gizmo__c", "parent-1")
    with engine.begin() as conn:
        queue.block_item(
            conn, item, dep, summary="test", probe_after=utcnow() - dt.timedelta(minutes=5)
        )
    return dep


@pytest.mark.parametrize("role", ["local", "handoff"])
async def test_handoff_role_fleet_hands_off_and_does_no_identity_recovery(
    temporal_env, settings, engine, tmp_path, role
):
    settings = settings.model_copy(
        update={
            "connector_task_queue": f"cn-{uuid.uuid4().hex[:8]}",
            "connector_role": role,
            "serving_selection": str(selection_file(engine, tmp_path, ["gizmo.handoff"]))
            if role == "handoff"
            else None,
        }
    )
    dep = block_waitless(engine)
    (handed,) = queue.enqueue(engine, [event(engine, "gizmo.handoff", "G2")]).work_ids
    inp = fleet_input(settings)
    inp.reconcile_interval_seconds = 0.3
    inp.idle_seconds = 0.5
    inp.drain_timeout_seconds = 2
    client = temporal_env.client
    wait_id = wait_workflow_id(settings.database_id, dep.key_hash)

    async def wait_started() -> bool:
        try:
            await client.get_workflow_handle(wait_id).describe()
        except Exception:
            return False
        return True

    async with build_connector_worker(client, settings):
        fleet = await start_fleet(client, settings, inp)
        try:
            started = False
            for _ in range(20):  # ~6 s, at least a dozen reconciles
                await asyncio.sleep(0.3)
                if await wait_started():
                    started = True
                    break
            assert [p["namespace"] for p in (await fleet.query("status"))["pools"]] == [NS]
            for _ in range(60):  # the pool's workers run the handoff item meanwhile
                if item_state(engine, handed)[0] in ("succeeded", "failed"):
                    break
                await asyncio.sleep(0.3)
        finally:
            await fleet.signal("stop")
            await fleet.result()
            if started:
                await client.get_workflow_handle(wait_id).terminate()
    assert inp.identity_recovery is (role == "local")
    # The local role recovers the overdue wait; the handoff role leaves it to the runtime.
    assert started is (role == "local")
    # Through the real worker: the handoff role hands the item off, the local role refuses it.
    if role == "handoff":
        assert item_state(engine, handed) == ("succeeded", None)
        assert [c.WorkId for c in commands(engine)] == [handed]
    else:
        assert item_state(engine, handed) == ("failed", "runtime-handoff-unavailable")
        assert commands(engine) == []


def test_worker_script_refuses_handoff_without_selection_in_one_line(tmp_path):
    """`python worker.py` is `nexusctl worker`: the handoff role without a serving
    selection is refused before it connects anywhere, as one `error:` line."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {
        "PATH": "/usr/bin:/bin",
        "NEXUS_DATABASE_URL": f"sqlite:///{tmp_path}/w.db",
        "NEXUS_CONNECTOR_ROLE": "handoff",
        "NEXUS_TEMPORAL_ADDRESS": "127.0.0.1:1",
    }
    proc = subprocess.run(
        [sys.executable, str(root / "worker.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Runtime handoff requires a serving selection" in proc.stderr
    assert "Traceback" not in proc.stderr
