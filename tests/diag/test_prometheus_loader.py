"""The Prometheus loader against a real Prometheus scraping a real agent and a real tracked app.

Set-up (once per module, ~20 s): ``diag collect`` (1 s samples, its own flight recorder), a small
process running the real ``RequestTracker`` under overload (2 slots, queue of 2, 6 clients: ok and
rejected outcomes) serving its prometheus_client /metrics, and Prometheus scraping both every second
-- plus a "mirror" job scraping the agent again under another instance name, to stand in for a
second machine. Where live cgroups are available (root), the agent watches a real 64 MiB memory
cgroup in which a process is OOM-killed by the kernel, so the OOM path is real too.
Everything is started here and killed by PID; Prometheus' data directory is removed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from collectors import catalog as cat
from collectors.recorder import FlightRecorder
from collectors.records import CgroupSnapshot, HostSnapshot
from diag.rules.classes import CLASSES, HEALTHY, INCONCLUSIVE
from diag.rules.engine import analyze
from diag.sources.prometheus import _ooms_from, _Result, default_step, load_prometheus
from tests import procs
from tests.livecg import LiveGroup, memory_cgroup
from tests.promserver import PromServer, ScrapeJob, free_port, prometheus, require_prometheus

DIAG = [sys.executable, "-m", "diag.cli"]
SELECTOR = 'job=~"llm-.*"'
HOG = "b=[]\nwhile True: b.append(bytearray(8 << 20))"
CGROUP_LIMIT = 64 << 20
APP = r"""
import random, threading, time
from prometheus_client import start_http_server
from collectors.tracking import AdmissionConfig, AdmissionRejected, RequestTracker

tracker = RequestTracker(model="m", recorder=False, span_sample_ratio=0.0,
                         admission=AdmissionConfig(max_concurrency=2, queue_size=2))
server, _ = start_http_server(0, addr="127.0.0.1")
print(server.server_port, flush=True)

def client(seed):
    rng = random.Random(seed)
    while True:
        try:
            with tracker.request(route="/v1/completions") as req:
                req.acquire_sync()
                time.sleep(rng.lognormvariate(-2.5, 0.4))  # ~80 ms of "inference"
        except AdmissionRejected:
            time.sleep(0.05)

for i in range(6):
    threading.Thread(target=client, args=(i,), daemon=True).start()
while True:
    time.sleep(1)
"""
# What vLLM, cAdvisor and DCGM export, with their names (from the catalog), types, labels and units.
# vLLM's metrics are prometheus_client families exactly like these; cAdvisor and DCGM cannot run
# here (no containers runtime, no GPU), so this process stands in for them at the /metrics boundary.
EXTERNAL_APP = r"""
import sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from prometheus_client import generate_latest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from collectors import catalog as cat

reg = CollectorRegistry()
lab = ["model_name", "engine"]
buckets = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0]  # vLLM: 0.3 ... 7680
queue = Histogram(cat.VLLM_QUEUE_TIME.name, "h", lab, buckets=buckets, registry=reg).labels("m", "0")
infer = Histogram(cat.VLLM_INFERENCE_TIME.name, "h", lab, buckets=buckets, registry=reg).labels("m", "0")
e2e = Histogram(cat.VLLM_E2E.name, "h", lab, buckets=buckets, registry=reg).labels("m", "0")
ok = Counter(cat.VLLM_SUCCESS.name.removesuffix("_total"), "c", [*lab, "finished_reason"], registry=reg).labels("m", "0", "stop")
Gauge(cat.VLLM_RUNNING.name, "g", lab, registry=reg).labels("m", "0").set(3)
Gauge(cat.VLLM_WAITING.name, "g", lab, registry=reg).labels("m", "0").set(1)
usage = Gauge(cat.CADVISOR_MEMORY["usage"].name, "g", ["id"], registry=reg)
limit = Gauge(cat.CADVISOR_MEMORY["limit"].name, "g", ["id"], registry=reg)
limit.labels("/kubepods/pod1").set(2 << 30)
limit.labels("/").set(0)  # cAdvisor: 0 = unlimited
stall = Counter(cat.CADVISOR_PSI_WAITING.name.removesuffix("_total"), "c", ["id"], registry=reg).labels("/kubepods/pod1")
used = Gauge(cat.DCGM_FB_USED.name, "g", ["gpu", "UUID"], registry=reg)
Gauge(cat.DCGM_FB_FREE.name, "g", ["gpu", "UUID"], registry=reg).labels("0", "GPU-x").set(80000)
used.labels("0", "GPU-x").set(1024)
if sys.argv[1] == "openmetrics":  # negotiated: prometheus_client escapes ':' to '_' (UTF-8 name escaping)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
else:  # the classic text format, which keeps vLLM's colons
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(reg)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_port, flush=True)
i = 0
while True:
    i += 1
    queue.observe(0.4)
    infer.observe(1.2)
    e2e.observe(1.6)
    ok.inc()
    usage.labels("/kubepods/pod1").set((1 << 30) + (i % 7) * 4096)
    stall.inc(0.01)  # stalled 0.01 s every 0.05 s: some = 20 %
    usage.labels("/").set((8 << 30) + (i % 5) * 4096)
    time.sleep(0.05)
