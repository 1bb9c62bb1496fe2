"""A box that is gone (issue 8, item 7): the real CLI against a real sidecar that is then killed by
its PID, its watched dir deleted. `pull --from durable` reads the durable copies of the last claims
list the controller kept (a directory, and moto's real S3 server), `verify` treats the tree as any
pulled one, and `down --box-gone` closes the box only on that evidence, complete."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3

from tests.conftest import Bw, pid_alive, save_weights, wait_until
from tests.controller.test_meter_stop import FAKE, audit, fake_profile, provider
from tests.s3server import S3Server, write_credentials
from tests.sshbox import Box, free_port
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
    assert r.returncode == 3 and "GONE_UNPROVEN" in codes(r), r.stdout
    detail = next(x["detail"] for x in json.loads(r.stdout)["reasons"] if x["code"] == "GONE_UNPROVEN")
    assert f"the provider's poll does not say i-{NAME} is gone" in detail and f"boxwarden up {NAME}" in detail
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


def no_meter(remote: Remote) -> Path:  # noqa: F811
    """The remote profile with a meter stopped by hand (as generic-ssh's): no provider to ask
    whether the box is gone, only its host."""
    p = remote.profile.with_name("nometer.toml")
    text = remote.profile.read_text().replace('name = "fakecloud"', 'name = "nometer"')
    head, rest = text.split("[meter_stop]", 1)
    tail = rest[rest.index("[detach]") :]
    manual = (
        '[meter_stop]\nverb = "release"\nirreversible = true\nmode = "manual"\nmanual = "Release it."\n\n'
    )
    p.write_text(head + manual + tail)
    return p


def point_at(box: Box, port: int) -> None:
    """The box's Host entry leads to `port` on its address from now on."""
    text = box.config.read_text()
    at = text.index(f"Host {box.alias}\n")
    now = re.search(r"Port (\d+)\n", text[at:])
    assert now is not None
    box.config.write_text(text[:at] + text[at:].replace(now.group(0), f"Port {port}\n", 1))


@contextlib.contextmanager
def dropping_sshd() -> Iterator[int]:
    """A port whose server accepts a connection and closes it at once, before any SSH banner: an sshd
    with too many logins starting (MaxStartups), or one going down. Something answers there."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = srv.accept()
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()


def test_a_remote_box_whose_host_answers_is_not_gone_until_no_link_reaches_it(
    remote: Remote,  # noqa: F811
) -> None:
    """Finding 3 of issue 25: `down --box-gone` passed while the box answered over SSH, its
    entries not covered by a claim were shown `ok`, and its ControlMaster stayed up. The review
    after it: an sshd that dropped the connection before the login was taken for no host at all."""
    bw = remote.bw
    box = remote.boxes("g1")
    remote.profile = no_meter(remote)
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
    assert "something answers at g1 over SSH (a login ran)" in r.stdout and "boxwarden up g1" in r.stdout
    for cm in _control_paths(bw):  # the `down` left no login to the box behind
        assert not cm.exists(), cm
    assert box_status(bw, "g1") == "up"  # nothing done, the meter untouched

    with dropping_sshd() as port:  # an sshd that drops every connection: the host is there
        point_at(box, port)
        r = bw("down", "g1", "--dry-run", "--box-gone", "--json", timeout=120)
        assert r.returncode == 3 and "SIDECAR_DEAD_HOST_UP" in codes(r), r.stdout
    point_at(box, free_port())  # the box vanishes: nothing answers at its address any more
    # Network evidence alone: a live box whose sshd stopped, or a firewall, looks the same from here
    # (sixth review). Only the user, in the provider's console, can tell.
    r = bw("down", "g1", "--confirm", "g1", "--box-gone", "--accept-lost", "--json", timeout=120)
    assert r.returncode == 3 and codes(r) == {"GONE_UNPROVEN"}, r.stdout
    assert "no link from here reaches g1" in r.stdout and "--console-shows-gone" in r.stdout
    assert "Release it." not in r.stderr and box_status(bw, "g1") == "up"  # nothing done
    gone = ("--box-gone", "--console-shows-gone")
    r = bw("down", "g1", "--dry-run", *gone, "--json", timeout=120)
    assert r.returncode == 3 and codes(r) == {"LOST_WITH_BOX"}, r.stdout
    doc = json.loads(r.stdout)
    assert [x["path"] for x in doc["reasons"]] == ["link"]
    assert not {c["check"]: c for c in doc["checks"]}["the box's live state"]["ok"]  # never shown ok
    assert doc["box_gone"]["absence"].startswith("no link from here reaches g1")
    assert "you say nometer's console shows it gone" in doc["box_gone"]["absence"]
    r = bw("down", "g1", "--confirm", "g1", *gone, "--accept-lost", "--json", timeout=120)
    assert r.returncode == 1 and "Release it." in r.stderr, r.stderr  # the steps, then your word
    doc = bw.json("down", "g1", "--confirm", "g1", "--meter-stopped")
    assert doc["teardown"]["gone"] is True
    assert box_status(bw, "g1") == "down"


def test_a_box_its_provider_still_lists_is_not_gone_however_out_of_reach(
    remote: Remote,  # noqa: F811
) -> None:
    """Review of issue 25: a host out of reach while the provider still lists the instance is a cut
    link or a stopped box, not a gone one: the provider's word decides."""
    bw = remote.bw
    box = remote.boxes("g2")
    remote.provider("create", "i-g2")
    first = remote.up(box, seeded=True)
    bw.artifacts("g2")  # the claims list kept (empty)
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), what="g2's sidecar gone")
    point_at(box, free_port())
    # (the user's word from the console does not outweigh the provider's poll)
    r = bw("down", "g2", "--dry-run", "--box-gone", "--console-shows-gone", "--json", timeout=120)
    assert r.returncode == 3 and "GONE_UNPROVEN" in codes(r), r.stdout
    assert "the provider's poll does not say i-g2 is gone" in r.stdout
    remote.provider("vanish", "i-g2")
    r = bw("down", "g2", "--dry-run", "--box-gone", "--json", timeout=120)
    assert not {"GONE_UNPROVEN", "SIDECAR_DEAD_HOST_UP"} & codes(r), r.stdout
    assert json.loads(r.stdout)["box_gone"]["absence"].startswith("the provider says it is gone")


