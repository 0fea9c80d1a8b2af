"""Contracts of identity-convergence waits: dependencies, blocked items, probes.

Plain dataclasses carried by Temporal's JSON payload converter: class, field
names and field order are the wire format of running workflows' histories.

No ``from __future__ import annotations``: the annotations must be real
types, not strings. Workflows decode these inside Temporal's sandbox, whose
``sys.modules`` lacks this module (``nexuscrm.contracts`` is passed through),
so string annotations could not be resolved there (``NameError`` while
decoding arguments).
"""

from dataclasses import dataclass, field


@dataclass
class DependencySpec:
    """What a blocked item waits on (``nexuscrm.connectors.identity.Dependency`` as data)."""

    kind: str
    object_api_name: str
    record_id: str = ""
    owner_key: str = ""
    namespace: str = ""
    remote_id: str = ""


@dataclass
class BlockedWait:
    """An item a batch blocked: its id, dependency and the dependency's key hash."""

    work_id: str
    key_hash: str
    dependency: DependencySpec


@dataclass
class IdentityWaitConfig:
    """Durations of an identity-convergence wait (seconds; settings, tests shorten them).

    probe_interval_seconds: first delay between probes, doubling up to
    max_probe_interval_seconds; probe_timeout_seconds bounds one probe;
    max_wait_seconds: an item still unresolved (by a fresh probe) this long
    after its own ``DependencyBlockedAt`` fails ``identity-convergence-expired``
    (``<= 0`` disables expiry); liveness_grace_seconds: how far past its next
    probe the wait marks its rows alive (recovery restarts waits of older marks).
    """

    probe_interval_seconds: float = 5.0
    max_probe_interval_seconds: float = 60.0
    probe_timeout_seconds: float = 5.0
    max_wait_seconds: float = 1800.0
    liveness_grace_seconds: float = 60.0
    probes_before_continue_as_new: int = 500
    search_attributes: bool = True  # off only on a server without them (the test server)


@dataclass
class IdentityWaitInput:
    """IdentityWaitWorkflow input (and its continue-as-new state)."""

    database_id: str
    key_hash: str
    dependency: DependencySpec
    config: IdentityWaitConfig = field(default_factory=IdentityWaitConfig)
    work_ids: list[str] = field(default_factory=list)
    started_at: str = ""
    probes: int = 0


@dataclass
class WaitNotifyRequest:
    """identity.notify input: waits to register (signal-with-start) and to wake."""

    database_id: str
    blocked: list[BlockedWait] = field(default_factory=list)
    wake_keys: list[str] = field(default_factory=list)


@dataclass
class WaitItem:
    """A blocked item of a wait: id, pack, blocked-at (ISO-8601, naive UTC)."""

    work_id: str
    installed_pack_id: str
    blocked_at: str


@dataclass
class ProbeRequest:
    """identity.probe input: the wait's key, dependency, registered items and liveness mark."""

    key_hash: str
    dependency: DependencySpec
    work_ids: list[str]
    alive_until: str
    timeout_seconds: float = 5.0


@dataclass
class ProbeResult:
    """A probe: converged or not, the items still blocked, invalid ones terminalized."""

    converged: bool
    items: list[WaitItem] = field(default_factory=list)
    invalid: int = 0


@dataclass
class ExpireRequest:
    """identity.expire input: due items of the wait, and the wait's now (ISO-8601 UTC)."""

    key_hash: str
    work_ids: list[str]
    now: str


@dataclass
class WakeResult:
    """identity.wake output: items woken and the packs that own them."""

    woken: int = 0
    install_ids: list[str] = field(default_factory=list)


@dataclass
class IdentityWaitStatus:
    """``status`` query of an identity wait."""

    key_hash: str
    kind: str
    object_api_name: str
    state: str
    items: list[str]
    probes: int
    next_probe: str | None
    started_at: str
    woken: int | None = None
