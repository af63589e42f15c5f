"""The negative check: during one step's load, a bounded memory hog in a sibling cgroup of the service's, and
whether the service's protection held -- its resident memory, its page faults and stalls, its latency, its OOM
kills, before the hog versus while it held its memory.

Why within one step (``start_after`` into it): the same open-loop load before and during the hog, so a change in
the service's latency or memory is the neighbour's doing, not the next step's rate. Why sample the service here
(a few reads of /proc and the group, four times a second) rather than only through the agent: the question is a
before/after of a few seconds, and the agent's one-second samples may straddle the hog's start; the rules engine
still diagnoses the hold's window from the agent's records (the runner does that).

A check that cannot run here (no root, no memory hierarchy, the service in the root group, a hog the host cannot
afford) is NOT RUN with the reason: the gate does not pass on a check it did not make.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.gate.criteria import Verdict, quantile
from diag.gate.load import StepLoad
from diag.gate.neighbour_group import NeighbourGroup, NotRun, TargetGroup, resolve_target
from diag.gate.spec import NeighbourSpec
from diag.units import format_bytes

SAMPLE_S = 0.25
READY_S = 30.0  # the hog's start and its touching of its memory; a host this slow fails to start it: NOT RUN
BEFORE_S = 3.0  # the service's memory "before" is its median over this long before the hog starts
AFTER_S = 1.0  # samples this long after the hog stops still count as "during" (reclaim's after-effects)


@dataclass(frozen=True)
class TargetSample:
    """The service at one moment (loop time): resident memory of its processes, its group's usage, its faults."""

    t: float
    rss: int | None  # summed VmRSS of the service's processes
    rss_file: int | None  # the file-backed part of it (mapped weights: what reclaim takes without swap)
    majflt: int | None  # summed major faults
    usage: int | None  # the group's usage (page cache included)
    psi_total_us: int | None  # the group's memory "some" stall time, microseconds (cgroup2 PSI)
    hog_usage: int | None  # the neighbour group's usage


def _pid_memory(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS, RssFile, majflt) of ``pid``; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssFile"):
            with contextlib.suppress(ValueError, IndexError):
                fields[key] = int(rest.split()[0]) * 1024
    try:
        majflt = int(stat.rsplit(")", 1)[1].split()[9])  # field 12: after the comm's ")" it is the 10th
    except (IndexError, ValueError):
        majflt = 0
    return fields.get("VmRSS", 0), fields.get("RssFile", 0), majflt


def _psi_total(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for word in line.split():
                if word.startswith("total="):
                    with contextlib.suppress(ValueError):
                        return int(word[6:])
    return None


def sample(t: float, target: TargetGroup, pids: tuple[int, ...], group: NeighbourGroup | None) -> TargetSample:
    """One sample of the service (its named pids and every process in its group) and of the neighbour's group."""
    every = sorted(set(pids) | set(target.pids()))
    found = [m for p in every if (m := _pid_memory(p)) is not None]
    rss = sum(m[0] for m in found) if found else None
    usage_text = ""
    with contextlib.suppress(OSError):
        usage_text = target.usage_file().read_text().strip()
    return TargetSample(
        t, rss, sum(m[1] for m in found) if found else None, sum(m[2] for m in found) if found else None,
        int(usage_text) if usage_text.isdigit() else None, _psi_total(target.pressure),
        group.usage_bytes() if group is not None else None,
    )  # fmt: skip


@dataclass
class NeighbourRun:
    """What happened: the hog's window (loop times), the samples, and why it did not run if it did not."""

    spec: NeighbourSpec
    target: TargetGroup | None = None
    group_path: str = ""
    limit_bytes: int = 0
    parent_limit: int | None = None
    samples: list[TargetSample] = field(default_factory=list)
    start: float | None = None  # the hog's spawn
    ready: float | None = None  # it had touched all its memory
    stop: float | None = None
    not_run: str = ""
    hog_exit: str = ""  # how the hog ended when it was not us stopping it (its own OOM kill, a refusal)
    oom_before: int | None = None
    oom_after: int | None = None
    leftover: str = ""


async def _sampler(run: NeighbourRun, pids: tuple[int, ...], group: NeighbourGroup | None, done: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    assert run.target is not None
    while not done.is_set():
        run.samples.append(sample(loop.time(), run.target, pids, group))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), SAMPLE_S)


