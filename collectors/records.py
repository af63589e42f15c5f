"""Typed, versioned records: the one shape every source writes and every loader reads.

Why one module: the flight recorder, bundles (``timeline/*.jsonl``) and third-party writers (a vLLM
plugin, a sidecar) must agree on the same JSON objects without importing each other. Each record is a
plain dataclass with a ``KIND`` (its name on the wire) and a ``SCHEMA`` version. ``to_dict`` adds
``kind`` and ``schema`` to the object; ``record_from_dict`` picks the class by ``kind`` and ignores
keys it does not know, so an older reader survives a newer writer that only *adds* fields.

Units are base units throughout: seconds (``ts`` is Unix time as a float), bytes, token counts.
A value that could not be read is ``None`` and its name is listed in ``missing`` with the reason --
a sampler never invents a zero.

What each field becomes in the Timeline is declared here too, on the field (``number("usage")``,
``family("stat")``, ``fact()`` ...) and on the class (``TIMELINE``): see ``collectors.fields``. The
readers derive their decoding and their columns from that, so a field is added in one place.
"""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from collectors.catalog import MEMINFO_FIELDS, PSI_RESOURCES, VMSTAT_FIELDS
from collectors.fields import (
    REQUIRED,
    Destination,
    Kept,
    Rows,
    SeriesGroup,
    Tracks,
    availability,
    each,
    fact,
    fact_set,
    family,
    flag,
    nested,
    nested_by_key,
    number,
    rows_of,
    text,
)

RequestOutcome = Literal["ok", "error", "queue_timeout", "inference_timeout", "rejected"]
REQUEST_OUTCOMES: tuple[str, ...] = get_args(RequestOutcome)


@dataclass
class Record:
    """Base of every record: a time stamp plus the wire identity (``KIND``, ``SCHEMA``)."""

    KIND: ClassVar[str] = ""
    SCHEMA: ClassVar[int] = 1
    TIMELINE: ClassVar[Destination | None] = None  # where the Timeline keeps it (None: not read into a Timeline)

    ts: float

    def to_dict(self) -> dict[str, Any]:
        body = _plain(self)
        return {"kind": self.KIND, "schema": self.SCHEMA, **body}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False, default=_json_default)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    """Dataclasses, lists and dicts to plain JSON values -- ``dataclasses.asdict`` without its deep copies,
    which cost ~5x more and sit on the hot path of every record the agent and the tracker write."""
    cls = type(value)
    if cls in (str, int, float, bool) or value is None:
        return value
    names = _FIELD_NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(cls):
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if cls is list or cls is tuple:
        return [_plain(v) for v in value]
    if cls is dict:
        return {k: _plain(v) for k, v in value.items()}
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


# --------------------------------------------------------------------------- host and cgroup


@dataclass
class PsiLine:
    """One ``some``/``full`` line of a PSI file. avgs are percent (0-100); total is microseconds."""

    avg10: float = number(default=REQUIRED)
    avg60: float = number(default=REQUIRED)
    avg300: float = number(default=REQUIRED)
    total_us: int = number("total_s", default=REQUIRED, divide_by=1e6)  # cumulative stall seconds in the Timeline


@dataclass
class Psi:
    """A PSI file (host ``/proc/pressure/*`` or cgroup2 ``*.pressure``). ``full`` is absent for host cpu before 5.13."""

    some: PsiLine | None = nested("some")
    full: PsiLine | None = nested("full")


@dataclass
class HostSnapshot(Record):
    """Host-wide memory and pressure at one instant.

    ``memory`` is /proc/meminfo in bytes keyed by snake-case names (``total``, ``available``,
    ``inactive_file`` ...); ``memory_available_estimated`` says MemAvailable was absent and
    ``available`` is the kernel's own fallback estimate. ``vmstat`` holds cumulative counters.
    """

    KIND: ClassVar[str] = "host"
    TIMELINE: ClassVar[Destination] = SeriesGroup("host")
    psi: dict[str, Psi] = nested_by_key("psi", keys=PSI_RESOURCES)  # cpu, memory, io (irq where present)
    memory: dict[str, int] = family("memory", keys=MEMINFO_FIELDS.values())
    memory_available_estimated: bool = False
    vmstat: dict[str, int] = family("vmstat", keys=VMSTAT_FIELDS)
    missing: dict[str, str] = field(default_factory=dict)  # field -> reason


