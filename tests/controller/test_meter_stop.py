"""The meter stop against a fake provider that, like real ones, says "deleted" before the instance is
gone: `down` runs the verb only after the gate passed, reports "gone" only after a poll proved it,
fails on a timeout, and the audit log holds every teardown."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Bw, save_weights

FAKE = REPO / "tests" / "fake_provider.py"


def fake_profile(tmp_path: Path, *, timeout_s: int = 30, watch_tier_path: str = "/nowhere") -> Path:
    """A profile of kind local whose meter stop drives the fake provider (argv only, no shell)."""
    p = tmp_path / "fakecloud.toml"
    p.write_text(
        f"""
name = "fakecloud"
kind = "local"
description = "A fake provider for tests."
verified = "2026-11-30"

[meter_stop]
verb = "destroy"
irreversible = true
mode = "argv"
argv = [{json.dumps(sys.executable)}, {json.dumps(str(FAKE))}, "delete", "{{instance_id}}"]
timeout_s = {timeout_s}

[meter_stop.poll]
argv = [{json.dumps(sys.executable)}, {json.dumps(str(FAKE))}, "show", "{{instance_id}}"]
gone_exit_code = 1
interval_s = 0.05

[detach]
primitive = "setsid"

[spot]
available = false
grace_s = 0
signal = ""

[[storage]]
name = "ephemeral"
path = {json.dumps(watch_tier_path)}
survives_stop = true
survives_destroy = false

