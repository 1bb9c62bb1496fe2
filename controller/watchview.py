"""`watch`: one live picture of many boxes. Each box is asked by a poller of its own, each call with
its own deadline, so a box that does not answer shows how long ago it was last seen and never slows
the other rows; the view redraws from the latest answers at its own pace. Alerts are highlighted in
the rows and also printed once as a log line above the view (they survive in scrollback).

Per box: its state, its cells (a plan's queue), step and loss, GPU use, the age of its last
checkpoint, what is not durable yet and the push lag, disk headroom, and what it still lacks before
`down` may tear it down (as far as a snapshot can tell: the gate itself re-checks every byte).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import armed, boxes, cellfacts, queues, render
from controller.errors import ControllerError, SidecarMismatch
from controller.reach import connect
from controller.state import Box, State

if TYPE_CHECKING:
    from rich.table import Table

POLL_DEADLINE_S = 5.0
LAGS_KEPT = 10_000
IDLE_AFTER_S = 600.0  # a box up with nothing to run for this long raises BOX_IDLE
STALE_S = 5.0  # a box that sends no snapshot for this long (it sends one a second) is unreachable


@dataclass
class Seen:
    """What the view knows of one box: its latest status row and queue, and when they came."""

    box: Box
    row: dict[str, object] = field(default_factory=dict)
    queue: pb.Queue | None = None
    at: float = 0.0  # time.monotonic() of the latest answer; 0: none yet
    error: str = ""
    mismatch: bool = False  # the latest answer came from another sidecar than the box's (refused)
    # Seconds from each snapshot's sampling on the box to its receipt here (the latest ones).
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=LAGS_KEPT))


async def poll(state: State, seen: Seen, queue_name: str, interval_s: float) -> None:
    """Keep `seen` up to date until cancelled, on one connection held open: the box's health stream
    (a snapshot each sampling interval) and, with `queue_name`, the queue at most every
    `interval_s`. A box that stops answering (no snapshot for STALE_S, a broken link) is shown
    unreachable with its last answer's time, and asked again after a pause."""
    pause = 1.0
    while True:
        try:
            async with connect(seen.box) as c:
                hello = await c.hello(timeout_s=POLL_DEADLINE_S)
                asked = 0.0
                async for snap in c.watch_health(idle_s=STALE_S):
                    seen.lags.append(max(0.0, (time.time_ns() - snap.at_unix_ns) / 1e9))
                    now = time.monotonic()
                    if now - asked >= interval_s:  # what changes slowly: once an interval
                        asked = now
                        seen.box = state.find(seen.box.name) or seen.box  # armed by a `down --when-safe`?
                        if queue_name:
                            qs = await asyncio.wait_for(
                                c.list_queues(queue_name, brief=True), POLL_DEADLINE_S
                            )
                            seen.queue = qs[0] if qs else None
                            cellfacts.learn(state, seen.box, qs)
                    seen.row = boxes.BoxStatus(seen.box, hello, snap).row()
                    seen.at, seen.error, seen.mismatch, pause = time.monotonic(), "", False, 1.0
        except (ControllerError, TimeoutError) as e:
            seen.error = str(e) or "no answer"
            seen.mismatch = isinstance(e, SidecarMismatch)
        seen.row = boxes.BoxStatus(seen.box, None, None, error=seen.error or "the stream ended").row()
        await asyncio.sleep(pause)
        pause = min(pause * 2, 10.0)


def lacks(seen: Seen) -> list[str]:
    """What the box still lacks before it may be torn down, as its snapshot shows."""
    r = seen.row
    if r.get("status") != "up":
        return [str(r.get("status", seen.box.status))]
    if r.get("unreachable") or not r:
        return ["an answer"]
    out = []
    running = _int(r.get("jobs_running"))
    if running:
        out.append(f"{running} job{'s' if running > 1 else ''}")
    if seen.queue is not None:
        left = sum(c.state in (pb.CELL_PENDING, pb.CELL_RUNNING) for c in seen.queue.cells)
        if left:
            out.append(f"{left} cell{'s' if left > 1 else ''}")
    not_durable = _int(r.get("claims")) - _int(r.get("durable"))
    if not_durable:
        out.append(f"{not_durable} not durable")
    out = out or ["pull+verify"]
    return [f"armed: {out[0]}", *out[1:]] if armed.follower(seen.box) else out


