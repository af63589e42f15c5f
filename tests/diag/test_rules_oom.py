"""host_oom, gpu_oom and allocator_fragmentation on synthetic timelines.

Kernel OOM events are the records ``collectors.kmsg`` produces from real ``oom-kill:`` lines. There
is no GPU here, so the CUDA side is fed the way a serving process would feed it: the documented
``torch.OutOfMemoryError`` message texts (PyTorch >= 2.1 and 1.x formats) through the real parser
``parse_cuda_oom_message``, plus ``TorchMemorySnapshot`` and ``GpuSnapshot`` records -- mocking
only the GPU, at the record boundary.
"""

from __future__ import annotations

import numpy as np

from collectors.records import GpuDevice, GpuProcess, GpuSnapshot, OomEvent, TorchMemorySnapshot
from collectors.tracking.torch_memory import parse_cuda_oom_message
from diag.rules.engine import analyze
from diag.rules.oom import allocator_fragmentation, gpu_oom, host_oom
from tests.diag.memory_builders import (
    GIB,
    MIB,
    SVC,
    T0,
    ar1,
    build,
    cgroup_records,
    healthy_timeline,
    host_records,
    leak_timeline,
    process_records,
    request_records,
    seconds,
)

FRAGMENTED = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.25 GiB is free. "
    "Including non-PyTorch memory, this process has 77.89 GiB memory in use. Of the allocated memory 60.12 GiB is "
    "allocated by PyTorch, and 16.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
    "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
FULL_WITH_NEIGHBOURS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 300.00 MiB is free. "
    "Process 111 has 25.00 GiB memory in use. Process 333 has 25.50 GiB memory in use. Process 222 has 28.00 GiB memory "
    "in use. Including non-PyTorch memory, this process has 28.00 GiB memory in use. Of the allocated memory 27.70 GiB "
    "is allocated by PyTorch, and 120.00 MiB is reserved by PyTorch but unallocated."
)
OLD_FORMAT = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.90 GiB total capacity; 14.95 GiB already allocated; "
    "9.75 MiB free; 15.07 GiB reserved in total by PyTorch)"
)


def _service_with_kill(kill: OomEvent | None, oom_kill_counter: bool = True, n: int = 60) -> list[dict]:
    rng = np.random.default_rng(5)
    ts = seconds(n)
    mem = 900 * MIB + ar1(rng, n, 5 * MIB)
    counter = np.zeros(n)
    if kill is not None and oom_kill_counter:
        counter[ts >= kill.ts] = 1
    parts = host_records(ts, available=np.full(n, 12.0 * GIB)) + cgroup_records(
        ts, mem, limit=GIB, events={"oom_kill": counter, "max": np.cumsum(rng.integers(0, 3, n))}
    )
    parts += process_records(ts, 4242, mem - 50 * MIB) + request_records(rng, T0, T0 + n, 2.0)
    if kill is not None:
        parts.append(kill.to_dict())
    return parts


def _memcg_kill(pid: int = 4242, memcg: str = SVC) -> OomEvent:
    return OomEvent(
        ts=T0 + 40,
        constraint="CONSTRAINT_MEMCG",
        oom_memcg=memcg,
        task_memcg=memcg,
        task="python",
        pid=pid,
        anon_rss_bytes=880 * MIB,
        total_vm_bytes=2 * GIB,
        file_rss_bytes=12 * MIB,
    )


# --------------------------------------------------------------------------- host_oom


def test_memcg_kill_of_the_service_names_the_group_and_its_limit() -> None:
    tl = build(_service_with_kill(_memcg_kill()))
    f = host_oom(tl)
    assert f is not None and f.cls == "host_oom" and f.confidence >= 0.8
    assert SVC in f.summary and "python" in f.summary and "4242" in f.summary
    ev = {e.what: e for e in f.evidence}
    assert ev["constraint"].value == "CONSTRAINT_MEMCG"
    assert ev[f"{SVC} limit"].value == GIB and ev[f"{SVC} limit"].unit == "bytes"
    assert ev["victim anon RSS"].value == 880 * MIB
    assert any("memory.events oom_kill" in e.what for e in f.evidence)  # corroborated by the counter
    assert any(r.startswith("host-wide exhaustion") for r in f.rules_out)
    assert analyze(tl).primary == "host_oom"


def test_global_oom_says_the_whole_host_ran_out() -> None:
    kill = OomEvent(ts=T0 + 40, constraint="CONSTRAINT_NONE", task_memcg=SVC, task="python", pid=4242, anon_rss_bytes=3 * GIB)
    f = host_oom(build(_service_with_kill(kill, oom_kill_counter=False)))
    assert f is not None and f.confidence >= 0.8 and "whole host" in f.summary
    assert any(e.what.startswith("host MemAvailable") and e.unit == "bytes" for e in f.evidence)
    assert any("memory limits" in r for r in f.remediation)


def test_another_tenants_memcg_kill_is_not_the_services_incident() -> None:
    f = host_oom(build(_service_with_kill(_memcg_kill(pid=999, memcg="/other"), oom_kill_counter=False)))
    assert f is not None and f.confidence < 0.5 and "not one of the service's processes" in f.summary


def test_counter_alone_reports_a_kill_when_the_kernel_log_is_missing() -> None:
    parts = _service_with_kill(_memcg_kill())
    parts = [p for p in parts if p["kind"] != "oom"]  # kmsg unreadable: only memory.oom_control's counter moved
    f = host_oom(build(parts))
    assert f is not None and 0.5 <= f.confidence < 0.8 and SVC in f.summary


def test_no_oom_is_evaluated_and_quiet() -> None:
    tl = healthy_timeline()
    assert host_oom(tl) is None
    assert "oom.host" in analyze(tl).evaluated  # host samples exist: an empty OOM list is evidence


