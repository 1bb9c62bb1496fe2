"""THE invariant, over generated trees: whatever lands in a watched directory, after pull + verify
the gate either refuses naming what it could not take, or every regular file of the watched
directory is byte-identical in the pulled tree.

Each example is a fresh box: its own real sidecar (a real process on a real Unix socket, ~1 s to
start), the tree written before or after it starts (the start-up walk, or inotify), a wait with a
deadline (never a bare sleep) until everything claimable is claimed and durable, then the controller
in-process: pull → verify (marker written) → gate.gather + gate.judge (dry run). One sidecar shared by
all examples would be faster but is not a fresh box: durable copies of an example's files outlive
their claims and collide with the next example's paths (test_file_replaced_by_a_directory_...).

Besides the invariant, the reasons must be exactly what the design promises for each entry: a
symlink, a fifo, or a name with a control character, a backslash or non-UTF-8 bytes (or under a
reserved top name) is UNCLAIMABLE under its own (displayed) path; a temp-named file is TEMP_FILE;
every other regular file — hidden ones, `.metadata`, `name~`, files under `run.tmp/`, 255-byte
names, hard links — is pulled byte for byte, never silently skipped.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from controller import __version__, gate
from controller.boxsource import pull
from controller.client import SidecarClient
from controller.errors import ControllerError
from controller.state import Box
from controller.verify import VerifyReport, verify_tree
from tests.conftest import wait_until
from tests.sidecar.daemon import Daemon, running

# -- what the design says each entry is (written here from DESIGN §1/§2, not imported) ------------

TEMP_GLOBS = ("*.tmp", "*.part", "*.swp", "*.swx", ".*.swp")
RELEASE_ASIDE = b".bw-release."
RESERVED_TOP = frozenset({b"MANIFEST.json", b"PULL_VERIFIED.json", b".bw-parts", b".bw-replaced"})
# First components the durable store keeps for itself (sidecar/storage/__init__.py split_rel).
STORE_RESERVED_TOP = frozenset({b".boxwarden-tmp", b".boxwarden-owner", b".boxwarden-store-id"})
PROBED_SUFFIXES = frozenset({".pt", ".pth", ".ckpt", ".safetensors"})  # torch/safetensors: not ours
NAME_MAX = 255
MAX_DEPTH = 5
SETTLE_S = 30.0

# Codes that explain a refusal without naming a path (the tree as a whole).
WHOLE_TREE_CODES = frozenset({"EMPTY", "NOT_VERIFIED", "NOT_PULLED"})


def shown(raw: bytes) -> str:
    """How an artifact path is spelled on the wire (non-UTF-8 bytes escaped)."""
    return raw.decode("utf-8", "backslashreplace")


def is_temp(base: bytes) -> bool:
    name = os.fsdecode(base)
    return base.startswith(RELEASE_ASIDE) or any(fnmatch.fnmatchcase(name, g) for g in TEMP_GLOBS)


def bad_name(parts: tuple[bytes, ...]) -> bool:
    """A path the controller could never take: non-UTF-8, backslash, control char, reserved top."""
    for p in parts:
        try:
            text = p.decode("utf-8")
        except UnicodeDecodeError:
            return True
        if "\\" in text or any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            return True
    return parts[0] in RESERVED_TOP


# -- the generated tree ---------------------------------------------------------------------------


def is_json(name: bytes) -> bool:
    return os.path.splitext(name)[1].lower() == b".json"


@dataclass(frozen=True)
class FileSpec:
    parts: tuple[bytes, ...]
    size: int
    seed: int
    json_body: bool  # verify probes `*.json` files: theirs must be valid JSON
    hardlink_of: tuple[bytes, ...] | None = None  # a second name of that file (same bytes)

    @property
    def data(self) -> bytes:
        if self.json_body:
            return json.dumps({"pad": "j" * self.size}).encode()
        return random.Random(self.seed).randbytes(self.size)


SPECIAL_KINDS = ("link-to-file", "link-to-dir", "link-outside", "link-dangling", "fifo")


@dataclass(frozen=True)
class SpecialSpec:
    """Not a regular file: a symlink (to a file or directory of the tree, to a directory outside
    the watched one, to nothing) or a fifo."""

    parts: tuple[bytes, ...]
    kind: str  # one of SPECIAL_KINDS


@dataclass
class Tree:
    files: list[FileSpec] = field(default_factory=list)
    specials: list[SpecialSpec] = field(default_factory=list)
    empty_dirs: list[tuple[bytes, ...]] = field(default_factory=list)
    before_start: bool = False  # written before the sidecar starts (its start-up walk finds it)

    def __repr__(self) -> str:
        rows = [f"written {'before' if self.before_start else 'after'} the sidecar started"]
        rows += [
            f"file {b'/'.join(f.parts)!r} {f.size}B"
            + (f" (hard link of {b'/'.join(f.hardlink_of)!r})" if f.hardlink_of else "")
            for f in self.files
        ]
        rows += [f"{s.kind} {b'/'.join(s.parts)!r}" for s in self.specials]
        rows += [f"dir  {b'/'.join(d)!r}/" for d in self.empty_dirs]
        return "Tree(\n  " + "\n  ".join(rows) + "\n)"


# Odd names every one of which the box must claim and the controller must pull.
CLAIMABLE_NAMES: list[bytes] = [
    b".metadata",  # torch.distributed.checkpoint's: data, never a temp
    b".hidden",
    b"notes~",
    b"with space",
    b" lead and trail ",
    b"run.tmp",  # as a file's name a temp; as a directory's, an ordinary directory
    b"x.part",
    b"a.bw-part",  # pull's legacy partial-file suffix
    b"metrics.json",
    b"..dots",
    b"-dash",
    "café".encode(),
    "cafe\u0301".encode(),  # the same, decomposed: another name
    "日本語のファイル".encode(),
    "emoji 🎉".encode(),
    "nel\u0085c1".encode(),  # a C1 control: valid UTF-8, not an ASCII control
    "ls\u2028sep".encode(),
    b"L" * NAME_MAX,
    "é".encode() * 127 + b"z",  # 255 bytes of 2-byte characters
]

# Names the box must refuse (or, for the store-reserved ones, may refuse).
HOSTILE_NAMES: list[bytes] = [
    b"x.tmp",
    b"y.part",
    b".z.swp",
    b"w.swx",
    b".bw-release.7",
    b"MANIFEST.json",  # reserved at the top of a pulled tree
    b"PULL_VERIFIED.json",
    b".bw-parts",
    b".boxwarden-tmp",  # reserved at the top of the durable store
    b".boxwarden-owner",
    b".boxwarden-store-id",
    b"new\nline",
    b"tab\there",
    b"back\\slash",
    os.fsencode("bad\udcff"),  # the surrogateescape trick: the raw byte 0xff
    b"\xe9latin1",
    b"\xc3",  # a truncated UTF-8 sequence
]


def _fix_name(raw: bytes) -> bytes:
    raw = raw.replace(b"/", b"_").replace(b"\x00", b"_")[:NAME_MAX] or b"_"
    if raw in (b".", b".."):
        raw += b"_"
    if os.path.splitext(raw)[1].lower().decode("utf-8", "replace") in PROBED_SUFFIXES:
        raw = raw[: NAME_MAX - 1] + b"_"
    return raw


clean_names: st.SearchStrategy[bytes] = st.one_of(
    st.sampled_from(CLAIMABLE_NAMES),
    st.text(
        st.characters(codec="utf-8", exclude_characters="/\\", exclude_categories=["Cc"]),
        min_size=1,
        max_size=24,
    ).map(lambda s: s.encode("utf-8")),
    st.integers(200, NAME_MAX).map(lambda n: b"n" * n),
).map(_fix_name)

any_names: st.SearchStrategy[bytes] = st.one_of(
    st.sampled_from(HOSTILE_NAMES),
    st.sampled_from(HOSTILE_NAMES),  # twice: hostile names are the point of a hostile tree
    clean_names,
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=24).map(lambda s: s.encode("utf-8")),
    st.binary(min_size=1, max_size=16),  # mostly not UTF-8: a raw name, as os.fsencode gives it
).map(_fix_name)

sizes = st.one_of(st.just(0), st.integers(1, 4096), st.integers(100 << 10, 400 << 10))


@st.composite
def trees(draw: st.DrawFn) -> Tree:
    """Files (a hard link, specials, empty dirs) at depths 1..5 whose directories come from a small
    pool of names, so that several entries share directories; conflicting entries are dropped. Half
    the trees are hostile (names the box must refuse, symlinks, fifos); the other half only have
    odd names it must take, so that the gate is expected to allow them."""
    hostile = draw(st.booleans())
    names = any_names if hostile else clean_names
    file_names = names if hostile else names.filter(lambda n: not is_temp(n))
    pool = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    dir_paths = st.lists(st.sampled_from(pool), max_size=MAX_DEPTH - 1).map(tuple)
    kinds: dict[tuple[bytes, ...], str] = {}

    def place(parts: tuple[bytes, ...], kind: str) -> bool:
        if parts in kinds or any(kinds.get(parts[:i], "dir") != "dir" for i in range(1, len(parts))):
            return False
        for i in range(1, len(parts)):
            kinds[parts[:i]] = "dir"
        kinds[parts] = kind
        return True

    tree = Tree(before_start=draw(st.booleans()))
    for dirs, name, size, seed in draw(
        st.lists(st.tuples(dir_paths, file_names, sizes, st.integers(0, 2**32)), min_size=1, max_size=8)
    ):
        if place((*dirs, name), "file"):
            tree.files.append(FileSpec((*dirs, name), size, seed, is_json(name)))
    for dirs, name in draw(st.lists(st.tuples(dir_paths, file_names), max_size=1)):
        first = tree.files[0]
        if is_json(name) == first.json_body and place((*dirs, name), "file"):
            tree.files.append(FileSpec((*dirs, name), first.size, first.seed, first.json_body, first.parts))
    for dirs, name, kind in draw(
        st.lists(
            st.tuples(dir_paths, names, st.sampled_from(SPECIAL_KINDS)),
            min_size=int(hostile),
            max_size=3 if hostile else 0,
        )
    ):
        if place((*dirs, name), "special"):
            tree.specials.append(SpecialSpec((*dirs, name), kind))
    for dirs, name in draw(st.lists(st.tuples(dir_paths, names), max_size=2)):
        if place((*dirs, name), "dir"):
            tree.empty_dirs.append((*dirs, name))
    return tree


# -- the box --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every example's box lives, and a directory outside them all (a symlink target)."""
    base = tmp_path_factory.mktemp("tree-invariant")
    (base / "outside").mkdir()
    (base / "outside" / "secret.bin").write_bytes(b"not in the watched dir")
    return base


