"""An optional Prometheus endpoint: the latest health snapshot as text exposition, for Grafana.

Owns the mapping HealthSnapshot → metric families (`render`, and the collector behind the server)
and `MetricsServer`, the small HTTP server that serves it at /metrics. prometheus_client is the
optional `metrics` extra: it is imported when a MetricsServer is made or `render` runs, never at
import time, and its absence is a `MetricsUnavailableError` that says what to install.

Every sample carries `box` and `run_id`. A field the snapshot does not hold (an `optional` GPU,
memory or progress field NVML or the kernel did not give, a sub-message not yet sampled) is no
sample at all, never a 0: a 0 would read as "idle" or "no errors". Counts that only grow (OOM kills,
ECC errors, non-finite losses, log lines) are counters (`_total`, reset when their source restarts);
the rest are gauges. Units are Prometheus base units: bytes, seconds, hertz, celsius, watts.

The scrape runs on the HTTP server's thread and reads the snapshot through `latest`, which must only
read an attribute (`lambda: hub.latest`: HealthHub replaces its snapshot whole, never changes it in
place); it never enters the event loop. The server binds to loopback by default; the snapshot names
paths and job ids, so a non-loopback host is served only when a caller passes it on purpose.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.errors import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'boxwarden[metrics]'"


class MetricsUnavailableError(ConfigError):
    """prometheus_client (the `metrics` extra) is not installed."""


class MetricsPortError(ConfigError, OSError):
    """The metrics port could not be bound (taken, or not ours to take)."""


def _require() -> None:
    try:
        importlib.import_module("prometheus_client")
    except ImportError as e:
        raise MetricsUnavailableError(
            f"the metrics endpoint needs prometheus_client, which is not installed ({e}): {INSTALL_HINT}"
        ) from e


# (field of GpuStats, metric name, factor to base units, help). Absent fields give no sample.
_GPU_GAUGES = (
    ("utilization_percent", "boxwarden_gpu_utilization_percent", 1.0, "GPU utilization, percent."),
    ("memory_used_bytes", "boxwarden_gpu_memory_used_bytes", 1.0, "GPU memory in use, bytes."),
    ("memory_total_bytes", "boxwarden_gpu_memory_total_bytes", 1.0, "GPU memory, bytes."),
    ("temperature_c", "boxwarden_gpu_temperature_celsius", 1.0, "GPU temperature, degrees Celsius."),
    ("power_w", "boxwarden_gpu_power_watts", 1.0, "GPU power draw, watts."),
    ("power_limit_w", "boxwarden_gpu_power_limit_watts", 1.0, "GPU power limit, watts."),
    ("sm_clock_mhz", "boxwarden_gpu_sm_clock_hertz", 1e6, "GPU SM clock, hertz."),
    ("sm_clock_max_mhz", "boxwarden_gpu_sm_clock_max_hertz", 1e6, "GPU SM clock maximum, hertz."),
    ("retired_pages", "boxwarden_gpu_retired_pages", 1.0, "GPU memory pages retired."),
    ("remapped_rows_pending", "boxwarden_gpu_remapped_rows_pending", 1.0, "1: a row remap awaits reset."),
    ("remapped_rows_failed", "boxwarden_gpu_remapped_rows_failed", 1.0, "1: a row remap failed."),
)
_GPU_COUNTERS = (
    ("ecc_corrected", "boxwarden_gpu_ecc_corrected_errors_total", "Corrected ECC errors since driver load."),
    ("ecc_uncorrected", "boxwarden_gpu_ecc_uncorrected_errors_total", "Uncorrected ECC errors since load."),
)
_ENDED = (pb.JOB_STATE_EXITED, pb.JOB_STATE_STOPPED)


class _Families:
    """Metric families in the order first used. Every sample gets `box` and `run_id`; a label set seen
    twice in one family keeps its first value (Prometheus rejects duplicate series)."""

    def __init__(self, box: str, run_id: str) -> None:
        self._base = {"box": box, "run_id": run_id}
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        self._seen: set[tuple[str, tuple[str, ...]]] = set()

    def gauge(self, name: str, doc: str, value: float, /, **labels: str) -> None:
        self._add(name, doc, value, labels, counter=False)

    def counter(self, name: str, doc: str, value: float, /, **labels: str) -> None:
        self._add(name, doc, value, labels, counter=True)

    def _add(self, name: str, doc: str, value: float, labels: dict[str, str], *, counter: bool) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        every = {**self._base, **labels}
        key = (name, tuple(every.values()))
        if key in self._seen:
            return
        self._seen.add(key)
        family = self._families.get(name)
        if family is None:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            family = self._families[name] = kind(name, doc, labels=list(every))
        family.add_metric(list(every.values()), float(value))

    def all(self) -> list[Metric]:
        return list(self._families.values())


def _metric_families(snap: pb.HealthSnapshot, *, box: str, run_id: str, now_unix_ns: int) -> list[Metric]:
    """The snapshot's metric families (prometheus_client must be importable: see `_require`)."""
    o = _Families(box, run_id)
    if snap.at_unix_ns:
        age = (now_unix_ns - snap.at_unix_ns) / 1e9
        o.gauge("boxwarden_snapshot_age_seconds", "Seconds since the health snapshot was taken.", age)
    o.gauge("boxwarden_journal_seq", "The newest journal sequence number.", snap.seq)
    for d in snap.disks:
        where = {"path": d.path, "role": d.role}
        o.gauge("boxwarden_disk_total_bytes", "Size of the filesystem, bytes.", d.total_bytes, **where)
        o.gauge("boxwarden_disk_free_bytes", "Free bytes of the filesystem.", d.free_bytes, **where)
        o.gauge("boxwarden_disk_total_inodes", "Inodes of the filesystem.", d.total_inodes, **where)
        o.gauge("boxwarden_disk_free_inodes", "Free inodes of the filesystem.", d.free_inodes, **where)
    if snap.HasField("memory"):
        _memory(o, snap.memory)
    for g in snap.gpus:
        _gpu(o, g)
    if snap.gpu_source:
        o.gauge("boxwarden_gpu_source_info", "Where GPU readings come from.", 1, source=snap.gpu_source)
    for j in snap.jobs:
        _job(o, j)
    if snap.HasField("artifacts"):
        _evidence(o, snap.artifacts)
    for a in snap.alerts:
        kind = pb.EventKind.Name(a.kind) if a.kind in pb.EventKind.values() else str(a.kind)
        o.gauge("boxwarden_alert_active", "1 for each alert active now.", 1, kind=kind, subject=a.subject)
    for p in snap.probes:
        o.gauge(
            "boxwarden_probe_stale",
            "1: no new answer from the probe at the last sample (failed, or past its deadline).",
            p.stale,
            probe=p.name,
        )
        o.gauge("boxwarden_probe_age_seconds", "Seconds since its last good reading.", p.age_s, probe=p.name)
    if snap.HasField("self"):
        s = snap.self
        o.gauge("boxwarden_sidecar_cpu_percent", "Sidecar CPU, percent of one core.", s.cpu_percent)
        o.gauge("boxwarden_sidecar_rss_bytes", "Sidecar resident set size, bytes.", s.rss_bytes)
        o.gauge("boxwarden_sidecar_uptime_seconds", "Seconds since the sidecar started.", s.uptime_s)
    return o.all()


