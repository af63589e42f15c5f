"""The eight dashboards, one question each. Every panel says what it shows and what to do about it.

Each query lists our series first and the upstream equivalent second (``ours or theirs``): a host
running vLLM, TGI, node_exporter, cAdvisor or DCGM instead of -- or beside -- the llm-diag agent gets
a filled panel either way. The inference backends' names are their declarations in ``collectors.backends`` (never
re-spelt here); other exporters' come from the catalog's pinned upstream families.
"""

from __future__ import annotations

from alerts import slo_names as slo
from collectors import backends
from dashboards.engine import engine_rows
from dashboards.fleet import UID as FLEET_UID
from dashboards.fleet import fleet_dashboard
from dashboards.promql import MODEL, RATE, m, mean, q, quantile, rate, ratio, sel
from dashboards.spec import Dashboard, Row, Variable, heatmap, stat, ts

VLLM_MODEL = 'model_name=~"$model"'
UIDS = {
    "overview": "llmdiag-overview",
    "slo": "llmdiag-slo",
    "latency": "llmdiag-latency",
    "memory": "llmdiag-memory",
    "gpu": "llmdiag-gpu",
    "moe": "llmdiag-batching-moe",
    "engine": "llmdiag-engine",
    "fleet": FLEET_UID,
}
MiB = 1048576

# --------------------------------------------------------------------------- variables

JOB = Variable("job", "Job", f"label_values({m('up')}, job)")
INSTANCE = Variable("instance", "Instance", f'label_values({m("up")}{{job=~"$job"}}, instance)')
# The models of whichever family is present: ours label `model`, vLLM's `model_name` (copied to `model` by the
# shipped scrape config, or not: label_replace covers a Prometheus configured without it). TGI serves one
# model and labels none. Scoped to request series: an unscoped label_values(model) also lists other exporters'
# labels (llmdiag_model_processes' model is a file path).
MODEL_VARIABLE = Variable(
    "model", "Model",
    f"query_result(count by (model) ({sel('llmdiag_requests_total')}) or count by (model) "
    f"(label_replace({sel(backends.VLLM_RUNNING.name)}, \"model\", \"$1\", \"model_name\", \"(.+)\")))",
    regex='/model="([^"]+)"/',
)  # fmt: skip
STANDARD_VARIABLES = (JOB, INSTANCE, MODEL_VARIABLE)


def _sum(expr: str, by: str = "") -> str:
    return f"sum by ({by}) ({expr})" if by else f"sum({expr})"


# --------------------------------------------------------------------------- shared request expressions


def _req_rate(by: str = "") -> tuple[str, ...]:
    return (
        _sum(rate("llmdiag_requests_total", MODEL), by),
        _sum(rate(backends.VLLM_SUCCESS.name, VLLM_MODEL), by),
        _sum(rate(backends.TGI_REQUEST_COUNT.name), by),
    )


def _errors_ratio() -> tuple[str, ...]:
    """Share not ok; ``or 0 * all`` keeps a 0 (not an empty panel) while every request succeeds."""
    out = []
    for name, matchers, bad in (
        ("llmdiag_requests_total", (MODEL,), 'outcome!="ok"'),
        (backends.VLLM_SUCCESS.name, (VLLM_MODEL,), 'finished_reason=~"abort|error"'),
    ):
        every = _sum(rate(name, *matchers))
        out.append(ratio(f"{_sum(rate(name, *matchers, bad))} or 0 * {every}", every))
    every = _sum(rate(backends.TGI_REQUEST_COUNT.name))
    out.append(ratio(f"{_sum(rate(backends.TGI_REQUEST_FAILURE.name))} or 0 * {every}", every))
    return tuple(out)


def _phase_quantiles(ours: str, *theirs: tuple[str, str]) -> tuple:
    """p50/p95/p99 of one phase, each ``ours or theirs``."""
    out = []
    for qq in (0.5, 0.95, 0.99):
        alts = [quantile(qq, ours, MODEL)] + [quantile(qq, name, matcher) if matcher else quantile(qq, name)
                                              for name, matcher in theirs]  # fmt: skip
        out.append(q(*alts, legend=f"p{round(qq * 100)}"))
    return tuple(out)


# --------------------------------------------------------------------------- Overview


def _burn(slo_sel: str, objective_sel: str, windows: tuple[str, ...]) -> list:
    """Error ratio over each window / the allowed error ratio (1 - objective): 1 spends the budget over the period."""
    objective = m(slo.OBJECTIVE)
    return [
        q(f"{m(slo.RATIO.format(w=w))}{{{slo_sel}}} / on(slo, model) group_left() (1 - {objective}{{{objective_sel}}})",
          legend=f"{{{{slo}}}} {{{{model}}}} {w}")
        for w in windows
    ]  # fmt: skip


