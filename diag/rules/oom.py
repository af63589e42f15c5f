"""OOM family: which memory ran out -- a cgroup's limit, the whole host, or the GPU -- and was it really full?

- ``host_oom`` reads the kernel's own attribution (``timeline.ooms``, parsed from ``oom-kill:``
  lines): ``CONSTRAINT_MEMCG`` names the cgroup whose limit was hit (``oom_memcg``), anything
  else with no memcg means the whole host ran out. Cgroup ``events.oom_kill`` and host
  ``vmstat.oom_kill`` increases corroborate it -- or stand in for it when the kernel log could
  not be read. It is a *symptom*: confidence stays at 0.8-0.85 so that a leak or duplicate copies
  found with more certainty rank above it as the cause.
- ``gpu_oom`` / ``allocator_fragmentation`` read the CUDA OOM message (``timeline.cuda_ooms``) and
  torch's allocator counters (``timeline.torch``). The memory was *there, just fragmented* when the
  caching allocator held at least the failed request reserved-but-unallocated (R >= X) and that
  slack is not a rounding error (>= 5 % of what torch held); then the fix is
  ``expandable_segments``, not a bigger GPU. Otherwise the GPU was really full, and the
  ``Process P has M memory in use`` lines say who else was on it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from collectors.records import CudaOomError, OomEvent
from diag.rules import stats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.stats import Scope
from diag.timeline import Series, Timeline
from diag.units import format_bytes

FRAG_MIN_SHARE = 0.05  # reserved-but-unallocated must be >= 5 % of torch's total (allocated + slack) to count
OTHER_PROCESS_MIN_SHARE = 0.10  # another process holding >= 10 % of the GPU is worth naming
SLACK_SHARE = 0.2  # torch snapshots only: >= 20 % of reserved memory cached-but-unallocated is a fragmentation sign
CONTEXT_S = 30.0  # how far before a kill to look for the memory state that led to it
SIMILAR_HOLDINGS = 1.5  # other processes holding GPU memory within 1.5x of each other look like copies of one model
FRAG_AMPLE = 2.0  # the slack held twice the failed request ...
FRAG_AMPLE_OF_ALLOCATED = 0.2  # ... and a fifth of what torch had allocated: plainly fragmentation


# --------------------------------------------------------------------------- host OOM


def _kind(ev: OomEvent) -> str:
    if ev.constraint == "CONSTRAINT_MEMCG" or (ev.constraint is None and ev.oom_memcg):
        return "memcg"
    if ev.constraint in (None, "CONSTRAINT_NONE"):
        return "host" if ev.constraint == "CONSTRAINT_NONE" else "unknown"
    return "policy"  # CONSTRAINT_CPUSET / CONSTRAINT_MEMORY_POLICY: a NUMA node or cpuset ran out


def _service_kill(ev: OomEvent, scope: Scope) -> bool:
    if not scope.known:
        return True  # nothing says what the service is: every kill may be ours
    if ev.pid is not None and ev.pid in scope.pids:
        return True
    return any(stats.in_cgroup(ev.task_memcg, g) or stats.in_cgroup(ev.oom_memcg, g) for g in scope.cgroups)


def _series_before(series: Series | None, ts: float) -> Series:
    if series is None:
        return Series(np.empty(0), np.empty(0))
    return series.window(ts - CONTEXT_S, ts).valid()


def _kill_evidence(timeline: Timeline, ev: OomEvent, kind: str) -> tuple[list[Evidence], list[str]]:
    out = [
        Evidence("constraint", ev.constraint or "unknown", "", ev.ts, ev.ts),
        Evidence("victim", f"{ev.task or '?'} (pid {ev.pid})", "", ev.ts, ev.ts),
    ]
    for what, value in (
        ("victim anon RSS", ev.anon_rss_bytes),
        ("victim file RSS", ev.file_rss_bytes),
        ("victim total VM", ev.total_vm_bytes),
    ):
        if value is not None:
            out.append(Evidence(what, value, "bytes", ev.ts, ev.ts))
    rules_out: list[str] = []
    avail = _series_before(timeline.host.get("memory.available"), ev.ts)
    if kind == "memcg":
        out.append(Evidence("cgroup that hit its limit (oom_memcg)", ev.oom_memcg or "?", "", ev.ts, ev.ts))
        if ev.task_memcg and ev.task_memcg != ev.oom_memcg:
            out.append(Evidence("victim's cgroup (task_memcg)", ev.task_memcg, "", ev.ts, ev.ts))
        group = ev.oom_memcg or ""
        limit = stats.cgroup_limit(timeline, group) if group else None
        if limit is not None:
            out.append(Evidence(f"{group} limit", limit, "bytes", ev.ts, ev.ts))
            cg = timeline.cgroups.get(group, {})
            usage = _series_before(cg.get("usage") or cg.get("working_set"), ev.ts)
            if len(usage):
                out.append(
                    Evidence(f"{group} usage before the kill, max", float(usage.values.max()), "bytes", float(usage.ts[0]), ev.ts)
                )
        if len(avail):
            rules_out.append(
                f"host-wide exhaustion: the host still had {format_bytes(float(avail.values.min()))} available "
                "-- the group hit its own limit"
            )
    elif kind == "host" and len(avail):
        out.append(
            Evidence("host MemAvailable before the kill, min", float(avail.values.min()), "bytes", float(avail.ts[0]), ev.ts)
        )
    rules_out.append("gpu_oom: the kernel killed a process for host memory, not a failed CUDA allocation")
    return out, rules_out


def _locked_evidence(timeline: Timeline, ev: OomEvent, group: str) -> tuple[list[Evidence], float]:
    """What the group could not reclaim at the kill: its unevictable (mlock'd) memory, the victim's locked pages, and
    the victim's own setting that locks them -- and the largest locked amount of these (0 when nothing was locked).

    Why: file pages are reclaimable, so a group that still ran out while holding them had them pinned; the kernel's
    own stats at the kill say how much, the samples before it corroborate, the configuration says who pinned them.
    """
    out: list[Evidence] = []
    locked = 0.0
    if ev.unevictable_bytes:
        locked = float(ev.unevictable_bytes)
        out.append(
            Evidence(
                f"{group} unevictable (mlock'd) memory at the kill (kernel OOM report)",
                ev.unevictable_bytes,
                "bytes",
                ev.ts,
                ev.ts,
            )
        )
    unevictable = _series_before(timeline.cgroups.get(group, {}).get("stat.unevictable"), ev.ts)
    if len(unevictable) and unevictable.values.max() > 0:
        locked = max(locked, float(unevictable.values.max()))
        out.append(
            Evidence(
                f"{group} memory.stat unevictable before the kill, max",
                float(unevictable.values.max()),
                "bytes",
                float(unevictable.ts[0]),
                ev.ts,
            )
        )
    for track in timeline.processes.values():
        if track.pid != ev.pid:
            continue
        vmlck = _series_before(track.series.get("locked"), ev.ts)
        if len(vmlck) and vmlck.values.max() > 0:
            locked = max(locked, float(vmlck.values.max()))
            out.append(
                Evidence(
                    "victim's locked memory (VmLck) before the kill, max",
                    float(vmlck.values.max()),
                    "bytes",
                    float(vmlck.ts[0]),
                    ev.ts,
                )
            )
    for cfg in timeline.configs:
        if cfg.pid == ev.pid and cfg.settings.get("use_mlock") is True:
            weights = cfg.settings.get("weights_bytes")
            size = f" ({format_bytes(weights)})" if isinstance(weights, (int, float)) else ""
            out.append(
                Evidence(
                    "victim's setting (its command line)",
                    f"use_mlock true: the model's weights{size} are locked in RAM",
                    "",
                    cfg.ts,
                    cfg.ts,
                )
            )
    return out, locked


LOCKED_SHARE = 0.25  # locked memory worth naming as why the group ran out: a quarter of its limit or more

ATTRIBUTE_S = 30.0  # a counted kill is owned by a group whose oom_kill counter rose within this of it


def _attributed(timeline: Timeline, ev: OomEvent) -> OomEvent:
    """A kill without an owner (one counted from a host-wide counter, as on the Prometheus path) given the group
    whose own ``memory.events`` oom_kill counter rose at that time -- the deepest such group."""
    if ev.oom_memcg or ev.task_memcg or ev.pid is not None:
        return ev
    owners = []
    for group, series in timeline.cgroups.items():
        s = series.get("events.oom_kill")
        if s is None or group == "/":
            continue
        near = s.window(ev.ts - ATTRIBUTE_S, ev.ts + ATTRIBUTE_S)
        if near.increase() > 0:
            owners.append(group)
    if not owners:
        return ev
    group = max(owners, key=lambda g: g.count("/"))
    return dataclasses.replace(ev, oom_memcg=group, task_memcg=group, constraint=ev.constraint or "CONSTRAINT_MEMCG")


def _counter_increases(timeline: Timeline) -> tuple[dict[str, float], float]:
    per_group = {}
    for group, series in timeline.cgroups.items():
        s = series.get("events.oom_kill")
        if s is not None and s.increase() > 0:
            per_group[group] = s.increase()
    host = timeline.host.get("vmstat.oom_kill")
    return per_group, host.increase() if host is not None else 0.0


# What to do, by which memory ran out (tuples: each Finding gets its own list).
_REMEDIATION_MEMCG = (
    "Find what filled the group before raising its limit (see the leak / duplicate-model / pressure findings).",
    "Bound concurrency and tokens in flight, and turn on the memory guard so the service sheds load before the kernel kills.",
    "Set memory.high a little below memory.max: the kernel reclaims and throttles there first, and the alert fires in time.",
)
_REMEDIATION_HOST = (
    "Give the service (and its neighbours) memory limits so the kernel kills inside the group that overran, not anywhere.",
    "Protect the service with memory.low/memory.min and find the host's largest consumers at the time of the kill.",
    "Bound concurrency and turn on the memory guard so the service itself does not push the host over.",
)


@rule("oom.host", "host_oom", needs=("ooms",))
def host_oom(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Kernel OOM kills: which memory ran out (a cgroup limit or the host), who died, corroborated by counters."""
    scope = stats.service_scope(timeline, ac)
    per_group, host_kills = _counter_increases(timeline)
    kills = list(timeline.ooms)
    if not kills and not per_group and host_kills <= 0:
        return None
    if kills:
        return _from_kernel_lines(timeline, scope, [_attributed(timeline, e) for e in kills], per_group, host_kills)
    return _from_counters(timeline, scope, per_group, host_kills)


def _from_kernel_lines(
    timeline: Timeline, scope: stats.Scope, kills: list[OomEvent], per_group: dict[str, float], host_kills: float
) -> Finding:
    """The kill to report (the service's own, else the latest), judged by whose memory ran out.

    Why the service's kill ranks first: a neighbour killed inside its own limit is not the service's
    incident (a low confidence), while a host-wide exhaustion can hit the service next (in between).
    """
    ranked = sorted(kills, key=lambda e: (_service_kill(e, scope), e.ts))
    ev = ranked[-1]
    kind = _kind(ev)
    ours = _service_kill(ev, scope)
    evidence, rules_out = _kill_evidence(timeline, ev, kind)
    evidence.insert(0, Evidence("kernel OOM kills in the window", len(kills), "kills", kills[0].ts, kills[-1].ts))
    group = ev.oom_memcg if kind == "memcg" else None
    locked = 0.0
    if group:
        locked_evidence, locked = _locked_evidence(timeline, ev, group)
        evidence.extend(locked_evidence)
    limit = stats.cgroup_limit(timeline, group) if group else None
    pinned = bool(locked and limit and locked >= LOCKED_SHARE * limit)
    mlock = any(e.what.startswith("victim's setting") for e in evidence)
    corroborated = (group in per_group) if group else host_kills > 0
    if group in per_group:
        evidence.append(
            Evidence(f"{group} memory.events oom_kill increase", per_group[group], "kills", timeline.start, timeline.end)
        )
    if host_kills > 0:
        evidence.append(Evidence("host vmstat oom_kill increase", host_kills, "kills", timeline.start, timeline.end))
    if ours:
        conf = 0.8 + (0.05 if corroborated else 0.0)
    elif kind == "host":
        conf = 0.55  # the whole host ran out: it hit someone else this time, it can hit the service next
    else:
        conf = 0.3  # another tenant's own limit: not the service's incident
    what = {
        "memcg": f"the memory cgroup {ev.oom_memcg} hit its limit",
        "host": "the whole host ran out of memory",
        "policy": f"a NUMA/cpuset constraint ({ev.constraint}) ran out",
        "unknown": "the kernel did not say which memory ran out",
    }[kind]
    if ev.pid is None and not ev.task:
        victim = "a process of it (the kernel log naming the victim was not available)"
    else:
        victim = f"{ev.task or '?'} (pid {ev.pid}, anon RSS {format_bytes(ev.anon_rss_bytes)})"
    summary = f"Kernel OOM kill: {what}; it killed {victim}"
    if not ours:
        summary += " -- not one of the service's processes"
    if len(kills) > 1:
        summary += f" ({len(kills)} kills in the window)"
    remediation = list(_REMEDIATION_MEMCG if kind == "memcg" else _REMEDIATION_HOST)
    if pinned:
        who = "the weights use_mlock pinned" if mlock else "locked pages (mlock)"
        summary += (
            f"; {format_bytes(locked)} of its {format_bytes(limit)} was unevictable -- {who}, which reclaim cannot drop, "
            "so the kernel killed instead of reclaiming"
        )
        remediation.insert(
            0,
            "Do not lock the model in a group smaller than it: turn mlock off (use_mlock=false: mapped weights are then "
            "reclaimable page cache) or give the group room for the whole model plus the server's working memory.",
        )
    return Finding(
        "host_oom",
        "oom.host",
        conf,
        summary,
        evidence,
        rules_out,
        remediation,
        ev.ts,
        ev.ts,
    )


def _from_counters(timeline: Timeline, scope: stats.Scope, per_group: dict[str, float], host_kills: float) -> Finding:
    """No kernel line (kmsg unreadable, or the kill scrolled away): the counters still say a kill happened, and where.

    Why the watched groups' own counters matter: when they were sampled and stayed flat, the host's
    kill happened in someone else's group -- a note, not a suspect; without them it may have been ours.
    """
    evidence = [
        Evidence(f"{g} memory.events oom_kill increase", n, "kills", timeline.start, timeline.end) for g, n in per_group.items()
    ]
    if host_kills > 0:
        evidence.append(Evidence("host vmstat oom_kill increase", host_kills, "kills", timeline.start, timeline.end))
    ours = [g for g in per_group if not scope.known or any(stats.in_cgroup(g, s) or stats.in_cgroup(s, g) for s in scope.cgroups)]
    if ours:
        return Finding(
            "host_oom",
            "oom.host",
            0.7,
            f"OOM kills inside {', '.join(ours)} (memory.events oom_kill); the kernel log with the victim was not available",
            evidence,
            ["gpu_oom: these are kernel kills for host memory"],
            list(_REMEDIATION_MEMCG),
            timeline.start,
            timeline.end,
        )
    own_counted = [
        g for g in scope.cgroups if (c := timeline.cgroups.get(g, {}).get("events.oom_kill")) is not None and len(c.valid()) >= 2
    ]
    return Finding(
        "host_oom",
        "oom.host",
        0.25 if own_counted else 0.45,
        f"{host_kills:.0f} OOM kill(s) on the host (vmstat oom_kill), victim unknown and not in the service's watched groups"
        + (f" (their own oom_kill counters stayed flat: {', '.join(own_counted)})" if own_counted else ""),
        evidence,
        [],
        list(_REMEDIATION_HOST),
        timeline.start,
        timeline.end,
    )


# --------------------------------------------------------------------------- GPU OOM and fragmentation


def _fragmented(err: CudaOomError) -> bool | None:
    """True: the failed request fit in torch's reserved-but-unallocated slack. None: the message lacks the fields."""
    x, r = err.tried_to_allocate_bytes, err.reserved_unallocated_bytes
    if x is None or r is None:
        return None
    held = r + (err.allocated_by_pytorch_bytes or 0)
    return r >= x and r >= FRAG_MIN_SHARE * max(held, 1)


def _others(err: CudaOomError) -> list[dict[str, int]]:
    return [p for p in err.other_processes if p.get("pid") != err.pid and p.get("bytes")]


def _torch_ooms(timeline: Timeline) -> tuple[float, float, Series | None]:
    """(OOMs torch counted, allocation retries, reserved - allocated over time) from the memory snapshots."""
    t = timeline.torch
    if not len(t):
        return 0.0, 0.0, None
    ooms = retries = 0.0
    pids = t["pid"] if "pid" in t else np.zeros(len(t))
    keys = np.nan_to_num(pids, nan=-1.0) * 1000 + np.nan_to_num(t["device"], nan=0.0)
    for key in np.unique(keys):
        sel = t.select(keys == key)
        for col, acc in (("num_ooms", "o"), ("num_alloc_retries", "r")):
            s = Series(sel["ts"], sel[col]).valid()
            inc = s.increase() if len(s) >= 2 else 0.0
            if acc == "o":
                ooms += inc
            else:
                retries += inc
    slack = Series(t["ts"], t["reserved_bytes"] - t["allocated_bytes"]).valid()
    return ooms, retries, slack


def _slack_share(timeline: Timeline) -> float:
    """(reserved - allocated) / reserved at the last torch snapshot: how much of torch's memory was cached slack."""
    t = timeline.torch
    if not len(t):
        return 0.0
    ok = np.isfinite(t["reserved_bytes"]) & np.isfinite(t["allocated_bytes"]) & (t["reserved_bytes"] > 0)
    if not ok.any():
        return 0.0
    i = np.flatnonzero(ok)[-1]
    return float((t["reserved_bytes"][i] - t["allocated_bytes"][i]) / t["reserved_bytes"][i])


def _err_evidence(err: CudaOomError) -> list[Evidence]:
    out = []
    for what, value in (
        ("tried to allocate", err.tried_to_allocate_bytes),
        ("GPU total capacity", err.total_capacity_bytes),
        ("GPU free at the failure", err.free_bytes),
        ("allocated by PyTorch", err.allocated_by_pytorch_bytes),
        ("reserved by PyTorch but unallocated", err.reserved_unallocated_bytes),
        ("this process in use (incl. non-PyTorch)", err.process_in_use_bytes),
    ):
        if value is not None:
            out.append(Evidence(what, value, "bytes", err.ts, err.ts))
    return out


def _gpu_used(timeline: Timeline, err: CudaOomError) -> Evidence | None:
    dev = timeline.gpus.get(err.device if err.device is not None else 0)
    if not dev or "used" not in dev or "total" not in dev:
        return None
    used, total = _series_before(dev["used"], err.ts + 1), dev["total"].last()
    if not len(used) or not math.isfinite(total) or total <= 0:
        return None
    return Evidence(
        f"GPU {err.device} used / total before the failure (NVML)",
        round(float(used.values[-1]) / total, 3),
        "ratio",
        float(used.ts[-1]),
        err.ts,
    )


@rule("oom.gpu", "gpu_oom", needs_any=("cuda_ooms", "torch"))
def gpu_oom(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """A CUDA allocation failed because the GPU was really full (not fragmented); who else held it."""
    errs = list(timeline.cuda_ooms)
    torch_ooms, _retries, slack = _torch_ooms(timeline)
    if not errs and torch_ooms <= 0:
        return None
    remediation = [
        "Lower what a batch needs: fewer tokens per batch (token-budget batching), fewer concurrent sequences, shorter context.",
        "Leave headroom: lower the fraction of GPU memory the engine pre-allocates (e.g. vLLM gpu_memory_utilization).",
        "Keep one model copy per GPU: other processes on the device hold memory this one cannot use.",
        "Use a smaller or quantized model, or shard it across more GPUs.",
    ]
    if not errs:
        ev = [
            Evidence(
                "OOMs counted by torch.cuda.memory_stats (no message captured)", torch_ooms, "ooms", timeline.start, timeline.end
            )
        ]
        if slack is not None and len(slack):
            ev.append(
                Evidence("reserved - allocated, last", float(slack.values[-1]), "bytes", float(slack.ts[-1]), float(slack.ts[-1]))
            )
        share = _slack_share(timeline)
        summary = f"torch counted {torch_ooms:.0f} CUDA OOM(s); the messages were not captured"
        if share >= SLACK_SHARE:
            summary += f"; {share:.0%} of reserved memory was cached but unallocated: see allocator_fragmentation"
        return Finding(
            "gpu_oom",
            "oom.gpu",
            0.45 if share >= SLACK_SHARE else 0.7,
            summary,
            ev,
            [],
            remediation,
            timeline.start,
            timeline.end,
        )
    frag = [e for e in errs if _fragmented(e)]
    full = [e for e in errs if _fragmented(e) is not True]
    err = full[-1] if full else frag[-1]
    ev = [Evidence("CUDA OOM errors in the window", len(errs), "errors", errs[0].ts, errs[-1].ts), *_err_evidence(err)]
    used = _gpu_used(timeline, err)
    if used:
        ev.append(used)
    others = _others(err)
    notes: list[str] = []
    rules_out: list[str] = []
    cap = err.total_capacity_bytes or 0
    if others:
        held = sum(p["bytes"] for p in others)
        ev.append(
            Evidence(
                "other processes on the GPU",
                ", ".join(f"pid {p['pid']}: {format_bytes(p['bytes'])}" for p in others),
                "",
                err.ts,
                err.ts,
            )
        )
        ev.append(Evidence("memory held by other processes", held, "bytes", err.ts, err.ts))
        big = [p["bytes"] for p in others if cap and p["bytes"] >= OTHER_PROCESS_MIN_SHARE * cap]
        if len(big) >= 2 and max(big) <= SIMILAR_HOLDINGS * min(big):
            notes.append(
                f"{len(big)} other processes hold ~{format_bytes(float(np.median(big)))} each: maybe duplicate model copies"
            )
        elif big:
            notes.append(f"other processes hold {format_bytes(held)} of the GPU")
    if _fragmented(err) is True:
        conf = 0.4
        summary = (
            f"CUDA OOM on GPU {err.device}, but {format_bytes(err.reserved_unallocated_bytes)} sat reserved-but-unallocated "
            f"for a {format_bytes(err.tried_to_allocate_bytes)} request: fragmentation, see allocator_fragmentation"
        )
    else:
        conf = 0.85 if err.tried_to_allocate_bytes is not None else 0.75
        asked, free = format_bytes(err.tried_to_allocate_bytes), format_bytes(err.free_bytes)
        summary = f"CUDA OOM on GPU {err.device}: {asked} requested, {free} free"
        if err.reserved_unallocated_bytes is not None:
            rules_out.append(
                f"allocator_fragmentation: only {format_bytes(err.reserved_unallocated_bytes)} reserved-but-unallocated, "
                f"less than the {format_bytes(err.tried_to_allocate_bytes)} request -- the GPU was really full"
            )
        if frag:
            notes.append(f"{len(frag)} other OOM(s) in the window were fragmentation")
    if notes:
        summary += "; " + "; ".join(notes)
    rules_out.append("host_oom: a CUDA allocation failed; the kernel did not kill anything for it")
    return Finding("gpu_oom", "oom.gpu", conf, summary, ev, rules_out, remediation, errs[0].ts, errs[-1].ts)


@rule("oom.allocator_fragmentation", "allocator_fragmentation", needs_any=("cuda_ooms", "torch"))
def allocator_fragmentation(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """The failed request fit in memory torch had reserved but not allocated: fragmented, not full."""
    errs = list(timeline.cuda_ooms)
    torch_ooms, retries, slack = _torch_ooms(timeline)
    remediation = [
        "Set PYTORCH_ALLOC_CONF=expandable_segments:True (older PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) "
        "so freed blocks can be stitched back together.",
        "On builds without expandable segments, PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:<N> stops big blocks being split.",
        "Make allocation sizes regular: pad/bucket sequence lengths and batch by a token budget instead of request count.",
        "Do not call torch.cuda.empty_cache() per request: it churns the cache and makes fragmentation worse.",
    ]
    frag = [e for e in errs if _fragmented(e)]
    if frag:
        err = max(frag, key=lambda e: (e.reserved_unallocated_bytes or 0) / max(e.tried_to_allocate_bytes or 1, 1))
        x, r, a = err.tried_to_allocate_bytes or 0, err.reserved_unallocated_bytes or 0, err.allocated_by_pytorch_bytes
        conf = 0.8
        if r >= FRAG_AMPLE * x and (a is None or r >= FRAG_AMPLE_OF_ALLOCATED * a):
            conf += 0.1
        if retries > 0:
            conf += 0.05
        ev = [
            Evidence(
                "CUDA OOMs with the request smaller than the reserved-but-unallocated slack",
                len(frag),
                "errors",
                frag[0].ts,
                frag[-1].ts,
            )
        ]
        ev += _err_evidence(err)
        if a:
            ev.append(Evidence("reserved-but-unallocated / allocated", round(r / a, 3), "ratio", err.ts, err.ts))
        if retries > 0:
            ev.append(
                Evidence(
                    "allocator retries (cudaMalloc failed, cache flushed, retried)",
                    retries,
                    "retries",
                    timeline.start,
                    timeline.end,
                )
            )
        if slack is not None and len(slack):
            ev.append(
                Evidence(
                    "reserved - allocated over time",
                    float(slack.values.max()),
                    "bytes",
                    float(slack.ts[0]),
                    float(slack.ts[-1]),
                    stats.excerpt(slack),
                )
            )
        return Finding(
            "allocator_fragmentation",
            "oom.allocator_fragmentation",
            min(conf, 0.95),
            f"CUDA OOM for {format_bytes(x)} while {format_bytes(r)} was reserved by PyTorch but unallocated: "
            "the memory was there, fragmented",
            ev,
            [f"gpu_oom (a full GPU): {format_bytes(r)} of cached slack >= the {format_bytes(x)} request"],
            remediation,
            frag[0].ts,
            frag[-1].ts,
        )
    if errs or slack is None or not len(slack):
        return None  # OOMs with no slack to speak of are the gpu_oom rule's; no OOMs and no snapshots: nothing to say
    share = _slack_share(timeline)
    if share < SLACK_SHARE or (torch_ooms <= 0 and retries <= 0):
        return None
    ev = [
        Evidence(
            "reserved - allocated, last",
            float(slack.values[-1]),
            "bytes",
            float(slack.ts[-1]),
            float(slack.ts[-1]),
            stats.excerpt(slack),
        ),
        Evidence("slack share of reserved", round(share, 3), "ratio", float(slack.ts[-1]), float(slack.ts[-1])),
        Evidence("OOMs counted by torch", torch_ooms, "ooms", timeline.start, timeline.end),
        Evidence("allocator retries", retries, "retries", timeline.start, timeline.end),
    ]
    conf = 0.6 if torch_ooms > 0 else 0.35  # retries alone: a warning sign, not an incident
    return Finding(
        "allocator_fragmentation",
        "oom.allocator_fragmentation",
        conf,
        f"{share:.0%} of PyTorch's reserved GPU memory is cached but unallocated, with {torch_ooms:.0f} OOM(s) and "
        f"{retries:.0f} allocation retries",
        ev,
        [],
        remediation,
        timeline.start,
        timeline.end,
    )
