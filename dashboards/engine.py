"""The inference engine's own panels: vLLM's overview, and TGI's and llama.cpp's equivalents where they export one.

Why a dashboard of the engines' families: on a host that runs vLLM (or TGI, or llama.cpp's server) without our
tracker inside, the engine's /metrics is the only view of its scheduler, KV cache and token rates. vLLM ships a
Grafana dashboard of its own; every panel of it has an equivalent here (``UPSTREAM_VLLM`` maps them, and
docs/DASHBOARDS.md is the table), beside the host and cgroup memory panels vLLM's lacks -- so a KV-cache
saturation and a host running out of memory are told apart on one screen.

Every metric name comes from the family declared in ``collectors.backends`` (``b.VLLM_KV_USAGE.name``, never a
re-spelt string), and every query is ``vLLM or TGI or llama.cpp``: each alternative reads one dialect, so the live
tests prove each dialect's alternative on its own. A dialect that has no such family has no alternative (TGI has
no KV-cache gauge and no time to first token; llama.cpp's server has no histograms, only totals and means).
TGI and llama.cpp label no model, so their alternatives carry no ``model`` matcher (``model=~".+"`` would drop
every series without the label).
"""

from __future__ import annotations

from collectors import backends as b
from dashboards.promql import RATE, Query, mean, metric_names, q, quantile, rate, ratio, sel, series_known
from dashboards.spec import Panel, Row, heatmap, ts
from diag.rules import levels

VLLM_MODEL = 'model_name=~"$model"'
QUANTILES = (0.5, 0.9, 0.95, 0.99)

# Titles the alerts link to and the docs table names.
KV_SATURATION_PANEL = "KV cache saturation: usage vs ceiling, with preemptions"
QUEUE_PANEL = "Queue time"
PREEMPTIONS_PANEL = "Preemptions"

# vLLM's own overview dashboard (examples/online_serving/prometheus_grafana/grafana.json at the pinned version,
# plus the panels its generated overview adds for preemptions and the prefix cache) -> our panel's title.
UPSTREAM_VLLM: dict[str, str] = {
    "E2E Request Latency": "End-to-end latency",
    "Token Throughput": "Token throughput",
    "Time Per Output Token Latency": "Inter-token latency",
    "Scheduler State": "Scheduler state: running and waiting",
    "Time To First Token Latency": "Time to first token",
    "Cache Utilization": "KV cache usage",
    "Request Prompt Length": "Request prompt length",
    "Request Generation Length": "Request generation length",
    "Finish Reason": "Finish reasons",
    "Queue Time": QUEUE_PANEL,
    "Requests Prefill and Decode Time": "Prefill and decode time",
    "Max Generation Token in Sequence Group": "Max generation tokens per request",
    "Preemptions/s (a tile of vLLM's later, generated overview)": PREEMPTIONS_PANEL,
    "Prefix hits (a tile of vLLM's later, generated overview)": "Prefix cache hit rate",
}


def _sum(expr: str, by: str = "") -> str:
    return f"sum by ({by}) ({expr})" if by else f"sum({expr})"


def _latency(hist_vllm: b.Family | None, hist_tgi: b.Family | None, llamacpp_mean: str | None = None) -> tuple[Query, ...]:
    """p50/p90/p95/p99 and the mean of one latency, each ``vLLM or TGI``; llama.cpp has only a mean (totals)."""
    out: list[Query] = []
    for qq in QUANTILES:
        alts = []
        if hist_vllm is not None:
            alts.append(quantile(qq, hist_vllm.name, VLLM_MODEL))
        if hist_tgi is not None:
            alts.append(quantile(qq, hist_tgi.name))
        out.append(q(*alts, legend=f"p{round(qq * 100)}"))
    means = []
    if hist_vllm is not None:
        means.append(mean(hist_vllm.name, VLLM_MODEL))
    if hist_tgi is not None:
        means.append(mean(hist_tgi.name))
    if llamacpp_mean is not None:
        means.append(llamacpp_mean)
    out.append(q(*means, legend="mean"))
    return tuple(out)


