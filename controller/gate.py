"""The gate: the one predicate that allows `down` (and any deletion of box data).

It gathers evidence from both ends — the sidecar's current claims, jobs and every watched entry
not covered by a claim, and the pulled tree re-verified byte for byte right now — and refuses, with
a machine-readable reason for each problem, unless everything holds and the user named the box.
Any doubt refuses: an unreachable sidecar, a missing marker, a marker bound to another manifest, a
pulled tree that overlaps what it judges. It says only what was checked: the durable line states
how and when each copy was last proven, and the evidence digest is a digest of the evidence itself.

A copy proven only by its store's checksum (proof "server-checksum") refuses the gate (WEAK_PROOF)
unless the user accepted that proof (`down --accept-server-checksum`, recorded in the evidence).
A box whose sidecar does not answer refuses (SIDECAR_UNREACHABLE: it may be a cut link while the
box still writes), unless the user says the box is gone (`down --box-gone`, `controller.gone`):
then the evidence is the last claims list received from it and a pull of that list's durable
copies, and the verdict says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import __version__, absence, proofs, released
from controller.client import SidecarClient
from controller.errors import (
    ControllerError,
    Reason,
    SidecarMismatch,
    SidecarRefused,
    SidecarUnreachable,
    StateError,
    VersionMismatch,
)
from controller.lastlist import GoneBox, Keeper
from controller.manifest import MANIFEST_NAME, read_manifest
from controller.overlap import overlap_problem
from controller.released import Released
from controller.state import Box
from controller.verify import VerifyReport, loaded_by, read_marker, verify_tree

PENDING_CODES = {
    pb.PENDING_WRITING: "UNSEALED_WRITES",
    pb.PENDING_CHANGED: "UNSEALED_WRITES",
    pb.PENDING_TEMP: "TEMP_FILE",
    pb.PENDING_UNCLAIMABLE: "UNCLAIMABLE",
}


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
    pending: list[pb.Pending] = field(default_factory=list)
    excluded_files: int = 0
    excluded_sample: list[str] = field(default_factory=list)
    exclude_patterns: list[str] = field(default_factory=list)
    jobs: list[pb.Job] = field(default_factory=list)
    strays: list[pb.Stray] = field(default_factory=list)
    watch_dirs: list[str] = field(default_factory=list)
    verify: VerifyReport | None = None
    marker_digest: str = ""
    allow_empty: bool = False
    accepted_server_checksum: bool = False  # the user's --accept-server-checksum
    gone: GoneBox | None = None  # --box-gone: judged from the last claims list, the box is gone
    accepted_lost: bool = False  # --accept-lost: what that list could not cover is lost with the box
    released: Released | None = None  # a teardown under way: what its release deleted (controller.released)


@dataclass
class Verdict:
    box: str
    allowed: bool
    reasons: list[Reason]
    checks: list[Check]
    evidence_digest: str
    box_manifest_digest: str
    confirmed: bool
    proofs: dict[str, int] = field(default_factory=dict)  # durable claims by proof kind
    accepted_server_checksum: bool = False
    gone: GoneBox | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "box": self.box,
            "allowed": self.allowed,
            "reasons": [r.to_json() for r in self.reasons],
            "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "evidence_digest": self.evidence_digest,
            "manifest_digest": self.box_manifest_digest,
            "confirmed": self.confirmed,
            "proofs": self.proofs,
            "accepted_server_checksum": self.accepted_server_checksum,
            "box_gone": self.gone.to_json() if self.gone is not None else None,
        }


NOT_GONE = absence.UNPROVEN
"""--box-gone, but nothing proves the box gone (controller.absence says why, and its own code)."""

SIDECAR_FAILURES = (
    "SIDECAR_UNREACHABLE",
    "VERSION_MISMATCH",
    SidecarMismatch.code,
    "SIDECAR_REFUSED",
    "SIDECAR_ERROR",
)
"""Reasons that mean the box's side of the evidence was not had from its own sidecar."""


def sidecar_reason(e: ControllerError) -> Reason:
    """The gate's code for a failure to get the box's side of the evidence, named for what it was."""
    if isinstance(e, SidecarUnreachable):
        return Reason("SIDECAR_UNREACHABLE", detail=str(e))
    if isinstance(e, VersionMismatch):
        return Reason("VERSION_MISMATCH", detail=str(e))
    if isinstance(e, SidecarMismatch):
        return Reason(SidecarMismatch.code, detail=str(e))
    if isinstance(e, SidecarRefused):
        return Reason("SIDECAR_REFUSED", detail=str(e))
    return Reason("SIDECAR_ERROR", detail=str(e))


