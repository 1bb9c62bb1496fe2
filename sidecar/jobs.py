"""Supervised training jobs: start, watch, stop and re-adopt after a sidecar restart.

Owns every process the sidecar launches and the `JobRecord` that describes it. A job leads its own
session (pgid == pid), so StopJob signals the whole group and never matches command-line text. Jobs
outlive the sidecar: `close()` stops watching and never kills, and `recover()` re-adopts a job only
if its PID still names the same process (its start time in /proc/PID/stat is unchanged).

Exit is observed through a pidfd registered with the event loop (Linux >= 5.3), so nothing polls
and no thread blocks in waitpid. We spawn with `subprocess.Popen` rather than
`asyncio.create_subprocess_exec` on purpose: an asyncio subprocess transport kills its child when
it is closed or garbage-collected, which would take the training job down with the sidecar.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sidecar.errors import NotFoundError, PreconditionError

logger = logging.getLogger(__name__)

JOB_STARTED = "JOB_STARTED"
JOB_EXITED = "JOB_EXITED"

# Where pidfds are unavailable (old kernel, seccomp), liveness is polled at this interval.
_POLL_INTERVAL_S = 0.5
# After SIGKILL a process normally vanishes at once; one stuck in uncommon I/O (state D) may not.
# StopJob then answers with the job still running instead of hanging the RPC.
_KILL_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One supervised job. Immutable: every state change stores a new record."""

    id: str
    cell: str
    argv: list[str]
    cwd: str
    # Only the extra variables the caller asked for, not the inherited environment.
    env: dict[str, str]
    pid: int
    pgid: int
    state: str  # "running" | "exited" | "stopped" | "lost"
    exit_code: int | None  # negative: the signal that ended it; None: unknown
    started_at_ns: int
    ended_at_ns: int | None
    log_path: str
    # Field 22 of /proc/PID/stat at start: tells our process apart from a later one with its PID.
    proc_start_ticks: int


class JobStore(Protocol):
    """Durable home of job records (the ledger implements it)."""

    def save_job(self, job: JobRecord) -> None: ...

    def load_jobs(self) -> list[JobRecord]: ...


def read_start_ticks(pid: int, *, include_zombie: bool = False) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may itself hold spaces and parentheses; fields after the last ")" are fixed.
    rest = stat[stat.rfind(b")") + 2 :].split()
    if len(rest) < 20 or (rest[0] in (b"Z", b"X") and not include_zombie):
        return None
    return int(rest[19])


