"""Process settings (pydantic-settings), read from ``NEXUS_*`` environment variables.

The connector runtime's ``NEXUSCRM_CONNECTOR_*`` knobs live in
``nexuscrm.connectors.knobs`` because the seed gives them their own clamps.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from nexuscrm.contracts.controlplane_queue import MAX_QUEUE_WAIT_SECONDS

_SLUG_RE = re.compile(r"[^a-z0-9]+")
KNOWN_ENVS = frozenset({"development", "dev", "test", "staging", "production", "prod"})


@dataclass(frozen=True)
class NumericRange:
    """The accepted values of one numeric setting: finite, ``low`` to ``high``.

    ``low_open``: ``low`` itself is refused (the value must be above it).
    ``unit`` is printed after the bounds (``seconds``, ``probes per second``).
    """

    env: str
    low: float
    high: float
    unit: str
    low_open: bool = False

    def describe(self) -> str:
        """``from 0 to 3,600 seconds`` / ``above 0, at most 86,400 seconds``."""
        if self.low_open:
            return f"above {self.low:,g} and at most {self.high:,g} {self.unit}"
        return f"from {self.low:,g} to {self.high:,g} {self.unit}"


NUMERIC_RANGES: dict[str, NumericRange] = {
    "identity_probes_per_second": NumericRange(
        "NEXUS_IDENTITY_PROBES_PER_SECOND", 0, 10_000, "probes per second", low_open=True
    ),
    "worker_shutdown_seconds": NumericRange("NEXUS_WORKER_SHUTDOWN_SECONDS", 0, 3600, "seconds"),
    "sticky_queue_timeout_seconds": NumericRange(
        "NEXUS_STICKY_QUEUE_TIMEOUT_SECONDS", 1, 60, "seconds"
    ),
    "connector_pack_allowance": NumericRange("NEXUS_CONNECTOR_PACK_ALLOWANCE", 1, 1000, "packs"),
    "connector_max_activity_slots": NumericRange(
        "NEXUS_CONNECTOR_MAX_ACTIVITY_SLOTS", 1, 10_000, "slots"
    ),
    "connector_stint_seconds": NumericRange("NEXUS_CONNECTOR_STINT_SECONDS", 0, 60, "seconds"),
    "final_verify_timeout_seconds": NumericRange(
        "NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS", 0, 86_400, "seconds", low_open=True
    ),
    "controlplane_queue_wait_seconds": NumericRange(
        "NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS",
        0,
        MAX_QUEUE_WAIT_SECONDS,
        "seconds",
        low_open=True,
    ),
}
"""Every numeric ``NEXUS_*`` setting (by field name) and its accepted range.

