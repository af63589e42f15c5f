"""Synthetic OpenMetrics expositions of every family the dashboards query, for backfilling Prometheus.

Why: some sources cannot run on a CI host -- an NVIDIA GPU (our NVML and torch series, DCGM), vLLM,
TGI, cAdvisor -- yet their panels must be proven to return data, and the benchmark needs 24 h of
history. ``promtool tsdb create-blocks-from openmetrics`` turns this text into TSDB blocks.

Provenance of the shapes (the values are synthetic, never recorded traffic): names, types and units
come from ``collectors.catalog`` -- ours as exported, upstream ones as pinned there with the
exporter version. Label names: vLLM ``model_name``, ``engine``, ``finished_reason`` (vLLM
@0b9faa41 ``vllm/v1/metrics/loggers.py``); DCGM ``gpu``, ``UUID``, ``pci_bus_id``, ``device``,
``modelName``, ``Hostname`` (dcgm-exporter @d5e5f51 ``render_metrics.go``; values in MiB and
percent); cAdvisor ``id`` = the cgroup path; TGI counters carry no ``_total`` (metrics-rs). Counters
without ``_total`` are written as ``unknown`` because OpenMetrics requires the suffix on counters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from collectors import backends
from collectors import catalog as cat

# Label values per label name (bounded, like the real exporters').
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "cgroup": ("/llm.slice/serve.service", "/llm.slice/sidecar.service"),
    "event": ("high", "max", "oom", "oom_kill"),
    "scope": ("hierarchical", "local"),
    "pid": ("4242", "4343"),
    "comm": ("python3",),
    "model": ("demo-model",),
    "gpu": ("0", "1"),
    "uuid": ("GPU-0f6c6ad4-0000-0000-0000-000000000000",),
    "resource": ("gpu", "memory"),
    "constraint": ("CONSTRAINT_MEMCG", "CONSTRAINT_NONE"),
    "route": ("/v1/completions",),
    "outcome": ("ok", "error", "queue_timeout", "inference_timeout", "rejected"),
    "reason": ("queue_full", "queue_timeout", "memory_watermark"),
    "phase": ("prefill", "decode"),
    "layer": ("0", "1", "2"),
    "device": ("cuda:0",),
    "stage": ("record",),
    "sampler": ("host",),
    "kind": ("some", "full"),
    "in_request_path": ("false",),
    "cache": ("hit", "miss"),
}
UPSTREAM_LABELS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "vLLM": (("model_name", ("demo-model",)), ("engine", ("0",))),
    "dcgm-exporter": (
        ("gpu", ("0", "1")),
        ("UUID", ("GPU-0f6c6ad4-0000-0000-0000-000000000000",)),
        ("modelName", ("NVIDIA H100 80GB HBM3",)),
        ("Hostname", ("gpu-node-1",)),
    ),
    "cAdvisor": (("id", ("/kubepods/pod-a/serve", "/kubepods/pod-a/sidecar")),),
}
FINISHED_REASONS = ("stop", "length", "abort")
GENERIC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0)


@dataclass(frozen=True)
class Family:
    name: str
    type: str  # counter | gauge | histogram | unknown
    labels: tuple[tuple[str, tuple[str, ...]], ...]
    unit: str
    buckets: tuple[float, ...] = ()


def family(name: str) -> Family:
    """The shape of one catalog family (ours or upstream)."""
    if name.startswith("llmdiag:slo_"):  # the alert generator's SLO recording rules (ratios per slo and model)
        labels = (("slo", ("availability", "latency")), ("model", ("demo-model",)))
        return Family(name, "gauge", labels, "ratio")
    spec = cat.CATALOG.get(name)
    if spec is not None:
        labels = tuple((label, LABEL_VALUES.get(label, ("x",))) for label in spec.labels)
        return Family(name, spec.type, labels, spec.unit, spec.buckets or ())
    if name in backends.FAMILIES:
        return _backend_family(backends.FAMILIES[name])
    fam = cat.external(name)
    labels = UPSTREAM_LABELS.get(fam.exporter, ())
    if name == "vllm:request_success_total":
        labels = (*labels, ("finished_reason", FINISHED_REASONS))
    if name == "tgi_request_failure":
        labels = (("err", ("validation", "generation")),)
    kind = fam.type if fam.type in ("gauge", "histogram") else "counter" if name.endswith("_total") else "unknown"
    if fam.type in ("counter", "untyped") and not name.endswith("_total"):
        kind = "unknown"
    unit = "bytes" if name.endswith("_bytes") else "seconds" if "seconds" in name or "duration" in name else ""
    if fam.exporter == "dcgm-exporter":
        unit = "mib" if "_FB_" in name else "percent"
    if name.startswith("vllm:kv_cache"):
        unit = "ratio"
    tokens = "token" in name or "size" in name
    return Family(name, kind, labels, unit, (TOKEN_BUCKETS if tokens else GENERIC_BUCKETS) if kind == "histogram" else ())


# Values of the inference backends' own labels (collectors.backends declares the names): bounded, as theirs are.
BACKEND_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "model_name": ("demo-model",),
    "engine": ("0",),
    "finished_reason": backends.VLLM_FINISHED_REASONS,
    "reason": backends.VLLM_WAITING_REASONS,
    "err": ("validation", "generation"),
    "method": ("prefill", "decode"),
}
MAX_BACKFILL_BUCKETS = 64  # TGI's batch-size histogram declares 1024 boundaries: the first 64 are plenty here


def _backend_family(fam: backends.Family) -> Family:
    """The shape of a family an inference backend declares (collectors.backends): its labels, type and buckets.

    Counters without ``_total`` (TGI's, metrics-rs) are written ``unknown``: OpenMetrics requires the suffix."""
    labels = tuple((label, BACKEND_LABEL_VALUES.get(label, ("x",))) for label in fam.labels)
    if fam.type == "counter":
        kind = "counter" if fam.name.endswith("_total") else "unknown"
    elif fam.type == "summary":
        kind = "unknown"  # no dashboard reads a summary; its _sum/_count are written as plain series
    else:
        kind = fam.type
    unit = "seconds" if "seconds" in fam.name or "duration" in fam.name else ""
    if fam.type == "gauge" and ("usage" in fam.name or "perc" in fam.name):
        unit = "ratio"
    buckets: tuple[float, ...] = ()
    if kind == "histogram":
        tokens = "token" in fam.name or "length" in fam.name or "size" in fam.name or "params" in fam.name
        buckets = (fam.buckets or (TOKEN_BUCKETS if tokens else GENERIC_BUCKETS))[:MAX_BACKFILL_BUCKETS]
    return Family(fam.name, kind, labels, unit, buckets)


def _label_sets(labels: tuple[tuple[str, tuple[str, ...]], ...]) -> Iterator[dict[str, str]]:
    if not labels:
        yield {}
        return
    (first, values), rest = labels[0], labels[1:]
    for v in values:
        for tail in _label_sets(rest):
            yield {first: v, **tail}


def _fmt(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _gauge_value(f: Family, i: int, rng: random.Random) -> float:
    if f.name == "up":  # a scrape target: up, with a failed scrape now and then
        return 0.0 if i % 97 == 96 else 1.0
    wave = 0.5 + 0.4 * math.sin(i / 37.0) + 0.05 * rng.random()
    if f.unit == "bytes":
        return float(int((4 << 30) * wave))
    if f.unit == "mib":
        return float(int(40000 * wave))
    if f.unit == "percent":
        return round(100 * wave, 2)
    if f.unit == "ratio":
        return round(wave, 4)
    if f.unit == "seconds":
        return round(wave, 4)
    return float(int(8 * wave) + 1)


def exposition(names: Iterable[str], start: float, end: float, step: float, labels: dict[str, str],
               seed: int = 0) -> Iterator[str]:  # fmt: skip
    """OpenMetrics lines for ``names`` from ``start`` to ``end`` every ``step`` seconds, ending with # EOF."""
    rng = random.Random(seed)
    n = int((end - start) // step) + 1
    for name in sorted(set(names)):
        f = family(name)
        yield f"# TYPE {name.removesuffix('_total') if f.type == 'counter' else name} {f.type}"
        for ls in _label_sets(f.labels):
            base = {**labels, **ls}
            if f.type == "histogram":
                yield from _histogram(f, base, start, step, n, rng)
                continue
            total = 0.0
            for i in range(n):
                ts = start + i * step
                if f.type in ("counter", "unknown"):
                    total += step * (0.5 + rng.random()) * (0.001 if f.unit == "seconds" else 1.0)
                    value = total
                else:
                    value = _gauge_value(f, i, rng)
                yield f"{name}{_fmt(base)} {value:.6g} {ts:.3f}"
    yield "# EOF"


def _histogram(f: Family, base: dict[str, str], start: float, step: float, n: int, rng: random.Random) -> Iterator[str]:
    buckets = (*f.buckets, math.inf)
    counts = [0.0] * len(buckets)
    total_sum = 0.0
    for i in range(n):
        ts = start + i * step
        for _ in range(3):  # three observations per step, log-normally spread over the buckets
            v = math.exp(rng.gauss(math.log(f.buckets[len(f.buckets) // 2]), 0.8))
            total_sum += v
            for j, b in enumerate(buckets):
                if v <= b:
                    counts[j] += 1
        for j, b in enumerate(buckets):
            le = "+Inf" if math.isinf(b) else repr(float(b))
            yield f"{f.name}_bucket{_fmt({**base, 'le': le})} {counts[j]:.0f} {ts:.3f}"
        yield f"{f.name}_count{_fmt(base)} {counts[-1]:.0f} {ts:.3f}"
        yield f"{f.name}_sum{_fmt(base)} {total_sum:.6g} {ts:.3f}"
