"""Pull: bring every claim of one claims list home from a source of bytes, hashing on receipt, and
write MANIFEST.json beside them.

The machinery here is the same whatever the bytes come from; a `Source` brings one claim's bytes
into its part file (`controller.parts`): the box itself (`controller.boxsource`: the sidecar's
ReadArtifact stream, or the connector's command channel for large files), or the box's durable
store read from this machine (`controller.fromdurable`, when the box is gone).

Before the first byte is fetched, everything that can be checked is: the tree does not overlap the
box's own directories (`overlap.py`), it can live where it is asked to, no claim's path is too long,
and nothing lies in a claim's way but what an earlier pull of this box put there (`inway.py`; every
path in the way that holds anything else is named at once). The whole pull holds an exclusive lock
on the tree's root directory.

Each file arrives in its part file, opened relative to directory fds and never through a symlink;
an interrupted transfer resumes from the part file's size. It is renamed into place only when its
size and blake3 equal the claim. A file already present with the claim's size and digest is
skipped. A claim its source cannot give (`Unavailable`: no durable copy, or one of other bytes) is
never placed; the others still are, and the pull then fails naming every one of them, without
writing MANIFEST.json.

A pull never replaces bytes it cannot account for. Before anything is written it refuses a tree
whose MANIFEST.json (or interrupted pull's record) belongs to another box or run, and a file at a
claim's path whose bytes are neither the claim's nor ones an earlier pull of this box and run put
there (recorded in its MANIFEST.json, or in `PARTS_DIR/placing.json`, written before a pull puts its
first file in place and removed once MANIFEST.json records the tree). Bytes an earlier pull put at
a path the box holds other bytes at now, or in the way of a path that changed kind on the box (a
file where its directory was, a directory where it was), move to `REPLACED_DIR/<path>.<blake3>`
before the new ones take the path (the box may hold the old ones nowhere any more); directories
they leave empty go. Nothing local is ever deleted except what lies in PARTS_DIR once every claim
is in place: a file the box no longer claims stays and `verify` reports it EXTRA (or checks it,
retired).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.digest import digest_file
from controller.errors import StateError, TransferError, Unavailable, UsageError
from controller.inway import Entry, clear, open_dirs, survey
from controller.manifest import (
    MANIFEST_NAME,
    PARTS_DIR,
    REPLACED_DIR,
    RESERVED_NAMES,
    Manifest,
    ManifestFile,
    atomic_write_json,
    is_digest,
    load_json_object,
    lock_tree,
    path_problem,
    read_manifest,
    utc_iso_from_unix_ns,
    write_manifest,
)
from controller.overlap import check_claim_paths, destination_problem, overlap_problem, resolve_loose
from controller.parts import PLACING_NAME, clear_parts, open_parts_dir, part_name

logger = logging.getLogger(__name__)

IN_FLIGHT = 4
"""Files transferred at once: over a high-latency link one file at a time waits a round trip per
file; more would only share the same link."""
T = TypeVar("T")


class Progress(Protocol):
    def start(self, files: int, total_bytes: int) -> None:
        """Before the first byte: how many files and bytes the pull covers."""

    def update(self, path: str, got: int, size: int) -> None:
        """`got` of the file's `size` bytes are here (`got == size`: it is complete)."""


async def in_flight(items: Sequence[T], work: Callable[[T], Awaitable[None]], limit: int) -> None:
    """Run `work` on every item, at most `limit` at once. After a failure no new item starts; those
    under way finish (a file half fetched is placed if it arrives whole), then the first failure is
    raised. Cancelled (Ctrl-C), every one under way stops."""
    queue = iter(items)
    failures: list[BaseException] = []

    async def worker() -> None:
        for item in queue:
            try:
                await work(item)
            except Exception as e:
                failures.append(e)
            if failures:
                return

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(limit, len(items))))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failures:
        raise failures[0]


PLACING_SCHEMA = "boxwarden.placing/1"
SHOWN = 5  # paths named in a message before "and N more"


