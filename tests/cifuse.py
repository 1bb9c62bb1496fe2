"""A case-insensitive, case-preserving passthrough filesystem for tests (what an SMB/CIFS share, an
exFAT or vfat disk, or an ext4 casefold dir does to names), on FUSE: `cifuse.py BACKING MOUNTPOINT`.

Each name is looked up by its exact spelling first, then case-insensitively; a new name keeps the
case it was created with; a rename onto a name that exists in another case replaces that file.
This kernel has no casefold support and no vfat, so this is the real filesystem behaviour the
durable store's name probe is tested against. Runs in the foreground until unmounted. With
CIFUSE_EXACT=1 in its environment, names are looked up as spelled (a plain passthrough); with
CIFUSE_HANG_STATFS=FILE, statfs hangs while FILE exists (a mount that stopped answering).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]

_STAT = ("st_atime", "st_ctime", "st_mtime", "st_gid", "st_uid", "st_mode", "st_nlink", "st_size", "st_ino")
_STATVFS = (
    "f_bavail",
    "f_bfree",
    "f_blocks",
    "f_bsize",
    "f_favail",
    "f_ffree",
    "f_files",
    "f_frsize",
    "f_namemax",
)


class CaseInsensitive(Operations):  # type: ignore[misc]
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.exact = os.environ.get("CIFUSE_EXACT") == "1"  # names as they are: a plain passthrough

    def _real(self, path: str) -> str:
        here = self.root
        for part in (p for p in path.split("/") if p):
            exact = os.path.join(here, part)
            if not self.exact and not os.path.lexists(exact) and os.path.isdir(here):
                folded = part.casefold()
                exact = next(
                    (os.path.join(here, n) for n in os.listdir(here) if n.casefold() == folded), exact
                )
            here = exact
        return here

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            raise FuseOSError(e.errno or errno.EIO) from e

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = self._call(os.lstat, self._real(path))
        return {k: getattr(st, k) for k in _STAT}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *self._call(os.listdir, self._real(path))]

    def statfs(self, path: str) -> dict[str, Any]:
        # A mount that stops answering (a hung NFS server): while the file CIFUSE_HANG_STATFS names
        # exists, statfs does not return (the server's only thread waits).
        hang = os.environ.get("CIFUSE_HANG_STATFS")
        while hang and os.path.exists(hang):
            time.sleep(0.05)
        st = self._call(os.statvfs, self._real(path))
        return {k: getattr(st, k) for k in _STATVFS}

    def access(self, path: str, mode: int) -> None:
        if not os.access(self._real(path), mode):
            raise FuseOSError(errno.EACCES)

    def chmod(self, path: str, mode: int) -> None:
        self._call(os.chmod, self._real(path), mode)

    def utimens(self, path: str, times: Any = None) -> None:
        self._call(os.utime, self._real(path), times)

    def mkdir(self, path: str, mode: int) -> None:
        self._call(os.mkdir, self._real(path), mode)

    def rmdir(self, path: str) -> None:
        self._call(os.rmdir, self._real(path))

    def unlink(self, path: str) -> None:
        self._call(os.unlink, self._real(path))

    def rename(self, old: str, new: str) -> None:
        self._call(os.rename, self._real(old), self._real(new))

    def link(self, target: str, source: str) -> None:
        self._call(os.link, self._real(source), self._real(target))

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return int(self._call(os.open, self._real(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))

    def open(self, path: str, flags: int) -> int:
        return int(self._call(os.open, self._real(path), flags & ~(os.O_DIRECT | os.O_NOFOLLOW)))

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return bytes(self._call(os.pread, fh, size, offset))

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return int(self._call(os.pwrite, fh, data, offset))

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        self._call(os.truncate, self._real(path) if fh is None else fh, length)

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        self._call(os.fsync, fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> None:
        self._call(os.close, fh)


if __name__ == "__main__":
    FUSE(CaseInsensitive(sys.argv[1]), sys.argv[2], foreground=True, nothreads=True)
