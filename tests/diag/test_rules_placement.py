"""duplicate_model_processes and noisy_neighbour on synthetic timelines built from real record shapes.

The duplicate-model cases mirror what the process sampler reports for the demo server: per-worker
loading puts the weights in each worker's private memory (USS ~ weights), a shared read-only mmap
puts them in shared page cache (RSS ~ weights, USS small, summed PSS ~ one copy). NVML's
per-process table is fed through ``GpuSnapshot`` records (no GPU here).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectors.records import GpuDevice, GpuProcess, GpuSnapshot, LoaderEvent, ServiceConfig
from diag.rules.engine import analyze
from diag.rules.placement import duplicate_model_processes, noisy_neighbour
from tests.diag.memory_builders import (
    GIB,
    HOST_TOTAL,
    MIB,
    T0,
    ar1,
    build,
    cgroup_records,
    host_records,
    leak_timeline,
    process_records,
    request_records,
    seconds,
)

MODEL = "/srv/models/demo-128m.safetensors"
WEIGHTS = 128 * MIB
OVERHEAD_RSS, OVERHEAD_USS, LIBS_PSS = 60 * MIB, 40 * MIB, 45 * MIB


def _workers(
    mode: str,
    n_workers: int = 4,
    n: int = 40,
    seed: int = 0,
    pids: list[int] | None = None,
    weights: int = WEIGHTS,
    overhead_uss: int = OVERHEAD_USS,
    limit: int | None = 2 * GIB,
) -> list[dict[str, Any]]:
    """Worker process samples: ``per-worker`` private copies or one ``shared`` mmap (all pages touched)."""
    rng = np.random.default_rng(seed)
    ts = seconds(n)
    out: list[dict[str, Any]] = []
    pids = pids or [5001 + i for i in range(n_workers)]
    for k, pid in enumerate(pids):
        jitter = ar1(rng, n, 1 * MIB)
        rss = OVERHEAD_RSS + weights + jitter
        libs_share = LIBS_PSS - OVERHEAD_USS  # the interpreter's shared libraries, this worker's share
        if mode == "per-worker":
            uss = overhead_uss + weights + jitter
            pss = uss + libs_share
        else:
            uss = overhead_uss + jitter
            pss = uss + libs_share + weights / len(pids)
        out += process_records(ts, pid, rss, uss=uss, pss=pss, model_files=[MODEL], start_time_s=1000.0 + k)
    mem = sum(float(np.median([r["uss_bytes"] for r in out if r["pid"] == p])) for p in {r["pid"] for r in out})
    out += host_records(ts) + cgroup_records(ts, np.full(n, mem) + ar1(rng, n, 2 * MIB), limit=limit)
    return out


def _config(weights: int = WEIGHTS) -> dict[str, Any]:
    return ServiceConfig(
        ts=T0,
        service="demo",
        pid=5001,
        settings={"workers": 4, "preload": "per-worker", "weights_bytes": weights, "model_path": MODEL},
    ).to_dict()


# --------------------------------------------------------------------------- duplicate_model_processes


def test_four_private_copies_are_duplicates() -> None:
    tl = build(_workers("per-worker"), [_config()])
    f = duplicate_model_processes(tl)
    assert f is not None and f.cls == "duplicate_model_processes" and f.confidence >= 0.85
    ev = {e.what: e for e in f.evidence}
    assert ev["processes holding it at the same time"].value == 4
    assert ev["model file"].value == MODEL
    assert ev["summed PSS / one copy"].value >= 4.0 and ev["summed PSS / one copy"].unit == "copies"
    assert ev["one copy (ServiceConfig weights_bytes)"].value == WEIGHTS
    assert "4 processes" in f.summary and "384.0 MiB" in f.summary  # three extra copies of 128 MiB
    assert any("mmap" in r for r in f.remediation)
    assert analyze(tl).primary == "duplicate_model_processes"


def test_one_shared_mmap_is_not_duplication() -> None:
    """Four workers map one read-only copy: each RSS includes the weights, summed PSS ~ one copy."""
    assert duplicate_model_processes(build(_workers("shared"), [_config()])) is None
    assert duplicate_model_processes(build(_workers("shared"))) is None  # size unknown: USS/RSS small


def test_shared_mmap_of_a_small_model_is_not_duplication() -> None:
    """The trap seen live: a 64 MiB model, workers whose interpreter alone has 48 MiB private (> 0.7 x 64 MiB).

    Only the holders' shared share (summed PSS - USS ~ one copy) tells the shared mmap apart.
    """
    load = LoaderEvent(ts=T0 + 1, name="checkpoint", start=T0, duration_s=0.2, bytes_read=64 * MIB, cache_hit=False, pid=5001)
    parts = _workers("shared", n_workers=2, weights=64 * MIB, overhead_uss=48 * MIB)
    assert duplicate_model_processes(build(parts, [load.to_dict()])) is None
    private = _workers("per-worker", n_workers=2, weights=64 * MIB, overhead_uss=48 * MIB, limit=GIB)
    f = duplicate_model_processes(build(private, [load.to_dict()]))
    assert f is not None and f.confidence >= 0.75  # 64 MiB extra of a 1 GiB group: material


def test_cheap_duplication_is_not_an_incident() -> None:
    """Two private copies of a 64 MiB model on a 24 GiB host without a group limit: true, but 0.3 % of memory."""
    parts = _workers("per-worker", n_workers=2, weights=64 * MIB, limit=None)
    f = duplicate_model_processes(build(parts, [_config(64 * MIB)]))
    assert f is not None and f.confidence < 0.5


def test_copy_size_from_the_loader_when_no_config() -> None:
    load = LoaderEvent(ts=T0 + 1, name="checkpoint", start=T0, duration_s=0.4, bytes_read=WEIGHTS, cache_hit=False, pid=5001)
    f = duplicate_model_processes(build(_workers("per-worker"), [load.to_dict()]))
    assert f is not None and f.confidence >= 0.85
    assert any("LoaderEvent" in e.what for e in f.evidence)


def test_copy_size_unknown_caps_confidence() -> None:
    f = duplicate_model_processes(build(_workers("per-worker")))
    assert f is not None and 0.5 <= f.confidence <= 0.6
    assert any(e.what == "one copy" and "unknown" in str(e.value) for e in f.evidence)


def test_a_restarted_worker_is_not_a_second_copy() -> None:
    """The old worker died (OOM) and a new PID took over: never two copies at the same time."""
    first = _workers("per-worker", n=40, pids=[5001])
    second = [dict(r, ts=r["ts"] + 40) for r in _workers("per-worker", n=40, pids=[5002]) if r["kind"] == "process"]
    assert duplicate_model_processes(build(first, second, [_config()])) is None


def test_copies_on_the_gpu_count_too() -> None:
    """Three engines each load the model into GPU memory; their host memory is small (weights live on the GPU)."""
    ts = seconds(20)
    parts = host_records(ts)
    for pid in (7001, 7002, 7003):
        parts += process_records(
            ts,
            pid,
            np.full(20, 900.0 * MIB),
            uss=np.full(20, 500.0 * MIB),
            pss=np.full(20, 520.0 * MIB),
            model_files=[MODEL],
            cgroup=None,
        )
    for t in ts:
        gpu = GpuSnapshot(
            ts=float(t),
            available=True,
            devices=[GpuDevice(0, "GPU-0", "H100", total_bytes=80 * GIB, used_bytes=63 * GIB)],
            processes=[GpuProcess(0, 7001, 21 * GIB), GpuProcess(0, 7002, 21 * GIB), GpuProcess(0, 7003, 21 * GIB)],
        )
        parts.append(gpu.to_dict())
    f = duplicate_model_processes(build(parts))
    assert f is not None and f.confidence >= 0.5
    assert any("NVML" in e.what and "7003" in str(e.value) for e in f.evidence)


def test_duplicates_not_evaluated_without_model_files() -> None:
    a = analyze(leak_timeline())
    missing = {n["rule"]: n["missing"] for n in a.not_evaluated}
    assert "process:model_files" in missing["placement.duplicate_models"]


def test_duplicates_quiet_on_a_leak_and_on_one_worker() -> None:
    assert duplicate_model_processes(build(_workers("per-worker", pids=[5001]), [_config()])) is None


# --------------------------------------------------------------------------- noisy_neighbour


def _neighbour(
    host_psi: np.ndarray,
    svc_psi: np.ndarray,
    available: np.ndarray | None = None,
    svc_mem: np.ndarray | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    n = host_psi.size
    ts = seconds(n)
    mem = svc_mem if svc_mem is not None else 500 * MIB + ar1(rng, n, 3 * MIB)
    hog = np.where(host_psi > 3, host_psi * 1.6, 0.2)
    return (
        host_records(ts, available=available, mem_some=host_psi, io_some=np.clip(host_psi * 0.8, 0, 100))
        + cgroup_records(ts, mem, limit=GIB, psi_some=svc_psi)
        + cgroup_records(ts, np.full(n, 150.0 * MIB), limit=160 * MIB, path="/neighbour", psi_some=hog)
        + process_records(ts, 4242, mem - 50 * MIB)
        + request_records(rng, T0, T0 + n, 3.0)
    )


def _burst(n: int, lo: float, hi: float, rng: np.random.Generator, start: int = 10) -> np.ndarray:
    out = rng.uniform(0.0, 0.5, n)
    out[start:] = rng.uniform(lo, hi, n - start)
    return out


def test_host_pressure_the_service_does_not_share_is_a_neighbour() -> None:
    rng = np.random.default_rng(1)
    tl = build(_neighbour(_burst(60, 6, 20, rng), rng.uniform(0, 0.4, 60)))
    f = noisy_neighbour(tl)
    assert f is not None and f.cls == "noisy_neighbour" and f.confidence >= 0.65
    assert "/neighbour" in f.summary  # the suspect is named
    psi = next(e for e in f.evidence if e.what.startswith("host memory PSI"))
    assert psi.unit == "%" and psi.value >= 5 and psi.series
    assert analyze(tl).primary == "noisy_neighbour"


def test_a_few_seconds_of_host_stall_is_a_note_not_the_verdict() -> None:
    """Another job stalls the host for 5 s of a minute while the service's group stays calm: named, never the incident.

    A neighbour keeps taking memory; the same stall lasting 8 s is one.
    """
    rng = np.random.default_rng(11)
    host = rng.uniform(0.0, 0.5, 60)
    host[30:35] = [18.5, 29.9, 31.3, 33.7, 8.9]
    brief = noisy_neighbour(build(_neighbour(host, rng.uniform(0, 0.4, 60))))
    assert brief is not None and brief.confidence < 0.3
    assert "at most 5 s at a time" in brief.summary
    assert analyze(build(_neighbour(host, rng.uniform(0, 0.4, 60)))).primary == "healthy"
    host[30:38] = 20.0
    held = noisy_neighbour(build(_neighbour(host, rng.uniform(0, 0.4, 60))))
    assert held is not None and held.confidence >= 0.65


def test_host_memory_drained_by_someone_else() -> None:
    rng = np.random.default_rng(2)
    n = 60
    avail = np.linspace(9.0, 1.5, n) * GIB + rng.normal(0, 50 * MIB, n)
    f = noisy_neighbour(build(_neighbour(_burst(n, 6, 20, rng), rng.uniform(0, 0.4, n), available=avail)))
    assert f is not None and f.confidence >= 0.8
    assert any(e.what == "host MemAvailable start -> end" for e in f.evidence)
    drained = noisy_neighbour(build(_neighbour(rng.uniform(0, 0.5, n), rng.uniform(0, 0.4, n), available=avail)))
    assert drained is not None and 0.5 <= drained.confidence < f.confidence  # the drain alone: less sure


def test_pressure_that_is_also_ours_is_not_a_neighbour() -> None:
    rng = np.random.default_rng(3)
    host = _burst(60, 6, 20, rng)
    f = noisy_neighbour(build(_neighbour(host, host * 0.9)))
    assert f is None


def test_own_pressure_episodes_keep_the_neighbour_below_a_verdict() -> None:
    """Host stalls throughout; the service is calm except for a few busy bursts of its own (>= 10 %)."""
    rng = np.random.default_rng(7)
    svc = rng.uniform(0, 0.4, 60)
    svc[[20, 21, 22, 40, 41]] = [14, 17, 12, 15, 11]
    f = noisy_neighbour(build(_neighbour(_burst(60, 15, 30, rng), svc)))
    assert f is not None and f.confidence < 0.5 and "of its own" in f.summary


def test_our_own_leak_draining_the_host_is_not_a_neighbour() -> None:
    rng = np.random.default_rng(4)
    n = 60
    svc = 500 * MIB + np.linspace(0, 7.5, n) * GIB
    avail = HOST_TOTAL - 6 * GIB - svc
    assert (
        noisy_neighbour(build(_neighbour(rng.uniform(0, 0.5, n), rng.uniform(0, 0.4, n), available=avail, svc_mem=svc))) is None
    )


def test_quiet_host_is_not_a_neighbour() -> None:
    rng = np.random.default_rng(5)
    assert noisy_neighbour(build(_neighbour(rng.uniform(0, 0.8, 60), rng.uniform(0, 0.4, 60)))) is None


def test_noisy_neighbour_not_evaluated_without_cgroup_psi() -> None:
    """A plain v1 group (no cgroup2 twin): the service's own PSI is unknown, so no verdict either way."""
    rng = np.random.default_rng(6)
    ts = seconds(40)
    tl = build(host_records(ts, mem_some=_burst(40, 6, 20, rng)), cgroup_records(ts, np.full(40, 500.0 * MIB), with_psi=False))
    a = analyze(tl)
    missing = {n["rule"]: n["missing"] for n in a.not_evaluated}
    assert missing["placement.noisy_neighbour"] == ["cgroup:psi.memory.some.avg10"]
