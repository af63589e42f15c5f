"""The metric catalog: every metric llm-diag exports, declared once.

Exporters register from here; dashboards and alerts refer to these entries, never to string
literals, so a rename breaks the build instead of silently emptying a panel. External families we
read or chart (vLLM, node_exporter, cAdvisor, DCGM) are declared at the bottom with the versions
they hold for.

Naming (Prometheus practice: the official naming guide and exposition-format docs): one prefix ``llmdiag_``,
base units in the name (``_seconds``, ``_bytes``, ``_ratio``), counters end in ``_total`` (the
*exposed* name is what is declared), bounded labels only -- never a request id or a prompt.
``validate_catalog()`` enforces these rules and runs in the test suite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]
PREFIX = "llmdiag_"

# OpenTelemetry GenAI semantic-convention bucket boundaries (seconds), so our latency histograms
# line up with vLLM's and OTel's.
GENAI_REQUEST_DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
GENAI_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# Queue wait starts far below the GenAI request duration's first bucket: a healthy queue is ~0.
QUEUE_WAIT_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.005, *GENAI_REQUEST_DURATION_BUCKETS)
TOKEN_COUNT_BUCKETS: tuple[float, ...] = tuple(float(4**i) for i in range(0, 10))  # 1 .. 262144


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric. ``name`` is the exposed name (counters include ``_total``)."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # bytes | seconds | ratio | "" (a plain count)
    source: str = ""  # the collector module that emits it
    buckets: tuple[float, ...] | None = None

    @property
    def base_name(self) -> str:
        """Name without ``_total``: what prometheus_client's Counter expects to be given."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


@dataclass(frozen=True)
class ExternalFamily:
    """A metric family someone else exports that we read or chart."""

    name: str
    type: str
    exporter: str
    versions: str
    help: str = ""


CATALOG: dict[str, MetricSpec] = {}


def _declare(spec: MetricSpec) -> MetricSpec:
    if spec.name in CATALOG:
        raise ValueError(f"metric {spec.name} declared twice")
    CATALOG[spec.name] = spec
    return spec


def metric(name: str) -> MetricSpec:
    """Look a metric up by its exposed name; an unknown name raises KeyError (the build breaks)."""
    return CATALOG[name]


# --------------------------------------------------------------------------- host: PSI

PSI_RESOURCES: tuple[str, ...] = ("cpu", "memory", "io")
# node_exporter convention: some -> waiting, full -> stalled. Host cpu "full" is undefined (zero),
# so it is not exported.
PSI_HOST_STALLED_RESOURCES: tuple[str, ...] = ("memory", "io")

HOST_PSI_WAITING = {
    r: _declare(MetricSpec(
        f"llmdiag_host_pressure_{r}_waiting_seconds_total", "counter",
        f"Total time at least one task waited on {r} (PSI 'some' total), host-wide.",
        unit="seconds", source="collectors.host"))
    for r in PSI_RESOURCES
}  # fmt: skip
HOST_PSI_STALLED = {
    r: _declare(MetricSpec(
        f"llmdiag_host_pressure_{r}_stalled_seconds_total", "counter",
        f"Total time all non-idle tasks stalled on {r} at once (PSI 'full' total), host-wide.",
        unit="seconds", source="collectors.host"))
    for r in PSI_HOST_STALLED_RESOURCES
}  # fmt: skip
HOST_PSI_AVG10 = _declare(MetricSpec(
    "llmdiag_host_pressure_avg10_ratio", "gauge",
    "PSI 10-second average as a 0-1 ratio, host-wide, by resource and kind (some|full).",
    labels=("resource", "kind"), unit="ratio", source="collectors.host"))  # fmt: skip

# --------------------------------------------------------------------------- host: meminfo

# /proc/meminfo key -> snake-case name used in records and in llmdiag_host_memory_<name>_bytes.
MEMINFO_FIELDS: dict[str, str] = {
    "MemTotal": "total",
    "MemFree": "free",
    "MemAvailable": "available",
    "Buffers": "buffers",
    "Cached": "cached",
    "SwapCached": "swap_cached",
    "Active": "active",
    "Inactive": "inactive",
    "Active(anon)": "active_anon",
    "Inactive(anon)": "inactive_anon",
    "Active(file)": "active_file",
    "Inactive(file)": "inactive_file",
    "Unevictable": "unevictable",
    "Mlocked": "mlocked",
    "SwapTotal": "swap_total",
    "SwapFree": "swap_free",
    "Dirty": "dirty",
    "Writeback": "writeback",
    "AnonPages": "anon_pages",
    "Mapped": "mapped",
    "Shmem": "shmem",
    "SReclaimable": "slab_reclaimable",
    "SUnreclaim": "slab_unreclaimable",
    "PageTables": "page_tables",
    "CommitLimit": "commit_limit",
    "Committed_AS": "committed_as",
}
HOST_MEMORY = {
    snake: _declare(MetricSpec(
        f"llmdiag_host_memory_{snake}_bytes", "gauge",
        f"/proc/meminfo {key}" + (" (the kernel's estimate when the line is absent)." if snake == "available" else "."),
        unit="bytes", source="collectors.host"))
    for key, snake in MEMINFO_FIELDS.items()
}  # fmt: skip

# --------------------------------------------------------------------------- host: vmstat

VMSTAT_FIELDS: tuple[str, ...] = (
    "pgfault", "pgmajfault", "pgpgin", "pgpgout", "pswpin", "pswpout", "oom_kill",
    "workingset_refault", "workingset_refault_anon", "workingset_refault_file",
    "pgscan_kswapd", "pgscan_direct", "pgscan_khugepaged", "pgscan_anon", "pgscan_file",
    "pgsteal_kswapd", "pgsteal_direct", "pgsteal_khugepaged", "pgsteal_anon", "pgsteal_file",
    "allocstall_normal", "allocstall_movable",
)  # fmt: skip
HOST_VMSTAT = {
    f: _declare(MetricSpec(
        f"llmdiag_host_vmstat_{f}_total", "counter", f"/proc/vmstat {f} (cumulative count since boot).",
        source="collectors.host"))
    for f in VMSTAT_FIELDS
}  # fmt: skip

