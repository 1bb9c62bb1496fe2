"""Adversarial reviews 4 and 5: each test is a way the real CLI lost data, allowed `down` wrongly
or refused wrongly before its fix (the findings are in issue 6's closing note)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from controller.state import State
from controller.teardown import RELEASE
from tests.conftest import Bw, pid_alive, wait_until

NAME = "box1"


def dry(bw: Bw, name: str = NAME) -> dict[str, Any]:
    r = bw("down", name, "--dry-run", "--json")
    doc = dict(json.loads(r.stdout))
    assert r.returncode == (0 if doc["allowed"] else 3), r.stderr
    return doc


def pulled_box(bw: Bw, files: dict[str, bytes]) -> tuple[dict[str, Path], Path]:
    """Box NAME up with `files` in its watched dir, all durable, pulled to ./pulled and verified."""
    p = bw.up(NAME)
    for name, data in files.items():
        (p["watch"] / name).write_bytes(data)
    bw.wait_durable(NAME, len(files))
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    return p, pulled


def up_args(bw: Bw, *extra: str) -> tuple[str, ...]:
    return ("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", *extra)


def test_up_refuses_a_durable_folder_that_holds_files_no_run_owns(bw: Bw) -> None:
    (bw.cwd / "ckpt").mkdir()
    (bw.cwd / "ckpt" / "x.bin").write_bytes(b"new")
    durable = bw.cwd / "durable"
    mine = durable / NAME / "R" / "x.bin"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"the user's own file")
    r = bw(*up_args(bw, "--durable", durable.as_uri(), "--run-id", "R"))
    assert r.returncode == 1, r.stderr  # the sidecar refused to start
    assert "holds 1 entry that no boxwarden run owns ('x.bin')" in r.stderr
    assert mine.read_bytes() == b"the user's own file"
    assert not bw.sidecar_pids()


def test_up_refuses_a_durable_url_inside_another_runs_folder(bw: Bw) -> None:
    durable = bw.cwd / "durable"
    durable.mkdir()
    p = bw.up("aa", "--durable", durable.as_uri(), "--run-id", "R1")
    nested = p["watch"] / "bb" / "R2" / "x.bin"
    nested.parent.mkdir(parents=True)
    nested.write_bytes(b"aa's precious bytes")
    bw.wait_durable("aa", 1)
    run_folder = durable / "aa" / "R1"
    assert (run_folder / "bb" / "R2" / "x.bin").read_bytes() == b"aa's precious bytes"
    other = bw.cwd / "other"
    (other / "ckpt").mkdir(parents=True)
    (other / "ckpt" / "x.bin").write_bytes(b"bb's bytes")
    r = bw("up", "bb", "--profile", "local", "--workdir", str(other), "--watch", "ckpt",
           "--durable", run_folder.as_uri(), "--run-id", "R2")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "the durable folder of another run" in r.stderr
    assert (run_folder / "bb" / "R2" / "x.bin").read_bytes() == b"aa's precious bytes"


def test_a_mount_over_the_watched_dir_itself_refuses_down(bw: Bw) -> None:
    p = bw.up(NAME)
    watch = p["watch"]
    (watch / "a.bin").write_bytes(b"sealed")
    bw.wait_durable(NAME, 1)
    (watch / "b.bin").write_bytes(b"written just before the mount: hidden under it")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(watch)], check=True)
    try:
        (watch / "c.bin").write_bytes(b"on the mount")

        def refused() -> dict[str, Any] | None:
            doc = dry(bw)
            return doc if any(r["code"] == "UNCLAIMABLE" for r in doc["reasons"]) else None

        doc = wait_until(refused, what="the mount over the watched dir to be reported")
        reason = next(r for r in doc["reasons"] if r["code"] == "UNCLAIMABLE")
        assert "changed under its path" in reason["detail"] and "another filesystem" in reason["detail"]
        r = bw("down", NAME, "--confirm", NAME)
        assert r.returncode == 3, r.stderr
    finally:
        subprocess.run(["umount", str(watch)], check=True)
    assert (watch / "b.bin").read_bytes().startswith(b"written just before")
    wait_until(lambda: not any(r["code"] == "UNCLAIMABLE" for r in dry(bw)["reasons"]), what="the mount gone")


def test_a_file_in_place_of_a_durable_directory_moves_the_old_copies_aside(bw: Bw) -> None:
    p = bw.up(NAME)
    model = p["watch"] / "model"
    model.mkdir()
    (model / "s0.bin").write_bytes(b"S0 precious")
    bw.wait_durable(NAME, 1)
    (model / "s0.bin").unlink()
    model.rmdir()
    model.write_bytes(b"a file now")
    wait_until(
        lambda: (p["durable"] / "model").is_file() and (p["durable"] / "model").read_bytes() == b"a file now",
        what="the new file to be durable",
    )
    attic = [f for f in (p["durable"] / ".boxwarden-attic").rglob("s0.bin")]
    assert [f.read_bytes() for f in attic] == [b"S0 precious"]

    def moved_aside() -> list[tuple[str, str]]:
        db = sqlite3.connect(p["box_dir"] / "sidecar" / "ledger.sqlite")
        try:
            return db.execute("SELECT path, detail FROM events WHERE kind = 'DURABLE_MOVED_ASIDE'").fetchall()
        finally:
            db.close()

    # The event is recorded once the commit that moved the old copies returns.
    events = wait_until(moved_aside, what="the DURABLE_MOVED_ASIDE event")
    assert [(path, detail.rsplit(" ", 1)[-1]) for path, detail in events] == [
        ("model", attic[0].parent.relative_to(p["durable"]).as_posix())
    ]


def test_files_the_box_no_longer_claims_stay_verified_in_the_pulled_tree(bw: Bw) -> None:
    """After a verified pull the box drops some files (an interrupted release deleted them, or the
    trainer rotates its checkpoints): pulling again used to leave them EXTRA, and only deleting the
    user's own verified copies by hand let verify and down pass."""
    p, pulled = pulled_box(bw, {f"f{i}.bin": bytes([i]) * 1000 for i in range(4)})
    (p["watch"] / "f0.bin").unlink()
    (p["watch"] / "f1.bin").rename(p["watch"] / "f1-renamed.bin")
    (pulled / "stranger.bin").write_bytes(b"not from the box")
    wait_until(lambda: len(bw.artifacts(NAME)["claims"]) == 3 and not dry(bw)["allowed"], what="the claims")
    r = bw("pull", NAME, "--to", str(pulled))
    assert r.returncode == 0, r.stderr
    assert "2 file(s) an earlier pull put here that the box no longer claims" in r.stderr
    manifest = json.loads((pulled / "MANIFEST.json").read_text())
    assert [f["path"] for f in manifest["retired"]] == ["f0.bin", "f1.bin"]
    assert {f["path"] for f in manifest["files"]} == {"f1-renamed.bin", "f2.bin", "f3.bin"}
    v = bw("verify", str(pulled), "--json")
    assert v.returncode == 3 and [(x["code"], x["path"]) for x in json.loads(v.stdout)["reasons"]] == [
        ("EXTRA", "stranger.bin")
    ]
    (pulled / "stranger.bin").unlink()
    (pulled / "f0.bin").write_bytes(b"edited locally")  # a retired file is checked like the rest
    v = bw("verify", str(pulled), "--json")
    assert v.returncode == 3 and [x["code"] for x in json.loads(v.stdout)["reasons"]] == ["SIZE_MISMATCH"]
    (pulled / "f0.bin").write_bytes(bytes([0]) * 1000)
    bw.ok("verify", str(pulled))
    assert dry(bw)["allowed"] is True


