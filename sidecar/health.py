"""HealthHub: samples the box once per interval and hands the latest snapshot to every WatchHealth stream.

Every probe that can block (statvfs of a hung mount, the durable store's space, cgroup and /proc
files, NVML, the jobs' logs) runs on its own `ProbeThread` with a deadline: the event loop only
assembles the snapshot from the ledger's counters and the probes' latest readings, and a probe
that does not answer in time leaves its last good reading in place, marked stale with its age.

It also turns what the readings show into alerts (`alerts.AlertBook`: once per episode, cleared
when it ends): DISK_LOW, INODES_LOW, MEMORY_HIGH, OOM_KILL, GPU_XID, GPU_THROTTLE, ECC_ERRORS,
VRAM_ZOMBIE, JOB_STALLED, LOSS_NONFINITE; and NEXT_SAVE_WONT_FIT (the newest checkpoint is bigger
than the free bytes of its filesystem, or no inode is left there: a save like it would fail). And
it says when the durable store gained free space or inodes (`on_space_freed`): pushes that failed
for want of room are retried at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar import alerts
from sidecar.alerts import AlertBook, Held
from sidecar.backlog import Bandwidth
from sidecar.bell import Bell
from sidecar.compat import SLOTS
from sidecar.errors import PreconditionError, SidecarError, StorageError
from sidecar.gpu import GpuProbe, GpuReading, NullGpuProbe
from sidecar.jobs import JobRecord, JobSupervisor
from sidecar.ledger import ClaimRow, Ledger
from sidecar.memprobe import MemoryProbe, MemorySample
from sidecar.probes import DiskSample, SelfSampler, disk_usage
from sidecar.probethread import ProbeThread, Reading
from sidecar.progress import LogFollower, Progress, ProgressTracker
from sidecar.storage import DurableStore

logger = logging.getLogger(__name__)

FREED_BYTES = 1 << 20
"""The durable store gaining more than this (or any inode) wakes the pushes that wait for room."""

PROBE_TIMEOUT_S = 2.0
"""A probe that has not answered within this is reported stale (its last good reading kept)."""

SIGKILLED_RECENTLY_S = 10.0
"""OOM_KILL names the jobs that died of SIGKILL within this many seconds of the kill."""

OOM_WAIT_S = 3.0
"""An OOM kill with no job seen dead of SIGKILL yet is reported after this long all the same."""

JOB_STATES = {
    "running": pb.JOB_STATE_RUNNING,
    "exited": pb.JOB_STATE_EXITED,
    "stopped": pb.JOB_STATE_STOPPED,
    "lost": pb.JOB_STATE_LOST,
}

PULSED = ("OOM_KILL", "GPU_XID", "LOSS_NONFINITE")


def job_to_pb(job: JobRecord, progress: Progress | None = None, now: float | None = None) -> pb.Job:
    out = pb.Job(
        id=job.id,
        cell=job.cell,
        argv=job.argv,
        cwd=job.cwd,
        pid=job.pid,
        pgid=job.pgid,
        state=JOB_STATES.get(job.state, pb.JOB_STATE_UNSPECIFIED),
        exit_code=job.exit_code or 0,
        started_at_unix_ns=job.started_at_ns,
        ended_at_unix_ns=job.ended_at_ns or 0,
        log_path=job.log_path,
        leader_exited=job.leader_exited,
        live_pids=job.live_pids,
        keeper_lost=job.keeper_lost,
        restart=job.restart,
        restarts=job.restarts,
        max_restarts=job.max_restarts,
    )
    if progress is not None:
        p = out.progress
        p.lines, p.nonfinite = progress.lines, progress.nonfinite_count
        if progress.step is not None:
            p.step = progress.step
        if progress.loss is not None:
            p.loss = progress.loss
        if progress.steps_per_s is not None:
            p.steps_per_s = progress.steps_per_s
        if progress.last_line_at is not None and now is not None:
            p.last_line_age_s = max(0.0, now - progress.last_line_at)
    return out


@dataclass(frozen=True, **SLOTS)
class HostReading:
    disks: tuple[DiskSample, ...]
    memory: MemorySample


LOG_TAIL = 1 << 20
"""A job's log is followed from at most this far before its end when first seen (after a sidecar
restart: from about now; an old NaN is not news)."""


class JobLogs:
    """The progress of the running jobs, from their logs. `follow` (on the loop) names the logs;
    `poll` (on its probe thread only) reads what they gained and returns every job's progress."""

    def __init__(self, step_re: str | None, loss_re: str | None) -> None:
        self._patterns = (step_re, loss_re)
        self._wanted: tuple[tuple[str, str], ...] = ()
        self._followed: dict[str, tuple[LogFollower, ProgressTracker]] = {}
        self._last: dict[str, Progress] = {}
        self._unreadable: dict[str, int | None] = {}  # job id -> errno of its log's last failure, logged once

    def follow(self, logs: tuple[tuple[str, str], ...]) -> None:
        """(job id, log path) of the jobs to follow now; the others are let go at the next poll."""
        self._wanted = logs

    def poll(self) -> dict[str, Progress]:
        wanted = dict(self._wanted)
        for job_id in [j for j in self._followed if j not in wanted]:
            self._followed.pop(job_id)[0].close()
            self._unreadable.pop(job_id, None)
        for job_id, log in wanted.items():
            if job_id not in self._followed:
                follower = LogFollower(Path(log), start_tail=LOG_TAIL)
                self._followed[job_id] = (follower, ProgressTracker(*self._patterns))
            follower, tracker = self._followed[job_id]
            try:
                while data := follower.read_new():
                    tracker.feed(data)
            except OSError as e:  # replaced by a FIFO or a symlink, unreadable: the others go on
                if self._unreadable.get(job_id) != e.errno:
                    logger.warning("cannot follow the log of job %s: %s", job_id, e)
                self._unreadable[job_id] = e.errno
            else:
                self._unreadable.pop(job_id, None)
            self._last[job_id] = tracker.snapshot()
        return dict(self._last)


