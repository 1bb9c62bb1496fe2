"""Release: delete the box-side copies of exactly one verified manifest's claims — only bytes that
were just verified — and say what stands in the way of a teardown.

Under one lock (a second release and StartJob are refused meanwhile):
  1. refuse, deleting nothing, unless the manifest is current, no job runs, every watched entry is
     claimed or excluded, and every durable copy is re-read NOW and hashes equal to its claim;
  2. per claim: rename the file aside without replacing anything, hash what was renamed, and unlink
     it only if the digest equals the claim and nobody holds it open for writing; otherwise put it
     back (a byte mismatch re-seals it) and report it kept;
  3. check jobs, watched entries and claims again: anything running, new or changed is refused.
A release that ends with nothing refused latches `released` for the rest of the sidecar's life:
StartJob is refused from then on, since the controller's Shutdown follows and a job started in
between would run on after `down` reported success. A refused release latches nothing.
An aside name is `.bw-release.<claim id>`; `restore_asides` undoes a release the sidecar died in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import fcntl
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.compat import SLOTS
from sidecar.errors import SidecarError
from sidecar.evidence import CHANGED, TEMP, UNCLAIMABLE, WRITING, box_evidence
from sidecar.ledger import ClaimRow
from sidecar.manifest import manifest_digest
from sidecar.openfiles import open_for_write
from sidecar.paths import RELEASE_ASIDE_PREFIX, open_regular
from sidecar.renames import rename_noreplace
from sidecar.sealer import Sealer, identity
from sidecar.storage.fsio import hash_by_read
from sidecar.storage.pace import UNLIMITED, Pace
from sidecar.strays import Caller

logger = logging.getLogger(__name__)

PENDING_CODES = {
    WRITING: "UNSEALED_WRITES",
    CHANGED: "UNSEALED_WRITES",
    TEMP: "TEMP_FILE",
    UNCLAIMABLE: "UNCLAIMABLE",
}


@dataclass(frozen=True, **SLOTS)
class Refusal:
    code: str
    path: str = ""
    detail: str = ""


@dataclass
class ReleaseResult:
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


RunningJobs = Callable[["Caller | None"], Awaitable[list[Refusal]]]  # (a string: 3.9 has no X | Y)
"""A fresh answer: JOB_RUNNING per job whose process tree still lives (or that is about to start),
STRAY_PROCESS per stray process, named (see sidecar.strays); the argument is who asks (pb.Caller)."""


class Releaser:
    def __init__(self, sealer: Sealer, running_jobs: RunningJobs, pace: Pace = UNLIMITED) -> None:
        """`pace`: the stores' byte rate, lifted while a release runs (it runs only once no job
        does: the user waits at `down`, with the meter running)."""
        self._s = sealer
        self._running_jobs = running_jobs
        self._pace = pace
        self._lock = asyncio.Lock()
        self._released = False

    @property
    def active(self) -> bool:
        return self._lock.locked()

    @property
    def released(self) -> bool:
        """A release succeeded on this sidecar: the box's artifacts are gone for its teardown."""
        return self._released

    async def release(
        self, digest: str, caller: Caller | None = None, *, accept_server_checksum: bool = False
    ) -> ReleaseResult:
        """`accept_server_checksum`: the user accepted copies proven by the store's checksum only;
        otherwise every copy is read back whole before any box copy is deleted."""
        if self._lock.locked():
            return ReleaseResult(
                refused=[Refusal("RELEASE_RUNNING", detail="another release is running on this box")]
            )
        async with self._lock:
            with self._pace.lifted():
                return await self._release(digest, caller, accept_server_checksum)

    async def _release(
        self, digest: str, caller: Caller | None, accept_server_checksum: bool
    ) -> ReleaseResult:
        result = ReleaseResult()
        verified = self._s.ledger.current_claims()
        result.refused = await self._preconditions(digest, verified, caller, accept_server_checksum)
        if result.refused:
            return result
        # Only the claims the digest named and that were just proven durable: one sealed while
        # they were proven (the proof takes a while) was never pulled, and `_after` refuses it.
        for v in verified:
            async with self._s.lock(v.path):
                c = self._s.ledger.current(v.path)
                if c is None or c.id != v.id:
                    why = "changed since it was verified" if c is not None else "already gone"
                else:
                    why = await self._release_one(c)
            if why:
                result.kept.append(f"{v.path}: {why}")
            else:
                result.deleted.append(v.path)
        self._s.notify()
        result.refused = await self._after(digest, result, caller)
        self._released = self._released or not result.refused
        return result

    async def _preconditions(
        self, digest: str, claims: list[ClaimRow], caller: Caller | None, cheap_proof: bool
    ) -> list[Refusal]:
        refused: list[Refusal] = []
        if digest != manifest_digest(claims):
            refused.append(
                Refusal("MANIFEST_STALE", detail="the box's claims changed since they were verified")
            )
        refused += await self._running_jobs(caller)
        refused += [
            Refusal("NOT_DURABLE", c.path, c.push_error or "push not proven yet")
            for c in claims
            if not c.durable
        ]
        refused += await self._pending()
        if refused:
            return refused
        # The ledger's word is not enough to delete the only other copy: prove every copy now.
        for c in claims:
            try:
                prove = functools.partial(self._s.store.verify, c.path, c.blake3, reread=not cheap_proof)
                proof = await self._s.run(prove)
            except SidecarError as e:  # the store failed, or a symlink was planted in it
                # Refused, nothing deleted; the claim keeps its state: a failure to look is not
                # a copy found wrong (and a durable-only claim's copy is the only one left).
                refused.append(
                    Refusal("NOT_DURABLE", c.path, f"its durable copy could not be proven now: {e}")
                )
                continue
            if proof:
                self._s.ledger.mark_durable(c.id, proof)  # records when and how it was proven
            else:
                why = "the durable copy did not hash equal when proven again before the release"
                self._s.ledger.mark_not_durable(c.id, why)
                refused.append(Refusal("NOT_DURABLE", c.path, why))
        if refused:
            self._s.notify()
        return refused

    async def _pending(self) -> list[Refusal]:
        ev = await box_evidence(self._s)
        return [Refusal(PENDING_CODES[p.state], p.path, p.detail) for p in ev.pending]

    async def _after(self, digest: str, result: ReleaseResult, caller: Caller | None) -> list[Refusal]:
        """What is on the box now that should stop the teardown."""
        refused = [Refusal("KEPT", k.split(": ", 1)[0], k.split(": ", 1)[-1]) for k in result.kept]
        refused += await self._running_jobs(caller)
        remaining = self._s.ledger.current_claims()
        kept = {k.split(": ", 1)[0] for k in result.kept}
        for c in remaining:
            if c.path not in kept:
                refused.append(
                    Refusal("MANIFEST_STALE", c.path, "sealed during the release: pull and verify it")
                )
        refused += [r for r in await self._pending() if r.path not in kept]
        return refused

    async def _release_one(self, c: ClaimRow) -> str:
        """Delete the claimed file if its bytes are exactly the claim's; else say why not."""
        if c.durable_only:
            # Retention deleted its box copy already; its durable copy was proven again above.
            self._s.ledger.end_claim(
                c.path, "released after verified pull (durable only)", "ARTIFACT_RELEASED"
            )
            return ""
        path = self._s.namer.to_abs(c.path)
        ident = identity(path)
        if ident is None:
            return "already gone"
        # A ctime of its own may move without its bytes (another name of the same file unlinked
        # just now): the hash below decides then. Anything else means it changed.
        same = dataclasses.replace(ident, ctime_ns=0) == dataclasses.replace(c.identity, ctime_ns=0)
        if not same or c.path in self._s.dirty:
            return "changed since its claim"
        aside = path.with_name(f"{RELEASE_ASIDE_PREFIX}{c.id}")
        why, mismatch = await self._s.run(delete_verified, path, aside, c)
        if mismatch:
            self._s.force_reseal(c.path, "the release found other bytes than the claim's")
        if not why:
            self._s.ledger.end_claim(c.path, "released after verified pull", "ARTIFACT_RELEASED")
            self._s.dirty.discard(c.path)
        return why

    async def restore_asides(self) -> int:
        """Put back files a release renamed aside and did not finish with (the sidecar died).
        Call at start, before the watcher's first rescan. Only an aside that IS what its name says
        goes back: claim N of this ledger, in its claimed file's directory, with its claimed bytes
        (a user's own file that happens to be called `.bw-release.7` is left alone, and reported)."""
        restored = 0
        for aside in await self._s.scan(_find_asides, self._s.namer.roots):
            why = await self._restore(aside)
            if why:
                logger.warning("%s: %s; leaving it where it is", aside, why)
            else:
                restored += 1
        return restored

    async def _restore(self, aside: Path) -> str:
        claim = self._s.ledger.claim_by_id(aside.name[len(RELEASE_ASIDE_PREFIX) :])
        if claim is None:
            return "not a release aside of this ledger"
        try:
            target = self._s.namer.to_abs(claim.path)
        except SidecarError as e:
            return f"its claim's path cannot be used: {e}"
        if target.parent != aside.parent:
            return f"claim {claim.id} ({claim.path}) lives in another directory"
        try:
            digest = await self._s.run(_hash_path, aside)
        except OSError as e:
            return f"cannot read it: {e.strerror}"
        if digest != claim.blake3:
            return f"its bytes are not claim {claim.id}'s ({claim.path})"
        try:
            rename_noreplace(aside, target)
        except OSError as e:
            return f"cannot put it back as {claim.path}: {e.strerror}"
        return ""


