"""An inference engine's own cause alerts, generated from an SLO spec that names the engine (``engine: vllm``).

Why from the spec and not among the fixed cause alerts: a host that runs vLLM without our tracker inside exports
vLLM's families, not ours, so the tracker's queue and refusal alerts can never fire there, and the causes that
matter -- a KV cache at its ceiling that preempts, a queue that dominates the request's time -- are visible only
in vLLM's own families. A spec written for vLLM (``alerts/slo-vllm.yaml``) therefore gets these in place of the
tracker's; the levels are the rules engine's (``diag.rules.levels``), so the alert and the diagnosis agree, and
every name is the family ``collectors.backends`` declares. Each alert links the engine dashboard's panel that
shows its signal, and carries a ``diag_class`` only when the rules engine knows the class (triage links to it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from alerts.causes import Cause
from alerts.links import PanelRef, panel_url
from alerts.spec import Spec, format_number
from collectors import backends as b
from collectors import catalog as cat
from dashboards.definitions import UIDS
from dashboards.engine import KV_SATURATION_PANEL, PREEMPTIONS_PANEL, QUEUE_PANEL
from dashboards.promql import metric_names, series_known
from diag.rules import levels

GROUP = "llmdiag-engine-{engine}"
RULE_FILE = "engine-{engine}.rules.yaml"
KV_ALERT = "LLMDiagVllmKVCacheSaturated"
QUEUE_ALERT = "LLMDiagVllmQueueTimeDominates"
PREEMPT_ALERT = "LLMDiagVllmPreempting"
RATE_WINDOW = "5m"
MIN_RPS = 0.05  # below this the queue's share of a request's time is noise (a few requests)
ENGINE_VARS = ("job", "instance")
SOURCE = "collectors.tracking"  # the module of our tracker's families, whose causes an engine spec replaces


@dataclass(frozen=True)
class EngineCause:
    alert: str
    diag_class: str | None  # the rules engine's incident class, when it has it
    severity: str
    expr: str
    for_: str
    summary: str
    description: str
    panel: PanelRef


def _n(x: float) -> str:
    return format_number(x)


def _rate(name: str) -> str:
    return f"rate({name}[{RATE_WINDOW}])"


def kv_usage_expr() -> str:
    """KV-cache usage per engine host, the most saturated model's (``kv_cache_usage_perc``, or the name before 0.9)."""
    by = "max by (job, instance, model_name)"
    return f"({by} ({b.VLLM_KV_USAGE.name})\nor\n{by} ({b.VLLM_GPU_CACHE_USAGE.name}))"


