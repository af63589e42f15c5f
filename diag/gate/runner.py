"""A gate run: the steps in order, each with the load, the host's samples over its window, the criteria judged
and the rules engine's diagnosis of that window -- so a FAIL says which criterion broke and why.

Why one event loop and one client for the whole run: connections are pooled across steps as a real client
pool would be, and a SIGINT handler on the loop turns Ctrl-C into a stop of the load (arrivals cease, what is in
flight is cancelled) rather than a traceback; the steps that ran are still judged and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from diag.gate.app_gate import before_load, graceful_termination, start_time
from diag.gate.criteria import HostFacts, Verdict, judge, quantile
from diag.gate.gates import Check, GateResult
from diag.gate.host import HostSampler, host_facts
from diag.gate.http_client import HttpClient
from diag.gate.infra import check_infrastructure
from diag.gate.inprocess import HttpxClient
from diag.gate.load import StepLoad, make_client, run_step
from diag.gate.neighbour import NeighbourOutcome, NeighbourRun, judge_neighbour, not_run, run_neighbour
from diag.gate.on_fail import BundleOutcome, take_bundle
from diag.gate.spec import GateSpec, Step
from diag.gate.unit import OomdState, UnitInfo
from diag.rules.engine import Analysis, analyze
from diag.sources import load_recorder

Progress = Callable[[str], None]
LATE_SEND_S = 0.05  # a generator this late behind its schedule is shaping the load itself: the report says so
FIRST_SAMPLE_S = 10.0  # the agent's first sample reads every process once: slow on a busy host


QUIET = ("healthy", "inconclusive")  # the rules' verdicts that explain no failure


def client_queue(load: StepLoad) -> str:
    """A queue as the client saw it, or "": fewer requests served than asked, and latency growing through the step
    or requests timing out.

    Why the client's side: a server that exposes no metrics (llama-cpp-python's) and queues requests behind one
    model lock shows the host nothing unusual -- one busy process, no memory pressure -- so the rules' verdict on the
    window is healthy or inconclusive while every request waits. The gate's own requests are the evidence then:
    an open-loop load the server does not keep up with leaves each arrival waiting longer than the one before."""
    res = load.results
    if len(res) < 3 or load.step.rate is None:
        return ""  # a closed loop waits for each answer: its queue cannot grow
    ok = [r for r in res if r.ok]
    timeouts = sum(1 for r in res if r.error == "timeout")
    third = max(1, len(res) // 3)
    early = sum(r.e2e_s for r in res[:third]) / third
    late = sum(r.e2e_s for r in res[-third:]) / third
    served = len(ok) / max(1e-9, load.end - load.t0)
    growing = late > 2 * early and late - early > 0.5
    if served >= load.step.rate * 0.9 or not (growing or timeouts):
        return ""
    parts = [f"served {served:.2f} req/s of the {load.step.rate:g} asked",
             f"e2e {early:.2f} s for the first third of arrivals, {late:.2f} s for the last"]  # fmt: skip
    if timeouts:
        parts.append(f"{timeouts} of {len(res)} timed out")
    return "queue_backlog (client side): " + ", ".join(parts)


@dataclass
class StepReport:
    """One step's outcome: the load's figures, each criterion's verdict, and the diagnosis of its window."""

    step: Step
    load: StepLoad
    verdicts: list[Verdict]
    host: HostFacts
    analysis: Analysis | None
    analysis_error: str = ""

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts) and not self.load.interrupted

    @property
    def window(self) -> tuple[float, float]:
        return self.load.wall0, self.load.wall(self.load.end)

    def diagnosis(self) -> str:
        """One line: the verdict of the rules on this step's window and its leading finding's summary; for a failed
        step the rules found nothing in (``client_queue`` says why that happens), what the client saw instead."""
        a = self.analysis
        if a is None:
            line = f"not diagnosed ({self.analysis_error})"
        else:
            lead = next((f for f in a.findings if f.cls == a.primary), None) or (a.findings[0] if a.findings else None)
            line = a.primary if a.primary == "healthy" or lead is None else f"{a.primary}: {lead.summary}"
        if not self.passed and (a is None or a.primary in QUIET):
            client = client_queue(self.load)
            if client:
                return f"{client} (the host's side: {line})"
        return line

    def figures(self) -> dict[str, Any]:
        """What the step measured, whatever its criteria: counts, achieved rate, send lag, latency quantiles."""
        res = self.load.results
        ok = [r for r in res if r.ok]
        span = max(1e-9, self.load.load_end - self.load.t0)
        lags = [r.lag_s for r in res]
        e2e = [r.e2e_s for r in ok]
        ttft = [t for r in ok if (t := r.ttft_s) is not None]
        itl = [g for r in ok for g in r.itl_s]

        def q(xs: list[float], p: float) -> float | None:
            return round(quantile(xs, p), 6) if xs else None

        whole = max(1e-9, self.load.end - self.load.t0)
        return {
            "sent": len(res), "ok": len(ok), "errors": len(res) - len(ok), "dropped": self.load.dropped,
            "achieved_rps": round(len(res) / span, 3), "throughput_rps": round(len(ok) / whole, 3),
            "send_lag_p50_s": q(lags, 0.5), "send_lag_p99_s": q(lags, 0.99),
            "send_lag_max_s": round(max(lags), 6) if lags else None,
            "e2e_p50_s": q(e2e, 0.5), "e2e_p99_s": q(e2e, 0.99), "ttft_p50_s": q(ttft, 0.5), "ttft_p99_s": q(ttft, 0.99),
            "itl_p50_s": q(itl, 0.5), "itl_p99_s": q(itl, 0.99), "output_tokens": sum(r.output_tokens for r in ok),
            "drain_s": round(max(0.0, self.load.end - self.load.load_end), 6),
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        a = self.analysis
        return {
            "name": self.step.name,
            "load": self.step.describe(),
            "passed": self.passed,
            "interrupted": self.load.interrupted,
            "window": {"start": self.window[0], "end": self.window[1]},
            "measured": self.figures(),
            "criteria": [v.to_dict() for v in self.verdicts],
            "diagnosis": {
                "primary": a.primary if a else None,
                "line": self.diagnosis(),
                "client": client_queue(self.load) or None if not self.passed else None,
                "findings": [
                    {"class": f.cls, "rule": f.rule, "confidence": round(f.confidence, 3), "summary": f.summary}
                    for f in (a.findings[:5] if a else [])
                ],
            },
        }


@dataclass
class GateReport:
    spec: GateSpec
    target: str
    steps: list[StepReport] = field(default_factory=list)
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)  # wall clock, before the host agent's first sample
    bundle: BundleOutcome | None = None  # the bundle taken at the first failed step (or why it is missing)
    neighbour: NeighbourOutcome | None = None  # the negative check, when the spec has one
    gates: dict[str, GateResult] = field(default_factory=dict)  # infrastructure, application: before the steps
    terminate_start: int | None = None  # start time of the process graceful_termination may signal, at the start

    @property
    def neighbour_held(self) -> bool:
        """No negative check asked for, or it ran and passed (NOT RUN never counts as held)."""
        return self.spec.neighbour is None or (self.neighbour is not None and self.neighbour.passed)

    @property
    def passed(self) -> bool:
        steps = not self.interrupted and len(self.steps) == len(self.spec.steps) and all(s.passed for s in self.steps)
        return steps and all(g.passed for g in self.gates.values()) and self.neighbour_held

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "spec": self.spec.source,
            "endpoint": self.spec.endpoint,
            "passed": self.passed,
            "interrupted": self.interrupted,
            "exit_code": self.exit_code,
            "notes": self.notes,
            "gates": {name: g.to_dict() for name, g in self.gates.items()},
            "bundle": self.bundle.path if self.bundle else None,
            "bundle_archive": self.bundle.archive if self.bundle else None,
            "steps": [s.to_dict() for s in self.steps],
            "not_run": [s.name for s in self.spec.steps[len(self.steps) :]],
            "neighbour": self.neighbour.to_dict() if self.neighbour else None,
        }


