"""MoE expert skew, request-count batching and oversized context (diag/rules/batching.py).

Routing and batch records are built with the tracker's own builders (``collectors.tracking.batches``),
so the skew/balancedness/overflow numbers are computed exactly as a serving process computes them.
"""

from __future__ import annotations

import math

import numpy as np

from collectors.records import RequestTiming, ServiceConfig, TorchMemorySnapshot
from collectors.tracking.batches import batch_stats, routing_stats
from tests.diag.request_builders import (
    PID,
    T0,
    assert_units,
    confidence,
    finding,
    not_evaluated,
    run,
    telemetry,
)

D = 90.0
MIB = 1 << 20


def _config(**settings: object) -> dict:
    return ServiceConfig(ts=T0 - 5, service="demo", pid=PID, settings=dict(settings)).to_dict()


# --------------------------------------------------------------------------- MoE expert skew


def _routing(seed: int, hot: float, *, tokens: float = 256.0, capacity: bool = True, torch: bool = True) -> list[dict]:
    """8 experts x 4 layers, one step every 0.5 s; expert 0 gets ``hot`` of the tokens (1/8 = balanced).
    Torch peak memory follows the busiest expert's tokens, one snapshot per step."""
    rng = np.random.default_rng(seed)
    out = []
    probs = np.array([hot] + [(1 - hot) / 7] * 7)
    for step in range(int(D * 2)):
        ts = T0 + step * 0.5
        n = int(rng.poisson(tokens * rng.uniform(0.5, 1.5)))
        top = 0
        for layer in range(4):
            counts = rng.multinomial(n, probs)
            cap = int(1.25 * n / 8) + 1 if capacity else None
            rec = routing_stats("demo-moe", layer, counts.tolist(), cap, ts=ts + layer * 0.01)
            rec.pid = PID
            out.append(rec.to_dict())
            top = max(top, int(counts.max()))
        if torch:
            peak = (2 << 30) + top * 4 * MIB + int(rng.normal(0, 16 * MIB))
            out.append(TorchMemorySnapshot(ts=ts + 0.2, device=0, allocated_bytes=peak - (64 * MIB),
                                           peak_allocated_bytes=peak, pid=PID).to_dict())  # fmt: skip
    return out


def test_moe_skew_with_overflow_and_memory_following_the_hot_expert() -> None:
    a = run([*_routing(1, hot=0.6), _config(experts=8)])
    f = finding(a, "batching.moe_expert_skew")
    assert f is not None and f.cls == "moe_expert_skew" and f.confidence >= 0.7
    assert a.primary == "moe_expert_skew"
    values = {e.what: e.value for e in f.evidence}
    assert values["median balancedness (mean / max expert tokens)"] < 0.3
    assert values["steps with capacity overflow"] > 0.9
    assert values["layers with skewed steps"] == "4 of 4"
    rho = next(e.value for e in f.evidence if e.what.startswith("Spearman rho, busiest-expert tokens"))
    assert rho > 0.5
    assert any("EPLB" in r for r in f.remediation)
    assert_units(f)


def test_balanced_routing_is_quiet() -> None:
    a = run(_routing(2, hot=1 / 8))
    assert finding(a, "batching.moe_expert_skew") is None and "batching.moe_expert_skew" in a.evaluated


def test_skew_alone_without_overflow_or_memory_is_a_note_not_a_verdict() -> None:
    a = run(_routing(3, hot=0.6, capacity=False, torch=False))
    f = finding(a, "batching.moe_expert_skew")
    assert f is not None and 0.3 <= f.confidence < 0.5


def test_few_tokens_per_expert_is_not_mistaken_for_skew() -> None:
    """~4 tokens over 8 experts: a perfectly fair router leaves most experts idle (median 0, skew undefined) -- noise, skipped."""
    a = run(_routing(4, hot=1 / 8, tokens=4.0))
    assert finding(a, "batching.moe_expert_skew") is None


def test_moe_not_evaluated_without_routing() -> None:
    a = run([_config(experts=8)])
    assert "batching.moe_expert_skew" in not_evaluated(a)


# --------------------------------------------------------------------------- request-count batching


def _prompt(rng: np.random.Generator, uniform: bool) -> int:
    if uniform:
        return int(rng.normal(100, 15))
    return int(rng.integers(900, 1500)) if rng.random() < 0.2 else int(rng.integers(8, 60))


