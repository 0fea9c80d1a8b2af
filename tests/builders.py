"""Builders and shared helpers for tests and benches: the one home of them.

- events: :func:`event` (any inbound event), :func:`record_upsert` (a
  ``salesforce.record.upsert``-shaped record event), :func:`hook_events`;
  :func:`plan_records` reads an SFDX data plan's records;
- packs: :func:`connector_pack_doc` / :func:`write_connector_pack`,
  :func:`webhook_route`, :func:`hook_pack`, :func:`write_sfdx`;
- databases: :func:`corpus_project`, :func:`snapshot`, :func:`system_row_counts`,
  :func:`db_state`, :func:`write_small_pack`, :func:`installed_state`;
- control plane and fleet: :func:`apply_all`, :func:`install`,
  :func:`connector_settings`, :func:`fast_fleet`, :func:`wait_drained`,
  :func:`wait_pools`; identity invariant :func:`assert_no_blocked_on_linked`;
- the CLI: :func:`cli_env`, :func:`invoke`, :func:`invoke_async`;
- endpoints: :class:`HookServer`;
- shared test bodies: :func:`sync_corpus_data_plans_shuffled`.

Every corpus project's data plans as one sync (sub-packs of projects that do
not load whole, remote ids per project) live in :mod:`tests.corpus`.

Workflow stand-ins live in :mod:`tests.stubs` instead: a sandboxed Temporal
worker re-imports the module that defines a workflow, and this one imports far
too much for the sandbox.

Test modules import from here, never from each other. The benches (``bench/``)
import the event builders too, so nothing here imports pytest at module level.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, func, inspect, select, table, text
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner, Result

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.importer import events_from_sfdx_plan
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.contracts import (
    ApplyAllInput,
    ApplyAllResult,
    DesiredPack,
    FleetInput,
    FleetStatus,
)
from nexuscrm.contracts.controlplane_queue import QueueEntry
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import index_names
from nexuscrm.db.engine import make_engine
from nexuscrm.log import configure_logging
from nexuscrm.packs.builtin import CONNECTOR_PACKS_DIR
from nexuscrm.settings import Settings
from nexusctl.cli import app
from nexusctl.controlplane_queue import build_request
from nexusctl.temporal import start_controlplane, start_fleet
from nexusctl.worker import build_connector_worker, build_worker

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus" / "sfdx"
SF_SYNC = CONNECTOR_PACKS_DIR / "salesforce-sync"


# --- events ------------------------------------------------------------------------


def event(
    pack_id: str,
    key: str,
    source_id: str | None = None,
    *,
    namespace: str = "sf",
    kind: str = "record.upsert",
    obj: str = "Account",
    payload: dict[str, Any] | None = None,
    target: str | None = None,
    **options: Any,
) -> queue.EnqueueRequest:
    """An inbound event of installed pack ``pack_id`` with idempotency key ``key``.

    Its source is ``obj``/``source_id`` (default: the key); ``target`` names
    the target remote id on ``obj`` (none by default: the source lane).
    ``options`` are the remaining :class:`~queue.EnqueueRequest` fields
    (``queue_class``, ``route_version``, ``companion_pack_install_id``).
    """
    return queue.EnqueueRequest(
        installed_pack_id=pack_id,
        namespace=namespace,
        event_kind=kind,
        idempotency_key=key,
        source_object=obj,
        source_id=key if source_id is None else source_id,
        payload={} if payload is None else payload,
        target_object=obj if target else None,
        target_remote_id=target,
        **options,
    )


def record_upsert(
    pack_id: str,
    namespace: str,
    sobject: str,
    remote_id: str,
    fields: dict[str, Any],
    *,
    refs: dict[str, str] | None = None,
    key: str | None = None,
    kind: str = "salesforce.record.upsert",
    targeted: bool = True,
) -> queue.EnqueueRequest:
    """A record event as the importer and the salesforce-sync pack shape it.

    Payload ``{"sobject", "remote_id", "fields"}`` plus ``"references"`` when
    ``refs`` is given; key ``<sobject>:<remote_id>`` unless ``key``; source
    and (when ``targeted``) target are ``sobject``/``remote_id``.
    """
    payload: dict[str, Any] = {"sobject": sobject, "remote_id": remote_id, "fields": fields}
    if refs is not None:
        payload["references"] = refs
    return event(
        pack_id,
        f"{sobject}:{remote_id}" if key is None else key,
        remote_id,
        namespace=namespace,
        kind=kind,
        obj=sobject,
        payload=payload,
        target=remote_id if targeted else None,
    )


def account_versions(
    pack_id: str, namespace: str, records: int, versions: int
) -> list[queue.EnqueueRequest]:
    """``versions`` upserts of each of ``records`` Accounts (``acct<k>``), Phone ``v0`` ..

    In version order, then record order, so the last version of every record is
    enqueued last; key ``acct<k>:v<v>``. See :func:`last_phones`.
    """
    return [
        record_upsert(
            pack_id,
            namespace,
            "Account",
            f"acct{k}",
            {"Name": f"Account {k}", "Phone": f"v{v}"},
            key=f"acct{k}:v{v}",
        )
        for v in range(versions)
        for k in range(records)
    ]


def children_and_parents(
    pack_id: str, namespace: str, n: int
) -> tuple[list[queue.EnqueueRequest], list[queue.EnqueueRequest]]:
    """``n`` Contacts ``c<k>`` whose AccountId looks up Account ``a<k>``, and those Accounts."""
    children = [
        record_upsert(
            pack_id,
            namespace,
            "Contact",
            f"c{k}",
            {"LastName": f"Child {k}", "AccountId": f"a{k}"},
            refs={"AccountId": f"a{k}"},
        )
        for k in range(n)
    ]
    parents = [
        record_upsert(pack_id, namespace, "Account", f"a{k}", {"Name": f"Account {k}"}, refs={})
        for k in range(n)
    ]
    return children, parents


def work_states(engine: Engine) -> dict[str, int]:
    """Work items by state, counted in the database."""
    w = t.connector_work_item
    with engine.connect() as conn:
        return {
            str(state): int(n)
            for state, n in conn.execute(select(w.c.State, func.count()).group_by(w.c.State))
        }


def applied_twice(engine: Engine) -> list[str]:
    """Work ids with more than one ``succeeded`` attempt (an event applied twice)."""
    a = t.connector_work_attempt
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(a.c.WorkId)
                .where(a.c.OutcomeState == "succeeded")
                .group_by(a.c.WorkId)
                .having(func.count() > 1)
            ).scalars()
        )


def last_phones(engine: Engine) -> dict[str, str]:
    """``{Account Name: Phone}``: what :func:`account_versions` left in the database.

    Every Account row counts, and so does its remote link: a name stored on a
    second record (an event applied as a new record) appears again as
    ``'<name> (copy 2)'``, a record no remote link points to as
    ``'<name> (unlinked)'`` and a link to no record as ``'(link to missing
    <RecordId>)'``, so comparing with the expected mapping shows each one.
    """
    rl = t.connector_remote_link
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT Id, Name, Phone FROM Account ORDER BY Name, Id")).all()
        links = set(
            conn.execute(select(rl.c.RecordId).where(rl.c.DestinationObject == "Account")).scalars()
        )
    out: dict[str, str] = {}
    for record_id, name, phone in rows:
        key = str(name)
        copy = 2
        while key in out:
            key = f"{name} (copy {copy})"
            copy += 1
        if record_id not in links:
            key += " (unlinked)"
        out[key] = str(phone)
    for missing in sorted(links - {r[0] for r in rows}):
        out[f"(link to missing {missing})"] = ""
    return out


def hook_events(install_id: str, keys: list[str]) -> list[queue.EnqueueRequest]:
    """``hook.event`` events of :func:`hook_pack`, one per key (payload ``{"key": k}``)."""
    return [
        event(
            install_id,
            f"hook:{k}",
            k,
            namespace="hook-pack",
            kind="hook.event",
            obj="Thing",
            payload={"key": k},
        )
        for k in keys
    ]


def plan_records(plan: Path) -> list[dict[str, Any]]:
    """The records of an SFDX data plan, in plan order, read straight from its files."""
    records: list[dict[str, Any]] = []
    for entry in json.loads(plan.read_text()):
        for name in entry["files"]:
            records += json.loads((plan.parent / name).read_text())["records"]
    return records


# --- packs -------------------------------------------------------------------------


def webhook_route(
    url: str = "http://x/", kind: str = "hook.event", **options: Any
) -> dict[str, Any]:
    """An inbound route of ``kind`` handled by the webhook flow posting to ``url``."""
    return {"event_kind": kind, "flow": "webhook", "webhook_url": url, **options}


def connector_pack_doc(
    name: str,
    routes: list[dict[str, Any]],
    profiles: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ConnectorPack manifest on platform-core (``callout_profiles`` when given)."""
    doc: dict[str, Any] = {
        "name": name,
        "category": "ConnectorPack",
        "depends_on": ["platform-core"],
        "inbound_routes": routes,
    }
    if profiles is not None:
        doc["callout_profiles"] = profiles
    return doc


