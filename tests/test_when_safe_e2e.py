"""`down NAME --confirm NAME --when-safe` through the real CLI on a real local box: armed while its
last job runs, it pulls and verifies once the job ended and tears the box down through the usual
gate, never before (the journal's order says so); a box whose evidence never completes is never
torn down; `watch` shows the box armed."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.conftest import Bw, save_weights, wait_until

NAME = "ws"
# Saves a checkpoint (safetensors, as tests.conftest.save_weights writes one), then waits for its
# gate file (a minute at most) and saves another.
JOB = r"""
import json, os, struct, sys, time, pathlib
def save(path):
    data = os.urandom(4000)
    head = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + data)
    os.replace(tmp, path)
out, gate = pathlib.Path("ckpt", "cell-a"), pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
save(out / "step-1.safetensors")
deadline = time.monotonic() + 60
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
save(out / "step-2.safetensors")
"""


def follower(bw: Bw, pulled: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "controller", "down", NAME, "--confirm", NAME, "--when-safe"]
    argv += ["--pull-to", str(pulled), "--poll", "0.3", "--json"]
    with open(log, "wb") as err:
        return subprocess.Popen(
            argv, cwd=bw.cwd, env=bw.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err
        )


def test_an_armed_box_is_torn_down_once_its_job_ended_and_its_claims_are_home(bw: Bw, tmp_path: Path) -> None:
    bw.up(NAME)
    gate = tmp_path / "gate"
    r = bw("run", NAME, "--json", "--cell", "cell-a", "--", sys.executable, "-c", JOB, str(gate))
    assert r.returncode == 0, r.stderr
    wait_until(lambda: bw.artifacts(NAME).get("claims"), timeout=30)
    log, pulled = tmp_path / "follower.log", tmp_path / "pulled"
    proc = follower(bw, pulled, log)
    try:
        wait_until(lambda: "waiting for job" in log.read_text(), timeout=60, what="the follower to wait")
        assert bw.json("status", NAME)["boxes"][0]["status"] == "up"  # armed, not torn down
        shown = bw("watch", NAME, "--once")
        assert "armed: 1 job" in shown.stderr, shown.stderr
        gate.touch()
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    doc = json.loads(out)
    assert doc["teardown"]["gone"] is True
    assert sorted(p.name for p in (pulled / "cell-a").iterdir()) == [
        "step-1.safetensors",
        "step-2.safetensors",
    ]
    assert bw.json("status", NAME)["boxes"][0]["status"] == "down"
    # Not one poll earlier: the job ended before anything was released.
    # (the box's own journal: its ledger stays on this machine after a local box's teardown)
    db = sqlite3.connect(f"file:{bw.home / 'boxes' / NAME / 'sidecar' / 'ledger.sqlite'}?mode=ro", uri=True)
    kinds = [k for (k,) in db.execute("SELECT kind FROM events ORDER BY seq")]
    db.close()
    assert "JOB_EXITED" in kinds and "ARTIFACT_RELEASED" in kinds
    assert kinds.index("JOB_EXITED") < kinds.index("ARTIFACT_RELEASED")


def test_a_box_whose_evidence_never_completes_is_never_torn_down(bw: Bw, tmp_path: Path) -> None:
    p = bw.up(NAME)
    save_weights(p["watch"] / "cell-a" / "step-1.safetensors")
    os.symlink("/etc/hostname", p["watch"] / "cell-a" / "link.pt")  # never claimable: the gate refuses
    log, pulled = tmp_path / "follower.log", tmp_path / "pulled"
    proc = follower(bw, pulled, log)
    try:
        wait_until(lambda: "waiting for" in log.read_text() and "UNCLAIMABLE" in log.read_text(), timeout=60)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    row = bw.json("status", NAME)["boxes"][0]
    assert row["status"] == "up" and (p["watch"] / "cell-a" / "step-1.safetensors").exists()
    assert "armed" not in bw("watch", NAME, "--once").stderr  # no longer followed
