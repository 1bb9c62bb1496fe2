"""Disk and self probes against the real filesystem and /proc; clocks injected where exactness matters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sidecar.probes import DISK_LOW, INODES_LOW, DiskSample, SelfSampler, disk_usage, low_space

GIB = 1 << 30


def test_disk_usage_matches_statvfs(tmp_path: Path) -> None:
    sample = disk_usage(tmp_path, "state")
    assert sample is not None
    st = os.statvfs(tmp_path)
    assert (sample.path, sample.role) == (tmp_path, "state")
    assert sample.total_bytes == st.f_blocks * st.f_frsize
    assert sample.total_bytes >= sample.free_bytes > 0
    # Free space moves with every write on the box; the unit (f_frsize) must match exactly.
    assert sample.free_bytes % st.f_frsize == 0
    assert abs(sample.free_bytes - st.f_bavail * st.f_frsize) < 256 * 1024 * 1024
    assert sample.total_inodes == st.f_files >= sample.free_inodes


def test_disk_usage_of_a_missing_path_is_none(tmp_path: Path) -> None:
    assert disk_usage(tmp_path / "not-mounted", "durable") is None


def test_self_sampler_percent_of_one_core_with_injected_clocks() -> None:
    wall = iter([100.0, 102.0, 106.0, 106.0])
    cpu = iter([10.0, 10.5, 12.5, 12.5])
    sampler = SelfSampler(monotonic=lambda: next(wall), cpu=lambda: next(cpu))
    first, second, third = sampler.sample(), sampler.sample(), sampler.sample()
    assert (first.cpu_percent, first.uptime_s) == (25.0, 2.0)
    assert (second.cpu_percent, second.uptime_s) == (50.0, 6.0)
    assert third.cpu_percent == 0.0  # no wall time elapsed: no division by zero


def test_self_sampler_reads_real_rss() -> None:
    s = SelfSampler().sample()
    status = Path("/proc/self/status").read_text()
    vm_rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) * 1024
    # The same kernel counter read a moment apart, by another interface.
    assert s.rss_bytes > 1 << 20
    assert abs(s.rss_bytes - vm_rss) < 4 << 20
    assert s.cpu_percent >= 0.0 and s.uptime_s >= 0.0


def sample(total: int, free: int, inodes: int = 1000, free_inodes: int = 500) -> DiskSample:
    return DiskSample(Path("/ckpt"), "watch", total, free, inodes, free_inodes)


@pytest.mark.parametrize(
    ("disk", "alarms"),
    [
        (sample(100 * GIB, 10 * GIB), []),
        (sample(100 * GIB, 5 * GIB), []),  # exactly 5 %: not low
        (sample(100 * GIB, 5 * GIB - 1), [DISK_LOW]),
        (sample(10 * GIB, GIB), []),  # exactly 1 GiB: not low
        (sample(10 * GIB, GIB - 1), [DISK_LOW]),  # 10 % free but under 1 GiB
        (sample(100 * GIB, 50 * GIB, 1000, 50), []),
        (sample(100 * GIB, 50 * GIB, 1000, 49), [INODES_LOW]),
        (sample(100 * GIB, 0, 1000, 0), [DISK_LOW, INODES_LOW]),
        (sample(100 * GIB, 50 * GIB, 0, 0), []),  # no inode table (btrfs)
        (sample(0, 0), []),  # no capacity reported at all
    ],
)
def test_low_space_thresholds(disk: DiskSample, alarms: list[str]) -> None:
    assert low_space(disk) == alarms
