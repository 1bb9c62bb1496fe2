"""verify_tree against real pulled trees: real torch.save checkpoints, real safetensors files, real
symlinks and FIFOs, and the b3sum binary for digest parity. Every refusal is asserted by its exact
reason code and path."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

from controller.digest import (
    EMPTY_DIGEST,
    StreamHasher,
    canonical_manifest_json,
    digest_file,
    file_digest,
    manifest_digest,
)
from controller.errors import StateError
from controller.manifest import (
    MANIFEST_NAME,
    MARKER_NAME,
    Manifest,
    ManifestFile,
    read_manifest,
    utc_iso_from_unix_ns,
    utc_now_iso,
    write_manifest,
)
from controller.probe import UnavailableLoader, probe_file
from controller.verify import VerifyReport, read_marker, verify_tree

VERSION = "0.1.0-test"
CELLS = ("cell-a", "cell-b")


# --- helpers -------------------------------------------------------------------------------------


def seal(root: Path, roster: tuple[str, ...] = CELLS, run_id: str = "run-1") -> Manifest:
    """Write MANIFEST.json claiming exactly the regular files now under `root`."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel in (MANIFEST_NAME, MARKER_NAME) or full.is_symlink():
                continue
            d = digest_file(full)
            files.append(ManifestFile(rel, d.bytes, d.blake3, utc_now_iso()))
    manifest = Manifest.build(run_id, "box-1", files, roster)
    write_manifest(root, manifest)
    return manifest


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    if importlib.util.find_spec("numpy") is not None:
        from safetensors.torch import save_file

        save_file(tensors, path)
        return
    # save_file hands safetensors' Rust writer each tensor's address and length, and takes that
    # address through numpy; without numpy (as in the dev env) make the same call directly.
    specs = {
        name: safetensors.TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.nbytes,
        )
        for name, t in tensors.items()
    }
    safetensors.serialize_file(specs, path)


def codes(report: VerifyReport) -> list[tuple[str, str]]:
    return [(r.code, r.path) for r in report.reasons]


def verify(root: Path, **kwargs: Any) -> VerifyReport:
    return verify_tree(root, verifier_version=VERSION, **kwargs)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


class TouchPayload:
    """Unpickling this would create `sentinel`."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.sentinel,))


class OpenPayload:
    """Unpickling this would create `sentinel` through open(..., "w")."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.sentinel), "w"))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A pulled tree: two cells, each with a checkpoint and metrics, and its MANIFEST.json."""
    root = tmp_path / "pulled"
    for i, cell in enumerate(CELLS):
        (root / cell).mkdir(parents=True)
        state = {"w": torch.full((64, 64), float(i)), "step": torch.tensor(100 + i)}
        torch.save({"model": state, "epoch": 3}, root / cell / "best.pt")
        (root / cell / "metrics.json").write_text(json.dumps({"loss": 0.5 - i / 10, "step": 100 + i}))
    seal(root)
    return root


# --- verify: the clean case ----------------------------------------------------------------------


def test_clean_tree_verifies_and_marker_binds_manifest_digest(tree: Path) -> None:
    manifest = read_manifest(tree / MANIFEST_NAME)

    report = verify(tree)

    assert report.ok and codes(report) == []
    assert report.files == 4 and report.bytes == sum(f.bytes for f in manifest.files)
    assert report.manifest_digest == manifest.digest == manifest_digest(manifest.files)
    assert report.marker_path == tree / MARKER_NAME
    marker = read_marker(tree)
    assert marker is not None
    assert marker["schema"] == "boxwarden.verified/1"
    assert marker["manifest_digest"] == manifest.digest
    assert marker["run_id"] == "run-1"
    assert (marker["files"], marker["bytes"]) == (report.files, report.bytes)
    assert marker["verifier"]["version"] == VERSION
    probed = {(p["path"], p["kind"], p["ok"]) for p in marker["load_probe"]}
    assert probed == {
        ("cell-a/best.pt", "torch", True),
        ("cell-b/best.pt", "torch", True),
        ("cell-a/metrics.json", "json", True),
        ("cell-b/metrics.json", "json", True),
    }
    doc = report.to_json()
    assert doc["allowed"] is True and doc["reasons"] == [] and doc["manifest_digest"] == manifest.digest
    # Writing the manifest and the marker left no temp file behind (it would be EXTRA next time).
    assert sorted(p.name for p in tree.iterdir()) == [MANIFEST_NAME, MARKER_NAME, *CELLS]
    assert verify(tree).ok


# --- verify: each refusal ------------------------------------------------------------------------