# --------------------------------------------------------------------------- cgroup memory

_CG = ("cgroup",)
CGROUP_USAGE = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_usage_bytes",
        "gauge",
        "cgroup memory usage (v2 memory.current, v1 memory.usage_in_bytes).",
        _CG,
        "bytes",
        "collectors.cgroup",
    )
)
CGROUP_WORKING_SET = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_working_set_bytes",
        "gauge",
        "Usage minus inactive_file, clamped at 0 (cAdvisor's working set): what the OOM killer cannot reclaim cheaply.",
        _CG,
        "bytes",
        "collectors.cgroup",
    )
)
CGROUP_LIMIT = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_limit_bytes",
        "gauge",
        "Hard memory limit (v2 memory.max, v1 memory.limit_in_bytes); absent when unlimited.",
        _CG,
        "bytes",
        "collectors.cgroup",
    )
)
CGROUP_HIGH = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_high_bytes",
        "gauge",
        "v2 memory.high throttling boundary; absent when 'max'.",
        _CG,
        "bytes",
        "collectors.cgroup",
    )
)
CGROUP_PEAK = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_peak_bytes",
        "gauge",
        "Peak usage (v2 memory.peak, v1 memory.max_usage_in_bytes).",
        _CG,
        "bytes",
        "collectors.cgroup",
    )
)
CGROUP_SWAP = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_swap_bytes",
        "gauge",
        "Swap used by the group (v2 memory.swap.current, v1 memory.stat swap).",
        _CG,
        "bytes",
        "collectors.cgroup",
    )
)
CGROUP_STAT_BYTES = {
    key: _declare(MetricSpec(
        f"llmdiag_cgroup_memory_{key}_bytes", "gauge", f"memory.stat {key} (v1: the hierarchical total_ value).",
        _CG, "bytes", "collectors.cgroup"))
    for key in ("anon", "file", "active_file", "inactive_file", "shmem", "file_mapped")
}  # fmt: skip
CGROUP_STAT_COUNTERS = {
    key: _declare(MetricSpec(
        f"llmdiag_cgroup_memory_{key}_total", "counter", f"memory.stat {key} (cumulative).",
        _CG, "", "collectors.cgroup"))
    for key in ("pgmajfault", "workingset_refault_anon", "workingset_refault_file")
}  # fmt: skip
CGROUP_EVENTS = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_events_total",
        "counter",
        "memory.events by key (low, high, max, oom, oom_kill, oom_group_kill); v1 failcnt maps to 'max' and "
        "memory.oom_control oom_kill to 'oom_kill'. scope is hierarchical or local (memory.events.local).",
        ("cgroup", "event", "scope"),
        "",
        "collectors.cgroup",
    )
)
CGROUP_UNDER_OOM = _declare(
    MetricSpec(
        "llmdiag_cgroup_memory_under_oom",
        "gauge",
        "1 while the v1 group is under OOM (memory.oom_control under_oom).",
        _CG,
        "",
        "collectors.cgroup",
    )
)
CGROUP_PSI_WAITING = _declare(
    MetricSpec(
        "llmdiag_cgroup_pressure_memory_waiting_seconds_total",
        "counter",
        "The group's memory PSI 'some' total (cgroup2 memory.pressure; on a hybrid host, the v2 twin).",
        _CG,
        "seconds",
        "collectors.cgroup",
    )
)
CGROUP_PSI_STALLED = _declare(
    MetricSpec(
        "llmdiag_cgroup_pressure_memory_stalled_seconds_total",
        "counter",
        "The group's memory PSI 'full' total.",
        _CG,
        "seconds",
        "collectors.cgroup",
    )
)

# --------------------------------------------------------------------------- processes

_PROC = ("pid", "comm")
PROCESS_RSS = _declare(
    MetricSpec(
        "llmdiag_process_resident_memory_bytes",
        "gauge",
        "Resident set size of a watched process (top-N by RSS, plus every process holding a model file; beyond "
        '--max-processes the smallest are summed into pid="other").',
        _PROC,
        "bytes",
        "collectors.processes",
    )
)
PROCESS_PSS = _declare(
    MetricSpec(
        "llmdiag_process_proportional_memory_bytes",
        "gauge",
        "Proportional set size (smaps_rollup Pss): shared pages divided among their users.",
        _PROC,
        "bytes",
        "collectors.processes",
    )
)
PROCESS_USS = _declare(
    MetricSpec(
        "llmdiag_process_unique_memory_bytes",
        "gauge",
        "Unique set size (private clean + private dirty): what killing the process would free.",
        _PROC,
        "bytes",
        "collectors.processes",
    )
)
PROCESS_SWAP = _declare(
    MetricSpec(
        "llmdiag_process_swap_bytes",
        "gauge",
        "Swapped-out memory of the process (smaps_rollup Swap).",
        _PROC,
        "bytes",
        "collectors.processes",
    )
)
PROCESS_MAJOR_FAULTS = _declare(
    MetricSpec(
        "llmdiag_process_major_faults_total",
        "counter",
        "Major page faults of the process (/proc/<pid>/stat majflt).",
        _PROC,
        "",
        "collectors.processes",
    )
)
MODEL_PROCESSES = _declare(
    MetricSpec(
        "llmdiag_model_processes",
        "gauge",
        "How many processes map or hold open each model file: 4 for one model means 4 private copies may be resident.",
        ("model",),
        "",
        "collectors.processes",
    )
)
MODEL_PROCESS_INFO = _declare(
    MetricSpec(
        "llmdiag_model_process_info",
        "gauge",
        "1 for each process that maps or holds open a model file (pid, comm as on the process series; one folded into "
        'pid="other" is left out, llmdiag_model_processes still counts it): joined with '
        "llmdiag_process_uss_bytes / _rss_bytes it tells private copies from processes sharing one mapping.",
        ("model", "pid", "comm"),
        "",
        "collectors.processes",
    )
)

