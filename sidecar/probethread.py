"""ProbeThread: one blocking probe (statvfs of a network mount, NVML, /proc and cgroup files, a
job's log) run on its own thread, so that nothing the sidecar's event loop serves ever waits on it.

Each `read()` asks for a fresh reading and waits at most `timeout_s` from the moment it was asked
for. A probe that does not answer in time keeps its thread (a call stuck in the kernel cannot be
taken back) and is not asked again until it returns; meanwhile `read()` answers at once with the last
good reading, marked stale with its age and why. A reading's age counts from when it was asked for:
an answer that comes late is as old as its question. `read_fresh()` takes only a reading asked for
after it was called (a call already under way began before). The thread is a daemon: a probe wedged
for good never holds up the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, **SLOTS)
class Reading(Generic[T]):
    value: T | None  # the newest good reading; None before the first
    # No new answer came for this read: the call failed, is past its deadline, or none came yet.
    # (An answer that came after its deadline is taken at the next read, aged from its question.)
    stale: bool
    age_s: float  # seconds since value's call was asked for (since the probe was made, before the first)
    error: str  # why this read got no fresh value; "" when it did


class ProbeThread(Generic[T]):
    def __init__(
        self, name: str, fn: Callable[[], T], *, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self._fn = fn
        self._timeout_s = timeout_s
        self._clock = clock
        self._requests: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[T]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._pending: tuple[asyncio.Future[T], float] | None = None  # the call under way, asked at
        self._value: T | None = None
        self._taken_at = clock()  # when the value's call was asked for
        self._error = "no reading yet"

    async def read(self) -> Reading[T]:
        """A fresh reading if the probe answers within timeout_s of being asked, else the last good
        one, stale (at once when the call under way is already past its deadline)."""
        if self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = (loop.create_future(), self._clock())
            self._start()
            self._requests.put((loop, self._pending[0]))
        pending, asked = self._pending
        left = self._timeout_s - (self._clock() - asked)
        if left > 0 and not pending.done():
            await asyncio.wait({pending}, timeout=left)
        fresh = False
        if pending.done():
            if self._pending is not None and self._pending[0] is pending:
                self._pending = None  # (another waiter may have asked anew since: leave that one)
            exc = pending.exception()
            if exc is not None:
                if self._value is None or asked >= self._taken_at:  # (an older call's failure: no news)
                    self._error = f"{type(exc).__name__}: {exc}"
                    logger.warning("probe %s failed: %s", self.name, self._error)
            elif self._value is None or asked >= self._taken_at:  # never an older answer over a newer
                self._value, self._taken_at, self._error, fresh = pending.result(), asked, "", True
            else:
                fresh = self._error == ""
        else:
            waited = self._clock() - asked
            self._error = f"no answer for {waited:.1f} s (timeout {self._timeout_s:g} s)"
        return Reading(self._value, not fresh, self._clock() - self._taken_at, self._error)

    async def read_fresh(self) -> Reading[T]:
        """`read()`, but only a reading whose call was asked for no earlier than this one: a call
        already under way (begun before) is waited out first, then the probe is asked again."""
        since = self._clock()
        got = await self.read()
        if got.stale or self._taken_at >= since:
            return got
        got = await self.read()
        if got.stale or self._taken_at >= since:
            return got
        return Reading(got.value, True, got.age_s, "no reading asked for since this call answered")

    def close(self) -> None:
        """Let the thread end after its current call (it is a daemon: exit never waits for it)."""
        if self._thread is not None:
            self._requests.put(None)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"probe-{self.name}", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            loop, future = request
            try:
                value = self._fn()
            except Exception as exc:
                self._answer(loop, future, None, exc)
            else:
                self._answer(loop, future, value, None)

    @staticmethod
    def _answer(
        loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], value: T | None, exc: Exception | None
    ) -> None:
        def settle() -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)  # type: ignore[arg-type]

        # RuntimeError: the loop closed while the probe ran; nobody waits for it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)
