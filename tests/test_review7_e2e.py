"""Adversarial review 7: each test is a way the real CLI allowed `down` wrongly before its fix
(the findings are in issue 6's closing note): processes that did their work where the gate did
not look."""

from __future__ import annotations

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

from tests.conftest import Bw, pid_alive, wait_until
from tests.test_review4_e2e import NAME, dry, pulled_box


def settled(bw: Bw) -> dict[str, Path]:
    """A box with one durable file, pulled and verified: only what the test adds may refuse."""
    p, _ = pulled_box(bw, {"a.bin": b"a"})
    assert dry(bw)["allowed"] is True
    return p


def running_reasons(bw: Bw) -> list[dict[str, Any]]:
    return [r for r in dry(bw)["reasons"] if r["code"] == "JOB_RUNNING"]


def stray_reasons(bw: Bw) -> list[dict[str, Any]]:
    return [r for r in dry(bw)["reasons"] if r["code"] == "STRAY_PROCESS"]


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def aliased(source: Path, alias: Path, ns: str, code: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """Python `code` run with `args` once `source` is bind-mounted at `alias`: in our own mount
    namespace ("here": unmounted afterwards) or in a private one (it goes with the process)."""
    run = f'exec {sys.executable} -c "$0" "$@"'
    if ns == "here":
        subprocess.run(["mount", "--bind", str(source), str(alias)], check=True)
        argv = ["sh", "-c", run, code, *args]
    else:
        script = f'mount --bind "{source}" "{alias}" && {run}'
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, code, *args]
    proc = subprocess.Popen(argv)
    try:
        yield proc
    finally:
        kill(proc)
        if ns == "here":
            subprocess.run(["umount", str(alias)], check=True)


# -- F2: an orphan given to a job that had already ended, and the sidecar's subtree exempt ---------

KILLS_ITS_KEEPER = """
import os, signal, sys, time
go, pid_file = sys.argv[1], sys.argv[2]
if not sys.argv[3].isdigit():  # the job's leader: later, start a child with a clean environment, and exit
    while not os.path.exists(go + ".fork"):
        time.sleep(0.05)
    leader = str(os.getpid())
    if os.fork() == 0:
        os.execve(sys.executable, [sys.executable, "-c", sys.argv[3], go, pid_file, leader], {})
    sys.exit(0)
leader = int(sys.argv[3])
while not os.path.exists(go) or os.getppid() == leader:  # then the keeper's child, untagged
    time.sleep(0.05)
keeper = os.getppid()
os.kill(keeper, signal.SIGKILL)  # its orphans now go to the sidecar
while os.getppid() == keeper:
    time.sleep(0.01)
os.setsid()  # and a session of its own
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pid_file + ".tmp", pid_file)
time.sleep(600)
"""


def test_an_orphan_stays_with_the_running_job_when_a_later_job_has_ended(tmp_path: Path, bw: Bw) -> None:
    """Review 7, F2: the sidecar gave an orphan to the newest job started before it, one that had
    already ended, so no running job had it; and every process under the sidecar was exempt from
    the stray rule, so nothing held the gate while it worked in the workdir."""
    settled(bw)
    go, pid_file = tmp_path / "go", tmp_path / "orphan.pid"
    a = json.loads(
        bw.ok(
            "run",
            NAME,
            "--json",
            "--",
            sys.executable,
            "-c",
            KILLS_ITS_KEEPER,
            str(go),
            str(pid_file),
            KILLS_ITS_KEEPER,
        ).stdout
    )
    b = json.loads(bw.ok("run", NAME, "--json", "--", "true").stdout)  # starts after A, ends at once
    wait_until(lambda: not any(b["id"] in r["detail"] for r in running_reasons(bw)), what="job B to end")
    (tmp_path / "go.fork").touch()  # A's child starts after B did
    go.touch()
    orphan = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), what="the orphan"))
    try:
        (sidecar,) = bw.sidecar_pids()
        ppid = Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]
        assert int(ppid) == sidecar
        (reason,) = running_reasons(bw)
        assert f"job {a['id']} " in reason["detail"] and f" {orphan}" in reason["detail"], reason
    finally:
        os.kill(orphan, signal.SIGKILL)
        wait_until(lambda: not pid_alive(orphan), what="the orphan gone")


# -- F3: a process whose main thread exited while another thread works on --------------------------

