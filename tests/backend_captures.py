"""Each inference backend's ``/metrics`` at its pinned version, rendered from the upstream metric definitions.

vLLM, TGI and llama.cpp's server cannot run here (no GPU, no model), so their expositions are built from the
definitions in their source at the commits ``collectors.backends`` pins, with each project's own exporter
behaviour -- and the vendored captures in ``tests/fixtures/external/backends/`` are these functions' output
(``test_backend_parsing.py`` checks they still are). Values are fixed numbers of a busy host, so tests can
assert what a parser must find; nothing here claims real traffic.

- vLLM @005a810b (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``): the same prometheus_client calls
  -- names, documentation, ``model_name``/``engine`` labels, buckets -- for ``engines`` data-parallel engines,
  ``max_model_len`` 4096 (the 1-2-5 token buckets), rendered by prometheus_client exactly as vLLM's API server
  renders them (``_created`` lines included), in the classic text format or OpenMetrics (names escaped or not).
  Beside them the API server's ``http_requests_total`` (prometheus-fastapi-instrumentator), which no feed reads.
- TGI @db931fc (``router/src/server.rs``, ``backends/v3``): the families the router records, rendered as
  metrics-exporter-prometheus 0.15 writes them (``recorder.rs``/``formatting.rs``): ``# HELP`` only for
  described families, counters without ``_total``, a blank line after each family, histograms only where
  buckets are set (``*duration``: 35 geometric buckets; token lengths: 100 buckets of the configured maximum),
  others as summaries, floats as Rust's ``Display`` prints them.
- llama.cpp @aa6192d3 (``tools/server/server.cpp``, ``get_metrics``): the hand-written ``llamacpp:`` lines,
  counters then gauges, values through C++'s default stream formatting (``%g``, 6 significant digits).
"""

from __future__ import annotations

import contextlib
import decimal
from collections.abc import Iterator, Sequence
from unittest import mock

import prometheus_client.metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import exposition as classic
from prometheus_client.openmetrics import exposition as openmetrics

from collectors import backends as bk

CREATED = 1_767_225_600.0  # the fixed creation time of every vLLM counter and histogram (prometheus_client's _created)
MODEL = "Qwen/Qwen2.5-7B-Instruct"
MAX_MODEL_LEN = 4096


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50 ... up to ``max_value``."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


@contextlib.contextmanager
def _fixed_created() -> Iterator[None]:
    with mock.patch.object(prometheus_client.metrics.time, "time", return_value=CREATED):
        yield


# --------------------------------------------------------------------------- vLLM

# Per engine: requests finished by reason, and the observations each latency histogram saw.
VLLM_FINISHED = {"stop": 40, "length": 8, "abort": 2}
VLLM_QUEUE_TIMES = (0.1, 0.4, 0.9, 2.0, 6.0)  # x 10 each: 50 finished requests per engine
VLLM_INFERENCE_TIMES = (1.2, 1.8, 2.2, 3.5, 4.0)
VLLM_TTFTS = (0.05, 0.2, 0.3, 0.7, 1.5)
VLLM_TPOTS = (0.02, 0.03, 0.04, 0.06, 0.12)
VLLM_GAUGES = {"running": 12.0, "waiting": 7.0, "kv": 0.97}
VLLM_PREEMPTIONS = 31
VLLM_PROMPT_TOKENS = 52_000
VLLM_GENERATION_TOKENS = 11_500
VLLM_PREFIX = (64_000, 16_000)  # queries, hits (tokens)


