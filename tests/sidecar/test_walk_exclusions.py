"""What an exclude pattern may leave out of the walk: single entries that are not directories,
never a directory that hides a subtree (review 12, F1 and F2). Real tmpfs mounts."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from sidecar import mounts
from sidecar.paths import ArtifactNamer


@contextlib.contextmanager
def tmpfs(point: Path) -> Iterator[None]:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(point)], check=True)


def kinds(namer: ArtifactNamer) -> dict[str, str]:
    return {e.art: e.kind for e in namer.walk_all()}


def test_a_mount_point_named_like_an_excluded_file_is_still_reported(tmp_path: Path) -> None:
    """F1: `--exclude '*.log'` turned a tmpfs mounted at ckpt/run.log into "1 file excluded"; the
    walk never entered it and the gate allowed while model.bin lay only there."""
    watch = tmp_path / "ckpt"
    (watch / "run.log").mkdir(parents=True)
    (watch / "train.log").write_text("a log")
    namer = ArtifactNamer((watch,), exclude_patterns=("*.log",))
    with tmpfs(watch / "run.log"):
        (watch / "run.log" / "model.bin").write_bytes(b"only here")
        found = kinds(namer)
    assert found == {"run.log": "unclaimable", "train.log": "excluded"}


def test_the_watched_dir_itself_is_never_excluded(tmp_path: Path) -> None:
    """F2: with one watched dir, a problem with the dir itself is reported as ".", and `.*` (a
    common pattern for dot-files) matched it: a mount over the watched dir became "excluded"."""
    watch = tmp_path / "ckpt"
    watch.mkdir()
    signatures = mounts.signatures((watch,), mounts.read())
    namer = ArtifactNamer((watch,), exclude_patterns=(".*",), root_signatures=signatures)
    with tmpfs(watch):
        assert kinds(namer) == {".": "unclaimable"}
    os.rmdir(watch)
    assert kinds(namer) == {".": "unclaimable"}  # gone: reported, not excluded


def test_a_symlink_or_a_fifo_may_still_be_excluded(tmp_path: Path) -> None:
    watch = tmp_path / "ckpt"
    watch.mkdir()
    (watch / "latest.pt").symlink_to("step-100.pt")
    os.mkfifo(watch / "progress.fifo")
    (watch / "linked.dir").symlink_to(tmp_path)
    namer = ArtifactNamer((watch,), exclude_patterns=("latest.*", "*.fifo"))
    assert kinds(namer) == {"latest.pt": "excluded", "progress.fifo": "excluded", "linked.dir": "unclaimable"}


def test_a_mount_point_that_is_watched_on_its_own_is_no_problem_of_its_parent(tmp_path: Path) -> None:
    """Review 13, F07: "unmount it, or watch it on its own" — watched on its own (a second --watch),
    the mount point was still reported by its parent's walk, and the gate refused forever."""
    watch = tmp_path / "ckpt"
    fast = watch / "fast"
    fast.mkdir(parents=True)
    (watch / "a.bin").write_bytes(b"a")
    with tmpfs(fast):
        (fast / "f.bin").write_bytes(b"f")
        found = {(e.art, e.kind) for e in ArtifactNamer((watch, fast)).walk_all()}
        alone = kinds(ArtifactNamer((watch,)))
    assert found == {("ckpt/a.bin", "artifact"), ("ckpt/fast/f.bin", "artifact")}
    assert alone == {"a.bin": "artifact", "fast": "unclaimable"}  # not watched: still reported


def test_up_refuses_every_name_the_sidecar_reserves_at_the_top() -> None:
    """Review 14, F03: `up` took a watched dir named `.boxwarden-tmp` (a durable store name), whose
    files were then unclaimable for good. The controller's list is the sidecar's (they never
    import each other: the lists are twins)."""
    from controller.boxes import RESERVED_WATCH_NAMES
    from sidecar.paths import RESERVED_TOP

    assert RESERVED_WATCH_NAMES == RESERVED_TOP
