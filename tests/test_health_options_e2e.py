"""The sidecar's health settings given at `up` (--stall-minutes, --step-regex, --loss-regex,
--memory-high, --metrics-port) reach its config; changing them restarts the sidecar (its jobs go on)
and keeping them leaves it alone; `metrics NAME` names the endpoint, proven by a real scrape, and
over SSH forwards a remote box's port here until it is interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from controller.ssh.connector import free_port
from tests.conftest import Bw, pid_alive, wait_until
from tests.test_remote_e2e import Remote, remote, venv_template, wheel_cache  # noqa: F401 - fixtures


def scrape(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {f.name for f in text_string_to_metric_families(text)}


PROSE = {"box", "profile", "status", "host", "error", "version", "path", "role", "kind", "subject"}
PROSE |= {"detail", "job_id", "cell", "name", "summary"}


def human_strings(doc: object, key: str = "") -> list[str]:
    """Every string of a `status --json` document that is not a name, an enum or a message: the
    figures must be numbers ("1 running / 3", "0.0s" were once strings)."""
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in human_strings(v, str(k))]
    if isinstance(doc, list):
        return [s for v in doc for s in human_strings(v, key)]
    if isinstance(doc, str) and key not in PROSE and key != "stale_probes":
        return [f"{key}={doc!r}"]
    return []


def config(bw: Bw, name: str) -> dict[str, object]:
    return dict(json.loads((bw.home / "boxes" / name / "sidecar.json").read_text()))


def test_health_settings_reach_the_sidecar_and_a_change_restarts_it(bw: Bw) -> None:
    port = free_port()
    bw.up(
        "h1",
        "--stall-minutes",
        "5",
        "--step-regex",
        r"it (?P<step>\d+)",
        "--memory-high",
        "80",
        "--metrics-port",
        str(port),
    )
    cfg = config(bw, "h1")
    assert (cfg["stallS"], cfg["stepRegex"], cfg["memoryHighPercent"], cfg["metricsPort"]) == (
        300,
        r"it (?P<step>\d+)",
        80,
        port,
    )
    doc = bw.json("metrics", "h1")
    assert doc == {"box": "h1", "url": f"http://127.0.0.1:{port}/metrics", "forwarded": False}
    assert "boxwarden_claims_sealed" in scrape(doc["url"])

    r = bw("run", "h1", "--json", "--", sys.executable, "-c", "import time; time.sleep(600)")
    job = json.loads(r.stdout)
    (before,) = bw.sidecar_pids()
    bw.up("h1")  # the same settings: left alone
    assert bw.sidecar_pids() == [before]
    bw.up("h1", "--stall-minutes", "10")  # a change: restarted to read it; the rest is kept
    (after,) = bw.sidecar_pids()
    assert after != before and not pid_alive(before)
    cfg = config(bw, "h1")
    assert (cfg["stallS"], cfg["stepRegex"], cfg["metricsPort"]) == (600, r"it (?P<step>\d+)", port)
    assert pid_alive(job["pid"])  # the job outlived the restart, and the new sidecar follows it
    doc = bw.json("status", "h1")
    assert doc["schema"] == 2
    (row,) = doc["boxes"]
    assert row["jobs_running"] == 1 and row["sidecar"] == {"version": row["sidecar"]["version"], "pid": after}
    assert [p["job_id"] for p in row["progress"]] == [job["id"]] and row["gpus"] == []
    assert {d["role"] for d in row["disks"]} >= {"watch", "state"}
    assert not human_strings(row), human_strings(row)
    bw.ok("stop", "h1", job["id"], "--grace", "1")


def test_metrics_are_named_the_boxs_only_when_its_own_sidecar_serves_them(bw: Bw) -> None:
    """Review of issue 25: with box md's sidecar dead, box mc's sidecar on the same port was
    given as md's endpoint."""
    port = free_port()
    bw.up("md", "--metrics-port", str(port), watch="ck-d")
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="md's sidecar gone")
    bw.up("mc", "--metrics-port", str(port), watch="ck-c")
    r = bw("metrics", "md", "--json")
    assert r.returncode == 1 and "with the metrics of box 'mc'" in r.stderr, r.stderr
    assert bw.json("metrics", "mc")["url"] == f"http://127.0.0.1:{port}/metrics"


def test_bad_health_settings_are_refused_before_anything_starts(bw: Bw) -> None:
    r = bw("up", "h2", "--profile", "local", "--watch", "ckpt", "--step-regex", r"step (\d+)")
    assert r.returncode == 2 and "needs a named group (?P<step>...)" in r.stderr
    r = bw("up", "h2", "--profile", "local", "--watch", "ckpt", "--loss-regex", "loss=(")
    assert r.returncode == 2 and "--loss-regex 'loss=(' is not a regular expression" in r.stderr
    r = bw("up", "h2", "--profile", "local", "--watch", "ckpt", "--memory-high", "0")
    assert r.returncode == 2
    assert not bw.sidecar_pids()
    bw.up("h2")
    r = bw("metrics", "h2")
    assert r.returncode == 2 and "serves no metrics" in r.stderr and "--metrics-port PORT" in r.stderr


def test_a_remote_boxs_metrics_are_forwarded_here_until_interrupted(remote: Remote) -> None:  # noqa: F811
    box = remote.boxes("m1")
    remote.up(box, "--metrics-port", str(free_port()), seeded=True)
    local = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller", "metrics", box.alias, "--port", str(local), "--json"],
        cwd=remote.bw.cwd,
        env=remote.bw.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        doc = json.loads(proc.stdout.readline())
        assert doc == {"box": box.alias, "url": f"http://127.0.0.1:{local}/metrics", "forwarded": True}
        assert "boxwarden_claims_sealed" in scrape(doc["url"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        # The forward ended with it: nothing listens on the port any more.
        wait_until(lambda: _refused(local), timeout=10, what="the forward to close")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _refused(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0