def overview() -> Dashboard:
    slo_sel = 'job=~"$job", model=~"$model"'
    ratio_period = m(slo.PERIOD_RATIO)
    objective = m(slo.OBJECTIVE)
    burn = _burn(slo_sel, 'model=~"$model"', ("5m", "1h", "6h", "3d"))
    red = Row("Requests, errors, duration", (
        stat("Request rate", "Finished requests per second: llmdiag_requests_total (or vllm:request_success_total, "
             "tgi_request_count). A drop to 0 with traffic still arriving means the backend stopped answering: check "
             "Targets down and the Latency phases dashboard.", "reqps", q(*_req_rate())),
        stat("Error ratio", "Share of requests not 'ok' (llmdiag_requests_total by outcome; vLLM abort|error; TGI "
             "tgi_request_failure). Above the SLO's budget: open Latency phases > Outcomes to see whether the queue "
             "or inference is failing.", "percentunit", q(*_errors_ratio())),
        stat("p95 end-to-end", "95th percentile of llmdiag_request_e2e_seconds (or vllm:e2e_request_latency_seconds, "
             "tgi_request_duration). When it rises, Latency phases tells queue wait from slow inference.", "s",
             q(quantile(0.95, "llmdiag_request_e2e_seconds", MODEL), quantile(0.95, backends.VLLM_E2E.name,
               VLLM_MODEL), quantile(0.95, backends.TGI_REQUEST_DURATION.name))),
        stat("p95 time to first token", "95th percentile of llmdiag_request_ttft_seconds (or "
             "vllm:time_to_first_token_seconds). High TTFT with a short queue points at prefill or memory pressure.",
             "s", q(quantile(0.95, "llmdiag_request_ttft_seconds", MODEL),
                    quantile(0.95, backends.VLLM_TTFT.name, VLLM_MODEL))),
        stat("Targets down", "Scrape targets whose last scrape failed: sum of 1 - up. Non-zero means a panel below "
             "may be blind; check the target's process and its /metrics.", "short",
             q(f"sum(1 - {sel('up')})")),
        stat("Model copies", "Processes mapping or holding each model file (llmdiag_model_processes, max over "
             "instances). More copies than workers means duplicate private copies of the weights: share one mmap.",
             "short", q(f"max({sel('llmdiag_model_processes')})")),
    ))  # fmt: skip
    slo_row = Row("SLO", (
        ts("SLO attainment (period)", f"1 - {slo.PERIOD_RATIO} (the error ratio over the spec's period, named in "
           "its period label) per SLO and model, against llmdiag:slo_objective:ratio. Below the objective: the error "
           "budget is spent; freeze risky changes and work the top burn-rate window (SLOs dashboard).", "percentunit",
           q(f"1 - {ratio_period}{{{slo_sel}}}", legend="{{slo}} {{model}} ({{period}})"),
           q(f'max by (slo, model) ({objective}{{model=~"$model"}})', legend="objective {{slo}} {{model}}"), w=12),
        ts("SLO burn rate", "Error ratio over 5m, 1h, 6h and 3d windows (llmdiag:slo_error_ratio:ratio<W>) divided by "
           "the allowed error ratio (1 - llmdiag:slo_objective:ratio). 1 spends the budget exactly over the period; "
           "14.4 on 1h and 5m together pages. Follow the page's window to the phase that failed.", "short", *burn,
           w=12),
    ))  # fmt: skip
    health = Row("Targets and copies", (
        ts("Targets up", "up per job and instance (1 = last scrape succeeded). A gap is a blind spot; a flapping "
           "target often is an OOM-killed agent or backend: see the OOM annotations.", "short",
           q(f"sum by (job, instance) ({sel('up')})", legend="{{job}} {{instance}}")),
        ts("Model copies over time", "llmdiag_model_processes per model file. A step up after a deploy or "
           "autoscale means another private copy of the weights is resident: check Memory & pressure.", "short",
           q(f"max by (model) ({sel('llmdiag_model_processes')})", legend="{{model}}")),
    ))  # fmt: skip
    incident = sel("llmdiag_incident")
    itself = Row("Diagnosis and the agent", (
        ts("Live diagnosis", "Hosts whose agent concludes each incident class now (llmdiag_incident == 1, from "
           "`diag collect --diagnose-every`, the LLMDiagIncident alert's signal); 'none' while nothing is concluded, "
           "no data while the live diagnosis is off. Run `diag analyze` on that host for the evidence.", "short",
           q(f'(sum by (class) ({incident}) > 0) or on() label_replace(0 * count({incident}), "class", "none", "", "")',
             legend="{{class}}")),
        ts("Agent errors", "Failed flight-recorder writes (llmdiag_recorder_write_errors_total), writes that met a "
           "full disk (llmdiag_recorder_disk_full_total) and failing samplers (llmdiag_agent_sampler_errors_total) "
           "per second. Non-zero writes: the recorder loses the history a bundle needs (disk full or read-only).",
           "ops",
           q(_sum(rate("llmdiag_recorder_write_errors_total"), "instance"), legend="recorder write errors {{instance}}"),
           q(_sum(rate("llmdiag_recorder_disk_full_total"), "instance"), legend="disk full {{instance}}"),
           q(_sum(rate("llmdiag_agent_sampler_errors_total"), "instance, sampler"),
             legend="{{sampler}} sampler errors {{instance}}")),
    ))  # fmt: skip
    return Dashboard(UIDS["overview"], "llm-diag / Overview", "Is the inference service meeting its SLOs right now?",
                     (red, slo_row, health, itself), STANDARD_VARIABLES)  # fmt: skip


