"""A box that is gone (issue 8, item 7): the real CLI against a real sidecar that is then killed by
its PID, its watched dir deleted. `pull --from durable` reads the durable copies of the last claims
list the controller kept (a directory, and moto's real S3 server), `verify` treats the tree as any
pulled one, and `down --box-gone` closes the box only on that evidence, complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import blake3

from tests.conftest import Bw, pid_alive, save_weights, wait_until
from tests.controller.test_meter_stop import audit, fake_profile, provider
from tests.s3server import S3Server, write_credentials
from tests.sshbox import free_port
from tests.test_remote_e2e import (  # noqa: F401 - fixtures
    Remote,
    _control_paths,
    remote,
    venv_template,
    wheel_cache,
    write_as_box,
)

NAME = "gone1"
CELLS = ("cell-a", "cell-b")


def codes(r: Any) -> set[str]:
    return {x["code"] for x in json.loads(r.stdout)["reasons"]}


def at_provider(bw: Bw, tmp_path: Path) -> tuple[str, ...]:
    """`up`'s arguments for a box at the fake provider (tests/fake_provider.py), whose word can prove
    it gone: a box on this machine is never gone by itself (its host answers)."""
    provider(bw, tmp_path, "create", f"i-{NAME}")
    return ("--profile-file", str(fake_profile(tmp_path)), "--instance-id", f"i-{NAME}")


def up_at_provider(bw: Bw, tmp_path: Path, *extra: str) -> dict[str, Path]:
    return bw.up(NAME, *at_provider(bw, tmp_path), *extra)


def kill_the_box(bw: Bw, watch: Path, tmp_path: Path) -> None:
    """The box is preempted: its sidecar dies at once, its disk goes with it, and the provider says
    it is gone."""
    for pid in bw.sidecar_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda pid=pid: not pid_alive(pid), what="the sidecar to be gone")
    shutil.rmtree(watch)
    provider(bw, tmp_path, "vanish", f"i-{NAME}")


def two_cells(watch: Path) -> dict[str, bytes]:
    for i, cell in enumerate(CELLS):
        save_weights(watch / cell / "best.safetensors", seed=i + 1)
    (watch / "cell-a" / "metrics.json").write_text('{"loss": 0.5}')
    return {p.relative_to(watch).as_posix(): p.read_bytes() for p in sorted(watch.rglob("*")) if p.is_file()}


def box_status(bw: Bw, name: str = NAME) -> str:
    (row,) = bw.json("status", name)["boxes"]
    return str(row["status"])


def test_a_gone_box_is_pulled_from_durable_and_closed_only_on_that_evidence_complete(
    bw: Bw, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    roster = [a for c in CELLS for a in ("--roster", c)]
    p = up_at_provider(bw, tmp_path, "--durable", store.as_uri(), *roster)
    files = two_cells(p["watch"])
    bw.wait_durable(NAME, len(files))
    first = bw.cwd / "from-box"
    bw.ok("pull", NAME, "--to", str(first))  # the controller keeps the claims list it got
    bw.ok("verify", str(first))
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the sidecar to be gone")
    # The sidecar is dead, but nothing says the box is: its host (this machine) answers and the
    # provider still lists it. Absence is proven, never inferred from a silent sidecar.
    r = bw("down", NAME, "--dry-run", "--box-gone", "--json")
    assert r.returncode == 3 and "SIDECAR_DEAD_HOST_UP" in codes(r), r.stdout
    detail = next(x["detail"] for x in json.loads(r.stdout)["reasons"] if x["code"] == "SIDECAR_DEAD_HOST_UP")
    assert f"boxwarden up {NAME}" in detail and "provider does not say it is gone" in detail
    kill_the_box(bw, p["watch"], tmp_path)

    r = bw("down", NAME, "--confirm", NAME, "--json")  # a cut link looks the same: refused
    assert r.returncode == 3 and "SIDECAR_UNREACHABLE" in codes(r), r.stderr
    r = bw("down", NAME, "--dry-run", "--box-gone", "--json")  # a tree pulled from the box is not it
    assert r.returncode == 3 and "NOT_PULLED" in codes(r), r.stderr

    pulled = bw.cwd / "from-durable"
    doc = bw.json("pull", NAME, "--from", "durable", "--to", str(pulled))
    assert doc["source"] == "durable" and sorted(doc["fetched"]) == sorted(files)
    assert "last claims list received from gone1 at" in doc["source_detail"]
    for path, data in files.items():
        assert (pulled / path).read_bytes() == data
    assert not any(n.startswith(".boxwarden") for n in os.listdir(pulled))  # nothing of the store's own
    bw.ok("verify", str(pulled))
    r = bw("down", NAME, "--confirm", NAME, "--json")  # without --box-gone: still refused
    assert r.returncode == 3 and "SIDECAR_UNREACHABLE" in codes(r)

    doc = bw.json("down", NAME, "--dry-run", "--box-gone")
    assert doc["allowed"] is True and doc["reasons"] == []
    assert doc["box_gone"]["judged"].startswith("durable bytes from the last claims list received at")
    assert doc["box_gone"]["absence"].startswith("the provider says it is gone")
    assert doc["box_gone"]["durable_pull"] == str(pulled)
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["pulled from durable storage"]["ok"] and "box gone (--box-gone)" in checks

    # A copy changed after the pull: `down` reads every copy back before the meter stop.
    copy = p["durable"] / "cell-b" / "best.safetensors"
    good = copy.read_bytes()
    copy.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    r = bw("down", NAME, "--confirm", NAME, "--box-gone", "--json")
    assert r.returncode == 3 and "NOT_DURABLE" in r.stderr and "cell-b/best.safetensors" in r.stderr
    assert box_status(bw) == "up"  # nothing done, the meter untouched
    (refused,) = audit(bw)
    assert [x["code"] for x in refused["reasons"]] == ["NOT_DURABLE"]
    copy.write_bytes(good)

    doc = bw.json("down", NAME, "--confirm", NAME, "--box-gone")
    assert doc["allowed"] is True and doc["teardown"]["gone"] is True
    assert doc["teardown"]["judged"] == doc["box_gone"]["judged"]
    assert box_status(bw) == "down"
    record = audit(bw)[-1]
    assert record["gate"].startswith("durable bytes from the last claims list received at")
    assert record["box_gone"]["durable_pull"] == str(pulled)
    assert record["evidence_digest"] == doc["evidence_digest"]


def test_a_copy_missing_from_durable_storage_is_named_and_the_gone_box_stays_refused(
    bw: Bw, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    p = up_at_provider(bw, tmp_path, "--durable", store.as_uri())
    files = two_cells(p["watch"])
    bw.wait_durable(NAME, len(files))  # `artifacts` kept the list: no pull from the box needed
    kill_the_box(bw, p["watch"], tmp_path)
    (p["durable"] / "cell-a" / "best.safetensors").unlink()
    pulled = bw.cwd / "from-durable"
    r = bw("pull", NAME, "--from", "durable", "--to", str(pulled))
    assert r.returncode == 1 and "cell-a/best.safetensors" in r.stderr and "no durable copy" in r.stderr
    assert (pulled / "cell-b" / "best.safetensors").read_bytes() == files["cell-b/best.safetensors"]
    assert not (pulled / "MANIFEST.json").exists()  # the tree does not say it is whole
    assert bw("verify", str(pulled)).returncode != 0
    r = bw("down", NAME, "--confirm", NAME, "--box-gone", "--json")
    assert r.returncode == 3 and "NOT_PULLED" in codes(r)
    assert box_status(bw) == "up"


def test_box_gone_is_refused_while_the_sidecar_answers(bw: Bw, tmp_path: Path) -> None:
    p = bw.up(NAME, "--durable", (tmp_path / "store").as_uri())
    two_cells(p["watch"])
    bw.wait_durable(NAME, 3)
    r = bw("down", NAME, "--dry-run", "--box-gone", "--json")
    assert r.returncode == 3 and "BOX_ANSWERS" in codes(r)
    r = bw("down", NAME, "--dry-run", "--accept-server-checksum", "--json")
    doc = json.loads(r.stdout)
    assert doc["accepted_server_checksum"] is True and doc["proofs"] == {"reread": 3}
    creds = write_credentials(tmp_path / "creds")
    r = bw("pull", NAME, "--durable-credentials", str(creds))
    assert r.returncode == 2 and "--from durable" in r.stderr
    r = bw("down", NAME, "--dry-run", "--durable-credentials", str(creds))
    assert r.returncode == 2 and "--box-gone" in r.stderr
    creds.chmod(0o644)
    r = bw("pull", NAME, "--from", "durable", "--durable-credentials", str(creds))
    assert r.returncode == 2 and "chmod 600" in r.stderr


def test_a_gone_box_with_a_bucket_is_pulled_from_s3(bw: Bw, s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.bucket()
    creds = write_credentials(tmp_path / "creds")
    watch = bw.cwd / "ckpt"
    bw.ok("up", NAME, *at_provider(bw, tmp_path), "--workdir", str(bw.cwd), "--watch", "ckpt", "--durable",
          s3.url(bucket, "runs"), "--durable-credentials", str(creds))  # fmt: skip
    files = two_cells(watch)
    claims = {c["path"]: c for c in bw.wait_durable(NAME, len(files))["claims"]}
    kill_the_box(bw, watch, tmp_path)
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"runs/{NAME}/")["Contents"]
    (run,) = {o["Key"].split("/")[2] for o in listed}
    # One copy overwritten in the bucket: it is never placed, and the pull says so.
    key = f"runs/{NAME}/{run}/cell-b/best.safetensors"
    s3.client().put_object(Bucket=bucket, Key=key, Body=b"not the checkpoint")
    pulled = bw.cwd / "from-bucket"
    args = ("pull", NAME, "--from", "durable", "--to", str(pulled), "--durable-credentials", str(creds))
    r = bw(*args)
    assert r.returncode == 1 and "cell-b/best.safetensors" in r.stderr and "never placed" in r.stderr
    assert not (pulled / "cell-b" / "best.safetensors").exists()
    s3.client().put_object(Bucket=bucket, Key=key, Body=files["cell-b/best.safetensors"])
    doc = bw.json(*args)
    assert sorted(doc["fetched"]) == ["cell-b/best.safetensors"]
    assert sorted(doc["skipped"]) == sorted(set(files) - {"cell-b/best.safetensors"})
    for path, data in files.items():
        assert blake3.blake3((pulled / path).read_bytes()).hexdigest() == claims[path]["blake3"]
        assert (pulled / path).read_bytes() == data
    bw.ok("verify", str(pulled))
    r = bw("down", NAME, "--confirm", NAME, "--box-gone", "--json", "--durable-credentials", str(creds))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["teardown"]["gone"] is True


def test_a_remote_box_whose_host_answers_is_not_gone_until_no_link_reaches_it(
    remote: Remote,  # noqa: F811
) -> None:
    """Finding 3 of issue 25: `down --box-gone` passed while the box answered over SSH, its
    entries not covered by a claim were shown `ok`, and its ControlMaster stayed up."""
    bw = remote.bw
    box = remote.boxes("g1")
    remote.provider("create", "i-g1", "--linger", "1")
    first = remote.up(box, seeded=True)
    write_as_box(box, "ckpt/a.bin", "weights")
    assert box.run_as_box(["ln", "-s", "/etc/hostname", str(box.home / "ckpt" / "link")]).returncode == 0
    bw.wait_durable("g1", 1, pending_ok=True)  # the list kept holds the link, which no claim covers
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), what="g1's sidecar gone")
    pulled = bw.cwd / "from-durable"
    bw.ok("pull", "g1", "--from", "durable", "--to", str(pulled))
    bw.ok("verify", str(pulled))

    r = bw("down", "g1", "--confirm", "g1", "--box-gone", "--json", timeout=120)
    assert r.returncode == 3 and "SIDECAR_DEAD_HOST_UP" in codes(r), r.stdout
    assert "g1 answers over SSH" in r.stdout and "boxwarden up g1" in r.stdout
    for cm in _control_paths(bw):  # the `down` left no login to the box behind
        assert not cm.exists(), cm
    assert box_status(bw, "g1") == "up"  # nothing done, the meter untouched

    # The box vanishes: nothing answers at its address any more.
    closed = free_port()
    text = box.config.read_text()
    block = text.index("Host g1\n")
    box.config.write_text(text[:block] + text[block:].replace(f"Port {box.port}\n", f"Port {closed}\n", 1))
    r = bw("down", "g1", "--dry-run", "--box-gone", "--json", timeout=120)
    assert r.returncode == 3 and codes(r) == {"LOST_WITH_BOX"}, r.stdout
    doc = json.loads(r.stdout)
    assert [x["path"] for x in doc["reasons"]] == ["link"]
    assert not {c["check"]: c for c in doc["checks"]}["the box's live state"]["ok"]  # never shown ok
    doc = bw.json("down", "g1", "--confirm", "g1", "--box-gone", "--accept-lost")
    assert doc["allowed"] is True and doc["teardown"]["gone"] is True
    assert doc["box_gone"]["absence"].startswith("no link reaches g1")
    assert box_status(bw, "g1") == "down"
