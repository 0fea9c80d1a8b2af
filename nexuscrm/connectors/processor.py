"""Process one claimed batch: resolve each item's route, run its flow, finish it.

Port of the seed's ``connector_inbound.Worker`` per-event step, batched. The
``upsert_record`` items of a batch run in one transaction per ``CHUNK``:
their leases are held (locked) first, the flow's writes (records and remote
links) are a few multi-row statements, and every item is finished in the
same transaction (one compare-and-set UPDATE and one attempts INSERT for the
successes), so a crash leaves either nothing or everything of the chunk. An
item whose lease was lost to a stale reclaim is left alone (the other worker
owns it). A database error in a chunk rolls it back and the chunk is redone
item by item, one transaction each (the seed's shape), which isolates the bad
item. Webhook items run one by one (an external call each).

A lookup whose parent is not linked yet (``DependencyUnresolved``) blocks the
item on that remote identity (``queue.block_item``, in the transaction
that ends its attempt): the outcome lists the blocked items, for the caller to
register their identity waits after commit. The remote links a batch creates
are collected too; right after their commit, their blocked children are set
pending and the key hashes that had children are the outcome's ``wake_keys``
(the caller completes those waits). A block re-reads its dependency right
after its commit and wakes itself if the parent linked meanwhile (issue 16).

Before any of that, in both roles (seed: ``SetOutboundEchoProbe`` and
``SetCompanionInstalledChecker`` on every worker):

* the outbound echo probe (``echo.SQLOutboundEchoProbe``) finds the items that
  echo the system's own outbound write; they are finished succeeded (attempt
  ``CauseCode='outbound-echo'``) without enrichment or flow;
* a cross-pack item (its route names a ``companion_pack``, or its event has a
  frozen companion) runs only while its frozen companion AppPack incarnation
  is installed and active: otherwise it fails ``companion-pack-inactive``
  (terminal; retried as ``companion-pack-installing`` while that incarnation
  is being re-applied).

Once and in order: a chunk that outlasts the flow deadline is rolled back
and redone item by item (never committed and then retried); an item that can
never run fails alone before any flow (``payload-invalid``,
``replay-superseded``), and an exception no handler expected ends only its
own item's attempt (``finishing.Finisher``). Everything of one batch (its
tally, the companions it read, the links it created) lives in the batch's own
``_Batch``: one processor serves concurrent batches.

Role (``handoff`` module): ``local`` runs ``flow`` routes; ``handoff`` writes
each item's business operation as a ``_System_RuntimeCommand`` row in the
transaction that finishes it (attempt ``CauseCode='runtime-command-handoff'``,
``FlowExecutionId`` = the command id), fails routes of any other invocation
mode with ``invocation-mode-unsupported`` and never runs a local flow.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from sqlalchemy import Engine, select

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.echo import EchoCandidate, SQLOutboundEchoProbe
from nexuscrm.connectors.enrich import (
    BatchReadClient,
    EnrichmentError,
    batch_read_key,
    pack_batch_client,
)
from nexuscrm.connectors.finishing import BatchOutcome, Finisher
from nexuscrm.connectors.flows import (
    DependencyUnresolved,
    FlowError,
    RemoteIdentity,
    UpsertRequest,
    post_webhook,
    upsert_record,
    upsert_records,
)
from nexuscrm.connectors.handoff import (
    ROLE_HANDOFF,
    RuntimeCommand,
    supported_modes,
    write_commands,
)
from nexuscrm.connectors.routes import (
    ConnectorPackRow,
    RouteNotFoundError,
    RouteResolver,
    still_installed,
)
from nexuscrm.connectors.serving import RuntimeServingSelection
from nexuscrm.connectors.wakes import wake_linked, wake_resolved
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import describe_error, is_transient
from nexuscrm.log import log
from nexuscrm.packs.model import Category, InboundRoute

MAX_ATTEMPTS = queue.MAX_ATTEMPTS
# Flow items per transaction (a batch is at most this in the default profiles).
CHUNK = 100


@dataclass
class _Plan:
    """What one claimed item runs: a batched flow request, a webhook, a runtime
    command (handoff role), or an error."""

    request: UpsertRequest | None = None
    webhook: bool = False
    error: Exception | None = None
    command: RuntimeCommand | None = None


class _ChunkOverrun(Exception):
    """Raised inside a chunk's transaction when it outlasted the flow deadline (rolls it back)."""