MAIN_THREAD_EXITS = """
import ctypes, os, sys, threading, time
os.chdir(sys.argv[1])
ready = sys.argv[2]
def worker():
    time.sleep(600)
threading.Thread(target=worker).start()
open(ready, "w").close()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_main_thread_exited_is_still_a_stray(tmp_path: Path, bw: Bw) -> None:
    """Review 7, F3: /proc/PID/stat reads Z once the main thread exits (pthread_exit), and the
    stray rule skipped zombies, while another thread of it still worked in the workdir."""
    p = settled(bw)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", MAIN_THREAD_EXITS, str(p["watch"]), str(ready)])
    try:
        wait_until(ready.exists, what="the main thread to exit")
        wait_until(
            lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", what="Z"
        )
        (reason,) = stray_reasons(bw)
        assert f"pid {proc.pid} " in reason["detail"] and f"works in {p['watch']}" in reason["detail"]
    finally:
        kill(proc)


# -- F4: an O_TMPFILE in the watched dir, held by a process that works elsewhere ------------------

HOLDS_A_TMPFILE = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_TMPFILE | os.O_WRONLY, 0o644)  # can be linked in later
os.write(fd, b"the final checkpoint")
os.chdir("/")
open(sys.argv[2], "w").close()
time.sleep(600)
"""


def test_a_process_holding_an_anonymous_file_in_the_watched_dir_is_a_stray(tmp_path: Path, bw: Bw) -> None:
    p = settled(bw)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", HOLDS_A_TMPFILE, str(p["watch"]), str(ready)])
    try:
        wait_until(ready.exists, what="the anonymous file")
        (reason,) = stray_reasons(bw)
        assert f"pid {proc.pid} " in reason["detail"] and f"holds {p['watch']}/#" in reason["detail"]
        assert "(deleted)" in reason["detail"]
    finally:
        kill(proc)


# -- F5: the program that runs `down` keeps working while it waits ---------------------------------

RUNS_DOWN_WHILE_TRAINING = """
import json, os, subprocess, sys, threading, time
os.chdir(sys.argv[1])
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # "the training thread"
r = subprocess.run(sys.argv[2:], capture_output=True, text=True)
print(r.stdout)
"""


def test_an_ancestor_that_runs_on_while_down_runs_is_a_stray(bw: Bw) -> None:
    """Review 7, F5: every ancestor of the controller was exempt, so a notebook kernel training in a
    thread that ran `!boxwarden down` was never looked at. An ancestor that only waits (a shell)
    still is exempt."""
    p = settled(bw)
    cli = [sys.executable, "-m", "controller", "down", NAME, "--dry-run", "--json"]
    r = subprocess.run(
        [sys.executable, "-c", RUNS_DOWN_WHILE_TRAINING, str(p["watch"]), *cli],
        env=bw.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    doc = json.loads(r.stdout)
    reasons = [x for x in doc["reasons"] if x["code"] == "STRAY_PROCESS"]
    assert len(reasons) == 1 and f"works in {p['watch']}" in reasons[0]["detail"], doc
    # A shell standing in the watched dir that runs `down` only waits for it: not a stray.
    shell = subprocess.run(
        ["sh", "-c", 'cd "$1" && shift && "$@"', "sh", str(p["watch"]), *cli],
        env=bw.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(shell.stdout)["allowed"] is True, shell.stdout + shell.stderr


# -- F1: after a sidecar restart, a job kills its keeper and starts a session with no trace --------


def test_a_job_that_kills_its_keeper_after_a_restart_holds_the_gate_until_stopped(
    tmp_path: Path, bw: Bw
) -> None:
    """Review 7, F1: once the sidecar had restarted it was no longer above the keeper, so the
    orphans of a killed keeper went to init; one that cleared its environment and started a
    session of its own belonged to no job, and `down` went ahead. A keeper gone without having
    recorded its job's end now keeps the job running until `boxwarden stop`."""
    settled(bw)
    go, pid_file = tmp_path / "go", tmp_path / "orphan.pid"
    argv = [sys.executable, "-c", KILLS_ITS_KEEPER, str(go), str(pid_file), KILLS_ITS_KEEPER]
    job = json.loads(bw.ok("run", NAME, "--json", "--", *argv).stdout)
    (tmp_path / "go.fork").touch()
    wait_until(lambda: any("live: none" not in r["detail"] for r in running_reasons(bw)), what="the child")
    (sidecar,) = bw.sidecar_pids()
    os.kill(sidecar, signal.SIGKILL)
    wait_until(lambda: not pid_alive(sidecar), what="the sidecar gone")
    bw.up(NAME)
    go.touch()
    orphan = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), what="the orphan"))
    try:
        (reason,) = wait_until(lambda: [r for r in running_reasons(bw) if "keeper" in r["detail"]], what="it")
        assert f"job {job['id']} " in reason["detail"]
        assert f"boxwarden stop {NAME} {job['id']}" in reason["detail"]
    finally:
        os.kill(orphan, signal.SIGKILL)
        wait_until(lambda: not pid_alive(orphan), what="the orphan gone")
    # Nothing of it is left, but nothing can show that: it holds the gate until stopped by hand.
    (reason,) = running_reasons(bw)
    assert f"job {job['id']} " in reason["detail"] and "live: none seen" in reason["detail"]
    stopped = json.loads(bw.ok("stop", NAME, job["id"], "--json").stdout)
    assert stopped["state"] == "stopped"
    assert dry(bw)["allowed"] is True