"""
NODE_EXPORTER = "prometheus-node-exporter"


@dataclass
class Stack:
    prom: PromServer
    recorder: Path
    agent_port: int
    group: LiveGroup | None
    oom_victims: int
    node_exporter: bool


def _samples(prom: PromServer, expr: str) -> float:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else 0.0


@contextlib.contextmanager
def _stack(tmp: Path, live: bool) -> Iterator[Stack]:
    """The agent, the apps and Prometheus; with ``live``, the agent also watches a real cgroup with an OOM kill in it."""
    require_prometheus()
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(memory_cgroup(CGROUP_LIMIT)) if live else None
        if group is not None:
            # A resident member, as a service group has: on a hybrid host whose own v1 and v2 paths differ, the agent
            # finds an explicit group's cgroup2 twin through a member's 0:: line, so an empty group has no PSI.
            group.spawn([sys.executable, "-c", "import time; time.sleep(900)"])
        recorder = tmp / "agent.db"
        log = tmp / "agent.log"
        argv = [*DIAG, "collect", "--interval", "1s", "--listen", "127.0.0.1:0", "--recorder", str(recorder), "--no-gpu"]
        argv += ["--cgroup", group.path] if group else ["--no-kmsg"]
        with log.open("wb") as fh:
            agent = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh)
        stack.callback(procs.stop, agent)
        app = subprocess.Popen([sys.executable, "-c", APP], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        stack.callback(procs.stop, app)
        assert app.stdout is not None
        app_port = int(app.stdout.readline())
        jobs = []
        for fmt in ("openmetrics", "text"):
            ext = subprocess.Popen([sys.executable, "-c", EXTERNAL_APP, fmt], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)  # fmt: skip
            stack.callback(procs.stop, ext)
            assert ext.stdout is not None
            jobs.append(ScrapeJob(f"ext-app-{fmt}", [f"127.0.0.1:{int(ext.stdout.readline())}"]))
        node = shutil.which(NODE_EXPORTER)
        if node:  # the real node_exporter (Debian prometheus-node-exporter), only the collectors we read
            node_port = free_port()
            node_proc = subprocess.Popen(
                [node, f"--web.listen-address=127.0.0.1:{node_port}", "--collector.disable-defaults",
                 "--collector.meminfo", "--collector.pressure", "--collector.vmstat"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            stack.callback(procs.stop, node_proc)
            jobs.append(ScrapeJob("ext-node", [f"127.0.0.1:{node_port}"]))
        agent_port = procs.agent_port(log, agent, 20)
        prom = stack.enter_context(
            prometheus([
                ScrapeJob("llm-host", [f"127.0.0.1:{agent_port}"]),
                ScrapeJob("llm-app", [f"127.0.0.1:{app_port}"]),
                ScrapeJob("mirror", [f"127.0.0.1:{agent_port}"], instance="otherhost:9464"),
                *jobs,
            ])
        )  # fmt: skip
        total = cat.HOST_MEMORY["total"].name
        assert prom.wait_for(f'{total}{{job="llm-host"}}', bool, 40), prom.log_tail()
        victims = 0
        if group is not None:  # a real memcg OOM kill while Prometheus watches the agent's counter
            victim = group.spawn([sys.executable, "-c", HOG])
            assert victim.wait(timeout=60) == -signal.SIGKILL
            victims = 1
        ok = prom.wait_for(
            f'count_over_time({total}{{job="llm-host"}}[5m])', lambda r: bool(r) and float(r[0]["value"][1]) >= 12, 40
        )
        assert ok and _samples(prom, f"sum(count_over_time({cat.REQUESTS.name}[5m]))") > 0, prom.log_tail()
        yield Stack(prom, recorder, agent_port, group, victims, node is not None)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack without cgroups: the same whichever tests of the module were selected."""
    with _stack(tmp_path_factory.mktemp("prom-loader"), live=False) as built:
        yield built