def _per_second(num: b.Family, den: b.Family) -> str:
    """llama.cpp's mean: seconds spent over tokens processed, both totals (no histogram is exported)."""
    return ratio(f"sum({rate(num.name)})", f"sum({rate(den.name)})")


def _kv_usage(agg: str) -> tuple[str, ...]:
    return (f"{agg}({sel(b.VLLM_KV_USAGE.name, VLLM_MODEL)})", f"{agg}({sel(b.VLLM_GPU_CACHE_USAGE.name, VLLM_MODEL)})",
            f"{agg}({sel(b.LLAMACPP_KV_USAGE.name)})")  # fmt: skip


def _kv_by_instance() -> tuple[str, ...]:
    return tuple(f"max by (instance) ({sel(f.name, *([VLLM_MODEL] if f.dialect == 'vllm' else []))})"
                 for f in (b.VLLM_KV_USAGE, b.VLLM_GPU_CACHE_USAGE, b.LLAMACPP_KV_USAGE))  # fmt: skip


def saturation_row() -> Row:
    preempt = _sum(rate(b.VLLM_PREEMPTIONS.name, VLLM_MODEL), "instance")
    kv = _kv_by_instance()
    ceiling = levels.KV_CEILING
    return Row("Engine saturation", (
        ts(KV_SATURATION_PANEL, f"KV-cache usage per instance ({b.VLLM_KV_USAGE.name}, or the deprecated "
           f"{b.VLLM_GPU_CACHE_USAGE.name}, or {b.LLAMACPP_KV_USAGE.name}; a fraction 0-1) against the ceiling "
           f"{ceiling} at which the scheduler has no free block, and preemptions per second ({b.VLLM_PREEMPTIONS.name}) "
           f"on the same time axis. Usage at the ceiling with preemptions >= {levels.PREEMPTIONS_UP}/s is KV "
           "saturation: running sequences are evicted and recomputed, so time per output token and TTFT rise. Lower "
           "max_num_seqs or max_model_len, raise gpu_memory_utilization, or add replicas. Usage at the ceiling "
           "without preemptions is a full but healthy cache.", "short",
           q(*kv, legend="KV usage {{instance}}"),
           q(*(f"0 * ({k}) + {ceiling}" for k in kv), legend="ceiling {{instance}}"),
           q(preempt, legend="preemptions/s {{instance}}"), w=24),
        ts("KV cache usage", f"Max, mean and min KV-cache usage over engines ({b.VLLM_KV_USAGE.name}, "
           f"{b.VLLM_GPU_CACHE_USAGE.name} before vLLM 0.9, {b.LLAMACPP_KV_USAGE.name} in older llama.cpp builds). "
           "A max far above the mean is one engine taking the long prompts: check the router.", "percentunit",
           q(*_kv_usage("max"), legend="max"), q(*_kv_usage("avg"), legend="mean"), q(*_kv_usage("min"), legend="min")),
        ts(PREEMPTIONS_PANEL, f"Preemptions per second ({b.VLLM_PREEMPTIONS.name}). Each one evicts a running "
           "sequence whose KV blocks are then recomputed; sustained preemptions mean the KV cache is too small for "
           "the concurrency admitted.", "ops", q(_sum(rate(b.VLLM_PREEMPTIONS.name, VLLM_MODEL), "instance"),
                                                 legend="{{instance}}")),
        ts("Scheduler state: running and waiting", f"Requests running ({b.VLLM_RUNNING.name}; TGI "
           f"{b.TGI_BATCH_CURRENT_SIZE.name}; llama.cpp {b.LLAMACPP_PROCESSING.name}) and waiting "
           f"({b.VLLM_WAITING.name}; TGI {b.TGI_QUEUE_SIZE.name}; llama.cpp {b.LLAMACPP_DEFERRED.name}). Waiting "
           "growing while running stays flat is a full batch: KV capacity (see saturation) or max_num_seqs.", "short",
           q(_sum(sel(b.VLLM_RUNNING.name, VLLM_MODEL)), _sum(sel(b.TGI_BATCH_CURRENT_SIZE.name)),
             _sum(sel(b.LLAMACPP_PROCESSING.name)), legend="running"),
           q(_sum(sel(b.VLLM_WAITING.name, VLLM_MODEL)), _sum(sel(b.TGI_QUEUE_SIZE.name)),
             _sum(sel(b.LLAMACPP_DEFERRED.name)), legend="waiting"), w=24),
    ))  # fmt: skip