def _memory(o: _Families, m: pb.MemoryStats) -> None:
    o.gauge("boxwarden_memory_cgroup_version", "Memory cgroup version; 0: none found.", m.cgroup_version)
    if m.HasField("limit_bytes"):
        o.gauge("boxwarden_memory_cgroup_limit_bytes", "Memory limit of the cgroup, bytes.", m.limit_bytes)
    if m.HasField("usage_bytes"):
        o.gauge("boxwarden_memory_cgroup_usage_bytes", "Memory used in the cgroup, bytes.", m.usage_bytes)
    if m.HasField("oom_kills"):
        o.counter("boxwarden_memory_oom_kills_total", "OOM kills in the cgroup.", m.oom_kills)
    o.gauge("boxwarden_memory_host_total_bytes", "Host memory, bytes.", m.host_total_bytes)
    o.gauge("boxwarden_memory_host_available_bytes", "Host memory available, bytes.", m.host_available_bytes)
    o.gauge("boxwarden_load1", "Load average over 1 minute.", m.load1)
    o.gauge("boxwarden_load5", "Load average over 5 minutes.", m.load5)
    o.gauge("boxwarden_load15", "Load average over 15 minutes.", m.load15)


def _gpu(o: _Families, g: pb.GpuStats) -> None:
    which = {"gpu": str(g.index), "uuid": g.uuid}
    o.gauge("boxwarden_gpu_info", "1 for each GPU, with its name.", 1, **which, name=g.name)
    present = {f.name: v for f, v in g.ListFields()}  # an optional field NVML did not give is not here
    for field, name, factor, doc in _GPU_GAUGES:
        if field in present:
            o.gauge(name, doc, float(present[field]) * factor, **which)
    for field, name, doc in _GPU_COUNTERS:
        if field in present:
            o.counter(name, doc, present[field], **which)
    for reason in g.throttle_reasons:
        o.gauge(
            "boxwarden_gpu_throttle", "1 for each active clock throttle reason.", 1, **which, reason=reason
        )


