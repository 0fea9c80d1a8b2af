"""Runtime serving selection: the exact connector-pack generations a supervisor may serve.

Port of the seed's ``RuntimeServingPack`` / ``RuntimeServingInboundRoute`` /
``RuntimeServingCalloutProfile`` / ``RuntimeServingSelection`` types,
``normalizeRuntimeServingPacks``, ``runtimeServingRouteCoordinates`` and the
checks inside ``runtimeServingPackLister`` and ``runtimeServingProfileLoader``
(seed ``000_20f34d33fdfcfdd6.txt``).

The selection is frozen before process start (the deploy pipeline writes it to
a JSON or YAML file, :func:`load`); it is deliberately not a live metadata
watcher. The supervisor resolves only these exact identities and never
enumerates the global installed-pack or callout-profile inventory. The seed's
``RouteResolver`` member is not part of this model: route verification
(``verifyRuntimeServingRoutes``) is done by the supervisor against
:meth:`RuntimeServingSelection.route_coordinates`.

File shape (JSON, or the same in YAML)::

    {"packs": [{"namespace": "acme", "installed_pack_id": "0Ap1",
                "payload_digest": "<the pack's PayloadHash: 64 hex digits>",
                "inbound_routes": [{"event_kind": "account.upsert", "route_version": 3}],
                "callout_profiles": [{"name": "crm", "credential_refs": ["cred-a"]}]}]}

Every seed error keeps its wording (prefix ``connector inbound supervisor: ``)
and is raised as :class:`ServingSelectionError`, never wrapped in pydantic's
``ValidationError`` (pydantic lets non-``ValueError`` exceptions from
validators propagate unchanged). Shape errors (missing field, wrong type,
unknown key) are pydantic ``ValidationError``s when constructing models
directly, and :class:`ServingSelectionError`s naming the file from :func:`load`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nexuscrm.connectors.knobs import go_trim_space, worker_key
from nexuscrm.connectors.routes import ConnectorPackRow
from nexuscrm.errors import FatalError
from nexuscrm.inputs import InputLimitError, kind_of, load_document
from nexuscrm.packs.model import CalloutProfile

_PREFIX = "connector inbound supervisor: "
_MAX_ROUTE_VERSION = 2**63 - 1  # the seed's math.MaxInt64 bound on a uint64 version


class ServingSelectionError(FatalError):
    """The Runtime serving selection is malformed, or a pack/profile falls outside it.

    Raised with the seed's wording. ``path`` is the selection file when the
    error came from :func:`load` (and the message then starts with it).
    """

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class RuntimeServingInboundRoute(BaseModel):
    """One exact Catalog-selected route coordinate (seed ``RuntimeServingInboundRoute``).

    After normalization ``event_kind`` is trimmed and lower-cased and
    ``route_version`` is in ``1..2**63-1``. The invocation mode stays with the
    retained route definition and is checked when routes are verified.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_kind: str
    route_version: int = Field(strict=True)


class RuntimeServingCalloutProfile(BaseModel):
    """One exact callout profile and the credential refs its Catalog binding authorizes.

    Seed ``RuntimeServingCalloutProfile``. After normalization ``name`` is
    trimmed and lower-cased and ``credential_refs`` are trimmed, unique and
    sorted. Credential values never enter the selection, only their refs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    credential_refs: list[str] = Field(default_factory=list)


class RuntimeServingPack(BaseModel):
    """One immutable connector-pack generation selected for serving (seed ``RuntimeServingPack``).

    ``inbound_routes`` is the complete route inventory of this exact generation
    (a partial inventory is not serving authority). A pack is normalized only
    as part of a :class:`RuntimeServingSelection`; on its own it holds the
    values as given.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str
    installed_pack_id: str
    payload_digest: str
    inbound_routes: list[RuntimeServingInboundRoute] = Field(default_factory=list)
    callout_profiles: list[RuntimeServingCalloutProfile] = Field(default_factory=list)

    @property
    def worker_key(self) -> str:
        """``<namespace>/<installed pack id>``, the key the supervisor runs it under."""
        return worker_key(self.namespace, self.installed_pack_id)


@dataclass(frozen=True)
class RouteCoordinate:
    """One route the supervisor must verify at start (seed ``runtimeServingRouteCoordinate``)."""

    namespace: str
    installed_pack_id: str
    event_kind: str
    route_version: int


def _fail(message: str) -> ServingSelectionError:
    return ServingSelectionError(_PREFIX + message)


