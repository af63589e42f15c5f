"""Inference backends' own metric families -- vLLM, TGI, llama.cpp's server and ours -- declared once.

Why one module: three readers must agree on every family an inference engine exports and on what it
means. The agent's scrape (``collectors.scrape``) keeps only the families declared here that feed a
signal; the Prometheus loader (``diag.sources.prometheus``) queries the same families; and the loaders of
recorded scrapes (``diag.timeline.backends``) turn them into the same ``service:`` signals -- one Timeline
vocabulary, one set of rules, whichever way the numbers travelled. The reference backend's dialect
exporter reads the names, types, labels and buckets from here too.

What is declared:

- ``Family``: a family as the backend exposes it in the classic text format -- name (counters with the
  ``_total`` their exporter writes; metrics-rs counters, TGI's, carry none), type, label names, the
  bucket boundaries where they are fixed in the source, the upstream version it was read from, and
  ``keep``: the labels the scrape keeps (those a feed selects on). Every other label (``model_name``,
  ``engine``, ``route`` ...) is summed away when the scrape is stored, as the Prometheus loader's
  ``sum(...)`` does, which is what bounds the stored series -- except for a gauge that is a ratio (KV-cache
  usage): its series are kept by ``keep`` and combined by ``max``, the most saturated engine.
- ``Feed``: which ``service:`` signal a family fills, and how: ``gauge`` (the sum of its series),
  ``rate`` (a counter's per-second increase), ``histogram`` (per step: p50, p95 and the mean of the
  latency stem), ``ratio`` (rate of one counter over the rate of another: a hit ratio, or a mean such as
  seconds per generated token), ``sum_rate`` (the rate of a histogram's ``_sum``: tokens per second from
  a tokens-per-request histogram). ``select`` keeps only the series whose label holds one of the values.
  A signal listed by several feeds is filled by the first whose family has data, in ``FEEDS`` order:
  ours, then vLLM, then TGI, then llama.cpp.

Sources (read, never copied): vLLM -- ``vllm/v1/metrics/loggers.py`` at vllm-project/vllm @005a810b
(``PrometheusStatLogger``: every family labelled ``model_name`` and ``engine``); two families later than
that commit are declared with the change that added them. TGI -- huggingface/text-generation-inference
@db931fc (v3.3.7+1; ``router/src/server.rs``, ``backends/v3``), rendered by metrics-exporter-prometheus
0.15: no ``_total`` on counters, histograms only where ``set_buckets_for_metric`` gives buckets, the
others are summaries. llama.cpp -- ``tools/server/server.cpp`` at ggml-org/llama.cpp @aa6192d3: unlabelled
``llamacpp:`` families written by hand; the KV-cache gauges of earlier builds are declared as such.

``collectors`` never imports ``diag``: the signal names are spelt here as the strings of
``diag.timeline.signals``, and ``diag.timeline.backends`` refuses at import a feed whose signal the
vocabulary does not hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from collectors import catalog as cat

Dialect = Literal["llmdiag", "vllm", "tgi", "llamacpp"]
FamilyType = Literal["counter", "gauge", "histogram", "summary"]
How = Literal["gauge", "rate", "histogram", "ratio", "sum_rate"]

DIALECTS: tuple[Dialect, ...] = ("llmdiag", "vllm", "tgi", "llamacpp")  # also the order of preference of feeds
DIALECT_NAMES: dict[str, str] = {"llmdiag": "llm-diag tracker", "vllm": "vLLM", "tgi": "TGI", "llamacpp": "llama.cpp server"}

VLLM_AT = "v1 engine @005a810b"
TGI_AT = "2.x/3.x @db931fc"
LLAMACPP_AT = "server @aa6192d3"
OURS_AT = "this release"

# Bucket boundaries fixed in the sources.
VLLM_TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_PREFILL_TOKEN_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
VLLM_ITERATION_TOKEN_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)


def _tgi_duration_buckets() -> tuple[float, ...]:
    """TGI's ``*duration`` buckets: 0.0001 multiplied by 1.5, 35 times, each product a boundary (as the router computes them)."""
    out, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        out.append(value)
    return tuple(out)


