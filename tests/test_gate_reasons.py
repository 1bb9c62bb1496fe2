"""Every gate reason code, produced from a real situation: the real CLI, the real sidecar on its
real socket, real checkpoints. Each test asserts the exact code (and path where it has one).

The torch load probe is the subject of the clean case and of the UNLOADABLE tests, which keep real
torch checkpoints; the other tests keep real safetensors checkpoints, whose probe needs no torch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Bw, pid_alive, save_ckpt, save_weights, wait_until

NAME = "box1"
W = "best.safetensors"  # the checkpoint of a box from verified_box(torch=False)


def codes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(r["code"], r["path"]) for r in doc["reasons"]}


def only_codes(doc: dict[str, Any]) -> set[str]:
    return {r["code"] for r in doc["reasons"]}


def verified_box(bw: Bw, *roster: str, torch: bool = False) -> dict[str, Path]:
    """A box with two cells checkpointed (`best.pt` with `torch`, else `W`), durable, pulled and
    verified: the clean starting point."""
    args = [a for cell in roster for a in ("--roster", cell)]
    paths = bw.up(NAME, *args)
    save, name = (save_ckpt, "best.pt") if torch else (save_weights, W)
    save(paths["watch"] / "cell-a" / name, seed=1)
    save(paths["watch"] / "cell-b" / name, seed=2)
    (paths["watch"] / "cell-a" / "metrics.json").write_text('{"loss": 0.5}')
    bw.wait_durable(NAME, 3)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    paths["pulled"] = pulled
    return paths


def down_dry(bw: Bw) -> dict[str, Any]:
    r = bw("down", NAME, "--dry-run", "--json")
    doc = dict(json.loads(r.stdout))
    assert r.returncode == (0 if doc["allowed"] else 3), r.stderr
    return doc


def test_clean_case_is_allowed_and_down_tears_down(bw: Bw) -> None:
    p = verified_box(bw, "cell-a", "cell-b", torch=True)
    dry = down_dry(bw)
    assert dry["allowed"] is True, dry["reasons"]
    assert dry["reasons"] == []
    # Nothing was done by the dry run.
    assert (p["watch"] / "cell-a" / "best.pt").exists()
    pid = bw.sidecar_pids()[0]
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert doc["allowed"] is True
    assert sorted(doc["teardown"]["deleted"]) == ["cell-a/best.pt", "cell-a/metrics.json", "cell-b/best.pt"]
    assert doc["teardown"]["gone"] is True
    assert not pid_alive(pid)
    # Box-side copies of the verified artifacts are gone; the durable copies and the pulled tree stay.
    assert not (p["watch"] / "cell-a" / "best.pt").exists()
    assert (p["durable"] / "cell-a" / "best.pt").exists()
    assert (p["pulled"] / "cell-b" / "best.pt").exists()
    status = bw.json("status")
    assert status["boxes"][0]["status"] == "down"


def test_flipped_byte_is_hash_mismatch(bw: Bw) -> None:
    p = verified_box(bw)
    f = p["pulled"] / "cell-a" / W
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert ("HASH_MISMATCH", f"cell-a/{W}") in codes(down_dry(bw))
    r = bw("verify", str(p["pulled"]), "--json")
    assert r.returncode == 3
    assert not (p["pulled"] / "PULL_VERIFIED.json").exists()


def test_truncated_file_is_size_mismatch(bw: Bw) -> None:
    p = verified_box(bw)
    f = p["pulled"] / "cell-b" / W
    os.truncate(f, f.stat().st_size - 10)
    assert ("SIZE_MISMATCH", f"cell-b/{W}") in codes(down_dry(bw))


def test_missing_file_is_missing(bw: Bw) -> None:
    p = verified_box(bw)
    (p["pulled"] / "cell-a" / "metrics.json").unlink()
    assert ("MISSING", "cell-a/metrics.json") in codes(down_dry(bw))


def test_extra_file_is_extra(bw: Bw) -> None:
    p = verified_box(bw)
    (p["pulled"] / "cell-b" / "stray.txt").write_text("not from the box")
    assert ("EXTRA", "cell-b/stray.txt") in codes(down_dry(bw))


def test_missing_roster_cell_is_roster_incomplete(bw: Bw) -> None:
    verified = None
    p = bw.up(NAME, "--roster", "cell-a", "--roster", "cell-c")
    save_weights(p["watch"] / "cell-a" / W, seed=1)
    bw.wait_durable(NAME, 1)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    verified = bw("verify", str(pulled), "--json")
    assert verified.returncode == 3
    assert ("ROSTER_INCOMPLETE", "cell-c") in codes(down_dry(bw))


def test_checkpoint_after_verification_is_manifest_stale(bw: Bw) -> None:
    p = verified_box(bw)
    save_ckpt(p["watch"] / "cell-a" / "step-200.pt", seed=3)
    bw.wait_durable(NAME, 4)
    assert "MANIFEST_STALE" in only_codes(down_dry(bw))


def test_file_held_open_for_writing_is_unsealed_writes(bw: Bw) -> None:
    p = verified_box(bw)
    target = p["watch"] / "cell-b" / "writing.pt"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"f = open({str(target)!r}, 'wb'); f.write(b'x' * 100); f.flush()\n"
            "print('ready', flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        doc = down_dry(bw)
        assert ("UNSEALED_WRITES", "cell-b/writing.pt") in codes(doc)
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
        assert holder.stdin is not None
        holder.stdin.close()


def test_running_job_is_job_running(bw: Bw) -> None:
    verified_box(bw)
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    r = bw.ok("run", NAME, "--json", "--cell", "cell-a", "--", *sleeper)
    job = json.loads(r.stdout)
    assert pid_alive(job["pid"])
    doc = down_dry(bw)
    assert "JOB_RUNNING" in only_codes(doc)
    os.killpg(job["pid"], signal.SIGKILL)
    wait_until(lambda: "JOB_RUNNING" not in only_codes(down_dry(bw)), what="the job to be seen as ended")


def test_unloadable_checkpoint_is_unloadable(bw: Bw) -> None:
    p = bw.up(NAME)
    bad = p["watch"] / "cell-a" / "best.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"this is not a torch checkpoint" * 10)
    bw.wait_durable(NAME, 1)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    assert bw("verify", str(pulled)).returncode == 3
    assert ("UNLOADABLE", "cell-a/best.pt") in codes(down_dry(bw))


class _Payload:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.sentinel, "w"))


def test_pickle_payload_is_unloadable_and_never_executed(bw: Bw) -> None:
    import torch

    p = bw.up(NAME)
    sentinel = bw.cwd / "PWNED"
    evil = p["watch"] / "cell-a" / "best.pt"
    evil.parent.mkdir(parents=True)
    tmp = evil.with_suffix(".tmp")
    torch.save({"model_state_dict": _Payload(str(sentinel))}, tmp)
    os.replace(tmp, evil)
    assert not sentinel.exists()
    bw.wait_durable(NAME, 1)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    assert bw("verify", str(pulled)).returncode == 3
    assert ("UNLOADABLE", "cell-a/best.pt") in codes(down_dry(bw))
    assert not sentinel.exists(), "the pickle payload was executed"


def test_symlink_in_pulled_tree_is_unsafe_path(bw: Bw) -> None:
    p = verified_box(bw)
    (p["pulled"] / "cell-a" / "link.pt").symlink_to("/etc/passwd")
    assert "UNSAFE_PATH" in only_codes(down_dry(bw))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Any:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    assert r.returncode == 0, f"mount tmpfs failed (tests run as root): {r.stderr}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_push_to_a_full_durable_store_is_not_durable(bw: Bw, tiny_tmpfs: Path) -> None:
    p = bw.up(NAME, "--durable", tiny_tmpfs.as_uri())
    save_weights(p["watch"] / "cell-a" / W, seed=1, size=100_000)  # ~400 KB > 64 KiB
    claim = wait_until(
        lambda: [c for c in bw.artifacts(NAME).get("claims", []) if c.get("push_error")],
        what="a push error",
    )[0]
    assert not claim.get("durable")
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    bw.ok("verify", str(pulled))
    doc = down_dry(bw)
    assert codes(doc) == {("NOT_DURABLE", f"cell-a/{W}")}
    bw.cleanup()  # the sidecar holds no file on the mount, but stop it before the unmount anyway


def test_no_confirmation_is_not_confirmed(bw: Bw) -> None:
    p = verified_box(bw)
    r = bw("down", NAME, "--json")  # stdin is not a terminal: no prompt, no silent yes
    assert r.returncode == 3
    assert {x["code"] for x in json.loads(r.stdout)["reasons"]} == {"NOT_CONFIRMED"}
    wrong = bw("down", NAME, "--json", "--confirm", "box2")
    assert wrong.returncode == 3
    assert {x["code"] for x in json.loads(wrong.stdout)["reasons"]} == {"NOT_CONFIRMED"}
    assert (p["watch"] / "cell-a" / W).exists()
    assert all(pid_alive(pid) for pid in bw.sidecar_pids())


def test_dead_sidecar_is_sidecar_unreachable(bw: Bw) -> None:
    verified_box(bw)
    pid = bw.sidecar_pids()[0]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the sidecar to die")
    doc = down_dry(bw)
    assert "SIDECAR_UNREACHABLE" in only_codes(doc)
    assert doc["allowed"] is False


def _down_on_a_terminal(bw: Bw, typed: str) -> tuple[int, str]:
    """Run `down NAME` with a real pseudo-terminal as its stdin and answer the prompt."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller", "down", NAME],
        cwd=bw.cwd,
        env=bw.env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    out = b""
    answered = False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                if not answered and b"to confirm teardown" in out:
                    os.write(master, typed.encode() + b"\r")
                    answered = True
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
    return code, out.decode(errors="replace")


