"""`file://` durable store: a directory on a local or mounted filesystem.

This module owns the copy, commit and proof of one artifact on a POSIX filesystem:

- stage: ONE read pass over the source (`copier.single_pass`, shared with other backends) into
  the temp file `<root>/.boxwarden-tmp/<uuid>`, whose path is the staged copy's handle. Copies of 1 MiB
  and more are allocated whole up front (fallocate: a store too small fails before the source is
  read). They are written through the page cache and pushed out behind the writer
  (`pagecache.write_out`), so the copy leaves memory as it is written and the kernel writes it
  back in large folios: requests of up to the device's maximum, where O_DIRECT from page-backed
  buffers is cut into ~1 MiB ones (`direct_io=True` writes with O_DIRECT all the same).
- commit: fsync the temp, rename it into place, fsync every directory the rename touched.
- verify: re-read the copy from the device and hash it. The copy is flushed and dropped from the
  page cache, then read in order through it; that counts only where the kernel shows no page of
  it was cached and this thread fetched every byte from storage (`pagecache`). Otherwise, or with
  `direct_io`, O_DIRECT reads (`fsio.hash_direct`); where those are refused, reads after the drop.
  A verification that reads cached pages proves nothing about the disk.

  Measured on this VM's disk, 1 GiB, against `cp && sync` then `b3sum` of both ends: 1.21 s
  against 1.71 s; with O_DIRECT writes and reads, 1.60–1.75 s against the same.

Stage and verify keep to the sidecar's push rate (`pace.py`), given to the store.

Paths inside the root are walked without following symlinks (`tree.py`); the low-level reads,
writes and the device re-read live in `fsio.py`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from sidecar import hashing
from sidecar.errors import ConfigError, PreconditionError, StorageError, UnsafePathError
from sidecar.priority import lower_this_thread
from sidecar.probes import DiskSample
from sidecar.storage import (
    ATTIC_NAME,
    ID_NAME,
    OWNER_NAME,
    REREAD,
    TMP_DIRNAME,
    Progress,
    StagedCopy,
    check_scope,
    check_source_unchanged,
    copier,
    open_source,
    split_rel,
)
from sidecar.storage.copier import BUFFERS, Ahead, single_pass
from sidecar.storage.fsio import (
    DIRECT_ALIGN,
    DIRECT_DEPTH,
    DirectUnsupported,
    close_fd,
    hash_by_read,
    hash_direct,
    preallocate,
    pwrite_all,
    set_direct,
    storage_error,
)
from sidecar.storage.pace import UNLIMITED, Pace
from sidecar.storage.pagecache import provable_fs, resident_pages, thread_read_bytes, write_out
from sidecar.storage.tree import (
    DIR_FLAGS,
    open_final,
    open_tmp_dir,
    refuse_symlink,
    remove_quietly,
    sync_made_dirs,
    walk_dirs,
)

logger = logging.getLogger(__name__)

WRITE_BEHIND = 16 << 20
"""Copies through the page cache: writeback starts every WRITE_BEHIND bytes, and stage waits for
the bytes WRITE_BEHIND behind the last written to reach the device (then drops them)."""

_DIRECT_MIN = 1 << 20  # below this, the page cache costs nothing worth avoiding


class _DirectUnsupported(Exception):
    """An O_DIRECT write was refused (alignment the filesystem will not take); retry buffered."""


class _FileSink:
    """A pass written into the temp file `fd` at `path`: with O_DIRECT while `direct` (page-aligned
    buffers, aligned lengths), else through the page cache with writeback started as it goes."""

    def __init__(
        self, fd: int, path: Path, direct: bool, ahead: Ahead | None = None, *, recording: bool = False
    ) -> None:
        """`ahead`: the copy was pushed ahead of the seal into this file; `recording`: this pass is
        such a push (each chunk's CRC is recorded), else the seal's pass (equal chunks are skipped)."""
        self.fd, self.path, self.direct = fd, path, direct
        self._ahead, self._recording = ahead, recording
        self._kicked = self._dropped = 0

    def write(self, data: memoryview, offset: int) -> None:
        if self.direct and len(data) % DIRECT_ALIGN:
            # A short read (normally the last one) leaves an unaligned length, and O_DIRECT takes
            # aligned lengths only: the rest goes through the page cache. This write is `alone`: no
            # other write of the pass runs under the flag change.
            set_direct(self.fd, False)
            self.direct = False
        try:
            pwrite_all(self.fd, data, offset)
        except OSError as exc:
            if self.direct and exc.errno == errno.EINVAL:
                raise _DirectUnsupported from exc
            raise storage_error("writing temp copy", self.path, exc) from exc
        if self._recording and self._ahead is not None:
            self._ahead.record(data, offset)

    def already(self, data: memoryview, offset: int) -> bool:
        return self._ahead is not None and not self._recording and self._ahead.matches(data, offset)

    def written(self, end: int) -> None:
        if self.direct or end - self._kicked < WRITE_BEHIND:
            return
        # Start writeback of what was just written; wait for what is WRITE_BEHIND further back to
        # reach the device and drop it. The copy leaves memory as it is written (fsync has little
        # left to do, the page cache stays the trainer's), and the kernel writes it back in
        # large folios: requests of up to max_sectors_kb, where an O_DIRECT write from a
        # page-backed buffer is cut into ~1 MiB ones.
        if not write_out(self.fd, self._kicked, end - self._kicked, wait=False):
            # No sync_file_range: DONTNEED starts writeback of dirty pages and drops clean ones.
            os.posix_fadvise(self.fd, self._dropped, end - self._dropped, os.POSIX_FADV_DONTNEED)
            self._dropped, self._kicked = self._kicked, end
            return
        self._kicked = end
        settled = end - WRITE_BEHIND
        if settled > self._dropped:
            write_out(self.fd, self._dropped, settled - self._dropped, wait=True)
            os.posix_fadvise(self.fd, self._dropped, settled - self._dropped, os.POSIX_FADV_DONTNEED)
            self._dropped = settled

    def alone(self, n: int) -> bool:
        return self.direct and n % DIRECT_ALIGN != 0


@dataclass
class _AheadFile:
    """The temp file a copy is pushed ahead into, held open until the seal's stage takes it."""

    path: Path
    fd: int
    direct: bool


class LocalStore:
    """A durable store rooted at one directory. Thread-safe: concurrent stages share nothing but
    the writer threads."""

    def __init__(
        self,
        root: Path,
        *,
        url: str | None = None,
        chunk_size: int = hashing.STAGE_CHUNK,
        direct_io: bool = False,
        pace: Pace = UNLIMITED,
    ) -> None:
        """`root` must be an absolute path to an existing directory (see `from_url`).

        `chunk_size` is the read/write size of stage's single pass (a multiple of 4096); tests pass
        a small one to get several `progress` calls out of a small file. `direct_io`: write copies
        of 1 MiB and more with O_DIRECT, and re-read them that way, instead of through the page
        cache (see the module's docstring: the page cache way was the faster one on this VM's disk).
        It turns itself off on filesystems that refuse O_DIRECT. `pace`: the byte rate stage and
        verify keep to (`storage.pace`).
        """
        if not root.is_absolute():
            raise ValueError(f"root must be absolute, got {root}")
        if chunk_size <= 0 or chunk_size % DIRECT_ALIGN:
            raise ValueError(f"chunk_size must be a positive multiple of {DIRECT_ALIGN}, got {chunk_size}")
        self.root = root
        self.url = url if url is not None else root.as_uri()
        self._chunk_size = chunk_size
        self._direct_io = direct_io
        self._direct_read = True
        self._cache_proof = True  # off once the store's filesystem or kernel cannot show it
        self._pace = pace
        self._tmp_dir = root / TMP_DIRNAME
        # Writes of every concurrent stage share these threads; each stage has at most BUFFERS
        # writes in flight, and a few concurrent stages already saturate any disk.
        self._write_pool = ThreadPoolExecutor(
            max_workers=2 * BUFFERS, thread_name_prefix="boxwarden-write", initializer=lower_this_thread
        )
        # verify's O_DIRECT reads: enough for two verifies at full depth.
        self._read_pool = ThreadPoolExecutor(
            max_workers=2 * DIRECT_DEPTH, thread_name_prefix="boxwarden-read", initializer=lower_this_thread
        )

    @classmethod
    def from_url(cls, url: str, scope: tuple[str, ...] = (), pace: Pace = UNLIMITED) -> LocalStore:
        """Open `file:///abs/dir`, creating `dir` (not its parents) if it is missing, then the
        `scope` directories under it (never through a symlink)."""
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
        base = root.resolve(strict=True)
        if not scope:
            return cls(base, url=url, pace=pace)
        check_scope(url, scope)
        try:
            dir_fds, _ = walk_dirs(base, scope, create=True)
        except (StorageError, UnsafePathError) as exc:
            raise ConfigError(f"durable URL {url!r}: {exc}") from exc
        for dfd in dir_fds:
            close_fd(dfd)
        scoped = "/".join([url.rstrip("/"), *(quote(p) for p in scope)])
        return cls(base.joinpath(*scope), url=scoped, pace=pace)

    # ----------------------------------------------------------------------------------- stage

    def stage(
        self, src: Path, rel: str, *, progress: Progress | None = None, ahead: Ahead | None = None
    ) -> StagedCopy:
        split_rel(rel)
        try:
            before, src_fd = open_source(src)
        except BaseException:
            if ahead is not None:
                self.discard_ahead(ahead)
            raise
        if ahead is not None and (ahead.rel != rel or ahead.source != (before.dev, before.ino)):
            self.discard_ahead(ahead)  # pushed from another file (the path was replaced since)
            ahead = None
        try:
            if ahead is not None:
                held = self._ahead_file(ahead)
                tmp_path, out_fd, direct = held.path, held.fd, held.direct
            else:
                tmp_path, out_fd, direct = self._open_tmp(before.size)
            try:
                try:
                    self._reserve(out_fd, tmp_path, before.size)
                    sink = _FileSink(out_fd, tmp_path, direct, ahead)
                    digest, copied = single_pass(
                        src,
                        src_fd,
                        sink,
                        self._write_pool,
                        chunk_size=self._chunk_size,
                        limit=before.size,
                        progress=progress,
                        pace=self._pace,
                    )
                    if ahead is not None:
                        os.ftruncate(out_fd, copied)  # pushed ahead past where the file ends now
                except OSError as exc:
                    raise storage_error("cutting temp copy", tmp_path, exc) from exc
                finally:
                    close_fd(out_fd)
                check_source_unchanged(src, before, src_fd, copied)
            except BaseException:
                remove_quietly(tmp_path)
                raise
        except _DirectUnsupported:
            logger.warning(
                "%s refuses O_DIRECT writes; copying through the page cache from now on", self.root
            )
            self._direct_io = False
            return self.stage(src, rel, progress=progress)
        finally:
            close_fd(src_fd)
        return StagedCopy(rel=rel, handle=tmp_path, digest=digest, size=copied, source=before)

    # ------------------------------------------------------------------- pushed ahead of the seal

    def begin_ahead(self, rel: str, source: tuple[int, int]) -> Ahead:
        """A temp copy to push a file into while it is still being written (see `copier.Ahead`)."""
        split_rel(rel)
        path, fd, direct = self._open_tmp(_DIRECT_MIN)
        return Ahead(rel=rel, source=source, handle=_AheadFile(path, fd, direct), chunk=self._chunk_size)

    def push_ahead(self, ahead: Ahead, src_fd: int, upto: int) -> None:
        """Copy the whole chunks of the file between what was pushed and `upto` (its size now)."""
        held = self._ahead_file(ahead)

        def sink_to(end: int) -> _FileSink:
            self._reserve(held.fd, held.path, end)  # O_DIRECT writes into allocated blocks run side by side
            return _FileSink(held.fd, held.path, held.direct, ahead, recording=True)

        copier.push_ahead(ahead, held.path, src_fd, upto, sink_to, self._write_pool, self._pace)

    def discard_ahead(self, ahead: Ahead) -> None:
        held = self._ahead_file(ahead)
        close_fd(held.fd)
        remove_quietly(held.path)

    def _ahead_file(self, ahead: Ahead) -> _AheadFile:
        held = ahead.handle
        if not isinstance(held, _AheadFile) or held.path.parent != self._tmp_dir:
            raise PreconditionError(
                f"the copy of {ahead.rel} was not pushed ahead by the store at {self.url}"
            )
        return held

    def _reserve(self, fd: int, path: Path, size: int) -> None:
        """Allocate a copy of 1 MiB and more whole before writing it (`fsio.preallocate`): its
        O_DIRECT writes then reach the device side by side instead of one at a time, and a store
        too small for it fails here, before the source is read."""
        if size < _DIRECT_MIN:
            return
        try:
            preallocate(fd, size)
        except OSError as exc:
            raise storage_error("reserving space for temp copy", path, exc) from exc

    def _open_tmp(self, size: int) -> tuple[Path, int, bool]:
        """Create a fresh temp file; returns its path, a write fd, and whether the fd is O_DIRECT."""
        try:
            os.mkdir(self._tmp_dir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise storage_error("creating temp directory", self._tmp_dir, exc) from exc
        try:
            dir_fd = open_tmp_dir(self._tmp_dir)
        except FileNotFoundError as exc:
            raise storage_error("opening temp directory", self._tmp_dir, exc) from exc
        try:
            direct = self._direct_io and size >= _DIRECT_MIN
            while True:
                name = uuid.uuid4().hex
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
                try:
                    return self._tmp_dir / name, os.open(name, flags, 0o644, dir_fd=dir_fd), direct
                except OSError as exc:
                    if not (direct and exc.errno == errno.EINVAL):
                        raise storage_error("creating temp copy", self._tmp_dir / name, exc) from exc
                # The filesystem has no O_DIRECT (FUSE, some network mounts). The failed open may
                # have created the file already, hence a new name for the buffered retry.
                remove_quietly(self._tmp_dir / name)
                logger.info("%s does not support O_DIRECT; copying through the page cache", self.root)
                self._direct_io = direct = False
        finally:
            close_fd(dir_fd)

    # ---------------------------------------------------------------------------------- commit

    def commit(self, staged: StagedCopy) -> str | None:
        parts = split_rel(staged.rel)
        tmp = self._tmp_of(staged)
        try:
            moved = self._commit(tmp, parts)
        except BaseException:
            # A failed commit leaves no temp behind; the caller re-stages from the source.
            remove_quietly(tmp)
            raise
        logger.debug("committed %s (%d bytes, %s)", staged.rel, staged.size, staged.digest)
        return moved

    def _tmp_of(self, staged: StagedCopy) -> Path:
        """The temp file behind a copy this store staged; PreconditionError for any other copy."""
        tmp = staged.handle
        if not isinstance(tmp, Path) or tmp.parent != self._tmp_dir:
            raise PreconditionError(f"the copy of {staged.rel} was not staged by the store at {self.url}")
        return tmp

    def _commit(self, tmp: Path, parts: tuple[str, ...]) -> str | None:
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise PreconditionError(f"staged copy {tmp} is gone (discarded or cleaned)") from exc
        except OSError as exc:
            raise storage_error("opening staged copy", tmp, exc) from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            raise storage_error("flushing staged copy", tmp, exc) from exc
        finally:
            close_fd(fd)
        final = self.root.joinpath(*parts)
        moved = self._clear_the_way(parts)
        dir_fds, first_new = walk_dirs(self.root, parts[:-1], create=True)
        try:
            # rename() replaces a symlink at the final name rather than following it, but a
            # symlink there means someone else is writing under our root: refuse, loudly.
            refuse_symlink(final, parts[-1], dir_fds[-1])
            try:
                os.replace(tmp, parts[-1], dst_dir_fd=dir_fds[-1])
            except OSError as exc:
                raise storage_error("renaming staged copy to", final, exc) from exc
            try:
                sync_made_dirs(dir_fds, first_new)
            except OSError as exc:
                raise storage_error("flushing directory of", final, exc) from exc
        finally:
            for dfd in dir_fds:
                close_fd(dfd)
        return moved

    def _clear_the_way(self, parts: tuple[str, ...]) -> str | None:
        """An old copy of another kind in the way (a file where this path needs a directory, a
        directory where it needs a file: the trainer changed formats) moves to the attic, whole.
        Returns where it went, relative to the root; None if nothing was in the way."""
        for depth in range(1, len(parts) + 1):
            here = self.root.joinpath(*parts[:depth])
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise storage_error("looking at", here, exc) from exc
            last = depth == len(parts)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(f"{here} is a symlink; nothing under the durable root may be one")
            if (not last and not stat.S_ISDIR(st.st_mode)) or (last and stat.S_ISDIR(st.st_mode)):
                attic = self.root / ATTIC_NAME / uuid.uuid4().hex
                try:
                    attic.mkdir(parents=True, mode=0o755)
                    os.rename(here, attic / parts[depth - 1])
                except OSError as exc:
                    raise storage_error("moving an old copy of another kind aside from", here, exc) from exc
                logger.warning("moved the old copy at %s to %s: the path changed kind", here, attic)
                return (attic / parts[depth - 1]).relative_to(self.root).as_posix()
            if last:
                return None
        return None

    def keep_aside(self, rel: str, tag: str) -> str | None:
        parts = split_rel(rel)
        aside = (ATTIC_NAME, tag, *parts)
        where = "/".join(aside)
        try:
            src_fds, _ = walk_dirs(self.root, parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return where if self._lexists(aside) else None
        try:
            try:
                st = os.lstat(parts[-1], dir_fd=src_fds[-1])
            except FileNotFoundError:
                return where if self._lexists(aside) else None
            except OSError as exc:
                raise storage_error("looking at", self.root / rel, exc) from exc
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(
                    f"{self.root / rel} is a symlink; nothing under the durable root may be one"
                )
            if not stat.S_ISREG(st.st_mode):
                return None  # a directory: commit moves it aside whole (`_clear_the_way`)
            if self._lexists(aside):
                raise StorageError(
                    f"{self.root / where} is taken already; the old copy stays at {self.root / rel}"
                )
            dst_fds, first_new = walk_dirs(self.root, aside[:-1], create=True)
            try:
                os.rename(parts[-1], aside[-1], src_dir_fd=src_fds[-1], dst_dir_fd=dst_fds[-1])
                os.fsync(src_fds[-1])
                sync_made_dirs(dst_fds, first_new)
            except OSError as exc:
                raise storage_error("keeping aside the old copy at", self.root / rel, exc) from exc
            finally:
                for dfd in dst_fds:
                    close_fd(dfd)
        finally:
            for dfd in src_fds:
                close_fd(dfd)
        logger.warning("kept the old copy at %s aside at %s: a new file took its path", rel, where)
        return where

    def _lexists(self, parts: tuple[str, ...]) -> bool:
        """Is anything at `parts` under the root (walked without following symlinks)?"""
        try:
            fds, _ = walk_dirs(self.root, parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            os.lstat(parts[-1], dir_fd=fds[-1])
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise storage_error("looking at", self.root.joinpath(*parts), exc) from exc
        finally:
            for fd in fds:
                close_fd(fd)

    def discard(self, staged: StagedCopy) -> None:
        tmp = self._tmp_of(staged)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error("removing staged copy", tmp, exc) from exc

    # ---------------------------------------------------------------------------------- verify

    def verify(self, rel: str, digest: str, *, reread: bool = False) -> str | None:
        fd = open_final(self.root, rel)
        if fd is None:
            return None
        path = self.root / rel
        try:
            # DONTNEED only drops clean pages; the copy is clean after commit, and if someone
            # dirtied it since, flushing first is what makes the re-read come from the device.
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            actual = self._hash_from_device(fd, path)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise storage_error("re-reading durable copy", path, exc) from exc
        finally:
            close_fd(fd)
        if actual != digest:
            logger.warning("durable copy %s does not hash to its claim %s", path, digest)
            return None
        # The bytes are right; make sure the name is too. A kill between commit's rename and its
        # directory fsync leaves a rename that a power cut could still undo.
        self._sync_dirs(split_rel(rel)[:-1], path)
        return REREAD

    def _hash_from_device(self, fd: int, path: Path) -> str:
        """The copy's digest as the device gives it (verify flushed and dropped it from the page
        cache). Read through the page cache where that is shown to have fetched every byte from
        storage (`_hash_through_cache`); else with O_DIRECT; else, where the filesystem refuses
        O_DIRECT, through the just-dropped page cache, unchecked (the only way left)."""
        unproven = None
        if not self._direct_io and self._cache_proof:
            unproven, why = self._hash_through_cache(fd)
            if unproven is not None and not why:
                return unproven
            logger.info("re-read of %s not shown to come from storage (%s); again with O_DIRECT", path, why)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if self._direct_read:
            try:
                return hash_direct(fd, self._read_pool, self._pace)
            except DirectUnsupported as exc:
                logger.warning(
                    "%s refuses O_DIRECT reads (%s); verifying through the page cache from now on",
                    self.root,
                    exc,
                )
                self._direct_read = False
        return unproven if unproven is not None else hash_by_read(fd, self._pace)

    def _hash_through_cache(self, fd: int) -> tuple[str | None, str]:
        """(digest, "") when a read through the page cache fetched every byte from the device: a
        filesystem where that can be told (`pagecache.provable_fs`), no page of the copy cached
        when the read began, every byte charged to this thread as read from storage, and the copy
        unchanged (size, mtime, ctime) from before to after. Else (digest or None, why not)."""
        fs = provable_fs(fd)
        if fs is None:
            self._cache_proof = False  # the store's filesystem: the same for every copy
            return None, "its filesystem cannot show where a read's bytes came from"
        before = os.fstat(fd)
        cached = resident_pages(fd, before.st_size)
        if cached != 0:
            return (
                None,
                "the kernel does not say what is cached"
                if cached is None
                else f"{cached} pages stayed cached",
            )
        start = thread_read_bytes()
        if start is None:
            self._cache_proof = False
            return None, "this kernel keeps no per-thread I/O accounting"
        digest = hash_by_read(fd, self._pace)
        fetched = (thread_read_bytes() or 0) - start
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
            before.st_size,
            before.st_mtime_ns,
            before.st_ctime_ns,
        ):
            return digest, "the copy changed while it was read"
        if fetched < before.st_size:
            return digest, f"{fetched} of its {before.st_size} bytes came from storage ({fs})"
        return digest, ""

    def _sync_dirs(self, parts: tuple[str, ...], path: Path) -> None:
        try:
            dir_fds, _ = walk_dirs(self.root, parts, create=False)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise StorageError(f"{path} vanished while being verified") from exc
        try:
            for dfd in reversed(dir_fds):
                os.fsync(dfd)
        except OSError as exc:
            raise storage_error("flushing directories of", path, exc) from exc
        finally:
            for dfd in dir_fds:
                close_fd(dfd)

    def read(self, rel: str, offset: int, length: int) -> bytes:
        fd = open_final(self.root, rel)
        if fd is None:
            raise StorageError(f"no durable copy at {self.root / rel}", "NOT_FOUND")
        try:
            return os.pread(fd, length, offset)
        except OSError as exc:
            raise storage_error("reading durable copy", self.root / rel, exc) from exc
        finally:
            close_fd(fd)

    def exists(self, rel: str) -> bool:
        fd = open_final(self.root, rel)
        if fd is None:
            return False
        close_fd(fd)
        return True

    def space(self) -> DiskSample:
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            raise storage_error("reading the free space of", self.root, exc) from exc
        return DiskSample.of(self.root, "durable", st)

    def bind_owner(self, owner: str) -> None:
        self._refuse_strangers_folder()
        self._refuse_folded_names()
        found = self._write_once(OWNER_NAME, owner)
        if found != owner:
            raise ConfigError(
                f"{self.root} holds the durable copies of another run (owner {found}, this ledger is "
                f"{owner}); they are never overwritten: give this box another --run-id (or durable URL)"
            )

    def _refuse_folded_names(self) -> None:
        """Copies are kept apart by their names: a filesystem that takes two names for one file
        (case-insensitive: SMB/CIFS, exFAT, vfat, ext4 casefold, ZFS casesensitivity=insensitive;
        or one that normalises Unicode) would let `Step-100.pt` replace the copy of `step-100.pt`,
        and one copy stand for two claims. Probed with a file in the temp dir, then refused."""
        pairs = (("Ab", "aB", "names that differ only in case"), ("\u00e9", "e\u0301", "é written two ways"))
        try:
            self._tmp_dir.mkdir(mode=0o700, exist_ok=True)
            dir_fd = open_tmp_dir(self._tmp_dir)
        except OSError as exc:
            raise storage_error("creating temp directory", self._tmp_dir, exc) from exc
        try:
            for first, other, what in pairs:
                stem = f"names-{uuid.uuid4().hex}-"
                try:
                    close_fd(
                        os.open(
                            stem + first,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                            0o600,
                            dir_fd=dir_fd,
                        )
                    )
                except OSError as exc:
                    if exc.errno == errno.EILSEQ:  # the filesystem refuses such a name: it cannot fold it
                        continue
                    raise storage_error("probing names in", self._tmp_dir, exc) from exc
                try:
                    os.lstat(stem + other, dir_fd=dir_fd)
                    folded = True
                except FileNotFoundError:
                    folded = False
                except OSError as exc:
                    if exc.errno != errno.EILSEQ:
                        raise storage_error("probing names in", self._tmp_dir, exc) from exc
                    folded = False
                finally:
                    remove_quietly(self._tmp_dir / (stem + first))
                if folded:
                    raise ConfigError(
                        f"the durable store at {self.root} takes {what} for one file (a case-insensitive "
                        "or normalising filesystem: SMB/CIFS, exFAT, vfat, ext4 casefold...): two "
                        "checkpoints could share one copy there and one of them be lost; put the durable "
                        "store on a filesystem that keeps names apart (ext4, xfs, btrfs, NFS)"
                    )
        finally:
            close_fd(dir_fd)

    def _refuse_strangers_folder(self) -> None:
        """Copies land at their artifact paths under the root, replacing what is there: a root
        inside another run's folder, or one that already holds files no run owns, is refused."""
        for above in self.root.parents:
            if (above / OWNER_NAME).exists():
                raise ConfigError(
                    f"{self.root} lies inside {above}, the durable folder of another run: its copies "
                    "could be overwritten; give this box a durable URL outside it"
                )
        if (self.root / OWNER_NAME).exists():
            return
        try:
            strangers = sorted(set(os.listdir(self.root)) - {TMP_DIRNAME, ID_NAME})
        except OSError as exc:
            raise storage_error("listing", self.root, exc) from exc
        if strangers:
            shown = ", ".join(repr(n) for n in strangers[:3]) + (", …" if len(strangers) > 3 else "")
            raise ConfigError(
                f"{self.root} already holds {len(strangers)} {'entry' if len(strangers) == 1 else 'entries'} "
                "that no boxwarden run owns "
                f"({shown}): durable copies would overwrite them; move them away, or give this box "
                "another --run-id (or durable URL)"
            )

    def store_id(self) -> str:
        return self._write_once(ID_NAME, uuid.uuid4().hex)

    def _write_once(self, name: str, value: str) -> str:
        """The content of the small file `name` under the root, written as `value` if missing.
        link() fails if another sidecar made one first: then theirs is the answer."""
        path = self.root / name
        try:
            return path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error("reading store id", path, exc) from exc
        new = value
        tmp = self._tmp_dir / f"id-{uuid.uuid4().hex}"
        try:
            self._tmp_dir.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, new.encode() + b"\n")
                os.fsync(fd)
            finally:
                close_fd(fd)
            # link() fails if another sidecar made one first: then theirs is the store's id.
            try:
                os.link(tmp, path)
            except FileExistsError:
                return path.read_text(encoding="ascii").strip()
            finally:
                os.unlink(tmp)
            dfd = os.open(self.root, DIR_FLAGS)
            try:
                os.fsync(dfd)
            finally:
                close_fd(dfd)
        except OSError as exc:
            raise storage_error(f"writing {name}", path, exc) from exc
        return new

    def clean_tmp(self) -> int:
        try:
            dir_fd = open_tmp_dir(self._tmp_dir)
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
                    raise storage_error("removing leftover temp copy", self._tmp_dir / name, exc) from exc
                removed += 1
        finally:
            close_fd(dir_fd)
        if removed:
            logger.info("removed %d leftover temp copies from %s", removed, self._tmp_dir)
        return removed

    def close(self) -> None:
        self._write_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
