"""Health probes that need no optional library: filesystem space and the sidecar's own cost.

Owns `DiskSample`/`disk_usage` (one statvfs per watched, durable or state directory), the
DISK_LOW / INODES_LOW thresholds, and `SelfSampler` (CPU percent of one core and RSS of this
process, for the "sidecar idle ≤ 1 % of a core, RSS ≤ 80 MiB" budget). GPU probes live elsewhere.
statvfs can block on a hung network mount, so callers run `disk_usage` in an executor.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

DISK_LOW = "DISK_LOW"
INODES_LOW = "INODES_LOW"

LOW_PERCENT = 5
LOW_BYTES = 1 << 30


@dataclass(frozen=True, **SLOTS)
class DiskSample:
    path: Path
    role: str  # "watch" | "durable" | "state"
    total_bytes: int
    free_bytes: int  # available to an unprivileged writer (f_bavail), not the root reserve
    total_inodes: int
    free_inodes: int  # f_favail, likewise

    @classmethod
    def of(cls, path: Path, role: str, st: os.statvfs_result) -> DiskSample:
        return cls(
            path=path,
            role=role,
            total_bytes=st.f_blocks * st.f_frsize,
            free_bytes=st.f_bavail * st.f_frsize,
            total_inodes=st.f_files,
            free_inodes=st.f_favail,
        )


@dataclass(frozen=True, **SLOTS)
class SelfSample:
    cpu_percent: float  # over the interval since the previous sample, percent of ONE core
    rss_bytes: int
    uptime_s: float


def disk_usage(path: Path, role: str) -> DiskSample | None:
    """Space and inodes of the filesystem holding `path`; None if it cannot be looked at."""
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        # A stale or unreachable mount must not take the health stream down with it.
        logger.warning("statvfs %s failed: %s", path, e)
        return None
    return DiskSample.of(path, role, st)


def low_space(sample: DiskSample) -> list[str]:
    """The alarms this sample raises: DISK_LOW and/or INODES_LOW."""
    alarms = []
    # A filesystem reporting no capacity (some FUSE and network mounts) tells us nothing.
    if sample.total_bytes > 0 and (
        sample.free_bytes * 100 < sample.total_bytes * LOW_PERCENT or sample.free_bytes < LOW_BYTES
    ):
        alarms.append(DISK_LOW)
    # Filesystems without an inode table (btrfs, some overlays) report 0 inodes.
    if sample.total_inodes > 0 and sample.free_inodes * 100 < sample.total_inodes * LOW_PERCENT:
        alarms.append(INODES_LOW)
    return alarms


class SelfSampler:
    """CPU and memory used by this process; create it once, at sidecar start."""

    def __init__(
        self,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self._monotonic = monotonic
        self._cpu = cpu
        self._started = monotonic()
        self._last_wall = self._started
        self._last_cpu = cpu()

    def sample(self) -> SelfSample:
        wall, cpu = self._monotonic(), self._cpu()
        elapsed = wall - self._last_wall
        percent = (cpu - self._last_cpu) / elapsed * 100.0 if elapsed > 0 else 0.0
        self._last_wall, self._last_cpu = wall, cpu
        return SelfSample(cpu_percent=percent, rss_bytes=rss_bytes(), uptime_s=wall - self._started)


def rss_bytes() -> int:
    """Resident set size of this process (/proc/self/statm, field 2, in pages); 0 without /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