@dataclass(frozen=True)
class RunOptions:
    """Where the load goes and what the host side watches."""

    target: str
    recorder: Path
    pids: Sequence[int] = ()
    cgroups: Sequence[str] = ()
    scrape: Sequence[str] = ()  # the backend's /metrics URLs the agent scrapes during the run
    interval_s: float = 1.0
    bundle_dir: Path | None = None  # where the first failed step's bundle goes; None: no bundle
    unit: UnitInfo | None = None  # --unit: what systemd applied (its cgroup and MainPID are in cgroups/pids)
    oomd: OomdState | None = None  # systemd-oomd's state, where it was asked
    terminate_pid: int | None = None  # the one process graceful_termination may signal (--pid or the unit's MainPID)
    transport: Any = None  # an httpx transport in place of the network (an in-process ASGI app); None: real HTTP
    notes: Sequence[str] = ()  # what the caller found before the run (e.g. no /metrics at the target): in the report


def _diagnose(opts: RunOptions, sampler: HostSampler, load: StepLoad) -> tuple[HostFacts, Analysis | None, str]:
    """The host's facts and the rules' verdict over the step's window (the sample after its end included)."""
    return _diagnose_window(opts, sampler, load.wall0, load.wall(load.end))


def _diagnose_window(opts: RunOptions, sampler: HostSampler, start: float, end: float,
                     cgroups: Sequence[str] | None = None) -> tuple[HostFacts, Analysis | None, str]:  # fmt: skip
    """The host's facts (OOM kills in ``cgroups``, default the watched ones) and the rules' verdict over [start, end]."""
    sampler.sampled_after(end, timeout_s=3 * opts.interval_s + 2.0)
    until = max(end, sampler.last_sample_ts) + 0.001
    try:
        tl = load_recorder(opts.recorder, since_s=until - start, until=until, workers=1)
    except Exception as exc:  # a step is still judged on the client's side without the host's
        empty = HostFacts(None, "host", None, oom_unreadable_why=f"recorder unreadable: {exc}")
        return empty, None, f"recorder unreadable: {exc}"
    groups = opts.cgroups if cgroups is None else cgroups
    facts = host_facts(tl, start, until, cgroups=groups, pids=opts.pids, kmsg_error=sampler.kmsg_error)
    try:
        return facts, analyze(tl), ""
    except Exception as exc:  # the verdicts stand without a diagnosis; say why there is none
        return facts, None, f"{type(exc).__name__}: {exc}"


