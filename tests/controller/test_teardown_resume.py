"""A teardown that did not finish (its meter stop timed out, or `down` was killed mid-way) is
continued by the next `down` without ever re-sending an irreversible stop blindly: every step is
recorded before it is taken, `status` shows where it stopped, and with the sidecar stopped the retry
polls first, records "gone" only when the poll shows it, and otherwise refuses (exit 3) unless the
user says `--resend-stop`. After `up` again the retry is a normal `down`, through the whole gate."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.state import State
from tests.conftest import Bw, pid_alive, save_weights, wait_until
from tests.s3server import S3Server, write_credentials

NAME = "fk1"
INSTANCE = "i-1"

# A fake provider's stop command: it logs each call, "destroys" the instance at once when the test
# has put `complete` in place, and hangs (bounded) while `hang` is there, as a slow provider CLI does.
STOPPER = """
import os, sys, time
from pathlib import Path
d, ident = Path(sys.argv[1]), sys.argv[2]
with open(d / "stop-calls", "a") as f:
    f.write(ident + "\\n")
(d / "stopper.pid.tmp").write_text(str(os.getpid()))
os.replace(d / "stopper.pid.tmp", d / "stopper.pid")
if (d / "complete").exists():
    (d / ("gone-" + ident)).touch()
deadline = time.monotonic() + 120
while (d / "hang").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
print("stop requested for " + ident)
"""


def provider_dir(tmp_path: Path) -> Path:
    d = tmp_path / "provider"
    d.mkdir(exist_ok=True)
    return d


def profile(tmp_path: Path) -> Path:
    prov = provider_dir(tmp_path)
    stopper = tmp_path / "stopper.py"
    stopper.write_text(STOPPER)
    stop = [sys.executable, str(stopper), str(prov), "{instance_id}"]
    poll = ["test", "-e", f"{prov}/gone-{{instance_id}}"]
    p = tmp_path / "slowcloud.toml"
    p.write_text(
        f"""
name = "slowcloud"
kind = "local"
description = "A fake provider whose destroy is slow to show."
verified = "2026-11-30"
danger_clocks = []

[meter_stop]
verb = "destroy"
irreversible = true
mode = "argv"
argv = {json.dumps(stop)}
timeout_s = 1

[meter_stop.poll]
argv = {json.dumps(poll)}
gone_exit_code = 0
interval_s = 0.05

[detach]
primitive = "setsid"

[spot]
available = false
grace_s = 0
signal = ""