@contextlib.contextmanager
def silent_sshd() -> Iterator[int]:
    """A port whose server accepts connections and never says a word (an sshd that cannot fork, a
    box thrashing): something is there."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def test_what_only_seems_out_of_reach_proves_no_box_gone(remote: Remote) -> None:  # noqa: F811
    """Second review of issue 25: an sshd that never sent its banner, and a jump host out of reach
    (the box itself answering), were taken for a box no link reaches."""
    bw = remote.bw
    box = remote.boxes("g3")
    remote.profile = no_meter(remote)
    first = remote.up(box, "--ssh-option", "ConnectTimeout=3", seeded=True)
    bw.artifacts("g3")  # the claims list kept
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), what="g3's sidecar gone")
    with silent_sshd() as port:
        point_at(box, port)
        r = bw("down", "g3", "--dry-run", "--box-gone", "--json", timeout=120)
    assert r.returncode == 3 and "SIDECAR_DEAD_HOST_UP" in codes(r), r.stdout
    assert "banner" in r.stdout
    point_at(box, free_port())
    text = box.config.read_text()
    at = text.index("Host g3\n") + len("Host g3\n")
    box.config.write_text(text[:at] + "    ProxyJump nowhere.invalid\n" + text[at:])
    r = bw("down", "g3", "--dry-run", "--box-gone", "--console-shows-gone", "--json", timeout=120)
    assert r.returncode == 3 and "SIDECAR_DEAD_HOST_UP" in codes(r), r.stdout
    assert "reached through nowhere.invalid" in r.stdout
    # Third review: this machine's own network down (no route out; a resolver that does not answer)
    # was taken for a box no link reaches.
    box.config.write_text(text.replace("Host g3\n", "Host g3\n    HostName g3box.invalid\n", 1))
    resolv = bw.cwd / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\n")  # nothing answers there: "Temporary failure"
    # Fifth review: that was then called "sidecar dead, host up": this machine cannot tell, and says so.
    down = ["down", "g3", "--dry-run", "--box-gone", "--console-shows-gone", "--json"]
    cli = shlex.join([sys.executable, "-m", "controller", *down])
    for how in (["-m", f"mount --bind {resolv} /etc/resolv.conf && exec {cli}"], ["-n", f"exec {cli}"]):
        if how[0] == "-n":
            box.config.write_text(text)  # its address again, from a machine with no network at all
        r = subprocess.run(["unshare", how[0], "sh", "-c", how[1]], env=bw.env, cwd=bw.cwd,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 3 and "GONE_UNPROVEN" in codes(r), (how, r.stdout, r.stderr)
        assert "this machine cannot tell whether" in r.stdout and "check this machine's network" in r.stdout
        assert "host up" not in r.stdout and "something answers" not in r.stdout


def test_a_provider_that_cannot_be_asked_proves_nothing(remote: Remote) -> None:  # noqa: F811
    """Second review of issue 25: a poll that could not run was taken for a profile with no
    provider to ask, and the host out of reach (maybe this machine's own network) decided."""
    bw = remote.bw
    text = remote.profile.read_text()
    poll = text.index("argv = [", text.index("[meter_stop.poll]"))
    end = text.index("]\n", poll) + 2
    cli = remote.tmp / "provider-cli"  # the provider's CLI, there at `up`, gone at `down`
    cli.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    cli.chmod(0o755)
    remote.profile.write_text(text[:poll] + f'argv = ["{cli}", "show", "{{instance_id}}"]\n' + text[end:])
    box = remote.boxes("g4")
    first = remote.up(box, seeded=True)
    cli.unlink()
    bw.artifacts("g4")
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), what="g4's sidecar gone")
    point_at(box, free_port())
    r = bw("down", "g4", "--dry-run", "--box-gone", "--console-shows-gone", "--json", timeout=120)
    assert r.returncode == 3 and "GONE_UNPROVEN" in codes(r), r.stdout
    assert "the provider could not be asked" in r.stdout
