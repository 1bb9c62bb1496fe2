"""`down NAME --confirm NAME --when-safe`: tear a box down the moment it is safe, not a minute later.

The controller follows the box: while a job runs or its queue has cells to run, it waits; then it
pulls the claims (resumably, into the pulled tree), verifies the tree as `verify` does, and asks the
usual gate with the name the user confirmed. The moment the gate passes, the usual teardown runs
(the release, the sidecar stop, the meter stop). Until then nothing is torn down: a box that does
not answer, or whose evidence never completes, is followed until the user ends it (Ctrl-C), never
torn down. While it follows, the box is marked armed in the controller's state (`watch` shows it).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import __version__, boxes, queues, reach, teardown
from controller.errors import ControllerError, StateError
from controller.state import Box, State
from controller.verify import verify_tree

POLL_S = 5.0


def armed_note(box: Box) -> str:
    """ "armed" while a `down --when-safe` of this box runs ("" otherwise)."""
    if box.armed_pid and os.path.exists(f"/proc/{box.armed_pid}"):
        return "armed"
    return ""


async def waiting_for(state: State, box: Box) -> list[str]:
    """What the box still runs (jobs, queued cells), or that it does not answer; [] when idle."""
    (s,) = await boxes.status(state, [box.name], deadline_s=10.0)
    if s.health is None:
        return [f"an answer from its sidecar ({s.error})"]
    running = [j.id for j in s.health.jobs if j.state == pb.JOB_STATE_RUNNING]
    out = [f"job {j} to end" for j in running]
    try:
        for q in await queues.list_queues(box, brief=True):
            left = [c.spec.cell for c in q.cells if c.state in (pb.CELL_PENDING, pb.CELL_RUNNING)]
            if left and not q.stopped:
                out.append(f"queue {q.name}'s cells {', '.join(left)}")
    except ControllerError as e:
        out.append(f"its queues ({e})")
    return out


async def follow(
    state: State,
    name: str,
    pull_to: Path,
    *,
    poll_s: float,
    report: Callable[[str], None],
    manual_done: Callable[[str], Awaitable[bool]],
) -> teardown.TeardownResult:
    """Follow box `name` until the gate passes, then tear it down; `report` gets each new reason
    it still waits. Raises StateError if the box stops being up meanwhile (another `down`)."""
    said: list[str] = []
    state.put(state.get(name).with_(armed_pid=os.getpid(), armed_at_ns=time.time_ns()))
    try:
        while True:
            box = state.get(name)
            if box.status != "up":
                raise StateError(f"{name} is {box.status} now: nothing left to tear down when safe")
            why = await waiting_for(state, box)
            if not why:
                try:
                    rep = await reach.pull_box(state, box, pull_to)
                    missing = sorted(rep.unavailable)
                    why = [f"the pull: {', '.join(missing)} unavailable"] if missing else []
                except ControllerError as e:
                    why = [f"the pull ({e})"]
            if not why:  # as `verify DIR` does it: the tree against its manifest, then a marker
                checked = await asyncio.to_thread(
                    verify_tree,
                    pull_to,
                    roster=box.roster or None,
                    write_marker=True,
                    verifier_version=__version__,
                )
                why = [f"{r.code} {r.path}".strip() for r in checked.reasons]
            if not why:
                verdict = await boxes.judge(box, pull_to, confirm=name, dry_run=False, state=state)
                if verdict.allowed:
                    report("the gate passed: tearing down")
                    return await boxes.down(state, state.get(name), verdict, manual_done)
                why = [f"{r.code} {r.path}".strip() for r in verdict.reasons]
            if why != said:
                said = why
                report("waiting for " + "; ".join(why))
            await asyncio.sleep(poll_s)
    finally:
        now = state.find(name)
        if now is not None and now.armed_pid == os.getpid():
            state.put(now.with_(armed_pid=0, armed_at_ns=0))
