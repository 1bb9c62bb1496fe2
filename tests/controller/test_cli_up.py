"""`up` and the other commands around it: idempotence, refusals at the edge, helpful failures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from controller.digest import path_key
from tests.conftest import Bw, pid_alive, save_ckpt, wait_until


def test_up_twice_leaves_the_running_sidecar_alone(bw: Bw) -> None:
    bw.up("b1")
    first = bw.sidecar_pids()
    bw.up("b1")
    assert bw.sidecar_pids() == first
    assert all(pid_alive(p) for p in first)
    rows = bw.json("status")["boxes"]
    assert [r["box"] for r in rows] == ["b1"]
    assert rows[0]["sidecar"]["version"] == "0.1.0" and rows[0]["sidecar"]["pid"] > 0


def test_unsafe_box_name_is_refused_before_anything_runs(bw: Bw) -> None:
    r = bw("up", "x; rm -rf ~", "--profile", "local", "--watch", "ckpt")
    assert r.returncode == 2
    assert "not allowed" in r.stderr
    assert not bw.sidecar_pids()


def test_unknown_profile_and_durable_scheme_are_usage_errors(bw: Bw) -> None:
    r = bw("up", "b1", "--profile", "nope", "--watch", "ckpt")
    assert r.returncode == 2 and "unknown profile" in r.stderr
    r = bw("up", "b1", "--profile", "local", "--watch", "ckpt", "--durable", "gs://bucket/x")
    assert r.returncode == 2 and "file:///absolute/dir and s3://" in r.stderr


def test_a_bucket_without_credentials_says_how_to_give_them(bw: Bw) -> None:
    bw.env = {k: v for k, v in bw.env.items() if not k.startswith("AWS_")}
    bw.env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance metadata service to ask here
    endpoint = "endpoint_url=http://127.0.0.1:9"
    r = bw("up", "b1", "--profile", "local", "--watch", "ckpt", "--durable", f"s3://bucket/x?{endpoint}")
    assert r.returncode == 1 and "--durable-credentials FILE" in r.stderr, r.stderr
    assert not bw.sidecar_pids()


def test_a_sidecar_that_cannot_start_shows_its_log(bw: Bw) -> None:
    shared = bw.home / "boxes" / "b1" / "sidecar"
    shared.mkdir(parents=True)
    shared.chmod(0o755)  # not private: the sidecar must refuse to put its socket and ledger there
    r = bw("up", "b1", "--profile", "local", "--watch", "ckpt")
    assert r.returncode == 1
    assert "mode 0700" in r.stderr
    assert "exited with status 2" in r.stderr


def test_up_refuses_a_pseudo_filesystem_before_anything_is_written(bw: Bw) -> None:
    """F9: `up --watch /proc/sys/kernel/random` started the sidecar, and every file there then showed
    as NOT_DURABLE ("Cannot allocate memory"). A workdir there is refused the same way."""
    r = bw("up", "b1", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "/proc/sys/kernel/random")
    assert r.returncode == 2, r.stderr
    assert "--watch /proc/sys/kernel/random is on a proc pseudo-filesystem" in r.stderr
    watch = bw.cwd / "ckpt"
    r = bw("up", "b1", "--profile", "local", "--workdir", "/proc/sys/kernel", "--watch", str(watch))
    assert r.returncode == 2, r.stderr
    assert "--workdir /proc/sys/kernel is on a proc pseudo-filesystem" in r.stderr
    # Refused before anything was created, started or recorded.
    assert not bw.sidecar_pids() and not (bw.home / "boxes").exists() and not watch.exists()
    assert bw.json("status")["boxes"] == []


def test_unknown_box_says_how_to_start_one(bw: Bw) -> None:
    r = bw("artifacts", "ghost")
    assert r.returncode == 1
    assert "boxwarden up ghost" in r.stderr


def test_pull_resumes_from_the_partial_file(bw: Bw) -> None:
    p = bw.up("b1")
    save_ckpt(p["watch"] / "cell-a" / "big.pt", seed=5, size=2_000_000)  # ~8 MB
    bw.wait_durable("b1", 1)
    pulled = bw.cwd / "pulled"
    # An interrupted earlier pull left the first 3 MB (right bytes) as the partial file.
    part = pulled / ".bw-parts" / f"{path_key('cell-a/big.pt')}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes((p["watch"] / "cell-a" / "big.pt").read_bytes()[: 3 << 20])
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["resumed"] == {"cell-a/big.pt": 3 << 20}
    assert rep["bytes_fetched"] == (p["watch"] / "cell-a" / "big.pt").stat().st_size - (3 << 20)
    assert not part.exists()
    assert (pulled / "cell-a" / "big.pt").read_bytes() == (p["watch"] / "cell-a" / "big.pt").read_bytes()
    bw.ok("verify", str(pulled))
    again = bw.json("pull", "b1", "--to", str(pulled))
    assert again["skipped"] == ["cell-a/big.pt"] and again["fetched"] == []


def test_pull_refetches_a_corrupt_partial_from_zero_and_keeps_nothing_wrong(bw: Bw) -> None:
    p = bw.up("b1")
    save_ckpt(p["watch"] / "cell-a" / "best.pt", seed=6, size=100_000)
    bw.wait_durable("b1", 1)
    pulled = bw.cwd / "pulled"
    part = pulled / ".bw-parts" / f"{path_key('cell-a/best.pt')}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 1000)  # wrong bytes: the hash on receipt must catch it
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["restarted"] == ["cell-a/best.pt"]
    assert (pulled / "cell-a" / "best.pt").read_bytes() == (p["watch"] / "cell-a" / "best.pt").read_bytes()
    assert not part.exists() and not (pulled / ".bw-parts").exists()
    bw.ok("verify", str(pulled))


def test_verify_json_and_marker_binding(bw: Bw, tmp_path: Path) -> None:
    p = bw.up("b1", "--roster", "cell-a")
    save_ckpt(p["watch"] / "cell-a" / "best.pt", seed=1)
    listing = bw.wait_durable("b1", 1)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    doc = bw.json("verify", str(pulled))
    assert doc["ok"] is True and doc["reasons"] == []
    marker = json.loads((pulled / "PULL_VERIFIED.json").read_text())
    assert marker["manifest_digest"] == listing["manifest_digest"] == doc["manifest_digest"]
    manifest = json.loads((pulled / "MANIFEST.json").read_text())
    assert manifest["schema"] == "boxwarden.manifest/1"
    assert manifest["instance"] == "b1" and manifest["roster"] == ["cell-a"]


def test_run_then_logs_follow_until_the_job_exits(bw: Bw) -> None:
    bw.up("b1")
    script = "import time\nfor i in range(3):\n    print('line', i, flush=True)\n    time.sleep(0.2)\n"
    job = json.loads(bw.ok("run", "b1", "--json", "--", sys.executable, "-c", script).stdout)
    r = bw.ok("logs", "b1", "--job", job["id"], "-f")  # returns only once the job has exited
    assert r.stdout.splitlines() == ["line 0", "line 1", "line 2"]
    assert bw.ok("logs", "b1").stdout == r.stdout  # newest job by default


def test_run_restart_on_failure_starts_a_failing_job_again(bw: Bw) -> None:
    bw.up("b1")
    out = bw.ok(
        "run",
        "b1",
        "--json",
        "--restart",
        "on-failure",
        "--max-restarts",
        "1",
        "--restart-backoff",
        "0.1",
        "--",
        "sh",
        "-c",
        "exit 4",
    ).stdout
    job = json.loads(out)
    assert job["restart"] == "on-failure" and job["max_restarts"] == 1

    def restarted() -> list[dict[str, object]]:
        recs = [json.loads(line) for line in bw.ok("events", "b1", "--json").stdout.splitlines()]
        return [r for r in recs if r["kind"] == "JOB_RESTARTED" and r.get("job_id") == job["id"]]

    events = wait_until(restarted, what="JOB_RESTARTED")
    assert str(events[0]["detail"]).startswith("attempt 1 of 1 after exit 4")
    r = bw("run", "b1", "--restart", "always", "--", "true")
    assert r.returncode != 0 and "on-failure" in r.stderr


def test_a_plans_profile_file_changed_after_it_was_read_is_refused(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: a plan's profile file was checked when the plan was read and
    loaded again at `up`: a file replaced in between (an interactive prompt's time) was pinned.
    `up` takes the text the plan read, or nothing."""
    import asyncio

    from controller import boxes
    from controller.errors import UsageError
    from controller.state import State
    from tests.controller.test_meter_stop import fake_profile

    prof = fake_profile(tmp_path)
    state = State(bw.home)
    try:
        args = dict(profile=None, profile_file=prof, instance_id="i-1", workdir=str(bw.cwd), watch=["ckpt"],
                    durable=None, run_id=None, roster=())  # fmt: skip
        with pytest.raises(UsageError, match="changed since the plan was read"):
            asyncio.run(boxes.up(state, "pf1", **args, profile_digest="0" * 64))  # type: ignore[arg-type]
        assert state.find("pf1") is None and not bw.sidecar_pids()
    finally:
        state.close()
