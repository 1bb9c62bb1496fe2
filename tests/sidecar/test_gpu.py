"""The GPU probe: recorded readings replayed, the NVML probe against a stand-in for pynvml (there is
no GPU here), open_gpu_probe on this machine as it is, and one test for a real GPU (--run-gpu)."""

from __future__ import annotations

import ctypes
import inspect
import logging
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from sidecar.gpu import (
    MAX_EVENTS_PER_SAMPLE,
    GpuProbe,
    GpuProcess,
    GpuReading,
    GpuSample,
    NullGpuProbe,
    NvmlGpuProbe,
    ReplayGpuProbe,
    XidEvent,
    open_gpu_probe,
    reading_from_dict,
    vram_zombies,
)

DATA = Path(__file__).resolve().parent / "data" / "nvml"
GIB = 1 << 30
CORRECTED, UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
SINGLE_BIT = pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
DOUBLE_BIT = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR


# ---------------------------------------------------------------- recorded readings, replayed


def test_replay_normal_utilization_then_the_last_reading_repeats() -> None:
    probe: GpuProbe = ReplayGpuProbe(DATA / "normal.json")
    busy, idle, again = probe.sample(), probe.sample(), probe.sample()
    assert (busy.source, busy.error, busy.xids) == ("replay", "", ())
    assert [g.utilization_percent for g in busy.gpus] == [97, 95]
    gpu0 = busy.gpus[0]
    assert gpu0.name == "NVIDIA H100 80GB HBM3"
    assert (gpu0.memory_used_bytes, gpu0.memory_total_bytes) == (72478523392, 85520809984)
    assert (gpu0.power_w, gpu0.power_limit_w, gpu0.temperature_c) == (512.337, 700.0, 61)
    assert gpu0.processes == (GpuProcess(4242, 71940702208),)
    assert not any(g.thermal_throttle or g.power_throttle or g.throttle_reasons for g in busy.gpus)
    # Idle clocks are not a throttle the sampler should care about.
    assert [g.throttle_reasons for g in idle.gpus] == [("gpu_idle",), ("gpu_idle",)]
    assert not any(g.thermal_throttle or g.power_throttle for g in idle.gpus)
    assert again == idle
    probe.close()


def test_replay_power_cap_is_a_power_throttle_not_a_thermal_one() -> None:
    (gpu,) = ReplayGpuProbe(DATA / "power_cap.json").sample().gpus
    assert gpu.throttle_reasons == ("sw_power_cap",)
    assert gpu.power_throttle is True
    assert gpu.thermal_throttle is False
    assert gpu.power_w is not None and gpu.power_limit_w is not None
    assert gpu.power_limit_w - gpu.power_w < 1.0
    assert gpu.sm_clock_mhz is not None and gpu.sm_clock_max_mhz is not None
    assert gpu.sm_clock_mhz < gpu.sm_clock_max_mhz


@pytest.mark.parametrize(
    ("reasons", "thermal", "power"),
    [
        (("sw_thermal_slowdown",), True, False),
        (("hw_thermal_slowdown", "hw_slowdown"), True, False),
        (("hw_power_brake_slowdown", "hw_slowdown"), False, True),
        (("hw_slowdown",), False, False),  # heat, brake or a P-state change: NVML does not say
        (("sw_power_cap", "sw_thermal_slowdown"), True, True),
    ],
)
def test_throttle_properties(reasons: tuple[str, ...], thermal: bool, power: bool) -> None:
    gpu = GpuSample(0, throttle_reasons=reasons)
    assert (gpu.thermal_throttle, gpu.power_throttle) == (thermal, power)


def test_replay_xid_79_is_returned_once() -> None:
    probe = ReplayGpuProbe(DATA / "xid79.json")
    readings = [probe.sample() for _ in range(5)]
    assert [len(r.xids) for r in readings] == [0, 1, 0, 0, 0]
    (xid,) = readings[1].xids
    assert xid == XidEvent(1, "GPU-1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d", 79, 1767225600123456789)
    lost = readings[1].gpus[1]
    assert lost == GpuSample(1)  # only its index: NVML answers nothing for a GPU off the bus
    assert lost.memory_total_bytes is None and lost.name == ""
    assert "GPU 1" in readings[1].error
    assert readings[4].gpus == readings[2].gpus


