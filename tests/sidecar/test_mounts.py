"""sidecar.mounts: a watched dir's mount signature and what counts as a change of it (pure, with a
mountinfo written here), and the mount points inside a watched dir."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from sidecar import mounts
from sidecar.paths import ArtifactNamer, Entry

LINE = "{id} 1 0:{dev} {root} {point} rw,relatime shared:1 - ext4 /dev/vda rw\n"


def info(tmp_path: Path, *rows: tuple[int, int, str, str]) -> mounts.Mounts:
    path = tmp_path / "mountinfo"
    path.write_text("".join(LINE.format(id=i, dev=d, root=r, point=p) for i, d, r, p in rows))
    found = mounts.read(str(path))
    assert found is not None
    return found


def test_read_stacks_and_unescapes(tmp_path: Path) -> None:
    points = info(
        tmp_path,
        (1, 20, "/", "/"),
        (2, 21, "/", "/w/ckpt"),
        (3, 20, "/srv/a", "/w/ckpt"),
        (4, 23, "/", r"/w/with\040space"),
    )
    assert points == {
        "/": ["0:20:/"],
        "/w/ckpt": ["0:21:/", "0:20:/srv/a"],
        "/w/with space": ["0:23:/"],
    }
    assert mounts.read(str(tmp_path / "missing")) is None


def test_a_signature_covers_the_root_and_every_directory_above_it(tmp_path: Path) -> None:
    root = tmp_path / "w" / "ckpt"
    root.mkdir(parents=True)
    dev = root.stat().st_dev
    points = info(
        tmp_path, (1, 20, "/", "/"), (5, 20, "/srv/w", str(tmp_path / "w")), (6, 9, "/", "/elsewhere")
    )
    (sig,) = mounts.signatures([root], points).values()
    assert sig == f"{dev}|{tmp_path / 'w'}=0:20:/srv/w|/=0:20:/"  # from the root up
    assert mounts.signatures([tmp_path / "gone"], points) == {}
    assert mounts.signatures([root], None) == {root: str(dev)}


@pytest.mark.parametrize(
    ("then", "now", "why"),
    [
        ("10|/=0:20:/", "10|/=0:20:/", None),
        ("10|/=0:20:/", "11|/=0:20:/|/w/ckpt=0:30:/", "another filesystem"),
        # A same-filesystem bind mount over the workdir: the device stays, a mount appears.
        ("10|/=0:20:/", "10|/=0:20:/|/w=0:20:/shadow", "mounted on it or on a directory above"),
        # A bind mount swapped for another: the directory it shows tells them apart.
        ("10|/w/ckpt=0:20:/srcA", "10|/w/ckpt=0:20:/srcB", "swapped"),
        ("10|/=0:20:/|/w=0:20:/x", "10|/=0:20:/", "taken away"),
    ],
)
def test_changed(then: str, now: str, why: str | None) -> None:
    found = mounts.changed(then, now)
    assert (found is None) == (why is None)
    if why is not None:
        assert found is not None and why in found


def test_inside_lists_mount_points_strictly_under_the_root(tmp_path: Path) -> None:
    points = info(
        tmp_path,
        (1, 20, "/", "/"),
        (2, 20, "/x", "/w/ckpt"),
        (3, 20, "/y", "/w/ckpt/cell-b"),
        (4, 20, "/z", "/w/ckpt/f.bin"),
        (5, 20, "/q", "/w/ckptx"),
    )
    assert mounts.inside(Path("/w/ckpt"), points) == ["/w/ckpt/cell-b", "/w/ckpt/f.bin"]
    assert mounts.inside(Path("/w/ckpt"), None) == []


def test_fs_path_places_a_path_within_its_filesystem_through_the_top_mount() -> None:
    points = {
        "/": ["8:1:/"],
        "/data": ["8:2:/"],
        "/mnt/alias": ["8:2:/work/ckpt/sub"],  # a bind mount of a subdirectory
        "/stacked": ["8:1:/a", "8:2:/b"],  # the one mounted last is what the path shows
    }
    assert mounts.fs_path("/data/work/ckpt", points) == ("8:2", "/work/ckpt")
    assert mounts.fs_path("/mnt/alias", points) == ("8:2", "/work/ckpt/sub")
    assert mounts.fs_path("/mnt/alias/x/y", points) == ("8:2", "/work/ckpt/sub/x/y")
    assert mounts.fs_path("/mnt/aliasx", points) == ("8:1", "/mnt/aliasx")  # not under /mnt/alias
    assert mounts.fs_path("/stacked/z", points) == ("8:2", "/b/z")
    assert mounts.fs_path("/", points) == ("8:1", "/")
    assert mounts.fs_path("relative", points) is None


def test_the_mount_table_says_when_a_mount_comes_or_goes(tmp_path: Path) -> None:
    point = tmp_path / "mnt"
    point.mkdir()
    with mounts.Watch() as table:
        before = table.read()
        assert before is not None and str(point) not in before and not table.changed()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True)
        try:
            assert table.changed()
            after = table.read()
            assert after is not None and str(point) in after
            assert not table.changed()  # reading it clears the mark
        finally:
            subprocess.run(["umount", str(point)], check=True)
        assert table.changed()


class StaleFirst(mounts.Watch):
    """A table whose first read is a snapshot from before a mount: the walk began, then the mount
    came (the race a loaded box loses: a directory made, then mounted, then walked)."""

    def __init__(self, stale: mounts.Mounts | None) -> None:
        super().__init__()
        self._stale: mounts.Mounts | None = stale
        self._first = True

    def read(self) -> mounts.Mounts | None:
        if self._first:
            self._first = False
            return self._stale
        return super().read()


def test_a_mount_made_after_the_walk_began_is_reported_never_entered(tmp_path: Path) -> None:
    from tests.test_review7_e2e import dead_fuse

    watch = tmp_path / "watch"
    (watch / "remote").mkdir(parents=True)
    (watch / "a.bin").write_bytes(b"a")
    namer = ArtifactNamer((watch,))
    table = StaleFirst(mounts.read())  # opened, and read, before the mount
    found: list[list[Entry]] = []
    with dead_fuse(watch / "remote"):  # every look inside blocks until the fuse fd is closed
        walker = threading.Thread(target=lambda: found.append(namer._walk_all(table)), daemon=True)
        walker.start()
        walker.join(timeout=20)
        entered = walker.is_alive()
    walker.join(timeout=20)  # the dead mount is gone: a walk stuck in it returns now
    table.close()
    assert not entered, "the walk looked inside a mount made after it began, and hung there"
    (entries,) = found
    by_path = {e.where: e for e in entries}
    assert by_path[str(watch / "a.bin")].kind == "artifact"
    assert "a mount point inside a watched dir" in by_path[str(watch / "remote")].why