@pytest.fixture
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of its own for the live test: a real memory cgroup and a kernel OOM kill in it (root only)."""
    with _stack(tmp_path_factory.mktemp("prom-loader-live"), live=True) as built:
        yield built


def _load(stack: Stack, selector: str = SELECTOR, **kw: object) -> object:
    return load_prometheus(stack.prom.url, selector=selector, since_s=kw.pop("since_s", 300), **kw)  # type: ignore[arg-type]


def _recorded_hosts(path: Path) -> list[HostSnapshot]:
    with FlightRecorder(path, readonly=True) as rec:
        return [r for r in rec.read(kinds=["host"]) if isinstance(r, HostSnapshot)]


# --------------------------------------------------------------------------- host


@pytest.mark.slow
@pytest.mark.process
def test_host_memory_is_what_the_recorder_holds(stack: Stack) -> None:
    tl = _load(stack)
    hosts = _recorded_hosts(stack.recorder)
    assert len(tl.host["memory.total"]) >= 10
    assert set(tl.host["memory.total"].values) == {float(h.memory["total"]) for h in hosts}
    # every scraped value of a changing gauge is exactly one the agent recorded
    recorded = {float(h.memory["available"]) for h in hosts}
    scraped = set(tl.host["memory.available"].values)
    assert scraped and scraped <= recorded, sorted(scraped - recorded)[:5]


@pytest.mark.process
def test_one_point_per_scrape_by_default(stack: Stack) -> None:
    tl = _load(stack)
    spacing = np.diff(tl.host["memory.total"].ts)
    assert float(np.median(spacing)) == pytest.approx(1.0)  # the 1 s scrape interval was measured
    assert default_step(86_400, 1.0) == pytest.approx(8.64)  # a day stays under Prometheus' 11 000 points


@pytest.mark.process
def test_psi_and_vmstat_counters_are_present_and_monotonic(stack: Stack) -> None:
    tl = _load(stack)
    for key in ("psi.memory.some.total_s", "psi.memory.full.total_s", "psi.cpu.some.total_s", "psi.io.some.total_s",
                "vmstat.pgfault", "vmstat.pgmajfault"):  # fmt: skip
        series = tl.host[key]
        assert len(series) >= 10, key
        assert np.all(np.diff(series.values) >= 0), key
    last = {h.ts: h for h in _recorded_hosts(stack.recorder)}
    pgfault = tl.host["vmstat.pgfault"]
    assert pgfault.values[-1] <= max(h.vmstat["pgfault"] for h in last.values())
    avg = tl.host["psi.cpu.some.avg10"]
    assert len(avg) >= 10 and np.all((avg.values >= 0) & (avg.values <= 100))  # percent, as in the recorder


@pytest.mark.process
def test_processes_and_model_counts(stack: Stack) -> None:
    tl = _load(stack)
    assert tl.processes, "the agent exports its top processes"
    for track in tl.processes.values():
        assert track.comm and track.start_time_s is None
        assert np.all(track.series["rss"].values > 0)
    assert "processes" in tl.signals() and "process:rss" in tl.signals()
    assert tl.gpus == {} and tl.gpu_unavailable_reason  # the agent ran with --no-gpu: said, not silent


@pytest.mark.live
def test_live_cgroup_and_oom_kill(live_stack: Stack) -> None:
    stack = live_stack
    assert stack.group is not None and stack.oom_victims == 1
    tl = _load(stack)
    series = tl.cgroups[stack.group.path]
    assert set(series["limit"].values) == {float(CGROUP_LIMIT)}
    assert series["events.oom_kill"].values[-1] >= 1
    with FlightRecorder(stack.recorder, readonly=True) as rec:
        recorded = [r for r in rec.read(kinds=["cgroup"]) if isinstance(r, CgroupSnapshot) and r.path == stack.group.path]
    if any(r.pressure is not None for r in recorded):  # the agent found the group's v2 twin: its PSI comes through
        assert np.all(np.diff(series["psi.memory.some.total_s"].values) >= 0)
        total = series["psi.memory.some.total_s"]
        assert "psi.memory.some.avg10" in series, (sorted(series), total.ts - total.ts[0], total.values)
        avg = series["psi.memory.some.avg10"]  # derived from the total: rate x 100
        assert len(avg) >= 3 and np.all((avg.values >= 0) & (avg.values <= 100))
    else:
        assert "psi.memory.some.total_s" not in series  # nothing recorded, nothing invented
    memcg = [o for o in tl.ooms if o.constraint == "CONSTRAINT_MEMCG"]
    assert len(memcg) >= stack.oom_victims  # other OOMs on this machine may add to it, never remove
    assert all(o.source == "prometheus" and tl.start <= o.ts <= tl.end for o in tl.ooms)
    assert "ooms" in tl.signals()
    # The fleet path names the kill's owner from the group's own memory.events oom_kill counter, as the recorder does.
    analysis = analyze(tl)
    oom = next(f for f in analysis.findings if f.rule == "oom.host")
    assert analysis.primary == "host_oom" and oom.confidence >= 0.8, (oom.summary, oom.confidence)
    assert stack.group.path in oom.summary and "None" not in oom.summary


def test_counter_increases_become_events_counting_through_a_reset() -> None:
    ts = np.arange(7, dtype=float)
    kills = _Result({"constraint": "CONSTRAINT_NONE"}, ts, np.array([2, 2, 3, 3, 5, 0, 1], dtype=float))
    events = _ooms_from(kills, "CONSTRAINT_NONE")  # +1 at t=2, +2 at t=4, agent restart, +1 at t=6
    assert [e.ts for e in events] == [2.0, 4.0, 4.0, 6.0]
    assert {(e.constraint, e.source) for e in events} == {("CONSTRAINT_NONE", "prometheus")}


@pytest.mark.process
def test_without_kills_no_synthetic_oom(stack: Stack) -> None:
    tl = _load(stack, until=time.time(), since_s=3)  # a window after the kill: counters flat
    assert "ooms" in tl.signals() and tl.ooms == []


# --------------------------------------------------------------------------- service


@pytest.mark.process
def test_service_series_from_the_tracker(stack: Stack) -> None:
    tl = _load(stack)
    svc = tl.service
    for key in ("queue_wait_p50_s", "queue_wait_p95_s", "inference_p50_s", "inference_p95_s", "e2e_p95_s",
                "requests_rps", "throughput_rps", "rejected_rps", "active_inferences", "queue_depth"):  # fmt: skip
        assert key in svc and len(svc[key]) >= 3, key
    assert np.all(svc["throughput_rps"].values >= 0) and svc["throughput_rps"].values.max() > 1
    assert svc["rejected_rps"].values.max() > 0  # 6 clients for 2 slots + 2 queue places
    # ~80 ms sleeps: the median lies in a plausible band, and p95 >= p50
    assert 0.01 < float(np.median(svc["inference_p50_s"].values)) < 1.0
    common, i50, i95 = np.intersect1d(svc["inference_p50_s"].ts, svc["inference_p95_s"].ts, return_indices=True)
    assert common.size and np.all(svc["inference_p95_s"].values[i95] >= svc["inference_p50_s"].values[i50])
    assert svc["active_inferences"].values.max() <= 2  # the slots
    assert svc["queue_depth"].values.max() <= 6  # at most every client waits
    # the tracker pre-creates every outcome at 0: measured zeros, not invented ones
    assert np.all(svc["error_rps"].values == 0) and np.all(svc["timeout_rps"].values == 0)


# --------------------------------------------------------------------------- external exporters


@pytest.mark.process
def test_node_exporter_fallback(stack: Stack) -> None:
    if not stack.node_exporter:
        pytest.skip(f"{NODE_EXPORTER} is not installed (Debian package prometheus-node-exporter)")
    tl = _load(stack, selector='job="ext-node"')
    assert set(tl.host["memory.total"].values) == {float(h.memory["total"]) for h in _recorded_hosts(stack.recorder)}
    assert len(tl.host["memory.available"]) >= 10 and len(tl.host["memory.inactive_file"]) >= 10
    for key in ("psi.memory.some.total_s", "psi.cpu.some.total_s", "vmstat.pgmajfault", "vmstat.pgfault"):
        assert len(tl.host[key]) >= 10 and np.all(np.diff(tl.host[key].values) >= 0), key
    avg = tl.host["psi.cpu.some.avg10"]  # derived: rate(total) x 100
    assert len(avg) >= 3 and np.all((avg.values >= 0) & (avg.values <= 100))


@pytest.mark.process
@pytest.mark.parametrize("fmt", ["openmetrics", "text"])
def test_vllm_cadvisor_dcgm_fallbacks(stack: Stack, fmt: str) -> None:
    tl = _load(stack, selector=f'job="ext-app-{fmt}"')
    svc = tl.service
    assert float(np.median(svc["queue_wait_p50_s"].values)) == pytest.approx(0.4, abs=0.1)  # bucket 0.3-0.5
    assert float(np.median(svc["inference_p95_s"].values)) == pytest.approx(1.5, abs=0.1)  # 1.2 lies in 1.0-1.5
    assert "e2e_p95_s" in svc and svc["throughput_rps"].values.max() > 5  # ~20 observations per second
    assert set(svc["active_inferences"].values) == {3.0} and set(svc["queue_depth"].values) == {1.0}
    pod = tl.cgroups["/kubepods/pod1"]
    assert set(pod["limit"].values) == {float(2 << 30)} and pod["usage"].values.min() >= 1 << 30
    assert "limit" not in tl.cgroups["/"]  # cAdvisor's 0 = unlimited is absent, not a zero limit
    some = pod["psi.memory.some.avg10"].values  # rate(total) x 100: ~20 % (the loop is a bit slower than 20 Hz)
    assert np.all(np.diff(pod["psi.memory.some.total_s"].values) >= 0) and 10 < float(np.median(some)) <= 21
    assert set(tl.gpus[0]["used"].values) == {1024.0 * 2**20} and set(tl.gpus[0]["free"].values) == {80000.0 * 2**20}
    assert tl.host == {} and tl.processes == {}


# --------------------------------------------------------------------------- selectors and hosts


@pytest.mark.process
def test_selector_filters(stack: Stack) -> None:
    app_only = _load(stack, selector='job="llm-app"')
    assert app_only.host == {} and app_only.processes == {} and "throughput_rps" in app_only.service
    nothing = _load(stack, selector='job="no-such-job"')
    assert (nothing.host, nothing.cgroups, nothing.processes, nothing.service, nothing.ooms) == ({}, {}, {}, {}, [])
    assert nothing.signals() == set()


@pytest.mark.process
def test_several_hosts_use_one_and_say_so(stack: Stack) -> None:
    tl = _load(stack, selector='job=~"llm-host|mirror"')
    assert "2 hosts matched" in tl.source
    ts = tl.host["memory.total"].ts
    assert np.all(np.diff(ts) > 0)  # one instance's samples, not two interleaved


# --------------------------------------------------------------------------- errors


@pytest.mark.process
def test_errors_are_value_errors_with_a_reason(stack: Stack) -> None:
    with pytest.raises(ValueError, match="cannot reach Prometheus"):
        load_prometheus(f"http://127.0.0.1:{free_port()}", since_s=60, timeout_s=5)
    with pytest.raises(ValueError, match=r"not a Prometheus API reply|HTTP \d+"):
        load_prometheus(f"http://127.0.0.1:{stack.agent_port}", since_s=60, timeout_s=5)  # a /metrics server
    with pytest.raises(ValueError, match="rejected"):
        load_prometheus(stack.prom.url, selector='job=="x"', since_s=60)
    with pytest.raises(ValueError, match="base URL"):
        load_prometheus("127.0.0.1:9090", since_s=60)


# --------------------------------------------------------------------------- end to end


@pytest.mark.process
def test_diag_analyze_prometheus_json(stack: Stack) -> None:
    out = subprocess.run(
        [*DIAG, "analyze", "--prometheus", stack.prom.url, "--selector", SELECTOR, "--since", "5m", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["verdict"]["primary"] in {c.name for c in CLASSES} | {HEALTHY, INCONCLUSIVE}
    assert doc["source"].startswith(f"prometheus:{stack.prom.url}")
    lacking = {entry["rule"]: entry["missing"] for entry in doc["not_evaluated"]}
    # Prometheus has no per-request rows, MoE routing or loader events: those rules say so
    assert any("requests" in missing for missing in lacking.values()), lacking
    assert all(entry["missing"] for entry in doc["not_evaluated"])
    bad = subprocess.run([*DIAG, "analyze", "--prometheus", f"http://127.0.0.1:{free_port()}", "--json"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "cannot reach Prometheus" in bad.stderr and "Traceback" not in bad.stderr
