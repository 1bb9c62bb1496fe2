"""verify under hostile conditions: a file truncated while it is hashed (never a SIGBUS), a pull
holding the tree, an empty run, and a roster over two watched directories. Real files, the real
CLI in a subprocess where a crash would show as an exit status."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from controller.digest import CHILD_MIN, digest_file, manifest_digest
from controller.errors import StateError
from controller.manifest import (
    MARKER_NAME,
    Manifest,
    ManifestFile,
    load_json_object,
    read_manifest,
    utc_now_iso,
    write_manifest,
)
from controller.verify import read_marker, verify_tree
from sidecar import hashing as shashing
from tests.conftest import Bw

VERSION = "0.1.0-test"


def claim_all(root: Path, roster: tuple[str, ...] = (), watch_dirs: tuple[str, ...] = ()) -> Manifest:
    files = []
    for full in sorted(p for p in root.rglob("*") if p.is_file()):
        d = digest_file(full)
        files.append(ManifestFile(full.relative_to(root).as_posix(), d.bytes, d.blake3, utc_now_iso()))
    manifest = Manifest.build("run-1", "box-1", files, roster, watch_dirs)
    write_manifest(root, manifest)
    return manifest


def big_sparse(path: Path, size: int) -> None:
    """A file of `size` bytes that costs nothing on disk but must really be read to be hashed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
        f.truncate(size)
        f.seek(size - 4096)
        f.write(os.urandom(4096))


# --- SIGBUS: truncated while hashed --------------------------------------------------------------


