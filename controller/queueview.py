"""How a cell queue reads in the terminal: one table per queue, and while waiting one line per cell
that changed (so that the story survives in scrollback). Text from the box is escaped (render.esc)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import cellfacts, queues, render
from controller.state import Box, State

_RESULT_STYLE = {"ok": "green", "failed": "bold red", "running": "cyan", "pushing": "yellow"}
_STATE_STYLE = {
    "done": "green",
    "skipped": "green",
    "failed": "bold red",
    "cancelled": "red",
    "running": "cyan",
}


def headline(box: str, q: pb.Queue) -> str:
    result = queues.result_name(q)
    counts: dict[str, int] = {}
    for c in q.cells:
        counts[queues.cell_state(c)] = counts.get(queues.cell_state(c), 0) + 1
    parts = ", ".join(f"{n} {s}" for s, n in counts.items())
    extra = " (stopped)" if q.stopped else ""
    return (
        f"queue [bold]{render.esc(q.name)}[/] on {render.esc(box)}: "
        f"[{_RESULT_STYLE.get(result, 'white')}]{result}[/]{extra} — {len(q.cells)} cells: {parts}"
        + (f"; pass {q.passes}" if q.passes > 1 else "")
    )


def checkpoints(c: pb.QueuedCell) -> str:
    kind = queues.durability_name(c)
    if not kind:
        return ""
    if kind == "no_checkpoint":
        return "none claimed"
    if not c.claims:
        return "none yet"
    return f"{c.durable_claims}/{c.claims} {'durable' if kind == 'durable' else 'pushing'}"


def table(box: str, q: pb.Queue) -> None:
    from rich.table import Table

    render.info(headline(box, q))
    t = Table(box=None, show_edge=False, pad_edge=False)
    for title in ("cell", "state", "job", "exit", "checkpoints", "detail"):
        t.add_column(title, overflow="fold")
    for c in q.cells:
        state = queues.cell_state(c)
        ran = c.state in (pb.CELL_DONE, pb.CELL_FAILED) and c.job_id
        t.add_row(
            render.esc(c.spec.cell),
            f"[{_STATE_STYLE.get(state, 'white')}]{state}[/]",
            render.esc(c.job_id),
            str(c.exit_code) if ran else "",
            checkpoints(c),
            render.esc(c.detail),
        )
    render.table_out(t)


def listing(box: str, qs: Sequence[pb.Queue]) -> None:
    if not qs:
        render.info(f"box {render.esc(box)} has no queues")
    for q in qs:
        render.info(headline(box, q))


def progress(box: str) -> Callable[[pb.Queue], None]:
    """A callback for queues.wait_queue: the queue's line at first, then a line per cell whose
    state or checkpoints changed."""
    seen: dict[str, tuple[str, str]] = {}

    def show(q: pb.Queue) -> None:
        now = time.strftime("%H:%M:%S")
        first = not seen
        for c in q.cells:
            key = (queues.cell_state(c), checkpoints(c))
            if seen.get(c.spec.cell) == key:
                continue
            seen[c.spec.cell] = key
            if first and key[0] == "pending":
                continue
            detail = f" ({render.esc(c.detail)})" if c.detail and key[0] in ("failed", "cancelled") else ""
            ckpt = f"; checkpoints {key[1]}" if key[1] else ""
            render.info(
                f"[{now}] {render.esc(q.name)}: cell {render.esc(c.spec.cell)} {key[0]}{detail}{ckpt}"
            )

    return show


def follow(box: Box, name: str, timeout_s: float, *, quiet: bool, state: State | None = None) -> pb.Queue:
    """Follow queue `name` to its end (queues.wait_queue), printing each change unless `quiet`;
    each state seen is kept as facts of the box's run (controller.cellfacts) when `state` is given."""
    show = (lambda _: None) if quiet else progress(box.name)

    def on_change(q: pb.Queue) -> None:
        if state is not None:
            cellfacts.learn(state, box, [q])
        show(q)

    return asyncio.run(
        queues.wait_queue(
            box,
            name,
            timeout_s,
            on_change=on_change,
            on_unreachable=lambda why: render.warn(f"{why}; still waiting"),
        )
    )