def write_connector_pack(
    path: Path,
    name: str,
    routes: list[dict[str, Any]],
    profiles: list[dict[str, Any]] | None = None,
) -> Path:
    """:func:`connector_pack_doc` written to ``path`` as YAML."""
    path.write_text(yaml.safe_dump(connector_pack_doc(name, routes, profiles)))
    return path


def hook_pack(path: Path, url: str, extra_route: bool = False) -> Path:
    """ConnectorPack ``hook-pack``: ``hook.event`` (and ``hook.other``) to webhook ``url``."""
    routes = [webhook_route(url)]
    if extra_route:
        routes.append(webhook_route(url, "hook.other"))
    return write_connector_pack(path, "hook-pack", routes)


def write_sfdx(
    root: Path,
    fields: dict[str, str],
    *,
    obj: str = "Gadget__c",
    label: str = "Gadget",
    project: str = "gadget-app",
) -> Path:
    """A minimal SFDX project ``project`` with custom object ``obj`` (labels
    ``label`` / ``label`` + "s") and the given field XML bodies."""
    base = root / "force-app" / "main" / "default" / "objects" / obj
    (base / "fields").mkdir(parents=True)
    (root / "sfdx-project.json").write_text(
        f'{{"name": "{project}", "packageDirectories": [{{"path": "force-app"}}]}}'
    )
    (base / f"{obj}.object-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomObject xmlns="http://soap.sforce.com/2006/04/metadata">'
        f"<label>{label}</label><pluralLabel>{label}s</pluralLabel>"
        "<nameField><label>Name</label><type>Text</type></nameField></CustomObject>"
    )
    for name, body in fields.items():
        (base / "fields" / f"{name}.field-meta.xml").write_text(
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
            f"<fullName>{name}</fullName>{body}</CustomField>"
        )
    return root


