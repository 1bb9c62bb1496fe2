"""`down NAME --confirm NAME --when-safe` through the real CLI on a real local box: armed while its
last job runs, it pulls and verifies once the job ended and tears the box down through the usual
gate, never before (the journal's order says so); a box whose evidence never completes is never
torn down; `watch` shows the box armed. A refused release is one more reason to wait; what can
never pass is refused at once (not a run whose failed job may be started again); a SIGTERM says
what is left and arming again continues it, as does a release whose answer was lost; the follower
names itself to a command it blocks (`down --all` too), and a pid reused since never shows a box
armed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from controller import reach, released
from controller.armed import process_start
from controller.state import State
from controller.teardown import RELEASE
from tests.conftest import Bw, pid_alive, save_weights, wait_until

NAME = "ws"
# Saves a checkpoint (safetensors, as tests.conftest.save_weights writes one), then waits for its
# gate file (a minute at most) and saves another.
SAVE = r"""
import json, os, struct, sys, time, pathlib
def save(path):
    data = os.urandom(4000)
    head = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + data)
    os.replace(tmp, path)
out = pathlib.Path("ckpt", "cell-a")
out.mkdir(parents=True, exist_ok=True)
save(out / "step-1.safetensors")
"""
JOB = (
    SAVE
    + r"""
gate = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 60
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
save(out / "step-2.safetensors")
"""
)
# Saves its checkpoint, then fails: with --restart on-failure it waits to be started again.
FAILS = SAVE + "sys.exit(1)\n"
FAILS_EMPTY = "import sys; sys.exit(1)\n"  # fails before it writes anything


def follower(bw: Bw, pulled: Path, log: Path, name: str = NAME) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "controller", "down", name, "--confirm", name, "--when-safe"]
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
        for blocked in (
            ("up", NAME, "--profile", "local"),
            ("down", NAME, "--confirm", NAME),
            ("down", "--all", "--confirm-count", "1"),
        ):
            r = bw(*blocked)  # the follower holds the box: it says who it is and how to stop it
            assert r.returncode != 0 and f"{NAME} is armed" in r.stderr, r.stderr
            assert f"--when-safe` (pid {proc.pid}, since " in r.stderr and f"kill -INT {proc.pid}" in r.stderr
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
    # A pid that is another process now (this test's own) never shows the box armed again.
    state = State(bw.home)
    state.put(state.get(NAME).with_(armed_pid=os.getpid(), armed_start=process_start(os.getpid()) + "0"))
    state.close()
    assert "armed" not in bw("watch", NAME, "--once").stderr


def ended(proc: subprocess.Popen[bytes]) -> bytes:
    """The follower's stdout once it ended by itself (killed if it did not within the deadline)."""
    try:
        out, _ = proc.communicate(timeout=180)
        return out
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_follower_outlives_a_refused_release_and_tears_down_once_it_passes(bw: Bw, tmp_path: Path) -> None:
    bw.up(NAME)
    argv = ["--restart", "on-failure", "--restart-backoff", "300", "--", sys.executable, "-c", FAILS]
    r = bw("run", NAME, "--json", "--cell", "cell-a", *argv)
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["id"]
    bw.wait_durable(NAME, 1)
    wait_until(lambda: bw.json("status", NAME)["boxes"][0]["jobs_running"] == 0, what="the job failed")
    log, pulled = tmp_path / "follower.log", tmp_path / "pulled"
    proc = follower(bw, pulled, log)
    try:
        # The gate passes (no job runs), the release refuses: the job waits to be started again.
        wait_until(lambda: "waiting to be started again" in log.read_text(), timeout=60, what="the refusal")
        assert "waiting for the release: JOB_RUNNING" in log.read_text()
        assert proc.poll() is None, log.read_text()  # still following
        assert bw.json("status", NAME)["boxes"][0]["status"] == "up"
        bw.ok("stop", NAME, job)  # it will not be started again: now the release passes
        out = ended(proc)
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()
    assert json.loads(out)["teardown"]["gone"] is True
    assert bw.json("status", NAME)["boxes"][0]["status"] == "down"


