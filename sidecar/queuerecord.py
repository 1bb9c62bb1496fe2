"""A cell queue as it is recorded and judged: its entries and their states, the evidence a cell
holds on the box, and the pure judgements (a finished job's outcome, a cell's durability, a queue's
result). `sidecar.cellqueue` runs queues with these; nothing here acts or blocks.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.compat import SLOTS
from sidecar.jobrecord import JobRecord
from sidecar.ledger import ClaimRow

CELL_TOKEN = "{cell}"  # noqa: S105 - a placeholder, not a secret

# Entry states, as stored.
PENDING, STARTING, RUNNING = "pending", "starting", "running"
DONE, FAILED, SKIPPED, CANCELLED = "done", "failed", "skipped", "cancelled"
FINAL = (DONE, FAILED, SKIPPED, CANCELLED)
STATE_PB = {
    PENDING: pb.CELL_PENDING,
    STARTING: pb.CELL_RUNNING,
    RUNNING: pb.CELL_RUNNING,
    DONE: pb.CELL_DONE,
    FAILED: pb.CELL_FAILED,
    SKIPPED: pb.CELL_SKIPPED,
    CANCELLED: pb.CELL_CANCELLED,
}


@dataclass(**SLOTS)
class Entry:
    """One cell of a queue and how it went in the current pass."""

    cell: str
    argv: list[str]
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    state: str = PENDING
    job_id: str = ""
    exit_code: int | None = None
    detail: str = ""
    ended_at_ns: int = 0

    def spec(self) -> tuple[str, tuple[str, ...], str, tuple[tuple[str, str], ...]]:
        return (self.cell, tuple(self.argv), self.cwd, tuple(sorted(self.env.items())))


@dataclass(**SLOTS)
class QueueRecord:
    name: str
    entries: list[Entry]
    restart: str = "never"
    max_restarts: int = 0
    backoff_s: float = 0.0
    created_at_ns: int = 0
    passes: int = 1
    stopped: bool = False
    ended_at_ns: int = 0  # 0 while a pass runs

    @property
    def active(self) -> bool:
        return not self.ended_at_ns

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> QueueRecord:
        known = {f.name for f in dataclasses.fields(Entry)}
        entries = [Entry(**{k: v for k, v in e.items() if k in known}) for e in doc.get("entries", [])]
        fields = {f.name for f in dataclasses.fields(cls)} - {"entries"}
        return cls(entries=entries, **{k: v for k, v in doc.items() if k in fields})


class QueueStore(Protocol):
    """Durable home of queue records (the ledger implements it)."""

    def save_queue(self, name: str, record: dict[str, Any]) -> None: ...

    def load_queues(self) -> list[dict[str, Any]]: ...

    def delete_queue(self, name: str) -> None: ...


@dataclass(frozen=True, **SLOTS)
class CellEvidence:
    """What the box holds of one cell now: claims under its directories, how many are durable, and
    entries there waiting to be sealed."""

    claims: int
    durable: int
    unsealed: int


def evidence_of(
    cells: Collection[str], owner: Mapping[str, str], claims: Iterable[ClaimRow], waiting: Iterable[str]
) -> dict[str, CellEvidence]:
    """Each cell's evidence, in one pass over the current claims and the artifacts waiting to be
    sealed. `owner`: the artifact path prefix of each cell's directory ("cell/", or "watch/cell/"
    with several watched dirs) -> the cell."""
    depths = sorted({p.count("/") for p in owner})
    counts = {cell: [0, 0, 0] for cell in cells}

    def cell_of(path: str) -> str | None:
        parts = path.split("/")
        for n in depths:
            found = owner.get("/".join(parts[:n]) + "/") if len(parts) > n else None
            if found is not None:
                return found
        return None

    for c in claims:
        held = cell_of(c.path)
        if held is not None:
            counts[held][0] += 1
            counts[held][1] += c.durable
    for art in waiting:
        found = cell_of(art)
        if found is not None:
            counts[found][2] += 1
    return {cell: CellEvidence(*n) for cell, n in counts.items()}


def durability(
    ev: CellEvidence, ended_at_ns: int, now_ns: int, settle_s: float
) -> pb.CellDurability.ValueType:
    """A finished cell's CellDurability. Nothing claimed counts as NO_CHECKPOINT only once its job
    has been over for `settle_s` (its last save may still be on its way to a claim)."""
    if ev.claims and ev.durable == ev.claims and not ev.unsealed:
        return pb.CELL_DURABLE
    if not ev.claims and not ev.unsealed and now_ns - ended_at_ns >= settle_s * 1e9:
        return pb.CELL_NO_CHECKPOINT
    return pb.CELL_PUSHING


def result(states: Sequence[str], durabilities: Sequence[int]) -> pb.QueueResult.ValueType:
    """The QueueResult of a queue whose entries are in `states`, its finished cells' (DONE and
    SKIPPED, in order) durabilities in `durabilities`."""
    if any(s not in FINAL for s in states):
        return pb.QUEUE_RUNNING
    if any(s in (FAILED, CANCELLED) for s in states) or pb.CELL_NO_CHECKPOINT in durabilities:
        return pb.QUEUE_FAILED
    if any(d != pb.CELL_DURABLE for d in durabilities):
        return pb.QUEUE_PUSHING
    return pb.QUEUE_OK


def outcome(job: JobRecord) -> tuple[str, str]:
    """(DONE or FAILED, why) from a job that is over: its exit status and state only."""
    if job.state == "exited" and job.exit_code == 0:
        return DONE, ""
    if job.state == "stopped":
        return FAILED, "stopped"
    if job.state == "lost" or job.exit_code is None:
        return FAILED, "lost: its exit status is unknown (the sidecar was not its parent when it ended)"
    if job.exit_code < 0:
        try:
            sig = signal.Signals(-job.exit_code).name
        except ValueError:
            sig = f"signal {-job.exit_code}"
        return FAILED, f"killed by {sig}"
    return FAILED, f"exit {job.exit_code}"


def fill(text: str, cell: str) -> str:
    return text.replace(CELL_TOKEN, cell)


def difference(old: QueueRecord, new: list[Entry]) -> str:
    was = {e.cell: e.spec() for e in old.entries}
    now = {e.cell: e.spec() for e in new}
    parts = []
    if sorted(was) != sorted(now) or list(was) != list(now):
        parts.append(f"cells now {', '.join(now)}; running {', '.join(was)}")
    changed = [c for c in now if c in was and was[c] != now[c]]
    if changed:
        parts.append(f"changed: {', '.join(changed)}")
    return "; ".join(parts) or "its restart options differ"
