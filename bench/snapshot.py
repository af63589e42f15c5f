"""Benchmark: CPU cost of one full snapshot, and the agent's CPU share and RSS at 1 Hz.

Targets: <= 10 ms CPU per full snapshot with ~70 processes; agent <= 1 % of one core; RSS <= 80 MiB.

    .venv/bin/python bench/snapshot.py [--runs 300] [--agent-seconds 60] [--long-argv-runs 40]

``--long-argv-runs``: also measure a host with a process whose single argument is 20 000 characters (a base64
blob, an inline JSON config: common for serving processes), side by side with the same host and an ordinary
process; the snapshot's CPU must stay within 10 % of the ordinary figure (redaction is linear in the argv).

Prints figures; asserts nothing (these machines are noisy; read the numbers).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import process_cpu_s
from collectors.snapshot import SamplerConfig, SnapshotTaker


def _proc_count() -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit())


def bench_snapshot(runs: int) -> dict[str, float]:
    taker = SnapshotTaker(SamplerConfig(kmsg_path="/dev/kmsg" if os.access("/dev/kmsg", os.R_OK) else None))
    parts = {
        "host": lambda: taker.host.sample(),
        "processes": lambda: taker.processes.sample(),
        "cgroup": lambda: taker.cgroups.sample(),
        "gpu": lambda: taker.gpu.sample() if taker.gpu else None,
    }
    for _ in range(20):  # warm caches (model-file scan, NVML init attempt)
        taker.take()
    results: dict[str, float] = {}
    samples = []
    for _ in range(runs):
        t0 = time.process_time()
        taker.take()
        samples.append(time.process_time() - t0)
    results["full"] = statistics.median(samples)
    results["full_p90"] = statistics.quantiles(samples, n=10)[-1]
    for name, fn in parts.items():
        cpu = []
        for _ in range(runs):
            t0 = time.process_time()
            fn()
            cpu.append(time.process_time() - t0)
        results[name] = statistics.median(cpu)
    taker.close()
    return results


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def bench_agent(seconds: float) -> dict[str, float]:
    diag = Path(sys.executable).with_name("diag")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [str(diag), "collect", "--interval", "1s", "--listen", "127.0.0.1:0", "--recorder", f"{tmp}/r.db"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(5)  # start-up (imports, first samples) is not steady state
            cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
            time.sleep(seconds)
            cpu1, t1 = process_cpu_s(proc.pid), time.monotonic()
            rss = _status_kib(proc.pid, "VmRSS") / 1024
            hwm = _status_kib(proc.pid, "VmHWM") / 1024
            size = os.path.getsize(f"{tmp}/r.db") + (
                os.path.getsize(f"{tmp}/r.db-wal") if os.path.exists(f"{tmp}/r.db-wal") else 0
            )
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
    return {
        "cpu_share": (cpu1 - cpu0) / (t1 - t0),
        "rss_mib": rss,
        "hwm_mib": hwm,
        "recorder_bytes_per_min": size / ((seconds + 5) / 60),
        "exit_code": proc.returncode,
    }


LONG_ARG_CHARS = 20_000


def _sleeper(arg: str) -> subprocess.Popen[bytes]:
    """A process that only sleeps, with ``arg`` as its single argument (Python ignores arguments after -c code)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", arg])


def bench_long_argv(runs: int) -> dict[str, float]:
    """Median CPU of one snapshot by a fresh taker (what ``diag snapshot`` does: every command line is read and
    redacted once), watching an ordinary process vs one with a 20 000-character argument; alternated run by run."""
    import random

    blob = "".join(random.Random(5).choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
                   for _ in range(LONG_ARG_CHARS))  # fmt: skip
    procs = {"ordinary": _sleeper("--port=8000"), "long argv": _sleeper(blob)}
    try:
        time.sleep(0.5)
        cpu: dict[str, list[float]] = {name: [] for name in procs}
        warm: dict[str, list[float]] = {name: [] for name in procs}
        for _ in range(runs):
            for name, proc in procs.items():
                taker = SnapshotTaker(SamplerConfig(pids=(proc.pid,), kmsg_path=None, gpu=False))
                t0 = time.process_time()
                snap = taker.take()
                cpu[name].append(time.process_time() - t0)
                t0 = time.process_time()
                taker.take()
                warm[name].append(time.process_time() - t0)
                taker.close()
                shown = [p.cmdline for p in snap.processes if p.pid == proc.pid]
                assert shown and len(shown[0]) > 20, f"the {name} process was not sampled"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)
    out = {f"cold {name}": statistics.median(v) for name, v in cpu.items()}
    out.update({f"warm {name}": statistics.median(v) for name, v in warm.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--agent-seconds", type=float, default=60.0)
    parser.add_argument("--long-argv-runs", type=int, default=40, help="0 skips the long-argument comparison")
    args = parser.parse_args()
    print(
        f"host: {os.cpu_count()} cores, {_proc_count()} processes, kernel {os.uname().release}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if args.long_argv_runs:
        la = bench_long_argv(args.long_argv_runs)
        for phase in ("cold", "warm"):
            base, long = la[f"{phase} ordinary"], la[f"{phase} long argv"]
            print(
                f"{phase} snapshot CPU, median of {args.long_argv_runs}: ordinary process {base * 1000:.2f} ms, "
                f"process with a {LONG_ARG_CHARS}-char argument {long * 1000:.2f} ms ({(long / base - 1) * 100:+.1f} %; "
                "target within 10 %)"
            )
    snap = bench_snapshot(args.runs)
    print(f"full snapshot CPU: median {snap['full'] * 1000:.2f} ms, p90 {snap['full_p90'] * 1000:.2f} ms (target <= 10 ms)")
    for name in ("host", "processes", "cgroup", "gpu"):
        print(f"  {name:<10} median {snap[name] * 1000:.3f} ms")
    agent = bench_agent(args.agent_seconds)
    print(
        f"agent at 1 Hz over {args.agent_seconds:.0f} s: CPU {agent['cpu_share'] * 100:.2f} % of one core (target <= 1 %), "
        f"RSS {agent['rss_mib']:.1f} MiB, peak {agent['hwm_mib']:.1f} MiB (target <= 80 MiB), "
        f"recorder growth {agent['recorder_bytes_per_min'] / 1024:.0f} KiB/min, exit code on SIGTERM {agent['exit_code']}"
    )


if __name__ == "__main__":
    main()
