"""NVIDIA GPU sampler over NVML (the ``pynvml`` module of the nvidia-ml-py distribution).

Why NVML directly: it is what nvidia-smi and DCGM sit on, it needs no daemon, and its per-process
list is the only way to see *which* processes hold GPU memory (duplicate model copies). Hosts without
a GPU are the common case on CI and CPU inference boxes, so absence is a normal answer, not an error:
``sample()`` then returns ``GpuSnapshot(available=False, reason=<NVML's own words>)`` and rules that
need GPU signals report "not evaluated".

Behaviour that matters to the agent loop:

* ``nvmlInit`` runs lazily on the first sample and, after a failure, is retried at most every
  ``retry_s`` seconds (60 by default): a missing library costs one failed dlopen a minute, not one a second.
* A failure of one device (GPU fallen off the bus, Xid) drops that device only; the snapshot stays
  ``available`` and ``reason`` names what was lost. A failure of the device count (driver unloaded)
  makes the snapshot unavailable and schedules a re-init.
* Memory uses ``nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)`` (total/reserved/free/used). Where
  v2 fails (NotSupported, FunctionNotFound, ArgumentVersionMismatch on older drivers -- any NVMLError)
  it falls back to v1 for that device from then on; ``reserved_bytes`` stays None there.
* Nothing raises into the caller.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from collectors.records import GpuDevice, GpuProcess, GpuSnapshot

# NVML's "value not available" for an unsigned long long (usedGpuMemory under WDDM, some vGPUs).
_NOT_AVAILABLE = (1 << 64) - 1


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _bytes_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= _NOT_AVAILABLE:
        return None
    return value


class GpuSampler:
    """Lazily initialised NVML sampler. ``nvml`` injects a module object (tests); None imports ``pynvml``."""

    def __init__(
        self,
        nvml: ModuleType | Any | None = None,
        *,
        retry_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._retry_s = retry_s
        self._clock = clock
        self._initialized = False
        self._failed_at: float | None = None
        self._reason: str | None = None
        self._driver_version: str | None = None
        self._v1_only: set[int] = set()

    # ------------------------------------------------------------------ lifecycle

    def _module(self) -> Any | None:
        if self._nvml is None:
            try:
                import pynvml  # from nvidia-ml-py

                self._nvml = pynvml
            except Exception as exc:  # ImportError, or a broken install raising anything at import
                self._reason = f"pynvml (nvidia-ml-py) not importable: {exc}"
                return None
        return self._nvml

    def _ensure_init(self) -> bool:
        if self._initialized:
            return True
        now = self._clock()
        if self._failed_at is not None and now - self._failed_at < self._retry_s:
            return False
        nvml = self._module()
        if nvml is None:
            self._failed_at = now
            return False
        try:
            nvml.nvmlInit()
        except Exception as exc:  # pynvml.NVMLError subclasses, or anything a broken binding raises
            self._failed_at = now
            self._reason = _error_text(exc)
            return False
        self._initialized = True
        self._failed_at = None
        self._reason = None
        self._v1_only.clear()
        try:
            self._driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            self._driver_version = None
        return True

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``) if we initialised it. Never raises."""
        if self._initialized and self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._initialized = False

    # ------------------------------------------------------------------ sampling

    def sample(self, now: float | None = None) -> GpuSnapshot:
        ts = time.time() if now is None else float(now)
        try:
            return self._sample(ts)
        except Exception as exc:  # a binding bug must not reach the agent loop
            return GpuSnapshot(ts=ts, available=False, reason=f"GPU sampling failed: {_error_text(exc)}")

    def _sample(self, ts: float) -> GpuSnapshot:
        if not self._ensure_init():
            return GpuSnapshot(ts=ts, available=False, reason=self._reason or "NVML not initialised")
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            # The driver went away under us: drop the session and try a fresh nvmlInit later.
            reason = _error_text(exc)
            self.close()
            self._failed_at = self._clock()
            self._reason = reason
            return GpuSnapshot(ts=ts, available=False, reason=reason, driver_version=self._driver_version)
        snapshot = GpuSnapshot(ts=ts, available=True, driver_version=self._driver_version)
        problems: list[str] = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                device = GpuDevice(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                )
            except Exception as exc:
                problems.append(f"device {index}: {_error_text(exc)}")
                continue
            self._fill_memory(device, handle, problems)
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                device.utilization_gpu_ratio = _ratio(util.gpu)
                device.utilization_memory_ratio = _ratio(util.memory)
            except Exception as exc:
                if not _is(exc, nvml, "NVMLError_NotSupported"):
                    problems.append(f"device {index} utilization: {_error_text(exc)}")
            try:
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle) or ():
                    snapshot.processes.append(
                        GpuProcess(gpu_index=index, pid=int(proc.pid), used_bytes=_bytes_or_none(proc.usedGpuMemory))
                    )
            except Exception as exc:
                if not _is(exc, nvml, "NVMLError_NotSupported"):
                    problems.append(f"device {index} processes: {_error_text(exc)}")
            snapshot.devices.append(device)
        if problems:
            snapshot.reason = "; ".join(problems)
        return snapshot

    def _fill_memory(self, device: GpuDevice, handle: Any, problems: list[str]) -> None:
        nvml = self._nvml
        if device.index not in self._v1_only:
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                device.total_bytes = _bytes_or_none(mem.total)
                device.reserved_bytes = _bytes_or_none(mem.reserved)
                device.free_bytes = _bytes_or_none(mem.free)
                device.used_bytes = _bytes_or_none(mem.used)
                return
            except Exception as exc:
                if isinstance(exc, (TypeError, AttributeError)) or any(_is(exc, nvml, n) for n in _V2_UNSUPPORTED):
                    self._v1_only.add(device.index)  # old driver or binding: v1 from now on
                elif not isinstance(exc, _nvml_error(nvml)):
                    problems.append(f"device {device.index} memory: {_error_text(exc)}")
                    return
                # any other NVML error: try v1 this time, v2 again next time
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            device.total_bytes = _bytes_or_none(mem.total)
            device.free_bytes = _bytes_or_none(mem.free)
            device.used_bytes = _bytes_or_none(mem.used)
        except Exception as exc:
            problems.append(f"device {device.index} memory: {_error_text(exc)}")


_V2_UNSUPPORTED = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch")


def _ratio(percent: Any) -> float | None:
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 <= percent <= 100:
        return None
    return float(percent) / 100.0


def _nvml_error(nvml: Any) -> type[BaseException]:
    cls = getattr(nvml, "NVMLError", None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else Exception


def _is(exc: BaseException, nvml: Any, name: str) -> bool:
    cls = getattr(nvml, name, None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _error_text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    return text or type(exc).__name__


__all__ = ["GpuSampler"]
