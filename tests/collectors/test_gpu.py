"""GpuSampler: the real NVML library on this machine, and the success paths through a fake NVML module.

There is no NVIDIA GPU here, so everything past ``nvmlInit`` is exercised with a fake ``nvml`` module
object injected into the sampler -- a mock at the boundary, as the team rules allow for hardware that
cannot exist on CI. The fake returns the real binding's shapes: ``pynvml.c_nvmlMemory_v2_t`` /
``c_nvmlMemory_t`` / ``c_nvmlUtilization_t`` structs, ``nvmlFriendlyObject`` process entries, and the
real ``pynvml.NVMLError`` subclasses (``NVMLError(code)`` builds the subclass, as the binding does).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pynvml
import pytest

from collectors.gpu import GpuSampler
from collectors.records import GpuSnapshot, record_from_json

GIB = 1 << 30


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeDevice:
    uuid: str
    name: str
    total: int = 80 * GIB
    reserved: int = GIB // 2
    free: int = 60 * GIB
    used: int = 20 * GIB
    util: tuple[int, int] | None = (75, 40)
    procs: list[tuple[int, int | None]] = field(default_factory=list)
    v2_error: int | None = None  # NVML error code the v2 memory call raises
    handle_error: int | None = None


class FakeNvml:
    """Implements exactly the pynvml functions GpuSampler calls, with the binding's return shapes."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_ArgumentVersionMismatch = pynvml.NVMLError_ArgumentVersionMismatch
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, devices: list[FakeDevice], driver: str | bytes = "550.54.15") -> None:
        self.devices = devices
        self.driver = driver
        self.init_error: int | None = None
        self.count_error: int | None = None
        self.calls: dict[str, int] = {}

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self) -> None:
        self._call("init")
        if self.init_error is not None:
            raise nvml_error(self.init_error)

    def nvmlShutdown(self) -> None:
        self._call("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise nvml_error(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        device = self.devices[index]
        if device.handle_error is not None:
            raise nvml_error(device.handle_error)
        return device

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> bytes:
        return handle.name.encode()  # older bindings returned bytes

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> object:
        if version:
            self._call("memory_v2")
            assert version == pynvml.nvmlMemory_v2
            if handle.v2_error is not None:
                raise nvml_error(handle.v2_error)
            return pynvml.c_nvmlMemory_v2_t(
                version=version, total=handle.total, reserved=handle.reserved, free=handle.free, used=handle.used
            )
        self._call("memory_v1")
        return pynvml.c_nvmlMemory_t(total=handle.total, free=handle.free, used=handle.used + handle.reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> object:
        if handle.util is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(gpu=handle.util[0], memory=handle.util[1])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[object]:
        return [
            pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": used, "gpuInstanceId": 0, "computeInstanceId": 0})
            for pid, used in handle.procs
        ]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_real_library_on_this_machine() -> None:
    """The real pynvml: here (no driver) an unavailable snapshot carrying NVML's own words."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        expected_reason: str | None = str(exc)
    else:
        expected_reason = None
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    sampler = GpuSampler()
    try:
        snap = sampler.sample(now=5.0)
    finally:
        sampler.close()
    assert isinstance(snap, GpuSnapshot) and snap.ts == 5.0
    if expected_reason is not None:
        assert snap.available is False
        assert snap.reason == expected_reason
        assert "NVML" in snap.reason or "Driver" in snap.reason
        assert snap.devices == [] and snap.processes == []
    else:  # pragma: no cover - only on a GPU host
        assert snap.available is True and len(snap.devices) == count


def test_no_driver_here_says_library_not_found() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - only on a GPU host
        pynvml.nvmlShutdown()
        pytest.skip("an NVML library is installed on this host")
    snap = GpuSampler().sample()
    assert snap.available is False
    assert snap.reason == "NVML Shared Library Not Found"


def test_success_path_with_v2_and_v1_fallback() -> None:
    fake = FakeNvml(
        [
            FakeDevice("GPU-aaaa", "NVIDIA H100 80GB HBM3", procs=[(1234, 30 * GIB), (5678, None)]),
            FakeDevice(
                "GPU-bbbb",
                "Tesla T4",
                total=16 * GIB,
                free=10 * GIB,
                used=5 * GIB,
                reserved=GIB,
                v2_error=pynvml.NVML_ERROR_NOT_SUPPORTED,
                util=None,
                procs=[(42, 2 * GIB)],
            ),
        ]
    )
    sampler = GpuSampler(nvml=fake)
    snap = sampler.sample(now=7.0)
    assert snap.available is True and snap.reason is None
    assert snap.driver_version == "550.54.15"
    d0, d1 = snap.devices
    assert (d0.index, d0.uuid, d0.name) == (0, "GPU-aaaa", "NVIDIA H100 80GB HBM3")
    assert (d0.total_bytes, d0.reserved_bytes, d0.free_bytes, d0.used_bytes) == (80 * GIB, GIB // 2, 60 * GIB, 20 * GIB)
    assert (d0.utilization_gpu_ratio, d0.utilization_memory_ratio) == (0.75, 0.40)
    # v2 NotSupported: v1 numbers (its used includes reserved), reserved unknown, utilization unsupported.
    assert (d1.index, d1.name) == (1, "Tesla T4")
    assert (d1.total_bytes, d1.reserved_bytes, d1.free_bytes, d1.used_bytes) == (16 * GIB, None, 10 * GIB, 6 * GIB)
    assert d1.utilization_gpu_ratio is None and d1.utilization_memory_ratio is None
    procs = [(p.gpu_index, p.pid, p.used_bytes) for p in snap.processes]
    assert procs == [(0, 1234, 30 * GIB), (0, 5678, None), (1, 42, 2 * GIB)]
    assert record_from_json(snap.to_json()) == snap  # the recorder's JSON round trip keeps every field

    # The v2 failure is remembered: the next sample asks v1 directly for that device.
    v2_calls = fake.calls["memory_v2"]
    sampler.sample()
    assert fake.calls["memory_v2"] == v2_calls + 1
    assert fake.calls["init"] == 1  # initialised once


def test_a_failing_device_does_not_lose_the_others() -> None:
    fake = FakeNvml(
        [
            FakeDevice("GPU-0", "A"),
            FakeDevice("GPU-1", "B", handle_error=pynvml.NVML_ERROR_GPU_IS_LOST),
            FakeDevice("GPU-2", "C"),
        ]
    )
    snap = GpuSampler(nvml=fake).sample()
    assert snap.available is True
    assert [d.uuid for d in snap.devices] == ["GPU-0", "GPU-2"]
    assert [d.index for d in snap.devices] == [0, 2]
    assert snap.reason is not None and "device 1" in snap.reason and "GPU is lost" in snap.reason


def test_init_failure_is_retried_at_most_every_retry_interval() -> None:
    fake = FakeNvml([FakeDevice("GPU-0", "A")])
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    clock = FakeClock()
    sampler = GpuSampler(nvml=fake, retry_s=60.0, clock=clock)
    first = sampler.sample()
    assert first.available is False and first.reason == "Driver Not Loaded"
    clock.t += 30
    fake.init_error = None
    assert sampler.sample().available is False  # not retried yet
    assert fake.calls["init"] == 1
    clock.t += 31
    snap = sampler.sample()
    assert snap.available is True and len(snap.devices) == 1
    assert fake.calls["init"] == 2


def test_driver_lost_after_init_reinitialises_later() -> None:
    fake = FakeNvml([FakeDevice("GPU-0", "A")])
    clock = FakeClock()
    sampler = GpuSampler(nvml=fake, retry_s=60.0, clock=clock)
    assert sampler.sample().available is True
    fake.count_error = pynvml.NVML_ERROR_UNINITIALIZED
    lost = sampler.sample()
    assert lost.available is False and lost.reason == "Uninitialized"
    assert fake.calls["shutdown"] == 1
    fake.count_error = None
    clock.t += 61
    assert sampler.sample().available is True
    assert fake.calls["init"] == 2


def test_missing_binding_is_unavailable_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" raise ImportError
    snap = GpuSampler().sample()
    assert snap.available is False
    assert snap.reason is not None and "pynvml" in snap.reason


def test_close_shuts_nvml_down_once() -> None:
    fake = FakeNvml([])
    sampler = GpuSampler(nvml=fake)
    snap = sampler.sample()
    assert snap.available is True and snap.devices == []
    sampler.close()
    sampler.close()
    assert fake.calls["shutdown"] == 1


def test_a_binding_bug_never_raises() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("boom")

    snap = GpuSampler(nvml=Broken([])).sample()
    assert snap.available is False and snap.reason is not None and "boom" in snap.reason
