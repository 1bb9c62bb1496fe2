"""Cell queues: roster cells that run one after another on this box, each as a supervised job.

Owns the queue records (kept in the ledger) and the choice of what runs next. A queue is an ordered
list of cells (program, working directory, environment); a pass over it starts each cell in turn,
once the one before is over for good (restarts included). The outcome of a cell is its job's exit
status and process state, never its log: exited 0 is DONE, anything else (a nonzero status, a
signal, stopped, lost) is FAILED. A DONE cell is judged further by its evidence: every claim under
<watch>/<cell>/ durable (CELL_DURABLE), some still on the way (CELL_PUSHING), or nothing ever
claimed there (CELL_NO_CHECKPOINT: a queue whose cells leave no checkpoint did not succeed).

No cell runs twice:
- a cell that finished on this box (a job of that cell exited 0, started by this queue, another one
  or by hand) is never started by a queue: SKIPPED, naming that job;
- a cell whose job already runs is followed, not started again;
- before a cell's job starts, its entry is recorded STARTING with the id the job will have. After a
  sidecar restart, such an entry whose job has a record is RUNNING; one whose job never got a log
  file never started (PENDING again); one in between (its keeper may have started it; its record
  was never written) is FAILED, for a person to look at, and never started a second time.

A queue survives a sidecar restart: `recover()` continues every queue that had not ended, at the
cell where it stood. Asking again for a queue that ended starts a new pass: its cells that did not
finish are queued again (with BOXWARDEN_RESUME_FROM, through the restart machinery's choice of
checkpoint, only on restarts; a new pass starts a cell fresh unless its trainer resumes by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.errors import NotFoundError, PreconditionError, SidecarError
from sidecar.jobrecord import JobRecord, check_name
from sidecar.jobs import RESTART_POLICIES, JobSupervisor
from sidecar.queuerecord import (
    CANCELLED,
    DONE,
    FAILED,
    FINAL,
    PENDING,
    RUNNING,
    SKIPPED,
    STARTING,
    STATE_PB,
    CellEvidence,
    Entry,
    QueueRecord,
    QueueStore,
    difference,
    durability,
    fill,
    outcome,
    result,
)

logger = logging.getLogger(__name__)

QUEUE_STARTED = "QUEUE_STARTED"
QUEUE_FINISHED = "QUEUE_FINISHED"
RETRY_S = 1.0  # a cell that may not start yet (a release is checking the box) is tried again after this
MAX_CELLS = 1000
MAX_ENDED = 100  # ended queues kept; the oldest past this are forgotten


class QueueRunner:
    """Runs the queues on the sidecar's loop; every change of an entry is recorded before it acts."""

    def __init__(
        self,
        store: QueueStore,
        jobs: JobSupervisor,
        emit: Callable[[str, str], None],
        evidence: Callable[[Collection[str]], Mapping[str, CellEvidence]],
        *,
        may_start: Callable[[], tuple[str, bool]] = lambda: ("", False),
        settle_s: float = 10.0,
    ) -> None:
        """`emit(kind, detail)` journals an event. `evidence(cells)`: what the box holds of each.
        `may_start()`: why no job may start now ("" when one may), and whether for good (a release
        deleted the box's artifacts: the rest is cancelled) or for now (one is checking: wait).
        `settle_s`: how long after its job ended a cell without claims counts as NO_CHECKPOINT."""
        self._store = store
        self._jobs = jobs
        self._emit = emit
        self._evidence = evidence
        self._may_start = may_start
        self._settle_s = settle_s
        self._queues: dict[str, QueueRecord] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        jobs.on_settled(self._on_settled)

    # ---- queries -------------------------------------------------------------------------------

    def queues(self) -> list[QueueRecord]:
        """Every queue, newest first."""
        return sorted(self._queues.values(), key=lambda q: q.created_at_ns, reverse=True)

    def get(self, name: str) -> QueueRecord:
        try:
            return self._queues[name]
        except KeyError:
            raise NotFoundError(f"no queue {name!r} on this box") from None

    def waiting(self) -> list[str]:
        """One line per queue with cells still to run (a release must not begin under them)."""
        out = []
        for q in self.queues():
            if q.active and not q.stopped:
                left = [e.cell for e in q.entries if e.state in (PENDING, STARTING)]
                if left:
                    out.append(f"queue {q.name} ({len(left)} cells to run: {', '.join(left[:5])})")
        return out

    def cell_busy(self, cell: str) -> str:
        """Why a job of `cell` may not start by hand now ("" if it may): one runs, or a running
        queue has it still to run (two runs of a cell would mix its checkpoints)."""
        for j in self._jobs.of_cell(cell):
            if not self._jobs.settled(j.id):
                return f"cell {cell} already runs as job {j.id}; stop it first (`boxwarden stop BOX {j.id}`)"
        for q in self._queues.values():
            if q.active and not q.stopped and any(e.cell == cell and e.state not in FINAL for e in q.entries):
                return (
                    f"cell {cell} is queued in running queue {q.name!r}; stop the queue first, or let it run"
                )
        return ""

    def to_pb(self, q: QueueRecord) -> pb.Queue:
        return self.listing([q])[0]

    def listing(self, queues: Sequence[QueueRecord], *, brief: bool = False) -> list[pb.Queue]:
        """The queues on the wire, their finished cells judged by their evidence: one pass over the
        claims for all of them. `brief`: cells without their argv, cwd and env."""
        now = time.time_ns()
        held = self._evidence({e.cell for q in queues for e in q.entries if e.state in (DONE, SKIPPED)})
        out = []
        for q in queues:
            msg = pb.Queue(
                name=q.name,
                stopped=q.stopped,
                passes=q.passes,
                created_at_unix_ns=q.created_at_ns,
                ended_at_unix_ns=q.ended_at_ns,
                restart=q.restart,
                max_restarts=q.max_restarts,
                restart_backoff_s=q.backoff_s,
            )
            finished = []
            for e in q.entries:
                spec = (
                    pb.QueueCell(cell=e.cell)
                    if brief
                    else pb.QueueCell(cell=e.cell, argv=e.argv, cwd=e.cwd, env=e.env)
                )
                cell = msg.cells.add(
                    spec=spec,
                    state=STATE_PB[e.state],
                    job_id=e.job_id,
                    exit_code=e.exit_code or 0,
                    detail=e.detail,
                )
                if e.state in (DONE, SKIPPED):
                    ev = held.get(e.cell, CellEvidence(0, 0, 0))
                    cell.durability = durability(ev, e.ended_at_ns, now, self._settle_s)
                    cell.claims, cell.durable_claims = ev.claims, ev.durable
                    finished.append(cell.durability)
            msg.result = result([e.state for e in q.entries], finished)
            out.append(msg)
        return out

    # ---- start / stop --------------------------------------------------------------------------

    async def start(
        self,
        name: str,
        cells: Sequence[Entry],
        *,
        restart: str = "never",
        max_restarts: int = 0,
        backoff_s: float = 0.0,
    ) -> tuple[QueueRecord, bool]:
        """Queue `cells` under `name`: (the queue, whether a pass began now). A running queue of the
        same name and cells is left as it is; one with other cells is refused."""
        if self._closed:
            raise PreconditionError("the sidecar is shutting down; queue the cells again once it is up")
        check_name(name, "queue name")
        entries = [self._checked(e) for e in cells]
        if not entries:
            raise PreconditionError(f"queue {name!r} has no cells")
        if len(entries) > MAX_CELLS:
            raise PreconditionError(f"queue {name!r} has {len(entries)} cells; at most {MAX_CELLS}")
        seen: set[str] = set()
        for e in entries:
            if e.cell in seen:
                raise PreconditionError(f"queue {name!r} names cell {e.cell!r} twice")
            seen.add(e.cell)
        restart = restart or "never"
        if restart not in RESTART_POLICIES:
            expected = ", ".join(RESTART_POLICIES)
            raise PreconditionError(f"restart policy {restart!r}: expected one of {expected}")
        if max_restarts < 0 or not (backoff_s >= 0 and math.isfinite(backoff_s)):
            raise PreconditionError(
                f"max restarts {max_restarts}, backoff {backoff_s} s: give 0 (the defaults) or more"
            )
        policy = (restart, max_restarts, backoff_s)
        async with self._lock:
            old = self._queues.get(name)
            if old is not None and old.active and old.stopped:
                raise PreconditionError(
                    f"queue {name!r} is being stopped; ask again once it ended "
                    f"(`boxwarden queue BOX {name} --wait` follows it)"
                )
            if old is not None and old.active:
                if [e.spec() for e in old.entries] == [e.spec() for e in entries] and (
                    old.restart,
                    old.max_restarts,
                    old.backoff_s,
                ) == policy:
                    return old, False
                raise PreconditionError(
                    f"queue {name!r} is running with other cells or options ({difference(old, entries)}); "
                    "stop it first, or give the new queue another name"
                )
            self._check_no_overlap(name, entries)
            q = QueueRecord(
                name=name,
                entries=entries,
                restart=policy[0],
                max_restarts=policy[1],
                backoff_s=policy[2],
                created_at_ns=old.created_at_ns if old is not None else time.time_ns(),
                passes=old.passes + 1 if old is not None else 1,
            )
            self._queues[name] = q
            self._save(q)
            self._safe_emit(
                QUEUE_STARTED,
                f"{name}: pass {q.passes}, {len(entries)} cells: {', '.join(e.cell for e in entries[:20])}"
                + (" ..." if len(entries) > 20 else ""),
            )
        self._schedule(q)
        return q, True

    def _checked(self, e: Entry) -> Entry:
        check_name(e.cell, "cell")
        if not e.argv or not e.argv[0]:
            raise PreconditionError(f"cell {e.cell!r} has no program: its argv is empty")
        if e.cwd and not Path(e.cwd).is_absolute():
            raise PreconditionError(f"cell {e.cell!r}: working directory {e.cwd!r} must be an absolute path")
        return Entry(cell=e.cell, argv=list(e.argv), cwd=e.cwd, env=dict(e.env))

    def _check_no_overlap(self, name: str, entries: list[Entry]) -> None:
        """Two running queues never hold the same cell: their checkpoints would mix."""
        cells = {e.cell for e in entries}
        for other in self._queues.values():
            if other.name == name or not other.active or other.stopped:
                continue
            shared = sorted(cells & {e.cell for e in other.entries if e.state not in FINAL})
            if shared:
                raise PreconditionError(
                    f"cells {', '.join(shared)} are queued in running queue {other.name!r} too; "
                    "no two queues may run the same cell (their checkpoints would mix)"
                )

    async def stop(self, name: str, grace_s: float = 10.0) -> QueueRecord:
        """Start no further cell of the queue; stop its running cell's job (SIGTERM, then SIGKILL
        after `grace_s`). The queue ends once that job is over."""
        q = self.get(name)
        async with self._lock:  # a cell being started is started (and recorded) first
            if q.active and not q.stopped:
                q.stopped = True
                self._save(q)
            running = [e.job_id for e in q.entries if e.state == RUNNING and e.job_id]
        for job_id in running:
            with contextlib.suppress(NotFoundError):
                await self._jobs.stop(job_id, grace_s=grace_s)
        await self._advance(q)
        return q

    # ---- running -------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load the queues and continue each one that had not ended, where it stood. Call after the
        job supervisor's own recover()."""
        for doc in self._store.load_queues():
            try:
                q = QueueRecord.from_json(doc)
            except (TypeError, ValueError) as err:
                logger.error("a queue record could not be read (%s); it is left alone: %r", err, doc)
                continue
            self._queues[q.name] = q
            for e in q.entries:
                if e.state == STARTING:
                    self._settle_start(q, e)
        for q in self.queues():
            if q.active:
                self._schedule(q)

    def _settle_start(self, q: QueueRecord, e: Entry) -> None:
        """An entry the last sidecar was starting when it stopped: did its job start? Its record, or
        its processes (by their tag), or the exit status its keeper left say so; only a start that
        never got as far as its log file is started again."""
        if self._jobs.known(e.job_id):
            e.state = RUNNING
        elif self._jobs.adopt_tagged(
            e.job_id, cell=e.cell, argv=[fill(a, e.cell) for a in e.argv], cwd=fill(e.cwd, e.cell)
        ):
            e.state = RUNNING
            e.detail = "started as the last sidecar stopped; followed by its processes since"
        elif (code := self._jobs.unrecorded_exit(e.job_id)) is not None:
            e.exit_code = code
            state = DONE if code == 0 else FAILED
            self._end_entry(q, e, state, "" if code == 0 else f"exit {code} (it ran while no sidecar did)")
        elif self._jobs.launch_began(e.job_id):
            e.state = FAILED
            e.detail = (
                f"the sidecar stopped while starting its job {e.job_id}: whether it ran is unknown "
                "(see that job's log); not started again"
            )
            e.ended_at_ns = time.time_ns()
        else:
            e.state, e.job_id = PENDING, ""
        self._save(q)

    def _on_settled(self, job: JobRecord) -> None:
        for q in self._queues.values():
            if q.active and any(e.job_id == job.id and e.state in (STARTING, RUNNING) for e in q.entries):
                self._schedule(q)

    def _schedule(self, q: QueueRecord) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._advance(q), name=f"queue-{q.name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("queue advance failed", exc_info=task.exception())

    async def _advance(self, q: QueueRecord) -> None:
        """Move the queue on as far as it goes now: conclude its cell whose job is over, skip cells
        finished before, start the next one (then wait for it), end the pass after the last."""
        async with self._lock:
            while q.active and not self._closed:
                e = next((x for x in q.entries if x.state not in FINAL), None)
                if e is None:
                    self._finish(q)
                    return
                try:
                    if e.state in (RUNNING, STARTING):
                        if not self._jobs.known(e.job_id):
                            self._end_entry(q, e, FAILED, f"its job {e.job_id} has no record on this box")
                        elif not self._jobs.settled(e.job_id):
                            return  # on_settled moves it on
                        else:
                            self._conclude(q, e)
                    elif q.stopped:
                        self._end_entry(q, e, CANCELLED, "the queue was stopped before it started")
                    elif not await self._start_cell(q, e):
                        return
                except Exception as err:  # a queue must never stall silently: this cell fails
                    logger.exception("queue %s: cell %s", q.name, e.cell)
                    self._end_entry(q, e, FAILED, f"internal error: {err!r}")

    async def _start_cell(self, q: QueueRecord, e: Entry) -> bool:
        """Start a pending cell (or settle it without a start); False when the queue must wait."""
        before = self._jobs.of_cell(e.cell)
        finished = next((j for j in before if j.state == "exited" and j.exit_code == 0), None)
        if finished is not None and self._evidence({e.cell})[e.cell].claims:
            e.job_id, e.exit_code = finished.id, 0
            why = f"it finished on this box before (job {finished.id})"
            self._end_entry(q, e, SKIPPED, why, finished.ended_at_ns)
            return True
        # A cell that exited 0 and left no checkpoint did not finish: it runs again.
        live = next((j for j in before if not self._jobs.settled(j.id)), None)
        if live is not None:
            e.state, e.job_id = RUNNING, live.id
            e.detail = f"it was already running as job {live.id}, not started by this queue"
            self._save(q)
            return True
        why, final = self._may_start()
        if why and final:
            self._end_entry(q, e, CANCELLED, why)
            return True
        if why:  # a release is checking the box: start once it is over (or cancel if it released)
            logger.info("queue %s waits to start cell %s: %s", q.name, e.cell, why)
            asyncio.get_running_loop().call_later(RETRY_S, self._schedule, q)
            return False
        e.state, e.job_id = STARTING, self._jobs.new_id()
        self._save(q)
        try:
            await self._jobs.start(
                [fill(a, e.cell) for a in e.argv],
                cell=e.cell,
                cwd=Path(fill(e.cwd, e.cell)) if e.cwd else None,
                env={k: fill(v, e.cell) for k, v in e.env.items()},
                restart=q.restart,
                max_restarts=q.max_restarts,
                backoff_s=q.backoff_s,
                job_id=e.job_id,
            )
        except Exception as err:  # OSError too: a full disk, no file descriptors left
            if self._closed or self._jobs.known(e.job_id):
                return False  # shutting down: the next sidecar settles this entry
            if not isinstance(err, SidecarError):
                logger.exception("queue %s: starting cell %s", q.name, e.cell)
            e.job_id = ""  # it never ran
            self._end_entry(q, e, FAILED, f"could not start: {err}")
            return True
        e.state = RUNNING
        self._save(q)
        return True

    def _conclude(self, q: QueueRecord, e: Entry) -> None:
        job = self._jobs.get(e.job_id)
        state, why = outcome(job)
        e.exit_code = job.exit_code
        self._end_entry(q, e, state, "; ".join(x for x in (why, e.detail) if x), job.ended_at_ns)

    def _end_entry(
        self, q: QueueRecord, e: Entry, state: str, detail: str, ended_at_ns: int | None = None
    ) -> None:
        e.state, e.detail, e.ended_at_ns = state, detail, ended_at_ns or time.time_ns()
        self._save(q)
        logger.info("queue %s: cell %s %s%s", q.name, e.cell, state, f" ({detail})" if detail else "")

    def _finish(self, q: QueueRecord) -> None:
        q.ended_at_ns = time.time_ns()
        self._save(q)
        self._prune()
        counts = {s: sum(e.state == s for e in q.entries) for s in FINAL}
        failed = [f"{e.cell} ({e.detail})" for e in q.entries if e.state in (FAILED, CANCELLED)]
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        self._safe_emit(
            QUEUE_FINISHED,
            f"{q.name}: pass {q.passes} over: {summary}"
            + (f"; not finished: {'; '.join(failed)}" if failed else ""),
        )

    async def close(self) -> None:
        """Start nothing more: a sidecar that stops leaves running cells running, and the next one
        continues the queues."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _prune(self) -> None:
        """Forget the oldest ended queues past MAX_ENDED (their jobs and the journal remain)."""
        ended = sorted((q for q in self._queues.values() if not q.active), key=lambda q: q.ended_at_ns)
        for old in ended[: max(0, len(ended) - MAX_ENDED)]:
            del self._queues[old.name]
            self._store.delete_queue(old.name)
            logger.info("forgot queue %s (ended %d ns ago)", old.name, time.time_ns() - old.ended_at_ns)

    def _save(self, q: QueueRecord) -> None:
        self._store.save_queue(q.name, q.to_json())

    def _safe_emit(self, kind: str, detail: str) -> None:
        try:
            self._emit(kind, detail)
        except Exception:
            logger.exception("could not emit %s", kind)
