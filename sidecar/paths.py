"""ArtifactNamer: the mapping between entries under the watched directories and artifact paths, and
what every entry there IS (an artifact, a save in progress, excluded by the user, or unclaimable).

An artifact path is POSIX and relative to its watched directory; with several watched directories
it is prefixed by that directory's name (the proto's PATHS rule). Every path that arrives from the
wire goes through `to_abs`, which refuses anything that could leave its root.

Nothing under a watched directory is ever silently skipped: `walk_all` reports every regular file,
every symlink, every special file and every directory it could not list, each with its kind and,
for the unclaimable ones, the reason and the fix. Temp patterns apply to a FILE's base name only,
never to a directory or to the watched directory's own name.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Literal, NamedTuple

from sidecar import mounts
from sidecar.errors import NotFoundError, UnsafePathError

DEFAULT_TEMP_PATTERNS = ("*.tmp", "*.part", "*.swp", "*.swx", ".*.swp")
"""What real writers use for files in flight: atomic-save temps, download parts, editor swap files.
Never ".*": torch.distributed.checkpoint writes `<dir>/.metadata`, and that is data."""

RELEASE_ASIDE_PREFIX = ".bw-release."
"""ReleaseArtifacts renames a file to `<dir>/.bw-release.<claim id>` before hashing and unlinking it;
such a name is never sealed (an interrupted release is undone at the next start)."""

# Names the controller writes at the top of a pulled tree; an artifact may not take them.
RESERVED_TOP = frozenset(
    {
        # the pulled tree's own files
        "MANIFEST.json",
        "PULL_VERIFIED.json",
        ".bw-parts",
        ".bw-replaced",
        # the durable store's own files, beside the artifacts at the top of a run's corner
        ".boxwarden-tmp",
        ".boxwarden-store-id",
        ".boxwarden-owner",
        ".boxwarden-attic",
    }
)

PATH_MAX = 4096
NAME_MAX = 255

_CONTROL = re.compile("[\x00-\x1f\x7f]")
# Names name_problem has nothing against: printable ASCII without a backslash.
_PLAIN = re.compile("[\x20-\x5b\x5d-\x7e]*")

TEMP_WHY = "a temp name (a save in progress, or one left behind): finish it, delete it, or exclude it"

EntryKind = Literal["artifact", "temp", "excluded", "unclaimable"]


def check_relative(rel: str) -> tuple[str, ...]:
    """The components of a safe relative POSIX path, or UnsafePathError."""
    if not rel or "\x00" in rel or "\\" in rel or rel.startswith("/"):
        raise UnsafePathError(f"unsafe path {rel!r}: must be relative, without NUL or backslash")
    parts = tuple(rel.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"unsafe path {rel!r}: empty, '.' or '..' component")
    return parts


def name_problem(art: str, top: str) -> str | None:
    """Why a file with this artifact path can never be claimed (the controller could not take it),
    with what to do about it; None if it can be. `top` is the first component under the watched
    directory (after the prefix, if any)."""
    try:
        art.encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not valid UTF-8: rename it"
    if "\\" in art:
        return "its name contains a backslash: rename it"
    if _CONTROL.search(art):
        return "its name contains a control character (newline, tab, ...): rename it"
    if top in RESERVED_TOP:
        return f"{top!r} is reserved for boxwarden's own files (pulled tree, durable store): rename it"
    return None


def display(art: str) -> str:
    """A printable, wire-safe spelling of any artifact path (non-UTF-8 bytes escaped)."""
    if art.isascii():
        return art
    return art.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class Entry(NamedTuple):  # a tuple: a walk makes 100,000 (a frozen dataclass cost 0.5 s more)
    art: str  # artifact path (may hold surrogate escapes: use display() on the wire)
    where: str  # its absolute path (a str: a walk of 100,000 files makes no Path objects)
    st: os.stat_result | None  # lstat of a file; None for an entry that could not be looked at
    kind: EntryKind
    why: str = ""  # for temp and unclaimable entries: what it is and what to do

    @property
    def path(self) -> Path:
        return Path(self.where)


class ArtifactNamer:
    def __init__(
        self,
        watch_dirs: tuple[Path, ...],
        temp_patterns: tuple[str, ...] = DEFAULT_TEMP_PATTERNS,
        exclude_patterns: tuple[str, ...] = (),
        root_signatures: Mapping[Path, str] | None = None,
    ) -> None:
        """`root_signatures`: each watched dir's mount signature (see sidecar.mounts) when the box
        came up; a walk that finds another reports the dir as unclaimable."""
        self._roots = watch_dirs
        self._signatures = dict(root_signatures or {})
        self._prefixed = len(watch_dirs) > 1
        # Each pattern list as one compiled regex: a walk classifies 100,000 names.
        self._temp = _any_of(temp_patterns)
        self._exclude_base = _any_of(tuple(p for p in exclude_patterns if "/" not in p))
        self._exclude_path = _any_of(tuple(p for p in exclude_patterns if "/" in p))
        # One watched dir inside another: a file's artifact path is `to_artifact`'s (the first root
        # that holds it), not the one the walk would build from where it found it.
        self._nested = any(a != b and b in a.parents for a in watch_dirs for b in watch_dirs)

    @property
    def roots(self) -> tuple[Path, ...]:
        return self._roots

    # -- classification (no disk access) ---------------------------------------------------------

    def is_temp_name(self, name: str) -> bool:
        """A file base name that marks a save in progress (temp patterns, release asides)."""
        return name.startswith(RELEASE_ASIDE_PREFIX) or bool(self._temp and self._temp.match(name))

    def is_excluded(self, art: str) -> bool:
        """Excluded by the user: a pattern without '/' matches the base name, one with '/' the path."""
        if self._exclude_path is not None and self._exclude_path.match(art):
            return True
        return self._exclude_base is not None and bool(self._exclude_base.match(art.rsplit("/", 1)[-1]))

    def kind_of(self, art: str) -> tuple[EntryKind, str]:
        """What a regular file at this artifact path is, and why (for the non-artifacts)."""
        if self.is_excluded(art):
            return "excluded", "matches an exclude pattern given at up"
        base = art[art.rfind("/") + 1 :]
        if self.is_temp_name(base):
            if base.startswith(RELEASE_ASIDE_PREFIX):
                return (
                    "temp",
                    "named like a release aside: the sidecar puts back its own at start; "
                    "if it is yours, rename it",
                )
            return "temp", TEMP_WHY
        # The pulled tree and the durable corner both hold artifact paths as they are (prefix and
        # all): the reserved names are reserved at the top of the artifact path.
        top = art[: art.find("/")] if "/" in art else art
        if _PLAIN.fullmatch(art) and top not in RESERVED_TOP:
            return "artifact", ""  # the common case, without name_problem's checks one by one
        problem = name_problem(art, top)
        if problem:
            return "unclaimable", problem
        return "artifact", ""

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

    def dir_prefix(self, path: Path) -> str | None:
        """What the artifact path of everything under the directory `path` starts with ("" for the
        one watched dir itself), or None if nothing under it is in a watched dir."""
        art = self.to_artifact(path / "x")
        return None if art is None else art[:-1]

    def claimable(self, path: Path) -> str | None:
        """The artifact path if a file here could be claimed (under a watched dir, not temp-named,
        not excluded, a name the controller can take); else None. Does not look at the disk."""
        art = self.to_artifact(path)
        if art is None or self.kind_of(art)[0] != "artifact":
            return None
        return art

    def root_of(self, artifact: str) -> tuple[Path, Sequence[str]]:
        """The watched dir an artifact path lies in and its components below it, from the text
        alone (the disk is not asked); refuses escapes."""
        parts = check_relative(artifact)
        if not self._prefixed:
            return self._roots[0], parts
        root = {r.name: r for r in self._roots}.get(parts[0])
        if root is None or len(parts) < 2:
            raise NotFoundError(f"{artifact!r} is not under a watched directory")
        return root, parts[1:]

    def to_abs(self, artifact: str) -> Path:
        """The absolute path for an artifact path from the wire; refuses escapes and symlinks."""
        root, parts = self.root_of(artifact)
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

    # -- the walk --------------------------------------------------------------------------------

    def walk(self) -> list[tuple[str, Path, os.stat_result]]:
        """Every claimable regular file under the watched dirs: (artifact path, abs path, lstat)."""
        return [(e.art, e.path, e.st) for e in self.walk_all() if e.kind == "artifact" and e.st is not None]

    def walk_all(self) -> list[Entry]:
        """Every entry under the watched dirs that is not a directory we could list.

        Regular files get their kind; a symlink, a special file, a directory that cannot be listed
        (EACCES, EIO) or a path too long to open is reported as unclaimable with the reason. No
        symlink is followed."""
        with mounts.Watch() as table:
            return self._walk_all(table)

    def _walk_all(self, table: mounts.Watch) -> list[Entry]:
        out: list[Entry] = []
        inner: set[str] = set()  # mount points inside a watched dir: reported, never entered
        points = table.read()

        def more_mounts() -> None:
            """Mount points under a watched dir not seen yet (made since `points` was read)."""
            for root in self._roots:
                for point in mounts.inside(root, points):
                    if point not in inner:
                        inner.add(point)
                        if Path(point) not in self._roots:  # a watched dir of its own is walked as one
                            out.append(self._problem(Path(point), _MOUNT_INSIDE))

        now = mounts.signatures(self._roots, points) if self._signatures else {}
        for root in self._roots:
            then = self._signatures.get(root)
            why = mounts.changed(then, now[root]) if then is not None and root in now else None
            if why is not None:
                out.append(
                    self._problem(
                        root,
                        f"the watched directory changed under its path: {why}. What the other tree "
                        "holds is hidden from every check: put the mounts back as they were",
                    )
                )
        more_mounts()
        for root in self._roots:
            # Each directory travels with its artifact-path prefix: 100,000 files cost 5 s when each
            # one's artifact path was derived from its Path (relative_to) instead.
            try:
                root_st = os.lstat(root)
                root_dev = root_st.st_dev
            except OSError:
                root_dev = -1  # scandir below says what is wrong with it
            else:
                if stat.S_ISLNK(root_st.st_mode):
                    out.append(self._problem(root, _ROOT_LINK))
                    continue
            stack = [(str(root), f"{root.name}/" if self._prefixed else "", root_dev)]
            while stack:
                d, prefix, dev = stack.pop()
                try:
                    with os.scandir(d) as it:
                        entries = list(it)
                except OSError as exc:
                    if d == str(root) and isinstance(exc, FileNotFoundError):
                        out.append(self._problem(root, "the watched directory itself is gone: recreate it"))
                        continue
                    out.append(
                        self._problem(
                            Path(d), f"cannot list this directory ({_why(exc)}): nothing in it can be checked"
                        )
                    )
                    continue
                for e in entries:
                    # d_type, no syscall: a directory may have become a mount point since the
                    # table was read (the kernel flags the change); read it again before looking.
                    if e.is_dir(follow_symlinks=False) and table.changed():
                        points = table.read()
                        more_mounts()
                    if e.path in inner:
                        # Not even looked at: a network or FUSE mount that stopped answering would
                        # hang the walk (and every listing with it) in the kernel.
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError as exc:
                        out.append(self._problem(Path(e.path), f"cannot look at it ({_why(exc)})"))
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        if st.st_dev != dev and Path(e.path) not in self._roots:
                            # Another filesystem mounted here hides whatever this one holds below it.
                            out.append(self._problem(Path(e.path), _MOUNT_INSIDE))
                        stack.append((e.path, f"{prefix}{e.name}/", st.st_dev))
                    elif stat.S_ISREG(st.st_mode):
                        out.append(self._file(e.path, st, prefix + e.name))
                    elif stat.S_ISLNK(st.st_mode):
                        p = Path(e.path)
                        try:
                            target = os.readlink(p)
                        except OSError:
                            target = "?"
                        out.append(
                            self._problem(
                                p,
                                f"a symlink (to {target!r}) is never followed: copy what it points to "
                                "into the watched dir, or exclude it",
                                excludable=True,
                            )
                        )
                    else:
                        out.append(
                            self._problem(
                                Path(e.path),
                                f"not a regular file ({file_type(st.st_mode)}): remove it or exclude it",
                                excludable=True,
                            )
                        )
        return out

    def _file(self, where: str, st: os.stat_result, art: str) -> Entry:
        """A regular file found by the walk: `art` is its artifact path, `where` its absolute path."""
        if self._nested:
            art = self.to_artifact(Path(where)) or art
        if len(os.fsencode(where)) >= PATH_MAX:
            return Entry(
                art,
                where,
                st,
                "unclaimable",
                f"its path is longer than PATH_MAX ({PATH_MAX} bytes): move it up",
            )
        kind, why = self.kind_of(art)
        return Entry(art, where, st, kind, why)

    def _problem(self, p: Path, why: str, *, excludable: bool = False) -> Entry:
        """An entry the walk cannot claim. Only a single entry that is not a directory (a symlink,
        a FIFO, a device) may be excluded by a pattern; a directory that hides what it holds (a
        mount point, one that cannot be listed, the watched dir itself) never is: a pattern names
        files, and `*.log` would otherwise drop a whole subtree because of its top's name."""
        art = self.to_artifact(p) or (p.name if self._prefixed else ".")
        if excludable and self.is_excluded(art):
            return Entry(art, str(p), None, "excluded", "matches an exclude pattern given at up")
        return Entry(art, str(p), None, "unclaimable", why)


_MOUNT_INSIDE = (
    "a mount point inside a watched dir: what lies under it is hidden from every check; unmount it, "
    "or watch it on its own"
)


_ROOT_LINK = (
    "the watched directory is a symlink now (moved elsewhere and linked back?): nothing behind it is "
    "watched; put the directory itself back at this path, or bring the box up with the new path"
)


def _any_of(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    """One regex matching exactly what fnmatchcase matches for any of `patterns`; None if none."""
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" if exc.strerror else str(exc)


def open_regular(path: str | Path, *, follow: bool = True) -> int:
    """`path` opened read-only, as an fd, only if it is a regular file. Never blocks: a job may put
    a FIFO where a file was, and a plain open() of one waits for a writer forever. OSError
    (EINVAL, saying what it is) for anything else; ELOOP for a symlink unless `follow`."""
    nofollow = 0 if follow else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | nofollow)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"not a regular file but {file_type(mode)}", str(path))
    return fd


def file_type(mode: int) -> str:
    """What a non-regular file is, in words ("a fifo"), for a message that refuses it."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"
