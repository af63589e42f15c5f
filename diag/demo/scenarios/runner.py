"""Run one scenario end to end: groups, agent, demo server, fault, load, cleanup -- then analyse.

Order, and why:
1. the checkpoint is generated *here*, outside every group, then flushed and evicted from the page
   cache (``posix_fadvise DONTNEED``): the service reads it from disk at start, so its page cache is
   charged to the service's group -- as after a deploy -- and a limit below the model really bites;
2. groups are created (each with its limit) before any process exists;
3. the scenario starts the server (inside its group), then the agent (so the recorded window is the
   steady state plus the incident, not the interpreter start-up), injects its fault and drives load;
4. ``finally``, whatever happened (an exception, Ctrl-C, SIGTERM): the agent stops, each server gets
   SIGTERM (its workers flush their records), then every process left in every group is killed by
   PID and the groups are removed; the cleanup is checked and reported;
5. the records are scoped to the scenario (``recording.scenario_records``), built into a Timeline
   and analysed by the same engine ``diag analyze`` uses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.demo.scenarios.cgroups import CgroupUnavailable, ScenarioCgroups, terminate_as_interrupt, unavailable_reason
from diag.demo.scenarios.context import MiB, Progress, ScenarioContext, evict_from_page_cache, stderr_progress
from diag.demo.scenarios.library import SCENARIOS
from diag.demo.scenarios.recording import copy_recorder, scenario_records, write_jsonl_gz
from diag.demo.scenarios.registry import Scenario

__all__ = [
    "MiB", "ScenarioContext", "ScenarioResult", "dialect_view", "evict_from_page_cache", "run_scenario",
    "run_scenario_in_dialects",
]  # fmt: skip


@dataclass
class ScenarioResult:
    name: str
    expected: str
    seed: int
    params: dict[str, Any]
    records: list[dict[str, Any]]
    analysis: Any  # diag.rules.engine.Analysis
    wall_s: float
    cleanup: dict[str, Any]
    notes: dict[str, Any]
    signal_problems: list[str] = field(default_factory=list)  # the fault's signature missing (signals.py)
    signal_summary: str = ""

    @property
    def primary(self) -> str:
        return str(self.analysis.primary)


def run_scenario(
    name: str,
    *,
    seed: int = 0,
    params: dict[str, Any] | None = None,
    weights_dir: str | os.PathLike[str] | None = None,
    keep_recorder: str | os.PathLike[str] | None = None,
    fixture: str | os.PathLike[str] | None = None,
    progress: Progress = stderr_progress,
    dialect: str | None = None,
) -> ScenarioResult:
    """Run scenario ``name`` for real and analyse its recorded window.

    Raises ``CgroupUnavailable`` (before starting anything) when the scenario needs memory cgroups
    that this host cannot give; ``KeyError`` for an unknown name; ``ValueError`` for a bad parameter.
    ``dialect``: serve the engine's /metrics (vllm, tgi, llamacpp) uninstrumented and record them with the
    agent's scrape; None: the scenario's own choice (ours, unless it names one).
    """
    scenario, merged = _checked(name, params, [dialect] if dialect is not None else None)
    run = _record(scenario, seed, merged, (dialect or str(merged.get("dialect", "llmdiag")),), weights_dir, progress)
    try:
        result = _judge(run, scenario.expected, run.records, run.dialects[0], progress)
        if keep_recorder is not None:
            copy_recorder(run.recorder, keep_recorder)
            progress(f"recorder kept at {keep_recorder}")
        if fixture is not None:
            n = write_jsonl_gz(run.records, fixture)
            progress(f"{n} records written to {fixture}")
        return result
    finally:
        shutil.rmtree(run.workdir, ignore_errors=True)


def run_scenario_in_dialects(
    name: str,
    dialects: Sequence[str],
    *,
    seed: int = 0,
    params: dict[str, Any] | None = None,
    weights_dir: str | os.PathLike[str] | None = None,
    progress: Progress = stderr_progress,
    fixture: str | os.PathLike[str] | None = None,
) -> dict[str, ScenarioResult]:
    """Run scenario ``name`` once with the reference backend speaking several engines' dialects at once, and judge
    the run as each engine: one result per dialect, from the records that engine's /metrics would leave.

    The server runs one worker and serves each engine's dialect at /metrics/<dialect> from the same live state; the
    agent scrapes them all. Each engine's view keeps the agent's host, cgroup and process samples and only the
    scrapes of its own /metrics -- what a host running that engine records. One run instead of one per dialect: the
    same load, fault and host for every engine, at a third of the real time.

    ``llmdiag`` first: the tracker instruments the server as well (its recorder, its /metrics), and the run is also
    judged as the instrumented service, on every record but the engines' scrapes -- the scenario suite's run and its
    engines' judgements in one. What the engines' views lose by it is nothing they would have held: the tracker runs
    its admission in an uninstrumented server too; its recorder's writes are the only addition. A scenario with
    several workers cannot run so (an engine's /metrics is one process's state), and is refused. ``fixture``: the
    first view's records written as a replay fixture.
    """
    names = list(dict.fromkeys(dialects))
    engines = [d for d in names if d != "llmdiag"]
    if len(names) != len(dialects) or not engines or "llmdiag" in names[1:]:
        raise ValueError(f"dialects {', '.join(dialects)}: engines' dialects (vllm, tgi, llamacpp), each once, after "
                         "llmdiag (the tracker) or not")  # fmt: skip
    scenario, merged = _checked(name, params, engines)
    if names[0] == "llmdiag" and int(merged.get("workers", 1)) != 1:
        raise ValueError(f"scenario {name} runs {merged['workers']} workers: judged beside engines' dialects it would "
                         "run one (an engine's /metrics is one process's state); run it on its own")  # fmt: skip
    run = _record(scenario, seed, merged, tuple(names), weights_dir, progress)
    try:
        views = {d: dialect_view(run.records, d) for d in names}
        if fixture is not None:
            n = write_jsonl_gz(views[names[0]], fixture)
            progress(f"{n} records written to {fixture}")
        return {d: _judge(run, scenario.expected, views[d], d, progress) for d in names}
    finally:
        shutil.rmtree(run.workdir, ignore_errors=True)


# What the tracker writes from inside the service (requests, batches, routing, loads, the allocator, the settings):
# none of it is on a host that runs an engine uninstrumented, where the agent's samples and scrapes are all there is.
TRACKER_KINDS = frozenset({"request", "batch", "routing", "loader", "torch_memory", "cuda_oom", "config"})


def dialect_view(records: list[dict[str, Any]], dialect: str) -> list[dict[str, Any]]:
    """The records of a run serving several dialects that a host running only ``dialect`` would hold.

    An engine's: every record but the tracker's and the scrapes of other dialects' /metrics/<dialect> paths.
    ``llmdiag`` (the instrumented service): every record but the engines' scrapes at /metrics/<dialect>.
    """
    if dialect == "llmdiag":
        return [r for r in records if r.get("kind") != "backend" or not _scraped_dialect(r)]
    suffix = f"/metrics/{dialect}"
    return [
        r for r in records
        if r.get("kind") not in TRACKER_KINDS and (r.get("kind") != "backend" or str(r.get("target", "")).endswith(suffix))
    ]  # fmt: skip


def _scraped_dialect(record: dict[str, Any]) -> bool:
    from diag.demo.dialects import PINNED  # the engines' dialects the reference backend serves

    target = str(record.get("target", ""))
    return any(target.endswith(f"/metrics/{d}") for d in PINNED)


@dataclass
class _Recorded:
    """One scenario run's recording, before any judgement: its records and what the run noted."""

    name: str
    seed: int
    params: dict[str, Any]
    dialects: tuple[str, ...]
    workdir: Path
    recorder: Path
    records: list[dict[str, Any]]
    cleanup: dict[str, Any]
    notes: dict[str, Any]
    started: float  # time.monotonic() at the start


