"""The gate: the one predicate that allows `down` (and any deletion of box data).

It gathers evidence from both ends — the sidecar's current claims, jobs and unsealed files, and
the pulled tree re-verified byte for byte right now — and refuses, with a machine-readable reason
for each problem, unless everything holds and the user named the box. Any doubt refuses: an
unreachable sidecar, a missing marker, a marker bound to another manifest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import __version__
from controller.client import SidecarClient
from controller.errors import ControllerError, Reason, SidecarUnreachable
from controller.state import Box
from controller.verify import VerifyReport, read_marker, verify_tree


@dataclass(frozen=True)
class Check:
    """One row of the evidence table."""

    name: str
    ok: bool
    detail: str


@dataclass
class Evidence:
    box: str
    pulled_dir: str
    claims: list[pb.Claim] = field(default_factory=list)
    box_manifest_digest: str = ""
    unsealed: list[str] = field(default_factory=list)
    jobs: list[pb.Job] = field(default_factory=list)
    verify: VerifyReport | None = None
    marker_digest: str = ""


@dataclass
class Verdict:
    box: str
    allowed: bool
    reasons: list[Reason]
    checks: list[Check]
    evidence_digest: str
    box_manifest_digest: str
    confirmed: bool

    def to_json(self) -> dict[str, object]:
        return {
            "box": self.box,
            "allowed": self.allowed,
            "reasons": [r.to_json() for r in self.reasons],
            "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "evidence_digest": self.evidence_digest,
            "manifest_digest": self.box_manifest_digest,
            "confirmed": self.confirmed,
        }


async def gather(
    client: SidecarClient | None, box: Box, pulled_dir: Path | None
) -> tuple[Evidence, list[Reason]]:
    ev = Evidence(box=box.name, pulled_dir=str(pulled_dir or ""))
    reasons: list[Reason] = []
    if client is None:
        reasons.append(Reason("SIDECAR_UNREACHABLE", detail="no sidecar socket for this box"))
    else:
        try:
            await client.hello()
            listing = await client.list_artifacts()
            jobs = await client.list_jobs()
        except (SidecarUnreachable, ControllerError) as e:
            reasons.append(Reason("SIDECAR_UNREACHABLE", detail=str(e)))
        else:
            ev.claims = list(listing.claims)
            ev.box_manifest_digest = listing.manifest_digest
            ev.unsealed = list(listing.unsealed)
            ev.jobs = [j for j in jobs.jobs if j.state == pb.JOB_STATE_RUNNING]
    if pulled_dir is None:
        reasons.append(
            Reason("NOT_PULLED", detail=f"nothing pulled yet: run `boxwarden pull {box.name} --to DIR`")
        )
    else:
        try:
            ev.verify = verify_tree(
                pulled_dir, roster=box.roster or None, write_marker=False, verifier_version=__version__
            )
        except ControllerError as e:  # the tree is gone or unreadable: nothing there proves anything
            reasons.append(Reason("NOT_PULLED", detail=str(e)))
            return ev, reasons
        try:
            marker = read_marker(pulled_dir)
        except ControllerError as e:
            marker = None
            reasons.append(Reason("NOT_VERIFIED", detail=str(e)))
        if marker is not None:
            ev.marker_digest = str(marker.get("manifest_digest", ""))
    return ev, reasons


def judge(ev: Evidence, early: list[Reason], *, confirm: str | None, dry_run: bool) -> Verdict:
    reasons = list(early)
    checks: list[Check] = []
    reachable = not any(r.code == "SIDECAR_UNREACHABLE" for r in reasons)
    checks.append(Check("sidecar reachable", reachable, "answered Hello" if reachable else "no answer"))

    if ev.verify is not None:
        v = ev.verify
        reasons.extend(v.reasons)
        checks.append(
            Check(
                "pulled tree re-verified",
                v.ok,
                f"{v.files} files, {v.bytes} bytes, exact set + size + blake3 + load probe"
                if v.ok
                else f"{len(v.reasons)} problem(s) in {ev.pulled_dir}",
            )
        )
        if not ev.marker_digest:
            if not any(r.code == "NOT_VERIFIED" for r in reasons):
                reasons.append(
                    Reason("NOT_VERIFIED", detail=f"no PULL_VERIFIED.json in {ev.pulled_dir}: run verify")
                )
            checks.append(Check("verification marker", False, "missing"))
        else:
            checks.append(Check("verification marker", True, f"bound to manifest {ev.marker_digest[:16]}…"))
        if reachable:
            stale = []
            if ev.marker_digest and ev.marker_digest != ev.box_manifest_digest:
                stale.append(f"marker is bound to {ev.marker_digest[:16]}…")
            if v.manifest_digest and v.manifest_digest != ev.box_manifest_digest:
                stale.append(f"pulled MANIFEST.json is {v.manifest_digest[:16]}…")
            if stale:
                reasons.append(
                    Reason(
                        "MANIFEST_STALE",
                        detail=f"the box's claims are now {ev.box_manifest_digest[:16]}… but the "
                        + " and the ".join(stale)
                        + ": new or changed claims since verification — pull and verify again",
                    )
                )
            checks.append(
                Check(
                    "manifest current",
                    not stale,
                    "; ".join(stale) or f"{ev.box_manifest_digest[:16]}… on both ends",
                )
            )
    else:
        checks.append(Check("pulled tree re-verified", False, "no pulled tree"))

    if reachable:
        for j in ev.jobs:
            reasons.append(Reason("JOB_RUNNING", detail=f"job {j.id} (pid {j.pid}) {' '.join(j.argv)[:80]}"))
        checks.append(
            Check("no job running", not ev.jobs, ", ".join(j.id for j in ev.jobs) or "none running")
        )
        for p in ev.unsealed:
            reasons.append(
                Reason("UNSEALED_WRITES", path=p, detail="being written, or changed since its claim")
            )
        checks.append(Check("no unsealed writes", not ev.unsealed, ", ".join(ev.unsealed[:5]) or "none"))
        waiting = [c for c in ev.claims if not c.durable]
        for c in waiting:
            reasons.append(Reason("NOT_DURABLE", path=c.path, detail=c.push_error or "push not proven yet"))
        checks.append(
            Check(
                "every claim durable",
                not waiting,
                f"{len(ev.claims) - len(waiting)}/{len(ev.claims)} durable (re-read and hashed equal)",
            )
        )

    confirmed = confirm == ev.box
    if not dry_run:
        if not confirmed:
            reasons.append(
                Reason("NOT_CONFIRMED", detail=f"name the box to confirm: --confirm {ev.box}")
                if confirm is None
                else Reason("NOT_CONFIRMED", detail=f"{confirm!r} is not the box's name {ev.box!r}")
            )
        checks.append(Check("confirmed by naming the box", confirmed, confirm or "not given"))
    reasons = _dedupe(reasons)
    return Verdict(
        box=ev.box,
        allowed=not reasons,
        reasons=reasons,
        checks=checks,
        evidence_digest=_evidence_digest(ev),
        box_manifest_digest=ev.box_manifest_digest,
        confirmed=confirmed,
    )


def _dedupe(reasons: list[Reason]) -> list[Reason]:
    seen: set[tuple[str, str, str]] = set()
    out = []
    for r in reasons:
        key = (r.code, r.path, r.detail)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _evidence_digest(ev: Evidence) -> str:
    doc = {
        "box": ev.box,
        "at_ns": time.time_ns(),
        "manifest": ev.box_manifest_digest,
        "marker": ev.marker_digest,
        "claims": [[c.path, c.size, c.blake3, c.durable] for c in ev.claims],
        "jobs": [j.id for j in ev.jobs],
        "unsealed": ev.unsealed,
        "verified_ok": ev.verify.ok if ev.verify else None,
    }
    return blake3.blake3(json.dumps(doc, sort_keys=True).encode()).hexdigest()