[[storage]]
name = "home"
path = "~"
survives_stop = true
survives_destroy = true
durable_default = true
"""
    )
    return p


def stop_calls(tmp_path: Path) -> int:
    f = provider_dir(tmp_path) / "stop-calls"
    return len(f.read_text().splitlines()) if f.exists() else 0


def audit(bw: Bw) -> list[dict[str, Any]]:
    db = sqlite3.connect(bw.home / "state.db")
    try:
        return [json.loads(r[0]) for r in db.execute("SELECT record FROM teardowns ORDER BY id")]
    finally:
        db.close()


def box_row(bw: Bw) -> dict[str, Any]:
    (row,) = bw.json("status")["boxes"]
    return dict(row)


def up_pulled_verified(bw: Bw, tmp_path: Path) -> dict[str, Path]:
    p = bw.up(NAME, "--profile-file", str(profile(tmp_path)), "--instance-id", INSTANCE)
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=1)
    bw.wait_durable(NAME, 1)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    p["pulled"] = pulled
    return p


def unproven(bw: Bw, tmp_path: Path) -> dict[str, Path]:
    """A box whose first `down` sent the stop, stopped the sidecar, and timed out polling."""
    p = up_pulled_verified(bw, tmp_path)
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 1 and "meter may still be running" in r.stderr, r.stderr
    assert stop_calls(tmp_path) == 1
    assert box_row(bw)["status"] == "meter-unproven"
    return p


def test_a_retry_of_an_unproven_stop_polls_and_refuses_instead_of_resending(bw: Bw, tmp_path: Path) -> None:
    p = unproven(bw, tmp_path)
    # The box is still alive and a trainer writes more; a second stop would now destroy it for good.
    new = p["watch"] / "cell-a" / "late.safetensors"
    save_weights(new, seed=2)
    (provider_dir(tmp_path) / "complete").touch()
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 3, r.stderr
    said = " ".join(r.stderr.split())
    assert "was sent at" in said and "never proven" in said
    assert f"boxwarden up {NAME}" in said and "--resend-stop" in said
    assert "TEARDOWN_UNFINISHED" in said
    assert stop_calls(tmp_path) == 1  # nothing sent again
    assert new.exists()
    assert box_row(bw)["status"] == "meter-unproven"
    assert audit(bw)[-1]["reasons"][0]["code"] == "TEARDOWN_UNFINISHED"
    # The way out the message names: restart the sidecar, and the retry is a normal `down`.
    again = ("--workdir", str(bw.cwd), "--watch", "ckpt", "--instance-id", INSTANCE)
    bw.ok("up", NAME, "--profile-file", str(profile(tmp_path)), *again)  # a new run of the box
    row = box_row(bw)
    assert row["status"] == "up" and "meter stop sent" in row["teardown"]["summary"]
    bw.wait_durable(NAME, 1)  # the new run claims what is on the box now: late.safetensors
    refused = bw.json("down", NAME, "--confirm", NAME, code=3)
    assert refused["allowed"] is False  # the gate runs: the verified tree is not this run's
    assert stop_calls(tmp_path) == 1
    bw.ok("pull", NAME, "--to", str(bw.cwd / "pulled2"))
    bw.ok("verify", str(bw.cwd / "pulled2"))
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["teardown"]["gone"] is True
    assert (bw.cwd / "pulled2" / "cell-a" / "late.safetensors").read_bytes()
    assert box_row(bw)["status"] == "down" and "teardown" not in box_row(bw)


def test_resend_stop_sends_again_without_a_gate_and_the_audit_says_so(bw: Bw, tmp_path: Path) -> None:
    up_pulled_verified(bw, tmp_path)
    r = bw("down", NAME, "--confirm", NAME, "--resend-stop")  # nothing unfinished: not for this box
    assert r.returncode == 2 and "--resend-stop" in r.stderr
    assert stop_calls(tmp_path) == 0
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 1
    (provider_dir(tmp_path) / "complete").touch()
    doc = bw.json("down", NAME, "--confirm", NAME, "--resend-stop")
    meter = doc["teardown"]["meter"]
    assert doc["teardown"]["gone"] is True and meter["sent"] is True
    assert meter["polls"] >= 2  # polled first, then after the stop
    assert stop_calls(tmp_path) == 2
    record = audit(bw)[-1]
    assert record["resend_stop"] is True and record["gate"].startswith("not run")
    assert any("WITHOUT a gate" in a for a in record["actions"])
    assert record["continues"]["steps"]["meter_stop"]["at"]
    assert box_row(bw)["status"] == "down"


def test_down_killed_during_the_meter_stop_is_shown_and_continued_by_polling(bw: Bw, tmp_path: Path) -> None:
    p = up_pulled_verified(bw, tmp_path)
    prov = provider_dir(tmp_path)
    (prov / "hang").touch()
    proc = bw.spawn("down", NAME, "--confirm", NAME)
    stopper = 0
    try:
        wait_until(lambda: (prov / "stopper.pid").exists(), timeout=60, what="the stop command to run")
        stopper = int((prov / "stopper.pid").read_text())
        proc.kill()  # kill -9 while the provider's stop command runs
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if stopper:
            (prov / "hang").unlink()
            wait_until(lambda: not pid_alive(stopper), timeout=30, what="the stop command to end")
    assert not (p["watch"] / "cell-a" / "best.safetensors").exists()  # released before the stop was sent
    row = box_row(bw)
    assert row["status"] == "tearing-down"
    assert "meter stop sent" in row["teardown"]["summary"] and "not proven" in row["teardown"]["summary"]
    assert set(row["teardown"]["steps"]) == {"release", "shutdown", "sidecar_gone", "meter_stop"}
    dry = bw.json("down", NAME, "--dry-run", code=3)
    assert dry["allowed"] is False and [r["code"] for r in dry["reasons"]] == ["TEARDOWN_UNFINISHED"]
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 3, r.stderr
    assert "SIDECAR_UNREACHABLE" not in r.stderr and "was sent at" in " ".join(r.stderr.split())
    assert stop_calls(tmp_path) == 1
    (prov / f"gone-{INSTANCE}").touch()  # the provider finished on its own
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["teardown"]["gone"] is True and doc["teardown"]["meter"]["sent"] is False
    assert stop_calls(tmp_path) == 1
    assert box_row(bw)["status"] == "down"


def test_a_box_whose_meter_stop_is_unproven_keeps_its_instance(bw: Bw, tmp_path: Path) -> None:
    """Review of issue 25: `up` of a meter-unproven box took another --instance-id, and the next
    `down` settled the meter stop of that one: the first instance's was forgotten, still running."""
    unproven(bw, tmp_path)
    again = ("--workdir", str(bw.cwd), "--watch", "ckpt")
    r = bw("up", NAME, "--profile-file", str(profile(tmp_path)), *again, "--instance-id", "i-2")
    assert (
        r.returncode == 2 and f"meter-unproven (its meter stop not proven) as instance {INSTANCE}" in r.stderr
    )
    assert box_row(bw)["status"] == "meter-unproven"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_down_stopped_by_a_signal_during_the_meter_stop_keeps_its_audit_record(
    bw: Bw, tmp_path: Path, sig: signal.Signals
) -> None:
    """Review of issue 25: a `down` ended by SIGTERM (a CI's timeout) or SIGHUP (its terminal closed)
    during its meter stop wrote no audit record of the teardown that had sent the stop."""
    up_pulled_verified(bw, tmp_path)
    prov = provider_dir(tmp_path)
    (prov / "hang").touch()
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller", "down", NAME, "--confirm", NAME],
        cwd=bw.cwd, env=bw.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_until(lambda: (prov / "stopper.pid").exists(), timeout=60, what="the stop command to run")
        stopper = int((prov / "stopper.pid").read_text())
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        (prov / "hang").unlink()
    wait_until(lambda: not pid_alive(stopper), timeout=30, what="the stop command to end")
    assert proc.returncode != 0 and b"interrupted" in err
    (record,) = audit(bw)
    assert (
        record["error"].startswith(("CancelledError", "KeyboardInterrupt"))
        and record["result"]["meter"] is None
    )
    assert box_row(bw)["status"] in ("tearing-down", "meter-unproven")


