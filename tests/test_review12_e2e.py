"""Adversarial review 12 and the gap review 11 left: each test is a way the real CLI allowed
`down` wrongly before its fix (the findings are in issue 6's closing note)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller import teardown
from controller.state import State
from tests.conftest import Bw, pid_alive, wait_until
from tests.controller.test_meter_stop import fake_profile
from tests.sidecar.test_openfiles import mapped, registered
from tests.test_review4_e2e import NAME, dry, pulled_box, up_args
from tests.test_review7_e2e import settled, stray_reasons


def test_a_process_writing_a_checkpoint_through_a_mapping_holds_the_gate(bw: Bw) -> None:
    """A process outside every job (cwd /) mapped a sealed, pulled checkpoint MAP_SHARED and
    closed the fd: it can still write into it, but /proc showed no fd, and `down` was allowed."""
    p = settled(bw)
    target = p["watch"] / "a.bin"
    with mapped(target, "w", "shared") as pid:
        report = dry(bw)
        assert report["allowed"] is False
        # The scan sees the writer itself: no "cannot tell" that hangs on other processes.
        writes = [r for r in report["reasons"] if r["code"] == "UNSEALED_WRITES"]
        assert writes == [{"code": "UNSEALED_WRITES", "detail": "open for writing", "path": "a.bin"}]
        (reason,) = stray_reasons(bw)
        assert f"pid {pid} " in reason["detail"] and f"maps {target} into memory" in reason["detail"]
    # Once the mapping is gone the file is sealed again (its last write event was before the
    # mapping went: the rescan finds it), and only then may `down` pass.
    wait_until(lambda: dry(bw)["allowed"], timeout=60, what="down allowed once the mapping is gone")


# -- F5: steps of an interrupted teardown outlived the sidecar they were taken on --------------------


def interrupted_after(bw: Bw, *steps: str) -> None:
    """Record `steps` as a `down` of box NAME does before it takes each one, as if that `down` was
    killed right after (its process gone: nothing else happened)."""
    state = State(bw.home)
    try:
        box = state.get(NAME)
        for step in steps:
            state.step(box.with_(status="tearing-down"), step, "recorded by the test")
    finally:
        state.close()


def sidecar_stops_answering(bw: Bw) -> None:
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGKILL)  # a crash, a reboot: the sidecar ends without a word
    wait_until(lambda: not pid_alive(pid), what="the sidecar to end")


def test_a_teardown_killed_before_the_sidecar_stopped_never_skips_the_gate(bw: Bw) -> None:
    """Review 12, F5 (the case without `up`): a `down` killed after recording its Shutdown step but
    before the sidecar got it left the sidecar watching; it sealed a new checkpoint and then
    crashed. The next `down` took the gate-less "continue the teardown" path: gone, exit 0."""
    p, _ = pulled_box(bw, {"a.bin": b"a"})
    interrupted_after(bw, teardown.RELEASE, teardown.SHUTDOWN)
    (p["watch"] / "b.bin").write_bytes(b"sealed after the interrupted teardown")
    bw.wait_durable(NAME, 2)
    sidecar_stops_answering(bw)
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 3, r.stderr
    assert "TEARDOWN_UNFINISHED" in r.stderr and f"boxwarden up {NAME}" in " ".join(r.stderr.split())
    assert bw.json("status")["boxes"][0]["status"] == "tearing-down"


def test_up_again_forgets_the_steps_taken_on_the_sidecar_before(bw: Bw) -> None:
    """Review 12, F5: a teardown killed after its sidecar was seen gone; `up` again started a new
    sidecar, which sealed a new checkpoint and then stopped answering. `down` continued the old
    teardown without a gate (its steps said the sidecar was stopped) and marked the box down."""
    p, _ = pulled_box(bw, {"a.bin": b"a"})
    interrupted_after(bw, teardown.RELEASE, teardown.SHUTDOWN)
    sidecar_stops(bw)
    interrupted_after(bw, teardown.SIDECAR_GONE)
    bw.ok(*up_args(bw))
    # Only the release stays on record (what it deleted stays deleted); the steps taken on the old
    # sidecar are forgotten, so nothing says the new one was stopped.
    left = bw.json("status")["boxes"][0].get("teardown") or {"steps": {}}
    assert set(left["steps"]) <= {teardown.RELEASE}, left
    (p["watch"] / "b.bin").write_bytes(b"sealed by the new sidecar")
    bw.wait_durable(NAME, 2)
    sidecar_stops_answering(bw)
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode != 0, r.stderr
    assert bw.json("status")["boxes"][0]["status"] == "up"
    assert (p["watch"] / "b.bin").exists()


# -- F4: an ancestor of `down` whose other thread waits for a child of its own -----------------------

WAITS_FOR_ITS_EVAL_STEP = """
import os, subprocess, sys, threading
os.chdir(sys.argv[1])
ready = threading.Event()
def train():
    eval_step = subprocess.Popen(["sleep", "600"], cwd="/")  # then it saves a checkpoint
    ready.set()
    eval_step.wait()
