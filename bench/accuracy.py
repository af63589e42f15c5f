"""How well do the rules classify real incidents? A confusion matrix over scenarios x variants x seeds x views.

Runs ``diag demo --scenario`` for real (root + memory cgroups; ~1 min a run) for each scenario with
its default parameters and a few parameter variants, for each seed. Every run is then judged in
several *views* -- what different users would hand the rules from that same real run:

- ``recorded``: everything (agent + the reference backend's tracker);
- ``uninstrumented``: only what the agent records next to a service we did not instrument (no request,
  batch, loader, routing or config records), plus the ``watch_scope`` the operator's ``--pid``/``--cgroup``
  give -- for the scenarios whose class the agent's signals can show (the memory scenarios and healthy);
  in noisy-neighbour runs the neighbour maps a ``.pth`` file, i.e. "a neighbour that holds model files";
- ``no-open-files`` (duplicate-models): uninstrumented, and no process holds a model file (read-and-close);
- ``short-no-calm`` / ``long-no-calm`` (queue): only the overload -- its first 10 s, or all of it -- as a
  bundle taken during the incident sees it (with and without the calm period: ``recorded`` has it).

It prints the confusion matrix (rows: expected class, columns: verdict), per-class precision/recall,
top-1 accuracy, the incidents claimed on healthy views, and every case where the verdict was ``healthy``
while a finding had confidence >= 0.3 (the invariant; must be 0). It asserts nothing.

``--dialects vllm,tgi,llamacpp`` runs each scenario with the reference backend speaking that engine's /metrics,
uninstrumented (no tracker rows), the agent scraping it (``diag demo --scenario NAME --dialect D``); such a
run is judged in the ``recorded`` view only (it has no tracker records to take away), and the report adds
one confusion matrix per dialect (``llmdiag``: the tracker; a scenario's own default, e.g. ``kv-saturation``'s
vLLM, when no dialect is asked). Beside top-1 over every run it prints top-1 over the runs whose class the engine's
pinned /metrics can show at all (KV-cache saturation where the engine exports no KV usage is left out, and named).

``--one-run-for-dialects`` (with several engines' dialects) runs each scenario once, the reference backend serving
every asked dialect at ``/metrics/<dialect>`` from one live state, and judges the run as each engine on the records
a host of that engine would hold (``runner.dialect_view``): a third of the real time, and the engines compared on the
very same load and fault; without it each dialect gets its own run.

``--engine`` runs the llama.cpp scenarios instead (``engine-*``: llama-cpp-python's own server on a GGUF written
here, the ``engines`` extra), each on every attachment it takes -- ``outside`` (nothing in the server, the load
generator's request rows) and ``wrapped`` (the server under ``diag wrap``) -- and prints one confusion matrix per
attachment, then all of them together. Engine runs are judged in the ``recorded`` view only.

Runs are cached: with ``--save DIR`` each run's records go to ``DIR/<scenario>__<variant>__s<seed>.jsonl.gz``
and a later invocation with the same ``--save`` reuses them instead of re-running (resumable: stop it any
time). ``--replay DIR`` judges only what is saved; ``--fixtures`` judges the repository's recorded fixtures
(seed 0, defaults) in seconds.

    .venv/bin/python bench/accuracy.py --save /tmp/acc                    # all scenarios x 3 variants, seed 0
    .venv/bin/python bench/accuracy.py --scenarios leak,thrash --seeds 0,1,2 --variants defaults --save /tmp/acc
    .venv/bin/python bench/accuracy.py --replay /tmp/acc                   # the rules only, on the saved runs
    .venv/bin/python bench/accuracy.py --fixtures                          # the committed fixtures only
    .venv/bin/python bench/accuracy.py --fixtures --replay /tmp/acc        # both, in one matrix
    .venv/bin/python bench/accuracy.py --dialects vllm,tgi,llamacpp --variants defaults --save /tmp/acc-d
    .venv/bin/python bench/accuracy.py --dialects vllm,tgi,llamacpp --one-run-for-dialects --variants defaults --save /tmp/acc-s
    .venv/bin/python bench/accuracy.py --engine --seeds 0,1 --save /tmp/acc-engine   # llama.cpp, both attachments
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
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
TRACKER_KINDS = {"request", "batch", "routing", "loader", "config", "torch_memory", "cuda_oom"}
# Scenarios whose class the agent's own signals can show without the tracker.
AGENT_VISIBLE = {"healthy", "leak", "pressure", "thrash", "duplicate-models", "noisy-neighbour", "host-oom"}
SUSPECT = 0.3
SHORT_S = 10.0


def _label(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items()) or "defaults"


# --------------------------------------------------------------------------- views of one run


def _uninstrumented(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's records only, plus the watch scope an operator would give: the service's pids and their groups."""
    pids = sorted({int(r["pid"]) for r in records if r["kind"] in TRACKER_KINDS and r.get("pid")})
    groups = sorted(
        {r["memory_cgroup"] for r in records if r["kind"] == "process" and r.get("pid") in pids and r.get("memory_cgroup")}
    )
    ts = min(float(r["ts"]) for r in records)
    scope = {"kind": "watch_scope", "schema": 1, "ts": ts, "pids": pids, "cgroups": groups, "resolved_pids": pids,
             "resolved_cgroups": groups, "missing": []}  # fmt: skip
    return [r for r in records if r["kind"] not in TRACKER_KINDS] + [scope]