def test_a_state_db_from_before_step_records_is_migrated(bw: Bw, tmp_path: Path) -> None:
    unproven(bw, tmp_path)
    db = sqlite3.connect(bw.home / "state.db")
    db.execute("DROP TABLE IF EXISTS teardown_steps")  # the schema of a version that kept no steps
    db.commit()
    db.close()
    row = box_row(bw)  # opening the state adds the table again
    assert row["status"] == "meter-unproven" and "meter stop sent" in row["teardown"]["summary"]
    (provider_dir(tmp_path) / "complete").touch()
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 3 and stop_calls(tmp_path) == 1
    (provider_dir(tmp_path) / f"gone-{INSTANCE}").touch()
    assert bw.json("down", NAME, "--confirm", NAME)["teardown"]["gone"] is True
    assert stop_calls(tmp_path) == 1


def test_down_all_never_leaves_out_a_box_whose_teardown_is_unfinished(bw: Bw, tmp_path: Path) -> None:
    """`down --all` took only the boxes that are up: a box whose meter stop was never proven (its
    meter may still run) was left out, and with no other box it said "nothing to tear down", exit 0."""
    unproven(bw, tmp_path)
    for args in (("--dry-run",), ()):
        doc = bw.json("down", "--all", *args, code=3)
        (row,) = doc["boxes"]
        assert row["box"] == NAME and row["outcome"] == "refused", row
        (reason,) = row["reasons"]
        assert reason["code"] == "TEARDOWN_UNFINISHED"
        said = " ".join(reason["detail"].split())
        assert "was sent at" in said and "never proven" in said
        assert f"boxwarden down {NAME} --confirm {NAME}` asks the provider first" in said
        assert doc["passing"] == 0
    r = bw("down", "--all")
    assert r.returncode == 3 and f"REFUSED {NAME}: TEARDOWN_UNFINISHED" in r.stderr, r.stderr
    assert stop_calls(tmp_path) == 1  # nothing sent again
    assert box_row(bw)["status"] == "meter-unproven"
    (provider_dir(tmp_path) / f"gone-{INSTANCE}").touch()  # the provider finished on its own
    assert bw.json("down", NAME, "--confirm", NAME)["teardown"]["gone"] is True  # as the line said
    r = bw("down", "--all")
    assert r.returncode == 0 and "nothing to tear down" in r.stderr, r.stderr


