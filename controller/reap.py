"""Ending a VRAM zombie on a box on request: the sidecar checks the pid and sends the signals
(`sidecar.reap`); this asks it to, and says what became of the process.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.reach import connect
from controller.state import Box


@dataclass(frozen=True, slots=True)
class ReapResult:
    box: str
    pid: int
    gone: bool  # the sidecar saw it exit (a zombie waiting for its parent counts: it holds no GPU memory)
    detail: str  # the sidecar's account: what it held, the signals sent, what became of it

    def to_json(self) -> dict[str, object]:
        return {"box": self.box, "pid": self.pid, "gone": self.gone, "detail": self.detail}


async def reap_process(box: Box, pid: int, grace_s: int) -> ReapResult:
    """Ask the box's sidecar to end `pid` (SIGTERM, SIGKILL after `grace_s`); it refuses unless the
    pid holds GPU memory outside every job now (a SidecarRefused with its reason)."""
    async with connect(box) as c:
        await c.hello()
        resp = await c.reap_process(pid, grace_s)
    return ReapResult(box.name, pid, resp.gone, resp.detail)
