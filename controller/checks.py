"""The profile's checks at `up`, run where the sidecar runs (on the local profile: here).

Each check returns findings; an `error` finding refuses `up` (the durable store is not usable), a
`warn` finding is printed loudly and `up` goes on.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from controller.profiles import Profile


@dataclass(frozen=True)
class Finding:
    level: Literal["ok", "warn", "error"]
    check: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"level": self.level, "check": self.check, "message": self.message}


def run_checks(profile: Profile, *, watch: list[Path], durable: Path, home: Path) -> list[Finding]:
    out: list[Finding] = []
    if "durable_writable" in profile.checks:
        out.append(durable_writable(durable))
    if "inode_headroom" in profile.checks:
        out.append(inode_headroom(profile, durable))
    if "watch_tier" in profile.checks:
        out.extend(watch_tier(profile, watch, durable, home))
    return out


def durable_writable(durable: Path) -> Finding:
    """The durable directory exists and a file can be written, synced and removed there."""
    probe = durable / f".boxwarden-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        return Finding(
            "error",
            "durable_writable",
            f"cannot write to the durable directory {durable}: {e.strerror}; is the durable volume mounted "
            "and writable?",
        )
    return Finding("ok", "durable_writable", f"{durable} is writable")


def inode_headroom(profile: Profile, durable: Path) -> Finding:
    try:
        st = os.statvfs(durable)
    except OSError as e:
        return Finding("error", "inode_headroom", f"cannot stat {durable}: {e.strerror}")
    cap = f" (platform cap {profile.inode_cap})" if profile.inode_cap else ""
    if st.f_files and st.f_favail < profile.inode_min_free:
        return Finding(
            "warn",
            "inode_headroom",
            f"only {st.f_favail} inodes free on the durable filesystem{cap}: a push of many small files "
            "can fail with 'No space left' while bytes remain",
        )
    return Finding("ok", "inode_headroom", f"{st.f_favail} inodes free on the durable filesystem{cap}")


def watch_tier(profile: Profile, watch: list[Path], durable: Path, home: Path) -> list[Finding]:
    """Which storage tier each watched dir (and the durable dir) lands on, and whether it survives."""
    verb = profile.meter_stop.verb
    out: list[Finding] = []
    for label, path in [*(("checkpoints", w) for w in watch), ("durable copies", durable)]:
        tier = profile.tier_for(str(path), str(home))
        if tier is None:
            out.append(Finding("ok", "watch_tier", f"{label} in {path}: on no tier this profile describes"))
            continue
        if profile.survives_meter_stop(tier):
            out.append(Finding("ok", "watch_tier", f"{label} in {path}: tier {tier.name} survives {verb}"))
            continue
        level: Literal["warn", "error"] = "warn" if label == "checkpoints" else "error"
        if label == "checkpoints":
            msg = (
                f"checkpoints in {path} land on tier {tier.name!r}, which does NOT survive {verb!r}: "
                "only their durable copies will; keep `down` the only way this box is stopped"
            )
        else:
            msg = (
                f"the durable directory {path} is on tier {tier.name!r}, which does NOT survive {verb!r}: "
                "durable copies there are lost with the box; point --durable at a tier that survives it"
            )
        out.append(Finding(level, "watch_tier", msg))
    return out