async def _bundle(opts: RunOptions, report: GateReport, name: str, stop: asyncio.Event, progress: Progress) -> None:
    """The first failed step's bundle, in a worker thread so the loop still sees a Ctrl-C (which abandons it)."""
    assert opts.bundle_dir is not None
    progress(f"{name}: first failed step: taking a bundle of the run so far into {opts.bundle_dir}")
    loop = asyncio.get_running_loop()
    outcome = await loop.run_in_executor(None, lambda: take_bundle(opts.bundle_dir, opts.recorder, report.started,  # type: ignore[arg-type]
                                                                     opts.pids, opts.cgroups, cancelled=stop.is_set))  # fmt: skip
    report.bundle = outcome
    if outcome.path is None:
        report.notes.append(f"{name}: {outcome.note}")
        progress(f"{name}: {outcome.note}")
    else:
        progress(f"{name}: bundle {outcome.archive or outcome.path} ({outcome.duration_s:.1f} s)")


def _summary(load: StepLoad) -> str:
    ok = sum(1 for r in load.results if r.ok)
    e2e = [r.e2e_s for r in load.results if r.ok]
    p99 = f", e2e p99 {quantile(e2e, 0.99) * 1e3:.0f} ms" if e2e else ""
    lags = [r.lag_s for r in load.results]
    lag = f", send lag p99 {quantile(lags, 0.99) * 1e3:.1f} ms" if lags else ""
    return f"sent {len(load.results)}, ok {ok}, dropped {load.dropped}{p99}{lag}"