def test_replay_vram_zombie_found_and_job_pids_ignored() -> None:
    reading = ReplayGpuProbe(DATA / "vram_zombie.json").sample()
    zombies = vram_zombies(reading, {4242, 4250})
    assert [(gpu.index, proc.pid, proc.used_memory_bytes) for gpu, proc in zombies] == [(1, 3131, 20 * GIB)]
    assert vram_zombies(reading, frozenset({4242, 4250, 3131})) == []
    assert sorted(p.pid for _, p in vram_zombies(reading, set())) == [3131, 4242, 4250]
    assert vram_zombies(GpuReading((), (), "none"), {1}) == []


def test_replay_not_supported_fields_are_none_never_zero() -> None:
    (gpu,) = ReplayGpuProbe(DATA / "not_supported.json").sample().gpus
    unsupported = (
        "utilization_percent",
        "power_w",
        "power_limit_w",
        "ecc_corrected",
        "ecc_uncorrected",
        "retired_pages",
        "remapped_rows_pending",
        "remapped_rows_failed",
    )
    assert {name: getattr(gpu, name) for name in unsupported} == dict.fromkeys(unsupported)
    assert gpu.processes == (GpuProcess(777, None),)
    assert (gpu.temperature_c, gpu.memory_total_bytes) == (38, 25757220864)  # what it does support


def test_replay_from_dicts_and_a_missing_field_is_none() -> None:
    probe = ReplayGpuProbe(
        [
            {
                "gpus": [{"index": 0, "uuid": "GPU-a", "name": "x"}],
                "xids": [{"gpu_index": 0, "uuid": "GPU-a", "xid": 48, "at_ns": 5}],
            },
        ]
    )
    first, second = probe.sample(), probe.sample()
    assert first.xids == (XidEvent(0, "GPU-a", 48, 5),) and second.xids == ()
    assert first.gpus == second.gpus == (GpuSample(0, "GPU-a", "x"),)
    assert first.gpus[0].ecc_uncorrected is None and first.gpus[0].processes == ()


@pytest.mark.parametrize(
    "bad",
    [
        {"gpus": [{"index": 0, "utilisation_percent": 5}]},  # a typo would pass as "not supported"
        {"gpus": [{"index": 0, "throttle_reasons": ["power_cap"]}]},
        {"gpus": [{"index": 0, "processes": [{"pid": 1, "memory": 5}]}]},
        {"gpus": [], "xid": []},
    ],
)
def test_a_recording_with_unknown_names_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="unknown"):
        reading_from_dict(bad)


def test_an_empty_recording_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ReplayGpuProbe([])


# ---------------------------------------------------------------- NVML, against a stand-in


def h100(index: int) -> dict[str, Any]:
    """What a healthy GPU answers, by pynvml function name (a dict: by its first argument after the
    handle; an exception: raised)."""
    return {
        "nvmlDeviceGetUUID": f"GPU-{index}",
        "nvmlDeviceGetName": b"NVIDIA H100 80GB HBM3",  # older pynvml gives bytes
        "nvmlDeviceGetMemoryInfo": SimpleNamespace(total=85520809984, used=1 * GIB, free=0),
        "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=97, memory=41),
        "nvmlDeviceGetTemperature": {pynvml.NVML_TEMPERATURE_GPU: 61},
        "nvmlDeviceGetPowerUsage": 512_337,  # milliwatts
        "nvmlDeviceGetEnforcedPowerLimit": 700_000,
        "nvmlDeviceGetClockInfo": {pynvml.NVML_CLOCK_SM: 1755},
        "nvmlDeviceGetMaxClockInfo": {pynvml.NVML_CLOCK_SM: 1980},
        "nvmlDeviceGetCurrentClocksEventReasons": 0,
        "nvmlDeviceGetCurrentClocksThrottleReasons": 0,
        "nvmlDeviceGetTotalEccErrors": {CORRECTED: 0, UNCORRECTED: 0},
        "nvmlDeviceGetRetiredPages": {SINGLE_BIT: [], DOUBLE_BIT: []},
        "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
        "nvmlDeviceGetComputeRunningProcesses": [],
        "nvmlDeviceGetGraphicsRunningProcesses": [],
        "register": None,  # nvmlDeviceRegisterEvents
    }