# --------------------------------------------------------------------------- GPU (NVML)

_GPU = ("gpu", "uuid")
GPU_AVAILABLE = _declare(
    MetricSpec(
        "llmdiag_gpu_available",
        "gauge",
        "1 when NVML answered; 0 when no driver/library (the reason is in the snapshot).",
        (),
        "",
        "collectors.gpu",
    )
)
GPU_MEMORY = {
    part: _declare(MetricSpec(
        f"llmdiag_gpu_memory_{part}_bytes", "gauge", f"NVML memory info v2 '{part}' of the device.", _GPU, "bytes",
        "collectors.gpu"))
    for part in ("total", "used", "free", "reserved")
}  # fmt: skip
GPU_UTILIZATION = _declare(
    MetricSpec(
        "llmdiag_gpu_utilization_ratio",
        "gauge",
        "Share of the last sample period a kernel ran (resource=gpu) or memory was read/written (resource=memory).",
        ("gpu", "uuid", "resource"),
        "ratio",
        "collectors.gpu",
    )
)
GPU_PROCESS_MEMORY = _declare(
    MetricSpec(
        "llmdiag_gpu_process_memory_bytes",
        "gauge",
        "GPU memory used by a process (NVML compute processes; host PIDs).",
        ("gpu", "pid"),
        "bytes",
        "collectors.gpu",
    )
)

# --------------------------------------------------------------------------- kernel OOM

OOM_KILLS = _declare(
    MetricSpec(
        "llmdiag_oom_kills_total",
        "counter",
        "Kernel OOM kills seen in /dev/kmsg since the agent started, by constraint (CONSTRAINT_MEMCG = a cgroup limit, "
        "CONSTRAINT_NONE = the whole host).",
        ("constraint",),
        "",
        "collectors.kmsg",
    )
)

# --------------------------------------------------------------------------- the agent itself

AGENT_SAMPLE_DURATION = _declare(
    MetricSpec(
        "llmdiag_agent_sample_duration_seconds",
        "gauge",
        "Wall time of the agent's last full sample.",
        (),
        "seconds",
        "collectors.agent",
    )
)
AGENT_SAMPLER_ERRORS = _declare(
    MetricSpec(
        "llmdiag_agent_sampler_errors_total",
        "counter",
        "Samples in which a sampler failed or reported a field missing, by sampler.",
        ("sampler",),
        "",
        "collectors.agent",
    )
)
AGENT_RESIDENT_MEMORY = _declare(
    MetricSpec(
        "llmdiag_agent_resident_memory_bytes",
        "gauge",
        "Resident memory of the agent itself (it must stay small).",
        (),
        "bytes",
        "collectors.agent",
    )
)
AGENT_CPU = _declare(
    MetricSpec(
        "llmdiag_agent_cpu_seconds_total",
        "counter",
        "User + system CPU time of the agent itself.",
        (),
        "seconds",
        "collectors.agent",
    )
)
RECORDER_SIZE = _declare(
    MetricSpec(
        "llmdiag_recorder_size_bytes",
        "gauge",
        "Size of the flight recorder on disk (database plus WAL).",
        (),
        "bytes",
        "collectors.recorder",
    )
)
RECORDER_WRITE_ERRORS = _declare(
    MetricSpec(
        "llmdiag_recorder_write_errors_total",
        "counter",
        "Batches the flight recorder failed to write.",
        (),
        "",
        "collectors.recorder",
    )
)
RECORDER_RESETS = _declare(
    MetricSpec(
        "llmdiag_recorder_resets_total",
        "counter",
        "Times the agent started a fresh flight recorder, by reason: corrupt (the file was not a database; it was "
        "moved aside as <name>.corrupt-<time>), deleted or replaced (the path no longer named the open file).",
        ("reason",),
        "",
        "collectors.agent",
    )
)
RECORDER_DISK_FULL = _declare(
    MetricSpec(
        "llmdiag_recorder_disk_full_total",
        "counter",
        "Writes that met a full disk; each time the oldest rows were deleted to make room before retrying.",
        (),
        "",
        "collectors.recorder",
    )
)
WATCH_TARGETS_ASKED = _declare(
    MetricSpec(
        "llmdiag_watch_targets",
        "gauge",
        "Targets given with --pid/--cgroup, by kind (pid|cgroup); compare with llmdiag_watch_targets_found.",
        ("kind",),
        "",
        "collectors.agent",
    )
)
WATCH_TARGETS_FOUND = _declare(
    MetricSpec(
        "llmdiag_watch_targets_found",
        "gauge",
        "Of the --pid/--cgroup targets, how many exist at the last sample, by kind (pid|cgroup). Below "
        "llmdiag_watch_targets: the service is not there (yet); the agent keeps looking every sample.",
        ("kind",),
        "",
        "collectors.agent",
    )
)

# The caps on process and cgroup label values (collectors.series_cap): kind = process | cgroup.
SERIES_FOLDED = _declare(MetricSpec(
    "llmdiag_series_folded", "gauge",
    "Process or cgroup label values beyond the agent's cap (--max-processes, --max-cgroups) at the last sample, "
    "folded into the pid=\"other\" / cgroup=\"other\" series, by kind (process|cgroup).",
    ("kind",), "", "collectors.exporter"))  # fmt: skip
