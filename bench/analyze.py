"""Benchmark: ``load_recorder`` + ``analyze`` on a flight recorder the size of a busy day.

Full size (16x) = 24 h of 1 Hz samples and 1 M requests, in one recorder file:

- host: one ``HostSnapshot`` per second (PSI cpu/memory/io some+full, 26 meminfo fields, 22 vmstat
  counters -- the shape the real agent writes);
- one watched cgroup: one ``CgroupSnapshot`` per second (hybrid: v1 memory + v2 PSI twin);
- 10 processes: one ``ProcessSample`` each per second (one of them holds a model file);
- 1 M ``RequestTiming`` rows: Poisson arrivals (~11.6 req/s) served by 16 slots with lognormal
  service times (an M/G/16 queue simulated exactly, so waits appear when bursts do), 0.5 % errors,
  0.2 % rejections; plus one ``ServiceConfig``.

1x and 4x are the first 1/16 and 4/16 of the same day (rows copied by time in SQLite), so the three
sizes hold the same mix. Each size is loaded and analysed in a fresh subprocess, which reports the
wall time of ``load_recorder(path)`` and of ``analyze(timeline)`` separately and its peak RSS
(``VmHWM``). Whatever rules are registered in ``diag/rules`` run.

Targets: full size <= 2.5 s (load + analyse) and <= 400 MiB peak RSS of the analysing process.

``--order time`` reads the same rows written in time order (as an agent and a tracker append them) instead of one
kind, and one process, after another as the generator writes them.

``--compare-rev REV`` runs the same recorder files through the code at another git revision too (unpacked from
git into a temporary folder, measured by this script's own child), alternating runs, so a before/after is
measured the same way, side by side, in one session on a machine whose load changes.

``--floor`` splits one reader's JSON load of the largest size into SQLite, msgspec and the rest, and times reading the
same numbers back from typed blocks in a scratch file: what a recorder storing its numbers typed would cost to load.

``--blocks`` stores each recorder's complete hours decoded beside it first (``diag.sources.compact``, what
``diag collect`` does once an hour), as they stand at the last row's time -- the analysis made right then, whose
last 13 minutes (the hour under way) are still JSON -- and measures this tree both ways, alternating: reading every
row's JSON (``use_blocks=False``) and reading the stored hours (the default ``load_recorder``). The compaction's
own time, size and peak RSS are printed.

    .venv/bin/python bench/analyze.py [--scales 1,4,16] [--keep DIR] [--profile] [--workers N] [--repeat N]
                                      [--order kind|time] [--compare-rev main] [--floor] [--blocks]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The tree whose code is measured: this one, or (a --compare-rev child) another revision's, measured by this script.
TREE = Path(os.environ.get("LLMDIAG_BENCH_TREE") or ROOT)
sys.path.insert(0, str(TREE))

import numpy as np  # noqa: E402

from collectors.catalog import MEMINFO_FIELDS, VMSTAT_FIELDS  # noqa: E402
from collectors.recorder import FlightRecorder  # noqa: E402
from collectors.records import (  # noqa: E402
    CgroupSnapshot,
    HostSnapshot,
    ProcessSample,
    Psi,
    PsiLine,
    RequestTiming,
    ServiceConfig,
)

DAY_S = 86_400
FULL_REQUESTS = 1_000_000
N_PROCESSES = 10
SLOTS = 16
GIB = 1 << 30
T0 = 1_790_000_000.0  # a fixed Unix time (2026-09), so runs are comparable


# --------------------------------------------------------------------------- generation


def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _host_rows(rng: np.random.Generator, n: int) -> list[tuple[float, str, int, str]]:
    """1 Hz host samples: a daily load wave on memory, small noisy PSI, monotonic counters."""
    tpl = HostSnapshot(
        ts=0.0,
        psi={r: Psi(some=PsiLine(0, 0, 0, 0), full=PsiLine(0, 0, 0, 0)) for r in ("cpu", "memory", "io")},
        memory={snake: 0 for snake in MEMINFO_FIELDS.values()},
        vmstat={f: 0 for f in VMSTAT_FIELDS},
    ).to_dict()
    t = np.arange(n, dtype=np.float64)
    total = 24 << 30
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * t / DAY_S)
    used = (6 << 30) + (4 << 30) * wave + rng.normal(0, 64 << 20, n)
    psi_some = {r: np.clip(rng.gamma(0.5, 0.4, n), 0, 100) for r in ("cpu", "memory", "io")}
    totals = {r: np.cumsum(psi_some[r] / 100 * 1e6).astype(np.int64) for r in psi_some}
    vm_rates = {f: rng.poisson(50 if "pg" in f else 1, n) for f in VMSTAT_FIELDS}
    vm_cum = {f: np.cumsum(v) for f, v in vm_rates.items()}
    rows = []
    tsv = T0 + t
    for i in range(n):
        mem = tpl["memory"]
        u = int(used[i])
        for snake in mem:
            mem[snake] = (u // 7) & ~4095
        mem["total"] = total
        mem["free"] = total - u
        mem["available"] = total - u + (2 << 30)
        mem["swap_total"] = mem["swap_free"] = 0
        for r in ("cpu", "memory", "io"):
            some = tpl["psi"][r]["some"]
            full = tpl["psi"][r]["full"]
            a = round(float(psi_some[r][i]), 2)
            some["avg10"], some["avg60"], some["avg300"], some["total_us"] = a, a, a, int(totals[r][i])
            full["avg10"], full["avg60"], full["avg300"], full["total_us"] = a / 2, a / 2, a / 2, int(totals[r][i] // 2)
        vm = tpl["vmstat"]
        for f in vm:
            vm[f] = int(vm_cum[f][i])
        tpl["ts"] = float(tsv[i])
        rows.append((float(tsv[i]), "host", HostSnapshot.SCHEMA, _dumps(tpl)))
    return rows


def _cgroup_rows(rng: np.random.Generator, n: int) -> list[tuple[float, str, int, str]]:
    tpl = CgroupSnapshot(
        ts=0.0, path="/system.slice/llm.service", version="hybrid", usage_bytes=0, working_set_bytes=0, peak_bytes=0,
        limit_bytes=16 << 30, swap_bytes=0, events={"max": 0, "oom_kill": 0},
        stat={"anon": 0, "file": 0, "inactive_file": 0, "pgmajfault": 0},
        under_oom=False, pressure=Psi(some=PsiLine(0, 0, 0, 0), full=PsiLine(0, 0, 0, 0)),
    ).to_dict()  # fmt: skip
    t = np.arange(n, dtype=np.float64)
    usage = (5 << 30) + (3 << 30) * (0.5 + 0.5 * np.sin(2 * np.pi * t / DAY_S)) + rng.normal(0, 32 << 20, n)
    some = np.clip(rng.gamma(0.5, 0.3, n), 0, 100)
    some_total = np.cumsum(some / 100 * 1e6).astype(np.int64)
    majflt = np.cumsum(rng.poisson(3, n))
    rows = []
    for i in range(n):
        u = int(usage[i])
        tpl["ts"] = T0 + i
        tpl["usage_bytes"], tpl["working_set_bytes"] = u, int(u * 0.9)
        tpl["peak_bytes"] = max(tpl["peak_bytes"], u)
        tpl["stat"].update(anon=int(u * 0.8), file=int(u * 0.2), inactive_file=int(u * 0.1), pgmajfault=int(majflt[i]))
        p = tpl["pressure"]
        a = round(float(some[i]), 2)
        p["some"].update(avg10=a, avg60=a, avg300=a, total_us=int(some_total[i]))
        p["full"].update(avg10=a / 2, avg60=a / 2, avg300=a / 2, total_us=int(some_total[i] // 2))
        rows.append((T0 + i, "cgroup", CgroupSnapshot.SCHEMA, _dumps(tpl)))
    return rows


def _process_rows(rng: np.random.Generator, n: int) -> list[tuple[float, str, int, str]]:
    rows = []
    for k in range(N_PROCESSES):
        pid = 4000 + k
        tpl = ProcessSample(
            ts=0.0, pid=pid, ppid=1, comm="python" if k == 0 else f"worker{k}",
            cmdline="python -m server --model /models/m.safetensors" if k == 0 else f"worker{k} --flag",
            start_time_s=100.0 + k, num_threads=8, memory_cgroup="/system.slice/llm.service",
            model_files=["/models/m.safetensors"] if k == 0 else [],
        ).to_dict()  # fmt: skip
        base = (4 << 30) if k == 0 else (200 << 20) * (1 + k % 3)
        rss = base + rng.normal(0, 16 << 20, n)
        maj = np.cumsum(rng.poisson(0.2, n))
        minf = np.cumsum(rng.poisson(200, n))
        for i in range(n):
            r = int(rss[i])
            tpl["ts"] = T0 + i + 0.01 * k
            tpl["rss_bytes"], tpl["pss_bytes"], tpl["uss_bytes"], tpl["swap_bytes"] = r, int(r * 0.95), int(r * 0.9), 0
            tpl["major_faults"], tpl["minor_faults"] = int(maj[i]), int(minf[i])
            rows.append((tpl["ts"], "process", ProcessSample.SCHEMA, _dumps(tpl)))
    return rows


def _request_rows(rng: np.random.Generator, n: int, span_s: float) -> list[tuple[float, str, int, str]]:
    """An M/G/16 queue: Poisson arrivals, lognormal service, first come first served."""
    rate = n / span_s
    arrivals = T0 + np.cumsum(rng.exponential(1.0 / rate, n))
    service = rng.lognormal(np.log(0.8), 0.6, n)
    prompt = np.maximum(1, rng.lognormal(np.log(400), 0.9, n)).astype(np.int64)
    output = np.maximum(1, rng.lognormal(np.log(150), 0.7, n)).astype(np.int64)
    fate = rng.random(n)
    free = [float(arrivals[0])] * SLOTS
    tpl = RequestTiming(ts=0.0, route="/v1/completions", model="m", pid=4000).to_dict()
    rows = []
    for i in range(n):
        a = float(arrivals[i])
        tpl["arrival"] = a
        tpl["prompt_tokens"], tpl["output_tokens"] = int(prompt[i]), int(output[i])
        if fate[i] < 0.002:  # refused at the door
            tpl["start"], tpl["finish"], tpl["outcome"], tpl["ttft_s"] = None, a + 0.001, "rejected", None
            tpl["output_tokens"] = None
        else:
            start = max(a, heapq.heappop(free))
            finish = start + float(service[i])
            heapq.heappush(free, finish)
            tpl["start"], tpl["finish"] = start, finish
            tpl["outcome"] = "error" if fate[i] > 0.995 else "ok"
            tpl["ttft_s"] = start - a + float(service[i]) * 0.1
        tpl["ts"] = tpl["finish"]
        rows.append((tpl["finish"], "request", RequestTiming.SCHEMA, _dumps(tpl)))
    return rows


def generate(path: Path, seconds: int, requests: int, seed: int = 7) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    big = 1 << 40
    counts = {}
    with FlightRecorder(path, retention_s=10 * DAY_S, max_size_bytes=big) as rec:
        rec.write([ServiceConfig(ts=T0, service="bench", pid=4000, settings={"workers": 1, "max_concurrency": SLOTS})])
        for kind, make in (
            ("host", lambda: _host_rows(rng, seconds)),
            ("cgroup", lambda: _cgroup_rows(rng, seconds)),
            ("process", lambda: _process_rows(rng, seconds)),
            ("request", lambda: _request_rows(rng, requests, float(seconds))),
        ):
            rows = make()
            for lo in range(0, len(rows), 200_000):
                rec.write_rows(rows[lo : lo + 200_000])
            counts[kind] = len(rows)
            del rows
    return counts


def subset(full: Path, out: Path, seconds: float, in_time_order: bool = False) -> None:
    """Copy the first ``seconds`` of the full recorder into a new recorder file (same schema); ``in_time_order``:
    rows written in time order, as an agent and a tracker append them, where the generator writes one kind (and one
    process) after another."""
    FlightRecorder(out, retention_s=10 * DAY_S, max_size_bytes=1 << 40).close()
    db = sqlite3.connect(out)
    db.execute("ATTACH DATABASE ? AS src", (str(full),))
    order = " ORDER BY ts, id" if in_time_order else ""
    db.execute("INSERT INTO records(ts, kind, schema, body) SELECT ts, kind, schema, body FROM src.records "
               f"WHERE ts < ?{order}", (T0 + seconds,))  # fmt: skip
    db.commit()
    db.execute("DETACH DATABASE src")
    db.close()


# --------------------------------------------------------------------------- measurement (child process)


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def _vm_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def child(path: str, profile: bool, workers: int | None, use_blocks: bool | None = None) -> None:
    import resource

    from diag.rules.base import RULES
    from diag.rules.engine import analyze, load_rules
    from diag.sources import load_recorder

    load_rules()  # imports (numpy/scipy/rules) are not what we measure
    base_rss = _vm_rss()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    c0 = time.process_time()
    t0 = time.perf_counter()
    # use_blocks None: the tree's own default (a revision from before the stored hours has no such option)
    timeline = load_recorder(path, workers=workers, **({} if use_blocks is None else {"use_blocks": use_blocks}))
    t1 = time.perf_counter()
    c1 = time.process_time()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss_loaded = _vm_rss()
    result = analyze(timeline)
    t2 = time.perf_counter()
    c2 = time.process_time()
    hwm = _vm_hwm()  # the peak of load + analyse (the rules timed alone below are the bench's own extra work)
    per_rule = []  # each evaluated rule again, alone: where the analysis time goes
    for rule_id in result.evaluated:
        r0 = time.perf_counter()
        RULES[rule_id].fn(timeline)
        per_rule.append((rule_id, round(time.perf_counter() - r0, 3)))
    per_rule.sort(key=lambda x: -x[1])
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    print(json.dumps({
        "load_s": t1 - t0, "analyze_s": t2 - t1, "base_rss": base_rss, "rss_loaded": rss_loaded, "hwm": hwm,
        "load_cpu_s": c1 - c0 + kids.ru_utime + kids.ru_stime, "analyze_cpu_s": c2 - c1, "worker_hwm": kids.ru_maxrss * 1024,
        "slowest_rules": per_rule[:5], "load_avg": os.getloadavg()[0],
        "counts": timeline.counts, "rules_evaluated": len(result.evaluated),
        "not_evaluated": [f"{e['rule']} (missing {', '.join(e['missing'])})" for e in result.not_evaluated],
        "findings": [(f.rule, round(f.confidence, 2)) for f in result.findings], "primary": result.primary,
    }))  # fmt: skip


def _timed_phases(path: str) -> dict[str, float]:
    """One reader's JSON load split into its phases (this tree's loader, its windows): SQLite handing over the
    joined windows, msgspec decoding them, and everything else (columns, checks, freeing, building)."""
    from diag.sources import recorder as source
    from diag.timeline import fastdecode

    sql_s = decode_s = 0.0
    joined = source.RecorderReader.joined

    def timed_joined(self: object, *args: object) -> object:
        nonlocal sql_s
        t = time.perf_counter()
        out = joined(self, *args)  # type: ignore[arg-type]
        sql_s += time.perf_counter() - t
        return out

    def timed(decode: Any) -> Any:
        def timed_decode(kind: str, text: str | bytes) -> object:
            nonlocal decode_s
            t = time.perf_counter()
            out = decode(kind, text)
            decode_s += time.perf_counter() - t
            return out

        return timed_decode

    decoders = [name for name in ("decode", "decode_strict") if hasattr(fastdecode, name)]  # a tree may lack one
    saved = {name: getattr(fastdecode, name) for name in decoders}
    source.RecorderReader.joined = timed_joined  # type: ignore[method-assign]
    for name, decode in saved.items():
        setattr(fastdecode, name, timed(decode))
    try:
        t = time.perf_counter()
        source.load_recorder(path, workers=1)
        total = time.perf_counter() - t
    finally:
        source.RecorderReader.joined = joined  # type: ignore[method-assign]
        for name, decode in saved.items():
            setattr(fastdecode, name, decode)
    return {"json_total_s": total, "json_sql_s": sql_s, "json_decode_s": decode_s}


def _typed_columns_floor(path: str, block: int = 3600) -> dict[str, float]:
    """What loading the same day would cost were its numbers stored typed: every array of the Timeline written into
    a scratch SQLite file as float64 (text columns as codes into their few distinct values) in blocks of
    ``block`` rows, then read back into whole columns. A prototype's floor, not a product: no window, no checks."""
    from diag.sources import load_recorder

    tl = load_recorder(path, workers=1)
    arrays: dict[str, np.ndarray] = {}
    for group, series in [("host", tl.host), *((f"cgroup {k}", v) for k, v in tl.cgroups.items()),
                          *((f"process {k}", t.series) for k, t in tl.processes.items())]:  # fmt: skip
        for name, s in series.items():
            arrays.setdefault(f"{group}|ts|{id(s.ts)}", s.ts)
            arrays[f"{group}|{name}"] = s.values
    for name, col in tl.requests.columns.items():
        arrays[f"requests|{name}"] = col
    del tl
    with tempfile.TemporaryDirectory(prefix="llmdiag-floor-") as tmp:
        db_path = Path(tmp) / "typed.db"
        db = sqlite3.connect(db_path)
        db.execute("CREATE TABLE blocks(name TEXT, k INTEGER, kind TEXT, data BLOB, PRIMARY KEY(name, k))")
        stored = 0
        for name, col in arrays.items():
            kind, values = "f8", col
            if col.dtype == object:
                distinct = list(dict.fromkeys(col.tolist()))
                lookup = {v: i for i, v in enumerate(distinct)}
                codes = np.uint8 if len(distinct) < 256 else np.uint32
                kind, values = json.dumps(distinct), np.fromiter(map(lookup.__getitem__, col), codes, col.size)
            rows = [(name, k, kind, values[lo : lo + block].tobytes()) for k, lo in enumerate(range(0, values.size, block))]
            db.executemany("INSERT INTO blocks VALUES (?, ?, ?, ?)", rows)
            stored += values.nbytes
        db.commit()
        db.close()
        del arrays
        t = time.perf_counter()
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        pieces: dict[str, tuple[str, list[bytes]]] = {}
        for name, kind, data in db.execute("SELECT name, kind, data FROM blocks ORDER BY name, k"):
            pieces.setdefault(name, (kind, []))[1].append(data)
        out = {}
        for name, (kind, blobs) in pieces.items():
            joined = b"".join(blobs)
            if kind == "f8":
                out[name] = np.frombuffer(joined, np.float64).copy()
            else:
                distinct = np.array(json.loads(kind), dtype=object)
                out[name] = distinct[np.frombuffer(joined, np.uint8 if distinct.size < 256 else np.uint32)]
        read_s = time.perf_counter() - t
        db.close()
    return {"typed_read_s": read_s, "typed_mib": stored / 2**20, "typed_columns": len(out)}