def _checked(name: str, params: dict[str, Any] | None, dialects: Sequence[str] | None) -> tuple[Scenario, dict[str, Any]]:
    """The scenario and its merged parameters, every refusal made before anything starts."""
    from diag.demo.dialects import DIALECTS

    scenario = SCENARIOS[name]
    # The dialect is refused first: a scenario's own parameter check may look for what its engine needs
    # installed, and a dialect that cannot apply is the user's error to fix whatever is installed.
    for dialect in dialects or ():
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r}: use one of {', '.join(DIALECTS)}")
        scenario.check_dialect(dialect)
    merged = scenario.params(params)
    if scenario.needs_cgroups:
        reason = unavailable_reason()
        if reason:
            raise CgroupUnavailable(f"scenario {name} injects a memory fault and needs real memory cgroups: {reason}")
    return scenario, merged


def _record(
    scenario: Scenario,
    seed: int,
    merged: dict[str, Any],
    dialects: tuple[str, ...],
    weights_dir: str | os.PathLike[str] | None,
    progress: Progress,
) -> _Recorded:
    """Run the scenario for real and clean up after it; the caller removes ``workdir`` once done with the recorder."""
    from diag.demo.weights import default_weights_dir

    name = scenario.name
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"llmdiag-scenario-{name}-"))
    try:
        wdir = Path(weights_dir) if weights_dir is not None else default_weights_dir()
        wdir.mkdir(parents=True, exist_ok=True)
        recorder = workdir / "recorder.db"
        progress(f"scenario {name} (seed {seed}): {scenario.summary}")
        group_paths: list[str] = []
        cleanup: dict[str, Any] = {}
        ctx: ScenarioContext | None = None
        with ScenarioCgroups() as cgroups, terminate_as_interrupt() as guard:
            ctx = ScenarioContext(name, seed, workdir, wdir, recorder, cgroups, progress)
            ctx.dialects = dialects
            try:
                scenario.run(ctx, merged)
            finally:
                with guard.shield():  # a second Ctrl-C or kill waits until everything is removed
                    progress("stopping agent and servers; killing what is left in the groups by PID")
                    cleanup = _cleanup(ctx, cgroups)
                    group_paths = cleanup["groups"]
                    if cleanup["leftover_groups"] or cleanup["server_pids_alive"]:
                        progress(f"WARNING: cleanup incomplete: {cleanup}")
                    else:
                        progress(
                            f"cleanup done: {len(group_paths)} group(s) removed, "
                            f"{len(cleanup['killed_pids'])} leftover process(es) killed"
                        )
        records = scenario_records(recorder, group_paths, ctx.extra_pids)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    notes = dict(ctx.notes)
    notes["records"] = len(records)
    return _Recorded(name, seed, merged, dialects, workdir, recorder, records, cleanup, notes, t0)


