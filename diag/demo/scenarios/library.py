"""The scenarios: one function per incident class, each injecting its fault for real.

Every function gets a ``ScenarioContext`` (groups, server, agent, load -- all cleaned up by the
runner) and its parameters (defaults in ``Scenario.defaults``; ``bench/accuracy.py`` varies them).
Each one says in its docstring what is injected and which signals it should leave in the
recorder. Durations are chosen so a scenario finishes in about a minute on a 2-core box.

Common shape: create the service group (always with a limit), start the server in it, start the
agent, a few seconds of baseline, the fault and the load, done. Servers run with the memory guard
off wherever the fault is memory (the guard's 503s would hide the incident the scenario is about).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from diag.demo.scenarios.context import MiB, ScenarioContext, evict_from_page_cache
from diag.demo.scenarios.load import Phase, completion, idle, mixture
from diag.demo.scenarios.registry import SCENARIOS, Scenario, ScenarioFn, scenario

__all__ = ["SCENARIOS", "Scenario", "ScenarioFn", "scenario"]


def _normal_traffic(p: dict[str, Any]) -> Callable[[random.Random], dict[str, Any]]:
    return completion((40, 300), (8, 24))


# --------------------------------------------------------------------------- healthy


@scenario(
    "healthy",
    "healthy",
    "safe defaults (shared weights, bounded queue, token budget), moderate load with a pause: nothing should fire",
    needs_cgroups=False,
    limit_mib=1024,
    workers=2,
    weights_mb=64,
    rate=6.0,
    busy_s=18.0,
    idle_s=8.0,
)
def healthy(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: flat memory, PSI ~0, queue wait ~0, inference flat, no loader in the request path."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    server = ctx.serve(["--preload", "shared"], group=group, workers=p["workers"], weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    body = _normal_traffic(p)
    ctx.load(
        server,
        [
            Phase("steady", p["busy_s"], 8, body, rate=p["rate"]),
            idle("pause", p["idle_s"]),
            Phase("steady-again", p["busy_s"], 8, body, rate=p["rate"]),
        ],
    )
    ctx.pause(3, "tail")


# --------------------------------------------------------------------------- memory: leak, pressure, thrash, OOM


@scenario(
    "leak",
    "memory_leak",
    "--leak-kib-per-request retains memory on every request: RSS climbs through busy and idle phases alike",
    needs_cgroups=True,
    limit_mib=1024,
    leak_kib=512,
    rate=10.0,
    cycles=4,
    busy_s=10.0,
    idle_s=5.0,
    weights_mb=64,
)
def leak(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: worker RSS/anon and group usage rise with every request and do not come back in the idle
    phases (troughs climb), PSI ~0, no OOM (the limit leaves room for the whole run)."""
    group = ctx.group("service", p["limit_mib"] * MiB)
    args = ["--preload", "shared", "--memory-guard", "0", "--leak-kib-per-request", str(p["leak_kib"])]
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, f"baseline; then each request leaks {p['leak_kib']} KiB")
    body = _normal_traffic(p)
    phases: list[Phase] = []
    for i in range(p["cycles"]):
        phases += [Phase(f"busy-{i + 1}", p["busy_s"], 8, body, rate=p["rate"]), idle(f"idle-{i + 1}", p["idle_s"])]
    ctx.load(server, phases)
    ctx.notes["oom_kills"] = group.oom_kills() if group else None