def test_pull_says_which_files_it_replaced_with_newer_bytes_from_the_box(bw: Bw) -> None:
    """Finding 4: a file rewritten on the box after a verified pull silently replaced the verified
    copy at the next pull. The box's newest bytes are the claim (durable storage keeps only those
    too), so the pull takes them, and now says so, naming the file."""
    p = bw.up(NAME)
    (p["watch"] / "x.bin").write_bytes(b"GOOD" * 100)
    (p["watch"] / "y.bin").write_bytes(b"same")
    bw.wait_durable(NAME, 2)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    (p["watch"] / "x.bin").write_bytes(b"EVIL" * 100)
    evil = blake3.blake3(b"EVIL" * 100).hexdigest()
    wait_until(
        lambda: any(c["blake3"] == evil and c["durable"] for c in bw.artifacts(NAME)["claims"]),
        what="the rewrite sealed and durable",
    )
    r = bw("pull", NAME, "--to", str(pulled))
    assert r.returncode == 0, r.stderr
    assert "replaced 1 file(s) an earlier pull put here with the box's newer bytes" in r.stderr
    assert "newest): x.bin\n" in r.stderr
    assert (pulled / "x.bin").read_bytes() == b"EVIL" * 100


def test_a_retired_file_deleted_locally_is_dropped_by_the_next_pull(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "old.bin").write_bytes(b"rotated away")
    (p["watch"] / "new.bin").write_bytes(b"kept")
    bw.wait_durable(NAME, 2)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    (p["watch"] / "old.bin").unlink()
    wait_until(lambda: len(bw.artifacts(NAME)["claims"]) == 1, what="the claim of old.bin to end")
    bw.ok("pull", NAME, "--to", str(pulled))
    (pulled / "old.bin").unlink()  # the user does not want it
    v = bw("verify", str(pulled), "--json")
    assert v.returncode == 3
    (reason,) = json.loads(v.stdout)["reasons"]
    assert (reason["code"], reason["path"]) == ("MISSING", "old.bin") and "pull again" in reason["detail"]
    bw.ok("pull", NAME, "--to", str(pulled))
    assert json.loads((pulled / "MANIFEST.json").read_text())["retired"] == []
    bw.ok("verify", str(pulled))


