"""The files written beside a pulled tree: MANIFEST.json (schema `boxwarden.manifest/1`, the claims
the tree must match) and the crash-safe JSON writer used for it and for PULL_VERIFIED.json.

Reading a manifest is strict: anything malformed, unsafe or tampered with is a StateError naming the
file and the field, because a manifest the verifier cannot trust must never let the gate pass.
"""

from __future__ import annotations

import contextlib
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
from controller.errors import StateError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.json"
MARKER_NAME = "PULL_VERIFIED.json"
MANIFEST_SCHEMA = "boxwarden.manifest/1"
MARKER_SCHEMA = "boxwarden.verified/1"
HASH_NAME = "blake3"

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
    if path in RESERVED_NAMES:
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

    @classmethod
    def build(
        cls, run_id: str, instance: str, files: Iterable[ManifestFile], roster: Iterable[str]
    ) -> Manifest:
        """A manifest over `files` (sorted by path), its digest computed here. Raises StateError for
        an unsafe or duplicate path, so that nothing is written that could not be read back."""
        ordered = tuple(sorted(files, key=lambda f: f.path.encode("utf-8")))
        cells = tuple(roster)
        for i, f in enumerate(ordered):
            _check_file(f, f"files[{i}]", "manifest")
        _check_unique(ordered, "manifest")
        for i, cell in enumerate(cells):
            _check_cell(cell, f"roster[{i}]", "manifest")
        return cls(run_id, instance, ordered, cells, manifest_digest(ordered))

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
            "totals": {"files": len(self.files), "bytes": self.total_bytes},
            "digest": self.digest,
        }


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
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            # mkstemp makes 0600; these files describe the user's own data and are meant to be read.
            os.fchmod(fh.fileno(), 0o644)
            fh.write(text.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
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
    return Manifest(run_id, instance, ordered, roster, digest)


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