TGI_DURATION_BUCKETS: tuple[float, ...] = _tgi_duration_buckets()
TGI_BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(x + 1) for x in range(1024))


@dataclass(frozen=True)
class Family:
    """One metric family an inference backend exports, as its exporter writes it in the classic text format."""

    name: str
    type: FamilyType
    dialect: Dialect
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # fixed boundaries (without +Inf); None: set at run time, or none
    versions: str = ""
    keep: tuple[str, ...] = ()  # labels the scrape stores (the ones a feed selects on); others are summed away

    @property
    def base(self) -> str:
        """The family name prometheus_client's parsers give it: a counter without ``_total``."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name

    @property
    def escaped(self) -> str:
        """The name with ``:`` escaped to ``_`` (UTF-8 name escaping, ``escaping=underscores``)."""
        return self.name.replace(":", "_")

    def sample_names(self) -> tuple[str, ...]:
        """Every sample name the family's lines may carry, in both spellings (what the scrape's line filter admits)."""
        if self.type == "counter":
            stems = [self.base + "_total", self.base]
        elif self.type in ("histogram", "summary"):
            suffixes = ("_bucket", "_sum", "_count") if self.type == "histogram" else ("", "_sum", "_count")
            stems = [self.name + s for s in suffixes]
        else:
            stems = [self.name]
        return tuple(dict.fromkeys([*stems, *(s.replace(":", "_") for s in stems)]))


@dataclass(frozen=True)
class Feed:
    """A family feeding one ``service:`` signal (for ``histogram``: a latency stem, ``<stem>_<p50|p95|mean>_s``)."""

    signal: str
    family: Family
    how: How
    select: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (label, accepted values): only those series
    per: Family | None = None  # ``ratio``: the denominator's counter
    combine: Literal["sum", "max"] = "sum"  # ``gauge``: how series (engines, targets) combine; a ratio takes the max

    def __post_init__(self) -> None:
        if self.combine != "sum" and self.how != "gauge":
            raise ValueError(f"{self.signal} <- {self.family.name}: only a gauge combines otherwise than by sum")
        if (self.how == "ratio") != (self.per is not None):
            raise ValueError(f"{self.signal} <- {self.family.name}: a ratio names its denominator (per=), nothing else does")
        wanted = {"gauge": ("gauge",), "rate": ("counter",), "ratio": ("counter",), "histogram": ("histogram",),
                  "sum_rate": ("histogram", "summary")}[self.how]  # fmt: skip
        if self.family.type not in wanted:
            raise ValueError(f"{self.signal} <- {self.family.name}: a {self.family.type} cannot feed as {self.how}")
        for label, _ in self.select:
            if label not in self.family.keep:
                raise ValueError(f"{self.family.name}: selects on {label!r}, which the scrape does not keep")

    @property
    def families(self) -> tuple[Family, ...]:
        return (self.family,) if self.per is None else (self.family, self.per)


# --------------------------------------------------------------------------- the families

FAMILIES: dict[str, Family] = {}


def _catalog_help(name: str) -> str | None:
    """The catalog's help for a name it already declares (ours or an external family); its type must agree."""
    spec = cat.CATALOG.get(name)
    if spec is not None:
        return spec.help
    try:
        return cat.external(name).help
    except KeyError:
        return None


def _catalog_type(name: str) -> str | None:
    spec = cat.CATALOG.get(name)
    if spec is not None:
        return spec.type
    try:
        return cat.external(name).type
    except KeyError:
        return None


def _family(
    name: str, type_: FamilyType, dialect: Dialect, help_: str = "", labels: Iterable[str] = (),
    buckets: Iterable[float] | None = None, versions: str = "", keep: Iterable[str] = (),
) -> Family:  # fmt: skip
    """Declare a family; one the catalog knows takes its help from there and must have the catalog's type."""
    known = _catalog_type(name)
    if known is not None and known != type_:
        raise ValueError(f"{name}: declared {type_} here but {known} in collectors.catalog")
    if name in FAMILIES:
        raise ValueError(f"backend family {name} declared twice")
    fam = Family(name, type_, dialect, help_ or _catalog_help(name) or "", tuple(labels),
                 None if buckets is None else tuple(float(b) for b in buckets), versions, tuple(keep))  # fmt: skip
    missing = set(fam.keep) - set(fam.labels)
    if missing:
        raise ValueError(f"{name}: keeps labels {sorted(missing)} it does not have")
    FAMILIES[name] = fam
    return fam


