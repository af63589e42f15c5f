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

What the recorded kinds fill is not listed by hand: it is read from their declarations in
``collectors.records`` (``collectors.fields``), the same declarations the Timeline builder follows --
so a field declared there is a signal here. Only the Prometheus-only ``service:`` series are spelt below.
"""

from __future__ import annotations

from collectors import fields as fl
from collectors.records import (
    RECORD_TYPES,
    BackendSample,
    CgroupSnapshot,
    GpuDevice,
    GpuSnapshot,
    HostSnapshot,
    ProcessSample,
    Psi,
    PsiLine,
)


def _recorded_tables() -> dict[str, str]:
    """Event tables and record lists of the declared kinds, with where they come from."""
    out: dict[str, str] = {}
    for cls in RECORD_TYPES.values():
        dest = fl.destination(cls)
        if isinstance(dest, fl.Rows):
            out[dest.table] = dest.about
        elif isinstance(dest, fl.Kept) and dest.signal:
            out[dest.signal] = dest.about
        for _, r in fl.roles(cls):
            if isinstance(r, fl.RowsOf):
                out[r.table] = r.about
    return out


def _table_names() -> dict[str, str]:
    names = {}
    for cls in RECORD_TYPES.values():
        dest = fl.destination(cls)
        if isinstance(dest, fl.Rows):
            names[dest.table] = dest.table
        names.update((r.table, r.table) for _, r in fl.roles(cls) if isinstance(r, fl.RowsOf))
    return names


# The Timeline attribute of each scope of sampled series, and the prefix of its signals.
SCOPES: dict[str, str] = {"host": "host:", "cgroups": "cgroup:", "processes": "process:", "gpus": "gpu:", "service": "service:",
                           "backends": "backend:"}  # fmt: skip

# Event tables and lists (one row/record per event).
TABLES: dict[str, str] = {
    **_recorded_tables(),
    "processes": "process samples from the agent (--pid or the processes it found)",
    "process:model_files": "model files a process mapped or held open (the agent's model-file scan)",
    "requests:prompt_tokens": "prompt token counts on the request rows",
    "requests:output_tokens": "output token counts on the request rows",
    "requests:ttft_s": "time to first token on the request rows",
}

# Event-table signals and the Timeline table holding each (``Timeline.signals()`` reads this).
TABLE_ATTRS: dict[str, str] = _table_names()
# Request-row columns that are a signal of their own when any row has them.
REQUEST_COLUMNS: tuple[str, ...] = ("prompt_tokens", "output_tokens", "ttft_s")

# Sampled series, by scope prefix: the pattern is matched on the part after the prefix.
SERIES_SOURCES: dict[str, str] = {
    "host:": "the agent's host sampler (/proc/meminfo, /proc/vmstat, /proc/pressure) or node_exporter",
    "cgroup:": "the agent's cgroup sampler for a watched group (--cgroup, or the group of a watched --pid)",
    "process:": "the agent's process sampler (/proc/<pid>/status, smaps_rollup)",
    "service:": "aggregated request metrics: the tracker's or the inference engine's own families (vLLM, TGI, llama.cpp), "
    "through Prometheus or the agent's --scrape of the backend's /metrics",
    "backend:": "the agent's scrapes of an inference backend's own /metrics (diag collect --scrape)",
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
        "service:requests_waiting",
        "service:requests_running",
        "service:requests_waiting_capacity",
        "service:kv_cache_usage_ratio",
        "service:preemptions_rps",
        "service:ttft_mean_s",
        "service:itl_mean_s",
        "service:e2e_mean_s",
    }
)


# --------------------------------------------------------------------------- what the sources fill
# The key a source writes under each scope -- ``Timeline.host[key]``, ``Timeline.cgroups[path][key]``,
# ``ProcessTrack.series[key]``, ``Timeline.gpus[index][key]``, ``Timeline.service[key]`` -- whose signal
# is ``<scope>:<key>``. Spelt once here so a Prometheus-built Timeline names a signal exactly as a
# recorder-built one does: a source that misspells one fills a series no rule ever reads.


def _family(cls: type, field_name: str) -> str:
    """``<name>.``: the prefix of a family field's series (``CgroupSnapshot.stat`` -> ``stat.``)."""
    r = next(r for name, r in fl.roles(cls) if name == field_name)
    assert isinstance(r, (fl.Family, fl.NestedByKey, fl.Nested))
    return r.name + "."


# host: ``memory.<snake>`` per meminfo field and ``vmstat.<field>`` per vmstat counter the collectors read
# (the catalog's lists: the agent samples exactly those, and node_exporter's families are declared by them).
HOST_MEMORY = _family(HostSnapshot, "memory")
HOST_VMSTAT = _family(HostSnapshot, "vmstat")

# Pressure stall information, host-wide (the catalog's resources) and per cgroup (``memory``).
PSI_KINDS: tuple[str, ...] = tuple(r.name for _, r in fl.roles(Psi) if isinstance(r, fl.Nested))
PSI_AVG10 = fl.series_name(PsiLine, "avg10")
PSI_TOTAL = fl.series_name(PsiLine, "total_us")  # cumulative stall seconds
PSI_FIELDS: tuple[str, ...] = tuple(fl.series_name(PsiLine, name) for name, _ in fl.roles(PsiLine))
_HOST_PSI = _family(HostSnapshot, "psi")


def psi(resource: str, kind: str, field: str) -> str:
    """``psi.<resource>.<some|full>.<avg10|avg60|avg300|total_s>`` (averages in percent)."""
    return f"{_HOST_PSI}{resource}.{kind}.{field}"


