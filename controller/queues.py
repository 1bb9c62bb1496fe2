"""Cell queues on a box, seen from the controller: start one (from a cells file or from flags), read
it, follow it to its end, stop it. The sidecar runs the queue: it survives this process, a cut link
and a sidecar restart; this only asks and reports.

A queue's exit status for scripts (`run --queue --wait`, `queue NAME Q`):

    0  every cell finished (exit 0) and every one's checkpoints are durable
    1  a cell failed, was cancelled or left no checkpoint
    4  not over yet: a cell still runs, or finished cells' checkpoints are still being pushed
       (with --wait: at its timeout)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.boxes import RestartPolicy
from controller.cellsfile import CellsFile
from controller.errors import EXIT_ERROR, EXIT_OK, SidecarUnreachable, StateError
from controller.reach import connect
from controller.state import Box

EXIT_NOT_OVER = 4
POLL_S = 2.0


def request_for(cells: CellsFile, policy: RestartPolicy) -> pb.StartQueueRequest:
    req = pb.StartQueueRequest(name=cells.name, restart=policy.restart)
    if policy.restart != "never":
        req.max_restarts, req.restart_backoff_s = policy.max_restarts, policy.backoff_s
    for c in cells.cells:
        req.cells.add(cell=c.name, argv=list(c.argv), cwd=c.cwd, env=dict(c.env))
    return req


async def start_queue(box: Box, cells: CellsFile, policy: RestartPolicy) -> pb.StartQueueResponse:
    async with connect(box) as c:
        await c.hello()
        return await c.start_queue(request_for(cells, policy))


async def list_queues(box: Box, name: str = "", *, brief: bool = False) -> list[pb.Queue]:
    """The box's queues, or only `name`'s; `brief`: without the cells' commands."""
    async with connect(box) as c:
        await c.hello()
        return await c.list_queues(name, brief=brief)


def pick(box: Box, queues: list[pb.Queue], name: str) -> pb.Queue:
    for q in queues:
        if q.name == name:
            return q
    known = ", ".join(q.name for q in queues) or "none"
    raise StateError(f"box {box.name} has no queue {name!r} (its queues: {known})")


async def stop_queue(box: Box, name: str, grace_s: int) -> pb.Queue:
    async with connect(box) as c:
        await c.hello()
        return await c.stop_queue(name, grace_s)


def is_over(q: pb.Queue) -> bool:
    """Nothing of it runs and no finished cell's checkpoints are on their way."""
    return q.result in (pb.QUEUE_OK, pb.QUEUE_FAILED) and all(
        c.durability != pb.CELL_PUSHING for c in q.cells
    )


async def wait_queue(
    box: Box,
    name: str,
    timeout_s: float,
    on_change: Callable[[pb.Queue], None],
    on_unreachable: Callable[[str], None],
) -> pb.Queue:
    """Follow the queue until it is over or `timeout_s` passed; the last state seen. `on_change` gets
    each new state; a sidecar that does not answer (restarting, a cut link) is waited for, and told
    to `on_unreachable` once per outage."""
    deadline = time.monotonic() + timeout_s
    last: pb.Queue | None = None
    down = False
    while True:
        try:
            q = pick(box, await list_queues(box, name), name)
            down = False
        except SidecarUnreachable as e:
            if last is None and time.monotonic() >= deadline:
                raise
            if not down:
                on_unreachable(str(e))
            down = True
        else:
            if last is None or q != last:
                on_change(q)
            last = q
            if is_over(q):
                return q
        if time.monotonic() >= deadline:
            assert last is not None
            return last
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def exit_code(q: pb.Queue) -> int:
    if q.result == pb.QUEUE_OK:
        return EXIT_OK
    if q.result == pb.QUEUE_FAILED:
        return EXIT_ERROR
    return EXIT_NOT_OVER


def result_name(q: pb.Queue) -> str:
    """ "running", "pushing", "ok", "failed"."""
    return pb.QueueResult.Name(q.result).removeprefix("QUEUE_").lower()


def cell_state(c: pb.QueuedCell) -> str:
    """ "pending", "running", "done", "failed", "skipped", "cancelled"."""
    return pb.CellState.Name(c.state).removeprefix("CELL_").lower()


def durability_name(c: pb.QueuedCell) -> str:
    """ "durable", "pushing", "no_checkpoint", or "" for a cell that did not finish."""
    if c.durability == pb.CELL_DURABILITY_UNSPECIFIED:
        return ""
    return pb.CellDurability.Name(c.durability).removeprefix("CELL_").lower()


def to_json(box: str, q: pb.Queue) -> dict[str, object]:
    """The queue for scripts: numbers and enum names, no prose but `detail`."""
    return {
        "box": box,
        "name": q.name,
        "result": result_name(q),
        "over": is_over(q),
        "stopped": q.stopped,
        "passes": q.passes,
        "created_at_unix_ns": q.created_at_unix_ns,
        "ended_at_unix_ns": q.ended_at_unix_ns,
        "restart": q.restart or "never",
        "max_restarts": q.max_restarts,
        "cells": [
            {
                "cell": c.spec.cell,
                "state": cell_state(c),
                "job_id": c.job_id,
                "exit_code": c.exit_code if c.state in (pb.CELL_DONE, pb.CELL_FAILED) and c.job_id else None,
                "detail": c.detail,
                "durability": durability_name(c) or None,
                "claims": c.claims,
                "durable_claims": c.durable_claims,
                "argv": list(c.spec.argv),
            }
            for c in q.cells
        ],
    }