def throughput_row() -> Row:
    tgi_in, tgi_out = b.TGI_INPUT_LENGTH.name + "_sum", b.TGI_GENERATED_TOKENS.name + "_sum"
    return Row("Tokens and requests", (
        ts("Token throughput", f"Prompt and generation tokens per second ({b.VLLM_PROMPT_TOKENS.name}, "
           f"{b.VLLM_GENERATION_TOKENS.name}; TGI the _sum of {b.TGI_INPUT_LENGTH.name} and "
           f"{b.TGI_GENERATED_TOKENS.name}; llama.cpp {b.LLAMACPP_PROMPT_TOKENS.name}, "
           f"{b.LLAMACPP_TOKENS_PREDICTED.name}). Generation falling while requests keep arriving is the engine "
           "stalling (preemptions, memory) rather than less demand.", "short",
           q(_sum(rate(b.VLLM_PROMPT_TOKENS.name, VLLM_MODEL)), _sum(rate(tgi_in)), _sum(rate(b.LLAMACPP_PROMPT_TOKENS.name)),
             legend="prompt tokens/s"),
           q(_sum(rate(b.VLLM_GENERATION_TOKENS.name, VLLM_MODEL)), _sum(rate(tgi_out)),
             _sum(rate(b.LLAMACPP_TOKENS_PREDICTED.name)), legend="generation tokens/s")),
        ts("Finish reasons", f"Finished requests per second by reason ({b.VLLM_SUCCESS.name} by finished_reason: "
           f"stop, length, abort; TGI {b.TGI_REQUEST_SUCCESS.name} and {b.TGI_REQUEST_FAILURE.name} by err). A rise "
           "of abort (or TGI's generation/dropped) is clients giving up or the engine failing them; length is "
           "max_tokens reached.", "reqps",
           q(_sum(rate(b.VLLM_SUCCESS.name, VLLM_MODEL), "finished_reason"), legend="{{finished_reason}}"),
           q(_sum(rate(b.TGI_REQUEST_SUCCESS.name)), legend="success"),
           q(_sum(rate(b.TGI_REQUEST_FAILURE.name), "err"), legend="failed: {{err}}")),
        ts("Prefix cache hit rate", f"Cached prompt tokens over queried ones ({b.VLLM_PREFIX_HITS.name} / "
           f"{b.VLLM_PREFIX_QUERIES.name}, or the gpu_ pair before vLLM 0.9). A drop after a deploy is a prompt "
           "template change or a cache too small to keep the shared prefixes: prefill work and TTFT rise.",
           "percentunit",
           q(ratio(_sum(rate(b.VLLM_PREFIX_HITS.name, VLLM_MODEL)), _sum(rate(b.VLLM_PREFIX_QUERIES.name, VLLM_MODEL))),
             ratio(_sum(rate(b.VLLM_GPU_PREFIX_HITS.name, VLLM_MODEL)),
                   _sum(rate(b.VLLM_GPU_PREFIX_QUERIES.name, VLLM_MODEL))), legend="hit rate")),
        ts("Max generation tokens per request", f"Mean of the max tokens requests ask for "
           f"({b.VLLM_MAX_GENERATION_TOKENS.name}; TGI {b.TGI_MAX_NEW_TOKENS.name}). Requests asking for far more "
           "than they generate reserve KV room they never use.", "short",
           q(mean(b.VLLM_MAX_GENERATION_TOKENS.name, VLLM_MODEL), mean(b.TGI_MAX_NEW_TOKENS.name), legend="mean max tokens")),
    ))  # fmt: skip