threading.Thread(target=train, daemon=True).start()
ready.wait()
with open(sys.argv[2], "w") as out:  # not captured: this thread waits in wait4(), not poll()
    code = subprocess.run(sys.argv[3:], stdout=out).returncode
for pid in os.listdir("/proc"):
    try:  # a process of someone else's may end while we look
        stat = open(f"/proc/{pid}/stat").read() if pid.isdigit() else ""
    except OSError:
        continue
    if stat and stat.rsplit(") ", 1)[1].split()[1] == str(os.getpid()):
        os.kill(int(pid), 9)  # the eval step: ours to end
sys.exit(code if code in (0, 3) else 1)
"""


def test_an_ancestor_whose_other_thread_waits_for_its_own_child_is_a_stray(tmp_path: Path, bw: Bw) -> None:
    """Review 12, F4: a trainer in the workdir ran `down` from its main thread while its training
    thread waited for an eval step it had started; every thread sat in do_wait, so it passed for
    a shell that only waits for `down`, and wrote a checkpoint after down exited 0."""
    p = settled(bw)
    out = tmp_path / "down.json"
    cli = [sys.executable, "-m", "controller", "down", NAME, "--dry-run", "--json"]
    r = subprocess.run(
        [sys.executable, "-c", WAITS_FOR_ITS_EVAL_STEP, str(p["watch"]), str(out), *cli],
        env=bw.env,
        timeout=120,
    )
    doc = json.loads(out.read_text())
    assert r.returncode == 3 and doc["allowed"] is False, doc
    (reason,) = [x for x in doc["reasons"] if x["code"] == "STRAY_PROCESS"]
    assert f"works in {p['watch']}" in reason["detail"]


def test_a_process_holding_the_watched_dir_in_an_io_uring_holds_the_gate(bw: Bw) -> None:
    """Review 12, F3, end to end: `down` was allowed while the watched dir sat in the fixed-file
    table of a process working in /."""
    p = settled(bw)
    with registered(p["watch"], "d") as pid:
        (reason,) = stray_reasons(bw)
        assert f"pid {pid} " in reason["detail"]
        assert f"holds {p['watch']} open through an io_uring" in reason["detail"]
    assert dry(bw)["allowed"] is True


def manual_box(bw: Bw, tmp_path: Path) -> tuple[dict[str, Path], Path]:
    """Box NAME on a profile whose meter stop is console steps, one file pulled and verified."""
    profile = fake_profile(tmp_path)
    text = profile.read_text()
    start, end = text.index("[meter_stop]"), text.index("[detach]")
    manual = 'verb = "release"\nirreversible = true\nmode = "manual"\nmanual = "Console: Release"\n\n'
    profile.write_text(text[:start] + "[meter_stop]\n" + manual + text[end:])
    p = bw.up(NAME, "--profile-file", str(profile))
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    bw.ok("pull", NAME, "--to", str(bw.cwd / "pulled"))
    bw.ok("verify", str(bw.cwd / "pulled"))
    return p, profile


def test_console_steps_are_not_offered_without_a_gate_before_the_sidecar_was_seen_gone(
    bw: Bw, tmp_path: Path
) -> None:
    """Review 12, F5 on a profile whose meter stop is console steps: the same interrupted
    teardown showed the steps, and `--meter-stopped` on the next `down` marked the box down."""
    p, _ = manual_box(bw, tmp_path)
    interrupted_after(bw, teardown.RELEASE, teardown.SHUTDOWN)
    (p["watch"] / "b.bin").write_bytes(b"sealed after the interrupted teardown")
    bw.wait_durable(NAME, 2)
    sidecar_stops_answering(bw)
    for _ in range(2):
        r = bw("down", NAME, "--confirm", NAME, "--meter-stopped")
        assert r.returncode == 3, r.stderr
        assert "Console: Release" not in r.stderr
    assert bw.json("status")["boxes"][0]["status"] == "tearing-down"


# -- Review 13, F01: the caller's PIDs from another PID namespace -----------------------------------

IN_A_PID_NAMESPACE = 'echo $(($1 - 1)) > /proc/sys/kernel/ns_last_pid && shift && "$@"; true'


def test_a_controller_in_another_pid_namespace_exempts_nobody_with_its_numbers(bw: Bw) -> None:
    """Review 13, F01: `down` run in `unshare -p` had the number of a trainer working in the
    workdir on this host; the sidecar exempted that trainer as "the controller" and allowed."""
    p = settled(bw)
    trainer = subprocess.Popen(["sleep", "600"], cwd=p["watch"])
    try:
        cli = [sys.executable, "-m", "controller", "down", NAME, "--dry-run", "--json"]
        r = subprocess.run(
            [
                "unshare",
                "-p",
                "-f",
                "--mount-proc",
                "sh",
                "-c",
                IN_A_PID_NAMESPACE,
                "sh",
                str(trainer.pid),
                *cli,
            ],
            env=bw.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        doc = json.loads(r.stdout)
        assert doc["allowed"] is False, r.stdout + r.stderr
        (reason,) = [x for x in doc["reasons"] if x["code"] == "STRAY_PROCESS"]
        assert f"pid {trainer.pid} " in reason["detail"]
    finally:
        trainer.kill()
        trainer.wait()


def test_a_retry_never_says_the_sidecar_is_gone_because_it_does_not_answer(bw: Bw, tmp_path: Path) -> None:
    """Review 13, F02's aside: the gate-less retry recorded "sidecar gone" whenever the sidecar did
    not answer (its socket removed, a slow Hello), which nothing had checked."""
    from tests.controller.test_teardown_resume import INSTANCE, audit, profile, provider_dir

    p = bw.up(NAME, "--profile-file", str(profile(tmp_path)), "--instance-id", INSTANCE)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    interrupted_after(bw, teardown.RELEASE)  # killed before Shutdown: the sidecar lives on
    state = State(bw.home)
    sock = Path(state.get(NAME).socket)
    state.close()
    sock.unlink()  # a tmp cleaner: it no longer answers, and it still runs
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 3, r.stderr
    assert audit(bw)[-1]["result"]["sidecar_gone"] is False
    (provider_dir(tmp_path) / f"gone-{INSTANCE}").touch()  # the provider says the box is gone
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["teardown"]["gone"] is True and doc["teardown"]["sidecar_gone"] is True


# -- Review 14 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["up", "by-hand"])
def test_a_sidecar_started_during_the_meter_stop_is_never_reported_gone(
    bw: Bw, tmp_path: Path, how: str
) -> None:
    """Review 14, F02: `up` during `down`'s meter stop started a fresh sidecar (one that had never
    released anything, so it took a job); `down` then said gone, with the job writing a checkpoint
    on a box about to be destroyed. `up` now waits for the `down`; a sidecar started by hand makes
    the `down` fail instead of saying gone."""
    from tests.controller.test_teardown_resume import INSTANCE, profile, provider_dir

    slow = profile(tmp_path)
    slow.write_text(slow.read_text().replace("timeout_s = 1\n", "timeout_s = 120\n"))
    p = bw.up(NAME, "--profile-file", str(slow), "--instance-id", INSTANCE)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    bw.ok("pull", NAME, "--to", str(bw.cwd / "pulled"))
    bw.ok("verify", str(bw.cwd / "pulled"))
    prov = provider_dir(tmp_path)
    (prov / "complete").touch()  # the stop destroys the box...
    (prov / "hang").touch()  # ...and its command takes its time returning
    down = bw.spawn("down", NAME, "--confirm", NAME)
    by_hand = None
    try:
        wait_until(lambda: (prov / "stopper.pid").exists(), timeout=60, what="the meter stop to run")
        if how == "up":
            again = ("--workdir", str(bw.cwd), "--watch", "ckpt", "--instance-id", INSTANCE)
            r = bw("up", NAME, "--profile-file", str(slow), *again)
            assert r.returncode == 1, r.stdout + r.stderr
            assert f"a `down {NAME}` is running" in r.stderr
        else:
            config = bw.home / "boxes" / NAME / "sidecar.json"
            by_hand = subprocess.Popen([sys.executable, "-m", "sidecar", "--config", str(config)], env=bw.env)
            state = State(bw.home)
            box = state.get(NAME)
            state.close()
            wait_until(lambda: asyncio.run(teardown.sidecar_answers(box)), what="the sidecar to answer")
    finally:
        (prov / "hang").unlink()
        down.wait(timeout=120)
        if by_hand is not None:
            by_hand.terminate()
            by_hand.wait(timeout=30)
    status = bw.json("status")["boxes"][0]["status"]
    if how == "up":
        assert down.returncode == 0 and status == "down"
        assert not any(pid_alive(pid) for pid in bw.sidecar_pids())
    else:
        assert down.returncode != 0 and status != "down"


def test_pull_never_takes_an_artifact_it_pulled_before_for_a_partial_copy(bw: Bw) -> None:
    """Review 14, F04: `a.bin.bw-part`, an artifact an earlier pull had put in the tree, was taken
    for an older version's partial copy of `a.bin` once the box no longer claimed it: moved into
    the parts dir and overwritten, and the manifest did not list it as retired."""
    p, pulled = pulled_box(bw, {"a.bin": b"model v1", "a.bin.bw-part": b"the only pulled copy"})
    (p["watch"] / "a.bin.bw-part").unlink()
    (p["watch"] / "a.bin").write_bytes(b"model v2, longer than v1")
    wait_until(lambda: [c["path"] for c in bw.wait_durable(NAME, 1)["claims"]] == ["a.bin"], what="v2")
    report = bw.json("pull", NAME, "--to", str(pulled))
    assert report["fetched"] == ["a.bin"] and report["resumed"] == {} and report["restarted"] == []
    assert report["retired"] == ["a.bin.bw-part"]
    assert (pulled / "a.bin.bw-part").read_bytes() == b"the only pulled copy"
    assert (pulled / "a.bin").read_bytes() == b"model v2, longer than v1"


def test_up_refuses_a_watched_dir_named_like_the_durable_stores_own_files(bw: Bw) -> None:
    """Review 14, F03: with two watched dirs, `.boxwarden-tmp/b.bin` was unclaimable for good."""
    (bw.cwd / "ckpt").mkdir()
    r = bw(*up_args(bw, "--watch", ".boxwarden-tmp"))
    assert r.returncode == 2 and "'.boxwarden-tmp' is reserved" in r.stderr, r.stderr
    assert not (bw.cwd / ".boxwarden-tmp").exists()
    # Review 23, F01: the same name spelled through `..` got past the check.
    (bw.cwd / ".bw-replaced" / "x").mkdir(parents=True)
    r = bw(*up_args(bw, "--watch", ".bw-replaced/x/.."))
    assert r.returncode == 2 and "'.bw-replaced' is reserved" in r.stderr, r.stderr
    assert not bw.sidecar_pids()


def test_a_pull_that_ends_after_a_down_leaves_the_box_down(bw: Bw) -> None:
    """Review 14 (a suspicion, confirmed here): a pull wrote back the whole box record it had read
    when it began, so a long pull that ended after a `down` set the box back to "up"."""
    from controller import reach

    p = bw.up(NAME)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    state = State(bw.home)
    try:
        as_the_pull_began = state.get(NAME)
        state.put(as_the_pull_began.with_(status="down"))  # what a `down` meanwhile records
        asyncio.run(reach.pull_box(state, as_the_pull_began, bw.cwd / "pulled"))
        after = state.get(NAME)
    finally:
        state.close()
    assert after.status == "down" and after.pulled_dir == str((bw.cwd / "pulled").resolve())


# -- Review 15 ------------------------------------------------------------------------------------


def test_up_with_a_path_for_a_name_touches_no_file(bw: Bw, tmp_path: Path) -> None:
    """Review 15, F02: `up ~/proj/poetry` took its lock at `~/proj/poetry.lock` (emptied it) before
    it refused the name."""
    lock = tmp_path / "proj" / "poetry.lock"
    lock.parent.mkdir()
    lock.write_text("the project's pinned dependencies\n")
    for name in (str(tmp_path / "proj" / "poetry"), "../../proj/poetry", "x/y"):
        r = bw("up", name, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
        assert r.returncode == 2 and "is not allowed" in r.stderr, r.stderr
    assert lock.read_text() == "the project's pinned dependencies\n"
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["poetry.lock"]
    assert not (bw.home / "locks").exists()


def test_pull_leaves_a_users_file_named_like_an_old_partial_copy_alone(bw: Bw) -> None:
    """Review 15, F01: a file `m.pt.bw-part` of the user's own in the target (no pull put it
    there) was taken for an older version's partial copy of `m.pt`, and overwritten."""
    p = bw.up(NAME)
    (p["watch"] / "m.pt").write_bytes(b"the checkpoint")
    bw.wait_durable(NAME, 1)
    pulled = bw.cwd / "pulled"
    pulled.mkdir()
    (pulled / "m.pt.bw-part").write_bytes(b"the user's own notes")
    report = bw.json("pull", NAME, "--to", str(pulled))
    assert report["fetched"] == ["m.pt"] and report["restarted"] == [] and report["resumed"] == {}
    assert report["extra_local"] == ["m.pt.bw-part"]
    assert (pulled / "m.pt.bw-part").read_bytes() == b"the user's own notes"