def _ours(spec: cat.MetricSpec, keep: Iterable[str] = ()) -> Family:
    """One of the tracker's families (``collectors.tracking``), straight from its catalog entry."""
    return _family(spec.name, spec.type, "llmdiag", spec.help, spec.labels, spec.buckets, OURS_AT, keep)


# ours: the tracker inside an instrumented service
OURS_QUEUE_WAIT = _ours(cat.REQUEST_QUEUE_WAIT)
OURS_INFERENCE = _ours(cat.REQUEST_INFERENCE)
OURS_E2E = _ours(cat.REQUEST_E2E)
OURS_TTFT = _ours(cat.REQUEST_TTFT)
OURS_QUEUE_DEPTH = _ours(cat.QUEUE_DEPTH)
OURS_ACTIVE = _ours(cat.ACTIVE_INFERENCES)
OURS_REQUESTS = _ours(cat.REQUESTS, keep=("outcome",))

# vLLM, v1 engine
_V = ("model_name", "engine")


def _vllm(name: str, type_: FamilyType, help_: str = "", buckets: Iterable[float] | None = None,
          labels: Iterable[str] = _V, versions: str = VLLM_AT, keep: Iterable[str] = ()) -> Family:  # fmt: skip
    return _family(name, type_, "vllm", help_, labels, buckets, versions, keep)


VLLM_RUNNING = _vllm(cat.VLLM_RUNNING.name, "gauge", "Number of requests in model execution batches.")
VLLM_WAITING = _vllm(cat.VLLM_WAITING.name, "gauge", "Number of requests waiting to be processed.")
VLLM_WAITING_BY_REASON = _vllm(
    "vllm:num_requests_waiting_by_reason", "gauge",
    "Requests waiting, by why: capacity (no room in the KV cache / batch) or deferred (a transient constraint).",
    labels=(*_V, "reason"), keep=("reason",),
    versions="after @005a810b: vllm-project/vllm pull request 38435 (reason: capacity, deferred)",
)  # fmt: skip
VLLM_KV_USAGE = _vllm("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", keep=_V)
VLLM_GPU_CACHE_USAGE = _vllm("vllm:gpu_cache_usage_perc", "gauge",
                             "GPU KV-cache usage (deprecated in 0.9 for vllm:kv_cache_usage_perc).", keep=_V)  # fmt: skip
VLLM_PREFIX_QUERIES = _vllm("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in queried tokens.")
VLLM_PREFIX_HITS = _vllm("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in cached tokens.")
VLLM_GPU_PREFIX_QUERIES = _vllm("vllm:gpu_prefix_cache_queries_total", "counter",
                                "GPU prefix cache queries (deprecated in 0.9 for vllm:prefix_cache_queries).")  # fmt: skip
VLLM_GPU_PREFIX_HITS = _vllm("vllm:gpu_prefix_cache_hits_total", "counter",
                             "GPU prefix cache hits (deprecated in 0.9 for vllm:prefix_cache_hits).")  # fmt: skip