def latency_row() -> Row:
    itl_llamacpp = _per_second(b.LLAMACPP_PREDICTED_SECONDS, b.LLAMACPP_TOKENS_PREDICTED)
    return Row("Engine latency", (
        ts("Time to first token", f"p50/p90/p95/p99 and mean of {b.VLLM_TTFT.name} (TGI and llama.cpp export no "
           "time to first token). High TTFT with a short queue is prefill work: long prompts, a cold prefix cache.",
           "s", *_latency(b.VLLM_TTFT, None)),
        ts("Inter-token latency", f"p50/p90/p95/p99 and mean of {b.VLLM_TPOT.name} (renamed "
           f"{b.VLLM_ITL.name} later; TGI {b.TGI_TIME_PER_TOKEN.name}; llama.cpp's mean is "
           f"{b.LLAMACPP_PREDICTED_SECONDS.name} / {b.LLAMACPP_TOKENS_PREDICTED.name}). Rising with a full KV "
           "cache is preemption and recompute; rising with a larger batch is the batch itself.", "s",
           *_latency(b.VLLM_TPOT, b.TGI_TIME_PER_TOKEN, itl_llamacpp),
           q(quantile(0.95, b.VLLM_ITL.name, VLLM_MODEL), legend="p95 (inter_token_latency)")),
        ts("End-to-end latency", f"p50/p90/p95/p99 and mean of {b.VLLM_E2E.name} (TGI {b.TGI_REQUEST_DURATION.name}).",
           "s", *_latency(b.VLLM_E2E, b.TGI_REQUEST_DURATION)),
        ts(QUEUE_PANEL, f"p50/p90/p95/p99 and mean of the time requests wait before running ({b.VLLM_QUEUE_TIME.name}; "
           f"TGI {b.TGI_QUEUE_DURATION.name}). Rising queue time with flat prefill/decode times is too little "
           "capacity (or a KV cache that admits too few sequences).", "s", *_latency(b.VLLM_QUEUE_TIME, b.TGI_QUEUE_DURATION)),
        ts("Prefill and decode time", f"Mean time per request in prefill and decode ({b.VLLM_PREFILL_TIME.name}, "
           f"{b.VLLM_DECODE_TIME.name}; TGI per batch: {b.TGI_BATCH_INFERENCE_DURATION.name} by method; llama.cpp "
           f"seconds per token: {b.LLAMACPP_PROMPT_SECONDS.name} / {b.LLAMACPP_PROMPT_TOKENS.name} and "
           f"{b.LLAMACPP_PREDICTED_SECONDS.name} / {b.LLAMACPP_TOKENS_PREDICTED.name}). Prefill growing points at "
           "prompts; decode growing at batch size or preemptions.", "s",
           q(mean(b.VLLM_PREFILL_TIME.name, VLLM_MODEL), mean(b.TGI_BATCH_INFERENCE_DURATION.name, 'method="prefill"'),
             _per_second(b.LLAMACPP_PROMPT_SECONDS, b.LLAMACPP_PROMPT_TOKENS), legend="prefill"),
           q(mean(b.VLLM_DECODE_TIME.name, VLLM_MODEL), mean(b.TGI_BATCH_INFERENCE_DURATION.name, 'method="decode"'),
             _per_second(b.LLAMACPP_PREDICTED_SECONDS, b.LLAMACPP_TOKENS_PREDICTED), legend="decode")),
        ts("Inference time", f"p95 and mean of the time requests run ({b.VLLM_INFERENCE_TIME.name}; TGI "
           f"{b.TGI_INFERENCE_DURATION.name}): queue time + this = end to end.", "s",
           q(quantile(0.95, b.VLLM_INFERENCE_TIME.name, VLLM_MODEL), quantile(0.95, b.TGI_INFERENCE_DURATION.name),
             legend="p95"),
           q(mean(b.VLLM_INFERENCE_TIME.name, VLLM_MODEL), mean(b.TGI_INFERENCE_DURATION.name), legend="mean")),
    ))  # fmt: skip


