"""rename_noreplace: move a file to a new name only if nothing has that name, never replacing it.

`os.rename` silently replaces an existing file at the destination: a release that renames a file
aside that way deletes whatever already had the aside name. Linux has renameat2(RENAME_NOREPLACE)
for this; where the filesystem or libc lacks it, link() + unlink() gives the same guarantee (link
fails with EEXIST instead of replacing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load() -> ctypes._NamedFuncPointer | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename src to dst; FileExistsError if dst exists (nothing is replaced), OSError otherwise."""
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
        logger.debug("renameat2 unsupported here (%s); link + unlink instead", os.strerror(err))
    os.link(src, dst, follow_symlinks=False)
    try:
        os.unlink(src)
    except OSError:
        os.unlink(dst)  # undo: the file keeps its one original name
        raise
