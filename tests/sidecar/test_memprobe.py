"""The memory probe: v1 and v2 parsing on constructed /proc and cgroupfs trees, then a real v1
memory cgroup on this machine, with a real OOM kill inside it."""

from __future__ import annotations

import errno
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.memprobe import MemoryProbe, MemorySample, find_memory_cgroup

MIB = 1 << 20
V1_MEMORY = Path("/sys/fs/cgroup/memory")
V1_UNLIMITED_4K = 9223372036854771712
MEMINFO = "MemTotal:        1000 kB\nMemFree:          100 kB\nMemAvailable:     250 kB\nCached: 5 kB\n"
LOADAVG = "0.50 1.25 2.00 1/91 5520\n"
EVENTS = "low 0\nhigh 0\nmax 7\noom 4\noom_kill 3\noom_group_kill 0\n"


def mount(mount_id: int, fstype: str, root: str, point: Path, superopts: str) -> str:
    """One mountinfo line, paths escaped as the kernel does."""
    escaped = str(point).replace("\\", "\\134").replace(" ", "\\040")
    opts = f"rw,relatime shared:{mount_id}"
    return f"{mount_id} 23 0:{mount_id} {root} {escaped} {opts} - {fstype} {fstype} {superopts}"


def fake_proc(tmp_path: Path, cgroup: str, mounts: list[str], pid: str = "self") -> Path:
    proc = tmp_path / "proc"
    (proc / pid).mkdir(parents=True)
    (proc / pid / "cgroup").write_text(cgroup)
    unrelated = "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw"
    (proc / pid / "mountinfo").write_text("\n".join([unrelated, *mounts]) + "\n")
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "loadavg").write_text(LOADAVG)
    return proc


def v2_dir(d: Path, *, limit: str = "max", controllers: str = "cpu io memory pids") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.controllers").write_text(controllers + "\n")
    (d / "memory.max").write_text(limit + "\n")
    (d / "memory.current").write_text("12345\n")
    (d / "memory.events").write_text(EVENTS)
    return d


