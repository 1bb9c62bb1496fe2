"""Drain: ask a box's sidecar to push everything not durable yet, and say what is still at risk.

What is at risk is what a kill of the box now would lose: claims whose durable copy is not proven
yet, and entries of the watched dirs not sealed yet (being written, changed, temp names), which no
push can save until they are sealed. The sidecar decides when its drain is over (nothing at risk,
or its timeout); this module keeps its last word and what the controller saw of the wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.errors import SidecarRefused, SidecarUnreachable, StateError
from controller.reach import connect
from controller.state import Box

OnProgress = Callable[[pb.DrainProgress], None]


@dataclass(frozen=True)
class DrainReport:
    box: str
    last: pb.DrainProgress  # the sidecar's last word (done set)
    waited: bool
    timeout_s: int
    elapsed_s: float

    @property
    def safe(self) -> bool:
        """Nothing at risk: every claim durable, nothing waiting to be sealed."""
        return self.last.at_risk_files == 0 and self.last.pending == 0

    def to_json(self) -> dict[str, Any]:
        """Numbers as numbers (bytes, seconds, bytes/s, counts); estimated_s is null when no push
        was measured yet."""
        p = self.last
        return {
            "box": self.box,
            "safe": self.safe,
            "waited": self.waited,
            "timeout_s": self.timeout_s if self.waited else None,
            "elapsed_s": round(self.elapsed_s, 3),
            "at_risk_files": p.at_risk_files,
            "at_risk_bytes": p.at_risk_bytes,
            "estimated_s": None if p.estimated_s < 0 else round(p.estimated_s, 3),
            "push_bytes_per_s": round(p.push_bytes_per_s, 1),
            "pending": p.pending,
            "at_risk": [
                {
                    "path": c.path,
                    "bytes": c.size,
                    "blake3": c.blake3,
                    "sealed_at_unix_ns": c.sealed_at_unix_ns,
                    "push_error": c.push_error,
                }
                for c in p.at_risk
            ],
        }


async def drain(
    box: Box, *, wait: bool, timeout_s: int, on_progress: OnProgress | None = None
) -> DrainReport:
    """Drain box `box`: every message of the sidecar goes to `on_progress`; the report holds the
    last. `timeout_s` (with `wait`): the most seconds the sidecar waits; 0 means its default."""
    if box.status in ("down", "meter-unproven"):
        raise StateError(f"{box.name} is {box.status}: its sidecar is stopped, there is nothing to drain")
    start = time.monotonic()
    last: pb.DrainProgress | None = None
    async with connect(box) as c:
        await c.hello()
        try:
            async with aclosing(c.drain(wait=wait, timeout_s=timeout_s)) as stream:
                async for progress in stream:
                    last = progress
                    if on_progress is not None:
                        on_progress(progress)
                    if progress.done:
                        break
        except SidecarRefused as e:
            raise SidecarRefused(f"{box.name}: {e}", e.code) from e
    if last is None or not last.done:
        raise SidecarUnreachable(f"Drain: {box.name}'s sidecar ended the drain before its last word")
    return DrainReport(box.name, last, wait, timeout_s, time.monotonic() - start)