def floor(path: str) -> None:
    """The ``--floor`` child: where one reader's JSON load goes, and the typed-columns prototype beside it."""
    from diag.rules.engine import load_rules

    load_rules()
    print(json.dumps({**_timed_phases(path), **_typed_columns_floor(path), "load_avg": os.getloadavg()[0]}))


# --------------------------------------------------------------------------- driver

TARGET_WALL_S = 2.5
TARGET_PEAK = 400 << 20


def _tree_at(rev: str, folder: Path) -> Path:
    """The repository at git revision ``rev``, unpacked into ``folder`` (its own ``bench/analyze.py`` runs there)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def _run(tree: Path, path: Path, workers: int | None, profile: bool, use_blocks: bool | None = None) -> dict | None:
    """One measured load + analysis in a fresh process: this script's measurement, ``tree``'s code."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path)]
    if use_blocks is not None:
        cmd += ["--use-blocks", "1" if use_blocks else "0"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    if profile:
        cmd.append("--profile")
    env = {**os.environ, "LLMDIAG_BENCH_TREE": str(tree)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tree, env=env)
    if out.returncode != 0:
        print(f"{tree}: child failed (rc {out.returncode})\n{out.stderr[-3000:]}")
        return None
    if profile:
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compact(path: Path, end: float) -> None:
    """Store ``path``'s complete hours decoded (this tree's ``compact``, in a fresh process as ``diag collect``
    runs it), as the agent's hourly runs would have left them at ``end``, the last row's time: the analysis is then
    the one made at that moment, its last 13 minutes (the hour under way) read from JSON; print the cost."""
    code = ("import json, sys, time, resource; from diag.sources.compact import compact; "
            f"d = compact(sys.argv[1], now={end}); "
            "print(json.dumps({**d.__dict__, 'maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"compact {path}: rc {out.returncode}\n{out.stderr[-3000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"     {path.name}: {d['written']} hours stored ({d['kept']} kept) in {d['seconds']:.2f} s, "
          f"{d['bytes_written'] / 2**20:.0f} MiB, peak RSS {d['maxrss'] / 1024:.0f} MiB")  # fmt: skip


def _report_floor(path: Path) -> None:
    """The ``--floor`` figures of ``path`` (this tree's code, one fresh process)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--floor-child", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        print(f"floor: child failed (rc {out.returncode})\n{out.stderr[-3000:]}")
        return
    f = json.loads(out.stdout.strip().splitlines()[-1])
    rest = f["json_total_s"] - f["json_sql_s"] - f["json_decode_s"]
    print(f"     floor, one reader (load avg {f['load_avg']:.1f}): JSON load {f['json_total_s']:.2f} s = SQLite "
          f"{f['json_sql_s']:.2f} + msgspec {f['json_decode_s']:.2f} + columns, checks, build {rest:.2f}; "
          f"the same numbers stored typed ({f['typed_columns']} columns, {f['typed_mib']:.0f} MiB) read back in "
          f"{f['typed_read_s']:.2f} s")  # fmt: skip


def _report(scale: int, label: str, runs: list[dict]) -> dict:
    """Every run's figures (a shared machine is noisy: all of them, with the load average at each start), then the
    median run by wall time in detail."""
    by_wall = sorted(runs, key=lambda r: r["load_s"] + r["analyze_s"])
    res = by_wall[len(by_wall) // 2]
    each = "; ".join(
        f"{r['load_s'] + r['analyze_s']:.2f} s ({r['load_s']:.2f} + {r['analyze_s']:.2f}), CPU "
        f"{r['load_cpu_s'] + r['analyze_cpu_s']:.2f} s, peak {r['hwm'] / 2**20:.0f} MiB, load avg {r['load_avg']:.1f}"
        for r in runs
    )
    c = res["counts"]
    total = res["load_s"] + res["analyze_s"]
    print(f"x{scale:<2} {label}: {len(runs)} run(s) in the order run: {each}\n"
          f"     median run ({scale / 16 * 24:4.1f} h: host {c.get('host', 0)}, cgroup {c.get('cgroup', 0)}, "
          f"process {c.get('process', 0)}, request {c.get('request', 0)})\n"
          f"     wall: load {res['load_s']:.2f} s + analyze {res['analyze_s']:.2f} s = {total:.2f} s "
          f"({total / scale:.3f} s per 1x)\n"
          f"     CPU:  load {res['load_cpu_s']:.2f} s (all readers) + analyze {res['analyze_cpu_s']:.2f} s "
          f"({(res['load_cpu_s'] + res['analyze_cpu_s']) / scale:.3f} s per 1x); load average at start "
          f"{res['load_avg']:.1f}\n"
          f"     RSS: before {res['base_rss'] / 2**20:.0f} MiB, after load {res['rss_loaded'] / 2**20:.0f} MiB, "
          f"peak {res['hwm'] / 2**20:.0f} MiB (a forked reader's peak: {res['worker_hwm'] / 2**20:.0f} MiB)\n"
          f"     rules: {res['rules_evaluated']} evaluated, verdict {res['primary']}; slowest {res['slowest_rules']}\n"
          f"     not evaluated: {'; '.join(res['not_evaluated']) or 'none'}")  # fmt: skip
    if res["findings"]:
        print(f"     findings: {res['findings']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,4,16", help="multiples of 1/16 of a day (16 = 24 h + 1 M requests)")
    ap.add_argument("--keep", type=Path, help="generate into (or reuse) this directory instead of a temp one")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest run (to stderr)")
    ap.add_argument("--workers", type=int, help="load_recorder(workers=...) (default: its own choice)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size (and per tree); every run is shown")
    ap.add_argument("--order", choices=("kind", "time"), default="kind",
                    help="rows as generated, one kind after another (default), or in time order as an agent "
                    "writes them")  # fmt: skip
    ap.add_argument("--compare-rev", metavar="REV",
                    help="also run the same files through the code at this git revision, alternating runs")  # fmt: skip
    ap.add_argument("--floor", action="store_true",
                    help="also split one reader's JSON load of the largest size into SQLite, decoding and the rest, "
                    "and time reading the same numbers stored typed (a prototype's floor)")  # fmt: skip
    ap.add_argument("--blocks", action="store_true",
                    help="store each recorder's complete hours decoded first (as diag collect does hourly) and measure "
                    "this tree reading them and reading the JSON, alternating")  # fmt: skip
    ap.add_argument("--use-blocks", choices=("0", "1"), help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--floor-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_child:
        floor(args.floor_child)
        return
    if args.child:
        child(args.child, args.profile, args.workers, None if args.use_blocks is None else args.use_blocks == "1")
        return
    scales = sorted({int(s) for s in args.scales.split(",")})
    if args.repeat < 1 or (args.workers is not None and args.workers < 1):
        ap.error("--repeat and --workers take a positive number")
    if not scales or min(scales) < 1:
        ap.error("--scales takes positive multiples of 1/16 of a day")
    tmp = None
    if args.keep:
        folder = args.keep
        folder.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="llmdiag-bench-")
        folder = Path(tmp.name)
    other = tempfile.TemporaryDirectory(prefix="llmdiag-bench-rev-") if args.compare_rev else None
    try:
        trees: list[tuple[str, Path, bool | None]] = [("this tree", ROOT, None)]
        if args.blocks:
            trees = [("this tree, JSON rows", ROOT, False), ("this tree, stored hours", ROOT, True)]
        if other is not None:
            trees.append((f"git {args.compare_rev}", _tree_at(args.compare_rev, Path(other.name)), None))
        full = folder / "x16.db"
        if not full.exists():
            t = time.perf_counter()
            counts = generate(full, DAY_S, FULL_REQUESTS)
            print(f"generated {full.name}: {counts} in {time.perf_counter() - t:.1f} s, "
                  f"{full.stat().st_size / 2**20:.0f} MiB")  # fmt: skip
        largest: dict[str, dict] = {}
        for scale in scales:
            in_time = args.order == "time"
            path = full if scale == 16 and not in_time else folder / f"x{scale}{'-time' if in_time else ''}.db"
            if not path.exists():
                subset(full, path, DAY_S * scale / 16, in_time_order=in_time)
            if args.blocks:
                _compact(path, T0 + DAY_S * scale / 16)
            runs: dict[str, list[dict]] = {label: [] for label, _, _ in trees}
            for k in range(args.repeat):
                order = trees if k % 2 == 0 else trees[::-1]  # alternate which tree runs first
                for label, tree, use_blocks in order:
                    res = _run(tree, path, args.workers, args.profile and scale == max(scales), use_blocks)
                    if res is not None:
                        runs[label].append(res)
            for label, got in runs.items():
                if got:
                    res = _report(scale, label, got)
                    if scale == 16:
                        largest[label] = res
            if args.floor and scale == max(scales):
                _report_floor(path)
        for label, res in largest.items():
            total = res["load_s"] + res["analyze_s"]
            print(
                f"full size, rows in {args.order} order, {label} (median run): {total:.2f} s wall, "
                f"{res['load_cpu_s'] + res['analyze_cpu_s']:.2f} s "
                f"CPU (target <= {TARGET_WALL_S} s: {'met' if total <= TARGET_WALL_S else 'MISSED'}), peak RSS "
                f"{res['hwm'] / 2**20:.0f} MiB (target <= {TARGET_PEAK >> 20} MiB: "
                f"{'met' if res['hwm'] <= TARGET_PEAK else 'MISSED'})"
            )
    finally:
        if tmp is not None:
            tmp.cleanup()
        if other is not None:
            other.cleanup()


if __name__ == "__main__":
    main()
