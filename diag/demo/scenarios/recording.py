"""Record a scenario: the host agent in a thread, writing the same flight recorder the demo's tracker writes.

Why in-process: the agent (``collectors.agent.Agent`` around a ``SnapshotTaker``) is the very code
``diag collect`` runs; a thread saves a second interpreter on a 2-core box, and the scenario runner
decides when sampling starts and stops. The runner process is *outside* every scenario cgroup, as
a collector must be (it would otherwise stall in the reclaim it is measuring).

Scope: a scenario's records are its own world -- the host series, its groups, the processes in its
groups and the OOM kills in its groups. Process samples of unrelated processes and OOM kills in
other cgroups (on a shared CI box: other jobs) are dropped by ``scenario_records`` before analysis
and before a fixture is written, and so are the configurations the agent read off such processes; the
host series stay, because host pressure is what the noisy-neighbour rule compares against.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from collectors.agent import Agent
from collectors.recorder import FlightRecorder
from collectors.recorder_queries import RecorderReader
from collectors.scrape import Scrapers
from collectors.snapshot import SamplerConfig, SnapshotTaker

RETENTION_S = 6 * 3600.0
MAX_RECORDER_BYTES = 256 << 20


class AgentThread:
    """``Agent`` sampling every ``interval_s`` in a daemon thread until ``stop()``."""

    def __init__(
        self,
        recorder_path: str | Path,
        *,
        cgroups: Sequence[str] = (),
        pids: Sequence[int] = (),
        interval_s: float = 1.0,
        kmsg: bool = True,
        top_n: int = 10,
        scrape: Sequence[str] = (),
    ) -> None:
        """``scrape``: backends' /metrics URLs the agent scrapes too (``diag collect --scrape``), at ``interval_s``."""
        config = SamplerConfig(
            pids=tuple(pids),
            cgroups=tuple(cgroups),
            top_n=top_n,
            kmsg_path="/dev/kmsg" if kmsg else None,
            gpu=True,  # no GPU here: the sampler records "unavailable", which the GPU rules need to say so
        )
        self.recorder = FlightRecorder(recorder_path, retention_s=RETENTION_S, max_size_bytes=MAX_RECORDER_BYTES)
        scrapers = None
        if scrape:
            scrapers = Scrapers(interval_s)
            scrapers.set_targets(scrape)
        self.agent = Agent(SnapshotTaker(config), interval_s=interval_s, recorder=self.recorder, scrapers=scrapers)
        self._thread = threading.Thread(target=self.agent.run, name="scenario-agent", daemon=True)

    @property
    def samples(self) -> int:
        return self.agent.samples

    def start(self) -> AgentThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.agent.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.agent.close()  # closes the recorder and the samplers (kmsg fd, NVML)


def _in_scope(path: str | None, groups: Sequence[str]) -> bool:
    return bool(path) and any(path == g or str(path).startswith(g.rstrip("/") + "/") for g in groups)


def scenario_records(recorder_path: str | Path, groups: Sequence[str], pids: Iterable[int] = ()) -> list[dict[str, Any]]:
    """Every record of the recorder, scoped to the scenario (see the module doc), oldest first."""
    keep_pids = set(pids)
    out: list[dict[str, Any]] = []
    FlightRecorder(recorder_path, readonly=True).close()  # a clear error when it is not a flight recorder
    with RecorderReader.open(recorder_path) as reader:
        for _ts, kind, body in reader.rows():
            try:
                obj = json.loads(body)
            except ValueError:
                continue
            if kind == "process" and not (_in_scope(obj.get("memory_cgroup"), groups) or obj.get("pid") in keep_pids):
                continue
            if kind == "oom" and not (_in_scope(obj.get("oom_memcg"), groups) or _in_scope(obj.get("task_memcg"), groups)):
                continue
            if kind == "cgroup" and not _in_scope(obj.get("path"), groups):
                continue
            if kind == "watch_scope":
                # The harness's agent watches the neighbour's group too, to record it as evidence: that is the
                # harness's scope, not an operator naming the service, and would make the neighbour the service.
                continue
            if kind == "process":
                keep_pids.add(obj.get("pid"))
            out.append(obj)
    # An engine's configuration (read by the agent from any engine process it sees on the host) belongs to the
    # scenario only when that process does: another job's llama.cpp server would otherwise add its KV cache to
    # the scenario's limit arithmetic.
    out = [o for o in out if o.get("kind") != "config" or o.get("pid") is None or o.get("pid") in keep_pids]
    out.sort(key=lambda o: float(o.get("ts") or 0.0))
    return out


def copy_recorder(src: str | Path, dst: str | Path) -> None:
    """A consistent copy of a flight recorder (SQLite's backup API: the WAL's contents are included)."""
    with RecorderReader.open(src) as reader:
        reader.backup(dst)


def write_jsonl_gz(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """One JSON record per line, gzip-compressed (the fixture format). Returns the number of records."""
    n = 0
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as fh:
        for obj in records:
            fh.write(json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n")
            n += 1
    return n


def read_jsonl_gz(path: str | Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
