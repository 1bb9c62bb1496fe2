"""Issue 25, finding 5: boxwarden's own processes never hold a local box's `down`, and a process that
does is named as a stray (STRAY_PROCESS), never called a job. A real `boxwarden watch` opened in the
workdir, a real `down ... | tail` under job control (and the same without it, where a trainer in the
background must still count), boxwarden's own followers of another box (`run --wait`, `drain --wait`,
`down --when-safe`) started there, and a real ControlMaster started by `up` of a remote box (the sshd
fixture) from a local box's workdir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Bw, pid_alive, wait_until
from tests.test_remote_e2e import (  # noqa: F401 - fixtures
    Remote,
    _link_pids,
    remote,
    venv_template,
    wheel_cache,
    write_as_box,
)
from tests.test_review4_e2e import NAME
from tests.test_review7_e2e import settled, stray_reasons

CLI = [sys.executable, "-m", "controller"]


@pytest.mark.parametrize("command", [["watch", NAME, "--interval", "0.5"], ["events", NAME, "-f"]])
def test_a_watch_opened_in_the_workdir_never_holds_down(bw: Bw, command: list[str]) -> None:
    settled(bw)
    watch = subprocess.Popen(
        [*CLI, *command],
        cwd=bw.cwd,  # the box's workdir
        env=bw.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # (it loads the CLI first: a minute on a loaded machine is not a failure)
        wait_until(
            lambda: os.readlink(f"/proc/{watch.pid}/cwd") == "/", timeout=60, what="it to leave the workdir"
        )
        r = bw("down", NAME, "--confirm", NAME, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["teardown"]["gone"] is True
        assert watch.poll() is None  # it watched all along
    finally:
        watch.kill()
        watch.wait()


def test_boxwardens_followers_of_another_box_started_in_the_workdir_never_hold_down(
    bw: Bw, tmp_path: Path
) -> None:
    """`run --wait`, `drain --wait` and `down --when-safe` of another box may follow it for hours:
    started in this box's workdir, each leaves it (for "/") once its paths are resolved."""
    settled(bw)
    other = tmp_path / "otherwork"
    other.mkdir()
    bw.ok("up", "y", "--profile", "local", "--workdir", str(other), "--watch", "ckpt")
    (other / "ckpt" / "cell-a").mkdir(parents=True)
    os.symlink("/etc/hostname", other / "ckpt" / "cell-a" / "link.pt")  # never claimed: both wait on
    # A checkpoint still being written: the drain waits on it (an unclaimable entry it does not).
    writing = (other / "ckpt" / "cell-a" / "w.bin").open("wb")
    commands = [
        ["run", "y", "--cell", "c1", "--cell", "c2", "--wait", "--", "sleep", "60"],
        ["drain", "y", "--wait", "--timeout", "120"],
        ["down", "y", "--confirm", "y", "--when-safe", "--pull-to", "pulled-y", "--poll", "1"],
    ]
    procs = [
        subprocess.Popen(
            [*CLI, *argv], cwd=bw.cwd, env=bw.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        for argv in commands
    ]
    try:
        for proc in procs:

            def left(proc: subprocess.Popen[bytes] = proc) -> bool:
                assert proc.poll() is None, f"{proc.args} ended"
                return os.readlink(f"/proc/{proc.pid}/cwd") == "/"

            wait_until(left, timeout=60, what="it to leave the workdir")
        assert stray_reasons(bw) == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        writing.close()


def in_a_shell(
    bw: Bw, tmp_path: Path, *, job_control: bool, trainer: bool, dry_run: bool
) -> tuple[int, str, int]:
    """`boxwarden down NAME ... | tail` run by a shell standing in the workdir, with job control
    (`set -m`: the pipeline is a process group of its own) or without (one group for all), and a
    trainer (`sleep 600 &`) started by that shell before it. Returns the exit status, what the
    pipeline printed (`tail` passes `down --json`'s document) and the trainer's pid (0 without one)."""
    pid_file = tmp_path / "trainer.pid"
    script = "set -o pipefail; " + ("set -m; " if job_control else "")
    if trainer:
        script += 'sleep 600 </dev/null >/dev/null 2>&1 & echo $! > "$0"; '
    script += '"$@" | tail -n 1000'
    how = ["--dry-run"] if dry_run else ["--confirm", NAME]
    r = subprocess.run(
        ["bash", "-c", script, str(pid_file), *CLI, "down", NAME, *how, "--json"],
        cwd=bw.cwd,
        env=bw.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, r.stdout or r.stderr, int(pid_file.read_text()) if trainer else 0


def strays(out: str) -> list[dict[str, Any]]:
    doc = json.loads(out)
    assert not [x for x in doc["reasons"] if x["code"] == "JOB_RUNNING"], doc  # no job runs
    return [x for x in doc["reasons"] if x["code"] == "STRAY_PROCESS"]


def test_down_piped_to_tail_under_job_control_passes_in_the_workdir(bw: Bw, tmp_path: Path) -> None:
    settled(bw)
    code, out, _ = in_a_shell(bw, tmp_path, job_control=True, trainer=False, dry_run=False)
    assert code == 0, out
    assert json.loads(out)["teardown"]["gone"] is True


@pytest.mark.parametrize("job_control", [True, False])
def test_a_trainer_the_shell_started_in_the_workdir_still_holds_down(
    bw: Bw, tmp_path: Path, job_control: bool
) -> None:
    settled(bw)
    try:
        code, out, trainer = in_a_shell(bw, tmp_path, job_control=job_control, trainer=True, dry_run=True)
        assert code == 3, out
        found = strays(out)
        assert any(f"pid {trainer} (sleep 600) works in {bw.cwd}" in x["detail"] for x in found), found
        # The pipeline's tail is the user's one command line only where the shell made it a group.
        assert any("(tail -n 1000)" in x["detail"] for x in found) is not job_control, found
    finally:
        if (tmp_path / "trainer.pid").exists():
            os.kill(int((tmp_path / "trainer.pid").read_text()), signal.SIGKILL)


def test_without_job_control_the_pipeline_is_looked_at(bw: Bw, tmp_path: Path) -> None:
    """A script's `down | tail` shares its group with whatever else the script started: nothing
    tells the pipeline apart, so its tail standing in the workdir is named, and so is the shell,
    which waits for more than the controller."""
    settled(bw)
    code, out, _ = in_a_shell(bw, tmp_path, job_control=False, trainer=False, dry_run=True)
    assert code == 3, out
    found = sorted(x["detail"].split(") works in")[0] for x in strays(out))
    assert len(found) == 2 and found[0].startswith("pid ") and "(bash -c set -o pipefail;" in found[0], found
    assert found[1].endswith("(tail -n 1000"), found


JOINS_THE_TRAINERS_GROUP = """
import pathlib, subprocess, sys
out = subprocess.DEVNULL
trainer = subprocess.Popen(["sleep", "600"], cwd=sys.argv[1], process_group=0, stdout=out, stderr=out)
pathlib.Path(sys.argv[2]).write_text(str(trainer.pid))
sys.exit(subprocess.run(sys.argv[3:], process_group=trainer.pid).returncode)
"""


def test_a_trainer_whose_group_down_joins_is_no_member_of_its_command_line(bw: Bw, tmp_path: Path) -> None:
    """A group of its own is not enough: a program that starts `down` in the group of a trainer it
    started (no pipeline: no pipe joins them) must not exempt that trainer."""
    settled(bw)
    pid_file = tmp_path / "trainer.pid"
    cli = [*CLI, "down", NAME, "--dry-run", "--json"]
    try:
        r = subprocess.run(
            [sys.executable, "-c", JOINS_THE_TRAINERS_GROUP, str(bw.cwd), str(pid_file), *cli],
            cwd=tmp_path,
            env=bw.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        trainer = int(pid_file.read_text())
        assert r.returncode == 3, r.stdout + r.stderr
        (found,) = strays(r.stdout)
        assert found["detail"].startswith(f"pid {trainer} (sleep 600) works in {bw.cwd}"), found
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_control_master_started_in_a_local_boxs_workdir_works_in_root(remote: Remote) -> None:  # noqa: F811
    bw = remote.bw
    settled(bw)  # a local box whose workdir is where the commands run
    box = remote.boxes("m1")
    remote.up(box, seeded=True)  # run in that workdir
    (master,) = _link_pids(bw, box, 0, "master")
    assert os.readlink(f"/proc/{master}/cwd") == "/"
    r = bw("down", NAME, "--confirm", NAME, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert pid_alive(master)  # the other box's link goes on


def test_a_teardown_continued_without_its_sidecar_closes_the_link_it_opened(
    remote: Remote,  # noqa: F811
) -> None:
    """The finding: `exit_master` ran only after a teardown that returned; a teardown continued
    while the sidecar does not answer (`down` again, or `--meter-stopped`) opened a master to ask
    and left it running."""
    bw = remote.bw
    remote.profile.write_text(remote.profile.read_text().replace("timeout_s = 30", "timeout_s = 1"))
    box = remote.boxes("m2")
    remote.provider("create", f"i-{box.alias}", "--stuck")  # the provider never shows it gone
    remote.up(box, seeded=True)
    write_as_box(box, "ckpt/a.bin", "weights")
    bw.wait_durable(box.alias, 1)
    pulled = bw.cwd.parent / "pulled"
    bw.ok("pull", box.alias, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    first = bw("down", box.alias, "--confirm", box.alias, "--json")
    assert first.returncode == 1, first.stdout + first.stderr  # the meter stop not proven
    assert not _link_pids(bw, box, 0, "master")
    again = bw("down", box.alias, "--confirm", box.alias, "--json")
    assert again.returncode == 3, again.stdout + again.stderr  # still not gone: refused
    assert not _link_pids(bw, box, 0, "master")


def test_another_boxs_sidecar_holding_its_state_in_the_workdir_is_no_stray(bw: Bw, tmp_path: Path) -> None:
    """Review of issue 25: two boxes whose workdir holds this machine's box state (a remote box's
    default workdir is its home, and its state is ~/.boxwarden): box sc's `down` was refused as
    STRAY_PROCESS because box sd's sidecar held its own log open there."""
    for n in ("sc", "sd"):
        bw.ok("up", n, "--profile", "local", "--workdir", str(tmp_path), "--watch", f"work/ckpt-{n}")
    (tmp_path / "work" / "ckpt-sc" / "a.bin").write_bytes(b"weights")
    bw.wait_durable("sc", 1)
    pulled = tmp_path / "pulled-sc"
    bw.ok("pull", "sc", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    doc = bw.json("down", "sc", "--dry-run")
    assert doc["allowed"] is True, doc["reasons"]
