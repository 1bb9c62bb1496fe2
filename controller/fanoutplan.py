"""What applying a plan does to each of its boxes, decided before anything starts (pure: the
caller gathers what the boxes say, `fanout up` acts on the answer).

A plan is applied by identity. A cell stays on the box the last applied plan gave it (its own `box`
may move it); a cell the plan's record does not place (a plan copied under a new name) stays where
it finished, or where it is still to run; only new cells are spread, over the boxes that will run.
A finished cell never runs again unless the user asks (`--rerun CELL`), wherever it finished: what
each box finished, and in which run, is a fact of the box (controller.cellfacts), kept whatever the
plan's name and across a teardown, so that a cell moved to another box, a plan renamed, or a box
started again (a new run, whose sidecar knows nothing of the old one) runs nothing twice. Only a cell
its queue said done (checkpoints durable or on their way) finished; one that failed, was stopped or
never started did not, and the notes say which. A box torn down is not started again unless the
user asks (`--restart-box NAME`): a one-time act, never a plan field, which would start the box
again at every later `fanout up` after each teardown. What is left alone or held back, and why, is
said before anything starts (`Settled.notes`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.cellfacts import Fact
from controller.cellsfile import QueuedCellSpec
from controller.errors import UsageError
from controller.plan import Plan, PlanBox, box_json

NEW, UP, RESTART, DOWN = "new", "up", "restart", "down"


@dataclass(frozen=True)
class Seen:
    """What the controller knows of the boxes before it acts."""

    status: Mapping[str, str]  # box -> its record's status (absent: no record)
    runs: Mapping[str, str] = field(default_factory=dict)  # box -> its record's run id
    facts: Mapping[str, Sequence[Fact]] = field(default_factory=dict)  # cell -> what boxes' queues said
    busy: Mapping[str, Mapping[str, str]] = field(
        default_factory=dict
    )  # box (up) -> cell -> the queue that has it still to run
    active: Collection[str] = ()  # boxes (up) whose queue of the plan's name has not ended
    silent: Mapping[str, str] = field(default_factory=dict)  # box (up) -> why its queues were not read

    def finished(self, cell: str) -> list[Fact]:
        return [f for f in self.facts.get(cell, ()) if f.finished]

    def finished_in_run(self, cell: str, box: str) -> Fact | None:
        """`cell` finished on `box` in the box's current run (its queue skips it)."""
        run = self.runs.get(box, "")
        return next((f for f in self.finished(cell) if f.box == box and f.run_id == run and run), None)


@dataclass
class BoxPlan:
    box: PlanBox
    action: str  # NEW, UP (left as it is), RESTART (--restart-box), DOWN (left torn down)
    cells: list[QueuedCellSpec]  # its cells by identity
    queue: list[QueuedCellSpec] = field(default_factory=list)  # what its queue is asked to hold now
    held: dict[str, str] = field(default_factory=dict)  # cell -> why it does not run now
    moving: set[str] = field(default_factory=set)  # cells still on another box's queue: not its own yet

    @property
    def queued(self) -> list[str]:
        """The cells that run on it now (a cell that finished there may stay in its queue's list)."""
        return [c.name for c in self.queue if c.name not in self.held]

    def recorded(self) -> dict[str, Any]:
        """Its entry in the plan's record once applied (a cell still on the way is not its own)."""
        return box_json(self.box, [c for c in self.cells if c.name not in self.moving])


@dataclass
class Settled:
    boxes: list[BoxPlan]
    notes: list[str]  # what is left alone or held back, and why: shown before anything starts


def previous_boxes(old: Mapping[str, Any] | None) -> dict[str, str]:
    """Cell -> box, as the plan was last applied."""
    out: dict[str, str] = {}
    for box, entry in ((old or {}).get("boxes") or {}).items():
        for c in entry.get("cells") or []:
            out.setdefault(str(c.get("name", "")), str(box))
    return out


def _previous(plan: Plan, old: Mapping[str, Any] | None, seen: Seen) -> dict[str, str]:
    """Cell -> the box it stays on: as the plan was last applied, else (a plan with no record of
    it: renamed) where it finished last, else where it is still to run."""
    out = previous_boxes(old)
    boxes = {b.name for b in plan.boxes}
    for c in plan.queue.cells:
        if c.name in out:
            continue
        done = [f.box for f in seen.finished(c.name) if f.box in boxes]
        busy = [b for b in sorted(seen.busy) if c.name in seen.busy[b] and b in boxes]
        if done or busy:
            out[c.name] = (done or busy)[-1]
    return out