# cgroup: memory counters (bytes), and the open memory.stat / memory.events families.
CG_USAGE = fl.series_name(CgroupSnapshot, "usage_bytes")
CG_WORKING_SET = fl.series_name(CgroupSnapshot, "working_set_bytes")
CG_PEAK = fl.series_name(CgroupSnapshot, "peak_bytes")
CG_LIMIT = fl.series_name(CgroupSnapshot, "limit_bytes")
CG_HIGH = fl.series_name(CgroupSnapshot, "high_bytes")
CG_LOW = fl.series_name(CgroupSnapshot, "low_bytes")
CG_MIN = fl.series_name(CgroupSnapshot, "min_bytes")
CG_SWAP = fl.series_name(CgroupSnapshot, "swap_bytes")
CG_UNDER_OOM = fl.series_name(CgroupSnapshot, "under_oom")
CG_STAT = _family(CgroupSnapshot, "stat")
CG_EVENTS = _family(CgroupSnapshot, "events")
CG_EVENTS_LOCAL = _family(CgroupSnapshot, "events_local")

# process tracks.
PROC_RSS = fl.series_name(ProcessSample, "rss_bytes")
PROC_PSS = fl.series_name(ProcessSample, "pss_bytes")
PROC_USS = fl.series_name(ProcessSample, "uss_bytes")
PROC_SWAP = fl.series_name(ProcessSample, "swap_bytes")
PROC_MAJOR_FAULTS = fl.series_name(ProcessSample, "major_faults")
PROC_MINOR_FAULTS = fl.series_name(ProcessSample, "minor_faults")

# GPUs: memory (bytes) and utilisation (0-1) of the GPU and of its memory.
GPU_TOTAL = fl.series_name(GpuDevice, "total_bytes")
GPU_USED = fl.series_name(GpuDevice, "used_bytes")
GPU_FREE = fl.series_name(GpuDevice, "free_bytes")
GPU_RESERVED = fl.series_name(GpuDevice, "reserved_bytes")
GPU_UTIL_GPU = fl.series_name(GpuDevice, "utilization_gpu_ratio")
GPU_UTIL_MEMORY = fl.series_name(GpuDevice, "utilization_memory_ratio")

# service (aggregated request side, Prometheus path): latencies as <stem>_<stat>_s, rates, gauges.
LATENCY_QUEUE_WAIT = "queue_wait"
LATENCY_INFERENCE = "inference"
LATENCY_E2E = "e2e"
LATENCY_PREFILL = "prefill"
LATENCY_DECODE = "decode"
LATENCY_TTFT = "ttft"
LATENCY_ITL = "itl"  # inter-token latency (vLLM's time per output token, TGI's mean time per token)
LATENCY_STEMS: tuple[str, ...] = (LATENCY_QUEUE_WAIT, LATENCY_INFERENCE, LATENCY_E2E, LATENCY_PREFILL, LATENCY_DECODE,
                                  LATENCY_TTFT, LATENCY_ITL)  # fmt: skip
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
# What an inference engine reports of its own scheduler (vLLM, TGI, llama.cpp's server; the tracker where it can):
SVC_REQUESTS_WAITING = "requests_waiting"  # requests queued for the scheduler
SVC_REQUESTS_RUNNING = "requests_running"  # requests in the running batch
SVC_WAITING_FOR_CAPACITY = "requests_waiting_capacity"  # waiting because the KV cache has no room (vLLM by reason)
SVC_KV_CACHE_USAGE = "kv_cache_usage_ratio"  # 0-1: the KV cache's blocks in use
SVC_PREEMPTIONS_RPS = "preemptions_rps"  # sequences preempted (and recomputed) per second
SVC_PROMPT_TOKENS_RPS = "prompt_tokens_rps"
SVC_GENERATION_TOKENS_RPS = "generation_tokens_rps"
SVC_PREFIX_CACHE_HIT_RATIO = "prefix_cache_hit_ratio"

# Per scope: the exact keys, and the open families (prefixes) a source may fill -- the recorded scopes as their
# kinds declare them (host memory, vmstat and PSI resources are the catalog's closed lists), the service by hand.
_SERVICE = frozenset(
    {latency(stem, stat) for stem in LATENCY_STEMS for stat in LATENCY_STATS}
    | {SVC_REQUESTS_RPS, SVC_THROUGHPUT_RPS, SVC_ERROR_RPS, SVC_TIMEOUT_RPS, SVC_REJECTED_RPS}
    | {SVC_ACTIVE_INFERENCES, SVC_QUEUE_DEPTH}
    | {
        SVC_REQUESTS_WAITING,
        SVC_REQUESTS_RUNNING,
        SVC_WAITING_FOR_CAPACITY,
        SVC_KV_CACHE_USAGE,
        SVC_PREEMPTIONS_RPS,
        SVC_PROMPT_TOKENS_RPS,
        SVC_GENERATION_TOKENS_RPS,
        SVC_PREFIX_CACHE_HIT_RATIO,
    }
)
_DECLARED = {"host:": fl.filled(HostSnapshot), "cgroup:": fl.filled(CgroupSnapshot), "process:": fl.filled(ProcessSample),
             "gpu:": fl.filled(GpuSnapshot), "backend:": fl.filled(BackendSample)}  # fmt: skip
FILLED: dict[str, frozenset[str]] = {**{scope: exact for scope, (exact, _) in _DECLARED.items()}, "service:": _SERVICE}
FAMILIES: dict[str, tuple[str, ...]] = {
    **{scope: prefixes for scope, (_, prefixes) in _DECLARED.items()},
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
