"""ArtifactNamer: the mapping between files under the watched directories and artifact paths.

An artifact path is POSIX and relative to its watched directory; with several watched directories
it is prefixed by that directory's name (the proto's PATHS rule). Every path that arrives from the
wire goes through `to_abs`, which refuses anything that could leave its root.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from sidecar.errors import NotFoundError, UnsafePathError


def check_relative(rel: str) -> tuple[str, ...]:
    """The components of a safe relative POSIX path, or UnsafePathError."""
    if not rel or "\x00" in rel or "\\" in rel or rel.startswith("/"):
        raise UnsafePathError(f"unsafe path {rel!r}: must be relative, without NUL or backslash")
    parts = tuple(rel.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"unsafe path {rel!r}: empty, '.' or '..' component")
    return parts


# Names the controller writes beside a pulled tree; an artifact may not take them.
RESERVED_TOP = frozenset({"MANIFEST.json", "PULL_VERIFIED.json"})


def name_problem(art: str) -> str | None:
    """Why a file with this artifact path can never be claimed (the controller could not take it)."""
    try:
        art.encode("utf-8")
    except UnicodeEncodeError:
        return "name is not valid UTF-8"
    if "\\" in art:
        return "name contains a backslash"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in art):
        return "name contains a control character"
    if art in RESERVED_TOP:
        return "name is reserved for the pulled tree's own files"
    return None


def display(art: str) -> str:
    """A printable, wire-safe spelling of any artifact path (non-UTF-8 bytes escaped)."""
    return art.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass(frozen=True, slots=True)
class Entry:
    art: str
    path: Path
    st: os.stat_result
    kind: Literal["artifact", "temp", "unclaimable"]


class ArtifactNamer:
    def __init__(self, watch_dirs: tuple[Path, ...], temp_patterns: tuple[str, ...]) -> None:
        self._roots = watch_dirs
        self._prefixed = len(watch_dirs) > 1
        self._patterns = temp_patterns

    @property
    def roots(self) -> tuple[Path, ...]:
        return self._roots

    def is_temp(self, rel_parts: tuple[str, ...]) -> bool:
        """A name matching a temp pattern, in any component, is never an artifact (e.g. `.cache/x`)."""
        return any(fnmatch.fnmatchcase(p, pat) for p in rel_parts for pat in self._patterns)

    def to_artifact(self, path: Path) -> str | None:
        """The artifact path of an absolute file path, or None if it is outside the watched dirs."""
        for root in self._roots:
            try:
                rel = path.relative_to(root)
            except ValueError:
                continue
            if not rel.parts:
                return None
            posix = PurePosixPath(*rel.parts).as_posix()
            return f"{root.name}/{posix}" if self._prefixed else posix
        return None

    def claimable(self, path: Path) -> str | None:
        """The artifact path if a file here could be claimed (under a watched dir, not temp-named,
        a name the controller can take); else None. Does not look at the disk."""
        art = self.to_artifact(path)
        if art is None or self.is_temp(tuple(art.split("/"))) or name_problem(art):
            return None
        return art

    def to_abs(self, artifact: str) -> Path:
        """The absolute path for an artifact path from the wire; refuses escapes and symlinks."""
        parts = check_relative(artifact)
        if self._prefixed:
            by_name = {r.name: r for r in self._roots}
            root = by_name.get(parts[0])
            if root is None or len(parts) < 2:
                raise NotFoundError(f"{artifact!r} is not under a watched directory")
            parts = parts[1:]
        else:
            root = self._roots[0]
        path = root.joinpath(*parts)
        # No component below the root may be a symlink: a link could point anywhere.
        cur = root
        for p in parts:
            cur = cur / p
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                return path
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(f"{artifact!r} goes through a symlink ({cur})")
        return path

    def walk(self) -> list[tuple[str, Path, os.stat_result]]:
        """Every claimable regular file under the watched dirs: (artifact path, abs path, lstat).

        Symlinks are not followed and not listed: a link is not an artifact.
        """
        return [(e.art, e.path, e.st) for e in self.walk_all() if e.kind == "artifact"]

    def walk_all(self) -> list[Entry]:
        """Every regular file under the watched dirs, temp-named and unclaimable ones included."""
        out: list[Entry] = []
        for root in self._roots:
            for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
                base = Path(dirpath)
                for name in filenames:
                    p = base / name
                    try:
                        st = os.lstat(p)
                    except OSError:
                        continue
                    art = self.to_artifact(p)
                    if art is None or not stat.S_ISREG(st.st_mode):
                        continue
                    if self.is_temp(tuple(art.split("/"))):
                        out.append(Entry(art, p, st, "temp"))
                    elif name_problem(art):
                        out.append(Entry(art, p, st, "unclaimable"))
                    else:
                        out.append(Entry(art, p, st, "artifact"))
        return out