# -- review 5: same-filesystem bind mounts, and a stray in another mount namespace ----------------


def unclaimable(bw: Bw, name: str = NAME) -> dict[str, str]:
    return {r["path"]: r["detail"] for r in dry(bw, name)["reasons"] if r["code"] == "UNCLAIMABLE"}


@contextlib.contextmanager
def bind(src: Path, dst: Path) -> Iterator[None]:
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(dst)], check=True)


def test_a_same_filesystem_bind_mount_over_the_workdir_refuses_down(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "e1.bin").write_bytes(b"epoch 1")
    bw.wait_durable(NAME, 1)
    shadow = bw.cwd.parent / "shadow"
    (shadow / "ckpt").mkdir(parents=True)
    (shadow / "ckpt" / "e1.bin").write_bytes(b"epoch 1")
    (p["watch"] / "e2.bin").write_bytes(b"epoch 2, hidden under the mount")
    with bind(shadow, bw.cwd):
        found = wait_until(lambda: unclaimable(bw).get("."), what="the mount over the workdir reported")
        assert "mounted on it or on a directory above it" in found
        assert bw("down", NAME, "--confirm", NAME).returncode == 3
    wait_until(lambda: not unclaimable(bw), what="the mount gone")


def test_a_swapped_bind_mount_over_the_watched_dir_refuses_down(tmp_path: Path, bw: Bw) -> None:
    a, b = tmp_path / "srcA", tmp_path / "srcB"
    a.mkdir()
    b.mkdir()
    watch = bw.cwd / "ckpt"
    watch.mkdir()
    with bind(a, watch):
        bw.up(NAME)
        (watch / "a.bin").write_bytes(b"a")
        bw.wait_durable(NAME, 1)
        assert not unclaimable(bw)
    (a / "b.bin").write_bytes(b"never sealed: under the swapped mount")
    (b / "a.bin").write_bytes(b"a")
    with bind(b, watch):
        found = wait_until(lambda: unclaimable(bw).get("."), what="the swapped mount reported")
        assert "swapped" in found
    with bind(a, watch):  # the original mount back: nothing hidden any more
        wait_until(lambda: "." not in unclaimable(bw), what="the original mount accepted again")