class FakeNvml:
    """Stands in for the pynvml module: its constants and exception classes are pynvml's own, its
    functions answer from `gpus` and record how they were called. Device handles are real ctypes
    pointers, and an event names its GPU by another pointer object to the same address, as NVML's do."""

    def __init__(self, gpus: list[dict[str, Any]], *, init_errors: Sequence[Exception] = ()) -> None:
        self.gpus = gpus
        self.init_errors = iter(init_errors)  # raised by successive nvmlInit calls, then it succeeds
        self.missing: set[str] = set()  # functions this "binding" lacks
        self.count_error: Exception | None = None
        self.events: deque[tuple[int, int]] = deque()  # (GPU index, Xid) queued in NVML
        self.endless_events = False
        self.wait_error: Exception | None = None  # raised once the queue is empty, for the timeout
        self.waits: list[int] = []  # the timeout of each nvmlEventSetWait_v2 call
        self.calls: list[tuple[str, int, tuple[Any, ...]]] = []
        self.registered: list[tuple[int, int]] = []
        self.freed: list[object] = []
        self.inits = self.shutdowns = 0
        self._buffers = [ctypes.create_string_buffer(8) for _ in gpus]
        self._by_address = {ctypes.addressof(b): i for i, b in enumerate(self._buffers)}
        self._event_set = object()

    def __getattr__(self, name: str) -> Any:
        if name in self.missing:
            raise AttributeError(name)
        if name.startswith("nvmlDevice") and name in self.gpus[0]:
            return lambda handle, *args: self._answer(name, handle, *args)
        value = getattr(pynvml, name)
        if inspect.isfunction(value):  # never reach the real library from a test
            raise AttributeError(f"the fake has no {name}")
        return value

    def handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.addressof(self._buffers[index]), pynvml.c_nvmlDevice_t)

    def index_of(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        assert address is not None
        return self._by_address[address]

    def _answer(self, name: str, handle: Any, *args: Any) -> Any:
        index = self.index_of(handle)
        self.calls.append((name, index, args))
        value = self.gpus[index][name]
        if isinstance(value, dict):
            value = value[args[0]]
        if isinstance(value, BaseException):
            raise value
        return value

    def nvmlInit(self) -> None:
        self.inits += 1
        error = next(self.init_errors, None)
        if error is not None:
            raise error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        error = self.gpus[index].get("handle")
        if error is not None:
            raise error
        return self.handle(index)

    def nvmlEventSetCreate(self) -> object:
        return self._event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: object) -> None:
        assert event_set is self._event_set
        error = self.gpus[self.index_of(handle)]["register"]
        if error is not None:
            raise error
        self.registered.append((self.index_of(handle), types))

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        assert event_set is self._event_set
        self.waits.append(timeout_ms)
        if self.endless_events:
            return SimpleNamespace(
                device=self.handle(0), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=13
            )
        if not self.events:
            raise self.wait_error or pynvml.NVMLError_Timeout()
        index, xid = self.events.popleft()
        return SimpleNamespace(
            device=self.handle(index), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid
        )

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.freed.append(event_set)


class NotSupportedByValue(pynvml.NVMLError):  # type: ignore[misc]  # pynvml is untyped
    """An NVMLError that says NOT_SUPPORTED by its value alone, not by its class."""


def ticks() -> Callable[[], int]:
    it = iter(range(1000, 2000))
    return lambda: next(it)


