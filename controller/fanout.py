"""`fanout up`: bring every box of a plan up at once and queue each box's cells on it.

Idempotent: a box already up is left as it is (`up` again), a queue already running with the same
cells is left alone, and a queue that ended is asked to run only its cells that did not finish. What
each box gets is decided by identity before anything starts (controller.fanoutplan): cells stay on
their boxes, a finished cell never runs again unasked wherever and in whichever run it finished, a
box torn down is left down unless `--restart-box NAME`. Every box the plan (or its last record, or
what is known of its cells) names is asked for all its queues, whatever their names: what they say
is kept as facts of each box's run (controller.cellfacts). The plan as last applied is kept in the
controller's state (`plans/<name>.json`), per box and only where it was applied: a box whose apply
failed, or that was left down, keeps its old entry, so the next `fanout up` shows its difference
again. A plan that differs from it is shown as a difference and applied only once the caller
confirms. A box whose queue runs with other cells keeps running it: the change reaches that box
once its queue ended or was stopped (`queue NAME Q --stop`), and the outcome says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import armed, boxes, cellfacts, queues
from controller.cellsfile import CellsFile
from controller.errors import ControllerError, UsageError
from controller.fanoutplan import DOWN, BoxPlan, Seen, Settled, settle
from controller.plan import Plan, PlanBox, plan_json
from controller.state import State, exclusive

LOOK_S = 15.0  # how long a box's queue is waited for before the plan is settled


@dataclass
class BoxOutcome:
    box: str
    up: str = ""  # "started", "running" (left alone), "down" (torn down, left so; a teardown left
    # unfinished: its status, e.g. "tearing-down"), or "" when up failed
    queue: str = ""  # "queued", "unchanged", "none" (nothing to queue), or "" when not queued
    cells: list[str] = field(default_factory=list)  # its cells by identity
    queued: list[str] = field(default_factory=list)  # those queued on it now
    held: dict[str, str] = field(default_factory=dict)  # cell -> why it does not run now
    error: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "box": self.box,
            "up": self.up,
            "queue": self.queue,
            "cells": self.cells,
            "queued": self.queued,
            "held": self.held,
            "error": self.error,
        }


def recorded_path(state: State, name: str) -> Path:
    return state.home / "plans" / f"{name}.json"


def difference(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """What applying `new` changes against the plan last applied (`old`), one line per change."""
    if old is None:
        return []
    lines: list[str] = []
    for key in ("durable", "roster", "restart"):
        if old.get(key) != new.get(key):
            lines.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    was, now = old.get("boxes", {}), new.get("boxes", {})
    for name in sorted(set(was) - set(now)):
        lines.append(f"box {name}: removed from the plan (it stays up; `down {name}` tears it down)")
    for name in sorted(set(now) - set(was)):
        lines.append(f"box {name}: new")
    for name in sorted(set(now) & set(was)):
        a, b = was[name], now[name]
        for key in sorted(set(a) | set(b)):
            if key != "cells" and a.get(key) != b.get(key):
                lines.append(f"box {name}: {key} {a.get(key)!r} -> {b.get(key)!r}")
        cells_a = {c["name"]: c for c in a.get("cells", [])}
        cells_b = {c["name"]: c for c in b.get("cells", [])}
        for c in sorted(set(cells_b) - set(cells_a)):
            lines.append(f"box {name}: cell {c} added")
        for c in sorted(set(cells_a) - set(cells_b)):
            lines.append(f"box {name}: cell {c} no longer here")
        for c in sorted(set(cells_a) & set(cells_b)):
            if cells_a[c] != cells_b[c]:
                lines.append(f"box {name}: cell {c} changed (command, cwd or env)")
    return lines


def _workdir(plan_dir: Path, b: PlanBox) -> str:
    """A local box's own workdir by default (<plan dir>/<box>): two boxes watching one directory
    would claim each other's files. A remote box's default is its home."""
    if b.workdir or b.host:
        return b.workdir or "."
    return str(plan_dir / b.name)


def _check_local_dirs(plan: Plan, plan_dir: Path) -> None:
    """No two local boxes watch the same directory (or one inside another)."""
    seen: list[tuple[Path, str]] = []
    for b in plan.boxes:
        if b.host:
            continue
        work = Path(_workdir(plan_dir, b))
        for w in b.watch:
            d = (work / w).resolve()
            for other, name in seen:
                if d == other or d.is_relative_to(other) or other.is_relative_to(d):
                    raise UsageError(
                        f"boxes {name} and {b.name} both watch {d if d == other else f'{d} and {other}'} on "
                        "this machine: they would claim each other's files; give each its own workdir"
                    )
            seen.append((d, b.name))


async def look(state: State, plan: Plan, old: dict[str, Any] | None) -> Seen:
    """What the boxes say now: each record's status and run, and for each box up, all its queues
    (kept as facts of its run); then everything known of the plan's cells, on any box and run. The
    boxes asked: the plan's, those of the plan last applied, and those known to have run its cells."""
    cells = [c.name for c in plan.queue.cells]
    known = cellfacts.facts(state, cells)
    names = sorted(
        {b.name for b in plan.boxes}
        | set((old or {}).get("boxes") or {})
        | {f.box for seen in known.values() for f in seen}
    )
    status: dict[str, str] = {}
    runs: dict[str, str] = {}
    busy: dict[str, dict[str, str]] = {}
    active: set[str] = set()
    silent: dict[str, str] = {}

    async def one(name: str) -> None:
        box = state.find(name)
        if box is None:
            return
        status[name], runs[name] = box.status, box.run_id
        if box.status != "up":
            return
        try:
            found = await asyncio.wait_for(queues.list_queues(box, brief=True), LOOK_S)
        except (ControllerError, TimeoutError) as e:
            silent[name] = str(e) or "no answer"
            return
        cellfacts.learn(state, box, found)
        for q in found:
            if q.name == plan.name and not q.ended_at_unix_ns:
                active.add(name)
            for c in q.cells:
                if c.state in (pb.CELL_PENDING, pb.CELL_RUNNING) and not q.stopped:
                    busy.setdefault(name, {})[c.spec.cell] = q.name

    await asyncio.gather(*(one(n) for n in names))
    return Seen(status, runs, cellfacts.facts(state, cells), busy, active, silent)


