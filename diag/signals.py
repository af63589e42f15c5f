"""The signal vocabulary: every name a rule may ask for, and where that signal comes from.

Why a registry: the Timeline names signals (``Timeline.signals()``), each rule declares what it
``needs``, the report says why a rule could not run, and the Prometheus loader decides which series to
fill -- four places that must spell a signal the same way. A rule that asks for a name not listed
here fails at import (``diag.rules.base.rule``), so a typo can no longer leave a rule silently
"not evaluated"; and the "why missing" text comes from here, so it names the collector to turn on.
The Prometheus loader writes every series key through the constants below (``FILLED``/``FAMILIES``:
what a source may fill), and ``tests/diag/test_signal_vocabulary.py`` checks that every source's
Timeline and every series a rule reads stay inside this vocabulary.

Names: ``host:<series>``, ``cgroup:<series>``, ``process:<series>``, ``service:<series>``,
``gpu:<series>`` for sampled series (see ``diag.timeline``), bare names for event tables and lists.
"""

from __future__ import annotations

from collectors.catalog import MEMINFO_FIELDS, PSI_RESOURCES, VMSTAT_FIELDS

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


# --------------------------------------------------------------------------- what the sources fill
# The key a source writes under each scope -- ``Timeline.host[key]``, ``Timeline.cgroups[path][key]``,
# ``ProcessTrack.series[key]``, ``Timeline.gpus[index][key]``, ``Timeline.service[key]`` -- whose signal
# is ``<scope>:<key>``. Spelt once here so a Prometheus-built Timeline names a signal exactly as a
# recorder-built one does: a source that misspells one fills a series no rule ever reads.

# host: ``memory.<snake>`` per meminfo field and ``vmstat.<field>`` per vmstat counter the collectors read
# (the catalog's lists: the agent samples exactly those, and node_exporter's families are declared by them).
HOST_MEMORY = "memory."
HOST_VMSTAT = "vmstat."

# Pressure stall information, host-wide (the catalog's resources) and per cgroup (``memory``).
PSI_KINDS: tuple[str, ...] = ("some", "full")
PSI_AVG10 = "avg10"
PSI_TOTAL = "total_s"  # cumulative stall seconds
PSI_FIELDS: tuple[str, ...] = (PSI_AVG10, "avg60", "avg300", PSI_TOTAL)


def psi(resource: str, kind: str, field: str) -> str:
    """``psi.<resource>.<some|full>.<avg10|avg60|avg300|total_s>`` (averages in percent)."""
    return f"psi.{resource}.{kind}.{field}"


# cgroup: memory counters (bytes), and the open memory.stat / memory.events families.
CG_USAGE = "usage"
CG_WORKING_SET = "working_set"
CG_PEAK = "peak"
CG_LIMIT = "limit"
CG_HIGH = "high"
CG_LOW = "low"
CG_MIN = "min"
CG_SWAP = "swap"
CG_UNDER_OOM = "under_oom"
CG_STAT = "stat."
CG_EVENTS = "events."
CG_EVENTS_LOCAL = "events_local."

# process tracks.
PROC_RSS = "rss"
PROC_PSS = "pss"
PROC_USS = "uss"
PROC_SWAP = "swap"
PROC_MAJOR_FAULTS = "major_faults"
PROC_MINOR_FAULTS = "minor_faults"

# GPUs: memory (bytes) and utilisation (0-1) of the GPU and of its memory.
GPU_TOTAL = "total"
GPU_USED = "used"
GPU_FREE = "free"
GPU_RESERVED = "reserved"
GPU_UTIL_GPU = "util_gpu"
GPU_UTIL_MEMORY = "util_memory"

# service (aggregated request side, Prometheus path): latencies as <stem>_<stat>_s, rates, gauges.
LATENCY_QUEUE_WAIT = "queue_wait"
LATENCY_INFERENCE = "inference"
LATENCY_E2E = "e2e"
LATENCY_PREFILL = "prefill"
LATENCY_DECODE = "decode"
LATENCY_STEMS: tuple[str, ...] = (LATENCY_QUEUE_WAIT, LATENCY_INFERENCE, LATENCY_E2E, LATENCY_PREFILL, LATENCY_DECODE)
LATENCY_STATS: tuple[str, ...] = ("p50", "p95", "mean")


def latency(stem: str, stat: str) -> str:
    """``<stem>_<p50|p95|mean>_s``, e.g. ``queue_wait_p50_s`` (seconds)."""
    return f"{stem}_{stat}_s"


SVC_REQUESTS_RPS = "requests_rps"
SVC_THROUGHPUT_RPS = "throughput_rps"
SVC_ERROR_RPS = "error_rps"
SVC_TIMEOUT_RPS = "timeout_rps"
SVC_REJECTED_RPS = "rejected_rps"
SVC_ACTIVE_INFERENCES = "active_inferences"
SVC_QUEUE_DEPTH = "queue_depth"
SVC_MODEL_PROCESSES = "model_processes:"  # + the model path: how many processes hold it (this host)

# Per scope: the exact keys, and the open families (prefixes) a source may fill.
_HOST = frozenset(
    {psi(r, k, f) for r in PSI_RESOURCES for k in PSI_KINDS for f in PSI_FIELDS}
    | {HOST_MEMORY + snake for snake in MEMINFO_FIELDS.values()}
    | {HOST_VMSTAT + field for field in VMSTAT_FIELDS}
)
_CG_PSI = frozenset(psi("memory", k, f) for k in PSI_KINDS for f in PSI_FIELDS)
_SERVICE = frozenset(
    {latency(stem, stat) for stem in LATENCY_STEMS for stat in LATENCY_STATS}
    | {SVC_REQUESTS_RPS, SVC_THROUGHPUT_RPS, SVC_ERROR_RPS, SVC_TIMEOUT_RPS, SVC_REJECTED_RPS}
    | {SVC_ACTIVE_INFERENCES, SVC_QUEUE_DEPTH}
)
FILLED: dict[str, frozenset[str]] = {
    "host:": _HOST,
    "cgroup:": frozenset({CG_USAGE, CG_WORKING_SET, CG_PEAK, CG_LIMIT, CG_HIGH, CG_LOW, CG_MIN, CG_SWAP, CG_UNDER_OOM}) | _CG_PSI,
    "process:": frozenset({PROC_RSS, PROC_PSS, PROC_USS, PROC_SWAP, PROC_MAJOR_FAULTS, PROC_MINOR_FAULTS}),
    "gpu:": frozenset({GPU_TOTAL, GPU_USED, GPU_FREE, GPU_RESERVED, GPU_UTIL_GPU, GPU_UTIL_MEMORY}),
    "service:": _SERVICE,
}
FAMILIES: dict[str, tuple[str, ...]] = {
    "host:": (),
    "cgroup:": (CG_STAT, CG_EVENTS, CG_EVENTS_LOCAL),
    "process:": (),
    "gpu:": (),
    "service:": (SVC_MODEL_PROCESSES,),
}


def fillable(name: str) -> bool:
    """Whether a source may produce the signal ``name``: a table, an exact key of its scope, or a family member.

    Wider than ``known``: it admits every series a source can fill (and any key of the open memory.stat and
    memory.events families of a cgroup), which a rule must still list in ``SERIES`` to ask for.
    """
    if name in TABLES:
        return True
    for scope, keys in FILLED.items():
        if name.startswith(scope):
            key = name[len(scope) :]
            return key in keys or any(key.startswith(p) and len(key) > len(p) for p in FAMILIES[scope])
    return False


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
