"""The two ends implement the proto's digest rules separately; these tests hold them to one answer."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from controller import digest as cdigest
from controller.manifest import ManifestFile
from sidecar import hashing as shashing
from sidecar.identity import FileIdentity
from sidecar.ledger import ClaimRow
from sidecar.manifest import manifest_digest as sidecar_manifest_digest


@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 3 << 20])
def test_file_digest_parity(tmp_path: Path, size: int) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(os.urandom(size))
    ours = shashing.hash_file(f)
    assert ours == cdigest.file_digest(f)
    assert len(ours) == 64 and ours == ours.lower()
    b3sum = shutil.which("b3sum")
    assert b3sum is not None, "b3sum is installed by .ci/run and `make setup` on this machine kind"
    out = subprocess.run([b3sum, "--no-names", str(f)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ours


def test_manifest_digest_parity_with_unicode_and_ordering() -> None:
    files = [("z/last.pt", 3, "c" * 64), ("cell-ä/best.pt", 10, "a" * 64), ("A/upper.pt", 0, "b" * 64)]
    ident = FileIdentity(dev=1, ino=1, size=0, mtime_ns=0, ctime_ns=0)
    claims = [ClaimRow(i, p, n, h, ident, 0, i, True, 0, "") for i, (p, n, h) in enumerate(files)]
    manifest_files = [ManifestFile(p, n, h, "2026-11-30T00:00:00.000Z") for p, n, h in files]
    assert sidecar_manifest_digest(claims) == cdigest.manifest_digest(manifest_files)
    assert sidecar_manifest_digest(list(reversed(claims))) == sidecar_manifest_digest(claims)
    canonical = cdigest.canonical_manifest_json(manifest_files).decode()
    assert canonical.startswith('{"files":[{"blake3":"' + "b" * 64 + '","bytes":0,"path":"A/upper.pt"}')
    assert "cell-ä" in canonical  # written as itself, not \\u escaped


def test_the_push_rate_the_controller_assumes_is_the_sidecars() -> None:
    """The controller cannot import the sidecar: it keeps its own copy of the default rate (what
    0 means) and of the lowest one the sidecar takes."""
    from controller import boxes
    from sidecar.storage import pace

    assert (boxes.DEFAULT_PUSH_RATE, boxes.MIN_PUSH_RATE) == (pace.DEFAULT_RATE, pace.MIN_RATE)


def test_the_identity_stamp_and_the_credentials_digest_are_read_as_the_sidecar_writes_them() -> None:
    """IDENTITY_METADATA and HelloResponse.credentials_digest, each implemented once per side."""
    from controller import identity
    from sidecar import stamp

    assert identity.KEY == stamp.KEY
    nonce = identity.new_nonce()
    assert stamp.NONCE_RE.match(nonce)  # the sidecar takes the nonces `up` makes
    said = identity.Stamp.parse(stamp.value("box-1", "run:2", nonce))
    assert said == identity.Stamp("box-1", "run:2", nonce)
    data = b"[default]\naws_access_key_id = K\n"
    assert identity.credentials_digest(nonce, data) == stamp.credentials_digest(nonce, data)
    assert identity.credentials_digest(nonce, data) != identity.credentials_digest(nonce, data + b" ")
    assert stamp.credentials_digest(nonce, None) == ""
