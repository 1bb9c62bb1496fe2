"""`fanout up`: bring every box of a plan up at once and queue each box's cells on it.

Idempotent: a box already up is left as it is (`up` again), a queue already running with the same
cells is left alone, and a queue that ended runs only its cells that did not finish (the sidecar
never runs a finished cell twice). The plan as last applied is kept in the controller's state
(`plans/<name>.json`); a plan that differs from it is shown as a difference and applied only once
the caller confirms. A box whose queue runs with other cells keeps running it: the change reaches
that box once its queue ended or was stopped (`queue NAME Q --stop`), and the outcome says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller import boxes, queues
from controller.cellsfile import CellsFile
from controller.errors import ControllerError, UsageError
from controller.plan import Plan, PlanBox, plan_json
from controller.state import State, exclusive


@dataclass
class BoxOutcome:
    box: str
    up: str = ""  # "started", "running" (left alone), or "" when up failed
    queue: str = ""  # "queued", "unchanged", "none" (no cells), or "" when not queued
    cells: list[str] = field(default_factory=list)
    error: str = ""

    def to_json(self) -> dict[str, object]:
        return {"box": self.box, "up": self.up, "queue": self.queue, "cells": self.cells, "error": self.error}


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


async def up(
    state: State,
    plan: Plan,
    plan_dir: Path,
    *,
    confirm: Callable[[list[str]], bool],
) -> list[BoxOutcome]:
    """Apply `plan`: every box up at once, then each box's cells queued on it. `confirm(lines)`
    is asked (with the difference) when the plan differs from the one last applied."""
    _check_local_dirs(plan, plan_dir)
    doc = plan_json(plan)
    path = recorded_path(state, plan.name)
    try:
        old = json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        old = None  # unreadable: treated as a first run, which only adds
    changes = difference(old, doc)
    if changes and not confirm(changes):
        raise UsageError(f"plan {plan.name} not applied: nothing was changed")
    assigned = plan.assignment()
    with contextlib.ExitStack() as locks:
        for b in sorted(plan.boxes, key=lambda b: b.name):  # one order: two fan-outs never deadlock
            busy = f"a `down {b.name}` or `up {b.name}` is running (pid {{pid}}); wait for it to end"
            locks.enter_context(exclusive(state.box_lock(b.name), busy))
        outcomes = await asyncio.gather(
            *(_one(state, plan, plan_dir, b, assigned[b.name]) for b in plan.boxes)
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return list(outcomes)


async def _one(state: State, plan: Plan, plan_dir: Path, b: PlanBox, cells: list[Any]) -> BoxOutcome:
    out = BoxOutcome(b.name, cells=[c.name for c in cells])
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
        )
        out.up = "started" if result.result.started else "running"
    except ControllerError as e:
        out.error = f"up: {e}"
        return out
    if not cells:
        out.queue = "none"
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
