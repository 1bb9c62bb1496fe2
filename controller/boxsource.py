"""The box as a pull's source of bytes: the sidecar's ReadArtifact stream, and for large claims the
box connector's command channel.

Claims of BULK_MIN bytes or more come over the command channel (`controller.rawcopy`: the box-side
`sidecar.send` writes them straight into the part file), the others through the sidecar's
ReadArtifact stream, hashed chunk by chunk as they arrive. A bulk copy that does not hash to the
claim is fetched again through ReadArtifact, whose reader hashes the bytes on the box too (and seals
the file again there if they changed). A durable-only claim (retention deleted the box-side file
after its durable copy was proven) always comes through ReadArtifact: the sidecar serves it from
its durable store, and the box-side sender would find no file. A stream that breaks is resumed
from the part file after the link is built again; a resumed copy that does not hash to the claim is
fetched once more from offset 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import parts, rawcopy
from controller.client import SidecarClient
from controller.digest import FileDigest, digest_fd
from controller.errors import SidecarUnreachable, TransferError
from controller.manifest import PARTS_DIR
from controller.parts import Chunk
from controller.pull import Progress, PullReport, pull_claims

logger = logging.getLogger(__name__)

ATTEMPTS = 5
BULK_MIN = 16 << 20
"""Claims at least this big come over the connector's command channel (`controller.rawcopy`) when
the pull is given one; smaller ones, and any the bulk path cannot bring intact, through gRPC."""


async def pull(
    client: SidecarClient,
    *,
    root: Path,
    run_id: str,
    instance: str,
    roster: tuple[str, ...],
    progress: Progress | None = None,
    hello: pb.HelloResponse | None = None,
    listing: pb.ListArtifactsResponse | None = None,
    sender: rawcopy.Runner | None = None,
) -> PullReport:
    """Pull every current claim of the box into `root` (see `controller.pull.pull_claims`).
    `hello`, `listing`: the box's Hello and ListArtifacts answers (asked here if None). `sender`: the
    box's connector, to bring large claims over its command channel (see BULK_MIN)."""
    if hello is None:
        hello = await client.hello()
    if listing is None:
        listing = await client.list_artifacts()
    bulk = Bulk(sender, tuple(hello.watch_dirs)) if sender is not None else None
    return await pull_claims(
        BoxSource(client, bulk),
        listing,
        hello,
        root=root,
        run_id=run_id,
        instance=instance,
        roster=roster,
        progress=progress,
    )


@dataclass(frozen=True)
class Bulk:
    sender: rawcopy.Runner
    watch_dirs: tuple[str, ...]  # as the sidecar's Hello names them: the box-side sender's roots


def comes_in_bulk(claim: pb.Claim, bulk: Bulk | None) -> bool:
    """Whether the claim's bytes are first asked of the box-side sender rather than the sidecar."""
    return bulk is not None and claim.size >= BULK_MIN and not claim.durable_only


class BoxSource:
    name = "box"

    def __init__(self, client: SidecarClient, bulk: Bulk | None) -> None:
        self.client, self.bulk = client, bulk

    async def fetch(
        self, claim: pb.Claim, parts_fd: int, progress: Progress | None, report: PullReport
    ) -> int:
        start = parts.part_size(parts_fd, claim)
        if start:
            report.resumed[claim.path] = start
        breaks = 0
        restarted = False
        bulk = self.bulk if comes_in_bulk(claim, self.bulk) else None
        while True:
            generation = self.client.generation
            try:
                if bulk is not None:
                    try:
                        offset, total, digest = await _fetch_once_bulk(bulk, claim, parts_fd, progress)
                    except rawcopy.SendRefused as e:
                        logger.info("%s; reading it through the sidecar", e)
                        bulk = None
                        continue
                else:
                    offset, total, digest = await parts.receive(
                        claim, parts_fd, progress, self._stream(claim)
                    )
            except SidecarUnreachable as e:
                breaks += 1
                if breaks >= ATTEMPTS:
                    raise TransferError(
                        f"{claim.path}: the stream broke {ATTEMPTS} times ({e}); run pull again to resume"
                    ) from e
                logger.warning("%s: stream broke (%s), resuming", claim.path, e)
                with contextlib.suppress(SidecarUnreachable):  # not yet: the next attempt tries again
                    await self.client.reconnect(generation)
                continue
            if total == claim.size and digest == claim.blake3:
                return total - start
            if bulk is not None or (offset and not restarted):
                # A bulk copy of other bytes: the sidecar's own read checks them on the box (and
                # seals the file again there if they changed). A resumed copy: the bytes kept from
                # before may be what is wrong. Either way the whole file once more, from 0.
                how = "bulk copy" if bulk is not None else "resumed copy"
                logger.warning(
                    "%s: the %s hashed %s…, fetching it again from 0", claim.path, how, digest[:12]
                )
                bulk = None
                parts.restart(parts_fd, claim, report, total - start)
                start = 0
                restarted = True
                continue
            parts.drop(parts_fd, claim)
            raise TransferError(
                f"{claim.path}: received {total} bytes hashing {digest[:12]}…, the claim is {claim.size} "
                f"bytes {claim.blake3[:12]}…; the partial copy was removed, run pull again"
            )

    def _stream(self, claim: pb.Claim) -> parts.Stream:
        def read(offset: int) -> AsyncIterator[Chunk]:
            return self.client.read_artifact(claim.path, offset, claim.blake3)

        return read


async def _fetch_once_bulk(
    bulk: Bulk, claim: pb.Claim, parts_fd: int, progress: Progress | None
) -> tuple[int, int, str]:
    """One transfer over the connector's command channel; returns (offset resumed from, total, digest),
    the digest of the whole part file as it lies on disk."""
    fd = parts.open_part(parts_fd, claim)
    try:
        offset = os.fstat(fd).st_size
        if offset > claim.size:
            os.ftruncate(fd, 0)
            offset = 0

        def arrived(got: int) -> None:
            if progress:
                progress.update(claim.path, offset + got, claim.size)

        try:
            await rawcopy.receive(
                bulk.sender, claim.path, bulk.watch_dirs, fd, offset, claim.size - offset, arrived
            )
        except BaseException:
            os.fsync(fd)  # what arrived is kept for the next attempt
            raise
        # Hashed as it lies on disk, by a child that maps it (as b3sum does), while it is synced;
        # both end before the fd closes, whichever fails.
        found, synced = await asyncio.gather(
            asyncio.to_thread(digest_fd, fd, f"{PARTS_DIR}/{parts.part_name(claim)}"),
            asyncio.to_thread(os.fsync, fd),
            return_exceptions=True,
        )
        for outcome in (synced, found):
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(found, FileDigest)
        return offset, found.bytes, found.blake3
    except OSError as exc:
        raise TransferError(f"{claim.path}: writing the partial copy failed: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