def test_nvml_reads_every_field_in_the_right_units() -> None:
    gpu = h100(0)
    gpu["nvmlDeviceGetCurrentClocksEventReasons"] = 0x4 | 0x40 | 0x200  # cap, hw thermal, board limit
    gpu["nvmlDeviceGetTotalEccErrors"] = {CORRECTED: 12, UNCORRECTED: 1}
    gpu["nvmlDeviceGetRetiredPages"] = {SINGLE_BIT: [0x1000, 0x2000], DOUBLE_BIT: [0x3000]}
    gpu["nvmlDeviceGetRemappedRows"] = (3, 1, 1, 0)
    gpu["nvmlDeviceGetComputeRunningProcesses"] = [
        SimpleNamespace(pid=10, usedGpuMemory=None),
        SimpleNamespace(pid=11, usedGpuMemory=2 * GIB),
    ]
    # 10 and 11 again (compute and graphics), 10 with its memory this time; 12 graphics only.
    gpu["nvmlDeviceGetGraphicsRunningProcesses"] = [
        SimpleNamespace(pid=10, usedGpuMemory=GIB),
        SimpleNamespace(pid=11, usedGpuMemory=None),  # says less than the compute list did
        SimpleNamespace(pid=12, usedGpuMemory=(1 << 64) - 1),
    ]
    nvml = FakeNvml([gpu])
    reading = NvmlGpuProbe(nvml).sample()
    assert (reading.source, reading.error, reading.xids) == ("nvml", "", ())
    assert reading.gpus == (
        GpuSample(
            index=0,
            uuid="GPU-0",
            name="NVIDIA H100 80GB HBM3",
            utilization_percent=97,
            memory_used_bytes=GIB,
            memory_total_bytes=85520809984,
            temperature_c=61,
            power_w=512.337,
            power_limit_w=700.0,
            sm_clock_mhz=1755,
            sm_clock_max_mhz=1980,
            throttle_reasons=("sw_power_cap", "hw_thermal_slowdown"),
            ecc_corrected=12,
            ecc_uncorrected=1,
            retired_pages=3,
            remapped_rows_pending=True,
            remapped_rows_failed=False,
            processes=(GpuProcess(10, GIB), GpuProcess(11, 2 * GIB), GpuProcess(12, None)),
        ),
    )
    ecc_args = {args for name, _, args in nvml.calls if name == "nvmlDeviceGetTotalEccErrors"}
    assert ecc_args == {(CORRECTED, pynvml.NVML_VOLATILE_ECC), (UNCORRECTED, pynvml.NVML_VOLATILE_ECC)}
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in {name for name, _, _ in nvml.calls}


def test_nvml_not_supported_is_none_never_zero() -> None:
    gpu = h100(0)
    for name in (
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrentClocksEventReasons",
    ):
        gpu[name] = pynvml.NVMLError_NotSupported()
    gpu["nvmlDeviceGetTotalEccErrors"] = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    gpu["nvmlDeviceGetTemperature"] = NotSupportedByValue(pynvml.NVML_ERROR_NOT_SUPPORTED)
    gpu["nvmlDeviceGetMaxClockInfo"] = pynvml.NVMLError_FunctionNotFound()  # a driver older than the call
    reading = NvmlGpuProbe(FakeNvml([gpu])).sample()
    (s,) = reading.gpus
    for name in (
        "utilization_percent",
        "power_w",
        "power_limit_w",
        "retired_pages",
        "remapped_rows_pending",
        "remapped_rows_failed",
        "ecc_corrected",
        "ecc_uncorrected",
        "temperature_c",
        "sm_clock_max_mhz",
    ):
        assert getattr(s, name) is None, name
    assert s.throttle_reasons == ()
    assert (s.memory_total_bytes, s.sm_clock_mhz) == (85520809984, 1755)  # the supported ones still read
    assert reading.error == ""  # "not supported" is an answer, not a failure


