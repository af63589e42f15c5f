"""Each step's criteria judged against what was measured: one ``Verdict`` per criterion, PASS or FAIL with the value.

Why latency quantiles count only successful requests: an error is judged by ``error_ratio`` (a refused
request answering fast would otherwise *improve* p99). A step with no successful request fails every latency
criterion it has, with that said, rather than passing on no data. Open-loop latencies start at the scheduled
send time (see ``diag.gate.load``), so a generator running late cannot flatter them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diag.gate.load import StepLoad
from diag.gate.spec import Criteria, Quantile, Recovery


@dataclass(frozen=True)
class HostFacts:
    """What the host's side of the step showed: the memory PSI ceiling and the OOM kills in the step's window."""

    psi_some_avg10_max: float | None  # percent; None when no PSI sample fell in the window
    psi_scope: str  # "host" or the cgroup path the value is from
    oom_kills: int | None  # None when the kernel log could not be read
    oom_detail: str = ""
    oom_unreadable_why: str = ""


@dataclass(frozen=True)
class Verdict:
    """One criterion of one step. A criterion that could not be measured fails, the reason in ``note``: a gate
    passes on evidence, never on its absence."""

    criterion: str
    limit: str
    measured: str
    passed: bool
    value: float | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, one shape wherever a verdict is reported (a step's criteria, the neighbour's)."""
        return {"criterion": self.criterion, "limit": self.limit, "measured": self.measured, "value": self.value,
                "passed": self.passed, "note": self.note}  # fmt: skip


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between closest ranks (numpy's default), of a non-empty list."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _latency(load: StepLoad, q: Quantile) -> Verdict:
    ok = [r for r in load.results if r.ok]
    if q.metric == "e2e":
        values = [r.e2e_s for r in ok]
    elif q.metric == "ttft":
        values = [t for r in ok if (t := r.ttft_s) is not None]
    else:
        values = [g for r in ok for g in r.itl_s]
    limit = f"<= {_ms(q.limit_s)}"
    if not values:
        return Verdict(q.key, limit, "no data", False, note=f"no successful request gave a {q.metric} time")
    got = quantile(values, q.q)
    return Verdict(q.key, limit, _ms(got), got <= q.limit_s, got, note=f"{len(values)} samples")


def _errors(load: StepLoad, limit: float) -> Verdict:
    total = len(load.results) + load.dropped
    bad = sum(1 for r in load.results if not r.ok) + load.dropped
    if total == 0:
        return Verdict("error_ratio", f"<= {limit:g}", "no requests", False, note="the step sent nothing")
    ratio = bad / total
    kinds: dict[str, int] = {}
    for r in load.results:
        if not r.ok:
            kinds[r.error or f"HTTP {r.status}"] = kinds.get(r.error or f"HTTP {r.status}", 0) + 1
    if load.dropped:
        kinds["dropped at max_in_flight"] = load.dropped
    note = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return Verdict("error_ratio", f"<= {limit:g}", f"{ratio:.3f} ({bad}/{total})", ratio <= limit, ratio, note)


def _drain(load: StepLoad, limit: float) -> Verdict:
    """Queue drain: how long the requests still in flight when arrivals stopped took to finish."""
    got = max(0.0, load.end - load.load_end)
    late = [r for r in load.results if r.done > load.load_end]
    note = f"{len(late)} requests in flight when arrivals stopped"
    return Verdict("drain_s", f"<= {_ms(limit)}", _ms(got), got <= limit and not load.interrupted, got, note)


def recovery_time(load: StepLoad, rec: Recovery) -> float | None:
    """Seconds into the step of the first arrival from which every request succeeded within ``e2e_below_s``
    (None: latency never settled, or the step had no request)."""
    settled: float | None = None
    for r in load.results:  # sorted by scheduled time
        if r.ok and r.e2e_s <= rec.e2e_below_s:
            if settled is None:
                settled = r.scheduled
        else:
            settled = None
    return None if settled is None else max(0.0, settled - load.t0)


def _recovery(load: StepLoad, rec: Recovery) -> Verdict:
    limit = f"<= {_ms(rec.within_s)} (e2e <= {_ms(rec.e2e_below_s)})"
    got = recovery_time(load, rec)
    if got is None:
        return Verdict("recovery_s", limit, "not recovered", False, note="latency was above the bound until the end")
    return Verdict("recovery_s", limit, _ms(got), got <= rec.within_s, got)


def _psi(host: HostFacts, limit: float) -> Verdict:
    if host.psi_some_avg10_max is None:
        return Verdict("psi_memory_some_avg10", f"<= {limit:g} %", "no data", False, note="no memory PSI sample in the window")
    got = host.psi_some_avg10_max
    note = f"max over the step, {host.psi_scope}"
    return Verdict("psi_memory_some_avg10", f"<= {limit:g} %", f"{got:.1f} %", got <= limit, got, note)


def _oom(host: HostFacts, limit: int) -> Verdict:
    if host.oom_kills is None:
        return Verdict("oom_kills", f"<= {limit}", "unknown", False, note=host.oom_unreadable_why)
    kills = host.oom_kills
    return Verdict("oom_kills", f"<= {limit}", str(kills), kills <= limit, float(kills), host.oom_detail)


def judge(load: StepLoad, criteria: Criteria, host: HostFacts) -> list[Verdict]:
    """Every criterion of the step, in the spec's order of kinds: latency, errors, host, drain, recovery."""
    out = [_latency(load, q) for q in criteria.quantiles]
    if criteria.error_ratio is not None:
        out.append(_errors(load, criteria.error_ratio))
    if criteria.oom_kills is not None:
        out.append(_oom(host, criteria.oom_kills))
    if criteria.psi_memory_some_avg10 is not None:
        out.append(_psi(host, criteria.psi_memory_some_avg10))
    if criteria.drain_s is not None:
        out.append(_drain(load, criteria.drain_s))
    if criteria.recovery is not None:
        out.append(_recovery(load, criteria.recovery))
    return out
