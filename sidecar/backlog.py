"""The push backlog: when claims that are not durable yet are pushed again, how fast pushes go,
and draining (push everything now and say what is still at risk).

Retries back off exponentially with jitter (a throttled or unreachable store is not hammered, and
boxes sharing one bucket do not retry in step), and start again at once when there is reason to
believe they can succeed: the durable store gained free space or inodes, or a drain was asked for.
Each round pushes the newest claims first (`Sealer.push_pending`): after an outage the newest
complete checkpoint is the one worth having.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from sidecar.compat import SLOTS
from sidecar.ledger import ClaimRow, Ledger
from sidecar.storage.pace import UNLIMITED, Pace

logger = logging.getLogger(__name__)

RETRY_BASE_S = 1.0
RETRY_CAP_S = 60.0
DRAIN_RETRY_CAP_S = 1.0
"""While a drain runs, failed pushes are retried at least this often."""
AT_RISK_SHOWN = 20
PENDING_S = 0.5
"""A drain that waits for unsealed entries looks at the watched dirs at most this often."""
Pending = Callable[[], Awaitable[list[str]]]
"""The entries of the watched dirs not sealed yet (a checkpoint being written), display form."""
POLL_S = 0.05
"""How often a drain looks whether it is done (a ledger count and the seals under way: cheap)."""


class Bandwidth:
    """Bytes per second of the recent pushes: bytes copied and proven over the time the pushes
    took (stage to proof), across the last `window` pushes."""

    def __init__(self, window: int = 16) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, size: int, seconds: float) -> None:
        if seconds > 0:
            self._recent.append((size, seconds))

    def bytes_per_s(self) -> float:
        took = sum(s for _, s in self._recent)
        return sum(b for b, _ in self._recent) / took if took > 0 else 0.0


@dataclass(frozen=True, **SLOTS)
class AtRisk:
    """What a kill of the box now would lose of what is claimed: claims not durable yet."""

    files: int
    bytes: int
    bytes_per_s: float
    first: list[ClaimRow] = field(default_factory=list)  # newest first, at most AT_RISK_SHOWN
    # Entries of the watched dirs not sealed yet (being written, changed, temp-named), when asked.
    pending: list[str] = field(default_factory=list)

    @property
    def estimated_s(self) -> float:
        """Seconds to push them at the measured bandwidth; -1 when nothing was measured yet."""
        if not self.bytes:
            return 0.0
        return self.bytes / self.bytes_per_s if self.bytes_per_s > 0 else -1.0


class Backlog:
    def __init__(
        self,
        *,
        ledger: Ledger,
        push_pending: Callable[[], Awaitable[int]],
        busy: Callable[[], int],
        bandwidth: Bandwidth,
        jitter: Callable[[], float] = random.random,
        pace: Pace = UNLIMITED,
    ) -> None:
        """`push_pending`: one round of pushes (an awaitable factory); `busy`: seals under way;
        `pace`: the stores' byte rate, lifted while a drain runs."""
        self._pace = pace
        self._ledger = ledger
        self._push_pending = push_pending
        self._busy = busy
        self.bandwidth = bandwidth
        self._jitter = jitter
        self._wake = asyncio.Event()
        self._draining = 0
        self.attempt = 0

    def wake(self, why: str = "") -> None:
        """Retry now (space came back, a drain was asked for)."""
        if why and self.waiting():
            logger.info("retrying pushes now: %s", why)
        self._wake.set()

    def waiting(self) -> bool:
        n = self._ledger.counts
        return n.sealed > n.durable

    def delay(self) -> float:
        """Seconds until the next round after `attempt` failed rounds: exponential, capped, and
        jittered into [d/2, d) so that it is never zero and never in step with another box."""
        cap = DRAIN_RETRY_CAP_S if self._draining else RETRY_CAP_S
        d = min(cap, RETRY_BASE_S * float(2 ** min(self.attempt, 16)))
        return d / 2 + float(self._jitter()) * d / 2

    async def run(self) -> None:
        while True:
            self._wake.clear()
            if self.waiting():
                await self._push_pending()
                self.attempt = self.attempt + 1 if self.waiting() else 0
            else:
                self.attempt = 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.delay())

    def at_risk(self, pending: list[str] | None = None) -> AtRisk:
        rows = self._ledger.not_durable()  # newest first
        return AtRisk(
            files=len(rows),
            bytes=sum(c.size for c in rows),
            bytes_per_s=self.bandwidth.bytes_per_s(),
            first=rows[:AT_RISK_SHOWN],
            pending=pending or [],
        )

    def settled(self) -> bool:
        """Nothing at risk that the sidecar knows of: every claim durable and no seal under way."""
        return not self.waiting() and not self._busy()

    async def drain(
        self, timeout_s: float, *, every_s: float = 1.0, pending: Pending | None = None
    ) -> AsyncIterator[AtRisk]:
        """Push everything now; yield what is at risk at once, then every `every_s` until nothing
        is (no claim unproven, no seal under way and, with `pending`, no entry of the watched dirs
        left unsealed: a checkpoint still being written) or `timeout_s` passed, then once more as
        the last word. `pending()` walks the watched dirs: it is asked at most every `PENDING_S`."""
        self._draining += 1
        try:
            # Everything now: the pace that spares the trainer waits until the drain ends.
            with self._pace.lifted():
                self.attempt = 0
                self.wake("a drain was asked for")
                deadline = time.monotonic() + timeout_s
                waiting = await pending() if pending is not None else []
                asked = shown = time.monotonic()
                yield self.at_risk(waiting)
                while time.monotonic() < deadline:
                    if self.settled() and (not waiting or time.monotonic() - asked >= PENDING_S):
                        if pending is None:
                            break
                        waiting, asked = await pending(), time.monotonic()
                        if not waiting:
                            break
                    await asyncio.sleep(POLL_S)
                    if time.monotonic() - shown >= every_s:
                        shown = time.monotonic()
                        yield self.at_risk(waiting)
                yield self.at_risk(await pending() if pending is not None else [])
        finally:
            self._draining -= 1