@scenario(
    "pressure",
    "memory_pressure",
    "bursts of long prompts: their activations squeeze the weights' page cache under the limit; memory returns when idle",
    needs_cgroups=True,
    limit_mib=0,  # 0: sized from the measured baseline: anon + weights x headroom + extra
    headroom=1.0,
    extra_mib=16,
    weights_mb=96,
    prompt_tokens=1000,
    concurrency=6,
    cycles=3,
    busy_s=12.0,
    idle_s=8.0,
)
def pressure(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: idle, anon + the whole checkpoint fit under the limit (PSI 0); in busy phases the
    prefill activations and KV caches of ``concurrency`` long prompts (~16 KiB per token) push anon
    up by tens of MiB and the kernel reclaims the weights' page cache to make room: usage at the
    limit, refaults and memory PSI some rise with load and decay when it stops; anon troughs flat
    (not a leak), no OOM."""
    group = ctx.group("service", 4096 * MiB)
    assert group is not None
    batch_tokens = p["prompt_tokens"] * p["concurrency"]
    args = [
        "--preload", "shared", "--memory-guard", "0", "--max-concurrency", str(p["concurrency"]),
        "--max-batch-requests", str(p["concurrency"]), "--max-batch-tokens", str(batch_tokens),
    ]  # fmt: skip
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"])
    _size_limit(ctx, group, p)
    ctx.record()
    ctx.pause(3, "baseline")
    body = completion((p["prompt_tokens"] - 200, p["prompt_tokens"]), (4, 8))
    phases: list[Phase] = []
    for i in range(p["cycles"]):
        phases += [Phase(f"busy-{i + 1}", p["busy_s"], p["concurrency"], body), idle(f"idle-{i + 1}", p["idle_s"])]
    ctx.load(server, phases)
    ctx.notes["oom_kills"] = group.oom_kills()


def _size_limit(ctx: ScenarioContext, group: Any, p: dict[str, Any]) -> None:
    """Set the group's limit from what the started service really uses (anon baseline + a share of the weights)."""
    if p["limit_mib"]:
        limit = p["limit_mib"] * MiB
    else:
        stat = group.stat()
        anon = stat.get("total_rss", 0)
        limit = int(anon + p["weights_mb"] * MiB * p["headroom"] + p.get("extra_mib", 0) * MiB)
    (group.v1_dir / "memory.limit_in_bytes").write_text(str(limit))
    group.limit_bytes = limit
    ctx.notes["limit_mib"] = round(limit / MiB, 1)
    ctx.progress(f"limit of {group.path} set to {limit / MiB:.0f} MiB (anon baseline + {p.get('headroom', 0):g} x weights)")


@scenario(
    "thrash",
    "thrashing",
    "shared mmap weights larger than what the limit leaves after anon: random table reads fault pages in and out",
    needs_cgroups=True,
    limit_mib=0,  # 0: anon baseline + headroom x weights
    headroom=0.45,
    weights_mb=200,
    steps="1,2,4,8",
    step_s=10.0,
)
def thrash(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: group memory PSI some 10-25 %, major faults and workingset refaults climbing,
    inference time inflating with concurrency while throughput stays flat; no queueing (slots > load)."""
    group = ctx.group("service", 4096 * MiB)
    assert group is not None
    args = ["--preload", "shared", "--memory-guard", "0", "--max-concurrency", "16", "--queue-size", "64"]
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"], ready_timeout=120)
    _size_limit(ctx, group, p)
    ctx.record()
    ctx.pause(3, "baseline")
    body = _normal_traffic(p)
    steps = [int(s) for s in str(p["steps"]).split(",")]
    ctx.load(server, [Phase(f"concurrency-{n}", p["step_s"], n, body) for n in steps], request_timeout_s=60.0)


@scenario(
    "host-oom",
    "host_oom",
    "private weights near the limit; bursts of 32 ordinary requests at once: the kernel OOM-kills the worker",
    needs_cgroups=True,
    weights_mb=96,
    margin_mib=40,
    rate=3.0,
    burst_requests=32,
    bursts=3,
    busy_s=4.0,
    calm_s=12.0,
)
def host_oom(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: kernel ``oom-kill`` lines (constraint CONSTRAINT_MEMCG, oom_memcg = the service group),
    memory.oom_control oom_kill and failcnt up, the worker replaced by a new PID (uvicorn's supervisor
    restarts it), requests cut off. Per-worker (anonymous) weights leave nothing to reclaim, so the kill
    comes at once with little PSI; prompts are ordinary -- it is the burst's batch activations that do not fit."""
    group = ctx.group("service", 4096 * MiB)
    assert group is not None
    args = [
        "--preload", "per-worker", "--memory-guard", "0", "--max-concurrency", str(p["burst_requests"]),
        "--queue-size", "64", "--max-batch-requests", str(p["burst_requests"]), "--max-batch-tokens", "16384",
    ]  # fmt: skip
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"])
    # The limit leaves ``margin_mib`` over the anonymous memory after start-up; the checkpoint's page
    # cache (read once, by the per-worker load) is reclaimable and goes first.
    anon = group.stat().get("total_rss", group.usage_bytes())
    limit = anon + p["margin_mib"] * MiB
    (group.v1_dir / "memory.limit_in_bytes").write_text(str(limit))
    group.limit_bytes = limit
    ctx.notes["limit_mib"] = round(limit / MiB, 1)
    ctx.progress(f"limit set to {limit / MiB:.0f} MiB: anonymous memory after start-up + {p['margin_mib']} MiB")
    ctx.record()
    ctx.pause(3, "baseline")
    body = _normal_traffic(p)
    phases: list[Phase] = [Phase("calm", p["calm_s"], 4, body, rate=p["rate"])]
    for i in range(p["bursts"]):
        phases += [
            Phase(f"burst-{i + 1}", p["busy_s"], p["burst_requests"], body, once=True),
            Phase(f"calm-{i + 1}", p["calm_s"], 4, body, rate=p["rate"]),
        ]
    ctx.load(server, phases, request_timeout_s=15.0)
    ctx.notes["oom_kills"] = group.oom_kills()
    ctx.progress(f"group oom_kill count: {ctx.notes['oom_kills']}")


@scenario(
    "noisy-neighbour",
    "noisy_neighbour",
    "a neighbour process thrashes its own limited cgroup; the service's group stays calm while host PSI rises",
    needs_cgroups=True,
    limit_mib=1024,
    neighbour_limit_mib=160,
    neighbour_anon_mib=100,
    neighbour_file_mib=192,
    rate=5.0,
    duration_s=45.0,
    weights_mb=64,
)
def noisy_neighbour(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: host memory PSI some 5-20 % (the host counts the neighbour's memcg stalls), the
    service group's PSI ~0 and its memory flat, service latency somewhat up (shared CPUs)."""
    import sys

    service = ctx.group("service", p["limit_mib"] * MiB)
    neighbour = ctx.group("neighbour", p["neighbour_limit_mib"] * MiB)
    assert service is not None and neighbour is not None
    server = ctx.serve(["--preload", "shared"], group=service, weights_mb=p["weights_mb"])
    data = ctx.workdir / "neighbour.dat"
    _write_file(data, p["neighbour_file_mib"] * MiB)
    evict_from_page_cache(data)
    ctx.record()
    ctx.pause(3, "baseline")
    argv = [
        sys.executable, "-m", "diag.demo.scenarios.hog", "--anon-mib", str(p["neighbour_anon_mib"]),
        "--file", str(data), "--seconds", str(p["duration_s"] + 5), "--seed", str(ctx.seed),
    ]  # fmt: skip
    hog = neighbour.spawn(argv)
    ctx.progress(
        f"neighbour pid {hog.pid} in {neighbour.path}: {p['neighbour_anon_mib']} MiB anon + random reads over "
        f"{p['neighbour_file_mib']} MiB under {p['neighbour_limit_mib']} MiB"
    )
    ctx.load(server, [Phase("steady", p["duration_s"], 8, _normal_traffic(p), rate=p["rate"])])
    ctx.notes["neighbour_oom_kills"] = neighbour.oom_kills()


def _write_file(path: Any, size: int) -> None:
    """A file of pseudo-random bytes (so no filesystem can store it sparse or compressed)."""
    rng = random.Random(0)
    block = rng.randbytes(1 << 20)
    with open(path, "wb") as fh:
        for i in range(size >> 20):
            fh.write(block[i % 7 :] + block[: i % 7])


# --------------------------------------------------------------------------- service: queue, loader, batching, MoE, context


@scenario(
    "queue",
    "queue_backlog",
    "one inference slot and a long queue, offered a load that ramps past its capacity: wait grows, inference stays flat",
    needs_cgroups=False,
    limit_mib=1024,
    weights_mb=64,
    probe_s=5.0,
    ramp="0.3,0.6,0.9,1.3,1.8",
    step_s=8.0,
    max_in_flight=48,
)
def queue(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: queue_wait_s ~0 at the low steps and climbing to seconds past capacity, inference_s flat,
    throughput pinned at the single slot's capacity (Little's law holds), PSI ~0, memory flat.

    Capacity is measured, not assumed: a short closed-loop probe (3 clients on the one slot) gives
    the throughput the server really sustains here (HTTP and event-loop costs included), and the
    open-loop ramp is set in multiples of it."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = ["--preload", "shared", "--max-concurrency", "1", "--queue-size", "512", "--queue-timeout", "15"]
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    # Long enough outputs that inference (~0.1 s) dwarfs the per-request HTTP overhead of a busy event loop.
    body = completion((150, 300), (48, 64))
    probe = ctx.load(server, [Phase("capacity-probe", p["probe_s"], 3, body)])
    capacity = max(probe.phases[0].ok / max(p["probe_s"], 1e-3), 0.5)
    ctx.notes["capacity_rps"] = round(capacity, 2)
    ctx.progress(f"one slot sustains ~{capacity:.1f} req/s here; ramping the offered load past it")
    ctx.pause(3, "calm after the probe")
    steps = [float(x) for x in str(p["ramp"]).split(",")]
    phases = [Phase(f"load-{f:g}x", p["step_s"], p["max_in_flight"], body, rate=f * capacity) for f in steps]
    ctx.load(server, phases, request_timeout_s=40.0)


@scenario(
    "loader-refresh",
    "blocking_loader_refresh",
    "--refresh every-request: the checkpoint is re-read on the request path before each request gets a slot",
    needs_cgroups=False,
    limit_mib=1536,
    workers=2,
    weights_mb=64,
    rate=4.0,
    duration_s=35.0,
)
def loader_refresh(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: one LoaderEvent per request with in_request_path true and the full checkpoint size,
    inside the request's arrival -> start window; e2e bimodal, queue wait = load time."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = ["--preload", "per-worker", "--refresh", "every-request"]
    server = ctx.serve(args, group=group, workers=p["workers"], weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    ctx.load(server, [Phase("steady", p["duration_s"], 8, _normal_traffic(p), rate=p["rate"])])


@scenario(
    "moe-skew",
    "moe_expert_skew",
    "an MoE model whose router sends nearly every token to expert 0 (--router-skew): the hot expert overflows its capacity",
    needs_cgroups=False,
    limit_mib=1024,
    experts=8,
    top_k=2,
    router_skew=6.0,
    capacity_factor=1.25,
    weights_mb=48,
    concurrency=6,
    duration_s=35.0,
)
def moe_skew(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: RoutingStats per batch and layer with the top expert taking ~half of all token-slots
    (top-2: every token picks it), balancedness far below 1, and -- with the usual capacity factor of
    1.25 -- most of the hot expert's tokens overflowing its capacity (really dropped from it); the hot
    expert's activation buffer (all of a batch's tokens) drives the worker's memory peaks."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = [
        "--preload", "shared", "--router-skew", str(p["router_skew"]), "--max-concurrency", str(p["concurrency"]),
        "--expert-capacity-factor", str(p["capacity_factor"]),
        "--max-batch-requests", str(p["concurrency"]), "--max-batch-tokens", "16384",
    ]  # fmt: skip
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"], experts=p["experts"], top_k=p["top_k"])
    ctx.record()
    ctx.pause(3, "baseline")
    body = mixture((0.5, completion((40, 300), (4, 8))), (0.5, completion((1500, 3000), (4, 8))))
    ctx.load(server, [Phase("steady", p["duration_s"], p["concurrency"], body, think_s=0.3)], request_timeout_s=60.0)


@scenario(
    "request-count-batching",
    "request_count_batching",
    "--batching requests: batches capped at 8 requests carry 200 tokens or 12 000 depending on which prompts arrive",
    needs_cgroups=False,
    limit_mib=1536,
    weights_mb=64,
    long_share=0.6,
    long_tokens=1500,
    concurrency=16,
    cycles=2,
    chat_s=3.0,
    phase_s=9.0,
)
def request_count_batching(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: BatchStats whose input_tokens swing by 10-60x at the same request count (chat traffic,
    then a document job's long prompts arrive), the biggest far over a sane token budget; memory
    peaks and slow batches line up with the token-heavy batches.

    Chat phases are short (``chat_s``): both kinds of phase are closed loops, so a fast machine runs
    ~15x more chat batches than document batches per second -- with chat as long as documents the
    document batches fell under 5 % of all batches (no p95 swing) and chat spent the run's request
    budget before the second document phase began."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = [
        "--preload", "shared", "--batching", "requests", "--max-batch-requests", "8",
        "--max-concurrency", str(p["concurrency"]), "--queue-size", "64", "--memory-guard", "0",
        "--max-prompt-tokens", str(max(2048, p["long_tokens"] + 64)),  # the long prompts are legitimate here
    ]  # fmt: skip
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    long_tokens = p["long_tokens"]
    short = completion((8, 40), (4, 8))
    heavy = mixture((1.0 - p["long_share"], short), (p["long_share"], completion((long_tokens - 200, long_tokens), (4, 8))))
    phases: list[Phase] = []
    for i in range(p["cycles"]):
        phases += [
            Phase(f"chat-{i + 1}", p["chat_s"], p["concurrency"], short),
            Phase(f"documents-{i + 1}", p["phase_s"], p["concurrency"], heavy),
        ]
    ctx.load(server, phases, request_timeout_s=60.0)


@scenario(
    "oversized-context",
    "oversized_context",
    "prompt cap off (--max-prompt-tokens 0): a few huge prompts blow the memory peak and time out",
    needs_cgroups=False,
    limit_mib=1536,
    workers=2,
    weights_mb=64,
    huge_share=0.12,
    huge_tokens=16000,
    request_timeout=2.0,
    rate=2.5,
    duration_s=45.0,
)
def oversized_context(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: RequestTiming rows whose prompt_tokens are 30-50x the typical prompt end in
    inference_timeout while normal prompts succeed; the worker's memory peaks (prefill activations,
    attention scores, KV cache: ~16 KiB per token) coincide with them. A normal request that arrives
    during a huge prefill waits behind it in the batcher -- as decode steps stall behind a long
    prefill in vLLM -- until the huge one times out and its prefill is stopped."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = [
        "--preload", "shared", "--max-prompt-tokens", "0", "--request-timeout", str(p["request_timeout"]),
        "--memory-guard", "0",
    ]  # fmt: skip
    server = ctx.serve(args, group=group, workers=p["workers"], weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    huge = p["huge_tokens"]
    body = mixture(
        (1.0 - p["huge_share"], _normal_traffic(p)),
        (p["huge_share"], completion((int(huge * 0.75), huge), (8, 16))),
    )
    ctx.load(server, [Phase("steady", p["duration_s"], 16, body, rate=p["rate"])], request_timeout_s=60.0)


@scenario(
    "duplicate-models",
    "duplicate_model_processes",
    "--workers 4 --preload per-worker: four workers, four private copies of the weights",
    needs_cgroups=False,
    limit_mib=2048,
    workers=4,
    weights_mb=128,
    rate=4.0,
    duration_s=25.0,
)
def duplicate_models(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: four processes mapping the same checkpoint, each with RSS/USS >= the weights size
    (private anon copies), summed PSS ~ 4 x weights; the group's anon ~ 4 x weights."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = ["--preload", "per-worker"]
    server = ctx.serve(args, group=group, workers=p["workers"], weights_mb=p["weights_mb"], ready_timeout=120)
    ctx.record()
    ctx.pause(3, "baseline")
    ctx.load(server, [Phase("steady", p["duration_s"], 8, _normal_traffic(p), rate=p["rate"])])


# --------------------------------------------------------------------------- the engine's KV cache


@scenario(
    "kv-saturation",
    "kv_cache_saturation",
    "a vLLM-speaking server with a small KV budget: long generations fill it, running sequences are preempted and "
    "recomputed, latency climbs",
    needs_cgroups=False,
    limit_mib=1024,
    weights_mb=64,
    dialect="vllm",
    kv_tokens=1600,
    calm_s=12.0,
    busy_s=30.0,
    clients=12,
)
def kv_saturation(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals (the engine's own /metrics, scraped by the agent): KV usage under 80 % in the calm phase and at
    its ceiling in the busy one, preemptions at several per second, TTFT and queue time rising; PSI ~0, memory
    flat (the cache is the engine's fixed budget, not the host's memory).

    The budget (1600 tokens = 100 blocks) admits about seven 200-token prompts; each then generates up to 200
    tokens (25 blocks a sequence at the end), so the batch outgrows the cache within a few dozen steps and the
    most recently admitted sequences are preempted, to be recomputed in a later batch."""
    group = ctx.group("service", p["limit_mib"] * MiB, required=False)
    args = ["--preload", "shared", "--max-concurrency", "16", "--queue-size", "256", "--queue-timeout", "60",
            "--request-timeout", "60", "--max-batch-requests", "8", "--max-prompt-tokens", "512",
            "--max-output-tokens", "256", "--kv-cache-tokens", str(p["kv_tokens"])]  # fmt: skip
    server = ctx.serve(args, group=group, weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    calm = completion((60, 120), (8, 16))  # two clients, short answers: the cache has room
    busy = completion((180, 220), (160, 200))  # long generations: the running batch outgrows the cache
    ctx.load(server, [Phase("calm", p["calm_s"], 2, calm), Phase("saturating", p["busy_s"], p["clients"], busy)],
             request_timeout_s=90.0)  # fmt: skip
    ctx.pause(2, "tail")


# Scenarios kept in their own modules register on import.
from diag.demo.scenarios import config_scenarios, engine_scenarios  # noqa: E402, F401
