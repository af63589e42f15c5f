"""Benchmark: what tracking costs on a real model path -- llama-cpp-python's server, alone and under ``diag wrap``.

The figure is counted, not timed: the server's CPU time per request (each thread's ``/proc/<pid>/task/*/schedstat``
run time, every thread: uvicorn's event loop, the thread pool, llama.cpp's compute threads), with full tracking (``diag wrap``:
metrics, flight recorder, spans on 10 % of requests exported over OTLP/HTTP to a sink in this script that answers
200 and counts) against the same server untracked, at 64 output tokens. Target: within 1 % (ratio <= 1.01).

Both servers run side by side from the start, on one GGUF written for the run (``diag.demo.engine.model``), one
compute thread each. A round sends ``--requests`` completions one at a time to one server, then the same to the
other (order alternating between rounds), and reads each server's CPU time before and after its turn: two turns
back to back share most of what the rest of the machine does to them. The ratio is taken per round; the median,
its 95 % percentile-bootstrap interval and the range are printed, and the target counts as met only when the
whole interval clears it. The load average is printed at start and end.

Per-thread accounting gives the second, sharper estimate. The server runs each
completion on one of its worker threads (``run_in_threadpool``; never on the event loop, the main thread), so a
worker thread that burnt more than half of one request's CPU in a turn ran the model (a completion runs whole on one
thread: such a worker's turn is a multiple of one request's CPU); those threads cost the same with or
without tracking in expectation but carry nearly all of the noise a busy host adds (cache and frequency effects
on ~140 ms of compute per request). Tracking runs on the others (the
event loop, the recorder's writer, the span exporter), so the added cost is estimated as the difference of the
*other* threads' CPU per request, over the untracked server's whole CPU per request. The bound of the method: a
tracking thread burning more than half a request's CPU per turn would be counted as a model thread -- with
``--requests`` 40 that is 1.25 % of the untracked CPU, so the estimate holds for overheads below that, and the
whole-process figure beside it is the check. ``LLMDIAG_BENCH_THREADS=1`` prints each turn's CPU per request of each thread.

Run: ``.venv/bin/python bench/engine_overhead.py [--rounds 9 --requests 40 --max-tokens 64 --size-mib 32]``
(needs ``pip install -c constraints.txt '.[engines]'``).
"""

from __future__ import annotations

import argparse
import http.server
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import bootstrap_median_ci, free_port  # noqa: E402


def _thread_cpu_ns(pid: int) -> dict[tuple[int, int], int]:
    """CPU nanoseconds of each thread of ``pid`` (``/proc/<pid>/task/<tid>/schedstat``: the scheduler's exact run
    time, where utime + stime are sampled at the 10 ms tick -- one tick per turn is 0.17 % of a 149 ms request at
    40 requests), keyed by (thread id, start time): a busy host wraps the id space, and a worker thread the server
    ended while idle (anyio's end after 10 s) may come back under an id an earlier one had -- keyed by id alone its
    time would be taken from the dead thread's. A thread that ended between the listing and the read is skipped."""
    out: dict[tuple[int, int], int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            run_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[(int(tid), int(fields[19]))] = run_ns  # starttime: field 22 of proc(5)
    return out


MODEL_THREAD_SHARE = 0.5  # of one request's CPU, in one turn


@dataclass
class Turn:
    """One server's turn of a round: CPU seconds per request, all threads and all but the model's thread."""

    total_s: float
    serving_s: float


EXPORT_DELAY_MS: int | None = None  # --export-delay-ms


class _OtlpSink(http.server.BaseHTTPRequestHandler):
    """Accepts OTLP/HTTP exports (any POST), answers 200, counts them: the spans leave the server for real.

    HTTP/1.1 with keep-alive, as an OpenTelemetry Collector's OTLP/HTTP receiver answers: the exporter's session
    then reuses its connection, as it does in a deployment. (HTTP/1.0, the handler's default, closed the
    connection after every export, and each export paid a new TCP connection in the tracked server.)"""

    protocol_version = "HTTP/1.1"
    posts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).posts += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _start(model: Path, tracked: bool, workdir: Path, otlp: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    server = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
              "--n_ctx", "512", "--n_threads", "1", "--verbose", "false"]  # fmt: skip
    argv = [sys.executable, "-m", "diag.cli", "wrap", "--recorder", str(workdir / "recorder.db"),
            "--span-sample-ratio", "0.1", "--model", "bench", "--", *server] if tracked else server  # fmt: skip
    log = (workdir / f"server-{'tracked' if tracked else 'untracked'}.log").open("wb")
    export = tracked and otlp
    # The batch span processor's own schedule (the SDK's default, 5 s) unless --export-delay-ms says otherwise.
    env = dict(os.environ)
    if export:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
        if EXPORT_DELAY_MS is not None:
            env["OTEL_BSP_SCHEDULE_DELAY"] = str(EXPORT_DELAY_MS)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {'tracked' if tracked else 'untracked'} server exited: see {log.name}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("a server did not answer within 120 s")


