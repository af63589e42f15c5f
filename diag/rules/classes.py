"""The incident classes: one table for the name, how causal the class is, and its plain-words headline.

Why one table: the rules (which classes exist), the engine (ranking ties by causality) and the
reports (the headline an operator reads) must agree on the same list; kept apart they drift, and a
class added in one place silently renders as its bare id or ranks as "unknown" in another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IncidentClass:
    name: str
    causal_weight: float  # higher = more of a root cause; symptoms (OOM kills) rank below what explains them
    plain: str  # the verdict in the operator's words


HEALTHY = "healthy"
INCONCLUSIVE = "inconclusive"

CLASSES: tuple[IncidentClass, ...] = (
    IncidentClass("memory_leak", 1.0, "Memory leak: memory keeps climbing regardless of load."),
    IncidentClass(
        "memory_pressure",
        0.85,
        "Memory pressure: memory follows load and comes back; the service needs more room or less concurrency.",
    ),
    IncidentClass("queue_backlog", 0.9, "Queue backlog: requests wait for a slot while each inference stays fast."),
    IncidentClass(
        "kv_cache_saturation",
        0.9,
        "KV-cache saturation: the engine's KV cache is full, it preempts running sequences and latency climbs.",
    ),
    IncidentClass("thrashing", 0.9, "Thrashing: the service stalls in memory reclaim/page faults and every request slows."),
    IncidentClass("duplicate_model_processes", 1.0, "Duplicate model copies: several processes each hold the model."),
    IncidentClass("blocking_loader_refresh", 1.0, "Blocking loader: the model is re-read on the request path."),
    IncidentClass("gpu_oom", 0.8, "GPU out of memory."),
    IncidentClass("host_oom", 0.8, "Host/cgroup out of memory: the kernel OOM killer fired."),
    IncidentClass(
        "allocator_fragmentation", 1.0, "GPU allocator fragmentation: memory is reserved but unallocated, not truly full."
    ),
    IncidentClass("moe_expert_skew", 0.95, "MoE expert skew: one expert takes most tokens and blows the peak."),
    IncidentClass(
        "request_count_batching", 0.95, "Request-count batching: batches capped by requests, not tokens, vary wildly in size."
    ),
    IncidentClass("oversized_context", 0.95, "Oversized context: long prompts drive the failures and the memory peak."),
    IncidentClass("noisy_neighbour", 0.95, "Noisy neighbour: host pressure comes from outside the service's cgroup."),
    IncidentClass("unsafe_config", 0.5, "Unsafe configuration: the settings make this incident likely."),
)

BY_NAME: dict[str, IncidentClass] = {c.name: c for c in CLASSES}
INCIDENT_CLASSES: tuple[str, ...] = tuple(c.name for c in CLASSES)
CAUSAL_WEIGHT: dict[str, float] = {c.name: c.causal_weight for c in CLASSES}

# Headlines for every verdict value, the two non-class verdicts included.
PLAIN: dict[str, str] = {
    HEALTHY: "No incident found: no rule that could be evaluated found anything.",
    INCONCLUSIVE: "Inconclusive: something was found but not firmly enough to name the cause -- see the suspects.",
    **{c.name: c.plain for c in CLASSES},
}