def _int(v: object) -> int:
    return v if isinstance(v, int) else 0


def _age(ns: object) -> str:
    if not isinstance(ns, int) or not ns:
        return "-"
    return render.human_duration(max(0.0, (time.time_ns() - ns) / 1e9))


def row_cells(seen: Seen, now: float) -> list[str]:
    r = seen.row
    name = seen.box.name
    if not r and not seen.error:
        return [name, "connecting", "", "", "", "", ""]
    if not r or r.get("unreachable"):
        ago = f"{render.human_duration(now - seen.at)} ago" if seen.at else "never"
        if seen.mismatch:  # something answers, and it is not the box's own sidecar
            return [name, f"SIDECAR_MISMATCH (seen {ago})", "", "", "", "", "its own sidecar"]
        return [name, f"UNREACHABLE (seen {ago})", "", "", "", "", ", ".join(lacks(seen))]
    if r.get("status") != "up":  # a teardown left unfinished: a follower may continue it
        return [name, str(r.get("status")), "", "", "", "", "armed" if armed.follower(seen.box) else ""]
    progress = r.get("progress")
    step = ""
    if isinstance(progress, list) and progress:
        p = progress[0]
        if isinstance(p, dict):
            loss = p.get("loss")
            step = f"{p.get('step') if p.get('step') is not None else '-'}"
            step += f" {loss:.3g}" if isinstance(loss, float) else (" nan" if p.get("nonfinite") else "")
    gpus = r.get("gpus")
    gpu = ""
    if isinstance(gpus, list) and gpus:
        utils = [g.get("utilization_percent") for g in gpus if isinstance(g, dict)]
        gpu = " ".join(f"{u}%" for u in utils if isinstance(u, int)) or "?"
    cells = ""
    if seen.queue is not None:
        done = sum(c.state in (pb.CELL_DONE, pb.CELL_SKIPPED) for c in seen.queue.cells)
        failed = sum(c.state in (pb.CELL_FAILED, pb.CELL_CANCELLED) for c in seen.queue.cells)
        cells = f"{done}/{len(seen.queue.cells)}" + (f" {failed}F" if failed else "")
    risk = render.human_bytes(_int(r.get("not_durable")))
    lag = r.get("push_lag_s")
    if isinstance(lag, (int, float)) and lag > 0:
        risk += f" {render.human_duration(lag)}"
    free = r.get("disk_free")
    return [
        name,
        " ".join(x for x in (cells, step) if x) or "idle",
        gpu,
        _age(r.get("last_checkpoint_unix_ns")),
        risk,
        render.human_bytes(free) if isinstance(free, int) else "",
        ", ".join(lacks(seen)),
    ]


COLUMNS = ("box", "cells step loss", "gpu", "ckpt", "at risk", "disk", "lacks")


def table(seen: Sequence[Seen], *, expand: bool) -> Table:
    from rich.table import Table

    now = time.monotonic()
    t = Table(
        box=None,
        show_edge=False,
        pad_edge=False,
        expand=False,
        caption=time.strftime("%H:%M:%S"),  # the view is alive: it redraws each interval
        caption_justify="right",
    )
    for title in COLUMNS:
        t.add_column(title, overflow="fold", max_width=24 if title == "lacks" else None)
    for s in seen:
        alerts = s.row.get("alerts")
        style = "bold red" if (isinstance(alerts, list) and alerts) or s.row.get("unreachable") else None
        t.add_row(*(render.esc(c) for c in row_cells(s, now)), style=style)
        if expand and s.queue is not None:
            for c in s.queue.cells:
                t.add_row(render.esc(f"  {c.spec.cell}"), render.esc(cell_text(s, c)), "", "", "", "", "")
    return t


