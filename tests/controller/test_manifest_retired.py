"""MANIFEST.json's `retired` list: files an earlier pull placed that the box no longer claims.
Not part of the digest; never a claim's path too; absent in manifests written before it existed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.errors import StateError
from controller.manifest import Manifest, ManifestFile, read_manifest, write_manifest

H = "ab" * 32
T = "2026-01-01T00:00:00Z"


def f(path: str, n: int = 1) -> ManifestFile:
    return ManifestFile(path, n, H, T)


def test_retired_files_are_not_in_the_digest_and_round_trip(tmp_path: Path) -> None:
    plain = Manifest.build("r", "b", [f("a.bin")], [])
    with_retired = plain.with_retired([f("z/old.bin", 5), f("c.bin")])
    assert with_retired.digest == plain.digest
    write_manifest(tmp_path, with_retired)
    back = read_manifest(tmp_path / "MANIFEST.json")
    assert [x.path for x in back.retired] == ["c.bin", "z/old.bin"] and back == with_retired


def test_a_manifest_without_the_field_reads_as_none_retired(tmp_path: Path) -> None:
    write_manifest(tmp_path, Manifest.build("r", "b", [f("a.bin")], []))
    doc = json.loads((tmp_path / "MANIFEST.json").read_text())
    del doc["retired"]
    (tmp_path / "MANIFEST.json").write_text(json.dumps(doc))
    assert read_manifest(tmp_path / "MANIFEST.json").retired == ()


@pytest.mark.parametrize(
    ("retired", "why"),
    [
        ([f("a.bin")], "twice"),
        ([f("a.bin/x")], "as a file and as a directory"),
        ([f("../up")], "unsafe"),
        ([f("x"), f("x")], "twice"),
    ],
)
def test_a_retired_list_that_cannot_be_on_disk_is_refused(
    tmp_path: Path, retired: list[ManifestFile], why: str
) -> None:
    plain = Manifest.build("r", "b", [f("a.bin")], [])
    with pytest.raises(StateError, match=why):
        plain.with_retired(retired)
    write_manifest(tmp_path, plain)
    doc = json.loads((tmp_path / "MANIFEST.json").read_text())
    doc["retired"] = [x.to_json() for x in retired]
    (tmp_path / "MANIFEST.json").write_text(json.dumps(doc))
    with pytest.raises(StateError, match=why):
        read_manifest(tmp_path / "MANIFEST.json")