@pytest.mark.parametrize("how", ["binding lacks it", "driver lacks it"])
def test_throttle_reasons_fall_back_to_the_older_call(how: str) -> None:
    gpu = h100(0)
    gpu["nvmlDeviceGetCurrentClocksThrottleReasons"] = 0x20 | 0x1
    nvml = FakeNvml([gpu])
    if how == "binding lacks it":
        nvml.missing.add("nvmlDeviceGetCurrentClocksEventReasons")
    else:
        gpu["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVMLError_FunctionNotFound()
    reading = NvmlGpuProbe(nvml).sample()
    assert reading.gpus[0].throttle_reasons == ("gpu_idle", "sw_thermal_slowdown")
    assert reading.gpus[0].thermal_throttle and reading.error == ""


def test_xids_are_drained_without_waiting_and_returned_once() -> None:
    nvml = FakeNvml([h100(0), h100(1)])
    probe = NvmlGpuProbe(nvml, clock=ticks())
    first = probe.sample()
    assert first.xids == ()
    assert nvml.registered == [
        (0, pynvml.nvmlEventTypeXidCriticalError),
        (1, pynvml.nvmlEventTypeXidCriticalError),
    ]
    nvml.events.extend([(1, 79), (0, 48)])
    second, third = probe.sample(), probe.sample()
    assert second.xids == (XidEvent(1, "GPU-1", 79, 1000), XidEvent(0, "GPU-0", 48, 1001))
    assert third.xids == ()
    assert len(second.gpus) == 2 and second.error == ""
    # One wait per event and one that timed out, per sample; every one with a 0 ms timeout.
    assert nvml.waits == [0] * (1 + 3 + 1)


@pytest.mark.timeout(10)  # an unbounded drain would hang here
def test_an_endless_stream_of_events_does_not_hold_the_sample() -> None:
    nvml = FakeNvml([h100(0)])
    nvml.endless_events = True
    reading = NvmlGpuProbe(nvml).sample()
    assert len(reading.xids) == MAX_EVENTS_PER_SAMPLE
    assert len(nvml.waits) == MAX_EVENTS_PER_SAMPLE and set(nvml.waits) == {0}
    assert reading.gpus[0].uuid == "GPU-0"


def test_a_failing_event_wait_keeps_the_xids_taken_and_says_why() -> None:
    nvml = FakeNvml([h100(0), h100(1)])
    probe = NvmlGpuProbe(nvml, clock=ticks())
    nvml.events.append((1, 79))
    nvml.wait_error = pynvml.NVMLError_GpuIsLost()
    reading = probe.sample()
    assert reading.xids == (XidEvent(1, "GPU-1", 79, 1000),)
    assert reading.error == "Xid events: GPU is lost"
    assert len(reading.gpus) == 2


def test_a_gpu_that_cannot_register_for_events_is_still_read() -> None:
    gpus = [h100(0), h100(1)]
    gpus[0]["register"] = pynvml.NVMLError_NotSupported()
    nvml = FakeNvml(gpus)
    probe = NvmlGpuProbe(nvml, clock=ticks())
    probe.sample()
    assert nvml.registered == [(1, pynvml.nvmlEventTypeXidCriticalError)]
    nvml.events.append((1, 94))
    reading = probe.sample()
    assert reading.xids == (XidEvent(1, "GPU-1", 94, 1000),)
    assert [g.uuid for g in reading.gpus] == ["GPU-0", "GPU-1"]


def test_nvml_init_failure_gives_an_empty_reading_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    failures = [pynvml.NVMLError_DriverNotLoaded(), pynvml.NVMLError_DriverNotLoaded()]
    nvml = FakeNvml([h100(0)], init_errors=failures)
    probe = NvmlGpuProbe(nvml)
    with caplog.at_level(logging.WARNING, logger="sidecar.gpu"):
        first, second = probe.sample(), probe.sample()
    for reading in (first, second):
        assert (reading.gpus, reading.xids, reading.source) == ((), (), "nvml")
        assert reading.error == "NVML: Driver Not Loaded"
    assert nvml.calls == [] and nvml.inits == 2
    assert [r.getMessage() for r in caplog.records] == ["no GPU readings: NVML: Driver Not Loaded"]
    # The driver came up: the next sample starts NVML and reads.
    third = probe.sample()
    assert third.error == "" and [g.uuid for g in third.gpus] == ["GPU-0"]
    probe.close()
    assert nvml.shutdowns == 1


def test_one_gpu_failing_does_not_lose_the_others() -> None:
    gpus = [h100(0), h100(1), h100(2)]
    gpus[0]["handle"] = pynvml.NVMLError_GpuIsLost()
    gpus[2]["nvmlDeviceGetMemoryInfo"] = pynvml.NVMLError_Unknown()
    gpus[2]["nvmlDeviceGetPowerUsage"] = pynvml.NVMLError_GpuIsLost()
    reading = NvmlGpuProbe(FakeNvml(gpus)).sample()
    lost, fine, partial = reading.gpus
    assert lost == GpuSample(0)
    assert (fine.uuid, fine.memory_total_bytes, fine.power_w) == ("GPU-1", 85520809984, 512.337)
    assert (partial.uuid, partial.memory_total_bytes, partial.power_w) == ("GPU-2", None, None)
    assert partial.temperature_c == 61
    assert reading.error == ("GPU 0: handle: GPU is lost; GPU 2: memory: Unknown Error, power: GPU is lost")


def test_a_failed_device_count_gives_no_gpus_and_says_why() -> None:
    nvml = FakeNvml([h100(0)])
    nvml.count_error = pynvml.NVMLError_Unknown()
    reading = NvmlGpuProbe(nvml).sample()
    assert reading.gpus == ()
    assert "Unknown Error" in reading.error


def test_close_frees_the_event_set_and_shuts_nvml_down_once() -> None:
    nvml = FakeNvml([h100(0)])
    probe = NvmlGpuProbe(nvml)
    probe.sample()
    probe.close()
    probe.close()
    assert (len(nvml.freed), nvml.shutdowns) == (1, 1)
    calls = len(nvml.calls)
    after = probe.sample()
    assert after.gpus == () and "closed" in after.error
    assert len(nvml.calls) == calls and nvml.inits == 1

    never_started = FakeNvml([h100(0)])
    NvmlGpuProbe(never_started).close()
    assert (never_started.inits, never_started.shutdowns, never_started.freed) == (0, 0, [])


# ---------------------------------------------------------------- open_gpu_probe


def test_open_gpu_probe_auto_on_this_machine_reads_no_gpus() -> None:
    probe = open_gpu_probe()
    try:
        if isinstance(probe, NvmlGpuProbe):
            pytest.skip("NVML started here: this test is for a machine without an NVIDIA driver")
        reading = probe.sample()
    finally:
        probe.close()
    assert isinstance(probe, NullGpuProbe)
    assert (reading.gpus, reading.xids, reading.source) == ((), (), "none")
    assert reading.error.startswith(("NVML: ", "pynvml is not installed"))


def test_open_gpu_probe_none_and_unknown() -> None:
    assert open_gpu_probe(prefer="none").sample() == GpuReading((), (), "none")
    with pytest.raises(ValueError, match="'nvidia'"):
        open_gpu_probe(prefer="nvidia")


class OnceOnlyError(pynvml.NVMLError):  # type: ignore[misc]
    """An init failure no other test gives, so that the log-once check sees only its own."""

    def __str__(self) -> str:
        return "the log-once test's own failure"


def test_open_gpu_probe_auto_picks_nvml_when_it_starts_else_null_with_the_reason_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = FakeNvml([h100(0)])
    probe = open_gpu_probe(nvml=up)
    assert isinstance(probe, NvmlGpuProbe) and up.inits == 1
    assert [g.uuid for g in probe.sample().gpus] == ["GPU-0"] and up.inits == 1
    probe.close()

    with caplog.at_level(logging.WARNING, logger="sidecar.gpu"):
        probes = [
            open_gpu_probe(nvml=FakeNvml([h100(0)], init_errors=[OnceOnlyError(999)])) for _ in range(2)
        ]
    for p in probes:
        assert isinstance(p, NullGpuProbe)
        assert p.sample() == GpuReading((), (), "none", "NVML: the log-once test's own failure")
    assert [r.getMessage() for r in caplog.records] == [
        "no GPU probe, GPU health is not sampled: NVML: the log-once test's own failure"
    ]


# ---------------------------------------------------------------- a real GPU


@pytest.mark.gpu
def test_real_nvml_reads_the_gpus() -> None:
    probe = NvmlGpuProbe()
    try:
        first, second = probe.sample(), probe.sample()
    finally:
        probe.close()
    assert (first.source, first.error) == ("nvml", "")
    assert first.gpus, "NVML started but listed no GPU"
    for gpu in first.gpus:
        assert gpu.name and gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.memory_total_bytes is not None and gpu.memory_total_bytes > GIB
        assert gpu.memory_used_bytes is not None and gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.power_w is None or 0 < gpu.power_w < 2000  # watts, not milliwatts
    assert [g.uuid for g in second.gpus] == [g.uuid for g in first.gpus]