def write_tree(watch: Path, outside: Path, tree: Tree) -> None:
    top = os.fsencode(watch)
    for dirs in tree.empty_dirs:
        os.makedirs(os.path.join(top, *dirs), exist_ok=True)
    for f in tree.files:
        path = os.path.join(top, *f.parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if f.hardlink_of is not None:
            os.link(os.path.join(top, *f.hardlink_of), path)
            continue
        with open(path, "wb") as out:
            out.write(f.data)
    for sp in tree.specials:
        path = os.path.join(top, *sp.parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if sp.kind == "fifo":
            os.mkfifo(path)
            continue
        if sp.kind == "link-to-file" and tree.files:
            target = os.path.join(top, *tree.files[0].parts)
        elif sp.kind == "link-to-dir":
            target = os.path.dirname(path)  # its own directory: a loop, were it followed
        elif sp.kind == "link-outside":
            target = os.fsencode(outside)
        else:
            target = b"nowhere/at/all"
        os.symlink(target, path)


def settled(d: Daemon) -> pb.ListArtifactsResponse | None:
    """The listing once nothing is being written or waits to be sealed, and every claim is durable
    or has given up with a push error. TEMP and UNCLAIMABLE entries stay pending by design."""
    listing = d.listing()
    for p in listing.pending:
        if p.state == pb.PENDING_WRITING:
            return None
        if p.state == pb.PENDING_CHANGED:
            return None
    if not all(c.durable or c.push_error for c in listing.claims):
        return None
    return listing


def regular_files(top: bytes) -> dict[bytes, bytes]:
    """Every regular file under `top` (relative path → bytes), never following a symlink."""
    out: dict[bytes, bytes] = {}
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, top)] = f.read()
    return out


