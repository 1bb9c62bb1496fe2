"""The durable root as a tree that is walked without ever following a symlink.

Every path under the root is opened one component at a time with directory fds and O_NOFOLLOW, so
a symlink planted anywhere below the root is refused instead of followed.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from sidecar.errors import UnsafePathError
from sidecar.storage import split_rel
from sidecar.storage.fsio import close_fd, storage_error

logger = logging.getLogger(__name__)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def walk_dirs(root: Path, parts: tuple[str, ...], *, create: bool) -> tuple[list[int], int | None]:
    """Open root and each directory in `parts` without following symlinks.

    Returns the open fds (root first) and the index in that list of the first directory this
    call created (None if none). Missing directories are created only if `create`; otherwise
    FileNotFoundError propagates. The caller closes the fds.
    """
    try:
        fds = [os.open(root, DIR_FLAGS)]
    except OSError as exc:
        raise storage_error("opening durable root", root, exc) from exc
    first_new: int | None = None
    try:
        for k, name in enumerate(parts, start=1):
            here = root.joinpath(*parts[:k])
            try:
                fds.append(os.open(name, DIR_FLAGS, dir_fd=fds[-1]))
                continue
            except FileNotFoundError:
                if not create:
                    raise
            except OSError as exc:
                refuse_symlink(here, name, fds[-1])
                if not create and isinstance(exc, NotADirectoryError):
                    raise
                raise storage_error("opening directory", here, exc) from exc
            try:
                os.mkdir(name, 0o755, dir_fd=fds[-1])
            except FileExistsError:
                pass  # a concurrent commit made it first; still ours to walk into
            except OSError as exc:
                raise storage_error("creating directory", here, exc) from exc
            if first_new is None:
                first_new = k
            try:
                fds.append(os.open(name, DIR_FLAGS, dir_fd=fds[-1]))
            except OSError as exc:
                refuse_symlink(here, name, fds[-1])
                raise storage_error("opening directory", here, exc) from exc
    except BaseException:
        for fd in fds:
            close_fd(fd)
        raise
    return fds, first_new


def sync_made_dirs(dir_fds: list[int], first_new: int | None) -> None:
    """Flush what a rename into the last of `walk_dirs`'s fds needs on disk: that directory, and
    every directory from the parent of the first one `walk_dirs` created down to it (each new
    directory is durable once *its* parent is flushed). OSError is the caller's to name."""
    lowest = len(dir_fds) - 1 if first_new is None else first_new - 1
    for k in range(len(dir_fds) - 1, lowest - 1, -1):
        os.fsync(dir_fds[k])


def open_final(root: Path, rel: str) -> int | None:
    """Open the durable copy at `rel` read-only; None if no regular file is there."""
    parts = split_rel(rel)
    try:
        dir_fds, _ = walk_dirs(root, parts[:-1], create=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(parts[-1], flags, dir_fd=dir_fds[-1])
    except FileNotFoundError:
        return None
    except OSError as exc:
        refuse_symlink(root / rel, parts[-1], dir_fds[-1])
        raise storage_error("opening durable copy", root / rel, exc) from exc
    finally:
        for dfd in dir_fds:
            close_fd(dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        close_fd(fd)
        return None
    return fd


def open_tmp_dir(tmp_dir: Path) -> int:
    """Open the temp directory without following a symlink; FileNotFoundError if missing."""
    try:
        return os.open(tmp_dir, DIR_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if tmp_dir.is_symlink():
            raise UnsafePathError(
                f"{tmp_dir} is a symlink; nothing under the durable root may be one"
            ) from exc
        raise storage_error("opening temp directory", tmp_dir, exc) from exc


def refuse_symlink(path: Path, name: str, dir_fd: int) -> None:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path} is a symlink; nothing under the durable root may be one")


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # already failing; the leftover is removed by clean_tmp at startup
        logger.warning("could not remove temp copy %s: %s", path, exc)
