"""HealthHub: samples the box once per interval and hands the latest snapshot to every WatchHealth stream.

It also turns threshold crossings (disk or inodes running low) into journal events, once per
crossing rather than once per sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.bell import Bell
from sidecar.errors import StorageError
from sidecar.jobs import JobRecord, JobSupervisor
from sidecar.ledger import Ledger
from sidecar.probes import DiskSample, SelfSampler, disk_usage, low_space
from sidecar.storage import DurableStore

logger = logging.getLogger(__name__)

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
    ) -> None:
        self._paths = paths
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
        for d in self._disks():
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