def vllm_registry(engines: int = 2) -> CollectorRegistry:
    """The families of vLLM's ``PrometheusStatLogger`` @005a810b for ``engines`` engines, each with the values above."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    with _fixed_created():
        g = {
            name: Gauge(name=name, documentation=doc, labelnames=labels, registry=reg)
            for name, doc in (
                ("vllm:num_requests_running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
                ("vllm:gpu_cache_usage_perc",
                 "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead."),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            )
        }  # fmt: skip
        c = {
            name: Counter(name=name, documentation=doc, labelnames=labels, registry=reg)
            for name, doc in (
                ("vllm:gpu_prefix_cache_queries",
                 "GPU prefix cache queries, in terms of number of queriedtokens. "  # sic: upstream's text has no space
                 "DEPRECATED: Use vllm:prefix_cache_queries instead."),
                ("vllm:gpu_prefix_cache_hits",
                 "GPU prefix cache hits, in terms of number of cached tokens. DEPRECATED: Use vllm:prefix_cache_hits instead."),
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
                ("vllm:prompt_tokens", "Number of prefill tokens processed."),
                ("vllm:generation_tokens", "Number of generation tokens processed."),
            )
        }  # fmt: skip
        success = Counter(name="vllm:request_success", documentation="Count of successfully processed requests.",
                          labelnames=[*labels, "finished_reason"], registry=reg)  # fmt: skip
        tokens = build_1_2_5_buckets(MAX_MODEL_LEN)
        h = {
            name: Histogram(name=name, documentation=doc, buckets=buckets, labelnames=labels, registry=reg)
            for name, doc, buckets in (
                ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens),
                ("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens),
                ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                 bk.VLLM_ITERATION_TOKEN_BUCKETS),
                ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
                 tokens),
                ("vllm:request_params_n", "Histogram of the n request parameter.", bk.VLLM_PARAMS_N_BUCKETS),
                ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens),
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                 bk.VLLM_TTFT.buckets),
                ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                 bk.VLLM_TPOT_BUCKETS),
                ("vllm:time_per_prefill_token_request_seconds", "Time spent per token during prefill  phase in seconds",
                 bk.VLLM_PREFILL_TOKEN_BUCKETS),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                 bk.VLLM_E2E.buckets),
                ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                 bk.VLLM_QUEUE_TIME.buckets),
                ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                 bk.VLLM_INFERENCE_TIME.buckets),
                ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                 bk.VLLM_PREFILL_TIME.buckets),
                ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                 bk.VLLM_DECODE_TIME.buckets),
            )
        }  # fmt: skip
        http = Counter("http_requests", "Total number of requests by method, status and handler.",
                       ("handler", "method", "status"), registry=reg)  # fmt: skip
        for engine in range(engines):
            lv = (MODEL, str(engine))
            g["vllm:num_requests_running"].labels(*lv).set(VLLM_GAUGES["running"])
            g["vllm:num_requests_waiting"].labels(*lv).set(VLLM_GAUGES["waiting"])
            g["vllm:gpu_cache_usage_perc"].labels(*lv).set(VLLM_GAUGES["kv"])
            g["vllm:kv_cache_usage_perc"].labels(*lv).set(VLLM_GAUGES["kv"])
            queries, hits = VLLM_PREFIX
            for prefix in ("vllm:gpu_prefix_cache_", "vllm:prefix_cache_"):
                c[prefix + "queries"].labels(*lv).inc(queries)
                c[prefix + "hits"].labels(*lv).inc(hits)
            c["vllm:num_preemptions"].labels(*lv).inc(VLLM_PREEMPTIONS)
            c["vllm:prompt_tokens"].labels(*lv).inc(VLLM_PROMPT_TOKENS)
            c["vllm:generation_tokens"].labels(*lv).inc(VLLM_GENERATION_TOKENS)
            for reason, n in VLLM_FINISHED.items():
                success.labels(*lv, reason).inc(n)
            for q, inf, ttft, tpot in zip(VLLM_QUEUE_TIMES, VLLM_INFERENCE_TIMES, VLLM_TTFTS, VLLM_TPOTS, strict=True):
                for _ in range(10):
                    h["vllm:request_queue_time_seconds"].labels(*lv).observe(q)
                    h["vllm:request_inference_time_seconds"].labels(*lv).observe(inf)
                    h["vllm:e2e_request_latency_seconds"].labels(*lv).observe(q + inf)
                    h["vllm:request_prefill_time_seconds"].labels(*lv).observe(ttft)
                    h["vllm:request_decode_time_seconds"].labels(*lv).observe(inf - ttft)
                    h["vllm:time_to_first_token_seconds"].labels(*lv).observe(q + ttft)
                    h["vllm:time_per_output_token_seconds"].labels(*lv).observe(tpot)
                    h["vllm:time_per_prefill_token_request_seconds"].labels(*lv).observe(ttft / 1000)
                    h["vllm:request_prompt_tokens"].labels(*lv).observe(1040)
                    h["vllm:request_generation_tokens"].labels(*lv).observe(230)
                    h["vllm:request_max_num_generation_tokens"].labels(*lv).observe(256)
                    h["vllm:request_params_n"].labels(*lv).observe(1)
                    h["vllm:request_params_max_tokens"].labels(*lv).observe(256)
                    h["vllm:iteration_tokens_total"].labels(*lv).observe(512)
        http.labels("/v1/chat/completions", "POST", "2xx").inc(50 * engines)
        http.labels("/metrics", "GET", "2xx").inc(120)
    return reg


def vllm_capture(engines: int = 2, fmt: str = "text", escaping: str = "underscores") -> bytes:
    """vLLM's /metrics: ``fmt`` text (classic, what a scraper asking for text/plain gets) or openmetrics."""
    reg = vllm_registry(engines)
    if fmt == "text":
        return classic.generate_latest(reg)
    return openmetrics.generate_latest(reg, escaping=escaping)


