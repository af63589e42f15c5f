"""Benchmark: what tracking costs on a real model path -- llama-cpp-python's server, alone and under ``diag wrap``.

The figure is counted, not timed: the server's CPU time per request (``/proc/<pid>/stat`` utime + stime, every
thread: uvicorn's event loop, the thread pool, llama.cpp's compute threads), with full tracking (``diag wrap``:
metrics, flight recorder, spans on 10 % of requests exported over OTLP/HTTP to a sink in this script that answers
200 and counts) against the same server untracked, at 64 output tokens. Target: within 1 % (ratio <= 1.01).

Both servers run side by side from the start, on one GGUF written for the run (``diag.demo.engine.model``), one
compute thread each. A round sends ``--requests`` completions one at a time to one server, then the same to the
other (order alternating between rounds), and reads each server's CPU time before and after its turn: two turns
back to back share most of what the rest of the machine does to them. The ratio is taken per round; the median,
its 95 % percentile-bootstrap interval and the range are printed, and the target counts as met only when the
whole interval clears it. The load average is printed at start and end.

Run: ``.venv/bin/python bench/engine_overhead.py [--rounds 9 --requests 20 --max-tokens 64 --size-mib 32]``
(needs ``pip install -c constraints.txt '.[engines]'``).
"""

from __future__ import annotations

import argparse
import http.server
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _OtlpSink(http.server.BaseHTTPRequestHandler):
    """Accepts OTLP/HTTP exports (any POST), answers 200, counts them: the spans leave the server for real."""

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
    port = _free_port()
    server = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
              "--n_ctx", "512", "--n_threads", "1", "--verbose", "false"]  # fmt: skip
    argv = [sys.executable, "-m", "diag.cli", "wrap", "--recorder", str(workdir / "recorder.db"),
            "--span-sample-ratio", "0.1", "--model", "bench", "--", *server] if tracked else server  # fmt: skip
    log = (workdir / f"server-{'tracked' if tracked else 'untracked'}.log").open("wb")
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp, "OTEL_BSP_SCHEDULE_DELAY": "1000"} if tracked else dict(os.environ)
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


def _turn(client: httpx.Client, url: str, pid: int, n: int, max_tokens: int) -> float:
    """CPU seconds per request over ``n`` completions sent one at a time."""
    before = _cpu_s(pid)
    for i in range(n):
        r = client.post(f"{url}/v1/completions", json={"prompt": f"request {i}", "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
    return (_cpu_s(pid) - before) / n


def _bootstrap_median_ci(values: list[float], n: int = 4000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(sorted(rng.choices(values, k=len(values)))[len(values) // 2] for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=20, help="completions per server per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--size-mib", type=int, default=32, help="size of the GGUF written for the run")
    args = parser.parse_args()
    if min(args.rounds, args.requests, args.max_tokens, args.size_mib) < 1:
        parser.error("--rounds, --requests, --max-tokens and --size-mib are at least 1")
    from diag.demo.engine.model import write_model

    print(f"load average at start: {os.getloadavg()}")
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpSink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    otlp = f"http://127.0.0.1:{sink.server_address[1]}"
    with tempfile.TemporaryDirectory(prefix="llmdiag-engine-bench-") as tmp:
        workdir = Path(tmp)
        model = write_model(workdir / "bench.gguf", args.size_mib << 20, seed=0).path
        servers = {tracked: _start(model, tracked, workdir, otlp) for tracked in (False, True)}
        try:
            per_round: dict[bool, list[float]] = {False: [], True: []}
            with httpx.Client(timeout=300, trust_env=False) as client:
                for proc, url in servers.values():  # warm-up: first requests pay for page faults and caches
                    _turn(client, url, proc.pid, 3, args.max_tokens)
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for tracked in order:
                        proc, url = servers[tracked]
                        per_round[tracked].append(_turn(client, url, proc.pid, args.requests, args.max_tokens))
                    print(f"round {r + 1}/{args.rounds}: untracked {per_round[False][-1] * 1e3:.2f} ms CPU/request, "
                          f"tracked {per_round[True][-1] * 1e3:.2f} ms, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    ratios = [t / u for t, u in zip(per_round[True], per_round[False], strict=True)]
    med = sorted(ratios)[len(ratios) // 2]
    lo, hi = _bootstrap_median_ci(ratios)
    print(f"\nCPU time per request, tracked / untracked, {args.max_tokens} output tokens, {args.rounds} rounds x "
          f"{args.requests} requests: median {med:.4f} (95 % CI {lo:.4f}-{hi:.4f}, "
          f"range {min(ratios):.4f}-{max(ratios):.4f})")  # fmt: skip
    untracked_ms = sorted(per_round[False])[len(ratios) // 2] * 1e3
    print(f"untracked median {untracked_ms:.2f} ms CPU/request; tracking adds {(med - 1) * untracked_ms:.3f} ms")
    verdict = "met" if hi <= 1.01 else ("missed" if lo > 1.01 else "not shown (the interval straddles 1.01)")
    print(f"target <= 1.01: {verdict}")
    print(f"OTLP exports received from the tracked server: {_OtlpSink.posts}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
