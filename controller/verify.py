"""The verify step: does a pulled tree hold exactly the bytes its MANIFEST.json claims, do they
load, and is every roster cell there? On success it writes PULL_VERIFIED.json, binding the tree to
one manifest digest; that marker is what the gate trusts.

Fail closed throughout: symlinks are never followed, anything that is not a regular file is
refused, a stray file is EXTRA, and an old marker is deleted before anything is checked, so a
failed or interrupted verification can never leave a stale "verified" behind. A shared lock on the
tree's root keeps a pull from writing into it meanwhile (and refuses to verify while one does).
A tree with no files verifies only when the caller says the run really produced nothing
(`allow_empty`), and the marker records that it did.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from controller.digest import FileChanged, NotRegularFile, digest_file
from controller.errors import Reason, StateError
from controller.manifest import (
    MANIFEST_NAME,
    MARKER_NAME,
    MARKER_SCHEMA,
    PARTS_DIR,
    REPLACED_DIR,
    RESERVED_NAMES,
    Manifest,
    ManifestFile,
    atomic_write_json,
    fsync_dir,
    is_digest,
    load_json_object,
    lock_tree,
    read_manifest,
    utc_now_iso,
)
from controller.probe import CheckpointLoader, ProbeResult, default_checkpoint_loader, probe_file, probe_kind

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What verification found. `ok` means no reasons; `marker_path` is set when a marker was written."""

    root: Path
    ok: bool
    reasons: tuple[Reason, ...]
    files: int
    bytes: int
    manifest_digest: str
    run_id: str
    probes: tuple[ProbeResult, ...]
    marker_path: Path | None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "allowed": self.ok,
            "root": str(self.root),
            "reasons": [r.to_json() for r in self.reasons],
            "files": self.files,
            "bytes": self.bytes,
            "manifest_digest": self.manifest_digest,
            "run_id": self.run_id,
            "probes": [p.to_json() for p in self.probes],
            "marker": str(self.marker_path) if self.marker_path is not None else None,
        }


@dataclass
class _Scan:
    """The tree as found on disk: regular files, and paths refused outright (path → why)."""

    files: set[str] = field(default_factory=set)
    unsafe: dict[str, str] = field(default_factory=dict)


def verify_tree(
    root: Path,
    *,
    roster: Sequence[str] | None = None,
    write_marker: bool = True,
    verifier_version: str,
    loader: CheckpointLoader | None = None,
    allow_empty: bool = False,
    loaded: Loaded | None = None,
) -> VerifyReport:
    """Verify the pulled tree at `root` against its MANIFEST.json.

    `roster` replaces the manifest's roster when given and non-empty (an empty list cannot weaken
    the manifest's). `loader` loads torch checkpoints (None: torch, imported lazily). `allow_empty`:
    a manifest with no files verifies (the run produced nothing) instead of being EMPTY. `loaded`:
    files an earlier verify of this very manifest load-probed (see `loaded_by`): a file whose bytes
    hash equal again is not loaded again (the same bytes load the same way). Raises
    ControllerError only when verification cannot run (root missing, a pull into it running, old
    marker not removable, a directory unreadable); every finding about the tree is a Reason.
    """
    root = Path(root)
    if not root.is_dir():
        raise StateError(f"{root}: not a directory")
    lock_fd = lock_tree(root, exclusive=False)
    try:
        return _verify_locked(root, roster, write_marker, verifier_version, loader, allow_empty, loaded)
    finally:
        os.close(lock_fd)


