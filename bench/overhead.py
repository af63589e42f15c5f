"""Benchmark: what llm-diag's request tracking costs, measured side by side in one run.

Three figures, each a ratio of two servers measured in the same interleaved rounds:

(a) sampled spans: ``llmdiag-10`` (``instrument_fastapi`` + ``RequestTracker`` with metrics, flight
    recorder and ``llm.*`` spans on 10 % of requests) over ``otel-edge-10`` (stock
    ``FastAPIInstrumentor`` server span, no send/receive spans, on 10 % of requests chosen at the edge,
    the rest skipping OpenTelemetry; no llm-diag code) -- target >= 0.95;
(b) tracker + metrics, no spans, no recorder (``llmdiag-0-noserver-norec``) over ``bare`` -- >= 0.90;
(c) realistic: the reference backend (``diag demo serve``'s app, its CPU model, the default 200 MiB
    checkpoint, one worker, one BLAS thread, ``PROMETHEUS_MULTIPROC_DIR`` set as ``diag demo serve``
    sets it) with full tracking -- admission (4 slots, queue 16), metrics, flight recorder, batch
    records, loader tracking, ``llm.*`` + server spans on 10 % -- (``demo-tracked``) over the same
    model path with no llm-diag at all (``demo-untracked``: same registry, batcher, tokenizer and
    handler, minus the tracker) -- within 1 %, i.e. >= 0.99.

(a) and (b) use a trivial ``async def`` endpoint returning a small dict (the worst case: nothing to
hide the cost behind), ``wrk -t1 -c16``; (c) POSTs a 64-byte prompt for 16 tokens, ``wrk -t1 -c4``
(4 = the backend's slots, so admission never queues and both sides batch alike). One uvicorn worker
per server (h11, no access log), all started up front as subprocesses (killed by PID). Every round
runs every trivial-endpoint server once (order reversed every other round) and the reference-backend
pair ``--demo-pairs`` times back to back (order alternating): (c) must resolve 1 % while a run's
throughput swings by +-10 % with the machine's other jobs, and two runs right after each other share
most of that noise. A ratio is computed per pair of back-to-back runs; the median, its 95 %
percentile-bootstrap interval and the range are printed, and a target counts as met only when the
whole interval clears it ("not shown" when the interval straddles it). Beside req/s, the server's CPU
time per request (``/proc/<pid>/stat``, all threads) is compared over the same pairs: it moves far
less with contention than throughput does. The load average is printed at start and end (1/5/15
min) and sampled before each run. Every traced mode exports to an SDK ``BatchSpanProcessor`` with an
exporter that only counts, so span creation is measured, not a network.

Other modes for diagnosis: ``otel`` (stock instrumentation, every request traced), ``otel-<pct>``
(the SDK's ``ParentBased(TraceIdRatioBased)`` sampler), ``llmdiag-<pct>[-norec][-notrack][-noserver]``
(spans at <pct> %; ``-norec`` no flight recorder; ``-notrack`` the handler does not track: edge
sampling + server spans alone; ``-noserver`` no server span: the tracker's ``llm.*`` spans are roots).

``--callgrind`` prints the tracking-cost figures by instruction count: the reference backend's app with the model
stubbed, untracked; with tracker + metrics + middleware only; with everything (admission, flight recorder, spans
on 10 %). One valgrind run per figure: after WARMUP requests the loop calls ``os.getppid()``, then N requests and
the tracker's flush, then ``os.getppid()`` again; callgrind dumps the main thread's counts at each call
(``--dump-before``), so the second part is exactly the N requests -- start-up, imports, warm-up and shutdown are
cut out without toggling the instrumentation. Counted on the event loop (the main thread, ``--separate-threads``);
the sampling draw is seeded, so a run repeats the same instructions and ``--runs`` shows how little they move.

``--instructions`` instead counts CPU instructions per request on the event loop with valgrind (callgrind), the
same way, for the ASGI app alone, driven in-process: deterministic, so it still compares modes when other jobs share
the machine and wall-clock figures swing by +-20 %. The reference-backend modes count there with the
model stubbed out (an instant answer), i.e. a request's event-loop path, where tracking's own cost
lies; ``demo-tracked`` takes ``-norec``, ``-nospans`` and ``-noadmission`` to take that cost apart
(e.g. ``demo-tracked-norec-nospans``), in either kind of run.

    .venv/bin/python bench/overhead.py [--rounds 9] [--duration 6] [--demo-duration 6] [--demo-pairs 3]
    .venv/bin/python bench/overhead.py --modes bare,otel,llmdiag-100      # any subset, same table
    .venv/bin/python bench/overhead.py --callgrind [--runs 3] [--jobs 3] [--callgrind-requests 200,500]
    .venv/bin/python bench/overhead.py --instructions [--modes bare,otel-edge-10,llmdiag-10]
    .venv/bin/python bench/overhead.py --instructions --modes demo-untracked,demo-tracked,demo-tracked-nospans
    .venv/bin/python bench/overhead.py --modes demo-untracked,demo-tracked --demo-max-tokens 128

Needs ``wrk`` (Debian package ``wrk``), and ``valgrind`` for ``--instructions``. Prints figures;
asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("bare", "otel-edge-10", "llmdiag-10", "llmdiag-0-noserver-norec", "demo-untracked", "demo-tracked")
# (label, numerator, denominator, target): the figures the run is for
FIGURES = (
    ("(a) llm-diag, spans 10 % / stock OTel server span 10 %", "llmdiag-10", "otel-edge-10", 0.95),
    ("(b) tracker + metrics, no spans / bare", "llmdiag-0-noserver-norec", "bare", 0.90),
    ("(c) reference backend, full tracking / untracked", "demo-tracked", "demo-untracked", 0.99),
)
DEMO_PROMPT = ("The quick brown fox jumps over the lazy dog. " * 2)[:64]  # short: tracking weighs more
DEMO_MAX_TOKENS = 16
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bootstrap_median_ci, free_port, process_cpu_s  # noqa: E402

# --------------------------------------------------------------------------- server side


def make_app(mode: str, recorder_dir: str) -> object:
    """The app of one mode. ``/ping`` is registered first in every mode: Starlette matches routes in
    order, so a helper route (``/spans``, ``/recorded``) in front of it would cost the instrumented
    modes a regex match per request that ``bare`` does not pay."""
    from fastapi import FastAPI

    app = FastAPI()
    if mode == "bare":

        @app.get("/ping")
        async def ping_bare() -> dict[str, bool]:
            return {"ok": True}

        return app

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def __init__(self) -> None:
            self.count = 0

        def export(self, spans: object) -> SpanExportResult:
            self.count += len(spans)  # type: ignore[arg-type]
            return SpanExportResult.SUCCESS

    exporter = CountingExporter()

    def add_spans_route() -> None:
        @app.get("/spans")
        def spans() -> dict[str, int]:
            provider.force_flush()
            return {"spans": exporter.count}

    parts = mode.split("-")
    if parts[0] == "otel" and len(parts) == 3 and parts[1] == "edge":
        return _stock_edge_sampled(app, int(parts[2]) / 100.0, exporter)
    if parts[0] == "otel":  # otel: stock instrumentation; otel-<pct>: with the SDK's TraceIdRatioBased sampler
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        sampler = ParentBased(TraceIdRatioBased(int(parts[1]) / 100.0)) if len(parts) > 1 else None
        provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))

        @app.get("/ping")
        async def ping_otel() -> dict[str, bool]:
            return {"ok": True}

        add_spans_route()
        FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
        return app

    from collectors.tracking import RequestTracker, instrument_fastapi

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    # llmdiag-<percent>[-norec][-notrack][-noserver]: spans sampled at <percent> %; -norec: no flight recorder;
    # -notrack: the handler does not use the tracker (what edge sampling + OTel server spans cost alone);
    # -noserver: no instrument_fastapi, so no OTel server span -- only the tracker's own llm.* spans
    ratio = int(parts[1]) / 100.0
    tracker = RequestTracker(
        model="bench",
        recorder=False if "norec" in parts else os.path.join(recorder_dir, f"{mode}.db"),
        tracer_provider=provider,
        span_sample_ratio=ratio,
        # under valgrind everything runs ~50x slower: scale the "did it wait?" threshold with it
        queue_span_min_s=float(os.environ.get("BENCH_QUEUE_SPAN_MIN_S", "0.001")),
    )

    if "notrack" in parts:  # diagnostic: edge sampling + OTel server spans only, the handler does not track

        @app.get("/ping")
        async def ping_untracked() -> dict[str, bool]:
            return {"ok": True}

    else:

        @app.get("/ping")
        async def ping_tracked() -> dict[str, bool]:
            async with tracker.request(route="/ping") as req:
                await req.acquire()
                return {"ok": True}

    app.state.tracker = tracker
    add_spans_route()

    @app.get("/recorded")
    def recorded() -> dict[str, int]:
        tracker.flush()
        writer = tracker.recorder
        return {"written": writer.written if writer else 0, "dropped": writer.dropped if writer else 0}

    if "noserver" in parts:  # no FastAPI server spans: the tracker samples its own llm.* spans (root spans here)
        from collectors.tracking.asgi import install_exception_handlers

        install_exception_handlers(app)
    else:
        instrument_fastapi(app, tracker)
    return app


def _stock_edge_sampled(app: Any, ratio: float, exporter: Any) -> Any:
    """The reference of the sampled mode: stock ``FastAPIInstrumentor`` (server span only, no send/receive
    spans) reached by ``ratio`` of the requests, chosen at the edge -- the others skip OpenTelemetry
    entirely. No llm-diag code at all: what tracing 10 % of requests costs without tracking them."""
    import random

    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))

    @app.get("/ping")
    async def ping_stock() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/spans")
    def spans() -> dict[str, int]:
        provider.force_flush()
        return {"spans": exporter.count}

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=["send", "receive"])
    stock_build = app.build_middleware_stack

    class EdgeSampler:
        def __init__(self, traced: Any, bare: Any) -> None:
            self.traced, self.bare, self.app = traced, bare, traced

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and random.random() >= ratio:
                await self.bare(scope, receive, send)
            else:
                await self.traced(scope, receive, send)

    def build() -> Any:
        outer = stock_build()  # ServerErrorMiddleware(OpenTelemetryMiddleware(rest of the stack))
        return EdgeSampler(outer, outer.app.app)

    app.build_middleware_stack = build
    return app


def make_demo_app(mode: str, recorder_dir: str, weights: str) -> object:
    """``demo-tracked``: the reference backend's own ``create_app`` with a full tracker (spans on 10 %,
    counted by an SDK exporter). ``demo-untracked``: the same model path without llm-diag.

    For taking the tracked mode apart: ``demo-tracked`` followed by any of ``-norec`` (no flight
    recorder), ``-nospans`` (nothing traced: no server or ``llm.*`` spans) and ``-noadmission`` (no
    slots, queue or inference deadline)."""
    from diag.demo.settings import DemoSettings

    settings = DemoSettings(weights_path=weights, recorder=os.path.join(recorder_dir, f"{mode}.db"))
    if mode == "demo-untracked":
        return _untracked_demo_app(settings)
    if not (mode.startswith("demo-tracked") and _MODE_RE.fullmatch(mode)):
        raise SystemExit(f"unknown mode {mode!r}: demo-untracked, or demo-tracked[-norec][-nospans][-noadmission]")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from collectors.tracking import AdmissionConfig, RequestTracker
    from diag.demo.app import create_app

    class CountingExporter(SpanExporter):
        """Counts the ``llm.inference`` spans: one per traced request (``--callgrind`` prints how many were traced)."""

        def __init__(self) -> None:
            self.inference = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.inference += sum(1 for span in spans if span.name == "llm.inference")
            return SpanExportResult.SUCCESS

    exporter = CountingExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    admission = AdmissionConfig(
        max_concurrency=settings.max_concurrency,
        queue_size=settings.queue_size,
        queue_timeout_s=settings.queue_timeout_s,
        inference_timeout_s=settings.request_timeout_s,
    )
    if "-norec" in mode:
        settings = dataclasses.replace(settings, recorder=None)
    tracker = RequestTracker(
        model=settings.model_name,
        recorder=settings.recorder or False,
        admission=None if "-noadmission" in mode else admission,
        tracer_provider=provider,
        span_sample_ratio=0.0 if "-nospans" in mode else 0.1,
    )
    app = create_app(settings, tracker)
    app.state.traced = lambda: (provider.force_flush(), exporter.inference)[1]  # requests traced so far
    return app


def _untracked_demo_app(settings: Any) -> object:
    """``diag.demo.app.create_app`` minus every ``# llm-diag:`` line: same weights registry, batcher,
    tokenizer, body model and response; no tracker, no admission, no /metrics."""
    import contextlib
    import time
    import uuid
    from collections.abc import AsyncIterator

    from fastapi import FastAPI, HTTPException

    from diag.demo.app import ROUTE, CompletionRequest
    from diag.demo.batcher import Batcher
    from diag.demo.model import ByteTokenizer
    from diag.demo.weights import WeightRegistry

    tokenizer = ByteTokenizer()
    parts: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = WeightRegistry(
            settings.weights_path, mode=settings.preload, refresh=settings.refresh, ttl_s=settings.refresh_ttl_s
        )
        batcher = Batcher(
            lambda: registry.current,
            mode=settings.batching,
            max_batch_requests=settings.max_batch_requests,
            max_batch_tokens=settings.max_batch_tokens,
            batch_wait_s=settings.batch_wait_s,
            router_skew=settings.router_skew,
            capacity_factor=settings.expert_capacity_factor,
        )
        batcher.start()
        parts["registry"], parts["batcher"] = registry, batcher
        try:
            yield
        finally:
            batcher.stop()
            registry.close()

    app = FastAPI(title="llm-diag demo backend", lifespan=lifespan)

    async def completions(body: CompletionRequest) -> dict[str, Any]:
        registry: WeightRegistry = parts["registry"]
        batcher: Batcher = parts["batcher"]
        n = tokenizer.count(body.prompt)
        if settings.max_prompt_tokens is not None and n > settings.max_prompt_tokens:
            raise HTTPException(413, f"prompt is {n} tokens; this server accepts {settings.max_prompt_tokens}")
        if body.max_tokens > settings.max_output_tokens:
            raise HTTPException(400, f"max_tokens {body.max_tokens} is over the limit of {settings.max_output_tokens}")
        registry.for_request()
        ids = tokenizer.encode(body.prompt)
        done = await batcher.submit(ids, body.max_tokens)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": settings.model_name,
            "choices": [{"index": 0, "text": tokenizer.decode(done.ids), "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": n, "completion_tokens": len(done.ids), "total_tokens": n + len(done.ids)},
            "system_fingerprint": f"pid-{os.getpid()}",
        }

    # The annotation is a string here (``from __future__ import annotations``) naming a class this
    # module does not import at top level: give FastAPI the class, or it reads ``body`` as a query.
    completions.__annotations__["body"] = CompletionRequest
    app.post(ROUTE)(completions)
    return app


def serve(mode: str, port: int, recorder_dir: str, weights: str | None) -> None:
    import uvicorn

    if mode.startswith("demo"):
        app = make_demo_app(mode, recorder_dir, weights or "")
        _count_batches(app)
    else:
        app = make_app(mode, recorder_dir)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http="h11")


def _count_batches(app: Any) -> None:
    """Count the batches the reference backend runs and the requests in them, served at ``/batches``: the
    requests per batch tell whether tracking changed how batches form (a smaller batch costs more model time
    per request). Patched into this server process only, on the class, after the completion route was added
    (so that route is matched first, as in the app)."""
    from diag.demo.batcher import Batcher

    counts = {"batches": 0, "requests": 0}
    run_batch = Batcher._run_batch

    def counting(self: Batcher, batch: list[Any]) -> None:
        counts["batches"] += 1
        counts["requests"] += len(batch)
        run_batch(self, batch)

    Batcher._run_batch = counting  # type: ignore[method-assign]
    app.get("/batches")(lambda: dict(counts))


# --------------------------------------------------------------------------- driver


def _wait_up(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server on {port} did not come up")


_RPS = re.compile(r"Requests/sec:\s+([0-9.]+)")
_LAT = re.compile(r"^\s+(50|99)%\s+([0-9.]+)(us|ms|s)\s*$", re.MULTILINE)
_NON2XX = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")


def _wrk(url: str, duration: int, connections: int, script: str | None = None) -> tuple[float, dict[str, float]]:
    """Requests per second and p50/p99 latency (ms) of one wrk run. Any non-2xx response is an error:
    a server that refuses work would look fast."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", *(["-s", script] if script else []), url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    m = _RPS.search(out)
    if not m:
        raise RuntimeError(f"could not parse wrk output:\n{out}")
    bad = _NON2XX.search(out)
    if bad:
        raise RuntimeError(f"{url}: {bad.group(1)} non-2xx responses:\n{out}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    lat = {f"p{q}": float(v) * scale[u] for q, v, u in _LAT.findall(out)}
    return float(m.group(1)), lat


# --------------------------------------------------------------------------- CPU instructions (valgrind)


def asgi_loop(mode: str, n: int, weights: str | None = None, warmup: int = 0) -> None:
    """Drive ``n`` requests straight through the ASGI app (no sockets, no uvicorn): the code under test only.

    With ``warmup``: that many requests first, then ``os.getppid()`` (``MARKER``), the ``n`` requests and the
    tracker's flush, then ``MARKER`` again -- callgrind's ``--dump-before`` on it cuts out exactly the measured
    requests (nothing else here calls it)."""
    import asyncio
    import random

    if os.environ.get("BENCH_SEED"):  # the traced tenth is the same requests in every count: deterministic figures
        random.seed(int(os.environ["BENCH_SEED"]))
    recorder_dir = tempfile.mkdtemp(prefix="llmdiag-bench-")
    if mode.startswith("demo"):
        app: Any = _stub_model_demo_app(mode, recorder_dir, weights or "")
        body = json.dumps({"prompt": DEMO_PROMPT, "max_tokens": DEMO_MAX_TOKENS}).encode()
        method, path = "POST", "/v1/completions"
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    else:
        app = make_app(mode, recorder_dir)
        body, method, path, headers = b"", "GET", "/ping", []
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"wrk"), (b"accept", b"*/*"), *headers],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    statuses: set[int] = set()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.add(message["status"])

    async def run() -> None:
        lifespan = app.router.lifespan_context(app) if mode.startswith("demo") else contextlib.nullcontext()
        async with lifespan:
            for _ in range(warmup):  # first-request paths, caches: not measured
                await app(dict(scope), receive, send)
            traced = getattr(app.state, "traced", lambda: 0)
            traced_before = traced() if warmup else 0  # before the marker: not counted
            if warmup:
                os.getppid()  # MARKER: callgrind dumps here
            for _ in range(n):
                await app(dict(scope), receive, send)
            tracker = getattr(app.state, "tracker", None)
            if tracker is not None:
                tracker.flush()  # the recorder's work (and the batched metrics') belongs to the requests
            if warmup:
                os.getppid()  # MARKER
                print(f"traced {traced() - traced_before}", flush=True)

    asyncio.run(run())
    tracker = getattr(app.state, "tracker", None)
    if tracker is not None and not mode.startswith("demo"):
        tracker.close()  # the demo app's lifespan closed its own
    shutil.rmtree(recorder_dir, ignore_errors=True)
    if statuses != {200}:
        raise SystemExit(f"{mode}: responses {sorted(statuses)}, expected only 200")