@dataclass
class CgroupSnapshot(Record):
    """Memory state of one watched cgroup, v1, v2, or hybrid (v1 memory + v2 pressure).

    ``limit_bytes`` None means unlimited (v2 ``max``, v1 the page-counter maximum). ``events`` maps
    v2 memory.events keys (low/high/max/oom/oom_kill/oom_group_kill ...) to counts; on v1, ``failcnt``
    is reported as ``max`` and memory.oom_control ``oom_kill`` as ``oom_kill`` so both versions read
    the same downstream. ``working_set_bytes`` = usage - inactive_file, clamped at 0 (cAdvisor).
    """

    KIND: ClassVar[str] = "cgroup"
    TIMELINE: ClassVar[Destination] = SeriesGroup("cgroups", key="path")
    path: str = ""  # the cgroup path as /proc/<pid>/cgroup prints it, e.g. /process_api/abc/svc
    version: Literal["v1", "v2", "hybrid", "none"] = "none"
    usage_bytes: int | None = number("usage")
    working_set_bytes: int | None = number("working_set")
    peak_bytes: int | None = number("peak")
    limit_bytes: int | None = number("limit")
    high_bytes: int | None = number("high")
    low_bytes: int | None = number("low")
    min_bytes: int | None = number("min")
    swap_bytes: int | None = number("swap")
    events: dict[str, int] = family("events")
    events_local: dict[str, int] = family("events_local")
    stat: dict[str, int] = family("stat")
    under_oom: bool | None = flag()
    pressure: Psi | None = nested("psi.memory")  # memory pressure of the group (v2 or the hybrid's v2 twin)
    missing: dict[str, str] = field(default_factory=dict)


@dataclass
class ProcessSample(Record):
    """One process: memory, faults, cgroup, redacted command line and the model files it holds."""

    KIND: ClassVar[str] = "process"
    TIMELINE: ClassVar[Destination] = Tracks(pid="pid", start="start_time_s")
    pid: int = 0
    ppid: int | None = fact("present")
    comm: str = fact(default="")
    cmdline: str = fact(default="")  # secret argument values replaced by "<redacted>"
    start_time_s: float | None = None  # seconds since boot; (pid, start_time_s) identifies a process
    rss_bytes: int | None = number("rss")
    pss_bytes: int | None = number("pss")
    uss_bytes: int | None = number("uss")
    swap_bytes: int | None = number("swap")
    locked_bytes: int | None = number("locked")  # mlock'd (smaps_rollup Locked): memory reclaim cannot take back
    major_faults: int | None = number()
    minor_faults: int | None = number()
    num_threads: int | None = None
    memory_cgroup: str | None = fact()
    model_files: list[str] = fact_set()  # absolute paths, mapped or open
    missing: dict[str, str] = field(default_factory=dict)


@dataclass
class GpuDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int | None = number("total")
    used_bytes: int | None = number("used")
    free_bytes: int | None = number("free")
    reserved_bytes: int | None = number("reserved")
    utilization_gpu_ratio: float | None = number("util_gpu")
    utilization_memory_ratio: float | None = number("util_memory")


@dataclass
class GpuProcess:
    gpu_index: int = number("gpu", default=REQUIRED)
    pid: int = number(default=REQUIRED)  # a host PID: NVML is not pid-namespace aware
    used_bytes: int | None = number()


@dataclass
class GpuSnapshot(Record):
    """NVML view. ``available`` False carries ``reason`` (e.g. "NVML Shared Library Not Found")."""

    KIND: ClassVar[str] = "gpu"
    TIMELINE: ClassVar[Destination] = SeriesGroup("gpus")
    available: bool = availability(reason="reason")
    reason: str | None = None
    driver_version: str | None = None
    devices: list[GpuDevice] = each(key="index")
    processes: list[GpuProcess] = rows_of("gpu_processes", "per-process GPU memory (NVML)")