@dataclass(slots=True)
class _Watch:
    """How one running job's end is observed."""

    done: asyncio.Future[None]
    popen: subprocess.Popen[bytes] | None  # None: a re-adopted job that is not our child
    pidfd: int | None = None
    poll_task: asyncio.Task[None] | None = None
    stop_requested: bool = False


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
    ) -> None:
        """`use_pidfd=False` forces the polling fallback (for tests of that path)."""
        self._store = store
        self._log_dir = log_dir
        self._default_cwd = default_cwd
        self._emit = emit
        self._use_pidfd = use_pidfd
        self._jobs: dict[str, JobRecord] = {}
        self._watches: dict[str, _Watch] = {}
        self._recovered = False
        self._closed = False

    # ---- queries -------------------------------------------------------------------------------

    def jobs(self) -> list[JobRecord]:
        """Every known job, newest first."""
        return sorted(reversed(self._jobs.values()), key=lambda j: j.started_at_ns, reverse=True)

    def get(self, job_id: str) -> JobRecord:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFoundError(f"no job {job_id!r}") from None

    def running(self) -> list[JobRecord]:
        return [j for j in self.jobs() if j.state == "running"]

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
    ) -> JobRecord:
        if self._closed:
            raise PreconditionError("the job supervisor is shut down")
        argv = list(argv)
        if not argv or not argv[0]:
            raise PreconditionError("a job needs a program: argv is empty")
        workdir = (cwd or self._default_cwd).absolute()
        if not workdir.is_dir():
            raise PreconditionError(f"working directory {str(workdir)!r} is not an existing directory")
        extra = dict(env or {})
        full_env = {**os.environ, **extra}
        executable = _resolve_program(argv[0], workdir, full_env.get("PATH", os.defpath))

        job_id = self._new_id()
        self._log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_path = self._log_dir / f"{job_id}.log"
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            popen = subprocess.Popen(
                argv,
                executable=executable,
                cwd=workdir,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (OSError, ValueError) as e:  # ValueError: NUL byte or "=" in argv/env
            raise PreconditionError(f"cannot start {argv[0]!r}: {e}") from e
        finally:
            os.close(log_fd)

        job = JobRecord(
            id=job_id,
            cell=cell,
            argv=argv,
            cwd=str(workdir),
            env=extra,
            pid=popen.pid,
            pgid=popen.pid,  # start_new_session: the child called setsid() before exec
            state="running",
            exit_code=None,
            started_at_ns=time.time_ns(),
            ended_at_ns=None,
            log_path=str(log_path),
            # A job that already exited is an unreaped zombie of ours: its start time is still there.
            proc_start_ticks=read_start_ticks(popen.pid, include_zombie=True) or 0,
        )
        self._jobs[job_id] = job
        self._watch(job, popen)
        try:
            self._store.save_job(job)
        except Exception:
            # A job nobody can find after a restart is worse than no job: take it down.
            logger.exception("could not record job %s; killing it", job_id)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pgid, signal.SIGKILL)
            raise
        logger.info("job %s started: pid %s, %s", job_id, job.pid, shlex.join(argv))
        self._safe_emit(JOB_STARTED, job_id, f"pid {job.pid}: {shlex.join(argv)}")
        return job

    async def stop(self, job_id: str, grace_s: float = 10.0) -> JobRecord:
        """SIGTERM the job's process group, SIGKILL it after `grace_s`; returns the final record."""
        job = self.get(job_id)
        watch = self._watches.get(job_id)
        if job.state != "running" or watch is None:
            return job
        if self._closed:
            raise PreconditionError("the job supervisor is shut down")
        watch.stop_requested = True
        self._signal_group(job_id, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(watch.done), timeout=max(grace_s, 0.0))
        except TimeoutError:
            logger.info("job %s outlived its %.1fs grace; sending SIGKILL", job_id, grace_s)
            self._signal_group(job_id, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(watch.done), timeout=_KILL_WAIT_S)
            except TimeoutError:
                logger.warning("job %s (pid %s) survived SIGKILL for %ss", job_id, job.pid, _KILL_WAIT_S)
        return self._jobs[job_id]

    def _signal_group(self, job_id: str, sig: signal.Signals) -> None:
        job = self._jobs[job_id]
        watch = self._watches.get(job_id)
        if watch is None or watch.done.done():
            return
        # Our own child's PID (and so its group id) cannot be reused before we reap it. A
        # re-adopted job's can, once its real parent reaps it: check it is still the same process.
        if watch.popen is None and read_start_ticks(job.pid) != job.proc_start_ticks:
            return
        try:
            os.killpg(job.pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            raise PreconditionError(f"not allowed to signal job {job_id} (pgid {job.pgid})") from e

    # ---- recovery / shutdown -------------------------------------------------------------------

    async def recover(self) -> None:
        """Load recorded jobs; re-adopt the ones still running, mark the vanished ones lost."""
        if self._recovered:
            return
        self._recovered = True
        for job in sorted(self._store.load_jobs(), key=lambda j: j.started_at_ns):
            if job.id in self._jobs:
                continue
            self._jobs[job.id] = job
            if job.state != "running":
                continue
            if job.proc_start_ticks and read_start_ticks(job.pid) == job.proc_start_ticks:
                self._watch(job, None)
                if job.id in self._watches:
                    logger.info("re-adopted running job %s (pid %s)", job.id, job.pid)
                    continue
            logger.info("job %s (pid %s) is gone or its PID was reused: lost", job.id, job.pid)
            self._finish(job.id, "lost", None)

    async def close(self) -> None:
        """Stop watching. Running jobs are left running: they survive a sidecar restart."""
        self._closed = True
        loop = asyncio.get_running_loop()
        tasks = []
        for job_id, watch in list(self._watches.items()):
            self._unwatch(loop, watch)
            if watch.poll_task is not None:
                tasks.append(watch.poll_task)
            if not watch.done.done():
                watch.done.cancel()
            logger.info("leaving job %s (pid %s) running", job_id, self._jobs[job_id].pid)
            # Our own children stay referenced (self._watches is kept) until this process exits.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- watching ------------------------------------------------------------------------------

    def _watch(self, job: JobRecord, popen: subprocess.Popen[bytes] | None) -> None:
        loop = asyncio.get_running_loop()
        watch = _Watch(done=loop.create_future(), popen=popen)
        try:
            if self._use_pidfd:
                watch.pidfd = os.pidfd_open(job.pid)
            elif popen is None:
                os.kill(job.pid, 0)  # the same ProcessLookupError as pidfd_open
        except ProcessLookupError:
            if popen is None:
                return  # gone before we could look; the caller marks it lost
        except (AttributeError, OSError) as e:
            logger.info("no pidfd for job %s (%s); polling its liveness", job.id, e)
        # A re-adopted PID may have been reused between the caller's check and pidfd_open.
        if popen is None and read_start_ticks(job.pid) != job.proc_start_ticks:
            if watch.pidfd is not None:
                os.close(watch.pidfd)
            return
        self._watches[job.id] = watch
        if watch.pidfd is not None:
            loop.add_reader(watch.pidfd, self._on_pidfd, job.id)
        else:
            watch.poll_task = loop.create_task(self._poll(job.id), name=f"job-poll-{job.id}")

    def _unwatch(self, loop: asyncio.AbstractEventLoop, watch: _Watch) -> None:
        if watch.pidfd is not None:
            loop.remove_reader(watch.pidfd)
            os.close(watch.pidfd)
            watch.pidfd = None

    def _ended(self, job_id: str) -> tuple[bool, int | None]:
        """(has it ended, exit code if known). Reaps our own child."""
        watch = self._watches[job_id]
        if watch.popen is not None:
            rc = watch.popen.poll()
            return rc is not None, rc
        job = self._jobs[job_id]
        return read_start_ticks(job.pid) != job.proc_start_ticks, None

    def _on_pidfd(self, job_id: str) -> None:
        loop = asyncio.get_running_loop()
        watch = self._watches[job_id]
        job = self._jobs[job_id]
        if watch.stop_requested and watch.popen is not None:
            # Sweep group members that outlived the leader; its unreaped zombie still holds the
            # group id, so this cannot hit anyone else.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job.pgid, signal.SIGKILL)
        ended, rc = self._ended(job_id)
        self._unwatch(loop, watch)
        if ended:
            self._on_end(job_id, rc)
        else:
            logger.warning("pidfd of job %s woke but the process lives; polling instead", job_id)
            watch.poll_task = loop.create_task(self._poll(job_id), name=f"job-poll-{job_id}")

    async def _poll(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(_POLL_INTERVAL_S)
            ended, rc = self._ended(job_id)
            if ended:
                self._on_end(job_id, rc)
                return

    def _on_end(self, job_id: str, rc: int | None) -> None:
        watch = self._watches.pop(job_id)
        if watch.stop_requested:
            state = "stopped"
        elif watch.popen is not None:
            state = "exited"
        else:
            state = "lost"  # not our child: its exit status went to its real parent
        self._finish(job_id, state, rc)
        if not watch.done.done():
            watch.done.set_result(None)

    def _finish(self, job_id: str, state: str, exit_code: int | None) -> None:
        job = dataclasses.replace(
            self._jobs[job_id], state=state, exit_code=exit_code, ended_at_ns=time.time_ns()
        )
        self._jobs[job_id] = job
        logger.info("job %s %s (exit code %s)", job_id, state, exit_code)
        try:
            self._store.save_job(job)
        except Exception:
            logger.exception("could not record the end of job %s", job_id)
        self._safe_emit(JOB_EXITED, job_id, str(exit_code) if exit_code is not None else state)

    def _safe_emit(self, kind: str, job_id: str, detail: str) -> None:
        # Called from loop callbacks: an exception here must not leave a job half-finished.
        try:
            self._emit(kind, job_id, detail)
        except Exception:
            logger.exception("could not emit %s for job %s", kind, job_id)

    def _new_id(self) -> str:
        while True:
            job_id = "j" + secrets.token_hex(4)
            if job_id not in self._jobs:
                return job_id


def _resolve_program(program: str, cwd: Path, path: str) -> str:
    """The executable argv[0] names, looked up the way exec would from `cwd`."""
    if "/" in program:
        candidate = cwd / program
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
        raise PreconditionError(f"{program!r} is not an executable file (relative to {str(cwd)!r})")
    found = shutil.which(program, path=path)
    if found is None:
        raise PreconditionError(f"{program!r} was not found on the job's PATH ({path})")
    return found