def v1_dir(d: Path, *, limit: int, oom_control: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text("4096\n")
    (d / "memory.oom_control").write_text(oom_control)
    return d


def test_v2_host_view_no_limit_then_a_limit(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    job = v2_dir(cg / "job.slice" / "x")
    proc = fake_proc(tmp_path, "0::/job.slice/x\n", [mount(30, "cgroup2", "/", cg, "rw,nsdelegate")])
    assert find_memory_cgroup(proc=proc) == (2, job)

    probe = MemoryProbe(proc=proc)
    s = probe.sample()
    assert (s.cgroup_version, s.cgroup_dir, s.error) == (2, str(job), "")
    assert (s.limit_bytes, s.usage_bytes, s.oom_kills) == (None, 12345, 3)
    assert (s.host_total_bytes, s.host_available_bytes) == (1000 * 1024, 250 * 1024)
    assert (s.load1, s.load5, s.load15) == (0.5, 1.25, 2.0)
    assert s.usage_fraction == pytest.approx(0.75)  # no cgroup limit: the host's (1000 - 250) / 1000

    (job / "memory.max").write_text("1073741824\n")
    s = probe.sample()
    assert s.limit_bytes == 1 << 30
    assert s.usage_fraction == pytest.approx(12345 / (1 << 30))


def test_v2_container_whose_mount_root_is_its_own_cgroup(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path / "cg")
    sub = v2_dir(cg / "worker", limit="536870912")
    # Without a cgroup namespace: the process names the full path, the mount shows that cgroup.
    root = "/kubepods/pod1/ctr"
    line = mount(30, "cgroup2", root, cg, "rw")
    assert find_memory_cgroup(proc=fake_proc(tmp_path / "a", f"0::{root}\n", [line])) == (2, cg)
    assert find_memory_cgroup(proc=fake_proc(tmp_path / "b", f"0::{root}/worker\n", [line])) == (2, sub)
    # With one: the process sees itself as "/", and so does the mount's root field.
    assert find_memory_cgroup(
        proc=fake_proc(tmp_path / "c", "0::/\n", [mount(30, "cgroup2", "/", cg, "rw")])
    ) == (
        2,
        cg,
    )
    # A mount made outside the namespace: roots disagree; the mount itself is the guess.
    assert find_memory_cgroup(proc=fake_proc(tmp_path / "d", "0::/\n", [line])) == (2, cg)
    s = MemoryProbe(cgroup=(2, sub), proc=tmp_path / "b" / "proc").sample()
    assert (s.limit_bytes, s.usage_bytes, s.oom_kills, s.error) == (1 << 29, 12345, 3, "")


def test_v2_without_the_memory_controller_is_not_a_memory_cgroup(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path / "cg", controllers="cpu io pids")
    proc = fake_proc(tmp_path, "0::/\n", [mount(30, "cgroup2", "/", cg, "rw")])
    assert find_memory_cgroup(proc=proc) is None
    s = MemoryProbe(proc=proc).sample()
    assert (s.cgroup_version, s.cgroup_dir, s.limit_bytes, s.usage_bytes, s.oom_kills) == (
        0,
        "",
        None,
        None,
        None,
    )
    assert "no memory cgroup" in s.error
    assert s.host_total_bytes == 1000 * 1024  # the host part stands on its own
    assert s.usage_fraction == pytest.approx(0.75)


def test_hybrid_prefers_the_v1_memory_hierarchy(tmp_path: Path) -> None:
    v1 = v1_dir(tmp_path / "mem" / "process_api" / "abc", limit=V1_UNLIMITED_4K, oom_control="oom_kill 0\n")
    unified = v2_dir(tmp_path / "unified", controllers="hugetlb")
    cgroup = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n"
    mounts = [
        mount(32, "cgroup", "/", tmp_path / "cpu", "rw,cpu,cpuacct"),
        mount(35, "cgroup", "/", tmp_path / "mem", "rw,memory"),
        mount(41, "cgroup2", "/", unified, "rw"),
    ]
    assert find_memory_cgroup("4242", proc=fake_proc(tmp_path, cgroup, mounts, pid="4242")) == (1, v1)
    # Even where the unified tree has a memory controller, a mounted v1 memory hierarchy wins.
    (unified / "cgroup.controllers").write_text("memory\n")
    assert find_memory_cgroup("4242", proc=tmp_path / "proc") == (1, v1)
    # A mount of some other cgroup, listed first, is passed over for the one that holds the path.
    other = v1_dir(tmp_path / "other", limit=1, oom_control="oom_kill 0\n")
    (tmp_path / "proc" / "4242" / "mountinfo").write_text(
        "\n".join([mount(50, "cgroup", "/elsewhere", other, "rw,memory"), *mounts]) + "\n"
    )
    assert find_memory_cgroup("4242", proc=tmp_path / "proc") == (1, v1)
    # And without the v1 mount, the v2 one is used.
    (tmp_path / "proc" / "4242" / "mountinfo").write_text(mounts[2] + "\n")
    assert find_memory_cgroup("4242", proc=tmp_path / "proc") == (2, unified)


def test_mount_points_with_escaped_characters(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path / "odd name\\dir")
    proc = fake_proc(tmp_path, "0::/\n", [mount(30, "cgroup2", "/", cg, "rw")])
    assert "\\040" in (proc / "self" / "mountinfo").read_text()
    assert find_memory_cgroup(proc=proc) == (2, cg)


def test_v1_parsing_unlimited_and_oom_control_with_and_without_oom_kill(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "", [])
    new = v1_dir(
        tmp_path / "new", limit=V1_UNLIMITED_4K, oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    )
    s = MemoryProbe(cgroup=(1, new), proc=proc).sample()
    assert (s.cgroup_version, s.limit_bytes, s.usage_bytes, s.oom_kills, s.error) == (1, None, 4096, 2, "")
    assert s.usage_fraction == pytest.approx(0.75)
    # 64 KiB pages round "unlimited" down further; still no limit.
    (new / "memory.limit_in_bytes").write_text("9223372036854710272\n")
    assert MemoryProbe(cgroup=(1, new), proc=proc).sample().limit_bytes is None

    old = v1_dir(tmp_path / "old", limit=64 * MIB, oom_control="oom_kill_disable 0\nunder_oom 0\n")
    s = MemoryProbe(cgroup=(1, old), proc=proc).sample()
    assert (s.limit_bytes, s.usage_bytes, s.oom_kills) == (64 * MIB, 4096, None)
    assert "no oom_kill" in s.error
    assert s.usage_fraction == pytest.approx(4096 / (64 * MIB))


def test_sample_never_raises_on_missing_or_odd_files(tmp_path: Path) -> None:
    cg = v2_dir(tmp_path / "cg")
    (cg / "memory.current").unlink()
    (cg / "memory.max").write_text("lots\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "loadavg").write_text("garbage\n")
    s = MemoryProbe(cgroup=(2, cg), proc=proc).sample()
    assert (s.limit_bytes, s.usage_bytes, s.oom_kills) == (None, None, 3)
    assert (s.host_total_bytes, s.host_available_bytes, s.load1) == (0, 0, 0.0)
    for part in ("memory.current", "memory.max", "meminfo", "loadavg"):
        assert part in s.error
    assert s.usage_fraction is None  # no limit, and no host figures to fall back on
    assert MemoryProbe(proc=tmp_path / "no-proc").sample().cgroup_version == 0


def test_usage_fraction_with_a_limit_but_no_usage_is_unknown() -> None:
    s = MemorySample(2, "/x", 100, None, None, 1000, 500, 0.0, 0.0, 0.0)
    assert s.usage_fraction is None


# --- the real v1 memory controller of this machine -------------------------------------------

needs_v1 = pytest.mark.skipif(
    not V1_MEMORY.is_dir(),
    reason="no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory (a pure v2 host); "
    "the v2 branch is covered by the constructed trees above",
)

JOIN = """
import os, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
"""
# Capped at 1 GiB, so that a limit that did not take cannot eat the host: exit 3 then.
JOIN_AND_EAT = (
    JOIN + "hog = []\nfor _ in range(128):\n    hog.append(bytearray(b'\\x01') * (8 << 20))\nsys.exit(3)\n"
)
JOIN_AND_WAIT = JOIN + "print('joined', flush=True)\nsys.stdin.read()\n"


@pytest.fixture
def v1_cgroup() -> Iterator[Path]:
    cg = V1_MEMORY / f"bw-memprobe-{secrets.token_hex(6)}"
    cg.mkdir()
    try:
        yield cg
    finally:
        # The test reaped its children; the kernel may take a moment to let the cgroup go.
        deadline = time.monotonic() + 10
        while True:
            try:
                cg.rmdir()
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _stop(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


@needs_v1
def test_real_v1_oom_kill_is_counted(v1_cgroup: Path) -> None:
    (v1_cgroup / "memory.limit_in_bytes").write_text(str(64 * MIB))
    probe = MemoryProbe(cgroup=(1, v1_cgroup))
    before = probe.sample()
    assert (before.cgroup_version, before.limit_bytes, before.oom_kills) == (1, 64 * MIB, 0), before.error

    with subprocess.Popen(
        [sys.executable, "-c", JOIN_AND_EAT, str(v1_cgroup)], stderr=subprocess.PIPE, text=True
    ) as child:
        try:
            _, err = child.communicate(timeout=60)
            assert child.returncode == -signal.SIGKILL, f"rc {child.returncode}: {err}"
        finally:
            _stop(child)

    after = probe.sample()
    assert after.oom_kills is not None and after.oom_kills >= 1, after
    assert after.limit_bytes == 64 * MIB
    assert after.usage_bytes is not None and after.usage_bytes <= 64 * MIB
    assert after.usage_fraction is not None and after.usage_fraction <= 1.0
    assert after.error == ""


@needs_v1
def test_real_v1_cgroup_of_a_live_process_is_found(v1_cgroup: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", JOIN_AND_WAIT, str(v1_cgroup)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 30)
            assert ready and child.stdout.readline() == "joined\n", f"child did not join (rc {child.poll()})"
            assert str(child.pid) in (v1_cgroup / "cgroup.procs").read_text().split()

            assert find_memory_cgroup(str(child.pid)) == (1, v1_cgroup)
            probe = MemoryProbe(pid=str(child.pid))
            assert probe.cgroup == (1, v1_cgroup)
            s = probe.sample()
            assert (s.cgroup_dir, s.limit_bytes, s.oom_kills, s.error) == (str(v1_cgroup), None, 0, "")
            assert s.usage_bytes is not None and s.usage_bytes > 0
        finally:
            _stop(child)
    assert child.returncode == -signal.SIGKILL


@needs_v1
def test_real_self_is_in_a_v1_memory_cgroup() -> None:
    found = find_memory_cgroup("self")
    assert found is not None
    version, d = found
    assert version == 1 and d.is_dir()
    assert d == V1_MEMORY or V1_MEMORY in d.parents
    assert str(os.getpid()) in (d / "cgroup.procs").read_text().split()
    s = MemoryProbe().sample()
    assert (s.cgroup_version, s.cgroup_dir, s.error) == (1, str(d), "")
    assert s.usage_bytes is not None and s.usage_bytes > 0


def test_real_host_memory_and_load() -> None:
    s = MemoryProbe().sample()
    assert s.host_total_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < s.host_available_bytes <= s.host_total_bytes
    # The kernel's load averages, read again a moment later by another interface.
    for ours, theirs in zip((s.load1, s.load5, s.load15), os.getloadavg(), strict=True):
        assert ours >= 0.0
        assert abs(ours - theirs) <= 0.25 * max(ours, theirs) + 0.5
    fraction = s.usage_fraction
    assert fraction is not None and 0.0 <= fraction <= 1.0
