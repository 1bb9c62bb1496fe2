"""Pull: bring every current claim of a box home, hashing on receipt, and write MANIFEST.json beside it.

Each file arrives as `<path>.bw-part` (resumed from its size after an interruption: the bytes already
there are hashed first), and is renamed into place only when its size and blake3 equal the claim.
A file already present with the claim's size and digest is skipped. Nothing local is ever deleted
except our own `.bw-part` files: a stale file from an older pull stays and `verify` reports it EXTRA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.client import SidecarClient
from controller.digest import StreamHasher, file_digest
from controller.errors import SidecarUnreachable, TransferError
from controller.manifest import (
    RESERVED_NAMES,
    Manifest,
    ManifestFile,
    fsync_dir,
    path_problem,
    utc_iso_from_unix_ns,
    write_manifest,
)

logger = logging.getLogger(__name__)

PART_SUFFIX = ".bw-part"
ATTEMPTS = 3
Progress = Callable[[str, int, int], None]  # (path, bytes done, bytes total)


@dataclass
class PullReport:
    root: Path
    manifest: Manifest
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_fetched: int = 0
    extra_local: list[str] = field(default_factory=list)
    resumed: dict[str, int] = field(default_factory=dict)  # path -> offset the transfer resumed from

    def to_json(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "manifest_digest": self.manifest.digest,
            "files": len(self.manifest.files),
            "fetched": self.fetched,
            "skipped": self.skipped,
            "bytes_fetched": self.bytes_fetched,
            "extra_local": self.extra_local,
            "resumed": self.resumed,
        }


def _dest(root: Path, rel: str) -> Path:
    problem = path_problem(rel)
    if problem:
        raise TransferError(f"the sidecar listed an unsafe path {rel!r} ({problem}); refusing to write it")
    dest = root.joinpath(*rel.split("/"))
    # Never write through a symlink planted in the destination tree.
    cur = root
    for part in rel.split("/")[:-1]:
        cur = cur / part
        if cur.is_symlink():
            raise TransferError(f"{cur} is a symlink; refusing to write {rel} through it")
    return dest


async def pull(
    client: SidecarClient,
    *,
    root: Path,
    run_id: str,
    instance: str,
    roster: tuple[str, ...],
    progress: Progress | None = None,
) -> PullReport:
    listing = await client.list_artifacts()
    claims = list(listing.claims)
    files = tuple(
        ManifestFile(
            path=c.path, bytes=c.size, blake3=c.blake3, sealed_at=utc_iso_from_unix_ns(c.sealed_at_unix_ns)
        )
        for c in claims
    )
    manifest = Manifest.build(run_id, instance, files, roster)
    if manifest.digest != listing.manifest_digest:
        raise TransferError(
            "the sidecar's manifest digest does not match its own claims as computed here; "
            "controller and sidecar disagree on the digest rule (version skew?)"
        )
    root.mkdir(parents=True, exist_ok=True)
    report = PullReport(root=root, manifest=manifest)
    for claim in claims:
        dest = _dest(root, claim.path)
        present = dest.is_file() and not dest.is_symlink() and dest.stat().st_size == claim.size
        if present and file_digest(dest) == claim.blake3:
            report.skipped.append(claim.path)
            if progress:
                progress(claim.path, claim.size, claim.size)
            continue
        report.bytes_fetched += await _fetch(client, claim, dest, progress, report.resumed)
        report.fetched.append(claim.path)
    wanted = {c.path for c in claims}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in wanted and rel not in RESERVED_NAMES:
                report.extra_local.append(rel)
    write_manifest(root, manifest)
    return report


async def _fetch(
    client: SidecarClient, claim: pb.Claim, dest: Path, progress: Progress | None, resumed: dict[str, int]
) -> int:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + PART_SUFFIX)
    fetched = 0
    for attempt in range(1, ATTEMPTS + 1):
        try:
            fetched += await _fetch_once(client, claim, part, progress, resumed)
            break
        except SidecarUnreachable as e:
            if attempt == ATTEMPTS:
                raise TransferError(
                    f"{claim.path}: the stream broke {ATTEMPTS} times ({e}); run pull again to resume"
                ) from e
            logger.warning("%s: stream broke (%s), resuming", claim.path, e)
    os.replace(part, dest)
    fsync_dir(dest.parent)
    return fetched


async def _fetch_once(
    client: SidecarClient, claim: pb.Claim, part: Path, progress: Progress | None, resumed: dict[str, int]
) -> int:
    hasher = StreamHasher()
    offset = 0
    if part.exists() and not part.is_symlink():
        offset = part.stat().st_size
        if offset > claim.size:
            part.unlink()
            offset = 0
    if offset:
        resumed[claim.path] = offset
    mode = "r+b" if offset else "w+b"
    with open(part, mode) as f:
        # Resume: the bytes already here are part of the digest too.
        while chunk := f.read(8 << 20):
            hasher.update(chunk)
        if hasher.bytes_seen != offset:
            raise TransferError(f"{part} changed while being resumed")
        received = 0
        try:
            async for msg in client.read_artifact(claim.path, offset, claim.blake3):
                if msg.offset != offset + received:
                    raise TransferError(f"{claim.path}: chunk at {msg.offset}, expected {offset + received}")
                f.write(msg.data)
                hasher.update(msg.data)
                received += len(msg.data)
                if progress:
                    progress(claim.path, offset + received, claim.size)
        finally:
            f.flush()
            os.fsync(f.fileno())
    total = offset + received
    digest = hasher.hexdigest()
    if total != claim.size or digest != claim.blake3:
        part.unlink()
        raise TransferError(
            f"{claim.path}: received {total} bytes hashing {digest[:12]}…, the claim is {claim.size} bytes "
            f"{claim.blake3[:12]}…; the partial copy was removed, run pull again"
        )
    return received