# --- databases ---------------------------------------------------------------------


def corpus_project(name: str) -> Path:
    """Path of a corpus SFDX project, or skip the test saying why."""
    path = CORPUS / name
    if not path.is_dir():
        import pytest  # here, not at the top: the benches import this module

        pytest.skip(f"corpus project {name} not found at {path} (../shared/corpus is absent)")
    return path


CORPUS_PROJECTS = [
    "apex-recipes",
    "dreamhouse-lwc",
    "ebikes-lwc",
    "eda",
    "k12-architecture-kit",
    "lwc-recipes",
    "project-management-tool",
]


async def install_whole_corpus(env: WorkflowEnvironment, settings: Settings) -> list[str]:
    """ApplyAll of all seven corpus projects on ``settings``' database, each view read,
    then a second ApplyAll that must write nothing; returns the views."""
    from sqlalchemy import text

    from nexuscrm import catalog
    from nexuscrm.db.dialect import quote

    sources = [str(corpus_project(p)) for p in CORPUS_PROJECTS]
    result = await apply_all(env, settings, app_pack_sources=sources)
    assert result.status == "completed", result.reason
    engine = make_engine(settings.database_url)
    try:
        views = sorted(inspect(engine).get_view_names())
        with engine.connect() as conn:
            for view in views:
                conn.execute(text(f"SELECT * FROM {quote(conn, view)} LIMIT 1")).all()
        before = snapshot(engine)
        catalog.CACHE.invalidate()
        again = await apply_all(env, settings)
        assert again.status == "completed", again.reason
        detail = next(p.detail or "" for p in again.phases if p.name == "apply-packs")
        assert "tables created 0, columns added 0, rows 0" in detail, detail
        assert snapshot(engine) == before
    finally:
        engine.dispose()
    return views