Values outside (or NaN, infinite) are refused when the settings load, each
named with its environment variable and value; the README's Settings table
gives the same ranges."""


def numeric_setting_problem(field: str, value: float) -> str | None:
    """Why ``value`` is not usable for the numeric setting ``field`` (``None``: it is).

    ``field`` is a key of :data:`NUMERIC_RANGES`; the message names the
    environment variable and the value, e.g. ``NEXUS_WORKER_SHUTDOWN_SECONDS
    1e+300 must be a finite number from 0 to 3,600 seconds``.
    """
    rng = NUMERIC_RANGES[field]
    above_low = value > rng.low if rng.low_open else value >= rng.low
    if math.isfinite(value) and above_low and value <= rng.high:
        return None
    return f"{rng.env} {value!r} must be a finite number {rng.describe()}"


def default_database_url() -> str:
    """SQLite file under ``./.nexus/`` so a new user needs no database server."""
    return f"sqlite:///{Path('.nexus') / 'nexus.db'}"


def database_id_for_url(url: str) -> str:
    """Stable, readable slug for a database URL (no password in it).

    Shape: ``<backend>-<host-or-file>-<db>-<6 hex>``, e.g.
    ``mysql-127-0-0-1-nexus-3f9a1c``. The hash covers host, port, database and
    the resolved SQLite path so two databases never share an id.
    """
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        path = str(Path(u.database or ":memory:").resolve()) if u.database else ":memory:"
        name = Path(path).stem
        key = f"sqlite:{path}"
        parts = [backend, name]
    else:
        # The default port spelled or not is the same database (one workflow id).
        key = f"{backend}:{u.host}:{u.port or 3306}:{u.database}"
        parts = [backend, u.host or "local", u.database or ""]
    slug = _SLUG_RE.sub("-", "-".join(p for p in parts if p).lower()).strip("-")
    digest = hashlib.sha256(key.encode()).hexdigest()[:6]
    return f"{slug[:48]}-{digest}"


class Settings(BaseSettings):
    """All ``NEXUS_*`` settings.

    Fields (env var in brackets):
      database_url [NEXUS_DATABASE_URL]: SQLAlchemy URL; SQLite default.
      database_id [NEXUS_DATABASE_ID]: slug naming the database in workflow ids.
      temporal_address [NEXUS_TEMPORAL_ADDRESS]: host:port of the frontend.
      temporal_namespace [NEXUS_TEMPORAL_NAMESPACE].
      controlplane_task_queue / connector_task_queue / identity_task_queue: task
        queue names; default ``nexus-controlplane/<database id>``,
        ``nexus-connectors/<database id>`` and ``nexus-identity/<database id>``
        (one database per worker, so never shared between databases).
      identity_probes_per_second [NEXUS_IDENTITY_PROBES_PER_SECOND]: the most
        identity-convergence probes the database's waits run per second, all
        workers together (the seed's 25 due rows per 5 s scan, by default 20/s);
        wakes are signals and never wait on it.
      env [NEXUS_ENV]: ``production``/``prod``/``staging`` skip the DevSample pack.
      serving_selection [NEXUS_SERVING_SELECTION]: path of a frozen serving selection.
      connector_role [NEXUS_CONNECTOR_ROLE]: ``local`` (run flows here, default) or
        ``handoff`` (write Runtime command rows for a separate runtime service;
        needs NEXUS_SERVING_SELECTION, see ``nexuscrm.connectors.handoff``).
      worker_shutdown_seconds [NEXUS_WORKER_SHUTDOWN_SECONDS]: the workers'
        ``graceful_shutdown_timeout``: after SIGTERM, activities in flight get
        this long to finish (a batch stops starting items and hands the rest
        back at once) before they are cancelled; default 30.
      sticky_queue_timeout_seconds [NEXUS_STICKY_QUEUE_TIMEOUT_SECONDS]: the
        workers' ``sticky_queue_schedule_to_start_timeout``: a workflow's next
        task waits this long for the worker that ran its last one (and holds
        its state in memory) before any worker may take it, replaying the
        history. After a worker is killed, its workflows resume this much
        later; default 10 (Temporal's own). Lower it for faster failover;
        a worker too loaded to poll within it loses its cached workflows
        and replays them.
      connector_pack_allowance [NEXUS_CONNECTOR_PACK_ALLOWANCE]: packs a
        connector worker is sized for at least (more if more are installed
        when it starts); default 4. See ``nexuscrm.connectors.sizing``.
      connector_max_activity_slots [NEXUS_CONNECTOR_MAX_ACTIVITY_SLOTS]: cap on
        a connector worker's inbound-worker slots of each kind; default 128.
      connector_stint_seconds [NEXUS_CONNECTOR_STINT_SECONDS]: how long one
        inbound worker's process activity keeps claiming and running further
        batches after the one it was given (each claim as the worker's own,
        under its fence; it stops at an empty claim, a superseded fence or
        shutdown); default 2. Each activity costs round trips to the server
        (about 100 ms a batch on a 2-core box), so one batch per activity caps
        a worker near 1,000 events/s. 0: one batch per activity. A worker's
        ``drain`` waits for the activity in hand, so up to this long.
      log_format [NEXUS_LOG_FORMAT]: ``auto`` (console on a TTY, else JSON), ``console``, ``json``.
      final_verify_command [NEXUS_FINAL_VERIFY_COMMAND]: ApplyAll's final-verify
        hook (the seed's ``ApplyAllFinalVerify``): a command line the worker runs
        after verify on every completing path and before an auto-start or
        exact-candidate skip; non-zero exit fails the run. Unset: no hook.
      final_verify_timeout_seconds [NEXUS_FINAL_VERIFY_TIMEOUT_SECONDS]: its bound; 600.
      controlplane_queue_wait_seconds [NEXUS_CONTROLPLANE_QUEUE_WAIT_SECONDS]:
        how long a control-plane request waits for its turn in the database's
        queue before it is dropped and its caller gets a timeout error (the
        seed's 600 s ``GET_LOCK`` wait); default 600.
      metrics_address [NEXUS_METRICS_ADDRESS]: ``<IP address>:<port>`` the
        worker process serves its Prometheus endpoint on
        (``http://<address>/metrics``: the Temporal SDK's metrics and the
        runtime's ``nexus_*``, see ``nexusctl.metrics``); unset or empty: none.
    """

    model_config = SettingsConfigDict(env_prefix="NEXUS_", extra="ignore")

    database_url: str = Field(default_factory=default_database_url)
    database_id_override: str | None = Field(default=None, alias="NEXUS_DATABASE_ID")
    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    # Empty: derived from the database id (see ``_task_queues``).
    controlplane_task_queue: str = ""
    connector_task_queue: str = ""
    identity_task_queue: str = ""
    identity_probes_per_second: float = 20.0
    worker_shutdown_seconds: float = 30.0
    sticky_queue_timeout_seconds: float = 10.0
    connector_pack_allowance: int = 4
    connector_max_activity_slots: int = 128
    connector_stint_seconds: float = 2.0
    env: str = "development"
    log_format: str = "auto"
    log_level: str = "INFO"
    # A RuntimeServingSelection file (JSON/YAML) frozen by the deploy pipeline.
    serving_selection: str | None = None
    connector_role: str = "local"
    final_verify_command: str | None = None
    final_verify_timeout_seconds: float = 600.0
    controlplane_queue_wait_seconds: float = 600.0
    metrics_address: str | None = None

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, v: str) -> str:
        if not v.strip():
            # Fail closed: an unset variable in a deploy script must not fall
            # back to a local SQLite file.
            raise ValueError(
                "NEXUS_DATABASE_URL is set but empty: give a URL such as "
                "mysql+pymysql://user:password@host:3306/db, or unset it for the "
                "SQLite default under .nexus/"
            )
        try:
            backend = make_url(v).get_backend_name()
        except Exception as exc:
            raise ValueError(f"NEXUS_DATABASE_URL is not a database URL: {exc}") from exc
        if backend not in {"sqlite", "mysql"}:
            raise ValueError(
                f"NEXUS_DATABASE_URL backend {backend!r} is not supported: use "
                "sqlite:///path/to/file.db or mysql+pymysql://user:password@host:3306/db"
            )
        return v

    @field_validator(*NUMERIC_RANGES)
    @classmethod
    def _in_range(cls, v: float, info: ValidationInfo) -> float:
        name = info.field_name or ""
        problem = numeric_setting_problem(name, v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("metrics_address")
    @classmethod
    def _metrics_address(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        return parse_metrics_address(v)

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, v: str) -> str:
        if v not in {"auto", "console", "json"}:
            raise ValueError(f"NEXUS_LOG_FORMAT {v!r} must be auto, console or json")
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        if v.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"NEXUS_LOG_LEVEL {v!r} must be DEBUG, INFO, WARNING or ERROR")
        return v.upper()

    @field_validator("connector_role")
    @classmethod
    def _connector_role(cls, v: str) -> str:
        role = v.strip().lower()
        if role not in {"local", "handoff"}:
            raise ValueError(
                f"NEXUS_CONNECTOR_ROLE {v!r} must be local (run connector flows in this "
                "process) or handoff (write Runtime command rows for the runtime service)"
            )
        return role

    @field_validator("env")
    @classmethod
    def _env(cls, v: str) -> str:
        # A typo in a production setting must not silently mean development.
        if v.strip().lower() not in KNOWN_ENVS:
            raise ValueError(f"NEXUS_ENV {v!r} must be one of {', '.join(sorted(KNOWN_ENVS))}")
        return v.strip().lower()

    @model_validator(mode="after")
    def _task_queues(self) -> Settings:
        # A worker is bound to one database, so its task queues must be too:
        # on a shared queue, another database's worker could run the activity.
        if not self.controlplane_task_queue:
            self.controlplane_task_queue = f"nexus-controlplane/{self.database_id}"
        if not self.connector_task_queue:
            self.connector_task_queue = f"nexus-connectors/{self.database_id}"
        if not self.identity_task_queue:
            self.identity_task_queue = f"nexus-identity/{self.database_id}"
        return self

    @cached_property
    def database_id(self) -> str:
        """The configured id, or one derived from ``database_url``."""
        if self.database_id_override:
            return _SLUG_RE.sub("-", self.database_id_override.lower()).strip("-")
        return database_id_for_url(self.database_url)

    @property
    def is_production(self) -> bool:
        """Port of the seed's ``isProduction``: NEXUS_ENV production/prod/staging."""
        return self.env.strip().lower() in {"production", "prod", "staging"}

    @property
    def controlplane_workflow_id(self) -> str:
        """One workflow id per database for every control-plane mutation."""
        return controlplane_workflow_id(self.database_id)


def parse_metrics_address(value: str) -> str:
    """Check a ``NEXUS_METRICS_ADDRESS``: ``<IP address>:<port>``.

    The host is an IPv4 address (``0.0.0.0`` for every interface,
    ``127.0.0.1`` for this host only) or a bracketed IPv6 one (``[::]:9464``);
    not a host name (the SDK's exporter binds a socket address as given). The
    port is 1-65535. Returns the address stripped of surrounding blanks;
    raises ``ValueError`` naming the setting and what is wrong.
    """
    v = value.strip()
    prefix = f"NEXUS_METRICS_ADDRESS {value!r}"
    host, sep, port_text = v.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{prefix} must be <IP address>:<port>, e.g. 0.0.0.0:9464")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(
            f"{prefix}: host {host!r} must be an IP address (0.0.0.0 for every interface, "
            "127.0.0.1 for this host, [::] for IPv6), not a host name"
        ) from None
    if ip.version == 6 and not bracketed:
        raise ValueError(f"{prefix}: an IPv6 host is written in brackets, e.g. [::1]:9464")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{prefix}: port {port_text!r} must be a number from 1 to 65535")
    return v


def controlplane_workflow_id(database_id: str) -> str:
    """``controlplane/<database id>``: the serialization key of ApplyAll and siblings."""
    return f"controlplane/{database_id}"
