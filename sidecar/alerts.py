"""Alerts: conditions the health sampler finds, journaled once per episode and cleared when they end.

`AlertBook` owns the episodes. Each sample, the sampler states, kind by kind, which subjects (a
path, a job id, "gpu0", "memory") the condition holds for now (`hold`); a subject that newly
holds fires its event once, one that no longer holds ends its episode with ALERT_CLEARED, and one
that still holds fires nothing. Conditions that are moments rather than states (an OOM kill, an
Xid) are `pulse`d: they hold for PULSE_HOLD_S after the last one, so a burst is one episode.
`active()` is what the health stream and `status` show.

The rules that turn readings into held subjects live here too, as pure functions of the readings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from sidecar.compat import SLOTS
from sidecar.gpu import GpuReading, vram_zombies
from sidecar.memprobe import MemorySample
from sidecar.probes import DiskSample, low_space
from sidecar.progress import Progress

PULSE_HOLD_S = 60.0
"""A moment-like condition (OOM kill, Xid) stays active this long after its last occurrence."""

ALERT_CLEARED = "ALERT_CLEARED"


@dataclass(frozen=True, **SLOTS)
class Alert:
    kind: str
    subject: str
    detail: str
    since_ns: int
    path: str = ""
    job_id: str = ""


@dataclass(frozen=True, **SLOTS)
class Held:
    """A condition holding for one subject now: what to say, and what it is about."""

    detail: str
    path: str = ""
    job_id: str = ""


Emit = Callable[[str, str, str, str], None]  # (kind, path, job_id, detail): one journal event


class AlertBook:
    def __init__(self, emit: Emit, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._clock = clock
        self._active: dict[tuple[str, str], Alert] = {}
        self._pulses: dict[tuple[str, str], tuple[float, Held]] = {}

    def hold(self, kind: str, now: Mapping[str, Held]) -> None:
        """The subjects `kind` holds for now (every other subject of `kind` no longer holds)."""
        for subject, held in now.items():
            if (kind, subject) not in self._active:
                self._active[(kind, subject)] = Alert(
                    kind, subject, held.detail, time.time_ns(), held.path, held.job_id
                )
                self._emit(kind, held.path, held.job_id, held.detail)
        for key in [k for k in self._active if k[0] == kind and k[1] not in now]:
            gone = self._active.pop(key)
            self._emit(ALERT_CLEARED, gone.path, gone.job_id, f"{kind}: {gone.subject} ({gone.detail})")

    def pulse(self, kind: str, subject: str, held: Held) -> None:
        """A moment of `kind` for `subject` happened: it holds until PULSE_HOLD_S after the last."""
        self._pulses[(kind, subject)] = (self._clock() + PULSE_HOLD_S, held)

    def hold_pulses(self, kinds: Iterable[str]) -> None:
        """Apply the pulses still within their hold time, for each of `kinds`."""
        now = self._clock()
        for key in [k for k, (until, _) in self._pulses.items() if until <= now]:
            del self._pulses[key]
        for kind in kinds:
            self.hold(kind, {s: held for (k, s), (_, held) in self._pulses.items() if k == kind})

    def active(self) -> list[Alert]:
        return sorted(self._active.values(), key=lambda a: (a.since_ns, a.kind, a.subject))


# ---------------------------------------------------------------------------------------- rules


def low_disks(disks: Iterable[DiskSample]) -> dict[str, dict[str, Held]]:
    """DISK_LOW / INODES_LOW: {kind: {path: Held}}."""
    out: dict[str, dict[str, Held]] = {"DISK_LOW": {}, "INODES_LOW": {}}
    for d in disks:
        for kind in low_space(d):
            free = f"{d.free_bytes} bytes" if kind == "DISK_LOW" else f"{d.free_inodes} inodes"
            out[kind][str(d.path)] = Held(f"{d.path} ({d.role}) is low: {free} free", path=str(d.path))
    return out


def memory_high(mem: MemorySample, percent: int) -> dict[str, Held]:
    fraction = mem.usage_fraction
    if fraction is None or fraction * 100 < percent:
        return {}
    where = f"cgroup v{mem.cgroup_version} {mem.cgroup_dir}" if mem.limit_bytes else "the host"
    return {"memory": Held(f"memory of {where} is {fraction * 100:.0f} % full (threshold {percent} %)")}


def gpu_throttled(reading: GpuReading) -> dict[str, Held]:
    out = {}
    for g in reading.gpus:
        why = [w for w, on in (("power cap", g.power_throttle), ("heat", g.thermal_throttle)) if on]
        if why:
            reasons = ", ".join(g.throttle_reasons)
            out[f"gpu{g.index}"] = Held(f"GPU {g.index} ({g.uuid}) slowed by {' and '.join(why)}: {reasons}")
    return out


def ecc_grown(reading: GpuReading, baseline: dict[str, tuple[int, int]]) -> dict[str, Held]:
    """GPUs whose uncorrected ECC errors or retired pages grew since first seen (`baseline`, kept
    by the caller), or whose row remapping failed."""
    out = {}
    for g in reading.gpus:
        now = (g.ecc_uncorrected or 0, g.retired_pages or 0)
        first = baseline.setdefault(g.uuid or str(g.index), now)
        if now[0] > first[0] or now[1] > first[1] or g.remapped_rows_failed:
            out[f"gpu{g.index}"] = Held(
                f"GPU {g.index} ({g.uuid}): uncorrected ECC errors {first[0]} -> {now[0]}, retired pages "
                f"{first[1]} -> {now[1]}" + (", a row remap failed" if g.remapped_rows_failed else "")
            )
    return out


def zombies(reading: GpuReading, job_pids: set[int], pid_exists: Callable[[int], bool]) -> dict[str, Held]:
    """VRAM_ZOMBIE: GPU memory held by a process outside every job's tree. Only pids this box's
    /proc shows (NVML gives the host's pids; in a container with its own pid namespace they mean
    nothing here), and never the sidecar itself."""
    out = {}
    for g, p in vram_zombies(reading, job_pids):
        if pid_exists(p.pid):
            held = f"{p.used_memory_bytes} bytes" if p.used_memory_bytes is not None else "memory"
            out[str(p.pid)] = Held(f"pid {p.pid} holds {held} of GPU {g.index} and belongs to no job")
    return out


def stalled(quiet_s: Mapping[str, float], stall_s: float) -> dict[str, Held]:
    """JOB_STALLED: running jobs (id -> seconds since its last log line, checkpoint or start,
    whichever was last) quiet for stall_s or more."""
    return {
        job_id: Held(f"no log line and no checkpoint for {quiet:.0f} s (limit {stall_s:g} s)", job_id=job_id)
        for job_id, quiet in quiet_s.items()
        if quiet >= stall_s
    }


def nonfinite(job_id: str, progress: Progress, seen: int) -> Held | None:
    """LOSS_NONFINITE for a job whose count of non-finite losses grew past `seen`, or whose latest
    loss is not finite."""
    if progress.nonfinite_count > seen or (progress.loss is not None and not math.isfinite(progress.loss)):
        return Held(f"non-finite loss: {progress.last_nonfinite}", job_id=job_id)
    return None
