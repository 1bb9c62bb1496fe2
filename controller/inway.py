"""What lies in the way of a pull's claims, and moving aside what an earlier pull put there.

Before the first byte is fetched, `survey` looks at every claim's path in the tree: its bytes may
be there already (skipped); a file an earlier pull of this box and run put there may hold older
bytes (a rewrite on the box); or the path may have changed kind on the box since (a file where a
directory was, or back), so that a file an earlier pull put at a directory's place, or a whole
directory of files it put there, is in the way. Such bytes are the pull's own: they move to
`REPLACED_DIR/<path>.<blake3>` when the claim that needs their place is put in place (`clear`), and
the directories they leave empty go. Pull never asks the user to move them.

Anything else in the way (a file whose bytes no pull of this box put there, or that was edited
since, a directory holding one, a symlink, a socket) is the user's: nothing is touched, and one
UsageError names every such path at once, with what to do.

A pull that stops while it moves things aside loses nothing: each file moves with one rename, and
the next pull knows the rest from the same records (the tree's MANIFEST.json is rewritten only once
every claim is in place).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.digest import digest_file
from controller.errors import TransferError, UsageError
from controller.manifest import REPLACED_DIR
from controller.parts import DIR_FLAGS

logger = logging.getLogger(__name__)

Entry = tuple[str, int, str]  # (path, bytes, blake3) of a file a pull put, or may have put, in place
NAME_MAX = 255


@dataclass
class Aside:
    """What must leave a claim's way before it is put in place: files an earlier pull put there
    (path, blake3), and then the directories they leave empty, deepest first."""

    files: list[tuple[str, str]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)


@dataclass
class Way:
    present: set[str] = field(default_factory=set)  # claims whose bytes are here already
    older: list[str] = field(default_factory=list)  # claims whose path holds older bytes of a pull
    aside: dict[str, Aside] = field(default_factory=dict)  # claim path -> what moves out of its way


def survey(root: Path, claims: list[pb.Claim], instance: str, known: set[Entry]) -> Way:
    """What lies at and above every claim's path in `root`, judged against `known` (the files an
    earlier pull of box `instance` put here, or may have). UsageError naming every path in the way
    that holds something no pull of this box put there; nothing is touched then."""
    look = _Look(root, known)
    way = Way()
    for claim in claims:
        parts = claim.path.split("/")
        plan = Aside()
        blocked = False
        for depth in range(1, len(parts)):
            above = "/".join(parts[:depth])
            st = look.above(above)
            if st is None:
                blocked = True  # nothing below exists
                break
            if stat.S_ISDIR(st.st_mode):
                continue
            moved = look.file_in_way(above, st, f"where the box has a directory ({claim.path})")
            if moved is not None:
                plan.files.append((above, moved))
            blocked = True
            break
        st = None if blocked else look.stat(claim.path)
        if st is None:
            pass
        elif stat.S_ISREG(st.st_mode):
            if look.holds(claim.path, st, claim.size, claim.blake3):
                way.present.add(claim.path)
            elif (moved := look.file_in_way(claim.path, st, "where the box has other bytes now")) is not None:
                plan.files.append((claim.path, moved))
                way.older.append(claim.path)
        elif stat.S_ISDIR(st.st_mode):
            look.tree_in_way(claim.path, plan)
        else:
            look.refuse(claim.path, f"{_kind(st.st_mode)} where the box has a file")
        if plan.files or plan.dirs:
            way.aside[claim.path] = plan
    if look.refused:
        raise UsageError(_refusal(root, instance, look.refused))
    way.older.sort()
    return way


class _Look:
    """Looks at the tree once per path, hashing a file only where its size says it may be known."""

    def __init__(self, root: Path, known: set[Entry]) -> None:
        self.root = root
        self.known = known
        self.sized = {(p, n) for p, n, _ in known}
        self.known_dirs = {p.rsplit("/", i)[0] for p, _, _ in known for i in range(1, p.count("/") + 1)}
        self.refused: dict[str, str] = {}  # path -> why it stays where it is
        self.judged: dict[str, str | None] = {}  # path of a file in the way -> its blake3 if known
        self.seen: dict[str, os.stat_result | None] = {}
        self.digests: dict[str, str | None] = {}

    def above(self, rel: str) -> os.stat_result | None:
        """`stat`, once per directory above a claim (claims share them)."""
        if rel not in self.seen:
            self.seen[rel] = self.stat(rel)
        return self.seen[rel]

    def stat(self, rel: str) -> os.stat_result | None:
        try:
            return os.lstat(self.root / rel)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TransferError(f"{self.root / rel}: cannot look at it: {exc.strerror or exc}") from exc

    def holds(self, rel: str, st: os.stat_result, size: int, blake3: str) -> bool:
        return st.st_size == size and self.digest(rel) == blake3

    def digest(self, rel: str) -> str | None:
        if rel not in self.digests:
            self.digests[rel] = _digest_or_none(self.root / rel)
        return self.digests[rel]

    def known_file(self, rel: str, st: os.stat_result) -> str | None:
        """The blake3 of the file at `rel` if an earlier pull of this box put exactly it there."""
        if not stat.S_ISREG(st.st_mode) or (rel, st.st_size) not in self.sized:
            return None
        digest = self.digest(rel)
        return digest if digest is not None and (rel, st.st_size, digest) in self.known else None

    def file_in_way(self, rel: str, st: os.stat_result, where: str) -> str | None:
        """The blake3 of the file at `rel`, to move aside, if a pull put it there; else refused."""
        if rel not in self.judged:
            self.judged[rel] = self.known_file(rel, st)
            if self.judged[rel] is None:
                if stat.S_ISREG(st.st_mode):
                    self.refuse(
                        rel, f"a file whose bytes no pull of this box put there (or edited since), {where}"
                    )
                else:
                    self.refuse(rel, f"{_kind(st.st_mode)} {where}")
        return self.judged[rel]

    def tree_in_way(self, top: str, plan: Aside) -> None:
        """A directory at a claim's path: every file in it moves aside if a pull put it there, and
        every directory goes once empty; anything else in it refuses the whole directory."""
        files: list[tuple[str, str]] = []
        dirs: list[str] = []
        foreign: list[str] = []
        if top not in self.known_dirs:
            self.refuse(top, "a directory that no pull of this box made, where the box has a file")
            return
        pending = [top]
        while pending:
            rel = pending.pop()
            if rel not in self.known_dirs:
                foreign.append(f"{rel}/")
            dirs.append(rel)
            try:
                with os.scandir(self.root / rel) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as exc:
                foreign.append(f"{rel}/ (cannot list it: {exc.strerror or exc})")
                continue
            for entry in entries:
                path = f"{rel}/{entry.name}"
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    foreign.append(path)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    pending.append(path)
                elif (digest := self.known_file(path, st)) is not None:
                    files.append((path, digest))
                else:
                    foreign.append(path)
        if foreign:
            self.refuse(
                top,
                f"a directory where the box has a file; it holds what no pull of this box put there: "
                f"{', '.join(sorted(foreign))}",
            )
            return
        plan.files += files
        plan.dirs += sorted(dirs, key=lambda d: d.count("/"), reverse=True)

    def refuse(self, rel: str, why: str) -> None:
        self.refused.setdefault(rel, why)


def _refusal(root: Path, instance: str, refused: dict[str, str]) -> str:
    lines = "\n".join(f"  {path}: {why}" for path, why in sorted(refused.items()))
    return (
        f"refusing to pull: {len(refused)} path(s) in {root} hold what no pull of box {instance!r} put "
        f"there, in the way of the box's files; pull never moves, replaces or deletes them, and wrote "
        f"nothing:\n{lines}\nmove them out of {root} (or delete them), then run pull again; or pull into "
        "an empty or new directory (--to)"
    )


def clear(root: Path, root_fd: int, plan: Aside) -> list[str]:
    """Move aside what `plan` names, then remove the directories it left empty; returns the files
    moved. Something that left already (moved by another claim's placement, or by a pull before
    this one that stopped) is skipped. TransferError if something new stands in the way."""
    moved: list[str] = []
    for rel, digest in plan.files:
        *dirs, name = rel.split("/")
        parent_fd = open_dirs(root, root_fd, dirs, create=False)
        if parent_fd is None:
            continue
        try:
            try:
                st = os.lstat(name, dir_fd=parent_fd)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):  # else another claim's placement moved it and made a directory
                keep_replaced(root, root_fd, rel, parent_fd, digest)
                moved.append(rel)
        finally:
            os.close(parent_fd)
    for rel in plan.dirs:
        *dirs, name = rel.split("/")
        parent_fd = open_dirs(root, root_fd, dirs, create=False)
        if parent_fd is None:
            continue
        try:
            os.rmdir(name, dir_fd=parent_fd)
            os.fsync(parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TransferError(
                f"{root / rel}: cannot remove the directory an earlier pull made there, where the box "
                f"has a file now ({exc.strerror or exc}): something was put in it during the pull; "
                "move that away and run pull again"
            ) from exc
        finally:
            os.close(parent_fd)
    return moved


def open_dirs(root: Path, root_fd: int, dirs: list[str], *, create: bool) -> int | None:
    """An fd of the directory `dirs` under the tree's root, never through a symlink; with `create`,
    making what is missing, else None when something is missing."""
    fd = os.dup(root_fd)
    here = root
    try:
        for part in dirs:
            here = here / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except FileNotFoundError:
        os.close(fd)
        if create:
            raise TransferError(f"cannot create or open the directory {here}: it went away") from None
        return None
    except OSError as exc:
        os.close(fd)
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise TransferError(f"cannot create or open the directory {here}: {why}; move it aside") from exc
    return fd


def keep_replaced(root: Path, root_fd: int, path: str, parent_fd: int, digest: str) -> None:
    """Move the bytes an earlier pull put at `path` to `REPLACED_DIR/<path>.<digest>`: whether the
    box still holds them anywhere (a durable copy, the attic) is not known here, so a pull never
    destroys them. Bytes kept there before under that name are not kept twice: the file here is
    removed only once both hash equal (it is hashed again here: it may have been edited since the
    survey)."""
    *dirs, name = path.split("/")
    aside_fd = open_dirs(root, root_fd, [REPLACED_DIR, *dirs], create=True)
    assert aside_fd is not None
    target = f"{name}.{digest}" if len(os.fsencode(name)) + 65 <= NAME_MAX else digest
    where = root / REPLACED_DIR / Path(*dirs, target)
    try:
        try:
            os.lstat(target, dir_fd=aside_fd)
        except FileNotFoundError:
            os.rename(name, target, src_dir_fd=parent_fd, dst_dir_fd=aside_fd)
            os.fsync(aside_fd)
            os.fsync(parent_fd)
            return
        if _digest_or_none(where) != digest or _digest_or_none(root / path) != digest:
            raise TransferError(
                f"{root / path} or {where} changed during the pull; move one of them away and run pull again"
            )
        os.unlink(name, dir_fd=parent_fd)  # its bytes are kept at `where`, just hashed
    except OSError as exc:
        raise TransferError(
            f"{root / path}: cannot move the older bytes to {where}: {exc.strerror or exc}"
        ) from exc
    finally:
        os.close(aside_fd)


def _digest_or_none(path: Path) -> str | None:
    try:
        return digest_file(path).blake3
    except OSError as exc:
        logger.info("%s: could not be hashed (%s)", path, exc)
        return None


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink (a pull never writes through or over one)"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"