SERIES_OVERFLOW = _declare(MetricSpec(
    "llmdiag_series_overflow_total", "counter",
    "Samples at which some label values of this kind (process|cgroup) were beyond the cap and folded into the "
    "overflow series: rising means the cap is too small for the host to show each one.",
    ("kind",), "", "collectors.exporter"))  # fmt: skip

# --------------------------------------------------------------------------- the agent's scrapes of backends

# ``diag collect --scrape``: the health of each scrape of an inference backend's own /metrics (collectors.scrape).
# ``target`` is the scraped URL without credentials or query: bounded by what the operator named (or the
# listening sockets of the model-file holders, with --scrape auto). The backend's own families are never
# re-exported here.
_TARGET = ("target",)
BACKEND_UP = _declare(MetricSpec(
    "llmdiag_backend_up", "gauge",
    "1 when the last scrape of the backend's /metrics gave its families, 0 when it failed; dialect = whose families "
    "(vllm, tgi, llamacpp, llmdiag, unknown).", ("target", "dialect"), "", "collectors.scrape"))  # fmt: skip
BACKEND_SCRAPE_DURATION = _declare(MetricSpec(
    "llmdiag_backend_scrape_duration_seconds", "gauge", "Wall time of the last scrape of the backend (fetch and parse).",
    _TARGET, "seconds", "collectors.scrape"))  # fmt: skip
BACKEND_SCRAPES = _declare(MetricSpec(
    "llmdiag_backend_scrapes_total", "counter", "Scrapes of the backend's /metrics attempted.", _TARGET, "",
    "collectors.scrape"))  # fmt: skip
BACKEND_SCRAPE_ERRORS = _declare(MetricSpec(
    "llmdiag_backend_scrape_errors_total", "counter",
    "Failed scrapes by reason: timeout, connect (refused, unreachable), http (not 200), too_large, parse (not a valid "
    "exposition), no_families (none of the known backend families). Sampling goes on regardless.",
    ("target", "reason"), "", "collectors.scrape"))  # fmt: skip
BACKEND_DROPPED_SERIES = _declare(MetricSpec(
    "llmdiag_backend_dropped_series_total", "counter",
    "Series of mapped families not stored: beyond the per-family cap of label sets, or with an over-long label value.",
    _TARGET, "", "collectors.scrape"))  # fmt: skip
BACKEND_KEPT_SERIES = _declare(MetricSpec(
    "llmdiag_backend_kept_series", "gauge", "Series the last scrape stored in the flight recorder (after summing away "
    "labels no signal reads).", _TARGET, "", "collectors.scrape"))  # fmt: skip

# --------------------------------------------------------------------------- in-process tracker

_REQ = ("route", "model")
REQUEST_QUEUE_WAIT = _declare(
    MetricSpec(
        "llmdiag_request_queue_wait_seconds",
        "histogram",
        "Time from arrival until the request got an inference slot.",
        _REQ,
        "seconds",
        "collectors.tracking",
        QUEUE_WAIT_BUCKETS,
    )
)
REQUEST_INFERENCE = _declare(
    MetricSpec(
        "llmdiag_request_inference_seconds",
        "histogram",
        "Time from the start of inference to the end of the request.",
        _REQ,
        "seconds",
        "collectors.tracking",
        GENAI_REQUEST_DURATION_BUCKETS,
    )
)
REQUEST_E2E = _declare(
    MetricSpec(
        "llmdiag_request_e2e_seconds",
        "histogram",
        "Time from arrival to the end of the request.",
        _REQ,
        "seconds",
        "collectors.tracking",
        GENAI_REQUEST_DURATION_BUCKETS,
    )
)
REQUEST_TTFT = _declare(
    MetricSpec(
        "llmdiag_request_ttft_seconds",
        "histogram",
        "Time from arrival to the first streamed token.",
        _REQ,
        "seconds",
        "collectors.tracking",
        GENAI_TTFT_BUCKETS,
    )
)
QUEUE_DEPTH = _declare(
    MetricSpec("llmdiag_queue_depth", "gauge", "Requests waiting for an inference slot now.", _REQ, "", "collectors.tracking")
)
ACTIVE_INFERENCES = _declare(
    MetricSpec("llmdiag_active_inferences", "gauge", "Requests holding an inference slot now.", _REQ, "", "collectors.tracking")
)
REQUESTS = _declare(
    MetricSpec(
        "llmdiag_requests_total",
        "counter",
        "Finished requests by outcome (ok, error, queue_timeout, inference_timeout, rejected).",
        ("route", "model", "outcome"),
        "",
        "collectors.tracking",
    )
)
TRACKER_ERRORS = _declare(
    MetricSpec(
        "llmdiag_tracker_errors_total",
        "counter",
        "Failures inside llm-diag's own recording (never raised into the app), by stage.",
        ("stage",),
        "",
        "collectors.tracking",
    )
)

# Admission control and the memory guard (collectors.tracking.admission). Limits are exported so a
# rule can multiply workers x concurrency against the memory limit (unsafe_config); in multiprocess
# mode they sum over live workers.
ADMISSION_REJECTIONS = _declare(MetricSpec(
    "llmdiag_admission_rejections_total", "counter",
    "Requests refused before inference, by reason (queue_full, memory_watermark, memory_psi, queue_timeout).",
    ("route", "model", "reason"), "", "collectors.tracking"))  # fmt: skip
ADMISSION_MAX_CONCURRENCY = _declare(MetricSpec(
    "llmdiag_admission_max_concurrency", "gauge",
    "Configured inference slots (summed over live worker processes); absent when unlimited.",
    ("model",), "", "collectors.tracking"))  # fmt: skip
ADMISSION_QUEUE_CAPACITY = _declare(MetricSpec(
    "llmdiag_admission_queue_capacity", "gauge",
    "Configured bound of the wait queue (summed over live worker processes); absent when unbounded.",
    ("model",), "", "collectors.tracking"))  # fmt: skip