def snapshot(engine: Engine) -> dict[str, Any]:
    """Everything ApplyAll converges, minus timestamps and generated install ids.

    Tables with their columns and indexes, views, object/field metadata rows,
    installed packs (name, status, hash) and the ApplyAll marker status.
    """
    insp = inspect(engine)
    tables = {}
    for name in sorted(insp.get_table_names()):
        cols = sorted(c["name"] for c in insp.get_columns(name))
        tables[name] = {"columns": cols, "indexes": sorted(index_names(engine, name))}
    with engine.connect() as conn:
        objects = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.object_meta.c.Id,
                    t.object_meta.c.ApiName,
                    t.object_meta.c.TableType,
                    t.object_meta.c.PackName,
                    t.object_meta.c.Label,
                    t.object_meta.c.PluralLabel,
                )
            )
        )
        fields = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.field_meta.c.Id,
                    t.field_meta.c.ObjectId,
                    t.field_meta.c.FieldType,
                    t.field_meta.c.ColumnNames,
                    t.field_meta.c.PackName,
                    t.field_meta.c.Formula,
                )
            )
        )
        packs = sorted(
            tuple(r)
            for r in conn.execute(
                select(
                    t.installed_pack.c.Name,
                    t.installed_pack.c.Status,
                    t.installed_pack.c.PayloadHash,
                )
            )
        )
    return {
        "tables": tables,
        "views": sorted(insp.get_view_names()),
        "objects": objects,
        "fields": fields,
        "packs": packs,
    }


def system_row_counts(engine: Engine) -> dict[str, int]:
    """Rows of every ``_System_*`` table (a phase run twice must double nothing;
    a refused run must add nothing)."""
    names = [n for n in inspect(engine).get_table_names() if n.startswith("_System_")]
    with engine.connect() as conn:
        return {
            n: conn.execute(select(func.count()).select_from(table(n))).scalar_one()
            for n in sorted(names)
        }


def db_state(engine: Engine) -> tuple[dict[str, Any], dict[str, int]]:
    """:func:`snapshot` and :func:`system_row_counts`: what a refused run must leave as it was."""
    return snapshot(engine), system_row_counts(engine)