def _job(o: _Families, j: pb.Job) -> None:
    which = {"job": j.id, "cell": j.cell}
    o.gauge("boxwarden_job_running", "1: the job runs.", j.state == pb.JOB_STATE_RUNNING, **which)
    if j.state in _ENDED:
        o.gauge("boxwarden_job_exit_code", "Exit status; negative: the signal.", j.exit_code, **which)
    if not j.HasField("progress"):
        return
    p = j.progress
    if p.HasField("step"):
        o.gauge("boxwarden_job_step", "The latest step the job's log reported.", p.step, **which)
    if p.HasField("loss"):  # NaN and Inf stay as they are: the text format has NaN and +Inf
        o.gauge("boxwarden_job_loss", "The latest loss the job's log reported.", p.loss, **which)
    if p.HasField("steps_per_s"):
        o.gauge("boxwarden_job_steps_per_second", "Training steps per second.", p.steps_per_s, **which)
    if p.HasField("last_line_age_s"):
        age = p.last_line_age_s
        o.gauge("boxwarden_job_last_line_age_seconds", "Seconds since the last log line.", age, **which)
    o.counter("boxwarden_job_nonfinite_losses_total", "Non-finite losses logged.", p.nonfinite, **which)
    o.counter("boxwarden_job_log_lines_total", "Complete log lines read.", p.lines, **which)


def _evidence(o: _Families, a: pb.ArtifactStats) -> None:
    o.gauge("boxwarden_claims_sealed", "Current claims.", a.sealed)
    o.gauge("boxwarden_claims_durable", "Current claims that are durable.", a.durable)
    o.gauge("boxwarden_claims_not_durable", "Current claims not durable yet.", a.sealed - a.durable)
    o.gauge("boxwarden_claims_sealed_bytes", "Bytes of current claims.", a.sealed_bytes)
    o.gauge("boxwarden_claims_not_durable_bytes", "Bytes of claims not durable yet.", a.not_durable_bytes)
    o.gauge("boxwarden_claims_server_checksum", "Durable claims proven by checksum only.", a.server_checksum)
    o.gauge("boxwarden_claims_durable_only", "Claims whose box-side copy was retired.", a.durable_only)
    o.gauge("boxwarden_push_lag_seconds", "Age of the oldest claim not durable.", a.push_lag_ms / 1000)
    o.gauge("boxwarden_push_bandwidth_bytes_per_second", "Recent push bandwidth.", a.push_bytes_per_s)


class _SnapshotCollector:
    """Reads `latest()` once per scrape, on the scraping thread."""

    def __init__(self, latest: Callable[[], pb.HealthSnapshot], box: str, run_id: str) -> None:
        self._latest, self._box, self._run_id = latest, box, run_id

    def collect(self) -> Iterable[Metric]:
        return _metric_families(
            self._latest(), box=self._box, run_id=self._run_id, now_unix_ns=time.time_ns()
        )


def _registry(latest: Callable[[], pb.HealthSnapshot], box: str, run_id: str) -> CollectorRegistry:
    _require()
    from prometheus_client import CollectorRegistry

    # Its own registry: never the process-wide default with its python_/process_ collectors.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(latest, box, run_id))
    return registry


def render(snapshot: pb.HealthSnapshot, *, box: str, run_id: str) -> bytes:
    """The snapshot in the Prometheus text exposition format (0.0.4)."""
    registry = _registry(lambda: snapshot, box, run_id)
    from prometheus_client import generate_latest

    return generate_latest(registry)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsServer:
    """Serves /metrics on host:port from a daemon thread. `host` is loopback unless a caller gives
    another on purpose (it is then served, with a warning: anyone who reaches it reads the box's
    paths and job ids). Raises MetricsUnavailableError here when prometheus_client is missing."""

    def __init__(
        self,
        latest: Callable[[], pb.HealthSnapshot],
        *,
        box: str,
        run_id: str,
        port: int,
        host: str = "127.0.0.1",
    ) -> None:
        self._registry = _registry(latest, box, run_id)
        self._host, self._port = host, port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Starts serving and returns the bound port (port 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("the metrics server is already started")
        from prometheus_client import start_http_server

        if not _is_loopback(self._host):
            logger.warning("serving metrics on %s, which is not loopback", self._host)
        try:
            self._server, self._thread = start_http_server(
                self._port, addr=self._host, registry=self._registry
            )
        except OSError as e:
            raise MetricsPortError(
                e.errno, f"cannot serve metrics on {self._host}:{self._port}: {e.strerror or e}"
            ) from e
        port = int(self._server.server_address[1])
        logger.info("serving metrics on http://%s:%d/metrics", self._host, port)
        return port

    def close(self) -> None:
        """Stops serving and releases the port. Idempotent."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