MEMORY_GUARD_USED = _declare(MetricSpec(
    "llmdiag_memory_guard_used_ratio", "gauge",
    "Memory in use as the guard sees it: cgroup working set / cgroup limit, else (MemTotal - MemAvailable) / MemTotal.",
    ("model",), "ratio", "collectors.tracking"))  # fmt: skip
MEMORY_GUARD_ACCEPTING = _declare(MetricSpec(
    "llmdiag_memory_guard_accepting", "gauge",
    "1 while the memory guard admits new work, 0 while it refuses it (lowest over live workers).",
    ("model",), "", "collectors.tracking"))  # fmt: skip

# Batching, MoE routing, loaders (collectors.tracking.batches / .loader). Per-expert counts stay in
# the flight recorder: only per-layer summaries are exported, never one series per expert.
BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(0, 11))  # 1 .. 1024 requests
LOADER_DURATION_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
BATCH_INPUT_TOKENS = _declare(MetricSpec(
    "llmdiag_batch_input_tokens", "histogram",
    "Total input tokens of one batch: with the request count it tells a token-heavy batch from a crowded one.",
    ("model", "phase"), "", "collectors.tracking", TOKEN_COUNT_BUCKETS))  # fmt: skip
BATCH_REQUESTS = _declare(MetricSpec(
    "llmdiag_batch_requests", "histogram", "Requests in one batch.",
    ("model", "phase"), "", "collectors.tracking", BATCH_SIZE_BUCKETS))  # fmt: skip
BATCH_MAX_REQUEST_TOKENS = _declare(MetricSpec(
    "llmdiag_batch_max_request_tokens", "histogram", "Tokens of the largest request in one batch.",
    ("model", "phase"), "", "collectors.tracking", TOKEN_COUNT_BUCKETS))  # fmt: skip
MOE_EXPERT_SKEW = _declare(MetricSpec(
    "llmdiag_moe_expert_skew_ratio", "gauge",
    "Last routing step of a MoE layer: tokens of the busiest expert / median tokens per expert "
    "(+Inf when the median is 0 but some expert got tokens).",
    ("model", "layer"), "ratio", "collectors.tracking"))  # fmt: skip
MOE_EXPERT_BALANCEDNESS = _declare(MetricSpec(
    "llmdiag_moe_expert_balancedness_ratio", "gauge",
    "Last routing step of a MoE layer: mean / max tokens per expert (1 = perfectly balanced; vLLM/SGLang definition).",
    ("model", "layer"), "ratio", "collectors.tracking"))  # fmt: skip
MOE_EXPERT_OVERFLOW = _declare(MetricSpec(
    "llmdiag_moe_expert_overflow_tokens_total", "counter",
    "Tokens routed to experts beyond their capacity (dropped or re-routed), by layer.",
    ("model", "layer"), "", "collectors.tracking"))  # fmt: skip
LOADER_DURATION = _declare(MetricSpec(
    "llmdiag_loader_duration_seconds", "histogram",
    "Duration of a model load or registry refresh; in_request_path=true when it ran inside a waiting request's "
    "arrival-to-start window.",
    ("model", "in_request_path"), "seconds", "collectors.tracking", LOADER_DURATION_BUCKETS))  # fmt: skip
LOADER_EVENTS = _declare(MetricSpec(
    "llmdiag_loader_events_total", "counter", "Model loads / registry refreshes by cache result (hit, miss, unknown).",
    ("model", "cache", "in_request_path"), "", "collectors.tracking"))  # fmt: skip
LOADER_READ = _declare(MetricSpec(
    "llmdiag_loader_read_bytes_total", "counter", "Bytes loaders reported reading.",
    ("model",), "bytes", "collectors.tracking"))  # fmt: skip

# torch CUDA allocator, from inside the serving process (collectors.tracking.torch_memory).
TORCH_MEMORY = {
    part: _declare(MetricSpec(
        f"llmdiag_torch_memory_{part}_bytes", "gauge",
        f"torch.cuda.memory_stats {part.replace('_', ' ')} bytes of the device (summed over live workers); "
        "reserved - allocated is the caching allocator's slack.",
        ("device",), "bytes", "collectors.tracking"))
    for part in ("allocated", "reserved", "allocated_peak", "reserved_peak")
}  # fmt: skip
CUDA_OOM_ERRORS = _declare(MetricSpec(
    "llmdiag_cuda_oom_errors_total", "counter", "CUDA out-of-memory errors caught in the serving process.",
    ("model", "device"), "", "collectors.tracking"))  # fmt: skip


# --------------------------------------------------------------------------- external families

