"""What every figure shares: the work directory and its random source file, page-cache control,
interleaved timing of ours vs a baseline, running either side at the priority of the sidecar's
workers, and the result record that ends up in results.json."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sidecar.priority import IOPRIO_CLASS_BE, IOPRIO_LEVEL, NICE, lower_this_thread
from sidecar.storage import DurableStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
CODE_PATH = os.pathsep.join([str(REPO), str(REPO / "proto")])
"""PYTHONPATH for the processes a figure starts (CLI, sidecar): this checkout's code."""
_WRITE_CHUNK = 16 * MiB
_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "overlay-tmpfs"}


@dataclass
class Timing:
    """One timed run: total seconds, plus named parts of it (e.g. stage/commit/verify)."""

    total: float
    parts: dict[str, float] = field(default_factory=dict)


@dataclass
class Side:
    """One side of a comparison: what was run, and every run's timing."""

    label: str
    runs: list[Timing] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(t.total for t in self.runs)

    def to_json(self) -> dict[str, Any]:
        parts = sorted({k for t in self.runs for k in t.parts})
        return {
            "label": self.label,
            "median_s": round(self.median_s, 4),
            "runs_s": [round(t.total, 4) for t in self.runs],
            "parts_median_s": {
                k: round(statistics.median(t.parts[k] for t in self.runs if k in t.parts), 4) for k in parts
            },
        }


@dataclass
class FigureResult:
    """A figure as DESIGN.md §9 states it: ours against a baseline, as a ratio with a target."""

    key: str
    title: str
    ours: Side
    baseline: Side
    ratio_kind: str  # "throughput" (ours/baseline, higher is better) or "time" (lower is better)
    target: float
    size_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        if self.ratio_kind == "throughput":  # same bytes on both sides: throughput ratio = 1/time ratio
            return self.baseline.median_s / self.ours.median_s
        return self.ours.median_s / self.baseline.median_s

    @property
    def target_text(self) -> str:
        return f"≥ {self.target:g}" if self.ratio_kind == "throughput" else f"≤ {self.target:g}"

    @property
    def passed(self) -> bool:
        return self.ratio >= self.target if self.ratio_kind == "throughput" else self.ratio <= self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "size_bytes": self.size_bytes,
            "ours": self.ours.to_json(),
            "baseline": self.baseline.to_json(),
            "ratio_kind": self.ratio_kind,
            "ratio": round(self.ratio, 4),
            "target": self.target_text,
            "pass": self.passed,
            "notes": self.notes,
        }


@dataclass
class Context:
    """The run's settings and its work directory (removed by the caller at the end)."""

    work_dir: Path
    size: int
    runs: int
    _src: Path | None = None

    def source_file(self) -> Path:
        """A `size`-byte file of random bytes, flushed to disk once so later figures never time its
        writeback; created on first use and shared by every figure."""
        if self._src is None:
            path = self.work_dir / "src.bin"
            write_random_file(path, self.size)
            self._src = path
        return self._src