def _neighbour(opts: RunOptions, sampler: HostSampler, run: NeighbourRun, rep: StepReport,
               progress: Progress) -> NeighbourOutcome:  # fmt: skip
    """The negative check judged, with the OOM kills in the service over the hold and the rules' diagnosis of the
    step it ran in (the step's window holds the before and the during: the contrast the rules read)."""
    out = judge_neighbour(run, rep.load, None)
    if out.window is not None and run.target is not None:
        groups = (run.target.path, *opts.cgroups)
        facts, _, _ = _diagnose_window(opts, sampler, out.window[0], out.window[1], groups)
        out = judge_neighbour(run, rep.load, facts.oom_kills)
        out.primary = rep.analysis.primary if rep.analysis else None
        out.diagnosis = rep.diagnosis()
    line = f"neighbour ({out.during}): {out.state}"
    progress(f"{line} ({out.reason})" if out.reason else f"{line} ({out.diagnosis})")
    return out


async def _step(client: Any, spec: GateSpec, opts: RunOptions, step: Step, i: int, stop: asyncio.Event,
                progress: Progress) -> tuple[StepLoad, NeighbourRun | None]:  # fmt: skip
    """The step's load; the neighbour beside it when the spec puts it in this step."""
    nb = spec.neighbour
    if nb is None or nb.during != step.name:
        return await run_step(client, spec, step, i, stop), None
    progress(f"[{i + 1}/{len(spec.steps)}] {step.name}: a {nb.memory_bytes >> 20} MiB neighbour from {nb.start_after_s:g} s "
             f"for {nb.hold_s:g} s")  # fmt: skip
    neighbour = run_neighbour(nb, tuple(opts.pids), tuple(opts.cgroups), stop)
    load, run = await asyncio.gather(run_step(client, spec, step, i, stop), neighbour)
    return load, run


async def _run(spec: GateSpec, opts: RunOptions, sampler: HostSampler, report: GateReport, progress: Progress) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handled: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # a kill stops the load too: the neighbour's group is always removed
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread: no handler
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        async with _client(opts, spec) as client:
            if spec.application is not None:
                app = await _unless_stopped(before_load(client, spec, spec.application, progress), stop)
                if app is None:  # Ctrl-C during the application gate (a readiness deadline can be a minute)
                    report.interrupted = True
                    return
                report.gates["application"] = app
                if app.stopped:
                    report.notes.append(f"application gate: {app.stopped}")
                    return
            for i, step in enumerate(spec.steps):
                progress(f"[{i + 1}/{len(spec.steps)}] {step.name}: {step.describe()}")
                load, nb_run = await _step(client, spec, opts, step, i, stop, progress)
                facts, analysis, why = _diagnose(opts, sampler, load)
                rep = StepReport(step, load, judge(load, step.criteria, facts), facts, analysis, why)
                report.steps.append(rep)
                lags = [r.lag_s for r in load.results]
                if lags and (late := quantile(lags, 0.99)) > LATE_SEND_S:
                    report.notes.append(
                        f"{step.name}: the load generator sent late (send lag p99 {late * 1e3:.0f} ms): this host could not "
                        "keep the schedule, so the step's load was lighter than asked (its latencies still count the lag)"
                    )
                state = "INTERRUPTED" if load.interrupted else ("PASS" if rep.passed else "FAIL")
                progress(f"[{i + 1}/{len(spec.steps)}] {step.name}: {state} ({_summary(load)}; {rep.diagnosis()})")
                if nb_run is not None:
                    report.neighbour = _neighbour(opts, sampler, nb_run, rep, progress)
                    state = "FAIL" if report.neighbour.state == "FAIL" else state
                if state == "FAIL" and report.bundle is None and opts.bundle_dir is not None and not stop.is_set():
                    await _bundle(opts, report, step.name, stop, progress)
                if stop.is_set():
                    report.interrupted = True
                    break
            await _terminate_last(client, spec, opts, report, progress)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        if spec.neighbour is not None and report.neighbour is None:
            report.neighbour = not_run(spec.neighbour, f"the run stopped before step {spec.neighbour.during!r}")


