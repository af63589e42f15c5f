"""Benchmark: what llm-diag's request tracking costs a trivial FastAPI endpoint, next to stock OpenTelemetry.

Modes (same ``async def`` endpoint returning a small dict; one uvicorn worker each, h11, no access log):

- ``bare``            -- no instrumentation;
- ``otel``            -- stock ``FastAPIInstrumentor.instrument_app`` (default: server + send/receive spans);
  ``otel-<pct>`` the same with the SDK's ``ParentBased(TraceIdRatioBased)`` sampler (stock sampling);
- ``llmdiag-10``      -- ``instrument_fastapi`` + ``RequestTracker`` (metrics + flight recorder), spans 10 %;
- ``llmdiag-100``     -- the same with spans for every request (server span + llm.inference, and
                         llm.queue when the request waited >= 1 ms);
- diagnostics: ``llmdiag-<pct>[-norec][-notrack]`` -- other span percentages, without the flight
  recorder (``-norec``), or with the handler not tracking at all (``-notrack``: the cost of edge
  sampling plus the stock OTel server span on the sampled requests, i.e. the floor of a mode), or
  without ``instrument_fastapi`` (``-noserver``: no OTel server span; the tracker samples and its
  ``llm.*`` spans are roots -- what an app that does not use the FastAPI instrumentation pays).

Every traced mode uses an SDK TracerProvider + BatchSpanProcessor with an exporter that only counts,
so span *creation* is measured, not a network. The servers run side by side as subprocesses
(killed by PID); load is ``wrk -t1 -cC -dDs`` per mode, modes interleaved (order reversed every
other round), ``--rounds`` rounds; the median per mode is reported. Latency per request comes from
sequential httpx requests (median), and server CPU per request from the server's /proc/<pid>/stat
utime+stime over each wrk run.

``--instructions`` instead counts CPU instructions per request with valgrind (callgrind) for the
ASGI app alone, driven in-process: deterministic, so it still compares modes when other jobs share
the machine and wall-clock figures swing by +-20 %.

Targets: llmdiag-10 >= 0.85x bare; llmdiag-100 no slower than stock otel.

    .venv/bin/python bench/overhead.py [--rounds 3] [--duration 8] [--connections 16] [--sequential 2000]
    .venv/bin/python bench/overhead.py --instructions [--modes bare,otel,llmdiag-10,llmdiag-100]

Needs ``wrk`` (Debian package ``wrk``), and ``valgrind`` for ``--instructions``. Prints figures;
asserts nothing.
"""

from __future__ import annotations

import argparse
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

MODES = ("bare", "otel", "llmdiag-10", "llmdiag-100")
ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def serve(mode: str, port: int, recorder_dir: str) -> None:
    import uvicorn

    uvicorn.run(make_app(mode, recorder_dir), host="127.0.0.1", port=port, log_level="warning", access_log=False, http="h11")


# --------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


_RPS = re.compile(r"Requests/sec:\s+([0-9.]+)")
_LAT = re.compile(r"^\s+(50|99)%\s+([0-9.]+)(us|ms|s)\s*$", re.MULTILINE)


