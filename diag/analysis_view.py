"""Terminal rendering of an Analysis: the verdict in plain words first, then the evidence, then what
could not be evaluated and why. Thin: it prints what the rules concluded and derives nothing."""

from __future__ import annotations

import datetime as dt

from rich.console import Console
from rich.text import Text

from diag.rules.engine import Analysis
from diag.units import format_value

PLAIN: dict[str, str] = {
    "healthy": "No incident found by the rules that could be evaluated.",
    "memory_leak": "Memory leak: memory keeps climbing regardless of load.",
    "memory_pressure": "Memory pressure: memory follows load and comes back; the service needs more room or less concurrency.",
    "queue_backlog": "Queue backlog: requests wait for a slot while each inference stays fast.",
    "thrashing": "Thrashing: every request itself slows down under memory reclaim/page faults.",
    "duplicate_model_processes": "Duplicate model copies: several processes each hold the model.",
    "blocking_loader_refresh": "Blocking loader: the model is re-read on the request path.",
    "gpu_oom": "GPU out of memory.",
    "host_oom": "Host/cgroup out of memory: the kernel OOM killer fired.",
    "allocator_fragmentation": "GPU allocator fragmentation: memory is reserved but unallocated, not truly full.",
    "moe_expert_skew": "MoE expert skew: one expert takes most tokens and blows the peak.",
    "request_count_batching": "Request-count batching: batches capped by requests, not tokens, vary wildly in size.",
    "oversized_context": "Oversized context: long prompts drive the failures and the memory peak.",
    "noisy_neighbour": "Noisy neighbour: host pressure comes from outside the service's cgroup.",
    "unsafe_config": "Unsafe configuration: the settings make this incident likely.",
}


def _when(ts: float | None) -> str:
    if ts is None:
        return "?"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%H:%M:%S")


def render_analysis(analysis: Analysis, console: Console | None = None) -> None:
    console = console or Console()
    start, end = analysis.window
    head = Text("Verdict: ", style="bold")
    head.append(analysis.primary, style="bold red" if analysis.primary != "healthy" else "bold green")
    console.print(head)
    console.print(PLAIN.get(analysis.primary, analysis.primary))
    if analysis.contributing:
        console.print("Contributing: " + ", ".join(analysis.contributing))
    console.print(Text(f"Window {_when(start)}–{_when(end)} UTC ({end - start:.0f} s) from {analysis.source}", style="dim"))
    for f in analysis.findings:
        console.print()
        console.print(Text(f"[{f.cls}] {f.summary}", style="bold"))
        console.print(Text(f"  confidence {f.confidence:.2f} · rule {f.rule}", style="dim"))
        for e in f.evidence:
            span = f" ({_when(e.start)}–{_when(e.end)})" if e.start is not None else ""
            console.print(Text(f"  • {e.what}: {format_value(e.value, e.unit)}{span}"))
        for r in f.rules_out:
            console.print(Text(f"  rules out: {r}", style="cyan"))
        for r in f.remediation:
            console.print(Text(f"  do: {r}", style="green"))
    if analysis.not_evaluated:
        console.print()
        console.print(Text("Not evaluated (missing signals — not the same as healthy):", style="yellow"))
        for item in analysis.not_evaluated:
            console.print(Text(f"  {item['rule']}: missing {', '.join(item['missing'])}", style="yellow"))
