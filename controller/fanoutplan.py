"""What applying a plan does to each of its boxes, decided before anything starts (pure: the
caller gathers what the boxes say, `fanout up` acts on the answer).

A plan is applied by identity. A cell stays on the box the last applied plan gave it (its own `box`
may move it); only new cells are spread, over the boxes that will run. A finished cell never runs
again unless the user asks (`--rerun CELL`): a box's queue says which of its cells finished in its
run, and the plan's record keeps what was learnt (`finished`: cell -> box), so that a cell moved to
another box, or a box started again, does not run it a second time. A box torn down took its
cells' end with it: they count as finished. A box torn down is not started again unless the user
asks (`--restart-box NAME`): a one-time act, never a plan field, which would start the box again at
every later `fanout up` after each teardown. What is left alone or held back, and why, is said
before anything starts (`Settled.notes`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.cellsfile import QueuedCellSpec
from controller.errors import UsageError
from controller.plan import Plan, PlanBox, box_json

NEW, UP, RESTART, DOWN = "new", "up", "restart", "down"


@dataclass(frozen=True)
class Seen:
    """What the controller knows of the boxes before it acts."""

    status: Mapping[str, str]  # box -> its record's status (absent: no record)
    finished: Mapping[str, str] = field(
        default_factory=dict
    )  # cell -> box whose live queue holds it finished
    busy: Mapping[str, Collection[str]] = field(default_factory=dict)  # box -> cells its queue has to run
    silent: Mapping[str, str] = field(default_factory=dict)  # box (up) -> why its queue was not read


@dataclass
class BoxPlan:
    box: PlanBox
    action: str  # NEW, UP (left as it is), RESTART (--restart-box), DOWN (left torn down)
    cells: list[QueuedCellSpec]  # its cells by identity
    queue: list[QueuedCellSpec] = field(default_factory=list)  # what is queued on it now
    held: dict[str, str] = field(default_factory=dict)  # cell -> why it does not run now
    moving: set[str] = field(default_factory=set)  # cells still on another box's queue: not its own yet

    def recorded(self) -> dict[str, Any]:
        """Its entry in the plan's record once applied (a cell still on the way is not its own)."""
        return box_json(self.box, [c for c in self.cells if c.name not in self.moving])


@dataclass
class Settled:
    boxes: list[BoxPlan]
    finished: dict[str, str]  # cell -> box: every cell known to have finished (a rerun one too)
    notes: list[str]  # what is left alone or held back, and why: shown before anything starts


def previous_boxes(old: Mapping[str, Any] | None) -> dict[str, str]:
    """Cell -> box, as the plan was last applied."""
    out: dict[str, str] = {}
    for box, entry in ((old or {}).get("boxes") or {}).items():
        for c in entry.get("cells") or []:
            out.setdefault(str(c.get("name", "")), str(box))
    return out


