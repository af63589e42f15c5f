"""Digests of the rules' analyses over every recorded fixture: proof that a refactoring changed no verdict.

A change that only moves code (a rule split into helpers, helpers moved between modules, precedence
moved into the engine) must leave every analysis byte for byte as it was. This prints, for each *view*,
the sha256 of ``json.dumps(analyze(timeline).to_dict(), sort_keys=True)``; run it on the code before
and after the change and compare.

Views, for every recording in ``tests/fixtures/scenarios/`` (the GPU replays built by
``diag/demo/scenarios/replays.py`` included), its ``variants/`` and ``tests/fixtures/uninstrumented/``:

- ``recorded`` and ``uninstrumented`` (the agent's records and the operator's watch scope only, as
  ``bench/accuracy.py`` builds it), each over several windows of the recording: all of it, each half,
  each third, the middle half, the first and last 30 s and the last 10 s (short windows reach the
  rules' "too little data" answers);
- ``fleet``: the request rows folded into per-step mean queue wait and inference time with the rows
  removed -- what the Prometheus path holds (as ``tests/diag/test_rules_aggregated.py`` builds it) --
  over the whole recording and each half;
- with ``--timelines DIR``: every pickled Timeline there (``*.pkl``), e.g. ones built once by
  ``load_prometheus`` against a live Prometheus, so the Prometheus path's own Timelines are compared too.

``--code DIR`` imports ``diag`` from another checkout (``git archive main | tar -x -C /tmp/base``), so
one command digests the code before the change; fixtures are always this checkout's.

Rule ids are user-visible, so renaming one changes the document. ``--rename OLD=NEW`` (repeatable)
rewrites OLD to NEW wherever a document of this run names a rule (give it to either run: the old
names on the run before, or NEW=OLD on the run after). Renaming also reorders what the engine lists
in rule-id order (``evaluated``, ``not_evaluated``, ``too_little_data``), so each view has two
digests: ``exact`` (the document as it is) and ``canonical`` (those three lists sorted by rule id).
Findings keep their ranking in both: findings of equal score stay in the order the engine ran their
rules (by id), so a rename that reorders a tie shows as a difference -- a reader sees it too.
``--compare FILE`` reads an earlier run's output (``--out``) and reports, per view, whether the exact
digests match, only the canonical ones, or neither.

    .venv/bin/python bench/digests.py --code /tmp/base --out /tmp/before.json
    .venv/bin/python bench/digests.py --compare /tmp/before.json --rename stalls.new_id=memory.old_id
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
RECORDINGS = (FIXTURES / "scenarios", FIXTURES / "scenarios" / "variants", FIXTURES / "uninstrumented")
TRACKER_KINDS = {"request", "batch", "routing", "loader", "config", "torch_memory", "cuda_oom"}
# (name, start share, end share) of the recording's span; negative seconds count back from the end.
WINDOWS: tuple[tuple[str, float, float], ...] = (
    ("all", 0.0, 1.0),
    ("half1", 0.0, 0.5),
    ("half2", 0.5, 1.0),
    ("third1", 0.0, 1 / 3),
    ("third2", 1 / 3, 2 / 3),
    ("third3", 2 / 3, 1.0),
    ("middle", 0.25, 0.75),
)
SECONDS: tuple[tuple[str, float, float], ...] = (("first30s", 0.0, 30.0), ("last30s", -30.0, 0.0), ("last10s", -10.0, 0.0))
FLEET_STEP_S = 5.0
SHOWN = 20  # differences listed by name; the rest are counted


def read_records(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _span(records: list[dict[str, Any]]) -> tuple[float, float]:
    ts = [float(r["ts"]) for r in records if r.get("ts") is not None and r["kind"] not in ("config", "watch_scope")]
    return min(ts), max(ts)


def _window(records: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """What a bundle covering [t0, t1] holds: samples in it, requests that arrived and finished in it."""
    out = []
    for r in records:
        if r["kind"] == "request":
            if t0 <= r["arrival"] and r["finish"] is not None and r["finish"] <= t1:
                out.append(r)
        elif r["kind"] in ("config", "watch_scope") or t0 <= float(r["ts"]) <= t1:
            out.append(r)
    return out


def _uninstrumented(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's records only, plus the watch scope an operator would give (the service's pids and their groups)."""
    if any(r["kind"] == "watch_scope" for r in records):
        return [r for r in records if r["kind"] not in TRACKER_KINDS]
    pids = sorted({int(r["pid"]) for r in records if r["kind"] in TRACKER_KINDS and r.get("pid")})
    groups = sorted(
        {r["memory_cgroup"] for r in records if r["kind"] == "process" and r.get("pid") in pids and r.get("memory_cgroup")}
    )
    scope = {"kind": "watch_scope", "schema": 1, "ts": _span(records)[0], "pids": pids, "cgroups": groups,
             "resolved_pids": pids, "resolved_cgroups": groups, "missing": []}  # fmt: skip
    return [r for r in records if r["kind"] not in TRACKER_KINDS] + [scope]


