"""Benchmark: ``diag bundle --since 1h`` over a full hour of 1 Hz history, side by side with ``sos report``.

The recorder holds what an agent plus a tracked server write in an hour on a 1-GPU inference box:

- host: one ``HostSnapshot`` per second (PSI cpu/memory/io some+full, every meminfo and vmstat field
  the sampler keeps), a slow memory climb with noise and a pressure episode;
- one watched cgroup (hybrid: v1 memory + v2 PSI twin) per second;
- 12 processes, one ``ProcessSample`` each per second (one model holder; command lines with a
  secret flag, so the redactor does real work);
- one ``GpuSnapshot`` per second (one device, two processes);
- ~14 000 ``RequestTiming`` rows from an M/G/4 queue with a load surge (so waits appear), a
  ``ServiceConfig``; ending *now*, so ``--since 1h`` selects all of it.

The project's packages are byte-compiled first, as an installed copy is (``compile_tree``). Then, in pairs
side by side (alternating which goes first), each in a fresh process timed with ``wait4`` (wall, CPU, peak
RSS = ``ru_maxrss``), with the load average at its start:

1. ``diag bundle --since 1h --recorder R --out D`` (through ``diag.cli`` with the bundle command
   registered if ``diag/cli/main.py`` does not have it yet); the archive and folder sizes;
2. ``sos report --batch --only-plugins memory,process,kernel --tmp-dir D`` (Debian ``sosreport``),
   if installed and able to run here; otherwise the exact reason is printed.

Targets: bundle wall time <= 1.2x sos report's in the same run (pair by pair and median), <= 150 MiB RSS,
archive <= 20 MiB. The host is shared and noisy: run it several times and keep every figure.

    .venv/bin/python bench/bundle.py [--keep DIR] [--runs 5] [--no-sos] [--floor]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from collectors.catalog import MEMINFO_FIELDS, VMSTAT_FIELDS  # noqa: E402
from collectors.recorder import FlightRecorder  # noqa: E402
from collectors.records import (  # noqa: E402
    CgroupSnapshot,
    GpuDevice,
    GpuProcess,
    GpuSnapshot,
    HostSnapshot,
    ProcessSample,
    Psi,
    PsiLine,
    RequestTiming,
    ServiceConfig,
)

HOUR = 3600
N_PROCESSES = 12
SLOTS = 4
GiB = 1 << 30
MiB = 1 << 20
CGROUP = "/system.slice/llm.service"
TARGET_RATIO = 1.2  # bundle wall time / sos report wall time, same host, same moment

WRAPPER = (
    "import sys, typer; from diag.cli.main import app\n"
    "names = {c.name or (c.callback.__name__ if c.callback else '') for c in app.registered_commands}\n"
    "if 'bundle' not in names:\n"
    "    from diag.cli.bundle import register; register(app)\n"
    "sys.argv[0] = 'diag'; app()\n"
)


def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def generate(path: Path, seconds: int = HOUR, seed: int = 11) -> dict[str, int]:
    """Write ``seconds`` of history ending now into a fresh recorder; return rows per kind."""
    rng = np.random.default_rng(seed)
    t0 = time.time() - seconds + 1
    t = np.arange(seconds, dtype=np.float64)
    rows: list[tuple[float, str, int, str]] = []
    counts: dict[str, int] = {}

    # host: memory climbs 2 GiB over the hour with noise; a pressure episode in the last 15 min
    episode = (t > seconds * 0.75).astype(float)
    used = 9 * GiB + 2 * GiB * t / seconds + rng.normal(0, 48 * MiB, seconds)
    psi = {r: np.clip(rng.gamma(0.6, 0.5, seconds) + 18 * episode * (r == "memory") * rng.random(seconds), 0, 100)
           for r in ("cpu", "memory", "io")}  # fmt: skip
    totals = {r: np.cumsum(psi[r] / 100 * 1e6).astype(np.int64) for r in psi}
    vm_cum = {f: np.cumsum(rng.poisson(40 if "pg" in f else 1, seconds)) for f in VMSTAT_FIELDS}
    host = HostSnapshot(
        ts=0.0,
        psi={r: Psi(some=PsiLine(0, 0, 0, 0), full=PsiLine(0, 0, 0, 0)) for r in ("cpu", "memory", "io")},
        memory={snake: 0 for snake in MEMINFO_FIELDS.values()},
        vmstat={f: 0 for f in VMSTAT_FIELDS},
    ).to_dict()
    for i in range(seconds):
        u = int(used[i])
        mem = host["memory"]
        for k in mem:
            mem[k] = (u // 9) & ~4095
        mem.update(total=24 * GiB, free=24 * GiB - u, available=24 * GiB - u + GiB, swap_total=0, swap_free=0)
        for r in psi:
            a = round(float(psi[r][i]), 2)
            host["psi"][r]["some"].update(avg10=a, avg60=a, avg300=a, total_us=int(totals[r][i]))
            host["psi"][r]["full"].update(avg10=a / 3, avg60=a / 3, avg300=a / 3, total_us=int(totals[r][i] // 3))
        for f in host["vmstat"]:
            host["vmstat"][f] = int(vm_cum[f][i])
        host["ts"] = t0 + i
        rows.append((t0 + i, "host", 1, _dumps(host)))
    counts["host"] = seconds

    cg = CgroupSnapshot(
        ts=0.0, path=CGROUP, version="hybrid", usage_bytes=0, working_set_bytes=0, peak_bytes=0, limit_bytes=12 * GiB,
        swap_bytes=0, events={"max": 0, "oom_kill": 0}, stat={"anon": 0, "file": 0, "inactive_file": 0, "pgmajfault": 0},
        under_oom=False, pressure=Psi(some=PsiLine(0, 0, 0, 0), full=PsiLine(0, 0, 0, 0)),
    ).to_dict()  # fmt: skip
    cg_usage = 7 * GiB + 1.5 * GiB * t / seconds + rng.normal(0, 32 * MiB, seconds)
    majflt = np.cumsum(rng.poisson(2 + 200 * episode))
    for i in range(seconds):
        u = int(cg_usage[i])
        cg["ts"] = t0 + i + 0.001
        cg["usage_bytes"], cg["working_set_bytes"] = u, int(u * 0.92)
        cg["peak_bytes"] = max(cg["peak_bytes"], u)
        cg["stat"].update(anon=int(u * 0.8), file=int(u * 0.2), inactive_file=int(u * 0.08), pgmajfault=int(majflt[i]))
        a = round(float(psi["memory"][i]) * 1.2, 2)
        cg["pressure"]["some"].update(avg10=a, avg60=a, avg300=a, total_us=int(totals["memory"][i] * 1.2))
        cg["pressure"]["full"].update(avg10=a / 3, avg60=a / 3, avg300=a / 3, total_us=int(totals["memory"][i] * 0.4))
        rows.append((cg["ts"], "cgroup", 1, _dumps(cg)))
    counts["cgroup"] = seconds

    for k in range(N_PROCESSES):
        holder = k == 0
        proc = ProcessSample(
            ts=0.0, pid=4000 + k, ppid=1 if holder else 4000, comm="python3" if k < 5 else f"helper{k}",
            cmdline=(f"python3 -m vllm.entrypoints.openai.api_server --model /models/llama-8b --api-key <redacted> "
                     f"--port {8000 + k}" if k < 5 else f"/usr/bin/helper{k} --interval 5"),
            start_time_s=1000.0 + k, num_threads=24 if k < 5 else 2, memory_cgroup=CGROUP,
            model_files=["/models/llama-8b/model.safetensors"] if holder else [],
        ).to_dict()  # fmt: skip
        base = 6 * GiB if holder else (300 * MiB) * (1 + k % 3)
        rss = base + rng.normal(0, 12 * MiB, seconds)
        maj = np.cumsum(rng.poisson(0.3 + 30 * episode))
        minf = np.cumsum(rng.poisson(300, seconds))
        for i in range(seconds):
            r = int(rss[i])
            proc["ts"] = t0 + i + 0.002 + 0.0001 * k
            proc["rss_bytes"], proc["pss_bytes"], proc["uss_bytes"], proc["swap_bytes"] = r, int(r * 0.96), int(r * 0.9), 0
            proc["major_faults"], proc["minor_faults"] = int(maj[i]), int(minf[i])
            rows.append((proc["ts"], "process", 1, _dumps(proc)))
    counts["process"] = seconds * N_PROCESSES

    gpu_used = 60 * GiB + 10 * GiB * t / seconds + rng.normal(0, 256 * MiB, seconds)
    for i in range(seconds):
        snap = GpuSnapshot(
            ts=t0 + i + 0.003, available=True, driver_version="550.54.15",
            devices=[GpuDevice(0, "GPU-0b1c2d3e", "NVIDIA H100 80GB HBM3", 80 * GiB, int(gpu_used[i]),
                               80 * GiB - int(gpu_used[i]), 512 * MiB, 0.7, 0.4)],
            processes=[GpuProcess(0, 4000, int(gpu_used[i]) - GiB), GpuProcess(0, 4001, GiB)],
        )  # fmt: skip
        rows.append((snap.ts, "gpu", 1, snap.to_json()))
    counts["gpu"] = seconds

    # requests: M/G/4, ~3.5/s baseline and a surge to ~6/s during the episode (waits grow)
    rate = lambda s: 3.5 + 2.5 * (s > seconds * 0.75)  # noqa: E731
    arrivals = []
    s = 0.0
    while s < seconds - 2:
        s += float(rng.exponential(1.0 / rate(s)))
        arrivals.append(s)
    free = [0.0] * SLOTS
    req = RequestTiming(ts=0.0, route="/v1/completions", model="llama-8b", pid=4000).to_dict()
    for a in arrivals:
        prompt = max(1, int(rng.lognormal(np.log(400), 0.8)))
        service = float(rng.lognormal(np.log(0.9), 0.35))
        start = max(a, heapq.heappop(free))
        finish = start + service
        heapq.heappush(free, finish)
        req.update(arrival=t0 + a, start=t0 + start, finish=t0 + finish, ts=t0 + finish, outcome="ok",
                   prompt_tokens=prompt, output_tokens=max(1, int(rng.lognormal(np.log(120), 0.6))),
                   ttft_s=start - a + service * 0.15)  # fmt: skip
        if req["finish"] < time.time():
            rows.append((req["ts"], "request", 1, _dumps(req)))
            counts["request"] = counts.get("request", 0) + 1
    cfg = ServiceConfig(ts=t0 + 30, service="llm", pid=4000, settings={"workers": 1, "max_concurrency": SLOTS, "queue_size": 64,
                                                                  "queue_timeout_s": 30, "memory_guard": 0.9})  # fmt: skip
    rows.append((cfg.ts, "config", 1, cfg.to_json()))
    counts["config"] = 1
    rows.sort(key=lambda r: r[0])
    with FlightRecorder(path, retention_s=30 * 24 * HOUR, max_size_bytes=1 << 40) as rec:
        for i in range(0, len(rows), 20000):
            rec.write_rows(rows[i : i + 20000])
    return counts


LAST_CPU_S = [0.0]


def timed(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MiB, exit code, output tail) of one command in a fresh process.

    The CPU seconds it used (user + sys, less sensitive than wall time to other load on a 2-core box)
    are left in ``LAST_CPU_S``."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    LAST_CPU_S[0] = usage.ru_utime + usage.ru_stime
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 1024, proc.returncode, out.decode(errors="replace")[-3000:]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def export_rev(rev: str, into: Path) -> Path:
    """The tree of revision ``rev`` (``git archive``), to run its ``diag bundle`` beside this one's."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def compile_tree(tree: Path = ROOT) -> float:
    """Byte-compile the project's packages, as ``pip install`` does for an installed copy; seconds taken.

    Why: a development shell may set PYTHONDONTWRITEBYTECODE (this one does), and then every ``diag`` run
    compiles the whole tree from source again (~0.4 s of a bundle), while sos's modules were compiled when
    dpkg installed them. Both sides are measured as installed."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(tree / "diag"), str(tree / "collectors")],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return time.monotonic() - started


def run_bundle(recorder: Path, out: Path, i: int, floor: bool, tree: Path = ROOT,
               label: str = "bundle") -> dict[str, float] | None:  # fmt: skip
    """One ``diag bundle`` of the code in ``tree`` (its directory first on the path: ``python -c`` puts the
    working directory there)."""
    target = out / f"{label}{i}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    argv = [sys.executable, "-c", WRAPPER, "bundle", "--since", "1h", "--recorder", str(recorder), "--out", str(target),
            "--deadline", "60s", "--quiet"]  # fmt: skip
    load = os.getloadavg()[0]
    wall, rss, rc, tail = timed(argv, cwd=str(tree))
    cpu = LAST_CPU_S[0]
    if rc != 0:
        print(f"{label} run {i} failed (exit {rc}):\n{tail}")
        return None
    folder = next(p for p in target.iterdir() if p.is_dir())
    archive = folder.with_name(folder.name + ".tar.gz")
    manifest = json.loads((folder / "manifest.json").read_text())
    steps = {c["name"]: c["duration_s"] for c in manifest["collectors"]}
    r = {"wall_s": wall, "cpu_s": cpu, "load": load, "rss_mib": rss, "archive_mib": archive.stat().st_size / MiB,
         "folder_mib": dir_bytes(folder) / MiB, "verdict": manifest["verdict"],
         "history_s": steps.get("history", float("nan")), "analysis_s": steps.get("analysis", float("nan")),
         "report_s": steps.get("report", float("nan")), "inner_s": manifest["duration_s"],
         "records": sum(manifest["timeline"].values()), "analyze_wall_s": float("nan"),
         "analyze_rss_mib": float("nan")}  # fmt: skip
    if floor:  # the same folder read back and judged by `diag analyze --bundle` alone (loader + rules)
        a_wall, a_rss, a_rc, _ = timed([sys.executable, "-m", "diag.cli", "analyze", "--bundle", str(folder), "--json"],
                                       cwd=str(ROOT))  # fmt: skip
        if a_rc == 0:
            r["analyze_wall_s"], r["analyze_rss_mib"] = a_wall, a_rss
    print(f"  {label} run {i}: wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s (load {r['load']:.2f}; "
          f"inside take_bundle {r['inner_s']:.2f} s: history {r['history_s']:.2f}, analysis {r['analysis_s']:.2f}, "
          f"report {r['report_s']:.2f}), peak RSS {r['rss_mib']:.0f} MiB, archive {r['archive_mib']:.1f} MiB, "
          f"folder {r['folder_mib']:.1f} MiB, {r['records']} records, verdict {r['verdict']}"
          + (f"; `diag analyze --bundle` on it alone: {r['analyze_wall_s']:.2f} s, {r['analyze_rss_mib']:.0f} MiB"
             if floor else ""))  # fmt: skip
    return r


def run_sos(out: Path, i: int) -> dict[str, float] | str:
    exe = shutil.which("sos") or shutil.which("sosreport")
    if exe is None:
        return "sos is not installed (Debian package 'sosreport': apt-get install -y sosreport)"
    target = out / f"sos{i}"
    target.mkdir(parents=True)
    argv = [exe, "report", "--batch", "--only-plugins", "memory,process,kernel", "--tmp-dir", str(target)]
    load = os.getloadavg()[0]
    wall, rss, rc, tail = timed(argv)
    cpu = LAST_CPU_S[0]
    archives = [p for p in target.iterdir() if p.name.startswith("sosreport") and p.name.endswith((".tar.xz", ".tar.gz"))]
    if rc != 0 or not archives:
        return f"sos report exited {rc} without an archive:\n{tail}"
    r = {"wall_s": wall, "cpu_s": cpu, "load": load, "rss_mib": rss, "archive_mib": archives[0].stat().st_size / MiB}
    print(f"  sos report run {i}: wall {wall:.2f} s, CPU {cpu:.2f} s (load {load:.2f}), peak RSS {rss:.0f} MiB, "
          f"archive {r['archive_mib']:.2f} MiB")  # fmt: skip
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="Keep the recorder and bundles here.")
    ap.add_argument("--runs", type=int, default=5, help="Pairs of runs (bundle and sos, side by side).")
    ap.add_argument("--no-sos", action="store_true")
    ap.add_argument("--floor", action="store_true", help="Also time `diag analyze --bundle` on the first bundle.")
    ap.add_argument("--compare-rev", help="Also run this git revision's diag bundle in every round (e.g. main).")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="llmdiag-bench-bundle-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        recorder = work / "recorder.db"
        recorder.unlink(missing_ok=True)
        started = time.monotonic()
        counts = generate(recorder)
        print(f"recorder: {sum(counts.values())} rows ({', '.join(f'{k} {n}' for k, n in counts.items())}), "
              f"{recorder.stat().st_size / MiB:.1f} MiB, generated in {time.monotonic() - started:.1f} s")  # fmt: skip
        print(f"byte-compiled diag/ and collectors/ in {compile_tree():.1f} s (as an installed copy is)")
        other = None
        if args.compare_rev:
            other = export_rev(args.compare_rev, work / "compare-tree")
            compile_tree(other)
            print(f"comparing with {args.compare_rev} ({other}), byte-compiled too")
        befores: list[dict[str, float]] = []
        print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
        bundles: list[dict[str, float]] = []
        soses: list[dict[str, float]] = []
        ratios: list[float] = []
        for i in range(args.runs):
            # side by side, alternating which goes first, so a burst of other load falls on both alike
            order = ["bundle", "sos"] + (["before"] if other else [])
            if i % 2:
                order.reverse()
            got: dict[str, dict[str, float] | str | None] = {}
            for which in order:
                if which == "bundle":
                    got[which] = run_bundle(recorder, work / "bundles", i, floor=args.floor and i == 0)
                elif which == "before" and other is not None:
                    got[which] = run_bundle(recorder, work / "bundles", i, False, other, args.compare_rev)
                elif not args.no_sos:
                    got[which] = run_sos(work / "sos", i)
            if isinstance(got.get("before"), dict):
                befores.append(got["before"])  # type: ignore[arg-type]
            b, o = got.get("bundle"), got.get("sos")
            if isinstance(b, dict):
                bundles.append(b)
            if isinstance(o, str):
                print(f"sos report: could not run here: {o}")
                args.no_sos = True
            elif isinstance(o, dict):
                soses.append(o)
                if isinstance(b, dict):
                    ratios.append(b["wall_s"] / o["wall_s"])
                    print(f"  pair {i}: bundle / sos = {ratios[-1]:.2f} (target <= {TARGET_RATIO})")
        med = lambda rows, key: float(np.median([r[key] for r in rows]))  # noqa: E731
        if bundles:
            print(f"diag bundle --since 1h: median wall {med(bundles, 'wall_s'):.2f} s, CPU {med(bundles, 'cpu_s'):.2f} s, "
                  f"peak RSS {med(bundles, 'rss_mib'):.0f} MiB (target <= 150), archive {med(bundles, 'archive_mib'):.1f} MiB "
                  f"(target <= 20; folder {med(bundles, 'folder_mib'):.1f} MiB); inside: "
                  f"history {med(bundles, 'history_s'):.2f} s, analysis {med(bundles, 'analysis_s'):.2f} s, "
                  f"report {med(bundles, 'report_s'):.2f} s")  # fmt: skip
        if befores:
            print(f"{args.compare_rev}'s diag bundle --since 1h: median wall {med(befores, 'wall_s'):.2f} s, "
                  f"CPU {med(befores, 'cpu_s'):.2f} s, peak RSS {med(befores, 'rss_mib'):.0f} MiB; inside: "
                  f"history {med(befores, 'history_s'):.2f} s, analysis {med(befores, 'analysis_s'):.2f} s, "
                  f"report {med(befores, 'report_s'):.2f} s; its ratio of the medians to sos "
                  f"{med(befores, 'wall_s') / med(soses, 'wall_s') if soses else float('nan'):.2f}")  # fmt: skip
        if soses:
            print(f"sos report --only-plugins memory,process,kernel: median wall {med(soses, 'wall_s'):.2f} s, "
                  f"CPU {med(soses, 'cpu_s'):.2f} s, peak RSS {med(soses, 'rss_mib'):.0f} MiB, archive "
                  f"{med(soses, 'archive_mib'):.2f} MiB (no history, no verdict, no report)")  # fmt: skip
        if ratios:
            print(f"bundle / sos, pair by pair: {' '.join(f'{r:.2f}' for r in ratios)}; median {float(np.median(ratios)):.2f}, "
                  f"ratio of the medians {med(bundles, 'wall_s') / med(soses, 'wall_s'):.2f} (target <= {TARGET_RATIO}); "
                  f"CPU ratio of the medians {med(bundles, 'cpu_s') / med(soses, 'cpu_s'):.2f}")  # fmt: skip
        print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