def write_random_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, _WRITE_CHUNK)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def make_hot(path: Path) -> None:
    """Read the whole file so it sits in the page cache, as a file a trainer just wrote does."""
    buf = bytearray(_WRITE_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def drop_from_cache(path: Path) -> None:
    """Flush and drop the file's pages, as the sidecar's verify does before re-reading a copy."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def quiesce() -> None:
    """Let pending writeback (an unlinked copy, a previous run) finish before the clock starts."""
    os.sync()


def interleaved(
    runs: int,
    ours: Callable[[], Timing],
    baseline: Callable[[], Timing],
    o: Side,
    b: Side,
    *,
    warmup: bool = False,
) -> None:
    """Run both sides `runs` times, alternating which goes first, so drift hits both alike.

    `warmup`: run each side once untimed first. A VM's disk writes (and reads back) blocks that no
    file has used yet, or that a discard gave back to the host, up to 3x slower than blocks it
    has just used: the first run's copy pays that, whichever side makes it (seen here: 2.5 s
    against 1.1 s for the same stage + verify)."""
    if warmup:
        t = (ours(), baseline())
        print(f"  warm-up (untimed): ours {_timed(t[0])}, baseline {_timed(t[1])}", file=sys.stderr)
    for r in range(runs):
        pair = ((ours, o), (baseline, b)) if r % 2 == 0 else ((baseline, b), (ours, o))
        for fn, side in pair:
            side.runs.append(fn())
        ours_t, base_t = _timed(o.runs[-1]), _timed(b.runs[-1])
        print(f"  run {r + 1}/{runs}: ours {ours_t}, baseline {base_t}", file=sys.stderr)


def _timed(t: Timing) -> str:
    parts = ", ".join(f"{k} {v:.3f}" for k, v in t.parts.items())
    return f"{t.total:.3f} s" + (f" ({parts})" if parts else "")


def timed_push(store: DurableStore, src: Path, rel: str, key: str) -> tuple[Timing, str]:
    """One push as the sidecar makes it (stage, commit, prove), timed by part; its digest.
    RuntimeError if the fresh copy does not prove."""
    t0 = clock()
    staged = store.stage(src, rel)
    t1 = clock()
    store.commit(staged)
    t2 = clock()
    proof = store.verify(rel, staged.digest)
    t3 = clock()
    if not proof:
        raise RuntimeError(f"{key}: verify of a fresh copy failed")
    return Timing(t3 - t0, {"stage": t1 - t0, "commit": t2 - t1, "verify": t3 - t2}), staged.digest


def clock() -> float:
    return time.perf_counter()


def lowered(fn: Callable[[], T]) -> T:
    """`fn()`, run in a thread at the priority of the sidecar's workers (`sidecar.priority`), as
    the sidecar runs its pushes; what that thread starts (threads, processes) inherits it."""
    with ThreadPoolExecutor(max_workers=1, initializer=lower_this_thread) as pool:
        return pool.submit(fn).result()


def lowered_argv(argv: list[str]) -> list[str]:
    """`argv` to be run at the priority of the sidecar's workers: a baseline then competes for a
    busy machine as ours does (on a quiet one, priorities change nothing)."""
    prefix = ["nice", "-n", str(NICE)]
    if shutil.which("ionice"):
        prefix += ["ionice", "-c", str(IOPRIO_CLASS_BE), "-n", str(IOPRIO_LEVEL)]
    return prefix + argv


def run_quiet(argv: list[str]) -> str:
    """Run a baseline command; its stdout, or a clear failure."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (longest mount-point prefix in /proc/self/mounts)."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def is_memory_fs(path: Path) -> bool:
    return fs_type(path) in _MEMORY_FS


def tool_version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "missing"


def machine_info(work_dir: Path) -> dict[str, Any]:
    import blake3

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "blake3_py": blake3.__version__,
        "b3sum": tool_version(["b3sum", "--version"]),
        "cp": tool_version(["cp", "--version"]).splitlines()[0] if shutil.which("cp") else "missing",
        "work_dir": str(work_dir),
        "work_dir_fs": fs_type(work_dir),
        "loadavg_at_start": os.getloadavg(),
    }


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def proc_rss_bytes(pid: int) -> int:
    """The process's resident set size now (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def stop_pid(pid: int | None) -> None:
    """SIGTERM the process we started, wait up to 30 s for it to go, then SIGKILL it."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    logger.warning("process %d ignored SIGTERM for 30 s; killing it", pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def budget(label: str, seconds: float) -> Side:
    """A "baseline" side that is a budget: the figure's ratio is then the share of it used."""
    return Side(label, [Timing(seconds)])


def start_sidecar(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """A real sidecar (`python -m sidecar --config`) of this tree, in a session of its own, its
    output in `log`; the caller ends it by its pid."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sidecar", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": CODE_PATH},
            start_new_session=True,
        )