async def _hog(run: NeighbourRun, group: NeighbourGroup, stop: asyncio.Event) -> None:
    """Spawn the hog in its group, wait for it to hold its memory, let it hold, stop it."""
    loop = asyncio.get_running_loop()
    spec = run.spec
    proc = await asyncio.create_subprocess_exec(
        *group.hog_argv(spec.memory_bytes, spec.hold_s + READY_S), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=group.join_in_child,
    )  # fmt: skip
    group.hog_pids.append(proc.pid)
    run.start = loop.time()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_S)
        except TimeoutError:
            line = b""
        if line.strip() != b"ready":
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            code = await proc.wait()
            err = (await proc.stderr.read()).decode(errors="replace").strip().splitlines()
            why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            if code == -9:
                why += f" (an OOM kill in its own group, limit {format_bytes(group.limit_bytes)}, is the likely cause)"
            run.not_run = f"the neighbour did not reach {format_bytes(spec.memory_bytes)}: {why}" + (
                f": {err[-1]}" if err else ""
            )
            return
        run.ready = loop.time()
        end = run.start + spec.hold_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_first(stop.wait(), proc.wait()), max(0.0, end - loop.time()))
        if stop.is_set():
            run.not_run = "the run was interrupted while the neighbour held its memory"
        elif proc.returncode is not None:
            code = proc.returncode
            run.hog_exit = f"the neighbour ended early ({'signal ' + str(-code) if code < 0 else 'exit status ' + str(code)})"
    finally:
        run.stop = loop.time()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # by its PID; close() kills whatever else is in the group
        with contextlib.suppress(Exception):
            await proc.wait()


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def run_neighbour(
    spec: NeighbourSpec, pids: tuple[int, ...], cgroups: tuple[str, ...], stop: asyncio.Event
) -> NeighbourRun:
    """From the start of the step it runs in: wait ``start_after`` (sampling the service), hold, clean up.

    The group is removed in ``finally`` whatever happens: a Ctrl-C (``stop``), a cancellation, an exception."""
    run = NeighbourRun(spec)
    try:
        run.target = resolve_target(pids, cgroups)
    except NotRun as exc:
        run.not_run = str(exc)
        return run
    done = asyncio.Event()
    sampler = asyncio.ensure_future(_sampler(run, pids, None, done))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    group: NeighbourGroup | None = None
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), spec.start_after_s)
        if stop.is_set():
            run.not_run = "the run was interrupted before the neighbour started"
            return run
        try:
            group = NeighbourGroup.create(run.target, spec.memory_bytes)
        except NotRun as exc:
            run.not_run = str(exc)
            return run
        run.group_path, run.limit_bytes = group.path, group.limit_bytes
        run.parent_limit = run.target.limit_of(run.target.parent_dir)
        run.oom_before = run.target.oom_kills()
        done.set()
        await sampler
        done.clear()
        sampler = asyncio.ensure_future(_sampler(run, pids, group, done))  # now with the neighbour's usage
        await _hog(run, group, stop)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, AFTER_S - (loop.time() - (run.stop or t0))))
        run.oom_after = run.target.oom_kills()
    finally:
        done.set()
        with contextlib.suppress(Exception):
            await sampler
        if group is not None:
            await loop.run_in_executor(None, group.close)
            run.leftover = group.leftover if group.dir.exists() else ""
    return run


# --------------------------------------------------------------------------- the verdict


@dataclass
class NeighbourOutcome:
    """PASS, FAIL or NOT RUN, each criterion's verdict, the evidence lines, and the rules' diagnosis of the hold."""

    state: str
    during: str
    verdicts: list[Verdict] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    reason: str = ""  # NOT RUN: why
    diagnosis: str = ""
    primary: str | None = None
    window: tuple[float, float] | None = None  # wall clock of the hold
    facts: dict[str, Any] = field(default_factory=dict)  # the evidence as figures (``neighbour_facts``), for a page

    @property
    def passed(self) -> bool:
        return self.state == "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "during": self.during,
            "reason": self.reason or None,
            "window": {"start": self.window[0], "end": self.window[1]} if self.window else None,
            "criteria": [v.to_dict() for v in self.verdicts],
            "evidence": self.evidence,
            "facts": self.facts or None,
            "diagnosis": {"primary": self.primary, "line": self.diagnosis},
        }


def not_run(spec: NeighbourSpec, reason: str) -> NeighbourOutcome:
    return NeighbourOutcome("NOT RUN", spec.during, reason=reason)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _mib(value: float) -> str:
    return f"{value / (1 << 20):.0f} MiB"


def _between(samples: list[TargetSample], lo: float, hi: float) -> list[TargetSample]:
    return [s for s in samples if lo <= s.t <= hi]