def _stub_model_demo_app(mode: str, recorder_dir: str, weights: str) -> Any:
    """The reference backend's app with the model thread replaced by an instant answer (16 tokens, a batch of
    4): what remains is the event-loop path of a request, which is where tracking's own cost lies, without
    the model's CPU swamping the count."""
    from diag.demo.batcher import Batcher, Completion

    async def submit(
        self: Batcher, ids: list[int], max_tokens: int, on_first_token: Any = None, on_scheduled: Any = None
    ) -> Completion:
        if on_scheduled is not None:
            on_scheduled()
        if on_first_token is not None:
            on_first_token()
        return Completion(list(ids[:max_tokens]), len(ids), 4, 4 * len(ids))

    Batcher.submit = submit  # type: ignore[method-assign]
    return make_demo_app(mode, recorder_dir, weights)


# The three figures of ``--callgrind``: (label, mode, target of the instructions added over the untracked app).
CALLGRIND_FIGURES = (
    ("untracked (the reference backend's app, model stubbed)", "demo-untracked", None),
    ("tracker + metrics + middleware", "demo-tracked-norec-nospans-noadmission", 100_000),
    ("+ admission, flight recorder, spans on 10 %", "demo-tracked", 250_000),
)
CALLGRIND_SEED = 20261203  # the sampling draws' seed in the counted child: the same requests are traced every run


