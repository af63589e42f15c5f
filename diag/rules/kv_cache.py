"""KV-cache saturation: the engine's paged KV cache is full, it preempts running sequences, latency climbs.

An engine with paged attention (vLLM's scheduler, llama.cpp's slots) admits a request only when it can
give it KV blocks, and when a *running* sequence needs a new block and none is free it preempts one
(vLLM: preemption by recompute -- its blocks are freed, it goes back to the waiting queue and its
prefill is redone later). So at saturation three things show together in the engine's own metrics:

- KV usage (blocks in use / total) sits at its ceiling (``levels.KV_CEILING``);
- preemptions happen at a sustained rate (``levels.PREEMPTIONS_UP``) -- or, where the engine says why
  requests wait (vLLM's ``num_requests_waiting_by_reason{reason="capacity"}``), they wait for capacity;
- latency (time to first token, queue wait, end to end) rises while the cache is full: recomputed
  prefills and requests that cannot be admitted.

How it differs from its neighbours, and why the fixes differ:

- ``queue_backlog``: requests wait too, but the KV cache has room (usage under ``levels.KV_ROOM``): the
  slots or the request-count limit are the bottleneck, not the cache. More slots help there; here they
  make it worse (more sequences competing for the same blocks);
- host memory pressure / thrashing: the KV cache lives in GPU memory the engine pre-allocated; a full
  cache does not stall the host. When the service's memory stalls too, the stall is the likelier cause
  of the latency and this finding stays a suspect;
- GPU OOM: there an allocation *failed*; a full KV cache is the engine managing a fixed budget as
  designed (it preempts instead of failing). A CUDA OOM in the window takes precedence (the table in
  ``diag.rules.precedence``).

Without the KV usage series and a preemption or capacity-wait series the rule is not evaluated: an
engine that does not report its cache cannot be judged on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diag.rules import levels
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.stall_signals import memory_stall
from diag.rules.stats import excerpt_arrays, service_context
from diag.timeline import Series, Timeline
from diag.timeline import signals as sv
from diag.units import format_seconds

MIN_SAMPLES = 5  # KV usage samples: fewer cannot tell a full cache from one busy scrape
MIN_CEILING_SAMPLES = 3  # the cache at its ceiling in at least this many samples: sustained, not a blip
LATENCY_RISE = 1.5  # latency while full vs while the cache had room (or the window's first part): x1.5 is a rise
EARLY_SHARE = 0.2  # without a period with room, the window's first fifth is the reference
LATENCY_STEMS = (sv.LATENCY_TTFT, sv.LATENCY_QUEUE_WAIT, sv.LATENCY_E2E)  # what users feel first, in order
FIRM = 0.75
WITH_CAPACITY_WAITS = 0.05  # the engine itself says requests wait for KV capacity: a little firmer
NO_LATENCY_DATA = 0.45  # full and preempting, but no latency series to see users affected: a suspect
LATENCY_FLAT = 0.35  # full and preempting, latency flat: the engine copes; a suspect
HOST_STALL_CAP = 0.45  # the service's memory stalls too: that stall may be what slows requests
KV_SIGNAL = f"service:{sv.SVC_KV_CACHE_USAGE}"
PRESSURE_SIGNALS = (f"service:{sv.SVC_PREEMPTIONS_RPS}", f"service:{sv.SVC_WAITING_FOR_CAPACITY}")


@dataclass
class LatencyRise:
    """One latency series compared between the cache's full steps and its reference steps."""

    name: str
    full: float
    ref: float
    ref_what: str  # "while the cache had room" or "early in the window"
    series: Series

    @property
    def factor(self) -> float:
        return self.full / self.ref if self.ref > 0 else (np.inf if self.full > 0 else 1.0)


def _at(series: Series | None, ts: np.ndarray) -> np.ndarray:
    """A series' values at the KV samples' times (previous value, as a gauge holds); NaN where it has none."""
    if series is None:
        return np.full(ts.size, np.nan)
    v = series.valid()
    if not len(v):
        return np.full(ts.size, np.nan)
    idx = np.searchsorted(v.ts, ts, side="right") - 1
    out = np.where(idx >= 0, v.values[np.clip(idx, 0, None)], np.nan)
    return out.astype(float)


def _latency_rise(tl: Timeline, ts: np.ndarray, full: np.ndarray, room: np.ndarray) -> LatencyRise | None:
    """The first latency series (TTFT, queue wait, end to end; mean before p50) with values on both sides."""
    for stem in LATENCY_STEMS:
        for stat in ("mean", "p50"):
            name = sv.latency(stem, stat)
            s = tl.service.get(name)
            if s is None or not len(s.valid()):
                continue
            vals = _at(s, ts)
            ok = np.isfinite(vals)
            if (ok & full).sum() == 0:
                continue
            ref_mask, what = ok & room, "while the cache had room and nothing was preempted"
            if ref_mask.sum() < 2:
                early = ts <= ts[0] + EARLY_SHARE * (ts[-1] - ts[0])
                ref_mask, what = ok & early & ~full, "early in the window, before the cache filled"
            if ref_mask.sum() == 0:
                continue
            return LatencyRise(name, float(np.median(vals[ok & full])), float(np.median(vals[ref_mask])), what, s.valid())
    return None


