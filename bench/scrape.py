"""Benchmark: the agent's CPU per scrape of a 2 000-series vLLM /metrics, beside a real Prometheus scraping the same.

Targets: the agent's scrape + store <= 1.5x Prometheus's own scrape CPU; the agent at 1 Hz with one backend
scraped <= 2 % of one core.

    .venv/bin/python bench/scrape.py [--engines 7] [--scrapes 300] [--prom-seconds 120] [--agent-seconds 60]

- The backend: a stand-in vLLM on loopback in its own process (vLLM @005a810b's families, ``engines``
  data-parallel engines: 7 give ~2 100 series), answering each scraper in the format it asks for (as
  prometheus_client does for vLLM), with new observations on every scrape so histograms move.
- The agent's scrape + store: in this process, ``TargetScraper.scrape()`` (fetch, filter, parse, deltas)
  and ``FlightRecorder.write`` of the record, back to back; CPU by ``time.process_time`` per scrape.
- Prometheus (2.42, Debian's): scraping the stand-in every second for ``--prom-seconds``; its CPU from
  ``/proc/<pid>/stat`` over the scrapes it reports (``prometheus_target_interval_length_seconds_count``),
  and the same with an idle target (a 1-series /metrics) for its baseline -- both ratios are printed.
- The agent whole: ``diag collect --interval 1s --scrape URL`` for ``--agent-seconds``, its CPU share from
  ``/proc``, beside the same agent without ``--scrape``.

Prints figures; asserts nothing (these machines are shared and noisy: read the numbers side by side).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]

SERVER = textwrap.dedent(
    """
    import sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from prometheus_client.exposition import choose_encoder
    from tests.backend_captures import vllm_registry
    engines, idle = int(sys.argv[1]), sys.argv[2] == "idle"
    reg = vllm_registry(engines)
    queue = next(m for m in reg._collector_to_names if getattr(m, "_name", "") == "vllm:request_queue_time_seconds")
    lock = threading.Lock()
    n = [0]
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            if idle:
                body, kind = b"# TYPE up_probe gauge\\nup_probe 1\\n", "text/plain; version=0.0.4"
            else:
                with lock:
                    n[0] += 1
                    for e in range(engines):
                        queue.labels("Qwen/Qwen2.5-7B-Instruct", str(e)).observe(0.05 * (n[0] % 40))
                    encoder, kind = choose_encoder(self.headers.get("Accept", ""))
                    body = encoder(reg)
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass  # a scraper that gave up (its timeout): nothing to tell
        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
    """
)


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _start(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def stand_in(engines: int, idle: bool = False) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc, port = _start([sys.executable, "-c", SERVER, str(engines), "idle" if idle else "busy"], env)
    return proc, f"http://127.0.0.1:{port}/metrics"


def series_of(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return sum(1 for line in resp.read().decode().splitlines() if line and not line.startswith("#"))


def bench_agent_scrape(url: str, scrapes: int) -> dict[str, float]:
    from collectors.recorder import FlightRecorder
    from collectors.scrape import TargetScraper

    scraper = TargetScraper(url)
    with tempfile.TemporaryDirectory() as tmp, FlightRecorder(Path(tmp) / "r.db") as rec:
        for _ in range(20):  # warm: imports, connection setup paths, the first deltas
            rec.write([scraper.scrape()])
        cpu, parse_cpu, walls, kept = [], [], [], []
        for _ in range(scrapes):
            w0, t0 = time.perf_counter(), time.process_time()
            sample = scraper.scrape()
            t1 = time.process_time()
            rec.write([sample])
            cpu.append(time.process_time() - t0)
            parse_cpu.append(t1 - t0)
            walls.append(time.perf_counter() - w0)
            kept.append(len(sample.gauges) + len(sample.counters) + len(sample.deltas))
        size = len(sample.to_json())
    return {"cpu_ms": statistics.median(cpu) * 1e3, "cpu_p90_ms": statistics.quantiles(cpu, n=10)[-1] * 1e3,
            "scrape_cpu_ms": statistics.median(parse_cpu) * 1e3, "wall_ms": statistics.median(walls) * 1e3,
            "kept": statistics.median(kept), "record_bytes": size}  # fmt: skip


def _prom_scrapes(port: int) -> float:
    """Scrapes Prometheus has made, from its own /metrics (``prometheus_target_interval_length_seconds_count``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m) for m in re.findall(r"^prometheus_target_interval_length_seconds_count\{[^}]*\} (\S+)$", text, re.M))


