"""The whole lifecycle with an s3:// durable store (moto's real server on loopback): `up --durable
s3://… --durable-credentials FILE`, copies proven in the bucket, pull, verify, down; the
credentials appear nowhere but in their own 0600 file on the box."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import blake3

from tests.conftest import Bw, save_ckpt, save_weights
from tests.s3server import KEY_ID, SECRET, S3Server, write_credentials

NAME = "s3box"


def everything_under(root: Path, but: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p != but]


def test_the_whole_lifecycle_with_a_bucket_and_credentials_that_never_show(
    bw: Bw, s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.bucket()
    url = s3.url(bucket, "ckpts")
    creds = write_credentials(tmp_path / "creds")
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--durable", url,
          "--durable-credentials", str(creds))  # fmt: skip
    watch = bw.cwd / "ckpt"
    save_ckpt(watch / "cell-a" / "best.pt", seed=1)
    save_weights(watch / "cell-b" / "best.safetensors", seed=2)
    claims = {c["path"]: c for c in bw.wait_durable(NAME, 2)["claims"]}
    (row,) = bw.json("status")["boxes"]
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"ckpts/{NAME}/")["Contents"]
    (run,) = {o["Key"].split("/")[2] for o in listed}  # one run's corner: ckpts/<box>/<run>/...
    for path, claim in claims.items():
        body = s3.client().get_object(Bucket=bucket, Key=f"ckpts/{NAME}/{run}/{path}")["Body"].read()
        assert blake3.blake3(body).hexdigest() == claim["blake3"]
    on_box = Path(bw.home, "boxes", NAME, "sidecar", "durable-credentials")
    assert stat.S_IMODE(on_box.stat().st_mode) == 0o600 and on_box.read_text() == creds.read_text()
    (pid,) = bw.sidecar_pids()
    shown = [Path(f"/proc/{pid}/cmdline").read_bytes(), json.dumps(row).encode()]
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["allowed"] is True and sorted(doc["teardown"]["deleted"]) == sorted(claims)
    assert not (watch / "cell-a" / "best.pt").exists()  # released: its copy is proven in the bucket
    assert not on_box.exists()  # the credentials left the box with its sidecar
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert {f"ckpts/{NAME}/{run}/{p}" for p in claims} <= keys
    shown += [b for _, b in everything_under(bw.home, but=on_box)]
    shown += [b for _, b in everything_under(bw.cwd, but=on_box)]
    for text in shown:
        assert SECRET.encode() not in text and KEY_ID.encode() not in text


def test_credentials_are_refused_in_a_url_with_a_directory_or_when_others_can_read_them(
    bw: Bw, s3: S3Server, tmp_path: Path
) -> None:
    creds = write_credentials(tmp_path / "creds")
    base = ("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    r = bw(*base, "--durable", f"s3://{KEY_ID}:{SECRET}@bkt/p")
    assert r.returncode == 2 and "credentials never go in the URL" in r.stderr
    assert SECRET not in r.stderr + r.stdout and KEY_ID not in r.stderr + r.stdout
    r = bw(*base, "--durable", (tmp_path / "d").as_uri(), "--durable-credentials", str(creds))
    assert r.returncode == 2 and "goes with an s3:// --durable URL" in r.stderr
    creds.chmod(0o644)
    r = bw(*base, "--durable", s3.url(s3.bucket()), "--durable-credentials", str(creds))
    assert r.returncode == 2 and "chmod 600" in r.stderr and SECRET not in r.stderr
    r = bw(*base, "--durable", "s3://bkt/p?acl=public-read")
    assert r.returncode == 2 and "unknown option 'acl'" in r.stderr
    assert not Path(bw.home, "boxes", NAME, "sidecar").exists()  # nothing started, nothing made


def test_a_server_checksum_proof_is_shown_and_passes_the_gate_only_when_accepted(
    bw: Bw, s3: S3Server, tmp_path: Path
) -> None:
    url = s3.url(s3.bucket(), "ckpts") + "&proof=server-checksum"
    creds = write_credentials(tmp_path / "creds")
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--durable", url,
          "--durable-credentials", str(creds))  # fmt: skip
    save_weights(bw.cwd / "ckpt" / "cell-a" / "best.safetensors", seed=3)
    bw.wait_durable(NAME, 1)
    (claim,) = bw.json("artifacts", NAME)["claims"]
    assert claim["proof"] == "server-checksum"
    shown = bw.ok("artifacts", NAME)
    assert "server-checksum" in shown.stdout + shown.stderr
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    refused = bw.json("down", NAME, "--confirm", NAME, code=3)
    assert refused["allowed"] is False
    assert [r["code"] for r in refused["reasons"]] == ["WEAK_PROOF"]
    doc = bw.json("down", NAME, "--confirm", NAME, "--accept-server-checksum")
    assert doc["allowed"] is True and doc["teardown"]["deleted"] == ["cell-a/best.safetensors"]
