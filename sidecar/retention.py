"""Retention: retiring the box-side copies of checkpoints the rules (`keep.py`) let go.

Retiring a claim deletes its box-side copy and nothing else: only when its durable copy was just
re-read whole and hashed equal (whatever cheaper proof the store may otherwise use), only if the
file is still exactly the claimed one (renamed aside, hashed, unlinked; put back otherwise, as a
release does), and the claim stays current, `durable_only`: pulls fetch it from durable storage and
the gate still demands it. Nothing is ever deleted from durable storage here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Iterable

from sidecar.errors import SidecarError
from sidecar.keep import MAX_METRICS, KeepRules, choose, read_metric
from sidecar.ledger import ClaimRow
from sidecar.paths import RELEASE_ASIDE_PREFIX, open_regular
from sidecar.release import delete_verified
from sidecar.sealer import Sealer, identity
from sidecar.storage import REREAD

logger = logging.getLogger(__name__)


class Retainer:
    """Applies the rules after each change of the claims: one pass at a time, claim by claim under
    the sealer's per-path lock."""

    def __init__(
        self, sealer: Sealer, rules: KeepRules, protected: Callable[[], Iterable[str]] = tuple
    ) -> None:
        """`protected()`: artifact paths (a file, or a checkpoint's directory) whose box copies stay
        now, whatever the rules say (what running jobs were told to resume from)."""
        self._s = sealer
        self.rules = rules
        self._protected = protected
        self._skip = 2 if len(sealer.namer.roots) > 1 else 1
        self._seen_version = -1

    async def run(self, interval_s: float = 1.0) -> None:
        while self.rules.active:
            if self._s.ledger.version != self._seen_version:
                self._seen_version = self._s.ledger.version
                await self.once()
            await asyncio.sleep(interval_s)

    async def once(self) -> int:
        """One pass; returns how many box-side copies it deleted."""
        ledger = self._s.ledger
        members = ledger.members
        chosen = self._spare(choose(ledger.current_claims(), self.rules, self._skip, self._metric))
        still = {c.id for c in chosen}
        retired = 0
        for c in chosen:
            async with self._s.lock(c.path):
                now = ledger.current(c.path)
                if now is None or now.id != c.id or not now.durable or now.durable_only:
                    continue
                # The rules again once claims came or went: a pass takes a while, and the newest
                # checkpoint may have gone meanwhile (deleted after a NaN, resumed from older).
                if ledger.members != members:
                    members = ledger.members
                    still = {
                        x.id for x in choose(ledger.current_claims(), self.rules, self._skip, self._metric)
                    }
                if c.id not in still or not self._spare(
                    [now]
                ):  # a job may just have been told to resume from it
                    continue
                why = await self._retire(now)
            if why:
                logger.info("retention keeps %s on the box: %s", c.path, why)
            else:
                retired += 1
        if retired:
            self._s.notify()
        return retired

    def _spare(self, chosen: list[ClaimRow]) -> list[ClaimRow]:
        """`chosen` without what a running job resumes from."""
        kept = tuple(self._protected())
        if not kept:
            return chosen
        within = tuple(p + "/" for p in kept)
        return [c for c in chosen if c.path not in kept and not c.path.startswith(within)]

    def _metric(self, c: ClaimRow) -> float | None:
        try:
            fd = open_regular(self._s.namer.to_abs(c.path), follow=False)
        except (OSError, SidecarError):
            return None
        try:
            if os.fstat(fd).st_size > MAX_METRICS:
                return None
            data = os.pread(fd, MAX_METRICS, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        return read_metric(data, self.rules.best_key)

    async def _retire(self, c: ClaimRow) -> str:
        """Delete the box-side copy of `c` if its durable copy re-reads equal now; else say why not."""
        path = self._s.namer.to_abs(c.path)
        if identity(path) != c.identity or c.path in self._s.dirty:
            return "changed since its claim"
        try:
            proof = await self._s.run(functools.partial(self._s.store.verify, c.path, c.blake3, reread=True))
        except SidecarError as e:
            return f"its durable copy could not be re-read: {e}"
        if proof != REREAD:
            # The copy is not what the claim says: not durable any more, pushed again from this
            # very file, which therefore stays.
            self._s.ledger.mark_not_durable(
                c.id, "MISMATCH: retention re-read the durable copy and it differs"
            )
            self._s.notify()
            return "its durable copy did not re-read equal to the claim"
        self._s.ledger.mark_durable(c.id, proof)
        # Durable-only BEFORE the file goes: its leaving must not end the claim.
        if not self._s.ledger.set_durable_only(c.id, True):
            return "its claim changed meanwhile"
        aside = path.with_name(f"{RELEASE_ASIDE_PREFIX}{c.id}")
        why, mismatch = await self._s.run(delete_verified, path, aside, c)
        if why and not os.path.lexists(path) and not os.path.lexists(aside):
            # Unlinked after all (a writer opened it just as it went): the box copy is gone, and the
            # claim is durable-only whatever the writer meant to do with it.
            logger.warning("%s: %s; its box copy is gone, its durable copy was just proven", c.path, why)
            why = ""
        if why:
            self._s.ledger.set_durable_only(c.id, False)
            if mismatch:
                self._s.force_reseal(c.path, "retention found other bytes than the claim's")
            return why
        self._s.ledger.add_event(
            "ARTIFACT_RETIRED",
            path=c.path,
            detail=f"box copy deleted by retention ({self.rules.text}); its durable copy was re-read equal",
        )
        self._s.dirty.discard(c.path)
        return ""