class HealthHub:
    def __init__(
        self,
        *,
        paths: list[tuple[Path, str]],
        store: DurableStore,
        ledger: Ledger,
        jobs: JobSupervisor,
        notify: Callable[[], None],
        bandwidth: Bandwidth | None = None,
        root_of: Callable[[str], Path] | None = None,
        on_space_freed: Callable[[], None] = lambda: None,
        gpu: GpuProbe | None = None,
        memory: MemoryProbe | None = None,
        memory_high_percent: int = 90,
        stall_s: float = 1800.0,
        step_re: str | None = None,
        loss_re: str | None = None,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        """`root_of`: the watched dir a claim's path lies in (for NEXT_SAVE_WONT_FIT; None: not checked).
        `gpu`, `memory`: the probes (default: none for the GPU, this process's cgroup)."""
        self._paths = paths
        self._bandwidth = bandwidth
        self._root_of = root_of
        self._on_space_freed = on_space_freed
        self._wont_fit = ""  # the claim the last NEXT_SAVE_WONT_FIT was about, while it holds
        self._durable_free: tuple[int, int] | None = None
        self._store = store
        self._ledger = ledger
        self._jobs = jobs
        self._notify = notify
        self._memory_probe = memory or MemoryProbe()
        self._gpu_probe = gpu or NullGpuProbe("no GPU probe configured")
        self._memory_high = memory_high_percent
        self._stall_s = stall_s
        self._logs = JobLogs(step_re, loss_re)
        self._host = ProbeThread("host", self._host_sample, timeout_s=probe_timeout_s)
        self._gpu = ProbeThread("gpu", self._gpu_probe.sample, timeout_s=probe_timeout_s)
        self._progress = ProbeThread("progress", self._logs.poll, timeout_s=probe_timeout_s)
        self._sampler = SelfSampler()
        self.alerts = AlertBook(self._emit)
        self._oom_seen: int | None = None
        self._oom_pending: tuple[float, int, str] | None = None  # (seen at, kills, cgroup)
        self._nonfinite_seen: dict[str, int] = {}
        self._ecc_baseline: dict[str, tuple[int, int]] = {}
        self._last_progress: dict[str, Progress] = {}
        self.bell = Bell()
        self.latest = pb.HealthSnapshot(at_unix_ns=time.time_ns(), seq=self._ledger.last_seq())

    # ---- probes (each on its own thread) ----------------------------------------------------------

    def _host_sample(self) -> HostReading:
        disks = [d for path, role in self._paths if (d := disk_usage(path, role)) is not None]
        try:
            durable = self._store.space()
        except StorageError as e:
            # A stale or unreachable store must not take the health stream down with it.
            logger.warning("the durable store's free space is unknown: %s", e)
            durable = None
        if durable is not None:
            disks.append(durable)
        return HostReading(tuple(disks), self._memory_probe.sample())

    async def gpu_reading_now(self) -> GpuReading:
        """A GPU reading begun after this call, never the snapshot's, through the GPU probe's own
        thread within its deadline (`reap` confirms a pid with it). PreconditionError when the probe
        does not answer in time or fails: nothing may be concluded from an old reading."""
        # A read already in flight (the sampler's) may have begun before this call: the second
        # read is always a new request, asked once the first one returned.
        await self._fresh_gpu()
        return await self._fresh_gpu()

    async def _fresh_gpu(self) -> GpuReading:
        got = await self._gpu.read()
        if got.stale or got.value is None:
            raise PreconditionError(
                f"no fresh GPU reading ({got.error or 'none yet'}): the GPU probe (NVML) did not answer "
                "in time; try again once `boxwarden status` shows the gpu probe fresh"
            )
        # Its Xids are handed out once: the alerts must see them as the sampler's would.
        # (The jobs as last scanned: their membership may be old, so VRAM_ZOMBIE is left to the sampler.)
        self._gpu_alerts(got.value, self._jobs.jobs(), fresh=True, members_fresh=False)
        return got.value

    # ---- one sample (on the loop: no blocking call) ---------------------------------------------

    async def sample(self) -> pb.HealthSnapshot:
        jobs = await self._jobs.jobs_now()  # scanned off the loop; the last state if it did not answer
        scan = self._jobs.scan_state()  # how that scan went (None: no job followed, nothing to scan)
        members_fresh = scan is None or not scan.stale
        self._logs.follow(tuple((j.id, j.log_path) for j in jobs if j.state == "running" and j.log_path))
        host, gpu, progress = await asyncio.gather(self._host.read(), self._gpu.read(), self._progress.read())
        if progress.value is not None:
            self._last_progress.update(progress.value)
        snap = pb.HealthSnapshot(at_unix_ns=time.time_ns(), seq=self._ledger.last_seq())
        now = time.monotonic()
        summary = self._ledger.summary()
        if host.value is not None:
            self._host_alerts(host.value, jobs, fresh=not host.stale)
            self._check_fit(list(host.value.disks), summary.newest)
            if not host.stale:
                self._check_freed(list(host.value.disks))
            _disks_to_pb(snap, host.value)
        if gpu.value is not None:
            self._gpu_alerts(gpu.value, jobs, fresh=not gpu.stale, members_fresh=members_fresh)
            _gpus_to_pb(snap, gpu.value, _job_pids(jobs))
            snap.gpu_source, snap.gpu_error = gpu.value.source, gpu.value.error
        self._job_alerts(jobs, summary.newest, now)
        self.alerts.hold_pulses(PULSED)
        snap.jobs.extend(job_to_pb(j, self._last_progress.get(j.id), now) for j in jobs)
        readings: list[tuple[str, Reading[Any]]] = [("host", host), ("gpu", gpu), ("progress", progress)]
        for name, reading in [*readings, *([("jobs", scan)] if scan is not None else [])]:
            snap.probes.append(
                pb.ProbeState(name=name, stale=reading.stale, age_s=reading.age_s, error=reading.error)
            )
        for a in self.alerts.active():
            snap.alerts.append(
                pb.Alert(kind=_kind(a.kind), subject=a.subject, detail=a.detail, since_unix_ns=a.since_ns)
            )
        self._artifacts_to_pb(snap, summary.server_checksum, summary.durable_only, summary.newest)
        s = self._sampler.sample()
        snap.self.CopyFrom(
            pb.SelfStats(cpu_percent=s.cpu_percent, rss_bytes=s.rss_bytes, uptime_s=s.uptime_s)
        )
        return snap

    def _artifacts_to_pb(
        self, snap: pb.HealthSnapshot, server_checksum: int, durable_only: int, newest: ClaimRow | None
    ) -> None:
        # Counters the ledger keeps as it changes, and one index lookup: no scan of the claims.
        n = self._ledger.counts
        oldest = self._ledger.oldest_not_durable_ns()
        snap.artifacts.CopyFrom(
            pb.ArtifactStats(
                sealed=n.sealed,
                durable=n.durable,
                not_durable_bytes=n.sealed_bytes - n.durable_bytes,
                push_lag_ms=(time.time_ns() - oldest) // 1_000_000 if oldest else 0,
                sealed_bytes=n.sealed_bytes,
                push_bytes_per_s=self._bandwidth.bytes_per_s() if self._bandwidth else 0.0,
                server_checksum=server_checksum,
                durable_only=durable_only,
                newest_sealed_unix_ns=newest.sealed_at_ns if newest is not None else 0,
            )
        )

    # ---- alerts -----------------------------------------------------------------------------------

    def _emit(self, kind: str, path: str, job_id: str, detail: str) -> None:
        self._ledger.add_event(kind, path=path, job_id=job_id, detail=detail)
        self._notify()

    def _host_alerts(self, host: HostReading, jobs: list[JobRecord], *, fresh: bool) -> None:
        if fresh:  # a stale reading says nothing new: episodes stay as they are
            for kind, held in alerts.low_disks(host.disks).items():
                self.alerts.hold(kind, held)
            self.alerts.hold("MEMORY_HIGH", alerts.memory_high(host.memory, self._memory_high))
        kills = host.memory.oom_kills
        if kills is not None:
            if self._oom_seen is not None and kills > self._oom_seen:
                before = self._oom_pending[1] if self._oom_pending else 0
                self._oom_pending = (
                    time.monotonic(),
                    before + kills - self._oom_seen,
                    host.memory.cgroup_dir,
                )
            self._oom_seen = kills
        self._report_oom(jobs)

    def _report_oom(self, jobs: list[JobRecord]) -> None:
        """OOM_KILL, naming the jobs that died of SIGKILL with it: the job's end may be seen a
        moment after the cgroup's counter, so a kill waits up to OOM_WAIT_S for it."""
        if self._oom_pending is None:
            return
        seen_at, count, where = self._oom_pending
        cutoff = time.time_ns() - int(SIGKILLED_RECENTLY_S * 1e9)
        died = [j.id for j in jobs if j.exit_code == -9 and (j.ended_at_ns or 0) >= cutoff]
        if not died and time.monotonic() - seen_at < OOM_WAIT_S:
            return
        self._oom_pending = None
        whose = f"; jobs killed: {', '.join(died)} (exit -9, SIGKILL)" if died else "; no job died of it"
        held = Held(f"the OOM killer killed {count} process(es) in {where}{whose}", job_id=",".join(died))
        self.alerts.pulse("OOM_KILL", "memory", held)

    def _gpu_alerts(
        self, reading: GpuReading, jobs: list[JobRecord], *, fresh: bool, members_fresh: bool
    ) -> None:
        """`fresh`: the GPU reading is new; `members_fresh`: the jobs' processes were scanned with
        it (a job's new process is no zombie: VRAM_ZOMBIE is judged only then)."""
        for x in reading.xids if fresh else ():
            self.alerts.pulse(
                "GPU_XID", f"gpu{x.gpu_index}", Held(f"GPU {x.gpu_index} ({x.uuid}): Xid {x.xid}")
            )
        if fresh:
            self.alerts.hold("GPU_THROTTLE", alerts.gpu_throttled(reading))
            self.alerts.hold("ECC_ERRORS", alerts.ecc_grown(reading, self._ecc_baseline))
        if fresh and members_fresh:
            self.alerts.hold("VRAM_ZOMBIE", alerts.zombies(reading, _job_pids(jobs), _pid_exists))

    def _job_alerts(self, jobs: list[JobRecord], newest: ClaimRow | None, now: float) -> None:
        wall = time.time_ns()
        seal_age = (wall - newest.sealed_at_ns) / 1e9 if newest is not None else math.inf
        quiet = {}
        for j in jobs:
            if j.state != "running":
                continue
            progress = self._last_progress.get(j.id)
            line_age = (
                now - progress.last_line_at if progress and progress.last_line_at is not None else math.inf
            )
            quiet[j.id] = min(line_age, seal_age, (wall - j.started_at_ns) / 1e9)
            if progress is not None:
                held = alerts.nonfinite(j.id, progress, self._nonfinite_seen.get(j.id, 0))
                if held is not None:
                    self.alerts.pulse("LOSS_NONFINITE", j.id, held)
                self._nonfinite_seen[j.id] = progress.nonfinite_count
        self.alerts.hold("JOB_STALLED", alerts.stalled(quiet, self._stall_s))

    def _check_fit(self, disks: list[DiskSample], newest: ClaimRow | None) -> None:
        """NEXT_SAVE_WONT_FIT once per episode: the newest claim's filesystem has fewer free bytes
        than its size, or fewer than two free inodes (a save writes a temp name, then renames)."""
        why = ""
        where = None
        if newest is not None and self._root_of is not None:
            try:
                where = self._root_of(newest.path)  # from its text: the disk is not asked on the loop
            except SidecarError:
                where = None
        if newest is not None and where is not None:
            for d in disks:
                if d.role != "watch" or where != d.path:
                    continue
                if d.total_bytes > 0 and d.free_bytes < newest.size:
                    why = (
                        f"the newest checkpoint {newest.path} is {newest.size} bytes and {d.path} has "
                        f"{d.free_bytes} bytes free: the next save of that size will fail; free space "
                        "there (or retire old checkpoints with `up --keep`)"
                    )
                elif d.total_inodes > 0 and d.free_inodes < 2:
                    why = (
                        f"{d.path} has {d.free_inodes} free inodes: the next save will fail; remove "
                        "files there (`df -i`)"
                    )
        key = f"{newest.path}#{newest.id}" if why and newest is not None else ""
        if key and key != self._wont_fit:
            self._ledger.add_event("NEXT_SAVE_WONT_FIT", path=newest.path if newest else "", detail=why)
            self._notify()
        self._wont_fit = key

    def _check_freed(self, disks: list[DiskSample]) -> None:
        durable = next((d for d in disks if d.role == "durable"), None)
        now = None if durable is None else (durable.free_bytes, durable.free_inodes)
        before, self._durable_free = self._durable_free, now
        if (
            now is not None
            and before is not None
            and (now[0] > before[0] + FREED_BYTES or now[1] > before[1])
        ):
            self._on_space_freed()

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                self.latest = await self.sample()
            except Exception:  # a full disk refusing the journal, an odd path: try again next tick
                logger.exception("health sample failed; the last snapshot stays")
            else:
                self.bell.ring()
            await asyncio.sleep(interval_s)

    def close(self) -> None:
        for probe in (self._host, self._gpu, self._progress):
            probe.close()
        self._gpu_probe.close()


def _kind(name: str) -> pb.EventKind.ValueType:
    try:
        return pb.EventKind.Value(name)
    except ValueError:
        return pb.EVENT_KIND_UNSPECIFIED


def _job_pids(jobs: list[JobRecord]) -> set[int]:
    return {pid for j in jobs if j.state == "running" for pid in j.live_pids} | {os.getpid()}


def _pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _disks_to_pb(snap: pb.HealthSnapshot, host: HostReading) -> None:
    for d in host.disks:
        snap.disks.append(
            pb.DiskUsage(
                path=str(d.path),
                role=d.role,
                total_bytes=d.total_bytes,
                free_bytes=d.free_bytes,
                total_inodes=d.total_inodes,
                free_inodes=d.free_inodes,
            )
        )
    m = host.memory
    mem = snap.memory
    mem.cgroup_version = m.cgroup_version
    mem.host_total_bytes, mem.host_available_bytes = m.host_total_bytes, m.host_available_bytes
    mem.load1, mem.load5, mem.load15 = m.load1, m.load5, m.load15
    for field, value in (
        ("limit_bytes", m.limit_bytes),
        ("usage_bytes", m.usage_bytes),
        ("oom_kills", m.oom_kills),
    ):
        if value is not None:
            setattr(mem, field, value)


def _gpus_to_pb(snap: pb.HealthSnapshot, reading: GpuReading, job_pids: set[int]) -> None:
    for g in reading.gpus:
        out = snap.gpus.add(index=g.index, uuid=g.uuid, name=g.name, throttle_reasons=g.throttle_reasons)
        for field in (
            "utilization_percent",
            "memory_used_bytes",
            "memory_total_bytes",
            "temperature_c",
            "power_w",
            "power_limit_w",
            "sm_clock_mhz",
            "sm_clock_max_mhz",
            "ecc_corrected",
            "ecc_uncorrected",
            "retired_pages",
            "remapped_rows_pending",
            "remapped_rows_failed",
        ):
            value = getattr(g, field)
            if value is not None:  # NVML's "not supported" stays absent, never a zero
                setattr(out, field, value)
        for p in g.processes:
            proc = out.processes.add(pid=p.pid, in_job=p.pid in job_pids)
            if p.used_memory_bytes is not None:
                proc.used_memory_bytes = p.used_memory_bytes
