"""Thrashing from stall signals alone: for services that write no per-request rows (vLLM, TGI, llama.cpp...).

Without request rows there is no queue-vs-inference test, but the kernel still tells the story: a
group that spends a sustained share of wall time with *every* task stalled on memory (PSI ``full``)
while pages are faulted back in (major faults, workingset refaults, swap-in) is thrashing -- the
working set does not fit, and what was evicted a moment ago is read again. PSI alone could be
reclaim of cold cache; faults alone could be a cold start; both together, sustained, are the
signature (PSI full at ``stall_signals.PSI_FULL_UP``, 5 %, is a thrashing candidate). Which page-in
counter rises depends on how the working set is read: pages of a mapping come back as major faults,
file pages re-read through the page cache mostly as workingset refaults (the recorded thrash variants
in ``tests/fixtures/scenarios/variants/`` thrash on refaults more than on major faults), so any of
them, sustained next to the stalls, counts.

The signals are the watched service group's, else -- only when no group is watched -- the host's.
With enough request rows (``requestload.MIN_REQUESTS``) this rule stands aside: ``requests.thrashing``
judges the same stalls against the requests' own slowdown, which is the finer test.
"""

from __future__ import annotations

import numpy as np

from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.requestload import MIN_REQUESTS
from diag.rules.stall_signals import FLOORS, PAGE_INS, PSI_FULL_UP, PSI_SOME_UP, STALL_SIGNALS, stall_candidates
from diag.rules.stats import excerpt_arrays, service_context
from diag.timeline import Series, Timeline

SUSTAINED_SAMPLES = 5  # samples at or above the threshold: one spike is not thrashing
SUSTAINED_SHARE = 0.2  # ... and at least this share of the samples in the window
PSI_FULL_SEVERE = 10.0  # percent: every task stalled a tenth of the time
STALLED_MOST = 0.5  # ... or stalled in at least half the samples
FAULT_MARGIN_S = 10.0  # fault samples count when they lie within this of the stalled period


def _sustained(series: Series, threshold: float) -> tuple[bool, np.ndarray]:
    hot = series.values >= threshold
    return bool(hot.sum() >= SUSTAINED_SAMPLES and hot.mean() >= SUSTAINED_SHARE), hot


def _service_requests(tl: Timeline) -> int:
    req = tl.requests
    return int(np.isfinite(req["start"]).sum()) if len(req) and "start" in req else 0


@rule("stalls.thrashing", "thrashing", needs_any=STALL_SIGNALS)
def thrashing_from_stalls(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Sustained PSI full plus page-ins (major faults, refaults, swap-in) of the service's group, or the host's."""
    if _service_requests(tl) >= MIN_REQUESTS:
        return None  # requests.thrashing judges this with the requests' own slowdown
    ctx = service_context(tl, ac)
    candidates = stall_candidates(tl, ctx)
    own = [c for c in candidates if c.service]
    if own:
        chosen, where = own, "the service's"
    elif not tl.cgroups or set(tl.cgroups) == {"/"}:
        chosen, where = [c for c in candidates if c.scope == "host"], "the host's (no group watched)"
    else:
        return None  # groups are watched but none is known to be the service: host stalls are not its own
    full = [c for c in chosen if c.kind == "psi_full"]
    some = [c for c in chosen if c.kind == "psi_some"]
    if not full:
        return None
    scope, name, unit, _, series, _ = full[0]
    if len(series) < SUSTAINED_SAMPLES:
        return TooLittleData(f"{len(series)} samples of {scope} {name}", f"{SUSTAINED_SAMPLES} samples (1 Hz: 5 s)")
    stalled, hot = _sustained(series, PSI_FULL_UP)
    if not stalled:
        return None
    t0, t1 = float(series.ts[hot][0]), float(series.ts[hot][-1])
    peak = float(np.max(series.values))
    median_hot = float(np.median(series.values[hot]))
    evidence = [
        Evidence(
            f"{scope} {name} (median while stalled)", round(median_hot, 2), unit, t0, t1, excerpt_arrays(series.ts, series.values)
        ),
        Evidence(f"{scope} {name} peak", round(peak, 2), unit, t0, t1),
        Evidence(f"samples with {name} >= {PSI_FULL_UP:g} %", f"{int(hot.sum())} of {len(series)}", "samples", t0, t1),
    ]
    for c in some[:1]:
        s = c.series
        peak_some = round(float(np.max(s.values)), 2)
        evidence.append(Evidence(f"{c.scope} {c.name} peak", peak_some, c.unit, float(s.ts[0]), float(s.ts[-1])))
    paging: list[str] = []
    recorded = 0
    for c_scope, c_name, c_unit, kind, s, _ in chosen:
        if kind not in PAGE_INS:
            continue
        recorded += 1
        near = s.window(t0 - FAULT_MARGIN_S, t1 + FAULT_MARGIN_S).valid()
        if not len(near):
            continue
        above = near.values >= FLOORS[kind]
        if int(above.sum()) >= min(SUSTAINED_SAMPLES, len(near)) and above.mean() >= SUSTAINED_SHARE:
            paging.append(f"{c_scope} {c_name}")
            evidence.append(
                Evidence(
                    f"{c_scope} {c_name} (median while stalled; floor {FLOORS[kind]:g})",
                    round(float(np.median(near.values[above])), 1),
                    c_unit,
                    float(near.ts[0]),
                    float(near.ts[-1]),
                    excerpt_arrays(near.ts, near.values),
                )
            )
    if paging:
        conf = 0.65
        conf += 0.1 if peak >= PSI_FULL_SEVERE or hot.mean() >= STALLED_MOST else 0.0
        conf += 0.05 if len(paging) >= 2 else 0.0
        conf += 0.05 if median_hot >= 2 * PSI_FULL_SEVERE else 0.0  # every task stalled a fifth of the time or more
    else:
        conf = 0.4 if recorded == 0 else 0.35  # stalls without page-ins: reclaim, not yet proven thrashing
    rules_out = [
        f"judged from {where} stall signals alone: no per-request rows, so queue wait vs inference time is not known",
    ]
    if not paging:
        rules_out.append(
            "no sustained page-ins (major faults, refaults, swap-in) next to the stalls"
            if recorded
            else "page-in counters not recorded: stalls alone cannot tell thrashing from reclaim"
        )
    if any(float(np.max(c.series.values)) >= PSI_SOME_UP for c in some):
        rules_out.append("not mere pressure: tasks are fully stalled, not only some of them")
    return Finding(
        cls="thrashing",
        rule="stalls.thrashing",
        confidence=min(conf, 0.85),
        summary=(
            f"{scope[0].upper()}{scope[1:]} is fully stalled on memory {median_hot:.1f} % of the time "
            f"(peak {peak:.1f} %) for {t1 - t0:.0f} s"
            + (f" while pages are read back in ({', '.join(paging[:2])})" if paging else "")
            + ": the working set does not fit"
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "give the group more memory or shrink the working set (fewer workers, one shared model copy, smaller batches)",
            "lower concurrency until memory PSI full stays near 0",
            "add a memory guard that sheds load when memory PSI rises",
        ],
        start=t0,
        end=t1,
    )