def settle(
    plan: Plan,
    old: Mapping[str, Any] | None,
    seen: Seen,
    *,
    rerun: Collection[str] = (),
    restart: Collection[str] = (),
) -> Settled:
    """Each box's action and cells, the finished cells and the notes; a UsageError for an ask
    that cannot be met (nothing has started)."""
    names = [b.name for b in plan.boxes]
    cells = {c.name for c in plan.queue.cells}
    for c in rerun:
        if c not in cells:
            raise UsageError(f"--rerun {c}: no [[cell]] of plan {plan.name} has that name")
    actions: dict[str, str] = {}
    for b in names:
        status = seen.status.get(b)
        actions[b] = NEW if status is None else UP if status == "up" else RESTART if b in restart else DOWN
    for b in restart:
        if b not in actions:
            raise UsageError(f"--restart-box {b}: no [[box]] of plan {plan.name} has that name")
        if actions[b] != RESTART:
            raise UsageError(
                f"--restart-box {b}: {b} is {'up' if actions[b] == UP else 'new'}, not torn down"
            )
    before = previous_boxes(old)
    finished = {str(k): str(v) for k, v in ((old or {}).get("finished") or {}).items()}
    for c, b in before.items():
        if seen.status.get(b, "up") != "up":
            finished.setdefault(c, b)  # its box was torn down: the cell ended with it
    finished.update(seen.finished)
    assigned = plan.assignment(before, [b for b in names if actions[b] != DOWN])
    lost = plan.unplaced(assigned)
    if lost:
        raise UsageError(
            f"cells {', '.join(lost)} are new and every box of plan {plan.name} is torn down: "
            f"`fanout up --restart-box NAME` starts one again for them"
        )
    out = [BoxPlan(b, actions[b.name], assigned[b.name]) for b in plan.boxes]
    notes: list[str] = []
    for bp in out:
        for spec in bp.cells:
            why = _held(plan, bp, spec.name, before.get(spec.name, ""), finished, seen, spec.name in rerun)
            if why:
                bp.held[spec.name] = why
            else:
                bp.queue.append(spec)
        notes += _notes(plan, bp, rerun, finished)
    return Settled(out, finished, notes)


def _held(
    plan: Plan, bp: BoxPlan, cell: str, was: str, finished: Mapping[str, str], seen: Seen, rerun: bool
) -> str:
    """Why `cell` does not run on its box now ("": it is queued there)."""
    b = bp.box.name
    if bp.action == DOWN:
        if rerun:
            raise UsageError(f"--rerun {cell}: its box {b} is torn down; add --restart-box {b}")
        return f"box {b} is torn down"
    if seen.finished.get(cell) == b and bp.action == UP:
        if rerun:
            raise UsageError(
                f"--rerun {cell}: {cell} finished on {b}, which is up, and its sidecar never starts a "
                f"finished cell from a queue again: run it there by hand (`boxwarden run {b} --cell {cell} "
                "-- ...`), or give it another box in the plan"
            )
        return ""  # the box's own queue holds it finished and skips it: its list stays the same
    if was and was != b and (cell in seen.busy.get(was, ()) or was in seen.silent):
        bp.moving.add(cell)  # asked to run again or not: never while another queue may run it
        if was in seen.silent:
            return f"it was on {was}, whose queue cannot be read ({seen.silent[was]})"
        return (
            f"it is still to run in {was}'s queue {plan.name}: it moves once that queue ended or was "
            f"stopped (`boxwarden queue {was} {plan.name} --stop`)"
        )
    if rerun or cell not in finished:
        return ""
    return f"it finished on {finished[cell]}"


def _notes(plan: Plan, bp: BoxPlan, rerun: Collection[str], finished: Mapping[str, str]) -> list[str]:
    b = bp.box.name
    if bp.action == DOWN:
        ended = [c.name for c in bp.cells if finished.get(c.name) == b]
        waiting = [c.name for c in bp.cells if c.name not in ended]
        line = f"box {b}: torn down, not started again (`fanout up --restart-box {b}` starts it)"
        if ended:
            line += f"; its cells {', '.join(ended)} ended with it"
        if waiting:
            line += f"; cells {', '.join(waiting)} wait for it"
        return [line]
    out = []
    if bp.action == RESTART:
        if not bp.queue:
            raise UsageError(
                f"--restart-box {b}: nothing would run on it (its cells finished; `--rerun CELL` runs one "
                "again)"
            )
        out.append(
            f"box {b}: torn down, started again (--restart-box) for {', '.join(c.name for c in bp.queue)}"
        )
    for c in bp.cells:
        if c.name in bp.held:
            out.append(f"cell {c.name}: not run on {b}: {bp.held[c.name]}" + _hint(c.name, bp))
        elif c.name in rerun:
            out.append(f"cell {c.name}: runs again on {b} (--rerun)")
    return out


def _hint(cell: str, bp: BoxPlan) -> str:
    return "" if cell in bp.moving else f" (`--rerun {cell}` runs it again)"
