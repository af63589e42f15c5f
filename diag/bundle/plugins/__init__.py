"""Every plugin of ``diag bundle``, in the order they are collected: a new plugin is one declaration here.

Read top to bottom, this is what a bundle holds. The volatile phase comes first -- PSI, meminfo and vmstat
change fastest and every later step perturbs them a little -- together with the sampler's snapshot, whose
watched groups and model holders decide what the second phase reads. Each step is one run in manifest.json
(its name below), in its own abandonable worker, under its timeout and the phase's share of the deadline
(``core.py``). The vocabulary is ``diag/bundle/plugin.py``; the code that executes it, ``runner.py``; the
subsystem modules beside this file hold what a plugin gathers in code.

What is deliberately *not* collected, by any plugin: process environments (``/proc/<pid>/environ``: secrets
live there), raw command lines (the snapshot's samples carry the redacted argv), prompt or completion text
(the tracker records token counts; the journal's request-log text is masked), core dumps, whole logs.
"""

from __future__ import annotations

import os

from diag.bundle.options import BundleOptions
from diag.bundle.plugin import COMMON, Command, Copy, Gather, Phase, Plugin, Redaction, Source, Step, enabled_by, proc
from diag.bundle.plugins import backends, cgroups, gpu, history, journal, kernel, processes, snapshot

VOLATILE, AFTER_SNAPSHOT = Phase.VOLATILE, Phase.AFTER_SNAPSHOT


def _includes(o: BundleOptions) -> tuple[Step, ...]:
    """One step per ``--include``, so an unreadable (or hung) one costs only itself."""
    return tuple(
        Copy(f"include.{i}", f"copy of {path} (--include)",
             (Source("", path, f"raw/include/{i}-{os.path.basename(path.rstrip('/')) or 'file'}"),))
        for i, path in enumerate(o.includes, 1)
    )  # fmt: skip


PLUGINS: tuple[Plugin, ...] = (
    Plugin(
        "host",
        "host memory and pressure, verbatim",
        VOLATILE,
        timeout="volatile_timeout_s",
        redaction=COMMON,
        steps=(
            Copy(
                "proc.pressure",
                "host PSI (/proc/pressure/*)",
                (proc("pressure/cpu"), proc("pressure/memory"), proc("pressure/io"), proc("pressure/irq", optional=True)),
            ),
            Copy("proc.meminfo", "host memory (/proc/meminfo)", (proc("meminfo"),)),
            Copy("proc.vmstat", "host VM counters (/proc/vmstat)", (proc("vmstat"),)),
            Copy("proc.loadavg", "load average (/proc/loadavg)", (proc("loadavg"),)),
        ),
    ),
    Plugin(
        "snapshot",
        "the sampler's records now",
        VOLATILE,
        timeout="snapshot_timeout_s",
        redaction=COMMON,
        steps=(Gather("snapshot", "host, watched cgroups and process table now (SnapshotTaker)", snapshot.take_snapshot),),
    ),
    Plugin(
        "cgroups",
        "the watched groups' own files",
        AFTER_SNAPSHOT,
        timeout=5.0,
        redaction=COMMON,
        steps=(
            Copy(
                "cgroup.files",
                "watched cgroups: memory.* (v1/v2) and the v2 twin's memory.pressure",
                cgroups.group_files,
                not_problems=cgroups.REFUSED,
            ),
        ),
    ),
    Plugin(
        "processes",
        "the watched processes' /proc files",
        AFTER_SNAPSHOT,
        timeout=5.0,
        redaction=COMMON,
        steps=(
            Copy(
                "process.files",
                "watched processes' /proc/<pid> status, cgroup, OOM score, smaps_rollup, limits",
                processes.pid_files,
            ),
        ),
    ),
    Plugin(
        "gpu",
        "NVIDIA GPUs: NVML and nvidia-smi",
        AFTER_SNAPSHOT,
        timeout="command_timeout_s",
        redaction=COMMON,
        when=(enabled_by("gpu", "disabled (--no-gpu)"),),
        steps=(
            Gather("gpu", "GPU state through NVML (GpuSnapshot)", gpu.sample_nvml),
            Command(
                "nvidia-smi",
                "nvidia-smi -q (full GPU query), killed at its timeout",
                lambda o: o.nvidia_smi,
                lambda state: ["-q"],
                "raw/nvidia-smi-q.txt",
                missing="{program} not on PATH (no NVIDIA driver tools on this host)",
            ),
        ),
    ),
    Plugin(
        "kernel",
        "the kernel's OOM kills",
        AFTER_SNAPSHOT,
        timeout=5.0,
        redaction=COMMON,
        steps=(
            Gather("kmsg", "kernel OOM lines from the ring buffer (/dev/kmsg, non-blocking), redacted", kernel.read_oom_lines),
        ),
    ),
    Plugin(
        "journal",
        "the service unit's log",
        AFTER_SNAPSHOT,
        timeout="command_timeout_s",
        redaction=Redaction(masks=journal.PROMPT_MASKS),
        steps=(
            Command(
                "journal",
                "the service unit's journal excerpt (journalctl -u UNIT --since)",
                "journalctl",
                journal.journal_args,
                "raw/journal.txt",
                cap="journal_cap",
                missing="journalctl not found: no systemd journal on this host",
                requires=(journal.no_journal, journal.no_unit),
                env=(("SYSTEMD_PAGER", ""), ("PAGER", "cat")),
            ),
        ),
    ),
    Plugin(
        "history",
        "the flight recorder's window",
        AFTER_SNAPSHOT,
        timeout="history_timeout_s",
        redaction=COMMON,
        steps=(Gather("history", "flight recorder history (--since), as timeline/*.jsonl", history.read_history),),
    ),
    Plugin(
        "backends",
        "the scraped inference backends' own /metrics",
        AFTER_SNAPSHOT,
        timeout=10.0,
        redaction=COMMON,
        steps=(
            Gather(
                "backends",
                "one raw /metrics exposition of each backend the agent scraped (diag collect --scrape)",
                backends.expositions,
            ),
        ),
    ),
    Plugin("include", "files named with --include", AFTER_SNAPSHOT, timeout=5.0, redaction=COMMON, steps=_includes),
)