def test_what_can_never_pass_is_refused_at_once(bw: Bw, tmp_path: Path) -> None:
    p = bw.up(NAME)
    arm = ("down", NAME, "--confirm", NAME, "--when-safe", "--poll", "0.3")
    inside = p["watch"] / "pulled"
    r = bw(*arm, "--pull-to", str(inside), timeout=60)
    assert r.returncode == 2 and f"--pull-to {inside}: the pulled tree" in r.stderr, r.stderr
    assert "is inside the box's watched directory" in r.stderr
    pulled = tmp_path / "pulled"
    r = bw(*arm, "--pull-to", str(pulled), timeout=60)  # nothing ran, nothing is in its watched dir
    assert r.returncode == 3 and "an empty run never passes the gate" in r.stderr, r.stderr
    assert "--allow-empty" in r.stderr and bw.json("status", NAME)["boxes"][0]["status"] == "up"
    # A job that failed before it wrote anything and may be started again: not empty for good.
    again = ["--restart", "on-failure", "--restart-backoff", "300", "--", sys.executable, "-c", FAILS_EMPTY]
    job = json.loads(bw.ok("run", NAME, "--json", "--cell", "cell-a", *again).stdout)["id"]
    wait_until(lambda: bw.json("status", NAME)["boxes"][0]["jobs_running"] == 0, what="the job failed")
    log = tmp_path / "follower.log"
    proc = follower(bw, pulled, log)
    try:
        said = "its restart policy may start it again"
        wait_until(lambda: said in log.read_text() or proc.poll() is not None, timeout=60)
        assert proc.poll() is None and said in log.read_text(), log.read_text()  # still following
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        stop(proc)
    bw.ok("stop", NAME, job)  # never started again now
    doc = bw.json(*arm, "--pull-to", str(pulled), "--allow-empty")
    assert doc["teardown"]["gone"] is True


def test_a_sigterm_says_what_is_left_and_arming_again_continues_the_teardown(bw: Bw, tmp_path: Path) -> None:
    p = bw.up(NAME)
    save_weights(p["watch"] / "cell-a" / "step-1.safetensors")
    bw.wait_durable(NAME, 1)
    # What a SIGTERM during the release leaves: the release requested, the box tearing down.
    state = State(bw.home)
    state.step(state.get(NAME).with_(status="tearing-down"), RELEASE, "no answer yet")
    link = p["watch"] / "cell-a" / "link.pt"
    os.symlink("/etc/hostname", link)  # unclaimable: the gate refuses while it is there
    log, pulled = tmp_path / "follower.log", tmp_path / "pulled"
    proc = follower(bw, pulled, log)
    try:
        wait_until(lambda: "UNCLAIMABLE" in log.read_text(), timeout=60, what="the follower to wait")
        assert "armed" in bw("watch", NAME, "--once").stderr
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()
    said = " ".join(log.read_text().split())
    assert "its teardown did not finish: release of box-side copies requested" in said
    assert f"`boxwarden down {NAME} --confirm {NAME}` continues it" in said
    assert "armed" not in bw("watch", NAME, "--once").stderr
    state.close()

    link.unlink()
    proc = follower(bw, pulled, log)
    out = ended(proc)
    assert proc.returncode == 0, log.read_text()
    assert json.loads(out)["teardown"]["gone"] is True
    assert "nothing left" not in log.read_text()
    assert bw.json("status", NAME)["boxes"][0]["status"] == "down"


def lost_release(bw: Bw, digest: str, *, recorded: bool = True) -> list[str]:
    """What a teardown whose release's answer was lost leaves (the review's simulation): the step
    recorded as a teardown records it (of which manifest, before it asks), then ReleaseArtifacts
    asked directly; the paths it deleted. `recorded` False: the record shows no such release."""
    state = State(bw.home)
    box = state.get(NAME)
    if recorded:
        state.step(
            box.with_(status="tearing-down"), RELEASE, released.release_detail(digest, "no answer yet")
        )
    state.close()

    async def release() -> list[str]:
        async with reach.connect(box) as c:
            await c.hello()
            return list((await c.release(digest)).deleted)

    return asyncio.run(release())


