"""The single read pass of a stage, shared by every backend: read a sealed file chunk by chunk,
hash each chunk, and hand the very same memory to the backend's sink (a temp file, the parts of a
multipart upload), so the digest is of exactly the bytes the sink received.

The calling thread reads chunk i into one of a few reusable, page-aligned buffers and hashes it
while a pool thread hands the same buffer to `Sink.write` at its offset: reading+hashing overlaps
writing, with at most `buffers` writes in flight (bounded memory: nothing is buffered whole). A
buffer is read into again only after its write returned.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sidecar import hashing
from sidecar.errors import StorageError
from sidecar.storage import Progress
from sidecar.storage.pace import UNLIMITED, Pace

BUFFERS = 3
"""Chunk buffers per pass: one being read and hashed while the others are being written."""


class Sink(Protocol):
    """Where a pass writes. `write` runs in a pool thread, possibly beside other writes of the same
    pass (each at its own offset, never overlapping); the others run in the calling thread."""

    def write(self, data: memoryview, offset: int) -> None:
        """Write all of `data` at `offset`, or raise (a StorageError, or what the sink's own
        caller knows how to handle). `data` is valid only until this returns."""
        ...

    def written(self, end: int) -> None:
        """Every byte before `end` is written (the writes finished in order up to there)."""
        ...

    def alone(self, n: int) -> bool:
        """The next chunk holds `n` bytes: True when it must be written alone, no other write of the
        pass in flight before it finishes (the sink changes how it writes, e.g. O_DIRECT cannot take
        a short last chunk)."""
        ...

    def already(self, data: memoryview, offset: int) -> bool:
        """True when exactly these bytes were written at `offset` before the pass (pushed ahead of
        the seal, `Ahead`): the pass hashes them and writes them no more."""
        ...


@dataclass
class Ahead:
    """A copy pushed while its file was still being written (speculative streaming): the store's
    handle of the copy in progress, the file it reads, and the blake3 and length of every chunk
    written so far, by offset. At the seal, the stage's one full read pass hashes every byte and
    writes again each chunk whose blake3 differs (a writer that went back and rewrote it): a strong
    hash, so that a store proven by its own checksum (computed from the same chunks) is not left
    to a CRC's luck; the proof of the committed copy then decides, as for any copy."""

    rel: str
    source: tuple[int, int]  # (st_dev, st_ino) of the file it reads
    handle: object
    chunk: int
    chunks: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    done: int = 0  # every byte before it was pushed (a multiple of `chunk`)

    def matches(self, data: memoryview, offset: int) -> bool:
        known = self.chunks.get(offset)
        return known is not None and known[1] == len(data) and known[0] == _chunk_digest(data)

    def record(self, data: memoryview, offset: int) -> None:
        self.chunks[offset] = (_chunk_digest(data), len(data))


def push_ahead(
    ahead: Ahead,
    src: Path,
    src_fd: int,
    upto: int,
    sink_to: Callable[[int], Sink],
    pool: Executor,
    pace: Pace = UNLIMITED,
) -> None:
    """Push the whole chunks of the file between what `ahead` has and `upto` (its size now), into
    the sink `sink_to(end)` gives for a push up to `end`; the shared part of every store's push."""
    end = upto - upto % ahead.chunk
    if end <= ahead.done:
        return
    os.lseek(src_fd, ahead.done, os.SEEK_SET)
    sink = sink_to(end)
    _, n = single_pass(
        src, src_fd, sink, pool, chunk_size=ahead.chunk, limit=end - ahead.done, start=ahead.done, pace=pace
    )
    ahead.done += n - n % ahead.chunk


def _chunk_digest(data: memoryview) -> bytes:
    return bytes(hashing.new_hasher().update(data).digest())


def single_pass(
    src: Path,
    src_fd: int,
    sink: Sink,
    pool: Executor,
    *,
    chunk_size: int,
    limit: int,
    buffers: int = BUFFERS,
    progress: Progress | None = None,
    start: int = 0,
    pace: Pace = UNLIMITED,
) -> tuple[str, int]:
    """Copy what `src_fd` yields to `sink`, `limit` bytes at most (the size of the sealed file: a
    file that grows while it is read would otherwise never end the pass; the caller sees the change
    in its identity). Returns (blake3 of the bytes, how many).

    Raises StorageError for a failed read of the source, and whatever a write raised. Returns or
    raises only once no write is in flight (the caller may then close what the sink writes to).
    `start`: the offset of the fd's position (a push ahead of the seal goes on where it stopped).
    `pace`: the rate the pass keeps to (every byte read counts, written or not)."""
    # One hashing thread: it keeps pace with the device (3.5 GB/s), and a multithreaded hash
    # measured no faster here while it would take cores from the trainer.
    hasher = hashing.new_hasher()
    # mmap'd buffers are page aligned, as O_DIRECT requires.
    ring = [mmap.mmap(-1, chunk_size) for _ in range(buffers)]
    writes: deque[tuple[Future[None], int]] = deque()  # in submission order, with end offset

    def finish_one() -> None:
        future, end = writes.popleft()
        future.result()
        sink.written(end)

    copied = start
    limit += start
    handed = 0  # buffers handed to a write so far: the next one is ring[handed % buffers]
    try:
        while True:
            if len(writes) == buffers:  # the buffer about to be reused is still being written
                finish_one()
            # Advanced only by a write: a chunk that is not written leaves its buffer free.
            buf = ring[handed % buffers]
            want = min(chunk_size, limit - copied)
            try:
                n = os.readv(src_fd, [memoryview(buf)[:want]]) if want > 0 else 0
            except OSError as exc:
                raise StorageError(f"reading source {src} failed: {exc.strerror or exc}", "SOURCE") from exc
            if n == 0:
                break
            view = memoryview(buf)[:n]
            if sink.already(view, copied):
                hasher.update(view)
                copied += n
                if progress is not None:
                    progress(copied)
                pace.take(n)
                continue
            alone = sink.alone(n)
            while alone and writes:
                finish_one()
            writes.append((pool.submit(sink.write, view, copied), copied + n))
            handed += 1
            hasher.update(view)
            copied += n
            while alone and writes:
                finish_one()
            if progress is not None:
                progress(copied)
            pace.take(n)
        while writes:
            finish_one()
    finally:
        # Never let the caller close the sink (or the buffers go) under a write in flight.
        futures_wait([f for f, _ in writes])
    return hasher.hexdigest(), copied - start
