"""sidecar.mounts: a watched dir's mark and what counts as a change of it (pure, with a mountinfo
written here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar import mounts

LINE = "{id} 1 0:{dev} / {point} rw,relatime shared:1 - tmpfs tmpfs rw\n"


def test_mount_counts_stack_and_unescape(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        LINE.format(id=1, dev=20, point="/")
        + LINE.format(id=2, dev=21, point="/w/ckpt")
        + LINE.format(id=3, dev=22, point="/w/ckpt")
        + LINE.format(id=4, dev=23, point=r"/w/with\040space")
    )
    counts = mounts.mount_counts(str(info))
    assert counts is not None
    assert (counts["/"], counts["/w/ckpt"], counts["/w/with space"], counts["/w"]) == (1, 2, 1, 0)
    assert mounts.mount_counts(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("then", "now", "why"),
    [
        ("10:0", "10:0", None),
        ("10:1", "10:1", None),
        ("10:0", "11:1", "another filesystem"),
        ("10:0", "10:1", "0 mounts were stacked on it when the box came up, 1 now"),
        ("10:2", "10:1", "2 mounts were stacked"),
        ("10:?", "10:3", None),  # mountinfo unreadable at up: only the device is compared
        ("10:1", "11:?", "another filesystem"),
    ],
)
def test_changed(then: str, now: str, why: str | None) -> None:
    found = mounts.changed(then, now)
    assert (found is None) == (why is None)
    if why is not None:
        assert found is not None and why in found


def test_marks_leave_out_a_root_that_is_gone(tmp_path: Path) -> None:
    here = tmp_path / "ckpt"
    here.mkdir()
    got = mounts.marks([here, tmp_path / "gone"], mounts.mount_counts())
    assert list(got) == [here] and got[here] == f"{here.stat().st_dev}:0"