def vllm_series(engines: int) -> int:
    """How many sample lines ``vllm_capture(engines)`` has (the benchmark sizes its exposition by it)."""
    return sum(1 for line in vllm_capture(engines).decode().splitlines() if line and not line.startswith("#"))


# --------------------------------------------------------------------------- TGI


def _rust_f64(value: float) -> str:
    """How Rust's ``Display`` prints an f64: shortest round-trip digits, never an exponent, no ``.0`` on integers."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e16:
        return str(int(value))
    text = repr(value)
    return format(decimal.Decimal(text), "f") if "e" in text else text


TGI_REQUESTS = 120
TGI_SUCCESS = 100
TGI_FAILURES = {"validation": 6, "overloaded": 10, "generation": 3, "dropped": 1}
TGI_QUEUE_TIMES = (0.05, 0.3, 1.5, 4.0)  # x 25 each
TGI_INFERENCE_TIMES = (0.8, 1.6, 2.4, 3.2)
TGI_TIME_PER_TOKEN = (0.018, 0.022, 0.03, 0.05)
TGI_MAX_INPUT_TOKENS = 4095
TGI_MAX_TOTAL_TOKENS = 4096


def _described(name: str) -> str | None:
    """The description the router gives ``name`` (``describe_*`` in server.rs); None: undescribed, no ``# HELP``."""
    undescribed = {"tgi_request_failure", "tgi_batch_inference_failure", "tgi_batch_concat", "tgi_batch_concat_duration",
                   "tgi_batch_max_total_tokens"}  # fmt: skip
    if name in undescribed:
        return None
    return bk.FAMILIES[name].help


def _tgi_histogram(name: str, buckets: Sequence[float], values: Sequence[float], labels: str = "") -> list[str]:
    lines = []
    for le in buckets:
        count = sum(1 for v in values if v <= le)
        sep = "," if labels else ""
        lines.append(f'{name}_bucket{{{labels}{sep}le="{_rust_f64(le)}"}} {count}')
    sep = "," if labels else ""
    lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {len(values)}')
    wrap = f"{{{labels}}}" if labels else ""
    lines.append(f"{name}_sum{wrap} {_rust_f64(sum(values))}")
    lines.append(f"{name}_count{wrap} {len(values)}")
    return lines


