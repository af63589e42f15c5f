"""Benchmark: ``diag analyze --fleet`` over N targets x 1 h at 5 s resolution, from a real Prometheus.

Data: each target is a recorded scenario run (``tests/fixtures/scenarios``) rendered through the product's
exporters (``tests/diag/fleet_series.py``) -- about 190 series per machine (agent and tracker) -- and tiled to
fill the hour: the run's samples, in order, one every 5 s, repeated (counters restart at each repeat, which
``rate()`` reads as a reset). Most targets replay ``healthy``; every tenth a queue, leak or host-OOM run.
Each size is served in turn by each ``--store`` (both by default, one after the other, so their figures compare
within one run): backfilled with promtool (one file per 25 targets) into a real Prometheus on 127.0.0.1, and
sent by remote write to a real VictoriaMetrics on 127.0.0.1 (``tests/vmserver.py``), as a Prometheus forwards
its series to a long-term store.

Measured in a fresh child process per size: ``load_fleet`` (the queries, parsing, split) and ``judge_fleet``
(assembly and rules in ``--jobs`` forked workers) wall times, the queries issued, and the peak RSS of the child
and of its largest worker (``getrusage``: the parent's own ``ru_maxrss`` and its children's). With one query in
flight, the load is also split per query: the HTTP round trip (the store evaluating and encoding, the transfer),
our decoding, the split per target; the six slowest queries are printed.

    .venv/bin/python bench/fleet.py [--targets 50,200] [--hours 1] [--step 5] [--jobs 2] [--concurrency 1,3]
                                    [--store prometheus,vm] [--rows DIR] [--keep DIR] [--warmup 1]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.diag.fleet_series import PLACEHOLDER, SELECTOR, recording, scenario_document  # noqa: E402

SICK_EVERY = 10
SICK = ("queue", "leak", "host-oom")
BATCH = 25
_LINE = re.compile(r"^(\S+\{.*\}|\S+) (\S+) (\S+)$")


def _tile(scenario: str) -> tuple[dict[str, list[tuple[str, str]]], int]:
    """The scenario's rendered series: family -> [(series, values by sample index)]; and the number of samples."""
    doc = scenario_document(recording(scenario), 0.0)
    families: dict[str, dict[str, list[str]]] = defaultdict(dict)
    times: set[str] = set()
    family = ""
    for line in doc.splitlines():
        if line.startswith("# TYPE "):
            family = line.split(" ")[2]
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        series, value, ts = m.groups()
        families[family].setdefault(series, []).append(value)
        times.add(ts)
    n = len(times)
    tiles = {fam: [(s, v) for s, v in series.items()] for fam, series in families.items()}
    return tiles, n  # type: ignore[return-value]


def _types(scenario: str) -> dict[str, str]:
    doc = scenario_document(recording(scenario), 0.0)
    return {line.split(" ")[2]: line.split(" ")[3] for line in doc.splitlines() if line.startswith("# TYPE ")}