# --------------------------------------------------------------------------- SLOs

TIER_PANEL = "Error ratio per tier window vs threshold"  # what an LLMDiagSLOBurn alert links to
EVENTS_PANEL = "SLI requests and errors"  # what an LLMDiagSLOMetricAbsent alert links to


def slos() -> Dashboard:
    """Per SLO and model: the period's attainment and budget, each tier's windows against its threshold, burn rates.

    Reads only names every spec records (alerts.slo_names.DASHBOARD_NAMES): the period and the tiers' windows are
    labels here, so the one committed dashboard is right for a 30d, 28d or 7d spec and for custom tiers."""
    sel_ = 'slo=~"$slo", model=~"$model", job=~"$job"'
    const = 'slo=~"$slo", model=~"$model"'  # objective and thresholds are recorded without a job
    period, objective = m(slo.PERIOD_RATIO), m(slo.OBJECTIVE)
    budget_left = f"1 - {period}{{{sel_}}} / on(slo, model) group_left() (1 - {objective}{{{const}}})"
    budget = Row("Error budget over the period", (
        stat("Attainment", f"Good events over the SLO's period: 1 - {slo.PERIOD_RATIO} (errors / requests summed "
             "over the period named in the period label). Below llmdiag:slo_objective:ratio the budget is gone.",
             "percentunit", q(f"1 - {period}{{{sel_}}}", legend="{{slo}} {{model}} ({{period}})"), w=8),
        stat("Error budget remaining", f"1 - {slo.PERIOD_RATIO} / (1 - llmdiag:slo_objective:ratio): the share of "
             "the period's allowed errors not yet spent. Under 0 the objective is missed; near 0, freeze risky "
             "changes until the window rolls on.", "percentunit", q(budget_left, legend="{{slo}} {{model}}"), w=8),
        stat("Objective", "llmdiag:slo_objective:ratio per SLO and model: the share of good events promised (from "
             "the spec the rules were generated from).", "percentunit",
             q(f"max by (slo, model) ({objective}{{{const}}})", legend="{{slo}} {{model}}"), w=8),
        ts("Attainment over time", f"1 - {slo.PERIOD_RATIO} against llmdiag:slo_objective:ratio. A line falling "
           "towards the objective is a budget being spent: the burn-rate panels below say how fast.", "percentunit",
           q(f"1 - {period}{{{sel_}}}", legend="{{slo}} {{model}} ({{period}})"),
           q(f"max by (slo, model) ({objective}{{{const}}})", legend="objective {{slo}} {{model}}")),
        ts("Error budget remaining over time", f"1 - {slo.PERIOD_RATIO} / (1 - llmdiag:slo_objective:ratio) over "
           "time. A steep drop is an incident; a slow slide is a service that misses its objective every day.",
           "percentunit", q(budget_left, legend="{{slo}} {{model}}")),
    ))  # fmt: skip
    tiers = Row("Burn-rate tiers", (
        ts(TIER_PANEL, f"Each tier's long and short window error ratios ({slo.TIER_LONG_RATIO}, "
           f"{slo.TIER_SHORT_RATIO}; the window is a label) against its threshold ({slo.TIER_THRESHOLD} = burn "
           "factor x error budget). A tier pages or tickets when both of its windows are above its threshold: this "
           "is the panel an LLMDiagSLOBurn alert links to. Then open Latency phases for the phase that failed.",
           "percentunit",
           q(f"{m(slo.TIER_LONG_RATIO)}{{{sel_}}}", legend="{{tier}} long {{window}} {{slo}} {{model}}"),
           q(f"{m(slo.TIER_SHORT_RATIO)}{{{sel_}}}", legend="{{tier}} short {{window}} {{slo}} {{model}}"),
           q(f"max by (slo, model, tier) ({m(slo.TIER_THRESHOLD)}{{{const}}})",
             legend="{{tier}} threshold {{slo}} {{model}}"), w=24),
        ts("Burn rate", "Error ratio over 5m ... 3d (llmdiag:slo_error_ratio:ratio<W>) divided by the allowed error "
           "ratio (1 - llmdiag:slo_objective:ratio). 1 spends the budget exactly over the period; a tier fires above "
           "its burn factor (e.g. 14.4 on 1h and 5m for a 30-day period).", "short",
           *_burn(sel_, const, slo.WINDOWS), w=24),
    ))  # fmt: skip
    traffic = Row("SLI events", (
        ts(EVENTS_PANEL, f"Requests and errors per 5 minutes as the SLO counts them ({slo.REQUESTS.format(w='5m')}, "
           f"{slo.ERRORS.format(w='5m')}). Requests falling to nothing with the job still up is what "
           "LLMDiagSLOMetricAbsent warns of: the SLO is blind, not met.", "short",
           q(f"sum by (slo, model) ({m(slo.REQUESTS.format(w='5m'))}{{{sel_}}})", legend="requests {{slo}} {{model}}"),
           q(f"sum by (slo, model) ({m(slo.ERRORS.format(w='5m'))}{{{sel_}}})", legend="errors {{slo}} {{model}}"),
           w=24),
    ))  # fmt: skip
    events = m(slo.REQUESTS.format(w="5m"))
    variables = (
        JOB,
        INSTANCE,
        Variable("slo", "SLO", f'label_values({events}{{job=~"$job"}}, slo)'),
        Variable("model", "Model", f'label_values({events}{{job=~"$job", slo=~"$slo"}}, model)'),
    )
    return Dashboard(UIDS["slo"], "llm-diag / SLOs", "Is each SLO within its error budget, and which tier burns it?",
                     (budget, tiers, traffic), variables)  # fmt: skip


