"""Speculative streaming: push a big checkpoint to the durable store while it is still being written,
so that at its seal only the chunks that changed since, and its tail, remain to be copied.

A follower starts when a claimable file reported written has grown past `min_bytes`; it opens the
file read-only, pushes its whole chunks as they appear (`DurableStore.push_ahead`, in the sealer's
low-priority workers), and stops once the file has not grown for `IDLE_S`, or when the seal takes
the copy. The seal's stage then reads the whole sealed file once, hashes every byte (the claim's
digest never comes from what was pushed ahead) and writes again every chunk whose CRC-32 differs;
the committed copy is proven like any other, so a writer that went back and rewrote earlier bytes
costs a re-push, never a false claim. A copy pushed from another file (the path replaced since) is
discarded. A copy no seal takes is discarded after `KEEP_S`; a crash leaves only temp files and
uploads, which the store removes at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.errors import SidecarError
from sidecar.identity import FileIdentity
from sidecar.storage import DurableStore
from sidecar.storage.copier import Ahead

logger = logging.getLogger(__name__)

POLL_S = 0.5
IDLE_S = 30.0
"""A file that has not grown for this long is left to its seal (or was abandoned)."""
KEEP_S = 600.0
"""A copy pushed ahead that no seal took within this long is discarded."""

Run = Callable[..., Awaitable[Any]]


@dataclass
class _Follow:
    task: asyncio.Task[None]
    stop: bool = False
    ahead: Ahead | None = None
    ended_at: float = 0.0


class AheadPusher:
    def __init__(self, store: DurableStore, run: Run, *, min_bytes: int) -> None:
        """`run(fn, *args)`: runs a blocking call in the sealer's workers."""
        self._store = store
        self._run = run
        self._min = min_bytes
        self._follows: dict[str, _Follow] = {}
        self._discards: set[asyncio.Task[None]] = set()

    def on_write(self, art: str, path: Path) -> None:
        """A claimable file was written: follow it once it is big enough."""
        self.reap()
        if art in self._follows:
            return
        try:
            if os.lstat(path).st_size < self._min:
                return  # small so far: a later write looks again
        except OSError:
            return
        f = _Follow(task=asyncio.get_running_loop().create_task(self._follow(art, path)))
        self._follows[art] = f
        f.task.add_done_callback(lambda t: _log_failure(art, t))

    async def _follow(self, art: str, path: Path) -> None:
        f = self._follows[art]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not self._room(st.st_size, 0):
                return
            f.ahead = await self._run(self._store.begin_ahead, art, (st.st_dev, st.st_ino))
            grew_at = time.monotonic()
            while not f.stop and time.monotonic() - grew_at < IDLE_S:
                size = os.fstat(fd).st_size
                if f.ahead is not None and size - f.ahead.done >= f.ahead.chunk:
                    if not self._room(size, f.ahead.done):
                        logger.info("stopped pushing %s ahead of its seal: its store is short of room", art)
                        await self._discard(f)
                        return
                    await self._run(self._store.push_ahead, f.ahead, fd, size)
                    grew_at = time.monotonic()
                else:
                    await asyncio.sleep(POLL_S)
        except (SidecarError, OSError) as e:
            logger.info("pushing %s ahead of its seal stopped: %s", art, e)
            await self._discard(f)
        finally:
            os.close(fd)
            f.ended_at = time.monotonic()

    async def take(self, art: str, ident: FileIdentity) -> Ahead | None:
        """The copy pushed ahead for `art`, if it was pushed from the file `ident` is (the seal's
        stage takes it over); None otherwise. The follower is stopped first, between two pushes."""
        f = self._follows.pop(art, None)
        if f is None:
            return None
        f.stop = True
        await asyncio.gather(f.task, return_exceptions=True)
        if f.ahead is not None and f.ahead.source != (ident.dev, ident.ino):
            await self._discard(f)
        return f.ahead

    async def drop(self, art: str) -> None:
        """The file left (deleted, renamed away): its copy pushed ahead goes too."""
        f = self._follows.pop(art, None)
        if f is not None:
            f.stop = True
            await asyncio.gather(f.task, return_exceptions=True)
            await self._discard(f)

    async def close(self) -> None:
        for art in list(self._follows):
            await self.drop(art)

    def pushed(self, art: str) -> int:
        """Bytes of `art` pushed ahead so far (0: none)."""
        f = self._follows.get(art)
        return f.ahead.done if f is not None and f.ahead is not None else 0

    async def _discard(self, f: _Follow) -> None:
        ahead, f.ahead = f.ahead, None
        if ahead is not None:
            with contextlib.suppress(SidecarError, OSError):
                await self._run(self._store.discard_ahead, ahead)

    def _room(self, size: int, done: int) -> bool:
        """Is there room to push a `size`-byte file from `done` on, and leave the writer room to
        write as much again (the store may be the trainer's own disk), plus the sealer's reserve?"""
        try:
            space = self._store.space()
        except SidecarError:
            return False
        if space is None:
            return True
        reserve = min(1 << 30, space.total_bytes // 50)
        return space.free_bytes >= (size - done) + size + reserve

    def reap(self) -> None:
        """Discard copies pushed ahead that no seal took in time (the file was abandoned, or sealed
        unchanged and never staged)."""
        now = time.monotonic()
        for art, f in list(self._follows.items()):
            if f.task.done() and now - f.ended_at > KEEP_S:
                del self._follows[art]
                task = asyncio.get_running_loop().create_task(self._discard(f))
                self._discards.add(task)
                task.add_done_callback(self._discards.discard)


def _log_failure(art: str, task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("pushing %s ahead of its seal failed", art, exc_info=task.exception())