EXTERNAL: tuple[ExternalFamily, ...] = (
    ExternalFamily("vllm:num_requests_running", "gauge", "vLLM", "v1 engine (0.9+)", "Requests in the running batch."),
    ExternalFamily("vllm:num_requests_waiting", "gauge", "vLLM", "v1 engine (0.9+)", "Requests waiting to be scheduled."),
    ExternalFamily("vllm:kv_cache_usage_perc", "gauge", "vLLM", "0.9+", "KV-cache usage as a 0-1 fraction."),
    ExternalFamily("vllm:num_preemptions_total", "counter", "vLLM", "v1 engine", "Preempted sequences."),
    ExternalFamily("vllm:request_queue_time_seconds", "histogram", "vLLM", "v1 engine", "Time in WAITING."),
    ExternalFamily("vllm:request_inference_time_seconds", "histogram", "vLLM", "v1 engine", "Time in RUNNING."),
    ExternalFamily("vllm:e2e_request_latency_seconds", "histogram", "vLLM", "v1 engine", "End-to-end latency."),
    ExternalFamily("vllm:time_to_first_token_seconds", "histogram", "vLLM", "v1 engine", "TTFT."),
    ExternalFamily("tgi_queue_size", "gauge", "TGI", "2.x/3.x", "Requests waiting."),
    ExternalFamily("tgi_request_queue_duration", "histogram", "TGI", "2.x/3.x", "Queue time (seconds, no unit suffix)."),
    ExternalFamily("node_pressure_memory_waiting_seconds_total", "counter", "node_exporter", "1.x", "Host memory PSI some."),
    ExternalFamily("node_pressure_memory_stalled_seconds_total", "counter", "node_exporter", "1.x", "Host memory PSI full."),
    ExternalFamily("node_memory_MemAvailable_bytes", "gauge", "node_exporter", "1.x", "MemAvailable."),
    ExternalFamily("node_vmstat_pgmajfault", "untyped", "node_exporter", "1.x", "Major faults (no _total)."),
    ExternalFamily("container_memory_working_set_bytes", "gauge", "cAdvisor", "0.4x", "Usage - inactive_file."),
    ExternalFamily("container_pressure_memory_waiting_seconds_total", "counter", "cAdvisor", "0.50+", "cgroup2 PSI some."),
    ExternalFamily("DCGM_FI_DEV_FB_USED", "gauge", "dcgm-exporter", "3.x/4.x", "Framebuffer used, MiB."),
    ExternalFamily("DCGM_FI_DEV_FB_FREE", "gauge", "dcgm-exporter", "3.x/4.x", "Framebuffer free, MiB."),
)

# External families the Prometheus loader (diag/sources/prometheus.py) falls back to where ours are
# absent, as named constants so the loader never spells a name. ``_external`` returns the entry
# above when the name is already declared, else declares it (appended to EXTERNAL below).
_EXTERNAL_ADDED: list[ExternalFamily] = []


def _external(name: str, type_: str, exporter: str, versions: str, help_: str) -> ExternalFamily:
    for fam in (*EXTERNAL, *_EXTERNAL_ADDED):
        if fam.name == name:
            return fam
    fam = ExternalFamily(name, type_, exporter, versions, help_)
    _EXTERNAL_ADDED.append(fam)
    return fam


def _node_meminfo_name(key: str) -> str:
    """node_exporter's gauge for a /proc/meminfo key: ``(x)`` becomes ``_x`` (``Active(anon)`` -> ``Active_anon``)."""
    return "node_memory_" + key.replace("(", "_").replace(")", "") + "_bytes"


NODE_MEMORY: dict[str, ExternalFamily] = {
    snake: _external(_node_meminfo_name(key), "gauge", "node_exporter", "1.x", f"/proc/meminfo {key}, bytes.")
    for key, snake in MEMINFO_FIELDS.items()
}
NODE_PSI_WAITING: dict[str, ExternalFamily] = {
    r: _external(f"node_pressure_{r}_waiting_seconds_total", "counter", "node_exporter", "1.x", f"Host {r} PSI some total.")
    for r in PSI_RESOURCES
}
NODE_PSI_STALLED: dict[str, ExternalFamily] = {
    r: _external(f"node_pressure_{r}_stalled_seconds_total", "counter", "node_exporter", "1.x", f"Host {r} PSI full total.")
    for r in PSI_HOST_STALLED_RESOURCES
}
NODE_VMSTAT: dict[str, ExternalFamily] = {
    f: _external(f"node_vmstat_{f}", "untyped", "node_exporter", "1.x",
                 f"/proc/vmstat {f} (no _total; only oom_kill|pgpg*|pswp*|pg*fault by default).")
    for f in VMSTAT_FIELDS
}  # fmt: skip
# cAdvisor, label ``id`` = the cgroup path. container_spec_memory_limit_bytes is 0 when unlimited;
# container_memory_max_usage_bytes is 0 when v2 memory.peak is missing, so it is not read.
CADVISOR_MEMORY: dict[str, ExternalFamily] = {
    "usage": _external("container_memory_usage_bytes", "gauge", "cAdvisor", "0.4x", "cgroup memory usage."),
    "working_set": _external("container_memory_working_set_bytes", "gauge", "cAdvisor", "0.4x", "Usage - inactive_file."),
    "swap": _external("container_memory_swap", "gauge", "cAdvisor", "0.4x", "Swap used (bytes, no unit suffix)."),
    "limit": _external("container_spec_memory_limit_bytes", "gauge", "cAdvisor", "0.4x", "Memory limit; 0 = unlimited."),
}
CADVISOR_PSI_WAITING = _external(
    "container_pressure_memory_waiting_seconds_total", "counter", "cAdvisor", "0.50+", "cgroup2 PSI some."
)
CADVISOR_PSI_STALLED = _external(
    "container_pressure_memory_stalled_seconds_total", "counter", "cAdvisor", "0.50+", "cgroup2 PSI full."
)
VLLM_RUNNING = _external("vllm:num_requests_running", "gauge", "vLLM", "v1 engine (0.9+)", "Requests in the running batch.")
VLLM_WAITING = _external("vllm:num_requests_waiting", "gauge", "vLLM", "v1 engine (0.9+)", "Requests waiting.")
VLLM_QUEUE_TIME = _external("vllm:request_queue_time_seconds", "histogram", "vLLM", "v1 engine", "Time in WAITING.")
VLLM_INFERENCE_TIME = _external("vllm:request_inference_time_seconds", "histogram", "vLLM", "v1 engine", "Time in RUNNING.")
VLLM_E2E = _external("vllm:e2e_request_latency_seconds", "histogram", "vLLM", "v1 engine", "End-to-end latency.")
VLLM_SUCCESS = _external(
    "vllm:request_success_total", "counter", "vLLM", "v1 engine", "Finished requests by finished_reason (stop, length, abort)."
)
DCGM_FB_USED = _external("DCGM_FI_DEV_FB_USED", "gauge", "dcgm-exporter", "3.x/4.x", "Framebuffer used, MiB.")
DCGM_FB_FREE = _external("DCGM_FI_DEV_FB_FREE", "gauge", "dcgm-exporter", "3.x/4.x", "Framebuffer free, MiB.")
PROMETHEUS_UP = _external("up", "gauge", "Prometheus", "any", "Per scrape target: 1 when its last scrape succeeded.")
PROMETHEUS_SCRAPED = _external("scrape_samples_scraped", "gauge", "Prometheus", "any",
                               "Per scrape target: the samples its last scrape exposed (one per series).")  # fmt: skip