def settle(
    plan: Plan,
    old: Mapping[str, Any] | None,
    seen: Seen,
    *,
    rerun: Collection[str] = (),
    restart: Collection[str] = (),
) -> Settled:
    """Each box's action and cells, and the notes; a UsageError for an ask that cannot be met
    (nothing has started)."""
    names = [b.name for b in plan.boxes]
    cells = {c.name for c in plan.queue.cells}
    for c in rerun:
        if c not in cells:
            raise UsageError(f"--rerun {c}: no [[cell]] of plan {plan.name} has that name")
    actions: dict[str, str] = {}
    for b in names:
        status = seen.status.get(b)
        down = status == "down"  # (a teardown unfinished is no torn-down box: its meter may still run)
        actions[b] = (
            NEW if status is None else UP if status == "up" else RESTART if b in restart and down else DOWN
        )
    for b in restart:
        if b not in actions:
            raise UsageError(f"--restart-box {b}: no [[box]] of plan {plan.name} has that name")
        if seen.status.get(b) not in (None, "up", "down"):
            raise UsageError(
                f"--restart-box {b}: its teardown did not finish ({seen.status.get(b)}; its meter may still "
                f"run): `boxwarden down {b} --confirm {b}` continues it first"
            )
        if actions[b] != RESTART:
            raise UsageError(
                f"--restart-box {b}: {b} is {'up' if actions[b] == UP else 'new'}, not torn down"
            )
    before = _previous(plan, old, seen)
    assigned = plan.assignment(before, [b for b in names if actions[b] != DOWN])
    lost = plan.unplaced(assigned)
    if lost:
        raise UsageError(
            f"cells {', '.join(lost)} are new and every box of plan {plan.name} is torn down: "
            f"`fanout up --restart-box NAME` starts one again for them"
        )
    out = [BoxPlan(b, actions[b.name], assigned[b.name]) for b in plan.boxes]
    ran = _applied_specs(old)
    notes: list[str] = []
    for bp in out:
        kept_in_list = []  # finished there, left in its running queue's list so that the list stays the same
        for spec in bp.cells:
            why = _held(plan, bp, spec, before.get(spec.name, ""), seen, spec.name in rerun, ran)
            if why:
                bp.held[spec.name] = why
                if bp.box.name in seen.active and seen.finished_in_run(spec.name, bp.box.name):
                    kept_in_list.append(spec.name)
            if not why or spec.name in kept_in_list:
                bp.queue.append(spec)
        notes += _notes(plan, bp, rerun, seen)
    return Settled(out, notes)


def _applied_specs(old: Mapping[str, Any] | None) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(box, cell) -> the cell's argv, cwd and env as the plan was last applied there."""
    out: dict[tuple[str, str], tuple[Any, ...]] = {}
    for box, entry in ((old or {}).get("boxes") or {}).items():
        for c in entry.get("cells") or []:
            command = (list(c.get("argv", [])), c.get("cwd", ""), c.get("env", {}))
            out[(str(box), str(c.get("name", "")))] = command
    return out