def test_flipped_byte_is_hash_mismatch(tree: Path) -> None:
    target = tree / "cell-a" / "best.pt"
    flip_byte(target, target.stat().st_size // 2)
    report = verify(tree)
    assert codes(report) == [("HASH_MISMATCH", "cell-a/best.pt")]
    assert not report.ok and report.marker_path is None
    assert report.to_json()["allowed"] is False


def test_truncated_file_is_size_mismatch(tree: Path) -> None:
    target = tree / "cell-b" / "best.pt"
    os.truncate(target, target.stat().st_size - 1)
    assert codes(verify(tree)) == [("SIZE_MISMATCH", "cell-b/best.pt")]


def test_missing_file(tree: Path) -> None:
    (tree / "cell-b" / "metrics.json").unlink()
    assert codes(verify(tree)) == [("MISSING", "cell-b/metrics.json")]


def test_extra_file_even_with_a_temp_name(tree: Path) -> None:
    (tree / "cell-a" / "best.pt.tmp").write_bytes(b"half a checkpoint")
    assert codes(verify(tree)) == [("EXTRA", "cell-a/best.pt.tmp")]


def test_roster_cell_without_files_is_incomplete(tree: Path) -> None:
    assert codes(verify(tree, roster=["cell-a", "cell-b", "cell-c"])) == [("ROSTER_INCOMPLETE", "cell-c")]


def test_manifest_roster_is_used_when_none_is_given(tree: Path) -> None:
    seal(tree, roster=("cell-a", "cell-b", "cell-c"))
    assert codes(verify(tree)) == [("ROSTER_INCOMPLETE", "cell-c")]
    assert codes(verify(tree, roster=[])) == [("ROSTER_INCOMPLETE", "cell-c")]


def test_roster_cell_whose_only_file_fails_is_incomplete(tree: Path) -> None:
    (tree / "cell-c").mkdir()
    (tree / "cell-c" / "best.pt").write_bytes(b"not a checkpoint")
    seal(tree, roster=("cell-a", "cell-b", "cell-c"))
    assert codes(verify(tree)) == [("ROSTER_INCOMPLETE", "cell-c"), ("UNLOADABLE", "cell-c/best.pt")]


def test_garbage_checkpoint_is_unloadable(tree: Path) -> None:
    (tree / "cell-a" / "best.pt").write_bytes(os.urandom(4096))
    seal(tree)
    report = verify(tree)
    assert codes(report) == [("UNLOADABLE", "cell-a/best.pt")]
    probe = next(p for p in report.probes if p.path == "cell-a/best.pt")
    assert probe.kind == "torch" and not probe.ok and probe.detail


@pytest.mark.parametrize("payload", [TouchPayload, OpenPayload])
def test_pickle_payload_is_unloadable_and_never_runs(tree: Path, tmp_path: Path, payload: type) -> None:
    sentinel = tmp_path / "pwned"
    torch.save({"model": payload(sentinel)}, tree / "cell-a" / "best.pt")
    assert not sentinel.exists()
    seal(tree)

    report = verify(tree)

    assert codes(report) == [("UNLOADABLE", "cell-a/best.pt")]
    assert "weights_only" in report.reasons[0].detail
    assert not sentinel.exists()


def test_torch_absent_fails_closed(tree: Path) -> None:
    loader = UnavailableLoader("torch is not importable; install boxwarden[torch]")
    report = verify(tree, loader=loader)
    assert codes(report) == [("UNLOADABLE", "cell-a/best.pt"), ("UNLOADABLE", "cell-b/best.pt")]
    assert "boxwarden[torch]" in report.reasons[0].detail


def test_legacy_torch_format_loads_without_mmap(tree: Path) -> None:
    state = {"w": torch.ones(8)}
    torch.save(state, tree / "cell-a" / "best.pt", _use_new_zipfile_serialization=False)
    seal(tree)
    assert verify(tree).ok


def test_symlink_to_outside_file_is_unsafe_and_not_followed(tree: Path) -> None:
    passwd = Path("/etc/passwd")
    link = tree / "cell-a" / "passwd"
    link.symlink_to(passwd)
    # Claim the target's real bytes: a verifier that followed the link would find them equal.
    manifest = read_manifest(tree / MANIFEST_NAME)
    target = digest_file(passwd)
    claimed = ManifestFile("cell-a/passwd", target.bytes, target.blake3, utc_now_iso())
    write_manifest(tree, Manifest.build("run-1", "box-1", [*manifest.files, claimed], CELLS))

    report = verify(tree)

    assert codes(report) == [("UNSAFE_PATH", "cell-a/passwd")]
    assert "never followed" in report.reasons[0].detail
    assert not (tree / MARKER_NAME).exists()


def test_symlinked_directory_is_unsafe_and_not_walked(tree: Path) -> None:
    (tree / "cell-c").symlink_to(tree / "cell-b", target_is_directory=True)
    assert codes(verify(tree)) == [("UNSAFE_PATH", "cell-c")]


def test_fifo_is_unsafe_and_never_opened(tree: Path) -> None:
    fifo = tree / "cell-a" / "pipe.pt"
    os.mkfifo(fifo)
    # Even when the manifest claims it: opening a FIFO for reading would block forever.
    manifest = read_manifest(tree / MANIFEST_NAME)
    claimed = ManifestFile("cell-a/pipe.pt", 0, EMPTY_DIGEST, utc_now_iso())
    write_manifest(tree, Manifest.build("run-1", "box-1", [*manifest.files, claimed], CELLS))
    assert codes(verify(tree)) == [("UNSAFE_PATH", "cell-a/pipe.pt")]


def test_name_that_is_not_utf8_is_unsafe(tree: Path) -> None:
    with open(os.fsencode(tree / "cell-a") + b"/bad\xff.bin", "wb") as fh:
        fh.write(b"x")
    assert codes(verify(tree)) == [("UNSAFE_PATH", "cell-a/bad\\xff.bin")]


def test_old_marker_is_deleted_when_verification_fails(tree: Path) -> None:
    assert verify(tree).ok and (tree / MARKER_NAME).exists()
    flip_byte(tree / "cell-b" / "metrics.json", 0)
    report = verify(tree)
    assert codes(report) == [("HASH_MISMATCH", "cell-b/metrics.json")]
    assert not (tree / MARKER_NAME).exists()
    assert read_marker(tree) is None


def test_old_marker_is_deleted_even_without_a_manifest(tree: Path) -> None:
    assert verify(tree).ok
    (tree / MANIFEST_NAME).unlink()
    assert codes(verify(tree)) == [("MISSING", MANIFEST_NAME)]
    assert not (tree / MARKER_NAME).exists()


def test_write_marker_false_writes_nothing(tree: Path) -> None:
    report = verify(tree, write_marker=False)
    assert report.ok and report.marker_path is None
    assert not (tree / MARKER_NAME).exists()


def test_tampered_manifest_is_invalid(tree: Path) -> None:
    path = tree / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["files"][0]["bytes"] += 1
    doc["totals"]["bytes"] += 1  # a careful forger fixes the totals, but cannot fix the digest
    path.write_text(json.dumps(doc))
    report = verify(tree)
    assert codes(report) == [("MANIFEST_INVALID", MANIFEST_NAME)]
    assert "'digest'" in report.reasons[0].detail


@pytest.mark.parametrize(
    ("bad_path", "problem"),
    [
        ("/etc/passwd", "absolute"),
        ("cell-a/../../x", "'..'"),
        ("cell-a//best.pt", "empty path component"),
        ("cell-a/\x00.pt", "NUL"),
        ("cell-a\\best.pt", "backslash"),
        (MARKER_NAME, "reserved"),
    ],
)
def test_manifest_with_unsafe_path_is_invalid(tree: Path, bad_path: str, problem: str) -> None:
    path = tree / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["files"][0]["path"] = bad_path
    path.write_text(json.dumps(doc))
    report = verify(tree)
    assert codes(report) == [("MANIFEST_INVALID", MANIFEST_NAME)]
    assert "files[0].path" in report.reasons[0].detail and problem in report.reasons[0].detail


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(schema="boxwarden.manifest/2"), "'schema'"),
        (lambda d: d.pop("run_id"), "'run_id'"),
        (lambda d: d["files"][1].update(bytes="12"), "files[1].bytes"),
        (lambda d: d["files"][1].update(blake3="ABC"), "files[1].blake3"),
        (lambda d: d["files"].append(dict(d["files"][0])), "twice"),
        (lambda d: d.update(roster=["cell-a/x"]), "roster[0]"),
    ],
)
def test_read_manifest_names_the_bad_field(tree: Path, edit: Any, field: str) -> None:
    path = tree / MANIFEST_NAME
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(StateError, match=MANIFEST_NAME) as info:
        read_manifest(path)
    assert field in str(info.value)