@dataclass
class PullReport:
    root: Path
    manifest: Manifest
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_fetched: int = 0  # received and kept: the fetched files' bytes not resumed from before
    bytes_discarded: int = 0  # received, then thrown away when a resumed copy did not match
    parts_removed: int = 0  # leftovers in PARTS_DIR that no claim needed any more
    extra_local: list[str] = field(default_factory=list)  # files here no pull of this box put here
    retired: list[str] = field(default_factory=list)  # pulled earlier, no longer claimed, bytes kept
    replaced: list[str] = field(default_factory=list)  # pulled earlier, changed on the box since
    # pulled earlier, in the way of a path that changed kind on the box (file <-> directory) since
    displaced: list[str] = field(default_factory=list)
    resumed: dict[str, int] = field(default_factory=dict)  # path -> offset the transfer resumed from
    restarted: list[str] = field(default_factory=list)  # a copy that did not match, fetched again from 0
    unavailable: dict[str, str] = field(default_factory=dict)  # path -> why its source cannot give it
    source: str = "box"  # where the bytes came from: "box", or "durable" (the box's durable store)
    source_detail: str = ""  # for "durable": the store and the claims list read

    def to_json(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "manifest_digest": self.manifest.digest,
            "files": len(self.manifest.files),
            "fetched": self.fetched,
            "skipped": self.skipped,
            "bytes_fetched": self.bytes_fetched,
            "bytes_discarded": self.bytes_discarded,
            "parts_removed": self.parts_removed,
            "extra_local": self.extra_local,
            "retired": self.retired,
            "replaced": self.replaced,
            "displaced": self.displaced,
            "resumed": self.resumed,
            "restarted": self.restarted,
            "source": self.source,
            "source_detail": self.source_detail,
        }


class Source(Protocol):
    """Where a pull's bytes come from."""

    name: str  # "box" or "durable": what the report says

    async def fetch(
        self, claim: pb.Claim, parts_fd: int, progress: Progress | None, report: PullReport
    ) -> int:
        """Bring the claim's bytes into its part file (`controller.parts`, resuming from what is
        there) until they hash equal to the claim; returns the bytes received that the file keeps.
        TransferError stops the pull; Unavailable says this source cannot give this claim (the
        other claims still come)."""
        ...


def manifest_of(
    listing: pb.ListArtifactsResponse,
    hello: pb.HelloResponse,
    run_id: str,
    instance: str,
    roster: tuple[str, ...],
) -> Manifest:
    """The manifest of a claims list, checked against the digest its sidecar computed."""
    watch_names = [Path(d).name for d in hello.watch_dirs] if len(hello.watch_dirs) >= 2 else []
    files = tuple(
        ManifestFile(
            path=c.path, bytes=c.size, blake3=c.blake3, sealed_at=utc_iso_from_unix_ns(c.sealed_at_unix_ns)
        )
        for c in listing.claims
    )
    manifest = Manifest.build(run_id, instance, files, roster, watch_names)
    if manifest.digest != listing.manifest_digest:
        raise TransferError(
            "the sidecar's manifest digest does not match its own claims as computed here; "
            "controller and sidecar disagree on the digest rule (version skew?)"
        )
    return manifest


async def pull_claims(
    source: Source,
    listing: pb.ListArtifactsResponse,
    hello: pb.HelloResponse,
    *,
    root: Path,
    run_id: str,
    instance: str,
    roster: tuple[str, ...],
    progress: Progress | None = None,
) -> PullReport:
    """Pull every claim of `listing` (the box's claims list, `hello` its Hello answer) into `root`
    from `source`.

    UsageError (nothing written) for a tree that overlaps the box's directories, cannot live at
    `root`, belongs to another box or run, or holds bytes at a claim's path that no pull of this box
    put there; TransferError for a claim that cannot be written or did not arrive intact, or (once
    every other claim is in place) for the claims the source could not give.
    """
    root = resolve_loose(root)
    problem = overlap_problem(root, hello) or destination_problem(root)
    if problem:
        raise UsageError(f"refusing to pull: {problem}")
    claims = list(listing.claims)
    manifest = manifest_of(listing, hello, run_id, instance, roster)
    check_claim_paths(root, [c.path for c in claims])
    created = _make_root(root)
    try:
        root_fd = lock_tree(root, exclusive=True)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        return await _pull_locked(source, root, root_fd, claims, manifest, progress)
    finally:
        os.close(root_fd)


