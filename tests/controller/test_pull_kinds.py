"""A path that changes kind on the box (a file where a directory was, or back) between two pulls.
Pull never asks the user to move its own bytes: what an earlier pull of this box put in the way
moves to .bw-replaced/<path>.<blake3>, as a rewrite's older bytes do, and `verify` passes after.
What no pull put there is never touched: every such path is listed in one refusal. Real sidecars
through the real CLI; the interrupted pull runs in this process against a real sidecar."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from controller.errors import TransferError
from tests.conftest import Bw, save_weights
from tests.controller.test_bulk_pull import pull_over
from tests.controller.test_pull_hardening import files_under


def aside(pulled: Path, path: str, digest: str) -> Path:
    return pulled / ".bw-replaced" / f"{path}.{digest}"


def blake3_of_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def settle(bw: Bw, paths: set[str]) -> None:
    """Until the box claims exactly `paths`, all durable."""
    bw.wait_durable("b1", len(paths))
    assert {c["path"] for c in bw.artifacts("b1")["claims"]} == paths


def pulled_once(bw: Bw, *paths: str) -> tuple[Path, Path]:
    """Box b1 with a checkpoint at each of `paths` (seeds 1, 2, ...), all durable, pulled once.
    Returns the watched dir and the pulled tree."""
    w = bw.up("b1")["watch"]
    for seed, path in enumerate(paths, 1):
        save_weights(w / path, seed=seed)
    settle(bw, set(paths))
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    return w, pulled


def test_a_pulled_directory_that_became_a_file_moves_aside_whole(bw: Bw) -> None:
    w, pulled = pulled_once(
        bw,
        "cell-a/x.safetensors",
        "cell-a/sub/y.safetensors",
        "cell-a/sub/deeper/z.safetensors",
        "cell-b/k.st",
    )
    before = files_under(pulled)
    old = {k: v for k, v in before.items() if k.startswith("cell-a/")}
    shutil.rmtree(w / "cell-a")
    save_weights(w / "cell-a", seed=5)  # the box now has a file where the directory was
    settle(bw, {"cell-a", "cell-b/k.st"})

    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["fetched"] == ["cell-a"]
    assert sorted(rep["displaced"]) == sorted(old)
    assert (pulled / "cell-a").read_bytes() == (w / "cell-a").read_bytes()
    for path, data in old.items():
        kept = aside(pulled, path, blake3_of_bytes(data))
        assert kept.read_bytes() == data, f"{path} is kept byte-identical under .bw-replaced"
    verified = bw.json("verify", str(pulled))
    assert verified["ok"] is True, verified


def test_a_pulled_file_that_became_a_directory_moves_aside(bw: Bw) -> None:
    w, pulled = pulled_once(bw, "cell-a", "cell-b/keep.safetensors")
    old = (pulled / "cell-a").read_bytes()
    (w / "cell-a").unlink()
    save_weights(w / "cell-a" / "x.safetensors", seed=3)
    save_weights(w / "cell-a" / "y.safetensors", seed=4)
    settle(bw, {"cell-a/x.safetensors", "cell-a/y.safetensors", "cell-b/keep.safetensors"})

    r = bw.ok("pull", "b1", "--to", str(pulled))
    assert "2 fetched" in r.stderr and "moved 1 file(s) an earlier pull put here to .bw-replaced" in r.stderr
    assert aside(pulled, "cell-a", blake3_of_bytes(old)).read_bytes() == old
    for name in ("x.safetensors", "y.safetensors"):
        assert (pulled / "cell-a" / name).read_bytes() == (w / "cell-a" / name).read_bytes()
    assert bw.json("verify", str(pulled))["ok"] is True


def test_several_kind_changes_and_a_retired_file_in_the_way_move_aside_in_one_pull(bw: Bw) -> None:
    w, pulled = pulled_once(bw, "cell-a/x.safetensors", "cell-b", "cell-c/old.safetensors")
    (w / "cell-c" / "old.safetensors").unlink()  # retired at the next pull
    settle(bw, {"cell-a/x.safetensors", "cell-b"})
    assert bw.json("pull", "b1", "--to", str(pulled))["retired"] == ["cell-c/old.safetensors"]
    before = files_under(pulled)
    shutil.rmtree(w / "cell-a")
    save_weights(w / "cell-a", seed=4)
    (w / "cell-b").unlink()
    save_weights(w / "cell-b" / "x.safetensors", seed=5)
    shutil.rmtree(w / "cell-c")
    save_weights(w / "cell-c", seed=6)  # where the retired file's directory is
    settle(bw, {"cell-a", "cell-b/x.safetensors", "cell-c"})

    rep = bw.json("pull", "b1", "--to", str(pulled))
    moved = ["cell-a/x.safetensors", "cell-b", "cell-c/old.safetensors"]
    assert sorted(rep["displaced"]) == moved and rep["retired"] == []
    for path in moved:
        assert aside(pulled, path, blake3_of_bytes(before[path])).read_bytes() == before[path]
    assert bw.json("verify", str(pulled))["ok"] is True


def test_what_no_pull_put_in_the_way_is_refused_all_at_once_and_untouched(bw: Bw) -> None:
    w, pulled = pulled_once(bw, "cell-a/x.safetensors", "cell-b")
    (pulled / "cell-a" / "notes.txt").write_text("mine")  # the user's own file in a pulled directory
    (pulled / "cell-b").write_bytes(b"edited here")  # a pulled file the user changed since
    (pulled / "cell-c").write_text("mine too")  # where the box will have a directory
    (pulled / "cell-d").mkdir()  # an empty directory of the user's where the box will have a file
    (bw.cwd / "elsewhere").mkdir()
    (pulled / "cell-e").symlink_to(bw.cwd / "elsewhere")  # where the box will have a directory
    for i in range(7):  # files at the paths of claims, as test_pull_hardening's, more than five
        (pulled / f"cell-{i}").mkdir()
        (pulled / f"cell-{i}" / "a.bin").write_text("y")
    shutil.rmtree(w / "cell-a")
    save_weights(w / "cell-a", seed=3)
    (w / "cell-b").unlink()
    save_weights(w / "cell-b" / "x.safetensors", seed=4)
    save_weights(w / "cell-c" / "x.safetensors", seed=5)
    save_weights(w / "cell-d", seed=6)
    save_weights(w / "cell-e" / "x.safetensors", seed=7)
    for i in range(7):
        save_weights(w / f"cell-{i}" / "a.bin", seed=10 + i)
    settle(
        bw,
        {"cell-a", "cell-b/x.safetensors", "cell-c/x.safetensors", "cell-d", "cell-e/x.safetensors"}
        | {f"cell-{i}/a.bin" for i in range(7)},
    )
    before = files_under(pulled)

    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 2, r.stderr
    for path in (
        "cell-a",
        "cell-a/notes.txt",
        "cell-b",
        "cell-c",
        "cell-d",
        "cell-e",
        *(f"cell-{i}/a.bin" for i in range(7)),
    ):
        assert path in r.stderr, f"{path} is named in the one refusal:\n{r.stderr}"
    assert "move" in r.stderr and "--to" in r.stderr
    assert files_under(pulled) == before, "nothing is moved or written"
    assert not (pulled / ".bw-parts").exists() and not (pulled / ".bw-replaced").exists()
    assert (pulled / "cell-d").is_dir() and (pulled / "cell-e").is_symlink()
    assert list((bw.cwd / "elsewhere").iterdir()) == [], "nothing is written through the symlink"


# The real CLI, killed with SIGKILL by its own second rename (the first moves one file aside).
_KILLED_MIDWAY = """
import os, signal, sys
real, calls = os.rename, []
def rename(*args, **kw):
    calls.append(args)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(*args, **kw)
