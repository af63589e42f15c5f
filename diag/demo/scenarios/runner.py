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

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.demo.harness import DemoServer, start_demo
from diag.demo.scenarios.cgroups import (
    CgroupUnavailable,
    MemoryGroup,
    ScenarioCgroups,
    terminate_as_interrupt,
    unavailable_reason,
)
from diag.demo.scenarios.load import LoadReport, Phase, drive
from diag.demo.scenarios.recording import AgentThread, copy_recorder, scenario_records, write_jsonl_gz

MiB = 1 << 20
Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def evict_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Write back and drop a file's cached pages, so the next reader's group is charged for them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class ScenarioContext:
    """What a scenario function gets: helpers that create groups, start servers and drive load, all cleaned up."""

    name: str
    seed: int
    workdir: Path
    weights_dir: Path
    recorder: Path
    cgroups: ScenarioCgroups
    progress: Progress
    servers: list[DemoServer] = field(default_factory=list)
    agent: AgentThread | None = None
    loads: list[LoadReport] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    extra_pids: set[int] = field(default_factory=set)

    @property
    def groups(self) -> list[MemoryGroup]:
        return self.cgroups.groups

    def group(self, role: str, limit_bytes: int, *, required: bool = True) -> MemoryGroup | None:
        """A limited child memory cgroup, or None when cgroups are unavailable and ``required`` is False."""
        reason = unavailable_reason()
        if reason:
            if required:
                raise CgroupUnavailable(reason)
            self.progress(f"no memory cgroup for the {role} ({reason}); running it unconfined")
            return None
        group = self.cgroups.create(role, limit_bytes)
        v2 = f", PSI from cgroup2 {group.v2_dir}" if group.v2_dir else ""
        self.progress(f"cgroup {group.path} ({role}): limit {limit_bytes / MiB:.0f} MiB{v2}")
        return group

    def weights(self, weights_mb: float, *, experts: int = 0, top_k: int = 2) -> Path:
        """Generate the checkpoint outside every group (cached by config) and evict it from the page cache."""
        from diag.demo.weights import ModelConfig, ensure_weights

        config = ModelConfig.for_budget(weights_mb, experts=experts, top_k=top_k)
        path = ensure_weights(self.weights_dir, config)
        evict_from_page_cache(path)
        return path

    def serve(
        self,
        args: Sequence[str] = (),
        *,
        group: MemoryGroup | None,
        workers: int = 1,
        weights_mb: float = 64,
        experts: int = 0,
        top_k: int = 2,
        env: dict[str, str] | None = None,
        ready_timeout: float = 90.0,
    ) -> DemoServer:
        """Start ``diag demo serve`` inside ``group`` with the scenario's recorder; wait until every worker is ready."""
        path = self.weights(weights_mb, experts=experts, top_k=top_k)
        self.notes["weights_bytes"] = path.stat().st_size
        self.notes["workers"] = workers
        flags = list(args)
        if experts:
            flags += ["--experts", str(experts), "--top-k", str(top_k)]
        # glibc hands freed buffers of >= 128 KiB back to the kernel at once with a fixed mmap threshold
        # (its default threshold adapts upwards and keeps them in the heap): per-request memory then goes
        # away when the request does, as with a caching allocator that releases -- peaks are peaks.
        env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), **(env or {})}
        where = f"in {group.path}" if group is not None else "unconfined"
        self.progress(f"starting demo server ({workers} worker(s), {weights_mb:g} MiB weights) {where}: {' '.join(flags)}")
        t0 = time.monotonic()
        server = start_demo(
            flags,
            workers=workers,
            weights_mb=weights_mb,
            weights_dir=self.weights_dir,
            log_dir=self.workdir,
            recorder=self.recorder,
            env=env,
            ready_timeout=ready_timeout,
            cgroup=group,
        )
        self.servers.append(server)
        self.extra_pids.update([server.pid, *server.worker_pids])
        self.progress(f"server ready in {time.monotonic() - t0:.1f} s at {server.url} (workers {server.worker_pids})")
        return server

    def record(self, *, interval_s: float = 1.0) -> AgentThread:
        """Start the host agent watching every group created so far (and the servers' PIDs)."""
        if self.agent is None:
            pids = sorted(self.extra_pids)
            self.agent = AgentThread(self.recorder, cgroups=[g.path for g in self.groups], pids=pids, interval_s=interval_s)
            self.agent.start()
            self.progress(f"agent recording every {interval_s:g} s to {self.recorder}")
        return self.agent

    def load(
        self, server: DemoServer, phases: Sequence[Phase], *, max_requests: int = 4000, request_timeout_s: float = 30.0
    ) -> LoadReport:
        report = drive(
            server.url,
            phases,
            seed=self.seed,
            max_requests=max_requests,
            request_timeout_s=request_timeout_s,
            progress=self.progress,
        )
        self.loads.append(report)
        return report

    def pause(self, seconds: float, why: str) -> None:
        self.progress(f"{why}: {seconds:g} s")
        time.sleep(seconds)

    def stop(self) -> None:
        """Agent first (nothing more to sample), then the servers gracefully (their workers flush records)."""
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.stop()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop(timeout=15.0)


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
) -> ScenarioResult:
    """Run scenario ``name`` for real and analyse its recorded window.

    Raises ``CgroupUnavailable`` (before starting anything) when the scenario needs memory cgroups
    that this host cannot give; ``KeyError`` for an unknown name; ``ValueError`` for a bad parameter.
    """
    from diag.demo.scenarios.library import SCENARIOS
    from diag.demo.scenarios.signals import check_signals
    from diag.demo.weights import default_weights_dir
    from diag.rules.engine import analyze
    from diag.timeline import timeline_from_records

    scenario = SCENARIOS[name]
    merged = scenario.params(params)
    if scenario.needs_cgroups:
        reason = unavailable_reason()
        if reason:
            raise CgroupUnavailable(f"scenario {name} injects a memory fault and needs real memory cgroups: {reason}")
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"llmdiag-scenario-{name}-"))
    wdir = Path(weights_dir) if weights_dir is not None else default_weights_dir()
    wdir.mkdir(parents=True, exist_ok=True)
    recorder = workdir / "recorder.db"
    progress(f"scenario {name} (seed {seed}): {scenario.summary}")
    group_paths: list[str] = []
    cleanup: dict[str, Any] = {}
    ctx: ScenarioContext | None = None
    try:
        with ScenarioCgroups() as cgroups, terminate_as_interrupt() as guard:
            ctx = ScenarioContext(name, seed, workdir, wdir, recorder, cgroups, progress)
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
        progress("analysing the recorded window")
        records = scenario_records(recorder, group_paths, ctx.extra_pids if ctx else ())
        timeline = timeline_from_records(records, source=f"scenario:{name}")
        notes = dict(ctx.notes) if ctx else {}
        notes["records"] = len(records)
        problems, summary = check_signals(name, timeline, notes)
        progress(f"signals: {summary}" + (f"; MISSING: {'; '.join(problems)}" if problems else " (as expected)"))
        analysis = analyze(timeline)
        if keep_recorder is not None:
            copy_recorder(recorder, keep_recorder)
            progress(f"recorder kept at {keep_recorder}")
        if fixture is not None:
            n = write_jsonl_gz(records, fixture)
            progress(f"{n} records written to {fixture}")
        wall = time.monotonic() - t0
        return ScenarioResult(name, scenario.expected, seed, merged, records, analysis, wall, cleanup, notes, problems, summary)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