def write_small_pack(path: Path, name: str = "small-app", obj: str = "Small__c") -> Path:
    """A native AppPack ``name`` with one object ``obj`` (a Text and a Number field)."""
    doc = {
        "name": name,
        "category": "AppPack",
        "depends_on": ["platform-core"],
        "objects": [
            {
                "api_name": obj,
                "label": obj.removesuffix("__c"),
                "fields": [
                    {"api_name": "Note__c", "type": "Text", "length": 80},
                    {"api_name": "Size__c", "type": "Number", "precision": 10, "scale": 2},
                ],
            }
        ],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


async def installed_state(
    env: WorkflowEnvironment, settings: Settings, tmp_path: Path
) -> tuple[Engine, tuple[dict[str, Any], dict[str, int]]]:
    """A database ApplyAll converged with one small app pack (:func:`write_small_pack`);
    its engine (the caller disposes it) and its :func:`db_state`: what a refused
    run must leave as it was."""
    await install(env, settings, [str(write_small_pack(tmp_path / "small.yaml"))])
    engine = make_engine(settings.database_url)
    return engine, db_state(engine)


# --- control plane and fleet -------------------------------------------------------


async def apply_all(env: WorkflowEnvironment, settings: Settings, **kw: object) -> ApplyAllResult:
    """ApplyAll through the Temporal client with a worker running; its result."""
    async with build_worker(env.client, settings):
        handle = await start_controlplane(env.client, settings, "ApplyAll", ApplyAllInput(**kw))  # type: ignore[arg-type]
        return await handle.result()


async def install(env: WorkflowEnvironment, settings: Settings, sources: list[str]) -> None:
    """ApplyAll of the app/connector pack ``sources`` (a worker runs meanwhile)."""
    await apply_all(env, settings, app_pack_sources=sources)


def connector_settings(settings: Settings) -> Settings:
    """``settings`` with a connector task queue of its own."""
    return settings.model_copy(update={"connector_task_queue": f"cn-{uuid.uuid4().hex[:8]}"})


def fast_fleet(settings: Settings) -> FleetInput:
    """Fleet timings short enough for tests."""
    return FleetInput(
        database_id=settings.database_id,
        reconcile_interval_seconds=1,
        lease_seconds=10,
        idle_seconds=0.5,
        drain_timeout_seconds=5,
        restart_backoff_min_seconds=0.2,
        restart_backoff_max_seconds=1,
    )


async def wait_drained(engine: Engine, timeout: float = 120) -> dict[str, int]:
    """Poll until no item is pending, processing or blocked; return counts by state."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = queue.pack_queue_stats(engine)
        by_state: dict[str, int] = {}
        for s in stats:
            for state, n in s.by_state().items():
                by_state[state] = by_state.get(state, 0) + n
        if not any(by_state.get(s) for s in ("pending", "processing", "blocked")):
            return by_state
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"queue not drained in {timeout} s: {by_state}")
        await asyncio.sleep(0.3)


def blocked_on_linked(engine: Engine) -> list[tuple[str, str]]:
    """``(work id, dependency key hash)`` of every ``blocked`` item whose remote
    link (or, for a record dependency, record) exists: an item that should
    already have been woken. The identity tests' invariant: this ends empty."""
    from nexuscrm.connectors.identity import Dependency, probe

    w = t.connector_work_item
    with engine.connect() as conn:
        rows = conn.execute(select(w).where(w.c.State == "blocked")).all()
    out = []
    for r in rows:
        dep = Dependency.from_row(r)
        if dep is not None and probe(engine, dep):
            out.append((r.WorkId, r.DependencyKeyHash))
    return out


async def assert_no_blocked_on_linked(engine: Engine, timeout: float = 60) -> None:
    """Wait until no item is ``blocked`` on a dependency that already resolved.

    A link commits before its waiters are woken (after the batch), so the
    invariant may be briefly false; it must hold within ``timeout`` seconds.
    Raises ``AssertionError`` naming the items still blocked on a linked parent.
    """
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stuck = await asyncio.to_thread(blocked_on_linked, engine)
        if not stuck:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"items blocked on a linked dependency after {timeout} s: {stuck}")
        await asyncio.sleep(0.2)


def no_blocked_on_linked_after(request: Any, timeout: float = 60) -> Iterator[None]:
    """Body of an autouse fixture: after the test, the identity invariant holds.

    For a test that uses the ``settings`` fixture: within ``timeout`` seconds
    no item of its database is ``blocked`` on a dependency whose remote link
    or record exists (:func:`blocked_on_linked`). Raises ``AssertionError``
    naming the items otherwise.
    """
    settings = request.getfixturevalue("settings") if "settings" in request.fixturenames else None
    yield
    if settings is None:
        return
    from nexuscrm.db.engine import make_engine

    engine = make_engine(settings.database_url)
    deadline = time.monotonic() + timeout
    try:
        if not inspect(engine).has_table(t.connector_work_item.name):
            return
        while stuck := blocked_on_linked(engine):
            if time.monotonic() > deadline:
                raise AssertionError(f"items blocked on a linked dependency: {stuck}")
            time.sleep(0.2)
    finally:
        engine.dispose()