def _held(
    plan: Plan,
    bp: BoxPlan,
    spec: QueuedCellSpec,
    was: str,
    seen: Seen,
    rerun: bool,
    ran: Mapping[tuple[str, str], tuple[Any, ...]],
) -> str:
    """Why `spec` does not run on its box now ("": it is queued there). `ran`: each cell's command
    as last applied to each box, for a cell whose finished run was listed without its own."""
    b, cell = bp.box.name, spec.name
    if bp.action == DOWN:
        if rerun:
            raise UsageError(f"--rerun {cell}: its box {b} is torn down; add --restart-box {b}")
        return f"box {b} is torn down"
    here = seen.busy.get(b, {}) if bp.action == UP else {}
    if here.get(cell) == plan.name:
        return ""  # its box's queue has it still to run: it stays there
    if cell in here:
        return (
            f"it is still to run in {b}'s queue {here[cell]}: it runs there (`boxwarden queue {b} "
            f"{here[cell]}` shows it)"
        )
    done = seen.finished_in_run(cell, b) if bp.action == UP else None
    if done is not None:
        if rerun:
            raise UsageError(
                f"--rerun {cell}: {cell} finished on {b} ({done.describe()}), which is up in that same run, "
                f"and a box's queue never starts a cell that finished there (the sidecar has no way to be "
                f"asked to: that needs a change of its protocol). Run it there by hand once its queue "
                f"ended (`boxwarden run {b} --cell {cell} -- CMD ...`), or give it another box in the plan "
                f'(`box = "..."` in its [[cell]]) and --rerun {cell}'
            )
        why = f"it finished on {b}: {done.describe()}"
        same = done.same_command(spec)
        if same is None and (b, cell) in ran:
            same = ran[(b, cell)] == (list(spec.argv), spec.cwd, dict(spec.env))
        if same is False:
            why += (
                "; the plan gives it another command (argv, cwd or env) now, and a box's queue never "
                "runs a cell that finished there again"
            )
        return why
    for other, left in sorted(seen.busy.items()):
        if other != b and cell in left:
            bp.moving.add(cell)  # asked to run again or not: never while another queue may run it
            return (
                f"it is still to run in {other}'s queue {left[cell]}: it moves once that queue ended or "
                f"was stopped (`boxwarden queue {other} {left[cell]} --stop`)"
            )
    if was and was != b and was in seen.silent:
        bp.moving.add(cell)
        return f"it was on {was}, whose queue cannot be read ({seen.silent[was]})"
    finished = seen.finished(cell)
    if rerun or not finished:
        return ""
    f = next((f for f in reversed(finished) if f.box == b), finished[-1])
    where = f"on {f.box}" + (f" in an earlier run ({f.run_id})" if f.box == b else "")
    return f"it finished {where}: {f.describe()}"


def _notes(plan: Plan, bp: BoxPlan, rerun: Collection[str], seen: Seen) -> list[str]:
    b = bp.box.name
    if bp.action == DOWN:
        ended = [c.name for c in bp.cells if seen.finished(c.name)]
        waiting = [c.name for c in bp.cells if c.name not in ended]
        line = f"box {b}: torn down, not started again (`fanout up --restart-box {b}` starts it)"
        status = seen.status.get(b)
        if status != "down":
            line = (
                f"box {b}: its teardown did not finish ({status}; its meter may still run), not started: "
                f"`boxwarden down {b} --confirm {b}` continues it"
            )
        if ended:
            line += f"; its cells {', '.join(ended)} finished"
        if waiting:
            how = "; ".join(f"{c}: {_last_here(seen, c, b)}" for c in waiting)
            line += f"; cells {', '.join(waiting)} did not finish and wait for it ({how})"
        return [line]
    out = []
    if bp.action == RESTART:
        if not bp.queued:
            raise UsageError(
                f"--restart-box {b}: nothing would run on it (its cells finished; `--rerun CELL` runs one "
                "again)"
            )
        out.append(f"box {b}: torn down, started again (--restart-box) for {', '.join(bp.queued)}")
    for c in bp.cells:
        if c.name in bp.held:
            out.append(f"cell {c.name}: not run on {b}: {bp.held[c.name]}" + _hint(c.name, bp, seen))
        elif c.name in rerun:
            out.append(f"cell {c.name}: runs again on {b} (--rerun)")
        else:
            facts = seen.facts.get(c.name, ())
            elsewhere = [x for x in facts if x.box != b and not x.finished and not x.active]
            if elsewhere:
                last = elsewhere[-1]
                out.append(f"cell {c.name}: runs on {b}; it did not finish on {last.box}: {last.describe()}")
    return out


def _last_here(seen: Seen, cell: str, box: str) -> str:
    """How `cell` last stood on `box`, as its queue said it."""
    here = [f for f in seen.facts.get(cell, ()) if f.box == box]
    return here[-1].describe() if here else "never seen in its queue here"


def _hint(cell: str, bp: BoxPlan, seen: Seen) -> str:
    if cell in bp.moving or bp.held[cell].startswith("it is still to run"):
        return ""
    if bp.action == UP and seen.finished_in_run(cell, bp.box.name):
        return (
            f" (to run it again: `boxwarden run {bp.box.name} --cell {cell} -- CMD ...` by hand, or give it "
            f"another box and --rerun {cell})"
        )
    return f" (`--rerun {cell}` runs it again)"