@rule("kv_cache.saturation", "kv_cache_saturation", needs=(KV_SIGNAL,), needs_any=PRESSURE_SIGNALS)
def kv_cache_saturation(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """The KV cache at its ceiling with preemptions (or requests waiting for KV capacity) while latency rises."""
    kv = tl.service[sv.SVC_KV_CACHE_USAGE].valid()
    if len(kv) < MIN_SAMPLES:
        return TooLittleData(f"{len(kv)} KV-cache usage samples", f"{MIN_SAMPLES} samples")
    ts, usage = kv.ts, kv.values
    full = usage >= levels.KV_CEILING
    room = usage < levels.KV_ROOM
    if int(full.sum()) < MIN_CEILING_SAMPLES:
        return None  # the cache never stayed full: whatever waits, waits for something else
    preempt = _at(tl.service.get(sv.SVC_PREEMPTIONS_RPS), ts)
    capacity = _at(tl.service.get(sv.SVC_WAITING_FOR_CAPACITY), ts)
    pre_full = float(np.nanmean(preempt[full])) if np.isfinite(preempt[full]).any() else float("nan")
    cap_full = float(np.nanmax(capacity[full])) if np.isfinite(capacity[full]).any() else float("nan")
    preempting = bool(np.isfinite(pre_full) and pre_full >= levels.PREEMPTIONS_UP)
    waits_for_capacity = bool(np.isfinite(cap_full) and cap_full > 0)
    if not (preempting or waits_for_capacity):
        return None  # full but nothing pushed out or held back: the cache is used, not short
    t0, t1 = float(ts[full][0]), float(ts[full][-1])
    evidence = [
        Evidence(f"KV-cache usage at >= {levels.KV_CEILING:.0%} (share of samples)", round(float(full.mean()), 3),
                 f"ratio of {ts.size} samples", float(ts[0]), float(ts[-1]), excerpt_arrays(ts, usage)),
        Evidence("KV-cache usage, max", round(float(usage.max()), 3), "ratio"),
    ]  # fmt: skip
    if np.isfinite(pre_full):
        evidence.append(Evidence("preemptions while the cache is full (mean rate)", round(pre_full, 3), "/s", t0, t1))
    if np.isfinite(cap_full):
        evidence.append(Evidence("requests waiting for KV capacity while full (max)", cap_full, "requests", t0, t1))
    # The reference: samples with room and no KV pressure at all. A cache that swings between full and partly
    # freed (sequences finishing, preempted ones leaving) has room at moments of the saturated stretch too, and
    # latency then is the saturation's, not the calm's.
    pressure = (np.nan_to_num(preempt, nan=0.0) > 0) | (np.nan_to_num(capacity, nan=0.0) > 0)
    rise = _latency_rise(tl, ts, full, room & ~pressure)
    if rise is not None:
        evidence.append(Evidence(f"{rise.name} while full vs {rise.ref_what} (median)",
                                 f"{rise.full:.3g} vs {rise.ref:.3g}", "s", t0, t1,
                                 excerpt_arrays(rise.series.ts, rise.series.values)))  # fmt: skip
    stall = [x for x in memory_stall(tl, service_context(tl, ac), None) if x.up and x.service]
    for x in stall[:3]:
        evidence.append(Evidence(f"{x.label()} (loaded vs calm)", f"{x.hi:.3g} vs {x.lo:.3g}", x.unit))
    pushed = (f"preempts {pre_full:.2g} sequences/s" if preempting else "") + (
        (" and " if preempting else "") + f"holds up to {cap_full:.0f} requests for KV capacity" if waits_for_capacity else ""
    )
    rising = rise is not None and rise.factor >= LATENCY_RISE
    if rise is None:
        conf, how = NO_LATENCY_DATA, "no latency series to see whether users are affected"
    elif rising:
        conf = FIRM + (WITH_CAPACITY_WAITS if waits_for_capacity else 0.0)
        how = (f"{rise.name} rises {rise.factor:.1f}x ({format_seconds(rise.ref)} {rise.ref_what} -> "
               f"{format_seconds(rise.full)} while full)")  # fmt: skip
    else:
        conf, how = LATENCY_FLAT, f"but {rise.name} stays at {rise.factor:.2f}x its reference: the engine copes for now"
    rules_out = [
        f"not a plain queue backlog: the KV cache is at >= {levels.KV_CEILING:.0%} of its blocks, not under "
        f"{levels.KV_ROOM:.0%} with room left",
    ]
    if stall:
        conf = min(conf, HOST_STALL_CAP)
        how += "; the service's memory stalls too, which may be what slows requests (see the memory findings)"
    else:
        rules_out.append("not host memory pressure: the service's memory does not stall while the cache is full")
    if not tl.cuda_ooms:
        rules_out.append("not a GPU OOM: no CUDA allocation failed; the engine preempts within its fixed KV budget")
    return Finding(
        cls="kv_cache_saturation",
        rule="kv_cache.saturation",
        confidence=conf,
        summary=(
            f"The KV cache is full ({float(usage.max()):.0%} of its blocks, >= {levels.KV_CEILING:.0%} in "
            f"{float(full.mean()):.0%} of the samples) and the engine {pushed}; {how}"
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "lower max_num_seqs (vLLM; TGI: max_batch_total_tokens, llama.cpp: --parallel) so the running batch fits "
            "the KV cache: every preemption throws away a prefill that must be recomputed",
            "lower max_num_batched_tokens (and max_model_len if prompts allow) so fewer tokens compete for blocks",
            "raise gpu_memory_utilization only within the GPU's free VRAM (the device's total minus what other processes "
            "and the activations need): past it the engine fails with CUDA OOM instead of preempting",
            "or scale out: more replicas give more KV blocks; more slots on one replica do not",
        ],
        start=t0,
        end=t1,
    )
