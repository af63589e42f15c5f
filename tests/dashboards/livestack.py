"""The live stack the dashboard tests query: one real Prometheus scraping a real ``diag collect``, a
real ``diag demo serve`` under load (MoE with a skewed router and a capacity limit, token-budget
batching, an overloaded queue), the real node_exporter when installed, and a process OOM-killed by
the kernel inside a limited memory cgroup -- plus TSDB blocks backfilled with
``promtool tsdb create-blocks-from openmetrics`` for what this host cannot produce (GPU, vLLM, TGI,
cAdvisor, DCGM; shapes from ``dashboards.synthetic``).

Everything runs on 127.0.0.1 on free ports; processes are stopped by PID and the cgroups removed
by the product's ScenarioCgroups (via tests/livecg.py).
"""

from __future__ import annotations

import contextlib
import glob
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from alerts.fleet_names import NAMES as FLEET_RULES
from alerts.slo_names import DASHBOARD_NAMES as SLO_RULES
from dashboards.definitions import all_dashboards
from dashboards.promql import metric_names, series_known
from dashboards.synthetic import exposition
from tests import procs
from tests.livecg import host_exclusive, memory_cgroup
from tests.promserver import PromServer, free_port, require_prometheus, rules_evaluated_after

REPO = Path(__file__).resolve().parents[2]
DIAG = [sys.executable, "-m", "diag.cli"]
NODE_EXPORTER = "prometheus-node-exporter"
HOG = "b=[]\nwhile True: b.append(bytearray(8 << 20))"
FAMILY = series_known()
BACKFILL_LABELS = {"job": "backfill", "instance": "gpu-node-1:9400"}
# Our own series this host cannot produce: no NVIDIA GPU, no torch CUDA allocator.
NO_HARDWARE_PREFIXES = ("llmdiag_gpu_", "llmdiag_torch_", "llmdiag_cuda_")


def dashboard_families() -> set[str]:
    out: set[str] = set()
    for d in all_dashboards():
        for p in d.panels:
            for query in p.queries:
                for alt in query.alternatives:
                    out |= {FAMILY[n] for n in metric_names(alt)}
    return out


def live_producible(name: str, node_exporter: bool) -> bool:
    if name in SLO_RULES or name in FLEET_RULES or name == "up":
        return True
    if name.startswith("llmdiag_"):
        return not name.startswith(NO_HARDWARE_PREFIXES)
    return node_exporter and name.startswith("node_")


@dataclass
class Live:
    prom: PromServer
    live_start: float
    live_end: float
    backfill_start: float
    backfill_end: float
    node_exporter: bool
    rules: list[Path]
    backfilled: set[str] = field(default_factory=set)


def backfill(data_dir: Path, families: set[str], start: float, end: float, work: Path) -> None:
    path = work / "backfill.om"
    with path.open("w") as fh:
        for line in exposition(families, start, end, 1.0, BACKFILL_LABELS):
            fh.write(line + "\n")
    proc = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(path), str(data_dir)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"promtool create-blocks failed: {proc.stderr[-2000:]}")
    path.unlink()


def fast_rules(rules: list[Path], work: Path) -> list[Path]:
    """The alert generator's rule files, evaluated every second instead of every few minutes.

    Long-window groups (the SLO period) run at ``interval: 5m`` in production; their first evaluation
    could then fall after this test's one-minute window. Only the cadence changes -- the expressions,
    names and labels are the generator's.
    """
    out = []
    for i, path in enumerate(rules):
        copy = work / f"rules-{i}-{path.name}"
        copy.write_text(re.sub(r"(?m)^(\s*)interval:\s*\S+\s*$", r"\1interval: 1s", path.read_text()))
        out.append(copy)
    return out


@contextlib.contextmanager
def prometheus_with(data_dir: Path, jobs: dict[str, str], rules: list[Path], folder: Path) -> Iterator[PromServer]:
    """Prometheus over a pre-filled data directory, with rule files (tests/promserver.py has neither)."""
    binary = require_prometheus()
    lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s"]
    if rules:
        lines += ["rule_files:", *(f"  - {str(r)!r}" for r in rules)]
    lines.append("scrape_configs:")
    for name, target in jobs.items():
        lines += [f"  - job_name: {name!r}", "    static_configs:", f"      - targets: [{target!r}]"]
    config = folder / "prometheus.yml"
    config.write_text("\n".join(lines).replace("'", '"') + "\n")
    port = free_port()
    with (folder / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}", f"--web.listen-address=127.0.0.1:{port}",
             "--storage.tsdb.retention.time=15d", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=folder,
        )  # fmt: skip
    try:
        server = PromServer(f"http://127.0.0.1:{port}", proc.pid, folder)
        procs.wait_http(f"{server.url}/-/ready", proc, 30, folder / "prometheus.log")
        yield server
    finally:
        procs.stop(proc)


