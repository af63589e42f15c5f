"""Cause alerts: what is wrong underneath, each labelled with the rules engine's incident class.

SLO burn alerts say users are hurt; these say why, in the same words ``diag analyze`` uses
(``diag_class``), so a person (or the triage webhook) can go from the alert to the matching rule's
evidence. Every metric name comes from the catalog. Severity is chosen per alert, with the reason
kept next to it (``severity_reason``, also in the generated file as an annotation):

- page: the kernel killed something (OOM kills, CUDA OOM) or the host is thrashing -- requests are
  being lost or stalled right now and no SLO window is short enough to catch it first;
- ticket: a cause that degrades service slowly or that the SLO pages already cover by its symptom
  (queue wait, refusals, memory stalls, duplicate copies, GPU memory), and the monitoring's own health.

Meta alerts about llm-diag itself (agent down, recorder failing) carry no ``diag_class``: they are
not incidents of the service.

Each cause carries a small example (input series and when it must fire), from which the promtool
unit tests are generated; the thresholds are constants here, documented by the ``why`` text. Each also
names the dashboard panel that shows its signal (``panel``): the generator turns it into the alert's
``dashboard_url`` from the dashboards' own uid and panel id, with the variables the alert's labels fill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alerts.links import PanelRef
from collectors import backends as bk
from collectors import catalog as cat
from dashboards.definitions import UIDS
from dashboards.engine import KV_SATURATION_PANEL
from diag.rules import levels

AGENT = 'job="llm-diag-agent", instance="host-a:9464"'
APP = 'job="llm-api", instance="host-a:8000"'


@dataclass(frozen=True)
class CauseExample:
    """Input series at a 1-minute interval, a time it must be quiet and a time it must fire with these labels."""

    series: tuple[tuple[str, str], ...]
    quiet_at: str
    fires_at: str
    labels: dict[str, str]  # the expression's output labels (the rule's own labels are added by the generator)
    annotations: dict[str, str] = field(default_factory=dict)  # expected values of templated annotations


@dataclass(frozen=True)
class Cause:
    alert: str
    diag_class: str | None
    severity: str
    severity_reason: str
    expr: str
    for_: str
    summary: str
    example: CauseExample
    panel: PanelRef  # the panel that shows the signal; its variables must be labels the alert carries
    extra_labels: dict[str, str] = field(default_factory=dict)


def _rate(name: str, window: str = "2m", sel: str = "") -> str:
    return f"rate({name}{sel}[{window}])"


def _num(value: float) -> str:
    return f"{value:g}"


STALLED = cat.CGROUP_PSI_STALLED.name
WAITING = cat.CGROUP_PSI_WAITING.name
MAJFAULT = cat.CGROUP_STAT_COUNTERS["pgmajfault"].name
REFAULT = cat.CGROUP_STAT_COUNTERS["workingset_refault_file"].name
QWAIT = cat.REQUEST_QUEUE_WAIT.name
INFER = cat.REQUEST_INFERENCE.name
CG = 'cgroup="/system.slice/llm.service"'
VLLM = 'job="llm-backend", instance="host-a:8000"'
KV_USAGE, PREEMPTIONS, WAITING_BY = bk.VLLM_KV_USAGE.name, bk.VLLM_PREEMPTIONS.name, bk.VLLM_WAITING_BY_REASON.name
ENGINE = ("job", "instance", "model_name")  # one vLLM engine: its target and the model it serves
# Preemptions matched per target: one engine per scraped target, and a scrape that kept only some labels of the
# counter (the agent's --scrape sums the ones no signal selects on) still matches its usage gauge.
TARGET = ("job", "instance")
HOST_VARS = ("job", "instance")  # the agent's alerts: one target
APP_VARS = ("job", "model")  # the service's alerts, summed over its instances
REFUSED = '{reason=~"queue_full|queue_timeout"}'  # refusals of the queue (memory refusals have their own alert)
WSET, LIMIT, EVENTS = cat.CGROUP_WORKING_SET.name, cat.CGROUP_LIMIT.name, cat.CGROUP_EVENTS.name
USS, RSS, HOLDS = cat.PROCESS_USS.name, cat.PROCESS_RSS.name, cat.MODEL_PROCESS_INFO.name
# Memory pressure as the rule counts it: its indicators, each 1 or 0 per cgroup (0 where a signal is missing, so the
# others still count), at least PRESSURE_INDICATORS of them.
PRESSURE_EXPR = (
    f"(\n  (({_rate(WAITING)} * 100 >= bool {_num(levels.PSI_SOME_UP)}) or (0 * {LIMIT}))\n"
    f"  + (({WSET} / {LIMIT} >= bool {_num(levels.NEAR_LIMIT)}) or (0 * {LIMIT}))\n"
    f'  + ((\n      (max without (event, scope) (increase({EVENTS}{{event=~"max|high"}}[2m])) > bool 0)\n'
    f"      * ({WSET} / {LIMIT} >= bool {_num(levels.LIMIT_EVENTS_NEAR)})\n    ) or (0 * {LIMIT}))\n"
    f") >= {levels.PRESSURE_INDICATORS}"
)

CAUSES: tuple[Cause, ...] = (
    Cause(
        "LLMDiagMemoryPressure",
        "memory_pressure",
        "ticket",
        "stalls show as latency first, which the latency SLOs page on; this names the cause",
        PRESSURE_EXPR,
        "2m",
        f"cgroup {{{{ $labels.cgroup }}}}: memory pressure -- at least {levels.PRESSURE_INDICATORS} of memory PSI some >= "
        f"{_num(levels.PSI_SOME_UP)} %, working set >= {levels.NEAR_LIMIT:.0%} of the limit, limit hits near it",
        CauseExample(
            (
                (f"{WAITING}{{{CG}, {AGENT}}}", "0x10 0+30x20"),
                (f"{WSET}{{{CG}, {AGENT}}}", "50x10 95x20"),
                (f"{LIMIT}{{{CG}, {AGENT}}}", "100x30"),
            ),
            "8m",
            "18m",
            {"cgroup": "/system.slice/llm.service", "job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["memory"], "cgroup memory PSI", HOST_VARS),
    ),
    Cause(
        "LLMDiagOOMKill",
        "host_oom",
        "page",
        "the kernel killed a process: requests in flight are lost now, before any SLO window fills",
        f"increase({cat.OOM_KILLS.name}[5m]) > 0",
        "0s",
        "the kernel OOM-killed a process ({{ $labels.constraint }}: "
        "CONSTRAINT_MEMCG = a cgroup limit, CONSTRAINT_NONE = the host)",
        CauseExample(
            ((f'{cat.OOM_KILLS.name}{{constraint="CONSTRAINT_MEMCG", {AGENT}}}', "0x10 1x10"),),
            "9m",
            "12m",
            {"constraint": "CONSTRAINT_MEMCG", "job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["memory"], "OOM kills", HOST_VARS),
    ),
    Cause(
        "LLMDiagCgroupOOMKill",
        "host_oom",
        "page",
        "the kernel killed a process in the service's cgroup: requests in flight are lost now",
        f'max without (scope) (increase({cat.CGROUP_EVENTS.name}{{event="oom_kill"}}[5m])) > 0',
        "0s",
        "cgroup {{ $labels.cgroup }} hit its memory limit and the kernel OOM-killed a process in it",
        CauseExample(
            ((f'{cat.CGROUP_EVENTS.name}{{event="oom_kill", scope="hierarchical", {CG}, {AGENT}}}', "0x10 1x10"),),
            "9m",
            "12m",
            {"cgroup": "/system.slice/llm.service", "event": "oom_kill", "job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["memory"], "memory.events rates", HOST_VARS),
    ),
    Cause(
        "LLMDiagThrashing",
        "thrashing",
        "page",
        "a thrashing host serves next to nothing and recovers only when someone frees memory",
        f"({_rate(STALLED)} * 100 >= {_num(levels.PSI_FULL_UP)})\nand\n"
        f"({_rate(MAJFAULT)} >= {_num(levels.FAULTS_UP)} or {_rate(REFAULT)} >= {_num(levels.REFAULTS_UP)})",
        "2m",
        f"cgroup {{{{ $labels.cgroup }}}} is thrashing: all its tasks stall on memory >= {_num(levels.PSI_FULL_UP)} % of the "
        f"time while re-reading evicted pages (major faults >= {_num(levels.FAULTS_UP)}/s or refaults >= "
        f"{_num(levels.REFAULTS_UP)}/s)",
        CauseExample(
            (
                (f"{STALLED}{{{CG}, {AGENT}}}", "0x10 0+40x20"),
                (f"{MAJFAULT}{{{CG}, {AGENT}}}", "0x10 0+9000x20"),
                (f"{REFAULT}{{{CG}, {AGENT}}}", "0x10 0+9000x20"),
            ),
            "8m",
            "18m",
            {"cgroup": "/system.slice/llm.service", "job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["memory"], "cgroup memory PSI", HOST_VARS),
    ),
    Cause(
        "LLMDiagQueueWaitDominates",
        "queue_backlog",
        "ticket",
        "users feel it as latency, which the queue-wait and TTFT SLOs page on; this names the cause",
        f"sum by (job, model) ({_rate(QWAIT + '_sum')})\n>= {_num(levels.OVERWHELM_FACTOR)} * "
        f"sum by (job, model) ({_rate(INFER + '_sum')})\n"
        f"and\nsum by (job, model) ({_rate(QWAIT + '_count')}) > 0.05",
        "1m",
        f"{{{{ $labels.model }}}}: requests wait >= {_num(levels.OVERWHELM_FACTOR)}x their inference time for a slot "
        "(queue backlog)",
        CauseExample(
            (
                (f'{QWAIT}_sum{{model="m1", route="/v1/completions", {APP}}}', "0x10 0+120x20"),
                (f'{QWAIT}_count{{model="m1", route="/v1/completions", {APP}}}', "0x10 0+30x20"),
                (f'{INFER}_sum{{model="m1", route="/v1/completions", {APP}}}', "0+30x30"),
            ),
            "8m",
            "14m",
            {"model": "m1", "job": "llm-api"},
        ),
        PanelRef(UIDS["latency"], "Mean phases (stacked)", APP_VARS),
    ),
    Cause(
        "LLMDiagKVCacheSaturated",
        "kv_cache_saturation",
        "ticket",
        "preemptions show as latency first, which the TTFT and latency SLOs page on; this names the cause",
        f"(max by ({', '.join(ENGINE)}) ({KV_USAGE}) >= {_num(levels.KV_CEILING)})\nand on ({', '.join(TARGET)})\n(\n"
        f"  sum by ({', '.join(TARGET)}) ({_rate(PREEMPTIONS)}) >= {_num(levels.PREEMPTIONS_UP)}\n  or\n"
        f'  max by ({", ".join(TARGET)}) ({WAITING_BY}{{reason="capacity"}}) > 0\n)',
        "2m",
        f"{{{{ $labels.model_name }}}} on {{{{ $labels.instance }}}}: the KV cache is >= {levels.KV_CEILING:.0%} full and "
        f"the engine preempts (>= {_num(levels.PREEMPTIONS_UP)}/s) or holds requests for KV capacity: lower max_num_seqs "
        "/ max_num_batched_tokens",
        CauseExample(
            (
                (f'{KV_USAGE}{{model_name="m1", engine="0", {VLLM}}}', "0.5x10 0.99x20"),
                (f'{PREEMPTIONS}{{model_name="m1", engine="0", {VLLM}}}', "0x10 0+30x20"),
            ),
            "8m",
            "18m",
            {"model_name": "m1", "job": "llm-backend", "instance": "host-a:8000"},
        ),
        PanelRef(UIDS["engine"], KV_SATURATION_PANEL, ("job", "instance")),
    ),
    Cause(
        "LLMDiagRequestsRefused",
        "queue_backlog",
        "ticket",
        "refusals are errors the availability SLO pages on; this says they come from a full or slow queue",
        f"sum by (job, model, reason) ({_rate(cat.ADMISSION_REJECTIONS.name, sel=REFUSED)}) > 0.05",
        "1m",
        "{{ $labels.model }}: requests refused before inference ({{ $labels.reason }}): the wait queue is full or too slow",
        CauseExample(
            (
                (
                    f'{cat.ADMISSION_REJECTIONS.name}{{model="m1", route="/v1/completions", reason="queue_full", {APP}}}',
                    "0x10 0+20x20",
                ),
            ),
            "8m",
            "14m",
            {"model": "m1", "reason": "queue_full", "job": "llm-api"},
        ),
        PanelRef(UIDS["latency"], "Outcomes and refusals", APP_VARS),
    ),
    Cause(
        "LLMDiagMemoryGuardRefusing",
        "memory_pressure",
        "ticket",
        "the guard refuses work to avoid an OOM kill: the availability SLO pages if users notice",
        f"min by (job, model) ({cat.MEMORY_GUARD_ACCEPTING.name}) == 0",
        "2m",
        "{{ $labels.model }}: the memory guard refuses new requests (memory near the limit or stalling)",
        CauseExample(
            ((f'{cat.MEMORY_GUARD_ACCEPTING.name}{{model="m1", {APP}}}', "1x10 0x20"),),
            "9m",
            "16m",
            {"model": "m1", "job": "llm-api"},
        ),
        PanelRef(UIDS["latency"], "Outcomes and refusals", APP_VARS),
    ),
    Cause(
        "LLMDiagDuplicateModelCopies",
        "duplicate_model_processes",
        "ticket",
        "extra copies waste memory and invite OOM kills later; nothing is lost yet",
        f"count by (job, instance, model) (\n  ({USS} >= {_num(levels.PRIVATE_DOMINANT)} * {RSS})\n"
        f"  * on (job, instance, pid) group_right\n  {HOLDS}\n) > 1",
        "10m",
        f"model file {{{{ $labels.model }}}} is held by several processes each keeping most of its memory private "
        f"(USS >= {levels.PRIVATE_DOMINANT:.0%} of RSS): private copies, not one shared mapping",
        CauseExample(
            tuple(
                (f"{name}{{{labels}, {AGENT}}}", values)
                for pid in ("101", "102")
                for name, labels, values in (
                    (USS, f'pid="{pid}", comm="python"', "10x10 900x30"),
                    (RSS, f'pid="{pid}", comm="python"', "1000x40"),
                    (HOLDS, f'model="/models/m1.safetensors", pid="{pid}", comm="python"', "1x40"),
                )
            ),
            "15m",
            "25m",
            {"model": "/models/m1.safetensors", "job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["overview"], "Model copies over time", HOST_VARS),
    ),
    Cause(
        "LLMDiagGPUMemoryNearFull",
        "gpu_oom",
        "ticket",
        "near full is a warning; the CUDA OOM alert pages when allocations actually fail",
        f"{cat.GPU_MEMORY['used'].name} / {cat.GPU_MEMORY['total'].name} > 0.95",
        "5m",
        "GPU {{ $labels.gpu }} memory is over 95 % used: the next large batch may hit CUDA OOM",
        CauseExample(
            (
                (f'{cat.GPU_MEMORY["used"].name}{{gpu="0", uuid="GPU-1", {AGENT}}}', "50x10 97x20"),
                (f'{cat.GPU_MEMORY["total"].name}{{gpu="0", uuid="GPU-1", {AGENT}}}', "100x30"),
            ),
            "12m",
            "18m",
            {"gpu": "0", "uuid": "GPU-1", "job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["gpu"], "Device memory used share", HOST_VARS),
    ),
    Cause(
        "LLMDiagCudaOOM",
        "gpu_oom",
        "page",
        "CUDA allocations are failing: the requests that hit them fail now",
        f"increase({cat.CUDA_OOM_ERRORS.name}[5m]) > 0",
        "0s",
        "{{ $labels.model }} on {{ $labels.device }}: CUDA out-of-memory errors in the serving process",
        CauseExample(
            ((f'{cat.CUDA_OOM_ERRORS.name}{{model="m1", device="cuda:0", {APP}}}', "0x10 2x10"),),
            "9m",
            "12m",
            {"model": "m1", "device": "cuda:0", "job": "llm-api", "instance": "host-a:8000"},
        ),
        PanelRef(UIDS["gpu"], "CUDA OOM errors", (*HOST_VARS, "model")),
    ),
    Cause(
        "LLMDiagAgentDown",
        None,
        "ticket",
        "the service may be fine; the diagnosis is blind until the agent is back",
        f"(max by (job, instance) ({cat.PROMETHEUS_UP.name}) == 0)\n"
        f"and on (job, instance)\n(max by (job, instance) (present_over_time({cat.AGENT_CPU.name}[1h])))",
        "2m",
        "the llm-diag agent at {{ $labels.instance }} does not answer scrapes: no flight recorder, no live diagnosis",
        CauseExample(
            ((f"{cat.PROMETHEUS_UP.name}{{{AGENT}}}", "1x10 0x20"), (f"{cat.AGENT_CPU.name}{{{AGENT}}}", "0+1x10")),
            "9m",
            "16m",
            {"job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["overview"], "Targets up", HOST_VARS),
        {"component": "llm-diag"},
    ),
    Cause(
        "LLMDiagRecorderFailing",
        None,
        "ticket",
        "the service may be fine; the flight recorder loses history an incident bundle would need",
        f"increase({cat.RECORDER_WRITE_ERRORS.name}[10m]) > 0",
        "5m",
        "the llm-diag agent at {{ $labels.instance }} cannot write its flight recorder (disk full or read-only?)",
        CauseExample(
            ((f"{cat.RECORDER_WRITE_ERRORS.name}{{{AGENT}}}", "0x10 0+1x20"),),
            "9m",
            "18m",
            {"job": "llm-diag-agent", "instance": "host-a:9464"},
        ),
        PanelRef(UIDS["overview"], "Agent errors", HOST_VARS),
        {"component": "llm-diag"},
    ),
)

INCIDENT_ALERT = "LLMDiagIncident"
_INFO = cat.INCIDENT_INFO.name
# Summary and evidence come from the info series of the same class and target, through the query
# template function: they stay out of the alert's labels (which would make every new wording a new alert).


def info_query(label: str, metric: str = _INFO) -> str:
    """Template reading one label (or ``Value``) of ``metric`` for the alert's class, instance and job."""
    field = "Value" if label == "Value" else f"Labels.{label}"
    return ('{{ with printf "' + metric + '{class=%q,instance=%q,job=%q}" $labels.class $labels.instance $labels.job '
            "| query }}{{ with first . }}{{ ." + field + " }}{{ end }}{{ end }}")  # fmt: skip


INCIDENT = Cause(
    INCIDENT_ALERT,
    "{{ $labels.class }}",
    "ticket",
    "a conclusion of the live diagnosis: it explains alerts that page on their own, so it routes as a ticket",
    f"max by (job, instance, class) ({cat.INCIDENT.name}) == 1",
    "0s",
    info_query("summary"),
    CauseExample(
        (
            (f'{cat.INCIDENT.name}{{class="host_oom", {AGENT}}}', "0x5 1x10"),
            (
                f'{_INFO}{{class="host_oom", rule="oom_kill", summary="python (pid 42) was OOM-killed in /llm", '
                f'evidence="OOM kills: 1", {AGENT}}}',
                "_x5 1x10",
            ),
            (f'{cat.INCIDENT_CONFIDENCE.name}{{class="host_oom", {AGENT}}}', "0x5 0.9x10"),
        ),
        "4m",
        "8m",
        {"class": "host_oom", "job": "llm-diag-agent", "instance": "host-a:9464"},
        {"summary": "python (pid 42) was OOM-killed in /llm", "evidence": "OOM kills: 1", "confidence": "0.9"},
    ),
    PanelRef(UIDS["overview"], "Live diagnosis", HOST_VARS),
)
