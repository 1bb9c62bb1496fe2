"""A local box's helper processes (`sidecar.launch start|gone`, the raw reader) never stand in the
directory the controller was started from: that is where local boxes work, and the sidecar's stray
rule counts any process standing there. Two teardowns run at once (`down --all`, two armed
`--when-safe` boxes) each took the other's `sidecar.launch gone` for a stray and refused after
their releases had deleted."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from controller.connector import LocalConnector


def test_a_local_helper_runs_in_the_root_not_in_the_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    conn = LocalConnector(str(tmp_path / "s.sock"))
    done = asyncio.run(conn.run([sys.executable, "-c", "import os; print(os.getcwd())"]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == "/"