def _verify_locked(
    root: Path,
    roster: Sequence[str] | None,
    write_marker: bool,
    verifier_version: str,
    loader: CheckpointLoader | None,
    allow_empty: bool,
    loaded: Loaded | None,
) -> VerifyReport:
    marker = root / MARKER_NAME
    manifest_path = root / MANIFEST_NAME
    # Without a MANIFEST.json this may be no pulled tree at all: a PULL_VERIFIED.json that is not
    # a marker of ours (the user's own file) is then left alone.
    if write_marker and (os.path.lexists(manifest_path) or _is_our_marker(root)):
        _remove_marker(root, marker)

    try:
        manifest = read_manifest(manifest_path)
    except StateError as exc:
        if os.path.lexists(manifest_path):
            reason = Reason("MANIFEST_INVALID", MANIFEST_NAME, str(exc))
        else:
            reason = Reason("MISSING", MANIFEST_NAME, "the tree has no MANIFEST.json")
        return VerifyReport(root, False, (reason,), 0, 0, "", "", (), None)

    scan = _scan(root)
    reasons = [Reason("UNSAFE_PATH", path, why) for path, why in scan.unsafe.items()]
    listed = {f.path for f in (*manifest.files, *manifest.retired)}
    reasons += [Reason("EXTRA", path, _extra_detail(path)) for path in scan.files - listed]
    # Retired files (pulled earlier, no longer claimed by the box) are not claims, but the manifest
    # says which bytes they hold: a tree that does not hold them is not the tree it describes.
    retired = [f for f in manifest.retired if f.path not in scan.unsafe]
    gone = (
        "listed as retired (the box no longer claims it) but not on disk: pull again to drop it from the list"
    )
    reasons += [r for f in retired if (r := _bytes_reason(root, f, scan, gone)) is not None]
    if not manifest.files and not allow_empty:
        reasons.append(
            Reason(
                "EMPTY",
                "",
                "the manifest lists no files; refusing to verify nothing (if the run really produced "
                "nothing, verify again with --allow-empty)",
            )
        )

    proven = loaded.paths if loaded is not None and loaded.manifest_digest == manifest.digest else frozenset()
    good, probes, file_reasons = _check_files(root, manifest, scan, loader, proven)
    reasons += file_reasons
    cells = tuple(roster) if roster else manifest.roster
    reasons += _roster_reasons(cells, manifest, good)

    reasons.sort(key=lambda r: (r.code, r.path))
    ok = not reasons
    marker_path: Path | None = None
    if ok and write_marker:
        doc = _marker_json(manifest, cells, probes, verifier_version, allow_empty)
        atomic_write_json(marker, doc)
        marker_path = marker
    logger.info(
        "verify %s: %s (%d files, %d reasons, manifest %s)",
        root,
        "ok" if ok else "refused",
        len(manifest.files),
        len(reasons),
        manifest.digest,
    )
    return VerifyReport(
        root,
        ok,
        tuple(reasons),
        len(manifest.files),
        manifest.total_bytes,
        manifest.digest,
        manifest.run_id,
        probes,
        marker_path,
    )


@dataclass(frozen=True)
class Loaded:
    """What a marker says was load-probed, and passed, for the manifest it verified."""

    manifest_digest: str
    paths: frozenset[str]


def loaded_by(marker: Mapping[str, Any]) -> Loaded:
    """The files a (read_marker-checked) marker's verify loaded, bound to its manifest digest."""
    probes = marker.get("load_probe", [])
    paths = (
        frozenset(
            p["path"]
            for p in probes
            if isinstance(p, dict) and p.get("ok") is True and isinstance(p.get("path"), str)
        )
        if isinstance(probes, list)
        else frozenset()
    )
    return Loaded(str(marker["manifest_digest"]), paths)


def read_marker(root: Path) -> dict[str, Any] | None:
    """The PULL_VERIFIED.json in `root`: None if there is none, StateError if it is unreadable or
    malformed (a marker that cannot be read must not count as "verified")."""
    path = Path(root) / MARKER_NAME
    if not os.path.lexists(path):
        return None
    doc = load_json_object(path)
    if doc.get("schema") != MARKER_SCHEMA:
        raise StateError(f"{path}: field 'schema' is {doc.get('schema')!r}, expected {MARKER_SCHEMA!r}")
    if not is_digest(doc.get("manifest_digest")):
        raise StateError(f"{path}: field 'manifest_digest' is not 64 lowercase hex")
    for name, kind in (("run_id", str), ("verified_at", str), ("files", int), ("bytes", int)):
        if not isinstance(doc.get(name), kind) or isinstance(doc.get(name), bool):
            raise StateError(f"{path}: field {name!r} is missing or not {kind.__name__}")
    # Absent in markers written before the field existed: those never verified an empty tree.
    allow_empty = doc.get("allow_empty", False)
    if not isinstance(allow_empty, bool):
        raise StateError(f"{path}: field 'allow_empty' is not a boolean")
    if doc["files"] == 0 and not allow_empty:
        raise StateError(f"{path}: it verifies no files, but field 'allow_empty' is not true")
    doc["allow_empty"] = allow_empty
    return doc


def _extra_detail(path: str) -> str:
    if path.split("/", 1)[0] == PARTS_DIR:
        return "a partial copy left by an interrupted pull: run pull again to finish it"
    return "on disk but not in the manifest"


def _is_our_marker(root: Path) -> bool:
    try:
        return read_marker(root) is not None
    except StateError:
        return False


def _remove_marker(root: Path, marker: Path) -> None:
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return
    except OSError as exc:
        if not os.path.lexists(marker):
            return  # none there (a read-only filesystem says EROFS before it says ENOENT)
        raise StateError(f"{marker}: cannot remove the old marker: {exc.strerror or exc}") from exc
    # The removal must be on disk before anything else happens, or a crash could revive it.
    fsync_dir(root)
    logger.debug("removed old marker %s", marker)