def read_recorded(state: State, name: str) -> dict[str, Any] | None:
    path = recorded_path(state, name)
    try:
        return dict(json.loads(path.read_text())) if path.exists() else None
    except (OSError, ValueError):
        return None  # unreadable: treated as a first run, which only adds


async def up(
    state: State,
    plan: Plan,
    plan_dir: Path,
    *,
    confirm: Callable[[list[str]], bool],
    notify: Callable[[list[str]], None] = lambda lines: None,
    rerun: Collection[str] = (),
    restart: Collection[str] = (),
) -> list[BoxOutcome]:
    """Apply `plan`: every box up at once, then each box's cells queued on it. `notify(lines)` is
    told what is left alone or held back, before anything starts; `confirm(lines)` is asked (with
    the difference) when the plan differs from the one last applied. `rerun`: cells to run again
    though they finished; `restart`: torn-down boxes to start again."""
    _check_local_dirs(plan, plan_dir)
    old = read_recorded(state, plan.name)
    seen = await look(state, plan, old)
    settled = settle(plan, old, seen, rerun=rerun, restart=restart)
    assigned = {bp.box.name: bp.cells for bp in settled.boxes}
    doc = plan_json(plan, assigned)
    if settled.notes:
        notify(settled.notes)
    changes = difference(old, doc)
    if changes and not confirm(changes):
        raise UsageError(f"plan {plan.name} not applied: nothing was changed")
    acting = [bp for bp in settled.boxes if bp.action != DOWN]
    with contextlib.ExitStack() as locks:
        for bp in sorted(acting, key=lambda bp: bp.box.name):  # one order: two fan-outs never deadlock
            name = bp.box.name
            busy = f"a `down {name}` or `up {name}` is running (pid {{pid}}); wait for it to end"
            locks.enter_context(exclusive(state.box_lock(name), armed.blocking(state, name, busy)))
        outcomes = await asyncio.gather(
            *(_one(state, plan, plan_dir, bp, seen.status.get(bp.box.name)) for bp in acting)
        )
    done = {o.box: o for o in outcomes}
    _record(state, plan, old, doc, settled, done)
    left = [
        BoxOutcome(
            bp.box.name,
            up=seen.status.get(bp.box.name) or "down",  # "tearing-down" and the like say so
            queue="none",
            cells=[c.name for c in bp.cells],
            held=bp.held,
        )
        for bp in settled.boxes
        if bp.action == DOWN
    ]
    order = [b.name for b in plan.boxes]
    return sorted([*outcomes, *left], key=lambda o: order.index(o.box))


