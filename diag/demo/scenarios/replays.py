"""Incident classes this machine cannot produce live (no NVIDIA GPU): recorded replays built from real shapes.

``gpu_oom`` and ``allocator_fragmentation`` need a CUDA device. Each gets a replay fixture instead
of a live scenario, built -- deterministically, by :func:`build` -- from:

- a real recording as the base: the ``healthy`` scenario's fixture (host, cgroup, process, request,
  batch and config records of a real run of the reference backend), so everything that is not GPU
  is what a real service on a real host looks like;
- NVML samples in the shape ``collectors.gpu.GpuSampler`` writes them from ``nvmlDeviceGetMemoryInfo``,
  ``nvmlDeviceGetUtilizationRates`` and ``nvmlDeviceGetComputeRunningProcesses`` (an A10G: 23028 MiB
  total as NVML reports it, 24 GB card);
- ``torch.cuda.memory_stats`` summaries in the shape ``collectors.tracking.torch_memory`` writes
  them (allocated/reserved current and peak, ``num_ooms``, ``num_alloc_retries``);
- CUDA OOM errors made by running the product's own parser (``parse_cuda_oom_message``) over
  messages in PyTorch's >= 2.1 wording (the ``CUDA out of memory. Tried to allocate ...`` text the
  caching allocator raises), so a change to the parser or the message shape shows up here.

The numbers tell the two stories apart the way real incidents do: ``gpu-oom`` -- the request is
bigger than free + PyTorch's cached slack, and a second process holds a third of the card;
``allocator-fragmentation`` -- the request is smaller than what PyTorch holds reserved but
unallocated (the fix is ``expandable_segments``, not a bigger GPU), with allocator retries climbing.

Regenerate with ``python -m diag.demo.scenarios.replays tests/fixtures/scenarios``; the tests check
that the committed fixtures are exactly what :func:`build` makes.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.records import GpuDevice, GpuProcess, GpuSnapshot, TorchMemorySnapshot
from collectors.tracking.torch_memory import parse_cuda_oom_message

GiB = 1 << 30
MiB = 1 << 20
A10G_TOTAL = 23028 * MiB  # what NVML reports as total for a 24 GB A10G
A10G_NVML_RESERVED = 493 * MiB  # driver/firmware reservation that nvmlDeviceGetMemoryInfo_v2 reports separately
BASE = "healthy"  # the real recording the GPU records are laid over
DRIVER = "550.54.15"
GPU_KINDS = frozenset({"gpu", "torch_memory", "cuda_oom"})
UUID = "GPU-5d0c0a44-8f3e-2a1b-9c7d-3e4f5a6b7c8d"


@dataclass(frozen=True)
class Replay:
    name: str
    expected: str  # the incident class the analysis must conclude
    summary: str
    build: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def oom_message(*, tried: int, total: int, free: int, procs: list[tuple[int, int]], this: int, alloc: int, unalloc: int) -> str:
    """The text of a ``torch.OutOfMemoryError`` as PyTorch >= 2.1's caching allocator formats it."""
    head = (
        f"CUDA out of memory. Tried to allocate {_gib(tried)}. "
        f"GPU 0 has a total capacity of {_gib(total)} of which {_gib(free)} is free. "
    )
    others = "".join(f"Process {pid} has {_gib(used)} memory in use. " for pid, used in procs)
    tail = (
        f"Including non-PyTorch memory, this process has {_gib(this)} memory in use. Of the allocated memory {_gib(alloc)} "
        f"is allocated by PyTorch, and {_gib(unalloc)} is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    return head + others + tail


def _service_pid(base: list[dict[str, Any]]) -> int:
    """The first serving worker of the base recording (its config record's pid)."""
    pids = sorted(r["pid"] for r in base if r["kind"] == "config" and r.get("pid"))
    if not pids:
        raise ValueError("the base recording has no config record with a pid")
    return int(pids[0])


def _ticks(base: list[dict[str, Any]]) -> list[float]:
    """The agent's sample times in the base recording (one per host sample)."""
    return sorted({float(r["ts"]) for r in base if r["kind"] == "host"})


def _lay_over(
    base: list[dict[str, Any]],
    *,
    pid: int,
    other: tuple[int, int] | None,
    torch_at: Callable[[float], tuple[int, int, int, int]],
    ooms: list[tuple[float, str]],
) -> list[dict[str, Any]]:
    """The base records plus NVML and torch samples at every agent tick and the parsed OOM errors.

    ``torch_at(frac)`` gives (allocated, reserved, num_ooms, num_alloc_retries) at a fraction of the window.
    """
    ticks = _ticks(base)
    t0, t1 = ticks[0], ticks[-1]
    out = [r for r in base if r["kind"] not in GPU_KINDS]  # the base host had no GPU: its "NVML not found" samples go
    peak_a = peak_r = 0
    for i, ts in enumerate(ticks):
        frac = (ts - t0) / max(t1 - t0, 1e-9)
        allocated, reserved, n_ooms, retries = torch_at(frac)
        peak_a, peak_r = max(peak_a, allocated), max(peak_r, reserved)
        context = 412 * MiB  # the CUDA context: in NVML's per-process figure, not in torch's counters
        own = reserved + context
        used = own + (other[1] if other else 0) + A10G_NVML_RESERVED
        procs = [GpuProcess(gpu_index=0, pid=pid, used_bytes=own)]
        if other:
            procs.append(GpuProcess(gpu_index=0, pid=other[0], used_bytes=other[1]))
        device = GpuDevice(
            index=0, uuid=UUID, name="NVIDIA A10G", total_bytes=A10G_TOTAL, used_bytes=used, free_bytes=A10G_TOTAL - used,
            reserved_bytes=A10G_NVML_RESERVED, utilization_gpu_ratio=round(0.55 + 0.4 * (i % 7) / 7, 2),
            utilization_memory_ratio=round(0.3 + 0.3 * (i % 5) / 5, 2),
        )  # fmt: skip
        out.append(GpuSnapshot(ts=ts, available=True, driver_version=DRIVER, devices=[device], processes=procs).to_dict())
        out.append(
            TorchMemorySnapshot(
                ts=ts + 0.25, device=0, allocated_bytes=allocated, reserved_bytes=reserved, peak_allocated_bytes=peak_a,
                peak_reserved_bytes=peak_r, num_ooms=n_ooms, num_alloc_retries=retries, pid=pid,
            ).to_dict()
        )  # fmt: skip
    for frac, text in ooms:
        err = parse_cuda_oom_message(text, ts=round(t0 + frac * (t1 - t0), 3), pid=pid)
        if err is None:
            raise ValueError(f"not a CUDA OOM message: {text[:80]}")
        out.append(err.to_dict())
    out.sort(key=lambda r: (float(r["ts"]), r["kind"]))
    return out


def build_gpu_oom(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The card is really full: a second process holds 7 GiB; a 2.5 GiB request meets 0.6 GiB free and 0.2 GiB slack."""
    pid, other = _service_pid(base), (48213, 7 * GiB)
    reserved_full = 14 * GiB + 512 * MiB

    def torch_at(frac: float) -> tuple[int, int, int, int]:
        allocated = int((12.6 + 1.7 * min(frac / 0.6, 1.0)) * GiB)
        reserved = min(max(allocated + 200 * MiB, 13 * GiB), reserved_full)
        return allocated, reserved, (1 if frac >= 0.62 else 0) + (1 if frac >= 0.81 else 0), 2 if frac >= 0.6 else 0

    def message(tried: int) -> str:
        alloc, unalloc = reserved_full - 200 * MiB, 200 * MiB
        this = reserved_full + 412 * MiB
        free = A10G_TOTAL - this - other[1] - A10G_NVML_RESERVED
        return oom_message(tried=tried, total=A10G_TOTAL, free=free, procs=[(other[0], other[1]), (pid, this)], this=this,
                           alloc=alloc, unalloc=unalloc)  # fmt: skip

    return _lay_over(
        base, pid=pid, other=other, torch_at=torch_at, ooms=[(0.62, message(5 * GiB // 2)), (0.81, message(3 * GiB))]
    )


def build_allocator_fragmentation(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fragmented, not full: 5.1 GiB reserved-but-unallocated, and a 1.5 GiB request still fails (no block that large)."""
    pid = _service_pid(base)

    def torch_at(frac: float) -> tuple[int, int, int, int]:
        # Variable-length batches churn the cache: reserved ratchets up while allocated swings back down.
        reserved = int((12.0 + 9.0 * min(frac / 0.7, 1.0)) * GiB)
        allocated = int((11.5 + 4.4 * (0.5 + 0.5 * ((frac * 13) % 1.0))) * GiB) if frac < 0.7 else int(15.9 * GiB)
        allocated = min(allocated, reserved - 256 * MiB)
        retries = int(40 * max(frac - 0.3, 0.0))
        return allocated, reserved, (1 if frac >= 0.72 else 0) + (1 if frac >= 0.9 else 0), retries

    reserved, alloc = 21 * GiB, int(15.9 * GiB)
    this = reserved + 412 * MiB
    free = A10G_TOTAL - this - A10G_NVML_RESERVED
    text = oom_message(tried=3 * GiB // 2, total=A10G_TOTAL, free=free, procs=[(pid, this)], this=this, alloc=alloc,
                       unalloc=reserved - alloc)  # fmt: skip
    return _lay_over(base, pid=pid, other=None, torch_at=torch_at, ooms=[(0.72, text), (0.9, text)])


REPLAYS: dict[str, Replay] = {
    r.name: r
    for r in (
        Replay("gpu-oom", "gpu_oom", "a CUDA allocation fails on a card that is really full (another process holds 7 GiB)",
               build_gpu_oom),
        Replay("allocator-fragmentation", "allocator_fragmentation",
               "a 1.5 GiB CUDA allocation fails while 5.1 GiB sit reserved-but-unallocated in PyTorch's cache",
               build_allocator_fragmentation),
    )
}  # fmt: skip


def read_fixture(path: str | Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def fixture_bytes(records: list[dict[str, Any]]) -> bytes:
    """The fixture file's bytes: JSON lines, gzip with mtime 0 and no file name, so a rebuild is byte-identical."""
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        for obj in records:
            gz.write((json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode())
    return raw.getvalue()


def rebuild(fixture: str | Path) -> bytes:
    """A committed replay fixture rebuilt from its own base records (the GPU ones dropped and made again).

    Why from itself: the fixture must stay byte-identical to what :func:`build` makes even if the base
    scenario's fixture is re-recorded later."""
    name = Path(fixture).name.removesuffix(".jsonl.gz")
    base = [r for r in read_fixture(fixture) if r["kind"] not in GPU_KINDS]
    return fixture_bytes(REPLAYS[name].build(base))


def build(name: str, folder: str | Path) -> bytes:
    """The replay fixture ``name`` built over ``folder``'s base recording."""
    base = read_fixture(Path(folder) / f"{BASE}.jsonl.gz")
    return fixture_bytes(REPLAYS[name].build(base))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m diag.demo.scenarios.replays FIXTURE_DIR", file=sys.stderr)
        return 2
    for name in REPLAYS:
        path = Path(argv[0]) / f"{name}.jsonl.gz"
        path.write_bytes(build(name, argv[0]))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
