"""Dashboard benchmark: generation time, and Prometheus query time of each dashboard's full load.

Generation: ``dashboards.generate.documents()`` (SDK build, post-build pass, grid/id/catalog checks,
JSON encoding of all five dashboards), median of N runs, measured in-process.

Queries: a real Prometheus (Debian 2.42) on 127.0.0.1 over 24 h of backfilled series -- every family
any panel queries, ours and upstream, synthetic values in the documented shapes
(``dashboards/synthetic.py``), one scrape every 15 s for ``--instances`` instances, written with
``promtool tsdb create-blocks-from openmetrics``. A dashboard's full load = every panel target plus
the OOM annotation as range queries over the last 6 h at Grafana's default step for the panel's
width (a 24-column dashboard on 1800 px, rounded as Grafana does, at least the 15 s scrape;
``$__rate_interval`` = max(step + scrape, 4 x scrape)), every variable at All (``.+``). Reported:
the wall time with 6 concurrent requests (what Grafana's frontend does), cold (first load) and warm
(median of the next 3) with the sum of query latencies, the wall time one by one, and Prometheus'
own CPU seconds per warm load (from /proc: what the load costs the server, whatever else a shared
host runs). Target: <= 1 s per dashboard.

    .venv/bin/python bench/dashboards.py --data /var/tmp/dash-tsdb   # ~5-8 min (backfill), then seconds
    .venv/bin/python bench/dashboards.py --instances 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards.build import OOM_ANNOTATION, render
from dashboards.definitions import all_dashboards
from dashboards.generate import documents
from dashboards.promql import metric_names, series_known
from dashboards.synthetic import exposition

SCRAPE_S = 15.0
SCREEN_PX = 1800  # a 24-column dashboard on a 1920 px screen: a panel of width w gets w / 24 of it
RANGE_S = 6 * 3600
HISTORY_S = 24 * 3600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def round_interval(s: float) -> float:
    """Grafana's roundInterval (@grafana/data rangeutil) for intervals from 10 s to 1 h."""
    table = ((12.5, 10), (17.5, 15), (25, 20), (45, 30), (90, 60), (210, 120), (450, 300), (750, 600), (1050, 900),
             (1500, 1200), (2700, 1800), (5400, 3600))  # fmt: skip
    for limit, nice in table:
        if s < limit:
            return float(nice)
    return 3600.0


def default_step(width_cols: int) -> float:
    """Grafana's default query interval: range / max data points (the panel's width in px), rounded, >= scrape."""
    return max(SCRAPE_S, round_interval(RANGE_S / (SCREEN_PX * width_cols / 24)))


def substitute(expr: str, step: float) -> str:
    rate_interval = max(step + SCRAPE_S, 4 * SCRAPE_S)
    out = expr.replace("$__rate_interval", f"{int(rate_interval)}s").replace("$__interval", f"{int(step)}s")
    return re.sub(r"\$\{?(job|instance|model|slo)\}?", ".+", out)


def generation(runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        documents()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def backfill(data: Path, work: Path, instances: int, end: float) -> tuple[int, float]:
    family = series_known()
    names = {family[n] for d in all_dashboards() for p in d.panels for q in p.queries for a in q.alternatives
             for n in metric_names(a)}  # fmt: skip
    t0 = time.perf_counter()
    lines = 0
    for i in range(instances):
        path = work / f"i{i}.om"
        with path.open("w") as fh:
            for line in exposition(names, end - HISTORY_S, end, SCRAPE_S, {"job": "bench", "instance": f"node-{i}:9464"}, i):
                fh.write(line + "\n")
                lines += 1
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(path), str(data)], check=True,
                       capture_output=True, timeout=1800)  # fmt: skip
        path.unlink()
    return lines, time.perf_counter() - t0