def normalize_runtime_serving_packs(
    values: Iterable[RuntimeServingPack],
) -> list[RuntimeServingPack]:
    """Trim, lower-case, check and sort selected packs; port of ``normalizeRuntimeServingPacks``.

    Per pack, in the seed's order: namespace / installed pack id / payload
    digest trimmed and all non-blank; no duplicate worker key; every route has
    a non-blank (trimmed, lower-cased) event kind and a version in
    ``1..2**63-1``; no duplicate event kind; at least one route; routes sorted
    by event kind; every profile name non-blank (trimmed, lower-cased) and
    unique; every credential ref non-blank (trimmed) and unique within its
    profile; refs sorted; profiles sorted by name. Packs are then sorted by
    worker key. Returns new model instances.

    Raises :class:`ServingSelectionError` with the seed's message at the first
    violation.
    """
    result: list[RuntimeServingPack] = []
    seen_packs: set[str] = set()
    for raw in values:
        namespace = go_trim_space(raw.namespace)
        installed_pack_id = go_trim_space(raw.installed_pack_id)
        payload_digest = go_trim_space(raw.payload_digest)
        if namespace == "" or installed_pack_id == "" or payload_digest == "":
            raise _fail("Runtime serving pack identity is incomplete")
        key = worker_key(namespace, installed_pack_id)
        if key in seen_packs:
            raise _fail(f"duplicate Runtime serving pack {namespace} ({installed_pack_id})")
        seen_packs.add(key)

        routes: list[RuntimeServingInboundRoute] = []
        seen_routes: set[str] = set()
        for raw_route in raw.inbound_routes:
            event_kind = go_trim_space(raw_route.event_kind).lower()
            version = raw_route.route_version
            if event_kind == "" or version <= 0 or version > _MAX_ROUTE_VERSION:
                raise _fail(
                    f"Runtime serving pack {namespace} has an invalid inbound route coordinate"
                )
            if event_kind in seen_routes:
                raise _fail(
                    f"Runtime serving pack {namespace} has duplicate inbound route {event_kind}"
                )
            seen_routes.add(event_kind)
            routes.append(RuntimeServingInboundRoute(event_kind=event_kind, route_version=version))
        if not routes:
            raise _fail(f"Runtime serving pack {namespace} has no selected inbound routes")
        routes.sort(key=lambda route: route.event_kind)

        profiles: list[RuntimeServingCalloutProfile] = []
        seen_profiles: set[str] = set()
        for raw_profile in raw.callout_profiles:
            name = go_trim_space(raw_profile.name).lower()
            if name == "":
                raise _fail(f"Runtime serving pack {namespace} has a blank callout profile")
            if name in seen_profiles:
                raise _fail(
                    f"Runtime serving pack {namespace} has duplicate callout profile {name}"
                )
            seen_profiles.add(name)
            refs: list[str] = []
            seen_refs: set[str] = set()
            for raw_ref in raw_profile.credential_refs:
                ref = go_trim_space(raw_ref)
                if ref == "":
                    raise _fail(
                        f"Runtime serving profile {namespace}/{name} has a blank "
                        "credential reference"
                    )
                if ref in seen_refs:
                    raise _fail(
                        f"Runtime serving profile {namespace}/{name} has duplicate "
                        f"credential reference {ref}"
                    )
                seen_refs.add(ref)
                refs.append(ref)
            refs.sort()
            profiles.append(RuntimeServingCalloutProfile(name=name, credential_refs=refs))
        profiles.sort(key=lambda profile: profile.name)

        result.append(
            RuntimeServingPack(
                namespace=namespace,
                installed_pack_id=installed_pack_id,
                payload_digest=payload_digest,
                inbound_routes=routes,
                callout_profiles=profiles,
            )
        )
    result.sort(key=lambda pack: pack.worker_key)
    return result