def _reclaimed(run: NeighbourRun, before: list[TargetSample], during: list[TargetSample]) -> tuple[float | None, str]:
    """(share of the service's resident memory gone during the hold, how it was measured)."""
    for attr, what in (("rss", "resident memory of the service's processes"), ("usage", "the service group's usage")):
        b = [v for s in before if (v := getattr(s, attr)) is not None]
        d = [v for s in during if (v := getattr(s, attr)) is not None]
        if b and d and statistics.median(b) > 0:
            base, low = statistics.median(b), min(d)
            ratio = max(0.0, (base - low) / base)
            return ratio, f"{what}: {_mib(base)} before, {_mib(low)} at the lowest during the hold"
    return None, "the service's memory was not readable before and during the hold"


def _rate(samples: list[TargetSample], attr: str) -> float | None:
    pts = [(s.t, v) for s in samples if (v := getattr(s, attr)) is not None]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def judge_neighbour(run: NeighbourRun, load: StepLoad, oom_kills_kmsg: int | None) -> NeighbourOutcome:
    """The criteria of ``run.spec`` from the samples and the step's requests; NOT RUN when the hog never held."""
    spec = run.spec
    if run.not_run or run.start is None or run.ready is None or run.stop is None or run.target is None:
        return not_run(spec, run.not_run or "the neighbour did not start")
    crit = spec.criteria
    out = NeighbourOutcome("PASS", spec.during, window=(load.wall(run.start), load.wall(run.stop)))
    target = run.target
    before = _between(run.samples, run.start - BEFORE_S, run.start)
    if not before:
        before = [s for s in run.samples if s.t < run.start][-1:]
    during = _between(run.samples, run.ready, run.stop + AFTER_S)
    ratio, how = _reclaimed(run, before, during)
    # latency: the step's requests scheduled before the hog against those scheduled while it held its memory
    pre = [r for r in load.results if r.scheduled < run.start]
    held = [r for r in load.results if run.start <= r.scheduled < run.stop]
    pre_ok = [r.e2e_s for r in pre if r.ok]
    held_ok = [r.e2e_s for r in held if r.ok]
    for q in crit.quantiles:
        limit = f"<= {_ms(q.limit_s)}"
        if not held_ok:
            out.verdicts.append(Verdict(q.key, limit, "no data", False, note="no request succeeded during the hold"))
            continue
        got = quantile(held_ok, q.q)
        out.verdicts.append(Verdict(q.key, limit, _ms(got), got <= q.limit_s, got, f"{len(held_ok)} requests during the hold"))
    if crit.max_latency_ratio is not None:
        limit = f"<= {crit.max_latency_ratio:g}x"
        if not pre_ok or not held_ok:
            out.verdicts.append(Verdict("max_latency_ratio", limit, "no data", False,
                                        note="no successful request before the hog or during its hold"))  # fmt: skip
        else:
            p_pre, p_held = quantile(pre_ok, 0.99), quantile(held_ok, 0.99)
            got = p_held / max(p_pre, 1e-6)
            note = f"e2e p99 {_ms(p_held)} during vs {_ms(p_pre)} before ({len(held_ok)}/{len(pre_ok)} requests)"
            out.verdicts.append(Verdict("max_latency_ratio", limit, f"{got:.2f}x", got <= crit.max_latency_ratio, got, note))
    if crit.error_ratio is not None:
        bad = sum(1 for r in held if not r.ok)
        limit = f"<= {crit.error_ratio:g}"
        if not held:
            out.verdicts.append(Verdict("error_ratio", limit, "no requests", False, note="nothing was sent during the hold"))
        else:
            got = bad / len(held)
            out.verdicts.append(Verdict("error_ratio", limit, f"{got:.3f} ({bad}/{len(held)})", got <= crit.error_ratio, got))
    if crit.max_target_reclaimed_ratio is not None:
        limit = f"<= {crit.max_target_reclaimed_ratio:g}"
        if ratio is None:
            out.verdicts.append(Verdict("max_target_reclaimed_ratio", limit, "no data", False, note=how))
        else:
            ok = ratio <= crit.max_target_reclaimed_ratio
            out.verdicts.append(Verdict("max_target_reclaimed_ratio", limit, f"{ratio:.3f}", ok, ratio, how))
    kills = _kills(run, oom_kills_kmsg)
    if crit.oom_kills is not None:
        limit = f"<= {crit.oom_kills}"
        if kills is None:
            out.verdicts.append(
                Verdict("oom_kills", limit, "unknown", False, note="neither the kernel log nor the group's count was readable")
            )
        else:
            out.verdicts.append(
                Verdict("oom_kills", limit, str(kills), kills <= crit.oom_kills, float(kills), f"in {target.path}")
            )
    out.evidence = _evidence(run, before, during, how, kills)
    out.facts = neighbour_facts(run, before, during, kills)
    if not all(v.passed for v in out.verdicts):
        out.state = "FAIL"
    return out


