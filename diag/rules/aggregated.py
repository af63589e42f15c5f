"""Queue backlog vs thrashing from aggregated request metrics, where no per-request rows exist.

On the fleet path (Prometheus) a service exposes histograms, not rows: ours
(``llmdiag_request_{queue_wait,inference}_seconds``), vLLM's (``vllm:request_queue_time_seconds``,
``vllm:request_inference_time_seconds``) or TGI's (``tgi_request_{queue,inference}_duration``). The
loader turns each into per-step means (rate of sum / rate of count) and quantiles, and this rule runs
the same test as ``requests.queue_backlog`` / ``requests.thrashing`` on those steps:

- a backlog: the queue wait rises (its busy level >= 4x its calm level and >= max(50 ms, half an
  inference)) -- or waits >= 3x the inference time in >= 80 % of the steps -- while inference time stays
  within 1.5x its calm level and the service's memory does not stall;
- thrashing: inference time itself inflates >= 1.5x while the service's memory stalls.

With enough request rows this rule stands aside: the per-request test is finer.

``aggregated.queue_from_gauges`` asks the same question of an engine that exports no latency histogram at all
(llama.cpp's server: ``requests_deferred`` waiting for a slot, ``requests_processing`` in one) from the two gauges
alone, by Little's law: over any window the mean number waiting is the arrival rate times the mean wait, and the
mean number running the arrival rate times the mean service time, so ``waiting / running`` (window means) *is*
the ratio of mean queue wait to mean service time -- without knowing the arrival rate, which such an engine does
not export. It stands aside wherever measured waits exist (histograms or request rows).
"""

from __future__ import annotations

import numpy as np

from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.requestload import (
    MIN_REQUESTS,
    OVERWHELM_FACTOR,
    OVERWHELM_SHARE,
    S_INFLATED,
    S_SEVERE,
    W_MIN_S,
    W_MIN_VS_S,
    W_RISE,
    W_RISE_MARGIN_S,
    WAIT_DOMINATES,
)
from diag.rules.stall_signals import StallSignal, memory_stall
from diag.rules.stats import excerpt_arrays, service_context
from diag.timeline import Series, Timeline
from diag.units import format_seconds

MIN_STEPS = 5  # steps with requests: fewer cannot tell a calm level from a busy one
DOMINANT_CONFIDENCE = 0.6  # a wait that dwarfs a (less than severely) slowed inference: a backlog, the slowdown contributing
CALM_QUARTER, BUSY_QUARTER = 0.25, 0.75  # steps by queue wait: the calm and the busy quarter
TIME_PARTS = 3  # a service can slow at constant load: inference time of the later thirds against the first


def _pick(svc: dict[str, Series], key: str) -> tuple[str, Series] | None:
    for name in (f"{key}_mean_s", f"{key}_p50_s"):
        s = svc.get(name)
        if s is not None and len(s.valid()):
            return name, s.valid()
    return None


def _stalling(stall: list[StallSignal]) -> str:
    """The stall that makes a risen wait only a suspect, named: without it, "slowed 1.00x" would read as no reason."""
    if not stall:
        return ""
    x = stall[0]
    return f" while its memory stalls ({x.label()} {x.hi:.3g} vs {x.lo:.3g} {x.unit} calm)"


