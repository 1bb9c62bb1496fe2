"""open_for_write against real processes holding real files open."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sidecar.openfiles import _registered, open_for_write
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys
f = open(sys.argv[1], sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""


@contextmanager
def holder(code: str, *args: str) -> Iterator[tuple[int, str]]:
    """Runs `code` in another process until the block ends (EOF on its stdin ends it); yields its
    pid and the first line it printed (once it printed it)."""
    with subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        said = proc.stdout.readline()
        try:
            yield proc.pid, said
        finally:
            proc.stdin.close()
            proc.wait()


@contextmanager
def held_open(path: Path, mode: str) -> Iterator[int]:
    """Another process holds `path` open in `mode` until the block ends; yields its pid."""
    with holder(HOLDER, str(path), mode) as (pid, said):
        assert said == "ready\n"
        yield pid


@pytest.fixture
def root(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.mark.parametrize(("mode", "reported"), [("wb", True), ("ab", True), ("r+b", True), ("rb", False)])
def test_reports_files_open_for_write_by_another_process(root: Path, mode: str, reported: bool) -> None:
    target = root / "step-100.pt"
    target.write_bytes(b"x")
    with held_open(target, mode):
        scan = open_for_write([root])
        assert (target in scan.paths) is reported
    assert target not in open_for_write([root]).paths  # the holder has exited


def test_ignores_files_outside_the_roots(tmp_path: Path, root: Path) -> None:
    # ckpt2/ shares a string prefix with ckpt/ but is not under it.
    for outside in (tmp_path / "elsewhere.pt", tmp_path / "ckpt2" / "a.pt"):
        outside.parent.mkdir(exist_ok=True)
        with held_open(outside, "wb"):
            assert outside not in open_for_write([root]).paths
            assert outside in open_for_write([outside.parent]).paths


def test_own_process_is_reported_unless_excluded(root: Path) -> None:
    target = root / "nested" / "metrics.jsonl"
    target.parent.mkdir()
    with open(target, "wb"):
        assert target in open_for_write([root]).paths
        assert target not in open_for_write([root], exclude_pids=[os.getpid()]).paths


def test_deleted_files_are_skipped(root: Path) -> None:
    target = root / "gone.pt"
    with open(target, "wb"):
        target.unlink()
        assert open_for_write([root]).paths == frozenset()


def test_answers_in_the_callers_spelling_of_a_symlinked_root(tmp_path: Path, root: Path) -> None:
    link = tmp_path / "workspace"
    link.symlink_to(root)
    target = root / "step-1.pt"
    with held_open(target, "wb"):
        assert open_for_write([link]).paths == {link / "step-1.pt"}


SCAN_AS_NOBODY = """
import os, sys
from sidecar.openfiles import _registered, open_for_write
os.setgid(65534)
os.setuid(65534)
print(open_for_write([sys.argv[1]]).unreadable_pids)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_counts_processes_it_may_not_inspect(root: Path) -> None:
    # Imported as root, scanning as nobody: at least this test process becomes unreadable.
    out = subprocess.run(
        [sys.executable, "-c", SCAN_AS_NOBODY, str(root)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    # Root may be refused too (a sandbox's protected init is), but never for its own processes.
    assert int(out.stdout) > open_for_write([root]).unreadable_pids


def test_write_lease_says_whether_anyone_writes_the_file(tmp_path: Path) -> None:
    from sidecar.openfiles import write_lease_blocked

    f = tmp_path / "ckpt.pt"
    f.write_bytes(b"x")
    assert write_lease_blocked(f) is False
    with open(f, "ab"):
        assert write_lease_blocked(f) is True
    with open(f, "rb"):
        assert write_lease_blocked(f) is False
    assert write_lease_blocked(tmp_path / "missing") is None
    os.mkfifo(tmp_path / "fifo")
    assert write_lease_blocked(tmp_path / "fifo") is None


MAPS_AND_CLOSES = """
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
fd = os.open(sys.argv[1], os.O_RDWR if sys.argv[2] == "w" else os.O_RDONLY)
prot = mmap.PROT_READ | (mmap.PROT_WRITE if sys.argv[2] == "w" else 0)
flags = mmap.MAP_SHARED if sys.argv[3] == "shared" else mmap.MAP_PRIVATE
assert libc.mmap(None, 4096, prot, flags, fd, 0) not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)  # the mapping alone holds the file now
os.chdir("/")
print("ready", os.listdir("/proc/self/fd"), flush=True)
sys.stdin.read()
"""


@contextmanager
def mapped(path: Path, access: str, kind: str) -> Iterator[int]:
    """Another process maps `path` (access "w" or "r", kind "shared" or "private") and closes the
    fd, until the block ends; yields its pid."""
    with holder(MAPS_AND_CLOSES, str(path), access, kind) as (pid, said):
        assert said == "ready ['0', '1', '2', '3']\n"  # no fd on the file left
        yield pid


@pytest.mark.parametrize(
    ("access", "kind", "reported"), [("w", "shared", True), ("w", "private", False), ("r", "shared", False)]
)
def test_a_shared_writable_mapping_is_a_writer_without_an_fd(
    root: Path, access: str, kind: str, reported: bool
) -> None:
    """Review 12: mmap(MAP_SHARED, PROT_WRITE) then close(fd) writes into the file with no fd
    open; the /proc scan saw nothing, so the gate passed a checkpoint still being written."""
    target = root / "weights.bin"
    target.write_bytes(b"\0" * 4096)
    with mapped(target, access, kind):
        assert (target in open_for_write([root]).paths) is reported
    assert target not in open_for_write([root]).paths


REGISTERS_AND_CLOSES = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_uint8 * 120)()
ring = libc.syscall(425, 4, params)  # io_uring_setup
if ring < 0:
    print("no io_uring", ctypes.get_errno(), flush=True)
    sys.exit(0)
flags = {"w": os.O_RDWR, "r": os.O_RDONLY, "d": os.O_RDONLY | os.O_DIRECTORY}[sys.argv[2]]
fd = os.open(sys.argv[1], flags)
fds = (ctypes.c_int * 1)(fd)
assert libc.syscall(427, ring, 2, fds, 1) == 0, ctypes.get_errno()  # IORING_REGISTER_FILES
os.close(fd)  # the ring alone holds the file now
os.chdir("/")
print("ready", flush=True)
sys.stdin.read()
"""


@contextmanager
def registered(path: Path, access: str) -> Iterator[int]:
    """Another process registers `path` with an io_uring (access "w", "r", or "d" for a directory)
    and closes its fd, until the block ends; yields its pid."""
    with holder(REGISTERS_AND_CLOSES, str(path), access) as (pid, said):
        if said.startswith("no io_uring"):
            pytest.skip(f"this kernel gives no io_uring ({said.strip()}): nothing can hide a file in one")
        assert said == "ready\n", said
        yield pid


@pytest.mark.parametrize(("access", "reported"), [("w", True), ("r", False)])
def test_a_file_registered_with_an_io_uring_is_a_writer_without_an_fd(
    root: Path, access: str, reported: bool
) -> None:
    """Review 12, F3: a file registered with an io_uring (IORING_REGISTER_FILES) and then closed is
    written through the ring with no fd open; the /proc scan saw nothing."""
    target = root / "weights.bin"
    target.write_bytes(b"\0" * 4096)
    with registered(target, access):
        assert (target in open_for_write([root]).paths) is reported
    assert target not in open_for_write([root]).paths


def test_registered_files_are_read_from_the_rings_fdinfo() -> None:
    info = b"pos:\t0\nUserFiles:\t3\n    0: /w/a\\040b\n    2: /w/c\\134d (deleted)\nUserBufs:\t0\n"
    assert _registered(info) == ["/w/a b", "/w/c\\d (deleted)"]
    assert _registered(b"pos:\t0\nflags:\t02000002\n") is None  # the ring's lock was busy


def test_a_file_behind_a_writable_loop_device_is_being_written(root: Path) -> None:
    """An image in the watched dir attached with `losetup` (and mounted elsewhere) is written by the
    kernel, with no process's fd on it; the /proc scan saw nothing."""
    image = root / "disk.img"
    with image.open("wb") as f:
        f.truncate(1 << 20)
    dev = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True, check=True)
    try:
        assert image in open_for_write([root]).paths
    finally:
        subprocess.run(["losetup", "-d", dev.stdout.strip()], check=True)
    assert image not in open_for_write([root]).paths