def test_manifest_that_is_a_fifo_is_invalid_without_blocking(tree: Path) -> None:
    (tree / MANIFEST_NAME).unlink()
    os.mkfifo(tree / MANIFEST_NAME)
    report = verify(tree)
    assert codes(report) == [("MANIFEST_INVALID", MANIFEST_NAME)]
    assert "not a regular file" in report.reasons[0].detail


def test_sealed_at_from_unix_ns_round_trips_through_read_manifest(tmp_path: Path) -> None:
    stamp = utc_iso_from_unix_ns(1_700_000_000_123_456_789)
    assert stamp == "2023-11-14T22:13:20.123Z"
    (tmp_path / "a.bin").write_bytes(b"a")
    d = digest_file(tmp_path / "a.bin")
    written = Manifest.build("r", "i", [ManifestFile("a.bin", d.bytes, d.blake3, stamp)], ())
    write_manifest(tmp_path, written)
    assert read_manifest(tmp_path / MANIFEST_NAME) == written


def test_manifest_that_is_not_json_is_invalid(tree: Path) -> None:
    (tree / MANIFEST_NAME).write_text('{"schema": ')
    assert codes(verify(tree)) == [("MANIFEST_INVALID", MANIFEST_NAME)]


def test_empty_manifest_refuses_to_verify_nothing(tmp_path: Path) -> None:
    seal(tmp_path, roster=())
    report = verify(tmp_path)
    assert codes(report) == [("EMPTY", "")]
    assert not (tmp_path / MARKER_NAME).exists()