def bench_prometheus(url: str, seconds: float) -> dict[str, float]:
    """Prometheus scraping ``url`` every second: its CPU per scrape (all of its CPU over the scrapes it made)."""
    binary = shutil.which("prometheus")
    if binary is None:
        return {}
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1m}\n"
            f"scrape_configs:\n  - job_name: backend\n    static_configs: [{{targets: ['{host_port}']}}]\n"
        )
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if _prom_scrapes(port) >= 5:
                        break
                except OSError:
                    pass
                time.sleep(0.2)
            c0, s0 = _cpu(proc.pid), _prom_scrapes(port)
            time.sleep(seconds)
            c1, s1 = _cpu(proc.pid), _prom_scrapes(port)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    scrapes = max(1.0, s1 - s0)
    return {"cpu_ms_per_scrape": (c1 - c0) / scrapes * 1e3, "scrapes": scrapes, "cpu_share_pct": (c1 - c0) / seconds * 100}


def bench_agent_process(url: str | None, seconds: float) -> dict[str, float]:
    diag = Path(sys.executable).with_name("diag")
    with tempfile.TemporaryDirectory() as tmp:
        args = [str(diag), "collect", "--interval", "1s", "--listen", "127.0.0.1:0", "--recorder", f"{tmp}/r.db",
                "--no-kmsg", "--no-gpu"]  # fmt: skip
        if url:
            args += ["--scrape", url]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(5)  # start-up (imports, first samples) is not the steady state
            c0 = _cpu(proc.pid)
            time.sleep(seconds)
            c1 = _cpu(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    return {"cpu_share_pct": (c1 - c0) / seconds * 100}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=7)
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--prom-seconds", type=float, default=120.0)
    ap.add_argument("--agent-seconds", type=float, default=60.0)
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    busy, url = stand_in(a.engines)
    idle, idle_url = stand_in(1, idle=True)
    try:
        print(f"stand-in vLLM: {series_of(url)} series at {url}")
        agent = bench_agent_scrape(url, a.scrapes)
        print(f"agent scrape+store, CPU per scrape: median {agent['cpu_ms']:.2f} ms (p90 {agent['cpu_p90_ms']:.2f}), of which "
              f"fetch+parse+deltas {agent['scrape_cpu_ms']:.2f} ms; wall {agent['wall_ms']:.2f} ms; "
              f"{agent['kept']:.0f} series kept, record {agent['record_bytes']} bytes")  # fmt: skip
        prom = bench_prometheus(url, a.prom_seconds)
        base = bench_prometheus(idle_url, a.prom_seconds)
        if prom:
            net = prom["cpu_ms_per_scrape"] - base["cpu_ms_per_scrape"]
            print(f"prometheus, CPU per scrape of the same endpoint: {prom['cpu_ms_per_scrape']:.2f} ms over "
                  f"{prom['scrapes']:.0f} scrapes ({prom['cpu_share_pct']:.2f} % of a core); idle target "
                  f"{base['cpu_ms_per_scrape']:.2f} ms; the scrape itself {net:.2f} ms")  # fmt: skip
            print(f"ratio agent/prometheus: {agent['cpu_ms'] / prom['cpu_ms_per_scrape']:.2f}x of its whole CPU per scrape, "
                  f"{agent['cpu_ms'] / max(net, 1e-6):.2f}x of its scrape over an idle target's (target <= 1.5x)")  # fmt: skip
        with_scrape = bench_agent_process(url, a.agent_seconds)
        without = bench_agent_process(None, a.agent_seconds)
        print(f"agent at 1 Hz: {with_scrape['cpu_share_pct']:.2f} % of a core scraping one backend, "
              f"{without['cpu_share_pct']:.2f} % without (target <= 2 %)")  # fmt: skip
    finally:
        _stop(busy)
        _stop(idle)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
