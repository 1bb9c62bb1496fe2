"""The files written beside a pulled tree: MANIFEST.json (schema `boxwarden.manifest/1`, the claims
the tree must match, and with several watched directories their names, which say where a path's
roster cell is), the crash-safe JSON writer used for it and for PULL_VERIFIED.json, and the lock on
a tree's root that keeps one pull at a time (and verify away from a pull).

Reading a manifest is strict: anything malformed, unsafe or tampered with is a StateError naming the
file and the field, because a manifest the verifier cannot trust must never let the gate pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from controller.digest import manifest_digest
from controller.errors import ControllerError, StateError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.json"
MARKER_NAME = "PULL_VERIFIED.json"
MANIFEST_SCHEMA = "boxwarden.manifest/1"
MARKER_SCHEMA = "boxwarden.verified/1"
HASH_NAME = "blake3"

PARTS_DIR = ".bw-parts"
"""The directory at the tree's root where a pull keeps its partial files (removed when it ends)."""
REPLACED_DIR = ".bw-replaced"
"""Where pull moves bytes an earlier pull put at a path before newer ones take it, or put in the way
of a path that changed kind: kept, never destroyed (the box may hold them nowhere any more). Not
part of the tree `verify` checks (never EXTRA, never MISSING)."""

# Names at the tree's root that belong to boxwarden, so no artifact may use them.
RESERVED_NAMES = frozenset({MANIFEST_NAME, MARKER_NAME})

_HEX64 = re.compile(r"[0-9a-f]{64}")

_T = TypeVar("_T")