# --------------------------------------------------------------------------- Latency phases


def latency() -> Dashboard:
    quant = Row("Phase quantiles", (
        ts("Queue wait p50/p95/p99", "llmdiag_request_queue_wait_seconds (or vllm:request_queue_time_seconds, "
           "tgi_request_queue_duration) quantiles from summed bucket rates. Rising queue wait with flat inference "
           "time is saturation: add capacity or shed load.", "s",
           *_phase_quantiles("llmdiag_request_queue_wait_seconds", (backends.VLLM_QUEUE_TIME.name, VLLM_MODEL),
                             (backends.TGI_QUEUE_DURATION.name, "")), w=6),
        ts("Inference p50/p95/p99", "llmdiag_request_inference_seconds (or vllm:request_inference_time_seconds). "
           "Rising inference time at steady concurrency is contention: check Memory & pressure for thrashing.", "s",
           *_phase_quantiles("llmdiag_request_inference_seconds", (backends.VLLM_INFERENCE_TIME.name, VLLM_MODEL)),
           w=6),
        ts("Time to first token p50/p95/p99", "llmdiag_request_ttft_seconds (or vllm:time_to_first_token_seconds). "
           "TTFT includes queue wait: compare with the queue panel to see which one moved.", "s",
           *_phase_quantiles("llmdiag_request_ttft_seconds", (backends.VLLM_TTFT.name, VLLM_MODEL)), w=6),
        ts("End-to-end p50/p95/p99", "llmdiag_request_e2e_seconds (or vllm:e2e_request_latency_seconds, "
           "tgi_request_duration): what the client saw. The other three panels say where the time went.", "s",
           *_phase_quantiles("llmdiag_request_e2e_seconds", (backends.VLLM_E2E.name, VLLM_MODEL),
                             (backends.TGI_REQUEST_DURATION.name, "")), w=6),
    ))  # fmt: skip
    phases = Row("Where the time goes", (
        ts("Mean phases (stacked)", "Mean queue wait and mean inference per request: rate(_sum) / rate(_count) of "
           "llmdiag_request_queue_wait_seconds and llmdiag_request_inference_seconds (or vLLM's queue/inference "
           "histograms). The larger band is the phase to fix.", "s",
           q(mean("llmdiag_request_queue_wait_seconds", MODEL), mean(backends.VLLM_QUEUE_TIME.name, VLLM_MODEL),
             legend="queue wait"),
           q(mean("llmdiag_request_inference_seconds", MODEL), mean(backends.VLLM_INFERENCE_TIME.name, VLLM_MODEL),
             legend="inference"), stacked=True),
        ts("Queue depth vs active inferences", "llmdiag_queue_depth and llmdiag_active_inferences (or "
           "vllm:num_requests_waiting/running, tgi_queue_size/tgi_batch_current_size). Active pinned at the slot "
           "limit with a growing queue is a queue problem; active inferences dropping while the queue grows is "
           "thrashing or a stall.", "short",
           q(_sum(sel("llmdiag_queue_depth", MODEL)), _sum(sel(backends.VLLM_WAITING.name, VLLM_MODEL)),
             _sum(sel(backends.TGI_QUEUE_SIZE.name)), legend="queued"),
           q(_sum(sel("llmdiag_active_inferences", MODEL)), _sum(sel(backends.VLLM_RUNNING.name, VLLM_MODEL)),
             _sum(sel(backends.TGI_BATCH_CURRENT_SIZE.name)), legend="active")),
    ))  # fmt: skip
    heat = Row("Distributions", (
        heatmap("Queue wait heatmap", "Bucket rates of llmdiag_request_queue_wait_seconds (or "
                "vllm:request_queue_time_seconds). Two bands mean two populations, e.g. requests that found a free "
                "slot and requests that waited for one.", "s",
                q(_sum(rate("llmdiag_request_queue_wait_seconds_bucket", MODEL), "le"),
                  _sum(rate(backends.VLLM_QUEUE_TIME.name + "_bucket", VLLM_MODEL), "le"),
                  legend="{{le}}", heatmap=True)),
        heatmap("End-to-end heatmap", "Bucket rates of llmdiag_request_e2e_seconds (or "
                "vllm:e2e_request_latency_seconds). A band moving up over time is a regression; a widening band is "
                "mixed prompt sizes or contention.", "s",
                q(_sum(rate("llmdiag_request_e2e_seconds_bucket", MODEL), "le"),
                  _sum(rate(backends.VLLM_E2E.name + "_bucket", VLLM_MODEL), "le"),
                  legend="{{le}}", heatmap=True)),
    ))  # fmt: skip
    outcomes = Row("Outcomes", (
        ts("Outcomes and refusals", "Finished requests by outcome (llmdiag_requests_total: ok, error, queue_timeout, "
           "inference_timeout, rejected) and refusals by reason (llmdiag_admission_rejections_total: queue_full, "
           "queue_timeout, memory_watermark / memory_psi = the memory guard). queue_full/queue_timeout = a queue "
           "problem (capacity); inference_timeout and guard refusals = memory pressure or thrashing.", "reqps",
           q(_sum(rate("llmdiag_requests_total", MODEL), "outcome"),
             _sum(rate(backends.VLLM_SUCCESS.name, VLLM_MODEL), "finished_reason"), legend="{{outcome}}{{finished_reason}}"),
           q(_sum(rate("llmdiag_admission_rejections_total", MODEL), "reason"), legend="refused: {{reason}}"), w=24),
    ))  # fmt: skip
    return Dashboard(
        UIDS["latency"],
        "llm-diag / Latency phases",
        "Where does request time go: queue, inference, first token, end to end?",
        (quant, phases, heat, outcomes),
        STANDARD_VARIABLES,
    )


