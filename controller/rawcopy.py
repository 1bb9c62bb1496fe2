"""Bulk bytes of one claim over the connector's command channel, straight into a part file.

`python -m sidecar.send` on the box writes the bytes to its stdout, and that stdout here is the part
file itself: the ssh client (or, for a local box, the sender) writes into it, so no byte passes
through this process. A pull of a large checkpoint through gRPC costs several times the CPU of this
path; small files stay on gRPC (`controller.pull` decides).

While the bytes arrive, this watches the file grow (progress; a link silent for STALL_S is broken)
and starts the disk's writeback every WRITEBACK_STEP bytes, so that the fsync at the end has little
left to do. Nothing here judges the bytes: the caller hashes the part file and keeps it only if it
equals the claim. Whatever arrived before a break stays in the file for the next attempt; a writer
that outlives its ssh client by a few bytes writes the stream's own next bytes at their own place,
and the digest decides in any case.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Protocol

from controller.connector import Completed
from controller.errors import ControllerError, SidecarUnreachable

STALL_S = 60.0
"""No byte for this long while the sender runs is a broken link."""

POLL_S = 0.1
TAIL_S = 5.0
"""After the sender's exit, how long the last bytes may take to land (a master writes them)."""
WRITEBACK_STEP = 64 << 20


class Runner(Protocol):
    """What this needs of a box's connector (controller.connector.Connector has it)."""

    python: str

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        stdout: int | None = None,
        timeout_s: float | None = 60.0,
    ) -> Completed: ...


class SendRefused(ControllerError):
    """The box-side sender ran and refused (no such file, not a regular file, fewer bytes): the
    sidecar's own ReadArtifact says what is wrong more exactly."""


async def receive(
    conn: Runner,
    art: str,
    watch_dirs: Sequence[str],
    fd: int,
    offset: int,
    length: int,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Bytes [offset, offset+length) of artifact `art` into the file `fd` (a regular file opened for
    writing) at the same offsets. `on_progress` gets how many of the `length` bytes are there, a
    few times a second.

    SidecarUnreachable when the link broke or stalled; SendRefused when the box-side sender
    refused; OSError when the file cannot be written."""
    os.lseek(fd, offset, os.SEEK_SET)  # the writer shares this offset
    argv = [conn.python, "-m", "sidecar.send", art, str(offset), str(length), *watch_dirs]
    proc = asyncio.ensure_future(conn.run(argv, stdout=fd, timeout_s=None))
    flushing: asyncio.Future[None] | None = None
    try:
        loop = asyncio.get_running_loop()
        seen, since, flushed = 0, loop.time(), 0
        while not proc.done():
            await asyncio.wait({proc}, timeout=POLL_S)
            got = os.fstat(fd).st_size - offset
            if on_progress is not None:
                on_progress(max(0, min(got, length)))
            if got - flushed >= WRITEBACK_STEP and (flushing is None or flushing.done()):
                flushed = got
                flushing = asyncio.ensure_future(asyncio.to_thread(_writeback, fd))
            if got > length:  # never let a sender fill the disk
                raise SendRefused(f"{art}: the box sent more than the {length} bytes asked for")
            if got != seen:
                seen, since = got, loop.time()
            elif not proc.done() and loop.time() - since > STALL_S:
                raise SidecarUnreachable(f"{art}: no bytes arrived for {STALL_S:.0f}s")
    finally:
        if not proc.done():
            proc.cancel()  # kills the sender's ssh client (or the local sender)
        await asyncio.wait({proc})
        if flushing is not None:
            await asyncio.wait({flushing})  # never fdatasync an fd the caller may have closed
    done = proc.result()  # a broken link raises here (ssh's exit 255)
    if done.returncode != 0:
        msg = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise SendRefused(f"{art}: the box did not send it (exit {done.returncode}): {msg[0]}")
    # The ssh client may end a moment before its master has written the last bytes it holds.
    deadline = loop.time() + TAIL_S
    while (got := os.fstat(fd).st_size - offset) < length and loop.time() < deadline:
        await asyncio.sleep(POLL_S / 2)
    if got > length:
        raise SendRefused(f"{art}: the box sent more than the {length} bytes asked for")
    if got < length:
        raise SidecarUnreachable(f"{art}: the stream ended after {got} of {length} bytes")


def _writeback(fd: int) -> None:
    with contextlib.suppress(OSError):  # the caller's final fsync reports what matters
        os.fdatasync(fd)
