"""Benchmark: the triage receiver under Alertmanager-like load, and how long a diagnosis takes to land.

1. Throughput and webhook latency *while diagnoses run*: ``wrk`` (C, 2 threads, 32 connections, keep-alive)
   posts pre-built webhook bodies -- 70 % new alerts (a new incident every 4th body, so the diagnosis worker
   is busy the whole time), 30 % exact duplicates of earlier bodies (retries / the other HA peer). The
   receiver diagnoses from a real flight recorder holding a real scenario run. Each front end is a
   ``Receiver`` built the way ``diag triage serve`` builds it, in its own process. ``--compare-server FILE``
   adds another server module with the same ``Receiver``/``ReceiverConfig`` API (say an older
   ``diag/triage/server.py`` from git; it runs against this tree's other ``diag.triage`` modules),
   alternated with this one ``--rounds`` times in one run so both see the same host; ``--fastapi`` adds this
   receiver's core behind FastAPI. ``--http-only`` posts one body over and over: after the first, the
   duplicate-body cache answers without the store or the validator, so what is left is the HTTP layer.
   The receiver's CPU time per delivery is reported too: on a shared host, deliveries/s measures the share
   of CPU we got as much as the code, CPU per delivery measures the code.
2. ``--only stores``: the store under the same load, diagnosis off: one ``diag triage serve`` on SQLite against
   two on one PostgreSQL 15 (active-active, each taking half the connections from its own ``wrk``), alternated
   ``--rounds`` times in one run. PostgreSQL is started here as the tests start it (``tests/pgserver.py``).
3. Time from delivery to stored diagnosis: POST one alert, poll the store until the diagnosis is stored;
   from the local recorder and from a real Prometheus scraping a real ``diag collect`` agent.

    .venv/bin/python bench/triage.py [--duration 15] [--connections 32] [--skip-prometheus]
    git show OLD:diag/triage/server.py > /tmp/old_server.py
    .venv/bin/python bench/triage.py --only throughput --compare-server /tmp/old_server.py --rounds 3

Targets: >= 500 deliveries/s sustained, webhook p99 <= 50 ms while diagnoses run. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from fastapi import Request  # noqa: E402  (module level: FastAPI resolves the handler's annotations here)

from tests.triage.helpers import alert, body, free_port  # noqa: E402

PY = sys.executable
LUA = r"""
local bodies = {}
local n = 0
init = function(args)
  for line in io.lines(args[1]) do n = n + 1; bodies[n] = line end
  math.randomseed(tonumber(args[2]))
end
local i = 0
request = function()
  i = i + 1
  local b = bodies[((i * 7919 + tonumber(wrk.thread:get("offset") or 0)) % n) + 1]
  return wrk.format("POST", "/webhook", {["Content-Type"] = "application/json"}, b)
