"""Where a pulled tree may lie: never overlapping what it is evidence about (the box's watched,
state and durable directories), never on a pseudo-filesystem, never under a regular file; and
whether each artifact path fits this system's limits and a writable directory (checked before a
pull fetches its first byte; what lies in a path's way is `controller.inway`'s).

`overlap_problem` is shared by `pull` (refuses before writing anything) and the gate (refuses to
judge a tree that overlaps what `down` would delete). Both sides are resolved the same way
(symlinks followed; a path that does not exist yet is resolved through its deepest existing
ancestor), so no spelling of a path can slip past the comparison. `pseudo_filesystem` is shared by
`pull` and `up` (a watched dir, a workdir or a durable dir there holds no files either).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.durable import local_dir
from controller.errors import TransferError, UsageError

logger = logging.getLogger(__name__)

# Filesystems that hold no files of their own: a pull there writes nowhere (or somewhere strange).
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "efivarfs",
        "binfmt_misc",
        "autofs",
        "nsfs",
    }
)
_PSEUDO_PREFIXES = (Path("/proc"), Path("/sys"), Path("/dev"))
PATH_MAX = 4096


def resolve_loose(path: Path | str) -> Path:
    """The real path `path` names: symlinks resolved in its deepest existing ancestor, the rest
    (which does not exist yet) appended as written."""
    here = Path(os.path.join(os.getcwd(), os.fspath(path)))
    tail: list[str] = []
    while not os.path.lexists(here) and here != here.parent:
        tail.insert(0, here.name)
        here = here.parent
    return Path(os.path.normpath(os.path.join(os.path.realpath(here), *tail)))


def this_boot_id() -> str:
    """This machine's boot id; a box whose sidecar reports the same one runs under this kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def overlap_problem(pulled: Path, hello: pb.HelloResponse) -> str | None:
    """Why the pulled tree `pulled` may not lie where it does, or None.

    It may not be equal to, inside, or contain any of the box's watched directories, its state
    directory, or the local path of its durable root (or durable URL): a tree that overlaps what it
    judges would be verified against itself, and `down` would delete the only copy.
    """
    if hello.boot_id and hello.boot_id != this_boot_id():
        return None  # the box is another machine (another kernel): its paths are not ours
    mine = resolve_loose(pulled)
    theirs: list[tuple[str, str]] = [(d, "watched directory") for d in hello.watch_dirs if d]
    if hello.state_dir:
        theirs.append((hello.state_dir, "state directory"))
    for url, role in ((hello.durable_root, "durable root"), (hello.durable_url, "durable store")):
        local = local_dir(url)
        if local is not None:
            theirs.append((os.fspath(local), role))
    resolved = [(resolve_loose(raw), role) for raw, role in theirs]
    name = hello.box_name or "NAME"
    for other, role in resolved:
        if mine == other:
            relation = "is"
        elif mine.is_relative_to(other):
            relation = "is inside"
        elif other.is_relative_to(mine):
            relation = "contains"
        elif same_dir_above(mine, other):
            relation = "is (through a bind mount or another alias) inside"
        elif same_dir_above(other, mine):
            relation = "contains (through a bind mount or another alias)"
        else:
            continue
        return (
            f"the pulled tree {mine} {relation} the box's {role} {other}: the copy must be separate "
            f"from what it proves, or `down` would delete the only copy; pull into a directory outside "
            f"it, e.g. `boxwarden pull {name} --to ./pulled-{name}`"
        )
    mounted = _mount_problem(mine, resolved)
    if mounted:
        return (
            f"the pulled tree {mine} {mounted}: the copy must be separate from what it proves, or "
            f"`down` would delete the only copy; pull into a plain directory outside it, e.g. "
            f"`boxwarden pull {name} --to ./pulled-{name}`"
        )
    return None


class _Mount:
    """One line of /proc/self/mountinfo: where it is mounted, what it shows, what it is."""

    def __init__(self, point: Path, dev: str, root: str, fstype: str, options: str) -> None:
        self.point, self.dev, self.root, self.fstype, self.options = point, dev, root, fstype, options

    def place(self, path: Path) -> str:
        """Where `path`, under this mount, lies within the mounted filesystem."""
        rest = path.relative_to(self.point).as_posix()
        return os.path.normpath(os.path.join(self.root, rest)) if rest != "." else self.root


def _mounts() -> list[_Mount]:
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-")
            out.append(
                _Mount(
                    Path(_unescape(fields[4])),
                    fields[2],
                    _unescape(fields[3]),
                    fields[sep + 1],
                    fields[sep + 3] if len(fields) > sep + 3 else "",
                )
            )
        except (ValueError, IndexError):
            continue
    return out