def steps_shown_then_up_again(bw: Bw, tmp_path: Path) -> None:
    """A manual-profile box whose `down` showed the console steps (not confirmed), then `up`
    again (a new run), with one new file durable."""
    p, profile = manual_box(bw, tmp_path)
    r = bw("down", NAME, "--confirm", NAME)  # no terminal: the console steps are not confirmed
    assert r.returncode == 1 and "Console: Release" in r.stderr, r.stderr
    bw.ok("up", NAME, "--profile-file", str(profile), "--workdir", str(bw.cwd), "--watch", "ckpt")
    (p["watch"] / "b.bin").write_bytes(b"written after up again")
    bw.wait_durable(NAME, 1)


def test_a_meter_stop_kept_across_up_never_stands_for_the_new_sidecars_end(bw: Bw, tmp_path: Path) -> None:
    """Review 15 (a suspicion, confirmed here): console steps shown by a `down` (not confirmed),
    then `up` again, new checkpoints, and the new sidecar crashed: `down --meter-stopped` took the
    kept meter-stop step for the sidecar seen gone, and marked the box down without a gate."""
    steps_shown_then_up_again(bw, tmp_path)
    sidecar_stops_answering(bw)
    r = bw("down", NAME, "--confirm", NAME, "--meter-stopped")
    assert r.returncode == 3, r.stderr
    assert bw.json("status")["boxes"][0]["status"] != "down"


