"""Benchmark: what the generated alerts cost Prometheus, how fast they arrive, what the live diagnosis costs the agent.

Three parts (``--part rules|delivery|cpu|all``):

- ``rules``: every generated rule file (the shipped default spec) loaded into a real Prometheus 2.42
  whose TSDB holds 24 h of backfilled history for 1 000 series (``promtool tsdb create-blocks-from
  openmetrics``; 125 models x 8 SLI series: requests ok/error and count/le-bucket of the TTFT,
  queue-wait and e2e histograms, one sample per minute, realistic rates with a 0.2 % error ratio).
  Reported: each rule group's evaluation time as Prometheus measures it
  (``prometheus_rule_group_last_duration_seconds``), median over several evaluations, and the sum.
  Caveat: the period (30d) rules sum recorded 5m increases, which have no backfilled history, so their
  cost here is a floor; the 1d/3d windows read the full backfill.
- ``delivery``: runs the live end-to-end test (``tests/alerts/test_live_alerts.py``, real Prometheus,
  Alertmanager 0.25, agent, demo, an OOM kill and a queue overload) and reports its fault -> delivery times.
- ``cpu``: two agents side by side (``diag collect``, 1 Hz, same flags) for ``--cpu-seconds``, one with
  ``--diagnose-every 15s``; CPU share of one core from /proc/<pid>/stat (utime+stime) over the last
  ``--cpu-measure`` seconds, after the recorder holds a full 5-minute diagnosis window. Then, for
  ``--cpu-runs`` runs 15 s apart, the CPU seconds of one diagnosis run measured in this process on the
  plain agent's recorder: the live path (window kept between runs) and a full read plus the rules.

    .venv/bin/python bench/alerts.py --part all [--cpu-seconds 540 --cpu-measure 240]

Prints a JSON document and a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import free_port, process_cpu_s  # noqa: E402
from collectors import catalog as cat  # noqa: E402


def write_openmetrics(path: Path, models: int, hours: float, step_s: int, end: float) -> int:
    """1 000 counter series (for 125 models) as OpenMetrics, one sample per ``step_s``; returns the sample count."""
    hists = (cat.REQUEST_TTFT, cat.REQUEST_QUEUE_WAIT, cat.REQUEST_E2E)
    thresholds = {cat.REQUEST_TTFT.name: "2.5", cat.REQUEST_QUEUE_WAIT.name: "1.28", cat.REQUEST_E2E.name: "20.48"}
    start = int(end - hours * 3600)
    steps = range(start, int(end), step_s)
    n = 0
    with path.open("w") as fh:
        # one family at a time (OpenMetrics wants a family's samples together), series by series, time ascending
        fam = cat.REQUESTS.base_name
        fh.write(f"# TYPE {fam} counter\n")
        for m in range(models):
            rate = 1 + (m % 10)  # requests per second
            for outcome, share in (("ok", 0.998), ("error", 0.002)):
                lab = f'{{model="m{m}",route="/v1/completions",outcome="{outcome}",job="llm-api",instance="h{m % 5}:8000"}}'
                for i, ts in enumerate(steps):
                    fh.write(f"{fam}_total{lab} {round(i * step_s * rate * share, 3)} {ts}\n")
                    n += 1
        for h in hists:
            fh.write(f"# TYPE {h.name} histogram\n")
            for m in range(models):
                rate = 1 + (m % 10)
                base = f'model="m{m}",route="/v1/completions",job="llm-api",instance="h{m % 5}:8000"'
                for le, share in ((thresholds[h.name], 0.995),):
                    for i, ts in enumerate(steps):
                        fh.write(f'{h.name}_bucket{{{base},le="{le}"}} {round(i * step_s * rate * share, 3)} {ts}\n')
                        n += 1
                # the rules read the threshold bucket and _count (= the +Inf bucket, left out to keep 1 000 series)
                for i, ts in enumerate(steps):
                    fh.write(f"{h.name}_count{{{base}}} {i * step_s * rate} {ts}\n")
                    n += 1
        fh.write("# EOF\n")
    return n


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name) :]] = float(value)
    return out


def bench_rules(evaluations: int) -> dict[str, Any]:
    from alerts.generate import DEFAULT_OUT

    work = Path(tempfile.mkdtemp(prefix="llmdiag-bench-alerts-"))
    proc = None
    try:
        end = time.time() - 120
        om = work / "history.om"
        t0 = time.monotonic()
        samples = write_openmetrics(om, models=125, hours=24, step_s=60, end=end)
        gen_s = time.monotonic() - t0
        # 125 models x (2 outcomes + 3 histograms x (threshold bucket, _count)) = 1 000 series
        t0 = time.monotonic()
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(work / "data")], check=True,
                       capture_output=True)  # fmt: skip
        backfill_s = time.monotonic() - t0
        om.unlink()
        rules = sorted(DEFAULT_OUT.glob("*.rules.yaml"))
        cfg = ["global:", "  evaluation_interval: 15s", "rule_files:"] + [f'  - "{p}"' for p in rules]
        (work / "prometheus.yml").write_text("\n".join(cfg) + "\n")
        port = free_port()
        log = (work / "prometheus.log").open("wb")
        argv = ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=1, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"prometheus not ready: {(work / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)
        ready_at = time.monotonic()
        per_group: dict[str, list[float]] = {}
        seen: dict[str, float] = {}
        deadline = time.monotonic() + evaluations * 15 + 120
        while time.monotonic() < deadline and min((len(v) for v in per_group.values()), default=0) < evaluations:
            last = _metric(url, "prometheus_rule_group_last_duration_seconds")
            stamps = _metric(url, "prometheus_rule_group_last_evaluation_timestamp_seconds")
            for labels, value in last.items():
                group = re.search(r'rule_group="[^"]*;([^"]+)"', labels).group(1)
                stamp = stamps.get(labels, 0.0)
                if stamp and seen.get(group) != stamp:
                    seen[group] = stamp
                    per_group.setdefault(group, []).append(value)
            time.sleep(2)
        query = {"query": 'count({__name__=~"llmdiag_.*"})'}
        counts = httpx.get(f"{url}/api/v1/query", params=query, trust_env=False, timeout=120).json()
        series = int(float(counts["data"]["result"][0]["value"][1])) if counts["data"]["result"] else 0
        medians = {g: statistics.median(v) for g, v in sorted(per_group.items())}
        return {"samples": samples, "series_in_tsdb": series, "generate_s": round(gen_s, 1), "backfill_s": round(backfill_s, 1),
                "evaluations": {g: len(v) for g, v in per_group.items()},
                "group_median_s": {g: round(v, 4) for g, v in medians.items()},
                "total_median_s": round(sum(medians.values()), 3), "evaluation_interval_s": 15,
                "measured_for_s": round(time.monotonic() - ready_at)}  # fmt: skip
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def bench_delivery() -> dict[str, Any]:
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/alerts/test_live_alerts.py"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    m = re.search(r"fault -> delivery \(s\): (\{.*\})", result.stdout + result.stderr)
    timings = json.loads(m.group(1).replace("'", '"')) if m else {}
    return {"passed": result.returncode == 0, "timings_s": timings, "tail": (result.stdout + result.stderr)[-300:]}


def _cpu_per_diagnosis(recorder: Path, runs: int, every_s: float = 15.0) -> dict[str, Any]:
    """CPU seconds (this process's, ``time.process_time``) per diagnosis run on a real agent's recorder that holds a
    full window and is still being written at 1 Hz, run every ``every_s`` as the agent would: the live path
    (``LiveDiagnosis.run_once``, window kept between runs) and, at the same moments, a full read of the window
    plus the rules (what each run cost before the window was kept). CPU time, not wall time: robust to load."""
    from diag.live.diagnosis import LiveDiagnosis
    from diag.rules.engine import analyze
    from diag.sources import load_recorder

    live = LiveDiagnosis(recorder, every_s)
    live.run_once()  # the first run reads the whole window, as the agent's first run does
    live_s, full_s, load_s = [], [], []
    for _ in range(runs):
        time.sleep(every_s)
        t0 = time.process_time()
        live.run_once()
        t1 = time.process_time()
        timeline = load_recorder(recorder, since_s=live.window_s, workers=1)
        t2 = time.process_time()
        analyze(timeline)
        t3 = time.process_time()
        live_s.append(t1 - t0)
        full_s.append(t3 - t1)
        load_s.append(t2 - t1)
    med = statistics.median
    return {"runs": runs, "live_median_s": round(med(live_s), 4), "live_mean_s": round(statistics.fmean(live_s), 4),
            "full_median_s": round(med(full_s), 4), "full_load_median_s": round(med(load_s), 4),
            "rows_in_window": sum(timeline.counts.values()), "loadavg": os.getloadavg()}  # fmt: skip


def bench_cpu(total_s: float, measure_s: float, runs: int = 10) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="llmdiag-bench-cpu-"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, extra in (("plain", []), ("diagnose-15s", ["--diagnose-every", "15s"])):
            procs[name] = subprocess.Popen([sys.executable, "-m", "diag.cli", "collect", "--listen", "127.0.0.1:0",
                                            "--recorder", str(work / f"{name}.db"), "--no-gpu", *extra],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
        time.sleep(total_s - measure_s)
        start = {n: process_cpu_s(p.pid) for n, p in procs.items()}
        t0 = time.monotonic()
        time.sleep(measure_s)
        wall = time.monotonic() - t0
        share = {n: round(100 * (process_cpu_s(p.pid) - start[n]) / wall, 2) for n, p in procs.items()}
        loadavg = os.getloadavg()
        per_run = _cpu_per_diagnosis(work / "plain.db", runs) if runs else {}
        return {"cpu_percent_of_one_core": share, "measured_s": round(wall), "after_s": total_s - measure_s,
                "loadavg": loadavg, "cpu_s_per_diagnosis_run": per_run}  # fmt: skip
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("rules", "delivery", "cpu", "all"), default="all")
    ap.add_argument("--evaluations", type=int, default=8)
    ap.add_argument("--cpu-seconds", type=float, default=540.0)
    ap.add_argument("--cpu-measure", type=float, default=240.0)
    ap.add_argument("--cpu-runs", type=int, default=10, help="in-process diagnosis runs timed after the side-by-side part")
    args = ap.parse_args()
    out: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    if args.part in ("rules", "all"):
        out["rules"] = bench_rules(args.evaluations)
    if args.part in ("delivery", "all"):
        out["delivery"] = bench_delivery()
    if args.part in ("cpu", "all"):
        out["cpu"] = bench_cpu(args.cpu_seconds, args.cpu_measure, args.cpu_runs)
    out["loadavg_end"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