def _scan(root: Path) -> _Scan:
    """Walk `root` without following any symlink."""
    scan = _Scan()
    pending: list[tuple[str, str]] = [("", os.fspath(root))]
    while pending:
        rel_dir, abs_dir = pending.pop()
        try:
            with os.scandir(abs_dir) as it:
                entries = list(it)
        except OSError as exc:
            # An unlisted directory could hide extra or changed files: verification cannot run.
            raise StateError(f"{abs_dir}: cannot list directory: {exc.strerror or exc}") from exc
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
                scan.unsafe[shown] = "name is not valid UTF-8"
                continue
            if entry.is_symlink():
                scan.unsafe[rel] = f"symlink to {os.readlink(entry.path)!r} (never followed)"
            elif entry.is_dir(follow_symlinks=False):
                if not (rel_dir == "" and entry.name == REPLACED_DIR):  # kept bytes, not the tree
                    pending.append((rel, entry.path))
            elif entry.is_file(follow_symlinks=False):
                if not (rel_dir == "" and entry.name in RESERVED_NAMES):
                    scan.files.add(rel)
            else:
                kind = _file_type(entry.stat(follow_symlinks=False).st_mode)
                scan.unsafe[rel] = f"not a regular file ({kind})"
    return scan


def _bytes_reason(
    root: Path, f: ManifestFile, scan: _Scan, missing: str = "in the manifest but not on disk"
) -> Reason | None:
    """Why the file at `f.path` does not hold the manifest's bytes; None if it does."""
    if f.path not in scan.files:
        return Reason("MISSING", f.path, missing)
    try:
        found = digest_file(root / f.path)
    except FileChanged as exc:
        return Reason("UNREADABLE", f.path, str(exc))
    except NotRegularFile:
        return Reason("UNSAFE_PATH", f.path, "replaced by a non-regular file during verify")
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            return Reason("UNSAFE_PATH", f.path, "replaced by a symlink during verify")
        return Reason("UNREADABLE", f.path, f"cannot read: {exc.strerror or exc}")
    if found.bytes != f.bytes:
        return Reason("SIZE_MISMATCH", f.path, f"{found.bytes} bytes on disk, manifest says {f.bytes}")
    if found.blake3 != f.blake3:
        return Reason("HASH_MISMATCH", f.path, f"blake3 {found.blake3} on disk, manifest says {f.blake3}")
    return None


def _check_files(
    root: Path, manifest: Manifest, scan: _Scan, loader: CheckpointLoader | None, proven: frozenset[str]
) -> tuple[set[str], tuple[ProbeResult, ...], list[Reason]]:
    """Size, hash and probe every manifest file (but those in `proven`, loaded by a verify of this
    manifest: once their bytes hash equal, they pass). Returns the paths that passed, the probe
    results (files a probe applies to), and the reasons."""
    good: set[str] = set()
    reasons: list[Reason] = []
    pending: dict[str, Future[ProbeResult]] = {}
    again: list[ProbeResult] = []
    needs_torch = loader is None and any(
        probe_kind(f.path) == "torch" and f.path not in proven for f in manifest.files
    )
    # One probe worker: probes of hashed files overlap with hashing the next one, and importing
    # torch (seconds) overlaps with hashing from the start.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-probe") as pool:
        torch_loader = pool.submit(default_checkpoint_loader) if needs_torch else None

        def run_probe(path: Path) -> ProbeResult:
            chosen = loader if torch_loader is None else torch_loader.result()
            return probe_file(path, loader=chosen)

        for f in manifest.files:
            if f.path in scan.unsafe:
                continue  # already refused as UNSAFE_PATH; its bytes are not read
            reason = _bytes_reason(root, f, scan)
            if reason is not None:
                reasons.append(reason)
            elif probe_kind(f.path) == "none":
                good.add(f.path)
            elif f.path in proven:
                good.add(f.path)
                again.append(ProbeResult(f.path, probe_kind(f.path), True, "loaded at verify (same bytes)"))
            else:
                pending[f.path] = pool.submit(run_probe, root / f.path)

        probes: list[ProbeResult] = list(again)
        for path, future in pending.items():
            result = replace(future.result(), path=path)
            probes.append(result)
            if result.ok:
                good.add(path)
            else:
                reasons.append(Reason("UNLOADABLE", path, f"{result.kind} probe: {result.detail}"))
    return good, tuple(probes), reasons


def _roster_reasons(cells: Sequence[str], manifest: Manifest, good: set[str]) -> list[Reason]:
    passed = {manifest.cell_of(path) for path in good}
    listed = {manifest.cell_of(f.path) for f in manifest.files}
    reasons = []
    for cell in dict.fromkeys(cells):
        if cell in passed:
            continue
        if cell in listed:
            detail = f"no file of roster cell {cell!r} passed verification"
        else:
            detail = f"roster cell {cell!r} has no file in the manifest"
        reasons.append(Reason("ROSTER_INCOMPLETE", cell, detail))
    return reasons


def _marker_json(
    manifest: Manifest, cells: Sequence[str], probes: Sequence[ProbeResult], version: str, allow_empty: bool
) -> dict[str, Any]:
    return {
        "allow_empty": allow_empty,
        "schema": MARKER_SCHEMA,
        "run_id": manifest.run_id,
        "manifest_digest": manifest.digest,
        "verified_at": utc_now_iso(),
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        "roster": list(cells),
        "load_probe": [p.to_json() for p in probes],
        "verifier": {"host": socket.gethostname(), "version": version},
    }


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"