def test_a_same_filesystem_bind_mount_inside_a_watched_dir_is_unclaimable(tmp_path: Path, bw: Bw) -> None:
    p = bw.up(NAME)
    cell = p["watch"] / "cell-b"
    cell.mkdir()
    (cell / "b1.bin").write_bytes(b"b1")
    bw.wait_durable(NAME, 1)
    (cell / "b2.bin").write_bytes(b"b2, hidden under the mount")
    other = tmp_path / "other"
    other.mkdir()
    (other / "b1.bin").write_bytes(b"b1")
    with bind(other, cell):
        found = wait_until(lambda: unclaimable(bw).get("cell-b"), what="the mount point named")
        assert "a mount point inside a watched dir" in found
        assert bw("down", NAME, "--confirm", NAME).returncode == 3


def test_a_process_in_another_mount_namespace_working_in_the_watched_dir_is_a_stray(
    tmp_path: Path, bw: Bw
) -> None:
    """A container that bind-mounted the watched dir at a path of its own and works there."""
    p, _ = pulled_box(bw, {"a.bin": b"a"})
    assert dry(bw)["allowed"] is True
    inside = tmp_path / "ctr"  # empty here; the watched dir inside the namespace
    inside.mkdir()
    script = f"mount --bind {p['watch']} {inside} && cd {inside} && exec sleep 600"
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script])
    try:

        def stray_seen() -> dict[str, Any] | None:
            doc = dry(bw)
            return doc if any(r["code"] == "STRAY_PROCESS" for r in doc["reasons"]) else None

        doc = wait_until(stray_seen, what="the process in the other namespace seen as a stray")
        (reason,) = [r for r in doc["reasons"] if r["code"] == "STRAY_PROCESS"]
        assert f"works in {inside}" in reason["detail"]
    finally:
        proc.kill()
        proc.wait()


# -- review 6: a thread with its own working directory or file table ------------------------------

THREAD_STRAY = """
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
os.chdir("/")  # the main thread works elsewhere and holds nothing there
flag, target, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def worker():
    assert libc.unshare(flag) == 0, ctypes.get_errno()
    if flag == 0x200:  # CLONE_FS: a cwd of its own
        os.chdir(target)
    else:  # CLONE_FILES: a file table of its own, holding the watched dir
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    open(ready, "w").close()
    time.sleep(600)
threading.Thread(target=worker, daemon=True).start()
time.sleep(600)
"""


@pytest.mark.parametrize(("flag", "why"), [(0x200, "works in"), (0x400, "holds")])
def test_a_thread_working_in_the_watched_dir_is_a_stray(tmp_path: Path, bw: Bw, flag: int, why: str) -> None:
    p = bw.up(NAME)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", THREAD_STRAY, str(flag), str(p["watch"]), str(ready)])
    try:
        wait_until(ready.exists, what="the thread in the watched dir")
        reasons = [r for r in dry(bw)["reasons"] if r["code"] == "STRAY_PROCESS"]
        assert len(reasons) == 1 and f"pid {proc.pid} " in reasons[0]["detail"], reasons
        assert f"{why} {p['watch']}" in reasons[0]["detail"] and "(thread " in reasons[0]["detail"]
    finally:
        proc.kill()
        proc.wait()