def _kills(run: NeighbourRun, kmsg: int | None) -> int | None:
    group = run.oom_after - run.oom_before if run.oom_after is not None and run.oom_before is not None else None
    known = [k for k in (group, kmsg) if k is not None]
    return max(known) if known else None


def _evidence(
    run: NeighbourRun, before: list[TargetSample], during: list[TargetSample], how: str, kills: int | None
) -> list[str]:
    assert run.target is not None and run.start is not None and run.ready is not None and run.stop is not None
    target = run.target
    parent = "unlimited" if run.parent_limit is None else _mib(run.parent_limit)
    lines = [
        f"neighbour: {_mib(run.spec.memory_bytes)} touched in {run.group_path} (hard limit {_mib(run.limit_bytes)}), "
        f"held {run.stop - run.ready:.1f} s (ready {run.ready - run.start:.1f} s after its start)",
        f"protection: {target.protection()}",
        f"shared parent: {target.parent_path} (limit {parent})"
        + (": the neighbour's pages count against the service's limit" if run.parent_limit is not None else ""),
        how,
    ]
    hog_peak = max((s.hog_usage for s in during if s.hog_usage is not None), default=None)
    if hog_peak is not None:
        lines.append(f"neighbour group usage at its peak: {_mib(hog_peak)}")
    fb = [s.rss_file for s in before if s.rss_file is not None]
    fd = [s.rss_file for s in during if s.rss_file is not None]
    if fb and fd:
        lines.append(
            f"file-backed resident (mapped weights): {_mib(statistics.median(fb))} before, {_mib(min(fd))} lowest during"
        )
    mb, md = _rate(before, "majflt"), _rate(during, "majflt")
    if mb is not None and md is not None:
        lines.append(f"major faults: {mb:.1f}/s before, {md:.1f}/s during")
    pb, pd = _rate(before, "psi_total_us"), _rate(during, "psi_total_us")
    if pb is not None and pd is not None:
        lines.append(f"memory stall (PSI some) of the service's group: {pb / 1e4:.1f} % before, {pd / 1e4:.1f} % during")
    lines.append(f"OOM kills in the service: {'unknown' if kills is None else kills}")
    if run.hog_exit:
        lines.append(run.hog_exit)
    if run.leftover:
        lines.append(f"the neighbour's group could not be removed: {run.leftover}")
    return lines


def _median(samples: list[TargetSample], attr: str) -> float | None:
    values = [v for s in samples if (v := getattr(s, attr)) is not None]
    return float(statistics.median(values)) if values else None


def _lowest(samples: list[TargetSample], attr: str) -> float | None:
    values = [v for s in samples if (v := getattr(s, attr)) is not None]
    return float(min(values)) if values else None


def neighbour_facts(run: NeighbourRun, before: list[TargetSample], during: list[TargetSample],
                    kills: int | None) -> dict[str, Any]:  # fmt: skip
    """The evidence lines' figures, each "before" and "during" a number or None (not readable here): what a page
    tabulates without parsing prose. Memory before is the median over the seconds before the hog, during the
    lowest while it held (what reclaim took); faults and stall are rates over each window."""
    assert run.target is not None and run.start is not None and run.ready is not None and run.stop is not None
    psi_b, psi_d = _rate(before, "psi_total_us"), _rate(during, "psi_total_us")
    return {
        "neighbour": {
            "group": run.group_path, "memory_bytes": run.spec.memory_bytes, "limit_bytes": run.limit_bytes,
            "ready_s": round(run.ready - run.start, 3), "held_s": round(run.stop - run.ready, 3),
            "peak_bytes": max((s.hog_usage for s in during if s.hog_usage is not None), default=None),
        },
        "service_group": run.target.path,
        "protection": run.target.protection(),
        "parent": {"path": run.target.parent_path, "limit_bytes": run.parent_limit},
        "resident_bytes": {"before": _median(before, "rss"), "during": _lowest(during, "rss")},
        "file_resident_bytes": {"before": _median(before, "rss_file"), "during": _lowest(during, "rss_file")},
        "group_usage_bytes": {"before": _median(before, "usage"), "during": _lowest(during, "usage")},
        "major_faults_per_s": {"before": _rate(before, "majflt"), "during": _rate(during, "majflt")},
        "memory_stall_pct": {"before": None if psi_b is None else psi_b / 1e4, "during": None if psi_d is None else psi_d / 1e4},
        "oom_kills": kills,
        "hog_exit": run.hog_exit or None,
        "leftover": run.leftover or None,
    }  # fmt: skip
