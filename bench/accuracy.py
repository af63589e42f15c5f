"""How well do the rules classify real incidents? A confusion matrix over every scenario x variants x seeds.

Runs ``diag demo --scenario`` for real (root + memory cgroups; ~1 min a run) for each scenario with
its default parameters *and* a few variants (other limits, load levels, worker counts, skews, ...),
for each seed, and prints:

- the confusion matrix (rows: the scenario's class; columns: the analysis' primary class),
- per-class precision and recall,
- every run that was misclassified or whose fault did not leave its signature (signals.py), with
  the top findings, so a miss can be traced to the scenario or to a rule,
- wall time per run.

It asserts nothing. ``--save DIR`` keeps each run's records (JSONL.gz) and ``--replay DIR`` recomputes
the matrix from such a directory in seconds -- how a rule change is measured against the same runs.

    .venv/bin/python bench/accuracy.py                      # everything: 12 scenarios x 3 variants, seed 0 (~40 min)
    .venv/bin/python bench/accuracy.py --scenarios leak,thrash --seeds 0,1 --save /tmp/acc
    .venv/bin/python bench/accuracy.py --replay /tmp/acc    # the rules only, on the saved runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Parameter variants beyond the defaults: what a scenario should survive (tests use the defaults only).
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "healthy": [{"workers": 1, "rate": 10.0}, {"workers": 3, "rate": 4.0, "weights_mb": 96}],
    "leak": [{"leak_kib": 256, "rate": 14.0}, {"leak_kib": 1024, "cycles": 3, "limit_mib": 768}],
    "pressure": [{"concurrency": 4, "prompt_tokens": 1400}, {"extra_mib": 32, "weights_mb": 128}],
    "queue": [{"ramp": "0.5,1,1.5,2.5"}, {"step_s": 6.0, "max_in_flight": 32}],
    "thrash": [{"headroom": 0.3}, {"weights_mb": 160, "steps": "2,4,8"}],
    "duplicate-models": [{"workers": 3, "weights_mb": 160}, {"workers": 2, "weights_mb": 256}],
    "loader-refresh": [{"workers": 1, "weights_mb": 96, "rate": 3.0}, {"rate": 6.0}],
    "moe-skew": [{"router_skew": 4.0}, {"experts": 4, "top_k": 1}],
    "request-count-batching": [{"long_share": 0.3}, {"long_tokens": 1000, "concurrency": 24}],
    "oversized-context": [{"huge_tokens": 12000, "request_timeout": 2.5}, {"huge_share": 0.15, "rate": 2.0}],
    "noisy-neighbour": [{"neighbour_limit_mib": 200, "neighbour_file_mib": 256}, {"rate": 8.0}],
    "host-oom": [{"margin_mib": 24}, {"burst_requests": 24, "weights_mb": 64}],
}


def _label(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items()) or "defaults"


def run_live(
    names: list[str], seeds: list[int], variants: str, save: Path | None, weights_dir: Path | None
) -> list[dict[str, Any]]:
    from diag.demo.scenarios.runner import run_scenario

    runs: list[dict[str, Any]] = []
    plan = []
    for name in names:
        sets = [{}] + (VARIANTS.get(name, []) if variants == "all" else [])
        plan += [(name, params, seed) for params in sets for seed in seeds]
    for i, (name, params, seed) in enumerate(plan, 1):
        label = _label(params)
        print(f"[{i}/{len(plan)}] {name} seed {seed} ({label})", file=sys.stderr, flush=True)
        fixture = None
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            fixture = save / f"{name}__{i:03d}.jsonl.gz"
        t0 = time.monotonic()
        try:
            res = run_scenario(name, seed=seed, params=params, weights_dir=weights_dir, fixture=fixture, progress=lambda m: None)
        except Exception as exc:  # a run that breaks is a data point, not the end of the bench
            traceback.print_exc()
            runs.append({"name": name, "params": label, "seed": seed, "primary": f"error: {type(exc).__name__}", "wall_s": 0.0})
            continue
        run = {
            "name": name,
            "params": label,
            "seed": seed,
            "expected": res.expected,
            "primary": res.primary,
            "findings": [(f.cls, round(f.confidence, 2), f.summary[:160]) for f in res.analysis.findings[:4]],
            "signal_problems": res.signal_problems,
            "signal_summary": res.signal_summary,
            "wall_s": time.monotonic() - t0,
        }
        if fixture is not None:
            fixture.with_suffix("").with_suffix(".json").write_text(json.dumps({k: run[k] for k in ("name", "params", "seed")}))
        print(f"    -> {res.primary} ({run['wall_s']:.0f} s); signals: {res.signal_summary}", file=sys.stderr, flush=True)
        runs.append(run)
    return runs


def run_replay(folder: Path) -> list[dict[str, Any]]:
    from diag.demo.scenarios.library import SCENARIOS
    from diag.demo.scenarios.recording import read_jsonl_gz
    from diag.demo.scenarios.signals import check_signals
    from diag.rules.engine import analyze
    from diag.timeline import timeline_from_records

    runs = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        meta_path = path.with_suffix("").with_suffix(".json")
        meta = (
            json.loads(meta_path.read_text())
            if meta_path.exists()
            else {"name": path.name.split("__")[0], "params": "?", "seed": "?"}
        )
        t0 = time.monotonic()
        tl = timeline_from_records(read_jsonl_gz(path), source=str(path))
        problems, summary = check_signals(meta["name"], tl)
        analysis = analyze(tl)
        runs.append(
            {
                **meta,
                "expected": SCENARIOS[meta["name"]].expected,
                "primary": analysis.primary,
                "findings": [(f.cls, round(f.confidence, 2), f.summary[:160]) for f in analysis.findings[:4]],
                "signal_problems": problems,
                "signal_summary": summary,
                "wall_s": time.monotonic() - t0,
            }
        )
    return runs


def report(runs: list[dict[str, Any]]) -> None:
    from diag.demo.scenarios.library import SCENARIOS

    for run in runs:
        run.setdefault("expected", SCENARIOS[run["name"]].expected)
    classes = sorted({r["expected"] for r in runs} | {r["primary"] for r in runs})
    matrix: dict[str, Counter[str]] = defaultdict(Counter)
    for r in runs:
        matrix[r["expected"]][r["primary"]] += 1
    short = {c: c[:10] for c in classes}
    width = max(len(c) for c in classes) + 2
    print("\nConfusion matrix (rows: scenario class, columns: analysis primary)\n")
    print(" " * width + " ".join(f"{short[c]:>10}" for c in classes))
    for row in classes:
        if row not in matrix:
            continue
        print(f"{row:<{width}}" + " ".join(f"{matrix[row][c] or '.':>10}" for c in classes))
    print("\nPer class")
    print(f"{'class':<{width}}{'precision':>10}{'recall':>10}{'support':>10}")
    for c in classes:
        tp = matrix[c][c]
        predicted = sum(matrix[r][c] for r in matrix)
        support = sum(matrix[c].values())
        prec = f"{tp / predicted:.2f}" if predicted else "-"
        rec = f"{tp / support:.2f}" if support else "-"
        print(f"{c:<{width}}{prec:>10}{rec:>10}{support:>10}")
    correct = sum(matrix[c][c] for c in classes)
    print(f"\naccuracy {correct}/{len(runs)} = {correct / max(1, len(runs)):.2f}")
    misses = [r for r in runs if r["primary"] != r["expected"] or r.get("signal_problems")]
    if misses:
        print("\nMisclassified runs or missing signatures")
        for r in misses:
            print(f"- {r['name']} seed {r['seed']} ({r['params']}): expected {r['expected']}, got {r['primary']}")
            if r.get("signal_problems"):
                print(f"    SIGNATURE MISSING: {'; '.join(r['signal_problems'])}")
            print(f"    signals: {r.get('signal_summary', '')}")
            for cls, conf, summary in r.get("findings", []):
                print(f"    {cls} {conf}: {summary}")
    walls = [r["wall_s"] for r in runs if r["wall_s"]]
    if walls:
        print(
            f"\nwall time per run: min {min(walls):.0f} s, median {sorted(walls)[len(walls) // 2]:.0f} s, max {max(walls):.0f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    ap.add_argument("--seeds", default="0", help="comma-separated load seeds")
    ap.add_argument("--variants", choices=("all", "defaults"), default="all")
    ap.add_argument("--save", type=Path, help="keep each run's records here (replay them with --replay)")
    ap.add_argument("--replay", type=Path, help="analyse saved runs instead of running scenarios")
    ap.add_argument("--weights-dir", type=Path, help="checkpoint cache (default: the user cache dir)")
    ap.add_argument("--json", type=Path, help="also write the runs as JSON here")
    args = ap.parse_args()
    from diag.demo.scenarios import SCENARIO_NAMES

    if args.replay:
        runs = run_replay(args.replay)
    else:
        from diag.demo.scenarios.cgroups import unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"accuracy: needs memory cgroups: {reason}", file=sys.stderr)
            raise SystemExit(3)
        names = [n for n in args.scenarios.split(",") if n] or list(SCENARIO_NAMES)
        seeds = [int(s) for s in args.seeds.split(",") if s]
        runs = run_live(names, seeds, args.variants, args.save, args.weights_dir)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2, default=str))
    report(runs)


if __name__ == "__main__":
    main()