def test_single_file_tree_without_roster_verifies(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "final.pt")
    seal(tmp_path, roster=())
    assert verify(tmp_path).ok


# --- safetensors -------------------------------------------------------------------------------


def _safetensors_tree(tree: Path) -> Path:
    target = tree / "cell-a" / "model.safetensors"
    tensors = {
        "weight": torch.randn(16, 8),
        "bias": torch.zeros(8, dtype=torch.bfloat16),
        "empty": torch.zeros(0),
    }
    save_safetensors(tensors, target)
    return target


def test_valid_safetensors_verifies(tree: Path) -> None:
    target = _safetensors_tree(tree)
    seal(tree)
    report = verify(tree)
    assert report.ok
    probe = next(p for p in report.probes if p.path == "cell-a/model.safetensors")
    assert probe.kind == "safetensors" and probe.ok
    with safetensors.safe_open(target, "pt") as reference:  # the reference reader agrees
        assert set(reference.keys()) == {"weight", "bias", "empty"}


def test_safetensors_with_inconsistent_header_is_unloadable(tree: Path) -> None:
    target = _safetensors_tree(tree)
    raw = target.read_bytes()
    # Same length, still valid JSON, but the weight's offsets no longer match its shape.
    header_end = 8 + int.from_bytes(raw[:8], "little")
    header = raw[8:header_end]
    assert b'"shape":[16,8]' in header
    target.write_bytes(raw[:8] + header.replace(b'"shape":[16,8]', b'"shape":[16,9]') + raw[header_end:])
    seal(tree)
    report = verify(tree)
    assert codes(report) == [("UNLOADABLE", "cell-a/model.safetensors")]
    with pytest.raises(safetensors.SafetensorError), safetensors.safe_open(target, "pt") as reference:
        reference.get_tensor("weight")


def test_safetensors_with_oversized_header_length_is_unloadable(tree: Path) -> None:
    target = _safetensors_tree(tree)
    raw = target.read_bytes()
    target.write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])
    seal(tree)
    assert codes(verify(tree)) == [("UNLOADABLE", "cell-a/model.safetensors")]


def test_probe_of_unknown_type_applies_no_probe(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    result = probe_file(tmp_path / "notes.txt")
    assert (result.kind, result.ok) == ("none", True)


# --- digests -------------------------------------------------------------------------------------


def test_known_vector_for_empty_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    expected = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert file_digest(empty) == EMPTY_DIGEST == expected
    assert StreamHasher().hexdigest() == expected


@pytest.mark.skipif(shutil.which("b3sum") is None, reason="b3sum is not installed")
@pytest.mark.parametrize("size", [0, 1, 3 * 1024 * 1024])
def test_file_digest_matches_b3sum(tmp_path: Path, size: int) -> None:
    path = tmp_path / f"data-{size}"
    path.write_bytes(os.urandom(size))
    b3sum = subprocess.run(["b3sum", "--no-names", str(path)], check=True, capture_output=True, text=True)
    assert file_digest(path) == b3sum.stdout.strip()


def test_stream_hasher_equals_file_digest(tmp_path: Path) -> None:
    data = os.urandom(5 * 1024 * 1024 + 7)
    path = tmp_path / "blob"
    path.write_bytes(data)
    hasher = StreamHasher()
    view = memoryview(data)
    for start in range(0, len(data), 1 << 20):
        hasher.update(view[start : start + (1 << 20)])
    assert hasher.hexdigest() == file_digest(path)
    assert hasher.bytes_seen == len(data)


def test_canonical_manifest_form_is_literal() -> None:
    a = ManifestFile("é/b.pt", 2, "a" * 64, "2024-01-01T00:00:00Z")
    b = ManifestFile("a/z.json", 10, "b" * 64, "2024-01-01T00:00:00Z")
    expected = (
        '{"files":[{"blake3":"' + "b" * 64 + '","bytes":10,"path":"a/z.json"},'
        '{"blake3":"' + "a" * 64 + '","bytes":2,"path":"é/b.pt"}]}'
    ).encode()
    assert canonical_manifest_json([a, b]) == expected
    assert manifest_digest([a, b]) == manifest_digest([b, a])