end
setup = function(thread) thread:set("offset", tostring(math.random(0, 100000))) end
"""


def make_recorder(folder: Path) -> tuple[Path, float]:
    """A flight recorder holding a real ``leak`` scenario run; returns (path, a time inside that run)."""
    from collectors.recorder import FlightRecorder
    from diag.demo.scenarios.recording import read_jsonl_gz

    records = read_jsonl_gz(ROOT / "tests" / "fixtures" / "scenarios" / "leak.jsonl.gz")
    path = folder / "recorder.db"
    rec = FlightRecorder(path, retention_s=10**9)
    rec.write_rows([(r["ts"], r["kind"], int(r.get("schema", 1)), json.dumps(r)) for r in records])
    rec.close()
    return path, max(r["ts"] for r in records) - 5


def make_bodies(folder: Path, starts: float, n: int = 20_000, *, one: bool = False) -> Path:
    """n bodies, one per line: 70 % new (a new incident every 4th), 30 % duplicates of earlier ones (``one``: one body)."""
    import random

    rng = random.Random(1)
    out: list[str] = []
    if one:
        n = 1
    for i in range(n):
        if out and rng.random() < 0.30:
            out.append(rng.choice(out))
            continue
        incident = i // 4
        labels = {"alertname": "BenchAlert", "job": "llm", "instance": f"node-{incident}", "pod": f"p{i % 4}"}
        out.append(json.dumps(body(alert(labels, starts=starts), group_key=f'{{}}:{{instance="node-{incident}"}}')))
    path = folder / "bodies.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


def start(cmd: list[str], port: int, log: Path, timeout_s: float = 60) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=fh, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {log.read_text()[-1500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"not up: {log.read_text()[-1500:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_module(module: str, port: int, db: str, recorder: str) -> None:
    """Run the ``Receiver`` of a server module (a dotted name, or a file) until SIGTERM, as the CLI does."""
    import importlib
    import importlib.util

    from diag.triage.diagnosis import Source

    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("compared_triage_server", module)
        assert spec is not None and spec.loader is not None
        server = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = server  # dataclasses look their module up while the class is built
        spec.loader.exec_module(server)
    else:
        server = importlib.import_module(module)
    rx = server.Receiver(server.ReceiverConfig(host="127.0.0.1", port=port, db=Path(db), source=Source("recorder", recorder)))
    signal.signal(signal.SIGTERM, lambda signum, frame: rx.shutdown())
    try:
        rx.serve_forever()
    finally:
        rx.close()


def serve_fastapi(port: int, db: str, recorder: str) -> None:
    """The same receiver core behind FastAPI/uvicorn (the comparison front end; not a product path)."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    from diag.triage.diagnosis import Source
    from diag.triage.server import Receiver, ReceiverConfig

    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=Path(db), source=Source("recorder", recorder)))
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/webhook")
    async def webhook(request: Request) -> JSONResponse:
        length = int(request.headers.get("content-length") or 0)
        if length > rx.config.max_body_bytes:
            return JSONResponse({"error": "too large"}, status_code=413)
        raw = await request.body()
        status, doc, extra = await run_in_threadpool(rx.webhook, request.headers, raw)
        return JSONResponse(doc, status_code=status, headers=extra)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def run_wrk(port: int, bodies: Path, duration: int, connections: int, folder: Path) -> dict[str, float]:
    script = folder / "post.lua"
    script.write_text(LUA)
    cmd = ["wrk", f"-t{min(2, connections)}", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), f"http://127.0.0.1:{port}",
           "--", str(bodies), "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60, check=True).stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "requests": total, "p50": ms("50%"), "p90": ms("90%"), "p99": ms("99%"),
            "non2xx": int(non2xx.group(1)) if non2xx else 0, "socket_errors": errors.group(1) if errors else "none"}  # fmt: skip


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the receiver process (all its threads; the diagnosis worker is a child, not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def diagnosed_count(db: Path) -> tuple[int, int]:
    conn = sqlite3.connect(db)
    try:
        done = conn.execute("SELECT COUNT(*) FROM incidents WHERE diag_state = 'done'").fetchone()[0]
        total = conn.execute("SELECT COUNT(*) FROM incidents").fetchone()[0]
        return done, total
    finally:
        conn.close()


def throughput(folder: Path, args: argparse.Namespace) -> None:
    recorder, starts = make_recorder(folder)
    bodies = make_bodies(folder, starts, one=args.http_only)
    what = "one body over and over (the HTTP layer)" if args.http_only else "70 % new alerts, 30 % duplicates"
    print(f"load: {what}; wrk 2 threads, {args.connections} connections, {args.duration}s; loadavg {os.getloadavg()[0]:.1f}")
    fronts = [("this", "diag.triage.server")]
    fronts += [(Path(path).stem, str(Path(path).resolve())) for path in args.compare_server]
    if args.fastapi:
        fronts.append(("fastapi", ""))
    runs = [(name, module, args.connections) for _ in range(args.rounds) for name, module in fronts]
    runs += [("this", "diag.triage.server", c) for c in args.light_connections]
    for name, module, connections in runs:
        port = free_port()
        db = folder / f"{name}-{port}.db"
        me = str(Path(__file__).resolve())
        if name == "fastapi":
            cmd = [PY, me, "--serve-fastapi", str(port), str(db), str(recorder)]
        else:
            cmd = [PY, me, "--serve-module", module, str(port), str(db), str(recorder)]
        proc = start(cmd, port, folder / f"{name}.log")
        try:
            cpu0 = cpu_s(proc.pid)
            res = run_wrk(port, bodies, args.duration, connections, folder)
            cpu = cpu_s(proc.pid) - cpu0
            done, total = diagnosed_count(db)
        finally:
            stop(proc)
        print(f"{name:14s} c={connections:<3d} {res['rps']:7.0f} deliveries/s ({res['requests']} in {args.duration}s)  "
              f"p50 {res['p50']:.1f} ms  p90 {res['p90']:.1f} ms  p99 {res['p99']:.1f} ms  non-2xx {res['non2xx']}  "
              f"socket errors {res['socket_errors']}  "
              f"receiver CPU {cpu / max(1, res['requests']) * 1e6:.0f} us/delivery ({cpu / args.duration:.2f} cores)  "
              f"incidents {total}, diagnosed during the run {done}; loadavg {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip


def _receiver(port: int, db: str, log: Path) -> subprocess.Popen[bytes]:
    return start([PY, "-m", "diag.cli", "triage", "serve", "--no-diagnosis", "--listen", f"127.0.0.1:{port}", "--db", db],
                 port, log)  # fmt: skip


def _wrk_parallel(ports: list[int], bodies: Path, duration: int, connections: int, folder: Path) -> list[dict[str, float]]:
    """One wrk per receiver at once, the connections split between them."""
    from concurrent.futures import ThreadPoolExecutor

    share = max(1, connections // len(ports))
    with ThreadPoolExecutor(len(ports)) as pool:
        return list(pool.map(lambda p: run_wrk(p, bodies, duration, share, folder), ports))


def stores(folder: Path, args: argparse.Namespace) -> None:
    """SQLite (one receiver) beside PostgreSQL (two receivers), same bodies, same host, alternated."""
    from tests.pgserver import postgres, reset

    bodies = make_bodies(folder, time.time() - 60)
    print(f"stores: 70 % new alerts, 30 % duplicates, diagnosis off; {args.connections} connections, {args.duration}s; "
          f"loadavg {os.getloadavg()[0]:.1f}")  # fmt: skip
    with postgres() as pg:
        for _ in range(args.rounds):
            for name in ("sqlite x1", "postgresql x2"):
                if name.startswith("sqlite"):
                    targets = [str(folder / f"stores-{free_port()}.db")]
                else:
                    reset(pg.url)
                    targets = [pg.url, pg.url]
                ports = [free_port() for _ in targets]
                procs = []
                try:
                    for port, db in zip(ports, targets, strict=True):
                        procs.append(_receiver(port, db, folder / f"stores-{port}.log"))
                    cpu0 = sum(cpu_s(p.pid) for p in procs)
                    results = _wrk_parallel(ports, bodies, args.duration, args.connections, folder)
                    cpu = sum(cpu_s(p.pid) for p in procs) - cpu0
                finally:
                    for proc in procs:
                        stop(proc)
                requests = sum(r["requests"] for r in results)
                print(f"{name:14s} c={args.connections:<3d} {sum(r['rps'] for r in results):7.0f} deliveries/s "
                      f"({requests} in {args.duration}s)  p50 {max(r['p50'] for r in results):.1f} ms  "
                      f"p99 {max(r['p99'] for r in results):.1f} ms (worst receiver)  "
                      f"non-2xx {sum(r['non2xx'] for r in results)}  "
                      f"receivers' CPU {cpu / max(1, requests) * 1e6:.0f} us/delivery; loadavg {os.getloadavg()[0]:.1f}",
                      flush=True)  # fmt: skip


def time_to_diagnosis(port: int, db: Path, labels: dict[str, str], starts: float, n: int) -> list[float]:
    out = []
    for i in range(n):
        doc = body(alert({**labels, "alertname": f"DiagLatency{i}"}, starts=starts))
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{port}/webhook", json=doc, timeout=30)
        assert r.status_code == 200, r.text
        conn = sqlite3.connect(db)
        try:
            while True:
                row = conn.execute(
                    "SELECT diag_state, diag_class, diag_error FROM incidents WHERE title LIKE ? ORDER BY id DESC LIMIT 1",
                    (f"%DiagLatency{i} %",),
                ).fetchone()
                if row and row[0] in ("done", "failed"):
                    break
                if time.monotonic() - t0 > 300:
                    raise RuntimeError("no diagnosis within 300 s")
                time.sleep(0.02)
        finally:
            conn.close()
        out.append(time.monotonic() - t0)
        print(f"    {i}: {out[-1]:.2f} s -> {row[1] or row[2]}")
    return out


def diagnosis_latency(folder: Path, args: argparse.Namespace) -> None:
    recorder, starts = make_recorder(folder)
    port = free_port()
    db = folder / "latency-recorder.db"
    cmd = [PY, "-m", "diag.cli", "triage", "serve", "--listen", f"127.0.0.1:{port}", "--db", str(db), "--recorder", str(recorder)]
    proc = start(cmd, port, folder / "latency-recorder.log")
    try:
        print("delivery -> stored diagnosis, local flight recorder (a real leak scenario run, 30 min window):")
        t = time_to_diagnosis(port, db, {"job": "llm", "instance": "127.0.0.1:8000"}, starts, args.samples)
        print(f"  recorder: median {statistics.median(t):.2f} s, max {max(t):.2f} s")
    finally:
        stop(proc)
    if args.skip_prometheus or shutil.which("prometheus") is None:
        print("  prometheus: skipped (no binary or --skip-prometheus)")
        return
    from tests.promserver import ScrapeJob, prometheus

    agent_port = free_port()
    agent = subprocess.Popen(
        [PY, "-m", "diag.cli", "collect", "--listen", f"127.0.0.1:{agent_port}", "--interval", "1s", "--no-kmsg", "--no-gpu",
         "--recorder", str(folder / "agent.db")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    try:
        with prometheus([ScrapeJob("llm", [f"127.0.0.1:{agent_port}"])]) as prom:
            prom.wait_for("llmdiag_host_memory_total_bytes", lambda r: bool(r), timeout_s=60)
            time.sleep(20)  # some history to analyse
            port = free_port()
            db = folder / "latency-prom.db"
            cmd = [PY, "-m", "diag.cli", "triage", "serve", "--listen", f"127.0.0.1:{port}", "--db", str(db),
                   "--prometheus", prom.url]  # fmt: skip
            proc = start(cmd, port, folder / "latency-prom.log")
            try:
                print(
                    "delivery -> stored diagnosis, Prometheus 2.42 scraping a diag collect agent at 1 s (selector job, instance):"
                )
                labels = {"job": "llm", "instance": f"127.0.0.1:{agent_port}"}
                t = time_to_diagnosis(port, db, labels, time.time() - 10, args.samples)
                print(f"  prometheus: median {statistics.median(t):.2f} s, max {max(t):.2f} s")
            finally:
                stop(proc)
    finally:
        stop(agent)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-fastapi":
        serve_fastapi(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    if len(sys.argv) == 6 and sys.argv[1] == "--serve-module":
        serve_module(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=15, help="seconds of wrk load per front end")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument(
        "--light-connections",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[4],
        help="extra runs of this server at these connection counts (latency below saturation), comma-separated",
    )
    ap.add_argument(
        "--compare-server", metavar="FILE", action="append", default=[],
        help="another server module (same Receiver API) to run side by side, named by its file; repeatable",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="times each front end runs, alternated (default 2)")
    ap.add_argument("--fastapi", action="store_true", help="also run this receiver's core behind FastAPI")
    ap.add_argument("--http-only", action="store_true", help="post one body over and over (duplicates: the HTTP layer's cost)")
    ap.add_argument("--samples", type=int, default=5, help="deliveries timed to a stored diagnosis, per source")
    ap.add_argument("--skip-prometheus", action="store_true")
    ap.add_argument("--keep", help="write logs and stores here instead of a temporary folder")
    ap.add_argument("--only", choices=("throughput", "stores", "latency"), default=None)
    args = ap.parse_args()
    for path in args.compare_server:
        if not Path(path).is_file():
            sys.exit(f"bench/triage.py: --compare-server {path}: no such file")
    if args.rounds < 1:
        sys.exit("bench/triage.py: --rounds must be at least 1")
    throughput_only = [name for name, given in (("--compare-server", args.compare_server), ("--fastapi", args.fastapi),
                                                ("--http-only", args.http_only)) if given]  # fmt: skip
    if args.only == "latency" and throughput_only:
        sys.exit(f"bench/triage.py: {', '.join(throughput_only)} cannot apply with --only latency")
    if shutil.which("wrk") is None and args.only != "latency":
        sys.exit("bench/triage.py: wrk is not installed (Debian package wrk)")
    with tempfile.TemporaryDirectory(prefix="llmdiag-triage-bench-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        if args.only in (None, "throughput"):
            throughput(folder, args)
        if args.only in (None, "stores"):
            stores(folder, args)
        if args.only in (None, "latency"):
            diagnosis_latency(folder, args)


if __name__ == "__main__":
    main()
