"""Which files under the watched roots some process holds open for writing.

This is the gate's UNSEALED_WRITES evidence: a file still open for write may be half written, so
`down` must not pass while one exists. The answer comes from /proc (fd links plus the access mode
in fdinfo; the shared writable mappings in maps and the files registered with an io_uring, which
write with their fd closed) and /sys (the files behind writable loop devices, which the kernel
writes), not from lsof/fuser, which may be missing on the box. A process whose fds we may not
read is counted, so the caller can fail closed instead of trusting a partial scan.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sidecar import proctree
from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

DELETED = " (deleted)"  # how /proc shows an fd whose file was unlinked (or is an O_TMPFILE)


@dataclass(frozen=True, **SLOTS)
class OpenWrites:
    """Result of one scan."""

    # Paths held open for write, spelled under the root that contains them (as the caller gave it).
    paths: frozenset[Path]
    # Processes whose fds could not be read (another user's, without privilege): the scan is
    # incomplete when this is not 0.
    unreadable_pids: int


def open_for_write(roots: Sequence[Path], *, exclude_pids: Collection[int] = ()) -> OpenWrites:
    """Scan every process's fds for files under `roots` opened O_WRONLY or O_RDWR."""
    # The kernel reports fully resolved paths; compare against resolved roots, but answer in the
    # caller's spelling (e.g. /workspace may be a symlink to /mnt/ws).
    mapped = [(os.path.realpath(r), Path(os.path.abspath(r))) for r in roots]
    paths: set[Path] = set()
    excluded = {int(p) for p in exclude_pids}
    with os.scandir("/proc") as entries:
        pids = [e.name for e in entries if e.name.isdigit() and int(e.name) not in excluded]
    # A process in the middle of execve() refuses its fds for an instant: ask those once more
    # before counting them as unreadable (each one makes every caller fall back to slower checks).
    for attempt in range(2):
        retry = []
        for pid in pids:
            try:
                _scan_pid(pid, mapped, paths)
            except PermissionError:
                proc = proctree.read_proc(int(pid))
                if proc is not None and not proc.kernel_thread:
                    retry.append(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass  # exited mid-scan
        pids = retry
        if not pids or attempt:
            break
    _loop_backed(mapped, paths)
    unreadable = len(pids)
    if unreadable:
        logger.debug("open-for-write scan could not read the fds of %s processes", unreadable)
    return OpenWrites(paths=frozenset(paths), unreadable_pids=unreadable)


def _loop_backed(mapped: list[tuple[str, Path]], out: set[Path]) -> None:
    """Files under the roots that back a writable loop device: the kernel holds them open for
    writing with no process's fd (`losetup` an image in the watched dir, mount it elsewhere, and
    every write there changes the image)."""
    try:
        devices = [d for d in os.listdir("/sys/block") if d.startswith("loop")]
    except OSError:
        return
    for dev in devices:
        try:
            with open(f"/sys/block/{dev}/loop/backing_file", "rb") as f:
                target = os.fsdecode(f.read().rstrip(b"\n"))
            with open(f"/sys/block/{dev}/ro", "rb") as f:
                read_only = f.read().strip() == b"1"
        except OSError:
            continue  # not attached
        shown = None if read_only else _under(target, mapped)
        if shown is not None:
            out.add(shown)


def _scan_pid(pid: str, mapped: list[tuple[str, Path]], out: set[Path]) -> None:
    for task in file_tables(pid):
        table = read_fds(pid, task=task)
        for fd, target in table.paths:
            shown = _under(target, mapped)
            if shown is not None and _opened_for_write(pid, fd, task):
                out.add(shown)
        # So does a file registered with an io_uring; its access mode does not show: the
        # kernel's lease says whether anyone writes it.
        registered, unsure = ring_files(pid, table.rings, task=task)
        for target in registered:
            shown = _under(target, mapped)
            if shown is not None and write_lease_blocked(shown) is not False:
                out.add(shown)
        if unsure:
            raise PermissionError(f"the files of an io_uring of process {pid} could not be read")
    # A shared writable mapping writes into the file with no fd left open (mmap, then close).
    _, maps = read_maps(pid)
    for target in mapped_files(maps, shared_writable=True):
        shown = _under(target, mapped)
        if shown is not None:
            out.add(shown)


def _base(pid: str, task: str | None) -> str:
    """The /proc directory of the process, or of its thread `task`."""
    return f"/proc/{pid}" if task is None else f"/proc/{pid}/task/{task}"


def tasks(pid: str) -> list[str]:
    """The process's thread ids, the main thread's first. FileNotFoundError or ProcessLookupError
    if it is gone."""
    return sorted(os.listdir(f"/proc/{pid}/task"), key=lambda t: t != pid)


def file_tables(pid: str) -> list[str]:
    """One thread of `pid` per file table its threads hold, the main thread first: a thread that
    called unshare(CLONE_FILES) has a table of its own, and the main thread's is gone once it has
    exited while others run on. Compared by kcmp(2) (in doubt, a thread counts as its own table)."""
    try:
        tids = tasks(pid)
    except (FileNotFoundError, ProcessLookupError):
        return []
    tables: list[str] = []
    for tid in tids:
        if not any(proctree.shares(int(t), int(tid), proctree.KCMP_FILES) for t in tables):
            tables.append(tid)
    return tables


@dataclass(frozen=True, **SLOTS)
class FdTable:
    """One read of a file table: the fds that name files or directories, and those of the kernel
    objects that hold files of their own (inotify and fanotify marks, io_uring registrations)."""

    paths: list[tuple[str, str]]  # (fd, path); path "" when it cannot be read (over PATH_MAX)
    notify: list[str]  # inotify and fanotify fds
    rings: list[str]  # io_uring fds


_NOTIFY = ("anon_inode:inotify", "anon_inode:[fanotify]")
_RING = "anon_inode:[io_uring]"


def read_fds(pid: str, task: str | None = None, *, deleted: bool = False) -> FdTable:
    """The process's file table (or that of its thread `task`, which has one of its own after
    unshare(CLONE_FILES)), one readlink per fd. Sockets and pipes are left out, and so are deleted
    files unless `deleted`: their path then ends in DELETED, as a live name may too (such a name is
    told apart by its inode). PermissionError if its fds may not be read, FileNotFoundError or
    ProcessLookupError if it is gone."""
    # readlink relative to an open fd directory skips a /proc path walk per fd: the scan is a
    # syscall per fd, and a box runs thousands of them.
    table = FdTable([], [], [])
    dir_fd = os.open(f"{_base(pid, task)}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for fd in os.listdir(dir_fd):
            try:
                target = os.readlink(fd, dir_fd=dir_fd)
            except (FileNotFoundError, ProcessLookupError):
                continue  # closed mid-scan
            except OSError as e:
                if e.errno != errno.ENAMETOOLONG:
                    raise  # EACCES: not ours to look at (the caller counts it)
                table.paths.append((fd, ""))  # over PATH_MAX: look at it through its link
                continue
            # Sockets, pipes and anon inodes read "socket:[123]" etc.; only real paths start with "/".
            if not target.startswith("/"):
                if target in _NOTIFY:
                    table.notify.append(fd)
                elif target == _RING:
                    table.rings.append(fd)
                continue
            if deleted or not target.endswith(DELETED) or not _unlinked(fd, dir_fd, target):
                table.paths.append((fd, target))
    finally:
        os.close(dir_fd)
    return table


def _unlinked(fd: str, dir_fd: int, target: str) -> bool:
    """Whether the file behind `fd`, whose link reads `target` (ending in DELETED), is really
    unlinked, rather than linked under a name that itself ends so."""
    try:
        st = os.stat(fd, dir_fd=dir_fd)
        named = os.lstat(target)
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino)


def read_maps(pid: str) -> tuple[str, bytes]:
    """The process's memory map (/proc/PID/task/TID/maps) and the thread it was read through: the
    main thread, or, once that has exited (it holds no memory then), the first thread that holds
    it. PermissionError if it may not be read, FileNotFoundError or ProcessLookupError if the
    process is gone."""
    for tid in tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/maps", "rb") as f:
                data = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread has ended
        if data:
            return tid, data
    return pid, b""


def mapped_files(data: bytes, *, shared_writable: bool = False) -> Iterator[str]:
    """The path of each file a memory map `data` (read_maps) maps (the executable and libraries
    too); with `shared_writable` only the MAP_SHARED mappings that may write into the file now. A
    mapping outlives the fd it was made from, and a deleted file's path ends in DELETED. The
    kernel writes a newline in a name as \\012: such a path comes both ways."""
    if shared_writable and b"w-s " not in data and b"wxs " not in data:
        return
    seen: set[bytes] = set()
    for line in data.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(b"/") or fields[5] in seen:
            continue
        perms = fields[1]
        if shared_writable and not (perms[1:2] == b"w" and perms[3:4] == b"s"):
            continue
        seen.add(fields[5])
        path = os.fsdecode(fields[5])
        yield path
        if "\\012" in path:
            yield path.replace("\\012", "\n")


def watch_marks(pid: str, fds: list[str], task: str | None = None) -> Iterator[tuple[int, int]]:
    """(device, inode) of every inode the process watches through its inotify or fanotify fds
    `fds` (FdTable.notify; the fdinfo lists each mark as `ino:HEX sdev:HEX`, sdev in the kernel's
    own encoding). Such a mark pins a directory as surely as an open fd, and a handle in it
    reopens the directory."""
    base = _base(pid, task)
    for fd in fds:
        try:
            with open(f"{base}/fdinfo/{fd}", "rb") as f:
                info = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in info.splitlines():
            if not line.startswith((b"inotify ", b"fanotify ")):
                continue
            fields = dict(kv.split(b":", 1) for kv in line.split()[1:] if b":" in kv)
            try:
                ino, sdev = int(fields[b"ino"], 16), int(fields[b"sdev"], 16)
            except (KeyError, ValueError):
                continue
            yield os.makedev(sdev >> 20, sdev & 0xFFFFF), ino


_RING_TRIES = 3


def ring_files(pid: str, rings: list[str], task: str | None = None) -> tuple[list[str], bool]:
    """The paths of the files registered with the process's io_urings `rings` (FdTable.rings): a
    registered file stays open (and writable, if it was opened so) in the ring after its fd is
    closed. And whether some ring's table could not be read (its fdinfo lists the files only when
    the ring's lock is free: asked up to three times; a kernel too old to list them counts so
    too)."""
    base = _base(pid, task)
    paths: list[str] = []
    unsure = False
    for fd in rings:
        for _ in range(_RING_TRIES):
            try:
                with open(f"{base}/fdinfo/{fd}", "rb") as f:
                    listed = _registered(f.read())
            except (FileNotFoundError, ProcessLookupError):
                listed = []  # closed mid-scan
            if listed is not None:
                paths += listed
                break
        else:
            unsure = True
    return paths, unsure


def _registered(info: bytes) -> list[str] | None:
    """The paths under `UserFiles:` in an io_uring's fdinfo (None when it has no such section).
    The kernel escapes space, tab, newline and backslash in them as octal."""
    lines = info.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(b"UserFiles:"))
    except StopIteration:
        return None
    out = []
    for line in lines[start + 1 :]:
        index, sep, name = line.strip().partition(b": ")
        if not sep or not index.isdigit():
            break
        if name.startswith(b"/"):
            out.append(os.fsdecode(_unescape(name)))
    return out