async def wait_pools(
    fleet: Any, count: int, not_fingerprint: str | None = None, timeout: float = 60
) -> list[DesiredPack]:
    """Poll the fleet's status until it runs ``count`` pools, none of fingerprint
    ``not_fingerprint``; return them."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        pools = (await fleet.query("status", result_type=FleetStatus)).pools
        if len(pools) == count and all(p.fingerprint != not_fingerprint for p in pools):
            return pools
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"fleet pools: {pools}")
        await asyncio.sleep(0.2)


# --- the CLI -----------------------------------------------------------------------

runner = CliRunner()


def worker_process(
    settings: Settings,
    env: WorkflowEnvironment,
    script: str = "worker.py",
    log_level: str = "ERROR",
    **extra: str,
) -> subprocess.Popen[bytes]:
    """``python <script>`` (default the repository's ``worker.py``; a path relative to
    the repository) as a worker process of this test's database, server and
    control-plane and connector task queues, JSON logs at ``log_level``;
    ``extra``: more environment variables (``NEXUS_TEST_CRASH_*`` and the like)."""
    environ = {
        **os.environ,
        "NEXUS_DATABASE_URL": settings.database_url,
        "NEXUS_DATABASE_ID": settings.database_id,
        "NEXUS_TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
        "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
        "NEXUS_CONNECTOR_TASK_QUEUE": settings.connector_task_queue,
        "NEXUS_LOG_FORMAT": "json",
        "NEXUS_LOG_LEVEL": log_level,
        **extra,
    }
    return subprocess.Popen([sys.executable, str(ROOT / script)], env=environ, cwd=ROOT)


def cli_env(
    settings: Settings | None = None, env: WorkflowEnvironment | None = None
) -> dict[str, str]:
    """NEXUS_* variables pointing the CLI at this test's database, server and queue."""
    out: dict[str, str] = {
        "NEXUS_ENV": "development",
        "NEXUS_LOG_FORMAT": "json",
        "NEXUS_LOG_LEVEL": "WARNING",
        "COLUMNS": "400",  # wide enough that rich never folds a path
    }
    if settings is not None:
        out |= {
            "NEXUS_DATABASE_URL": settings.database_url,
            "NEXUS_CONTROLPLANE_TASK_QUEUE": settings.controlplane_task_queue,
            "NEXUS_CONNECTOR_TASK_QUEUE": settings.connector_task_queue,
            "NEXUS_DATABASE_ID": settings.database_id,
        }
    if env is not None:
        out["NEXUS_TEMPORAL_ADDRESS"] = env.client.service_client.config.target_host
    return out


def invoke(args: Sequence[str], env: Mapping[str, str | None]) -> Result:
    """Run a CLI command through typer's CliRunner; logging is rebound afterwards."""
    try:
        return runner.invoke(app, list(args), env=env)
    finally:
        configure_logging("json", "WARNING")


async def invoke_async(args: Sequence[str], env: Mapping[str, str | None]) -> Result:
    """Run a CLI command in a thread (it runs its own event loop)."""
    return await asyncio.to_thread(invoke, args, env)


# --- endpoints ---------------------------------------------------------------------


@dataclass
class HookCall:
    """One request :class:`HookServer` answered: body, headers, when it started and ended.

    ``started`` / ``ended`` are ``time.monotonic()`` seconds; ``ended`` is
    ``None`` while the request is in flight.
    """

    body: dict[str, Any]
    headers: dict[str, str]
    started: float
    ended: float | None = None