@rule(
    "aggregated.queue_vs_thrash",
    "queue_backlog",
    needs=("service:inference_p50_s",),
    needs_any=("service:queue_wait_mean_s", "service:queue_wait_p50_s"),
)
def queue_vs_thrash(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Per step: queue wait vs inference time from histograms; a backlog keeps inference flat, thrashing inflates it."""
    if len(tl.requests) and "start" in tl.requests and int(np.isfinite(tl.requests["start"]).sum()) >= MIN_REQUESTS:
        return None  # per-request rows decide (requests.queue_backlog / requests.thrashing)
    wait, infer = _pick(tl.service, "queue_wait"), _pick(tl.service, "inference")
    if wait is None or infer is None:
        return None
    (w_name, w), (s_name, s) = wait, infer
    s_at = np.interp(w.ts, s.ts, s.values, left=np.nan, right=np.nan)
    keep = np.isfinite(s_at) & np.isfinite(w.values)
    ts, wv, sv = w.ts[keep], w.values[keep], s_at[keep]
    if ts.size < MIN_STEPS:
        return TooLittleData(f"{ts.size} steps with requests", f"{MIN_STEPS} steps with requests")
    # Busy steps: the top quarter by queue wait; calm: the bottom quarter. Inference is compared between them, as the
    # per-request rule compares it between load quartiles (medians: a step or two of noise must not decide).
    w_lo, w_hi = np.quantile(wv, [CALM_QUARTER, BUSY_QUARTER])
    calm, busy = wv <= w_lo, wv >= w_hi
    w_calm, w_busy = float(np.median(wv[calm])), float(np.median(wv[busy]))
    s_calm, s_busy = float(np.median(sv[calm])), float(np.median(sv[busy]))
    thirds = [float(np.median(part)) for part in np.array_split(sv, TIME_PARTS)]
    by_time = max(thirds) / thirds[0] if thirds[0] > 0 else 1.0
    inflation = max(s_busy / s_calm if s_calm > 0 else 1.0, by_time)
    overwhelming = float(np.mean(wv >= OVERWHELM_FACTOR * np.maximum(sv, 1e-3))) >= OVERWHELM_SHARE
    rose = (w_busy >= max(W_MIN_S, W_MIN_VS_S * s_calm) and w_busy >= W_RISE * w_calm + W_RISE_MARGIN_S) or overwhelming
    stall = [x for x in memory_stall(tl, service_context(tl, ac), None) if x.up and x.service]
    depth = tl.service.get("queue_depth")
    never_empty = depth is not None and len(depth.valid()) >= MIN_STEPS and float(np.min(depth.valid().values)) > 0
    t0, t1 = float(ts[0]), float(ts[-1])
    evidence = [
        Evidence(f"queue wait per step ({w_name}), busy vs calm quarter (median)", f"{w_busy:.3g} vs {w_calm:.3g}", "s", t0, t1,
                 excerpt_arrays(ts, wv)),
        Evidence(f"inference time per step ({s_name}), busy vs calm quarter (median)", f"{s_busy:.3g} vs {s_calm:.3g}", "s",
                 t0, t1, excerpt_arrays(ts, sv)),
        Evidence("inference time inflation (worst of busy/calm and later/first third)", round(inflation, 2), "x", t0, t1),
        Evidence(f"steps with queue wait >= {OVERWHELM_FACTOR:g}x inference", round(float(np.mean(wv >= OVERWHELM_FACTOR * sv)),
                 3), f"ratio of {ts.size} steps", t0, t1),
    ]  # fmt: skip
    if depth is not None and len(depth.valid()):
        evidence.append(Evidence("queue depth, min over the window", float(np.min(depth.valid().values)), "requests", t0, t1))
    for x in stall[:3]:
        evidence.append(Evidence(f"{x.label()} (loaded vs calm)", f"{x.hi:.3g} vs {x.lo:.3g}", x.unit))
    basis = "judged from aggregated histograms (no per-request rows)"
    if inflation >= S_INFLATED and stall:
        return Finding(
            cls="thrashing",
            rule="aggregated.queue_vs_thrash",
            confidence=0.6 + (0.1 if inflation >= S_SEVERE else 0.0),
            summary=(
                f"Inference time itself inflates {inflation:.1f}x ({format_seconds(thirds[0])} -> {format_seconds(max(thirds))}) "
                f"while the service's memory stalls: thrashing, not only a queue"
            ),
            evidence=evidence,
            rules_out=[basis, f"not a plain queue backlog: inference time rose {inflation:.1f}x"],
            remediation=["lower max concurrency", "shrink the working set or give the group more memory"],
            start=t0,
            end=t1,
        )
    if not rose:
        return None
    # The wait rose, but inference slowed or memory stalls too: the queue may be a symptom (a suspect only) --
    # unless the wait dwarfs an inference slowed less than severely: a backlog with a contributing slowdown.
    flat = inflation < S_INFLATED and not stall
    dominant = not stall and inflation < S_SEVERE and s_busy > 0 and w_busy >= WAIT_DOMINATES * s_busy
    conf = 0.65 + (0.05 if never_empty else 0.0) if flat else (DOMINANT_CONFIDENCE if dominant else 0.4)
    stays = (
        f"stays at {format_seconds(s_busy)} ({inflation:.2f}x its calm level): too little capacity, not a slower service"
        if flat
        else f"also slowed {inflation:.2f}x to {format_seconds(s_busy)}, but the wait is "
        f"{w_busy / s_busy:.0f}x the inference time: too little capacity, with a contributing slowdown"
        if dominant
        else f"slowed {inflation:.2f}x to {format_seconds(s_busy)}{_stalling(stall)}: the queue is at least partly a symptom"
    )
    return Finding(
        cls="queue_backlog",
        rule="aggregated.queue_vs_thrash",
        confidence=conf,
        summary=(
            f"Requests wait {format_seconds(w_busy)} for a slot at busy times (vs {format_seconds(w_calm)} calm) "
            f"while inference {stays}"
        ),
        evidence=evidence,
        rules_out=[basis, *(["no memory stall of the service at the busy times"] if not stall else [])],
        remediation=[
            "bound concurrency and keep the queue small; reject the excess early with 429 + Retry-After (backpressure)",
            "scale out (more replicas/workers within the memory budget) or rate-limit the heaviest clients",
        ],
        start=t0,
        end=t1,
    )


# --------------------------------------------------------------------------- the gauges alone (Little's law)

MIN_WAITING_STEPS = 5  # samples with requests waiting: fewer is a blip, not a backlog (and not too little data)
GAUGE_FLAT_CONFIDENCE = 0.6  # under the histograms' 0.65: point samples of two gauges, not measured waits
GAUGE_DOMINANT_CONFIDENCE = 0.55  # under the histograms' 0.6, for the same reason
GAUGE_SUSPECT_CONFIDENCE = 0.4


@rule(
    "aggregated.queue_from_gauges",
    "queue_backlog",
    needs=("service:requests_waiting", "service:requests_running"),
)
def queue_from_gauges(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Waiting vs running requests from the engine's gauges: by Little's law their ratio is queue wait over service time."""
    if len(tl.requests) and "start" in tl.requests and int(np.isfinite(tl.requests["start"]).sum()) >= MIN_REQUESTS:
        return None  # per-request rows decide (requests.queue_backlog / requests.thrashing)
    if _pick(tl.service, "queue_wait") is not None:
        return None  # measured waits decide (aggregated.queue_vs_thrash)
    waiting, running = tl.service["requests_waiting"].valid(), tl.service["requests_running"].valid()
    if len(waiting) < MIN_STEPS or len(running) < MIN_STEPS:
        return TooLittleData(f"{min(len(waiting), len(running))} samples of the engine's gauges", f"{MIN_STEPS} samples")
    ts = waiting.ts
    lq = waiting.values
    # A request waits only while a slot is busy: a sample with some waiting and none running caught the instant
    # between one request's end and the next one's start, so at least one slot counts as serving then.
    ls = np.interp(ts, running.ts, running.values)
    ls = np.where(lq > 0, np.maximum(ls, 1.0), ls)
    occupied = (lq + ls) > 0
    if int(np.sum(lq > 0)) < MIN_WAITING_STEPS:
        return None  # hardly anything ever waited: no backlog (an idle engine is an answer, not a lack of data)
    ts, lq, ls = ts[occupied], lq[occupied], ls[occupied]
    # Busy and calm: the top and bottom quarters of the occupied samples by requests waiting; W/S over each quarter
    # is the ratio of its means (Little's law holds for averages, not sample by sample).
    q_lo, q_hi = np.quantile(lq, [CALM_QUARTER, BUSY_QUARTER])
    busy, calm = lq >= q_hi, lq <= q_lo
    ratio_busy = float(np.mean(lq[busy]) / np.mean(ls[busy]))
    ratio_calm = float(np.mean(lq[calm]) / np.mean(ls[calm])) if np.mean(ls[calm]) > 0 else 0.0
    dwarfed = lq >= OVERWHELM_FACTOR * ls  # samples where the wait is >= 3x the service time
    rose = ratio_busy >= WAIT_DOMINATES and int(dwarfed.sum()) >= MIN_WAITING_STEPS
    if not rose:
        return None
    # Did the service itself slow? The engine's time per generated token (its decode speed), busy vs calm and later
    # thirds vs the first, as the histogram rule compares inference time.
    inflation, s_note = 1.0, "no per-token time exported: whether the service itself slowed is not known"
    per_token = _pick(tl.service, "itl")
    if per_token is not None:
        s = per_token[1]
        s_at = np.interp(ts, s.ts, s.values, left=np.nan, right=np.nan)
        ok = np.isfinite(s_at)
        if int(ok.sum()) >= MIN_STEPS and int((ok & busy).sum()) and int((ok & calm).sum()):
            s_busy, s_calm = float(np.median(s_at[ok & busy])), float(np.median(s_at[ok & calm]))
            thirds = [float(np.median(part)) for part in np.array_split(s_at[ok], TIME_PARTS)]
            by_time = max(thirds) / thirds[0] if thirds[0] > 0 else 1.0
            inflation = max(s_busy / s_calm if s_calm > 0 else 1.0, by_time)
            s_note = f"time per generated token {format_seconds(s_calm)} calm -> {format_seconds(s_busy)} busy"
    stall = [x for x in memory_stall(tl, service_context(tl, ac), None) if x.up and x.service]
    flat = inflation < S_INFLATED and not stall
    dominant = not stall and inflation < S_SEVERE
    conf = GAUGE_FLAT_CONFIDENCE if flat else GAUGE_DOMINANT_CONFIDENCE if dominant else GAUGE_SUSPECT_CONFIDENCE
    t0, t1 = float(ts[0]), float(ts[-1])
    evidence = [
        Evidence("requests waiting / running, busy quarter (window means)", f"{np.mean(lq[busy]):.3g} / {np.mean(ls[busy]):.3g}",
                 "requests", t0, t1, excerpt_arrays(waiting.ts, waiting.values)),
        Evidence("queue wait / service time by Little's law, busy vs calm quarter", f"{ratio_busy:.3g} vs {ratio_calm:.3g}",
                 "x", t0, t1),
        Evidence(f"samples with waiting >= {OVERWHELM_FACTOR:g}x running", int(dwarfed.sum()), f"of {ts.size} occupied samples",
                 t0, t1),
        Evidence("service slowdown (time per token: worst of busy/calm and later/first third)", round(inflation, 2), "x", t0, t1),
    ]  # fmt: skip
    for x in stall[:3]:
        evidence.append(Evidence(f"{x.label()} (loaded vs calm)", f"{x.hi:.3g} vs {x.lo:.3g}", x.unit))
    why = (f"the service's time per token stays within {inflation:.2f}x: too little capacity, not a slower service"
           if flat else f"the service slowed {inflation:.2f}x too, but the wait is {ratio_busy:.0f}x the service time: "
           "too little capacity, with a contributing slowdown" if dominant
           else f"the service slowed {inflation:.2f}x{' and its memory stalls' if stall else ''}: the queue is at least "
           "partly a symptom")  # fmt: skip
    return Finding(
        cls="queue_backlog",
        rule="aggregated.queue_from_gauges",
        confidence=conf,
        summary=(
            f"{np.mean(lq[busy]):.0f} requests wait for {np.mean(ls[busy]):.1g} running at busy times: by Little's law each "
            f"waits about {ratio_busy:.0f}x its service time (vs {ratio_calm:.1f}x calm); {why}"
        ),
        evidence=evidence,
        rules_out=[
            "judged from the engine's waiting and running gauges by Little's law (no latency histograms, no request rows)",
            s_note,
            *(["no memory stall of the service at the busy times"] if not stall else []),
        ],
        remediation=[
            "bound concurrency and keep the queue small; reject the excess early with 429 + Retry-After (backpressure)",
            "scale out (more replicas or slots within the memory budget) or rate-limit the heaviest clients",
        ],
        start=t0,
        end=t1,
    )
