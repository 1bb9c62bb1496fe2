"""What this controller learnt of each box's cells from the box's own queues: which cell finished in
which run of which box, and how the others ended. A box's finished cells are facts of the box, not
of a plan or a queue name: a plan copied under another name, a box torn down and brought up again
(a new run, whose sidecar knows nothing of the old one), a cell moved to another box, all find them
here.

Every listing of a box's queues a command receives (`fanout up`, `queue`, `run --queue --wait`,
`watch`, `down --when-safe`) is kept, per box, run and cell, in the controller state. A cell counts
as finished only where a queue said so: done (or skipped: done before) with checkpoints durable or
on their way. One that failed, was stopped or cancelled, left no checkpoint, or never started did
not finish, and says which. Once seen finished in a run, a cell stays finished in that run: its job
exited 0 and left its checkpoints, and a later pass that skips or cancels it undoes neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import queues
from controller.cellsfile import QueuedCellSpec
from controller.state import Box, State

_ENDED, _ACTIVE, _FINISHED = 1, 2, 3  # which of two listings of a cell says more


@dataclass(frozen=True)
class Fact:
    """What a queue of box `box`'s run `run_id` last said of `cell`."""

    box: str
    run_id: str
    cell: str
    state: str  # pending, running, done, failed, skipped, cancelled
    durability: str = ""  # of a done or skipped cell: durable, pushing, no_checkpoint
    claims: int = -1  # the claims under its directories when listed (-1: a listing that did not say)
    exit_code: int | None = None
    detail: str = ""
    job_id: str = ""
    queue: str = ""
    stopped: bool = False  # its queue was stopped
    spec: Mapping[str, Any] | None = None  # argv, cwd, env as the box's queue holds them (None: not listed)
    seen_at_ns: int = 0

    @property
    def finished(self) -> bool:
        return _rank(self.state, self.durability, self.stopped, self.claims) == _FINISHED

    @property
    def active(self) -> bool:
        """Still to run (or running) in a queue that was not stopped."""
        return _rank(self.state, self.durability, self.stopped, self.claims) == _ACTIVE

    def same_command(self, spec: QueuedCellSpec) -> bool | None:
        """Whether `spec` is the command this cell ran with (None: not known)."""
        if self.spec is None:
            return None
        return (list(spec.argv), spec.cwd, dict(spec.env)) == (
            list(self.spec.get("argv", [])),
            str(self.spec.get("cwd", "")),
            dict(self.spec.get("env", {})),
        )

    def describe(self) -> str:
        """How the cell stood, in a few words: "done (job j-3), checkpoints durable", "failed:
        stopped (job j-4)", "never started: the queue was stopped before it started"."""
        job = f" (job {self.job_id})" if self.job_id else ""
        why = f": {self.detail}" if self.detail else ""
        if self.state in ("done", "skipped"):
            if self.durability == "no_checkpoint":
                return f"exited 0{job} but left no checkpoint"
            if self.durability == "pushing":
                if self.claims == 0:
                    return f"done{job}, nothing claimed yet when last seen (settling)"
                return f"done{job}, its checkpoints still on their way when last seen"
            return f"done{job}, its checkpoints durable"
        if self.state == "cancelled":
            return f"never started{why}"
        if self.state == "pending":
            return f"never started (queue {self.queue} was stopped)" if self.stopped else "still to run"
        if self.state == "running":
            return f"running{job}" + (" (its queue was stopped)" if self.stopped else "")
        return f"{self.state}{why}{job}"


def _rank(state: str, durability: str, stopped: bool, claims: int) -> int:
    """Which of two listings says more of a cell. Done with its checkpoints on their way counts as
    finished only once something was claimed: a cell whose job just ended with nothing claimed yet
    is still settling (its queue says NO_CHECKPOINT a few seconds later when nothing comes)."""
    if state in ("done", "skipped") and durability == "pushing" and claims == 0:
        return _ACTIVE
    if state in ("done", "skipped") and durability in ("durable", "pushing"):
        return _FINISHED
    if state in ("pending", "running") and not stopped:
        return _ACTIVE
    return _ENDED


def _record(q: pb.Queue, c: pb.QueuedCell) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "state": queues.cell_state(c),
        "durability": queues.durability_name(c),
        "claims": c.claims,
        "exit_code": c.exit_code if c.state in (pb.CELL_DONE, pb.CELL_FAILED) and c.job_id else None,
        "detail": c.detail,
        "job_id": c.job_id,
        "queue": q.name,
        "stopped": q.stopped,
        "spec": None,
    }
    if c.spec.argv:  # listed with its command (not `brief`)
        doc["spec"] = {"argv": list(c.spec.argv), "cwd": c.spec.cwd, "env": dict(c.spec.env)}
    return doc


def _order(doc: Mapping[str, Any]) -> int:
    return _rank(str(doc["state"]), str(doc["durability"]), bool(doc["stopped"]), int(doc.get("claims", -1)))


def _merge(kept: Mapping[str, Any] | None, new: Mapping[str, Any]) -> Mapping[str, Any]:
    """A cell seen finished in a run stays finished there; else the newest listing says it."""
    if kept is not None and _order(kept) == _FINISHED and _order(new) != _FINISHED:
        return kept
    if new.get("spec") is None and kept is not None and kept.get("job_id") == new.get("job_id"):
        return {**new, "spec": kept.get("spec")}  # a brief listing of the same run of the cell
    return new


def learn(state: State, box: Box, found: Iterable[pb.Queue]) -> None:
    """Keep what the box's queues (`found`, as the box listed them: newest first) say of each cell,
    as facts of the box's current run; an entry whose job is known from an earlier run of the box
    (a sidecar that kept its ledger across a teardown lists its old queues) stays a fact of that one."""
    best: dict[str, dict[str, Any]] = {}
    for q in found:
        for c in q.cells:
            doc = _record(q, c)
            was = best.get(c.spec.cell)
            if was is None or _order(doc) > _order(was):  # the newest queue wins a tie
                best[c.spec.cell] = doc
    if not best or not box.run_id:
        return
    earlier = {
        (f.cell, f.job_id): f.run_id
        for seen in facts(state, list(best)).values()
        for f in seen
        if f.box == box.name and f.job_id and f.run_id != box.run_id
    }
    by_run: dict[str, dict[str, dict[str, Any]]] = {}
    for cell, doc in best.items():
        run = earlier.get((cell, doc["job_id"]), box.run_id) if doc["job_id"] else box.run_id
        by_run.setdefault(run, {})[cell] = doc
    for run, docs in by_run.items():
        state.merge_cells(box.name, run, docs, _merge)


def facts(state: State, cells: Sequence[str]) -> dict[str, list[Fact]]:
    """Cell -> what is known of it on every box and run, oldest first."""
    out: dict[str, list[Fact]] = {}
    for box, run_id, cell, at_ns, doc in state.cells(cells):
        out.setdefault(cell, []).append(
            Fact(
                box=box,
                run_id=run_id,
                cell=cell,
                state=str(doc.get("state", "")),
                durability=str(doc.get("durability", "")),
                claims=int(doc.get("claims", -1)),
                exit_code=doc.get("exit_code"),
                detail=str(doc.get("detail", "")),
                job_id=str(doc.get("job_id", "")),
                queue=str(doc.get("queue", "")),
                stopped=bool(doc.get("stopped", False)),
                spec=doc.get("spec"),
                seen_at_ns=at_ns,
            )
        )
    for seen in out.values():
        seen.sort(key=lambda f: f.seen_at_ns)
    return out
