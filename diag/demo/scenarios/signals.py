"""Did the fault really happen? Per-scenario checks of the *raw* signals, independent of the rules.

Why separate from the verdict: when a scenario is misclassified, the first question is whether the
fault left the signature it should (a leak that did not leak is a scenario bug; a leak the rules
call pressure is a rule bug). Each check reads the recorded Timeline directly -- cgroup counters,
PSI, process memory, request timings -- and returns the problems it found (empty: the signature is
there) plus a one-line summary of the numbers for the progress output.

Thresholds are deliberately loose (a fraction of what the scenarios produce on a 2-core box) so that
a check fails only when the fault clearly did not happen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diag.timeline import Series, Timeline

MiB = float(1 << 20)
Check = Callable[[Timeline, dict[str, Any]], tuple[list[str], str]]
CHECKS: dict[str, Check] = {}


def check(name: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return register


def _group(tl: Timeline, role: str) -> tuple[str, dict[str, Series]] | None:
    """The recorded cgroup whose leaf name carries the scenario role (``llmdiag-demo-<role>-<id>``)."""
    for path, series in tl.cgroups.items():
        if f"-{role}-" in path.rsplit("/", 1)[-1]:
            return path, series
    return None


def _max(series: dict[str, Series] | None, key: str) -> float:
    s = (series or {}).get(key)
    v = s.valid().values if s is not None else np.empty(0)
    return float(v.max()) if v.size else float("nan")


def _inc(series: dict[str, Series] | None, key: str) -> float:
    s = (series or {}).get(key)
    return s.increase() if s is not None else 0.0


def _quarters(values: np.ndarray, ts: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(ts)
    return [values[q] for q in np.array_split(order, 4)]


def _median(v: np.ndarray) -> float:
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else float("nan")


def _ok_requests(tl: Timeline) -> np.ndarray:
    r = tl.requests
    return (r["outcome"] == "ok") if len(r) else np.zeros(0, bool)


def _service(tl: Timeline) -> dict[str, Series] | None:
    found = _group(tl, "service")
    return found[1] if found else None


def _no_ooms(tl: Timeline, problems: list[str]) -> None:
    if tl.ooms:
        problems.append(f"{len(tl.ooms)} OOM kill(s) recorded in the scenario's groups")


@check("healthy")
def _healthy(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    problems: list[str] = []
    svc = _service(tl)
    psi = _max(svc, "psi.memory.some.avg10")
    ok = _ok_requests(tl)
    share = float(ok.mean()) if ok.size else 0.0
    if ok.size < 50 or share < 0.95:
        problems.append(f"only {int(ok.sum())} of {ok.size} requests succeeded")
    if np.isfinite(psi) and psi > 5:
        problems.append(f"service memory PSI some reached {psi:.1f} %")
    _no_ooms(tl, problems)
    return problems, f"{ok.size} requests, {share:.0%} ok, service PSI some max {psi:.1f} %"


@check("leak")
def _leak(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    problems: list[str] = []
    anon = (_service(tl) or {}).get("stat.anon")
    if anon is None or len(anon.valid()) < 20:
        return ["no cgroup anon series"], "no data"
    a = anon.valid()
    q = _quarters(a.values, a.ts)
    rise = (a.values[-1] - a.values[0]) / MiB
    if rise < 64:
        problems.append(f"anon rose only {rise:.0f} MiB")
    if not q[3].min() > q[0].max():
        problems.append("anon troughs did not climb (last quarter's minimum <= first quarter's maximum)")
    _no_ooms(tl, problems)
    return problems, f"anon {a.values[0] / MiB:.0f} -> {a.values[-1] / MiB:.0f} MiB over {a.ts[-1] - a.ts[0]:.0f} s"


@check("pressure")
def _pressure(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    problems: list[str] = []
    svc = _service(tl)
    psi = _max(svc, "psi.memory.some.avg10")
    refault = _inc(svc, "stat.workingset_refault_file")
    anon = (svc or {}).get("stat.anon")
    if not (np.isfinite(psi) and psi >= 1.0):
        problems.append(f"service memory PSI some max {psi:.2f} % (< 1 %)")
    if refault <= 0:
        problems.append("no page-cache refaults: nothing was squeezed")
    if anon is not None and len(anon.valid()) >= 10:
        a = anon.valid().values
        if a.max() - a[-1] < 16 * MiB:
            problems.append(f"anon did not come back down (max {a.max() / MiB:.0f}, last {a[-1] / MiB:.0f} MiB)")
    _no_ooms(tl, problems)
    return problems, f"service PSI some max {psi:.1f} %, refaults +{refault:.0f}"


@check("thrash")
def _thrash(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    problems: list[str] = []
    svc = _service(tl)
    psi = _max(svc, "psi.memory.some.avg10")
    majf = _inc(svc, "stat.pgmajfault")
    if not (np.isfinite(psi) and psi >= 5):
        problems.append(f"service memory PSI some max {psi:.1f} % (< 5 %)")
    if majf < 300:
        problems.append(f"only {majf:.0f} major faults")
    r = tl.requests
    ok = _ok_requests(tl)
    if ok.sum() >= 8:
        q = _quarters(r["inference_s"][ok], r["ts"][ok])
        first, last = _median(q[0]), _median(q[3])
        if not last >= 1.5 * first:
            problems.append(f"inference did not inflate with concurrency ({first:.2f} s -> {last:.2f} s)")
    else:
        problems.append(f"only {int(ok.sum())} requests succeeded")
    _no_ooms(tl, problems)
    return problems, f"service PSI some max {psi:.1f} %, major faults +{majf:.0f}"


@check("host-oom")
def _host_oom(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    found = _group(tl, "service")
    path = found[0] if found else None
    kills = [o for o in tl.ooms if o.constraint == "CONSTRAINT_MEMCG" and o.oom_memcg == path]
    problems = [] if kills else ["no kernel OOM kill (CONSTRAINT_MEMCG) in the service group recorded"]
    return problems, f"{len(kills)} memcg OOM kill(s) of the service group, victims {[o.pid for o in kills]}"


@check("noisy-neighbour")
def _noisy(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    problems: list[str] = []
    nb = _group(tl, "neighbour")
    nb_psi = _max(nb[1] if nb else None, "psi.memory.some.avg10")
    svc_psi = _max(_service(tl), "psi.memory.some.avg10")
    host_psi = _max(tl.host, "psi.memory.some.avg10")
    if not (np.isfinite(nb_psi) and nb_psi >= 5):
        problems.append(f"neighbour PSI some max {nb_psi:.1f} % (< 5 %)")
    if not (np.isfinite(host_psi) and host_psi >= 2):
        problems.append(f"host PSI some max {host_psi:.1f} % (< 2 %)")
    if np.isfinite(svc_psi) and svc_psi >= 1:
        problems.append(f"the service's own PSI reached {svc_psi:.1f} %")
    return problems, f"neighbour PSI max {nb_psi:.1f} %, host {host_psi:.1f} %, service {svc_psi:.1f} %"


@check("queue")
def _queue(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    problems: list[str] = []
    r = tl.requests
    ok = _ok_requests(tl)
    if ok.sum() < 40:
        return [f"only {int(ok.sum())} requests succeeded"], "too few requests"
    wait = _quarters(r["queue_wait_s"][ok], r["ts"][ok])
    inf = _quarters(r["inference_s"][ok], r["ts"][ok])
    w0, w3, s0, s3 = _median(wait[0]), _median(wait[3]), _median(inf[0]), _median(inf[3])
    if not w3 >= max(0.2, 3 * s3):
        problems.append(f"queue wait did not build up (last quarter {w3:.2f} s vs inference {s3:.2f} s)")
    if not s3 <= 2 * s0:
        problems.append(f"inference did not stay flat ({s0:.3f} s -> {s3:.3f} s)")
    return problems, f"queue wait {w0:.2f} -> {w3:.2f} s, inference {s0:.3f} -> {s3:.3f} s"


@check("kv-saturation")
def _kv_saturation(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    """From the engine's own metrics (the agent's scrape): the cache filled, sequences were preempted."""
    usage, pre = tl.service.get("kv_cache_usage_ratio"), tl.service.get("preemptions_rps")
    if usage is None or pre is None or not len(usage.valid()):
        return ["no KV-cache usage or preemption series: was the engine's /metrics scraped?"], "no KV signals"
    u, p = usage.valid().values, pre.valid().values
    problems = []
    calm = float(np.min(u))
    if calm >= 0.8:
        problems.append(f"the cache never had room (usage never under 80 %, min {calm:.0%})")
    if int(np.sum(u >= 0.95)) < 3:
        problems.append(f"the cache was at >= 95 % in {int(np.sum(u >= 0.95))} samples (need 3)")
    if not float(np.max(p)) > 0:
        problems.append("no preemption")
    return (
        problems,
        f"KV usage {calm:.0%} -> {float(np.max(u)):.0%}, {int(np.sum(u >= 0.95))} samples at >= 95 %, "
        f"preemptions up to {float(np.max(p)):.2g}/s",
    )


@check("duplicate-models")
def _duplicates(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    weights = float(notes.get("weights_bytes") or 0)
    by_file: dict[str, list[float]] = {}
    for t in tl.processes.values():
        uss = t.series.get("uss")
        if not t.model_files or uss is None or not len(uss.valid()):
            continue
        for f in t.model_files:
            by_file.setdefault(f, []).append(float(np.nanmax(uss.valid().values)))
    best = max(by_file.values(), key=len, default=[])
    big = [u for u in best if weights and u >= 0.8 * weights]
    want = max(2, int(notes.get("workers") or 4))
    problems = [] if len(big) >= want else [f"{len(big)} processes hold a private copy (USS >= 80 % of the weights), want {want}"]
    return problems, f"{len(best)} processes map the checkpoint; USS {[round(u / MiB) for u in best]} MiB"


@check("loader-refresh")
def _loader(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    ld = tl.loader
    in_path = int(np.nansum(ld["in_request_path"])) if len(ld) else 0
    ok = int(_ok_requests(tl).sum())
    problems = [] if ok >= 20 and in_path >= 0.9 * ok else [f"{in_path} on-path loads for {ok} successful requests"]
    return problems, f"{in_path} loads on the request path for {ok} successful requests"


@check("moe-skew")
def _moe(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    rt = tl.routing
    if len(rt) < 20:
        return [f"only {len(rt)} routing records"], "too few routing records"
    bal = _median(rt["balancedness"])
    overflow = float(np.nansum(rt["overflow_tokens"]))
    problems = [] if bal < 0.3 else [f"median balancedness {bal:.2f} (>= 0.3): not skewed"]
    return problems, f"{len(rt)} routing records, median balancedness {bal:.2f}, overflow {overflow:.0f} tokens"


@check("request-count-batching")
def _batching(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    b = tl.batches
    if len(b) < 20:
        return [f"only {len(b)} batches"], "too few batches"
    tok = b["input_tokens"]
    lo, hi = float(np.percentile(tok, 5)), float(np.percentile(tok, 95))
    top = float(tok.max())
    swing = hi >= 10 * max(lo, 1) and top > 4096  # 10x at the same request cap, and batches past a sane budget
    problems = [] if swing else [f"batch tokens p5 {lo:.0f}, p95 {hi:.0f}, max {top:.0f}: no wide swing past a 4096 budget"]
    return problems, f"{len(b)} batches, input tokens p5 {lo:.0f} / p95 {hi:.0f} / max {tok.max():.0f}"


@check("oversized-context")
def _oversized(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    r = tl.requests
    if not len(r):
        return ["no requests"], "no requests"
    long_ = r["prompt_tokens"] >= 4000
    failed = r["outcome"] != "ok"
    fl = float(failed[long_].mean()) if long_.any() else float("nan")
    fr = float(failed[~long_].mean()) if (~long_).any() else float("nan")
    problems = []
    if long_.sum() < 3:
        problems.append(f"only {int(long_.sum())} huge prompts")
    elif not fl >= 0.5:
        problems.append(f"huge prompts failed only {fl:.0%} of the time")
    return problems, f"{int(long_.sum())} huge prompts fail {fl:.0%}, the rest {fr:.0%}"


@check("unsafe-config")
def _unsafe_config(tl: Timeline, notes: dict[str, Any]) -> tuple[list[str], str]:
    """The dangerous settings are on record, and the run itself stayed calm: the risk is in the arithmetic."""
    problems: list[str] = []
    settings = tl.configs[-1].settings if tl.configs else {}
    slots = settings.get("max_concurrency")
    if not isinstance(slots, int) or slots < 16:
        problems.append(f"config record max_concurrency {slots!r}, expected a large slot count")
    for key in ("queue_timeout_s", "request_timeout_s", "max_prompt_tokens"):
        if settings.get(key) is not None:
            problems.append(f"config record {key} = {settings.get(key)!r}, expected unset")
    g = _group(tl, "service")
    limit, peak = _max(g[1] if g else None, "limit"), _max(g[1] if g else None, "usage")
    ooms = _inc(g[1] if g else None, "events.oom_kill") + len(tl.ooms)
    if not (np.isfinite(peak) and np.isfinite(limit)) or peak >= 0.9 * limit:
        problems.append(f"group usage peak {peak / MiB:.0f} MiB against a {limit / MiB:.0f} MiB limit: not calm")
    if ooms:
        problems.append(f"{ooms:.0f} OOM kill(s): the incident happened instead of being foreseen")
    r = tl.requests
    ok = float((r["outcome"] == "ok").mean()) if len(r) else 0.0
    if ok < 0.95:
        problems.append(f"only {ok:.0%} of {len(r)} requests succeeded")
    return problems, (
        f"slots {slots}, usage peak {peak / MiB:.0f} of {limit / MiB:.0f} MiB, "
        f"{len(r)} requests {ok:.0%} ok, OOM kills {ooms:.0f}"
    )


def config_notes(tl: Timeline) -> dict[str, Any]:
    """What the service's ServiceConfig records say (weights size, workers) -- enough to check a replayed run."""
    out: dict[str, Any] = {}
    for c in tl.configs:
        for key in ("weights_bytes", "workers"):
            if c.settings.get(key):
                out[key] = max(out.get(key, 0), c.settings[key])
    return out


def check_signals(name: str, tl: Timeline, notes: dict[str, Any] | None = None) -> tuple[list[str], str]:
    """(problems, summary) for scenario ``name``; no check registered -> ([], "").

    ``notes`` are the runner's (weights size, workers ...); missing ones come from the config records."""
    fn = CHECKS.get(name)
    return fn(tl, {**config_notes(tl), **(notes or {})}) if fn else ([], "")