# -- the controller's side, in-process ------------------------------------------------------------


class NoLoad:
    """A checkpoint loader that accepts anything (no torch-suffixed names are generated)."""

    def load(self, path: Path) -> None:
        return None


@dataclass
class Outcome:
    pull_error: str = ""
    report: VerifyReport | None = None
    verdict: gate.Verdict | None = None


async def controller_side(d: Daemon, pulled: Path) -> Outcome:
    out = Outcome()
    box = Box(
        name="t1",
        profile="local",
        box_dir=str(d.root),
        state_dir=str(d.state),
        socket=str(d.socket),
        workdir=str(d.root),
        watch=(str(d.watch),),
        durable=d.durable.as_uri(),
        run_id="default",
        pulled_dir=str(pulled),
    )
    async with SidecarClient(f"unix:{d.socket}") as c:
        try:
            await pull(c, root=pulled, run_id="default", instance="t1", roster=())
        except ControllerError as e:
            out.pull_error = str(e)
        else:
            out.report = verify_tree(pulled, write_marker=True, verifier_version=__version__, loader=NoLoad())
        ev, early = await gate.gather(c, box, pulled)
    out.verdict = gate.judge(ev, early, confirm=None, dry_run=True)
    return out


# -- the property ---------------------------------------------------------------------------------


