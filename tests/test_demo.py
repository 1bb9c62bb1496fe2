"""`make demo`, the main job, run whole in a tmp dir: up, two cells of training, status until they
end, pull, verify, a refused tampered copy, down. It broke once unnoticed: `status --json` changed
its schema and the demo's wait for the jobs read a field that was gone, so it pulled while the
cells still trained and its own gate refused the teardown (MANIFEST_STALE)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import REPO, pid_alive, wait_until


def test_the_demo_runs_the_whole_lifecycle(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    env = {**os.environ, "BOXWARDEN_DEMO_DIR": str(demo), "COLUMNS": "160"}
    pid_file = demo / "home" / "boxes" / "demo" / "sidecar" / "sidecar.pid"
    try:
        r = subprocess.run(
            ["bash", str(REPO / "examples" / "demo.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):  # a failed demo's
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not pid_alive(pid), what="the demo's sidecar to end")
    assert r.returncode == 0, r.stderr[-6000:]
    assert "(refused with exit 3, as it must be)" in r.stderr
    pulled = demo / "work" / "pulled"
    marker = json.loads((pulled / "PULL_VERIFIED.json").read_text())
    assert marker  # verified
    for cell in ("cell-a", "cell-b"):
        assert (pulled / cell / "best.pt").is_file()
        # Trained to its end before the pull: the last of its 200 steps is in what came home.
        assert (pulled / cell / "ckpt-000200.pt").is_file(), sorted(p.name for p in (pulled / cell).iterdir())
    assert not pid_file.exists()  # down stopped the sidecar
