"""strays.find against real processes: what ties a process outside every job to the workdir."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sidecar import proctree, strays
from tests.sidecar.test_openfiles import holder, mapped, registered


def found(root: Path) -> dict[int, str]:
    table = proctree.scan()
    return {s.pid: s.why for s in strays.find(table, roots=[str(root)], exempt=set(), watched=[str(root)])}


def test_a_process_that_maps_a_file_there_and_closed_it_is_a_stray(tmp_path: Path) -> None:
    """Review 12: a process working in / that mapped a checkpoint and closed the fd held nothing
    /proc showed as open, so it was no stray; a read-only mapping counts too (mprotect can make
    it writable when the file was opened for writing)."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    target = root / "sub" / "w.bin"
    target.write_bytes(b"\0" * 4096)
    with mapped(target, "r", "private") as pid:
        assert found(root).get(pid) == f"maps {target} into memory"
    assert found(root) == {}


def test_a_process_running_a_program_from_the_workdir_is_a_stray(tmp_path: Path) -> None:
    """Review 11, finding 2: a process that works elsewhere but whose executable lies in the
    workdir (a tool from the project's tree, started with cwd /) was not a stray."""
    root = tmp_path / "work"
    root.mkdir()
    sleeper = root / "sleeper"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", sleeper)
    proc = subprocess.Popen([str(sleeper), "600"], cwd="/")
    try:
        assert found(root).get(proc.pid) == f"maps {sleeper} into memory"
    finally:
        proc.kill()
        proc.wait()
    assert not any(pid == proc.pid for pid in found(root))


def test_a_process_mapping_only_files_elsewhere_is_no_stray(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\0" * 4096)
    with mapped(outside, "w", "shared") as pid:
        assert pid not in found(root)
    assert found(root) == {}


def test_a_process_holding_a_watched_dir_in_an_io_uring_is_a_stray(tmp_path: Path) -> None:
    """Review 12, F3: a process that registered the watched dir with an io_uring and closed its fd
    held nothing the scan read; after `down` it took an fd back (IORING_OP_FIXED_FD_INSTALL) and
    wrote a checkpoint there."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    for held in (root, root / "sub"):
        with registered(held, "d") as pid:
            assert found(root).get(pid) == f"holds {held} open through an io_uring"
    assert found(root) == {}


def test_the_callers_numbers_are_believed_only_in_this_pid_namespace_and_with_their_start_times() -> None:
    """Review 13, F01: a controller in another PID namespace sent its own numbers, and the host
    process that had the controller's number there was exempt from the scan."""
    from controller.client import lineage

    table = proctree.scan()
    sent = lineage()
    mine = strays.Caller(tuple(sent.pids), tuple(sent.start_ticks), sent.pid_ns, sent.boot_id)
    assert strays.believed(mine, table) == list(sent.pids)[: len(strays.believed(mine, table))]
    assert strays.believed(mine, table)[0] == os.getpid()
    assert strays.believed(dataclasses.replace(mine, pid_ns=mine.pid_ns + 1), table) == []
    assert strays.believed(dataclasses.replace(mine, boot_id="another boot"), table) == []
    assert strays.believed(dataclasses.replace(mine, start_ticks=mine.start_ticks[:1]), table) == []
    reused = (mine.start_ticks[0], mine.start_ticks[1] + 1, *mine.start_ticks[2:])
    assert strays.believed(dataclasses.replace(mine, start_ticks=reused), table) == [os.getpid()]
    assert strays.believed(None, table) == []


HOLDS_A_DIR = """
import ctypes, os, sys, threading
root, how = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)

def deep(where):
    os.chdir(where)
    for _ in range(25):  # 5 KB of path: longer than PATH_MAX
        os.makedirs("d" * 200, exist_ok=True)
        os.chdir("d" * 200)

ready = threading.Event()
def hold():
    if how == "thread-table":
        assert libc.unshare(0x400) == 0, ctypes.get_errno()  # CLONE_FILES
        deep(sys.argv[3])
        os.open("first.log", os.O_WRONLY | os.O_CREAT)  # an fd whose path cannot be read, first
        os.chdir("/")
    os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    ready.set()
    threading.Event().wait()

threading.Thread(target=hold, daemon=True).start()
ready.wait()
if how == "deep-cwd":
    deep(sys.argv[3])
else:
    os.chdir("/")
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["named-as-deleted", "deep-cwd", "thread-table"])
def test_a_process_holding_the_watched_dir_is_seen_whatever_else_it_does(tmp_path: Path, how: str) -> None:
    """Review 13: F03, a watched dir named "ckpt (deleted)" (what /proc shows for an unlinked file)
    held open was taken for a deleted file beside it; F04, a holder whose cwd lies elsewhere
    deeper than PATH_MAX was skipped whole; F06, an fd whose path is too long to read, first in a
    thread's own file table, hid the rest of that table."""
    root = tmp_path / ("ckpt (deleted)" if how == "named-as-deleted" else "ckpt")
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with holder(HOLDS_A_DIR, str(root), how, str(elsewhere)) as (pid, said):
        assert said == "ready\n"
        why = found(root).get(pid, "")
        assert why.startswith(f"holds {root} open"), why
    assert found(root) == {}


def test_a_release_names_a_stray_and_never_calls_it_a_job(tmp_path: Path) -> None:
    """Issue 25, finding 5: the release refused a stray as JOB_RUNNING; it is STRAY_PROCESS, with
    its pid and command."""
    from boxwarden_pb.v1 import sidecar_pb2 as pb

    from tests.sidecar.daemon import running

    with running(tmp_path / "box") as d:
        trainer = subprocess.Popen(["sleep", "600"], cwd=d.watch)
        try:
            r = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest="0" * 64), timeout=30)
            assert not r.deleted and not [x for x in r.refused if x.code == "JOB_RUNNING"], r.refused
            (stray,) = [x for x in r.refused if x.code == "STRAY_PROCESS"]
            assert stray.detail.startswith(f"pid {trainer.pid} (sleep 600) works in {d.watch}"), stray
        finally:
            trainer.kill()
            trainer.wait()