def features(tree: Tree) -> set[str]:
    """What an example exercises (hypothesis statistics: --hypothesis-show-statistics)."""
    out: set[str] = set()
    paths = [f.parts for f in tree.files] + [sp.parts for sp in tree.specials] + tree.empty_dirs
    for sp in tree.specials:
        out.add(sp.kind)
    for parts in paths:
        for p in parts:
            try:
                text = p.decode("utf-8")
            except UnicodeDecodeError:
                out.add("non-UTF-8 name")
                continue
            if "\\" in text or any(ord(c) < 0x20 for c in text):
                out.add("backslash or control character")
            if any(ord(c) > 0x7F for c in text):
                out.add("non-ASCII UTF-8 name")
        if any(p.startswith(b".") for p in parts):
            out.add("hidden entry")
        if any(len(p) >= 200 for p in parts):
            out.add("name of 200+ bytes")
        if len(parts) == MAX_DEPTH:
            out.add("depth 5")
        if parts[0] in RESERVED_TOP | STORE_RESERVED_TOP:
            out.add("reserved top name")
    for f in tree.files:
        if is_temp(f.parts[-1]):
            out.add("temp-named file")
        if any(is_temp(p) for p in f.parts[:-1]):
            out.add("file under a temp-named dir")
        out.add("empty file" if f.size == 0 else "file of 100+ KiB" if f.size >= 100 << 10 else "small file")
    if tree.empty_dirs:
        out.add("empty dir")
    return out


