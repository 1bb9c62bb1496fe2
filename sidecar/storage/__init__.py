"""Durable storage: where sealed artifacts are copied, and how a copy is proven.

This package owns the `DurableStore` contract, the `StagedCopy` it hands back, the rule for the
relative paths (`rel`) that name artifacts inside a store, the source side of every backend's
stage (open a sealed file, then prove it did not change while it was read; the single read pass
itself is `copier.py`), and what a durable URL means: `open_store` turns it into a store and
`local_dir` says which directory of this machine it names, if any. Nothing outside this package
knows a scheme. Backends live in their own modules (`local` for `file://`, `s3` for `s3://`)
and are imported only when their scheme is asked for, so an optional client library (boto3 for
`s3://`) is never imported by a box that does not use it. The contract assumes no filesystem: a copy in
flight is an opaque handle, and free space is whatever the backend can say (`space`).

The push of one artifact is three blocking calls, run by the caller in a bounded executor:

    staged = store.stage(src, rel)   # ONE read pass: hash + write a temp copy; digest = the claim
    ledger.record_claim(staged)      # caller's business: the claim exists before the copy is final
    store.commit(staged)             # fsync, atomic rename into place, fsync the directories
    store.verify(rel, digest)        # prove the copy (a re-read from the device); equal → "durable"
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # copier imports this module
    from sidecar.storage.copier import Ahead
from urllib.parse import unquote, urlsplit

from sidecar.compat import SLOTS
from sidecar.errors import ChangedError, ConfigError, PreconditionError, StorageError, UnsafePathError
from sidecar.identity import FileIdentity
from sidecar.probes import DiskSample
from sidecar.storage.pace import UNLIMITED, Pace

logger = logging.getLogger(__name__)

SUPPORTED_SCHEMES = ("file", "s3")

REREAD = "reread"
"""A proof: the copy was read back whole (from the device, not a cache) and hashed equal."""
SERVER_CHECKSUM = "server-checksum"
"""A proof: the store's own full-object checksum equals the one taken from the bytes that were
hashed for the claim (cheaper, weaker; only where the user opted in)."""

TMP_DIRNAME = ".boxwarden-tmp"
"""Directory under a store's root that holds copies in flight; never a valid first `rel` part."""

ID_NAME = ".boxwarden-store-id"
"""File under a store's root holding its random id (see `DurableStore.store_id`); reserved too."""

ATTIC_NAME = ".boxwarden-attic"
"""Directory under a run's root where old copies go when a path changes kind (a file becomes a
directory or back): durable copies are moved aside, never deleted."""

OWNER_NAME = ".boxwarden-owner"
"""File under a run's root naming the ledger that owns it (see `DurableStore.bind_owner`); reserved."""


@dataclass(frozen=True, **SLOTS)
class StagedCopy:
    """A complete, not yet durable copy of `source`'s bytes, in flight in the store.

    `digest` is the blake3 of exactly the bytes written (and read from `source`, whose identity did
    not change during the read): it is the claim digest. `handle` is the store's own business
    (a temp file, an upload in progress): only the store that staged the copy can use it.
    """

    rel: str
    handle: object
    digest: str
    size: int
    source: FileIdentity


Progress = Callable[[int], None]
"""Called from the copying thread with the number of bytes copied so far."""


