"""ArtifactNamer: the mapping between files under the watched directories and artifact paths.

An artifact path is POSIX and relative to its watched directory; with several watched directories
it is prefixed by that directory's name (the proto's PATHS rule). Every path that arrives from the
wire goes through `to_abs`, which refuses anything that could leave its root.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from pathlib import Path, PurePosixPath

from sidecar.errors import NotFoundError, UnsafePathError


def check_relative(rel: str) -> tuple[str, ...]:
    """The components of a safe relative POSIX path, or UnsafePathError."""
    if not rel or "\x00" in rel or "\\" in rel or rel.startswith("/"):
        raise UnsafePathError(f"unsafe path {rel!r}: must be relative, without NUL or backslash")
    parts = tuple(rel.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"unsafe path {rel!r}: empty, '.' or '..' component")
    return parts


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

    def is_candidate(self, path: Path) -> bool:
        """Under a watched dir and not temp-named (does not look at the disk)."""
        art = self.to_artifact(path)
        return art is not None and not self.is_temp(tuple(art.split("/")))

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
        """Every regular, non-temp file under the watched dirs: (artifact path, abs path, lstat).

        Symlinks are not followed and not listed: a link is not an artifact.
        """
        out: list[tuple[str, Path, os.stat_result]] = []
        for root in self._roots:
            for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
                base = Path(dirpath)
                dirnames[:] = [d for d in dirnames if not self.is_temp((d,))]
                for name in filenames:
                    p = base / name
                    try:
                        st = os.lstat(p)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    art = self.to_artifact(p)
                    if art is None or self.is_temp(tuple(art.split("/"))):
                        continue
                    out.append((art, p, st))
        return out