def test_a_lost_release_is_taken_only_for_the_tree_verified_for_it(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: the gate took "released by this teardown" for any tree holding
    files at the released paths: an older pull of the run (other bytes) passed, and the tree
    verified for the release was never judged."""
    p = bw.up(NAME)
    ckpt = p["watch"] / "cell-a" / "last.safetensors"
    save_weights(ckpt, seed=1)
    bw.wait_durable(NAME, 1)
    old, new = tmp_path / "old", tmp_path / "new"
    bw.ok("pull", NAME, "--to", str(old))
    bw.ok("verify", str(old))
    save_weights(tmp_path / "second.safetensors", seed=2)
    os.replace(tmp_path / "second.safetensors", ckpt)  # saved again: another claim at the same path
    first = blake3.blake3((old / "cell-a" / "last.safetensors").read_bytes()).hexdigest()

    def rewritten() -> bool:
        (claim,) = bw.artifacts(NAME)["claims"]
        return bool(claim["blake3"] != first and claim["durable"])

    wait_until(rewritten, what="the new bytes durable")
    # (a claim sealed within its file's racy window is sealed again: pulled once that settled)
    wait_until(lambda: bw("pull", NAME, "--to", str(new)).returncode == 0, what="the new bytes pulled")
    bw.ok("verify", str(new))
    digest = bw.json("down", NAME, "--dry-run", "--pulled", str(new))["manifest_digest"]
    assert lost_release(bw, digest) == ["cell-a/last.safetensors"]
    r = bw("down", NAME, "--confirm", NAME, "--pulled", str(old), "--json")
    assert r.returncode == 3, r.stdout  # the older tree holds other bytes than those released
    assert bw.json("status", NAME)["boxes"][0]["status"] == "tearing-down"


@pytest.mark.parametrize("how", ["when-safe", "down", "not recorded"])
def test_a_release_whose_answer_was_lost_is_continued_through_the_gate(
    bw: Bw, tmp_path: Path, how: str
) -> None:
    """The release finished on the box, its answer never came back (the review's simulation: the
    step recorded, ReleaseArtifacts asked directly). Armed again, or pulled and `down` again, the
    gate sees the claims released by this teardown, held by the tree it verified: not an empty run.
    A release the record does not show was asked for proves nothing: refused as before. The box has
    a roster (second review): the tree verified for the release held it; a pull since lists those
    files retired, and the follower no longer pulls once the release is on record."""
    p = bw.up(NAME, "--roster", "cell-a", "--roster", "cell-b")
    save_weights(p["watch"] / "cell-a" / "one.safetensors", seed=1)
    save_weights(p["watch"] / "cell-b" / "two.safetensors", seed=2)
    bw.wait_durable(NAME, 2)
    pulled = tmp_path / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    digest = bw.json("down", NAME, "--dry-run", "--pulled", str(pulled))["manifest_digest"]
    deleted = lost_release(bw, digest, recorded=how != "not recorded")
    assert sorted(deleted) == ["cell-a/one.safetensors", "cell-b/two.safetensors"]
    if how == "when-safe":
        r = bw(
            "down",
            NAME,
            "--confirm",
            NAME,
            "--when-safe",
            "--pull-to",
            str(pulled),
            "--poll",
            "0.3",
            "--json",
        )
    else:
        bw.ok("pull", NAME, "--to", str(pulled))  # the box claims nothing: both kept, listed as retired
        r = bw("down", NAME, "--confirm", NAME, "--pulled", str(pulled), "--json")
    if how == "not recorded":
        assert r.returncode == 3, r.stderr
        assert {x["code"] for x in json.loads(r.stdout)["reasons"]} >= {"EMPTY", "MANIFEST_STALE"}
        assert bw.json("status", NAME)["boxes"][0]["status"] == "up"
        return
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["teardown"]["gone"] is True
    if how == "down":
        rows = {c["check"]: c for c in doc["checks"]}
        assert rows["released by this teardown"]["ok"] is True
        assert (
            "2 claims were deleted on it by the release this teardown asked for"
            in rows["released by this teardown"]["detail"]
        )
    assert bw.json("status", NAME)["boxes"][0]["status"] == "down"


def test_a_lost_release_then_a_dead_sidecar_has_a_way_out_that_works(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: after a lost release the sidecar died; `down` said to bring it
    back, pull, verify and down, and that path ended at EMPTY (verify removed the marker; `up`
    dropped the release from the record). It now says what works, and it does."""
    p = bw.up(NAME)
    save_weights(p["watch"] / "cell-a" / "one.safetensors", seed=1)
    bw.wait_durable(NAME, 1)
    pulled = tmp_path / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    digest = bw.json("down", NAME, "--dry-run", "--pulled", str(pulled))["manifest_digest"]
    assert lost_release(bw, digest) == ["cell-a/one.safetensors"]
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the sidecar gone")
    r = bw("down", NAME, "--confirm", NAME, "--pulled", str(pulled))
    assert r.returncode == 3 and "without pulling or verifying again" in " ".join(r.stderr.split()), r.stderr
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    doc = bw.json("down", NAME, "--confirm", NAME, "--pulled", str(pulled))
    assert doc["allowed"] is True and doc["teardown"]["gone"] is True


def test_a_follower_waits_through_a_silence_in_an_unfinished_teardown(bw: Bw, tmp_path: Path) -> None:
    """Third review of issue 25: a release whose answer was lost, then the sidecar silent for a while
    (a box under load; SIGSTOP here): the follower went straight to the meter's settling, which
    refused (nothing saw the sidecar gone), and exited 3 while the box would pass once it answered."""
    p = bw.up(NAME)
    save_weights(p["watch"] / "cell-a" / "a.safetensors", seed=1)
    bw.wait_durable(NAME, 1)
    pulled = tmp_path / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    digest = bw.json("down", NAME, "--dry-run")["manifest_digest"]
    assert lost_release(bw, digest) == ["cell-a/a.safetensors"]
    (pid,) = bw.sidecar_pids()
    log = tmp_path / "follower.log"
    os.kill(pid, signal.SIGSTOP)
    try:
        proc = follower(bw, pulled, log)
        wait_until(lambda: b"waiting for an answer from its sidecar" in log.read_bytes(), what="the wait")
        assert proc.poll() is None, log.read_text()
        assert f"boxwarden up {NAME}" in " ".join(log.read_text().split())  # the way out, if it died
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        out = ended(proc)
        assert proc.returncode == 0, log.read_text()
    finally:
        stop(proc)
    assert json.loads(out)["teardown"]["gone"] is True


def test_a_follower_waits_for_the_provider_to_show_a_stopped_instance_gone(bw: Bw, tmp_path: Path) -> None:
    """Fourth review of issue 25: a teardown that saw its sidecar gone and sent the stop, unproven
    (an instance slow to end): the follower armed on it exited 3 at its first look instead of
    following until the provider shows the instance gone."""
    from tests.controller.test_meter_stop import calls, fake_profile, provider, ready_box

    provider(bw, tmp_path, "create", "i-123", "--stuck")
    ready_box(bw, tmp_path, fake_profile(tmp_path, timeout_s=1))
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "fk1", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    assert bw("down", "fk1", "--confirm", "fk1").returncode == 1  # sent, never proven
    log = tmp_path / "follower.log"
    proc = follower(bw, pulled, log, "fk1")
    try:
        wait_until(lambda: b"waiting for the provider to show it gone" in log.read_bytes(), what="the wait")
        assert proc.poll() is None, log.read_text()
        assert bw.json("status")["boxes"][0]["status"] == "meter-unproven"
        provider(bw, tmp_path, "vanish", "i-123")  # the instance ends at last
        out = ended(proc)
        assert proc.returncode == 0, log.read_text()
    finally:
        stop(proc)
    assert json.loads(out)["teardown"]["gone"] is True
    assert calls(tmp_path).count(["delete", "i-123"]) == 1  # never sent again while it waited
