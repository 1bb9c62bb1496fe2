"""The GPU probe: what NVML says about each GPU of the box, behind a small Protocol.

Owns the GPU reading the health sampler takes (`GpuReading`: one `GpuSample` per GPU and the Xid
errors seen since the previous reading), the probes that take it (`NvmlGpuProbe` over pynvml,
`NullGpuProbe` where there is no NVML, `ReplayGpuProbe` over recorded readings), `open_gpu_probe`,
which picks one, and `vram_zombies`, the pure check behind VRAM_ZOMBIE. Thresholds and health
states are the sampler's, not this module's.

pynvml (the optional `gpu` extra) is imported only inside NvmlGpuProbe. Every NVML call blocks
(nvmlInit can take seconds per GPU without the persistence daemon), so `sample()`, `close()` and
`open_gpu_probe` run in the sidecar's NVML executor, one thread at a time, never on the event loop.
A field NVML does not support is None, never 0: a 0 would read as "no ECC errors" or "idle".
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

# NVML's clock-event ("throttle") reason bits, from nvml.h (the older nvmlClocksThrottleReason*
# names have the same values), in bit order, with the names a reading carries. Newer bits (board
# limit, reliability) are left out until the sampler has a use for them.
THROTTLE_BITS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clocks"),
)
THROTTLE_REASONS = frozenset(name for _, name in THROTTLE_BITS)
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})

# NVML return codes and the event type this module tells apart (nvml.h; a stable ABI).
_NOT_SUPPORTED = 3
_TIMEOUT = 10
_FUNCTION_NOT_FOUND = 13  # the driver predates the call: as good as not supported
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE, where pynvml does not make it None

# The newer name first; a driver or pynvml older than it has the older one (the same bits).
_REASONS_CALLS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
MAX_EVENTS_PER_SAMPLE = 256  # bounds one drain, even if events arrive as fast as they are taken


@dataclass(frozen=True, **SLOTS)
class GpuProcess:
    pid: int  # in the PID namespace NVML sees: the host's, which in a container may not be ours
    used_memory_bytes: int | None = None  # None: NVML did not say (MIG, no permission)


@dataclass(frozen=True, **SLOTS)
class GpuSample:
    index: int  # NVML's index, which is CUDA's only under CUDA_DEVICE_ORDER=PCI_BUS_ID
    uuid: str = ""  # "" when it could not be read
    name: str = ""
    utilization_percent: int | None = None  # share of the driver's last period the GPU was busy
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: int | None = None  # the die (NVML_TEMPERATURE_GPU)
    power_w: float | None = None
    power_limit_w: float | None = None  # the enforced limit
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    throttle_reasons: tuple[str, ...] = ()  # names from THROTTLE_BITS in bit order; () unsupported
    ecc_corrected: int | None = None  # volatile counts: since the driver loaded
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None  # both causes; None where unsupported (row remapping GPUs)
    remapped_rows_pending: bool | None = None  # a remap waits for a GPU reset
    remapped_rows_failed: bool | None = None  # a remap failed: the GPU needs service
    processes: tuple[GpuProcess, ...] = ()  # compute, then graphics-only, one per pid

    @property
    def thermal_throttle(self) -> bool:
        """Clocks held down for heat: the software or hardware thermal slowdown. The bare
        hw_slowdown bit does not count: NVML sets it for heat, an external power brake, power-draw
        protection and even a P-state change alike; the specific bits say when it is heat."""
        return not THERMAL_REASONS.isdisjoint(self.throttle_reasons)

    @property
    def power_throttle(self) -> bool:
        """Clocks held down for power: the board's power cap or an external power brake."""
        return not POWER_REASONS.isdisjoint(self.throttle_reasons)


@dataclass(frozen=True, **SLOTS)
class XidEvent:
    gpu_index: int  # -1 when the event's GPU could not be told
    uuid: str
    xid: int
    at_ns: int  # time.time_ns() when the probe took it from NVML


