"""The digest rule, implemented once for the sidecar: blake3 of a file's bytes, 32 bytes, lowercase hex.

This module owns how the sidecar computes that digest: `hash_file` for a file at rest, `new_hasher`
for the streaming paths (storage's stage and verify, bytes arriving over gRPC), and the chunk sizes
those paths read with. Every digest the sidecar records or compares comes from here, so the rule
cannot drift between the claim and its proof.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import blake3

from sidecar.paths import open_regular

logger = logging.getLogger(__name__)

DIGEST_SIZE = 32
"""Bytes in a digest; `hexdigest()` gives twice as many lowercase hex characters."""

STAGE_CHUNK = 8 << 20
"""Read/write size of storage's copy pass: large enough that per-call overhead vanishes and the
device gets big requests (O_DIRECT writes of 2–32 MiB measured alike), small enough that the three
buffers of a copy stay cheap."""

VERIFY_CHUNK = 16 << 20
"""Read size of `hash_file_read` (a cold read of a file on the box)."""

MMAP_THRESHOLD = 4 << 20
"""Below this a plain read into one buffer is as fast as a mapping hashed on all cores (measured
crossover 2–4 MiB) and cannot SIGBUS; above it, mmap plus all cores wins, as in `b3sum`."""

# blake3's multithreaded update splits one input across a thread pool. That only pays for inputs of
# hundreds of KiB and up; for smaller updates the fork/join overhead costs more than it saves.
_MULTITHREAD_MIN_UPDATE = 1 << 20

_DIGEST_RE = re.compile("[0-9a-f]{64}")  # 2 * DIGEST_SIZE


def new_hasher(*, update_size: int = 0) -> blake3.blake3:
    """A fresh blake3 hasher for streaming use.

    `update_size` is the typical size of one `update()` call. Pass it when the updates are large
    (≥ 1 MiB, e.g. a whole read chunk) and the hash is the bottleneck: the hasher then spreads each
    update over all cores. Leave it 0 for small updates (gRPC messages, tiny files), where threads
    only add overhead, and where one core already keeps pace with the I/O (one thread hashes
    ~3.5 GB/s), so the trainer keeps its cores.
    """
    if update_size >= _MULTITHREAD_MIN_UPDATE:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


def hash_file(path: Path) -> str:
    """The digest of the file at `path`: blake3, 32 bytes, lowercase hex.

    For a file of MMAP_THRESHOLD bytes or more, the file is memory-mapped and hashed on all cores,
    which is how `b3sum` reaches its throughput; smaller files are read into memory in one go.

    Meant for files at rest (pulled copies, files no other process writes). A file truncated by
    another process *while* it is mapped, or a device error on a mapped page, makes the kernel send
    SIGBUS and the process dies; for files that may change under us, use `hash_file_read`.

    Raises OSError (FileNotFoundError, IsADirectoryError, ...) as the OS reports it.
    """
    size = os.stat(path).st_size
    if size < MMAP_THRESHOLD:
        with open(path, "rb") as f:
            return blake3.blake3(f.read()).hexdigest()
    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()


def hash_file_read(path: Path) -> str:
    """The same digest as `hash_file`, computed with read() instead of a mapping.

    For files that may be rewritten while they are hashed (a checkpoint the trainer can overwrite
    in place): a truncation then shows as a short read, which the caller's identity check turns
    into "changed", instead of a SIGBUS that kills the process. About 1.5–2× slower than
    `hash_file` on a hot file (one more copy per byte), still several GB/s.
    """
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:  # a FIFO swapped in never blocks
        # Sized to the file: a 16 MiB buffer zeroed per call is 1 ms, most of a small file's cost.
        chunk = min(VERIFY_CHUNK, max(os.fstat(f.fileno()).st_size + 1, 64 << 10))
        hasher = new_hasher(update_size=chunk)
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


def is_digest(value: str) -> bool:
    """True if `value` has the shape of a digest: 64 lowercase hex characters."""
    return _DIGEST_RE.fullmatch(value) is not None