# -- Review 16 ------------------------------------------------------------------------------------


def test_pull_never_empties_a_parts_dir_no_pull_made(bw: Bw) -> None:
    """Review 16, F03: a pull into a directory that was never a pulled tree emptied (rmtree) the
    user's own subdirectory named `.bw-parts`."""
    p = bw.up(NAME)
    (p["watch"] / "m.pt").write_bytes(b"the checkpoint")
    bw.wait_durable(NAME, 1)
    target = bw.cwd / "mine"
    (target / ".bw-parts" / "notes").mkdir(parents=True)
    (target / ".bw-parts" / "notes" / "a.txt").write_text("mine")
    (target / ".bw-parts" / "b.txt").write_text("mine too")
    bw.ok("pull", NAME, "--to", str(target))
    assert (target / "m.pt").read_bytes() == b"the checkpoint"
    assert (target / ".bw-parts" / "notes" / "a.txt").read_text() == "mine"  # only its own part
    assert (target / ".bw-parts" / "b.txt").read_text() == "mine too"  # files are cleared


def test_meter_stopped_never_vouches_for_console_steps_shown_before_up_again(bw: Bw, tmp_path: Path) -> None:
    """Review 16, F04: console steps shown by a `down` (not confirmed), then `up` again, a new
    claim pulled and verified: `down --meter-stopped` took the old showing for this teardown's and
    recorded the user's confirmation without asking."""
    steps_shown_then_up_again(bw, tmp_path)
    bw.ok("pull", NAME, "--to", str(bw.cwd / "pulled2"))
    bw.ok("verify", str(bw.cwd / "pulled2"))
    r = bw("down", NAME, "--confirm", NAME, "--meter-stopped", "--pulled", str(bw.cwd / "pulled2"))
    assert r.returncode == 1 and "meter is NOT stopped" in r.stderr, r.stderr
    assert bw.json("status")["boxes"][0]["status"] == "meter-unproven"