@dataclass
class _Batch:
    """State of ONE batch, owned by the call that processes it.

    One :class:`Processor` serves every batch of its worker process, up to
    ``max_concurrent_activities`` of them at once in threads, so nothing that
    belongs to a batch may live on the processor: ``outcome`` is its tally,
    ``companions`` the status of each frozen companion incarnation it read,
    ``created`` the remote links its flows created (whose blocked children it
    wakes).
    """

    outcome: BatchOutcome = field(default_factory=BatchOutcome)
    companions: dict[str, str] = field(default_factory=dict)
    created: list[RemoteIdentity] = field(default_factory=list)


class Processor:
    """Runs claimed items for one database.

    ``http`` is the client for webhook flows (one per process);
    ``flow_deadline`` bounds each external call (``None`` disables it);
    ``selection``: the frozen serving selection, if any (batch reads then
    use only its profiles and credentials, ``enrich.pack_batch_client``);
    ``role`` is ``local`` or ``handoff`` (see the module docstring; the
    handoff role's serving-selection requirement is checked where the
    selection is loaded, ``handoff.require_serving_selection``). Raises
    ``ValueError`` for an unknown role.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        http: httpx.Client | None = None,
        flow_deadline: dt.timedelta | None = dt.timedelta(minutes=10),
        max_attempts: int = MAX_ATTEMPTS,
        role: str = "local",
        selection: RuntimeServingSelection | None = None,
        on_woken: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.on_woken = on_woken  # (path, installed pack id, seconds parked) per woken item
        self.selection = selection  # batch reads use only its profiles and credentials
        self.modes = supported_modes(role)
        self.role = role
        self.echo = SQLOutboundEchoProbe(engine)
        self.engine = engine
        self.routes = RouteResolver(engine)
        self.http = http or httpx.Client()
        self.flow_deadline = flow_deadline
        self.max_attempts = max_attempts
        self.finish = Finisher(engine, max_attempts)
        # Shared by concurrent batches: only immutable-once-built clients per pack.
        self._clients: dict[str, BatchReadClient] = {}

    def _woken_hook(self, path: str) -> queue.WokenHook | None:
        """``on_woken`` bound to the wake ``path`` (``batch``: the parent's batch woke
        its children; ``self``: a child's own post-block re-read woke it)."""
        hook = self.on_woken
        if hook is None:
            return None
        return lambda pack, seconds: hook(path, pack, seconds)

    def process(
        self,
        items: Sequence[queue.ClaimedItem],
        *,
        on_item: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> BatchOutcome:
        """Process ``items``; ``on_item`` runs after each item and each batch read (progress).

        ``should_stop`` is asked before each chunk and each single item: once
        it says yes (the worker shuts down), no further item starts and the
        leases of the items not started are handed back at once
        (``queue.release_leases``; counted in ``released``), so another
        worker claims them now rather than when their leases expire.

        Items of a batch are heads of distinct lanes, so they are independent:
        the ``upsert_record`` items (and items that fail before any flow runs)
        go through :meth:`_flow_chunk`, ``CHUNK`` at a time, one transaction
        each; webhook items run one by one after them (an external call per
        item). ``on_item`` is never called inside a transaction.
        """
        batch = _Batch()
        outcome = batch.outcome
        try:
            batched, single = self._prepare(items, batch, on_item)
        except Exception as exc:  # one bad item must not sink its batch-mates
            log.warning(
                "batch preparation raised; preparing its items one by one",
                items=len(items),
                err=describe_error(exc),
            )
            batched, single = [], []
            for item in items:
                try:
                    b, one = self._prepare([item], batch, on_item)
                except Exception as item_exc:
                    self.finish.unexpected(item, item_exc, outcome)
                    continue
                batched += b
                single += one
        cat = catalog.CACHE.get(self.engine)
        for start in range(0, len(batched), CHUNK):
            if should_stop is not None and should_stop():
                rest = [i for i, _p in batched[start:]] + single
                outcome.released = len(queue.release_leases(self.engine, rest))
                single = []
                break
            chunk = batched[start : start + CHUNK]
            if not self._flow_chunk(chunk, cat, batch):
                # Something in the chunk raised a database error (or lost a
                # lease between hold and finish, or outlasted the flow
                # deadline): nothing of it was written. Redo it item by item,
                # one transaction each, which isolates the bad item and
                # classifies its error.
                for item, _plan in chunk:
                    self._one_guarded(item, cat, batch)
                    if on_item is not None:
                        on_item()
                continue
            if on_item is not None:
                for _ in chunk:
                    on_item()
        for k, item in enumerate(single):
            if should_stop is not None and should_stop():
                outcome.released = len(queue.release_leases(self.engine, single[k:]))
                break
            self._one_guarded(item, cat, batch)
            if on_item is not None:
                on_item()
        return outcome

    def _prepare(
        self,
        items: Sequence[queue.ClaimedItem],
        batch: _Batch,
        on_read: Callable[[], None] | None = None,
    ) -> tuple[list[tuple[queue.ClaimedItem, _Plan]], list[queue.ClaimedItem]]:
        """Split ``items`` into chunkable ``(item, plan)`` pairs and one-by-one items.

        Fails at once what can never run (a payload that is not a JSON object:
        ``payload-invalid``), refuses replays that a later event of their
        record superseded (``replay-superseded``), finishes outbound echoes,
        reads the companions, enriches (``on_read`` after each batch read) and
        resolves each item's route. Raises
        whatever a step raises (the caller retries the items one by one, so
        one bad item fails alone).
        """
        items = self.finish.unrunnable(items, batch.outcome)
        items = self._finish_echoes(items, batch.outcome)
        batch.companions = {**batch.companions, **self._companion_states(items)}
        items, enrich_errors = self._enrich(items, on_read=on_read)
        batched: list[tuple[queue.ClaimedItem, _Plan]] = []
        single: list[queue.ClaimedItem] = []
        for item in items:
            error = enrich_errors.get(item.work_id)
            plan = _Plan(error=error) if error is not None else self._plan(item, batch)
            if plan.webhook:
                single.append(item)
            else:
                batched.append((item, plan))
        return batched, single

    def _finish_echoes(
        self, items: Sequence[queue.ClaimedItem], outcome: BatchOutcome
    ) -> list[queue.ClaimedItem]:
        """Finish the items that echo an outbound write; return the others.

        One probe read per batch; only when something matches, one write
        transaction holds those leases, consumes their writes (compare-and-set)
        and finishes them succeeded. An item whose lease is lost is counted
        and dropped; one whose write was consumed meanwhile runs normally.
        """
        candidates = []
        for item in items:
            fields = item.payload.get("fields")
            if not isinstance(fields, dict) or not fields or not item.source_id:
                continue
            try:
                owner = self.routes.pack(item.installed_pack_id).namespace
            except RouteNotFoundError:
                continue  # fails route-not-found later
            candidates.append(
                EchoCandidate(
                    item.work_id, owner, item.namespace, item.source_object, item.source_id, fields
                )
            )
        matches = self.echo.probe(candidates)
        if not matches:
            return list(items)
        echoed: list[queue.ClaimedItem] = []
        with queue.write_transaction(self.engine) as conn:
            held = queue.hold_leases(conn, [i for i in items if i.work_id in matches])
            for item in held:
                if self.echo.consume(conn, item.work_id, matches[item.work_id]):
                    echoed.append(item)
            queue.finish_succeeded_many(
                conn,
                echoed,
                flow_execution_ids={i.work_id: f"echo:{matches[i.work_id]}" for i in echoed},
                cause_code="outbound-echo",
            )
        held_ids = {i.work_id for i in held}
        done = {i.work_id for i in echoed}
        outcome.lost += len(matches) - len(held_ids)
        outcome.succeeded_items(echoed)
        if echoed:
            log.info("outbound echoes finished without their flow", items=len(echoed))
        return [
            i
            for i in items
            if i.work_id not in done and (i.work_id not in matches or i.work_id in held_ids)
        ]

    def _companion_states(self, items: Sequence[queue.ClaimedItem]) -> dict[str, str]:
        """``{companion install id: Status}`` of the AppPack incarnations the items froze.

        ``''`` for an id with no AppPack row (removed from the table or never
        active). One read per batch that has cross-pack items.
        """
        ids = sorted({i.companion_pack_install_id for i in items if i.companion_pack_install_id})
        if not ids:
            return {}
        ip = t.installed_pack
        with self.engine.connect() as conn:
            found = {
                r.PackInstallId: r.Status
                for r in conn.execute(
                    select(ip.c.PackInstallId, ip.c.Status).where(
                        ip.c.PackInstallId.in_(ids), ip.c.Category == Category.AppPack.value
                    )
                )
            }
        return {i: found.get(i, "") for i in ids}

    def _check_companion(
        self, item: queue.ClaimedItem, route: InboundRoute, pack: ConnectorPackRow, batch: _Batch
    ) -> None:
        """Port of ``companionInstallStillInstalledChecker``: the frozen companion must be active.

        Raises ``FlowError`` ``companion-pack-inactive`` (terminal) when the
        event is cross-pack and its frozen AppPack incarnation is not
        installed and active (or none was frozen), ``companion-pack-installing``
        (retried) while that incarnation is being re-applied.
        """
        frozen = item.companion_pack_install_id
        if frozen is None and route.companion_pack is None:
            return  # not a cross-pack event
        if frozen and frozen not in batch.companions:
            batch.companions.update(self._companion_states([item]))
        status = batch.companions.get(frozen, "") if frozen else ""
        if status == "active":
            return
        where = (
            f"cross-pack event {item.event_id} (route {route.event_kind} v{route.route_version} "
            f"of pack {pack.namespace})"
        )
        companion = route.companion_pack or "companion"
        if not frozen:
            raise FlowError(
                "companion-pack-inactive",
                f"{where}: no {companion} AppPack incarnation was active when it was enqueued",
                retriable=False,
            )
        if status == "installing":
            raise FlowError(
                "companion-pack-installing",
                f"{where}: companion AppPack {companion} incarnation {frozen} is being applied",
                retriable=True,
            )
        raise FlowError(
            "companion-pack-inactive",
            f"{where}: companion AppPack {companion} incarnation {frozen} is no longer installed "
            f"and active (status {status or 'absent'!s})",
            retriable=False,
        )

    def forget(self) -> None:
        """Drop cached routes and batch clients (after packs changed)."""
        self.routes.forget()
        self._clients.clear()

    def _batch_client(self, install_id: str) -> BatchReadClient:
        """The incarnation's batch-read client: selected profiles only, drain-only context."""
        client = self._clients.get(install_id)
        if client is None:
            client = pack_batch_client(
                self.routes.pack(install_id),
                self.http,
                deadline=self.flow_deadline,
                selection=self.selection,
                still_installed=lambda: still_installed(self.engine, install_id),
            )
            self._clients[install_id] = client
        return client

    def _enrich(
        self,
        items: Sequence[queue.ClaimedItem],
        on_read: Callable[[], None] | None = None,
    ) -> tuple[list[queue.ClaimedItem], dict[str, FlowError]]:
        """Lay each record's current remote fields over its payload fields.

        One batch read per (pack, namespace, source object) for the whole
        batch, its idempotency key derived from the group's work ids
        (:func:`batch_read_key`); ``on_read`` runs after each. A failed read
        fails only the items of that group, with class ``enrichment-failed``
        (retried when the error is retriable).
        """
        groups: dict[tuple[str, str, str], list[queue.ClaimedItem]] = {}
        for item in items:
            groups.setdefault(
                (item.installed_pack_id, item.namespace, item.source_object), []
            ).append(item)
        enriched: dict[str, queue.ClaimedItem] = {}
        errors: dict[str, FlowError] = {}
        for (install_id, namespace, source_object), members in groups.items():
            try:
                client = self._batch_client(install_id)
                remote = client.batch_read(
                    namespace,
                    source_object,
                    [m.source_id for m in members],
                    idempotency_key=batch_read_key(m.work_id for m in members),
                )
            except RouteNotFoundError:
                continue  # the item fails with route-not-found in _plan
            except EnrichmentError as exc:
                for m in members:
                    errors[m.work_id] = FlowError(
                        "enrichment-failed", str(exc), retriable=exc.retriable
                    )
                continue
            finally:
                if on_read is not None:
                    on_read()
            for m in members:
                fields = remote.get(m.source_id)
                if fields:
                    payload = dict(m.payload)
                    payload["fields"] = {**dict(payload.get("fields") or {}), **fields}
                    enriched[m.work_id] = dataclasses.replace(m, payload=payload)
        return [enriched.get(i.work_id, i) for i in items], errors

    def _route(
        self, item: queue.ClaimedItem, batch: _Batch
    ) -> tuple[InboundRoute, ConnectorPackRow]:
        """The item's route and pack, checked for this role and its companion.

        Raises ``RouteNotFoundError``, or ``FlowError`` for a route this
        supervisor cannot run (``runtime-handoff-unavailable`` in the local
        role, ``invocation-mode-unsupported`` in the handoff role) or a failed
        companion check (:meth:`_check_companion`).
        """
        route = self.routes.resolve(item.installed_pack_id, item.event_kind, item.route_version)
        pack = self.routes.pack(item.installed_pack_id)
        if route.invocation_mode not in self.modes:
            if self.role == ROLE_HANDOFF:
                # Port of RuntimeCommandHandoffSupportsInvocationMode: no local fallback.
                raise FlowError(
                    "invocation-mode-unsupported",
                    f"route {route.event_kind} v{route.route_version} of pack {pack.namespace} "
                    f"({pack.install_id}) selects invocation mode {route.invocation_mode!r}, "
                    "which Runtime command handoff does not support; the handoff role runs "
                    "no local flow",
                    retriable=False,
                )
            raise FlowError(
                "runtime-handoff-unavailable",
                f"route {route.event_kind} v{route.route_version} hands off to a runtime "
                "service; this supervisor runs local flows only",
                retriable=False,
            )
        self._check_companion(item, route, pack, batch)
        return route, pack

    def _plan(self, item: queue.ClaimedItem, batch: _Batch) -> _Plan:
        """Resolve the item's route: its flow request, or the error it fails with."""
        try:
            route, pack = self._route(item, batch)
        except (RouteNotFoundError, FlowError) as exc:
            return _Plan(error=exc)
        except Exception:  # classified by the one-by-one path
            return _Plan(webhook=True)
        if self.role == ROLE_HANDOFF:
            return _Plan(command=RuntimeCommand(item, route, pack.namespace))
        if route.flow == "webhook":
            return _Plan(webhook=True)
        return _Plan(
            request=UpsertRequest(
                owner_key=pack.namespace,
                namespace=item.namespace,
                payload=item.payload,
                destination_object=route.destination_object,
                field_map=route.field_map,
            )
        )

    def _flow_chunk(
        self,
        chunk: Sequence[tuple[queue.ClaimedItem, _Plan]],
        cat: catalog.Catalog,
        batch: _Batch,
    ) -> bool:
        """Run a chunk of flow items in ONE transaction; False if it must be redone one by one.

        Holds the chunk's leases (items whose lease is lost are counted and
        left alone), runs :func:`upsert_records` for the rest, and finishes
        every item in the same transaction: successes with one batched
        compare-and-set and one attempts INSERT, flow errors (which wrote
        nothing) with their retry or failure. A database error anywhere rolls
        the whole chunk back and returns False. So does a chunk that outlasted
        the flow deadline: its writes are rolled back (never committed and then
        retried, which would apply the events again), and the one-by-one redo
        bounds each item by the deadline on its own.
        """
        outcome = batch.outcome
        start = time.monotonic()
        counts = BatchOutcome()
        try:
            with queue.write_transaction(self.engine) as conn:
                held = {i.work_id for i in queue.hold_leases(conn, [i for i, _p in chunk])}
                live = [(i, p) for i, p in chunk if i.work_id in held]
                counts.lost = len(chunk) - len(live)
                flow_items = [(i, p.request) for i, p in live if p.request is not None]
                created: list[RemoteIdentity] = []
                results = upsert_records(conn, cat, [r for _i, r in flow_items], created)
                by_work: dict[str, tuple[str, RemoteIdentity] | Exception] = {
                    i.work_id: res for (i, _r), res in zip(flow_items, results, strict=True)
                }
                if self.flow_deadline and time.monotonic() - start > (
                    self.flow_deadline.total_seconds()
                ):
                    raise _ChunkOverrun()
                succeeded: list[queue.ClaimedItem] = []
                commands = [p.command for _i, p in live if p.command and p.error is None]
                handed = write_commands(conn, commands)
                for item, plan in live:
                    if item.work_id in handed:
                        continue
                    res = plan.error if plan.error is not None else by_work[item.work_id]
                    if not isinstance(res, Exception):
                        succeeded.append(item)
                        continue
                    self.finish.error(conn, item, res, counts)
                queue.finish_succeeded_many(conn, succeeded)
                queue.finish_succeeded_many(
                    conn,
                    [c.item for c in commands],
                    flow_execution_ids=handed,
                    cause_code="runtime-command-handoff",
                )
                counts.succeeded_items([*succeeded, *(c.item for c in commands)])
        except _ChunkOverrun:
            log.warning(
                "connector batch outlasted the flow deadline; rolled back, redoing it item by item",
                items=len(chunk),
                deadline_s=self.flow_deadline.total_seconds() if self.flow_deadline else None,
            )
            return False
        except Exception as exc:  # the one-by-one redo classifies it
            log.warning(
                "connector batch rolled back; redoing it item by item",
                items=len(chunk),
                err=describe_error(exc),
            )
            return False
        outcome.succeeded += counts.succeeded
        outcome.retried += counts.retried
        outcome.failed += counts.failed
        outcome.lost += counts.lost
        outcome.ended.update(counts.ended)
        outcome.blocked += wake_resolved(
            self.engine, counts.blocked, outcome, self._woken_hook("self")
        )
        wake_linked(self.engine, created, outcome, self._woken_hook("batch"))
        batch.created += created
        for key, n in counts.failure_classes.items():
            outcome.failure_classes[key] = outcome.failure_classes.get(key, 0) + n
        return True

    def _one_guarded(self, item: queue.ClaimedItem, cat: catalog.Catalog, batch: _Batch) -> None:
        """:meth:`_one`, with a lost lease counted and any escaping error finishing the item."""
        try:
            self._one(item, cat, batch)
        except queue.LeaseLost:
            batch.outcome.lost += 1
        except Exception as exc:  # e.g. the finish itself failed: fail or retry the item alone
            self.finish.unexpected(item, exc, batch.outcome)

    def _one(self, item: queue.ClaimedItem, cat: catalog.Catalog, batch: _Batch) -> None:
        outcome = batch.outcome
        try:
            route, pack = self._route(item, batch)
            if self.role == ROLE_HANDOFF:
                with self.engine.begin() as conn:
                    handed = write_commands(conn, [RuntimeCommand(item, route, pack.namespace)])
                    queue.finish_succeeded(
                        conn,
                        item,
                        flow_execution_id=handed[item.work_id],
                        cause_code="runtime-command-handoff",
                    )
            elif route.flow == "webhook":
                timeout = self.flow_deadline.total_seconds() if self.flow_deadline else None
                post_webhook(
                    self.http,
                    str(route.webhook_url),
                    {"event_id": item.event_id, "kind": item.event_kind, "payload": item.payload},
                    timeout_s=timeout,
                    idempotency_key=item.work_id,
                )
                with self.engine.begin() as conn:
                    queue.finish_succeeded(conn, item)
            else:
                start = time.monotonic()
                created: list[RemoteIdentity] = []
                with self.engine.begin() as conn:
                    upsert_record(
                        conn,
                        cat,
                        owner_key=pack.namespace,
                        namespace=item.namespace,
                        payload=item.payload,
                        destination_object=route.destination_object,
                        field_map=route.field_map,
                        created=created,
                    )
                    if (
                        self.flow_deadline
                        and time.monotonic() - start > self.flow_deadline.total_seconds()
                    ):
                        raise FlowError(
                            "flow-deadline", "flow exceeded its deadline", retriable=True
                        )
                    queue.finish_succeeded(conn, item)
                wake_linked(self.engine, created, outcome, self._woken_hook("batch"))
                batch.created += created
            outcome.succeeded_items([item])
        except RouteNotFoundError as exc:  # route-not-found, or pack-removed
            self.finish.failed(item, exc.failure_class, str(exc), outcome)
        except DependencyUnresolved as exc:
            with self.engine.begin() as conn:
                self.finish.block(conn, item, exc, outcome)
            outcome.blocked[-1:] = wake_resolved(
                self.engine, outcome.blocked[-1:], outcome, self._woken_hook("self")
            )
        except FlowError as exc:
            if exc.retriable and item.budget_attempt < self.max_attempts:
                delay = queue.retry_backoff(item.budget_attempt)
                self.finish.retry(item, exc.failure_class, str(exc), delay, outcome)
            else:
                self.finish.failed(item, exc.failure_class, str(exc), outcome)
        except queue.LeaseLost:
            raise
        except Exception as exc:
            if is_transient(exc) and item.budget_attempt < self.max_attempts:
                delay = queue.retry_backoff(item.budget_attempt)
                self.finish.retry(item, "transient-db", describe_error(exc), delay, outcome)
            else:
                log.error("flow raised", work_id=item.work_id, err=describe_error(exc))
                self.finish.failed(item, "flow-error", describe_error(exc), outcome)
