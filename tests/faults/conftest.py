"""Fixtures of the fault suite: a MariaDB of the suite's own, which tests may restart.

The shared MariaDB (``NEXUS_TEST_MYSQL_URL``) is never restarted: a test that
needs a database going away gets :class:`OwnMariaDB`, a ``mariadbd`` on a free
port with its data directory under the session's temporary folder, started
with ``--no-defaults`` so nothing of the machine's configuration leaks in.
Skipped (with the reason) where ``mariadb-install-db`` / ``mariadbd`` are not
installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings

MARIADBD = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
INSTALL_DB = shutil.which("mariadb-install-db")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnMariaDB:
    """A private ``mariadbd``: start, stop (clean or SIGKILL), restart; fresh databases.

    ``url(name)`` is a ``mysql+pymysql`` URL of database ``name`` (root, no
    password); ``database()`` creates a new utf8mb4 database and returns its URL.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "server.log"
        self.tmp = root / "tmp"

    def install(self) -> None:
        assert INSTALL_DB is not None
        subprocess.run(
            [
                INSTALL_DB,
                "--no-defaults",
                f"--datadir={self.data}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        """Start the server and wait until it answers (60 s at most)."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    MARIADBD,
                    "--no-defaults",
                    f"--datadir={self.data}",
                    f"--port={self.port}",
                    "--bind-address=127.0.0.1",
                    f"--socket={self.root / 'mysqld.sock'}",
                    f"--pid-file={self.root / 'mysqld.pid'}",
                    # Its own temporary files: at start after a crash a server
                    # deletes the #sql* files of its tmpdir, which in /tmp would
                    # be the shared server's (tests run in parallel).
                    f"--tmpdir={self.tmp}",
                    "--user=root",
                    "--innodb-buffer-pool-size=64M",
                    "--skip-log-bin",
                    "--max-connections=500",
                ],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                engine = make_engine(self.url(""))
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
                engine.dispose()
                return
            except Exception:
                time.sleep(0.2)
        raise AssertionError(f"own MariaDB did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the server (a crash: InnoDB recovers at the next start)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)

    def restart(self, *, crash: bool = True, down_seconds: float = 1.0) -> None:
        """Stop (SIGKILL when ``crash``), stay down ``down_seconds``, start again."""
        self.kill() if crash else self.stop()
        time.sleep(down_seconds)
        self.start()

    def url(self, database: str) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        name = f"nexus_f_{uuid.uuid4().hex[:10]}"
        engine = make_engine(self.url(""))
        with engine.begin() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        engine.dispose()
        return self.url(name)


@pytest.fixture(scope="session")
def own_mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnMariaDB]:
    """The suite's own MariaDB (session-wide; tests may restart it)."""
    if INSTALL_DB is None or not Path(MARIADBD).exists():
        pytest.skip("mariadb-install-db / mariadbd are not installed")
    server = OwnMariaDB(tmp_path_factory.mktemp("own-mariadb"))
    server.install()
    server.start()
    try:
        yield server
    finally:
        server.stop()


class OwnTemporal:
    """A private Temporal dev server with its state in a file: SIGKILL it, start it again.

    ``address`` is ``127.0.0.1:<port>``; history survives a restart (the
    server's SQLite file), as it does for a real cluster's persistence.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._stack: contextlib.ExitStack | None = None

    def _settings(self) -> Settings:
        return Settings(temporal_address=self.address)

    def start(self) -> None:
        from nexusctl.devserver import dev_server

        self._stack = contextlib.ExitStack()
        self.proc = self._stack.enter_context(
            dev_server(self._settings(), ui=False, state_dir=self.root)
        )
        assert self.proc is not None, f"something already answers at {self.address}"
        # Accepting connections is not serving: wait until the frontend says so.
        from nexusctl.temporal import temporal_binary

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = subprocess.run(
                [temporal_binary(), "operator", "cluster", "health", "--address", self.address],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if health.returncode == 0 and "SERVING" in health.stdout:
                return
            time.sleep(0.3)
        raise AssertionError(f"own Temporal server at {self.address} never became healthy")

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def restart(self, down_seconds: float = 1.0) -> None:
        self.kill()
        time.sleep(down_seconds)
        self.start()


@pytest.fixture
def own_temporal(tmp_path: Path) -> Iterator[OwnTemporal]:
    """A dev server of this test's own (tests may kill and restart it)."""
    server = OwnTemporal(tmp_path / "temporal")
    server.root.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.kill()