def _overload_start(records: list[dict[str, Any]]) -> float | None:
    """The first arrival from which most requests wait >= 3x their inference time (the queue scenario's overload)."""
    rows = sorted((r for r in records if r["kind"] == "request" and r.get("start") is not None), key=lambda r: r["arrival"])
    for i, r in enumerate(rows):
        nxt = rows[i : i + 10]
        if len(nxt) == 10 and sum((x["start"] - x["arrival"]) >= 3 * (x["finish"] - x["start"]) for x in nxt) >= 9:
            return float(r["arrival"])
    return None


def _window(records: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """What a bundle covering [t0, t1] holds: samples in it, requests that arrived and finished in it."""
    out = []
    for r in records:
        if r["kind"] == "request":
            if t0 <= r["arrival"] and r["finish"] <= t1:
                out.append(r)
        elif r["kind"] in ("config", "watch_scope") or t0 <= float(r["ts"]) <= t1:
            out.append(r)
    return out


def views(name: str, expected: str, records: list[dict[str, Any]]) -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
    yield "recorded", expected, records
    if not any(r["kind"] in TRACKER_KINDS for r in records):
        return  # an engine's dialect, uninstrumented already: no other view to take
    if name in AGENT_VISIBLE:
        bare = _uninstrumented(records)
        yield "uninstrumented", expected, bare
        if name == "duplicate-models":
            yield "no-open-files", expected, [{**r, "model_files": []} if r["kind"] == "process" else r for r in bare]
    if name == "queue":
        t0 = _overload_start(records)
        if t0 is not None:
            end = max(float(r["ts"]) for r in records)
            yield "short-no-calm", expected, _window(records, t0, t0 + SHORT_S)
            yield "long-no-calm", expected, _window(records, t0, end)


def judge(meta: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from diag.demo.scenarios.library import SCENARIOS
    from diag.demo.scenarios.replays import REPLAYS
    from diag.demo.scenarios.signals import check_signals
    from diag.rules.engine import analyze
    from diag.timeline import timeline_from_records

    out = []
    name = meta["name"]
    # The GPU classes have recorded replays, not live scenarios (no GPU here): judged as recorded, no signature check.
    expected_class = SCENARIOS[name].expected if name in SCENARIOS else REPLAYS[name].expected
    for view, expected, recs in views(name, expected_class, records):
        tl = timeline_from_records(recs, source=f"{name}:{view}")
        # The signature checks read the tracker's request rows; uninstrumented runs have none (kv-saturation's
        # check reads the engine's own series).
        checkable = view == "recorded" and name in SCENARIOS and (len(tl.requests) > 0 or name == "kv-saturation")
        problems = check_signals(name, tl)[0] if checkable else []
        t0 = time.monotonic()
        analysis = analyze(tl)
        out.append({
            **meta, "view": view, "expected": expected, "primary": analysis.primary,
            "findings": [(f.cls, round(f.confidence, 2), f.summary[:160]) for f in analysis.findings[:4]],
            "max_confidence": max((f.confidence for f in analysis.findings), default=0.0),
            "signal_problems": problems, "rules_s": time.monotonic() - t0, "window_s": round(tl.duration_s, 1),
        })  # fmt: skip
    return out


# --------------------------------------------------------------------------- runs (cached)


def _cache_name(name: str, variant: int, seed: int, dialect: str | None = None, attachment: str | None = None) -> str:
    tail = (f"__d{dialect}" if dialect else "") + (f"__a{attachment}" if attachment else "")
    return f"{name}__v{variant}__s{seed}{tail}.jsonl.gz"


def _dialect_of(name: str, dialect: str | None) -> str:
    from diag.demo.scenarios.library import SCENARIOS

    default = SCENARIOS[name].defaults.get("dialect", "llmdiag") if name in SCENARIOS else "llmdiag"
    return dialect or str(default)


def run_live(names: list[str], seeds: list[int], variants: str, save: Path, weights_dir: Path | None,
             dialects: list[str | None] | None = None, one_run: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    from diag.demo.scenarios.engine_scenarios import ENGINE_ATTACHMENTS

    plan = []
    for name in names:
        sets = [{}] + (VARIANTS.get(name, []) if variants == "all" else [])
        if name in ENGINE_ATTACHMENTS:  # an engine scenario: once per attachment it takes (its only variants)
            sets = [{"attachment": a} for a in ENGINE_ATTACHMENTS[name]]
        plan += [(name, vi, params, seed, d) for d in (dialects or [None]) for vi, params in enumerate(sets) for seed in seeds]
    if one_run:
        _run_shared(plan, save, weights_dir)  # writes every dialect's view where _run_plan finds it cached
    return _run_plan(plan, save, weights_dir)


def _run_shared(plan: list[tuple[str, int, dict[str, Any], int, str | None]], save: Path, weights_dir: Path | None) -> None:
    """One run per (scenario, variant, seed) for all its dialects, each dialect's view saved as its own run would be."""
    from diag.demo.scenarios.recording import write_jsonl_gz
    from diag.demo.scenarios.runner import run_scenario_in_dialects

    save.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, int, int], list[str]] = defaultdict(list)
    params_of: dict[tuple[str, int, int], dict[str, Any]] = {}
    for name, vi, params, seed, dialect in plan:
        if dialect and not (save / _cache_name(name, vi, seed, dialect)).exists():
            runs[(name, vi, seed)].append(dialect)
            params_of[(name, vi, seed)] = params
    for i, ((name, vi, seed), dialects) in enumerate(runs.items(), 1):
        params = params_of[(name, vi, seed)]
        print(f"[shared {i}/{len(runs)}] {name} seed {seed} ({_label(params)}) as {', '.join(dialects)}: running",
              file=sys.stderr, flush=True)  # fmt: skip
        t0 = time.monotonic()
        try:
            results = run_scenario_in_dialects(name, dialects, seed=seed, params=params, weights_dir=weights_dir,
                                               progress=lambda m: None)  # fmt: skip
        except Exception:  # _run_plan then runs what is missing on its own and reports what breaks
            traceback.print_exc()
            continue
        for dialect, result in results.items():
            path = save / _cache_name(name, vi, seed, dialect)
            write_jsonl_gz(result.records, path)
            meta = {"name": name, "params": _label(params), "seed": seed, "dialect": dialect,
                    "wall_s": round(time.monotonic() - t0), "shared_run": dialects}  # fmt: skip
            path.with_suffix("").with_suffix(".json").write_text(json.dumps(meta))


def _run_plan(plan: list[tuple[str, int, dict[str, Any], int, str | None]], save: Path,
              weights_dir: Path | None) -> list[dict[str, Any]]:  # fmt: skip
    from diag.demo.scenarios.recording import read_jsonl_gz
    from diag.demo.scenarios.runner import run_scenario

    save.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for i, (name, vi, params, seed, dialect) in enumerate(plan, 1):
        attachment = params.get("attachment")
        path = save / _cache_name(name, vi, seed, dialect, attachment)
        meta = {"name": name, "params": _label(params), "seed": seed, "dialect": _dialect_of(name, dialect)}
        if attachment:
            meta["attachment"] = attachment
        if not path.exists():
            print(f"[{i}/{len(plan)}] {name} seed {seed} ({meta['params']}): running", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                run_scenario(name, seed=seed, params=params, weights_dir=weights_dir, fixture=path, progress=lambda m: None,
                             dialect=dialect)  # fmt: skip
            except Exception as exc:  # a run that breaks is a data point, not the end of the bench
                traceback.print_exc()
                path.unlink(missing_ok=True)
                results.append({**meta, "view": "recorded", "expected": "?", "primary": f"error: {type(exc).__name__}"})
                continue
            meta["wall_s"] = round(time.monotonic() - t0)
            path.with_suffix("").with_suffix(".json").write_text(json.dumps(meta))
        else:
            print(f"[{i}/{len(plan)}] {name} seed {seed} ({meta['params']}): cached", file=sys.stderr, flush=True)
        results += judge(meta, read_jsonl_gz(path))
    return results


def run_replay(folder: Path) -> list[dict[str, Any]]:
    from diag.demo.scenarios.recording import read_jsonl_gz

    results = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        meta_path = path.with_suffix("").with_suffix(".json")
        meta = (
            json.loads(meta_path.read_text())
            if meta_path.exists()
            else {"name": path.name.split("__")[0], "params": "?", "seed": "?"}
        )
        results += judge(meta, read_jsonl_gz(path))
    return results


def run_fixtures() -> list[dict[str, Any]]:
    from diag.demo.scenarios.recording import read_jsonl_gz

    results = []
    for path in sorted((REPO / "tests" / "fixtures" / "scenarios").glob("*.jsonl.gz")):
        name = path.name.split(".")[0]
        results += judge({"name": name, "params": "defaults", "seed": 0, "dialect": _dialect_of(name, None)},
                         read_jsonl_gz(path))  # fmt: skip
    for path in sorted((REPO / "tests" / "fixtures" / "dialects").glob("*.jsonl.gz")):
        name, _, dialect = path.name.split(".")[0].rpartition("-")
        results += judge({"name": name, "params": "defaults", "seed": 0, "dialect": dialect}, read_jsonl_gz(path))
    return results


# --------------------------------------------------------------------------- report


def report(runs: list[dict[str, Any]]) -> None:
    attachments = sorted({str(r["attachment"]) for r in runs if r.get("attachment")})
    if attachments:  # engine runs: one matrix per attachment, then all of them
        for a in attachments:
            print(f"\n=== attachment {a} ===")
            _report([r for r in runs if r.get("attachment") == a])
        print("\n=== all attachments ===")
        _report(runs)
        return
    dialects = sorted({str(r.get("dialect", "llmdiag")) for r in runs})
    if len(dialects) > 1:
        for d in dialects:
            print(f"\n=== dialect {d} ===")
            _report([r for r in runs if str(r.get("dialect", "llmdiag")) == d])
        print("\n=== all dialects ===")
    _report(runs)


def _unobservable(expected: str, dialect: str) -> str | None:
    """Why an engine's pinned /metrics cannot show ``expected`` at all (None: it can, or the run is not an engine's).

    Read from the declarations (``collectors.backends``), not listed here: KV-cache saturation needs a KV-usage
    family the pinned release of the engine exports (TGI has none; llama.cpp's server dropped its own).
    """
    from collectors import backends as bk
    from diag.demo.dialects import PINNED

    if expected != "kv_cache_saturation" or dialect not in PINNED:
        return None
    kv = [f for f in bk.feeds_of("kv_cache_usage_ratio") if f.family.dialect == dialect and f.family.versions == PINNED[dialect]]
    return None if kv else f"{bk.DIALECT_NAMES[dialect]} ({PINNED[dialect]}) exports no KV-cache usage"


def _report(runs: list[dict[str, Any]]) -> None:
    classes = sorted({r["expected"] for r in runs} | {r["primary"] for r in runs})
    matrix: dict[str, Counter[str]] = defaultdict(Counter)
    for r in runs:
        matrix[r["expected"]][r["primary"]] += 1
    width = max(len(c) for c in classes) + 2
    print("\nConfusion matrix (rows: expected class, columns: verdict)\n")
    print(" " * width + " ".join(f"{c[:10]:>10}" for c in classes))
    for row in classes:
        if row in matrix:
            print(f"{row:<{width}}" + " ".join(f"{matrix[row][c] or '.':>10}" for c in classes))
    print(f"\n{'class':<{width}}{'precision':>10}{'recall':>10}{'support':>10}")
    for c in classes:
        tp, predicted, support = matrix[c][c], sum(matrix[r][c] for r in matrix), sum(matrix[c].values())
        prec = f"{tp / predicted:.2f}" if predicted else "-"
        rec = f"{tp / support:.2f}" if support else "-"
        print(f"{c:<{width}}{prec:>10}{rec:>10}{support:>10}")
    correct = sum(1 for r in runs if r["primary"] == r["expected"])
    print(f"\ntop-1 accuracy {correct}/{len(runs)} = {correct / max(1, len(runs)):.3f}")
    blind = {f"{r['name']} in {r.get('dialect')}": why for r in runs
             if (why := _unobservable(r["expected"], str(r.get("dialect", ""))))}  # fmt: skip
    if blind:
        seen = [r for r in runs if not _unobservable(r["expected"], str(r.get("dialect", "")))]
        ok = sum(1 for r in seen if r["primary"] == r["expected"])
        print(f"top-1 on the classes the engine's metrics can show: {ok}/{len(seen)} = {ok / max(1, len(seen)):.3f} "
              f"(left out: {'; '.join(f'{n}: {w}' for n, w in sorted(blind.items()))})")  # fmt: skip
    by_view: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in runs:
        by_view[r["view"]][0] += r["primary"] == r["expected"]
        by_view[r["view"]][1] += 1
    print("by view: " + ", ".join(f"{v} {ok}/{n}" for v, (ok, n) in sorted(by_view.items())))
    healthy = [r for r in runs if r["expected"] == "healthy"]
    incidents = [r for r in healthy if r["primary"] not in ("healthy", "inconclusive")]
    print(f"incidents claimed on healthy views: {len(incidents)} of {len(healthy)}")
    hidden = [r for r in runs if r["primary"] == "healthy" and r.get("max_confidence", 0.0) >= SUSPECT]
    print(f"verdict healthy while a finding had confidence >= {SUSPECT}: {len(hidden)}")
    misses = [r for r in runs if r["primary"] != r["expected"] or r.get("signal_problems")]
    if misses:
        print("\nMisclassified views or missing signatures")
        for r in misses:
            print(f"- {r['name']} seed {r['seed']} ({r['params']}) [{r['view']}]: expected {r['expected']}, got {r['primary']}")
            if r.get("signal_problems"):
                print(f"    SIGNATURE MISSING: {'; '.join(r['signal_problems'])}")
            for cls, conf, summary in r.get("findings", []):
                print(f"    {cls} {conf}: {summary}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    ap.add_argument("--seeds", default="0", help="comma-separated load seeds")
    ap.add_argument("--variants", choices=("all", "defaults"), default="all")
    ap.add_argument("--save", type=Path, help="cache of runs: reused when present, written when run (resumable)")
    ap.add_argument("--replay", type=Path, help="judge the runs saved in this folder, run nothing")
    ap.add_argument("--fixtures", action="store_true", help="judge the repository's recorded fixtures, run nothing")
    ap.add_argument("--weights-dir", type=Path, help="checkpoint cache (default: the user cache dir)")
    ap.add_argument("--json", type=Path, help="also write the judged views as JSON here")
    ap.add_argument("--engine", action="store_true", help="the llama.cpp scenarios (engine-*), on every attachment each "
                    "takes (outside, wrapped); a confusion matrix per attachment")  # fmt: skip
    ap.add_argument("--dialects", default="", help="comma-separated: llmdiag, vllm, tgi, llamacpp (default: each "
                    "scenario's own)")  # fmt: skip
    ap.add_argument("--one-run-for-dialects", action="store_true", help="with several engines' --dialects: one run per "
                    "scenario serving them all, judged as each engine")  # fmt: skip
    args = ap.parse_args()
    from diag.demo.scenarios import ENGINE_SCENARIO_NAMES, SCENARIO_NAMES

    asked = [d for d in args.dialects.split(",") if d]
    if args.one_run_for_dialects and (len(asked) < 2 or "llmdiag" in asked or args.engine or args.replay or args.fixtures):
        ap.error("--one-run-for-dialects needs live runs and two or more engines' --dialects (vllm, tgi, llamacpp)")

    if args.fixtures or args.replay:  # both: the committed fixtures (seed 0) and the saved runs, in one matrix
        runs = (run_fixtures() if args.fixtures else []) + (run_replay(args.replay) if args.replay else [])
    else:
        from diag.demo.scenarios.cgroups import unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"accuracy: needs memory cgroups: {reason}", file=sys.stderr)
            raise SystemExit(3)
        names = [n for n in args.scenarios.split(",") if n] or list(ENGINE_SCENARIO_NAMES if args.engine else SCENARIO_NAMES)
        if args.engine:
            from diag.demo.engine.server import unavailable_reason as engine_missing

            if engine_missing():
                print(f"accuracy: --engine needs the engine: {engine_missing()}", file=sys.stderr)
                raise SystemExit(3)
        seeds = [int(s) for s in args.seeds.split(",") if s]
        save = args.save or Path(".accuracy-runs")
        dialects: list[str | None] = [d for d in args.dialects.split(",") if d] or [None]
        runs = run_live(names, seeds, args.variants, save, args.weights_dir, dialects, args.one_run_for_dialects)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2, default=str))
    report(runs)


if __name__ == "__main__":
    main()