def _top_mount(mounts: list[_Mount], path: Path) -> _Mount | None:
    """The mount `path` shows: at the deepest mount point above it, the one mounted last."""
    best: _Mount | None = None
    for m in mounts:
        if path.is_relative_to(m.point) and (best is None or len(m.point.parts) >= len(best.point.parts)):
            best = m
    return best


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _mount_problem(mine: Path, others: list[tuple[Path, str]]) -> str | None:
    """Why mounts make the pulled tree `mine` show the box's own files, or None: a filesystem
    mounted inside it (what it shows is no copy), a bind mount that shows a watched (state,
    durable) directory or one inside it (the same place in the same filesystem), or an overlay
    whose layers are one of those."""
    mounts = _mounts()
    inside = sorted({str(m.point) for m in mounts if m.point != mine and m.point.is_relative_to(mine)})
    if inside:
        return f"has a filesystem mounted inside it, at {inside[0]}"
    top = _top_mount(mounts, mine)
    if top is None:
        return None
    for other, role in others:
        theirs = _top_mount(mounts, other)
        if theirs is not None and theirs.dev == top.dev and _related(top.place(mine), theirs.place(other)):
            return f"shows the same files as the box's {role} {other} (through a bind mount)"
        if top.fstype == "overlay":
            layers = [
                v
                for opt in top.options.split(",")
                if opt.partition("=")[0] in ("lowerdir", "upperdir")
                for v in opt.partition("=")[2].split(":")
                if v.startswith("/")
            ]
            if any(_related(os.path.realpath(v), str(other)) for v in layers):
                return f"is an overlay mount with the box's {role} {other} as a layer"
    return None


def same_dir_above(path: Path, other: Path) -> bool:
    """Is the directory `other` `path` itself or one of its ancestors, by (device, inode)? A bind
    mount is another path to the same directory, which no comparison of paths sees."""
    try:
        st = other.stat()
    except OSError:
        return False
    for p in (path, *path.parents):
        try:
            mine = p.stat()
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def pseudo_filesystem(path: Path) -> str | None:
    """The type of the pseudo-filesystem (proc, sysfs, ...) that `path` lies on, or None if it lies
    on one that stores files. Resolved as `resolve_loose` does: a path that does not exist yet is
    judged by its deepest existing ancestor's filesystem. Without mountinfo, a path under /proc,
    /sys or /dev counts as one ("system")."""
    real = resolve_loose(path)
    fs = _filesystem_type(real)
    if fs in PSEUDO_FILESYSTEMS:
        return fs
    if fs is None and any(real.is_relative_to(p) for p in _PSEUDO_PREFIXES):
        return "system"
    return None


def destination_problem(root: Path) -> str | None:
    """Why a pull cannot make `root` its tree (a pseudo-filesystem, a regular file or something
    else in the way, a name too long), or None. Looks only: creates nothing."""
    real = resolve_loose(root)
    kind = pseudo_filesystem(real)
    if kind is not None:
        return f"{real} is on a {kind} pseudo-filesystem, which stores no files: pull into a normal directory"
    if len(os.fsencode(real)) >= PATH_MAX:
        return f"{real} is longer than this system's limit of {PATH_MAX} bytes: pull into a shorter path"
    deepest = _deepest_existing(real)
    try:
        name_max = os.pathconf(deepest, "PC_NAME_MAX")
    except OSError:
        name_max = 255
    for part in real.parts[1:]:
        if len(os.fsencode(part)) > name_max:
            return f"the name {part!r} in {real} is longer than this filesystem's limit ({name_max} bytes)"
    here = Path("/")
    for part in real.parts[1:]:
        here = here / part
        try:
            st = here.lstat()
        except FileNotFoundError:
            break
        except OSError as exc:
            return f"cannot look at {here}: {exc.strerror or exc}; pull into a directory you can use"
        if not stat.S_ISDIR(st.st_mode):
            return f"{here} is not a directory, so nothing can be created under it: pull elsewhere"
    if not os.access(deepest, os.W_OK | os.X_OK):
        return f"{deepest} is not writable by you, so {real} cannot be made there: pull elsewhere"
    return None


def check_claim_paths(root: Path, paths: list[str]) -> None:
    """Raise UsageError or TransferError (naming the path and the fix) for any artifact path too long
    for this system or filesystem, or under a directory that is not writable. Looks only; what lies
    in a path's way is judged under the tree's lock (`controller.inway`)."""
    try:
        name_max = os.pathconf(root if root.exists() else "/", "PC_NAME_MAX")
    except OSError:
        name_max = 255
    prefix = len(os.fsencode(root)) + 1
    writable: set[Path] = set()
    for path in paths:
        full = root / path
        length = prefix + len(path.encode("utf-8"))
        if length >= PATH_MAX:
            raise UsageError(
                f"{full}: the local path would be {length} bytes, over this system's limit of {PATH_MAX}; "
                "pull into a directory with a shorter path (--to)"
            )
        parts = path.split("/")
        for part in parts:
            if len(part.encode("utf-8")) > name_max:
                raise TransferError(
                    f"{full}: the name {part[:40]!r}… is {len(part.encode('utf-8'))} bytes, over this "
                    f"filesystem's limit of {name_max}; rename it on the box, or pull onto a filesystem "
                    "that takes longer names"
                )
        deepest = _deepest_dir(root, parts[:-1])
        if deepest not in writable:
            if deepest.exists() and not os.access(deepest, os.W_OK | os.X_OK):
                raise TransferError(
                    f"{deepest}: permission denied, so {path} cannot be written there; "
                    "fix its permissions or pull into another directory"
                )
            writable.add(deepest)


def _deepest_dir(root: Path, dirs: list[str]) -> Path:
    here = root
    for part in dirs:
        if not (here / part).is_dir():
            break
        here = here / part
    return here


def _deepest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` lies on (from /proc/self/mountinfo), None if unknown."""
    top = _top_mount(_mounts(), path)
    return top.fstype if top is not None else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