EXTERNAL = (*EXTERNAL, *_EXTERNAL_ADDED)


def external(name: str) -> ExternalFamily:
    """Look an external family up by name; an undeclared name raises KeyError (like ``metric``)."""
    for fam in EXTERNAL:
        if fam.name == name:
            return fam
    raise KeyError(name)


_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
_UNIT_SUFFIX = {"bytes": "_bytes", "seconds": "_seconds", "ratio": "_ratio"}
_FORBIDDEN_LABELS = {"request_id", "prompt", "completion", "trace_id", "user"}


def validate_catalog(catalog: dict[str, MetricSpec] | None = None) -> list[str]:
    """Return every naming-rule violation (empty when the catalog is clean)."""
    problems: list[str] = []
    for name, spec in (catalog or CATALOG).items():
        if not name.startswith(PREFIX) or not _NAME_RE.match(name):
            problems.append(f"{name}: must be snake case with prefix {PREFIX}")
        if spec.type == "counter" and not name.endswith("_total"):
            problems.append(f"{name}: counters end in _total")
        if spec.type != "counter" and name.endswith("_total"):
            problems.append(f"{name}: only counters end in _total")
        suffix = _UNIT_SUFFIX.get(spec.unit)
        if suffix and suffix not in name:
            problems.append(f"{name}: unit {spec.unit} must appear in the name as {suffix}")
        if spec.type == "histogram" and not spec.buckets:
            problems.append(f"{name}: histograms declare their buckets")
        bad = _FORBIDDEN_LABELS.intersection(spec.labels)
        if bad:
            problems.append(f"{name}: unbounded labels {sorted(bad)}")
        if not spec.help.strip():
            problems.append(f"{name}: help text is required")
    return problems


# Request-phase histograms the Prometheus loader reads for the queue-vs-thrash test where no per-request rows exist.
VLLM_PREFILL_TIME = _external("vllm:request_prefill_time_seconds", "histogram", "vLLM", "v1 engine", "Prefill phase time.")
VLLM_DECODE_TIME = _external("vllm:request_decode_time_seconds", "histogram", "vLLM", "v1 engine", "Decode phase time.")
TGI_QUEUE_TIME = _external("tgi_request_queue_duration", "histogram", "TGI", "2.x/3.x", "Queue time (seconds, no unit suffix).")
TGI_INFERENCE_TIME = _external(
    "tgi_request_inference_duration", "histogram", "TGI", "2.x/3.x", "Inference time (seconds, no unit suffix)."
)
TGI_QUEUE_SIZE = _external("tgi_queue_size", "gauge", "TGI", "2.x/3.x", "Requests waiting.")

