"""The GPU through NVML: one ``GpuSnapshot`` (devices, memory, utilisation, per-process memory).

NVML and ``nvidia-smi -q`` are two steps of the plugin, each in its own worker: a wedged driver that hangs
one must not take the other's output with it (nvidia-bug-report's ``--safe-mode`` exists for that hang).
"""

from __future__ import annotations

from diag.bundle.plugin import Context, Output, State


def sample_nvml(state: State, ctx: Context) -> Output:
    from collectors.gpu import GpuSampler

    sampler = GpuSampler()
    try:
        snap = sampler.sample()
    finally:
        sampler.close()
    out = Output(records=[snap.to_dict()])
    if not snap.available:
        out.status, out.reason = "skipped", f"no GPU state: {snap.reason or 'NVML unavailable'}"
    return out