# -- review 8, finding 2: a watched dir held open under another name ------------------------------

HOLDS_OPEN = """
import os, sys, time
target, ready = sys.argv[1], sys.argv[2]
fd = os.open(target, os.O_RDONLY)  # a directory, or a file in it
os.chdir("/")
open(ready, "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize("held", ["ckpt", "ckpt/a.bin"])
@pytest.mark.parametrize("where", ["alias", "namespace"])
def test_a_watched_dir_held_open_under_another_name_makes_a_stray(
    tmp_path: Path, bw: Bw, held: str, where: str
) -> None:
    """Review 8, finding 2: the working directory was compared by device and inode, but open files
    only by path: a process holding the watched dir (or a file in it) open through a bind-mount
    alias, here or in a container's own mount namespace, was not a stray."""
    settled(bw)
    alias, ready = tmp_path / "alias", tmp_path / "ready"
    alias.mkdir()
    ns = "here" if where == "alias" else "namespace"
    with aliased(bw.cwd, alias, ns, HOLDS_OPEN, f"{alias}/{held}", str(ready)) as proc:
        wait_until(ready.exists, what="the process holding it")
        (reason,) = stray_reasons(bw)
        assert f"pid {proc.pid} " in reason["detail"] and f"holds {alias}/{held} open" in reason["detail"]


# -- review 9: a subdirectory of a watched dir under another name; `exec boxwarden down` -----------

WORKS_OR_HOLDS = """
import os, sys, time
how, where, ready = sys.argv[1:4]
if how == "cwd":
    os.chdir(where)
else:  # an anonymous file there, which linkat() could put in place later
    fd = os.open(where, os.O_TMPFILE | os.O_WRONLY, 0o644)
    os.chdir("/")
open(ready, "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize(("how", "ns"), [("cwd", "here"), ("cwd", "namespace"), ("tmpfile", "here")])
def test_a_bind_mount_of_a_watched_subdirectory_is_seen_as_the_watched_dir(
    tmp_path: Path, bw: Bw, how: str, ns: str
) -> None:
    """Review 9, finding 1: from the root of a bind mount of ckpt/sub, ".." leads to the mount
    point's parent, never through ckpt: a process working there (or holding an anonymous file
    there) under the alias was not a stray. Where a path lies in its filesystem, read from the
    process's mountinfo, says it is inside ckpt."""
    p = settled(bw)
    sub, alias, ready = p["watch"] / "sub", tmp_path / "alias", tmp_path / "ready"
    sub.mkdir()
    alias.mkdir()
    with aliased(sub, alias, ns, WORKS_OR_HOLDS, how, str(alias), str(ready)) as proc:
        wait_until(ready.exists, what="the process in the alias")
        (reason,) = wait_until(lambda: stray_reasons(bw), what="it counted")
        assert f"pid {proc.pid} " in reason["detail"] and str(alias) in reason["detail"], reason


