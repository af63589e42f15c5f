"""What a bundle is asked to collect, and the limits it runs under (one frozen value, no globals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20


@dataclass(frozen=True)
class BundleOptions:
    out_dir: Path = Path(".")  # the bundle folder and archive are created inside it
    since_s: float = 1800.0  # history window read from the flight recorder
    recorder: Path | None = None  # None: $LLMDIAG_RECORDER or the default path
    deadline_s: float = 30.0  # the whole bundle, wall clock
    tar: bool = True
    pids: tuple[int, ...] = ()
    cgroups: tuple[str, ...] = ()
    unit: str | None = None  # systemd unit for the journal excerpt (else derived from the watched cgroup)
    includes: tuple[str, ...] = ()  # extra files to copy (tail-capped, redacted), e.g. a service config
    gpu: bool = True
    nvidia_smi: str = "nvidia-smi"
    proc_root: str = "/proc"
    sys_root: str = "/sys"
    kmsg_path: str = "/dev/kmsg"
    top_n: int = 25
    max_watched_pids: int = 16
    # Size caps (the TAIL is kept): per copied file, per command's stdout, the journal, the history.
    file_cap: int = 4 * MiB
    command_cap: int = 4 * MiB
    journal_cap: int = 8 * MiB
    kmsg_cap: int = 2 * MiB
    history_cap: int = 96 * MiB
    # Per-collector timeouts (seconds), each also bounded by the bundle's deadline.
    volatile_timeout_s: float = 2.0
    snapshot_timeout_s: float = 6.0
    command_timeout_s: float = 10.0
    history_timeout_s: float = 15.0
    argv: tuple[str, ...] = field(default_factory=tuple)  # the command line, for the manifest (redacted there)