@dataclass
class OomEvent(Record):
    """A kernel OOM kill, from the ``oom-kill:`` and ``Killed process`` lines of /dev/kmsg.

    ``constraint`` is the kernel's (CONSTRAINT_MEMCG for a cgroup limit, CONSTRAINT_NONE for the
    whole host, ...); ``ts`` is wall time computed from the record's monotonic stamp.
    """

    KIND: ClassVar[str] = "oom"
    TIMELINE: ClassVar[Destination] = Kept(
        "ooms", "ooms", "kernel OOM kill records (the agent reading /dev/kmsg, or a per-cgroup oom_kill counter)"
    )
    constraint: str | None = None
    oom_memcg: str | None = None
    task_memcg: str | None = None
    task: str | None = None
    pid: int | None = None
    uid: int | None = None
    total_vm_bytes: int | None = None
    anon_rss_bytes: int | None = None
    file_rss_bytes: int | None = None
    shmem_rss_bytes: int | None = None
    # The OOM'd group's unevictable (mlock'd) memory, from the stats the kernel prints with the kill: the pages
    # reclaim could not free, so the reason a group with file pages still ran out.
    unevictable_bytes: int | None = None
    source: str = "kmsg"


# --------------------------------------------------------------------------- in-process tracker


@dataclass
class RequestTiming(Record):
    """One request: arrival -> start of inference -> finish, in Unix seconds.

    ``start`` is None when the request never got an inference slot (rejected, queue timeout).
    Prompts and completions are never recorded: only their token counts.
    """

    KIND: ClassVar[str] = "request"
    TIMELINE: ClassVar[Destination] = Rows(
        "requests", "per-request rows (the request tracker, or an instrumented server's request records)"
    )
    arrival: float = number(default=0.0)
    start: float | None = number()
    finish: float = number(default=0.0)
    outcome: RequestOutcome = text(default="ok")
    route: str = text()
    model: str = text()
    prompt_tokens: int | None = number()
    output_tokens: int | None = number()
    ttft_s: float | None = number()
    pid: int | None = number()
    trace_id: str | None = None

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.start is None else max(0.0, self.start - self.arrival)

    @property
    def inference_s(self) -> float | None:
        return None if self.start is None else max(0.0, self.finish - self.start)


@dataclass
class BatchStats(Record):
    """One batch formed by the server's batcher: request count vs token count decides the peak."""

    KIND: ClassVar[str] = "batch"
    TIMELINE: ClassVar[Destination] = Rows("batches", "per-batch records from the serving loop (the tracker's batch hook)")
    model: str = ""
    requests: int = number(default=0)
    input_tokens: int = number(default=0)
    max_request_tokens: int = number(default=0)
    active_decode_sequences: int = number(default=0)
    concurrent_batches: int = number(default=1)
    phase: str = "mixed"  # prefill | decode | mixed
    pid: int | None = number()


@dataclass
class RoutingStats(Record):
    """MoE routing of one layer over one step. Full per-expert counts stay here, never in Prometheus."""

    KIND: ClassVar[str] = "routing"
    TIMELINE: ClassVar[Destination] = Rows("routing", "MoE routing records (expert token counts per step)")
    model: str = ""
    layer: int = number(default=0)
    expert_tokens: list[int] = field(default_factory=list)
    top_expert_tokens: int = number(default=0)
    median_expert_tokens: float = number(default=0.0)
    skew: float | None = number()  # top / median; None when the median is 0
    balancedness: float | None = number()  # mean / max (vLLM/SGLang definition)
    overflow_tokens: int = number(default=0)
    pid: int | None = number()


@dataclass
class LoaderEvent(Record):
    """A model load or registry refresh: how long, how many bytes, cache hit, and on the request path or not."""

    KIND: ClassVar[str] = "loader"
    TIMELINE: ClassVar[Destination] = Rows("loader", "model-loader records (bytes loaded, duration, whether on the request path)")
    name: str = ""
    start: float = number(default=0.0)
    duration_s: float = number(default=0.0)
    bytes_read: int | None = number()
    cache_hit: bool | None = number()  # a table column: 1.0 / 0.0
    in_request_path: bool = number(default=False)
    pid: int | None = number()