def _batches(seed: int, mode: str, *, uniform: bool = False, budget: int = 2048, cap: int = 8) -> list[dict]:
    """~2.5 batches/s, formed from a queue of prompts by request count (``requests``) or a token budget
    (``tokens``); the service cgroup's anon memory follows the largest batch of each second."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    biggest: dict[int, int] = {}
    pending = [_prompt(rng, uniform) for _ in range(16)]
    t = 0.0
    while t < D:
        t += float(rng.exponential(0.4))
        take: list[int] = []
        while pending and len(take) < cap:
            if mode == "tokens" and take and sum(take) + pending[0] > budget:
                break
            take.append(pending.pop(0))
        pending += [_prompt(rng, uniform) for _ in range(len(take))]
        rec = batch_stats("demo", requests=len(take), input_tokens=sum(take), max_request_tokens=max(take), ts=T0 + t)
        rec.pid = PID
        out.append(rec.to_dict())
        sec = math.ceil(t)
        biggest[sec] = max(biggest.get(sec, 0), sum(take))

    def usage(t: float) -> float:
        return float((3 << 30) + biggest.get(int(t), 0) * 256 * 1024)

    return out + telemetry(rng, D, usage=usage)


def test_request_count_batching_fires_when_count_capped_batches_vary_in_tokens() -> None:
    a = run([*_batches(5, "requests"), _config(batching="requests", max_batch_requests=8)])
    f = finding(a, "batching.request_count")
    assert f is not None and f.cls == "request_count_batching" and f.confidence >= 0.7
    values = {e.what: e.value for e in f.evidence}
    assert values["request-count cap (largest batch by requests)"] == 8
    spread = next(v for k, v in values.items() if k.startswith("input-token spread"))
    assert spread >= 10
    rho = next(v for k, v in values.items() if k.startswith("Spearman rho, batch input tokens"))
    assert rho > 0.5  # memory follows the batch tokens
    assert any("token budget" in r for r in f.remediation)
    assert_units(f)


def test_request_count_spread_without_memory_or_config_is_below_verdict() -> None:
    records = [r for r in _batches(6, "requests") if r["kind"] == "batch"]
    a = run(records)
    f = finding(a, "batching.request_count")
    assert f is not None and f.confidence < 0.5


def test_token_budget_batching_is_quiet() -> None:
    a = run([*_batches(7, "tokens"), _config(batching="tokens", max_batch_tokens=2048)])
    assert confidence(a, "batching.request_count") < 0.5


def test_even_prompts_batched_by_count_are_quiet() -> None:
    a = run([*_batches(8, "requests", uniform=True), _config(batching="requests")])
    assert finding(a, "batching.request_count") is None


def test_batching_not_evaluated_without_batches() -> None:
    a = run([_config(batching="requests")])
    assert "batching.request_count" in not_evaluated(a)


# --------------------------------------------------------------------------- oversized context


def _requests_by_prompt(seed: int, *, fail_long: float, fail_rest: float, capped: int | None = None) -> tuple[list[dict], list]:
    """Poisson arrivals (3/s), prompts ~200 tokens with 10 % of 8k-30k; ample slots. Long prompts fail
    (after starting) with ``fail_long``; with ``capped`` they are refused before inference instead."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    long_spans = []
    t = 0.0
    while True:
        t += float(rng.exponential(1 / 3))
        if t > D:
            break
        long_ = rng.random() < 0.1
        prompt = int(rng.integers(8000, 30000)) if long_ else int(rng.lognormal(math.log(200), 0.5))
        if capped is not None and prompt > capped:
            rec = RequestTiming(ts=T0 + t + 0.001, arrival=T0 + t, start=None, finish=T0 + t + 0.001, outcome="error",
                                prompt_tokens=prompt, pid=PID)  # fmt: skip
            out.append(rec.to_dict())
            continue
        start = t + 0.002
        s = 0.1 + prompt * 5e-5
        failed = rng.random() < (fail_long if long_ else fail_rest)
        outcome = str(rng.choice(["error", "inference_timeout"])) if failed else "ok"
        out.append(RequestTiming(ts=T0 + start + s, arrival=T0 + t, start=T0 + start, finish=T0 + start + s,
                                 outcome=outcome, prompt_tokens=prompt, output_tokens=16, pid=PID).to_dict())  # type: ignore[arg-type]  # fmt: skip
        if long_:
            long_spans.append((start, start + s))
    return out, long_spans


def _memory_with_peaks(spans: list) -> object:
    def usage(t: float) -> float:
        inflight = sum(1 for s, e in spans if s <= t <= e + 1.0)
        return float((2 << 30) + inflight * (3 << 30))

    return usage


def test_oversized_context_fires_when_failures_and_peaks_follow_long_prompts() -> None:
    rng = np.random.default_rng(9)
    reqs, spans = _requests_by_prompt(9, fail_long=0.5, fail_rest=0.01)
    a = run(reqs + telemetry(rng, D, usage=_memory_with_peaks(spans)) + [_config(max_prompt_tokens=None)])  # type: ignore[arg-type]
    f = finding(a, "batching.oversized_context")
    assert f is not None and f.cls == "oversized_context" and f.confidence >= 0.7
    values = {e.what: e.value for e in f.evidence}
    assert values["failure rate, longest decile (errors/timeouts after admission)"] >= 0.3
    assert values["Fisher exact test p (failures over-represented in long prompts)"] < 0.01
    peak_share = next(v for k, v in values.items() if k.startswith("memory peaks"))
    assert peak_share >= 0.8
    assert values["max_prompt_tokens (service config)"] == "unbounded"
    assert any("413" in r for r in f.remediation)
    assert_units(f)


def test_prompt_cap_refusing_long_prompts_early_is_quiet() -> None:
    rng = np.random.default_rng(10)
    reqs, _ = _requests_by_prompt(10, fail_long=0.0, fail_rest=0.01, capped=4096)
    a = run(reqs + telemetry(rng, D) + [_config(max_prompt_tokens=4096)])
    assert confidence(a, "batching.oversized_context") < 0.5


def test_failures_spread_evenly_over_prompt_lengths_are_quiet() -> None:
    rng = np.random.default_rng(11)
    reqs, _ = _requests_by_prompt(11, fail_long=0.05, fail_rest=0.05)
    a = run(reqs + telemetry(rng, D))
    assert finding(a, "batching.oversized_context") is None


def test_oversized_not_evaluated_without_requests() -> None:
    a = run(telemetry(np.random.default_rng(12), 30.0))
    assert "batching.oversized_context" in not_evaluated(a)
