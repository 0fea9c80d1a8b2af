"""Post-claim enrichment: read the current remote state of a batch's records.

Port of the seed's ``BatchReadClient`` path: a pack whose callout profile maps
an object kind to a batch-read endpoint gets one read per (namespace, object
kind) per claimed batch — never one per item — and the remote fields are laid
over the event's payload fields. A pack with no eligible profile takes the
payload-only path (``NoopBatchReadClient``).

Startup contract (:func:`plan_batch`, the seed's ``buildBatchClient``): a
profile may declare ``required_object_kinds`` (a pool without batch coverage
for one of them does not start; the error names the kinds) and
``projection_fields`` (sent with every read; their metadata feeds the pool
fingerprint). Two profiles covering one kind degrade the pack to payload-only
with a warning (the fleet shows it as degraded). Credentials are validated
when a pool is built (:func:`validate_batch_credentials`), in a drain-only
context (:class:`DrainOnlyContext`) for a drain-only incarnation.

At runtime (:func:`pack_batch_client`) the reads use exactly the profiles
admission checked: under a serving selection only the selected ones with
their authorized credentials, and a drain-only incarnation reads in its
drain-only context (:class:`DrainOnlyBatchReadClient`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import httpx

from nexuscrm.connectors.routes import ConnectorPackRow
from nexuscrm.connectors.serving import (
    RuntimeServingSelection,
    ServingSelectionError,
    selected_profiles,
)
from nexuscrm.errors import NexusError
from nexuscrm.log import log
from nexuscrm.packs.model import CalloutProfile


class EnrichmentError(NexusError):
    """A batch read failed; ``retriable`` says whether a later attempt may succeed."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


IDEMPOTENCY_HEADER = "Idempotency-Key"
"""The header every external call carries (webhook POSTs and batch reads).

External effects are at-least-once: a call in flight when its worker dies
(or whose answer is lost) is made again by the next attempt, with the same
key, so the remote end can recognize the repeat."""


def batch_read_key(work_ids: Iterable[str]) -> str:
    """The idempotency key of one batch read: ``batch-read:<sha256 of the sorted work ids>``.

    The same group of items (a repeat after a crash) reads with the same key.
    """
    digest = hashlib.sha256("\n".join(sorted(work_ids)).encode("utf-8")).hexdigest()
    return f"batch-read:{digest[:32]}"