@dataclass
class TorchMemorySnapshot(Record):
    """``torch.cuda.memory_stats`` summary of one device, from inside the serving process."""

    KIND: ClassVar[str] = "torch_memory"
    TIMELINE: ClassVar[Destination] = Rows("torch", "torch CUDA allocator snapshots")
    device: int = number(default=0)
    allocated_bytes: int | None = number()
    reserved_bytes: int | None = number()
    peak_allocated_bytes: int | None = number()
    peak_reserved_bytes: int | None = number()
    num_ooms: int | None = number()
    num_alloc_retries: int | None = number()
    pid: int | None = number()


@dataclass
class CudaOomError(Record):
    """A parsed ``torch.OutOfMemoryError`` message. Sizes in bytes; None where the message lacked the field."""

    KIND: ClassVar[str] = "cuda_oom"
    TIMELINE: ClassVar[Destination] = Kept("cuda_ooms", "cuda_ooms", "CUDA out-of-memory errors reported by the service")
    device: int | None = None
    tried_to_allocate_bytes: int | None = None
    total_capacity_bytes: int | None = None
    free_bytes: int | None = None
    process_in_use_bytes: int | None = None
    allocated_by_pytorch_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    other_processes: list[dict[str, int]] = field(default_factory=list)  # [{"pid":..., "bytes":...}]
    pid: int | None = None


@dataclass
class ServiceConfig(Record):
    """How a serving process is configured, written once at start-up (and on change).

    Why a record: the ``unsafe_config`` rule judges workers x concurrency x per-request memory against
    the limit, queue size 0, preload per worker, unbounded prompts -- facts no sampler can see.
    ``settings`` keys are free-form but these are understood: workers, max_concurrency, queue_size,
    queue_timeout_s, request_timeout_s, preload (per-worker|shared), refresh (none|every-request|ttl),
    max_prompt_tokens, memory_guard, batching (requests|tokens), max_batch_tokens, weights_bytes,
    model_path, experts. The agent writes one for an engine it sees from outside (``collectors.engine_config``:
    ``engine``, n_ctx, use_mmap, use_mlock, type_k/type_v, and the model's n_layer, n_embd_k_gqa, n_embd_v_gqa ...).
    """

    KIND: ClassVar[str] = "config"
    TIMELINE: ClassVar[Destination] = Kept("configs", "config", "the service's configuration record")
    service: str = ""
    pid: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class WatchScope(Record):
    """What the operator asked the agent to watch, and what that resolved to -- written by ``diag collect`` at
    start-up and again whenever the resolution changes (a pid appears or exits, a group is created or removed).

    Why a record: the operator's ``--pid``/``--cgroup`` is the best definition of "the service" there is. The rules
    take the service from this first (then from service records, then from model-file holders), so a neighbour
    that happens to map a model file is never promoted to the service. ``missing`` says, per asked-for target
    that could not be found, why (``"pid 4242: no such process"``, ``"cgroup /nope: not found under memory (v1),
    unified (v2)"``); an agent keeps resolving them every sample, since a service may start later.
    """

    KIND: ClassVar[str] = "watch_scope"
    # A configuration, not an observation: it does not stretch the Timeline's window, and no rule asks for it by name.
    TIMELINE: ClassVar[Destination] = Kept("watch_scopes", "", observation=False)
    pids: list[int] = field(default_factory=list)  # --pid as given
    cgroups: list[str] = field(default_factory=list)  # --cgroup as given
    resolved_pids: list[int] = field(default_factory=list)  # the asked-for pids that exist now
    resolved_cgroups: list[str] = field(default_factory=list)  # memory-cgroup paths now watched for those targets
    missing: list[str] = field(default_factory=list)  # one line per asked-for target not found, with where it was sought


# --------------------------------------------------------------------------- inference backends' own metrics


