"""Memory of the box and of the memory cgroup the sidecar (or a given process) lives in.

Owns `MemorySample`, `find_memory_cgroup` (which cgroup directory holds a process's memory
accounting, v1 or v2, on the host or inside a container) and `MemoryProbe` (one blocking read of
that directory, /proc/meminfo and /proc/loadavg). Everything here reads small files: callers run
`MemoryProbe.sample` in an executor, never on the event loop. Nothing here raises on a missing or
odd file: the value is None (or 0) and `MemorySample.error` says why.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value (9223372036854771712
# with 4 KiB pages; other page sizes round it differently), so anything this large is no limit.
V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, **SLOTS)
class MemorySample:
    cgroup_version: int  # 1, 2, or 0 when no memory cgroup could be found
    cgroup_dir: str  # the directory read ("" if none)
    limit_bytes: int | None  # None: no limit (v2 "max", v1 >= 2**62) or unreadable
    usage_bytes: int | None  # v2 memory.current, v1 memory.usage_in_bytes; page cache included
    # OOM kills in this cgroup and its descendants: v2 memory.events (hierarchical since Linux 5.2,
    # so a job in a child cgroup counts), v1 memory.oom_control; None where the kernel has no count.
    oom_kills: int | None
    host_total_bytes: int  # /proc/meminfo MemTotal; 0 if unreadable
    host_available_bytes: int  # MemAvailable (MemFree on kernels before 3.14); 0 if unreadable
    load1: float
    load5: float
    load15: float
    error: str = ""  # why some part is missing; "" when everything was read

    @property
    def usage_fraction(self) -> float | None:
        """usage / limit when both are known; where the cgroup has no (known) limit, the host's
        (total - available) / total; None when neither can be worked out."""
        if self.limit_bytes is not None:
            if self.usage_bytes is None or self.limit_bytes <= 0:
                return None
            return self.usage_bytes / self.limit_bytes
        if self.host_total_bytes <= 0:
            return None
        return (self.host_total_bytes - self.host_available_bytes) / self.host_total_bytes


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as \\ooo."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of each cgroup and cgroup2 mount."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-", 6)
            fstype, superopts = fields[sep + 1], fields[sep + 3]
        except (ValueError, IndexError):
            continue
        if fstype in ("cgroup", "cgroup2"):
            found.append((fstype, _unescape(fields[3]), _unescape(fields[4]), set(superopts.split(","))))
    return found


def _candidates(cgroup_path: str, mounts: list[tuple[str, str, str, set[str]]]) -> list[Path]:
    """Where `cgroup_path` (as /proc/<pid>/cgroup names it) may lie under these mounts, best first.

    A mount's root (mountinfo field 4) is the cgroup it shows at its mount point; a container's
    cgroupfs is often mounted with its own cgroup as root. A mount whose root does not contain
    the path comes last, as itself: a namespaced view of the process's cgroup, a guess."""
    under, guesses = [], []
    for _, mount_root, mount_point, _ in mounts:
        root = mount_root.rstrip("/")
        if cgroup_path == root or cgroup_path.startswith(root + "/"):
            rel = cgroup_path[len(root) :].strip("/")
            under.append(Path(mount_point, rel) if rel else Path(mount_point))
        else:
            guesses.append(Path(mount_point))
    return under + guesses


def find_memory_cgroup(pid: str = "self", *, proc: Path = Path("/proc")) -> tuple[int, Path] | None:
    """(cgroup version, directory) holding the memory accounting of `pid`; None if there is none.

    A mounted v1 memory hierarchy wins (on a hybrid host the v2 tree has no memory controller);
    a v2 directory counts only if its cgroup.controllers lists "memory"."""
    try:
        membership = (proc / pid / "cgroup").read_text()
        mounts = _mounts((proc / pid / "mountinfo").read_text())
    except (OSError, UnicodeDecodeError) as e:
        logger.debug("cannot read the cgroups of %s: %s", pid, e)
        return None
    v1_path: str | None = None
    v2_path: str | None = None
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    if v1_path is not None:
        v1_mounts = [m for m in mounts if m[0] == "cgroup" and "memory" in m[3]]
        for d in _candidates(v1_path, v1_mounts):
            if d.is_dir():
                return 1, d
    if v2_path is not None:
        for d in _candidates(v2_path, [m for m in mounts if m[0] == "cgroup2"]):
            try:
                if "memory" in (d / "cgroup.controllers").read_text().split():
                    return 2, d
            except (OSError, UnicodeDecodeError):
                continue
    return None