def write_batch(path: Path, names: list[str], plan: dict[str, str], tiles: dict[str, tuple[dict, int]],
                types: dict[str, str], start: float, points: int, step: float) -> None:  # fmt: skip
    """Targets ``names`` as one OpenMetrics file: families grouped, every series ``points`` samples ``step`` apart."""
    stamps = [f"{start + k * step:.3f}" for k in range(points)]
    with path.open("w") as fh:
        for family, kind in types.items():
            fh.write(f"# TYPE {family} {'unknown' if kind == 'untyped' else kind}\n")
            for name in names:
                fams, _n = tiles[plan[name]]
                for series, values in fams.get(family, ()):
                    head = series.replace(PLACEHOLDER, name)
                    # Values repeat the run in order; a value the run did not have at some sample ("NaN") stays NaN.
                    reps = values * (points // len(values) + 1)
                    fh.write("".join(f"{head} {reps[k]} {stamps[k]}\n" for k in range(points)))
        fh.write("# EOF\n")


class _Profile:
    """Where the load's time goes, per query: the HTTP round trip (the store evaluating, encoding and sending, and
    our reading the bytes) apart from our decoding of the reply into arrays, and the split per target."""

    def __init__(self) -> None:
        self.queries: list[dict] = []
        self.split_s = 0.0

    def install(self) -> None:
        """Time each query's request (``_Prometheus._post``, inside the fleet's in-flight limit) and its decoding, per
        thread: the parts of the query set run on several threads even with one query in flight."""
        import diag.sources.fleet as fleet_mod

        prof = self
        local, lock = threading.local(), threading.Lock()
        import diag.sources.prometheus as prom_mod

        call, post = fleet_mod._LazyPrometheus._call, prom_mod._Prometheus._post  # the request, inside the limit
        lazy, split = fleet_mod._lazy_matrix, fleet_mod._split

        def timed_call(client, path, params):  # type: ignore[no-untyped-def]
            row = {"query": params.get("query", ""), "http_s": 0.0, "bytes": 0, "wire_bytes": 0, "encoding": ""}
            local.row = row
            t = time.perf_counter()
            out = call(client, path, params)
            row["call_s"] = time.perf_counter() - t
            with lock:
                prof.queries.append(row)
            return out

        def timed_post(client, where, params):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            resp = post(client, where, params)
            row = local.row
            row["http_s"] = time.perf_counter() - t
            row["bytes"], row["wire_bytes"] = len(resp.content), resp.num_bytes_downloaded
            row["encoding"] = resp.headers.get("content-encoding", "") or "identity"
            return resp

        def timed_lazy(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = lazy(*a, **k)
            row = getattr(local, "row", None)
            if row is not None:
                row["decode_s"] = time.perf_counter() - t
                row["series"] = len(out)
            return out

        def timed_split(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = split(*a, **k)
            prof.split_s = time.perf_counter() - t
            return out

        fleet_mod._LazyPrometheus._call = timed_call  # type: ignore[method-assign]
        prom_mod._Prometheus._post = timed_post  # type: ignore[method-assign]
        fleet_mod._lazy_matrix = timed_lazy
        fleet_mod._split = timed_split

    def summary(self) -> dict:
        q = self.queries
        top = sorted(q, key=lambda r: -r["call_s"])[:6]
        return {
            "http_s": sum(r["http_s"] for r in q), "decode_s": sum(r.get("decode_s", 0.0) for r in q),
            "call_s": sum(r["call_s"] for r in q), "split_s": self.split_s,
            "mib": sum(r["bytes"] for r in q) / 2**20, "wire_mib": sum(r["wire_bytes"] for r in q) / 2**20,
            "encodings": sorted({r["encoding"] for r in q}),
            "top": [{"query": r["query"][:90], "http_s": round(r["http_s"], 2), "decode_s": round(r.get("decode_s", 0), 2),
                     "mib": round(r["bytes"] / 2**20, 1), "series": r.get("series", 0)} for r in top],
        }  # fmt: skip


ACCEPT_ENCODING_ENV = "LLMDIAG_BENCH_ACCEPT_ENCODING"


def child(url: str, end: float, since: float, jobs: int, concurrency: int, rows_to: str) -> None:
    """One measured run, printed as JSON on stdout (and its rows, target by target, to ``rows_to`` if given)."""
    from diag.cli.fleet import judge_fleet
    from diag.sources.fleet import load_fleet

    prof = _Profile()
    if concurrency == 1:  # the per-query figures are each query's own with one in flight
        prof.install()
    t0 = time.perf_counter()
    encoding = os.environ.get(ACCEPT_ENCODING_ENV)  # --gzip-too: the reply compressed as a remote store's would be
    fleet = load_fleet(url, selector=SELECTOR, since_s=since, until=end, timeout_s=600, concurrency=concurrency,
                       headers={"Accept-Encoding": encoding} if encoding else None)  # fmt: skip
    t1 = time.perf_counter()
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load_cpu = time.process_time()
    rows = judge_fleet(fleet.targets, jobs, lambda _m: None)
    t2 = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() + usage.ru_utime + usage.ru_stime
    verdicts: dict[str, int] = defaultdict(int)
    for r in rows:
        verdicts[r["verdict"]] += 1
    if rows_to:
        Path(rows_to).write_text(json.dumps(sorted(rows, key=lambda r: r["target"]), sort_keys=True, default=str))
    print(json.dumps({
        "targets": len(fleet.targets), "queries": fleet.queries, "step": fleet.step, "load_s": t1 - t0,
        "judge_s": t2 - t1, "rss_load_mib": rss_load / 1024, "load_cpu_s": load_cpu, "cpu_s": cpu,
        "rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "verdicts": verdicts,
        "profile": prof.summary() if prof.queries else None,
    }))  # fmt: skip


def _compacted(url: str, start: float, end: float, timeout_s: float = 900.0) -> None:
    """Wait until Prometheus has merged the backfilled blocks: one per two-hour range the hour touches.

    Why: promtool writes one block per file, all over the same hour; Prometheus merges such overlapping blocks in
    the background a minute or so after it starts (~10 s of CPU at 200 targets), which would land in the middle of
    the first measured run -- and a Prometheus that scraped its targets would have one block for the hour. Blocks
    are aligned on two-hour boundaries (promtool's default block duration), so an hour across one (17:34-18:34)
    stays two blocks after the merge: waiting for one would wait out the whole timeout."""
    import httpx

    want = int(end // 7200) - int(start // 7200) + 1
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        loaded = re.search(r"^prometheus_tsdb_blocks_loaded (\S+)$", text, re.M)
        if loaded and float(loaded[1]) <= want:
            return
        time.sleep(5)
    print(f"Prometheus had not merged its backfilled blocks into {want}; measuring anyway", flush=True)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, its threads included.

    Why: the store shares this host's cores with the analysing process, so its own CPU time for the query set,
    over the cores, is a floor under the load's wall time that no client-side change can go below."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="50,200")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--step", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--concurrency", default="1", help="queries in flight; several (1,3) are measured in turn")
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--store", default="prometheus,vm", help="the servers queried, each size on each in turn")
    ap.add_argument("--rows", type=Path, help="write each run's rows, target by target, to DIR (to compare verdicts)")
    ap.add_argument(
        "--compare-code",
        type=Path,
        metavar="TREE",
        help="also run each measurement with the code of TREE (a checkout of another commit), alternately",
    )
    ap.add_argument(
        "--gzip-too",
        action="store_true",
        help="also run each measurement with the replies gzip-compressed (as from a store elsewhere)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured runs of this tree against each freshly loaded store first (default 1)",
    )
    ap.add_argument("--child", nargs=6, metavar=("URL", "END", "SINCE", "JOBS", "CONC", "ROWS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        url, end, since, jobs, conc, rows_to = args.child
        child(url, float(end), float(since), int(jobs), int(conc), rows_to)
        return
    from tests.promserver import prometheus
    from tests.vmserver import victoria_metrics

    if args.warmup < 0:
        ap.error("--warmup: a number of runs, 0 or more")
    stores = args.store.split(",")
    if not stores or any(s not in ("prometheus", "vm") for s in stores):
        ap.error("--store: prometheus, vm, or both separated by a comma")
    sizes = [int(x) for x in args.targets.split(",")]
    points = int(args.hours * 3600 / args.step)
    end = float(int(time.time() - 900) // 300 * 300)
    start = end - (points - 1) * args.step
    scenarios = ("healthy", *SICK)
    t = time.perf_counter()
    tiles = {s: _tile(s) for s in scenarios}
    types: dict[str, str] = {}
    for s in scenarios:
        for fam, kind in _types(s).items():
            types.setdefault(fam, kind)
    print(f"rendered {len(scenarios)} runs in {time.perf_counter() - t:.1f} s; "
          f"{sum(len(v) for v in tiles['healthy'][0].values())} series per healthy target, {points} points each")  # fmt: skip
    if args.rows:
        args.rows.mkdir(parents=True, exist_ok=True)
    for n in sizes:
        work = Path(args.keep or tempfile.mkdtemp(prefix="llmdiag-bench-fleet-")) / f"n{n}"
        work.mkdir(parents=True, exist_ok=True)
        names = [f"node{i:04d}" for i in range(n)]
        plan = {name: (SICK[(i // SICK_EVERY) % len(SICK)] if i % SICK_EVERY == 3 else "healthy")
                for i, name in enumerate(names)}  # fmt: skip
        t = time.perf_counter()
        files = []
        for b in range(0, n, BATCH):
            path = work / f"batch{b // BATCH:03d}.om"
            write_batch(path, names[b : b + BATCH], plan, tiles, types, start, points, args.step)
            files.append(path)
        size = sum(p.stat().st_size for p in files)
        print(f"{n} targets: wrote {size / 2**20:.0f} MiB of OpenMetrics in {time.perf_counter() - t:.1f} s", flush=True)
        for kind in stores:
            t = time.perf_counter()
            store = prometheus([], backfill=files, ready_timeout_s=300) if kind == "prometheus" else victoria_metrics()
            with store as server:
                if kind == "vm":
                    sent = sum(server.remote_write(p) for p in files)
                    print(f"{n} targets: {sent} samples sent by remote write", flush=True)
                else:
                    _compacted(server.url, start, end)
                print(f"{n} targets: {kind} loaded and ready in {time.perf_counter() - t:.1f} s", flush=True)
                since = (points - 1) * args.step
                variants = [("this tree", Path(__file__), None)]
                if args.gzip_too:
                    variants.append(("this tree, gzip", Path(__file__), "gzip"))
                if args.compare_code:
                    variants.append((f"{args.compare_code}", args.compare_code / "bench" / "fleet.py", None))
                # Why a warm-up: the first run against a store just loaded was measured 2-3 s slower than the next
                # ones whatever the code (21.6 s, then 18.6 and 19.6 s; the old tree after it 22.8, 22.0, 22.7 s): the
                # backfilled blocks read for the first time. A Prometheus serving its last hour holds it in memory.
                for k in range(args.warmup):
                    cmd = [sys.executable, str(Path(__file__)), "--child", server.url, str(end), str(since),
                           str(args.jobs), args.concurrency.split(",")[0], ""]  # fmt: skip
                    t = time.perf_counter()
                    subprocess.run(cmd, capture_output=True, check=False, timeout=3600, cwd=ROOT)
                    print(f"warm-up run {k + 1} of {args.warmup} (not counted): {time.perf_counter() - t:.1f} s", flush=True)
                for conc in args.concurrency.split(","):
                    for label, script, encoding in variants:
                        tag = f"-{label.replace('/', '_').replace(' ', '_').replace(',', '')}" if len(variants) > 1 else ""
                        rows_to = str(args.rows / f"{kind}-{n}-c{conc}{tag}.json") if args.rows else ""
                        cmd = [sys.executable, str(script), "--child", server.url, str(end), str(since), str(args.jobs),
                               conc, rows_to]  # fmt: skip
                        env = {**os.environ, ACCEPT_ENCODING_ENV: encoding} if encoding else None
                        loadavg = _loadavg()
                        store_cpu0 = _cpu_s(server.pid)
                        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600, env=env,
                                             cwd=script.parent.parent)  # fmt: skip
                        store_cpu = _cpu_s(server.pid) - store_cpu0
                        if out.returncode != 0:
                            print(out.stderr[-3000:])
                            continue
                        r = json.loads(out.stdout.strip().splitlines()[-1])
                        r["store_cpu_s"] = store_cpu
                        if len(variants) > 1:
                            print(f"[{label}]", end=" ")
                        _report(n, kind, conc, args.jobs, loadavg, r)
        for p in files:
            p.unlink()
        if not args.keep:
            shutil.rmtree(work.parent, ignore_errors=True)


def _report(n: int, store: str, conc: str, jobs: int, loadavg: str, r: dict) -> None:
    """One measured run: one line, then where the load's time went when it was profiled."""
    print(f"{n} targets on {store} (load average {loadavg}), {conc} queries in flight: {r['queries']} queries, "
          f"step {r['step']:g} s; load {r['load_s']:.1f} s, rules {r['judge_s']:.1f} s ({jobs} jobs), "
          f"total {r['load_s'] + r['judge_s']:.1f} s; peak RSS {r['rss_self_mib']:.0f} MiB "
          f"(after load {r['rss_load_mib']:.0f}), largest worker {r['rss_worker_mib']:.0f} MiB; "
          f"verdicts {dict(r['verdicts'])}", flush=True)  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    if "cpu_s" in r:  # an older tree's child (--compare-code) does not count its own
        print(f"  the store's own CPU over the run: {r['store_cpu_s']:.1f} s (the analysing process: {r['cpu_s']:.1f} s); "
              f"on {cores} shared cores the load cannot take less than "
              f"{(r['store_cpu_s'] + r['load_cpu_s']) / cores:.1f} s", flush=True)  # fmt: skip
    else:
        print(f"  the store's own CPU over the run: {r['store_cpu_s']:.1f} s", flush=True)
    p = r.get("profile")
    if p:
        print(f"  load: HTTP {p['http_s']:.1f} s for {p['mib']:.0f} MiB of JSON ({p['wire_mib']:.0f} MiB on the wire, "
              f"encoding {p['encodings']}), decoding {p['decode_s']:.1f} s (beside the next requests), "
              f"split {p['split_s']:.1f} s, no request in flight {r['load_s'] - p['http_s'] - p['split_s']:.1f} s",
              flush=True)  # fmt: skip
        for q in p["top"]:
            print(f"    {q['http_s']:6.2f} s HTTP {q['decode_s']:5.2f} s decode {q['mib']:6.1f} MiB "
                  f"{q['series']:6d} series  {q['query']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
