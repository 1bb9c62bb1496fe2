"""pull against a hostile destination: the box's own directories, planted symlinks, long names,
files and directories in the way, pseudo-filesystems, a second pull at once, a corrupt partial
copy. The real CLI against real sidecars; pure path rules tested directly. The checkpoints are
real safetensors files: the verify after a pull probes them without importing torch."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.digest import path_key
from controller.overlap import destination_problem, overlap_problem
from tests.conftest import Bw, save_weights, wait_until


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def one_claim(bw: Bw, *extra: str) -> dict[str, Path]:
    p = bw.up("b1", *extra)
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=3, size=100_000)
    bw.wait_durable("b1", 1)
    return p


# --- overlap with the box's own directories --------------------------------------------------------


@pytest.mark.parametrize("where", ["watch", "inside", "parent", "symlinked", "durable"])
def test_pull_into_the_box_s_own_dirs_is_refused_and_writes_nothing(bw: Bw, where: str) -> None:
    p = one_claim(bw)
    (bw.cwd / "alias").symlink_to(p["watch"])
    to = {
        "watch": p["watch"],
        "inside": p["watch"] / "cell-a" / "pulled",
        "parent": bw.cwd,
        "symlinked": bw.cwd / "alias" / "pulled",
        "durable": p["durable"] / "pulled",
    }[where]
    before = files_under(p["watch"])
    r = bw("pull", "b1", "--to", str(to))
    assert r.returncode == 2, r.stderr
    assert "refusing to pull" in r.stderr and "--to" in r.stderr
    assert files_under(p["watch"]) == before
    assert not to.exists() or where in ("watch", "parent")
    assert not (p["watch"] / "MANIFEST.json").exists() and not (bw.cwd / "MANIFEST.json").exists()


def test_overlap_problem_resolves_both_sides(tmp_path: Path) -> None:
    watch = tmp_path / "box" / "ckpt"
    watch.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "box")
    hello = pb.HelloResponse(
        box_name="b1",
        watch_dirs=[str(tmp_path / "link" / "ckpt")],
        state_dir=str(tmp_path / "state"),
        durable_root=f"file://{tmp_path}/dur%20able/b1/run",
        durable_url="s3://bucket/x",
    )
    assert overlap_problem(tmp_path / "elsewhere" / "new", hello) is None
    assert overlap_problem(tmp_path / "box-2", hello) is None
    inside = overlap_problem(watch / "not" / "yet", hello)
    assert inside is not None and "is inside the box's watched directory" in inside
    contains = overlap_problem(tmp_path / "link", hello)
    assert contains is not None and "contains" in contains
    assert "is the box's state directory" in str(overlap_problem(tmp_path / "state", hello))
    durable = overlap_problem(tmp_path / "dur able" / "b1", hello)
    assert durable is not None and "durable root" in durable


def test_destination_problem_names_pseudo_filesystems_and_files_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "pseudo-filesystem" in str(destination_problem(Path("/proc/pulled")))
    assert "is not a directory" in str(destination_problem(tmp_path / "file" / "sub"))
    assert "longer than" in str(destination_problem(tmp_path / ("n" * 300)))
    assert destination_problem(tmp_path / "fresh" / "tree") is None


@pytest.mark.parametrize("to", ["/proc/pulled", "FILE/sub", "LONG"])
def test_impossible_destination_is_a_usage_error(bw: Bw, to: str) -> None:
    one_claim(bw)
    (bw.cwd / "FILE").write_text("not a dir")
    dest = {"FILE/sub": str(bw.cwd / "FILE" / "sub"), "LONG": str(bw.cwd / ("n" * 300))}.get(to, to)
    r = bw("pull", "b1", "--to", dest)
    assert r.returncode == 2, r.stderr
    assert "refusing to pull" in r.stderr and "internal error" not in r.stderr


# --- what lies in the tree ---------------------------------------------------------------------------


def test_directory_where_the_box_has_a_file_refuses_before_the_first_byte(bw: Bw) -> None:
    p = bw.up("b1")
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=1, size=1000)
    save_weights(p["watch"] / "cell-b" / "best.safetensors", seed=2, size=1000)
    bw.wait_durable("b1", 2)
    pulled = bw.cwd / "pulled"
    (pulled / "cell-b" / "best.safetensors").mkdir(parents=True)
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 2, r.stderr
    assert "cell-b/best.safetensors: a directory that no pull of this box made" in r.stderr
    assert "move them out" in r.stderr
    assert not (pulled / "cell-a").exists(), "nothing is fetched before every path was checked"
    assert not (pulled / ".bw-parts").exists()


def test_file_where_the_box_has_a_directory_is_refused(bw: Bw) -> None:
    one_claim(bw)
    pulled = bw.cwd / "pulled"
    pulled.mkdir()
    (pulled / "cell-a").write_text("mine")
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 2, r.stderr
    assert "cell-a: a file whose bytes no pull of this box put there" in r.stderr
    assert "where the box has a directory" in r.stderr
    assert (pulled / "cell-a").read_text() == "mine"


def test_planted_part_symlink_is_never_written_through(bw: Bw, tmp_path: Path) -> None:
    p = one_claim(bw)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    pulled = bw.cwd / "pulled"
    (pulled / "cell-a").mkdir(parents=True)
    (pulled / "cell-a" / "best.safetensors.bw-part").symlink_to(victim)  # where the old pull wrote its part
    bw.ok("pull", "b1", "--to", str(pulled))
    assert victim.read_bytes() == b"precious"
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == (
        p["watch"] / "cell-a" / "best.safetensors"
    ).read_bytes()
    assert not (pulled / ".bw-parts").exists()


def test_parts_dir_that_is_a_symlink_is_refused(bw: Bw, tmp_path: Path) -> None:
    one_claim(bw)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pulled = bw.cwd / "pulled"
    pulled.mkdir()
    (pulled / ".bw-parts").symlink_to(elsewhere)
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 1, r.stderr
    assert ".bw-parts" in r.stderr and "remove it" in r.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_name_of_250_bytes_pulls_and_verifies(bw: Bw) -> None:
    p = bw.up("b1")
    name = "n" * 238 + ".safetensors"
    save_weights(p["watch"] / "cell-a" / name, seed=4, size=1000)
    bw.wait_durable("b1", 1)
    pulled = bw.cwd / "pulled"
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["fetched"] == [f"cell-a/{name}"]
    assert (pulled / "cell-a" / name).read_bytes() == (p["watch"] / "cell-a" / name).read_bytes()
    bw.ok("verify", str(pulled))


# --- resume and retry ------------------------------------------------------------------------------


def test_resume_from_the_part_file_in_bw_parts(bw: Bw) -> None:
    p = bw.up("b1")
    src = p["watch"] / "cell-a" / "big.safetensors"
    save_weights(src, seed=5, size=1_000_000)
    bw.wait_durable("b1", 1)
    pulled = bw.cwd / "pulled"
    parts = pulled / ".bw-parts"
    parts.mkdir(parents=True, mode=0o700)
    (parts / f"{path_key('cell-a/big.safetensors')}.part").write_bytes(src.read_bytes()[: 1 << 20])
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["resumed"] == {"cell-a/big.safetensors": 1 << 20}
    assert rep["bytes_fetched"] == src.stat().st_size - (1 << 20)
    assert (pulled / "cell-a" / "big.safetensors").read_bytes() == src.read_bytes()
    assert not parts.exists()


def test_corrupt_resumed_part_is_fetched_again_from_zero(bw: Bw) -> None:
    p = one_claim(bw)
    pulled = bw.cwd / "pulled"
    parts = pulled / ".bw-parts"
    parts.mkdir(parents=True, mode=0o700)
    (parts / f"{path_key('cell-a/best.safetensors')}.part").write_bytes(b"\0" * 1000)  # wrong bytes
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["restarted"] == ["cell-a/best.safetensors"] and rep["fetched"] == ["cell-a/best.safetensors"]
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == (
        p["watch"] / "cell-a" / "best.safetensors"
    ).read_bytes()
    assert not parts.exists()
    bw.ok("verify", str(pulled))


# --- one pull at a time ----------------------------------------------------------------------------


def test_a_second_pull_into_the_same_dir_is_refused(bw: Bw) -> None:
    one_claim(bw)
    pulled = bw.cwd / "pulled"
    pulled.mkdir()
    fd = os.open(pulled, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the first pull holds
        r = bw("pull", "b1", "--to", str(pulled))
        assert r.returncode == 1, r.stderr
        assert f"another pull into {pulled} is running" in r.stderr and "wait for it" in r.stderr
        assert list(pulled.iterdir()) == []
    finally:
        os.close(fd)
    bw.ok("pull", "b1", "--to", str(pulled))


# --- two watched directories -------------------------------------------------------------------------


def test_two_watched_dirs_pull_and_verify_by_the_cell_after_the_prefix(bw: Bw) -> None:
    p = bw.up("b1", "--watch", "logs", "--roster", "cell-a")
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=7, size=1000)
    (bw.cwd / "logs" / "cell-a").mkdir(parents=True)
    (bw.cwd / "logs" / "cell-a" / "x.log").write_text("done\n")
    bw.wait_durable("b1", 2)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    manifest = json.loads((pulled / "MANIFEST.json").read_text())
    assert manifest["watch_dirs"] == ["ckpt", "logs"]
    assert sorted(f["path"] for f in manifest["files"]) == [
        "ckpt/cell-a/best.safetensors",
        "logs/cell-a/x.log",
    ]
    doc = bw.json("verify", str(pulled))
    assert doc["ok"] is True, doc["reasons"]


# --- bytes pull cannot account for -------------------------------------------------------------------


def test_pull_refuses_a_tree_pulled_from_another_box(bw: Bw) -> None:
    pa = one_claim(bw)
    pulled = bw.cwd / "shared"
    bw.ok("pull", "b1", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    pb2 = bw.up("b2", watch="ckpt2")
    save_weights(
        pb2["watch"] / "cell-a" / "best.safetensors", seed=99, size=100_000
    )  # same path, other bytes
    save_weights(pb2["watch"] / "cell-c" / "new.safetensors", seed=98, size=1000)  # a path free in the tree
    bw.wait_durable("b2", 2)
    before = files_under(pulled)
    r = bw("pull", "b2", "--to", str(pulled))
    assert r.returncode == 2, r.stderr
    assert "'b1'" in r.stderr and "empty or new directory" in r.stderr
    assert files_under(pulled) == before, "nothing is written into another box's tree"
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == (
        pa["watch"] / "cell-a" / "best.safetensors"
    ).read_bytes()
    bw.ok("verify", str(pulled))


def test_pull_never_replaces_a_file_no_pull_of_this_box_wrote(bw: Bw) -> None:
    p = bw.up("b1")
    for i in range(7):
        save_weights(p["watch"] / f"cell-{i}" / "a.bin", seed=i, size=1000)
    bw.wait_durable("b1", 7)
    pulled = bw.cwd / "pulled"
    for i in range(7):
        (pulled / f"cell-{i}").mkdir(parents=True)
        (pulled / f"cell-{i}" / "a.bin").write_text("y")
    before = files_under(pulled)
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 2, r.stderr
    assert "7 path(s)" in r.stderr and all(f"cell-{i}/a.bin" in r.stderr for i in range(7)), "all at once"
    assert files_under(pulled) == before and not (pulled / ".bw-parts").exists()


def test_a_user_file_beside_this_box_s_tree_is_not_replaced(bw: Bw) -> None:
    p = one_claim(bw)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    save_weights(p["watch"] / "cell-b" / "best.safetensors", seed=8, size=1000)
    bw.wait_durable("b1", 2)
    (pulled / "cell-b").mkdir()
    (pulled / "cell-b" / "best.safetensors").write_text("y")  # not recorded in this box's manifest here
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 2, r.stderr
    assert "cell-b/best.safetensors" in r.stderr and "cell-a/best.safetensors" not in r.stderr
    assert (pulled / "cell-b" / "best.safetensors").read_text() == "y"


def _wait_new_claim(bw: Bw, path: str, old: str) -> None:
    def changed() -> bool:
        claims = bw.artifacts("b1")["claims"]
        return any(c["path"] == path and c["blake3"] != old and c.get("durable") for c in claims)

    wait_until(changed, what=f"a new durable claim of {path}")


def _blake3_of(bw: Bw, path: str) -> str:
    (claim,) = [c for c in bw.artifacts("b1")["claims"] if c["path"] == path]
    return str(claim["blake3"])


def test_a_file_placed_by_an_interrupted_pull_of_this_box_is_replaced(bw: Bw, tmp_path: Path) -> None:
    p = bw.up("b1")
    a, b = p["watch"] / "cell-a" / "best.safetensors", p["watch"] / "cell-b" / "best.safetensors"
    save_weights(a, seed=1, size=1000)
    save_weights(b, seed=2, size=1000)
    bw.wait_durable("b1", 2)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    old_a, old_b = _blake3_of(bw, "cell-a/best.safetensors"), _blake3_of(bw, "cell-b/best.safetensors")
    save_weights(a, seed=11, size=2000)
    save_weights(b, seed=12, size=2000)
    _wait_new_claim(bw, "cell-a/best.safetensors", old_a)
    _wait_new_claim(bw, "cell-b/best.safetensors", old_b)
    # A part file for cell-b that is not a plain file of ours stops the pull after cell-a is placed.
    parts = pulled / ".bw-parts"
    parts.mkdir(mode=0o700)
    (tmp_path / "elsewhere").write_bytes(b"x")
    blocker = parts / f"{path_key('cell-b/best.safetensors')}.part"
    os.link(tmp_path / "elsewhere", blocker)
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 1 and "not a plain file of ours" in r.stderr, r.stderr
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == a.read_bytes(), (
        "placed before the failure"
    )
    blocker.unlink()
    mid_a = _blake3_of(bw, "cell-a/best.safetensors")
    save_weights(a, seed=21, size=3000)  # the file the interrupted pull placed is now an older claim
    _wait_new_claim(bw, "cell-a/best.safetensors", mid_a)
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert sorted(rep["fetched"]) == ["cell-a/best.safetensors", "cell-b/best.safetensors"]
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == a.read_bytes()
    assert not parts.exists()
    bw.ok("verify", str(pulled))


def test_a_changed_claim_replaces_this_box_s_earlier_copy(bw: Bw) -> None:
    p = one_claim(bw)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    old = _blake3_of(bw, "cell-a/best.safetensors")
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=4, size=100_000)
    _wait_new_claim(bw, "cell-a/best.safetensors", old)
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["fetched"] == ["cell-a/best.safetensors"]
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == (
        p["watch"] / "cell-a" / "best.safetensors"
    ).read_bytes()
    bw.ok("verify", str(pulled))


def test_a_local_edit_of_a_pulled_file_is_not_replaced(bw: Bw) -> None:
    p = one_claim(bw)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    old = _blake3_of(bw, "cell-a/best.safetensors")
    (pulled / "cell-a" / "best.safetensors").write_bytes(b"edited here")
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=4, size=100_000)
    _wait_new_claim(bw, "cell-a/best.safetensors", old)
    r = bw("pull", "b1", "--to", str(pulled))
    assert r.returncode == 2 and "cell-a/best.safetensors" in r.stderr, r.stderr
    assert (pulled / "cell-a" / "best.safetensors").read_bytes() == b"edited here"


def test_files_the_box_no_longer_claims_are_kept_and_not_called_stale(bw: Bw) -> None:
    p = bw.up("b1")
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=1, size=1000)
    save_weights(p["watch"] / "cell-b" / "best.safetensors", seed=2, size=1000)
    bw.wait_durable("b1", 2)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    (p["watch"] / "cell-b" / "best.safetensors").unlink()
    bw.wait_durable("b1", 1)
    r = bw.ok("pull", "b1", "--to", str(pulled))
    assert "cell-b/best.safetensors" in r.stderr and "stale" not in r.stderr and "move them" not in r.stderr
    assert "released" in r.stderr and "durable copies remain" in r.stderr and "kept" in r.stderr
    assert (pulled / "cell-b" / "best.safetensors").exists()
    bw.ok("verify", str(pulled))  # listed as retired, not EXTRA


def test_leftover_parts_no_claim_needs_are_removed(bw: Bw) -> None:
    one_claim(bw)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "b1", "--to", str(pulled))
    parts = pulled / ".bw-parts"
    parts.mkdir(mode=0o700)
    (parts / f"{path_key('cell-y/other.pt')}.part").write_bytes(b"half")
    (parts / f"{path_key('cell-z/gone.pt')}.part").write_bytes(b"half")
    assert bw.json("verify", str(pulled), code=3)["ok"] is False
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert not parts.exists()
    bw.ok("verify", str(pulled))
    assert rep["fetched"] == [] and rep["parts_removed"] == 2


def test_a_restarted_transfer_counts_the_final_bytes_once(bw: Bw) -> None:
    p = one_claim(bw)
    size = (p["watch"] / "cell-a" / "best.safetensors").stat().st_size
    pulled = bw.cwd / "pulled"
    parts = pulled / ".bw-parts"
    parts.mkdir(parents=True, mode=0o700)
    (parts / f"{path_key('cell-a/best.safetensors')}.part").write_bytes(b"\0" * 1000)  # wrong bytes
    rep = bw.json("pull", "b1", "--to", str(pulled))
    assert rep["restarted"] == ["cell-a/best.safetensors"]
    assert rep["bytes_fetched"] == size and rep["bytes_discarded"] == size - 1000
