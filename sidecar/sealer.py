"""Sealer: decides when a watched file is finished, claims it, pushes it, and proves the copy.

The life of an artifact, for one path at a time (a per-path lock serialises it):
  close-after-write / rename-into-place / rescan  →  settle (identity stable for settle_s and
  older than its filesystem's timestamp granularity, no process holds it open for writing)  →
  stage: ONE read pass hashes it and writes the durable temp  →  ledger claim (supersedes the old
  one)  →  commit (fsync, rename, fsync dir)  →  verify (re-read from the device)  →  durable.
The claim is recorded BEFORE the rename: once new bytes sit at the durable path, no current claim
may still name the old ones. A kill at any point leaves either a not-durable claim (retried by
`push_pending`) or no claim (re-sealed by the rescan) — never a false durable claim.

A changed file is always noticed: every write or close-after-write event on a claimed file marks it
dirty, and a dirty file is re-hashed at its next seal whatever its stat identity says; a byte
mismatch found elsewhere (a pull, a release) comes back through `force_reseal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TypeVar

from sidecar.ahead import AheadPusher
from sidecar.backlog import Bandwidth
from sidecar.errors import ChangedError, SidecarError, StorageError
from sidecar.hashing import hash_file_read
from sidecar.identity import FileIdentity
from sidecar.ledger import ClaimRow, Ledger
from sidecar.openfiles import write_lease_blocked
from sidecar.paths import ArtifactNamer
from sidecar.storage import DurableStore, StagedCopy
from sidecar.watcher import FsChange
from sidecar.writescan import WriteScans

logger = logging.getLogger(__name__)
T = TypeVar("T")

UNREPORTED = "changed on the box with no report of how (rewritten, or replaced after it left)"
"""Why a claim ends when its path holds other bytes that no watcher event announced."""

LEAVE_REPORT_S = 0.6
"""How late a move out of the watched tree may be reported: watchdog holds an IN_MOVED_FROM for
half a second to pair it with its IN_MOVED_TO. A claimed path that holds another file waits this
long before it is sealed, so that the old file's leaving is known first (see `_settle_and_seal_now`)."""

MAX_SEALING = 64
"""Seals settling or running at once. A burst of 100,000 new files must not become 100,000 tasks
hammering the executors and the ledger together while queries wait behind them."""


