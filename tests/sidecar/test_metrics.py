"""The Prometheus endpoint: real scrapes over HTTP parsed with prometheus_client's own parser (values,
labels, absent fields giving no sample, NaN loss, a new snapshot seen by the next scrape), the port
released on close, a clear error for a taken port, and the missing `metrics` extra named."""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from sidecar.metrics import MetricsPortError, MetricsServer, render

REPO = Path(__file__).resolve().parents[2]
AT_NS = 1_700_000_000_000_000_000
BOX = {"box": "gpu-box-1", "run_id": "sweep-7"}

Labels = tuple[tuple[str, str], ...]


def snapshot(*, loss: float = math.nan, free: int = 40 << 30) -> pb.HealthSnapshot:
    snap = pb.HealthSnapshot(at_unix_ns=AT_NS, seq=42, gpu_source="replay")
    snap.disks.add(
        path="/data/ckpt",
        role="watch",
        total_bytes=100 << 30,
        free_bytes=free,
        total_inodes=1000,
        free_inodes=900,
    )
    snap.disks.add(path="/mnt/durable", role="durable", total_bytes=1 << 40, free_bytes=1 << 39)
    snap.memory.CopyFrom(
        pb.MemoryStats(
            cgroup_version=2, usage_bytes=3 << 30, oom_kills=1, host_total_bytes=64 << 30, load1=2.5
        )
    )  # limit_bytes absent: no limit
    gpu = snap.gpus.add(index=0, uuid="GPU-abc", name="NVIDIA H200", utilization_percent=0, temperature_c=61)
    gpu.sm_clock_mhz, gpu.ecc_uncorrected = 1980, 0
    gpu.throttle_reasons.extend(["sw_power_cap", "hw_thermal_slowdown"])
    # power_w, memory_*, ecc_corrected, retired_pages...: NVML said "not supported"
    job = snap.jobs.add(id="job-1", cell="cell-a", state=pb.JOB_STATE_RUNNING)
    job.progress.CopyFrom(pb.JobProgress(step=1200, loss=loss, steps_per_s=4.5, lines=300, nonfinite=2))
    snap.jobs.add(id="job-0", cell="cell-a", state=pb.JOB_STATE_EXITED, exit_code=-9)
    snap.artifacts.CopyFrom(
        pb.ArtifactStats(sealed=5, durable=3, not_durable_bytes=2048, push_lag_ms=1500, push_bytes_per_s=1e8)
    )
    snap.alerts.add(kind=pb.GPU_THROTTLE, subject="gpu0", detail="sw_power_cap", since_unix_ns=AT_NS)
    snap.probes.add(name="gpu", stale=True, age_s=12.5, error="NVML is late")
    snap.probes.add(name="host", stale=False, age_s=0.5)
    snap.self.CopyFrom(pb.SelfStats(cpu_percent=1.5, rss_bytes=80 << 20, uptime_s=3600))
    return snap


def parse(text: str) -> tuple[dict[str, str], dict[str, dict[Labels, float]]]:
    """(family name → type, sample name → {labels without box/run_id → value}); checks that every
    sample carries box and run_id."""
    types: dict[str, str] = {}
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("boxwarden_"), family.name
        types[family.name] = family.type
        for s in family.samples:
            assert {k: s.labels[k] for k in BOX} == BOX, s
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in BOX))
            assert rest not in samples.setdefault(s.name, {}), f"duplicate series {s}"
            samples[s.name][rest] = s.value
    return types, samples