# --------------------------------------------------------------------------- Memory & pressure


def _psi(ours: str, theirs: str, legend: str) -> object:
    return q(rate(ours), rate(theirs), legend=legend, on="job, instance")


def memory() -> Dashboard:
    cg = 'cgroup=~".+"'
    cadvisor = 'id=~"/.+"'

    def cad(name: str) -> str:
        return f'label_replace({sel(name, cadvisor)}, "cgroup", "$1", "id", "(.*)")'

    host = Row("Host", (
        ts("MemAvailable", "llmdiag_host_memory_available_bytes (or node_memory_MemAvailable_bytes): what can be "
           "allocated without swapping. Trending to 0 precedes reclaim storms and OOM kills: find the grower in "
           "Per-process memory.", "bytes",
           q(sel("llmdiag_host_memory_available_bytes"), sel("node_memory_MemAvailable_bytes"),
             legend="{{instance}}", on="job, instance"), w=8),
        ts("Swap used", "llmdiag_host_memory_swap_total_bytes - swap_free (or node_memory_Swap*). Growing swap "
           "under an inference workload means weights or KV are paged out: expect latency spikes.", "bytes",
           q(f"{sel('llmdiag_host_memory_swap_total_bytes')} - {sel('llmdiag_host_memory_swap_free_bytes')}",
             f"{sel('node_memory_SwapTotal_bytes')} - {sel('node_memory_SwapFree_bytes')}",
             legend="{{instance}}", on="job, instance"), w=8),
        ts("Host PSI (share of time stalled)", "rate() of the PSI totals llmdiag_host_pressure_*_seconds_total (or "
           "node_pressure_*_seconds_total): memory some/full and io some. Memory full above a few % is thrashing: "
           "lower concurrency or memory per request.", "percentunit",
           _psi("llmdiag_host_pressure_memory_waiting_seconds_total", "node_pressure_memory_waiting_seconds_total",
                "memory some {{instance}}"),
           _psi("llmdiag_host_pressure_memory_stalled_seconds_total", "node_pressure_memory_stalled_seconds_total",
                "memory full {{instance}}"),
           _psi("llmdiag_host_pressure_io_waiting_seconds_total", "node_pressure_io_waiting_seconds_total",
                "io some {{instance}}"), w=8),
        ts("Major faults and refaults", "rate of llmdiag_host_vmstat_pgmajfault_total (or node_vmstat_pgmajfault) "
           "and workingset refaults (llmdiag_host_vmstat_workingset_refault_*_total). Refaults rising with latency = "
           "the page cache (mmap'd weights) is thrashing: give the service more memory or fewer copies.", "ops",
           q(rate("llmdiag_host_vmstat_pgmajfault_total"), f"rate({sel('node_vmstat_pgmajfault')}[{RATE}])",
             legend="major faults {{instance}}", on="job, instance"),
           q(rate("llmdiag_host_vmstat_workingset_refault_file_total"), legend="file refaults {{instance}}"),
           q(rate("llmdiag_host_vmstat_workingset_refault_anon_total"), legend="anon refaults {{instance}}"), w=24),
    ))  # fmt: skip
    cgroups = Row("Per cgroup", (
        ts("Usage and working set vs limit", "llmdiag_cgroup_memory_usage_bytes, _working_set_bytes and _limit_bytes "
           "(or cAdvisor container_memory_*, container_spec_memory_limit_bytes). Working set at the limit means the "
           "kernel will reclaim hard and then OOM-kill: raise the limit or cut memory per worker.", "bytes",
           q(sel("llmdiag_cgroup_memory_usage_bytes", cg), cad("container_memory_usage_bytes"),
             legend="usage {{cgroup}}", on="cgroup"),
           q(sel("llmdiag_cgroup_memory_working_set_bytes", cg), cad("container_memory_working_set_bytes"),
             legend="working set {{cgroup}}", on="cgroup"),
           q(sel("llmdiag_cgroup_memory_limit_bytes", cg),
             f'label_replace({sel("container_spec_memory_limit_bytes", cadvisor)} > 0, "cgroup", "$1", "id", "(.*)")',
             legend="limit {{cgroup}}", on="cgroup")),
        ts("Working set / limit", "llmdiag_cgroup_memory_working_set_bytes / llmdiag_cgroup_memory_limit_bytes (or "
           "cAdvisor's pair); unlimited groups are left out. Above ~90 % the group is one burst from an OOM kill.",
           "percentunit",
           q(ratio(sel("llmdiag_cgroup_memory_working_set_bytes", cg), sel("llmdiag_cgroup_memory_limit_bytes", cg)),
             ratio(cad("container_memory_working_set_bytes"), cad("container_spec_memory_limit_bytes")),
             legend="{{cgroup}}", on="cgroup")),
        ts("memory.events rates", "rate of llmdiag_cgroup_memory_events_total by event (high, max, oom, oom_kill; "
           "hierarchical) and cAdvisor container_oom_events_total. 'high' = throttled reclaim, 'max' = limit hit, "
           "'oom_kill' = a process died: raise memory.high/max or reduce concurrency.", "ops",
           q(_sum(rate("llmdiag_cgroup_memory_events_total", cg, 'scope="hierarchical"'), "cgroup, event"),
             legend="{{event}} {{cgroup}}"),
           q(_sum(rate("container_oom_events_total", cadvisor), "id"), legend="cAdvisor oom {{id}}")),
        ts("cgroup memory PSI", "rate of llmdiag_cgroup_pressure_memory_{waiting,stalled}_seconds_total (or cAdvisor "
           "container_pressure_memory_*). A group's 'full' pressure says its own tasks stall on memory even when "
           "the host looks fine.", "percentunit",
           q(rate("llmdiag_cgroup_pressure_memory_waiting_seconds_total", cg),
             f'label_replace({rate("container_pressure_memory_waiting_seconds_total", cadvisor)}, "cgroup", "$1", "id", "(.*)")',
             legend="some {{cgroup}}", on="cgroup"),
           q(rate("llmdiag_cgroup_pressure_memory_stalled_seconds_total", cg), legend="full {{cgroup}}")),
    ))  # fmt: skip
    procs = Row("Processes and OOM kills", (
        ts("Per-process RSS and PSS (top 10)", "topk of llmdiag_process_resident_memory_bytes and "
           "_proportional_memory_bytes by pid/comm. PSS far below RSS = pages shared (mmap'd weights); equal = private "
           "copies. The top grower is the leak or the extra copy.", "bytes",
           q(f"topk(10, {sel('llmdiag_process_resident_memory_bytes')})", legend="RSS {{comm}} {{pid}}"),
           q(f"topk(10, {sel('llmdiag_process_proportional_memory_bytes')})", legend="PSS {{comm}} {{pid}}")),
        ts("OOM kills", "increase of llmdiag_oom_kills_total by constraint (kernel log: CONSTRAINT_MEMCG = a cgroup "
           "limit, CONSTRAINT_NONE = the whole host) or node_vmstat_oom_kill. Also drawn as red annotations on every "
           "panel. Find the victim's group in memory.events and its growth in Per-process memory.", "short",
           q(_sum(f"increase({sel('llmdiag_oom_kills_total')}[{RATE}])", "constraint"),
             _sum(f"increase({sel('node_vmstat_oom_kill')}[{RATE}])", "instance"), legend="{{constraint}}{{instance}}")),
    ))  # fmt: skip
    return Dashboard(
        UIDS["memory"],
        "llm-diag / Memory & pressure",
        "Is memory the problem: host, cgroup limit, or a process?",
        (host, cgroups, procs),
        STANDARD_VARIABLES,
    )