def _turn(client: httpx.Client, url: str, pid: int, n: int, max_tokens: int) -> Turn:
    """CPU per request over ``n`` completions sent one at a time, whole process and without the model's thread."""
    before = _thread_cpu_ns(pid)
    for i in range(n):
        r = client.post(f"{url}/v1/completions", json={"prompt": f"request {i}", "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
    after = _thread_cpu_ns(pid)
    deltas = {key: ns - before.get(key, 0) for key, ns in after.items()}
    total = sum(deltas.values())
    per_request = total / n
    # the workers the model ran on; never the event loop (the main thread: the server runs the model off it)
    model = sum(d for (tid, _), d in deltas.items() if tid != pid and d > MODEL_THREAD_SHARE * per_request)
    if os.environ.get("LLMDIAG_BENCH_THREADS"):
        us = sorted(((round(d / n / 1e3), t) for (t, _), d in deltas.items() if d >= n * 1000), reverse=True)
        print(f"  pid {pid} us/request by thread (>= 1): {us}")
    return Turn(total / 1e9 / n, (total - model) / 1e9 / n)


def _summary(what: str, ratios: list[float]) -> None:
    med = sorted(ratios)[len(ratios) // 2]
    lo, hi = bootstrap_median_ci(ratios)
    verdict = "met" if hi <= 1.01 else ("missed" if lo > 1.01 else "not shown (the interval straddles 1.01)")
    print(f"\n{what}: median {med:.4f} (95 % CI {lo:.4f}-{hi:.4f}, range {min(ratios):.4f}-{max(ratios):.4f}); "
          f"target <= 1.01: {verdict}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=40, help="completions per server per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--size-mib", type=int, default=32, help="size of the GGUF written for the run")
    parser.add_argument("--no-otlp", action="store_true", help="spans sampled but not exported (the exporter's share)")
    parser.add_argument(
        "--export-delay-ms",
        type=int,
        default=None,
        help="OTEL_BSP_SCHEDULE_DELAY for the tracked server (default: the SDK's own, 5000); 1000 exports 5x as often",
    )
    args = parser.parse_args()
    global EXPORT_DELAY_MS
    if args.export_delay_ms is not None and args.export_delay_ms <= 0:
        parser.error("--export-delay-ms: a positive number of milliseconds")
    EXPORT_DELAY_MS = args.export_delay_ms
    if min(args.rounds, args.requests, args.max_tokens, args.size_mib) < 1:
        parser.error("--rounds, --requests, --max-tokens and --size-mib are at least 1")
    from diag.demo.engine.model import write_model

    print(f"load average at start: {os.getloadavg()}")
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpSink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    otlp = "" if args.no_otlp else f"http://127.0.0.1:{sink.server_address[1]}"
    with tempfile.TemporaryDirectory(prefix="llmdiag-engine-bench-") as tmp:
        workdir = Path(tmp)
        model = write_model(workdir / "bench.gguf", args.size_mib << 20, seed=0).path
        servers = {tracked: _start(model, tracked, workdir, otlp) for tracked in (False, True)}
        try:
            per_round: dict[bool, list[Turn]] = {False: [], True: []}
            with httpx.Client(timeout=300, trust_env=False) as client:
                for proc, url in servers.values():  # warm-up: first requests pay for page faults and caches
                    _turn(client, url, proc.pid, 3, args.max_tokens)
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for tracked in order:
                        proc, url = servers[tracked]
                        per_round[tracked].append(_turn(client, url, proc.pid, args.requests, args.max_tokens))
                    u, t = per_round[False][-1], per_round[True][-1]
                    print(f"round {r + 1}/{args.rounds}: untracked {u.total_s * 1e3:.2f} ms CPU/request "
                          f"({u.serving_s * 1e3:.2f} off the model's thread), tracked {t.total_s * 1e3:.2f} ms "
                          f"({t.serving_s * 1e3:.2f}), load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    pairs = list(zip(per_round[False], per_round[True], strict=True))
    header = f"{args.max_tokens} output tokens, {args.rounds} rounds x {args.requests} requests"
    _summary(f"whole process, tracked / untracked ({header})", [t.total_s / u.total_s for u, t in pairs])
    _summary("per thread: 1 + (tracked - untracked CPU off the model's thread) / untracked whole CPU",
             [1 + (t.serving_s - u.serving_s) / u.total_s for u, t in pairs])  # fmt: skip
    untracked_ms = sorted(u.total_s for u, _ in pairs)[len(pairs) // 2] * 1e3
    added_ms = sorted((t.serving_s - u.serving_s) for u, t in pairs)[len(pairs) // 2] * 1e3
    print(f"untracked median {untracked_ms:.2f} ms CPU/request; tracking adds {added_ms:.3f} ms off the model's thread")
    print(f"OTLP exports received from the tracked server: {_OtlpSink.posts}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