def scrape(port: int) -> tuple[dict[str, str], dict[str, dict[Labels, float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(resp.read().decode())


GPU: Labels = (("gpu", "0"), ("uuid", "GPU-abc"))
JOB: Labels = (("cell", "cell-a"), ("job", "job-1"))


@pytest.fixture
def current() -> list[pb.HealthSnapshot]:
    """What `latest` returns: the test swaps the element, as HealthHub swaps its attribute."""
    return [snapshot()]


@pytest.fixture
def server(current: list[pb.HealthSnapshot]) -> Iterator[tuple[MetricsServer, int]]:
    srv = MetricsServer(lambda: current[0], port=0, **BOX)
    port = srv.start()
    try:
        yield srv, port
    finally:
        srv.close()


def test_a_real_scrape_reports_the_snapshot(server: tuple[MetricsServer, int]) -> None:
    _, port = server
    assert port > 0
    types, got = scrape(port)

    ckpt: Labels = (("path", "/data/ckpt"), ("role", "watch"))
    durable: Labels = (("path", "/mnt/durable"), ("role", "durable"))
    assert got["boxwarden_disk_free_bytes"] == {ckpt: float(40 << 30), durable: float(1 << 39)}
    assert got["boxwarden_disk_total_bytes"][ckpt] == float(100 << 30)
    assert got["boxwarden_disk_free_inodes"][ckpt] == 900.0
    assert got["boxwarden_disk_total_inodes"][ckpt] == 1000.0

    assert got["boxwarden_memory_cgroup_usage_bytes"] == {(): float(3 << 30)}
    assert "boxwarden_memory_cgroup_limit_bytes" not in got  # absent, not 0
    assert got["boxwarden_memory_oom_kills_total"] == {(): 1.0}
    assert types["boxwarden_memory_oom_kills"] == "counter"
    assert got["boxwarden_load1"] == {(): 2.5}

    assert got["boxwarden_gpu_utilization_percent"] == {GPU: 0.0}  # a real 0 is a sample
    assert got["boxwarden_gpu_temperature_celsius"] == {GPU: 61.0}
    assert got["boxwarden_gpu_sm_clock_hertz"] == {GPU: 1.98e9}
    assert got["boxwarden_gpu_ecc_uncorrected_errors_total"] == {GPU: 0.0}
    assert got["boxwarden_gpu_info"] == {(*GPU[:1], ("name", "NVIDIA H200"), *GPU[1:]): 1.0}
    assert got["boxwarden_gpu_throttle"] == {
        (*GPU[:1], ("reason", "hw_thermal_slowdown"), *GPU[1:]): 1.0,
        (*GPU[:1], ("reason", "sw_power_cap"), *GPU[1:]): 1.0,
    }
    for absent in (
        "boxwarden_gpu_power_watts",
        "boxwarden_gpu_power_limit_watts",
        "boxwarden_gpu_memory_used_bytes",
        "boxwarden_gpu_memory_total_bytes",
        "boxwarden_gpu_sm_clock_max_hertz",
        "boxwarden_gpu_ecc_corrected_errors_total",
        "boxwarden_gpu_retired_pages",
        "boxwarden_gpu_remapped_rows_pending",
    ):
        assert absent not in got, absent

    ended: Labels = (("cell", "cell-a"), ("job", "job-0"))
    assert got["boxwarden_job_running"] == {JOB: 1.0, ended: 0.0}
    assert got["boxwarden_job_exit_code"] == {ended: -9.0}  # only for an ended job
    assert got["boxwarden_job_step"] == {JOB: 1200.0}
    assert math.isnan(got["boxwarden_job_loss"][JOB])
    assert got["boxwarden_job_steps_per_second"] == {JOB: 4.5}
    assert "boxwarden_job_last_line_age_seconds" not in got  # never a complete line: absent
    assert got["boxwarden_job_nonfinite_losses_total"] == {JOB: 2.0}

    assert got["boxwarden_claims_sealed"] == {(): 5.0}
    assert got["boxwarden_claims_durable"] == {(): 3.0}
    assert got["boxwarden_claims_not_durable"] == {(): 2.0}
    assert got["boxwarden_claims_not_durable_bytes"] == {(): 2048.0}
    assert got["boxwarden_push_lag_seconds"] == {(): 1.5}
    assert got["boxwarden_push_bandwidth_bytes_per_second"] == {(): 1e8}

    assert got["boxwarden_alert_active"] == {(("kind", "GPU_THROTTLE"), ("subject", "gpu0")): 1.0}
    assert got["boxwarden_probe_stale"] == {(("probe", "gpu"),): 1.0, (("probe", "host"),): 0.0}
    assert got["boxwarden_probe_age_seconds"][(("probe", "gpu"),)] == 12.5
    assert got["boxwarden_sidecar_rss_bytes"] == {(): float(80 << 20)}
    assert got["boxwarden_sidecar_uptime_seconds"] == {(): 3600.0}
    assert got["boxwarden_journal_seq"] == {(): 42.0}
    # Taken long ago (AT_NS is in 2023): the age is counted from now, at the scrape.
    assert got["boxwarden_snapshot_age_seconds"][()] > 10_000_000
    assert types["boxwarden_disk_free_bytes"] == "gauge"


def test_the_next_scrape_sees_the_new_snapshot(
    server: tuple[MetricsServer, int], current: list[pb.HealthSnapshot]
) -> None:
    _, port = server
    _, before = scrape(port)
    assert math.isnan(before["boxwarden_job_loss"][JOB])

    newer = snapshot(loss=math.inf, free=1 << 30)
    newer.alerts.add(kind=pb.MEMORY_HIGH, subject="memory")
    newer.gpus[0].power_w = 512.5
    current[0] = newer
    _, after = scrape(port)

    assert after["boxwarden_job_loss"] == {JOB: math.inf}
    assert after["boxwarden_disk_free_bytes"][(("path", "/data/ckpt"), ("role", "watch"))] == float(1 << 30)
    assert after["boxwarden_gpu_power_watts"] == {GPU: 512.5}
    assert set(after["boxwarden_alert_active"]) == {
        (("kind", "GPU_THROTTLE"), ("subject", "gpu0")),
        (("kind", "MEMORY_HIGH"), ("subject", "memory")),
    }


def test_close_releases_the_port(current: list[pb.HealthSnapshot]) -> None:
    first = MetricsServer(lambda: current[0], port=0, **BOX)
    port = first.start()
    scrape(port)
    first.close()
    first.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)

    second = MetricsServer(lambda: current[0], port=port, **BOX)
    try:
        assert second.start() == port
        _, got = scrape(port)
        assert got["boxwarden_journal_seq"] == {(): 42.0}
    finally:
        second.close()


def test_a_taken_port_is_a_clear_error(current: list[pb.HealthSnapshot]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        srv = MetricsServer(lambda: current[0], port=port, **BOX)
        with pytest.raises(MetricsPortError) as caught:
            srv.start()
        srv.close()  # nothing was started: a no-op
    assert isinstance(caught.value, OSError)
    assert caught.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{port}" in str(caught.value)


def test_render_gives_no_sample_for_what_the_snapshot_lacks() -> None:
    # The hub's first snapshot, before any probe answered: only what it holds.
    _, got = parse(render(pb.HealthSnapshot(seq=3), **BOX).decode())
    assert got == {"boxwarden_journal_seq": {(): 3.0}}


def test_render_keeps_one_series_per_label_set() -> None:
    snap = pb.HealthSnapshot()
    snap.alerts.add(kind=pb.VRAM_ZOMBIE, subject="gpu0", detail="pid 1")
    snap.alerts.add(kind=pb.VRAM_ZOMBIE, subject="gpu0", detail="pid 2")
    snap.alerts.add(kind=999, subject="new")  # a kind this sidecar's proto does not know yet
    _, got = parse(render(snap, **BOX).decode())  # parse() refuses duplicate series
    assert got["boxwarden_alert_active"] == {
        (("kind", "VRAM_ZOMBIE"), ("subject", "gpu0")): 1.0,
        (("kind", "999"), ("subject", "new")): 1.0,
    }


BLOCKED = """
import importlib.abc, json, sys


class Absent(importlib.abc.MetaPathFinder):
    # As if prometheus_client were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "prometheus_client":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
from boxwarden_pb.v1 import sidecar_pb2 as pb
from sidecar import metrics  # imports without it: the import is lazy

errors = {}
for what, call in (
    ("server", lambda: metrics.MetricsServer(pb.HealthSnapshot, box="b", run_id="r", port=0)),
    ("render", lambda: metrics.render(pb.HealthSnapshot(), box="b", run_id="r")),
):
    try:
        call()
    except metrics.MetricsUnavailableError as e:
        errors[what] = str(e)
print(json.dumps(errors))
"""


def test_a_missing_extra_is_named() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "proto")])
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout)
    assert set(errors) == {"server", "render"}
    for message in errors.values():
        assert "pip install 'boxwarden[metrics]'" in message
        assert "prometheus_client" in message
