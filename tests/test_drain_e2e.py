"""`drain --wait` end to end on the local profile: a real sidecar whose durable store (a tiny real
tmpfs) is full reports what is at risk and why, exits 3 while it stays at risk, and once the store
has room again drains it and exits 0 with every claim durable."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import Bw, save_weights, wait_until
from tests.test_gate_reasons import tiny_tmpfs  # noqa: F401 - the fixture

NAME = "drain1"


def test_drain_wait_reports_what_is_at_risk_then_drains_it(bw: Bw, tiny_tmpfs: Path) -> None:  # noqa: F811
    p = bw.up(NAME, "--durable", tiny_tmpfs.as_uri())
    save_weights(p["watch"] / "cell-a" / "old.safetensors", seed=1, size=50_000)  # ~200 KB > 64 KiB
    save_weights(p["watch"] / "cell-a" / "new.safetensors", seed=2, size=60_000)
    wait_until(
        lambda: len([c for c in bw.artifacts(NAME).get("claims", []) if c.get("push_error")]) == 2,
        what="both pushes to fail",
    )

    doc = bw.json("drain", NAME)  # without --wait: a report, exit 0
    assert doc["safe"] is False and doc["waited"] is False
    assert doc["at_risk_files"] == 2 and doc["at_risk_bytes"] > 400_000
    assert any(c["push_error"] for c in doc["at_risk"])
    assert {c["path"] for c in doc["at_risk"]} == {"cell-a/old.safetensors", "cell-a/new.safetensors"}
    # The sidecar's health snapshot is taken once an interval: await one that counts both claims.
    row = wait_until(lambda: next((r for r in bw.json("status")["boxes"] if r.get("claims") == 2), None))
    assert row["not_durable"] == doc["at_risk_bytes"] and row["push_lag_s"] > 0 and row["durable"] == 0

    r = bw("drain", NAME, "--wait", "--timeout", "2")  # still at risk at the end: exit 3
    assert r.returncode == 3, r.stderr
    assert f"{NAME}: at risk: 2 files" in r.stderr and "still at risk after" in r.stderr
    assert "cell-a/new.safetensors" in r.stderr and "push error" in r.stderr

    subprocess.run(["mount", "-o", "remount,size=8m", str(tiny_tmpfs)], check=True)
    doc = bw.json("drain", NAME, "--wait", "--timeout", "120")
    assert doc["safe"] is True and doc["at_risk_files"] == 0 and doc["pending"] == 0
    claims = bw.artifacts(NAME)["claims"]
    assert len(claims) == 2 and all(c["durable"] for c in claims)
    row = wait_until(lambda: next((r for r in bw.json("status")["boxes"] if r.get("durable") == 2), None))
    assert row["proofs"]["reread"] == 2 and row["not_durable"] == 0 and row["push_bytes_per_s"] > 0
    bw.cleanup()  # stop the sidecar before the fixture unmounts its store