class RuntimeServingSelection(BaseModel):
    """The frozen set of pack generations one supervisor serves (seed ``RuntimeServingSelection``).

    Constructing it (directly, via ``model_validate`` or :func:`load`) runs
    :func:`normalize_runtime_serving_packs` on ``packs``, so an instance is
    always normalized; seed errors surface as :class:`ServingSelectionError`.
    An empty selection is allowed here (as in the seed's normalizer); the
    supervisor's route verification must refuse it ("route authority is
    unavailable").
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    packs: list[RuntimeServingPack] = Field(default_factory=list)

    @field_validator("packs", mode="after")
    @classmethod
    def _normalize_packs(cls, packs: list[RuntimeServingPack]) -> list[RuntimeServingPack]:
        # ServingSelectionError is not a ValueError, so pydantic re-raises it
        # as is: the seed's message is what the caller sees.
        return normalize_runtime_serving_packs(packs)

    @classmethod
    def load(cls, path: str | Path) -> RuntimeServingSelection:
        """Read a frozen selection file; see :func:`load`."""
        return load(path)

    def find_pack(self, namespace: str, install_id: str) -> RuntimeServingPack | None:
        """The selected pack with this worker key (inputs trimmed), or ``None``."""
        key = worker_key(namespace, install_id)
        for pack in self.packs:
            if pack.worker_key == key:
                return pack
        return None

    def worker_keys(self) -> list[str]:
        """Worker keys of the selected packs, sorted (the supervisor's desired set)."""
        return [pack.worker_key for pack in self.packs]

    def route_coordinates(self) -> list[RouteCoordinate]:
        """Every selected route as a coordinate; port of ``runtimeServingRouteCoordinates``.

        Packs in worker-key order, routes in event-kind order.
        """
        return [
            RouteCoordinate(
                namespace=pack.namespace,
                installed_pack_id=pack.installed_pack_id,
                event_kind=route.event_kind,
                route_version=route.route_version,
            )
            for pack in self.packs
            for route in pack.inbound_routes
        ]

    def check_pack_row(
        self, namespace: str, install_id: str, found: bool, payload_hash: str
    ) -> None:
        """Admit the active pack row found for a selected pack (``runtimeServingPackLister``).

        ``found``/``payload_hash`` are what the active-ready-generation lookup
        returned for ``(namespace, install_id)``. Raises
        :class:`ServingSelectionError`:

        * ``... pack is outside Runtime serving selection`` if the pack is not
          selected (the seed only looks up selected packs);
        * ``selected Runtime serving pack <ns> (<id>) is not an active ready
          generation`` if not found;
        * ``selected Runtime serving pack <ns> (<id>) payload digest does not
          match`` if ``payload_hash`` differs (exact comparison, as in the seed).
        """
        selected = self.find_pack(namespace, install_id)
        if selected is None:
            raise _fail("pack is outside Runtime serving selection")
        if not found:
            raise _fail(
                f"selected Runtime serving pack {selected.namespace} "
                f"({selected.installed_pack_id}) is not an active ready generation"
            )
        if payload_hash != selected.payload_digest:
            raise _fail(
                f"selected Runtime serving pack {selected.namespace} "
                f"({selected.installed_pack_id}) payload digest does not match "
                f"(selected {selected.payload_digest}, installed {payload_hash})"
            )

    def check_profile_credentials(
        self,
        namespace: str,
        install_id: str,
        profile_name: str,
        credential_refs_of_profile: Sequence[str],
    ) -> None:
        """Check a loaded profile's credential refs (``runtimeServingProfileLoader``).

        ``credential_refs_of_profile`` are the refs the loaded profile uses
        (its own and its batch spec's); blanks are skipped as in
        ``runtimeServingProfileCredentialRefs``. Raises :class:`ServingSelectionError`:

        * ``pack is outside Runtime serving selection`` if the pack is not selected;
        * ``Runtime serving profile <ns>/<name> is outside Runtime serving
          selection`` if the profile is not selected for it (not a seed
          message: the seed only ever loads selected profiles);
        * ``Runtime serving profile <ns>/<name> credential is not authorized by
          its selection`` if any ref is not among the selected refs.
        """
        selected = self.find_pack(namespace, install_id)
        if selected is None:
            raise _fail("pack is outside Runtime serving selection")
        name = go_trim_space(profile_name).lower()
        profile = next((p for p in selected.callout_profiles if p.name == name), None)
        if profile is None:
            raise _fail(
                f"Runtime serving profile {namespace}/{name} is outside Runtime serving selection"
            )
        authorized = set(profile.credential_refs)
        for raw_ref in credential_refs_of_profile:
            ref = go_trim_space(raw_ref)
            if ref and ref not in authorized:
                raise _fail(
                    f"Runtime serving profile {namespace}/{profile.name} credential is not "
                    "authorized by its selection"
                )

    @staticmethod
    def refuse_drain_only(drain_only: bool = True) -> None:
        """See the module function :func:`refuse_drain_only`."""
        refuse_drain_only(drain_only)


def require_route_authority(selection: RuntimeServingSelection) -> None:
    """Refuse a selection that selects no route (the start check of ``verifyRuntimeServingRoutes``).

    Raises :class:`ServingSelectionError` ``connector inbound supervisor:
    Runtime serving route authority is unavailable`` when ``selection`` has no
    route coordinate (an empty selection): the runtime must not start serving
    nothing, silently.
    """
    if not selection.route_coordinates():
        raise _fail("Runtime serving route authority is unavailable")


def selected_profiles(
    row: ConnectorPackRow, selection: RuntimeServingSelection | None
) -> list[CalloutProfile]:
    """The callout profiles a pool of ``row`` may use; port of ``runtimeServingProfileLoader``.

    Without a selection: every profile of the installed payload. Under one: a
    drain-only generation is refused, and exactly the selected profiles are
    loaded, each of whose credential references must be authorized by the
    selection (so only selected credentials are ever resolved). Both the
    admission (reconcile) and the runtime batch reads (the processor's batch
    clients) take their profiles from here. Raises
    :class:`ServingSelectionError` naming pack and profile.
    """
    if selection is None:
        return list(row.pack.callout_profiles)
    refuse_drain_only(row.drain_only)
    selected = selection.find_pack(row.namespace, row.install_id)
    if selected is None:
        raise _fail("pack is outside Runtime serving selection")
    by_name = {p.name.strip().lower(): p for p in row.pack.callout_profiles}
    out = []
    for sel in selected.callout_profiles:
        profile = by_name.get(sel.name)
        if profile is None:
            raise ServingSelectionError(
                f"load exact Runtime serving profile {row.namespace}/{sel.name}: "
                "not in the installed payload"
            )
        selection.check_profile_credentials(
            row.namespace, row.install_id, sel.name, [profile.credential_ref or ""]
        )
        out.append(profile)
    return out


def refuse_drain_only(drain_only: bool = True) -> None:
    """Refuse a drain-only generation under a serving selection (``runtimeServingProfileLoader``).

    Raises :class:`ServingSelectionError` ``Runtime serving selection cannot
    start a drain-only generation`` when ``drain_only`` (the default, so a bare
    call always raises); returns otherwise.
    """
    if drain_only:
        raise _fail("Runtime serving selection cannot start a drain-only generation")


def _format_validation_error(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "<root>"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


MAX_SELECTION_BYTES = 4 * 1024 * 1024
"""Largest serving selection file read (4 MiB)."""


def load(path: str | Path) -> RuntimeServingSelection:
    """Read and normalize a frozen selection file (``.json``, ``.yaml`` or ``.yml``).

    The document must be a mapping with a ``packs`` list (shape in the module
    docstring); unknown keys are refused. Every failure is a
    :class:`ServingSelectionError` whose message starts with
    ``Runtime serving selection file <path>: `` and whose ``path`` is set:
    unreadable file, unsupported suffix, larger than
    :data:`MAX_SELECTION_BYTES` (at most that much is read), not UTF-8,
    JSON/YAML syntax error, nested deeper than
    :data:`~nexuscrm.inputs.MAX_JSON_DEPTH` levels, wrong shape
    (field paths listed) or any seed normalization error (seed message kept
    after the prefix).
    """
    file = Path(path)
    where = f"Runtime serving selection file {file}: "
    suffix = file.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ServingSelectionError(
            f"{where}unsupported file type {file.suffix!r} (expected .json, .yaml or .yml)",
            file,
        )
    document: Any
    try:
        document = load_document(file, MAX_SELECTION_BYTES)
    except OSError as exc:
        raise ServingSelectionError(f"{where}cannot read: {exc.strerror or exc}", file) from None
    except InputLimitError as exc:
        raise ServingSelectionError(f"{where}{exc}", file) from None
    if not isinstance(document, dict):
        raise ServingSelectionError(
            f"{where}expected a mapping with a 'packs' list, got {kind_of(document)}",
            file,
        )
    try:
        return RuntimeServingSelection.model_validate(document)
    except ValidationError as exc:
        raise ServingSelectionError(f"{where}{_format_validation_error(exc)}", file) from exc
    except ServingSelectionError as exc:
        raise ServingSelectionError(f"{where}{exc}", file) from exc


__all__ = [
    "RouteCoordinate",
    "RuntimeServingCalloutProfile",
    "RuntimeServingInboundRoute",
    "RuntimeServingPack",
    "RuntimeServingSelection",
    "ServingSelectionError",
    "load",
    "normalize_runtime_serving_packs",
    "refuse_drain_only",
    "require_route_authority",
    "selected_profiles",
]