[[danger_clocks]]
name = "auto-destroy"
after = "7 days idle"
effect = "the instance and its disks are destroyed"
"""
    )
    return p


def provider(bw: Bw, tmp_path: Path, *args: str) -> None:
    import subprocess

    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")
    subprocess.run([sys.executable, str(FAKE), *args], env=bw.env, check=True, capture_output=True)


def calls(tmp_path: Path) -> list[list[str]]:
    return list(json.loads((tmp_path / "provider.json").read_text())["calls"])


def audit(bw: Bw) -> list[dict[str, Any]]:
    db = sqlite3.connect(bw.home / "state.db")
    try:
        return [json.loads(r[0]) for r in db.execute("SELECT record FROM teardowns ORDER BY id")]
    finally:
        db.close()


def ready_box(bw: Bw, tmp_path: Path, profile: Path) -> dict[str, Path]:
    p = bw.up("fk1", "--profile-file", str(profile), "--instance-id", "i-123")
    save_weights(p["watch"] / "cell-a" / "best.safetensors", seed=1)
    bw.wait_durable("fk1", 1)
    return p


def test_down_refuses_before_the_gate_then_proves_gone_after(bw: Bw, tmp_path: Path) -> None:
    provider(bw, tmp_path, "create", "i-123", "--linger", "3")
    profile = fake_profile(tmp_path)
    ready_box(bw, tmp_path, profile)
    # Nothing pulled yet: refused, and the provider never heard a delete.
    r = bw("down", "fk1", "--confirm", "fk1", "--json")
    assert r.returncode == 3
    assert [c for c in calls(tmp_path) if c[0] == "delete"] == []
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "fk1", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    before = len(calls(tmp_path))  # (`up` asked once that the provider lists the instance)
    doc = bw.json("down", "fk1", "--confirm", "fk1")
    meter = doc["teardown"]["meter"]
    assert doc["teardown"]["gone"] is True and meter["gone"] is True
    # "deleted" was not taken as proof: it polled through "terminating" until the 404.
    shows = [c for c in calls(tmp_path)[before:] if c[0] == "show"]
    assert len(shows) - 1 == meter["polls"] >= 4  # (one more before anything was released: it lists it)
    assert calls(tmp_path).count(["delete", "i-123"]) == 1
    assert meter["command"][-2:] == ["delete", "i-123"]
    record = audit(bw)[-1]
    assert record["confirmed_by"] and record["evidence_digest"] and record["instance_id"] == "i-123"
    assert record["result"]["meter"]["gone"] is True
    assert record["result"]["meter"]["output"].strip() == "deleted i-123"
    assert bw.json("status")["boxes"][0]["status"] == "down"


def test_a_stuck_instance_times_out_non_zero_and_is_audited(bw: Bw, tmp_path: Path) -> None:
    provider(bw, tmp_path, "create", "i-123", "--stuck")
    ready_box(bw, tmp_path, fake_profile(tmp_path, timeout_s=1))
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "fk1", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    r = bw("down", "fk1", "--confirm", "fk1")
    assert r.returncode == 1
    assert "meter may still be running" in r.stderr and "console" in r.stderr
    record = audit(bw)[-1]
    assert record["result"]["meter"]["gone"] is False and "error" in record
    assert bw.json("status")["boxes"][0]["status"] == "meter-unproven"


def test_up_warns_when_checkpoints_land_on_a_tier_that_does_not_survive(bw: Bw, tmp_path: Path) -> None:
    profile = fake_profile(tmp_path, watch_tier_path=str(bw.cwd))  # this machine's dir, mapped as ephemeral
    provider(bw, tmp_path, "create", "i-1")
    r = bw(
        "up",
        "fk1",
        "--profile-file",
        str(profile),
        "--instance-id",
        "i-1",
        "--workdir",
        str(bw.cwd),
        "--watch",
        "ckpt",
    )
    assert r.returncode == 0, r.stderr
    assert "does NOT survive 'destroy'" in r.stderr
    assert "ephemeral" in r.stderr
    assert "auto-destroy" in r.stderr  # the danger clocks, shown the first time
    again = bw("up", "fk1", "--profile-file", str(profile), "--workdir", str(bw.cwd), "--watch", "ckpt")
    assert "auto-destroy" not in again.stderr  # ...and only once per box


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda t: t.replace('verb = "destroy"', 'verb = "destroy"\ncolour = "red"'), "meter_stop.colour"),
        (lambda t: t.replace("irreversible = true", 'irreversible = "yes"'), "meter_stop.irreversible"),
        (lambda t: t.replace('description = "A fake provider for tests."\n', ""), "description"),
        (
            lambda t: t.replace('"{instance_id}"]\ntimeout_s', '"{instance_id}", "{token}"]\ntimeout_s'),
            "meter_stop.argv",
        ),
    ],
)
def test_a_broken_profile_file_names_file_and_field(bw: Bw, tmp_path: Path, edit: Any, field: str) -> None:
    profile = fake_profile(tmp_path)
    profile.write_text(edit(profile.read_text()))
    r = bw("up", "fk1", "--profile-file", str(profile), "--watch", "ckpt")
    assert r.returncode == 2
    assert str(profile) in r.stderr and f"field {field}" in r.stderr
    assert not bw.sidecar_pids()


def test_a_manual_meter_stop_prints_the_steps_and_needs_the_users_word(bw: Bw, tmp_path: Path) -> None:
    profile = fake_profile(tmp_path)
    text = profile.read_text()
    start, end = text.index("[meter_stop]"), text.index("[detach]")
    profile.write_text(
        text[:start]
        + '[meter_stop]\nverb = "release"\nirreversible = true\nmode = "manual"\n'
        + 'manual = "Console → Instances → fk1 → Release"\n\n'
        + text[end:]
    )
    ready_box(bw, tmp_path, profile)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "fk1", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    r = bw("down", "fk1", "--confirm", "fk1")  # no terminal, no --meter-stopped: not confirmed
    assert r.returncode == 1
    assert "Console → Instances → fk1 → Release" in r.stderr
    assert "meter is NOT stopped" in r.stderr
    assert bw.json("status")["boxes"][0]["status"] == "meter-unproven"
    doc = bw.json("down", "fk1", "--confirm", "fk1", "--meter-stopped")
    assert doc["teardown"]["gone"] is True and doc["teardown"]["meter"]["manual_confirmed"] is True
    records = audit(bw)
    assert records[-2]["result"]["meter"]["manual_confirmed"] is False
    assert records[-1]["result"]["meter"]["manual_confirmed"] is True
    assert bw.json("status")["boxes"][0]["status"] == "down"


def pulled_and_verified(bw: Bw) -> None:
    pulled = bw.cwd / "pulled"
    bw.ok("pull", "fk1", "--to", str(pulled))
    bw.ok("verify", str(pulled))


def test_a_retry_polls_first_and_proves_gone_without_deleting_again(bw: Bw, tmp_path: Path) -> None:
    provider(bw, tmp_path, "create", "i-123", "--stuck")
    ready_box(bw, tmp_path, fake_profile(tmp_path, timeout_s=1))
    pulled_and_verified(bw)
    assert bw("down", "fk1", "--confirm", "fk1").returncode == 1  # still "terminating" at the timeout
    provider(bw, tmp_path, "vanish", "i-123")  # the provider finished later
    doc = bw.json("down", "fk1", "--confirm", "fk1")
    assert doc["teardown"]["gone"] is True
    assert calls(tmp_path).count(["delete", "i-123"]) == 1  # a retry re-queries, it does not re-delete
    assert bw.json("status")["boxes"][0]["status"] == "down"


def test_ctrl_c_while_polling_still_writes_the_audit_record(bw: Bw, tmp_path: Path) -> None:
    import signal

    from tests.conftest import wait_until

    provider(bw, tmp_path, "create", "i-123", "--stuck")
    ready_box(bw, tmp_path, fake_profile(tmp_path, timeout_s=600))
    pulled_and_verified(bw)
    proc = bw.spawn("down", "fk1", "--confirm", "fk1")
    try:
        shown = (
            calls(tmp_path).count(["show", "i-123"]) + 1
        )  # (`up` asked once; `down` once before the release)
        wait_until(
            lambda: calls(tmp_path).count(["show", "i-123"]) > shown, timeout=60, what="the first poll"
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    record = audit(bw)[-1]
    assert "KeyboardInterrupt" in record["error"] or "CancelledError" in record["error"]
    assert record["result"]["sidecar_gone"] is True
    assert bw.json("status")["boxes"][0]["status"] == "meter-unproven"


def test_manual_steps_are_printed_verbatim_and_the_flag_cannot_vouch_for_unseen_steps(
    bw: Bw, tmp_path: Path
) -> None:
    profile = fake_profile(tmp_path)
    text = profile.read_text()
    start, end = text.index("[meter_stop]"), text.index("[detach]")
    steps = "Console → [instances] → fk1 → Release [/x] (keep the [bold] tags as text)"
    profile.write_text(
        text[:start]
        + '[meter_stop]\nverb = "release"\nirreversible = true\nmode = "manual"\n'
        + f"manual = {json.dumps(steps)}\n\n"
        + text[end:]
    )
    ready_box(bw, tmp_path, profile)
    pulled_and_verified(bw)
    r = bw("down", "fk1", "--confirm", "fk1", "--meter-stopped")  # steps not seen yet: not confirmed
    assert r.returncode == 1
    assert steps in r.stderr.replace("\n", " ") or steps in r.stderr
    assert "Traceback" not in r.stderr
    assert bw.json("status")["boxes"][0]["status"] == "meter-unproven"
    assert bw.json("down", "fk1", "--confirm", "fk1", "--meter-stopped")["teardown"]["gone"] is True


def test_up_refuses_what_would_break_the_meter_stop_later(bw: Bw, tmp_path: Path) -> None:
    profile = fake_profile(tmp_path)
    provider(bw, tmp_path, "create", "i-123")
    r = bw("up", "fk1", "--profile-file", str(profile), "--watch", "ckpt")  # no --instance-id
    assert r.returncode == 2 and "--instance-id" in r.stderr
    bw.up("fk1", "--profile-file", str(profile), "--instance-id", "i-123")
    swap = bw("up", "fk1", "--profile", "local", "--watch", "ckpt")  # another profile on a running box
    assert swap.returncode == 2 and "down` it before" in swap.stderr
    other_id = bw("up", "fk1", "--profile-file", str(profile), "--instance-id", "i-999", "--watch", "ckpt")
    assert other_id.returncode == 2
    # A profile file edited after `up` is not what `down` may run.
    profile.write_text(profile.read_text().replace("timeout_s = 30", "timeout_s = 31"))
    r = bw("down", "fk1", "--dry-run")
    assert r.returncode == 2 and "changed since `up fk1`" in r.stderr


def test_durable_dir_on_a_tier_lost_at_the_meter_stop_refuses_up(bw: Bw, tmp_path: Path) -> None:
    doomed = tmp_path / "doomed"
    doomed.mkdir()  # the tier's volume is mounted (`up` never creates a durable dir's parent)
    profile = fake_profile(tmp_path, watch_tier_path=str(doomed))
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")
    r = bw(
        "up",
        "fk1",
        "--profile-file",
        str(profile),
        "--instance-id",
        "i-1",
        "--watch",
        "ckpt",
        "--durable",
        (doomed / "d").as_uri(),
    )
    assert r.returncode == 1
    assert "does NOT survive 'destroy'" in r.stderr
    assert not bw.sidecar_pids()
