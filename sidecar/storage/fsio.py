"""Low-level file I/O shared by the durable stores: error wording, fd helpers, preallocating a
copy, and hashing a file from the device (by reading, or in a child process that maps it).

Nothing here keeps state; `local.py` owns the store's layout and the order of operations.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

from sidecar import children, hashing
from sidecar.errors import StorageError

logger = logging.getLogger(__name__)

CHILD_VERIFY_MIN = 64 << 20
"""verify: copies at least this big are hashed by a child process that maps them."""

READ_AHEAD = 64 << 20
"""verify: bytes requested from the device ahead of the hash (POSIX_FADV_WILLNEED)."""

_HINTS = {
    errno.ENOSPC: "no space left: free space on the durable store or point the durable URL at a larger one",
    errno.EDQUOT: "disk quota exceeded on the durable store: raise the quota or free space",
    errno.EACCES: "permission denied: the sidecar's user must be able to write the durable root",
    errno.EPERM: "operation not permitted: check the durable root's owner and mount options",
    errno.EROFS: "the durable store is mounted read-only: remount it read-write",
    errno.ENOENT: "it is missing: is the durable store mounted?",
    errno.EXDEV: "it crosses a filesystem boundary: the durable root must not contain other mounts",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg) before trusting it",
    errno.ENOTDIR: "a file sits where a directory is expected",
    errno.EISDIR: "a directory sits where the artifact should go",
}


_REASONS = {
    errno.ENOSPC: "NO_SPACE",
    errno.EDQUOT: "QUOTA",
    errno.EACCES: "PERMISSION",
    errno.EPERM: "PERMISSION",
    errno.EROFS: "READ_ONLY",
    errno.ENOENT: "NOT_MOUNTED",
    errno.EIO: "IO_ERROR",
}


def storage_error(action: str, path: Path | str, exc: OSError) -> StorageError:
    code = exc.errno or 0
    hint = _HINTS.get(code, "check the durable store")
    reason = _REASONS.get(code, "STORE_ERROR")
    if code == errno.ENOSPC and _inodes_out(Path(path)):
        # ENOSPC with bytes to spare: the filesystem ran out of inodes (`df -i`), not of bytes.
        reason = "NO_INODES"
        hint = "no free inodes (`df -i`): remove files from the durable store or use one with more inodes"
    return StorageError(f"{action} {path} failed: {exc.strerror or exc}; {hint}", reason)


def _inodes_out(path: Path) -> bool:
    """Has the filesystem of `path` (or of its nearest existing parent) no free inodes left?"""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_files > 0 and st.f_favail == 0
    return False


def close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # an fd we own and close once; a failure here is only worth a note
        logger.warning("closing fd %d failed: %s", fd, exc)


def read_ahead(fd: int, done: int, advised: int) -> int:
    """Ask the kernel to start reading up to READ_AHEAD bytes past `done`; returns the new mark."""
    if done + READ_AHEAD > advised:
        os.posix_fadvise(fd, advised, done + READ_AHEAD - advised, os.POSIX_FADV_WILLNEED)
        advised = done + READ_AHEAD
    return advised


def hash_by_read(fd: int) -> str:
    """Hash an (uncached) open file by reading it, keeping requests in flight ahead of the hash."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    # Sized to the file (a 16 MiB buffer zeroed per file is 1 ms: most of a small file's verify).
    size = os.fstat(fd).st_size
    chunk = min(hashing.VERIFY_CHUNK, max(size + 1, 64 << 10))
    hasher = hashing.new_hasher(update_size=chunk)
    buf = bytearray(chunk)
    view = memoryview(buf)
    done = advised = dropped = 0
    while True:
        # Plain sequential reads of a freshly written file ran at half the device's speed here (one
        # readahead stream, mostly waiting); asking for the next READ_AHEAD bytes up front keeps
        # several requests in flight while this thread hashes.
        advised = read_ahead(fd, done, advised)
        n = os.readv(fd, [buf])
        if n == 0:
            break
        hasher.update(view[:n])
        done += n
        if done - dropped >= READ_AHEAD:
            # Leave nothing behind as we go: the copy is for the future, not for this box's page
            # cache (a 20 GiB checkpoint would evict the trainer's).
            os.posix_fadvise(fd, dropped, done - dropped, os.POSIX_FADV_DONTNEED)
            dropped = done
    return hasher.hexdigest()


_CHILD_HASH = (
    "import sys, blake3; "
    "print(blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(sys.argv[1]).hexdigest())"
)


def hash_in_child(fd: int, path: Path, size: int) -> str | None:
    """Hash the open file in a child process that maps it, as b3sum does.

    A mapped cold read keeps many page-ins in flight on all cores and ran about 1.5x faster here
    than reading; but an I/O error (or a truncation) under a mapping is a SIGBUS, and that must
    not kill the daemon: in a child it kills only the child, and is reported as the failed read
    it is. The child gets the very same open file (its fd), never a path that could be swapped.
    None: no child could run here (the caller reads the file itself).
    """
    timeout = 60 + size / (20 << 20)  # 20 MB/s: slower than that, the device is failing
    try:
        # Registered while it runs: the sidecar reaps its orphaned children, never this one.
        proc = children.popen(
            [sys.executable, "-I", "-c", _CHILD_HASH, f"/dev/fd/{fd}"],
            pass_fds=(fd,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("hashing %s in a child failed to run (%s); reading it here instead", path, exc)
        return None
    stdout: str
    stderr: str
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        logger.warning("hashing %s in a child failed to run (%s); reading it here instead", path, exc)
        return None
    finally:
        if proc.returncode is None:  # interrupted: collect it before it may be reaped by anyone
            proc.kill()
            proc.wait()
        children.release(proc.pid)
    if proc.returncode < 0:
        raise StorageError(
            f"re-reading durable copy {path} failed: the reader was killed by "
            f"{signal.Signals(-proc.returncode).name} (an I/O error on the device, or the copy was truncated)"
        )
    out = stdout.strip()
    if proc.returncode != 0 or not hashing.is_digest(out):
        logger.warning(
            "hashing %s in a child gave no digest (%s); reading it here instead", path, stderr[-300:]
        )
        return None
    return out


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # the filesystem has none, or not this mode


def preallocate(fd: int, size: int) -> bool:
    """Give the open, empty file `size` bytes of allocated (unwritten) blocks and that size:
    fallocate(2), mode 0. False where the filesystem or libc has no fallocate (nothing done: never
    emulated by writing zeros, as posix_fallocate would). OSError for a real failure (ENOSPC...).

    Why: ext4 takes the inode lock exclusively for an O_DIRECT write that allocates blocks or
    extends the file, and holds it until the device has the data, so the parallel writes of a copy
    into a new file reached the device one at a time (the other writers wait in
    ext4_file_write_iter), where the writeback of `cp` keeps dozens of requests in flight. On a
    disk shared with another writer, staging 1 GiB took 2.7 s against 1.0 s for `cp && sync`;
    preallocated, 0.9 s. Writes into allocated blocks within the file's size take the lock shared
    and run side by side.
    """
    fallocate = _fallocate()
    if fallocate is None or size <= 0:
        return False
    while fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in _NO_FALLOCATE:
            return False
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))
    return True


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate with 64-bit offsets, or None (no such symbol: not Linux, an odd libc)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    for name in ("fallocate64", "fallocate"):
        fn = getattr(libc, name, None)
        if fn is not None:
            fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
            fn.restype = ctypes.c_int
            return cast("Callable[[int, int, int, int], int]", fn)
    return None