# --------------------------------------------------------------------------- GPU


def gpu() -> Dashboard:
    dcgm_total = f"({sel('DCGM_FI_DEV_FB_USED')} + {sel('DCGM_FI_DEV_FB_FREE')} + {sel('DCGM_FI_DEV_FB_RESERVED')})"
    dev = Row("Devices", (
        ts("Device memory used / reserved / free", "llmdiag_gpu_memory_{used,reserved,free}_bytes from NVML (or "
           "DCGM_FI_DEV_FB_* in MiB, scaled to bytes). Free near 0 precedes CUDA OOM errors: lower "
           "gpu_memory_utilization or batch size.", "bytes",
           *(q(sel(f"llmdiag_gpu_memory_{part}_bytes"), f"{sel(f'DCGM_FI_DEV_FB_{part.upper()}')} * {MiB}",
               legend=f"{part} gpu {{{{gpu}}}}", on="instance, gpu") for part in ("used", "reserved", "free"))),
        ts("Device memory used share", "llmdiag_gpu_memory_used_bytes / llmdiag_gpu_memory_total_bytes (or DCGM used "
           "/ (used + free + reserved)). Pinned near 100 % is normal for vLLM's pre-allocation; a rise from a lower "
           "plateau is a leak or a second process.", "percentunit",
           q(ratio(sel("llmdiag_gpu_memory_used_bytes"), sel("llmdiag_gpu_memory_total_bytes")),
             ratio(sel("DCGM_FI_DEV_FB_USED"), dcgm_total), legend="gpu {{gpu}}", on="instance, gpu")),
        ts("Utilisation", "llmdiag_gpu_utilization_ratio (resource=gpu: kernels running; resource=memory: memory "
           "read/write) or DCGM_FI_DEV_GPU_UTIL / DCGM_FI_DEV_MEM_COPY_UTIL (percent, scaled to 0-1). Low utilisation "
           "with a long queue means the batch is starved: check Batching & MoE.", "percentunit",
           q(sel("llmdiag_gpu_utilization_ratio", 'resource="gpu"'), f"{sel('DCGM_FI_DEV_GPU_UTIL')} / 100",
             legend="kernels gpu {{gpu}}", on="instance, gpu"),
           q(sel("llmdiag_gpu_utilization_ratio", 'resource="memory"'), f"{sel('DCGM_FI_DEV_MEM_COPY_UTIL')} / 100",
             legend="memory gpu {{gpu}}", on="instance, gpu")),
    ))  # fmt: skip
    procs = Row("Processes and allocator", (
        ts("Per-process GPU memory", "llmdiag_gpu_process_memory_bytes by gpu and pid (NVML compute processes). "
           "Two serving processes on one device = two copies of the weights: pin workers to devices.", "bytes",
           q(sel("llmdiag_gpu_process_memory_bytes"), legend="gpu {{gpu}} pid {{pid}}")),
        ts("torch allocator: allocated vs reserved", "llmdiag_torch_memory_allocated_bytes and _reserved_bytes from "
           "inside the server. Reserved far above allocated is the caching allocator's slack (fragmentation): set "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.", "bytes",
           q(sel("llmdiag_torch_memory_allocated_bytes"), legend="allocated {{device}}"),
           q(sel("llmdiag_torch_memory_reserved_bytes"), legend="reserved {{device}}")),
        ts("CUDA OOM errors", "increase of llmdiag_cuda_oom_errors_total by model and device. Any is an incident: "
           "compare free memory and the allocator slack at that time.", "short",
           q(_sum(f"increase({sel('llmdiag_cuda_oom_errors_total', MODEL)}[{RATE}])", "model, device"),
             legend="{{model}} {{device}}")),
    ))  # fmt: skip
    return Dashboard(UIDS["gpu"], "llm-diag / GPU", "Is a GPU full, idle, or shared by more processes than it should be?",
                     (dev, procs), STANDARD_VARIABLES)  # fmt: skip