IN_ANOTHER_THREAD = """
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
ready = threading.Event()
def writer():
    if sys.argv[2] == "own-table":
        assert libc.unshare(0x400) == 0, ctypes.get_errno()  # CLONE_FILES: a table of its own
    os.open(sys.argv[1], os.O_WRONLY)
    ready.set()
    threading.Event().wait()
threading.Thread(target=writer, daemon=True).start()
ready.wait()
print("ready", flush=True)
if sys.argv[2] == "main-exits":
    libc.pthread_exit(None)  # /proc/PID/fd is the main thread's: empty from now on
sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["own-table", "main-exits"])
def test_a_writer_in_a_thread_whose_table_is_not_the_main_threads_is_seen(root: Path, how: str) -> None:
    """Review 13: the scan read /proc/PID/fd, the main thread's table, only: a thread that
    unshared its file table, or outlived the main thread, wrote a checkpoint unseen."""
    target = root / "w.bin"
    target.write_bytes(b"x")
    with holder(IN_ANOTHER_THREAD, str(target), how) as (pid, said):
        assert said == "ready\n"
        if how == "main-exits":
            wait_until(
                lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", what="Z"
            )
            assert os.listdir(f"/proc/{pid}/fd") == []
        try:
            assert target in open_for_write([root]).paths
        finally:
            os.kill(pid, 9)


def test_a_live_file_whose_name_ends_like_a_deleted_one_is_seen(root: Path) -> None:
    """Review 13, F03's twin: "x (deleted)" is also what /proc shows for an unlinked file; a live
    file of that name open for writing was skipped as unlinked."""
    target = root / "w.bin (deleted)"
    target.write_bytes(b"x")
    with held_open(target, "ab"):
        assert target in open_for_write([root]).paths


LONG_PATH_FIRST = """
import os, sys
deep = sys.argv[1]
os.chdir(deep)
for _ in range(25):
    os.mkdir("d" * 200)
    os.chdir("d" * 200)
fd = os.open("build.log", os.O_WRONLY | os.O_CREAT)  # its path is longer than PATH_MAX
os.chdir("/")
print("ready", flush=True)
sys.stdin.read()
"""


def test_an_fd_whose_path_is_too_long_to_read_breaks_nothing(tmp_path: Path, root: Path) -> None:
    """Review 13, F05: any process holding a file at a path longer than PATH_MAX made readlink
    fail with ENAMETOOLONG; the scan let it out and every listing on the box failed."""
    target = root / "w.bin"
    target.write_bytes(b"x")
    with holder(LONG_PATH_FIRST, str(tmp_path)) as (_, said), held_open(target, "ab"):
        assert said == "ready\n"
        assert open_for_write([root]).paths == {target}