SLOWEST: list[tuple[float, str]] = []


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process: what a load cost the server, whatever else the shared host runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(client: httpx.Client, url: str, exprs: list[tuple[str, float]], end: float, parallel: int) -> tuple[float, float, int]:
    """(sum of latencies, wall time, series returned) of one full dashboard load; each query at its panel's step."""

    def one(item: tuple[str, float]) -> tuple[float, int]:
        expr, step = item
        t0 = time.perf_counter()
        params = {"query": substitute(expr, step), "start": end - RANGE_S, "end": end, "step": step}
        body = client.get(f"{url}/api/v1/query_range", params=params).json()
        if body.get("status") != "success":
            raise RuntimeError(f"{expr}: {body}")
        took = time.perf_counter() - t0
        SLOWEST.append((took, expr))
        return took, len(body["data"]["result"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(one, exprs))
    wall = time.perf_counter() - t0
    return sum(r[0] for r in results), wall, sum(r[1] for r in results)


def settle(pid: int, timeout_s: float = 600.0) -> None:
    """Wait until Prometheus has finished compacting the backfilled blocks (its CPU use drops)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline and quiet < 3:
        before = cpu_seconds(pid)
        time.sleep(2.0)
        quiet = quiet + 1 if cpu_seconds(pid) - before < 0.1 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--gen-runs", type=int, default=20)
    ap.add_argument("--data", type=Path, help="keep the backfilled TSDB here and reuse it on the next run (saves ~4 min)")
    args = ap.parse_args()
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        sys.exit("needs prometheus and promtool (Debian package 'prometheus')")
    med, best = generation(args.gen_runs)
    print(f"generation of all 5 dashboards: median {med * 1000:.0f} ms, best {best * 1000:.0f} ms ({args.gen_runs} runs)")
    work = Path(tempfile.mkdtemp(prefix="llmdiag-bench-dash-"))
    data = args.data or work / "data"
    proc = None
    try:
        stamp = data / "llmdiag-bench-end"
        if stamp.is_file():
            end = float(stamp.read_text())
            print(f"reusing the backfilled TSDB in {data} (ends {time.time() - end:.0f} s ago)")
        else:
            end = time.time() - 60
            lines, took = backfill(data, work, args.instances, end)
            stamp.write_text(repr(end))
            print(f"backfilled 24 h x {args.instances} instance(s): {lines} exposition lines in {took:.0f} s")
        port = free_port()
        (work / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
        proc = subprocess.Popen(["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={data}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=15d",
                                 "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            for _ in range(300):
                try:
                    if client.get(f"{url}/-/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            settle(proc.pid)
            base = [load(client, url, [("vector(1)", 60.0)], end, 1)[1] for _ in range(20)]
            print(f"load average {os.getloadavg()[0]:.1f}; 6 h range; step by panel width (full {default_step(24):.0f} s, "
                  f"half {default_step(12):.0f} s, quarter {default_step(6):.0f} s); variables = All; "
                  f"round trip of vector(1): median {statistics.median(base) * 1000:.1f} ms")  # fmt: skip
            print(
                "| dashboard | queries | series | cold: sum / wall (6 parallel) | warm median: sum / wall "
                "| sequential wall | Prometheus CPU per load |"
            )
            print("|---|---|---|---|---|---|---|")
            for d in all_dashboards():
                board: dict[str, Any] = render(d)
                exprs = [(t["expr"], default_step(p["gridPos"]["w"])) for p in board["panels"] for t in p.get("targets", [])]
                exprs.append((OOM_ANNOTATION, default_step(24)))
                cold = load(client, url, exprs, end, 6)
                cpu0 = cpu_seconds(proc.pid)
                warm = [load(client, url, exprs, end, 6) for _ in range(3)]
                cpu = (cpu_seconds(proc.pid) - cpu0) / 3
                seq = load(client, url, exprs, end, 1)
                print(f"| {d.title} | {len(exprs)} | {cold[2]} | {cold[0]:.3f} s / {cold[1]:.3f} s | "
                      f"{statistics.median(w[0] for w in warm):.3f} s / {statistics.median(w[1] for w in warm):.3f} s | "
                      f"{seq[1]:.3f} s | {cpu:.2f} s |")  # fmt: skip
            print("slowest queries (warm or cold):")
            for took, expr in sorted(SLOWEST, reverse=True)[:6]:
                print(f"  {took:.3f} s  {expr[:150]}")
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