def vllm_causes(incident_classes: Iterable[str]) -> tuple[EngineCause, ...]:
    known = set(incident_classes)
    preempt = f"sum by (job, instance) ({_rate(b.VLLM_PREEMPTIONS.name)})"
    q_sum, q_count = b.VLLM_QUEUE_TIME.name + "_sum", b.VLLM_QUEUE_TIME.name + "_count"
    infer_sum = b.VLLM_INFERENCE_TIME.name + "_sum"
    by = "sum by (job, instance, model_name)"
    return (
        EngineCause(
            KV_ALERT, "kv_cache_saturation" if "kv_cache_saturation" in known else None, "ticket",
            f"{kv_usage_expr()} >= {_n(levels.KV_CEILING)}\nand on (job, instance)\n{preempt} >= {_n(levels.PREEMPTIONS_UP)}",
            "5m",
            f"{{{{ $labels.instance }}}}: vLLM's KV cache is at its ceiling ({{{{ $value | humanizePercentage }}}} >= "
            f"{_n(levels.KV_CEILING)}) and it preempts >= {_n(levels.PREEMPTIONS_UP)} sequences/s",
            "The scheduler has no free KV block, so it evicts running sequences and recomputes them later: time per "
            "output token and TTFT rise. Lower max_num_seqs or max_model_len, raise gpu_memory_utilization, or add "
            "replicas.",
            PanelRef(UIDS["engine"], KV_SATURATION_PANEL, ENGINE_VARS),
        ),
        EngineCause(
            QUEUE_ALERT, "queue_backlog" if "queue_backlog" in known else None, "ticket",
            f"{by} ({_rate(q_sum)})\n>= {_n(levels.OVERWHELM_FACTOR)} * {by} ({_rate(infer_sum)})\n"
            f"and\n{by} ({_rate(q_count)}) > {_n(MIN_RPS)}",
            "5m",
            f"{{{{ $labels.model_name }}}} on {{{{ $labels.instance }}}}: requests wait >= "
            f"{_n(levels.OVERWHELM_FACTOR)}x their running time before vLLM schedules them",
            f"Time in the WAITING phase ({b.VLLM_QUEUE_TIME.name}) dominates time RUNNING "
            f"({b.VLLM_INFERENCE_TIME.name}): too little capacity for the load, or a KV cache that admits too few "
            "sequences (see the KV saturation alert). Add replicas or shed load.",
            PanelRef(UIDS["engine"], QUEUE_PANEL, ENGINE_VARS),
        ),
        EngineCause(
            PREEMPT_ALERT, None, "ticket",
            f"{preempt} >= {_n(levels.PREEMPTIONS_UP)}",
            "10m",
            f"{{{{ $labels.instance }}}}: vLLM preempts {{{{ $value | printf \"%.2f\" }}}} sequences/s (>= "
            f"{_n(levels.PREEMPTIONS_UP)} for 10 minutes)",
            f"Sustained preemptions ({b.VLLM_PREEMPTIONS.name}) recompute work already done; with the KV cache below "
            "its ceiling they come from bursts of long prompts. Check the KV saturation panel.",
            PanelRef(UIDS["engine"], PREEMPTIONS_PANEL, ENGINE_VARS),
        ),
    )  # fmt: skip


def engine_causes(spec: Spec, incident_classes: Iterable[str]) -> tuple[EngineCause, ...]:
    """The cause alerts of the spec's engine (none for our tracker's: its are the fixed cause alerts)."""
    return vllm_causes(incident_classes) if spec.engine == "vllm" else ()


def engine_labels(spec: Spec, cause: EngineCause) -> dict[str, str]:
    labels = {**spec.labels, "severity": cause.severity, "backend": spec.engine}
    if cause.diag_class is not None:
        labels["diag_class"] = cause.diag_class
    return labels


def engine_annotations(spec: Spec, cause: EngineCause) -> dict[str, str]:
    out = {"summary": cause.summary, "description": cause.description}
    if spec.runbook_url:
        out["runbook_url"] = spec.runbook_url
    if spec.grafana_url:
        out["dashboard_url"] = panel_url(spec.grafana_url, cause.panel)
    return out


def engine_rule_groups(spec: Spec, incident_classes: Iterable[str]) -> list[dict[str, Any]]:
    causes = engine_causes(spec, incident_classes)
    if not causes:
        return []
    rules = [{"alert": c.alert, "expr": c.expr, "for": c.for_, "labels": engine_labels(spec, c),
              "annotations": engine_annotations(spec, c)} for c in causes]  # fmt: skip
    return [{"name": GROUP.format(engine=spec.engine), "rules": rules}]


def cause_sources(cause: Cause) -> set[str]:
    """The collector modules whose families a cause alert's expression reads (``collectors.tracking``: our tracker)."""
    known = series_known()
    fams = {known.get(n, n) for n in metric_names(cause.expr)}
    return {cat.CATALOG[f].source for f in fams if f in cat.CATALOG}


def replaced_by_engine(spec: Spec, cause: Cause) -> bool:
    """Whether a fixed cause alert is left out for this spec's engine: on an engine host our tracker's families are
    absent, so a cause that reads them can never fire there."""
    return spec.engine != "llmdiag" and SOURCE in cause_sources(cause)