def check(base: Path, tree: Tree) -> None:
    for feature in sorted(features(tree)):
        event(feature)
    root = Path(tempfile.mkdtemp(dir=base))
    try:
        if tree.before_start:
            (root / "watch").mkdir()
            write_tree(root / "watch", base / "outside", tree)
        with running(root) as d:
            if not tree.before_start:
                write_tree(d.watch, base / "outside", tree)
            listing = wait_until(lambda: settled(d), timeout=SETTLE_S, what="the sidecar to settle")
            note(f"claims: {[c.path for c in listing.claims]}")
            note(f"pending: {[(pb.PendingState.Name(p.state), p.path) for p in listing.pending]}")
            out = asyncio.run(controller_side(d, root / "pulled"))
        judge_outcome(tree, out, os.fsencode(root / "watch"), os.fsencode(root / "pulled"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def judge_outcome(tree: Tree, out: Outcome, watch: bytes, pulled: bytes) -> None:
    assert out.verdict is not None
    reasons = out.verdict.reasons
    note(f"verdict: allowed={out.verdict.allowed} reasons={[r.to_json() for r in reasons]}")
    on_box = regular_files(watch)
    here = regular_files(pulled) if os.path.isdir(pulled) else {}

    if out.pull_error:
        event("pull raised")
        note(f"pull raised: {out.pull_error}")
        named = any(shown(raw) in out.pull_error for raw in on_box)
        assert named, f"pull refused without naming a path of the tree: {out.pull_error}"
        assert not out.verdict.allowed

    # THE invariant: every regular file is in the pulled tree, byte-identical, or the gate
    # refuses and a reason names it.
    named_paths = {r.path for r in reasons}
    for raw, data in on_box.items():
        if here.get(raw) == data:
            continue
        assert not out.verdict.allowed, f"gate allowed, but {raw!r} is not pulled byte-identical"
        assert shown(raw) in named_paths, f"{raw!r} is not pulled and no reason names it: {reasons}"
    if not out.verdict.allowed:
        assert reasons
        for r in reasons:
            assert r.path or r.code in WHOLE_TREE_CODES, f"a refusal that names nothing: {r}"

    # The stronger, per-entry facts: exactly the reasons the tree explains, each under its path.
    must, may = expected_reasons(tree)
    got = {(r.code, r.path) for r in reasons if r.code not in WHOLE_TREE_CODES}
    for path, codes in must.items():
        assert any((c, path) in got for c in codes), f"{path!r}: expected one of {codes}, got {got}"
    explained = {(c, p) for p, cs in (must | may).items() for c in cs}
    assert got <= explained, f"reasons the tree does not explain: {got - explained}"
    artifacts = [f for f in tree.files if shown(b"/".join(f.parts)) not in must | may]
    for f in artifacts:
        raw = b"/".join(f.parts)
        assert here.get(raw) == f.data, f"artifact {raw!r} was not pulled byte-identical"
    if artifacts:
        assert out.report is not None, out.pull_error
        assert out.report.ok, out.report.reasons
    if may:
        event("a store-reserved name")
    if not must and not may and artifacts:
        assert out.verdict.allowed, reasons
    event(f"verdict allowed={out.verdict.allowed}")


def expected_reasons(tree: Tree) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The entries the box must refuse (displayed path → codes that may name it), and those it may
    refuse or pull: files under a store-reserved name (stuck "not sealed yet" today)."""
    must: dict[str, tuple[str, ...]] = {}
    may: dict[str, tuple[str, ...]] = {}
    for sp in tree.specials:
        must[shown(b"/".join(sp.parts))] = ("UNCLAIMABLE",)
    for f in tree.files:
        path = shown(b"/".join(f.parts))
        temp, bad = is_temp(f.parts[-1]), bad_name(f.parts)
        if temp and bad:
            must[path] = ("TEMP_FILE", "UNCLAIMABLE")
        elif temp:
            must[path] = ("TEMP_FILE",)
        elif bad or f.parts[0] in STORE_RESERVED_TOP:
            must[path] = ("UNCLAIMABLE",)
    return must, may


def _f(path: bytes, size: int = 3, seed: int = 0, link: bytes | None = None) -> FileSpec:
    """A file of an explicit example; a hard link (`link`) must repeat its file's size and seed."""
    parts = tuple(path.split(b"/"))
    return FileSpec(parts, size, seed, is_json(parts[-1]), tuple(link.split(b"/")) if link else None)


LONG = b"L" * NAME_MAX
# Every kind of entry the design names, in one tree each way: these run first, on every CI run.
EVERY_HOSTILE_KIND = Tree(
    files=[
        _f(b".metadata", 0),
        _f(b".hidden/notes~", 100),
        _f(b"run.tmp/big.bin", 300 << 10, 1),
        _f(b"run.tmp/x.tmp", 10),
        _f(b".z.swp"),
        _f(b"d/y.part"),
        _f(b"new\nline"),
        _f(b"dir\twith tab/f"),
        _f(b"back\\slash"),
        _f(b"bad\xff/inside"),
        _f(b"bad\xfe"),
        _f(b"MANIFEST.json", 5),
        _f(b".bw-parts/p"),
        _f(b"a/b/c/d/" + LONG, 4096, 2),
        _f(b"hard-link", 0, link=b".metadata"),
    ],
    specials=[
        SpecialSpec((b"to-file",), "link-to-file"),
        SpecialSpec((b"a", b"to-dir"), "link-to-dir"),
        SpecialSpec((b"to-outside",), "link-outside"),
        SpecialSpec((b".dangling",), "link-dangling"),
        SpecialSpec((b"fifo",), "fifo"),
    ],
    empty_dirs=[(b"empty",), (b"a", b"b", b"empty.tmp")],
)
EVERY_CLAIMABLE_KIND = Tree(
    files=[
        _f(b".metadata", 0),
        _f(b"run.tmp/.hidden/notes~", 200 << 10, 3),
        _f(LONG + b"/" + "é".encode() * 127 + b"z/" + LONG + b"/" + LONG + b"/" + LONG),
        _f(" lead/日本語のファイル/emoji 🎉/nel\u0085c1".encode(), 1),
        _f(b"metrics.json", 20),
        _f(b"x.part/a.bw-part", 7),
        _f(b"a", 9, 4),
        _f(b"second name", 9, 4, link=b"a"),
    ],
    empty_dirs=[(b"empty",), (b".hidden-empty",)],
    before_start=True,
)


@example(tree=EVERY_HOSTILE_KIND)
@example(tree=EVERY_CLAIMABLE_KIND)
@settings(
    max_examples=int(os.environ.get("BOXWARDEN_TREE_EXAMPLES", "12")),  # `make crash`: 100
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(tree=trees())
def test_every_file_is_pulled_or_named(base: Path, tree: Tree) -> None:
    check(base, tree)


# -- bugs found by the property (reproductions; they pass once the bug is fixed) --------------------


def durable_or_failed(d: Daemon, paths: set[str]) -> list[pb.Claim] | None:
    claims = [c for c in d.claims() if c.path in paths and (c.durable or c.push_error)]
    return claims if len(claims) == len(paths) else None


def test_store_reserved_name_is_unclaimable_not_pending_forever(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "ok.bin").write_bytes(b"a plain artifact")
        (d.watch / ".boxwarden-owner").write_bytes(b"a user's file that happens to have this name")
        wait_until(lambda: durable_or_failed(d, {"ok.bin"}), timeout=SETTLE_S, what="ok.bin durable")

        def decided() -> bool:
            # Claimed (durable or with a push error), or reported unclaimable: not "not sealed yet".
            listing = d.listing()
            claimed = {c.path for c in listing.claims if c.durable or c.push_error}
            refused = {p.path for p in listing.pending if p.state == pb.PENDING_UNCLAIMABLE}
            return ".boxwarden-owner" in claimed | refused

        def failed() -> bool:
            return "sealing .boxwarden-owner failed" in (d.root / "sidecar.log").read_text()

        wait_until(lambda: decided() or failed(), timeout=SETTLE_S, what="the sealer to decide")
        assert decided(), ".boxwarden-owner: the sealer failed on it, and it is still 'not sealed yet'"


def test_file_replaced_by_a_directory_of_the_same_name_becomes_durable(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "step-100").write_bytes(b"a torch.save file")
        (d.watch / "cell").mkdir()
        (d.watch / "cell" / "best.bin").write_bytes(b"a file in a directory")
        d.wait_durable(2)
        # The trainer switches formats: step-100 becomes a DCP directory, cell becomes a file.
        (d.watch / "step-100").unlink()
        shutil.rmtree(d.watch / "cell")
        wait_until(lambda: not d.claims(), timeout=SETTLE_S, what="the old claims to end")
        (d.watch / "step-100").mkdir()
        (d.watch / "step-100" / ".metadata").write_bytes(b"dcp metadata")
        (d.watch / "cell").write_bytes(b"now a file")
        paths = {"step-100/.metadata", "cell"}
        claims = wait_until(lambda: durable_or_failed(d, paths), timeout=SETTLE_S, what="both sealed")
        assert all(c.durable for c in claims), [(c.path, c.push_error) for c in claims]