def _find_asides(roots: tuple[Path, ...]) -> list[Path]:
    """Blocking: every `.bw-release.*` file under the watched dirs (no symlink followed)."""
    found = []
    for root in roots:
        for dirpath, _dirs, names in os.walk(root):
            found += [Path(dirpath) / n for n in names if n.startswith(RELEASE_ASIDE_PREFIX)]
    return found


def _hash_path(path: Path) -> str:
    """Blocking: the digest of the regular file at `path` (OSError for anything else). Opened
    without blocking: a FIFO given an aside's name would otherwise hang the sidecar's start."""
    fd = open_regular(path, follow=False)
    try:
        return hash_by_read(fd)
    finally:
        os.close(fd)


def delete_verified(path: Path, aside: Path, c: ClaimRow) -> tuple[str, bool]:
    """Blocking. Returns (why it was kept or "", whether its bytes differ from the claim).

    The file is held under a read lease from before it is hashed until after it is unlinked: a
    writer's open() of it then breaks the lease (and waits), which is seen before the unlink (the
    file is kept) or right after it (reported, so the teardown stops: that writer's bytes are not
    pulled). Where leases are not available, a /proc scan stands in, and in doubt the file is kept."""
    try:
        rename_noreplace(path, aside)
    except FileExistsError:
        return f"{aside.name} already exists beside it (not ours to replace)", False
    except OSError as e:
        return f"cannot rename it aside: {e.strerror}", False
    why, mismatch = "", False
    fd, leased = -1, False
    try:
        fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        st = os.fstat(fd)
        # A rename sets the inode's ctime: compare what it cannot change; the hash settles the rest.
        if (st.st_dev, st.st_ino, st.st_size) != (c.identity.dev, c.identity.ino, c.identity.size):
            why = "changed since its claim"
        else:
            why, leased = _hold_lease(fd, aside)
        if not why and hash_by_read(fd) != c.blake3:  # the fd is fresh: from byte 0
            why, mismatch = "its bytes differ from the claim", True
        if not why and not _lease_intact(fd, aside, leased):
            why = "someone opened it for writing while it was hashed"
        if not why:
            os.unlink(aside)
            if not _lease_intact(fd, aside, leased):
                return "someone opened it for writing as it was deleted: their bytes are not pulled", False
            _fsync_dir(path.parent)
            return "", False
    except OSError as e:
        why = why or f"cannot read it: {e.strerror}"
    finally:
        if fd >= 0:
            os.close(fd)  # drops the lease
    try:
        rename_noreplace(aside, path)
    except OSError as e:
        return f"{why}; it stays at {aside.name} ({e.strerror}: a new file took its name)", mismatch
    return why, mismatch


def _hold_lease(fd: int, aside: Path) -> tuple[str, bool]:
    """Take a read lease on the open file. Returns (why not to delete it, whether a lease is held);
    without leases (filesystem, privileges), a /proc scan stands in."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        return "", True
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return "someone holds it open for writing", False
    return _scan_problem(aside), False


def _scan_problem(aside: Path) -> str:
    scan = open_for_write([aside.parent], exclude_pids=(os.getpid(),))
    if aside in scan.paths:
        return "someone holds it open for writing"
    if scan.unreadable_pids:
        return "cannot tell that nobody writes it (no lease here, and processes the sidecar cannot see)"
    return ""


def _lease_intact(fd: int, aside: Path, leased: bool) -> bool:
    """No writer has opened the file since the check began (a lease break leaves it F_UNLCK)."""
    if not leased:
        return not _scan_problem(aside)
    return bool(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
