"""Supervised training jobs: start, watch, stop and re-adopt after a sidecar restart.

Owns every job the sidecar launches (its record lives in `sidecar.jobrecord`). A job is its whole
process tree (see `sidecar.proctree`): it runs while its leader or any process it started lives,
double-forked or not. Each job is started by its own keeper (`sidecar.keeper`), a child subreaper
that outlives the sidecar: everything the job leaves behind is reparented to the keeper, so while
the keeper lives the job's processes are its descendants, before and after a sidecar restart.
The leader leads its own session and carries `BOXWARDEN_JOB_ID=<id>` in its environment, which
every descendant inherits; membership is also found by session and that tag (and by the orphans
and sessions recorded while the sidecar watched), never by command-line text, so a job whose
keeper was killed is still followed. Jobs outlive the sidecar: `close()` stops watching and never
kills, and `recover()` re-adopts a job whose keeper (same start time) or any member still lives.

The keeper's exit (the job's last process has ended) is observed through a pidfd registered with
the event loop (Linux >= 5.3); the leader's exit status is the one its keeper wrote to a file.
Once the keeper is gone with members left, or where pidfds are unavailable, a light poll re-scans
/proc until the tree is empty. Every scan of /proc runs on a thread of its own with a deadline
(`scan_now`): reading a process's environment can block in the kernel, and the event loop must
never wait on it. `jobs()` and `running()` answer as of the last scan; `jobs_now()` and
`running_now()` scan first, and the gate's `running_now(strict=True)` refuses when no fresh scan
answers, so it never sees a stale "not running". We spawn with `subprocess.Popen` rather than
`asyncio.create_subprocess_exec` on purpose: an asyncio subprocess transport kills its child when
it is closed or garbage-collected, which would take the training job down with the sidecar.
Records from before keepers (no `keeper`) are watched through their leader, as they were.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import secrets
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar import children, mounts, proctree, spawn, strays
from sidecar.compat import SLOTS
from sidecar.errors import NotFoundError, PreconditionError
from sidecar.jobrecord import (
    JobRecord,
    JobStore,
    check_name,
    exit_lines,
    read_start_ticks,
    resolve_program,
)
from sidecar.probethread import ProbeThread, Reading
from sidecar.strays import Stray

__all__ = ["JOB_EXITED", "JOB_STARTED", "JobRecord", "JobStore", "JobSupervisor", "read_start_ticks"]

logger = logging.getLogger(__name__)

JOB_STARTED = "JOB_STARTED"
JOB_EXITED = "JOB_EXITED"
JOB_RESTARTED = "JOB_RESTARTED"
RESUME_ENV = "BOXWARDEN_RESUME_FROM"
CELL_ENV = "BOXWARDEN_CELL"
RESTART_POLICIES = ("never", "on-failure")
DEFAULT_MAX_RESTARTS = 3
DEFAULT_BACKOFF_S = 10.0
MAX_BACKOFF_S = 300.0

# Where pidfds are unavailable (old kernel, seccomp), the leader's liveness is polled this often.
_POLL_INTERVAL_S = 0.5
# A job whose leader has exited is re-scanned this often until its last process is gone.
_TREE_POLL_S = 1.0
# While StopJob waits for a tree to empty, it re-scans (and re-signals) at this pace.
_STOP_POLL_S = 0.05
# After SIGKILL a process normally vanishes at once; one stuck in uncommon I/O (state D) may not.
# StopJob then answers with the job still running instead of hanging the RPC.
_KILL_WAIT_S = 5.0
# A stray scan that has not finished by then is stuck in the kernel (a mount that does not answer).
_STRAY_SCAN_S = 5.0
# A scan of /proc that has not answered by then is stuck in the kernel (an environ read of a process
# whose memory map is locked): the last scan's state stands, marked stale, and the gate refuses.
_SCAN_S = 5.0
# A keeper reports its leader (or why it could not start it) within this time, or StartJob fails.


_Scan = tuple[proctree.ProcTable, dict[str, set[int]]]  # a table and its job tags, read together


@dataclass(**SLOTS)
class _Watch:
    """How one running job's end is observed: through its anchor, the process whose exit is
    awaited by pidfd (the keeper; the leader in records from before keepers)."""

    done: asyncio.Future[None]
    popen: subprocess.Popen[Any] | None  # the keeper, while it is our child; None once re-adopted
    pidfd: int | None = None
    stop_requested: bool = False
    anchor_done: bool = False
    # True when rc holds the leader's real status (its keeper's file, or recorded before a restart).
    rc_known: bool = False
    rc: int | None = None


def _anchor(job: JobRecord) -> tuple[int, int]:
    """(pid, start ticks) of the process whose exit the job's watch awaits."""
    if job.keeper:
        return job.keeper[0], job.keeper[1]
    return job.pid, job.proc_start_ticks


