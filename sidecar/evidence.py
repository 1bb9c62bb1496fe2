"""Evidence from the box's side: every entry of the watched directories that is NOT covered by a
current claim, with why (being written, changed since its claim, temp-named, unclaimable), and how
many files the user's exclude patterns left out.

This is what the gate's UNSEALED_WRITES / TEMP_FILE / UNCLAIMABLE reasons are made of, and what
release checks before and after it deletes anything. Fail closed: a file some process holds open
for writing, or that the sidecar cannot prove nobody writes (no lease answer and processes whose
fds it cannot read), counts as being written.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from sidecar.compat import SLOTS
from sidecar.ledger import ClaimRow
from sidecar.openfiles import OpenWrites, write_lease_blocked
from sidecar.paths import ArtifactNamer, display
from sidecar.sealer import Sealer

EXCLUDED_SHOWN = 20
WRITING = "WRITING"
CHANGED = "CHANGED"
TEMP = "TEMP"
UNCLAIMABLE = "UNCLAIMABLE"


@dataclass(frozen=True, **SLOTS)
class PendingEntry:
    path: str  # display form (wire-safe)
    state: str  # WRITING | CHANGED | TEMP | UNCLAIMABLE
    detail: str


@dataclass(frozen=True, **SLOTS)
class BoxEvidence:
    pending: list[PendingEntry]
    excluded_files: int
    excluded_sample: list[str]  # the first EXCLUDED_SHOWN of them, by path (display form)


def _collect(
    namer: ArtifactNamer,
    claims: dict[str, ClaimRow],
    dirty: frozenset[str],
    busy: frozenset[str],
    scan: OpenWrites,
) -> BoxEvidence:
    """Blocking: walks the watched dirs (run it off-loop)."""
    out: dict[str, PendingEntry] = {}
    excluded: list[str] = []
    seen: set[str] = set()
    writing = {namer.to_artifact(p) for p in scan.paths}
    in_doubt = scan.unreadable_pids > 0
    for e in namer.walk_all():
        shown = display(e.art)
        if e.kind == "excluded":
            excluded.append(shown)
            continue
        seen.add(e.art)
        if e.kind == "unclaimable":
            out[shown] = PendingEntry(shown, UNCLAIMABLE, e.why)
            continue
        being_written = e.art in writing
        # The /proc scan saw every process's fds: it is the answer. Only where it could not (other
        # users' processes) does each file get the kernel's own word, a lease probe (100,000 of
        # them cost seconds). Release probes every file with a held lease before it deletes it.
        if not being_written and e.kind == "artifact" and in_doubt:
            lease = write_lease_blocked(e.where)
            being_written = bool(lease) or (lease is None and in_doubt)
        if e.kind == "temp":
            why = e.why if not being_written else "a temp name being written (a save in progress)"
            out[shown] = PendingEntry(shown, TEMP, why)
            continue
        if being_written:
            detail = (
                "open for writing"
                if e.art in writing or not in_doubt
                else "cannot tell that nobody writes it"
            )
            out[shown] = PendingEntry(shown, WRITING, detail)
            continue
        assert e.st is not None
        claim = claims.get(e.art)
        if claim is None:
            why = "being sealed" if e.art in busy else "not sealed yet"
            out[shown] = PendingEntry(shown, CHANGED, why)
        elif not claim.identity.matches(e.st) or e.art in dirty:
            out[shown] = PendingEntry(shown, CHANGED, "changed since its claim; being sealed again")
    for path in claims.keys() - seen:
        if claims[path].durable_only:
            continue  # retired: its bytes live in durable storage only, as the claim says
        shown = display(path)
        out[shown] = PendingEntry(shown, CHANGED, "claimed, but no longer on the box as a regular file")
    return BoxEvidence(
        pending=[out[k] for k in sorted(out)],
        excluded_files=len(excluded),
        excluded_sample=sorted(excluded)[:EXCLUDED_SHOWN],
    )


async def unsealed(sealer: Sealer) -> list[str]:
    """The entries of the watched dirs a drain waits for: being written, changed since their
    claim, or temp-named (a save in progress). Unclaimable ones never seal by themselves."""
    ev = await box_evidence(sealer)
    return [p.path for p in ev.pending if p.state != UNCLAIMABLE]


def box_evidence(sealer: Sealer, current: list[ClaimRow] | None = None) -> Coroutine[Any, Any, BoxEvidence]:
    """The pending entries now. The ledger belongs to the loop thread: the claims and the sealer's
    dirty and busy sets are read here, at the call, together; the walk runs off-loop when the result
    is awaited. `current`: the current claims, if the caller just read them (reading 100,000 twice
    would hold the loop for seconds)."""
    claims = {c.path: c for c in (sealer.ledger.current_claims() if current is None else current)}
    dirty = frozenset(sealer.dirty)
    busy = sealer.busy_set()

    async def walk() -> BoxEvidence:
        scan = await sealer.writes.scan()
        return await sealer.scan(_collect, sealer.namer, claims, dirty, busy, scan)

    return walk()