class HookServer:
    """A local HTTP endpoint for webhook flows: scripted statuses, optional delay.

    ``received`` are the request bodies; ``calls`` the same requests with their
    headers and time spans (:class:`HookCall`).
    """

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.calls: list[HookCall] = []
        self.script: dict[str, list[int]] = {}  # idempotency source id -> statuses to answer
        self.delay = 0.0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                call = HookCall(body, dict(self.headers.items()), time.monotonic())
                outer.received.append(body)
                outer.calls.append(call)
                try:
                    self._answer(body)
                except OSError:
                    pass  # the client is gone (a killed worker): nobody reads the answer
                finally:
                    call.ended = time.monotonic()

            def _answer(self, body: dict[str, Any]) -> None:
                time.sleep(outer.delay)
                key = (body.get("payload") or {}).get("key", "")
                statuses = outer.script.get(key) or [200]
                status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
                # Also a valid batch-read answer (nothing to enrich), so the same
                # server can stand in for a slow callout endpoint.
                data = b'{"records": {}}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    async def in_flight(self, keys: list[str] | None = None, timeout: float = 60.0) -> None:
        """Until a request (of one of the events ``keys``; any without) is in flight.

        Raises ``AssertionError`` naming the calls after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(
                c.ended is None and (keys is None or c.body["payload"]["key"] in keys)
                for c in self.calls
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no call of {keys or 'any key'} in flight: {self.calls}")

    def close(self) -> None:
        self.server.shutdown()


def abandoned_attempts(engine: Engine) -> list[tuple[str, str, str]]:
    """Attempts that ended ``abandoned``: (event idempotency key, work id, cause code)."""
    a, w, e = t.connector_work_attempt, t.connector_work_item, t.connector_event
    with engine.connect() as conn:
        rows = conn.execute(
            select(e.c.IdempotencyKey, w.c.WorkId, a.c.CauseCode)
            .join(w, w.c.WorkId == a.c.WorkId)
            .join(e, e.c.EventId == w.c.EventId)
            .where(a.c.OutcomeState == "abandoned")
        ).all()
    return [(str(k), str(wid), str(c)) for k, wid, c in rows]


# --- shared test bodies ------------------------------------------------------------


async def sync_corpus_data_plans_shuffled(env: WorkflowEnvironment, settings: Settings) -> None:
    """DreamHouse + eBikes sample data plans, shuffled, synced through the fleet.

    Installs both corpus projects and salesforce-sync (on a connector queue of
    its own), enqueues every plan record as an event, runs the fleet until the
    queue drains, and asserts every event succeeded and every record landed
    exactly once with its fields and resolved lookups.
    """
    settings = connector_settings(settings)
    dreamhouse = corpus_project("dreamhouse-lwc")
    ebikes = corpus_project("ebikes-lwc")
    await install(env, settings, [str(dreamhouse), str(ebikes), str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    (pack,) = list_connector_packs(engine)
    plans = [
        dreamhouse / "data" / "sample-data-plan.json",
        ebikes / "data" / "sample-data-plan.json",
    ]
    events = []
    for plan in plans:
        events += events_from_sfdx_plan(
            plan, installed_pack_id=pack.install_id, namespace=pack.namespace, shuffle=True, seed=7
        )
    result = queue.enqueue(engine, events)
    assert result.inserted == len(events)
    catalog.CACHE.invalidate()
    async with (
        build_worker(env.client, settings),
        build_connector_worker(env.client, settings),
    ):
        fleet = await start_fleet(env.client, settings, fast_fleet(settings))
        states = await wait_drained(engine)
        await fleet.signal("stop")
        await fleet.result()
    assert states == {"succeeded": len(events)}, states

    verify_synced(engine, [r for plan in plans for r in plan_records(plan)])


def verify_synced(engine: Engine, records: list[dict[str, Any]]) -> None:
    """Assert every SFDX data-plan record landed exactly once, with its fields and
    resolved lookups (``@ref`` values name the parent's remote id)."""
    with engine.connect() as conn:
        links = {
            (r.DestinationObject, r.RemoteId): r.RecordId
            for r in conn.execute(select(t.connector_remote_link))
        }
        for rec in records:
            obj, ref = rec["attributes"]["type"], rec["attributes"]["referenceId"]
            record_id = links[(obj, ref)]
            found = (
                conn.execute(
                    text(f'SELECT * FROM "{obj}" WHERE "Id" = :id'.replace('"', "`"))
                    if engine.dialect.name == "mysql"
                    else text(f'SELECT * FROM "{obj}" WHERE "Id" = :id'),
                    {"id": record_id},
                )
                .mappings()
                .one()
            )
            row = {k.lower(): v for k, v in found.items()}  # plans spell names freely
            for key, value in rec.items():
                if key == "attributes":
                    continue
                key = key.lower()
                if isinstance(value, str) and value.startswith("@"):
                    parent_obj = catalog.CACHE.get(engine).get(obj)
                    assert parent_obj is not None
                    field = next(f for f in parent_obj.fields if f.api_name.lower() == key)
                    assert row[key] == links[(field.reference_to, value[1:])], (obj, ref, key)
                elif isinstance(value, bool):
                    assert bool(row[key]) == value
                elif isinstance(value, int | float):
                    assert Decimal(str(row[key])) == Decimal(str(value)), (obj, ref, key)
                elif value is not None:
                    assert str(row[key]) == str(value)[: len(str(row[key]))], (obj, ref, key)
        for obj in {r["attributes"]["type"] for r in records}:
            count = conn.execute(text(f"SELECT COUNT(*) FROM {obj}")).scalar_one()
            expected = sum(1 for r in records if r["attributes"]["type"] == obj)
            assert count == expected, obj  # once: never duplicated


# --- history measurement (the soak test and bench_history) -------------------------


async def executions(client: Any, query: str) -> list[Any]:
    """Every execution (any run, any status) the server lists for visibility ``query``."""
    return [wf async for wf in client.list_workflows(query)]


async def history_length(client: Any, workflow_id: str, run_id: str) -> int:
    """Events in one run's history, as the server counts them (describe, not visibility)."""
    desc = await client.get_workflow_handle(workflow_id, run_id=run_id).describe()
    return int(desc.raw_description.workflow_execution_info.history_length)


async def chain_events(client: Any, workflow_id: str) -> dict[str, int]:
    """Events per run of every run of ``workflow_id`` (continue-as-new chains and reuses)."""
    runs = await executions(client, f'WorkflowId = "{workflow_id}"')
    return {wf.run_id: await history_length(client, wf.id, wf.run_id) for wf in runs}


# -- Prometheus endpoints (a worker's NEXUS_METRICS_ADDRESS) -------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Scraped samples: ``(name, labels) -> value``."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (free when asked; bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(text: str) -> Samples:
    """Prometheus text format -> {(name, labels): value} (``service_name`` dropped),
    read with ``prometheus_client``'s parser (which also checks the format)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "service_name")
            out[(sample.name, labels)] = float(sample.value)
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with exactly ``labels`` (``None``: absent)."""
    return samples.get((name, frozenset(labels.items())))


async def scrape_until(url: str, ready: Callable[[Samples], bool], timeout: float = 20) -> Samples:
    """Scrape ``url`` until ``ready(samples)`` (the gauges are sampled every 5 s)."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient() as http:
        while True:
            try:
                samples = parse((await http.get(url)).text)
            except httpx.TransportError:
                samples = {}
            if ready(samples):
                return samples
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"metrics not ready in {timeout} s: {sorted(samples)[:80]}")
            await asyncio.sleep(0.25)


def apply_all_entry(
    settings: Settings, request_id: str, arg: ApplyAllInput | None = None, **fields: Any
) -> QueueEntry:
    """An ApplyAll ``QueueEntry`` of the database's control-plane queue, as the queue
    entity holds one (child id ``<controlplane workflow id>/ApplyAll/<request id>``);
    ``fields`` set the rest (state, deadline...)."""
    return QueueEntry(
        request_id=request_id,
        workflow_id=f"{settings.controlplane_workflow_id}/ApplyAll/{request_id}",
        operation="ApplyAll",
        request=build_request("ApplyAll", arg or ApplyAllInput(), settings),
        **fields,
    )
