"""What a batch carries decides the memory peak: MoE expert skew, request-count batching, oversized prompts.

Activation and KV memory scale with *tokens* in flight, not requests (collectors/tracking/batches.py):

- ``moe_expert_skew``: in a mixture-of-experts layer the peak is set by the busiest expert; a router
  that persistently sends most tokens to one expert overflows its capacity and spikes memory.
- ``request_count_batching``: a batcher capped by request count lets eight long prompts through
  where eight short ones were expected -- ten or a hundred times the tokens in "the same" batch.
- ``oversized_context``: a few very long prompts drive the failures (timeouts, OOMs) and peaks.

Each rule needs one table (routing / batches / requests) and uses memory, OOM and config records
when present to corroborate: the table alone shows a *risk*; a finding of 0.5 or more needs the
risk to line up with a memory peak, an overflow or failures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.rules import numstats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.stats import ServiceContext, excerpt_arrays, memory_series, service_context, spearman_test, text_masks
from diag.rules.usl import covered_time
from diag.timeline import Series, Timeline

# MoE: vLLM/SGLang call balancedness (mean/max) below ~0.3 badly imbalanced; top/median > 3 means the
# busiest expert does three times the typical one's work. Steps with under 4 tokens per expert on
# average are skipped: with so few tokens a random router looks skewed by chance.
SKEW_HIGH = 3.0
BALANCED_LOW = 0.3
MIN_TOKENS_PER_EXPERT = 4.0
MIN_ROUTING_STEPS = 20
PERSISTENT_SHARE = 0.5
BALANCED_SEVERE = 0.2  # balancedness under 0.2, or skew at twice SKEW_HIGH: severely skewed
OVERFLOW_OFTEN, OVERFLOW_SOME = 0.1, 0.01  # shares of steps with expert capacity overflow

# Batching: a 10x spread of input tokens among batches of (nearly) the same request count is the
# signature of a request-count cap; batches must actually hit the count cap often for the cap to be the limiter.
TOKEN_SPREAD = 10.0
CAP_SHARE = 0.2
NEAR_CAP = 0.75  # batches of at least 75 % of the request-count cap (and 2 requests) are "at the cap"
BIG_BATCH_QUANTILE = 0.95  # the largest batches by tokens, among those near the cap
SPREAD_QUANTILES = (0.05, 0.95)  # token spread: p95 / p5 ...
MIN_SPREAD_BATCHES = 10  # ... with this many batches, else max / min
BUDGET_HOLDS_CEILING = 0.3  # a token budget that holds: the spread is a risk within the budget, a note at most
MIN_BATCHES = 20

# Oversized context: failures concentrated in the longest decile, with a one-sided Fisher exact test.
MIN_PROMPTS = 30
LONG_QUANTILE = 0.9
LONG_VS_REST = 3.0  # the long decile's median prompt must be this many times the rest's: otherwise nothing is "oversized"
FAIL_RATE_LONG = 0.1
FAIL_RATIO = 3.0
FISHER_P = 0.01
MIN_PER_SIDE = 3  # requests in the longest decile and in the rest, and failures in the longest decile
TIES_AT_CUT = 0.2  # more than this share at or above the cut: many ties, take strictly longer prompts
MIN_PEAK_SAMPLES = 20  # memory samples around the long prompts to find peaks in
PEAK_QUANTILE = 0.95  # memory peaks: the top 5 % of samples ...
MIN_PEAKS = 3  # ... at least three of them
PEAKS_INSIDE = 0.5  # at least half the peaks while a long prompt is in flight ...
PEAKS_OVER_CHANCE = 1.5  # ... and 1.5x more often than the time they are in flight would give by chance
HUGE_PROMPT_CAP = 100_000  # a max_prompt_tokens this large is no cap at all
SIMILAR_PEAKS_CEILING = 0.2  # peaks during the longer of similar prompts, nothing failing: a note, not a suspect
SIMILAR_FAILURES_CEILING = 0.35  # failures concentrate, but the "long" prompts are not much longer: a suspect
PEAKS_ONLY_CEILING = 0.45  # memory peaks with long prompts but no failures: a suspect at most

CORRELATION_MIN = 0.3  # Spearman rho for "memory follows ..."; with p < CORRELATION_P and >= 10 points
CORRELATION_P = 0.01
MIN_CORRELATION_POINTS = 10
OOM_AFTER_S = 5.0  # an OOM this soon after the last skewed step or batch still counts as during them


def _latest_settings(tl: Timeline) -> dict[str, Any]:
    return dict(tl.configs[-1].settings) if tl.configs else {}


def _follows(mem: Series, ts: np.ndarray, amount: np.ndarray) -> tuple[float, float, int]:
    """Rank correlation between the largest ``amount`` started in each memory-sample interval and the
    memory peak at that sample or the next (a batch's peak can land one sample late)."""
    mts, mval = mem.ts, mem.values
    if mts.size < 3 or ts.size == 0:
        return math.nan, math.nan, 0
    k = np.searchsorted(mts, ts, "left")  # the first sample at or after the event
    keep = k < mts.size
    k, amt = k[keep], amount[keep]
    top = np.full(mts.size, -np.inf)
    np.maximum.at(top, k, amt)
    peak = np.maximum(mval, np.concatenate((mval[1:], mval[-1:])))
    has = np.isfinite(top) & (top > -np.inf)
    return spearman_test(top[has], peak[has], min_points=MIN_CORRELATION_POINTS)


def _oom_times(tl: Timeline) -> np.ndarray:
    return np.asarray([o.ts for o in tl.ooms] + [o.ts for o in tl.cuda_ooms], dtype=np.float64)


# --------------------------------------------------------------------------- MoE expert skew


@rule("batching.moe_expert_skew", "moe_expert_skew", needs=("routing",))
def moe_expert_skew(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """One expert persistently takes most tokens (skew = top/median, balancedness = mean/max), with overflow or memory peaks."""
    rt = tl.routing
    if not len(rt):
        return None
    top = rt["top_expert_tokens"]
    bal = rt["balancedness"]
    mean_per_expert = bal * top
    eligible = np.isfinite(top) & (top > 0) & np.isfinite(bal) & (mean_per_expert >= MIN_TOKENS_PER_EXPERT)
    n = int(eligible.sum())
    if n < MIN_ROUTING_STEPS:
        return None
    skew = np.where(np.isfinite(rt["skew"]), rt["skew"], np.inf)[eligible]  # median 0 with tokens routed: extreme skew
    b = bal[eligible]
    skewed = (skew > SKEW_HIGH) | (b < BALANCED_LOW)
    share = float(skewed.mean())
    med_skew = float(np.median(skew))
    med_bal = float(np.median(b))
    if share < PERSISTENT_SHARE or not (med_skew > SKEW_HIGH or med_bal < BALANCED_LOW):
        return None
    ts = rt["ts"][eligible]
    layers = rt["layer"][eligible]
    skewed_layers = np.unique(layers[skewed])
    overflow = np.nan_to_num(rt["overflow_tokens"][eligible], nan=0.0)
    overflow_share = float((overflow > 0).mean())
    ctx = service_context(tl, ac)
    mem = _moe_memory(tl, ctx)
    rho = p = math.nan
    points = 0
    if mem is not None:
        rho, p, points = _follows(mem[1], ts, top[eligible])
    mem_follows = np.isfinite(rho) and rho >= CORRELATION_MIN and p < CORRELATION_P
    ooms = _oom_times(tl)
    ooms_in = int(((ooms >= ts.min()) & (ooms <= ts.max() + OOM_AFTER_S)).sum()) if ooms.size else 0

    conf = 0.4
    conf += 0.05 if (med_bal < BALANCED_SEVERE or med_skew >= 2 * SKEW_HIGH) else 0.0
    conf += 0.2 if overflow_share >= OVERFLOW_OFTEN else 0.1 if overflow_share > OVERFLOW_SOME else 0.0
    conf += 0.2 if mem_follows else 0.0
    conf += 0.1 if ooms_in else 0.0
    conf = min(conf, 0.95)
    settings = _latest_settings(tl)
    evidence = [
        Evidence("routing steps analysed (layer x step)", n, "steps", float(ts.min()), float(ts.max())),
        Evidence("share of steps skewed (top/median > 3 or balancedness < 0.3)", round(share, 3), "ratio"),
        Evidence("median skew (top / median expert tokens)", "inf" if math.isinf(med_skew) else round(med_skew, 2), "ratio"),
        Evidence("median balancedness (mean / max expert tokens)", round(med_bal, 3), "ratio", series=excerpt_arrays(ts, b)),
        Evidence("layers with skewed steps", f"{skewed_layers.size} of {np.unique(layers).size}", "layers"),
        Evidence("median tokens at the busiest expert", round(float(np.median(top[eligible])), 1), "tokens"),
        Evidence("steps with capacity overflow", round(overflow_share, 3), "ratio"),
        Evidence("overflow tokens (dropped or re-routed)", int(overflow.sum()), "tokens"),
    ]
    if mem is not None:
        evidence.append(
            Evidence(
                f"Spearman rho, busiest-expert tokens vs {mem[0]}",
                None if math.isnan(rho) else round(rho, 3),
                f"rho (p={p:.2g}, n={points})",
            )
        )
    if ooms_in:
        evidence.append(Evidence("OOM kills / CUDA OOM errors while skewed", ooms_in, "events"))
    if "experts" in settings:
        evidence.append(Evidence("experts (service config)", settings["experts"], "experts"))
    rules_out = [f"not a momentary burst: {share:.0%} of {n} routing steps are skewed, across {skewed_layers.size} layer(s)"]
    if mem is not None and not mem_follows:
        rules_out.append("memory does not follow the busiest expert's load here: skew may be a latency, not a memory, cause")
    return Finding(
        cls="moe_expert_skew",
        rule="batching.moe_expert_skew",
        confidence=conf,
        summary=(
            f"MoE routing is persistently skewed: median busiest/typical expert {med_skew:.1f}x, balancedness {med_bal:.2f} "
            f"over {n} steps; {overflow_share:.0%} of steps overflow expert capacity"
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "enable expert load balancing (EPLB / redundant copies of the hot experts across devices)",
            "set a capacity factor so an overloaded expert drops or re-routes tokens instead of growing its buffer",
            "batch by a token budget so a skewed step cannot exceed the activation memory you planned for",
        ],
        start=float(ts.min()),
        end=float(ts.max()),
    )


def _moe_memory(tl: Timeline, ctx: ServiceContext) -> tuple[str, Series] | None:
    """GPU allocator peak where torch stats exist (MoE usually runs on GPUs), else the service memory."""
    t = tl.torch
    if len(t) >= 3:
        col = "peak_allocated_bytes" if np.isfinite(t["peak_allocated_bytes"]).sum() >= 3 else "allocated_bytes"
        s = Series(t["ts"], t[col]).valid()
        if len(s) >= 3:
            return f"torch {col}", s
    return memory_series(tl, ctx)


# --------------------------------------------------------------------------- request-count batching


@rule("batching.request_count", "request_count_batching", needs=("batches",))
def request_count_batching(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Batches capped by request count whose input tokens vary >= 10x, with memory following the batch tokens."""
    bt = tl.batches
    if len(bt) < MIN_BATCHES:
        return None
    count, tokens = bt["requests"], bt["input_tokens"]
    ok = np.isfinite(count) & np.isfinite(tokens) & (count >= 1)
    count, tokens, ts = count[ok], tokens[ok], bt["ts"][ok]
    if count.size < MIN_BATCHES:
        return None
    cap = float(count.max())
    if cap < 2:
        return None  # one request per batch: nothing is batched by count
    at_cap = count >= cap
    cap_share = float(at_cap.mean())
    near = count >= max(2.0, NEAR_CAP * cap)
    spread, basis = _spread(tokens[near])
    group_spread = _group_spread(count, tokens)
    if not np.isfinite(spread) or (np.isfinite(group_spread) and group_spread > spread):
        spread, basis = group_spread, "p95/p5 within one request count"
    if cap_share < CAP_SHARE or not np.isfinite(spread) or spread < TOKEN_SPREAD:
        return None
    settings = _latest_settings(tl)
    mode = str(settings.get("batching") or "")
    budget = settings.get("max_batch_tokens")
    budget_holds = mode == "tokens" or (
        isinstance(budget, (int, float)) and mode != "requests" and float(tokens.max()) <= float(budget)
    )
    ctx = service_context(tl, ac)
    mem = memory_series(tl, ctx)
    rho = p = math.nan
    points = 0
    if mem is not None:
        rho, p, points = _follows(mem[1], ts, tokens)
    mem_follows = np.isfinite(rho) and rho >= CORRELATION_MIN and p < CORRELATION_P
    ooms = _oom_times(tl)
    ooms_in = int(((ooms >= ts.min()) & (ooms <= ts.max() + OOM_AFTER_S)).sum()) if ooms.size else 0

    conf = 0.4
    conf += 0.05 if spread >= 3 * TOKEN_SPREAD else 0.0
    conf += 0.15 if mode == "requests" else 0.0
    conf += 0.2 if mem_follows else 0.0
    conf += 0.1 if ooms_in else 0.0
    if budget_holds:
        conf = min(conf, BUDGET_HOLDS_CEILING)
    big = near & (tokens >= np.quantile(tokens[near], BIG_BATCH_QUANTILE))
    evidence = [
        Evidence("batches analysed", int(count.size), "batches", float(ts.min()), float(ts.max())),
        Evidence("request-count cap (largest batch by requests)", int(cap), "requests"),
        Evidence("share of batches at the cap", round(cap_share, 3), "ratio"),
        Evidence(f"input-token spread among near-cap batches ({basis})", round(spread, 1), "x"),
        Evidence(
            "input tokens per near-cap batch, median / max", f"{np.median(tokens[near]):.0f} / {tokens[near].max():.0f}", "tokens"
        ),
        Evidence(
            "largest batches by tokens (near the request cap)", int(big.sum()), "batches", series=excerpt_arrays(ts, tokens)
        ),
    ]
    if mem is not None:
        evidence.append(
            Evidence(
                f"Spearman rho, batch input tokens vs {mem[0]} peak",
                None if math.isnan(rho) else round(rho, 3),
                f"rho (p={p:.2g}, n={points})",
            )
        )
    if mode:
        evidence.append(Evidence("batching policy (service config)", mode, ""))
    if budget is not None:
        evidence.append(Evidence("max_batch_tokens (service config)", budget, "tokens"))
    if ooms_in:
        evidence.append(Evidence("OOM kills / CUDA OOM errors during the batches", ooms_in, "events"))
    rules_out = []
    if budget_holds:
        rules_out.append("a token budget is configured and holds: the spread is within the budget, not an unbounded batch")
    else:
        rules_out.append(
            f"not an even load: batches of {int(cap)} requests carried from {np.min(tokens[near]):.0f} "
            f"to {np.max(tokens[near]):.0f} tokens"
        )
    if mem is not None and not mem_follows:
        rules_out.append("memory does not follow batch tokens here: the spread is a risk, not (yet) the cause of a peak")
    return Finding(
        cls="request_count_batching",
        rule="batching.request_count",
        confidence=conf,
        summary=(
            f"Batches are capped at {int(cap)} requests but not by tokens: input tokens per batch vary {spread:.0f}x "
            f"({basis}){'; memory follows batch tokens' if mem_follows else ''}"
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "batch by a token budget (max_batch_tokens) instead of a request count",
            "give prefill and decode separate token budgets so one long prefill cannot crowd out decoding",
            "cap prompt length per request so a single request cannot exceed the batch budget",
        ],
        start=float(ts.min()),
        end=float(ts.max()),
    )


def _spread(tokens: np.ndarray) -> tuple[float, str]:
    """p95/p5 of batch tokens with >= 10 batches, else max/min; NaN when there is nothing to compare."""
    t = tokens[np.isfinite(tokens)]
    if t.size >= MIN_SPREAD_BATCHES:
        lo, hi = np.quantile(t, SPREAD_QUANTILES)
        return (float(hi / lo) if lo > 0 else math.inf if hi > 0 else math.nan), "p95/p5"
    if t.size >= 2:
        lo, hi = float(t.min()), float(t.max())
        return (hi / lo if lo > 0 else math.inf if hi > 0 else math.nan), "max/min"
    return math.nan, ""


def _group_spread(count: np.ndarray, tokens: np.ndarray) -> float:
    """Largest p95/p5 of tokens among batches of exactly the same request count (>= 10 batches, >= 2 requests)."""
    best = math.nan
    for c in np.unique(count[count >= 2]):
        t = tokens[count == c]
        if t.size >= MIN_SPREAD_BATCHES:
            s, _ = _spread(t)
            if np.isfinite(s) and not (s <= best):
                best = s
    return best


# --------------------------------------------------------------------------- oversized context

_EARLY = ("error", "rejected")  # outcomes that, without an inference start, are a cap or admission refusing early


@dataclass
class PromptSplit:
    """Requests with a prompt length, split into the longest decile and the rest, with their failures."""

    has: np.ndarray  # requests with prompt, arrival and finish
    p: np.ndarray  # their prompt tokens
    long_: np.ndarray  # the longest decile (of ``has``)
    early: np.ndarray  # refused before inference (a cap or admission): not a failure of the prompt
    started: np.ndarray
    cut: float
    med_long: float
    med_rest: float
    f_long: int
    n_long: int
    f_rest: int
    n_rest: int

    @property
    def ratio_len(self) -> float:
        return self.med_long / self.med_rest if self.med_rest > 0 else math.inf

    @property
    def rate_long(self) -> float:
        return self.f_long / self.n_long if self.n_long else 0.0

    @property
    def rate_rest(self) -> float:
        return self.f_rest / self.n_rest if self.n_rest else 0.0


def _split_prompts(req: Any) -> PromptSplit | None:
    """The longest decile of prompts against the rest (None when either side has under 3 requests).

    Why refusals are left out of the failure counts: a prompt cap answering 413 before inference is the
    remedy working, not the long prompt failing; counting it would blame the cap's own success.
    """
    prompt = req["prompt_tokens"]
    has = np.isfinite(prompt) & np.isfinite(req["arrival"]) & np.isfinite(req["finish"])
    if has.sum() < MIN_PROMPTS:
        return None
    p = prompt[has]
    masks = text_masks(req["outcome"][has]) if "outcome" in req else {"ok": np.ones(p.size, dtype=bool)}
    nothing = np.zeros(p.size, dtype=bool)
    started = np.isfinite(req["start"][has])
    early = ~started & np.logical_or.reduce([masks.get(text, nothing) for text in _EARLY])
    cut = float(np.quantile(p, LONG_QUANTILE))
    long_ = p >= cut
    if long_.mean() > TIES_AT_CUT:  # many ties at the cut: take strictly longer ones
        long_ = p > cut
    if long_.sum() < MIN_PER_SIDE or (~long_).sum() < MIN_PER_SIDE:
        return None
    failed = ~masks.get("ok", nothing) & ~early
    counted = ~early
    return PromptSplit(
        has, p, long_, early, started, cut, float(np.median(p[long_])), float(np.median(p[~long_])),
        int((failed & long_).sum()), int((counted & long_).sum()), int((failed & ~long_).sum()), int((counted & ~long_).sum()),
    )  # fmt: skip


def _oversized_confidence(concentrated: bool, coincide: bool, ooms_long: int, unbounded: bool, ratio_len: float) -> float | None:
    """Failures concentrated in long prompts make a finding; memory peaks alone only a suspect; similar lengths a note.

    None when neither failures nor memory peaks point at the long prompts.
    """
    if concentrated:
        conf = 0.5
    elif coincide:
        conf = 0.35
    else:
        return None
    conf += 0.2 if coincide and concentrated else 0.0
    conf += 0.1 if ooms_long else 0.0
    conf += 0.1 if unbounded else 0.0
    if ratio_len < LONG_VS_REST and not concentrated:
        conf = min(conf, SIMILAR_PEAKS_CEILING)
    elif ratio_len < LONG_VS_REST:
        conf = min(conf, SIMILAR_FAILURES_CEILING)
    if not concentrated:
        conf = min(conf, PEAKS_ONLY_CEILING)
    return min(conf, 0.9)


@rule("batching.oversized_context", "oversized_context", needs=("requests", "requests:prompt_tokens"))
def oversized_context(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Failures (errors, timeouts) concentrate in the longest prompts, and memory peaks coincide with them."""
    req = tl.requests
    if not len(req) or "prompt_tokens" not in req:
        return None
    sp = _split_prompts(req)
    if sp is None:
        return None
    has, p, long_ = sp.has, sp.p, sp.long_
    ratio_len, rate_long, rate_rest = sp.ratio_len, sp.rate_long, sp.rate_rest
    p_fisher = _fisher(sp.f_long, sp.n_long - sp.f_long, sp.f_rest, sp.n_rest - sp.f_rest)
    concentrated = (
        sp.f_long >= MIN_PER_SIDE
        and rate_long >= FAIL_RATE_LONG
        and rate_long >= FAIL_RATIO * max(rate_rest, 1e-9)
        and p_fisher < FISHER_P
    )
    # Memory peaks vs long prompts in flight.
    begin = np.where(sp.started, req["start"][has], req["arrival"][has])
    finish = req["finish"][has]
    ctx = service_context(tl, ac)
    mem = memory_series(tl, ctx)
    coincide, peak_share, time_share, n_peaks = _peaks_in(mem[1] if mem else None, begin[long_], finish[long_])
    ooms = _oom_times(tl)
    lag = _sample_lag(mem[1]) if mem else 1.0
    ooms_long = int((covered_time(begin[long_], finish[long_] + lag, ooms - 1e-3, ooms + 1e-3) > 0).sum()) if ooms.size else 0
    settings = _latest_settings(tl)
    cap = settings.get("max_prompt_tokens", "absent") if settings else "absent"
    unbounded = bool(settings) and (cap is None or (isinstance(cap, (int, float)) and cap >= HUGE_PROMPT_CAP))
    early_long = int((sp.early & long_).sum())

    conf = _oversized_confidence(concentrated, coincide, ooms_long, unbounded, ratio_len)
    if conf is None:
        return None
    t_lo, t_hi = float(req["arrival"][has].min()), float(finish.max())
    evidence = [
        Evidence("requests with prompt token counts", int(has.sum()), "requests", t_lo, t_hi),
        Evidence(f"longest decile: prompts >= {sp.cut:.0f} tokens, median", round(sp.med_long), "tokens"),
        Evidence("median prompt of the rest", round(sp.med_rest), "tokens"),
        Evidence(
            "failure rate, longest decile (errors/timeouts after admission)",
            round(rate_long, 3),
            f"ratio ({sp.f_long}/{sp.n_long})",
        ),
        Evidence("failure rate, the rest", round(rate_rest, 3), f"ratio ({sp.f_rest}/{sp.n_rest})"),
        Evidence("Fisher exact test p (failures over-represented in long prompts)", float(f"{p_fisher:.3g}"), "p"),
        Evidence("prompt tokens per request over time", int(p.max()), "tokens", series=excerpt_arrays(req["arrival"][has], p)),
    ]
    if mem is not None and n_peaks:
        evidence.append(
            Evidence(
                f"memory peaks ({mem[0]}, top 5 %) while a long prompt was in flight",
                round(peak_share, 3),
                f"ratio of {n_peaks} peaks",
            )
        )
        evidence.append(Evidence("share of time a long prompt was in flight", round(time_share, 3), "ratio"))
    if ooms_long:
        evidence.append(Evidence("OOM kills / CUDA OOM errors while a long prompt was in flight", ooms_long, "events"))
    if early_long:
        evidence.append(Evidence("long prompts refused before inference (prompt cap / admission)", early_long, "requests"))
    if settings:
        evidence.append(Evidence("max_prompt_tokens (service config)", "unbounded" if cap is None else cap, "tokens"))
    rules_out = []
    if concentrated:
        rules_out.append(
            f"not load-wide failure: the longest decile fails {rate_long:.0%} of the time vs {rate_rest:.0%} for the rest"
        )
    if early_long and not concentrated:
        rules_out.append(f"the prompt cap works: {early_long} long prompts were refused before inference")
    if ratio_len < LONG_VS_REST:
        rules_out.append(f"prompts are of similar length (longest decile {ratio_len:.1f}x the rest): nothing is oversized")
    return Finding(
        cls="oversized_context",
        rule="batching.oversized_context",
        confidence=conf,
        summary=(
            f"The longest prompts (>= {sp.cut:.0f} tokens, {ratio_len:.0f}x the typical) fail {rate_long:.0%} of the time vs "
            f"{rate_rest:.0%} for the rest" + ("; memory peaks coincide with them" if coincide else "")
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "cap prompt length (max_prompt_tokens) at what the memory budget allows",
            "reject over-long prompts early with 413, before they take a slot or memory",
            "use chunked prefill so a long prompt is processed in bounded pieces",
        ],
        start=t_lo,
        end=t_hi,
    )


def _fisher(a: int, b: int, c: int, d: int) -> float:
    if a + b == 0 or c + d == 0:
        return 1.0
    return numstats.fisher_exact([[a, b], [c, d]], alternative="greater")


def _sample_lag(mem: Series) -> float:
    return float(np.median(np.diff(mem.ts))) if len(mem) >= 2 else 1.0


def _peaks_in(mem: Series | None, starts: np.ndarray, ends: np.ndarray) -> tuple[bool, float, float, int]:
    """Do memory peaks (top 5 % of samples) fall while a long prompt is in flight more than chance would say?

    Returns (coincide, share of peaks inside, share of time inside, peaks). A sample reflects what ran
    up to one sampling interval before it, so intervals are stretched by that lag.
    """
    if mem is None or len(mem) < MIN_PEAK_SAMPLES or starts.size == 0:
        return False, math.nan, math.nan, 0
    lo, hi = float(starts.min()), float(ends.max())
    win = mem.window(lo - 60, hi + 60)
    if len(win) < MIN_PEAK_SAMPLES:
        return False, math.nan, math.nan, 0
    lag = _sample_lag(win)
    thr = float(np.quantile(win.values, PEAK_QUANTILE))
    peaks = win.ts[win.values >= thr]
    if peaks.size < MIN_PEAKS or np.ptp(win.values) == 0:
        return False, math.nan, math.nan, int(peaks.size)
    stretched = ends + lag
    inside = covered_time(starts, stretched, peaks - 1e-3, peaks + 1e-3) > 0
    span = float(win.ts[-1] - win.ts[0])
    time_share = float(covered_time(starts, stretched, np.array([win.ts[0]]), np.array([win.ts[-1]]))[0] / span) if span else 1.0
    peak_share = float(inside.mean())
    coincide = peak_share >= PEAKS_INSIDE and (time_share <= 0 or peak_share >= PEAKS_OVER_CHANCE * time_share)
    return bool(coincide), peak_share, time_share, int(peaks.size)