class KeyedLocks:
    """One asyncio.Lock per key, alive only while someone holds or waits for it (10,000 artifacts
    leave no 10,000 locks behind)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> (lock, holders and waiters)

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users > 1:
                self._locks[key] = (lock, users - 1)
            else:
                del self._locks[key]


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
        bandwidth: Bandwidth | None = None,
        ahead_min_bytes: int = 0,
    ) -> None:
        """`ahead_min_bytes`: push files that grow past it while they are written (0: never)."""
        self.namer = namer
        self.bandwidth = bandwidth or Bandwidth()
        self._ahead = AheadPusher(store, self.run, min_bytes=ahead_min_bytes) if ahead_min_bytes else None
        self.ledger = ledger
        self.store = store
        self._executor = executor
        # Walks and /proc scans get their own thread: a listing must not queue behind a 50 GiB push.
        self._scan_executor = scan_executor
        self.writes = WriteScans(namer.roots, scan_executor)
        self._settle_s = settle_s
        self.notify = notify
        self._tasks: dict[str, asyncio.Task[None]] = {}  # seals, by artifact path
        # Seals beyond MAX_SEALING wait here, not as tasks: a burst of 10,000 small files is 10,000
        # entries, not 10,000 suspended coroutines (their memory stayed with the process after).
        self._queued: dict[str, Path] = {}
        self._closing = False
        # The sealer's own chores ("rescan", "left", "gone:<path>"), apart from the seals: a file
        # named `rescan` or `gone:last.pt` must never stand for one, nor be dropped for one.
        self._chores: dict[str, asyncio.Task[None]] = {}
        # Claimed paths onto which a file was reported created or renamed since their claim: a
        # file replaced in one reported step. Only then may another inode there supersede the claim.
        self._arrived: set[str] = set()
        self._again: set[str] = set()
        self._locks = KeyedLocks()
        # Claimed artifacts with a write event since their claim: re-hashed at their next seal even
        # if their identity looks unchanged (two writes inside one timestamp tick).
        self.dirty: set[str] = set()
        self.last_walk_s = 0.0
        self.last_rescan_s = 0.0  # the whole of the last rescan: walk, compare, ends
        self._sealing = asyncio.Semaphore(MAX_SEALING)
        self._last_rescan = 0.0
        self._rescan_again = False
        # Directories that left the watched tree (moved away, deleted), as artifact-path prefixes,
        # whose claims `_dirs_left` has yet to end.
        self._left: set[str] = set()
        # Each watched dir's (dev, ino): another directory at its path (the old one moved aside or
        # deleted, one made again) means every claim under it may have left with the old one.
        self._root_ids = {root: _dir_id(root) for root in namer.roots}
        # Claims whose file may have changed while the watcher's events were lost (the kernel's
        # queue overflowed): a change found there is never taken for a rewrite.
        self._unsure: set[str] = set()
        self.on_root_replaced: Callable[[Path], None] = lambda root: None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def scan(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._scan_executor, fn, *args)

    def lock(self, art: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold `art`'s lock: its seal, release and retention never overlap."""
        return self._locks.hold(art)

    # -- inputs -----------------------------------------------------------------------------------

    def on_change(self, change: FsChange) -> None:
        if change.kind in ("done", "dirty", "arrived"):
            art = self.namer.to_artifact(change.path)
            # A write to a CLAIMED file forces a re-hash whatever its identity says; a file with no
            # claim is hashed at its first seal anyway (and its identity is checked around the read).
            if art is not None and self.ledger.current(art) is not None:
                self.dirty.add(art)
                if change.kind == "arrived":
                    self._arrived.add(art)
            if art is not None and art in self._tasks:
                self._again.add(art)  # (a queued one is settled when its turn comes)
            if change.kind != "dirty":
                self.candidate(change.path)
            elif self._ahead is not None:
                claimable = self.namer.claimable(change.path)
                if claimable is not None:
                    self._ahead.on_write(claimable, change.path)
        elif change.kind == "gone":
            art = self.namer.to_artifact(change.path)
            if art is not None:
                # Whatever comes back under this name brings its own "done" event (dirty again).
                self.dirty.discard(art)
                self._arrived.discard(art)
                self._chore(f"gone:{art}", self._gone(art, change.path))
        elif change.kind == "blind":
            # Events were dropped: any claim may have been deleted and written again unseen.
            logger.warning("filesystem events were lost; every changed claim keeps its old copy")
            self._unsure.update(c.path for c in self.ledger.current_claims())
            self._rescan()
        elif change.kind == "left":
            prefix = self.namer.dir_prefix(change.path)
            if prefix is not None:
                self._left.add(prefix)
                self._chore("left", self._dirs_left())
        else:
            self._rescan()

    def _rescan(self) -> None:
        """A rescan soon; one asked for while one runs follows it (that one may have walked past
        the change already)."""
        if "rescan" in self._chores:
            self._rescan_again = True
        else:
            self._chore("rescan", self._rescan_soon())

    def candidate(self, path: Path) -> None:
        """A file may be finished: settle it and seal it (debounced per path)."""
        if self._closing:
            return
        art = self.namer.claimable(path)
        if art is None:
            return
        if art in self._tasks:
            self._again.add(art)
            return
        if art in self._queued or len(self._tasks) >= MAX_SEALING:
            self._queued[art] = path
            return
        self._spawn(art, self._settle_and_seal(art, path))

    def _next_queued(self) -> None:
        while self._queued and len(self._tasks) < MAX_SEALING:
            art = next(iter(self._queued))
            self._spawn(art, self._settle_and_seal(art, self._queued.pop(art)))

    def pending(self, art: str) -> bool:
        """A seal of `art` is queued, settling or running."""
        return art in self._tasks or art in self._queued

    def force_reseal(self, art: str, why: str) -> None:
        """Bytes on disk were found not to match the claim: seal the file again, whatever its identity."""
        logger.warning("%s: %s; sealing it again", art, why)
        self.ledger.add_changed_event(art, why)
        self.dirty.add(art)
        self.notify()
        try:
            self.candidate(self.namer.to_abs(art))
        except SidecarError as e:
            logger.warning("cannot re-seal %s: %s", art, e)

    def _spawn(self, key: str, coro: object) -> None:
        """A seal of the artifact `key`, unless one is settling or running (then it is dropped)."""
        _start(self._tasks, key, coro, functools.partial(self._done, key))

    def _chore(self, key: str, coro: object) -> None:
        """One of the sealer's own chores, unless the same one is under way."""
        _start(self._chores, key, coro, functools.partial(self._chore_done, key))

    def _chore_done(self, key: str, task: asyncio.Task[None]) -> None:
        self._chores.pop(key, None)
        if task.cancelled():
            return
        if task.exception() is not None:
            logger.error("%s failed", key, exc_info=task.exception())
        if key == "rescan" and self._rescan_again:
            self._rescan_again = False
            self._chore("rescan", self._rescan_soon())
        elif key == "left" and self._left:
            self._chore("left", self._dirs_left())  # reported after its last pass, before its end

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("sealing %s failed", key, exc_info=task.exception())
        if self._closing:
            return
        if key in self._again:
            self._again.discard(key)
            try:
                path = self.namer.to_abs(key)
                if self._queued:  # others have waited longer: behind them (none starves)
                    self._queued[key] = path
                else:
                    self.candidate(path)
            except SidecarError as e:
                logger.warning("not re-sealing %s: %s", key, e)
        self._next_queued()

    def busy_set(self) -> frozenset[str]:
        """Artifacts whose seal is queued, settling or running now."""
        return frozenset(self._tasks) | frozenset(self._queued)

    async def _rescan_soon(self) -> None:
        """A rescan asked for by a directory event, at most one per few walk-times: a tree of
        thousands of new directories must not walk everything thousands of times."""
        gap = max(1.0, 20 * self.last_walk_s) - (time.monotonic() - self._last_rescan)
        if gap > 0:
            await asyncio.sleep(gap)
        await self.rescan()

    async def _dirs_left(self) -> None:
        while self._left:
            await asyncio.sleep(0)  # the events of one `rm -rf` or `mv` arrive together: one pass
            prefixes = tuple(self._left)
            self._left.clear()
            self.end_left(prefixes, "moved away or deleted with its directory on the box")

    def end_left(self, prefixes: tuple[str, ...], why: str, *, same_inode_unsure: bool = False) -> int:
        """End every current claim under `prefixes` whose file is no longer at its path: not there,
        or another file (another identity) there. Ended, not superseded: a new file that takes the path
        later never replaces its durable copy (`_keep_retired`). No lock: each end is one ledger
        transaction, and a seal that runs meanwhile finds the claim ended.

        `same_inode_unsure`: a claim whose inode is still there, changed, is only marked unsure
        (its seal keeps it if the bytes are the same, and otherwise ends it as left)."""
        ended = 0
        for c in self.ledger.current_claims():
            if not c.path.startswith(prefixes):
                continue
            try:
                now = identity(self.namer.to_abs(c.path))
            except SidecarError:
                now = None  # a symlink or worse in the way: not the claimed file
            if c.identity == now or (c.durable_only and now is None):
                continue  # exactly the claimed file is at its path (or, retired, none is)
            if same_inode_unsure and c.identity.same_file(now):
                self._unsure.add(c.path)
                continue
            if self.ledger.end_claim(c.path, why, "ARTIFACT_REMOVED"):
                self.dirty.discard(c.path)
                ended += 1
        if ended:
            self.notify()
        return ended

    def check_roots(self) -> None:
        """A watched dir that is another directory now (moved aside or deleted, and made again):
        the claims under it left with the old one; the new one is watched instead."""
        for root, known in self._root_ids.items():
            now = _dir_id(root)
            if now == known:
                continue
            self._root_ids[root] = now
            prefix = self.namer.dir_prefix(root)
            if prefix is not None:
                n = self.end_left((prefix,), "left with its watched directory (moved aside or deleted)")
                logger.warning("%s is another directory now; %d claims under it ended", root, n)
            if now is not None:
                self.on_root_replaced(root)

    async def rescan(self) -> None:
        """Walk the watched dirs: seal what changed, end claims whose file is gone."""
        started = time.monotonic()
        self._last_rescan = started
        self.check_roots()
        if self._ahead is not None:
            self._ahead.reap()
        walked = await self.scan(self.namer.walk)
        self.last_walk_s = time.monotonic() - started
        claims = {c.path: c for c in self.ledger.current_claims()}
        seen = set()
        for art, path, st in walked:
            seen.add(art)
            if self.pending(art):
                continue  # its seal is on the way; a write event brings it back if it changes again
            claim = claims.get(art)
            if claim is None or claim.identity != FileIdentity.of(st) or art in self.dirty:
                self.candidate(path)
            elif art in self._unsure:
                self._unsure.discard(art)  # found exactly as claimed since the events were lost
        for art in claims.keys() - seen:
            if art in self._tasks:
                continue
            try:
                await self._gone(art, None)
            except SidecarError as e:  # one odd claim must not stop the rest of the rescan
                logger.warning("rescan: cannot check %s: %s", art, e)
        self.last_rescan_s = time.monotonic() - started

    async def close(self) -> None:
        self._closing = True  # a seal cancelled below starts no other
        self._queued.clear()
        tasks = [*self._tasks.values(), *self._chores.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.stop_ahead()

    async def stop_ahead(self) -> None:
        """Stop pushing files ahead of their seal (and drop what was pushed): at shutdown."""
        if self._ahead is not None:
            await self._ahead.close()
            self._ahead = None

    # -- sealing ----------------------------------------------------------------------------------

    async def _settle_and_seal(self, art: str, path: Path) -> None:
        async with self._sealing:
            await self._settle_and_seal_now(art, path)

    async def _settle_and_seal_now(self, art: str, path: Path) -> None:
        ident = await self._settled(path)
        if ident is None:
            return
        if art in self._again:
            return  # it changed again while settling; _done starts over
        if await self.open_for_write(path):
            # A writer still holds it: its close event (or the rescan) brings it back.
            logger.debug("%s is open for writing; not sealed yet", art)
            return
        claim = self.ledger.current(art)
        if claim is not None and not claim.identity.same_file(ident):
            # Another file at a claimed path: the old one was replaced in one step (a temp renamed
            # over it: superseded), or it left (deleted, renamed away, moved with its directory) and
            # a new one came: then its claim ends first, and its copy is kept. A leaving can be
            # reported late; wait for it.
            await asyncio.sleep(LEAVE_REPORT_S)
        async with self.lock(art):
            await self._seal(art, path, ident)

    async def open_for_write(self, path: Path) -> bool:
        """Does any process hold this file open for writing? In doubt, yes."""
        lease = await self.scan(write_lease_blocked, path)
        if lease:
            return True
        scan = await self.writes.scan()
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
            space = self.store.space()
        except StorageError as e:
            return f"{e.reason}: cannot read the durable store's free space: {e}"
        if space is None:  # a store without such a notion (an object store) says so when it is full
            return ""
        free, total = space.free_bytes, space.total_bytes
        reserve = min(1 << 30, total // 50)
        if free >= size + reserve:
            return ""
        return (
            f"NO_SPACE: won't fit: the durable store has {free} bytes free, this copy needs {size} plus a "
            f"reserve of {reserve}; free space there or point the durable URL at a larger store"
        )

    async def _settled(self, path: Path) -> FileIdentity | None:
        """The file's identity once it stopped changing for settle_s AND is older than its
        filesystem's timestamp granularity (so that any later write changes the identity)."""
        first = identity(path)
        while first is not None:
            await asyncio.sleep(self._settle_s)
            second = identity(path)
            if second == first:
                assert second is not None
                wait_ns = second.ctime_ns + second.racy_window_ns() - time.time_ns()
                if wait_ns <= 0:
                    return second
                # A ctime in the future (the clock was stepped back since the write) is no reason to
                # hold a sealing slot for hours: any later write carries a ctime that differs from it.
                await asyncio.sleep(min(wait_ns, second.racy_window_ns()) / 1e9)
                second = identity(path)
                if second == first:
                    return second
            first = second
        return None

    async def _seal(self, art: str, path: Path, ident: FileIdentity) -> None:
        self.check_roots()
        was_dirty = art in self.dirty
        self.dirty.discard(art)  # from here on, a new write event marks it again
        await self._seal_now(art, path, ident, was_dirty)
        if was_dirty and art in self._again:
            self.dirty.add(art)  # sealed again soon: what was reported still holds

    async def _seal_now(self, art: str, path: Path, ident: FileIdentity, was_dirty: bool) -> None:
        claim = self.ledger.current(art)
        if claim is not None and claim.durable_only:
            # A file where retention deleted the box copy. Its inode number says nothing (a freed
            # number is soon reused): only its bytes can say it is the claimed file back (a
            # retention that died before it finished puts the file back).
            same = (
                await self._holds_claimed_bytes(art, path, ident, claim)
                if claim.size == ident.size
                else False
            )
            if same is None:
                return
            if same:
                self.ledger.set_durable_only(claim.id, False)
                self.ledger.refresh_identity(claim.id, ident)
                self._unsure.discard(art)
                return
            if self.ledger.end_claim(art, RETIRED_TAKEN, "ARTIFACT_REMOVED"):
                self.notify()  # another file: its copy never replaces the retired one's (`_keep_retired`)
            claim = None
        if claim is not None and claim.identity == ident and not was_dirty:
            self._unsure.discard(art)
            return  # already claimed as it is (a restart, a read-only touch)
        if claim is not None and claim.size == ident.size and claim.durable:
            # Perhaps only its metadata changed (touch, chmod) or it was rewritten with the same
            # bytes: hash first, and keep the proven claim if the bytes are the same.
            same = await self._holds_claimed_bytes(art, path, ident, claim)
            if same is None:
                return
            if same:
                self.ledger.refresh_identity(claim.id, ident)
                self._unsure.discard(art)  # the claimed bytes, whatever happened unseen
                return
        arrived = art in self._arrived
        self._arrived.discard(art)
        if claim is not None and not _rewritten(claim, ident, was_dirty, arrived, art in self._unsure):
            # Other bytes at a claimed path that no report shows to be a rewrite of the claimed
            # file (events the kernel dropped, a directory nothing watched, a change while the
            # sidecar was down): whether it was rewritten or left is unknown, so it left. Its copy
            # is kept (`_keep_retired`), never replaced.
            if self.ledger.end_claim(art, UNREPORTED, "ARTIFACT_REMOVED"):
                self.notify()
            claim = None
        self._unsure.discard(art)
        staged: StagedCopy | None = None
        started = time.monotonic()
        ahead = await self._ahead.take(art, ident) if self._ahead is not None else None
        note = f"{ahead.done} bytes pushed ahead of the seal" if ahead is not None else ""
        # What was pushed ahead already takes its room in the store.
        push_error = self._space_short(ident.size - (ahead.done if ahead is not None else 0))
        if ahead is not None and push_error:
            await self.run(self.store.discard_ahead, ahead)
            ahead = None
        try:
            if not push_error:
                staged = await self.run(functools.partial(self.store.stage, path, art, ahead=ahead))
        except ChangedError:
            self._again.add(art)
            return
        except StorageError as e:
            push_error = push_failure(e)
        except FileNotFoundError:
            return
        if staged is None:
            # The durable store is failing; the artifact still gets its claim, from a plain hash.
            # Read-based: the trainer may truncate this file under us, and a mapped read would SIGBUS.
            digest = await self.run(hash_file_read, path)
            if identity(path) != ident:
                self._again.add(art)
                return
            if claim is not None and claim.blake3 == digest and claim.size == ident.size:
                self.ledger.refresh_identity(claim.id, ident)
                return
            claim = self.ledger.add_claim(art, ident.size, digest, ident)
            self.ledger.mark_push_failed(claim.id, push_error)
            self.notify()
            return
        if staged.source != ident:
            await self.run(self.store.discard, staged)
            self._again.add(art)
            return
        if claim is not None and claim.blake3 == staged.digest and claim.size == staged.size:
            self.ledger.refresh_identity(claim.id, ident)
            if claim.durable:
                await self.run(self.store.discard, staged)
                return
        else:
            claim = self.ledger.add_claim(art, staged.size, staged.digest, ident)
            self.notify()
        await self._finish(claim, staged, started, note)

    async def _holds_claimed_bytes(
        self, art: str, path: Path, ident: FileIdentity, claim: ClaimRow
    ) -> bool | None:
        """Does the file at `path` (as `ident`) hold exactly the claim's bytes? None: it went or
        changed while it was hashed (a later seal looks again)."""
        try:
            digest = await self.run(hash_file_read, path)
        except FileNotFoundError:
            return None
        if identity(path) != ident:
            self._again.add(art)
            return None
        return digest == claim.blake3

    async def _finish(self, claim: ClaimRow, staged: StagedCopy, started: float, note: str = "") -> bool:
        """Commit, prove, and mark durable; True if the claim is now durable. `started`: when the
        stage began (monotonic), for the measured bandwidth; `note`: for the ARTIFACT_DURABLE event."""
        try:
            await self._keep_retired(claim)
            moved = await self.run(self.store.commit, staged)
            if moved is not None:
                self.ledger.add_event(
                    "DURABLE_MOVED_ASIDE",
                    path=claim.path,
                    detail=f"an older durable copy of another kind was in the way; it now lies at {moved}",
                )
            proof = await self.run(self.store.verify, claim.path, claim.blake3)
        except SidecarError as e:
            await self.run(self.store.discard, staged)
            self.ledger.mark_push_failed(claim.id, push_failure(e))
            self.notify()
            return False
        ok = False
        if proof:
            self.bandwidth.add(staged.size, time.monotonic() - started)
            ok = self.ledger.mark_durable(claim.id, proof, note=note)
        else:
            self.ledger.mark_push_failed(claim.id, MISMATCH)
        self.notify()
        return ok

    async def _keep_retired(self, claim: ClaimRow) -> None:
        """The copy of a file that left the box (deleted, renamed away, released) stays where it is
        until a new file takes its path: then it moves to the attic, never under the new bytes."""
        old = self.ledger.retired_copy(claim.path)
        if old is None or old.blake3 == claim.blake3:
            return  # nothing retired there, or the same bytes came back: replacing them loses nothing
        # Even when another file holds the same bytes now (`last.pt` renamed to `step-100.pt`, or
        # copied to `best.pt`): that file may be rewritten next, and its copy with it.
        where = await self.run(self.store.keep_aside, claim.path, f"retired-{old.id}")
        self.ledger.mark_kept(old.id, where)

    async def push_pending(self) -> int:
        """Push every current claim that is not durable yet, newest first. Returns how many became durable."""
        made = 0
        for claim in self.ledger.not_durable():
            if self.pending(claim.path):
                continue  # being sealed (or about to be): that seal pushes and proves it
            if claim.durable_only and claim.push_error.startswith("LOST:"):
                continue  # nothing on the box can push it, and re-reading a rotten copy costs egress
            async with self.lock(claim.path):
                now = self.ledger.current(claim.path)
                if now is None or now.id != claim.id or now.durable:
                    continue
                # A kill after the rename but before the ledger said so leaves a good copy in place.
                try:
                    proof = await self.run(self.store.verify, claim.path, claim.blake3)
                    if proof:
                        made += int(self.ledger.mark_durable(claim.id, proof))
                        self.notify()
                        continue
                except StorageError as e:
                    self.ledger.mark_push_failed(claim.id, push_failure(e))
                    self.notify()
                    continue
                path = self.namer.to_abs(claim.path)
                if claim.durable_only:
                    # Its box copy is gone (retention) and its durable copy no longer proves: no
                    # push can bring it back. It stays not durable, and the gate says so.
                    self.ledger.mark_push_failed(claim.id, LOST)
                    self.notify()
                    continue
                if identity(path) != claim.identity or claim.path in self.dirty:
                    self.candidate(path)  # changed or gone since the claim: the rescan settles it
                    continue
                short = self._space_short(claim.size)
                if short:
                    self.ledger.mark_push_failed(claim.id, short)
                    self.notify()
                    continue
                started = time.monotonic()
                try:
                    staged = await self.run(self.store.stage, path, claim.path)
                except (ChangedError, FileNotFoundError):
                    self.candidate(path)
                    continue
                except StorageError as e:
                    self.ledger.mark_push_failed(claim.id, push_failure(e))
                    self.notify()
                    continue
                if staged.digest != claim.blake3 or staged.source != claim.identity:
                    await self.run(self.store.discard, staged)
                    if staged.source == claim.identity:
                        self.force_reseal(claim.path, "a push read other bytes than the claim's")
                    else:
                        self.candidate(path)
                    continue
                made += int(await self._finish(claim, staged, started))
        return made

    async def _gone(self, art: str, path: Path | None) -> None:
        if self._ahead is not None and path is not None:
            await self._ahead.drop(art)
        async with self.lock(art):
            p = path or self.namer.to_abs(art)
            claim = self.ledger.current(art)
            now = identity(p)
            if claim is None or claim.identity == now or (claim.durable_only and now is None):
                return  # nothing claimed, or exactly the claimed file is there (a stale report)
            # The claimed file left. Another file may have taken its name since, even its inode
            # number (its "done" event seals it): the claim ends all the same, so the new copy never
            # replaces the old one.
            if self.ledger.end_claim(art, "deleted or renamed away on the box", "ARTIFACT_REMOVED"):
                self.dirty.discard(art)
                self.notify()


RETIRED_TAKEN = (
    "a new file took the path of a claim whose box copy retention deleted; its durable copy is kept"
)
LOST = (
    "LOST: retention deleted the box copy and the durable copy no longer proves equal to the claim; "
    "nothing on the box can push it again"
)
MISMATCH = "MISMATCH: the durable copy did not hash equal to the claim when proven"


def push_failure(e: SidecarError) -> str:
    """A PUSH_FAILED detail: the kind of failure first (NO_SPACE, NETWORK, THROTTLED, ...), then
    what failed and what to do."""
    reason = e.reason if isinstance(e, StorageError) else "STORE_ERROR"
    return f"{reason}: {e}"


def _start(
    table: dict[str, asyncio.Task[None]], key: str, coro: object, done: Callable[[asyncio.Task[None]], None]
) -> None:
    if key in table:
        coro.close()  # type: ignore[attr-defined]
        return
    task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
    table[key] = task
    task.add_done_callback(done)


def _rewritten(claim: ClaimRow, ident: FileIdentity, was_dirty: bool, arrived: bool, unsure: bool) -> bool:
    """Did the watcher report the change from `claim` to the file now at its path as a rewrite?
    The claimed inode written (in place), or another file created or renamed onto the path since
    the claim, with no events lost meanwhile. Anything else may be the claimed file leaving."""
    if unsure:
        return False
    return arrived if not claim.identity.same_file(ident) else was_dirty


def _dir_id(path: Path) -> tuple[int, int] | None:
    """The (dev, ino) of the directory at `path` itself; None if none is there (a symlink is not
    one: nothing follows it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def identity(path: Path) -> FileIdentity | None:
    """The identity of the regular file at `path`; None if there is none (gone, a directory in
    the way, a symlink loop, a FIFO put in its place)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return FileIdentity.of(st) if stat.S_ISREG(st.st_mode) else None