def test_host_oom_not_evaluated_without_host_samples() -> None:
    rng = np.random.default_rng(1)
    a = analyze(build(request_records(rng, T0, T0 + 30, 2.0)))
    assert any(n["rule"] == "oom.host" and "ooms" in n["missing"] for n in a.not_evaluated)


def test_the_leak_outranks_the_oom_it_caused() -> None:
    tl = leak_timeline()
    kill = _memcg_kill()
    kill.ts = tl.end - 1
    tl.ooms.append(kill)
    a = analyze(tl)
    assert a.primary == "memory_leak" and "host_oom" in a.contributing


# --------------------------------------------------------------------------- GPU


def _gpu_timeline(messages: list[str], pid: int = 222, torch: list[TorchMemorySnapshot] | None = None) -> list[dict]:
    ts = seconds(30)
    parts = host_records(ts)
    for i, t in enumerate(ts):
        snap = GpuSnapshot(
            ts=float(t),
            available=True,
            devices=[
                GpuDevice(0, "GPU-0", "H100", total_bytes=int(79.15 * GIB), used_bytes=int(78.5 * GIB), free_bytes=int(0.6 * GIB))
            ],
            processes=[GpuProcess(0, 111, 25 * GIB), GpuProcess(0, 333, int(25.5 * GIB)), GpuProcess(0, pid, 28 * GIB)]
            if i % 2 == 0
            else [],
        )
        parts.append(snap.to_dict())
    for k, text in enumerate(messages):
        err = parse_cuda_oom_message(text, ts=T0 + 20 + k, pid=pid)
        assert err is not None
        parts.append(err.to_dict())
    parts += [s.to_dict() for s in torch or []]
    return parts


def test_fragmented_oom_is_fragmentation_not_a_full_gpu() -> None:
    tl = build(_gpu_timeline([FRAGMENTED]))
    frag = allocator_fragmentation(tl)
    assert frag is not None and frag.cls == "allocator_fragmentation" and frag.confidence >= 0.85
    assert any("PYTORCH_ALLOC_CONF=expandable_segments:True" in r for r in frag.remediation)
    assert any("PYTORCH_CUDA_ALLOC_CONF" in r for r in frag.remediation)  # older torch spelling
    ev = {e.what: e for e in frag.evidence}
    assert ev["reserved by PyTorch but unallocated"].value == round(16.5 * GIB)
    assert ev["tried to allocate"].unit == "bytes"
    oom = gpu_oom(tl)
    assert oom is not None and oom.confidence < 0.5 and "fragmentation" in oom.summary
    assert analyze(tl).primary == "allocator_fragmentation"


def test_full_gpu_is_gpu_oom_and_names_the_other_copies() -> None:
    tl = build(_gpu_timeline([FULL_WITH_NEIGHBOURS]))
    f = gpu_oom(tl)
    assert f is not None and f.cls == "gpu_oom" and f.confidence >= 0.8
    assert "maybe duplicate model copies" in f.summary
    assert any(r.startswith("allocator_fragmentation") for r in f.rules_out)
    held = next(e for e in f.evidence if e.what == "memory held by other processes")
    assert held.value == round(25 * GIB + 25.5 * GIB) and held.unit == "bytes"
    assert any(e.unit == "ratio" and "NVML" in e.what for e in f.evidence)
    assert allocator_fragmentation(tl) is None
    assert analyze(tl).primary == "gpu_oom"


def test_old_format_with_tiny_slack_is_a_full_gpu() -> None:
    """1.x message: 120 MiB reserved-but-unallocated >= the 20 MiB request, but under 1 % of what torch held."""
    tl = build(_gpu_timeline([OLD_FORMAT]))
    assert allocator_fragmentation(tl) is None
    f = gpu_oom(tl)
    assert f is not None and f.confidence >= 0.8


def _torch(ooms: list[int], reserved: float, allocated: float, retries: list[int]) -> list[TorchMemorySnapshot]:
    return [
        TorchMemorySnapshot(
            ts=T0 + 2 * i,
            device=0,
            allocated_bytes=int(allocated),
            reserved_bytes=int(reserved),
            num_ooms=o,
            num_alloc_retries=r,
            pid=222,
        )
        for i, (o, r) in enumerate(zip(ooms, retries, strict=True))
    ]


def test_torch_counters_alone_point_at_fragmentation() -> None:
    snaps = _torch([0, 0, 1, 1, 2, 2], 40 * GIB, 28 * GIB, [0, 3, 5, 9, 12, 15])
    tl = build(_gpu_timeline([], torch=snaps))
    frag = allocator_fragmentation(tl)
    oom = gpu_oom(tl)
    assert frag is not None and frag.confidence >= 0.5
    assert oom is not None and oom.confidence < frag.confidence
    assert analyze(tl).primary == "allocator_fragmentation"


def test_gpu_rules_quiet_on_a_healthy_gpu() -> None:
    snaps = _torch([0] * 6, 30 * GIB, 29 * GIB, [0] * 6)
    tl = build(_gpu_timeline([], torch=snaps))
    assert gpu_oom(tl) is None and allocator_fragmentation(tl) is None
    assert {"oom.gpu", "oom.allocator_fragmentation"} <= set(analyze(tl).evaluated)


def test_gpu_rules_not_evaluated_without_cuda_records() -> None:
    a = analyze(healthy_timeline())
    missing = {n["rule"]: n["missing"] for n in a.not_evaluated}
    assert missing["oom.gpu"] == ["cuda_ooms or torch"]
    assert missing["oom.allocator_fragmentation"] == ["cuda_ooms or torch"]
