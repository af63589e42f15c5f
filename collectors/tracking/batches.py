"""Batch and MoE-routing statistics: pure functions that build the records the tracker stores.

Why these numbers: a memory peak is set by the *tokens* in flight, not the number of requests --
one 30k-token prompt in a batch of 2 costs more than 64 short chats. ``BatchStats`` keeps both so
the ``request_count_batching`` rule can tell them apart. For mixture-of-experts models the peak is
set by the busiest expert: ``RoutingStats`` keeps the full per-expert counts (in the flight recorder
only -- never one Prometheus series per expert) and the summaries exported per layer:

- ``top_expert_tokens`` / ``median_expert_tokens``: the busiest expert and the typical one;
- ``skew`` = top / median (None when the median is 0: most experts idle, the ratio is undefined);
- ``balancedness`` = mean / max, the vLLM EPLB / SGLang definition (1.0 = perfectly even;
  None when no expert got a token);
- ``overflow_tokens`` = sum over experts of tokens beyond ``capacity`` (what a capacity-factor
  router drops or re-routes); 0 when no capacity is given.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

from collectors.records import BatchStats, RoutingStats

BATCH_PHASES: tuple[str, ...] = ("prefill", "decode", "mixed")


def batch_stats(
    model: str,
    *,
    requests: int,
    input_tokens: int,
    max_request_tokens: int | None = None,
    active_decode_sequences: int = 0,
    concurrent_batches: int = 1,
    phase: str = "mixed",
    ts: float | None = None,
) -> BatchStats:
    """Validate and build one ``BatchStats``. Raises ValueError on impossible input (negative counts,
    a max request larger than the batch, an unknown phase) -- a caller bug, not a telemetry failure."""
    if requests < 0 or input_tokens < 0 or active_decode_sequences < 0 or concurrent_batches < 0:
        raise ValueError("batch counts cannot be negative")
    if max_request_tokens is None:
        max_request_tokens = input_tokens if requests == 1 else 0
    if max_request_tokens < 0 or max_request_tokens > input_tokens:
        raise ValueError("max_request_tokens must be between 0 and input_tokens")
    if phase not in BATCH_PHASES:
        raise ValueError(f"phase must be one of {BATCH_PHASES}")
    return BatchStats(
        ts=time.time() if ts is None else ts,
        model=model,
        requests=int(requests),
        input_tokens=int(input_tokens),
        max_request_tokens=int(max_request_tokens),
        active_decode_sequences=int(active_decode_sequences),
        concurrent_batches=int(concurrent_batches),
        phase=phase,
        pid=os.getpid(),
    )


def routing_stats(
    model: str,
    layer: int,
    expert_token_counts: Sequence[int],
    capacity: int | None = None,
    *,
    ts: float | None = None,
) -> RoutingStats:
    """Summarise one layer's routing step. Raises ValueError on no experts or negative counts."""
    counts = [int(c) for c in expert_token_counts]
    if not counts:
        raise ValueError("expert_token_counts is empty")
    if any(c < 0 for c in counts):
        raise ValueError("expert token counts cannot be negative")
    if layer < 0:
        raise ValueError("layer cannot be negative")
    if capacity is not None and capacity < 0:
        raise ValueError("capacity cannot be negative")
    top = max(counts)
    median = float(statistics.median(counts))
    mean = sum(counts) / len(counts)
    skew = top / median if median > 0 else None
    balancedness = mean / top if top > 0 else None
    overflow = sum(c - capacity for c in counts if c > capacity) if capacity is not None else 0
    return RoutingStats(
        ts=time.time() if ts is None else ts,
        model=model,
        layer=int(layer),
        expert_tokens=counts,
        top_expert_tokens=top,
        median_expert_tokens=median,
        skew=skew,
        balancedness=balancedness,
        overflow_tokens=overflow,
        pid=os.getpid(),
    )