def test_verify_of_a_file_truncated_while_hashed_is_a_reason_never_a_crash(bw: Bw, tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    big = root / "cell-a" / "big.bin"
    size = 1 << 30
    big_sparse(big, size)
    claim_all(root)
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller", "verify", str(root), "--json"],
        cwd=bw.cwd,
        env=bw.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    truncations = 0
    # Cut the second half away from under the hash, again and again, until verify has finished;
    # the file is at its full size most of the time, so the hash starts on (maps) all of it.
    while proc.poll() is None:
        os.truncate(big, size // 2)
        os.truncate(big, size)
        truncations += 1
        for _ in range(50):
            os.stat(big)
    out, err = proc.communicate(timeout=120)
    assert truncations > 0
    assert proc.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), err
    assert proc.returncode == 3, f"exit {proc.returncode}:\n{out}\n{err}"
    doc = json.loads(out)
    [reason] = doc["reasons"]
    assert reason["path"] == "cell-a/big.bin"
    assert reason["code"] in {"UNREADABLE", "SIZE_MISMATCH", "HASH_MISMATCH"}, reason
    if reason["code"] == "UNREADABLE":
        assert "changed while hashed" in reason["detail"]
    assert not (root / MARKER_NAME).exists()


@pytest.mark.parametrize("size", [CHILD_MIN - 1, CHILD_MIN, CHILD_MIN + 1, CHILD_MIN + (3 << 20) + 7])
def test_digest_either_side_of_the_child_threshold_matches_b3sum_and_the_sidecar(
    tmp_path: Path, size: int
) -> None:
    f = tmp_path / "f.bin"
    big_sparse(f, size)
    ours = digest_file(f)
    assert ours.bytes == size
    assert ours.blake3 == shashing.hash_file(f)
    b3sum = shutil.which("b3sum")
    assert b3sum is not None
    out = subprocess.run([b3sum, "--no-names", str(f)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ours.blake3


# --- a pull holds the tree -----------------------------------------------------------------------


def test_verify_refuses_while_a_pull_holds_the_tree(bw: Bw, tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    (root / "cell-a").mkdir(parents=True)
    (root / "cell-a" / "m.json").write_text("{}")
    claim_all(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running pull holds
        r = bw("verify", str(root))
        assert r.returncode == 1, r.stderr
        assert f"another pull into {root} is running" in r.stderr and "wait for it" in r.stderr
        assert not (root / MARKER_NAME).exists()
    finally:
        os.close(fd)
    bw.ok("verify", str(root))
    assert (root / MARKER_NAME).exists()


# --- an empty run ---------------------------------------------------------------------------------


def test_empty_tree_verifies_only_with_allow_empty_and_the_marker_says_so(bw: Bw, tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    root.mkdir()
    claim_all(root)
    r = bw("verify", str(root), "--json")
    assert r.returncode == 3
    [reason] = json.loads(r.stdout)["reasons"]
    assert reason["code"] == "EMPTY" and "--allow-empty" in reason["detail"]
    assert read_marker(root) is None

    doc = bw.json("verify", str(root), "--allow-empty")
    assert doc["ok"] is True and doc["files"] == 0
    marker = read_marker(root)
    assert marker is not None and marker["allow_empty"] is True and marker["files"] == 0


def test_a_non_empty_tree_marker_records_allow_empty_false(tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    (root / "cell-a").mkdir(parents=True)
    (root / "cell-a" / "m.json").write_text("{}")
    claim_all(root)
    assert verify_tree(root, verifier_version=VERSION).ok
    marker = read_marker(root)
    assert marker is not None and marker["allow_empty"] is False
    assert json.loads((root / MARKER_NAME).read_text())["allow_empty"] is False


# --- two watched directories ---------------------------------------------------------------------


def two_dir_tree(root: Path) -> Manifest:
    for top in ("ckpt", "logs"):
        for cell in ("cell-a", "cell-b"):
            (root / top / cell).mkdir(parents=True)
            (root / top / cell / "x.json").write_text(json.dumps([top, cell]))
    return claim_all(root, roster=("cell-a", "cell-b"), watch_dirs=("ckpt", "logs"))


def test_roster_cells_of_two_watched_dirs_are_the_component_after_the_prefix(tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    manifest = two_dir_tree(root)
    rep = verify_tree(root, verifier_version=VERSION)
    assert rep.ok, rep.reasons
    rep = verify_tree(root, roster=["cell-a", "cell-c"], verifier_version=VERSION)
    assert [(r.code, r.path) for r in rep.reasons] == [("ROSTER_INCOMPLETE", "cell-c")]
    # A cell whose only file fails is incomplete, even though the other watched dir has it.
    (root / "ckpt" / "cell-b" / "x.json").write_text("changed")
    (root / "logs" / "cell-b" / "x.json").unlink()
    codes = {(r.code, r.path) for r in verify_tree(root, verifier_version=VERSION).reasons}
    assert ("ROSTER_INCOMPLETE", "cell-b") in codes
    assert manifest.cell_of("ckpt/cell-a/x.json") == "cell-a"


def test_watch_dirs_round_trip_and_stay_out_of_the_digest(tmp_path: Path) -> None:
    root = tmp_path / "pulled"
    manifest = two_dir_tree(root)
    assert manifest.digest == manifest_digest(manifest.files)
    doc = json.loads((root / "MANIFEST.json").read_text())
    assert doc["watch_dirs"] == ["ckpt", "logs"]
    assert read_manifest(root / "MANIFEST.json").watch_dirs == ("ckpt", "logs")
    # An older manifest without the field reads as one watched directory.
    del doc["watch_dirs"]
    (root / "MANIFEST.json").write_text(json.dumps(doc))
    old = read_manifest(root / "MANIFEST.json")
    assert old.watch_dirs == () and old.digest == manifest.digest
    assert old.cell_of("ckpt/cell-a/x.json") == "ckpt"


def test_verify_of_a_directory_without_a_manifest_leaves_a_user_s_file_alone(tmp_path: Path) -> None:
    """Review 3, finding 6: verify deleted any PULL_VERIFIED.json before looking for a manifest."""
    mine = tmp_path / "PULL_VERIFIED.json"
    mine.write_text("my precious marker notes")
    r = subprocess.run(
        [sys.executable, "-m", "controller", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "BOXWARDEN_HOME": str(tmp_path / "home")},
        timeout=120,
    )
    assert r.returncode == 3 and "MANIFEST.json" in r.stdout + r.stderr
    assert mine.read_text() == "my precious marker notes"


@pytest.mark.parametrize("name", ["MANIFEST.json", "PULL_VERIFIED.json"])
def test_json_nested_past_the_parsers_stack_is_refused_as_invalid(tmp_path: Path, name: str) -> None:
    """Review 10, finding 4: it was an "internal error: RecursionError" (exit 1)."""
    deep = tmp_path / name
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(StateError, match="nested too deeply"):
        load_json_object(deep)


def test_a_full_or_read_only_tree_is_a_clear_error_not_an_internal_one(tmp_path: Path) -> None:
    """Review 14, F01: ENOSPC while writing MANIFEST.json or the marker was an "internal error"
    with a traceback in the logs; on a read-only tree with no marker, verify said it could not
    remove the old one."""
    from controller.manifest import atomic_write_json
    from controller.verify import _remove_marker

    point = tmp_path / "small"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(point)], check=True)
    try:
        with contextlib.suppress(OSError):
            (point / "filler").write_bytes(b"x" * (1 << 20))  # fills it
        with pytest.raises(StateError, match=r"No space left on device.*free some space"):
            atomic_write_json(point / "MANIFEST.json", {"files": ["x" * 100_000]})
        assert sorted(p.name for p in point.iterdir()) == ["filler"]  # no temp file left
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        _remove_marker(point, point / "PULL_VERIFIED.json")  # none there: nothing to say
    finally:
        subprocess.run(["umount", str(point)], check=True)


class CountingLoader:
    """A checkpoint loader that records what it was asked to load (and loads nothing)."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load(self, path: Path) -> None:
        self.loaded.append(path.name)


def test_the_gate_loads_again_only_what_the_verify_of_this_manifest_did_not(tmp_path: Path) -> None:
    """The gate hashes every byte again, but a checkpoint the marker's verify loaded, whose bytes
    hash equal, is not loaded again (each `down` paid `import torch`); a marker of another manifest
    vouches for nothing, and a changed file is a mismatch before any load."""
    from controller.verify import loaded_by

    root = tmp_path / "pulled"
    (root / "cell-a").mkdir(parents=True)
    (root / "cell-a" / "a.pt").write_bytes(b"checkpoint a")
    (root / "cell-a" / "b.pt").write_bytes(b"checkpoint b")
    claim_all(root)
    first = CountingLoader()
    assert verify_tree(root, verifier_version=VERSION, loader=first).ok
    assert sorted(first.loaded) == ["a.pt", "b.pt"]
    marker = read_marker(root)
    assert marker is not None
    again = CountingLoader()
    report = verify_tree(
        root, verifier_version=VERSION, loader=again, write_marker=False, loaded=loaded_by(marker)
    )
    assert report.ok and again.loaded == []
    assert {p.detail for p in report.probes} == {"loaded at verify (same bytes)"}
    other = CountingLoader()
    stale = dataclasses.replace(loaded_by(marker), manifest_digest="0" * 64)
    assert verify_tree(root, verifier_version=VERSION, loader=other, write_marker=False, loaded=stale).ok
    assert sorted(other.loaded) == ["a.pt", "b.pt"]
    (root / "cell-a" / "a.pt").write_bytes(b"checkpoint A")  # same size, other bytes
    changed = verify_tree(
        root, verifier_version=VERSION, loader=again, write_marker=False, loaded=loaded_by(marker)
    )
    assert [r.code for r in changed.reasons] == ["HASH_MISMATCH"] and again.loaded == []
