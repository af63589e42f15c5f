"""One full sample of the host: host memory/PSI, watched cgroups, processes, GPU, new kernel OOMs.

``SnapshotTaker`` owns the samplers so that their state (NVML handle, /dev/kmsg position, the
process sampler's model-file cache) lives as long as the agent does; ``take()`` never raises --
each sampler degrades to "missing"/"unavailable" on its own, and a sampler that crashes outright is
reported in ``Snapshot.errors`` while the others still deliver.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from collectors.cgroup import CgroupSampler, clean_cgroup_path
from collectors.engine_config import EngineConfigs
from collectors.gpu import GpuSampler
from collectors.host import HostSampler
from collectors.kmsg import KmsgOomWatcher
from collectors.processes import DEFAULT_MODEL_EXTENSIONS, ProcessSampler, model_process_counts
from collectors.procfs import under
from collectors.records import (
    CgroupSnapshot,
    GpuSnapshot,
    HostSnapshot,
    OomEvent,
    ProcessSample,
    Record,
    ServiceConfig,
    WatchScope,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerConfig:
    """Where to read and what to watch. Roots are configurable so a container can read the host's /proc."""

    proc_root: str = "/proc"
    sys_root: str = "/sys"
    pids: tuple[int, ...] = ()
    cgroups: tuple[str, ...] = ()
    top_n: int = 10
    model_extensions: tuple[str, ...] = DEFAULT_MODEL_EXTENSIONS
    extra_model_paths: tuple[str, ...] = ()
    kmsg_path: str | None = "/dev/kmsg"  # None: do not watch kernel OOM lines
    gpu: bool = True


@dataclass
class Snapshot:
    ts: float
    host: HostSnapshot
    cgroups: list[CgroupSnapshot]
    processes: list[ProcessSample]
    gpu: GpuSnapshot
    ooms: list[OomEvent] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # sampler -> why it produced nothing
    duration_s: float = 0.0
    scope: WatchScope | None = None  # what --pid/--cgroup asked for and what exists now (None: nothing asked)
    configs: list[ServiceConfig] = field(default_factory=list)  # engines' settings read from outside, once per process

    def records(self) -> list[Record]:
        """Everything worth storing, in one list (what the agent writes to the flight recorder)."""
        return [self.host, *self.cgroups, *self.processes, self.gpu, *self.ooms, *self.configs]

    def model_processes(self) -> dict[str, int]:
        return model_process_counts(self.processes)


class SnapshotTaker:
    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config = config or SamplerConfig()
        self.host = HostSampler(config.proc_root)
        self.processes = ProcessSampler(
            config.proc_root,
            top_n=config.top_n,
            model_extensions=config.model_extensions,
            extra_model_paths=config.extra_model_paths,
            watch_pids=config.pids,
        )
        self.gpu = GpuSampler() if config.gpu else None
        self.kmsg = KmsgOomWatcher(config.kmsg_path) if config.kmsg_path else None
        self._explicit_cgroups = bool(config.pids or config.cgroups)
        self._holders: tuple[int, ...] = ()
        self.cgroups = CgroupSampler(config.proc_root, config.sys_root, pids=config.pids, cgroups=config.cgroups)
        self.engines = EngineConfigs()

    def take(self) -> Snapshot:
        started = time.perf_counter()
        now = time.time()
        errors: dict[str, str] = {}
        host = _guard("host", errors, lambda: self.host.sample(now), lambda: HostSnapshot(ts=now))
        processes = _guard("processes", errors, lambda: self.processes.sample(now), list)
        cgroups = _guard("cgroup", errors, lambda: self._sample_cgroups(now, processes), list)
        if self.gpu is not None:
            gpu = _guard("gpu", errors, lambda: self.gpu.sample(now), lambda: GpuSnapshot(ts=now, reason="sampler failed"))
        else:
            gpu = GpuSnapshot(ts=now, available=False, reason="disabled (--no-gpu)")
        ooms = _guard("kmsg", errors, self.kmsg.poll, list) if self.kmsg is not None else []
        if self.kmsg is not None and self.kmsg.error:
            errors.setdefault("kmsg", self.kmsg.error)
        scope = _guard("scope", errors, lambda: self._scope(now, cgroups), lambda: None) if self._explicit_cgroups else None
        configs = _guard("engine_config", errors, lambda: self.engines.observe(now, processes), list)
        return Snapshot(now, host, cgroups, processes, gpu, ooms, errors, time.perf_counter() - started, scope, configs)

    def _scope(self, now: float, cgroups: Sequence[CgroupSnapshot]) -> WatchScope:
        """Which asked-for pids and groups exist now, and for each missing one why and where it was sought.

        Resolved on every sample (a service may start after the agent, or restart into a new group).
        """
        proc_root = self.config.proc_root
        missing: list[str] = []
        resolved_pids: list[int] = []
        for pid in self.config.pids:
            if pid > 0 and under(proc_root, str(pid)).is_dir():
                resolved_pids.append(pid)
            else:
                missing.append(f"pid {pid}: no such process (looked in {proc_root})")
        found = {c.path for c in cgroups if c.version != "none"}
        by_path = {c.path: c for c in cgroups}
        for raw in self.config.cgroups:
            path = clean_cgroup_path(raw) or raw
            snap = by_path.get(path)
            if snap is None or snap.version == "none":
                reason = snap.missing.get("group", "not found") if snap is not None else "not found"
                missing.append(f"cgroup {raw}: {reason}")
        for pid, reason in sorted(self.cgroups.unresolved.items()):
            if pid in resolved_pids:
                missing.append(f"pid {pid}: its memory cgroup could not be resolved ({reason})")
        return WatchScope(
            ts=now, pids=list(self.config.pids), cgroups=list(self.config.cgroups), resolved_pids=resolved_pids,
            resolved_cgroups=sorted(found), missing=missing,
        )  # fmt: skip

    def _sample_cgroups(self, now: float, processes: Sequence[ProcessSample]) -> list[CgroupSnapshot]:
        """Watch what the user named; otherwise the groups of the processes that hold a model file.

        Why that default: on a host the operator did not describe, the model holders *are* the
        inference service, and their groups carry the limit that decides who gets OOM-killed.
        """
        if not self._explicit_cgroups:
            holders = tuple(sorted({p.pid for p in processes if p.model_files}))
            if holders != self._holders:
                self._holders = holders
                self.cgroups = CgroupSampler(self.config.proc_root, self.config.sys_root, pids=holders)
            if not holders:
                return []
        return self.cgroups.sample(now)

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
        if self.kmsg is not None:
            self.kmsg.close()


def _guard(name, errors, fn, fallback):  # type: ignore[no-untyped-def]
    """Run one sampler; a crash becomes an entry in ``errors`` and an empty result, never an exception."""
    try:
        return fn()
    except Exception as exc:  # samplers promise not to raise; this is the belt to their braces
        log.exception("sampler %s failed", name)
        errors[name] = f"{type(exc).__name__}: {exc}"
        return fallback()
