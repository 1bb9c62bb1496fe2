"""What the kernel's page cache holds of a file and what a thread read from storage, and pushing a
written range out to the device: the facts a copy made and proven through the page cache relies on.

- `write_out(fd, offset, length, wait)`: sync_file_range(2), start (and with `wait`, finish)
  writeback of a range, so a buffered copy leaves the box's memory as it is written.
- `resident_pages(fd, size)`: how many of the file's pages the page cache holds (mincore(2) on a
  mapping of it); None where that cannot be told.
- `thread_read_bytes()`: bytes this thread caused to be fetched from storage
  (/proc/thread-self/io `read_bytes`); None without per-task I/O accounting.

A re-read through the page cache proves the device's bytes only if no page of the file was cached
when it began (resident_pages == 0) and the thread then fetched the whole file from storage
(read_bytes grew by at least the size): `local.py` checks both, and re-reads with O_DIRECT if
either fails. Linux only; every function answers "unknown" (False/None) elsewhere.
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
        if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
            return False
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))
    return True


@functools.cache
def _mincore() -> Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int] | None:
    libc = _libc()
    if libc is None or not all(hasattr(libc, n) for n in ("mmap", "munmap", "mincore")):
        return None
    c_int = ctypes.c_int
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_int64)
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    libc.mincore.restype = ctypes.c_int
    return cast("Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int]", libc.mincore)


def resident_pages(fd: int, size: int) -> int | None:
    """How many pages of the open file's first `size` bytes the page cache holds now; None where
    it cannot be told (no mincore, the mapping refused). Mapping the file reads nothing."""
    mincore = _mincore()
    libc = _libc()
    if size <= 0:
        return 0
    if mincore is None or libc is None:
        return None
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if mincore(addr, size, vec) != 0:
            return None
        # mincore answers "resident" for every page of a file the caller may not write (so that
        # it reveals nothing of others' reads): the verify owns its copies, and a wrong "resident"
        # only sends it to the O_DIRECT re-read.
        raw = bytes(vec)
        return len(raw) - raw.count(0)  # bit 0 is "resident"; the others are reserved (zero)
    finally:
        libc.munmap(addr, size)


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
