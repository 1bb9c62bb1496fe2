"""What the kernel's page cache holds of a file and what a thread read from storage, and pushing a
written range out to the device: the facts a copy made and proven through the page cache relies on.

- `write_out(fd, offset, length, wait)`: sync_file_range(2), start (and with `wait`, finish)
  writeback of a range, so a buffered copy leaves the box's memory as it is written.
- `resident_pages(fd, size)`: how many of the file's pages the page cache holds (mincore(2) on a
  mapping of it); None where that cannot be told.
- `thread_read_bytes()`: bytes this thread caused to be fetched from storage
  (/proc/thread-self/io `read_bytes`); None without per-task I/O accounting.
- `provable_fs(fd)`: whether the file's filesystem is one where those two facts mean "from the
  device" (ext4, xfs, btrfs).

A re-read through the page cache proves the device's bytes only on such a filesystem, if no page of
the file was cached when it began (resident_pages == 0), the thread then fetched the whole file
from storage (read_bytes grew by at least the size) and the file did not change meanwhile:
`local.py` checks all of it, and re-reads with O_DIRECT if anything fails. Linux only; every
function answers "unknown" (False/None) elsewhere.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
from collections.abc import Callable
from typing import cast

_WRITE = 2  # SYNC_FILE_RANGE_WRITE
_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on the device when it returns


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    libc = _libc()
    fn = getattr(libc, "sync_file_range", None) if libc is not None else None
    if fn is None:
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", fn)


def write_out(fd: int, offset: int, length: int, *, wait: bool) -> bool:
    """Start writeback of `length` bytes at `offset` of the open file (with `wait`: and return once
    they reached the device). False where sync_file_range is unavailable or refused (nothing done);
    OSError for an I/O error it reports."""
    fn = _sync_file_range()
    if fn is None or length <= 0:
        return False
    while fn(fd, offset, length, _WAIT if wait else _WRITE) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.EPERM):
            return False  # not here (EPERM: a seccomp filter): write-behind is only a speed-up
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))
    return True


@functools.cache
def _mincore() -> Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int] | None:
    libc = _libc()
    if libc is None or not all(hasattr(libc, n) for n in ("mmap", "munmap", "mincore")):
        return None
    c_int = ctypes.c_int
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_long)  # off_t
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    libc.mincore.restype = ctypes.c_int
    return cast("Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int]", libc.mincore)


RESIDENCY_WINDOW = 1 << 30
"""resident_pages maps and asks about this many bytes at a time (a 1 TiB file needs no 256 MiB
table)."""


def resident_pages(fd: int, size: int) -> int | None:
    """How many pages of the open file's first `size` bytes the page cache holds now, counted up to
    the first window that holds any; None where it cannot be told (no mincore, a mapping refused).
    Mapping the file reads nothing. 0 means none at all."""
    if size <= 0:
        return 0
    mincore, libc = _mincore(), _libc()
    if mincore is None or libc is None:
        return None
    for offset in range(0, size, RESIDENCY_WINDOW):
        length = min(RESIDENCY_WINDOW, size - offset)
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
            if mincore(addr, length, vec) != 0:
                return None
            # mincore answers "resident" for every page of a file the caller may not write (so
            # that it reveals nothing of others' reads): the verify owns its copies, and a wrong
            # "resident" only sends it to the O_DIRECT re-read. Bit 0 is "resident"; the others
            # are reserved (zero).
            raw = bytes(vec)
            cached = len(raw) - raw.count(0)
        finally:
            libc.munmap(addr, length)
        if cached:
            return cached
    return 0


_FS_MAGIC = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs"}
"""Filesystems whose page cache is the only cache between a read and the device, and which charge
a read to the thread that made it (block layer accounting): there, no cached page at the start and
every byte charged means every byte came from the device. ZFS (its own ARC, charging RAM hits on
older versions), network filesystems (fscache) and FUSE are not among them."""


def provable_fs(fd: int) -> str | None:
    """The name of the open file's filesystem if a read through its page cache can be shown to
    come from the device (`_FS_MAGIC`); None otherwise or where fstatfs is unavailable."""
    libc = _libc()
    fstatfs = getattr(libc, "fstatfs", None) if libc is not None else None
    if fstatfs is None:
        return None
    buf = (ctypes.c_long * 32)()  # struct statfs: f_type (a long) first; 120 bytes on 64-bit Linux
    if fstatfs(fd, buf) != 0:
        return None
    return _FS_MAGIC.get(buf[0] & 0xFFFFFFFF)


def thread_read_bytes() -> int | None:
    """Bytes the calling thread has caused to be fetched from storage (readahead included); None
    where the kernel keeps no per-task I/O accounting."""
    try:
        with open("/proc/thread-self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