def test_interactive_prompt_wrong_name_refuses_right_name_tears_down(bw: Bw) -> None:
    p = verified_box(bw)
    code, out = _down_on_a_terminal(bw, "not-the-box")
    assert code == 3, out
    assert "NOT_CONFIRMED" in out
    assert (p["watch"] / "cell-a" / W).exists()
    code, out = _down_on_a_terminal(bw, NAME)
    assert code == 0, out
    assert "gone" in out
    assert not (p["watch"] / "cell-a" / W).exists()


def test_nothing_pulled_is_not_pulled(bw: Bw) -> None:
    p = bw.up(NAME)
    save_ckpt(p["watch"] / "cell-a" / "best.pt", seed=1)
    bw.wait_durable(NAME, 1)
    assert only_codes(down_dry(bw)) == {"NOT_PULLED"}


def test_pulled_but_not_verified_is_not_verified(bw: Bw) -> None:
    p = bw.up(NAME)
    save_ckpt(p["watch"] / "cell-a" / "best.pt", seed=1)
    bw.wait_durable(NAME, 1)
    bw.ok("pull", NAME, "--to", str(bw.cwd / "pulled"))
    assert only_codes(down_dry(bw)) == {"NOT_VERIFIED"}


def test_a_pulled_tree_that_was_removed_is_not_pulled(bw: Bw) -> None:
    p = verified_box(bw)
    shutil.rmtree(p["pulled"])
    doc = down_dry(bw)
    assert only_codes(doc) == {"NOT_PULLED"}