def utc_now_iso() -> str:
    """Now, as ISO-8601 UTC with a `Z` suffix (the form every timestamp in these files uses)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def utc_iso_from_unix_ns(unix_ns: int) -> str:
    """A Unix time in nanoseconds (as the proto carries times) in the same ISO-8601 UTC form."""
    # Integer arithmetic: a float of ~1.7e18 ns cannot hold every nanosecond.
    moment = datetime.fromtimestamp(0, UTC) + timedelta(microseconds=unix_ns // 1000)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def is_digest(value: object) -> bool:
    """True for 64 lowercase hex characters (the DIGEST RULE's written form)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def path_problem(path: str) -> str | None:
    """Why `path` is not a safe artifact path (relative POSIX, no escape, no aliasing), or None."""
    if not path:
        return "empty path"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if "\x00" in path:
        return "contains NUL"
    if "\\" in path:
        return "contains a backslash"
    if path.startswith("/"):
        return "absolute path"
    for part in path.split("/"):
        if part == "":
            return "empty path component"
        if part in (".", ".."):
            # `..` escapes the tree; `.` would let two spellings name one file.
            return f"{part!r} path component"
    if path in RESERVED_NAMES or path.split("/", 1)[0] in (PARTS_DIR, REPLACED_DIR):
        return "reserved name"
    return None


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One claim as recorded in the manifest."""

    path: str
    bytes: int
    blake3: str
    sealed_at: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "blake3": self.blake3, "sealed_at": self.sealed_at}


@dataclass(frozen=True, slots=True)
class Manifest:
    """The canonical list of claims at one moment; `digest` is the MANIFEST CANONICAL FORM digest."""

    run_id: str
    instance: str
    files: tuple[ManifestFile, ...]
    roster: tuple[str, ...]
    digest: str
    # The watched directories' base names when there are two or more (each path then starts with
    # one of them); empty for one. Not part of the digest: it says how to read paths, not bytes.
    watch_dirs: tuple[str, ...] = ()
    # Files an earlier pull of this box and run put in the tree that the box no longer claims
    # (deleted, renamed or released there), still holding the bytes it put there. Verify checks
    # their bytes like the rest; they are not claims, so not part of the digest or the roster.
    retired: tuple[ManifestFile, ...] = ()

    @classmethod
    def build(
        cls,
        run_id: str,
        instance: str,
        files: Iterable[ManifestFile],
        roster: Iterable[str],
        watch_dirs: Iterable[str] = (),
        retired: Iterable[ManifestFile] = (),
    ) -> Manifest:
        """A manifest over `files` (sorted by path), its digest computed here. Raises StateError for
        an unsafe or duplicate path, so that nothing is written that could not be read back."""
        ordered = tuple(sorted(files, key=lambda f: f.path.encode("utf-8")))
        cells = tuple(roster)
        names = tuple(watch_dirs)
        for i, f in enumerate(ordered):
            _check_file(f, f"files[{i}]", "manifest")
        _check_unique(ordered, "manifest")
        for i, cell in enumerate(cells):
            _check_cell(cell, f"roster[{i}]", "manifest")
        _check_watch_dirs(names, ordered, "manifest")
        kept = _checked_retired(retired, ordered, "manifest")
        return cls(run_id, instance, ordered, cells, manifest_digest(ordered), names, kept)

    def with_retired(self, retired: Iterable[ManifestFile]) -> Manifest:
        return dataclasses.replace(self, retired=_checked_retired(retired, self.files, "manifest"))

    def cell_of(self, path: str) -> str:
        """The roster cell of an artifact path: its first component after the watched directory's
        name when paths carry one (two or more watched directories), else its first component."""
        parts = path.split("/")
        if len(self.watch_dirs) >= 2 and len(parts) > 1:
            return parts[1]
        return parts[0]

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": MANIFEST_SCHEMA,
            "run_id": self.run_id,
            "instance": self.instance,
            "hash": HASH_NAME,
            "files": [f.to_json() for f in self.files],
            "roster": list(self.roster),
            "watch_dirs": list(self.watch_dirs),
            "totals": {"files": len(self.files), "bytes": self.total_bytes},
            "digest": self.digest,
            "retired": [f.to_json() for f in self.retired],
        }


def lock_tree(root: Path, *, exclusive: bool) -> int:
    """Open the tree's root directory and lock it (a pull: exclusive; a verify: shared), without
    waiting. Returns the fd, which holds the lock until it is closed. ControllerError if another
    pull holds it (or a verify, for an exclusive lock)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
    if exclusive:
        # A pull writes relative to this fd: it must be the resolved directory, not a symlink to one.
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(root, flags)
    except OSError as exc:
        raise StateError(f"{root}: cannot open the directory: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        if exclusive:
            raise ControllerError(
                f"another pull into {root} is running (or a verify of it); wait for it"
            ) from None
        raise ControllerError(f"another pull into {root} is running; wait for it") from None
    except OSError as exc:
        os.close(fd)
        raise StateError(f"{root}: cannot lock the directory: {exc.strerror or exc}") from exc
    return fd


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON so that `path` holds either the old content or all of the new one, even
    across a crash: tmp in the same directory → write → fsync → rename → fsync the directory."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise StateError(f"{path}: cannot write it: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            # mkstemp makes 0600; these files describe the user's own data and are meant to be read.
            os.fchmod(fh.fileno(), 0o644)
            fh.write(text.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            why = exc.strerror or str(exc)
            full = " (free some space, then run the command again)" if exc.errno == errno.ENOSPC else ""
            raise StateError(f"{path}: cannot write it: {why}{full}") from exc
        raise
    fsync_dir(path.parent)


def write_manifest(directory: Path, m: Manifest) -> Path:
    """Write `m` as `directory/MANIFEST.json` (atomically) and return that path."""
    path = directory / MANIFEST_NAME
    atomic_write_json(path, m.to_json())
    logger.debug("wrote %s (%d files, digest %s)", path, len(m.files), m.digest)
    return path


def load_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the regular file `path` (never through a symlink). StateError otherwise."""
    # O_NONBLOCK: a FIFO planted under this name must be refused, not block the open forever.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise StateError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise StateError(f"{path}: not a regular file")
            raw = fh.read()
    except OSError as exc:
        raise StateError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateError(f"{path}: not valid JSON: {exc}") from exc
    except RecursionError:  # arrays nested deeper than the parser's stack: no file of ours
        raise StateError(f"{path}: not valid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise StateError(f"{path}: top level is not a JSON object")
    return doc


def read_manifest(path: Path) -> Manifest:
    """Parse and validate MANIFEST.json; StateError (naming file and field) for anything amiss,
    including a `digest` that does not match its own files (a tampered manifest)."""
    doc = load_json_object(path)
    where = str(path)
    if doc.get("schema") != MANIFEST_SCHEMA:
        raise StateError(f"{where}: field 'schema' is {doc.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
    if doc.get("hash") != HASH_NAME:
        raise StateError(f"{where}: field 'hash' is {doc.get('hash')!r}, expected {HASH_NAME!r}")
    run_id = _field(doc, "run_id", str, where)
    instance = _field(doc, "instance", str, where)
    raw_files = _field(doc, "files", list, where)
    raw_roster = _field(doc, "roster", list, where)
    digest = _field(doc, "digest", str, where)

    files = tuple(_parse_file(raw, f"files[{i}]", where) for i, raw in enumerate(raw_files))
    _check_unique(files, where)
    roster = tuple(_parse_cell(raw, f"roster[{i}]", where) for i, raw in enumerate(raw_roster))
    raw_watch = doc.get("watch_dirs", [])
    if not isinstance(raw_watch, list):
        raise StateError(f"{where}: field 'watch_dirs' must be list, got {type(raw_watch).__name__}")
    watch_dirs = tuple(_parse_cell(raw, f"watch_dirs[{i}]", where) for i, raw in enumerate(raw_watch))
    _check_watch_dirs(watch_dirs, files, where)

    totals = doc.get("totals")
    if totals is not None:
        expected = {"files": len(files), "bytes": sum(f.bytes for f in files)}
        if totals != expected:
            raise StateError(f"{where}: field 'totals' is {totals!r}, its files add up to {expected!r}")
    recomputed = manifest_digest(files)
    if digest != recomputed:
        raise StateError(
            f"{where}: field 'digest' is {digest!r} but its files digest to {recomputed!r} "
            "(the manifest was edited)"
        )
    ordered = tuple(sorted(files, key=lambda f: f.path.encode("utf-8")))
    raw_retired = doc.get("retired", [])  # absent in manifests written before the field existed
    if not isinstance(raw_retired, list):
        raise StateError(f"{where}: field 'retired' must be list, got {type(raw_retired).__name__}")
    retired = _checked_retired(
        (_parse_file(raw, f"retired[{i}]", where) for i, raw in enumerate(raw_retired)), ordered, where
    )
    return Manifest(run_id, instance, ordered, roster, digest, watch_dirs, retired)


def _checked_retired(
    retired: Iterable[ManifestFile], files: tuple[ManifestFile, ...], where: str
) -> tuple[ManifestFile, ...]:
    ordered = tuple(sorted(retired, key=lambda f: f.path.encode("utf-8")))
    for i, f in enumerate(ordered):
        _check_file(f, f"retired[{i}]", where)
    _check_unique((*files, *ordered), where)  # a path twice, or a file where another has a directory
    return ordered


def _field(doc: dict[str, Any], name: str, kind: type[_T], where: str) -> _T:
    if name not in doc:
        raise StateError(f"{where}: field {name!r} is missing")
    value = doc[name]
    if not isinstance(value, kind):
        raise StateError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _parse_file(raw: object, field: str, where: str) -> ManifestFile:
    if not isinstance(raw, dict):
        raise StateError(f"{where}: field {field!r} must be an object")
    values: dict[str, Any] = {}
    for key, kind in (("path", str), ("bytes", int), ("blake3", str), ("sealed_at", str)):
        if key not in raw:
            raise StateError(f"{where}: field '{field}.{key}' is missing")
        value = raw[key]
        # bool is an int subclass; `true` is not a size.
        if not isinstance(value, kind) or isinstance(value, bool):
            raise StateError(f"{where}: field '{field}.{key}' must be {kind.__name__}")
        values[key] = value
    f = ManifestFile(values["path"], values["bytes"], values["blake3"], values["sealed_at"])
    _check_file(f, field, where)
    return f


def _check_file(f: ManifestFile, field: str, where: str) -> None:
    problem = path_problem(f.path)
    if problem is not None:
        raise StateError(f"{where}: field '{field}.path' is unsafe ({problem}): {f.path!r}")
    if f.bytes < 0:
        raise StateError(f"{where}: field '{field}.bytes' is negative: {f.bytes}")
    if not is_digest(f.blake3):
        raise StateError(f"{where}: field '{field}.blake3' is not 64 lowercase hex: {f.blake3!r}")
    if not _is_utc_iso(f.sealed_at):
        raise StateError(f"{where}: field '{field}.sealed_at' is not an ISO-8601 UTC time: {f.sealed_at!r}")


def _is_utc_iso(value: str) -> bool:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return False
    return parsed.utcoffset() == timedelta(0)


def _check_unique(files: Sequence[ManifestFile], where: str) -> None:
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise StateError(f"{where}: field 'files' lists {f.path!r} twice")
        seen.add(f.path)
    for f in files:
        # "a" and "a/b" cannot both be files on disk; such a manifest can never verify.
        parts = f.path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in seen:
                raise StateError(f"{where}: field 'files' lists {parent!r} as a file and as a directory")


def _check_watch_dirs(names: Sequence[str], files: Sequence[ManifestFile], where: str) -> None:
    """Each name one path component, no repeats, and (with two or more) every path under one."""
    for i, name in enumerate(names):
        _check_cell(name, f"watch_dirs[{i}]", where)
    if len(set(names)) != len(names):
        raise StateError(f"{where}: field 'watch_dirs' names a directory twice: {list(names)!r}")
    if len(names) < 2:
        return
    for i, f in enumerate(files):
        if f.path.split("/", 1)[0] not in names or "/" not in f.path:
            raise StateError(
                f"{where}: field 'files[{i}].path' is {f.path!r}, not under one of watch_dirs {list(names)!r}"
            )


def _parse_cell(raw: object, field: str, where: str) -> str:
    if not isinstance(raw, str):
        raise StateError(f"{where}: field {field!r} must be str")
    _check_cell(raw, field, where)
    return raw


def _check_cell(cell: str, field: str, where: str) -> None:
    problem = path_problem(cell)
    if problem is None and "/" in cell:
        problem = "a roster cell is one path component"
    if problem is not None:
        raise StateError(f"{where}: field {field!r} is not a valid roster cell ({problem}): {cell!r}")