def lengths_row() -> Row:
    def heat(fam_v: b.Family, fam_t: b.Family) -> Query:
        return q(_sum(f"increase({sel(fam_v.name + '_bucket', VLLM_MODEL)}[{RATE}])", "le"),
                 _sum(f"increase({sel(fam_t.name + '_bucket')}[{RATE}])", "le"), legend="{{le}}", heatmap=True)  # fmt: skip

    return Row("Request lengths", (
        heatmap("Request prompt length", f"Requests per prompt-length bucket ({b.VLLM_PROMPT_TOKENS_REQUEST.name}; "
                f"TGI {b.TGI_INPUT_LENGTH.name}). A band moving up is longer prompts: more prefill, more KV per request.",
                "short", heat(b.VLLM_PROMPT_TOKENS_REQUEST, b.TGI_INPUT_LENGTH)),
        heatmap("Request generation length", f"Requests per generated-length bucket "
                f"({b.VLLM_GENERATION_TOKENS_REQUEST.name}; TGI {b.TGI_GENERATED_TOKENS.name}). Long generations hold "
                "their KV blocks longest.", "short", heat(b.VLLM_GENERATION_TOKENS_REQUEST, b.TGI_GENERATED_TOKENS)),
    ))  # fmt: skip


def engine_rows() -> tuple[Row, ...]:
    return (saturation_row(), throughput_row(), latency_row(), lengths_row())


def engine_panels() -> tuple[Panel, ...]:
    return tuple(p for r in engine_rows() for p in r.panels)


def alternative_dialects(expr: str) -> set[str]:
    """The backends' dialects whose families one query alternative reads (empty: none of theirs)."""
    fams = {series_known()[n] for n in metric_names(expr) if n in series_known()}
    return {b.FAMILIES[f].dialect for f in fams if f in b.FAMILIES}


def panel_dialects(panel: Panel) -> tuple[str, ...]:
    """The dialects a panel claims: those with at least one alternative of their own, in ``DIALECTS`` order."""
    found = {d for query in panel.queries for alt in query.alternatives for d in alternative_dialects(alt)}
    return tuple(d for d in b.DIALECTS if d in found)


def _families_md(panel: Panel, dialect: str) -> str:
    """The families of one dialect a panel reads, as declared in collectors.backends (never re-spelt)."""
    names = sorted({series_known()[n] for q in panel.queries for a in q.alternatives if alternative_dialects(a) == {dialect}
                    for n in metric_names(a)})  # fmt: skip
    return ", ".join(f"`{n}`" for n in names) if names else "--"


def markdown_table() -> str:
    """docs/DASHBOARDS.md's table: vLLM's upstream overview panel, ours, and the families each dialect fills it from."""
    by_title = {p.title: p for p in engine_panels()}
    lines = ["| vLLM's overview panel | our panel (llmdiag-engine) | vLLM | TGI | llama.cpp server |", "|---|---|---|---|---|"]
    listed = set()
    for upstream, ours in UPSTREAM_VLLM.items():
        p = by_title[ours]
        listed.add(ours)
        lines.append(f"| {upstream} | {ours} | " + " | ".join(_families_md(p, d) for d in ("vllm", "tgi", "llamacpp")) + " |")
    for title, p in by_title.items():
        if title not in listed:
            lines.append(f"| -- | {title} | " + " | ".join(_families_md(p, d) for d in ("vllm", "tgi", "llamacpp")) + " |")
    return "\n".join(lines) + "\n"
