"""The signal vocabulary: every name a rule may ask for, and where that signal comes from.

Why a registry: the Timeline names signals (``Timeline.signals()``), each rule declares what it
``needs``, the report says why a rule could not run, and the Prometheus loader decides which series to
fill -- four places that must spell a signal the same way. A rule that asks for a name not listed
here fails at import (``diag.rules.base.rule``), so a typo can no longer leave a rule silently
"not evaluated"; and the "why missing" text comes from here, so it names the collector to turn on.

Names: ``host:<series>``, ``cgroup:<series>``, ``process:<series>``, ``service:<series>``,
``gpu:<series>`` for sampled series (see ``diag.timeline``), bare names for event tables and lists.
"""

from __future__ import annotations

# Event tables and lists (one row/record per event).
TABLES: dict[str, str] = {
    "requests": "per-request rows (the request tracker, or an instrumented server's request records)",
    "batches": "per-batch records from the serving loop (the tracker's batch hook)",
    "routing": "MoE routing records (expert token counts per step)",
    "loader": "model-loader records (bytes loaded, duration, whether on the request path)",
    "torch": "torch CUDA allocator snapshots",
    "gpu_processes": "per-process GPU memory (NVML)",
    "ooms": "kernel OOM kill records (the agent reading /dev/kmsg, or a per-cgroup oom_kill counter)",
    "cuda_ooms": "CUDA out-of-memory errors reported by the service",
    "config": "the service's configuration record",
    "processes": "process samples from the agent (--pid or the processes it found)",
    "process:model_files": "model files a process mapped or held open (the agent's model-file scan)",
    "requests:prompt_tokens": "prompt token counts on the request rows",
    "requests:output_tokens": "output token counts on the request rows",
    "requests:ttft_s": "time to first token on the request rows",
}

# Event-table signals and the Timeline attribute holding each (``Timeline.signals()`` reads this).
TABLE_ATTRS: dict[str, str] = {
    "requests": "requests",
    "batches": "batches",
    "routing": "routing",
    "loader": "loader",
    "torch": "torch",
    "gpu_processes": "gpu_processes",
}
# Request-row columns that are a signal of their own when any row has them.
REQUEST_COLUMNS: tuple[str, ...] = ("prompt_tokens", "output_tokens", "ttft_s")

# Sampled series, by scope prefix: the pattern is matched on the part after the prefix.
SERIES_SOURCES: dict[str, str] = {
    "host:": "the agent's host sampler (/proc/meminfo, /proc/vmstat, /proc/pressure) or node_exporter",
    "cgroup:": "the agent's cgroup sampler for a watched group (--cgroup, or the group of a watched --pid)",
    "process:": "the agent's process sampler (/proc/<pid>/status, smaps_rollup)",
    "service:": "aggregated request metrics on the Prometheus path (the tracker's or vLLM/TGI histograms)",
    "gpu:": "the agent's GPU sampler (NVML)",
}

# The series rules ask for by name: asking for one not listed here is a typo.
SERIES: frozenset[str] = frozenset(
    {
        "host:memory.available",
        "host:memory.total",
        "host:psi.memory.some.avg10",
        "host:psi.memory.full.avg10",
        "host:psi.io.some.avg10",
        "host:vmstat.pgmajfault",
        "host:vmstat.workingset_refault",
        "host:vmstat.workingset_refault_file",
        "host:vmstat.workingset_refault_anon",
        "host:vmstat.pswpin",
        "cgroup:working_set",
        "cgroup:usage",
        "cgroup:limit",
        "cgroup:stat.anon",
        "cgroup:stat.pgmajfault",
        "cgroup:stat.workingset_refault_file",
        "cgroup:stat.workingset_refault_anon",
        "cgroup:events.oom_kill",
        "cgroup:psi.memory.some.avg10",
        "cgroup:psi.memory.full.avg10",
        "process:rss",
        "process:uss",
        "process:pss",
        "process:major_faults",
        "service:queue_wait_mean_s",
        "service:inference_mean_s",
        "service:queue_wait_p50_s",
        "service:inference_p50_s",
        "service:queue_depth",
    }
)


def known(name: str) -> bool:
    """Whether ``name`` is a signal of the vocabulary (a trailing ``*`` matches a prefix of one)."""
    if name.endswith("*"):
        prefix = name[:-1]
        return any(s.startswith(prefix) for s in (*SERIES, *TABLES))
    return name in SERIES or name in TABLES


def where_from(name: str) -> str:
    """``name (where it comes from)``: the "why missing" text of a report."""
    if name in TABLES:
        return f"{name} ({TABLES[name]})"
    for prefix, source in SERIES_SOURCES.items():
        if name.startswith(prefix):
            return f"{name} ({source})"
    return name
