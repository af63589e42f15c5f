"""What a scenario function gets: ``ScenarioContext`` -- helpers that create limited groups, start the
demo server inside them, record with the host agent and drive load, every one of them cleaned up by
the runner.

Why its own module: the scenario library uses the context and the runner uses the library; with the
context in the runner the two imported each other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.demo.harness import DemoServer, start_demo
from diag.demo.scenarios.cgroups import CgroupUnavailable, MemoryGroup, ScenarioCgroups, unavailable_reason
from diag.demo.scenarios.load import LoadReport, Phase, drive
from diag.demo.scenarios.recording import AgentThread

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


def scrape_urls(server_url: str, dialects: Sequence[str]) -> list[str]:
    """What the agent scrapes on one server: nothing for ours alone (the tracker records), the engine's /metrics for
    one engine's dialect, each engine's /metrics/<dialect> for several (ours first or not: the tracker records)."""
    engines = [d for d in dialects if d != "llmdiag"]
    if not engines:
        return []
    if list(dialects) == engines[:1]:
        return [f"{server_url}/metrics"]
    return [f"{server_url}/metrics/{d}" for d in engines]


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
    # The /metrics the servers speak: ours (the tracker, recording request rows) or engines' (vllm, tgi,
    # llamacpp): then the servers run uninstrumented, one worker each, and the agent scrapes their /metrics --
    # with several engines' dialects, each one's /metrics/<dialect> (one run, read as each engine). Ours first and
    # engines' after: the tracker records as usual and the engines' families are scraped beside it, one worker.
    dialects: tuple[str, ...] = ("llmdiag",)

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
        if self.dialects != ("llmdiag",):
            flags += ["--metrics-dialect", ",".join(self.dialects)]
            workers = 1  # an engine's /metrics is one process's state
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
            scrape = [url for s in self.servers for url in scrape_urls(s.url, self.dialects)]
            self.agent = AgentThread(
                self.recorder, cgroups=[g.path for g in self.groups], pids=pids, interval_s=interval_s, scrape=scrape
            )
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
