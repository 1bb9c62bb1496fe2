"""Sealer: decides when a watched file is finished, claims it, pushes it, and proves the copy.

The life of an artifact, for one path at a time (a per-path lock serialises it):
  close-after-write / rename-into-place / rescan  →  settle (size and mtime stable for settle_s,
  no process holds it open for writing)  →  stage: ONE read pass hashes it and writes the durable
  temp  →  ledger claim (supersedes the old one)  →  commit (fsync, rename, fsync dir)  →  verify
  (re-read from the device)  →  durable.
The claim is recorded BEFORE the rename: once new bytes sit at the durable path, no current claim
may still name the old ones. A kill at any point leaves either a not-durable claim (retried by
`push_pending`) or no claim (re-sealed by the rescan) — never a false durable claim.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import stat
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TypeVar

from sidecar.errors import ChangedError, PreconditionError, SidecarError, StorageError
from sidecar.hashing import hash_file_read
from sidecar.identity import FileIdentity
from sidecar.ledger import ClaimRow, Ledger
from sidecar.manifest import manifest_digest
from sidecar.openfiles import open_for_write, write_lease_blocked
from sidecar.paths import ArtifactNamer, display
from sidecar.storage import DurableStore, StagedCopy
from sidecar.watcher import FsChange

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Sealer:
    def __init__(
        self,
        *,
        namer: ArtifactNamer,
        ledger: Ledger,
        store: DurableStore,
        executor: Executor,
        scan_executor: Executor,
        settle_s: float,
        notify: Callable[[], None],
    ) -> None:
        self._namer = namer
        self._ledger = ledger
        self._store = store
        self._executor = executor
        # Walks and /proc scans get their own thread: a listing must not queue behind a 50 GiB push.
        self._scan_executor = scan_executor
        self._settle_s = settle_s
        self._notify = notify
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _scan(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._scan_executor, fn, *args)

    def _lock(self, art: str) -> asyncio.Lock:
        return self._locks.setdefault(art, asyncio.Lock())

    # -- inputs -----------------------------------------------------------------------------------

    def on_change(self, change: FsChange) -> None:
        if change.kind == "done":
            self.candidate(change.path)
        elif change.kind == "gone":
            art = self._namer.to_artifact(change.path)
            if art is not None:
                self._spawn(f"gone:{art}", self._gone(art, change.path))
        else:
            self._spawn("rescan", self.rescan())

    def candidate(self, path: Path) -> None:
        """A file may be finished: settle it and seal it (debounced per path)."""
        art = self._namer.claimable(path)
        if art is None:
            return
        if art in self._tasks:
            self._again.add(art)
            return
        self._spawn(art, self._settle_and_seal(art, path))

    def _spawn(self, key: str, coro: object) -> None:
        if key in self._tasks:
            coro.close()  # type: ignore[attr-defined]
            return
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks[key] = task
        task.add_done_callback(functools.partial(self._done, key))

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("sealing %s failed", key, exc_info=task.exception())
        if key in self._again:
            self._again.discard(key)
            try:
                self.candidate(self._namer.to_abs(key))
            except SidecarError as e:
                logger.warning("not re-sealing %s: %s", key, e)

    async def rescan(self) -> None:
        """Walk the watched dirs: seal what changed, end claims whose file is gone."""
        walked = await self._scan(self._namer.walk)
        seen = set()
        for art, path, st in walked:
            seen.add(art)
            claim = self._ledger.current(art)
            if claim is None or claim.identity != FileIdentity.of(st):
                self.candidate(path)
        for claim in self._ledger.current_claims():
            if claim.path not in seen and claim.path not in self._tasks:
                try:
                    await self._gone(claim.path, None)
                except SidecarError as e:  # one odd claim must not stop the rest of the rescan
                    logger.warning("rescan: cannot check %s: %s", claim.path, e)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- sealing ----------------------------------------------------------------------------------

    async def _settle_and_seal(self, art: str, path: Path) -> None:
        ident = await self._settled(path)
        if ident is None:
            return
        if art in self._again:
            return  # it changed again while settling; _done starts over
        if await self._scan(self._open_for_write, path):
            # A writer still holds it: its close event (or the rescan) brings it back.
            logger.debug("%s is open for writing; not sealed yet", art)
            return
        async with self._lock(art):
            await self._seal(art, path, ident)

    def _open_for_write(self, path: Path) -> bool:
        """Does any process hold this file open for writing? In doubt, yes."""
        lease = write_lease_blocked(path)
        if lease:
            return True
        scan = open_for_write([path.parent], exclude_pids=(os.getpid(),))
        if path in scan.paths:
            return True
        if lease is None and scan.unreadable_pids:
            logger.warning(
                "cannot tell whether %s is being written (no lease, %d processes unreadable); not sealing it",
                path,
                scan.unreadable_pids,
            )
            return True
        return False

    def _space_short(self, size: int) -> str:
        """Why a copy of `size` bytes must not be started now (empty: it fits with room to spare).

        Staging a copy that cannot fit would fill the durable filesystem — often the trainer's own
        disk — on every retry, and make the trainer's next save fail."""
        try:
            st = os.statvfs(self._store.path_for_usage())
        except OSError as e:
            return f"cannot read the durable store's free space: {e.strerror}"
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        reserve = min(1 << 30, total // 50)
        if free >= size + reserve:
            return ""
        return (
            f"won't fit: the durable store has {free} bytes free, this copy needs {size} plus a reserve of "
            f"{reserve}; free space there or point the durable URL at a larger store"
        )

    async def _settled(self, path: Path) -> FileIdentity | None:
        first = _identity(path)
        while first is not None:
            await asyncio.sleep(self._settle_s)
            second = _identity(path)
            if second == first:
                return second
            first = second
        return None

    async def _seal(self, art: str, path: Path, ident: FileIdentity) -> None:
        claim = self._ledger.current(art)
        if claim is not None and claim.identity == ident:
            return  # already claimed (e.g. a read-only touch, or a restart)
        staged: StagedCopy | None = None
        push_error = self._space_short(ident.size)
        try:
            if not push_error:
                staged = await self._run(self._store.stage, path, art)
        except ChangedError:
            self._again.add(art)
            return
        except StorageError as e:
            push_error = str(e)
        except FileNotFoundError:
            return
        if staged is None:
            # The durable store is failing; the artifact still gets its claim, from a plain hash.
            # Read-based: the trainer may truncate this file under us, and a mapped read would SIGBUS.
            digest = await self._run(hash_file_read, path)
            if _identity(path) != ident:
                self._again.add(art)
                return
            claim = self._ledger.add_claim(art, ident.size, digest, ident)
            self._ledger.mark_push_failed(claim.id, push_error)
            self._notify()
            return
        if staged.source != ident:
            await self._run(self._store.discard, staged)
            self._again.add(art)
            return
        claim = self._ledger.add_claim(art, staged.size, staged.digest, ident)
        self._notify()
        await self._finish(claim, staged)

    async def _finish(self, claim: ClaimRow, staged: StagedCopy) -> bool:
        """Commit, re-read, and mark durable; True if the claim is now durable."""
        try:
            await self._run(self._store.commit, staged)
            ok = await self._run(self._store.verify, claim.path, claim.blake3)
        except SidecarError as e:
            await self._run(self._store.discard, staged)
            self._ledger.mark_push_failed(claim.id, str(e))
            self._notify()
            return False
        if ok:
            ok = self._ledger.mark_durable(claim.id)
        else:
            self._ledger.mark_push_failed(claim.id, "the durable copy did not hash equal on re-read")
        self._notify()
        return ok

    async def push_pending(self) -> int:
        """Push every current claim that is not durable yet, newest first. Returns how many became durable."""
        made = 0
        for claim in self._ledger.not_durable():
            async with self._lock(claim.path):
                now = self._ledger.current(claim.path)
                if now is None or now.id != claim.id or now.durable:
                    continue
                # A kill after the rename but before the ledger said so leaves a good copy in place.
                try:
                    if await self._run(self._store.verify, claim.path, claim.blake3):
                        made += int(self._ledger.mark_durable(claim.id))
                        self._notify()
                        continue
                except StorageError as e:
                    self._ledger.mark_push_failed(claim.id, str(e))
                    continue
                path = self._namer.to_abs(claim.path)
                if _identity(path) != claim.identity:
                    self.candidate(path)  # changed or gone since the claim: the rescan settles it
                    continue
                short = self._space_short(claim.size)
                if short:
                    self._ledger.mark_push_failed(claim.id, short)
                    continue
                try:
                    staged = await self._run(self._store.stage, path, claim.path)
                except (ChangedError, FileNotFoundError):
                    self.candidate(path)
                    continue
                except StorageError as e:
                    self._ledger.mark_push_failed(claim.id, str(e))
                    self._notify()
                    continue
                if staged.digest != claim.blake3 or staged.source != claim.identity:
                    await self._run(self._store.discard, staged)
                    self.candidate(path)
                    continue
                made += int(await self._finish(claim, staged))
        return made

    async def _gone(self, art: str, path: Path | None) -> None:
        async with self._lock(art):
            p = path or self._namer.to_abs(art)
            if _identity(p) is not None:
                return  # replaced by a new file in the meantime: the "done" event handles it
            if self._ledger.end_claim(art, "deleted or renamed away on the box", "ARTIFACT_REMOVED"):
                self._notify()

    # -- evidence and release -----------------------------------------------------------------------

    def _unsealed(self, claims: dict[str, ClaimRow]) -> list[str]:
        """Files being written, not sealed as they are now, or never claimable. Blocking: off-loop.

        Being written: the kernel's lease answer, or a writer fd seen in /proc (temp names too:
        a `best.pt.tmp` being written is a save in progress). In doubt (no lease answer and
        unreadable processes), the file counts as being written."""
        out: set[str] = set()
        scan = open_for_write(list(self._namer.roots), exclude_pids=(os.getpid(),))
        for p in scan.paths:
            art = self._namer.to_artifact(p)
            if art is not None:
                out.add(display(art))
        for e in self._namer.walk_all():
            if e.kind == "unclaimable":
                out.add(display(e.art))
                continue
            if e.kind == "artifact":
                claim = claims.get(e.art)
                if claim is None or claim.identity != FileIdentity.of(e.st):
                    out.add(e.art)
                    continue
            lease = write_lease_blocked(e.path)
            if lease or (lease is None and scan.unreadable_pids):
                out.add(display(e.art))
        return sorted(out)

    async def unsealed(self) -> list[str]:
        # The ledger connection belongs to the loop thread: snapshot the claims here, walk off-loop.
        claims = {c.path: c for c in self._ledger.current_claims()}
        return await self._scan(self._unsealed, claims)

    async def release(self, digest: str, jobs_running: bool) -> tuple[list[str], list[str]]:
        """Delete the box-side copies of the current manifest's claims, and nothing else.

        Every durable copy is re-read first: the ledger's word is not enough to delete the only
        other copy. Each file is then renamed aside, its identity checked on the renamed name (a
        writer cannot slip a new file in between), and only then unlinked.
        """
        claims = self._ledger.current_claims()
        if digest != manifest_digest(claims):
            raise PreconditionError("the manifest changed since it was verified (MANIFEST_STALE)")
        if jobs_running:
            raise PreconditionError("a supervised job is running (JOB_RUNNING)")
        if any(not c.durable for c in claims):
            raise PreconditionError("not every claim is durable (NOT_DURABLE)")
        if await self.unsealed():
            raise PreconditionError("a watched file is being written or is not sealed (UNSEALED_WRITES)")
        bad = []
        for c in claims:
            if not await self._run(self._store.verify, c.path, c.blake3):
                self._ledger.mark_not_durable(c.id, "the durable copy did not hash equal at release")
                bad.append(c.path)
        if bad:
            self._notify()
            raise PreconditionError(f"durable copies failed to verify, nothing deleted (NOT_DURABLE): {bad}")
        deleted: list[str] = []
        kept: list[str] = []
        for c in claims:
            async with self._lock(c.path):
                why = self._delete_if_unchanged(c)
                if why:
                    kept.append(f"{c.path}: {why}")
                    continue
                self._ledger.end_claim(c.path, "released after verified pull", "ARTIFACT_RELEASED")
                deleted.append(c.path)
        self._notify()
        return deleted, kept

    def _delete_if_unchanged(self, c: ClaimRow) -> str:
        """Unlink the claimed file if it is still exactly the claimed one; else say why not."""
        path = self._namer.to_abs(c.path)
        ident = _identity(path)
        if ident is None:
            return "already gone"
        if ident != c.identity:
            return "changed since claim"
        aside = path.with_name(f".{path.name}.bw-release")  # a temp name: never sealed
        os.rename(path, aside)
        if _identity(aside) != c.identity:
            os.rename(aside, path)
            return "changed since claim"
        aside.unlink()
        return ""


def _identity(path: Path) -> FileIdentity | None:
    """The identity of the regular file at `path`; None if there is none (gone, a directory in
    the way, a symlink loop, a FIFO put in its place)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return FileIdentity.of(st) if stat.S_ISREG(st.st_mode) else None
