"""A vLLM server's /metrics at the wire, for tests that need a vLLM host and cannot run vLLM (no GPU here).

It serves what vLLM's v1 engine exports through prometheus_client, as vLLM itself does: the names, types,
label names and buckets of ``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py`` (vllm-project/vllm
@005a810b): every family labelled ``model_name`` and ``engine``, ``vllm:request_success`` also
``finished_reason`` (stop, length, abort), the request-latency buckets 0.3 ... 7680 s. Beside them the API
server's ``http_requests_total{handler,method,status}`` (prometheus-fastapi-instrumentator), which no rule or
panel reads and the shipped scrape config drops. Values are small fixed numbers that grow on every scrape
(a served request per scrape), so rates and increases are defined; nothing here claims real traffic.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LABELS = ("model_name", "engine")
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class VllmMetrics:
    """One vLLM engine's families for one served model; ``serve()`` one request's worth of change per scrape."""

    def __init__(self, model: str = "demo-model") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, (model, "0")
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", LABELS, registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption.", LABELS, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*LABELS, "finished_reason"), registry=r)  # fmt: skip
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.iteration = Histogram("vllm:iteration_tokens_total", "Tokens per engine step.", LABELS,
                                   buckets=ITERATION_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.latency = {
            name: Histogram(name, name, LABELS, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
            for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                         "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                         "vllm:request_decode_time_seconds")
        }  # fmt: skip
        self.http = Counter("http_requests", "Total number of requests by method, status and handler.",
                            ("handler", "method", "status"), registry=r)  # fmt: skip
        # Also at @005a810b: inter-token time and the token and prefix-cache counters.
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              LABELS, buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.tokens = {
            name: Counter(name, name, LABELS, registry=r)
            for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
        }
        self.labels = labels
        self.running.labels(*labels).set(1)
        self.waiting.labels(*labels).set(0)
        self.kv.labels(*labels).set(0.25)
        self.preemptions.labels(*labels)
        for reason in ("stop", "length", "abort"):
            self.success.labels(*labels, reason)
        self.lock = threading.Lock()

    def one_request(self) -> None:
        """A request finished (stop) in 0.6 s, of which 0.1 s queued."""
        with self.lock:
            self.success.labels(*self.labels, "stop").inc()
            self.ttft.labels(*self.labels).observe(0.2)
            self.iteration.labels(*self.labels).observe(64)
            for name, seconds in (("vllm:e2e_request_latency_seconds", 0.6), ("vllm:request_queue_time_seconds", 0.1),
                                  ("vllm:request_inference_time_seconds", 0.5), ("vllm:request_prefill_time_seconds", 0.1),
                                  ("vllm:request_decode_time_seconds", 0.4)):  # fmt: skip
                self.latency[name].labels(*self.labels).observe(seconds)
            self.http.labels("/v1/completions", "POST", "2xx").inc()
            self.tpot.labels(*self.labels).observe(0.04)
            for name, n in (("vllm:prompt_tokens", 120), ("vllm:generation_tokens", 10), ("vllm:prefix_cache_queries", 120),
                            ("vllm:prefix_cache_hits", 30)):  # fmt: skip
                self.tokens[name].labels(*self.labels).inc(n)

    def exposition(self) -> bytes:
        self.one_request()
        with self.lock:
            return generate_latest(self.registry)


@contextlib.contextmanager
def serve(metrics: VllmMetrics) -> Iterator[int]:
    """Serve ``metrics`` at http://127.0.0.1:PORT/metrics (404 elsewhere); yields PORT."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
