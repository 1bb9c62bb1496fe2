"""HealthHub: samples the box once per interval and hands the latest snapshot to every WatchHealth stream.

It also turns threshold crossings into journal events, once per crossing rather than once per
sample: disk or inodes running low, and NEXT_SAVE_WONT_FIT (the newest checkpoint is bigger than
the free bytes of its filesystem, or no inode is left there: a save like it would fail). And it
says when the durable store gained free space or inodes (`on_space_freed`): pushes that failed for
want of room are retried at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.backlog import Bandwidth
from sidecar.bell import Bell
from sidecar.errors import StorageError
from sidecar.jobs import JobRecord, JobSupervisor
from sidecar.ledger import ClaimRow, Ledger
from sidecar.probes import DiskSample, SelfSampler, disk_usage, low_space
from sidecar.storage import DurableStore

logger = logging.getLogger(__name__)

FREED_BYTES = 1 << 20
"""The durable store gaining more than this (or any inode) wakes the pushes that wait for room."""

JOB_STATES = {
    "running": pb.JOB_STATE_RUNNING,
    "exited": pb.JOB_STATE_EXITED,
    "stopped": pb.JOB_STATE_STOPPED,
    "lost": pb.JOB_STATE_LOST,
}


def job_to_pb(job: JobRecord) -> pb.Job:
    return pb.Job(
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
    )


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
        to_abs: Callable[[str], Path] | None = None,
        on_space_freed: Callable[[], None] = lambda: None,
    ) -> None:
        """`to_abs`: a claim's path on the box (for NEXT_SAVE_WONT_FIT; None: not checked)."""
        self._paths = paths
        self._bandwidth = bandwidth
        self._to_abs = to_abs
        self._on_space_freed = on_space_freed
        self._wont_fit = ""  # the claim the last NEXT_SAVE_WONT_FIT was about, while it holds
        self._durable_free: tuple[int, int] | None = None
        self._store = store
        self._ledger = ledger
        self._jobs = jobs
        self._notify = notify
        self._sampler = SelfSampler()
        self._low: set[tuple[str, str]] = set()
        self.bell = Bell()
        self.latest = self._sample()

    def _sample(self) -> pb.HealthSnapshot:
        snap = pb.HealthSnapshot(at_unix_ns=time.time_ns(), seq=self._ledger.last_seq())
        disks = self._disks()
        summary = self._ledger.summary()
        self._check_fit(disks, summary.newest)
        self._check_freed(disks)
        for d in disks:
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
            self._track_low(str(d.path), set(low_space(d)))
        snap.jobs.extend(job_to_pb(j) for j in self._jobs.jobs())
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
                server_checksum=summary.server_checksum,
                durable_only=summary.durable_only,
            )
        )
        s = self._sampler.sample()
        snap.self.CopyFrom(
            pb.SelfStats(cpu_percent=s.cpu_percent, rss_bytes=s.rss_bytes, uptime_s=s.uptime_s)
        )
        return snap

    def _disks(self) -> list[DiskSample]:
        disks = [d for path, role in self._paths if (d := disk_usage(path, role)) is not None]
        try:
            durable = self._store.space()
        except StorageError as e:
            # A stale or unreachable store must not take the health stream down with it.
            logger.warning("the durable store's free space is unknown: %s", e)
            durable = None
        return disks if durable is None else [*disks, durable]

    def _check_fit(self, disks: list[DiskSample], newest: ClaimRow | None) -> None:
        """NEXT_SAVE_WONT_FIT once per episode: the newest claim's filesystem has fewer free bytes
        than its size, or fewer than two free inodes (a save writes a temp name, then renames)."""
        why = ""
        if newest is not None and self._to_abs is not None:
            where = self._to_abs(newest.path)
            for d in disks:
                if d.role != "watch" or not where.is_relative_to(d.path):
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

    def _track_low(self, path: str, kinds: set[str]) -> None:
        for kind in kinds:
            if (path, kind) not in self._low:
                self._low.add((path, kind))
                self._ledger.add_event(kind, detail=f"{path} is low")
                self._notify()
        for kind in {"DISK_LOW", "INODES_LOW"} - kinds:
            self._low.discard((path, kind))

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.latest = self._sample()
            self.bell.ring()