def _record(
    state: State,
    plan: Plan,
    old: dict[str, Any] | None,
    doc: dict[str, Any],
    settled: Settled,
    done: dict[str, BoxOutcome],
) -> None:
    """Keep the plan as applied, box by box: a box whose apply failed, or that was left down, keeps
    its old entry (none if it had none); the plan-wide fields are the new ones only once every box
    acted on (`done`) took them. (What finished where is kept apart, as facts of the boxes.)"""
    applied = {name for name, o in done.items() if not o.error}
    was = (old or {}).get("boxes") or {}
    record: dict[str, Any] = dict(doc) if old is None or applied == set(done) else dict(old)
    record["name"] = plan.name
    record["boxes"] = {}
    record.pop("finished", None)  # kept here by an older version: facts of the boxes now
    for bp in settled.boxes:
        name = bp.box.name
        if name in applied:
            record["boxes"][name] = bp.recorded()
        elif name in was:
            record["boxes"][name] = was[name]
    path = recorded_path(state, plan.name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, path)


async def _one(state: State, plan: Plan, plan_dir: Path, bp: BoxPlan, status: str | None) -> BoxOutcome:
    b, cells = bp.box, bp.queue
    out = BoxOutcome(b.name, cells=[c.name for c in bp.cells], queued=bp.queued, held=bp.held)
    now = state.find(b.name)
    if (now.status if now is not None else None) != status:  # a `down` or `up` since the look
        was, is_ = status or "not known here", now.status if now is not None else "not known here"
        out.error = f"it was {was} when the plan was settled and is {is_} now: run `fanout up` again"
        return out
    roster = tuple(c.name for c in cells if c.name in plan.roster)
    try:
        if not b.host:
            Path(_workdir(plan_dir, b)).mkdir(parents=True, exist_ok=True)
        result = await boxes.up(
            state,
            b.name,
            profile=b.profile or None,
            profile_file=Path(b.profile_file) if b.profile_file else None,
            instance_id=b.instance_id or None,
            workdir=_workdir(plan_dir, b),
            watch=b.watch,
            durable=plan.durable,
            run_id=None,
            roster=roster,
            host=b.host or None,
            ssh_options=b.ssh_options,
            ssh_config=os.environ.get("BOXWARDEN_SSH_CONFIG", ""),
            price_per_hour=b.price_per_hour,
            profile_digest=b.profile_digest or None,
        )
        out.up = "started" if result.result.started else "running"
    except ControllerError as e:
        out.error = f"up: {e}"
        return out
    if not cells:
        out.queue = "none"  # nothing to run (a finished cell is never asked of a queue that ended)
        return out
    q = plan.queue
    policy = boxes.RestartPolicy(q.restart or "never", q.max_restarts or 3, q.restart_backoff or 10.0)
    try:
        resp = await queues.start_queue(
            state.get(b.name),
            CellsFile(plan.name, tuple(cells), q.restart, q.max_restarts, q.restart_backoff),
            policy,
        )
        out.queue = "queued" if resp.started else "unchanged"
    except ControllerError as e:  # a refusal too (SidecarRefused): say it, the other boxes go on
        out.error = f"queue: {e}"
    return out
