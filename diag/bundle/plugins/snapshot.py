"""The sampler's snapshot now: host, watched cgroups and the process table, as the agent records them.

It runs in the volatile phase, beside the raw /proc copies, and what it finds decides what the later
plugins read: the watched groups (``State.cgroups``) and the model holders (``State.processes``).
Command lines in it are already redacted argv; process environments are never read.
"""

from __future__ import annotations

from diag.bundle.plugin import Context, Output, State


def take_snapshot(state: State, ctx: Context) -> Output:
    from collectors.snapshot import SamplerConfig, SnapshotTaker

    o = state.options
    config = SamplerConfig(
        proc_root=o.proc_root, sys_root=o.sys_root, pids=o.pids, cgroups=o.cgroups, top_n=o.top_n,
        kmsg_path=None, gpu=False,  # the kernel and the GPU have plugins of their own (own timeouts)
    )  # fmt: skip
    taker = SnapshotTaker(config)
    try:
        snap = taker.take()
    finally:
        taker.close()
    state.cgroups = list(snap.cgroups)
    state.processes = list(snap.processes)
    out = Output(records=[r.to_dict() for r in (snap.host, *snap.cgroups, *snap.processes)])
    out.extra = {"processes": len(snap.processes), "cgroups": [c.path for c in snap.cgroups], "errors": snap.errors}
    if snap.errors:
        out.reason = "; ".join(f"{k}: {v}" for k, v in snap.errors.items())
    return out