class BatchReadClient(Protocol):
    """Reads remote records: ``{source id: {field: value}}`` for the ids it found."""

    def batch_read(
        self,
        namespace: str,
        object_kind: str,
        source_ids: Sequence[str],
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """One call for all ``source_ids`` of one object kind (``idempotency_key``: its header)."""
        ...


class NoopBatchReadClient:
    """The payload-only path: enriches nothing."""

    def batch_read(
        self,
        namespace: str,
        object_kind: str,
        source_ids: Sequence[str],
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Always ``{}``."""
        return {}


_REF_RE = re.compile(r"[^A-Za-z0-9]+")


def resolve_credential(ref: str, env: Mapping[str, str] = os.environ) -> str:
    """The secret for credential reference ``ref``: env ``NEXUS_CREDENTIAL_<REF>``.

    ``ref`` is upper-cased with non-alphanumerics as ``_`` (``salesforce-prod`` ->
    ``NEXUS_CREDENTIAL_SALESFORCE_PROD``). Raises ``EnrichmentError`` (not
    retriable) naming the variable when it is unset: batch credentials are
    validated when a pool is built, so a missing one fails closed.
    """
    name = "NEXUS_CREDENTIAL_" + _REF_RE.sub("_", ref).strip("_").upper()
    value = env.get(name)
    if not value:
        raise EnrichmentError(f"credential reference {ref!r}: {name} is not set", retriable=False)
    return value


class HttpBatchReadClient:
    """Batch reads over HTTP for one callout profile.

        POST ``<endpoint><object_path_map[kind]>`` with ``{"namespace", "ids"}``;
        ``"fields"`` lists the profile's projection fields when it declares any;
    the answer is ``{"records": {id: {field: value}}}``. The credential (if
        any) goes as a bearer token. ``deadline`` bounds each call (the flow
        deadline also bounds every post-claim batch read, as in the seed).
    """

    def __init__(
        self,
        profile: CalloutProfile,
        client: httpx.Client,
        *,
        deadline: timedelta | None,
        env: Mapping[str, str] = os.environ,
    ) -> None:
        self.profile = profile
        self.client = client
        self.deadline = deadline
        self.headers = (
            {"Authorization": f"Bearer {resolve_credential(profile.credential_ref, env)}"}
            if profile.credential_ref
            else {}
        )

    def batch_read(
        self,
        namespace: str,
        object_kind: str,
        source_ids: Sequence[str],
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Read ``source_ids``; kinds the profile does not map are not read (``{}``).

        ``idempotency_key`` goes as the ``Idempotency-Key`` header when given.
        Raises ``EnrichmentError``: 429/5xx/timeouts/transport errors are
        retriable, other statuses and malformed answers are not.
        """
        path = self.profile.object_path_map.get(object_kind)
        if path is None or not source_ids:
            return {}
        url = self.profile.endpoint.rstrip("/") + "/" + path.lstrip("/")
        timeout = self.deadline.total_seconds() if self.deadline else None
        body: dict[str, Any] = {"namespace": namespace, "ids": list(source_ids)}
        if self.profile.projection_fields:
            body["fields"] = list(self.profile.projection_fields)
        headers = dict(self.headers)
        if idempotency_key:
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        start = time.monotonic()
        try:
            # Streamed so the deadline bounds the whole read, not each socket
            # operation: a server trickling bytes would otherwise pin the lane.
            with self.client.stream(
                "POST", url, json=body, headers=headers, timeout=timeout
            ) as response:
                chunks = []
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    if timeout is not None and time.monotonic() - start > timeout:
                        raise EnrichmentError(
                            f"batch read {url} timed out (flow deadline {timeout:g} s)",
                            retriable=True,
                        )
                status, content = response.status_code, b"".join(chunks)
        except httpx.TimeoutException as exc:
            raise EnrichmentError(f"batch read {url} timed out", retriable=True) from exc
        except httpx.TransportError as exc:
            raise EnrichmentError(f"batch read {url}: {exc}", retriable=True) from exc
        if status >= 300:
            raise EnrichmentError(
                f"batch read {url} answered {status}",
                retriable=status == 429 or status >= 500,
            )
        try:
            records = json.loads(content)["records"]
            if not isinstance(records, dict):
                raise TypeError("records is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise EnrichmentError(
                f"batch read {url}: malformed answer ({exc})", retriable=False
            ) from exc
        return {str(k): dict(v) for k, v in records.items() if isinstance(v, dict)}


class PackInactiveError(EnrichmentError):
    """A drain-only incarnation is no longer installed: skip it (``ErrConnectorPackInactive``).

    ``retriable``: False when a pool is built (the pool is skipped); True for
    a runtime read (the item waits; a removal fails it ``pack-removed``).
    """

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message, retriable=retriable)


@dataclass(frozen=True)
class DrainOnlyContext:
    """Credentials resolved for a drain-only incarnation (``WithDrainOnlyInstalledPack``).

    ``still_installed()`` re-reads the incarnation: a pack that is no longer
    installed gets no credential (:class:`PackInactiveError`), so a removed
    pack's secrets are never used to drain it.
    """

    namespace: str
    install_id: str
    still_installed: Callable[[], bool]


def resolve_credential_for(
    ref: str, env: Mapping[str, str] = os.environ, drain_only: DrainOnlyContext | None = None
) -> str:
    """:func:`resolve_credential`, in a drain-only context when ``drain_only`` is given.

    Raises :class:`PackInactiveError` (drain-only pack gone) or
    ``EnrichmentError`` (variable unset).
    """
    if drain_only is not None and not drain_only.still_installed():
        raise PackInactiveError(
            f"connector pack {drain_only.namespace} ({drain_only.install_id}) is inactive: "
            f"credential {ref!r} is not resolved for it"
        )
    return resolve_credential(ref, env)


@dataclass(frozen=True)
class BatchPlan:
    """How a pack enriches: port of the seed's ``buildBatchClient`` decisions.

    ``coverage`` maps each object kind read to the one profile that reads it
    (empty: payload-only). ``degraded`` is the warning when duplicate coverage
    forced payload-only; ``required`` are the contract's required kinds.
    """

    coverage: dict[str, CalloutProfile] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    degraded: str = ""

    @property
    def profiles(self) -> list[CalloutProfile]:
        """Distinct profiles used, in first-use order."""
        out: list[CalloutProfile] = []
        for p in self.coverage.values():
            if p not in out:
                out.append(p)
        return out

    @property
    def projection_fields(self) -> tuple[str, ...]:
        """Sorted union of the used profiles' projection fields."""
        return tuple(sorted({f for p in self.profiles for f in p.projection_fields}))


def _required_kinds(profiles: Sequence[CalloutProfile]) -> tuple[str, ...]:
    return tuple(sorted({k.strip() for p in profiles for k in p.required_object_kinds if k}))


def plan_batch(profiles: Sequence[CalloutProfile], label: str = "") -> BatchPlan:
    """Decide a pack's enrichment from its profiles (the startup contract).

    * required kinds declared: each must be covered by some profile's
      ``object_path_map``, else ``EnrichmentError`` (not retriable) ``...
      startup contract requires batch coverage for <kinds>``; only required
      kinds are read (``filterProfilesForRequiredObjectKinds``);
    * no required kinds and two profiles cover one kind: payload-only, with
      ``degraded`` naming the kind and profiles (logged by the caller);
    * no profile with an object path map: payload-only, silently.
    ``label`` (``namespace (install id)``) prefixes error messages.
    """
    required = _required_kinds(profiles)
    coverage: dict[str, CalloutProfile] = {}
    duplicates: dict[str, list[str]] = {}
    for profile in profiles:
        for kind in profile.object_path_map:
            kind = kind.strip()
            if required and kind not in required:
                continue
            if kind in coverage:
                duplicates.setdefault(kind, [coverage[kind].name]).append(profile.name)
                continue
            coverage[kind] = profile
    where = f" for {label}" if label else ""
    if required:
        missing = [k for k in required if k not in coverage]
        if missing:
            raise EnrichmentError(
                f"connector inbound startup contract{where} requires batch coverage for "
                f"{', '.join(missing)}",
                retriable=False,
            )
        return BatchPlan(coverage, required)
    if duplicates:
        detail = "; ".join(f"{k} by {', '.join(v)}" for k, v in sorted(duplicates.items()))
        return BatchPlan(
            {},
            (),
            f"duplicate batch object coverage{where} ({detail}); degraded to payload-only",
        )
    return BatchPlan(coverage)


def validate_batch_credentials(
    plan: BatchPlan,
    env: Mapping[str, str] = os.environ,
    drain_only: DrainOnlyContext | None = None,
) -> None:
    """Port of ``validateBatchCredentials``: every used profile's credential resolves.

    Raises ``EnrichmentError`` naming the reference and variable, or
    :class:`PackInactiveError` for a drain-only pack that is gone.
    """
    for profile in plan.profiles:
        if profile.credential_ref:
            resolve_credential_for(profile.credential_ref, env, drain_only)


class RoutedBatchReadClient:
    """One HTTP client per covering profile, chosen by object kind."""

    def __init__(self, by_kind: Mapping[str, BatchReadClient]) -> None:
        self.by_kind = dict(by_kind)

    def batch_read(
        self,
        namespace: str,
        object_kind: str,
        source_ids: Sequence[str],
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Read through the profile covering ``object_kind``; ``{}`` for an uncovered kind."""
        client = self.by_kind.get(object_kind)
        if client is None:
            return {}
        return client.batch_read(
            namespace, object_kind, source_ids, idempotency_key=idempotency_key
        )


def client_for_profiles(
    profiles: Sequence[CalloutProfile],
    client: httpx.Client,
    *,
    deadline: timedelta | None,
    env: Mapping[str, str] = os.environ,
    drain_only: DrainOnlyContext | None = None,
) -> BatchReadClient:
    """The batch-read client of a pack, following :func:`plan_batch`.

    Payload-only (``NoopBatchReadClient``) when no profile covers a kind or
    coverage is duplicated; otherwise one HTTP client per covering profile,
    each call bounded by ``deadline`` (the flow deadline). Credentials are
    resolved here, when the pool is built (``EnrichmentError`` if missing);
    raises ``EnrichmentError`` when required coverage is missing.
    """
    plan = plan_batch(profiles)
    if not plan.coverage:
        if plan.degraded:
            log.warning("connector batch enrichment degraded", reason=plan.degraded)
        return NoopBatchReadClient()
    made: dict[str, HttpBatchReadClient] = {}
    by_kind: dict[str, BatchReadClient] = {}
    for kind, profile in plan.coverage.items():
        if profile.name not in made:
            if profile.credential_ref:
                resolve_credential_for(profile.credential_ref, env, drain_only)
            made[profile.name] = HttpBatchReadClient(profile, client, deadline=deadline, env=env)
        by_kind[kind] = made[profile.name]
    return RoutedBatchReadClient(by_kind)


class DrainOnlyBatchReadClient:
    """Batch reads of a drain-only incarnation, each in its drain-only context.

    Port of the seed's ``drainOnlyBatchReadClient``
    (``namedcredential.WithDrainOnlyInstalledPack`` around every
    ``BatchRead``): before each read the incarnation must still be installed
    (``context.still_installed()``), else :class:`PackInactiveError`
    (retriable: the removal sweep fails the item ``pack-removed``) and nothing
    is sent, so a removed pack's credential is never used to drain it.
    """

    def __init__(self, inner: BatchReadClient, context: DrainOnlyContext) -> None:
        self.inner = inner
        self.context = context

    def batch_read(
        self,
        namespace: str,
        object_kind: str,
        source_ids: Sequence[str],
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """``inner.batch_read`` while the incarnation is installed; raises ``PackInactiveError``."""
        if not self.context.still_installed():
            raise PackInactiveError(
                f"connector pack {self.context.namespace} ({self.context.install_id}) is "
                f"inactive: no batch read of {object_kind} for it",
                retriable=True,
            )
        return self.inner.batch_read(
            namespace, object_kind, source_ids, idempotency_key=idempotency_key
        )


def pack_batch_client(
    row: ConnectorPackRow,
    client: httpx.Client,
    *,
    deadline: timedelta | None,
    selection: RuntimeServingSelection | None = None,
    still_installed: Callable[[], bool] | None = None,
    env: Mapping[str, str] = os.environ,
) -> BatchReadClient:
    """The runtime batch-read client of one pack incarnation (the seed's ``buildBatchClient``).

    Built from exactly the profiles admission checked
    (:func:`~nexuscrm.connectors.serving.selected_profiles`: under a serving
    selection only the selected profiles, with only their authorized
    credentials; otherwise every profile of the incarnation's own payload).
    A drain-only incarnation's credentials are resolved in its drain-only
    context and every read is wrapped in :class:`DrainOnlyBatchReadClient`
    (``still_installed`` re-reads the incarnation; required for a drain-only
    ``row``). Raises ``EnrichmentError``: a selection that no longer admits
    the pack (retriable: the fleet stops that pool), a missing credential or
    required coverage (not retriable), :class:`PackInactiveError`.
    """
    try:
        profiles = selected_profiles(row, selection)
    except ServingSelectionError as exc:
        raise EnrichmentError(str(exc), retriable=True) from exc
    drain_only = None
    if row.drain_only:
        if still_installed is None:
            raise ValueError(
                f"drain-only pack {row.namespace} ({row.install_id}) needs still_installed"
            )
        drain_only = DrainOnlyContext(row.namespace, row.install_id, still_installed)
    inner = client_for_profiles(profiles, client, deadline=deadline, env=env, drain_only=drain_only)
    if drain_only is None or isinstance(inner, NoopBatchReadClient):
        return inner
    return DrainOnlyBatchReadClient(inner, drain_only)