TRACED: dict[str, int] = {}  # requests traced among the counted ones, per mode (the last run's)
MARKER = "os_getppid*"  # CPython's C function behind os.getppid(): asgi_loop calls it around the measured requests


def _count_marked(mode: str, warmup: int, n: int, weights: str | None) -> float:
    """Event-loop instructions per request of one valgrind run: callgrind dumps the main thread's counts at each
    ``MARKER`` (``--dump-before``), so the second part is exactly the ``n`` measured requests (and the tracker's
    flush after them) -- no start-up, imports, warm-up or shutdown in it, and no toggling of the instrumentation.
    The main thread is the event loop (``--separate-threads=yes``): what a request's latency and the server's
    throughput pay for; the recorder's writer and the metrics flusher run on their own threads."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_QUEUE_SPAN_MIN_S": "1.0", "BENCH_SEED": str(CALLGRIND_SEED)}
    env["PYTHONHASHSEED"] = "0"  # str hashes (dict and set layouts) the same in every run: ~2k/request of spread otherwise
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    work = tempfile.mkdtemp(prefix="llmdiag-bench-cg-")
    try:
        if mode.startswith("demo-tracked"):  # as in the wrk runs: `diag demo serve` always sets it
            os.makedirs(os.path.join(work, "prom"))
            env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(work, "prom")
        prefix = os.path.join(work, "cg.out")
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--dump-before={MARKER}",
             f"--callgrind-out-file={prefix}", sys.executable, __file__, "--asgi-loop", mode, "--requests", str(n),
             "--warmup", str(warmup), *(["--weights", weights] if weights else [])],
            env=env, cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"{mode}: valgrind exited {out.returncode}:\n{out.stderr[-2000:]}")
        parts = sorted(Path(work).glob("cg.out.*-01"))
        if [p.name for p in parts] != ["cg.out.1-01", "cg.out.2-01"]:
            raise RuntimeError(f"{mode}: expected two marker dumps of the main thread, got {[p.name for p in parts]}")
        m = re.search(r"^totals:\s*(\d+)", parts[1].read_text(errors="replace"), re.MULTILINE)
        if not m:
            raise RuntimeError(f"{mode}: no totals in {parts[1]}")
        traced = re.search(r"^traced (\d+)$", out.stdout, re.MULTILINE)
        TRACED[mode] = int(traced.group(1)) if traced else 0
        return int(m.group(1)) / n
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stub_weights(modes: list[str]) -> str | None:
    """A small checkpoint, made once, for the reference-backend modes (the model never runs: ``_stub_model_demo_app``)."""
    if not any(m.startswith("demo") for m in modes):
        return None
    from diag.demo.server import prepare_weights
    from diag.demo.weights import ModelConfig, default_weights_dir

    return str(prepare_weights(default_weights_dir(), ModelConfig.for_budget(8)))


def instructions(modes: list[str]) -> None:
    """CPU instructions per request on the event loop (callgrind), ASGI app only: deterministic, unlike wall-clock on
    a busy box. 300 warm-up requests, 1000 counted (see ``_count_marked``)."""
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found: apt-get install -y valgrind")
    weights = _stub_weights(modes)
    per_request = {}
    width = max(16, *map(len, modes))
    for mode in modes:
        per_request[mode] = _count_marked(mode, 300, 1000, weights)
        print(f"{mode:<{width}} {per_request[mode] / 1000:8.1f}k instructions/request on the event loop", flush=True)
    for base_mode, what in (
        ("bare", "ASGI app only; add ~630k for uvicorn + h11 + sockets per request on this box"),
        ("demo-untracked", "the reference backend's event-loop path, model stubbed out"),
    ):
        if base_mode not in per_request:
            continue
        base = per_request[base_mode]
        print(f"\nadded over {base_mode} ({what}):")
        for mode in modes:
            if mode.startswith("demo") == base_mode.startswith("demo"):
                print(f"{mode:<{width}} {(per_request[mode] - base) / 1000:+8.1f}k")


def callgrind(runs: int, warmup: int, n: int, jobs: int = 1) -> None:
    """The tracking-cost figures by instruction count: untracked, tracker + metrics + middleware, everything with
    spans on 10 % -- each ``runs`` times, with the spread; event-loop instructions per request (``_count_marked``)."""
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found: apt-get install -y valgrind")
    if runs < 1 or warmup < 1 or n < 1:
        sys.exit("--runs and both numbers of --callgrind-requests must be >= 1")
    modes = [mode for _, mode, _ in CALLGRIND_FIGURES]
    weights = _stub_weights(modes)
    loop: dict[str, list[float]] = {m: [] for m in modes}
    started = time.strftime("%H:%M:%S", time.gmtime())
    from concurrent.futures import ThreadPoolExecutor

    for r in range(runs):
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # counts do not depend on what runs beside them
            counted = list(pool.map(lambda mode: _count_marked(mode, warmup, n, weights), modes))
        for mode, value in zip(modes, counted, strict=True):
            loop[mode].append(value)
        print(f"run {r + 1}: " + ", ".join(f"{m} {loop[m][-1] / 1000:.1f}k" for m in modes), flush=True)
    print(
        f"\ncallgrind, {runs} run(s) from {started} to {time.strftime('%H:%M:%S', time.gmtime())} UTC; event-loop "
        f"instructions per request over {n} requests after {warmup} warm-up; sampling seeded ({CALLGRIND_SEED})\n"
    )
    base = statistics.median(loop[modes[0]])
    header = f"{'figure':<56} {'per request':>11} {'spread':>9} {'added':>9} {'target':>15}"
    print(header)
    print("-" * len(header))
    for label, mode, target in CALLGRIND_FIGURES:
        med = statistics.median(loop[mode])
        spread = max(loop[mode]) - min(loop[mode])
        added = med - base
        verdict = "" if target is None else (f"<= {target // 1000}k " + ("met" if added <= target else "NOT met"))
        print(
            f"{label:<56} {med / 1000:>10.1f}k {spread / 1000:>8.2f}k "
            f"{'' if target is None else f'{added / 1000:+.1f}k':>9} {verdict:>15}"
        )
    print("\nper-run event-loop instructions/request: " + json.dumps({m: [round(v) for v in loop[m]] for m in modes}))
    print(f"traced among the {n} counted requests (llm.inference spans): " + json.dumps(TRACED))


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _loadavgs() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return ", ".join(Path("/proc/loadavg").read_text().split()[:3])


def _runs(mode: str, demo_pairs: int) -> int:
    """Runs of ``mode`` in one round: the reference-backend pair runs ``demo_pairs`` times."""
    return demo_pairs if mode.startswith("demo") else 1


def _round_order(modes: list[str], r: int, demo_pairs: int) -> list[str]:
    """The runs of round ``r``: every trivial-endpoint mode once, the reference-backend modes ``demo_pairs``
    times back to back, order reversed every other round and, for the pair, every other repetition.

    Why the pair repeats inside a round: (c) has to resolve 1 % while a run's throughput moves by
    +-10 % with the other jobs on the machine; the noise is slow next to one run, so two runs right
    after each other share most of it, and many such pairs narrow the interval of their median ratio.
    """
    trivial = [m for m in modes if not m.startswith("demo")]
    demo = [m for m in modes if m.startswith("demo")]
    pairs: list[str] = []
    for k in range(demo_pairs):
        pairs += demo if (r + k) % 2 == 0 else list(reversed(demo))
    order = trivial + pairs
    return order if r % 2 == 0 else list(reversed(trivial)) + pairs


def _verdict(lo: float, med: float, hi: float, target: float) -> str:
    """Met only when the whole interval clears the target; "not shown" when the interval straddles it."""
    if lo >= target:
        return "met"
    if hi < target:
        return "NOT met"
    return "not shown (interval straddles the target)" if med >= target else "not met (interval straddles the target)"


class Servers:
    """The servers of one run, started up front (one subprocess each) and stopped by PID."""

    def __init__(self, modes: list[str], recorder_dir: str, weights: str | None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = "1"  # as `diag demo serve --threads 1` (its default)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        for mode in modes:
            mode_env = env
            if mode.startswith("demo-tracked"):  # `diag demo serve` always sets it (metrics summed over workers)
                mode_env = {**env, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(dir=recorder_dir, prefix="prom-")}
            self.ports[mode] = free_port()
            cmd = [sys.executable, __file__, "--serve", mode, "--port", str(self.ports[mode]), "--recorder-dir", recorder_dir]
            if weights:
                cmd += ["--weights", weights]
            self.procs[mode] = subprocess.Popen(cmd, env=mode_env, cwd=ROOT)
        for mode in modes:
            _wait_up(self.ports[mode], self.procs[mode], timeout=120.0)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def _prepare_demo_weights() -> str:
    """The checkpoint `diag demo serve` uses by default (200 MiB), generated once into the user cache."""
    from diag.demo.server import prepare_weights
    from diag.demo.weights import ModelConfig, default_weights_dir

    return str(prepare_weights(default_weights_dir(), ModelConfig.for_budget(200)))


def _demo_script(directory: str, max_tokens: int) -> str:
    path = os.path.join(directory, "post.lua")
    body = json.dumps({"prompt": DEMO_PROMPT, "max_tokens": max_tokens})
    Path(path).write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\nwrk.headers["Content-Type"] = "application/json"\n'
    )
    return path


def run(args: argparse.Namespace, modes: list[str]) -> None:
    recorder_dir = tempfile.mkdtemp(prefix="llmdiag-bench-")
    weights = _prepare_demo_weights() if any(m.startswith("demo") for m in modes) else None
    script = _demo_script(recorder_dir, args.demo_max_tokens)

    def load(mode: str, duration: int) -> tuple[float, dict[str, float]]:
        port = servers.ports[mode]
        if mode.startswith("demo"):
            return _wrk(f"http://127.0.0.1:{port}/v1/completions", duration, args.demo_connections, script)
        return _wrk(f"http://127.0.0.1:{port}/ping", duration, args.connections)

    rps: dict[str, list[float]] = {m: [] for m in modes}
    p99: dict[str, list[float]] = {m: [] for m in modes}
    cpu_us: dict[str, list[float]] = {m: [] for m in modes}
    loads: list[float] = []
    loads_at: tuple[str, str] = ("?", "?")
    extras: dict[str, str] = {}
    started = time.strftime("%H:%M:%S", time.gmtime())
    servers = Servers(modes, recorder_dir, weights)
    try:
        for mode in modes:  # warm-up: imports, first-request paths, the model's caches
            load(mode, 2)
        load_start = _loadavgs()
        for r in range(args.rounds):
            for mode in _round_order(modes, r, args.demo_pairs):
                duration = args.demo_duration if mode.startswith("demo") else args.duration
                loads.append(_loadavg())
                pid = servers.procs[mode].pid
                cpu0 = process_cpu_s(pid)
                value, lat = load(mode, duration)
                cpu1 = process_cpu_s(pid)
                rps[mode].append(value)
                p99[mode].append(lat.get("p99", float("nan")))
                cpu_us[mode].append((cpu1 - cpu0) / max(1.0, value * duration) * 1e6)
            print(
                f"round {r + 1} (load {_loadavg():.1f}): "
                + ", ".join(f"{m} {'/'.join(f'{v:.0f}' for v in rps[m][-_runs(m, args.demo_pairs) :])}" for m in modes),
                flush=True,
            )
        loads_at = (load_start, _loadavgs())
        import httpx

        for mode in modes:
            if mode.startswith(("otel", "llmdiag")) and mode != "bare":
                extras[mode] = httpx.get(f"http://127.0.0.1:{servers.ports[mode]}/spans").text
            if mode.startswith("llmdiag"):
                extras[mode] += " " + httpx.get(f"http://127.0.0.1:{servers.ports[mode]}/recorded").text
            if mode.startswith("demo"):
                counted = httpx.get(f"http://127.0.0.1:{servers.ports[mode]}/batches").json()
                per_batch = counted["requests"] / max(1, counted["batches"])
                extras[mode] = f"{counted['batches']} batches, {per_batch:.2f} requests per batch"
    finally:
        servers.stop()
        shutil.rmtree(recorder_dir, ignore_errors=True)
    _report(args, modes, rps, p99, cpu_us, loads, extras, started, loads_at)


def _report(
    args: argparse.Namespace,
    modes: list[str],
    rps: dict[str, list[float]],
    p99: dict[str, list[float]],
    cpu_us: dict[str, list[float]],
    loads: list[float],
    extras: dict[str, str],
    started: str,
    loads_at: tuple[str, str],
) -> None:
    print(
        f"\n{args.rounds} interleaved rounds from {started} to {time.strftime('%H:%M:%S', time.gmtime())} UTC; "
        f"{os.cpu_count()} CPUs; load average (1/5/15 min) at start {loads_at[0]}, at end {loads_at[1]}; "
        f"1 min load before each run: median {statistics.median(loads):.1f}, {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        f"trivial endpoint: wrk -t1 -c{args.connections} -d{args.duration}s GET /ping, once per round; reference "
        f"backend: wrk -t1 -c{args.demo_connections} -d{args.demo_duration}s POST /v1/completions "
        f"({len(DEMO_PROMPT)}-byte prompt, max_tokens {args.demo_max_tokens}), {args.demo_pairs} back-to-back pairs per round\n"
    )
    header = f"{'mode':<26} {'runs':>4} {'req/s':>8} {'range':>13} {'p99 ms':>7} {'cpu us/req':>10}"
    print(header)
    print("-" * len(header))
    for mode in modes:
        print(
            f"{mode:<26} {len(rps[mode]):>4} {statistics.median(rps[mode]):>8.0f} "
            f"{min(rps[mode]):>6.0f}-{max(rps[mode]):<6.0f} {statistics.median(p99[mode]):>7.2f} "
            f"{statistics.median(cpu_us[mode]):>10.0f}"
        )
    print(
        "\nratios: one per pair of back-to-back runs (numerator / denominator); median, 95 % bootstrap interval of the"
        "\nmedian, range; verdict on the interval. CPU: server CPU per request, numerator over denominator, same pairs:"
    )
    for label, num, den, target in FIGURES:
        if num in rps and den in rps:
            ratios = [a / b for a, b in zip(rps[num], rps[den], strict=True) if b > 0]
            if not ratios:
                print(f"  {label}: no pair with requests served by {den}")
                continue
            med = statistics.median(ratios)
            lo, hi = bootstrap_median_ci(ratios)
            served = [n > 0 and d > 0 for n, d in zip(rps[num], rps[den], strict=True)]
            cpu = [a / b for a, b, ok in zip(cpu_us[num], cpu_us[den], served, strict=True) if ok]
            clo, chi = bootstrap_median_ci(cpu) if cpu else (float("nan"), float("nan"))
            cpu = cpu or [float("nan")]
            print(f"  {label}")
            print(
                f"      req/s ratio {med:.3f}  95 % CI {lo:.3f}-{hi:.3f}  range {min(ratios):.3f}-{max(ratios):.3f}  "
                f"n={len(ratios)}  target >= {target:.2f}: {_verdict(lo, med, hi, target)}"
            )
            print(
                f"      CPU/request {(statistics.median(cpu) - 1) * 100:+.1f} %  95 % CI {(clo - 1) * 100:+.1f} .. "
                f"{(chi - 1) * 100:+.1f} %  (at full CPU, req/s ratio ~ 1 / this: {1 / statistics.median(cpu):.3f})"
            )
    for mode in modes:
        if mode != "bare" and "bare" in rps and not mode.startswith("demo"):
            ratios = [a / b for a, b in zip(rps[mode], rps["bare"], strict=True) if b > 0]
            print(f"  {mode + ' / bare':<58} median {statistics.median(ratios):.3f}")
    print("\nper-run req/s: " + json.dumps({m: [round(v) for v in rps[m]] for m in modes}))
    print("per-run server CPU us/request: " + json.dumps({m: [round(v) for v in cpu_us[m]] for m in modes}))
    for mode, text in extras.items():
        print(f"{mode}: {text}")


_PCT = r"(?:100|[1-9]?[0-9])"
_MODE_RE = re.compile(
    rf"bare|otel(?:-{_PCT}|-edge-{_PCT})?|llmdiag-{_PCT}(?:-norec|-notrack|-noserver)*"
    r"|demo-untracked|demo-tracked(?:-norec|-nospans|-noadmission)*"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--duration", type=int, default=6, help="seconds per trivial-endpoint wrk run")
    parser.add_argument("--demo-duration", type=int, default=6, help="seconds per reference-backend wrk run")
    parser.add_argument(
        "--demo-pairs", type=int, default=3, help="back-to-back reference-backend pairs per round (more pairs: narrower (c))"
    )
    parser.add_argument(
        "--demo-max-tokens",
        type=int,
        default=DEMO_MAX_TOKENS,
        help=f"tokens each reference-backend request generates (default {DEMO_MAX_TOKENS}: short, so tracking weighs "
        "most; the backend accepts up to 512)",
    )
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--demo-connections", type=int, default=4)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated; default {','.join(MODES)}; also otel, otel-<pct>, otel-edge-<pct>, "
        "llmdiag-<pct>[-norec][-notrack][-noserver] (e.g. llmdiag-0-norec)",
    )
    parser.add_argument(
        "--instructions", action="store_true", help="count CPU instructions per request with valgrind instead of wrk"
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="the tracking-cost figures by instruction count (valgrind): untracked, tracker + metrics + middleware, "
        "everything with spans on 10 %%; see --runs and --callgrind-requests",
    )
    parser.add_argument("--runs", type=int, default=3, help="--callgrind: runs of each figure (the spread is printed)")
    parser.add_argument("--jobs", type=int, default=1, help="--callgrind: valgrind runs side by side")
    parser.add_argument(
        "--callgrind-requests",
        default="200,500",
        help="--callgrind: WARMUP,N: N requests counted after WARMUP uncounted ones",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--asgi-loop", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--recorder-dir", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.recorder_dir, args.weights)
        return
    if args.asgi_loop:
        asgi_loop(args.asgi_loop, args.requests, args.weights, args.warmup)
        return
    if args.callgrind:
        try:
            warmup, n = (int(v) for v in args.callgrind_requests.split(","))
        except ValueError:
            sys.exit(f"--callgrind-requests {args.callgrind_requests!r}: two integers WARMUP,N, e.g. 200,500")
        callgrind(args.runs, warmup, n, args.jobs)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if not _MODE_RE.fullmatch(m)]
    if unknown or not modes:
        sys.exit(
            f"unknown mode(s) {', '.join(unknown) or '(none given)'}: bare, otel, otel-<pct>, otel-edge-<pct>, "
            "llmdiag-<pct>[-norec][-notrack][-noserver], demo-untracked, demo-tracked[-norec][-nospans][-noadmission]"
        )
    if args.instructions:
        instructions(modes)
        return
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install -y wrk")
    if args.rounds < 1 or args.duration < 1 or args.demo_duration < 1 or args.demo_pairs < 1:
        sys.exit("--rounds, --duration, --demo-duration and --demo-pairs must be >= 1")
    if not 1 <= args.demo_max_tokens <= 512:
        sys.exit("--demo-max-tokens must be between 1 and 512 (the reference backend's limit)")
    run(args, modes)


if __name__ == "__main__":
    main()