async def _pull_locked(
    source: Source,
    root: Path,
    root_fd: int,
    claims: list[pb.Claim],
    manifest: Manifest,
    progress: Progress | None,
) -> PullReport:
    report = PullReport(root=root, manifest=manifest, source=source.name)
    placing = _placing(root, manifest)
    earlier = _recorded(root, manifest)
    known = {(f.path, f.bytes, f.blake3) for f in earlier.values()} | placing
    way = survey(root, claims, manifest.instance, known)
    report.replaced = way.older
    parts_fd = open_parts_dir(root, root_fd)
    try:
        claim_paths = {c.path for c in claims}
        todo = {(c.path, c.size, c.blake3) for c in claims if c.path not in way.present}
        if todo:
            _write_placing(root, manifest, placing | todo)
        if progress:
            progress.start(len(claims), sum(c.size for c in claims))

        async def one(claim: pb.Claim) -> None:
            *dirs, name = claim.path.split("/")
            if claim.path in way.present:
                report.skipped.append(claim.path)
                if progress:
                    progress.update(claim.path, claim.size, claim.size)
                return
            try:
                # Not `+= await`: that reads the total before the await, and transfers run at once.
                got = await source.fetch(claim, parts_fd, progress, report)
            except Unavailable as e:
                report.unavailable[claim.path] = str(e)
                return
            report.bytes_fetched += got
            # Everything below runs without an await: no other transfer comes between.
            if claim.path in way.aside:
                moved = clear(root, root_fd, way.aside[claim.path])
                report.displaced += [p for p in moved if p != claim.path]
            parent_fd = open_dirs(root, root_fd, dirs, create=True)
            assert parent_fd is not None
            try:
                try:
                    os.replace(part_name(claim), name, src_dir_fd=parts_fd, dst_dir_fd=parent_fd)
                    os.fsync(parent_fd)
                except OSError as exc:
                    raise TransferError(
                        f"{root / claim.path}: cannot put the received file in place: {exc.strerror or exc}; "
                        "move what is there aside and run pull again"
                    ) from exc
                report.fetched.append(claim.path)
            finally:
                os.close(parent_fd)

        await in_flight(claims, one, IN_FLIGHT)
        report.fetched.sort()
        report.skipped.sort()
        report.displaced.sort()
        if report.unavailable:
            raise _unavailable(root, report)
        extra = _extra_local(root, claim_paths)
        retired = _still_as_pulled(root, extra, earlier)
        report.retired = [f.path for f in retired]
        report.extra_local = sorted(set(extra) - set(report.retired))
        write_manifest(root, manifest.with_retired(retired))
        report.parts_removed = clear_parts(parts_fd)
    finally:
        os.close(parts_fd)
        with contextlib.suppress(OSError):  # not empty: an interrupted pull left parts to resume from
            os.rmdir(PARTS_DIR, dir_fd=root_fd)
    return report


def _unavailable(root: Path, report: PullReport) -> TransferError:
    """Fail closed: the tree lacks claims, so no MANIFEST.json says it is whole."""
    missing = sorted(report.unavailable)
    shown = "; ".join(f"{p}: {report.unavailable[p]}" for p in missing[:SHOWN])
    more = f"; and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    return TransferError(
        f"{len(missing)} of {len(report.manifest.files)} claims could not come from {report.source} "
        f"and were not placed ({len(report.fetched)} fetched, {len(report.skipped)} already in {root}; "
        f"no {MANIFEST_NAME} written, so the tree does not verify): {shown}{more}"
    )


def _make_root(root: Path) -> list[Path]:
    """Create `root` and its missing parents; returns those it created (deepest last)."""
    missing: list[Path] = []
    here = root
    while not os.path.lexists(here):
        missing.insert(0, here)
        here = here.parent
    created: list[Path] = []
    for d in missing:
        try:
            d.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            _remove_empty(created)
            raise UsageError(
                f"cannot create {d}: {exc.strerror or exc}; pull into a directory you can create (--to)"
            ) from exc
        created.append(d)
    return created


def _remove_empty(created: list[Path]) -> None:
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


def name_some(paths: Sequence[str], shown: int = SHOWN) -> str:
    """The first `shown` of `paths`, then how many more there are."""
    head = ", ".join(paths[:shown])
    return f"{head} and {len(paths) - shown} more" if len(paths) > shown else head


def _recorded(root: Path, manifest: Manifest) -> dict[str, ManifestFile]:
    """The files the tree's MANIFEST.json records (claims and retired), by path, if an earlier pull
    of this box and run wrote it. UsageError if it is another's, or cannot be read (then what it may
    stand for is unknown)."""
    where = root / MANIFEST_NAME
    if not os.path.lexists(where):
        return {}
    try:
        earlier = read_manifest(where)
    except StateError as exc:
        raise UsageError(
            f"refusing to pull: {exc}; pull cannot tell which files here it may replace: "
            f"pull into an empty or new directory (--to), or move {MANIFEST_NAME} away"
        ) from exc
    _check_same_box(root, "the tree pulled from", earlier.instance, earlier.run_id, manifest)
    return {f.path: f for f in (*earlier.files, *earlier.retired)}