# --------------------------------------------------------------------------- upstream names the dashboards query
# Each panel with an upstream equivalent queries ``ours or theirs``; these are the names it may use, with the
# exporter version (and source commit) they were read from. Dashboard generation refuses any other name.
# vLLM: vllm-project/vllm @0b9faa41 (v0.11+, v1 engine); TGI: huggingface/text-generation-inference @db931fc
# (2.x/3.x; metrics-rs counters carry no _total); node_exporter: prometheus/node_exporter @a7dcc3a (1.x);
# cAdvisor 0.4x (label ``id`` = cgroup path); DCGM: NVIDIA/dcgm-exporter @d5e5f51 (3.x/4.x, framebuffer in MiB).
DASHBOARD_UPSTREAM: tuple[ExternalFamily, ...] = tuple(
    _external(name, type_, exporter, versions, help_)
    for name, type_, exporter, versions, help_ in (
        ("vllm:time_to_first_token_seconds", "histogram", "vLLM", "0.11 @0b9faa41", "Time to first token."),
        ("vllm:e2e_request_latency_seconds", "histogram", "vLLM", "0.11 @0b9faa41", "End-to-end latency."),
        ("vllm:request_queue_time_seconds", "histogram", "vLLM", "0.11 @0b9faa41", "Time in WAITING."),
        ("vllm:request_inference_time_seconds", "histogram", "vLLM", "0.11 @0b9faa41", "Time in RUNNING."),
        ("vllm:num_requests_running", "gauge", "vLLM", "0.11 @0b9faa41", "Requests in the running batch."),
        ("vllm:num_requests_waiting", "gauge", "vLLM", "0.11 @0b9faa41", "Requests waiting to be scheduled."),
        ("vllm:request_success_total", "counter", "vLLM", "0.11 @0b9faa41", "Finished requests by finished_reason."),
        ("vllm:iteration_tokens_total", "histogram", "vLLM", "0.11 @0b9faa41", "Tokens per engine step (a histogram)."),
        ("vllm:kv_cache_usage_perc", "gauge", "vLLM", "0.11 @0b9faa41", "KV-cache usage, 0-1."),
        ("vllm:num_preemptions_total", "counter", "vLLM", "0.11 @0b9faa41", "Preempted sequences."),
        ("tgi_request_queue_duration", "histogram", "TGI", "2.x/3.x @db931fc", "Queue time, seconds."),
        ("tgi_request_duration", "histogram", "TGI", "2.x/3.x @db931fc", "End-to-end request time, seconds."),
        ("tgi_queue_size", "gauge", "TGI", "2.x/3.x @db931fc", "Requests waiting."),
        ("tgi_batch_current_size", "gauge", "TGI", "2.x/3.x @db931fc", "Requests in the current batch."),
        ("tgi_request_count", "counter", "TGI", "2.x/3.x @db931fc", "Requests received (no _total)."),
        ("tgi_request_failure", "counter", "TGI", "2.x/3.x @db931fc", "Failed requests by err (no _total)."),
        ("tgi_batch_next_size", "histogram", "TGI", "2.x/3.x @db931fc", "Requests in each new batch."),
        ("tgi_batch_next_tokens", "histogram", "TGI", "2.x/3.x @db931fc", "Tokens in each new batch."),
        ("node_memory_MemAvailable_bytes", "gauge", "node_exporter", "1.x @a7dcc3a", "MemAvailable."),
        ("node_memory_SwapTotal_bytes", "gauge", "node_exporter", "1.x @a7dcc3a", "SwapTotal."),
        ("node_memory_SwapFree_bytes", "gauge", "node_exporter", "1.x @a7dcc3a", "SwapFree."),
        ("node_pressure_memory_waiting_seconds_total", "counter", "node_exporter", "1.x @a7dcc3a", "Memory PSI some."),
        ("node_pressure_memory_stalled_seconds_total", "counter", "node_exporter", "1.x @a7dcc3a", "Memory PSI full."),
        ("node_pressure_io_waiting_seconds_total", "counter", "node_exporter", "1.x @a7dcc3a", "IO PSI some."),
        ("node_pressure_cpu_waiting_seconds_total", "counter", "node_exporter", "1.x @a7dcc3a", "CPU PSI some."),
        ("node_vmstat_pgmajfault", "untyped", "node_exporter", "1.x @a7dcc3a", "Major faults (a counter, no _total)."),
        ("node_vmstat_oom_kill", "untyped", "node_exporter", "1.x @a7dcc3a", "OOM kills (a counter, no _total)."),
        ("container_memory_usage_bytes", "gauge", "cAdvisor", "0.4x", "cgroup memory usage."),
        ("container_memory_working_set_bytes", "gauge", "cAdvisor", "0.4x", "Usage - inactive_file."),
        ("container_spec_memory_limit_bytes", "gauge", "cAdvisor", "0.4x", "Memory limit; 0 = unlimited."),
        ("container_oom_events_total", "counter", "cAdvisor", "0.4x", "OOM events of the container."),
        ("container_pressure_memory_waiting_seconds_total", "counter", "cAdvisor", "0.50+", "cgroup2 PSI some."),
        ("DCGM_FI_DEV_FB_USED", "gauge", "dcgm-exporter", "3.x/4.x @d5e5f51", "Framebuffer used, MiB."),
        ("DCGM_FI_DEV_FB_FREE", "gauge", "dcgm-exporter", "3.x/4.x @d5e5f51", "Framebuffer free, MiB."),
        ("DCGM_FI_DEV_FB_RESERVED", "gauge", "dcgm-exporter", "3.x/4.x @d5e5f51", "Framebuffer reserved, MiB."),
        ("DCGM_FI_DEV_GPU_UTIL", "gauge", "dcgm-exporter", "3.x/4.x @d5e5f51", "GPU utilisation, percent."),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "dcgm-exporter", "3.x/4.x @d5e5f51", "Memory utilisation, percent."),
    )
)
EXTERNAL = (*EXTERNAL, *(f for f in DASHBOARD_UPSTREAM if f.name not in {e.name for e in EXTERNAL}))


# --------------------------------------------------------------------------- SLO alerts: external buckets

# Bucket boundaries (seconds) of the vLLM v1 engine's latency histograms, so an SLO spec that targets
# them can be checked offline: a latency threshold must be one of these (an ``le`` that does not exist
# silently matches nothing). Read from vllm/v1/metrics/loggers.py; other versions may differ, which is
# why ``diag alerts --metrics-url`` checks against a live /metrics as well.
VLLM_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
EXTERNAL_HISTOGRAM_BUCKETS: dict[str, tuple[float, ...]] = {
    external("vllm:time_to_first_token_seconds").name: VLLM_TTFT_BUCKETS,
    **{fam.name: VLLM_REQUEST_LATENCY_BUCKETS for fam in (VLLM_QUEUE_TIME, VLLM_INFERENCE_TIME, VLLM_E2E)},
}

# --------------------------------------------------------------------------- live diagnosis

# ``diag collect --diagnose-every`` runs the rules engine on the agent's own recent records. One
# series per incident class the engine concluded (the class list is the engine's, a bounded set).
INCIDENT = _declare(MetricSpec(
    "llmdiag_incident", "gauge",
    "1 while the live diagnosis concludes this incident class (primary or contributing) on the recent window.",
    ("class",), "", "diag.live.diagnosis"))  # fmt: skip
INCIDENT_CONFIDENCE = _declare(MetricSpec(
    "llmdiag_incident_confidence", "gauge",
    "Confidence (0-1) of the live diagnosis' strongest finding of this class on the recent window.",
    ("class",), "", "diag.live.diagnosis"))  # fmt: skip
# The words behind a concluded class, for alert annotations. Bounded: at most one series per class,
# and its text is frozen when the class is first concluded (an incident is one series, not one per
# evaluation); the text is cut to INCIDENT_TEXT_MAX characters.
INCIDENT_TEXT_MAX = 200
INCIDENT_INFO = _declare(MetricSpec(
    "llmdiag_incident_info", "gauge",
    "Always 1 while the class is concluded; labels carry the finding's rule, one-line summary and top evidence.",
    ("class", "rule", "summary", "evidence"), "", "diag.live.diagnosis"))  # fmt: skip