def tgi_capture() -> bytes:
    """TGI's /metrics (router @db931fc, metrics-exporter-prometheus 0.15.3): counters, gauges, then distributions."""
    out: list[str] = []

    def family(name: str, type_: str, samples: list[str]) -> None:
        desc = _described(name)
        if desc is not None:
            out.append(f"# HELP {name} {desc}")
        out.append(f"# TYPE {name} {type_}")
        out.extend(samples)
        out.append("")

    family("tgi_request_count", "counter", [f"tgi_request_count {TGI_REQUESTS}"])
    family("tgi_request_success", "counter", [f"tgi_request_success {TGI_SUCCESS}"])
    family("tgi_request_failure", "counter", [f'tgi_request_failure{{err="{e}"}} {n}' for e, n in TGI_FAILURES.items()])
    family(
        "tgi_batch_inference_count",
        "counter",
        ['tgi_batch_inference_count{method="prefill"} 140', 'tgi_batch_inference_count{method="decode"} 23000'],
    )
    family(
        "tgi_batch_inference_success",
        "counter",
        ['tgi_batch_inference_success{method="prefill"} 140', 'tgi_batch_inference_success{method="decode"} 23000'],
    )
    family("tgi_batch_concat", "counter", ['tgi_batch_concat{reason="backpressure"} 12'])  # fmt: skip
    family("tgi_queue_size", "gauge", ["tgi_queue_size 9"])
    family("tgi_batch_current_size", "gauge", ["tgi_batch_current_size 16"])
    family("tgi_batch_current_max_tokens", "gauge", ["tgi_batch_current_max_tokens 30208"])
    family("tgi_batch_max_total_tokens", "gauge", [f"tgi_batch_max_total_tokens {_rust_f64(32768.0)}"])
    queue = [v for v in TGI_QUEUE_TIMES for _ in range(25)]
    infer = [v for v in TGI_INFERENCE_TIMES for _ in range(25)]
    per_token = [v for v in TGI_TIME_PER_TOKEN for _ in range(25)]
    dur = bk.TGI_DURATION_BUCKETS
    family(
        "tgi_request_duration",
        "histogram",
        _tgi_histogram("tgi_request_duration", dur, [q + i for q, i in zip(queue, infer, strict=True)]),
    )
    family("tgi_request_validation_duration", "histogram", _tgi_histogram("tgi_request_validation_duration", dur, [0.0004] * 100))
    family("tgi_request_queue_duration", "histogram", _tgi_histogram("tgi_request_queue_duration", dur, queue))
    family("tgi_request_inference_duration", "histogram", _tgi_histogram("tgi_request_inference_duration", dur, infer))
    family(
        "tgi_request_mean_time_per_token_duration",
        "histogram",
        _tgi_histogram("tgi_request_mean_time_per_token_duration", dur, per_token),
    )
    input_buckets = [TGI_MAX_INPUT_TOKENS / 100.0 * (x + 1) for x in range(100)]
    total_buckets = [TGI_MAX_TOTAL_TOKENS / 100.0 * (x + 1) for x in range(100)]
    family("tgi_request_input_length", "histogram", _tgi_histogram("tgi_request_input_length", input_buckets, [900] * 100))
    family(
        "tgi_request_generated_tokens", "histogram", _tgi_histogram("tgi_request_generated_tokens", total_buckets, [180] * 100)
    )
    family("tgi_request_max_new_tokens", "histogram", _tgi_histogram("tgi_request_max_new_tokens", total_buckets, [256] * 100))
    family("tgi_batch_next_size", "histogram", _tgi_histogram("tgi_batch_next_size", bk.TGI_BATCH_SIZE_BUCKETS, [4] * 140))
    family(
        "tgi_batch_forward_duration",
        "histogram",
        _tgi_histogram("tgi_batch_forward_duration", dur, [0.09] * 140, 'method="prefill"')
        + _tgi_histogram("tgi_batch_forward_duration", dur, [0.021] * 300, 'method="decode"'),
    )
    family("tgi_request_skipped_tokens", "summary",
           [f'tgi_request_skipped_tokens{{quantile="{q}"}} 0' for q in ("0", "0.5", "0.9", "0.95", "0.99", "0.999", "1")]
           + ["tgi_request_skipped_tokens_sum 0", "tgi_request_skipped_tokens_count 100"])  # fmt: skip
    return "\n".join(out).encode() + b"\n"


# --------------------------------------------------------------------------- llama.cpp


def _cpp_double(value: float) -> str:
    """C++ ``std::ostream << double`` with the default flags: ``%g``, 6 significant digits."""
    return format(value, "g")


LLAMACPP_COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed.", 183_400.0),
    ("prompt_seconds_total", "Prompt process time", 96.3),
    ("tokens_predicted_total", "Number of generation tokens processed.", 1_234_567.0),
    ("tokens_predicted_seconds_total", "Predict process time", 24_691.34),
    ("n_decode_total", "Total number of llama_decode() calls", 402_113.0),
    ("n_tokens_max", "Largest observed n_tokens.", 8192.0),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", 3.07),
)
LLAMACPP_GAUGES = (
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", 1904.46),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", 49.999),
    ("requests_processing", "Number of requests processing.", 4.0),
    ("requests_deferred", "Number of requests deferred.", 11.0),
)


def llamacpp_capture() -> bytes:
    """llama.cpp's ``llama-server --metrics`` /metrics @aa6192d3."""
    lines = []
    for type_, items in (("counter", LLAMACPP_COUNTERS), ("gauge", LLAMACPP_GAUGES)):
        for name, help_, value in items:
            lines += [
                f"# HELP llamacpp:{name} {help_}",
                f"# TYPE llamacpp:{name} {type_}",
                f"llamacpp:{name} {_cpp_double(value)}",
            ]
    return ("\n".join(lines) + "\n").encode()


CAPTURES = {
    "vllm-005a810b.prom": lambda: vllm_capture(2),
    "vllm-005a810b.openmetrics": lambda: vllm_capture(2, "openmetrics"),
    "tgi-db931fc.prom": tgi_capture,
    "llamacpp-aa6192d3.prom": llamacpp_capture,
}
CONTENT_TYPES = {
    "vllm-005a810b.prom": "text/plain; version=0.0.4; charset=utf-8",
    "vllm-005a810b.openmetrics": "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores",
    "tgi-db931fc.prom": "text/plain; charset=utf-8",
    "llamacpp-aa6192d3.prom": "text/plain; version=0.0.4",
}
