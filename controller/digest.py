"""The controller's implementation of the contract's two digest rules (see the top comment of
`proto/boxwarden_pb/v1/sidecar.proto`): an artifact's digest and the manifest digest.

The sidecar implements the same rules on its own (the two packages import nothing from each other);
a parity test keeps them equal. Nothing else in the controller hashes bytes any other way.

Files are never mapped in this process: a file truncated under a mapping is a SIGBUS that would
kill the controller without a word. Small files are read; large ones are mapped by a child process
(as fast as `b3sum`), whose death by a signal becomes a `FileChanged` error here.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3

logger = logging.getLogger(__name__)

# blake3 of b"": a fixed point worth naming.
EMPTY_DIGEST = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"

CHILD_MIN = 64 << 20
"""Files at least this big are hashed by a child process that maps them; smaller ones are read."""

READ_CHUNK = 16 << 20
"""Bytes per read() when hashing in-process: large enough for blake3's threads to pay off."""

SMALL_READ = 64 << 10
"""The smallest read buffer: a file that grows while hashed is still read in sizeable steps."""

# O_NOFOLLOW: a digest must describe the file at that name, never what a symlink points to.
# O_NONBLOCK: opening a FIFO that was swapped in must not hang; it is refused by the S_ISREG check.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

# The child gets our open fd (never a path that could be swapped) and maps it, as b3sum does.
_CHILD_HASH = (
    "import sys, blake3; "
    "print(blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(sys.argv[1]).hexdigest())"
)


class ManifestEntryLike(Protocol):
    """What the manifest digest needs from one file: its path, size and digest."""

    @property
    def path(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def blake3(self) -> str: ...


@dataclass(frozen=True, slots=True)
class FileDigest:
    """Size and digest measured on one open file descriptor, so the two describe the same bytes."""

    bytes: int
    blake3: str


class NotRegularFile(OSError):
    """The name does not denote a regular file (directory, FIFO, socket, device)."""


class FileChanged(OSError):
    """The file changed (was truncated, grew, was rewritten) while it was being hashed, or the
    device failed under the reader: its bytes were not read as one consistent whole."""


def digest_file(path: Path | str, *, dir_fd: int | None = None) -> FileDigest:
    """Size and blake3 of the regular file at `path` (relative to `dir_fd` if given), in one pass.

    Raises OSError: ELOOP for a symlink, NotRegularFile for anything not a regular file,
    FileChanged when the file changed under the hash (never a signal that kills this process).
    """
    fd = os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
    try:
        return digest_fd(fd, str(path))
    finally:
        os.close(fd)


def digest_fd(fd: int, name: str) -> FileDigest:
    """Size and blake3 of the regular file open as `fd` (read from offset 0; the offset is not used)."""
    before = os.fstat(fd)
    if not stat.S_ISREG(before.st_mode):
        raise NotRegularFile(f"{name}: not a regular file")
    found: FileDigest | None = None
    if before.st_size >= CHILD_MIN:
        found = _hash_in_child(fd, name, before.st_size)
    if found is None:
        found = _hash_by_read(fd, before.st_size)
    after = os.fstat(fd)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or (
        found.bytes != after.st_size
    ):
        raise FileChanged(
            f"{name}: changed while hashed ({before.st_size} bytes before, {after.st_size} after, "
            f"{found.bytes} read)"
        )
    return found


def file_digest(path: Path) -> str:
    """blake3 of the file's bytes, 64 lowercase hex characters (the DIGEST RULE)."""
    return digest_file(path).blake3


def _hash_by_read(fd: int, size_hint: int) -> FileDigest:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    # Sized to the file (one read reaches EOF, one more sees it): a 16 MiB buffer zeroed per file
    # cost 1 ms each, 100 s for a tree of 100,000 small files.
    buf = bytearray(min(READ_CHUNK, max(size_hint + 1, SMALL_READ)))
    view = memoryview(buf)
    offset = 0
    while n := os.preadv(fd, [buf], offset):
        hasher.update(view[:n])
        offset += n
    return FileDigest(offset, hasher.hexdigest())


def _hash_in_child(fd: int, name: str, size: int) -> FileDigest | None:
    """Hash in a child that maps the file; None if no child could run (the caller reads instead).

    Raises FileChanged if the child was killed by a signal (SIGBUS: the file was truncated under
    the mapping, or the device failed).
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _CHILD_HASH, f"/dev/fd/{fd}"],
            pass_fds=(fd,),
            cwd="/",  # never where a box's jobs work: the sidecar's stray rule would count it
            capture_output=True,
            text=True,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("hashing %s in a child failed to run (%s); reading it here instead", name, exc)
        return None
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        raise FileChanged(
            f"{name}: changed while hashed (the reader was killed by {sig}: the file was truncated "
            "under it, or the device failed)"
        )
    out = proc.stdout.strip()
    if proc.returncode != 0 or len(out) != 64:
        logger.warning(
            "hashing %s in a child gave no digest (%s); reading it here instead", name, proc.stderr[-300:]
        )
        return None
    return FileDigest(size, out)


def canonical_manifest_json(files: Iterable[ManifestEntryLike]) -> bytes:
    """The exact bytes the manifest digest is taken over (the MANIFEST CANONICAL FORM)."""
    # The contract says "byte order of the UTF-8 path"; for valid text that equals Python's code
    # point order, but sorting the bytes states the rule literally (and fails on lone surrogates,
    # which have no UTF-8 form, instead of digesting something the sidecar could never produce).
    ordered = sorted(files, key=lambda f: f.path.encode("utf-8"))
    doc = {"files": [{"blake3": f.blake3, "bytes": f.bytes, "path": f.path} for f in ordered]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def manifest_digest(files: Iterable[ManifestEntryLike]) -> str:
    """blake3 hex of the canonical manifest JSON of `files`."""
    return blake3.blake3(canonical_manifest_json(files)).hexdigest()


def path_key(path: str) -> str:
    """A short, fixed-length name derived from an artifact path (32 hex of its blake3): the part
    file's name, which fits any filesystem whatever the artifact's name."""
    return blake3.blake3(path.encode("utf-8")).hexdigest()[:32]


class StreamHasher:
    """Hashes bytes as they arrive (a pull hashes each chunk on receipt) and counts them."""

    def __init__(self, *, max_threads: int = 1) -> None:
        # One thread by default: transfer chunks are small, and rayon's fan-out only pays off on
        # inputs of several MiB.
        self._hasher = blake3.blake3(max_threads=max_threads)
        self._count = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hasher.update(data)
        self._count += len(data) if not isinstance(data, memoryview) else data.nbytes

    @property
    def bytes_seen(self) -> int:
        return self._count

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()