def test_a_process_the_shell_started_before_it_execd_down_is_a_stray(tmp_path: Path, bw: Bw) -> None:
    """Review 9, finding 2: the controller's descendants were exempt, and after `exec boxwarden
    down` a trainer the shell had started in the workdir is one of them."""
    p = settled(bw)
    cli = f"{sys.executable} -m controller down {NAME} --dry-run --json"
    pid_file = tmp_path / "sleeper.pid"
    r = subprocess.run(
        ["sh", "-c", f"sleep 600 </dev/null >/dev/null 2>&1 & echo $! > {pid_file}; exec {cli}"],
        cwd=p["watch"],
        env=bw.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    sleeper = int(pid_file.read_text())
    try:
        doc = json.loads(r.stdout)
        reasons = [x for x in doc["reasons"] if x["code"] == "STRAY_PROCESS"]
        assert len(reasons) == 1 and f"pid {sleeper} (sleep 600)" in reasons[0]["detail"], doc
    finally:
        os.kill(sleeper, signal.SIGKILL)


# -- review 10, finding 1: a pulled tree that shows the box's own files through a mount ------------


@pytest.mark.parametrize("how", ["bind-inside", "bind-at-root", "overlay"])
def test_a_pulled_tree_that_shows_the_watched_files_through_a_mount_is_refused(
    tmp_path: Path, bw: Bw, how: str
) -> None:
    """Review 10, finding 1: with a subdirectory of the watched dir bind-mounted inside (or at) the
    pulled tree, or an overlay over it whose lower layer is the watched dir, `pull` found every
    file "already present", `verify` passed, and `down` deleted the only copy outside durable."""
    p = bw.up(NAME)
    sub = p["watch"] / "run1"
    sub.mkdir()
    (sub / "x.bin").write_bytes(os.urandom(5000))
    bw.wait_durable(NAME, 1)
    pulled, mounted = tmp_path / "pulled", tmp_path / "pulled"
    pulled.mkdir()
    if how == "bind-inside":
        mounted = pulled / "run1"
        mounted.mkdir()
        subprocess.run(["mount", "--bind", str(sub), str(mounted)], check=True)
    elif how == "bind-at-root":
        subprocess.run(["mount", "--bind", str(sub), str(pulled)], check=True)
    else:
        upper, work = tmp_path / "upper", tmp_path / "ovl-work"
        upper.mkdir()
        work.mkdir()
        opts = f"lowerdir={p['watch']},upperdir={upper},workdir={work}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(pulled)], check=True)
    try:
        r = bw("pull", NAME, "--to", str(pulled))
        assert r.returncode == 2 and "refusing to pull" in r.stderr, r.stdout + r.stderr
        # And the gate, for a tree pulled before the mount was made.
        doc = json.loads(bw("down", NAME, "--dry-run", "--json", "--pulled", str(pulled)).stdout)
        assert "EVIDENCE_OVERLAP" in {x["code"] for x in doc["reasons"]}, doc
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    assert (sub / "x.bin").exists()


# -- review 10, finding 2: a dead FUSE (or network) mount inside a watched dir ---------------------


@contextlib.contextmanager
def dead_fuse(point: Path) -> Iterator[None]:
    """A FUSE filesystem at `point` that never answers (as one does once its server or network is
    gone): every look inside blocks until the connection is aborted, which closing its fd does."""
    fd = os.open("/dev/fuse", os.O_RDWR)
    try:
        opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0"
        subprocess.run(
            ["mount", "-t", "fuse", "-o", opts, "deadfuse", str(point)], pass_fds=(fd,), check=True
        )
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        os.close(fd)
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_a_dead_mount_inside_a_watched_dir_is_reported_never_entered(bw: Bw) -> None:
    """The walk of the watched dirs looked at every mount point it had already found in mountinfo:
    one that does not answer hung it, and every listing with it (SIDECAR_UNREACHABLE)."""
    p = bw.up(NAME)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    remote = p["watch"] / "remote"
    remote.mkdir()
    with dead_fuse(remote):
        listing = bw.artifacts(NAME)
        assert [c["path"] for c in listing["claims"]] == ["a.bin"]
        (entry,) = [e for e in listing["pending"] if e["path"] == "remote"]
        assert "mount point" in entry["detail"], entry


# -- review 11: a process that watches a watched dir for changes (and writes when it sees one) ----

WATCHES = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
assert libc.inotify_add_watch(fd, sys.argv[1].encode(), 0x200 | 0x100 | 0x8) >= 0, ctypes.get_errno()
os.chdir("/")
open(sys.argv[2], "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize("watched", ["ckpt", "ckpt/sub"])
def test_a_process_watching_a_watched_dir_with_inotify_is_a_stray(
    tmp_path: Path, bw: Bw, watched: str
) -> None:
    """Review 11, finding 1: an agent that waits for the release's deletes and then writes a
    checkpoint held nothing open but an inotify mark on the watched dir; `down` went ahead."""
    p = settled(bw)
    (p["watch"] / "sub").mkdir()
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", WATCHES, str(bw.cwd / watched), str(ready)])
    try:
        wait_until(ready.exists, what="the watch")
        (reason,) = wait_until(lambda: stray_reasons(bw), what="it counted")
        assert f"pid {proc.pid} " in reason["detail"] and "watches a directory there" in reason["detail"]
    finally:
        kill(proc)