def _still_as_pulled(root: Path, extra: list[str], earlier: dict[str, ManifestFile]) -> list[ManifestFile]:
    """The files among `extra` (here, not claimed by the box now) that an earlier pull of this box
    and run put here and that still hold its bytes: the box deleted, renamed or released them after
    that pull. They stay, listed as retired, so that verify checks them instead of calling them
    EXTRA (a trainer that rotates its checkpoints, or a release that was interrupted)."""
    out: list[ManifestFile] = []
    for path in extra:
        f = earlier.get(path)
        if f is None:
            continue
        try:
            if os.lstat(root / path).st_size != f.bytes:
                continue
            found = digest_file(root / path)
        except OSError as exc:
            logger.info("%s: could not be hashed (%s)", root / path, exc)
            continue
        if (found.bytes, found.blake3) == (f.bytes, f.blake3):
            out.append(f)
    return out


def _placing(root: Path, manifest: Manifest) -> set[Entry]:
    """The files an interrupted pull of this box and run was putting in place. UsageError if that
    pull was another box's; an unreadable record is ignored (then its files count as unknown)."""
    parts = root / PARTS_DIR
    if not parts.is_dir() or parts.is_symlink() or not os.path.lexists(parts / PLACING_NAME):
        return set()
    try:
        instance, run_id, entries = _read_placing(parts / PLACING_NAME)
    except StateError as exc:
        logger.warning("ignoring an unreadable record of an interrupted pull: %s", exc)
        return set()
    _check_same_box(root, "files an interrupted pull put there from", instance, run_id, manifest)
    return entries


def _read_placing(path: Path) -> tuple[str, str, set[Entry]]:
    doc = load_json_object(path)
    instance, run_id, files = doc.get("instance"), doc.get("run_id"), doc.get("files")
    if doc.get("schema") != PLACING_SCHEMA or not isinstance(instance, str) or not isinstance(run_id, str):
        raise StateError(f"{path}: not a {PLACING_SCHEMA} record")
    if not isinstance(files, list):
        raise StateError(f"{path}: field 'files' is not a list")
    entries: set[Entry] = set()
    for raw in files:
        match raw:
            case [str(p), int(n), str(digest)] if path_problem(p) is None and n >= 0 and is_digest(digest):
                entries.add((p, n, digest))
            case _:
                raise StateError(f"{path}: field 'files' holds {raw!r}, not [path, bytes, blake3]")
    return instance, run_id, entries


def _write_placing(root: Path, manifest: Manifest, entries: set[Entry]) -> None:
    """Record, before the first file is put in place, every file this pull (and any interrupted one
    before it) may put there, so that a pull after an interruption knows those bytes."""
    doc = {
        "schema": PLACING_SCHEMA,
        "instance": manifest.instance,
        "run_id": manifest.run_id,
        "files": [list(e) for e in sorted(entries)],
    }
    try:
        atomic_write_json(root / PARTS_DIR / PLACING_NAME, doc)
    except OSError as exc:
        raise TransferError(f"{root / PARTS_DIR}: cannot record the pull: {exc.strerror or exc}") from exc


def _check_same_box(root: Path, what: str, instance: str, run_id: str, manifest: Manifest) -> None:
    """UsageError unless box `instance`, run `run_id` (what the tree holds `what`) is the one pulled now."""
    if (instance, run_id) == (manifest.instance, manifest.run_id):
        return
    raise UsageError(
        f"refusing to pull box {manifest.instance!r} (run {manifest.run_id}) into {root}: it holds {what} "
        f"box {instance!r} (run {run_id}); pull into an empty or new directory (--to)"
    )


def _extra_local(root: Path, wanted: set[str]) -> list[str]:
    extra: list[str] = []
    for dirpath, dirs, names in os.walk(root):
        if Path(dirpath) == root:
            dirs[:] = [d for d in dirs if d not in (PARTS_DIR, REPLACED_DIR)]
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in wanted and rel not in RESERVED_NAMES:
                extra.append(rel)
    return sorted(extra)