class MemoryProbe:
    """Samples one memory cgroup (found once, at construction) and the host's memory and load."""

    def __init__(
        self,
        *,
        cgroup: tuple[int, Path] | None = None,
        pid: str = "self",
        proc: Path = Path("/proc"),
    ) -> None:
        self._proc = proc
        self._cgroup = cgroup if cgroup is not None else find_memory_cgroup(pid, proc=proc)

    @property
    def cgroup(self) -> tuple[int, Path] | None:
        return self._cgroup

    def sample(self) -> MemorySample:
        """One reading. Blocking (file reads); never raises."""
        errors: list[str] = []
        version, cgdir = self._cgroup if self._cgroup is not None else (0, None)
        limit = usage = oom_kills = None
        if cgdir is None:
            errors.append("no memory cgroup found")
        elif version == 2:
            limit = _read_int(cgdir / "memory.max", errors, none_if="max")
            usage = _read_int(cgdir / "memory.current", errors)
            oom_kills = _read_key(cgdir / "memory.events", "oom_kill", errors)
        elif version == 1:
            limit = _read_int(cgdir / "memory.limit_in_bytes", errors)
            if limit is not None and limit >= V1_UNLIMITED:
                limit = None
            usage = _read_int(cgdir / "memory.usage_in_bytes", errors)
            oom_kills = _read_key(cgdir / "memory.oom_control", "oom_kill", errors)
        else:
            errors.append(f"unknown cgroup version {version}")
        total, available = _host_memory(self._proc / "meminfo", errors)
        load = _loadavg(self._proc / "loadavg", errors)
        return MemorySample(
            cgroup_version=version,
            cgroup_dir=str(cgdir) if cgdir is not None else "",
            limit_bytes=limit,
            usage_bytes=usage,
            oom_kills=oom_kills,
            host_total_bytes=total,
            host_available_bytes=available,
            load1=load[0],
            load5=load[1],
            load15=load[2],
            error="; ".join(errors),
        )


def _read(path: Path, errors: list[str]) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        errors.append(f"{path}: {e.strerror if isinstance(e, OSError) else e}")
        return None


def _read_int(path: Path, errors: list[str], *, none_if: str = "") -> int | None:
    text = _read(path, errors)
    if text is None:
        return None
    value = text.strip()
    if none_if and value == none_if:
        return None
    try:
        return int(value)
    except ValueError:
        errors.append(f"{path}: not a number: {value[:40]!r}")
        return None


def _read_key(path: Path, key: str, errors: list[str]) -> int | None:
    """The value of a `key N` line (memory.events, memory.oom_control)."""
    text = _read(path, errors)
    if text is None:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].rstrip(":") == key:
            try:
                return int(fields[1])
            except ValueError:
                break
    errors.append(f"{path}: no {key}")
    return None


def _host_memory(meminfo: Path, errors: list[str]) -> tuple[int, int]:
    text = _read(meminfo, errors)
    if text is None:
        return 0, 0
    kib: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].isdigit():
            kib[fields[0].rstrip(":")] = int(fields[1])
    if "MemTotal" not in kib:
        errors.append(f"{meminfo}: no MemTotal")
    if "MemAvailable" not in kib:
        errors.append(f"{meminfo}: no MemAvailable")
    available = kib.get("MemAvailable", kib.get("MemFree", 0))
    return kib.get("MemTotal", 0) * 1024, available * 1024


def _loadavg(path: Path, errors: list[str]) -> tuple[float, float, float]:
    text = _read(path, errors)
    if text is not None:
        try:
            one, five, fifteen = (float(x) for x in text.split()[:3])
            return one, five, fifteen
        except ValueError:
            errors.append(f"{path}: unexpected {text[:40]!r}")
    return 0.0, 0.0, 0.0