VLLM_PREEMPTIONS = _vllm("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.")
VLLM_PROMPT_TOKENS = _vllm("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
VLLM_GENERATION_TOKENS = _vllm("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
VLLM_SUCCESS = _vllm(cat.VLLM_SUCCESS.name, "counter", "Count of successfully processed requests.",
                     labels=(*_V, "finished_reason"), keep=("finished_reason",))  # fmt: skip
VLLM_PROMPT_TOKENS_REQUEST = _vllm("vllm:request_prompt_tokens", "histogram",
                                   "Number of prefill tokens processed (1-2-5 buckets up to max_model_len).")  # fmt: skip
VLLM_GENERATION_TOKENS_REQUEST = _vllm("vllm:request_generation_tokens", "histogram",
                                       "Number of generation tokens processed (1-2-5 buckets up to max_model_len).")  # fmt: skip
VLLM_ITERATION_TOKENS = _vllm("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.",
                              VLLM_ITERATION_TOKEN_BUCKETS)  # fmt: skip
VLLM_MAX_GENERATION_TOKENS = _vllm("vllm:request_max_num_generation_tokens", "histogram",
                                   "Histogram of maximum number of requested generation tokens.")  # fmt: skip
VLLM_PARAMS_N = _vllm("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", VLLM_PARAMS_N_BUCKETS)
VLLM_PARAMS_MAX_TOKENS = _vllm("vllm:request_params_max_tokens", "histogram",
                               "Histogram of the max_tokens request parameter.")  # fmt: skip
VLLM_TTFT = _vllm("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
                  cat.VLLM_TTFT_BUCKETS)  # fmt: skip
VLLM_TPOT = _vllm("vllm:time_per_output_token_seconds", "histogram", "Histogram of time per output token in seconds.",
                  VLLM_TPOT_BUCKETS)  # fmt: skip
VLLM_ITL = _vllm("vllm:inter_token_latency_seconds", "histogram",
                 "Histogram of inter-token latency in seconds (replaces vllm:time_per_output_token_seconds).",
                 versions="after @005a810b (0.11+)")  # fmt: skip
VLLM_PREFILL_PER_TOKEN = _vllm("vllm:time_per_prefill_token_request_seconds", "histogram",
                               "Time spent per token during prefill phase in seconds.", VLLM_PREFILL_TOKEN_BUCKETS)  # fmt: skip
VLLM_E2E = _vllm(cat.VLLM_E2E.name, "histogram", "Histogram of e2e request latency in seconds.",
                 cat.VLLM_REQUEST_LATENCY_BUCKETS)  # fmt: skip
VLLM_QUEUE_TIME = _vllm(cat.VLLM_QUEUE_TIME.name, "histogram", "Histogram of time spent in WAITING phase for request.",
                        cat.VLLM_REQUEST_LATENCY_BUCKETS)  # fmt: skip
VLLM_INFERENCE_TIME = _vllm(cat.VLLM_INFERENCE_TIME.name, "histogram", "Histogram of time spent in RUNNING phase for request.",
                            cat.VLLM_REQUEST_LATENCY_BUCKETS)  # fmt: skip
VLLM_PREFILL_TIME = _vllm(cat.VLLM_PREFILL_TIME.name, "histogram", "Histogram of time spent in PREFILL phase for request.",
                          cat.VLLM_REQUEST_LATENCY_BUCKETS)  # fmt: skip
VLLM_DECODE_TIME = _vllm(cat.VLLM_DECODE_TIME.name, "histogram", "Histogram of time spent in DECODE phase for request.",
                         cat.VLLM_REQUEST_LATENCY_BUCKETS)  # fmt: skip
VLLM_CACHE_CONFIG_INFO = _vllm("vllm:cache_config_info", "gauge",
                               "Information of the LLMEngine CacheConfig (always 1; the configuration in labels).",
                               labels=("engine",))  # fmt: skip
# The finish reasons of the pinned engine (``FinishReason``: stop, length, abort), each a request_success series.
VLLM_FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort")
VLLM_WAITING_REASONS: tuple[str, ...] = ("capacity", "deferred")


# TGI (text-generation-inference router, metrics-rs): no labels but on failures, batch methods and concatenations
def _tgi(name: str, type_: FamilyType, help_: str = "", buckets: Iterable[float] | None = None,
         labels: Iterable[str] = (), keep: Iterable[str] = ()) -> Family:  # fmt: skip
    return _family(name, type_, "tgi", help_, labels, buckets, TGI_AT, keep)


TGI_REQUEST_COUNT = _tgi("tgi_request_count", "counter", "Total number of requests")
TGI_REQUEST_SUCCESS = _tgi("tgi_request_success", "counter", "Number of successful requests")
TGI_REQUEST_FAILURE = _tgi("tgi_request_failure", "counter",
                           "Failed requests by err (overloaded, validation, template, generation, dropped, incomplete); "
                           "not described upstream (no # HELP).", labels=("err",), keep=("err",))  # fmt: skip
TGI_QUEUE_SIZE = _tgi(cat.TGI_QUEUE_SIZE.name, "gauge", "Current queue size")
TGI_BATCH_CURRENT_SIZE = _tgi("tgi_batch_current_size", "gauge", "Current batch size")
TGI_BATCH_CURRENT_MAX_TOKENS = _tgi("tgi_batch_current_max_tokens", "gauge", "Maximum tokens for the current batch")
TGI_BATCH_MAX_TOTAL_TOKENS = _tgi("tgi_batch_max_total_tokens", "gauge", "Maximum amount of tokens in total.")
# Help texts: the first ``describe_*`` of each name in server.rs (metrics-rs keeps the first); token-length buckets are
# 100 steps of the configured maximum (max_input_tokens, max_total_tokens), so not fixed here.
TGI_REQUEST_DURATION = _tgi("tgi_request_duration", "histogram", "Request duration", TGI_DURATION_BUCKETS)
TGI_VALIDATION_DURATION = _tgi("tgi_request_validation_duration", "histogram", "Request validation duration",
                               TGI_DURATION_BUCKETS)  # fmt: skip
TGI_QUEUE_DURATION = _tgi(cat.TGI_QUEUE_TIME.name, "histogram", "Request queue duration", TGI_DURATION_BUCKETS)
TGI_INFERENCE_DURATION = _tgi(cat.TGI_INFERENCE_TIME.name, "histogram", "Request inference duration", TGI_DURATION_BUCKETS)
TGI_TIME_PER_TOKEN = _tgi("tgi_request_mean_time_per_token_duration", "histogram", "Mean time per token per request",
                          TGI_DURATION_BUCKETS)  # fmt: skip
TGI_INPUT_LENGTH = _tgi("tgi_request_input_length", "histogram", "Input token length per request")
TGI_GENERATED_TOKENS = _tgi("tgi_request_generated_tokens", "histogram", "Generated tokens per request")
TGI_MAX_NEW_TOKENS = _tgi("tgi_request_max_new_tokens", "histogram", "Maximum new tokens per request")
TGI_BATCH_NEXT_SIZE = _tgi("tgi_batch_next_size", "histogram", "Batch size of the next batch", TGI_BATCH_SIZE_BUCKETS)
TGI_SKIPPED_TOKENS = _tgi("tgi_request_skipped_tokens", "summary", "Speculated tokens per request")
TGI_BATCH_INFERENCE_COUNT = _tgi("tgi_batch_inference_count", "counter", "Inference calls per method (prefill or decode)",
                                 labels=("method",))  # fmt: skip
TGI_BATCH_INFERENCE_SUCCESS = _tgi("tgi_batch_inference_success", "counter",
                                   "Number of successful inference calls per method (prefill or decode)",
                                   labels=("method",))  # fmt: skip
TGI_BATCH_INFERENCE_FAILURE = _tgi("tgi_batch_inference_failure", "counter", "Failed inference calls per method",
                                   labels=("method",))  # fmt: skip
TGI_BATCH_CONCAT = _tgi("tgi_batch_concat", "counter", "Batch concatenations by reason", labels=("reason",))
TGI_BATCH_FORWARD_DURATION = _tgi("tgi_batch_forward_duration", "histogram",
                                  "Batch forward duration per method (prefill or decode)", TGI_DURATION_BUCKETS,
                                  labels=("method",))  # fmt: skip
TGI_BATCH_DECODE_DURATION = _tgi("tgi_batch_decode_duration", "histogram",
                                 "Time spent decoding a batch per method (prefill or decode)", TGI_DURATION_BUCKETS,
                                 labels=("method",))  # fmt: skip
TGI_BATCH_FILTER_DURATION = _tgi("tgi_batch_filter_duration", "histogram",
                                 "Time spent filtering batches and sending generated tokens per method (prefill or decode)",
                                 TGI_DURATION_BUCKETS, labels=("method",))  # fmt: skip
TGI_BATCH_INFERENCE_DURATION = _tgi("tgi_batch_inference_duration", "histogram", "Batch inference duration",
                                    TGI_DURATION_BUCKETS, labels=("method",))  # fmt: skip
TGI_BATCH_CONCAT_DURATION = _tgi("tgi_batch_concat_duration", "histogram", "Batch concatenation duration",
                                 TGI_DURATION_BUCKETS, labels=("method",))  # fmt: skip
# tgi_request_failure's err values that are the server's failure (``overloaded`` is a refusal, ``validation`` and
# ``template`` are the client's request).
TGI_SERVER_ERRORS: tuple[str, ...] = ("generation", "dropped", "incomplete")
TGI_REFUSALS: tuple[str, ...] = ("overloaded",)


# llama.cpp's server (``--metrics``): unlabelled, written by hand
def _llamacpp(name: str, type_: FamilyType, help_: str, versions: str = LLAMACPP_AT) -> Family:
    return _family(name, type_, "llamacpp", help_, (), None, versions)


LLAMACPP_PROMPT_TOKENS = _llamacpp("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.")
LLAMACPP_PROMPT_SECONDS = _llamacpp("llamacpp:prompt_seconds_total", "counter", "Prompt process time")
LLAMACPP_TOKENS_PREDICTED = _llamacpp("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.")
LLAMACPP_PREDICTED_SECONDS = _llamacpp("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time")
LLAMACPP_DECODE_CALLS = _llamacpp("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls")
LLAMACPP_TOKENS_MAX = _llamacpp("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.")
LLAMACPP_BUSY_SLOTS = _llamacpp("llamacpp:n_busy_slots_per_decode", "counter",
                                "Average number of busy slots per llama_decode() call")  # fmt: skip
LLAMACPP_PROMPT_TPS = _llamacpp("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.")
LLAMACPP_PREDICTED_TPS = _llamacpp("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.")
LLAMACPP_PROCESSING = _llamacpp("llamacpp:requests_processing", "gauge", "Number of requests processing.")
LLAMACPP_DEFERRED = _llamacpp("llamacpp:requests_deferred", "gauge", "Number of requests deferred.")
LLAMACPP_KV_USAGE = _llamacpp("llamacpp:kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                              versions="earlier builds (examples/server); absent @aa6192d3")  # fmt: skip
LLAMACPP_KV_TOKENS = _llamacpp("llamacpp:kv_cache_tokens", "gauge", "KV-cache tokens.",
                               versions="earlier builds (examples/server); absent @aa6192d3")  # fmt: skip


# --------------------------------------------------------------------------- what feeds which signal

# The latency stems of diag.timeline.signals (``<stem>_<p50|p95|mean>_s``) and the service keys, as strings.
QUEUE_WAIT, INFERENCE, E2E, PREFILL, DECODE, TTFT, ITL = "queue_wait", "inference", "e2e", "prefill", "decode", "ttft", "itl"
ITL_MEAN = "itl_mean_s"


def _sel(label: str, *values: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return ((label, values),)


FEEDS: tuple[Feed, ...] = (
    # latencies: p50, p95 and mean per step
    Feed(QUEUE_WAIT, OURS_QUEUE_WAIT, "histogram"),
    Feed(QUEUE_WAIT, VLLM_QUEUE_TIME, "histogram"),
    Feed(QUEUE_WAIT, TGI_QUEUE_DURATION, "histogram"),
    Feed(INFERENCE, OURS_INFERENCE, "histogram"),
    Feed(INFERENCE, VLLM_INFERENCE_TIME, "histogram"),
    Feed(INFERENCE, TGI_INFERENCE_DURATION, "histogram"),
    Feed(E2E, OURS_E2E, "histogram"),
    Feed(E2E, VLLM_E2E, "histogram"),
    Feed(E2E, TGI_REQUEST_DURATION, "histogram"),
    Feed(PREFILL, VLLM_PREFILL_TIME, "histogram"),
    Feed(DECODE, VLLM_DECODE_TIME, "histogram"),
    Feed(TTFT, OURS_TTFT, "histogram"),
    Feed(TTFT, VLLM_TTFT, "histogram"),
    Feed(ITL, VLLM_ITL, "histogram"),
    Feed(ITL, VLLM_TPOT, "histogram"),
    Feed(ITL, TGI_TIME_PER_TOKEN, "histogram"),
    Feed(ITL_MEAN, LLAMACPP_PREDICTED_SECONDS, "ratio", per=LLAMACPP_TOKENS_PREDICTED),
    # request outcomes
    Feed("requests_rps", OURS_REQUESTS, "rate"),
    Feed("requests_rps", TGI_REQUEST_COUNT, "rate"),
    Feed("throughput_rps", OURS_REQUESTS, "rate", _sel("outcome", "ok")),
    Feed("throughput_rps", VLLM_SUCCESS, "rate"),
    Feed("throughput_rps", TGI_REQUEST_SUCCESS, "rate"),
    Feed("error_rps", OURS_REQUESTS, "rate", _sel("outcome", "error")),
    Feed("error_rps", TGI_REQUEST_FAILURE, "rate", _sel("err", *TGI_SERVER_ERRORS)),
    Feed("rejected_rps", OURS_REQUESTS, "rate", _sel("outcome", "rejected")),
    Feed("rejected_rps", TGI_REQUEST_FAILURE, "rate", _sel("err", *TGI_REFUSALS)),
    Feed("timeout_rps", OURS_REQUESTS, "rate", _sel("outcome", "queue_timeout", "inference_timeout")),
    # the scheduler: waiting and running requests
    Feed("queue_depth", OURS_QUEUE_DEPTH, "gauge"),
    Feed("queue_depth", VLLM_WAITING, "gauge"),
    Feed("queue_depth", TGI_QUEUE_SIZE, "gauge"),
    Feed("queue_depth", LLAMACPP_DEFERRED, "gauge"),
    Feed("requests_waiting", OURS_QUEUE_DEPTH, "gauge"),
    Feed("requests_waiting", VLLM_WAITING, "gauge"),
    Feed("requests_waiting", TGI_QUEUE_SIZE, "gauge"),
    Feed("requests_waiting", LLAMACPP_DEFERRED, "gauge"),
    Feed("active_inferences", OURS_ACTIVE, "gauge"),
    Feed("active_inferences", VLLM_RUNNING, "gauge"),
    Feed("active_inferences", TGI_BATCH_CURRENT_SIZE, "gauge"),
    Feed("active_inferences", LLAMACPP_PROCESSING, "gauge"),
    Feed("requests_running", OURS_ACTIVE, "gauge"),
    Feed("requests_running", VLLM_RUNNING, "gauge"),
    Feed("requests_running", TGI_BATCH_CURRENT_SIZE, "gauge"),
    Feed("requests_running", LLAMACPP_PROCESSING, "gauge"),
    Feed("requests_waiting_capacity", VLLM_WAITING_BY_REASON, "gauge", _sel("reason", "capacity")),
    # the KV cache
    Feed("kv_cache_usage_ratio", VLLM_KV_USAGE, "gauge", combine="max"),
    Feed("kv_cache_usage_ratio", VLLM_GPU_CACHE_USAGE, "gauge", combine="max"),
    Feed("kv_cache_usage_ratio", LLAMACPP_KV_USAGE, "gauge", combine="max"),
    Feed("preemptions_rps", VLLM_PREEMPTIONS, "rate"),
    Feed("prefix_cache_hit_ratio", VLLM_PREFIX_HITS, "ratio", per=VLLM_PREFIX_QUERIES),
    Feed("prefix_cache_hit_ratio", VLLM_GPU_PREFIX_HITS, "ratio", per=VLLM_GPU_PREFIX_QUERIES),
    # tokens
    Feed("prompt_tokens_rps", VLLM_PROMPT_TOKENS, "rate"),
    Feed("prompt_tokens_rps", TGI_INPUT_LENGTH, "sum_rate"),
    Feed("prompt_tokens_rps", LLAMACPP_PROMPT_TOKENS, "rate"),
    Feed("generation_tokens_rps", VLLM_GENERATION_TOKENS, "rate"),
    Feed("generation_tokens_rps", TGI_GENERATED_TOKENS, "sum_rate"),
    Feed("generation_tokens_rps", LLAMACPP_TOKENS_PREDICTED, "rate"),
)


def _check_order() -> None:
    """A signal's feeds are listed ours, vLLM, TGI, llama.cpp: the order the first found wins in."""
    rank = {d: i for i, d in enumerate(DIALECTS)}
    last: dict[str, int] = {}
    for feed in FEEDS:
        r = rank[feed.family.dialect]
        if r < last.get(feed.signal, -1):
            raise ValueError(f"{feed.signal}: feed from {feed.family.name} listed after a less preferred dialect")
        last[feed.signal] = r


_check_order()

# Families the scrape keeps: every family a feed reads (a ratio's denominator too).
SCRAPED: dict[str, Family] = {f.name: f for feed in FEEDS for f in feed.families}


def feeds_of(signal: str) -> tuple[Feed, ...]:
    """The feeds of one signal, most preferred first."""
    return tuple(f for f in FEEDS if f.signal == signal)


def signals() -> tuple[str, ...]:
    """Every signal some feed fills, in first-declared order."""
    return tuple(dict.fromkeys(f.signal for f in FEEDS))


def families_of(dialect: Dialect) -> tuple[Family, ...]:
    """Every declared family of a dialect, in declaration order (what a host of that dialect exports)."""
    return tuple(f for f in FAMILIES.values() if f.dialect == dialect)


def _sample_index() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for fam in SCRAPED.values():
        for name in fam.sample_names():
            out.setdefault(name, fam)
    return out


# Every sample name a scraped family's lines may carry (both spellings) -> the family: the scrape's line filter.
SCRAPED_SAMPLES: dict[str, Family] = _sample_index()
# Parsed family names (prometheus_client: a counter without ``_total``), both spellings -> the family.
SCRAPED_BY_PARSED_NAME: dict[str, Family] = {
    n: fam for fam in SCRAPED.values() for n in dict.fromkeys([fam.base, fam.base.replace(":", "_")])
}


# The name prefixes each dialect's families share: a /metrics page with any of them is that backend's, even before
# it has exported a family a signal reads (TGI and our tracker create theirs with the first request).
DIALECT_PREFIXES: dict[str, Dialect] = {"llmdiag_": "llmdiag", "vllm:": "vllm", "vllm_": "vllm", "tgi_": "tgi",
                                        "llamacpp:": "llamacpp"}  # fmt: skip


def dialect_by_prefix(name: str) -> str | None:
    """The dialect a sample or family name belongs to by its prefix, if any."""
    for prefix, dialect in DIALECT_PREFIXES.items():
        if name.startswith(prefix):
            return dialect
    return None


def dialect_of(names: Iterable[str]) -> str:
    """The dialect whose scraped families are most of ``names`` (family names as declared), or ``unknown``."""
    counts: dict[str, int] = {}
    for name in names:
        fam = FAMILIES.get(name)
        if fam is not None:
            counts[fam.dialect] = counts.get(fam.dialect, 0) + 1
    if not counts:
        return "unknown"
    return max(counts, key=lambda d: (counts[d], -DIALECTS.index(d)))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- stored series keys

# A stored series is ``<sample name>`` or ``<sample name>{label="value",...}`` with the kept labels (and ``le``) in
# sorted order, values escaped as the text format escapes them -- so a key is also readable as an exposition line.
_KEY = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?$", re.S)
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)', re.S)


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _unescape(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def series_key(name: str, labels: Mapping[str, str] | None = None) -> str:
    """``name{a="x",le="0.5"}`` (labels sorted by name), or ``name`` without labels."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_series_key(key: str) -> tuple[str, dict[str, str]] | None:
    """The inverse of ``series_key``; None for a key it did not write."""
    m = _KEY.match(key)
    if m is None:
        return None
    name, inner = m.group(1), m.group(2)
    if not inner:
        return name, {}
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(inner):
        pm = _PAIR.match(inner, pos)
        if pm is None:
            return None
        labels[pm.group(1)] = _unescape(pm.group(2))
        pos = pm.end()
    return name, labels
