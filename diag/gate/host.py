"""The host's side of a gate run: the agent sampling into a flight recorder while the load runs, and what a
step's window of it says (memory PSI, OOM kills).

Why the agent itself and not a few reads of /proc: the rules engine judges each step from the same records
``diag collect`` writes (host and cgroup PSI, processes, kernel OOM lines, the backend's own /metrics when it
serves them), so a FAIL carries the same diagnosis an on-call engineer would get from ``diag analyze``. It runs
in a thread of the gate (one interpreter less on a small host), outside the service's cgroup.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from collectors.agent import Agent
from collectors.recorder import FlightRecorder
from collectors.scrape import Scrapers
from collectors.snapshot import SamplerConfig, Snapshot, SnapshotTaker
from diag.gate.criteria import HostFacts
from diag.timeline import Timeline

RETENTION_S = 24 * 3600.0
MAX_RECORDER_BYTES = 256 << 20
PSI_KEY = "psi.memory.some.avg10"


class HostSampler:
    """``collectors.agent.Agent`` sampling every ``interval_s`` in a daemon thread until ``stop()``."""

    def __init__(self, recorder_path: str | Path, *, pids: Sequence[int] = (), cgroups: Sequence[str] = (),
                 scrape: Sequence[str] = (), interval_s: float = 1.0) -> None:  # fmt: skip
        kmsg = "/dev/kmsg" if os.access("/dev/kmsg", os.R_OK) else None
        self.kmsg_error: str | None = None if kmsg else "/dev/kmsg is not readable by this user (run as root to count OOM kills)"
        config = SamplerConfig(pids=tuple(pids), cgroups=tuple(cgroups), kmsg_path=kmsg, gpu=True)
        self.recorder = FlightRecorder(recorder_path, retention_s=RETENTION_S, max_size_bytes=MAX_RECORDER_BYTES)
        scrapers = None
        if scrape:
            scrapers = Scrapers(interval_s)
            scrapers.set_targets(scrape)
        self.interval_s = interval_s
        self.cgroups = tuple(cgroups)
        self.pids = tuple(pids)
        self._seen = threading.Condition()
        self.agent = Agent(SnapshotTaker(config), interval_s=interval_s, recorder=self.recorder, scrapers=scrapers,
                           on_sample=self._sampled)  # fmt: skip
        self._thread = threading.Thread(target=self.agent.run, name="gate-agent", daemon=True)
        self.last_sample_ts = 0.0

    def _sampled(self, snapshot: Snapshot) -> None:
        if snapshot.errors.get("kmsg") and self.kmsg_error is None:
            self.kmsg_error = f"kernel log: {snapshot.errors['kmsg']}"
        with self._seen:
            self.last_sample_ts = snapshot.ts
            self._seen.notify_all()

    def start(self) -> HostSampler:
        self._thread.start()
        return self

    def sampled_after(self, ts: float, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until a sample taken after wall time ``ts`` is recorded."""
        deadline = time.monotonic() + timeout_s
        with self._seen:
            while self.last_sample_ts <= ts:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._seen.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        self.agent.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.agent.close()  # the recorder, the samplers (kmsg fd, NVML) and the scrapers


def _in(path: str | None, groups: Sequence[str]) -> bool:
    return bool(path) and any(path == g or str(path).startswith(g.rstrip("/") + "/") for g in groups)


def host_facts(tl: Timeline, start: float, end: float, *, cgroups: Sequence[str] = (), pids: Sequence[int] = (),
               kmsg_error: str | None = None) -> HostFacts:  # fmt: skip
    """Memory PSI (the watched cgroup's when there is one, else the host's) and the OOM kills in [start, end].

    OOM kills count for the service only when it was named: a kill inside a watched cgroup, or of a watched
    pid; with neither named, every OOM kill on the host counts (a gate run owns the host it tests on)."""
    psi_scope, series = "host", tl.host.get(PSI_KEY)
    for path in cgroups:
        s = tl.cgroups.get(path, {}).get(PSI_KEY)
        if s is not None and len(s.window(start, end).valid()):
            psi_scope, series = path, s
            break
    psi = None
    if series is not None:
        w = series.window(start, end).valid()
        psi = float(np.max(w.values)) if len(w) else None
    if kmsg_error:
        return HostFacts(psi, psi_scope, None, oom_unreadable_why=kmsg_error)
    kills = [o for o in tl.ooms if start <= o.ts <= end]
    if cgroups or pids:
        kills = [o for o in kills if _in(o.oom_memcg, cgroups) or _in(o.task_memcg, cgroups) or o.pid in set(pids)]
    detail = "; ".join(f"{o.task or '?'} (pid {o.pid}) in {o.task_memcg or o.oom_memcg or '?'}" for o in kills[:3])
    return HostFacts(psi, psi_scope, len(kills), detail)