class DurableStore(Protocol):
    """A place that keeps artifacts after the box is gone. Every method blocks."""

    @property
    def url(self) -> str:
        """The URL the store was opened with (for messages and events)."""
        ...

    def stage(
        self, src: Path, rel: str, *, progress: Progress | None = None, ahead: Ahead | None = None
    ) -> StagedCopy:
        """Copy `src` to a temp place in the store in one read pass, hashing the bytes as they pass.
        `ahead`: what `push_ahead` already put there while `src` was being written (the pass writes
        only the chunks that differ, and what follows; an `ahead` from another file is discarded).

        Raises UnsafePathError (bad `rel`), ChangedError (`src` changed or vanished during the
        read), PreconditionError (`src` is not a regular file), StorageError (I/O on either side).
        No temp is left behind when it raises.
        """
        ...

    def begin_ahead(self, rel: str, source: tuple[int, int]) -> Ahead:
        """A temp copy for the file (st_dev, st_ino) `source` at `rel`, to push while it is written."""
        ...

    def push_ahead(self, ahead: Ahead, src_fd: int, upto: int) -> None:
        """Push the whole chunks of the file between what was pushed and `upto` (never its tail)."""
        ...

    def discard_ahead(self, ahead: Ahead) -> None:
        """Drop a copy pushed ahead that no stage will take."""
        ...

    def commit(self, staged: StagedCopy) -> str | None:
        """Make the staged copy durable at `rel`: flush it, rename it into place, flush directories.
        An older copy of another kind in the way (a directory where the file goes, or a file where
        a directory must be) is moved aside whole, never deleted: returns where it now lies (relative
        to the store's root), None if nothing was in the way."""
        ...

    def keep_aside(self, rel: str, tag: str) -> str | None:
        """Move the copy at `rel` to `<attic>/<tag>/<rel>`, so that a new copy for the same path
        never replaces it: the copy of a file that left the box while a new file took its name.
        Returns where it lies now (relative to the store's root), also when an earlier call moved
        it; None if no file is at `rel` and none was moved there. Never deletes anything."""
        ...

    def discard(self, staged: StagedCopy) -> None:
        """Remove the temp copy; a temp that is already gone is not an error."""
        ...

    def verify(self, rel: str, digest: str, *, reread: bool = False) -> str | None:
        """Prove the durable copy at `rel` holds the bytes of `digest`: how it was proven (REREAD:
        read back from the device and hashed; SERVER_CHECKSUM: the store's own full-object checksum,
        where the user opted in), or None if it is missing or not equal. `reread` demands a re-read
        whatever the store's default (before anything is deleted on the strength of the proof)."""
        ...

    def read(self, rel: str, offset: int, length: int) -> bytes:
        """Up to `length` bytes of the durable copy at `rel` from `offset` (fewer at its end):
        how a claim whose box copy was retired is served. StorageError if there is no copy."""
        ...

    def exists(self, rel: str) -> bool:
        """True if a durable copy exists at `rel` (says nothing about its bytes)."""
        ...

    def clean_tmp(self) -> int:
        """Remove temp copies left by a crash; returns how many. Call only when no stage is running."""
        ...

    def store_id(self) -> str:
        """A random id kept inside the store, made on first use. A different id means a different
        (or emptied, or re-mounted) store: claims proven in the old one prove nothing here."""
        ...

    def bind_owner(self, owner: str) -> None:
        """Make this store belong to `owner` (a ledger's id), or refuse with ConfigError if it
        already belongs to another: one run never overwrites another run's durable copies."""
        ...

    def space(self) -> DiskSample | None:
        """Free and total bytes and inodes where the copies land; None when the backend has no such
        notion (an object store). Raises StorageError when it has one but it cannot be read now."""
        ...

    def close(self) -> None:
        """Release threads and handles; the store is unusable afterwards."""
        ...


def split_rel(rel: str) -> tuple[str, ...]:
    """Validate an artifact's relative path and return its components.

    A `rel` is a relative POSIX path: no leading '/', no empty, '.' or '..' component, no NUL, and
    it may not start inside the store's temp directory. Anything else raises UnsafePathError: such a
    path comes from the wire or from a directory listing and must never reach the filesystem.
    """
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"artifact path {rel!r} is empty")
    if "\x00" in rel:
        raise UnsafePathError(f"artifact path {rel!r} contains a NUL byte")
    if rel.startswith("/"):
        raise UnsafePathError(f"artifact path {rel!r} is absolute; it must be relative to the root")
    parts = tuple(rel.split("/"))
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafePathError(
                f"artifact path {rel!r} has a {part or 'empty'!r} component; "
                "only plain names separated by single '/' are allowed"
            )
    if parts[0] in (ID_NAME, OWNER_NAME, ATTIC_NAME):
        raise UnsafePathError(f"artifact path {rel!r} is the store's reserved id file")
    if parts[0] == TMP_DIRNAME:
        raise UnsafePathError(f"artifact path {rel!r} is inside the store's reserved {TMP_DIRNAME}/")
    return parts