def _judge(run: _Recorded, expected: str, records: list[dict[str, Any]], dialect: str, progress: Progress) -> ScenarioResult:
    """The analysis of one view of a run (all its records, or one dialect's), with the fault's signature checked."""
    from diag.demo.scenarios.signals import check_signals
    from diag.rules.engine import analyze
    from diag.timeline import timeline_from_records

    progress(f"analysing the recorded window{f' as {dialect}' if len(run.dialects) > 1 else ''}")
    timeline = timeline_from_records(records, source=f"scenario:{run.name}")
    notes = {**run.notes, "records": len(records)}
    if dialect != "llmdiag" and not len(timeline.requests):
        # Uninstrumented: the checks that read the tracker's request rows cannot look; those that read the
        # engine's own series (kv-saturation's) still do.
        problems, summary = check_signals(run.name, timeline, notes) if run.name == "kv-saturation" else ([], "")
        summary = summary or f"uninstrumented ({dialect} /metrics scraped): no request rows to check"
    else:
        problems, summary = check_signals(run.name, timeline, notes)
    progress(f"signals: {summary}" + (f"; MISSING: {'; '.join(problems)}" if problems else " (as expected)"))
    analysis = analyze(timeline)
    wall = time.monotonic() - run.started
    return ScenarioResult(run.name, expected, run.seed, run.params, records, analysis, wall, run.cleanup, notes,
                          problems, summary)  # fmt: skip


def _cleanup(ctx: ScenarioContext, cgroups: ScenarioCgroups) -> dict[str, Any]:
    """Stop the agent and servers, kill what is left in every group by PID, remove the groups; report what happened."""
    ctx.stop()
    paths = [g.path for g in cgroups.groups]
    dirs = [d for g in cgroups.groups for d in (g.v1_dir, g.v2_dir) if d is not None]
    cgroups.close()
    return {
        "groups": paths,
        "killed_pids": list(cgroups.killed),
        "leftover_groups": list(cgroups.leftovers) + [str(d) for d in dirs if d.exists()],
        "server_pids_alive": [p for p in sorted(ctx.extra_pids) if _alive(p)],
    }


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False
