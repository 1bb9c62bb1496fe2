"""The pace of the sidecar's pushes: a box-wide byte rate that stages and re-reads keep to, so a
push costs the trainer a little for a while instead of a lot at once.

Why a rate and not only a priority: the workers already run at nice 10 and the lowest best-effort
I/O level (`sidecar.priority`), which settles who gets a busy core or disk; but every byte a push
reads crosses the CPU's caches and the memory bus that the trainer shares, whatever its priority.
Measured here (2 cores, a CPU trainer of ~10 ms steps): copying and hashing a hot 1 GiB checkpoint
at full speed (~1.1 GB/s) slowed the trainer's steps by 9 % while it ran; at 500 MB/s by 5 %; at
250 MB/s by 3.5 %. The cost is per byte, so a slower pace spreads it thinner.

A drain lifts the pace (`lifted`): when the box is going away, or the user asked for everything now,
the bytes matter more than the trainer's step time. So does a release (the re-reads `down` makes
before deleting box copies: no job runs then, and the user waits), and an exiting sidecar (`end`).

This module owns the rate and nothing else: a store calls `take(n)` after each chunk it moved.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DEFAULT_RATE = 400 * 10**6
"""Bytes per second when the configuration says nothing: a 1 GiB checkpoint durable and re-read
in about 6 s, a 20 GiB one in about 2 minutes, with the trainer's steps at most ~5 % slower
meanwhile (bench/trainstep.py)."""

MIN_RATE = 10**6
"""The lowest rate a configuration may ask for (below it a checkpoint takes hours: a typo)."""

BURST_S = 0.05
"""How far a push may run ahead of the rate after a pause (a chunk or two), in seconds of rate."""


class Pace:
    """A byte rate shared by every push of the sidecar (concurrent stages split it). Thread-safe.
    `rate` ≤ 0: no limit."""

    def __init__(self, rate: float = 0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0.0  # monotonic time at which the bytes taken so far are paid for
        self._lifts = 0
        self._lifted = threading.Event()  # set while a drain runs: sleepers wake at once

    def take(self, n: int) -> None:
        """Account `n` bytes just moved; sleep until the rate allows them (at once while lifted)."""
        wait = self.owed(n)
        if wait > 0:
            self._lifted.wait(wait)

    def owed(self, n: int) -> float:
        """Account `n` bytes; the seconds to wait before they are paid for (0 while lifted)."""
        if self.rate <= 0 or self._lifted.is_set():
            return 0.0
        with self._lock:
            now = self._clock()
            self._next = max(self._next, now - BURST_S) + n / self.rate
            return max(0.0, self._next - now)

    @contextmanager
    def lifted(self) -> Iterator[None]:
        """No limit while inside (drains nest: the pace returns when the last one ends)."""
        with self._lock:
            self._lifts += 1
            self._lifted.set()
        try:
            yield
        finally:
            with self._lock:
                self._lifts -= 1
                if not self._lifts:
                    self._lifted.clear()
                    self._next = self._clock()  # no debt from the drain's bytes

    def end(self) -> None:
        """No limit from now on, and every push asleep in the pace wakes (the sidecar is exiting)."""
        with self._lock:
            self.rate = 0
            self._lifted.set()

    @property
    def is_lifted(self) -> bool:
        return self._lifted.is_set()


UNLIMITED = Pace(0)
"""For stores built without a pace (tests, benches of the store alone, the controller's reads)."""