V1, V2 = b"weights after 1000 steps (v1)", b"weights after 100 steps of a restarted run (v2)"


def put_in_place(bw: Bw, p: dict[str, Path], rel: str, data: bytes) -> None:
    """The box writes a new file at `rel`: a temp outside the watched dir renamed into place."""
    tmp = bw.cwd / "new.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, p["watch"] / rel)


def a_new_file_takes_the_path(bw: Bw, p: dict[str, Path], rel: str, data: bytes) -> None:
    """The box writes a new file at `rel`, the box's only claim, and its copy is durable."""
    put_in_place(bw, p, rel, data)
    claimed_with(bw, data)


def kept_in_attic(p: dict[str, Path], rel: str) -> bytes:
    """The bytes of the one copy of `rel` the durable store kept aside as retired."""
    (kept,) = (p["durable"] / ".boxwarden-attic").glob(f"retired-*/{rel}")
    return kept.read_bytes()


def claimed_with(bw: Bw, data: bytes, timeout: float = 30.0) -> None:
    """Until box NAME's one claim is durable and holds `data`'s size."""
    wait_until(
        lambda: [c["size"] for c in bw.wait_durable(NAME, 1)["claims"]] == [str(len(data))],
        timeout=timeout,
        what="the new claim",
    )


def sidecar_stops(bw: Bw) -> None:
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(pid), what="the sidecar to stop")


