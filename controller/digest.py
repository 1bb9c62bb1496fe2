"""The controller's implementation of the contract's two digest rules (see the top comment of
`proto/boxwarden_pb/v1/sidecar.proto`): an artifact's digest and the manifest digest.

The sidecar implements the same rules on its own (the two packages import nothing from each other);
a parity test keeps them equal. Nothing else in the controller hashes bytes any other way.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3

# blake3 of b"": a fixed point worth naming, and the answer for files mmap cannot map.
EMPTY_DIGEST = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"

# O_NOFOLLOW: a digest must describe the file at that name, never what a symlink points to.
# O_NONBLOCK: opening a FIFO that was swapped in must not hang; it is refused by the S_ISREG check.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


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


def digest_file(path: Path) -> FileDigest:
    """Size and blake3 of the regular file at `path`, read in one pass.

    Raises OSError (ELOOP for a symlink, NotRegularFile for anything not a regular file). The bytes
    are mapped and hashed by blake3's multi-threaded tree hash, which is what `b3sum` does; reading
    through an fd we opened (rather than `update_mmap(path)`) lets us refuse symlinks and take the
    size from the very same file.
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path}: not a regular file")
        if st.st_size == 0:
            # mmap refuses zero-length mappings.
            return FileDigest(0, EMPTY_DIGEST)
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            hasher.update(mapped)
            size = len(mapped)
        return FileDigest(size, hasher.hexdigest())
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    """blake3 of the file's bytes, 64 lowercase hex characters (the DIGEST RULE)."""
    return digest_file(path).blake3


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