def _wrk(port: int, duration: int, connections: int) -> tuple[float, dict[str, float]]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", f"http://127.0.0.1:{port}/ping"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    m = _RPS.search(out)
    if not m:
        raise RuntimeError(f"could not parse wrk output:\n{out}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    lat = {f"p{q}": float(v) * scale[u] for q, v, u in _LAT.findall(out)}
    return float(m.group(1)), lat


def _sequential_ms(port: int, n: int) -> float:
    import httpx

    url = f"http://127.0.0.1:{port}/ping"
    samples = []
    with httpx.Client() as client:
        for _ in range(50):
            client.get(url)
        for _ in range(n):
            t0 = time.perf_counter()
            client.get(url)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


# --------------------------------------------------------------------------- CPU instructions (valgrind)


def asgi_loop(mode: str, n: int) -> None:
    """Drive ``n`` requests straight through the ASGI app (no sockets, no uvicorn): the code under test only."""
    import asyncio

    app: Any = make_app(mode, tempfile.mkdtemp(prefix="llmdiag-bench-"))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": "/ping", "raw_path": b"/ping", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"wrk"), (b"accept", b"*/*")],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    async def run() -> None:
        for _ in range(n):
            await app(dict(scope), receive, send)

    asyncio.run(run())
    tracker = getattr(app.state, "tracker", None)
    if tracker is not None:
        tracker.flush()  # the recorder's work belongs to the requests


def instructions(modes: list[str]) -> None:
    """CPU instructions per request (callgrind), ASGI app only: deterministic, unlike wall-clock on a busy box."""
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found: apt-get install -y valgrind")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_QUEUE_SPAN_MIN_S": "1.0"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)

    def count(mode: str, n: int) -> int:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__, "--asgi-loop", mode,
             "--requests", str(n)],
            env=env, cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        m = re.search(r"Collected : (\d+)", out.stderr)
        if not m:
            raise RuntimeError(out.stderr[-2000:])
        return int(m.group(1))

    per_request = {}
    for mode in modes:
        per_request[mode] = (count(mode, 1300) - count(mode, 300)) / 1000
        print(f"{mode:<16} {per_request[mode] / 1000:8.0f}k instructions/request", flush=True)
    if "bare" in per_request:
        base = per_request["bare"]
        print("\nadded over bare (ASGI app only; add ~630k for uvicorn + h11 + sockets per request on this box):")
        for mode in modes:
            print(f"{mode:<16} {(per_request[mode] - base) / 1000:+8.0f}k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--sequential", type=int, default=2000)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, from {MODES}; also otel-<pct>, llmdiag-<pct>[-norec][-notrack][-noserver] (e.g. llmdiag-0-norec)",
    )
    parser.add_argument(
        "--instructions", action="store_true", help="count CPU instructions per request with valgrind instead of wrk"
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--asgi-loop", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--recorder-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.recorder_dir)
        return
    if args.asgi_loop:
        asgi_loop(args.asgi_loop, args.requests)
        return
    if args.instructions:
        instructions([m for m in args.modes.split(",") if m])
        return
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install -y wrk")
    modes = [m for m in args.modes.split(",") if m]
    recorder_dir = tempfile.mkdtemp(prefix="llmdiag-bench-")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    try:
        for mode in modes:
            ports[mode] = _free_port()
            procs[mode] = subprocess.Popen(
                [sys.executable, __file__, "--serve", mode, "--port", str(ports[mode]), "--recorder-dir", recorder_dir],
                env=env,
                cwd=ROOT,
            )
        for mode in modes:
            _wait_up(ports[mode], procs[mode])
        for mode in modes:  # warm-up (imports, first-request paths)
            _wrk(ports[mode], 2, args.connections)
        rps: dict[str, list[float]] = {m: [] for m in modes}
        p50: dict[str, list[float]] = {m: [] for m in modes}
        p99: dict[str, list[float]] = {m: [] for m in modes}
        cpu_us: dict[str, list[float]] = {m: [] for m in modes}
        seq_ms: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else list(reversed(modes))  # interleave, alternate order
            for mode in order:
                pid = procs[mode].pid
                cpu0 = _cpu_s(pid)
                value, lat = _wrk(ports[mode], args.duration, args.connections)
                cpu1 = _cpu_s(pid)
                rps[mode].append(value)
                p50[mode].append(lat.get("p50", float("nan")))
                p99[mode].append(lat.get("p99", float("nan")))
                cpu_us[mode].append((cpu1 - cpu0) / max(1.0, value * args.duration) * 1e6)
                if args.sequential:
                    seq_ms[mode].append(_sequential_ms(ports[mode], args.sequential))
            print(f"round {r + 1}: " + ", ".join(f"{m} {rps[m][-1]:.0f}" for m in modes), flush=True)
        extras: dict[str, str] = {}
        import httpx

        for mode in modes:
            if mode != "bare":
                extras[mode] = httpx.get(f"http://127.0.0.1:{ports[mode]}/spans").text
            if mode.startswith("llmdiag"):
                extras[mode] += " " + httpx.get(f"http://127.0.0.1:{ports[mode]}/recorded").text
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(recorder_dir, ignore_errors=True)

    med = {m: statistics.median(rps[m]) for m in modes}
    base = med.get("bare")
    base_seq = statistics.median(seq_ms["bare"]) if seq_ms.get("bare") else None
    base_cpu = statistics.median(cpu_us["bare"]) if "bare" in cpu_us else None
    print(
        f"\nwrk -t1 -c{args.connections} -d{args.duration}s x {args.rounds} rounds (median), "
        f"{args.sequential} sequential httpx requests per round, {os.cpu_count()} CPUs\n"
    )
    header = (
        f"{'mode':<12} {'req/s':>8} {'x bare':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'seq ms':>7} {'+lat us':>8} {'cpu us/req':>10} {'+cpu us':>8}"
    )
    print(header)
    print("-" * len(header))
    for mode in modes:
        seq = statistics.median(seq_ms[mode]) if seq_ms[mode] else float("nan")
        cpu = statistics.median(cpu_us[mode])
        ratio = med[mode] / base if base else float("nan")
        added = (seq - base_seq) * 1e3 if base_seq is not None else float("nan")
        added_cpu = cpu - base_cpu if base_cpu is not None else float("nan")
        print(
            f"{mode:<12} {med[mode]:>8.0f} {ratio:>7.2f} {statistics.median(p50[mode]):>7.2f} "
            f"{statistics.median(p99[mode]):>7.2f} {seq:>7.3f} {added:>8.0f} {cpu:>10.0f} {added_cpu:>8.0f}"
        )
    print("\nper-round req/s: " + json.dumps({m: [round(v) for v in rps[m]] for m in modes}))
    for mode, text in extras.items():
        print(f"{mode}: {text}")


if __name__ == "__main__":
    main()