@contextlib.contextmanager
def running(argv: list[str], **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A child process for the block; killed (and reaped) if it is still running at its end."""
    proc = subprocess.Popen(argv, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_new_file_at_the_path_of_one_deleted_on_the_box_replaces_no_copy_of_it(bw: Bw) -> None:
    """Review 16, F01: a checkpoint pulled and verified, then deleted on the box (a run restarted
    from scratch); the new run wrote a file of the same name. The sidecar renamed the new copy over
    the old durable one, the next pull replaced the retired bytes in the tree, and `down` passed:
    the old checkpoint was nowhere. Now the old copy is in the attic, and at home in .bw-replaced."""
    p, pulled = pulled_box(bw, {"best.bin": V1})
    (p["watch"] / "best.bin").unlink()
    wait_until(lambda: bw.artifacts(NAME)["claims"] == [], what="the claim to end")
    assert bw.json("pull", NAME, "--to", str(pulled))["retired"] == ["best.bin"]
    a_new_file_takes_the_path(bw, p, "best.bin", V2)
    assert (p["durable"] / "best.bin").read_bytes() == V2
    assert kept_in_attic(p, "best.bin") == V1
    report = bw.json("pull", NAME, "--to", str(pulled))
    assert report["fetched"] == ["best.bin"] and report["replaced"] == ["best.bin"]
    assert (pulled / "best.bin").read_bytes() == V2
    assert replaced_in(pulled, "best.bin") == V1  # the retired bytes stay home, aside
    bw.ok("verify", str(pulled))


def replaced_in(pulled: Path, rel: str) -> bytes:
    """The bytes a pull moved aside from `rel` (exactly one version)."""
    (kept,) = (pulled / ".bw-replaced").glob(f"{rel}.*")
    return kept.read_bytes()


def test_pull_never_destroys_bytes_at_home_that_never_became_durable(bw: Bw, tmp_path: Path) -> None:
    """Review 22, F01: a checkpoint pulled home while the durable store was full (never durable),
    then rotated on the box: its claim ended with no copy anywhere but the pulled tree, and the
    next pull replaced it there with the new bytes (`replaced`): then it was nowhere."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], check=True)
    try:
        p = bw.up(NAME, "--durable", tiny.as_uri())
        big = os.urandom(200_000)  # > 64 KiB: its push fails, the claim is never durable
        (p["watch"] / "last.bin").write_bytes(big)
        wait_until(lambda: [c for c in bw.artifacts(NAME)["claims"] if c["push_error"]], what="a push error")
        pulled = bw.cwd / "pulled"
        bw.ok("pull", NAME, "--to", str(pulled))
        (p["watch"] / "last.bin").unlink()
        (p["watch"] / "last.bin").write_bytes(b"small enough")
        claimed_with(bw, b"small enough")
        report = bw.json("pull", NAME, "--to", str(pulled))
        assert report["replaced"] == ["last.bin"]
        assert (pulled / "last.bin").read_bytes() == b"small enough"
        assert replaced_in(pulled, "last.bin") == big
        bw.ok("verify", str(pulled))
    finally:
        bw.cleanup()
        subprocess.run(["umount", str(tiny)], check=True)


def test_a_new_file_at_the_path_of_a_released_one_replaces_no_durable_copy_of_it(bw: Bw) -> None:
    """Review 16, F02: the release of a `down` that was then interrupted deleted a verified
    checkpoint on the box; training went on and wrote a file of the same name, whose copy the
    sidecar renamed over the released file's durable copy."""
    from controller.client import SidecarClient

    p, pulled = pulled_box(bw, {"best.bin": V1, "other.bin": b"o"})
    digest = json.loads((pulled / "MANIFEST.json").read_text())["digest"]
    state = State(bw.home)
    try:
        box = state.get(NAME)
    finally:
        state.close()

    async def release() -> list[str]:
        async with SidecarClient(f"unix:{box.socket}") as c:
            return sorted((await c.release(digest)).deleted)

    assert asyncio.run(release()) == ["best.bin", "other.bin"]
    a_new_file_takes_the_path(bw, p, "best.bin", V2)
    assert (p["durable"] / "best.bin").read_bytes() == V2
    assert kept_in_attic(p, "best.bin") == V1
    assert (p["durable"] / "other.bin").read_bytes() == b"o"  # the copy of a file no new one replaced stays


def test_a_deleted_checkpoint_whose_bytes_another_file_holds_is_still_kept_aside(bw: Bw) -> None:
    """Review 17, F01: `step-100.bin` copied to `best.bin`, then deleted (a restart from scratch);
    the new run wrote `step-100.bin` and then a new `best.bin`. The old copy was not kept aside
    because `best.bin` held the same bytes, and the rewrite of `best.bin` superseded those: the
    old checkpoint was nowhere."""
    p = bw.up(NAME)
    (p["watch"] / "step-100.bin").write_bytes(V1)
    (p["watch"] / "best.bin").write_bytes(V1)
    bw.wait_durable(NAME, 2)
    (p["watch"] / "step-100.bin").unlink()
    wait_until(
        lambda: [c["path"] for c in bw.wait_durable(NAME, 1)["claims"]] == ["best.bin"], what="the end"
    )
    put_in_place(bw, p, "step-100.bin", V2)
    bw.wait_durable(NAME, 2)
    (p["watch"] / "best.bin").write_bytes(V2)
    wait_until(
        lambda: {c["size"] for c in bw.wait_durable(NAME, 2)["claims"]} == {str(len(V2))}, what="new best"
    )
    assert kept_in_attic(p, "step-100.bin") == V1
    assert (p["durable"] / "best.bin").read_bytes() == V2


# -- Review 18 ------------------------------------------------------------------------------------


def test_up_refuses_a_durable_store_that_folds_case(bw: Bw, case_insensitive_dir: Path) -> None:
    """Review 18, F01: a durable store on a case-insensitive filesystem (SMB, exFAT, casefold)
    let a new `step-100.bin` replace the kept copy of a deleted `Step-100.bin`: one name there."""
    durable = case_insensitive_dir / "durable"
    durable.mkdir()
    r = bw(*up_args(bw, "--durable", durable.as_uri()))
    assert r.returncode != 0, r.stdout
    assert "takes names that differ only in case for one file" in r.stderr, r.stderr
    assert not bw.sidecar_pids()


# -- Review 19 ------------------------------------------------------------------------------------


def test_a_checkpoint_dir_moved_out_of_the_watched_tree_keeps_its_copies(bw: Bw) -> None:
    """Review 19, F01: `ckpt/latest/` moved to a trash dir outside the tree, and a new
    `ckpt/latest/model.bin` written: the directory event only asked for a (delayed) rescan, so
    the new file superseded the old claim as if it were a rewrite, and its copy replaced the old."""
    p = bw.up(NAME)
    (p["watch"] / "latest").mkdir()
    (p["watch"] / "latest" / "model.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    trash = bw.cwd / "trash"
    trash.mkdir()
    os.rename(p["watch"] / "latest", trash / "latest.old")
    (p["watch"] / "latest").mkdir()  # at once: a new run writes the same path
    a_new_file_takes_the_path(bw, p, "latest/model.bin", V2)
    assert kept_in_attic(p, "latest/model.bin") == V1
    assert (p["durable"] / "latest" / "model.bin").read_bytes() == V2


def test_a_watched_dir_moved_aside_and_made_again_keeps_the_old_copies_and_is_watched(bw: Bw) -> None:
    """Review 19, F02: `mv ckpt ckpt-run1 && mkdir ckpt` before a new run: nothing watched the new
    `ckpt` (the watch followed the old one), and the periodic rescan took the new `last.bin` for a
    rewrite of the old one, whose durable copy it replaced."""
    p = bw.up(NAME)
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    os.rename(p["watch"], bw.cwd / "ckpt-run1")
    p["watch"].mkdir()
    put_in_place(bw, p, "last.bin", V2)
    claimed_with(bw, V2, timeout=60)  # found by the periodic rescan
    assert kept_in_attic(p, "last.bin") == V1
    # The new directory is watched: a file written there now is sealed without waiting for a rescan.
    (p["watch"] / "next.bin").write_bytes(b"next")
    bw.wait_durable(NAME, 2, timeout=8)


def test_a_file_deleted_and_written_again_at_once_keeps_its_copy(bw: Bw) -> None:
    """The same leaving as above for one file: deleted, and a new one written at its name before
    the sidecar looked (the deletion is reported, so the new file is no rewrite of the old)."""
    p = bw.up(NAME)
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    (p["watch"] / "last.bin").unlink()
    (p["watch"] / "last.bin").write_bytes(V2)
    claimed_with(bw, V2)
    assert kept_in_attic(p, "last.bin") == V1


def test_a_file_replaced_in_one_step_supersedes_its_copy(bw: Bw) -> None:
    """A temp renamed over `last.bin` (how trainers save atomically) is a rewrite: the path holds
    its newest bytes, and the attic does not grow by one checkpoint per save."""
    p = bw.up(NAME)
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    (p["watch"] / "last.bin.tmp").write_bytes(V2)
    os.replace(p["watch"] / "last.bin.tmp", p["watch"] / "last.bin")
    claimed_with(bw, V2)
    assert (p["durable"] / "last.bin").read_bytes() == V2
    assert not (p["durable"] / ".boxwarden-attic").exists()


# -- Review 20 ------------------------------------------------------------------------------------

BURST = """
import os, sys
d = sys.argv[1]
def burst(a, b):
    for i in range(a, b):
        os.close(os.open(f"{d}/cache/c{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))
burst(0, 20000)
os.unlink(f"{d}/last.bin")
with open(f"{d}/last.bin", "wb") as f:
    f.write(sys.argv[2].encode())
burst(20000, 40000)
"""


def test_a_rotation_inside_a_burst_the_kernel_dropped_keeps_the_old_copy(bw: Bw) -> None:
    """Review 20, F01: files written to an excluded cache overflowed the kernel's inotify queue
    (16,384 events), and the deletion of `last.bin` in its middle was never reported: the rescan
    took the new `last.bin` for a rewrite and its copy replaced the old one."""
    (bw.cwd / "ckpt" / "cache").mkdir(parents=True)
    p = bw.up(NAME, "--exclude", "cache/*")
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1, pending_ok=True)
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGSTOP)  # a stalled sidecar (swapped out, starved): nothing drains the queue
    try:
        subprocess.run([sys.executable, "-c", BURST, str(p["watch"]), V2.decode()], check=True, timeout=120)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(
        lambda: [c["size"] for c in bw.wait_durable(NAME, 1, pending_ok=True)["claims"]] == [str(len(V2))],
        timeout=90,
        what="the new claim",
    )
    assert "events were lost" in (p["box_dir"] / "sidecar.log").read_text()  # the burst did overflow
    assert kept_in_attic(p, "last.bin") == V1