# --------------------------------------------------------------------------- Batching & MoE


def moe() -> Dashboard:
    batch = Row("Batching", (
        ts("Batch input tokens p5/p95", "llmdiag_batch_input_tokens quantiles by phase (or vLLM's "
           "vllm:iteration_tokens_total, TGI tgi_batch_next_tokens). A p95 far above p5 under a request-count cap "
           "means token-heavy batches: switch to a token budget.", "short",
           *(q(quantile(p, "llmdiag_batch_input_tokens", MODEL, by="le, phase"),
               quantile(p, backends.VLLM_ITERATION_TOKENS.name, VLLM_MODEL), quantile(p, "tgi_batch_next_tokens"),
               legend=f"p{round(p * 100)} {{{{phase}}}}") for p in (0.05, 0.95))),
        ts("Requests per batch p5/p95", "llmdiag_batch_requests quantiles by phase (or TGI tgi_batch_next_size). "
           "p95 at the request cap with a queue building = the batch limit is the bottleneck.", "short",
           *(q(quantile(p, "llmdiag_batch_requests", MODEL, by="le, phase"), quantile(p, backends.TGI_BATCH_NEXT_SIZE.name),
               legend=f"p{round(p * 100)} {{{{phase}}}}") for p in (0.05, 0.95))),
    ))  # fmt: skip
    experts = Row("MoE routing", (
        ts("Expert load skew per layer", "llmdiag_moe_expert_skew_ratio by layer: busiest expert's tokens / the "
           "median expert's. Above ~4 one expert is hot; all tokens wait on it. Check the router (and the capacity "
           "factor).", "short",
           q(f"max by (layer) ({sel('llmdiag_moe_expert_skew_ratio', MODEL)} < +Inf)", legend="layer {{layer}}")),
        ts("Expert balancedness per layer", "llmdiag_moe_expert_balancedness_ratio by layer: mean / max tokens per "
           "expert (1 = balanced, vLLM/SGLang definition). Imbalance = 1 - this. Falling values = routing collapse.",
           "percentunit",
           q(f"min by (layer) ({sel('llmdiag_moe_expert_balancedness_ratio', MODEL)})", legend="layer {{layer}}")),
        ts("Expert overflow", "rate of llmdiag_moe_expert_overflow_tokens_total by layer: tokens beyond an expert's "
           "capacity, dropped or re-routed. Non-zero degrades quality silently: raise the capacity factor or fix the "
           "skew.", "short",
           q(_sum(rate("llmdiag_moe_expert_overflow_tokens_total", MODEL), "layer"), legend="layer {{layer}}"), w=24),
    ))  # fmt: skip
    return Dashboard(UIDS["moe"], "llm-diag / Batching & MoE", "Are batches well formed and experts evenly loaded?",
                     (batch, experts), STANDARD_VARIABLES)  # fmt: skip


