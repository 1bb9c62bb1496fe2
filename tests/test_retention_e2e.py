"""Retention end to end on the local profile: `up --keep last=1` retires the box copies of old
checkpoints once their durable copies re-read equal; those claims stay current and durable-only,
`pull` fetches them from durable storage, `verify` checks them like any other, and the gate still
demands them before `down` stops the meter."""

from __future__ import annotations

import blake3

from tests.conftest import Bw, save_weights, wait_until

NAME = "keepbox"


def test_durable_only_claims_are_pulled_from_durable_and_pass_the_gate(bw: Bw) -> None:
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--keep", "last=1")
    cell = bw.cwd / "ckpt" / "cell-a"
    for step in (1, 2, 3):
        save_weights(cell / f"step-{step}.safetensors", seed=step)
    digests = {f"cell-a/{p.name}": blake3.blake3(p.read_bytes()).hexdigest() for p in sorted(cell.iterdir())}

    def retired() -> list[str] | None:
        rows = bw.json("artifacts", NAME)["claims"]
        gone = sorted(c["path"] for c in rows if c.get("durable_only"))
        return gone if len(gone) == 2 and all(c["durable"] for c in rows) else None

    assert wait_until(retired, timeout=60, what="two retired checkpoints") == [
        "cell-a/step-1.safetensors",
        "cell-a/step-2.safetensors",
    ]
    assert sorted(p.name for p in cell.iterdir()) == ["step-3.safetensors"]
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    for path, digest in digests.items():
        assert blake3.blake3((pulled / path).read_bytes()).hexdigest() == digest
    bw.ok("verify", str(pulled))
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["allowed"] is True and sorted(doc["teardown"]["deleted"]) == sorted(digests)


def test_keep_rules_that_cannot_mean_anything_are_refused_before_anything_starts(bw: Bw) -> None:
    for bad in ("last=0", "newest=3", "best=metrics.json", "last=2,,every=3"):
        r = bw("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--keep", bad)
        assert r.returncode == 2 and "--keep rule" in r.stderr, r.stderr
    assert not (bw.home / "boxes" / NAME / "sidecar").exists()