async def _unless_stopped(work: Any, stop: asyncio.Event) -> Any:
    """``await work``, or None as soon as ``stop`` is set (the work is cancelled)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _client(opts: RunOptions, spec: GateSpec) -> HttpClient | HttpxClient:
    if opts.transport is None:
        return make_client(opts.target, spec)
    return HttpxClient(httpx.AsyncClient(base_url=opts.target, transport=opts.transport, timeout=None))


async def _terminate_last(client: Any, spec: GateSpec, opts: RunOptions, report: GateReport, progress: Progress) -> None:
    """graceful_termination, when the spec asks for it: after every step, since it ends the service."""
    probe = spec.application.graceful_termination if spec.application is not None else None
    app = report.gates.get("application")
    if probe is None or app is None:
        return
    if report.interrupted or opts.terminate_pid is None:
        why = "the run was interrupted" if report.interrupted else "no --pid or --unit to signal"
        app.add(Check("graceful_termination", "NOT AVAILABLE", "not run", why))
        return
    pid = opts.terminate_pid
    check = app.add(await graceful_termination(client, spec, probe, pid, report.terminate_start, progress))
    progress(f"application: graceful_termination {check.state} ({check.value})")


def _infrastructure(spec: GateSpec, opts: RunOptions, report: GateReport, progress: Progress) -> None:
    gate = report.gates["infrastructure"] = check_infrastructure(spec.infrastructure, pids=opts.pids, cgroups=opts.cgroups,
                                                                 unit=opts.unit, oomd=opts.oomd)  # fmt: skip
    for c in gate.checks:
        progress(f"infrastructure: {c.name} {c.state} ({c.value})")


def run_gate(spec: GateSpec, opts: RunOptions, progress: Progress = lambda _line: None) -> GateReport:
    """The infrastructure gate, then the application gate and every step of ``spec`` against ``opts.target``
    (graceful termination last); a Ctrl-C ends the run early with what ran.

    A failed infrastructure gate does not stop the run: its checks are read-only facts about the host's
    configuration, the load's figures are still the evidence a reviewer wants beside them, and the exit status
    is 1 either way. A failed readiness check does stop it (diag.gate.app_gate says why)."""
    report = GateReport(spec, opts.target)
    report.notes.extend(opts.notes)
    if opts.terminate_pid is not None:
        report.terminate_start = start_time(opts.terminate_pid)  # the process graceful_termination may signal, by identity
    _infrastructure(spec, opts, report, progress)
    sampler = HostSampler(opts.recorder, pids=opts.pids, cgroups=opts.cgroups, scrape=opts.scrape, interval_s=opts.interval_s)
    sampler.start()
    try:
        if not sampler.sampled_after(0.0, FIRST_SAMPLE_S):
            report.notes.append(f"the host agent took no sample in {FIRST_SAMPLE_S:g} s; host criteria may lack data")
        if sampler.kmsg_error:
            report.notes.append(f"OOM kills cannot be counted: {sampler.kmsg_error}")
        asyncio.run(_run(spec, opts, sampler, report, progress))
    except KeyboardInterrupt:  # Ctrl-C outside the load (before the first step): stop here, report what ran
        report.interrupted = True
    finally:
        sampler.stop()
    return report