def test_a_watched_dir_moved_elsewhere_and_linked_back_holds_the_gate(bw: Bw) -> None:
    """Review 20, F02: `mv ckpt /mnt/big/ckpt && ln -s /mnt/big/ckpt ckpt` (the classic fix for a
    full disk): the sidecar re-watched the link, not the directory, so nothing reported a file's
    leaving there, and the dry run said ALLOWED."""
    p, _ = pulled_box(bw, {"last.bin": V1})
    big = bw.cwd / "big"
    big.mkdir()
    os.rename(p["watch"], big / "ckpt")
    os.symlink(big / "ckpt", p["watch"])

    def refused() -> list[dict[str, Any]]:
        doc = dry(bw)
        return [] if doc["allowed"] else doc["reasons"]

    reasons = wait_until(refused, what="the gate to refuse")
    assert any("is a symlink now" in r["detail"] for r in reasons), reasons


def test_a_file_changed_while_the_sidecar_was_down_keeps_its_old_copy(bw: Bw) -> None:
    """Nothing reported how `last.bin` changed while no sidecar ran (deleted and written again, or
    rewritten): taken for a rewrite, its new copy replaced the old one; now the old one is kept."""
    p = bw.up(NAME)
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    sidecar_stops(bw)
    (p["watch"] / "last.bin").unlink()
    (p["watch"] / "last.bin").write_bytes(V2)
    bw.ok(*up_args(bw))
    claimed_with(bw, V2)
    assert kept_in_attic(p, "last.bin") == V1