os.rename = rename
sys.argv[0] = "boxwarden"
from controller.__main__ import main
main()
"""


@pytest.mark.parametrize("how", ["exception", "kill -9"])
def test_a_pull_interrupted_while_moving_aside_loses_nothing_and_the_next_completes(
    bw: Bw, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    w, pulled = pulled_once(bw, *(f"cell-a/sub/{n}.safetensors" for n in (1, 2, 3)))
    old = {k: v for k, v in files_under(pulled).items() if k.startswith("cell-a/")}
    shutil.rmtree(w / "cell-a")
    save_weights(w / "cell-a", seed=9)
    settle(bw, {"cell-a"})

    if how == "kill -9":
        r = subprocess.run(
            [sys.executable, "-c", _KILLED_MIDWAY, "pull", "b1", "--to", str(pulled)],
            cwd=bw.cwd,
            env=bw.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == -signal.SIGKILL, r.stderr
    else:
        real_rename = os.rename
        calls = 0

        def fails_second(src: object, dst: object, **kw: object) -> None:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise OSError(5, "Input/output error")
            real_rename(src, dst, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "rename", fails_second)
        with pytest.raises(TransferError, match="cell-a"):
            pull_over(bw, "b1", pulled)
        monkeypatch.setattr(os, "rename", real_rename)
    for path, data in old.items():  # each file is where it was, or kept aside: none lost
        here, kept = pulled / path, aside(pulled, path, blake3_of_bytes(data))
        assert (here.exists() and here.read_bytes() == data) or kept.read_bytes() == data, path
    moved = [path for path, d in old.items() if aside(pulled, path, blake3_of_bytes(d)).exists()]
    assert 0 < len(moved) < len(old), "it stopped midway through moving the directory aside"

    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["fetched"] == ["cell-a"]
    for path, data in old.items():
        assert aside(pulled, path, blake3_of_bytes(data)).read_bytes() == data
    assert (pulled / "cell-a").read_bytes() == (w / "cell-a").read_bytes()
    assert bw.json("verify", str(pulled))["ok"] is True
