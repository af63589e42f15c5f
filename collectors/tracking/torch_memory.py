"""The CUDA caching allocator from inside the serving process, and CUDA OOM messages.

Why inside the process: NVML sees how much GPU memory a process holds, not how much of it torch
actually uses. ``reserved - allocated`` is the caching allocator's slack; when an OOM happens with
a large slack the memory was *fragmented*, not full (the ``allocator_fragmentation`` finding), and
the fix is ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, not a bigger GPU.

torch is optional and imported lazily: nothing here imports it at module import time, and without
torch (or without CUDA) :func:`torch_memory_snapshot` returns a snapshot whose fields are None.

:func:`parse_cuda_oom_message` is a pure function over the text of ``torch.OutOfMemoryError``.
Formats handled (all seen in real logs):

- PyTorch >= 2.1: ``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
  79.15 GiB of which 1.25 GiB is free. [Process 12345 has 40.00 GiB memory in use.]* [Including
  non-PyTorch memory, this process has 77.89 GiB memory in use.] Of the allocated memory 60.12 GiB
  is allocated by PyTorch, and 16.50 GiB is reserved by PyTorch but unallocated. ...``
  (2.1 spelled "total capacty"; sizes print as ``N bytes``, ``KiB``, ``MiB``, ``GiB``);
- PyTorch 1.x: ``CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.90 GiB total capacity;
  14.95 GiB already allocated; 9.75 MiB free; 15.07 GiB reserved in total by PyTorch)``.

``Process P has M memory in use`` entries (NVML's list of processes on the device, which may
include this process) go to ``other_processes``; several of them on one GPU is the fingerprint of
duplicate model copies.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from collectors.records import CudaOomError, TorchMemorySnapshot

_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3}  # fmt: skip
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|byte|b|kib|mib|gib|tib|kb|mb|gb)\b"

_OOM_MARKER = re.compile(r"CUDA out of memory", re.IGNORECASE)
_TRIED = re.compile(r"Tried to allocate " + _SIZE, re.IGNORECASE)
_GPU_NEW = re.compile(r"GPU (\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE + r" is free", re.IGNORECASE)
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use", re.IGNORECASE)
_THIS_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use", re.IGNORECASE)
_ALLOCATED_NEW = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", re.IGNORECASE)
_RESERVED_NEW = re.compile(_SIZE + r" is reserved by PyTorch but unallocated", re.IGNORECASE)
_GPU_OLD = re.compile(r"\(GPU (\d+);", re.IGNORECASE)
_TOTAL_OLD = re.compile(_SIZE + r" total capacity", re.IGNORECASE)
_ALLOCATED_OLD = re.compile(_SIZE + r" already allocated", re.IGNORECASE)
_FREE_OLD = re.compile(_SIZE + r" free", re.IGNORECASE)
_RESERVED_OLD = re.compile(_SIZE + r" reserved in total by PyTorch", re.IGNORECASE)


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit.lower()])


def _find(pattern: re.Pattern[str], text: str, group: int = 1) -> int | None:
    m = pattern.search(text)
    return _bytes(m.group(group), m.group(group + 1)) if m else None


def is_cuda_oom_message(text: str) -> bool:
    return bool(_OOM_MARKER.search(text or ""))


def parse_cuda_oom_message(text: str, *, ts: float | None = None, pid: int | None = None) -> CudaOomError | None:
    """Parse a CUDA OOM message into a :class:`CudaOomError` (sizes in bytes, None where absent).

    Returns None when the text is not a CUDA OOM message at all. Pure: no torch needed.
    """
    if not is_cuda_oom_message(text):
        return None
    err = CudaOomError(ts=time.time() if ts is None else ts, pid=pid)
    err.tried_to_allocate_bytes = _find(_TRIED, text)
    m = _GPU_NEW.search(text)
    if m:
        err.device = int(m.group(1))
        err.total_capacity_bytes = _bytes(m.group(2), m.group(3))
        err.free_bytes = _bytes(m.group(4), m.group(5))
        err.process_in_use_bytes = _find(_THIS_PROCESS, text)
        err.allocated_by_pytorch_bytes = _find(_ALLOCATED_NEW, text)
        reserved_unallocated = _find(_RESERVED_NEW, text)
        err.reserved_unallocated_bytes = reserved_unallocated
    else:  # the 1.x parenthesised format
        gpu = _GPU_OLD.search(text)
        err.device = int(gpu.group(1)) if gpu else None
        err.total_capacity_bytes = _find(_TOTAL_OLD, text)
        err.allocated_by_pytorch_bytes = _find(_ALLOCATED_OLD, text)
        err.free_bytes = _find(_FREE_OLD, text)
        reserved_total = _find(_RESERVED_OLD, text)
        if reserved_total is not None and err.allocated_by_pytorch_bytes is not None:
            err.reserved_unallocated_bytes = max(0, reserved_total - err.allocated_by_pytorch_bytes)
    err.other_processes = [{"pid": int(m.group(1)), "bytes": _bytes(m.group(2), m.group(3))} for m in _PROCESS.finditer(text)]
    return err


# --------------------------------------------------------------------------- live torch


def _cuda_torch() -> tuple[Any | None, str | None]:
    """``(torch, None)`` when torch with a usable CUDA device is importable, else ``(None, reason)``."""
    try:
        import torch  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken install raising anything
        return None, f"torch not importable: {type(exc).__name__}"
    try:
        if not torch.cuda.is_available():
            return None, "torch.cuda.is_available() is False"
    except Exception as exc:
        return None, f"torch.cuda unusable: {exc}"
    return torch, None


def torch_cuda_status() -> str | None:
    """None when torch CUDA memory stats can be read here, else the reason they cannot."""
    return _cuda_torch()[1]


def torch_memory_snapshot(device: int = 0, *, ts: float | None = None) -> TorchMemorySnapshot:
    """``torch.cuda.memory_stats(device)`` summarised; every size None when torch/CUDA is absent.

    Costs a few microseconds (the allocator keeps these counters); safe to call per batch.
    """
    snap = TorchMemorySnapshot(ts=time.time() if ts is None else ts, device=int(device), pid=os.getpid())
    torch, _reason = _cuda_torch()
    if torch is None:
        return snap
    try:
        stats = torch.cuda.memory_stats(device)
    except Exception:
        return snap

    def stat(key: str) -> int | None:
        value = stats.get(key)
        return int(value) if isinstance(value, (int, float)) else None

    snap.allocated_bytes = stat("allocated_bytes.all.current")
    snap.reserved_bytes = stat("reserved_bytes.all.current")
    snap.peak_allocated_bytes = stat("allocated_bytes.all.peak")
    snap.peak_reserved_bytes = stat("reserved_bytes.all.peak")
    snap.num_ooms = stat("num_ooms")
    snap.num_alloc_retries = stat("num_alloc_retries")
    return snap


@contextlib.contextmanager
def capture_cuda_oom(sink: Callable[[CudaOomError], Any] | None = None) -> Iterator[None]:
    """Record a CUDA OOM raised inside the block (via ``sink``), then re-raise it unchanged.

    Matches any exception whose message is a CUDA OOM (``torch.OutOfMemoryError``, or a
    RuntimeError from older torch / a wrapping library). ``sink`` is usually
    ``tracker.record_cuda_oom``; a failing sink never replaces the original exception.
    """
    try:
        yield
    except Exception as exc:
        try:
            parsed = parse_cuda_oom_message(str(exc), pid=os.getpid())
            if parsed is not None and sink is not None:
                sink(parsed)
        except Exception:  # never mask the application's exception with ours
            pass
        raise
