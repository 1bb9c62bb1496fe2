"""Part files: where a pull's bytes land before they count, whatever source they come from.

Each claim arrives as `<root>/PARTS_DIR/<32 hex of blake3(path)>.part` (a name that fits any
filesystem), opened relative to the parts directory's fd and never through a symlink or a second
link. A transfer resumes from the part file's size: the bytes already there are hashed first, so
the digest always covers the whole file. `receive` writes one stream of chunks into a part file
and hashes them on receipt; the caller keeps the file only if size and digest equal the claim
(`restart` throws its bytes away once, `drop` removes it for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.digest import StreamHasher, path_key
from controller.errors import TransferError
from controller.manifest import PARTS_DIR

if TYPE_CHECKING:
    from controller.pull import Progress, PullReport

logger = logging.getLogger(__name__)

PLACING_NAME = "placing.json"
"""In PARTS_DIR: the claims a pull is about to put in place, with its box and run."""
# What a pull writes in PARTS_DIR: part files, the placing record, and its atomic-write temp files.
_OUR_PART = re.compile(r"[0-9a-f]{32}\.part|placing\.json|\.placing\.json\.[^/]*\.tmp")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PART_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Chunk(Protocol):
    """Bytes of a claim from `offset` (a ReadArtifactChunk has these, and so has `Piece`)."""

    @property
    def offset(self) -> int: ...
    @property
    def data(self) -> bytes: ...


Stream = Callable[[int], AsyncIterator[Chunk]]
"""Opens a claim's bytes from an offset, chunk by chunk in order."""


def part_name(claim: pb.Claim) -> str:
    return f"{path_key(claim.path)}.part"


def open_parts_dir(root: Path, root_fd: int) -> int:
    where = root / PARTS_DIR
    with contextlib.suppress(FileExistsError):
        try:
            os.mkdir(PARTS_DIR, 0o700, dir_fd=root_fd)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise
            raise TransferError(f"cannot create {where}: {exc.strerror or exc}") from exc
    try:
        fd = os.open(PARTS_DIR, DIR_FLAGS, dir_fd=root_fd)
    except OSError as exc:
        raise TransferError(
            f"{where} is not a directory of ours ({exc.strerror or exc}): remove it and run pull again"
        ) from exc
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise TransferError(f"{where} belongs to uid {st.st_uid}, not to you: remove it and run pull again")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def part_size(parts_fd: int, claim: pb.Claim) -> int:
    """The bytes a transfer of the claim will resume from (its part file's size, 0 if it has none)."""
    try:
        st = os.stat(part_name(claim), dir_fd=parts_fd, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_size <= claim.size else 0


def open_part(parts_fd: int, claim: pb.Claim) -> int:
    part = part_name(claim)
    try:
        try:
            fd = os.open(part, _PART_FLAGS, dir_fd=parts_fd)
        except FileNotFoundError:
            fd = os.open(part, _PART_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=parts_fd)
    except OSError as exc:
        raise TransferError(
            f"{PARTS_DIR}/{part} (partial copy of {claim.path}): cannot open it ({exc.strerror or exc}); "
            "remove it and run pull again"
        ) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise TransferError(
            f"{PARTS_DIR}/{part} (partial copy of {claim.path}) is not a plain file of ours; "
            "remove it and run pull again"
        )
    return fd


def restart(parts_fd: int, claim: pb.Claim, report: PullReport, received: int) -> None:
    """A copy that did not hash to the claim is fetched again from 0: its `received` bytes go."""
    report.restarted.append(claim.path)
    report.bytes_discarded += received
    fd = open_part(parts_fd, claim)
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def drop(parts_fd: int, claim: pb.Claim) -> None:
    """Remove the claim's part file: its bytes are not the claim's, and nothing will resume them."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(part_name(claim), dir_fd=parts_fd)


async def receive(
    claim: pb.Claim, parts_fd: int, progress: Progress | None, stream: Stream
) -> tuple[int, int, str]:
    """One transfer into the part file, from where it ends; returns (offset resumed from, total,
    digest), the digest covering the bytes kept from before too."""
    fd = open_part(parts_fd, claim)
    try:
        offset = os.fstat(fd).st_size
        if offset > claim.size:
            os.ftruncate(fd, 0)
            offset = 0
        hasher = StreamHasher()
        # Resume: the bytes already here are part of the digest too.
        while chunk := os.pread(fd, 8 << 20, hasher.bytes_seen):
            hasher.update(chunk)
        if hasher.bytes_seen != offset:
            raise TransferError(f"the partial copy of {claim.path} changed while being resumed")
        received = 0
        pending: asyncio.Future[None] | None = None
        try:
            async for msg in stream(offset):
                if msg.offset != offset + received:
                    raise TransferError(f"{claim.path}: chunk at {msg.offset}, expected {offset + received}")
                if pending is not None:
                    await pending
                # Written and hashed off the event loop, while the next chunk arrives.
                pending = asyncio.ensure_future(asyncio.to_thread(_keep, fd, hasher, msg.data, msg.offset))
                received += len(msg.data)
                if progress:
                    progress.update(claim.path, offset + received, claim.size)
            if pending is not None:
                await pending  # the last chunk's write: its error surfaces here
                pending = None
        finally:
            if pending is not None:  # the stream broke: the write in flight ends before the fd closes
                await asyncio.wait({pending})
            os.fsync(fd)
        return offset, offset + received, hasher.hexdigest()
    except OSError as exc:
        raise TransferError(f"{claim.path}: writing the partial copy failed: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def _keep(fd: int, hasher: StreamHasher, data: bytes, offset: int) -> None:
    view = memoryview(data)
    at = offset
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    hasher.update(data)


def clear_parts(parts_fd: int) -> int:
    """Every claim is in place and recorded: nothing in PARTS_DIR will be resumed. Empty it; returns
    how many leftovers (entries other than this pull's own record) went."""
    removed = 0
    for name in os.listdir(parts_fd):
        if not _OUR_PART.fullmatch(name):
            logger.warning("%s/%s: not a file pull makes; left alone", PARTS_DIR, name)
            continue
        try:
            if not stat.S_ISREG(os.stat(name, dir_fd=parts_fd, follow_symlinks=False).st_mode):
                logger.warning("%s/%s: not a regular file; left alone", PARTS_DIR, name)
                continue
            os.unlink(name, dir_fd=parts_fd)
        except OSError as exc:
            logger.warning("%s/%s: cannot remove it: %s", PARTS_DIR, name, exc.strerror or exc)
            continue
        removed += name != PLACING_NAME
    return removed