class JobSupervisor:
    """Starts, watches and stops jobs on the one sidecar event loop."""

    def __init__(
        self,
        store: JobStore,
        log_dir: Path,
        default_cwd: Path,
        emit: Callable[[str, str, str], None],
        *,
        use_pidfd: bool = True,
        reap: Callable[[], object] | None = None,
        environ: Mapping[str, str] | None = None,
        resume_from: Callable[[JobRecord], Awaitable[str]] | None = None,
        scan: Callable[[], proctree.ProcTable] = proctree.scan,
        aside: Sequence[Path] = (),
    ) -> None:
        """`resume_from(job)`: the checkpoint a restarted job resumes from ("" for none).
        `use_pidfd=False` forces the polling fallback (for tests of that path). `reap`, if
        given, is called on every poll to collect orphaned jobs' zombies (the sidecar is their
        subreaper); never pass it in a process whose other children someone else waits for.
        `environ`: what every job inherits (default: this process's environment when the job starts).
        `scan`: how the live process table is read (run on the scanner's thread, never on the loop).
        `aside`: where a process's open or mapped files never make it a stray (this machine's boxes'
        own state: another box's sidecar holds its ledger and log there)."""
        self._aside = [str(a) for a in aside]
        self._store = store
        self._log_dir = log_dir
        self._default_cwd = default_cwd
        self._emit = emit
        self._use_pidfd = use_pidfd
        self._reap = reap
        self._environ = environ
        self._jobs: dict[str, JobRecord] = {}
        self._watches: dict[str, _Watch] = {}
        self._tags = proctree.TagReader()
        self._scan = scan
        self._scanner = ProbeThread("proc-scan", self._read_procs, timeout_s=_SCAN_S)
        self._last_scan: Reading[_Scan] | None = None  # how the latest scan went (see scan_state)
        # The tags of the latest table, so that one scan reads them once for every job.
        self._tagged: tuple[proctree.ProcTable, dict[str, set[int]]] | None = None
        self._orphans: dict[str, set[int]] = {}
        self._starting: set[str] = set()
        self._boot = mounts.boot_id()
        # One thread: a scan stuck in the kernel is never joined by a second one.
        self._stray_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stray-scan")
        self._stuck: tuple[asyncio.Future[list[Stray]], strays.Progress] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._woken: set[asyncio.Task[None]] = set()  # scans begun by a pidfd that woke
        self._me = os.getpid()
        self._recovered = False
        self._closed = False
        self._resume_from = resume_from
        self._restarts: dict[str, asyncio.Task[None]] = {}  # jobs waiting out their backoff
        self._relaunching: set[str] = set()  # of those, the ones being started now
        self._no_restart: set[str] = set()  # stopped by StopJob: never started again
        self._settled: list[Callable[[JobRecord], None]] = []

    def on_settled(self, listener: Callable[[JobRecord], None]) -> None:
        """Call `listener(job)` (on the loop) each time a job is over for good: it ended and will
        not be started again (no restart left or due, stopped, or its restart could not start)."""
        self._settled.append(listener)

    def settled(self, job_id: str) -> bool:
        """The job ended and nothing will start it again."""
        job = self.get(job_id)
        return job.state != "running" and job_id not in self._restarts and job_id not in self._starting

    # ---- queries -------------------------------------------------------------------------------

    def jobs(self) -> list[JobRecord]:
        """Every known job, newest first, as of the last scan (see `jobs_now`)."""
        return sorted(reversed(self._jobs.values()), key=lambda j: j.started_at_ns, reverse=True)

    async def jobs_now(self, *, strict: bool = False) -> list[JobRecord]:
        """Every known job, with the running ones' membership scanned now (off the loop). A scan
        that does not answer in time leaves the last state; with `strict` it raises
        PreconditionError instead (what the gate asks must be fresh)."""
        await self.scan_now(strict=strict)
        return self.jobs()

    def get(self, job_id: str) -> JobRecord:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFoundError(f"no job {job_id!r}") from None

    def known(self, job_id: str) -> bool:
        return job_id in self._jobs

    def of_cell(self, cell: str) -> list[JobRecord]:
        """The jobs of a roster cell as last seen (no scan), newest first."""
        return sorted(
            (j for j in self._jobs.values() if j.cell == cell), key=lambda j: j.started_at_ns, reverse=True
        )

    def launch_began(self, job_id: str) -> bool:
        """A start of this job id got as far as creating its log (its keeper may have run)."""
        return (self._log_dir / f"{job_id}.log").exists()

    def unrecorded_exit(self, job_id: str) -> int | None:
        """The exit status the keeper of a job with no record wrote (it ran and ended while no
        sidecar recorded it), if it wrote one."""
        lines = exit_lines(self._log_dir / f"{job_id}.exit")
        if lines[1:2] != ["end"]:
            return None
        try:
            return int(lines[0])
        except ValueError:
            return None

    def scan_state(self) -> Reading[_Scan] | None:
        """How the latest scan of /proc went, while some job is watched (None otherwise)."""
        return self._last_scan if self._watches else None

    def running(self) -> list[JobRecord]:
        """Jobs with a live process, as of the last scan."""
        return [j for j in self.jobs() if j.state == "running"]

    async def running_now(self, *, strict: bool = True) -> list[JobRecord]:
        """Jobs with a live process, scanned now (the gate and release ask this): strict by default."""
        return [j for j in await self.jobs_now(strict=strict) if j.state == "running"]

    def log_path(self, job_id: str) -> Path:
        return Path(self.get(job_id).log_path)

    def log_size(self, job_id: str) -> int:
        """Bytes in the job's log now; 0 if the file is gone."""
        try:
            return self.log_path(job_id).stat().st_size
        except FileNotFoundError:
            return 0

    # ---- start / stop --------------------------------------------------------------------------

    async def start(
        self,
        argv: Sequence[str],
        *,
        cell: str = "",
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        restart: str = "never",
        max_restarts: int = 0,
        backoff_s: float = 0.0,
        job_id: str = "",
    ) -> JobRecord:
        """`job_id`: the id to give the job (a queue records it before the start); "" for a new one."""
        if self._closed:
            raise PreconditionError("the job supervisor is shut down")
        restart = restart or "never"
        if restart not in RESTART_POLICIES:
            raise PreconditionError(
                f"restart policy {restart!r}: expected one of {', '.join(RESTART_POLICIES)}"
            )
        if not (backoff_s >= 0 and math.isfinite(backoff_s)):
            raise PreconditionError(f"restart backoff {backoff_s} s: give 0 (the default) or more")
        policy = (
            (restart, max_restarts or DEFAULT_MAX_RESTARTS, backoff_s or DEFAULT_BACKOFF_S)
            if restart == "on-failure"
            else ("never", 0, 0.0)
        )
        if cell:
            check_name(cell, "cell")
        argv = list(argv)
        if not argv or not argv[0]:
            raise PreconditionError("a job needs a program: argv is empty")
        workdir = (cwd or self._default_cwd).absolute()
        if not workdir.is_dir():
            raise PreconditionError(f"working directory {str(workdir)!r} is not an existing directory")
        extra = dict(env or {})
        if job_id and (job_id in self._jobs or job_id in self._starting):
            raise PreconditionError(f"job id {job_id!r} is taken")
        job_id = job_id or self.new_id()
        full_env = self._job_env(job_id, cell, extra)
        executable = resolve_program(argv[0], workdir, full_env.get("PATH", os.defpath))

        # From here until its record exists the job is "starting": a release must not begin.
        self._starting.add(job_id)
        # Shielded: once the keeper runs, the job is recorded even if the caller gives up waiting.
        launch = self._launch(job_id, argv, cell, workdir, extra, executable, full_env, policy)
        return await asyncio.shield(asyncio.ensure_future(launch))

    def _job_env(self, job_id: str, cell: str, extra: Mapping[str, str], resume: str = "") -> dict[str, str]:
        """What a job's process starts with: the inherited environment, the caller's variables, then
        what the sidecar sets (last: a caller's variable of the same name must not hide the job's
        members, nor name another cell or checkpoint)."""
        inherited = os.environ if self._environ is None else self._environ
        ours = (proctree.TAG, CELL_ENV, RESUME_ENV)
        env = {k: v for k, v in {**inherited, **extra}.items() if k not in ours}
        if cell:
            env[CELL_ENV] = cell
        if resume:
            env[RESUME_ENV] = resume
        env[proctree.TAG] = job_id
        return env

    def starting(self) -> list[str]:
        """Jobs whose keeper was started and that have no record yet (their leader may run)."""
        return sorted(self._starting)

    async def _launch(
        self,
        job_id: str,
        argv: list[str],
        cell: str,
        workdir: Path,
        extra: dict[str, str],
        executable: str,
        full_env: dict[str, str],
        policy: tuple[str, int, float] = ("never", 0, 0.0),
        restarts: int = 0,
        resume: str = "",
    ) -> JobRecord:
        log_path = self._log_dir / f"{job_id}.log"
        try:
            keeper, leader, leader_ticks = await spawn.start_keeper(
                job_id, argv, executable, workdir, full_env, log_path, self._tags
            )
            job = JobRecord(
                id=job_id,
                cell=cell,
                argv=argv,
                cwd=str(workdir),
                env=extra,
                pid=leader,
                pgid=leader,  # the keeper started it in a session of its own
                state="running",
                exit_code=None,
                started_at_ns=time.time_ns(),
                ended_at_ns=None,
                log_path=str(log_path),
                proc_start_ticks=leader_ticks,
                # Our unreaped child: its start time is there even if it has exited already.
                keeper=[keeper.pid, read_start_ticks(keeper.pid, include_zombie=True) or 0],
                boot_id=mounts.boot_id(),
                restart=policy[0],
                max_restarts=policy[1],
                backoff_s=policy[2],
                restarts=restarts,
                resume_from=resume,
            )
            self._jobs[job_id] = job
        finally:
            self._starting.discard(job_id)
        self._watch(job, keeper)
        try:
            self._store.save_job(job)
        except Exception:
            # A job nobody can find after a restart is worse than no job: take it down.
            logger.exception("could not record job %s; killing it", job_id)
            await self._signal_tree(job_id, signal.SIGKILL)
            raise
        logger.info("job %s started: pid %s (keeper %s), %s", job_id, job.pid, keeper.pid, shlex.join(argv))
        self._safe_emit(JOB_STARTED, job_id, f"pid {job.pid}: {shlex.join(argv)}")
        return job

    async def stop(self, job_id: str, grace_s: float = 10.0) -> JobRecord:
        """SIGTERM every process of the job, SIGKILL the survivors after `grace_s`; the final record.
        A job waiting to be started again is not started again."""
        self.get(job_id)
        self._no_restart.add(job_id)
        pending = self._restarts.get(job_id)
        if pending is not None:
            if job_id in self._relaunching:  # its new run is starting: let it, then stop it
                await asyncio.gather(pending, return_exceptions=True)
            else:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
                logger.info("job %s will not be started again: stopped", job_id)
                self._set_restart_due(job_id, 0)
                self._notify_settled(job_id)
        elif self.get(job_id).restart_at_ns and job_id not in self._watches:
            self._set_restart_due(job_id, 0)  # due while no sidecar ran, not armed yet
        job = self.get(job_id)
        watch = self._watches.get(job_id)
        if job.state != "running" or watch is None:
            return job
        if self._closed:
            raise PreconditionError("the job supervisor is shut down")
        watch.stop_requested = True
        whole = await self._signal_tree(job_id, signal.SIGTERM)
        # No table answered: only the group has it; the rest get it as soon as a scan answers.
        if not await self._wait_end(job_id, grace_s, None, term_once=None if whole else signal.SIGTERM):
            logger.info("job %s outlived its %.1fs grace; sending SIGKILL", job_id, grace_s)
            # Re-sent on every scan: a member may fork between one scan and the next signal.
            if not await self._wait_end(job_id, _KILL_WAIT_S, signal.SIGKILL):
                logger.warning("job %s (pid %s) survived SIGKILL for %ss", job_id, job.pid, _KILL_WAIT_S)
        return self._jobs[job_id]

    async def _wait_end(
        self,
        job_id: str,
        timeout: float,
        resend: signal.Signals | None,
        *,
        term_once: signal.Signals | None = None,
    ) -> bool:
        """Await the job's end for `timeout`, scanning; `resend` on every scan; `term_once` until one
        reached the whole tree (the first signal found no table)."""
        watch = self._watches.get(job_id)
        if watch is None:
            return True
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            if resend is not None:
                await self._signal_tree(job_id, resend)
            elif term_once is not None and await self._signal_tree(job_id, term_once):
                term_once = None
            await self.scan_now()
            remaining = deadline - time.monotonic()
            if watch.done.done() or remaining <= 0:
                return watch.done.done()
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin one before 3.11
                await asyncio.wait_for(asyncio.shield(watch.done), timeout=min(remaining, _STOP_POLL_S))

    async def _signal_tree(self, job_id: str, sig: signal.Signals) -> bool:
        """Signal the job's group and every process of it; False when no table answered (only the
        group was signalled, if provably the job's), True otherwise (or when nothing is left)."""
        watch = self._watches.get(job_id)
        if watch is None or watch.done.done():
            return True
        table = await self._fresh_table(strict=False)  # off the loop (a process's environ can hang)
        job = self._jobs[job_id]
        if watch.done.done():
            return True
        # The group first, in one call: it also reaches a child forked after the scan. Only while
        # the group id is provably ours: the PID still names the leader (alive, or a zombie); read
        # now when no table answered.
        ticks = (
            read_start_ticks(job.pid, include_zombie=True)
            if table is None
            else (table.procs[job.pid].start_ticks if job.pid in table.procs else None)
        )
        if ticks is not None and job.proc_start_ticks and ticks == job.proc_start_ticks:
            try:
                os.killpg(job.pgid, sig)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                raise PreconditionError(f"not allowed to signal job {job_id} (pgid {job.pgid})") from e
        if table is None:
            # No table: members seen before may be gone and their PIDs reused; only the group is
            # sure. The caller signals again once a scan answers.
            logger.warning("job %s: the scan of /proc did not answer; signalled its group only", job_id)
            return False
        for pid in self._members(job, table):  # never the keeper: it ends with its last child
            proctree.send_signal(table.procs[pid], sig)
        return True

    # ---- recovery / shutdown -------------------------------------------------------------------

    async def recover(self) -> None:
        """Load recorded jobs; re-adopt the ones with a live process, finish the vanished ones."""
        if self._recovered:
            return
        self._recovered = True
        table: proctree.ProcTable | None = None
        loaded = [
            j
            for j in sorted(self._store.load_jobs(), key=lambda j: j.started_at_ns)
            if j.id not in self._jobs
        ]
        # All of them first: an orphan is given to a job by comparing it with EVERY job's leader.
        self._jobs.update((j.id, j) for j in loaded)
        tagged = self._tags.tags(proctree.scan())
        for job in loaded:
            carrying = tagged.get(job.id, set()) - {self._me}
            if job.state != "running" and carrying:
                # Its record says it ended, yet processes carrying its tag live: the last sidecar
                # died while starting it again (after the keeper started, before the record was
                # saved). Follow those processes; never start it a second time.
                self._adopt_tagged(job, carrying, restarted=bool(job.restart_at_ns))
                continue
            if job.state != "running":
                continue
            table = table or proctree.scan()
            pid, ticks = _anchor(job)
            if ticks and table.live(pid, ticks):
                self._watch(job, None)
                if job.id in self._watches:
                    logger.info("re-adopted running job %s (pid %s; awaiting pid %s)", job.id, job.pid, pid)
                    continue
            table = proctree.scan()  # the anchor just vanished: its children may have moved
            live = self._members(job, table)
            if live:
                logger.info(
                    "re-adopted job %s: its %s (pid %s) is gone, %d of its processes live: %s",
                    job.id,
                    "keeper" if job.keeper else "leader",
                    pid,
                    len(live),
                    live,
                )
                self._adopt_tree(job)
                continue
            if self._keeper_vanished(job):  # killed while we were away: hold on to the job
                self._adopt_tree(job)
                continue
            rc = job.recorded_exit()
            if rc is not None or job.leader_exited:
                logger.info("job %s's last process ended while the sidecar was away", job.id)
                self._finish(job.id, "exited", rc if rc is not None else job.exit_code)
            else:
                logger.info("job %s (pid %s) is gone or its PID was reused: lost", job.id, job.pid)
                self._finish(job.id, "lost", None)
        for job in loaded:  # restarts that were due when the sidecar stopped
            if job.state == "exited" and job.restart_at_ns and job.id not in self._restarts:
                logger.info("job %s was waiting to be started again: armed again", job.id)
                self._maybe_restart(self._jobs[job.id], due_ns=job.restart_at_ns)
        await self.scan_now()

    def adopt_tagged(self, job_id: str, *, cell: str, argv: Sequence[str], cwd: str) -> JobRecord | None:
        """A job id that has no record but whose processes (carrying its tag) live: a start the
        last sidecar did not get to record. Recorded now and followed; None when none lives."""
        if job_id in self._jobs:
            return self._jobs[job_id]
        live = self._tags.tags(proctree.scan()).get(job_id, set()) - {self._me}
        if not live:
            return None
        blank = JobRecord(
            id=job_id,
            cell=cell,
            argv=list(argv),
            cwd=cwd or str(self._default_cwd.absolute()),
            env={},
            pid=0,
            pgid=0,
            state="running",
            exit_code=None,
            started_at_ns=time.time_ns(),
            ended_at_ns=None,
            log_path=str(self._log_dir / f"{job_id}.log"),
            proc_start_ticks=0,
        )
        return self._adopt_tagged(blank, live, restarted=False)

    def _adopt_tagged(self, job: JobRecord, live: set[int], *, restarted: bool) -> JobRecord:
        """Record `job` as running with the processes `live` (its tag's): its keeper is the one whose
        parent is none of them, its leader that keeper's child leading its own session."""
        table = proctree.scan()
        procs = [table.procs[p] for p in sorted(live) if p in table.procs]
        roots = [p for p in procs if p.ppid not in live]
        keeper = roots[0] if len(roots) == 1 else None
        leaders = [p for p in procs if keeper is not None and p.ppid == keeper.pid and p.session == p.pid]
        leader = leaders[0] if leaders else (roots[0] if roots else procs[0])
        record = dataclasses.replace(
            job,
            state="running",
            exit_code=None,
            ended_at_ns=None,
            pid=leader.pid,
            pgid=leader.pgrp,
            proc_start_ticks=leader.start_ticks,
            keeper=[keeper.pid, keeper.start_ticks] if keeper is not None and leaders else [],
            boot_id=self._boot,
            leader_exited=False,
            restarts=job.restarts + 1 if restarted else job.restarts,
            restart_at_ns=0,
        )
        logger.warning(
            "job %s: processes carrying its tag live (%s) with no record of their start (the sidecar "
            "stopped while starting it): recorded and followed as running, never started again",
            job.id,
            sorted(live),
        )
        self._jobs[job.id] = record
        try:
            self._store.save_job(record)
        except Exception:
            logger.exception("could not record job %s", job.id)
        self._watch(record, None)
        if job.id not in self._watches:
            self._adopt_tree(record)
        return record

    def _adopt_tree(self, job: JobRecord) -> None:
        loop = asyncio.get_running_loop()
        self._watches[job.id] = _Watch(
            done=loop.create_future(),
            popen=None,
            anchor_done=True,
            rc_known=job.leader_exited and not job.keeper,  # a keeper's file is read by _check
            rc=job.exit_code if job.leader_exited else None,
        )
        self._ensure_poll()

    async def close(self) -> None:
        """Stop watching. Running jobs are left running: they survive a sidecar restart."""
        self._closed = True
        for pending in list(self._restarts.values()):
            pending.cancel()  # the next sidecar arms it again (its due time is recorded)
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        loop = asyncio.get_running_loop()
        for job_id, watch in list(self._watches.items()):
            self._unwatch(loop, watch)
            if not watch.done.done():
                watch.done.cancel()
            logger.info("leaving job %s (pid %s) running", job_id, self._jobs[job_id].pid)
            # Our own children stay referenced (self._watches is kept) until this process exits.
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        for task in list(self._woken):
            task.cancel()
        await asyncio.gather(*self._woken, return_exceptions=True)
        self._scanner.close()
        self._stray_pool.shutdown(wait=False, cancel_futures=True)

    # ---- watching ------------------------------------------------------------------------------

    def _watch(self, job: JobRecord, popen: subprocess.Popen[Any] | None) -> None:
        """Await the exit of the job's anchor; `popen`: the keeper we just started (our child)."""
        loop = asyncio.get_running_loop()
        watch = _Watch(done=loop.create_future(), popen=popen)
        pid, ticks = _anchor(job)
        try:
            if self._use_pidfd:
                watch.pidfd = os.pidfd_open(pid)
            elif popen is None:
                os.kill(pid, 0)  # the same ProcessLookupError as pidfd_open
        except ProcessLookupError:
            if popen is None:
                return  # gone before we could look; the caller checks the rest of the tree
        except (AttributeError, OSError) as e:
            logger.info("no pidfd for job %s (%s); polling its liveness", job.id, e)
        # A re-adopted PID may have been reused between the caller's check and pidfd_open.
        if popen is None and read_start_ticks(pid) != ticks:
            if watch.pidfd is not None:
                os.close(watch.pidfd)
            return
        self._watches[job.id] = watch
        if watch.pidfd is not None:
            loop.add_reader(watch.pidfd, self._on_pidfd, job.id)
        else:
            self._ensure_poll()

    def _unwatch(self, loop: asyncio.AbstractEventLoop, watch: _Watch) -> None:
        if watch.pidfd is not None:
            loop.remove_reader(watch.pidfd)
            os.close(watch.pidfd)
            watch.pidfd = None

    def _ensure_poll(self) -> None:
        if self._poll_task is None or self._poll_task.done():
            self._poll_task = asyncio.get_running_loop().create_task(self._poll(), name="job-poll")

    async def _poll(self) -> None:
        """Re-scan while some job is watched without a pidfd: an anchor-less tree, or no pidfds."""
        while not self._closed:
            polled = [w for w in self._watches.values() if w.anchor_done or w.pidfd is None]
            if not polled:
                return
            fast = any(not w.anchor_done for w in polled)
            await asyncio.sleep(_POLL_INTERVAL_S if fast else _TREE_POLL_S)
            try:
                await self.scan_now()
                if self._reap is not None:
                    self._reap()
            except Exception:  # the poll is all that ends these jobs: it must not die
                logger.exception("scanning the jobs' processes failed")

    def _on_pidfd(self, job_id: str) -> None:
        watch = self._watches.get(job_id)
        if watch is None or watch.pidfd is None:
            return
        # A readable pidfd stays readable: off the loop's readers at once, or the loop spins while
        # the scan runs on its thread.
        asyncio.get_running_loop().remove_reader(watch.pidfd)
        task = asyncio.get_running_loop().create_task(self._pidfd_woke(job_id), name=f"job-{job_id}-woke")
        self._woken.add(task)
        task.add_done_callback(self._woken.discard)

    async def _pidfd_woke(self, job_id: str) -> None:
        table = None
        try:
            table = await self.scan_now()
        except Exception:
            logger.exception("scanning job %s's processes failed", job_id)
        watch = self._watches.get(job_id)
        if watch is not None and watch.pidfd is not None:
            if table is not None:
                logger.warning("pidfd of job %s woke but its process lives; polling instead", job_id)
            self._unwatch(asyncio.get_running_loop(), watch)
            self._ensure_poll()  # (a scan that did not answer: the poll looks again)

    def _read_procs(self) -> _Scan:
        """On the scanner's thread: every process's stat, and the job tags of the new ones."""
        table = self._scan()
        return table, self._tags.tags(table)

    async def _fresh_table(self, strict: bool) -> proctree.ProcTable | None:
        """A table read now on the scanner's thread (with its tags indexed), or None when it did not
        answer within _SCAN_S (PreconditionError with `strict`)."""
        reading = await self._scanner.read_fresh()  # never a table asked for before this call
        self._last_scan = reading
        if reading.stale or reading.value is None:
            if strict:
                raise PreconditionError(
                    f"the scan of this box's processes did not answer ({reading.error}): whether a job "
                    "still runs cannot be told now; try again in a minute"
                )
            return None
        table, tags = reading.value
        self._index(table, tags)
        return table

    async def scan_now(self, *, strict: bool = False) -> proctree.ProcTable | None:
        """Scan /proc now, off the loop: note leader exits, each running job's live processes, and
        finished jobs. The table read (None when no watched job needed one or the scan did not
        answer; PreconditionError then with `strict`)."""
        if self._closed or not self._watches:
            return None
        table = await self._fresh_table(strict)
        if table is None:
            return None
        empty = [
            job_id
            for job_id in list(self._watches)
            if job_id in self._watches and not self._check(job_id, table)
        ]
        if empty:
            # A scan is not atomic: a process forked behind the scan's position by a member that
            # then exited is missed. Only a second look, after it, may end a job.
            again = await self._fresh_table(strict)
            if again is None:
                self._ensure_poll()  # their end is still to be seen: the poll looks again
                return table
            table = again
            for job_id in empty:
                if job_id in self._watches and not self._check(job_id, table):
                    self._on_end(job_id)
        return table

    def _index(self, table: proctree.ProcTable, tags: dict[str, set[int]]) -> None:
        """Make `table` (and its tags) the one `_members` reads, with the orphans it shows."""
        # Only among running jobs: an orphan given to a finished one would be nobody's.
        leaders = {j.id: (j.pid, j.proc_start_ticks) for j in self._jobs.values() if j.state == "running"}
        self._orphans = proctree.orphans_of_jobs(table, self._me, children.registered(), leaders)
        self._tagged = (table, tags)

    def _members(self, job: JobRecord, table: proctree.ProcTable) -> list[int]:
        if self._tagged is None or self._tagged[0] is not table:
            self._index(table, self._tags.tags(table))  # a table of recover's or adoption's own
        assert self._tagged is not None
        given = self._orphans.get(job.id, set())
        recorded = self._jobs[job.id].adopted if job.id in self._jobs else job.adopted
        adopted = {pid for pid, ticks in recorded if table.live(pid, ticks)}
        new = sorted([pid, table.procs[pid].start_ticks] for pid in given - adopted if pid in table.procs)
        if new:
            self._remember(job, "adopted", new, "orphans")
        known = {(sid, ticks) for sid, ticks in self._jobs.get(job.id, job).sessions}
        while True:  # a session's processes may have started sessions of their own
            found = proctree.members(
                table,
                self._tagged[1],
                job_id=job.id,
                leader_pid=job.pid,
                leader_ticks=job.proc_start_ticks,
                exclude=(self._me,),
                orphans=given | adopted,
                sessions=known,
                keeper=_anchor(job) if job.keeper else None,
            )
            led = {s for s in proctree.sessions_of(table, found) if s[0] != job.pid} - known
            if not led:
                return found
            known |= led
            if job.id in self._jobs:
                self._remember(job, "sessions", sorted([sid, ticks] for sid, ticks in led), "sessions")

    def _remember(self, job: JobRecord, field: str, new: list[list[int]], what: str) -> None:
        """Add `new` to the record's list `field` (adopted orphans, sessions) and save it before
        anything else: after a restart only the record still ties those processes to the job (init
        reaps them then, and their environment may be cleared)."""
        live = self._jobs[job.id]
        record = dataclasses.replace(live, **{field: getattr(live, field) + new})
        self._jobs[job.id] = record
        try:
            self._store.save_job(record)
        except Exception:
            logger.exception("could not record the %s of job %s", what, job.id)

    async def strays(self, roots: Sequence[str], caller: strays.Caller | None = None) -> list[strays.Stray]:
        """Processes outside every job's tree that work where the jobs work (see sidecar.strays).

        The look at each process's directories and open files runs in a thread of its own, with a
        deadline: a stat through a process's cwd on a network or FUSE mount that stopped answering
        blocks in the kernel, and must not freeze the sidecar. A scan that misses its deadline (or
        one still stuck from before) names the process it is stuck on as a stray: fail closed. A
        scan of /proc itself that does not answer raises PreconditionError."""
        stuck = self._stuck_scan()
        if stuck is not None:
            return [stuck]
        # Scanned now (off the loop), every job's membership brought up to date; a scan that does
        # not answer raises PreconditionError: nothing shows what the jobs' processes are.
        table = await self.scan_now(strict=True) or await self._fresh_table(strict=True)
        assert table is not None
        running = self.running()
        # The sidecar and its own children (the keepers), not every process that
        # was reparented to it: an orphan no running job took is looked at like any other.
        exempt = {self._me} | table.closure(children.registered(), set())
        for j in running:
            exempt |= set(self._members(j, table))
            if j.keeper and table.live(j.keeper[0], j.keeper[1]):
                exempt.add(j.keeper[0])  # it works in "/" and holds only the job's log
        progress = strays.Progress()
        scan = functools.partial(
            strays.find,
            table,
            roots=[*roots, str(self._default_cwd), *(j.cwd for j in self._jobs.values())],
            exempt=exempt,
            caller=caller,
            progress=progress,
            watched=roots,
            aside=self._aside,
        )
        future = asyncio.get_running_loop().run_in_executor(self._stray_pool, scan)
        try:
            return await asyncio.wait_for(asyncio.shield(future), _STRAY_SCAN_S)
        except asyncio.TimeoutError:  # not the builtin one before 3.11
            self._stuck = (future, progress)
            logger.warning("the stray scan is stuck on pid %s (a mount that does not answer?)", progress.pid)
            return [strays.stuck_on(progress.pid, _STRAY_SCAN_S)]

    def _stuck_scan(self) -> Stray | None:
        if self._stuck is None or self._stuck[0].done():
            self._stuck = None
            return None
        return strays.stuck_on(self._stuck[1].pid, _STRAY_SCAN_S)

    def _check(self, job_id: str, table: proctree.ProcTable) -> bool:
        """Update one job from `table`; False when its anchor is gone and no member is left."""
        watch = self._watches[job_id]
        job = self._jobs[job_id]
        if not watch.anchor_done:
            pid, ticks = _anchor(job)
            if watch.popen is not None:
                ended = watch.popen.poll() is not None  # reaps our child: only this may, see sidecar.children
                if ended:
                    children.release(pid)
            else:
                ended = read_start_ticks(pid) != ticks
            if ended:
                watch.anchor_done = True
                self._unwatch(asyncio.get_running_loop(), watch)
        if watch.anchor_done and watch.popen is None and self._keeper_vanished(job):
            job = self._flag_keeper_lost(job)
        keeper = table.procs.get(job.keeper[0]) if job.keeper and not watch.anchor_done else None
        if keeper is not None and keeper.start_ticks == job.keeper[1]:
            spawn.wake_if_stopped(keeper)
        leader_live = table.live(job.pid, job.proc_start_ticks)
        if job.keeper and not watch.rc_known and not leader_live:
            # Only once the leader is gone: the job itself may write that file. Final only once
            # the keeper is gone (it writes the status as it reaps the leader, and before it exits).
            watch.rc = job.recorded_exit()
            watch.rc_known = watch.rc is not None and watch.anchor_done
        leader_done = watch.rc_known or not leader_live
        live = self._members(job, table)
        if not live and watch.anchor_done and (watch.stop_requested or not job.keeper_lost):
            return False
        changes: dict[str, Any] = {}
        if leader_done and live and (not job.leader_exited or job.exit_code != watch.rc):
            logger.info(
                "job %s's leader (pid %s) exited (%s); it keeps running while %s live",
                job_id,
                job.pid,
                watch.rc,
                live,
            )
            changes = {"leader_exited": True, "exit_code": watch.rc}
        self._update(job, live=live, **changes)
        if watch.anchor_done:
            self._ensure_poll()
        return True

    def _keeper_vanished(self, job: JobRecord) -> bool:
        """Its keeper is gone without recording the job's end, in this boot (no process outlives a
        reboot), and it was not our child (then its orphans came to us): it was killed, and what
        it held went to init, where nothing ties it to the job."""
        if not job.keeper or job.keeper_lost or job.keeper_ended():
            return False
        return not job.boot_id or job.boot_id == self._boot

    def _flag_keeper_lost(self, job: JobRecord) -> JobRecord:
        logger.warning(
            "job %s: its keeper (pid %s) is gone without recording the job's end: it was killed, "
            "and processes of the job may run where nothing ties them to it; the job counts as "
            "running until it is stopped",
            job.id,
            job.keeper[0],
        )
        record = dataclasses.replace(self._jobs[job.id], keeper_lost=True)
        self._jobs[job.id] = record
        try:
            self._store.save_job(record)
        except Exception:
            logger.exception("could not record that job %s lost its keeper", job.id)
        return record

    def _update(self, job: JobRecord, *, live: list[int], **changes: Any) -> None:
        job = self._jobs[job.id]  # the newest record (a scan may just have recorded orphans)
        new = dataclasses.replace(job, live_pids=live, **changes)
        if new == job:
            return
        self._jobs[job.id] = new
        # Only a change of state is durable; the list of live PIDs is a snapshot for the caller.
        if (new.leader_exited, new.exit_code) != (job.leader_exited, job.exit_code):
            try:
                self._store.save_job(new)
            except Exception:
                logger.exception("could not record that job %s's leader exited", job.id)

    def _on_end(self, job_id: str) -> None:
        watch = self._watches.pop(job_id)
        self._unwatch(asyncio.get_running_loop(), watch)
        if watch.stop_requested:
            state = "stopped"
        elif watch.rc_known:
            state = "exited"
        else:
            state = "lost"  # not our child: its exit status went to its real parent
        self._finish(job_id, state, watch.rc)
        if not watch.done.done():
            watch.done.set_result(None)

    def _finish(self, job_id: str, state: str, exit_code: int | None) -> None:
        job = dataclasses.replace(
            self._jobs[job_id], state=state, exit_code=exit_code, ended_at_ns=time.time_ns(), live_pids=[]
        )
        self._jobs[job_id] = job
        logger.info("job %s %s (exit code %s)", job_id, state, exit_code)
        try:
            self._store.save_job(job)
        except Exception:
            logger.exception("could not record the end of job %s", job_id)
        self._safe_emit(JOB_EXITED, job_id, str(exit_code) if exit_code is not None else state)
        self._maybe_restart(job)
        if job_id not in self._restarts:
            self._notify_settled(job_id)

    def _notify_settled(self, job_id: str) -> None:
        job = self._jobs[job_id]
        for listener in self._settled:
            try:
                listener(job)
            except Exception:
                logger.exception("a listener failed on the end of job %s", job_id)

    # ---- restarts ---------------------------------------------------------------------------------

    def _maybe_restart(self, job: JobRecord, due_ns: int = 0) -> None:
        """Start a job that failed again, after its backoff, if its policy says so. Failed: it
        exited nonzero or died of a signal, by itself (a stopped job, or one whose exit is unknown
        after a sidecar restart, is never restarted). `due_ns`: when (a restart that was due when the
        sidecar stopped); 0: after the backoff from now. The due time is recorded first."""
        if job.restart != "on-failure" or job.state != "exited" or not job.exit_code or self._closed:
            return
        if job.id in self._no_restart:  # StopJob asked for it to end
            return
        if job.restarts >= job.max_restarts:
            logger.warning(
                "job %s failed (exit %s) with no restart left (%d)", job.id, job.exit_code, job.max_restarts
            )
            return
        now = time.time_ns()
        due_ns = due_ns or now + int(min(job.backoff_s * 2**job.restarts, MAX_BACKOFF_S) * 1e9)
        delay = max(0.0, (due_ns - now) / 1e9)
        self._set_restart_due(job.id, due_ns)
        logger.info("job %s failed (exit %s); starting it again in %.1f s", job.id, job.exit_code, delay)
        task = asyncio.get_running_loop().create_task(self._restart(job, delay), name=f"restart-{job.id}")
        self._restarts[job.id] = task

        def forget(done: asyncio.Task[None], job_id: str = job.id) -> None:
            if self._restarts.get(job_id) is done:  # not a newer restart of the same job
                del self._restarts[job_id]

        task.add_done_callback(forget)

    async def _restart(self, job: JobRecord, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            resume = await self._resume_from(job) if self._resume_from is not None else ""
        except Exception:
            logger.exception("could not choose a checkpoint for job %s to resume from", job.id)
            resume = ""
        extra = {k: v for k, v in job.env.items() if k != RESUME_ENV}
        full_env = self._job_env(job.id, job.cell, extra, resume)
        workdir = Path(job.cwd)
        attempt = job.restarts + 1
        self._relaunching.add(job.id)
        try:
            executable = resolve_program(job.argv[0], workdir, full_env.get("PATH", os.defpath))
            self._starting.add(job.id)
            policy = (job.restart, job.max_restarts, job.backoff_s)
            launch = self._launch(
                job.id, job.argv, job.cell, workdir, extra, executable, full_env, policy, attempt, resume
            )
            await asyncio.shield(asyncio.ensure_future(launch))
        except Exception as e:
            logger.error("job %s could not be started again: %s", job.id, e)
            self._safe_emit(
                JOB_RESTARTED, job.id, f"attempt {attempt} of {job.max_restarts} failed to start: {e}"
            )
            self._set_restart_due(job.id, 0)
            self._restarts.pop(job.id, None)
            self._notify_settled(job.id)
            return
        finally:
            self._relaunching.discard(job.id)
            self._starting.discard(job.id)
        self._safe_emit(
            JOB_RESTARTED,
            job.id,
            f"attempt {attempt} of {job.max_restarts} after exit {job.exit_code}; "
            + (
                f"{RESUME_ENV}={resume}"
                if resume
                else f"no durable checkpoint to resume from ({RESUME_ENV} unset)"
            ),
        )

    def _set_restart_due(self, job_id: str, due_ns: int) -> None:
        record = dataclasses.replace(self._jobs[job_id], restart_at_ns=due_ns)
        self._jobs[job_id] = record
        try:
            self._store.save_job(record)
        except Exception:
            logger.exception("could not record the restart of job %s", job_id)

    def restart_pending(self) -> list[str]:
        """Jobs that failed and will be started again after their backoff."""
        return sorted(self._restarts)

    def _safe_emit(self, kind: str, job_id: str, detail: str) -> None:
        # Called from loop callbacks: an exception here must not leave a job half-finished.
        try:
            self._emit(kind, job_id, detail)
        except Exception:
            logger.exception("could not emit %s for job %s", kind, job_id)

    def new_id(self) -> str:
        """An id no job has or is being started with."""
        while True:
            job_id = "j" + secrets.token_hex(4)
            if job_id not in self._jobs and job_id not in self._starting:
                return job_id