async def gather(
    client: SidecarClient | None,
    box: Box,
    pulled_dir: Path | None,
    *,
    unreachable: str = "",
    keep: Keeper | None = None,
    release: released.ReleaseAsked | None = None,
) -> tuple[Evidence, list[Reason]]:
    """The box's side of the evidence, asked of its sidecar now, and the pulled tree re-verified.
    `keep` is handed each complete claims list received (the controller keeps the last one).
    `release`: the one the box's unfinished teardown asked for, if any (controller.released)."""
    ev = Evidence(box=box.name, pulled_dir=str(pulled_dir or ""))
    reasons: list[Reason] = []
    hello: pb.HelloResponse | None = None
    if client is None:
        reasons.append(Reason("SIDECAR_UNREACHABLE", detail=unreachable or "no link to this box's sidecar"))
    else:
        try:
            hello = await client.hello()
            listing = await client.list_artifacts()
            if keep is not None:
                keep(hello, listing)
            jobs = await client.list_jobs()
        except ControllerError as e:
            reasons.append(sidecar_reason(e))
        else:
            fill_claims(ev, hello, listing)
            ev.jobs = [j for j in jobs.jobs if j.state == pb.JOB_STATE_RUNNING]
            ev.strays = list(jobs.strays)
    await gather_tree(ev, reasons, box, pulled_dir, hello)
    if client is not None and hello is not None and not ev.claims and not ev.pending:
        ev.released = await released.gather(client, box, pulled_dir, release)
    return ev, reasons


def fill_claims(ev: Evidence, hello: pb.HelloResponse, listing: pb.ListArtifactsResponse) -> None:
    """The evidence a claims list (and the Hello beside it) gives."""
    ev.claims = list(listing.claims)
    ev.box_manifest_digest = listing.manifest_digest
    ev.pending = list(listing.pending)
    ev.excluded_files = listing.excluded_files
    ev.excluded_sample = list(listing.excluded_sample)
    ev.exclude_patterns = list(hello.exclude_patterns)
    ev.watch_dirs = list(hello.watch_dirs)


async def gather_tree(
    ev: Evidence, reasons: list[Reason], box: Box, pulled_dir: Path | None, hello: pb.HelloResponse | None
) -> None:
    """The pulled tree's side of the evidence: where it lies (`hello`: the box's directories it must
    not overlap), its marker, and every byte of it hashed again."""
    if pulled_dir is None:
        reasons.append(
            Reason("NOT_PULLED", detail=f"nothing pulled yet: run `boxwarden pull {box.name} --to DIR`")
        )
        return
    if hello is not None:
        overlap = overlap_problem(pulled_dir, hello)
        if overlap:
            # A "pulled" tree inside what it judges proves nothing: release would delete its bytes.
            reasons.append(Reason("EVIDENCE_OVERLAP", path=str(pulled_dir), detail=overlap))
            return
    try:
        marker = read_marker(pulled_dir)
    except StateError as e:
        marker = None
        reasons.append(Reason("NOT_VERIFIED", detail=str(e)))
    if marker is not None:
        ev.marker_digest = str(marker.get("manifest_digest", ""))
        ev.allow_empty = bool(marker.get("allow_empty", False))
    try:
        # Every byte is hashed again; a checkpoint the verify of this manifest loaded is not loaded
        # again (the same bytes load the same way, and `import torch` costs seconds).
        ev.verify = verify_tree(
            pulled_dir,
            roster=box.roster or None,
            write_marker=False,
            verifier_version=__version__,
            allow_empty=ev.allow_empty,
            loaded=loaded_by(marker) if marker is not None else None,
        )
    except ControllerError as e:  # the tree is gone or unreadable: nothing there proves anything
        reasons.append(Reason("NOT_PULLED", detail=str(e)))
        return
    run = _tree_run(pulled_dir)
    if run and run != box.run_id:
        # Another run's tree: its marker (an empty run's acknowledgement too) says nothing of this one.
        reasons.append(
            Reason(
                "NOT_PULLED",
                path=str(pulled_dir),
                detail=f"the pulled tree is of run {run}; {box.name} runs {box.run_id}: pull this run "
                f"(`boxwarden pull {box.name} --to DIR`), then verify it",
            )
        )


def _tree_run(pulled_dir: Path) -> str:
    """The run a pulled tree's MANIFEST.json says it holds ("" when it cannot say)."""
    try:
        return read_manifest(pulled_dir / MANIFEST_NAME).run_id
    except ControllerError:
        return ""