@dataclass
class BackendSample(Record):
    """One scrape of an inference backend's own ``/metrics`` (``diag collect --scrape``): vLLM, TGI, llama.cpp, ours.

    Only the families ``collectors.backends`` maps to a signal are kept, with only the labels a signal selects on
    (every other label summed away), under ``collectors.backends.series_key`` names. ``gauges`` hold values,
    ``counters`` cumulative values, ``deltas`` what each histogram gained since the previous successful scrape
    of the target -- per bucket (not cumulative: ``le`` names the bucket's upper bound), ``_sum`` and
    ``_count``; a zero is left out unless the bucket above it gained (a quantile interpolates from a bucket's
    lower bound), and a series seen for the first time has none (no baseline yet).
    ``up`` is False when the scrape failed (``error`` says why: timeout, connect, http_<status>, too_large,
    parse, no_families); ``dropped_series`` counts series beyond the per-family cap. The loaders turn these
    into the ``service:`` signals exactly as the Prometheus loader turns the same families
    (``diag.timeline.backends``).
    """

    KIND: ClassVar[str] = "backend"
    TIMELINE: ClassVar[Destination] = SeriesGroup("backends", key="target")
    target: str = ""  # the URL scraped, without credentials or query string
    dialect: str = ""  # vllm | tgi | llamacpp | llmdiag | unknown: whose families most of the kept ones are
    duration_s: float | None = number("scrape_duration_s")
    dropped_series: int | None = number()
    gauges: dict[str, float] = family("gauge")
    counters: dict[str, float] = family("counter")
    deltas: dict[str, float] = family("delta")
    up: bool | None = flag()
    error: str | None = None


# --------------------------------------------------------------------------- alerts (triage input)


@dataclass
class Alert(Record):
    """One alert from an Alertmanager webhook (v4), as triage stores it."""

    KIND: ClassVar[str] = "alert"
    status: str = "firing"
    alertname: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    starts_at: float | None = None
    ends_at: float | None = None
    fingerprint: str = ""


# --------------------------------------------------------------------------- decoding

RECORD_TYPES: dict[str, type[Record]] = {
    cls.KIND: cls
    for cls in (
        HostSnapshot,
        CgroupSnapshot,
        ProcessSample,
        GpuSnapshot,
        OomEvent,
        RequestTiming,
        BatchStats,
        RoutingStats,
        LoaderEvent,
        TorchMemorySnapshot,
        CudaOomError,
        ServiceConfig,
        WatchScope,
        BackendSample,
        Alert,
    )
}


class RecordDecodeError(ValueError):
    """A JSON object that is not a record we can read (unknown kind, newer major schema, bad types)."""


def record_from_dict(obj: dict[str, Any]) -> Record:
    """Build the record named by ``obj["kind"]``; unknown keys are ignored (forward compatibility)."""
    kind = obj.get("kind")
    cls = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordDecodeError(f"unknown record kind {kind!r}")
    schema = obj.get("schema", 1)
    if not isinstance(schema, int) or schema > cls.SCHEMA:
        raise RecordDecodeError(f"{kind} schema {schema!r} is newer than this reader ({cls.SCHEMA})")
    try:
        return _build(cls, obj)
    except (TypeError, ValueError, KeyError) as exc:
        raise RecordDecodeError(f"bad {kind} record: {exc}") from exc


def record_from_json(text: str) -> Record:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordDecodeError(f"not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise RecordDecodeError("a record is a JSON object")
    return record_from_dict(obj)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, obj: dict[str, Any]) -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            kwargs[f.name] = _convert(hints[f.name], obj[f.name])
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    """Rebuild nested dataclasses from plain JSON values, following the type hints."""
    if value is None:
        return None
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            if arg is type(None):
                continue
            return _convert(arg, value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__} expects an object")
        return _build(tp, value)
    if origin is list:
        (item,) = get_args(tp) or (Any,)
        return [_convert(item, v) for v in value]
    if origin is dict:
        _, item = get_args(tp) or (str, Any)
        return {k: _convert(item, v) for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    return value
