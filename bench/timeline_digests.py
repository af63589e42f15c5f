"""Digests of every Timeline the loaders build from the replay fixtures, and of its analysis: run on two trees, diff.

Why: a change to how records become a Timeline (the record declarations, the builder, the loaders, the
recorder's queries) must not change a single finding. (``bench/digests.py`` does the same for the rules:
many windows of the records, one loader.) This prints, for every fixture under
``tests/fixtures`` (scenario recordings, their variants, the uninstrumented replays) and every way a
Timeline is built from it, the sha256 of ``json.dumps(analyze(timeline).to_dict(), sort_keys=True)``
and of the Timeline itself (every series, table column, track, record and count, in order):

- ``rows``: ``timeline_from_records`` (one record at a time), whole and over windows;
- ``recorder``: the records in a flight recorder, ``load_recorder`` whole and over the same windows,
  in one reader, in tiny batches, and in two forked readers;
- ``live``: ``RecorderWindow`` (the live diagnosis's incremental reader) at several instants;
- ``bundle-dir`` / ``bundle-tar``: a bundle's ``timeline/*.jsonl`` as a folder and as a .tar.gz;
- ``recorder+blocks``: the recorder read through its stored blocks (``diag.sources.blocks``, "hours" of 10 s here),
  whole and over the windows: each digest must equal its ``recorder`` view's, in the same run;
- ``prometheus``: ``load_prometheus`` against an in-process stand-in for the HTTP API (the test suite's
  approach: every catalog family answered, per selection of families; values rise, fall and skip).

    .venv/bin/python bench/timeline_digests.py > after.txt   # on each tree; then: diff before.txt after.txt

Prints digests; asserts nothing.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import sys
import tarfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
WORK = Path("/tmp/llmdiag-digests")


def _read(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# --------------------------------------------------------------------------- canonical forms


def _array(h: Any, a: np.ndarray) -> None:
    h.update(f"{a.dtype.str}{a.shape}".encode())
    if a.dtype == object:
        h.update(json.dumps([None if v is None else str(v) for v in a.tolist()]).encode())
    else:
        h.update(np.ascontiguousarray(a).tobytes())


def _series_map(h: Any, series: dict[str, Any]) -> None:
    for name, s in series.items():  # in the Timeline's order: a reordering shows
        h.update(f"|{name}".encode())
        _array(h, s.ts)
        _array(h, s.values)


def timeline_digest(tl: Any) -> str:
    h = hashlib.sha256()
    h.update(repr((tl.start, tl.end, tl.source, tl.gpu_unavailable_reason)).encode())
    h.update(b"host")
    _series_map(h, tl.host)
    for path, series in tl.cgroups.items():
        h.update(f"cgroup {path}".encode())
        _series_map(h, series)
    for key, t in tl.processes.items():
        h.update(repr((key, t.pid, t.start_time_s, t.comm, t.cmdline, t.memory_cgroup, sorted(t.model_files), t.ppid)).encode())
        _series_map(h, t.series)
    for index, series in tl.gpus.items():
        h.update(f"gpu {index}".encode())
        _series_map(h, series)
    h.update(b"service")
    _series_map(h, tl.service)
    for name in ("requests", "batches", "routing", "loader", "torch", "gpu_processes"):
        table = getattr(tl, name)
        h.update(f"table {name}".encode())
        for col, values in table.columns.items():
            h.update(col.encode())
            _array(h, values)
    for name in ("ooms", "cuda_ooms", "configs", "watch_scopes"):
        h.update(name.encode())
        h.update(json.dumps([r.to_dict() for r in getattr(tl, name)], sort_keys=True).encode())
    h.update(json.dumps([tl.counts, tl.skipped]).encode())
    return h.hexdigest()[:16]


def analysis_digest(tl: Any) -> str:
    from diag.rules.engine import analyze

    return hashlib.sha256(json.dumps(analyze(tl).to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the views of one fixture


def _windows(records: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    ts = sorted(float(r["ts"]) for r in records if isinstance(r.get("ts"), (int, float)))
    lo, hi = ts[0], ts[-1]
    span = hi - lo
    return [
        ("last-20s", hi - 20, hi),
        ("last-30pct", hi - 0.3 * span, hi),
        ("first-half", lo, lo + span / 2),
        ("middle", lo + span / 4, lo + 3 * span / 4),
        ("tail-from-40pct", lo + 0.4 * span, hi),
    ]


def _recorder(records: list[dict[str, Any]], path: Path) -> Path:
    from collectors.recorder import FlightRecorder

    with FlightRecorder(path, retention_s=1e12, max_size_bytes=1 << 40) as rec:
        rec.write_rows([(float(r["ts"]), r["kind"], int(r.get("schema", 1)), json.dumps(r)) for r in records])
    return path


def _bundle(records: list[dict[str, Any]], root: Path) -> tuple[Path, Path]:
    folder = root / "bundle"
    (folder / "timeline").mkdir(parents=True)
    kinds: dict[str, list[str]] = {}
    for r in records:
        kinds.setdefault(r["kind"], []).append(json.dumps(r))
    for kind, lines in kinds.items():
        (folder / "timeline" / f"{kind}.jsonl").write_text("\n".join(lines) + "\n")
    archive = root / "bundle.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="bundle")
    return folder, archive


def views(fixture: Path, work: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    import diag.sources.recorder as rec_source
    from diag.sources import load_bundle, load_recorder
    from diag.timeline import timeline_from_records

    records = _read(fixture)
    windows = _windows(records)
    yield "rows", lambda: timeline_from_records(records, source="digest")
    for name, lo, hi in windows:
        yield f"rows@{name}", lambda lo=lo, hi=hi: timeline_from_records(
            [r for r in records if lo <= float(r["ts"]) <= hi], source="digest")  # fmt: skip
    db = _recorder(records, work / "r.db")
    yield "recorder", lambda: load_recorder(db, workers=1)
    for name, lo, hi in windows:
        yield f"recorder@{name}", lambda lo=lo, hi=hi: load_recorder(db, since_s=hi - lo, until=hi, workers=1)

    def tiny_batches() -> Any:
        saved = rec_source.BATCH_ROWS
        rec_source.BATCH_ROWS = 7
        try:
            return load_recorder(db, workers=1)
        finally:
            rec_source.BATCH_ROWS = saved

    yield "recorder-batches-of-7", tiny_batches

    def two_readers() -> Any:
        saved = rec_source.PARALLEL_MIN_ROWS
        rec_source.PARALLEL_MIN_ROWS = 0
        try:
            return load_recorder(db, workers=2)
        finally:
            rec_source.PARALLEL_MIN_ROWS = saved

    yield "recorder-2-readers", two_readers
    lo, hi = windows[2][1], windows[0][2]
    live = rec_source.RecorderWindow(db, window_s=0.3 * (hi - lo), segment_s=5.0)
    for k, now in enumerate(np.linspace(lo + 0.2 * (hi - lo), hi + 5, 6)):
        yield f"live-{k}", lambda now=float(now): live.load(now)
    folder, archive = _bundle(records, work)
    yield "bundle-dir", lambda: load_bundle(folder)
    yield "bundle-tar", lambda: load_bundle(archive)
    # Last, as they leave a blocks file beside the recorder: the same recorder read through stored "hours" of 10 s
    # (diag/sources/blocks.py; a sixth of a shorter recording), so a fixture spans several: each must digest as its
    # "recorder" view does.
    first, last = windows[2][1], windows[0][2]
    block = min(10.0, max(0.5, (last - first) / 6))  # a short recording still spans several
    yield "recorder+blocks", lambda: _through_blocks(db, None, None, last, block)
    for name, lo, hi in windows:
        yield f"recorder+blocks@{name}", lambda lo=lo, hi=hi: _through_blocks(db, hi - lo, hi, last, block)


def _through_blocks(db: Path, since_s: float | None, until: float | None, last: float, block: float) -> Any:
    """``load_recorder`` after every ``block``-second block of ``db`` was stored (``last``: the latest record)."""
    from diag.sources import blocks, load_recorder
    from diag.sources.compact import compact

    saved = blocks.BLOCK_S, blocks.LATE_S
    blocks.BLOCK_S, blocks.LATE_S = block, 0.0
    try:
        if not blocks.blocks_path(db).exists():
            done = compact(db, now=last + 2 * block)
            assert done.written > 1, done
        assert blocks.usable(db, None, None), "no stored block was used"
        return load_recorder(db, since_s=since_s, until=until, workers=1)
    finally:
        blocks.BLOCK_S, blocks.LATE_S = saved


# --------------------------------------------------------------------------- the Prometheus path


def _catalog_names() -> set[str]:
    from collectors import catalog as cat

    return {
        n
        for spec in vars(cat).values()
        for s in (spec.values() if isinstance(spec, dict) else (spec,))
        if isinstance(n := getattr(s, "name", None), str)
    }


LABELS = {
    "cgroup": "/svc", "id": "/svc", "pid": "42", "comm": "python", "gpu": "0", "resource": "memory", "kind": "some",
    "event": "oom_kill", "model": "/m/w.safetensors", "constraint": "CONSTRAINT_MEMCG",
}  # fmt: skip
OUTCOMES = ("ok", "error", "rejected", "queue_timeout", "inference_timeout")


class _FakePrometheus:
    """Answers ``query_range``/``query`` as if the chosen catalog families were exported by ``hosts``.

    Deterministic but uneven: each series' values follow its name (a counter that rises, resets once, and
    skips some steps), so merges, resets and gaps are exercised. Two hosts: the second with fewer samples.
    """

    def __init__(self, only: Callable[[str], bool], hosts: tuple[str, ...] = ("10.0.0.5:9464",), cgroups: int = 1) -> None:
        self.only, self.hosts, self.cgroups = only, hosts, cgroups
        self.names = _catalog_names()

    def families(self, query: str) -> list[str]:
        found = {n for group in re.findall(r'__name__=~"([^"]*)"', query) for n in group.split("|")}
        found |= set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", query))
        fam = {n: re.sub(r"_(bucket|sum|count)$", "", n) for n in found}
        return sorted(n for n in found if fam[n] in self.names and self.only(fam[n]))

    def _values(self, seed: str, ts: list[float], host_k: int) -> list[list[Any]]:
        k = zlib.crc32(seed.encode()) % 97
        out = []
        for i, t in enumerate(ts):
            if (i + k) % (11 + host_k) == 0:
                continue  # a missed scrape
            v = (i + 1) * (k + 1) if i < len(ts) * 2 // 3 else (i - len(ts) * 2 // 3) * (k + 1)  # one reset
            out.append([t, str(float(v))])
        return out[: len(out) - 3 * host_k] if host_k else out

    def call(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        query = params["query"]
        names = self.families(query)
        if path == "/api/v1/query":
            t = float(params["time"])
            ts = [t - 30, t - 15, t]
            return self._matrix([({"__name__": n, **LABELS, "instance": h}, n) for n in names for h in self.hosts], ts)
        start, end, step = float(params["start"]), float(params["end"]), float(params["step"])
        ts = [float(x) for x in np.arange(start, end + step / 2, step)]
        if not names:
            return self._matrix([], ts)
        if query.startswith("{"):
            series = []
            for n in names:
                for h in self.hosts:
                    for g in range(self.cgroups):
                        labels = {"__name__": n, **LABELS, "instance": h}
                        if g:
                            labels.update(cgroup=f"/svc/{g}", id=f"/svc/{g}", pid=str(42 + g), gpu=str(g))
                        series.append((labels, f"{n}{h}{g}"))
            return self._matrix(series, ts)
        if "sum by (outcome)" in query:
            return self._matrix([({"outcome": o}, query + o) for o in OUTCOMES], ts)
        return self._matrix([({**LABELS, "instance": self.hosts[0]}, query)], ts)

    def _matrix(self, series: list[tuple[dict[str, str], str]], ts: list[float]) -> dict[str, Any]:
        result = []
        for labels, seed in series:
            host_k = self.hosts.index(labels["instance"]) if labels.get("instance") in self.hosts else 0
            result.append({"metric": labels, "values": self._values(seed, ts, host_k)})
        return {"resultType": "matrix", "result": result}


def prometheus_views() -> Iterator[tuple[str, Callable[[], Any]]]:
    from diag.sources import prometheus as prom

    ours = re.compile(r"^llmdiag_")
    selections: dict[str, tuple[Callable[[str], bool], dict[str, Any]]] = {
        "ours": (lambda n: bool(ours.match(n)), {}),
        "external": (lambda n: not ours.match(n), {}),
        "everything": (lambda n: True, {}),
        "node-exporter": (lambda n: n.startswith("node_"), {}),
        "cadvisor": (lambda n: n.startswith("container_"), {}),
        "vllm-tgi-dcgm": (lambda n: n.startswith(("vllm", "tgi_", "DCGM")), {}),
        "ours-two-hosts-two-groups": (lambda n: bool(ours.match(n)), {"hosts": ("10.0.0.5:9464", "10.0.0.6:9464"), "cgroups": 2}),
        "external-two-hosts": (lambda n: not ours.match(n), {"hosts": ("10.0.0.6:9100", "10.0.0.5:9100")}),
        "nothing": (lambda n: False, {}),
    }
    for name, (only, kwargs) in selections.items():

        def load(only: Callable[[str], bool] = only, kwargs: dict[str, Any] = kwargs) -> Any:
            fake = _FakePrometheus(only, **kwargs)
            saved = prom._Prometheus._call
            prom._Prometheus._call = lambda self, path, params: fake.call(path, params)  # type: ignore[method-assign]
            try:
                return prom.load_prometheus("http://127.0.0.1:9", since_s=600, until=1_800_000_000.0)
            finally:
                prom._Prometheus._call = saved  # type: ignore[method-assign]

        yield f"prometheus-{name}", load


# --------------------------------------------------------------------------- driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="fixtures whose path contains this text")
    args = ap.parse_args()
    from diag.rules.engine import load_rules

    load_rules()
    fixtures = sorted(p for p in FIXTURES.rglob("*.jsonl.gz") if not args.only or args.only in str(p))
    n = 0
    for fixture in fixtures:
        name = str(fixture.relative_to(FIXTURES))
        work = WORK / "fixture"  # the same path on every tree: it is in the Timeline's source
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for view, build in views(fixture, work):
            tl = build()
            print(f"{name} {view} analysis={analysis_digest(tl)} timeline={timeline_digest(tl)}", flush=True)
            n += 1
        shutil.rmtree(work, ignore_errors=True)
    if not args.only:
        for view, build in prometheus_views():
            tl = build()
            print(f"- {view} analysis={analysis_digest(tl)} timeline={timeline_digest(tl)}", flush=True)
            n += 1
    print(f"# {n} views of {len(fixtures)} fixtures", file=sys.stderr)


if __name__ == "__main__":
    main()