@dataclass(frozen=True, **SLOTS)
class GpuReading:
    gpus: tuple[GpuSample, ...]
    xids: tuple[XidEvent, ...]  # Xid errors seen since the previous sample() (NVML events)
    source: str  # "nvml", "none" (NullGpuProbe), "replay"
    error: str = ""  # why the reading is partial or empty; "" when nothing failed


class GpuProbe(Protocol):
    def sample(self) -> GpuReading:
        """Blocking: call from a worker thread, never the event loop, one thread at a time."""
        ...

    def close(self) -> None: ...


class NullGpuProbe:
    """No GPU readings, and why (`reason`, e.g. why NVML could not start)."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def sample(self) -> GpuReading:
        return GpuReading((), (), "none", self.reason)

    def close(self) -> None:
        pass


def reading_from_dict(d: Mapping[str, Any]) -> GpuReading:
    """A reading from a recording. Unknown keys and throttle names are refused (a typo in a fixture
    must not pass as a field NVML left out); a missing optional field is None."""

    def build(cls: Any, item: Mapping[str, Any], **nested: Any) -> Any:
        unknown = set(item) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
        return cls(**{**item, **nested})

    gpus = []
    for g in d.get("gpus", ()):
        reasons = tuple(g.get("throttle_reasons", ()))
        if not THROTTLE_REASONS.issuperset(reasons):
            raise ValueError(f"unknown throttle reasons {sorted(set(reasons) - THROTTLE_REASONS)}")
        procs = tuple(build(GpuProcess, p) for p in g.get("processes", ()))
        gpus.append(build(GpuSample, g, throttle_reasons=reasons, processes=procs))
    xids = tuple(build(XidEvent, x) for x in d.get("xids", ()))
    reading: GpuReading = build(GpuReading, {"source": "replay", **d}, gpus=tuple(gpus), xids=xids)
    return reading


class ReplayGpuProbe:
    """Recorded readings, played back: each sample() returns the next one and the last one repeats,
    without its Xids (an Xid is seen once). For tests and demos without a GPU."""

    def __init__(self, recording: Sequence[Mapping[str, Any]] | str | os.PathLike[str]) -> None:
        if isinstance(recording, (str, os.PathLike)):
            loaded = json.loads(Path(recording).read_text())
            # A file holds the list, or an object with it under "readings" (beside notes on it).
            readings: Sequence[Mapping[str, Any]] = loaded["readings"] if isinstance(loaded, dict) else loaded
        else:
            readings = recording
        self._readings = [replace(reading_from_dict(r), source="replay") for r in readings]
        if not self._readings:
            raise ValueError("a recording needs at least one reading")
        self._next = 0

    def sample(self) -> GpuReading:
        i = self._next
        self._next += 1
        if i < len(self._readings):
            return self._readings[i]
        return replace(self._readings[-1], xids=())

    def close(self) -> None:
        pass


def _code(e: BaseException) -> object:
    return getattr(e, "value", None)


def _text(v: object) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def _watts(milliwatts: Any) -> float | None:
    return None if milliwatts is None else int(milliwatts) / 1000.0


def _handle_key(handle: Any) -> object:
    """What identifies a device handle: its address (a handle NVML hands back in an event is a new
    ctypes object for the same device), or the object itself for a stand-in."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class _DeviceReader:
    """One GPU's sample. Each field is read on its own, so one failing call costs that field only."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.index = index
        self.errors: list[str] = []

    def call(self, what: str, fn: str | tuple[str, ...], *args: Any) -> Any:
        """NVML's answer, or None when it has none: unsupported, or failed (then noted in errors).
        With several names, the first the binding and the driver both have."""
        for name in (fn,) if isinstance(fn, str) else fn:
            f = getattr(self.nvml, name, None)
            if f is None:  # a pynvml older than the call
                continue
            try:
                return f(*args)
            except self.nvml.NVMLError as e:
                if _code(e) == _FUNCTION_NOT_FOUND:
                    continue
                if _code(e) != _NOT_SUPPORTED:
                    logger.debug("GPU %d: %s: %s", self.index, what, e)
                    self.errors.append(f"{what}: {e}")
                return None
        return None

    def read(self) -> GpuSample:
        nvml, c = self.nvml, self.call
        h = c("handle", "nvmlDeviceGetHandleByIndex", self.index)
        if h is None:
            return GpuSample(self.index)
        mem = c("memory", "nvmlDeviceGetMemoryInfo", h)
        util = c("utilization", "nvmlDeviceGetUtilizationRates", h)
        ecc = [
            _int(c("ECC errors", "nvmlDeviceGetTotalEccErrors", h, kind, nvml.NVML_VOLATILE_ECC))
            for kind in (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        ]
        rows = c("remapped rows", "nvmlDeviceGetRemappedRows", h)  # (corr, unc, pending, failed)
        reasons = _int(c("clock event reasons", _REASONS_CALLS, h))
        return GpuSample(
            index=self.index,
            uuid=_text(c("uuid", "nvmlDeviceGetUUID", h)),
            name=_text(c("name", "nvmlDeviceGetName", h)),
            utilization_percent=None if util is None else int(util.gpu),
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            temperature_c=_int(c("temperature", "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)),
            power_w=_watts(c("power", "nvmlDeviceGetPowerUsage", h)),
            power_limit_w=_watts(c("power limit", "nvmlDeviceGetEnforcedPowerLimit", h)),
            sm_clock_mhz=_int(c("SM clock", "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)),
            sm_clock_max_mhz=_int(c("SM clock max", "nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM)),
            throttle_reasons=() if reasons is None else tuple(n for b, n in THROTTLE_BITS if reasons & b),
            ecc_corrected=ecc[0],
            ecc_uncorrected=ecc[1],
            retired_pages=self.retired_pages(h),
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            remapped_rows_failed=None if rows is None else bool(rows[3]),
            processes=self.processes(h),
        )

    def retired_pages(self, h: Any) -> int | None:
        nvml = self.nvml
        causes = (
            nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        pages = [self.call("retired pages", "nvmlDeviceGetRetiredPages", h, cause) for cause in causes]
        return None if any(p is None for p in pages) else sum(len(p) for p in pages)

    def processes(self, h: Any) -> tuple[GpuProcess, ...]:
        used: dict[int, int | None] = {}  # pid -> bytes, in the order first seen
        for kind in ("Compute", "Graphics"):
            for p in self.call(f"{kind.lower()} processes", f"nvmlDeviceGet{kind}RunningProcesses", h) or ():
                mem = getattr(p, "usedGpuMemory", None)
                if used.get(int(p.pid)) is None:
                    used[int(p.pid)] = None if mem is None or mem == _NOT_AVAILABLE else int(mem)
        return tuple(GpuProcess(pid, mem) for pid, mem in used.items())


class NvmlGpuProbe:
    """The GPUs as NVML sees them. NVML starts on the first sample() (and again on each later one
    until it does); close() frees the Xid event set and shuts NVML down. `nvml` is the pynvml module
    or a stand-in for it (tests); None imports pynvml when first needed."""

    def __init__(self, nvml: Any = None, *, clock: Callable[[], int] = time.time_ns) -> None:
        self._nvml = nvml
        self._clock = clock
        self._lock = threading.Lock()  # close() from another thread waits for a sample in flight
        self._ready = False
        self._closed = False
        self._last_error = ""  # the start failure last logged: each new one is logged once
        self._events: Any = None  # the Xid event set, None where there is none
        self._event_gpus: dict[object, tuple[int, str]] = {}  # handle key -> (index, uuid)

    def sample(self) -> GpuReading:
        with self._lock:
            if self._closed:
                return GpuReading((), (), "nvml", "the GPU probe is closed")
            error = self._start()
            if error:
                if error != self._last_error:
                    logger.warning("no GPU readings: %s", error)
                    self._last_error = error
                return GpuReading((), (), "nvml", error)
            if self._last_error:
                logger.info("NVML started after: %s", self._last_error)
                self._last_error = ""
            xids, errors = self._drain_xids()
            gpus = self._read_gpus(errors)
            return GpuReading(gpus, xids, "nvml", "; ".join(errors))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._ready:
                return
            nvml = self._nvml
            if self._events is not None:
                try:
                    nvml.nvmlEventSetFree(self._events)
                except nvml.NVMLError as e:
                    logger.debug("freeing the NVML event set: %s", e)
                self._events = None
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as e:
                logger.debug("NVML shutdown: %s", e)
            self._ready = False

    def _start(self) -> str:
        """Start NVML and watch for Xid errors, if not started yet: "" when up, else why not."""
        if self._ready:
            return ""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                return f"pynvml is not installed ({e})"
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except (nvml.NVMLError, OSError) as e:
            return f"NVML: {e}"
        self._ready = True
        self._watch_xids()
        return ""

    def _watch_xids(self) -> None:
        nvml = self._nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            logger.warning("Xid errors will not be seen: %s", e)
            return
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                nvml.nvmlDeviceRegisterEvents(handle, _XID_CRITICAL, self._events)
            except nvml.NVMLError as e:
                log = logger.info if _code(e) == _NOT_SUPPORTED else logger.warning
                log("GPU %d: its Xid errors will not be seen: %s", i, e)
                continue
            uuid = _DeviceReader(nvml, i).call("uuid", "nvmlDeviceGetUUID", handle)
            self._event_gpus[_handle_key(handle)] = (i, _text(uuid))

    def _drain_xids(self) -> tuple[tuple[XidEvent, ...], list[str]]:
        """The Xid events queued since the last drain. Waits 0 ms: takes what is there, never more."""
        if self._events is None:
            return (), []
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        xids: list[XidEvent] = []
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = wait(self._events, 0)
            except nvml.NVMLError as e:
                if _code(e) == _TIMEOUT:  # nothing (more) queued
                    return tuple(xids), []
                logger.debug("waiting for NVML events: %s", e)
                return tuple(xids), [f"Xid events: {e}"]
            if data.eventType & _XID_CRITICAL:
                index, uuid = self._event_gpus.get(_handle_key(data.device), (-1, ""))
                xids.append(XidEvent(index, uuid, int(data.eventData), self._clock()))
        logger.warning("over %d NVML events queued: the rest wait for the next sample", MAX_EVENTS_PER_SAMPLE)
        return tuple(xids), []

    def _read_gpus(self, errors: list[str]) -> tuple[GpuSample, ...]:
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            errors.append(f"NVML device count: {e}")
            return ()
        gpus = []
        for i in range(count):
            reader = _DeviceReader(nvml, i)
            gpus.append(reader.read())
            if reader.errors:
                errors.append(f"GPU {i}: {', '.join(reader.errors)}")
        return tuple(gpus)


_told: set[str] = set()  # the reasons open_gpu_probe fell back to Null for, each logged once


def open_gpu_probe(*, prefer: str = "auto", nvml: Any = None) -> GpuProbe:
    """The GPU probe to use. "auto": NVML when pynvml imports and nvmlInit succeeds, else the Null
    probe, whose readings carry the reason (logged once). "none": the Null probe. Blocking (it
    starts NVML): call it from the NVML executor or before the loop serves. `nvml` as NvmlGpuProbe's."""
    if prefer == "none":
        return NullGpuProbe()
    if prefer != "auto":
        raise ValueError(f"GPU probe {prefer!r}: expected 'auto' or 'none'")
    probe = NvmlGpuProbe(nvml)
    with probe._lock:
        error = probe._start()
    if not error:
        return probe
    probe.close()
    if error not in _told:
        _told.add(error)
        logger.warning("no GPU probe, GPU health is not sampled: %s", error)
    return NullGpuProbe(error)


def vram_zombies(reading: GpuReading, job_pids: AbstractSet[int]) -> list[tuple[GpuSample, GpuProcess]]:
    """The GPU processes that belong to no supervised job (`job_pids`: every pid of every job's
    process tree): the VRAM_ZOMBIE candidates, each with its GPU. Pure. NVML's pids are in the
    host's PID namespace: in a container that has its own, none of them are the jobs'."""
    return [(gpu, p) for gpu in reading.gpus for p in gpu.processes if p.pid not in job_pids]
