"""WriteScans: one /proc scan for "who holds these files open for writing" shared by every caller
that asked before it started.

A burst of 2,000 new files used to run 2,000 whole-/proc scans back to back, one per file, and
every query waiting behind them timed out. A caller here gets the result of a scan that STARTED
after it asked (so a writer that opened the file before the question is always seen); callers
that arrive while a scan runs share the next one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from sidecar.openfiles import OpenWrites, open_for_write


class WriteScans:
    def __init__(self, roots: tuple[Path, ...], executor: Executor) -> None:
        self._roots = list(roots)
        self._executor = executor
        self._running: asyncio.Task[OpenWrites] | None = None
        self._next: asyncio.Future[OpenWrites] | None = None
        self.scans = 0  # how many scans ran (for tests and the bench)

    def _scan(self) -> OpenWrites:
        return open_for_write(self._roots, exclude_pids=(os.getpid(),))

    async def scan(self) -> OpenWrites:
        """The open-for-write set from a scan that started after this call."""
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
        mine = self._next
        if self._running is None:
            self._start(loop)
        return await asyncio.shield(mine)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting, self._next = self._next, None
        assert waiting is not None
        run: Callable[[], OpenWrites] = self._scan
        self.scans += 1
        task = loop.create_task(_in_executor(loop, self._executor, run))
        self._running = task

        def done(t: asyncio.Task[OpenWrites]) -> None:
            self._running = None
            if t.cancelled():
                waiting.cancel()
            elif t.exception() is not None:
                waiting.set_exception(t.exception())  # type: ignore[arg-type]
            else:
                waiting.set_result(t.result())
            if self._next is not None:
                self._start(loop)

        task.add_done_callback(done)


async def _in_executor(
    loop: asyncio.AbstractEventLoop, executor: Executor, fn: Callable[[], OpenWrites]
) -> OpenWrites:
    return await loop.run_in_executor(executor, fn)