def _unescape(name: bytes) -> bytes:
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8) & 0xFF]), name)


def _under(target: str, mapped: list[tuple[str, Path]]) -> Path | None:
    for real, given in mapped:
        if target == real:
            return given
        prefix = real if real.endswith("/") else real + "/"
        if target.startswith(prefix):
            return given / target[len(prefix) :]
    return None


def _opened_for_write(pid: str, fd: str, task: str | None = None) -> bool:
    base = _base(pid, task)
    try:
        with open(f"{base}/fdinfo/{fd}", "rb") as f:
            info = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    for line in info.splitlines():
        if line.startswith(b"flags:"):
            flags = int(line.split()[1], 8)
            return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    return False


def write_lease_blocked(path: str | Path) -> bool | None:
    """Ask the kernel whether any process holds `path` open for writing.

    A read lease (F_SETLEASE, F_RDLCK) is refused with EAGAIN exactly when the file is open for
    writing by anyone — including processes whose /proc entries we cannot read. The lease goes
    with the fd, closed at once (three syscalls: a listing probes 100,000 files this way when the
    /proc scan was incomplete). True: being written; False: nobody writes it; None: the kernel
    would not say (not our file and no CAP_LEASE, a filesystem without leases, not a regular file:
    leases exist only on regular files, EINVAL otherwise).
    The process must ignore SIGIO: a writer opening the file in the instant we hold the lease
    makes the kernel signal us (app.py sets SIG_IGN).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        return True if e.errno == errno.EAGAIN else None
    finally:
        os.close(fd)
    return False