def test_up_after_an_interrupted_teardown_continues_the_same_run(bw: Bw) -> None:
    """Review 6, finding 3: the release stopped part-way and the sidecar died; `up` started a new
    run, so the verified tree no longer counted ("nothing pulled yet", then MANIFEST_STALE)."""
    p, pulled = pulled_box(bw, {f"f{i}.bin": bytes([i]) * 100 for i in range(3)})
    state = State(bw.home)
    box = state.get(NAME)
    # What an interrupted `down` leaves: the release recorded as taken, one file already released.
    state.step(box.with_(status="tearing-down"), RELEASE, "requested")
    (p["watch"] / "f0.bin").unlink()
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the sidecar gone")
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    again = State(bw.home).get(NAME)
    assert (again.run_id, again.pulled_dir) == (box.run_id, box.pulled_dir)
    wait_until(lambda: len(bw.artifacts(NAME)["claims"]) == 2, what="the released file's claim to end")
    bw.ok("pull", NAME, "--to", str(pulled))  # f0.bin stays, listed as retired
    bw.ok("verify", str(pulled))
    bw.ok("down", NAME, "--confirm", NAME)
    assert State(bw.home).get(NAME).status == "down"
    assert (pulled / "f0.bin").read_bytes() == bytes([0]) * 100


ORPHAN_FORKS_LATER = """
import os, sys, time
trigger, out = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.chdir("/")
        while not os.path.exists(trigger):
            time.sleep(0.05)
        if os.fork() == 0:  # a clean environment; its parent exits at once
            if sys.argv[3] == "setsid":  # and a session of its own, that no scan ever saw
                os.setsid()
            os.execve("/bin/sh", ["sh", "-c", f"sleep 600; echo late > {out}"], {})
        os._exit(0)
    os._exit(0)
"""


@pytest.mark.parametrize("session", ["same", "setsid"])
def test_a_clean_child_of_a_job_orphan_after_a_sidecar_restart_keeps_the_job_running(
    tmp_path: Path, bw: Bw, session: str
) -> None:
    """Review 6, finding 2: after a restart the sidecar is no longer its orphans' subreaper; an
    orphan forked a child with an empty environment and exited, and the child was nobody's. The
    sessions a job was seen in caught the child in the orphan's session, but not one that also
    started a session of its own at once (review 6's residual): the job's keeper, a subreaper
    that outlives the sidecar, inherits it whatever it does."""
    p = bw.up(NAME)
    trigger = tmp_path / "trigger"
    late = str(p["watch"] / "late.bin")
    bw.ok("run", NAME, "--", sys.executable, "-c", ORPHAN_FORKS_LATER, str(trigger), late, session)
    wait_until(lambda: any(r["code"] == "JOB_RUNNING" for r in dry(bw)["reasons"]), what="the orphan tracked")
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the sidecar gone")
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    wait_until(
        lambda: any(r["code"] == "JOB_RUNNING" for r in dry(bw)["reasons"]), what="the orphan re-adopted"
    )
    trigger.touch()

    wanted = f"sh\0-c\0sleep 600; echo late > {late}\0".encode()

    def clean_child() -> int | None:
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and (d / "cmdline").read_bytes() == wanted:
                    return int(d.name)
            except OSError:
                continue
        return None

    child = wait_until(clean_child, what="the clean child")
    group = os.getpgid(child)  # the orphan's, or its own: the shell and its sleep, nothing else of ours
    try:

        def parent() -> bytes:
            ppid = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]
            return Path(f"/proc/{ppid}/cmdline").read_bytes()

        # Its parent exited: it was reparented, and not to init but to the job's keeper.
        wait_until(lambda: b"keeper.py" in parent(), what="it is the keeper's")
        assert b"BOXWARDEN_JOB_ID" not in Path(f"/proc/{child}/environ").read_bytes()
        (reason,) = [r for r in dry(bw)["reasons"] if r["code"] == "JOB_RUNNING"]
        assert f" {child} " in reason["detail"].split(")")[0] + " ", reason
    finally:
        os.killpg(group, signal.SIGKILL)