def _load(url: str, stop: threading.Event, seed: int) -> None:
    """A client: prompts of mixed length (token batching sees light and heavy batches), streaming answers."""
    words = ["the", "memory", "cgroup", "expert", "token", "batch", "queue", "latency"]
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        i = seed
        while not stop.is_set():
            i += 1
            prompt = " ".join(words[(i * 7 + k) % len(words)] for k in range(8 + (i % 5) * 40))
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8})
            time.sleep(0.02)


@contextlib.contextmanager
def live_stack(load_s: float = 40.0) -> Iterator[Live]:
    require_prometheus()
    if shutil.which("promtool") is None:
        import pytest

        pytest.skip("needs promtool (Debian package 'prometheus')")
    node = shutil.which(NODE_EXPORTER)
    work = Path(tempfile.mkdtemp(prefix="llmdiag-dash-"))
    rules = [Path(p) for p in sorted(glob.glob(str(REPO / "alerts" / "generated" / "*.rules.yaml")))]
    try:
        with contextlib.ExitStack() as stack:
            serve_group = stack.enter_context(memory_cgroup(768 << 20, name="llmdiag-dash-serve"))
            hog_group = stack.enter_context(memory_cgroup(64 << 20, name="llmdiag-dash-hog"))
            # a resident member: the agent finds the group's cgroup2 twin (per-group PSI) through a member
            hog_group.spawn([sys.executable, "-c", "import time; time.sleep(900)"])
            data = work / "data"
            families = {f for f in dashboard_families() if not live_producible(f, node is not None)}
            now = time.time()
            backfill_start, backfill_end = now - 13 * 60, now - 60
            backfill(data, families, backfill_start, backfill_end, work)
            serve_port = free_port()
            serve = serve_group.spawn([
                *DIAG, "demo", "serve", "--port", str(serve_port), "--experts", "8", "--top-k", "2", "--router-skew", "3",
                "--expert-capacity-factor", "1.0", "--batching", "tokens", "--max-concurrency", "2", "--queue-size", "3",
                "--weights-mb", "16", "--weights-dir", str(work / "weights"), "--no-access-log", "--log-level", "warning",
            ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            stack.callback(procs.stop, serve)
            serve_url = f"http://127.0.0.1:{serve_port}"
            procs.wait_http(f"{serve_url}/healthz", serve, 90)
            log = work / "agent.log"
            with log.open("wb") as fh:
                agent = subprocess.Popen(
                    [*DIAG, "collect", "--interval", "1s", "--listen", "127.0.0.1:0", "--recorder", str(work / "agent.db"),
                     "--no-gpu", "--cgroup", serve_group.path, "--cgroup", hog_group.path, "--diagnose-every", "5s"],
                    stdout=subprocess.DEVNULL, stderr=fh,
                )  # fmt: skip
            stack.callback(procs.stop, agent)
            jobs = {"llmdiag-agent": f"127.0.0.1:{procs.agent_port(log, agent, 30)}", "llmdiag-demo": f"127.0.0.1:{serve_port}"}
            if node:
                node_port = free_port()
                node_proc = subprocess.Popen(
                    [node, f"--web.listen-address=127.0.0.1:{node_port}", "--collector.disable-defaults",
                     "--collector.meminfo", "--collector.pressure", "--collector.vmstat"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                stack.callback(procs.stop, node_proc)
                jobs["node"] = f"127.0.0.1:{node_port}"
            prom = stack.enter_context(prometheus_with(data, jobs, fast_rules(rules, work), work))
            assert prom.wait_for('up{job="llmdiag-agent"} == 1', bool, 60), prom.log_tail()
            # The load and the OOM kills are what the host shows (kernel log lines, vmstat oom_kill): made while no live
            # test judges the host. The rest -- the queries over this window, the wait for the period rules -- runs
            # beside the live group: its faults only add points outside the window the checks read.
            with host_exclusive():
                live_start = time.time()
                stop = threading.Event()
                clients = [threading.Thread(target=_load, args=(serve_url, stop, i * 1000), daemon=True) for i in range(6)]
                for c in clients:
                    c.start()
                try:
                    for at in (load_s * 0.3, load_s * 0.6):  # two real memcg OOM kills while load runs
                        time.sleep(max(0.0, live_start + at - time.time()))
                        victim = hog_group.spawn([sys.executable, "-c", HOG])
                        assert victim.wait(timeout=60) == -signal.SIGKILL
                    time.sleep(max(0.0, live_start + load_s - time.time()))
                finally:
                    stop.set()
                    for c in clients:
                        c.join(timeout=35)
                # The last scrapes and rule evaluations land: a scrape of the agent after the load, then every group
                # evaluated.
                load_end = time.time()
                landed = prom.wait_for(f'timestamp(up{{job="llmdiag-agent"}}) > {load_end}', bool, 30)
                assert landed and procs.poll_until(lambda: rules_evaluated_after(prom.url, load_end + 1), 30), prom.log_tail()
            yield Live(prom, live_start, time.time(), backfill_start, backfill_end, node is not None, rules, families)
    finally:
        shutil.rmtree(work, ignore_errors=True)
