"""The profile's checks at `up`, decided here from facts established on the box.

The box-side checks (`durable_writable`, `inode_headroom`) run in `sidecar.launch start` and come
back as findings; the tier check runs here, on the real paths the box resolved (`sidecar.launch
resolve`). An `error` finding refuses `up`; a `warn` finding is printed loudly and `up` goes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from controller.profiles import Profile, Tier

BOX_SIDE = ("durable_writable", "inode_headroom")


@dataclass(frozen=True)
class Finding:
    level: Literal["ok", "warn", "error"]
    check: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"level": self.level, "check": self.check, "message": self.message}

    @classmethod
    def from_json(cls, d: Mapping[str, str]) -> Finding:
        level = d["level"]
        if level not in ("ok", "warn", "error"):
            level = "error"
        return cls(level, d["check"], d["message"])  # type: ignore[arg-type]


def box_side_request(profile: Profile, *, durable_dir: bool = True) -> dict[str, object]:
    """What `sidecar.launch start` checks on the box for this profile. Both checks are about a
    durable directory: a bucket gets neither (the sidecar proves it can write there as it starts)."""
    return {
        "checks": [c for c in profile.checks if c in BOX_SIDE] if durable_dir else [],
        "inode_min_free": profile.inode_min_free,
        "inode_cap": profile.inode_cap,
    }


def tier_of(profile: Profile, real: str, tiers: Mapping[str, str]) -> Tier | None:
    """The tier a box path (resolved on the box) lands on: the tier whose mount (resolved on the
    box: `tiers` maps each tier's path to its real path there) is the longest prefix of it."""
    best: tuple[int, Tier] | None = None
    for t in profile.storage:
        mount = tiers.get(t.path)
        if mount is None:
            continue
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > best[0]):
            best = (len(mount), t)
    return best[1] if best else None


def watch_tier(
    profile: Profile, watch: list[str], durable: str | None, real: Mapping[str, str], tiers: Mapping[str, str]
) -> list[Finding]:
    """Which storage tier each watched dir (and the durable dir; None: an object store, on no tier of
    the box) lands on, and whether it survives."""
    if "watch_tier" not in profile.checks:
        return []
    verb = profile.meter_stop.verb
    out: list[Finding] = []
    durable_copies = [] if durable is None else [("durable copies", durable)]
    for label, path in [*(("checkpoints", w) for w in watch), *durable_copies]:
        tier = tier_of(profile, real.get(path, path), tiers)
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