def record_views(name: str, records: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    t0, t1 = _span(records)
    span = t1 - t0
    cuts = [(w, t0 + a * span, t0 + b * span) for w, a, b in WINDOWS]
    cuts += [(w, (t1 if a < 0 else t0) + a, (t1 if a < 0 else t0) + b) for w, a, b in SECONDS]
    for flavour, recs in (("recorded", records), ("uninstrumented", _uninstrumented(records))):
        for window, lo, hi in cuts:
            yield f"{name}/{flavour}/{window}", _window(recs, lo, hi) if window != "all" else recs


def as_fleet(tl: Any, series_cls: Any, table_cls: Any) -> Any | None:
    """The timeline as Prometheus would hold it: per-step mean queue wait and inference time, no rows."""
    import numpy as np

    req = tl.requests
    if not len(req) or "start" not in req:
        return None
    ok = np.isfinite(req["start"]) & np.isfinite(req["finish"])
    finish, wait, infer = req["finish"][ok], req["queue_wait_s"][ok], req["inference_s"][ok]
    edges = np.arange(tl.start, tl.end + FLEET_STEP_S, FLEET_STEP_S)
    idx = np.digitize(finish, edges)
    steps = [i for i in np.unique(idx) if (idx == i).sum() >= 2]
    ts = np.array([edges[i - 1] + FLEET_STEP_S for i in steps])
    tl.service = {
        "queue_wait_mean_s": series_cls(ts, np.array([wait[idx == i].mean() for i in steps])),
        "inference_mean_s": series_cls(ts, np.array([infer[idx == i].mean() for i in steps])),
        "inference_p50_s": series_cls(ts, np.array([np.median(infer[idx == i]) for i in steps])),
    }
    for table in ("requests", "batches", "loader", "routing"):
        setattr(tl, table, table_cls())
    tl.configs = []
    return tl


def renamed(doc: Any, names: dict[str, str]) -> Any:
    """The document with every rule id in ``names`` replaced (values of "rule" keys and the ``evaluated`` list)."""
    if isinstance(doc, dict):
        out = {}
        for key, value in doc.items():
            if key == "rule" and isinstance(value, str):
                out[key] = names.get(value, value)
            elif key == "evaluated" and isinstance(value, list):
                out[key] = [names.get(v, v) for v in value]
            else:
                out[key] = renamed(value, names)
        return out
    if isinstance(doc, list):
        return [renamed(v, names) for v in doc]
    return doc


def canonical(doc: dict[str, Any]) -> dict[str, Any]:
    """The lists the engine keeps in rule-id order, sorted by rule id; everything else as it is."""
    out = dict(doc)
    out["evaluated"] = sorted(doc["evaluated"])
    out["not_evaluated"] = sorted(doc["not_evaluated"], key=lambda x: x["rule"])
    out["verdict"] = {**doc["verdict"], "too_little_data": sorted(doc["verdict"]["too_little_data"], key=lambda x: x["rule"])}
    return out


def sha(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def digest_all(timelines: Path | None, names: dict[str, str]) -> dict[str, dict[str, str]]:
    from diag.rules.engine import analyze
    from diag.timeline import Series, Table, timeline_from_records

    def digests(tl: Any) -> dict[str, str]:
        doc = renamed(analyze(tl).to_dict(), names)
        return {"exact": sha(doc), "canonical": sha(canonical(doc)), "primary": doc["verdict"]["primary"]}

    out: dict[str, dict[str, str]] = {}
    for folder in RECORDINGS:
        for path in sorted(folder.glob("*.jsonl.gz")):
            name = str(path.relative_to(FIXTURES)).removesuffix(".jsonl.gz")
            records = read_records(path)
            for view, recs in record_views(name, records):
                out[view] = digests(timeline_from_records(recs, source=view))
            for window, recs in (("all", records), *[(w, _window(records, *_cut(records, a, b))) for w, a, b in WINDOWS[1:3]]):
                fleet = as_fleet(timeline_from_records(recs, source=name), Series, Table)
                if fleet is not None:
                    out[f"{name}/fleet/{window}"] = digests(fleet)
    for path in sorted(timelines.glob("*.pkl")) if timelines else []:
        with path.open("rb") as fh:
            out[f"pickled/{path.stem}"] = digests(pickle.load(fh))  # only files you made: unpickling runs code
    return out


def _cut(records: list[dict[str, Any]], a: float, b: float) -> tuple[float, float]:
    t0, t1 = _span(records)
    return t0 + a * (t1 - t0), t0 + b * (t1 - t0)


def compare(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> int:
    """Print the comparison; 0 when every view of ``before`` has the same canonical digest after, else 1."""
    missing = sorted(set(before) - set(after))
    extra = sorted(set(after) - set(before))
    exact = [v for v in before if v in after and before[v]["exact"] == after[v]["exact"]]
    order_only = [v for v in before if v in after and v not in exact and before[v]["canonical"] == after[v]["canonical"]]
    differ = [v for v in before if v in after and before[v]["canonical"] != after[v]["canonical"]]
    print(f"views compared: {len(before) - len(missing)}; identical: {len(exact)}; "
          f"identical but for the order of rules: {len(order_only)}; different: {len(differ)}")  # fmt: skip
    for label, views in (("missing after", missing), ("new after", extra), ("different", differ)):
        for v in views[:SHOWN]:
            print(f"  {label}: {v} ({before.get(v, {}).get('primary')} -> {after.get(v, {}).get('primary')})")
        if len(views) > SHOWN:
            print(f"  ... and {len(views) - SHOWN} more {label}")
    return 0 if not (missing or differ) else 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", type=Path, help="import diag from this checkout instead of this one (the code before a change)")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="a rule id renamed by the change")
    ap.add_argument("--timelines", type=Path, help="a folder of pickled Timelines (*.pkl) to digest too")
    ap.add_argument("--out", type=Path, help="write the digests here (JSON)")
    ap.add_argument("--compare", type=Path, help="an earlier --out to compare with")
    args = ap.parse_args(argv)
    bad = [r for r in args.rename if r.count("=") != 1 or not all(r.split("="))]
    if bad:
        print(f"--rename takes OLD=NEW, not {bad[0]!r}", file=sys.stderr)
        return 2
    if args.code is not None and not (args.code / "diag" / "rules" / "engine.py").is_file():
        print(f"--code {args.code}: not a checkout of this project (no diag/rules/engine.py)", file=sys.stderr)
        return 2
    if args.compare is not None and not args.compare.is_file():
        print(f"--compare {args.compare}: no such file", file=sys.stderr)
        return 2
    sys.path.insert(0, str(args.code.resolve() if args.code else REPO))
    t0 = time.monotonic()
    got = digest_all(args.timelines, dict(r.split("=") for r in args.rename))
    import diag

    print(f"{len(got)} views digested in {time.monotonic() - t0:.1f} s (code: {Path(diag.__file__).parents[1]})", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(got, indent=1, sort_keys=True))
    return compare(json.loads(args.compare.read_text()), got) if args.compare else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