def check_scope(url: str, scope: tuple[str, ...]) -> None:
    """Each part of a store's scope (a box's name, a run id) names one directory (or key prefix)
    under the durable URL: ConfigError for one that would name none, or another place."""
    for part in scope:
        if not part or part in (".", "..") or "/" in part or "\x00" in part:
            raise ConfigError(f"durable URL {url!r}: {part!r} cannot name a directory in it")


def open_source(src: Path) -> tuple[FileIdentity, int]:
    """Open a sealed artifact for stage's single read pass; returns its identity and a read fd.

    The identity is taken (lstat) before the open and checked against the opened fd, so the fd is
    known to be the file the identity describes. The caller closes the fd.
    Raises ChangedError (gone or replaced), PreconditionError (not a regular file), StorageError.
    """
    try:
        st = os.lstat(src)
    except FileNotFoundError as exc:
        raise ChangedError(f"{src} vanished before it could be copied") from exc
    except OSError as exc:
        raise StorageError(f"reading source {src} failed: {exc.strerror or exc}", "SOURCE") from exc
    if not stat.S_ISREG(st.st_mode):
        raise PreconditionError(f"{src} is not a regular file; only regular files are artifacts")
    before = FileIdentity.of(st)
    # O_NONBLOCK: if the path was swapped for a FIFO after lstat, open must not hang on it.
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            raise ChangedError(f"{src} was replaced or removed before it could be copied") from exc
        raise StorageError(f"reading source {src} failed: {exc.strerror or exc}", "SOURCE") from exc
    if FileIdentity.of(os.fstat(fd)) != before:
        os.close(fd)
        raise ChangedError(f"{src} changed between lstat and open; it is still being written")
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return before, fd


def check_source_unchanged(src: Path, before: FileIdentity, fd: int, copied: int) -> None:
    """Raise ChangedError unless the file behind `fd` and the file at `src` both still have the
    identity `before`, and exactly `before.size` bytes were read: otherwise the bytes copied are
    not the sealed file's bytes (it was written, truncated or replaced during the read)."""
    after_fd = FileIdentity.of(os.fstat(fd))
    try:
        after_path: FileIdentity | None = FileIdentity.from_path(src)
    except OSError:
        after_path = None
    if after_fd != before or after_path != before or copied != before.size:
        raise ChangedError(
            f"{src} changed while it was copied (identity {before} → {after_path}, "
            f"{copied} bytes read of {before.size}); it was still being written"
        )


def local_dir(url: str) -> Path | None:
    """The directory of this machine that the durable URL names (`file:///abs/dir`); None for a
    URL of any other kind. Syntax only: nothing is looked at."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        return None
    path = unquote(parts.path)
    return Path(path) if path.startswith("/") else None


def open_store(
    url: str, scope: tuple[str, ...] = (), credentials: Path | None = None, pace: Pace = UNLIMITED
) -> DurableStore:
    """Open the durable store named by `url`, narrowed to the sub-directories `scope` (a box's
    name, then its run id: every run gets its own corner).

    Supported: `file:///absolute/dir` (a local or mounted filesystem). The directory itself is
    created if missing, but its parent must exist: a missing parent usually means a volume that is
    not mounted, and creating the tree there would silently write to the box's ephemeral disk.
    The scope directories are created under it. `s3://bucket/prefix[?endpoint_url=…&region=…]`:
    an S3-compatible bucket (boto3 needed), with `credentials` (a file, see `s3.read_credentials`)
    or boto3's standard sources. Anything else raises ConfigError. `pace`: the byte rate its pushes
    keep to (`storage.pace`; none by default).
    """
    scheme = urlsplit(url).scheme if isinstance(url, str) else ""
    if scheme == "file":
        if credentials is not None:
            raise ConfigError(f"durable URL {url!r}: a credentials file is for s3:// stores, not file://")
        from sidecar.storage.local import LocalStore

        return LocalStore.from_url(url, scope, pace)
    if scheme == "s3":
        from sidecar.storage.s3 import S3Store

        return S3Store.from_url(url, scope, credentials, pace)
    supported = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise ConfigError(
        f"durable URL {url!r}: scheme {scheme + '://' if scheme else '(none)'} is not supported; "
        f"supported: {supported} (e.g. file:///mnt/durable/ckpt)"
    )