# --------------------------------------------------------------------------- Inference engine

# The host panels drawn beside the engine's own: memory running out is told from a full KV cache on one screen.
HOST_BESIDE_ENGINE = ("MemAvailable", "Host PSI (share of time stalled)", "Working set / limit", "cgroup memory PSI",
                      "memory.events rates", "OOM kills")  # fmt: skip


def engine() -> Dashboard:
    """vLLM's overview panels (TGI's and llama.cpp's where they export the family), with our host panels beside."""
    by_title = {p.title: p for p in memory().panels}
    beside = Row("Host and cgroup memory beside the engine", tuple(by_title[t] for t in HOST_BESIDE_ENGINE))
    return Dashboard(UIDS["engine"], "llm-diag / Inference engine",
                     "Is the engine itself saturated (KV cache, preemptions, queue), or the host under it?",
                     (*engine_rows(), beside), STANDARD_VARIABLES)  # fmt: skip


def all_dashboards() -> list[Dashboard]:
    return [overview(), slos(), latency(), memory(), gpu(), moe(), engine(), fleet()]


def fleet() -> Dashboard:
    """The fleet overview (dashboards/fleet.py), with the job and instance variables only: it has no model panel."""
    return fleet_dashboard((JOB, INSTANCE))


def dashboard(key: str) -> Dashboard:
    """One dashboard by its key in ``UIDS`` (what alert links name)."""
    (d,) = [d for d in all_dashboards() if d.uid == UIDS[key]]
    return d