# -- Review 21 ------------------------------------------------------------------------------------

SLOW_WRITER = """
import sys
with open(sys.argv[1], "wb") as f:
    f.write(sys.argv[2].encode()[:8])
    f.flush()
    sys.stdin.readline()  # until the test says so: the sidecar is up again by then
    f.write(sys.argv[2].encode()[8:])
"""


def test_a_file_deleted_while_the_sidecar_was_down_and_written_after_keeps_the_old_copy(bw: Bw) -> None:
    """Review 21, F01: the sidecar down, `last.bin` deleted and its next save begun; the save went on
    after `up`. Its write events marked the path "written", and the new inode was taken for a
    rewrite of the claimed one: the old copy was replaced."""
    p = bw.up(NAME)
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    sidecar_stops(bw)
    (p["watch"] / "last.bin").unlink()
    argv = [sys.executable, "-c", SLOW_WRITER, str(p["watch"] / "last.bin"), V2.decode()]
    with running(argv, stdin=subprocess.PIPE) as writer:
        wait_until(lambda: (p["watch"] / "last.bin").exists(), what="the save to begin")
        bw.ok(*up_args(bw))
        assert writer.stdin is not None
        writer.stdin.write(b"go\n")
        writer.stdin.close()
        assert writer.wait(timeout=30) == 0
    claimed_with(bw, V2)
    assert kept_in_attic(p, "last.bin") == V1


ODD_NAMED_WRITER = """
import sys, time
for i in range(60):
    with open(sys.argv[1], "wb") as f:
        f.write(b"step %d" % i)
    time.sleep(0.1)
"""


def test_a_file_named_like_the_sealers_own_chores_hides_no_deletion(bw: Bw) -> None:
    """Review 21, F02: the sealer kept its own chores and the seals in one table, keyed by text: while
    a file named `gone:last.bin` was being sealed, the report that `last.bin` was deleted was
    dropped, and the next `last.bin` replaced the old copy."""
    p = bw.up(NAME)
    (p["watch"] / "last.bin").write_bytes(V1)
    bw.wait_durable(NAME, 1)
    with running([sys.executable, "-c", ODD_NAMED_WRITER, str(p["watch"] / "gone:last.bin")]) as writer:
        wait_until(lambda: (p["watch"] / "gone:last.bin").exists(), what="the odd-named writer")
        (p["watch"] / "last.bin").unlink()
        (p["watch"] / "last.bin").write_bytes(V2)
        assert writer.wait(timeout=60) == 0
    wait_until(
        lambda: (
            {c["path"]: c["size"] for c in bw.wait_durable(NAME, 2)["claims"]}.get("last.bin") == str(len(V2))
        ),
        what="the new claim",
    )
    assert kept_in_attic(p, "last.bin") == V1