def judge(ev: Evidence, early: list[Reason], *, confirm: str | None, dry_run: bool) -> Verdict:
    reasons = list(early)
    checks: list[Check] = []
    failed = [r for r in reasons if r.code in SIDECAR_FAILURES]
    reachable = not failed
    gone = ev.gone
    live = reachable and gone is None  # the box's state asked now (else: the last list of a gone box)
    if gone is None:
        checks.append(
            Check(
                "sidecar answered",
                reachable,
                "Hello, ListArtifacts, ListJobs" if reachable else failed[0].code,
            )
        )
    else:
        proven = bool(gone.absence)
        if not proven:
            code = gone.presence_code or NOT_GONE
            reasons.append(Reason(code, detail=gone.presence or "nothing proves the box gone"))
        checks.append(
            Check(
                "box gone (--box-gone)",
                reachable and proven,
                f"your word, the sidecar does not answer ({gone.unreachable}) and "
                + (gone.absence if proven else "nothing proves the box gone")
                + f"; judged: durable bytes from the last claims list received at {gone.received_at}, "
                "not the box's live state",
            )
        )

    # Claims a release of this teardown deleted, held by the tree its marker verified: not an
    # empty run, and the marker stands for them (controller.released).
    freed = ev.released is not None and live and not ev.claims and ev.released.proves(ev.marker_digest)
    if ev.verify is not None:
        v = ev.verify
        # (what the release deleted is retired in a tree pulled since: not there, not the roster's;
        # the marker was written for that manifest, roster and all)
        found = [r for r in v.reasons if not (freed and r.code in ("EMPTY", "ROSTER_INCOMPLETE"))]
        reasons.extend(found)
        checks.append(
            Check(
                "pulled tree re-verified",
                not found,
                f"{v.files} files, {v.bytes} bytes, exact set + size + blake3 + load probe"
                + (
                    " (an empty run, acknowledged with verify --allow-empty)"
                    if ev.allow_empty and not v.files and not freed
                    else ""
                )
                if not found
                else f"{len(found)} problem(s) in {ev.pulled_dir}",
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
        if reachable:  # the box's claims are known: asked now, or its last list (gone)
            current = {ev.box_manifest_digest} | ({ev.released.digest} if freed and ev.released else set())
            stale = []
            if ev.marker_digest and ev.marker_digest not in current:
                stale.append(f"marker is bound to {ev.marker_digest[:16]}…")
            if v.manifest_digest and v.manifest_digest not in current:
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
            both = f"{ev.box_manifest_digest[:16]}… on both ends"
            if freed and ev.marker_digest != ev.box_manifest_digest:
                both = "the box claims nothing: its claims went in this teardown's release (see below)"
            checks.append(Check("manifest current", not stale, "; ".join(stale) or both))
            if freed and ev.released is not None:
                checks.append(Check(released.CHECK, True, released.detail(ev.released)))
    else:
        checks.append(Check("pulled tree re-verified", False, "no pulled tree"))

    if live:
        for j in ev.jobs:
            reasons.append(Reason("JOB_RUNNING", detail=_job_line(ev.box, j)))
        for x in ev.strays:  # never JOB_RUNNING: it is no job, and the user may not know it for one
            reasons.append(
                Reason(
                    "STRAY_PROCESS",
                    detail=f"pid {x.pid} ({x.command[:240]}) {x.why or 'works in ' + x.cwd}, outside every "
                    "job's process tree: it may be writing for one (a tmux session, `at`, a trainer "
                    "started by hand); stop it, or if it is only your shell, leave that directory",
                )
            )
        running = [j.id for j in ev.jobs]
        checks.append(Check("no job running", not running, ", ".join(running) or "none running"))
        strays = [f"pid {x.pid}" for x in ev.strays]
        checks.append(Check("no stray process", not strays, ", ".join(strays) or "none works there"))
        for p in ev.pending:
            reasons.append(
                Reason(PENDING_CODES.get(p.state, "UNSEALED_WRITES"), path=p.path, detail=p.detail)
            )
        shown = ", ".join(p.path for p in ev.pending[:5]) + (" …" if len(ev.pending) > 5 else "")
        where = ", ".join(ev.watch_dirs)
        checks.append(
            Check(
                "every watched file claimed",
                not ev.pending,
                shown or (f"yes, in {where}" if where else "yes"),
            )
        )
        excluded = (
            f"{ev.excluded_files} files excluded by {', '.join(ev.exclude_patterns)} (given at up)"
            + (": " + ", ".join(ev.excluded_sample) if ev.excluded_sample else "")
            + (" …" if ev.excluded_files > len(ev.excluded_sample) else "")
            if ev.exclude_patterns
            else "no exclude patterns"
        )
        checks.append(Check("exclusions", True, excluded))
    elif gone is not None and reachable:
        if not ev.accepted_lost:
            for p in ev.pending:
                reasons.append(
                    Reason(
                        "LOST_WITH_BOX",
                        path=p.path,
                        detail=f"not covered by a claim in the last list ({p.detail or 'being written'}): "
                        "its bytes went with the box; `--accept-lost` says you accept that",
                    )
                )
        lost = f"{gone.pending} entries not covered by a claim, lost with the box" if gone.pending else "none"
        accepted = " (accepted: --accept-lost)" if gone.pending and ev.accepted_lost else ""
        checks.append(
            Check(
                "the box's live state",
                not gone.pending or ev.accepted_lost,
                f"not judged: its jobs and watched files went with it; in the last list: {lost}{accepted}",
            )
        )
    if reachable:
        waiting = [c for c in ev.claims if not c.durable]
        for c in waiting:
            reasons.append(Reason("NOT_DURABLE", path=c.path, detail=c.push_error or "push not proven yet"))
        checks.append(
            Check(
                "every claim durable",
                not waiting,
                proofs.durable_detail(ev.claims, len(waiting), gone=gone is not None),
            )
        )
        # A gone box's copies were read and hashed here (the pull from durable, and again at down):
        # the proof that counts is this controller's own, whatever the sidecar's was.
        weak = [] if gone is not None else proofs.weak(ev.claims, accepted=ev.accepted_server_checksum)
        reasons.extend(weak)
        checks.append(
            Check(
                "durable proofs",
                not weak,
                proofs.check_detail(ev.claims, accepted=ev.accepted_server_checksum, gone=gone is not None),
            )
        )
    if gone is not None:
        if not gone.durable_pull:
            reasons.append(Reason("NOT_PULLED", path=ev.pulled_dir, detail=gone.durable_pull_problem))
        checks.append(
            Check(
                "pulled from durable storage",
                bool(gone.durable_pull),
                f"{gone.durable_pull}: every claim of that list read from {gone.durable_root}"
                if gone.durable_pull
                else gone.durable_pull_problem,
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
        evidence_digest=_evidence_digest(ev, reasons),
        box_manifest_digest=ev.box_manifest_digest,
        confirmed=confirmed,
        proofs=proofs.counts(ev.claims),
        accepted_server_checksum=ev.accepted_server_checksum,
        gone=gone,
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


def evidence_document(ev: Evidence, reasons: list[Reason]) -> dict[str, object]:
    """Everything the verdict rests on, and nothing else (no clock): equal evidence, equal digest."""
    v = ev.verify
    return {
        "box": ev.box,
        "pulled_dir": ev.pulled_dir,
        "manifest": ev.box_manifest_digest,
        "marker": ev.marker_digest,
        "allow_empty": ev.allow_empty,
        "claims": [
            [c.path, c.size, c.blake3, c.durable, c.proven_at_unix_ns, proofs.proof_kind(c), c.durable_only]
            for c in ev.claims
        ],
        "accepted_server_checksum": ev.accepted_server_checksum,
        "accepted_lost": ev.accepted_lost,
        "box_gone": ev.gone.to_json() if ev.gone is not None else None,
        "released": ev.released.digest if ev.released is not None else None,
        "jobs": [[j.id, list(j.live_pids)] for j in ev.jobs],
        "strays": [[x.pid, x.cwd] for x in ev.strays],
        "pending": [[p.path, int(p.state), p.detail] for p in ev.pending],
        "excluded": [ev.excluded_files, ev.exclude_patterns, ev.excluded_sample],
        "verified": None
        if v is None
        else {
            "ok": v.ok,
            "files": v.files,
            "bytes": v.bytes,
            "manifest": v.manifest_digest,
            "probes": [p.to_json() for p in v.probes],
        },
        "reasons": [r.to_json() for r in reasons],
    }


def _evidence_digest(ev: Evidence, reasons: list[Reason]) -> str:
    doc = evidence_document(ev, reasons)
    return blake3.blake3(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _job_line(box: str, j: pb.Job) -> str:
    live = " ".join(map(str, j.live_pids)) or "none seen"
    line = f"job {j.id} (pid {j.pid}; live: {live}) {' '.join(j.argv)[:80]}"
    if j.keeper_lost:
        line += (
            ": its keeper (the process that holds every process of the job) was killed before the "
            "job ended, so processes of it may run where boxwarden cannot see them; look with "
            "`ps -eo pid,ppid,sid,args`, end any of them, then end the job with "
            f"`boxwarden stop {box} {j.id}`"
        )
    return line
