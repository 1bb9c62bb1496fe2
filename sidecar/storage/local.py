"""`file://` durable store: a directory on a local or mounted filesystem.

This module owns the copy, commit and proof of one artifact on a POSIX filesystem:

- stage: ONE read pass over the source. The calling thread reads each chunk into a reusable,
  page-aligned buffer and hashes it while a writer thread writes that same buffer to
  `<root>/.boxwarden-tmp/<uuid>`, so the digest is of exactly the bytes written. Copies of 1 MiB
  and more are written with O_DIRECT: no page-cache copy to make, nothing left for fsync to flush,
  and the trainer keeps its page cache. Where O_DIRECT is refused, written ranges are pushed to
  the device early instead (POSIX_FADV_DONTNEED starts writeback of dirty pages).
- commit: fsync the temp, rename it into place, fsync every directory the rename touched.
- verify: drop the copy from the page cache, then re-read it from the device and hash it; a
  verification that reads cached pages proves nothing about the disk.

Paths inside the root are walked one component at a time with directory fds and O_NOFOLLOW, so a
symlink planted anywhere under the root is refused instead of followed.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sidecar import hashing
from sidecar.errors import ConfigError, PreconditionError, StorageError, UnsafePathError
from sidecar.storage import (
    ID_NAME,
    TMP_DIRNAME,
    Progress,
    StagedCopy,
    check_source_unchanged,
    open_source,
    split_rel,
)

logger = logging.getLogger(__name__)

WRITEBACK_WINDOW = 64 << 20
"""Buffered copies only: bytes written between two writeback kicks during stage."""

READ_AHEAD = 64 << 20
"""verify: bytes requested from the device ahead of the hash (POSIX_FADV_WILLNEED)."""

_BUFFERS = 3  # chunk buffers per stage: one being read and hashed, up to three being written
_ALIGN = 4096  # O_DIRECT offset/length alignment that every common block device accepts
_DIRECT_MIN = 1 << 20  # below this, the page cache costs nothing worth avoiding

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

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


def _storage_error(action: str, path: Path | str, exc: OSError) -> StorageError:
    hint = _HINTS.get(exc.errno or 0, "check the durable store")
    return StorageError(f"{action} {path} failed: {exc.strerror or exc}; {hint}")


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # an fd we own and close once; a failure here is only worth a note
        logger.warning("closing fd %d failed: %s", fd, exc)


def _read_ahead(fd: int, done: int, advised: int) -> int:
    """Ask the kernel to start reading up to READ_AHEAD bytes past `done`; returns the new mark."""
    if done + READ_AHEAD > advised:
        os.posix_fadvise(fd, advised, done + READ_AHEAD - advised, os.POSIX_FADV_WILLNEED)
        advised = done + READ_AHEAD
    return advised


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _DirectUnsupported(Exception):
    """An O_DIRECT write was refused (alignment the filesystem will not take); retry buffered."""


class LocalStore:
    """A durable store rooted at one directory. Thread-safe: concurrent stages share nothing but
    the writer threads."""

    def __init__(
        self,
        root: Path,
        *,
        url: str | None = None,
        chunk_size: int = hashing.STAGE_CHUNK,
        direct_io: bool = True,
    ) -> None:
        """`root` must be an absolute path to an existing directory (see `from_url`).

        `chunk_size` is the read/write size of stage's single pass (a multiple of 4096); tests pass
        a small one to get several `progress` calls out of a small file. `direct_io` writes copies
        of 1 MiB and more with O_DIRECT: they bypass the page cache, so the trainer keeps its cache,
        commit's fsync has no data left to flush, and nothing stale can be re-read by verify.
        It turns itself off on filesystems that refuse O_DIRECT.
        """
        if not root.is_absolute():
            raise ValueError(f"root must be absolute, got {root}")
        if chunk_size <= 0 or chunk_size % _ALIGN:
            raise ValueError(f"chunk_size must be a positive multiple of {_ALIGN}, got {chunk_size}")
        self.root = root
        self.url = url if url is not None else root.as_uri()
        self._chunk_size = chunk_size
        self._direct_io = direct_io
        self._tmp_dir = root / TMP_DIRNAME
        # Writes of every concurrent stage share these threads; each stage has at most _BUFFERS
        # writes in flight, and a few concurrent stages already saturate any disk.
        self._write_pool = ThreadPoolExecutor(max_workers=2 * _BUFFERS, thread_name_prefix="boxwarden-write")

    @classmethod
    def from_url(cls, url: str) -> LocalStore:
        """Open `file:///abs/dir`, creating `dir` (not its parents) if it is missing."""
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ConfigError(
                f"durable URL {url!r}: expected file:///absolute/dir (no host, query or fragment)"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"durable URL {url!r}: the directory must be absolute (file:///abs/dir)")
        root = Path(path)
        if not root.parent.is_dir():
            raise ConfigError(
                f"durable URL {url!r}: parent directory {root.parent} does not exist; "
                "mount the durable volume (or create the parent) first"
            )
        if root.exists() and not root.is_dir():
            raise ConfigError(f"durable URL {url!r}: {root} exists and is not a directory")
        try:
            root.mkdir(exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"durable URL {url!r}: cannot create {root}: {exc.strerror or exc}") from exc
        # Resolve once: symlinks in the configured path are the operator's choice; under it, none.
        return cls(root.resolve(strict=True), url=url)

    # ----------------------------------------------------------------------------------- stage

    def stage(self, src: Path, rel: str, *, progress: Progress | None = None) -> StagedCopy:
        split_rel(rel)
        before, src_fd = open_source(src)
        try:
            tmp_path, out_fd, direct = self._open_tmp(before.size)
            try:
                try:
                    digest, copied = self._copy(src, src_fd, out_fd, tmp_path, direct, progress)
                finally:
                    _close(out_fd)
                check_source_unchanged(src, before, src_fd, copied)
            except BaseException:
                self._remove_quietly(tmp_path)
                raise
        except _DirectUnsupported:
            logger.warning(
                "%s refuses O_DIRECT writes; copying through the page cache from now on", self.root
            )
            self._direct_io = False
            return self.stage(src, rel, progress=progress)
        finally:
            _close(src_fd)
        return StagedCopy(rel=rel, tmp_path=tmp_path, digest=digest, size=copied, source=before)

    def _open_tmp(self, size: int) -> tuple[Path, int, bool]:
        """Create a fresh temp file; returns its path, a write fd, and whether the fd is O_DIRECT."""
        try:
            os.mkdir(self._tmp_dir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise _storage_error("creating temp directory", self._tmp_dir, exc) from exc
        try:
            dir_fd = self._open_tmp_dir()
        except FileNotFoundError as exc:
            raise _storage_error("opening temp directory", self._tmp_dir, exc) from exc
        try:
            direct = self._direct_io and size >= _DIRECT_MIN
            while True:
                name = uuid.uuid4().hex
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
                try:
                    return self._tmp_dir / name, os.open(name, flags, 0o644, dir_fd=dir_fd), direct
                except OSError as exc:
                    if not (direct and exc.errno == errno.EINVAL):
                        raise _storage_error("creating temp copy", self._tmp_dir / name, exc) from exc
                # The filesystem has no O_DIRECT (FUSE, some network mounts). The failed open may
                # have created the file already, hence a new name for the buffered retry.
                self._remove_quietly(self._tmp_dir / name)
                logger.info("%s does not support O_DIRECT; copying through the page cache", self.root)
                self._direct_io = direct = False
        finally:
            _close(dir_fd)

    def _copy(
        self, src: Path, src_fd: int, out_fd: int, tmp_path: Path, direct: bool, progress: Progress | None
    ) -> tuple[str, int]:
        """The single pass over the source.

        The calling thread reads chunk i into one of three buffers and hashes it while a writer
        thread writes the same buffer at its offset, so reading+hashing overlaps writing and the
        device sees up to three writes in flight. The hashed bytes and the written bytes are the
        same memory: the digest is of exactly what was written.
        """
        # One hashing thread: it keeps pace with the device (3.5 GB/s), and a multithreaded hash
        # measured no faster here while it would take cores from the trainer.
        hasher = hashing.new_hasher()
        # mmap'd buffers are page aligned, as O_DIRECT requires.
        buffers = [mmap.mmap(-1, self._chunk_size) for _ in range(_BUFFERS)]
        writes: deque[tuple[Future[None], int]] = deque()  # in submission order, with end offset
        copied = kicked = dropped = 0
        try:
            for i in itertools.count():
                if len(writes) == _BUFFERS:  # the buffer about to be reused is still being written
                    written = self._finish_write(writes.popleft(), tmp_path, direct)
                    if not direct and written - kicked >= WRITEBACK_WINDOW:
                        # Start writeback of what is written and drop what went out last time,
                        # so fsync has little left to do and the page cache stays the trainer's.
                        os.posix_fadvise(out_fd, dropped, written - dropped, os.POSIX_FADV_DONTNEED)
                        dropped, kicked = kicked, written
                buf = buffers[i % _BUFFERS]
                try:
                    n = os.readv(src_fd, [buf])
                except OSError as exc:
                    raise StorageError(f"reading source {src} failed: {exc.strerror or exc}") from exc
                if n == 0:
                    break
                view = memoryview(buf)[:n]
                if direct and n % _ALIGN:
                    # A short read (normally the last one) leaves an unaligned length, and O_DIRECT
                    # takes aligned lengths only: the rest of the copy goes through the page cache.
                    while writes:
                        self._finish_write(writes.popleft(), tmp_path, direct)
                    fcntl.fcntl(out_fd, fcntl.F_SETFL, fcntl.fcntl(out_fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    direct = False
                writes.append((self._write_pool.submit(_pwrite_all, out_fd, view, copied), copied + n))
                hasher.update(view)
                copied += n
                if progress is not None:
                    progress(copied)
            while writes:
                self._finish_write(writes.popleft(), tmp_path, direct)
        finally:
            # Never let the caller close the fd (or the buffers go) under a write in flight.
            futures_wait([f for f, _ in writes])
        return hasher.hexdigest(), copied

    @staticmethod
    def _finish_write(write: tuple[Future[None], int], tmp_path: Path, direct: bool) -> int:
        future, end = write
        try:
            future.result()
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise _DirectUnsupported from exc
            raise _storage_error("writing temp copy", tmp_path, exc) from exc
        return end

    # ---------------------------------------------------------------------------------- commit

    def commit(self, staged: StagedCopy) -> None:
        parts = split_rel(staged.rel)
        if staged.tmp_path.parent != self._tmp_dir:
            raise PreconditionError(f"{staged.tmp_path} was not staged by the store at {self.url}")
        try:
            self._commit(staged, parts)
        except BaseException:
            # A failed commit leaves no temp behind; the caller re-stages from the source.
            self._remove_quietly(staged.tmp_path)
            raise
        logger.debug("committed %s (%d bytes, %s)", staged.rel, staged.size, staged.digest)

    def _commit(self, staged: StagedCopy, parts: tuple[str, ...]) -> None:
        try:
            fd = os.open(staged.tmp_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise PreconditionError(f"staged copy {staged.tmp_path} is gone (discarded or cleaned)") from exc
        except OSError as exc:
            raise _storage_error("opening staged copy", staged.tmp_path, exc) from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _storage_error("flushing staged copy", staged.tmp_path, exc) from exc
        finally:
            _close(fd)
        final = self.root.joinpath(*parts)
        dir_fds, first_new = self._walk_dirs(parts[:-1], create=True)
        try:
            # rename() replaces a symlink at the final name rather than following it, but a
            # symlink there means someone else is writing under our root: refuse, loudly.
            self._refuse_symlink(final, parts[-1], dir_fds[-1])
            try:
                os.replace(staged.tmp_path, parts[-1], dst_dir_fd=dir_fds[-1])
            except OSError as exc:
                raise _storage_error("renaming staged copy to", final, exc) from exc
            # The rename is durable once the final parent is flushed; each directory created on
            # the way is durable once *its* parent is flushed. So: every dir from the parent of
            # the first new one down to the final parent.
            lowest = len(dir_fds) - 1 if first_new is None else first_new - 1
            for k in range(len(dir_fds) - 1, lowest - 1, -1):
                try:
                    os.fsync(dir_fds[k])
                except OSError as exc:
                    raise _storage_error("flushing directory of", final, exc) from exc
        finally:
            for dfd in dir_fds:
                _close(dfd)

    def discard(self, staged: StagedCopy) -> None:
        if staged.tmp_path.parent != self._tmp_dir:
            raise PreconditionError(f"{staged.tmp_path} was not staged by the store at {self.url}")
        try:
            os.unlink(staged.tmp_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _storage_error("removing staged copy", staged.tmp_path, exc) from exc

    # ---------------------------------------------------------------------------------- verify

    def verify(self, rel: str, digest: str) -> bool:
        fd = self._open_final(rel)
        if fd is None:
            return False
        path = self.root / rel
        try:
            # DONTNEED only drops clean pages; the copy is clean after commit, and if someone
            # dirtied it since, flushing first is what makes the re-read come from the device.
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            hasher = hashing.new_hasher(update_size=hashing.VERIFY_CHUNK)
            buf = bytearray(hashing.VERIFY_CHUNK)
            view = memoryview(buf)
            done = advised = dropped = 0
            while True:
                # Plain sequential reads of a freshly written file ran at half the device's speed
                # here (one readahead stream, mostly waiting); asking for the next READ_AHEAD bytes
                # up front keeps several requests in flight while this thread hashes.
                advised = _read_ahead(fd, done, advised)
                n = os.readv(fd, [buf])
                if n == 0:
                    break
                hasher.update(view[:n])
                done += n
                if done - dropped >= READ_AHEAD:
                    # Leave nothing behind as we go: the copy is for the future, not for this box's
                    # page cache (a 20 GiB checkpoint would evict the trainer's), and freeing pages
                    # while the device works costs less than freeing them all at the end.
                    os.posix_fadvise(fd, dropped, done - dropped, os.POSIX_FADV_DONTNEED)
                    dropped = done
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise _storage_error("re-reading durable copy", path, exc) from exc
        finally:
            _close(fd)
        ok: bool = hasher.hexdigest() == digest
        if not ok:
            logger.warning("durable copy %s does not hash to its claim %s", path, digest)
            return False
        # The bytes are right; make sure the name is too. A kill between commit's rename and its
        # directory fsync leaves a rename that a power cut could still undo.
        self._sync_dirs(split_rel(rel)[:-1], path)
        return True

    def _sync_dirs(self, parts: tuple[str, ...], path: Path) -> None:
        try:
            dir_fds, _ = self._walk_dirs(parts, create=False)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise StorageError(f"{path} vanished while being verified") from exc
        try:
            for dfd in reversed(dir_fds):
                os.fsync(dfd)
        except OSError as exc:
            raise _storage_error("flushing directories of", path, exc) from exc
        finally:
            for dfd in dir_fds:
                _close(dfd)

    def exists(self, rel: str) -> bool:
        fd = self._open_final(rel)
        if fd is None:
            return False
        _close(fd)
        return True

    def path_for_usage(self) -> Path:
        return self.root

    def store_id(self) -> str:
        path = self.root / ID_NAME
        try:
            return path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _storage_error("reading store id", path, exc) from exc
        new = uuid.uuid4().hex
        tmp = self._tmp_dir / f"id-{new}"
        try:
            self._tmp_dir.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, new.encode() + b"\n")
                os.fsync(fd)
            finally:
                _close(fd)
            # link() fails if another sidecar made one first: then theirs is the store's id.
            try:
                os.link(tmp, path)
            except FileExistsError:
                return path.read_text(encoding="ascii").strip()
            finally:
                os.unlink(tmp)
            dfd = os.open(self.root, _DIR_FLAGS)
            try:
                os.fsync(dfd)
            finally:
                _close(dfd)
        except OSError as exc:
            raise _storage_error("writing store id", path, exc) from exc
        return new

    def clean_tmp(self) -> int:
        try:
            dir_fd = self._open_tmp_dir()
        except FileNotFoundError:
            return 0
        removed = 0
        try:
            for name in os.listdir(dir_fd):
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    continue
                except IsADirectoryError:  # not ours: we only ever create files here
                    logger.warning("leaving unexpected directory %s", self._tmp_dir / name)
                    continue
                except OSError as exc:
                    raise _storage_error("removing leftover temp copy", self._tmp_dir / name, exc) from exc
                removed += 1
        finally:
            _close(dir_fd)
        if removed:
            logger.info("removed %d leftover temp copies from %s", removed, self._tmp_dir)
        return removed

    def close(self) -> None:
        self._write_pool.shutdown(wait=True)

    # --------------------------------------------------------------------------------- helpers

    def _walk_dirs(self, parts: tuple[str, ...], *, create: bool) -> tuple[list[int], int | None]:
        """Open root and each directory in `parts` without following symlinks.

        Returns the open fds (root first) and the index in that list of the first directory this
        call created (None if none). Missing directories are created only if `create`; otherwise
        FileNotFoundError propagates. The caller closes the fds.
        """
        try:
            fds = [os.open(self.root, _DIR_FLAGS)]
        except OSError as exc:
            raise _storage_error("opening durable root", self.root, exc) from exc
        first_new: int | None = None
        try:
            for k, name in enumerate(parts, start=1):
                here = self.root.joinpath(*parts[:k])
                try:
                    fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
                    continue
                except FileNotFoundError:
                    if not create:
                        raise
                except OSError as exc:
                    self._refuse_symlink(here, name, fds[-1])
                    if not create and isinstance(exc, NotADirectoryError):
                        raise
                    raise _storage_error("opening directory", here, exc) from exc
                try:
                    os.mkdir(name, 0o755, dir_fd=fds[-1])
                except FileExistsError:
                    pass  # a concurrent commit made it first; still ours to walk into
                except OSError as exc:
                    raise _storage_error("creating directory", here, exc) from exc
                if first_new is None:
                    first_new = k
                try:
                    fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
                except OSError as exc:
                    self._refuse_symlink(here, name, fds[-1])
                    raise _storage_error("opening directory", here, exc) from exc
        except BaseException:
            for fd in fds:
                _close(fd)
            raise
        return fds, first_new

    def _open_final(self, rel: str) -> int | None:
        """Open the durable copy at `rel` read-only; None if no regular file is there."""
        parts = split_rel(rel)
        try:
            dir_fds, _ = self._walk_dirs(parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(parts[-1], flags, dir_fd=dir_fds[-1])
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._refuse_symlink(self.root / rel, parts[-1], dir_fds[-1])
            raise _storage_error("opening durable copy", self.root / rel, exc) from exc
        finally:
            for dfd in dir_fds:
                _close(dfd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _close(fd)
            return None
        return fd

    def _open_tmp_dir(self) -> int:
        """Open the temp directory without following a symlink; FileNotFoundError if missing."""
        try:
            return os.open(self._tmp_dir, _DIR_FLAGS)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if self._tmp_dir.is_symlink():
                raise UnsafePathError(
                    f"{self._tmp_dir} is a symlink; nothing under the durable root may be one"
                ) from exc
            raise _storage_error("opening temp directory", self._tmp_dir, exc) from exc

    @staticmethod
    def _refuse_symlink(path: Path, name: str, dir_fd: int) -> None:
        try:
            st = os.lstat(name, dir_fd=dir_fd)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"{path} is a symlink; nothing under the durable root may be one")

    @staticmethod
    def _remove_quietly(path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # already failing; the leftover is removed by clean_tmp at startup
            logger.warning("could not remove temp copy %s: %s", path, exc)