def test_watch_shows_a_box_whose_teardown_is_unfinished(bw: Bw, tmp_path: Path) -> None:
    """Its meter may still run: `watch` (every box not down) must not drop it as it drops a box down."""
    unproven(bw, tmp_path)
    r = bw("watch", "--once")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert NAME in out and "meter-unproven" in out, out


def test_a_continued_teardown_takes_the_stores_credentials_off_the_box(
    bw: Bw, s3: S3Server, tmp_path: Path
) -> None:
    """Issue 25: credentials leave the box on every teardown path, a continued one too (the first
    `down` was killed after the sidecar stopped, before it took them away)."""
    creds = write_credentials(tmp_path / "creds")
    url = s3.url(s3.bucket(), "runs")
    bw.ok("up", NAME, "--profile-file", str(profile(tmp_path)), "--instance-id", INSTANCE, "--workdir",
          str(bw.cwd), "--watch", "ckpt", "--durable", url, "--durable-credentials", str(creds))  # fmt: skip
    save_weights(bw.cwd / "ckpt" / "cell-a" / "best.safetensors", seed=1)
    bw.wait_durable(NAME, 1)
    bw.ok("pull", NAME, "--to", str(bw.cwd / "pulled"))
    bw.ok("verify", str(bw.cwd / "pulled"))
    on_box = bw.home / "boxes" / NAME / "sidecar" / "durable-credentials"
    kept = on_box.read_bytes()
    prov = provider_dir(tmp_path)
    (prov / "hang").touch()
    proc = bw.spawn("down", NAME, "--confirm", NAME)
    try:
        wait_until(lambda: (prov / "stopper.pid").exists(), timeout=60, what="the stop command to run")
        stopper = int((prov / "stopper.pid").read_text())
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (prov / "hang").unlink()
    wait_until(lambda: not pid_alive(stopper), timeout=30, what="the stop command to end")
    # As a `down` killed between the sidecar's stop and the credentials' removal leaves the box.
    on_box.write_bytes(kept)
    on_box.chmod(0o600)
    (prov / f"gone-{INSTANCE}").touch()
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["teardown"]["gone"] is True
    assert not on_box.exists()
    assert audit(bw)[-1]["credentials"] == "removed from the box (and its run closed)"


def test_the_meter_waits_for_every_box_whose_sidecar_may_still_run_on_the_instance(
    bw: Bw, tmp_path: Path
) -> None:
    """Second review of issue 25: a box whose `down` was interrupted (its sidecar still up) did not
    count as sharing the instance, nor did one brought up with a copy of the profile file: the
    first box's `down` sent the instance's meter stop under them. (Third review: nor a copy that
    differs in a comment: the instance id alone says whose meter it is.)"""
    copy = tmp_path / "copies" / "slowcloud.toml"
    copy.parent.mkdir()
    copy.write_text("# my own copy\n" + profile(tmp_path).read_text())  # a copy, not the same text
    for name, prof in (("ba", profile(tmp_path)), ("bb", profile(tmp_path)), ("bc", copy)):
        bw.ok("up", name, "--profile-file", str(prof), "--instance-id", INSTANCE, "--workdir", str(bw.cwd),
              "--watch", f"ckpt-{name}")  # fmt: skip
    state = State(bw.home)
    try:  # bb's `down` stopped after it asked its release: its sidecar still runs there
        state.step(state.get("bb").with_(status="tearing-down"), "release", "no answer yet")
    finally:
        state.close()
    (bw.cwd / "ckpt-ba" / "w.bin").write_bytes(b"weights")
    bw.wait_durable("ba", 1)
    bw.ok("pull", "ba", "--to", str(bw.cwd / "pulled-ba"))
    bw.ok("verify", str(bw.cwd / "pulled-ba"))
    r = bw("down", "ba", "--confirm", "ba", "--json")
    assert r.returncode == 3 and "METER_HELD" in r.stderr and "(bb; bc)" in r.stderr, r.stderr
    assert stop_calls(tmp_path) == 0