def cell_text(seen: Seen, c: pb.QueuedCell) -> str:
    """A cell's state ("stalled" for a running one whose job raised JOB_STALLED), with its job's
    step and loss while it runs, or why it failed."""
    state = queues.cell_state(c)
    if state == "running":
        alerts = seen.row.get("alerts")
        stalled = any(
            isinstance(a, dict) and a.get("kind") == "JOB_STALLED" and a.get("subject") == c.job_id
            for a in (alerts if isinstance(alerts, list) else [])
        )
        progress = seen.row.get("progress")
        mine = [p for p in (progress if isinstance(progress, list) else []) if isinstance(p, dict)]
        p = next((x for x in mine if x.get("job_id") == c.job_id), None)
        text = "stalled" if stalled else "running"
        if p is not None and p.get("step") is not None:
            loss = p.get("loss")
            text += f" {p['step']}" + (
                f" {loss:.3g}" if isinstance(loss, float) else " nan" if p.get("nonfinite") else ""
            )
        return text
    detail = f" {c.detail}" if c.detail and state in ("failed", "cancelled") else ""
    return f"{state}{detail}"


def idle_for(seen: Seen) -> float | None:
    """Seconds the box has been up with no job running and no cell to run; None if it is busy."""
    r = seen.row
    ended = r.get("jobs_ended_unix_ns")
    if not isinstance(ended, int) or r.get("unreachable"):
        return None
    cells = seen.queue.cells if seen.queue is not None else []
    if any(c.state in (pb.CELL_PENDING, pb.CELL_RUNNING) for c in cells):
        return None
    return max(0.0, (time.time_ns() - ended) / 1e9)


def idle_line(seen: Seen, idle_s: float) -> str:
    r = seen.row
    text = f"{seen.box.name}: BOX_IDLE: no job has run for {render.human_duration(idle_s)}"
    price, since = r.get("price_per_hour"), r.get("up_since_unix_ns")
    if isinstance(price, (int, float)) and price > 0 and isinstance(since, int):
        hours = max(0.0, (time.time_ns() - since) / 3.6e12)
        text += f"; up {render.human_duration(hours * 3600)} at {price:g}/h: {price * hours:.2f} so far"
    name = seen.box.name
    return text + f"; tear it down once it is safe: `boxwarden down {name} --confirm {name}`"


def new_alerts(
    seen: Sequence[Seen], shown: set[tuple[str, str, str, int]], idle_after_s: float = IDLE_AFTER_S
) -> list[str]:
    """Log lines for the alerts not printed yet (each once per episode), BOX_IDLE among them."""
    out = []
    for s in seen:
        idle = idle_for(s)
        ended = s.row.get("jobs_ended_unix_ns")
        if idle is not None and idle >= idle_after_s and isinstance(ended, int):
            key = (s.box.name, "BOX_IDLE", "", ended)
            if key not in shown:
                shown.add(key)
                out.append(idle_line(s, idle))
        alerts = s.row.get("alerts")
        for a in alerts if isinstance(alerts, list) else []:
            if not isinstance(a, dict):
                continue
            key = (s.box.name, str(a.get("kind")), str(a.get("subject")), int(a.get("since_unix_ns") or 0))
            if key not in shown:
                shown.add(key)
                out.append(f"{s.box.name}: {a.get('kind')} {a.get('subject')}: {a.get('detail')}")
    return out


async def run(
    state: State,
    seen: Sequence[Seen],
    queue_name: str,
    *,
    interval_s: float,
    once: bool,
    show: Callable[[Table, list[str]], None],
    idle_after_s: float = IDLE_AFTER_S,
) -> None:
    """Poll every box at once and call `show(table, new alert lines)` each interval (once with
    `once`, after every box answered or missed its deadline)."""
    pollers = [asyncio.create_task(poll(state, s, queue_name, interval_s)) for s in seen]
    shown: set[tuple[str, str, str, int]] = set()
    try:
        if once:
            deadline = time.monotonic() + POLL_DEADLINE_S * 3
            while any(not s.row and not s.error for s in seen) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            show(table(seen, expand=bool(queue_name)), new_alerts(seen, shown, idle_after_s))
            return
        while True:
            show(table(seen, expand=bool(queue_name)), new_alerts(seen, shown, idle_after_s))
            await asyncio.sleep(interval_s)
    finally:
        for p in pollers:
            p.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
