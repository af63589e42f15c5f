"""What a bundle plugin declares, and what its steps get and give back.

A plugin is one subsystem of the sick machine (host memory and pressure, cgroups, processes, the GPU, the
kernel's OOM lines, the service's journal, the flight-recorder history ...). Like a plugin of sos report, it
*declares* what to collect rather than collecting it: the files it copies (sos: ``add_copy_spec``, a tail kept
under a size cap), the commands it runs (``add_cmd_output``), what it gathers in code where neither fits (a
sampler, NVML, ``/dev/kmsg``, the recorder), when it does not apply and why (``check_enabled``), its deadline
(``plugin_timeout``) and its own redaction (``postproc``). ``runner.py`` executes the declarations; the
plugins themselves live in one table, ``plugins/__init__.py``, in the order they are collected.

Each step of a plugin is one run in manifest.json: its own worker, its own timeout (the plugin's unless the
step says otherwise, always capped by the phase's share of the bundle's deadline), its own status and reason.
Steps return what they found and write nothing: the main thread redacts, writes and hashes, so a step
abandoned at its deadline can never change the bundle afterwards.

Redaction is not a plugin's choice: every file takes every text rule of ``collectors.redact``, every record
every field rule (``redactor.py``). A plugin *adds* masks for what only it knows the shape of -- the journal's
request log lines that carry prompts -- applied to its files before the common rules and counted under their
own name in redaction.json.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from collectors.procfs import under
from diag.bundle.redactor import Mask, Redactor

if TYPE_CHECKING:
    from collectors.records import CgroupSnapshot, ProcessSample
    from diag.bundle.options import BundleOptions


# --------------------------------------------------------------------------- what a step gets and gives back


@dataclass
class OutFile:
    """One file a step wants in the bundle (free text; redacted as text by the main thread)."""

    path: str  # relative to the bundle root, e.g. raw/proc/meminfo
    text: str
    truncated: bool = False
    source: str | None = None  # what it is a copy of (a path or a command)
    source_bytes: int | None = None  # how big the source was, when known


@dataclass
class Output:
    """What a step returns. ``status`` ok | skipped | error; ``reason`` says why when not ok."""

    status: str = "ok"
    reason: str | None = None
    files: list[OutFile] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)  # redacted field by field by the main thread
    return_code: int | None = None
    argv: list[str] | None = None
    timeout_hit: bool = False  # a command killed by its own deadline (partial output kept)
    extra: dict[str, Any] = field(default_factory=dict)  # notes for the manifest (and the history's staged files)


class Cancelled(Exception):
    """Raised inside a step that noticed its cancel flag."""


@dataclass
class Context:
    """What a step gets: its cancel flag and its own deadline (monotonic seconds).

    ``partial``: a step that produces output over time (a command's stdout) sets it to a function returning
    what it has so far. If the step is abandoned at its deadline, the runner keeps that -- a snapshot taken
    then, so nothing the abandoned worker does later can reach the bundle.
    """

    cancel: threading.Event
    deadline: float
    partial: Callable[[], Output] | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled


@dataclass
class State:
    """One bundle's inputs, and what later plugins learn from earlier ones (the snapshot's groups and processes)."""

    options: BundleOptions
    redactor: Redactor
    started: float  # Unix time the bundle started
    since: float  # start of the history window
    staging: Path  # where the history plugin streams its timeline files
    cgroups: list[CgroupSnapshot] = field(default_factory=list)
    processes: list[ProcessSample] = field(default_factory=list)


# --------------------------------------------------------------------------- the declarations


class Phase(enum.IntEnum):
    """When a plugin runs. Every plugin of a phase starts at once; the next phase starts when they are done."""

    VOLATILE = 1  # first: what changes fastest, before any later step perturbs it (nvidia-bug-report's rule)
    AFTER_SNAPSHOT = 2  # what the snapshot decides (the watched groups and processes), commands, history


Check = Callable[[State], "str | None"]  # why the plugin (or step) does not apply here, or None when it does
Seconds = float | str  # a number, or the BundleOptions field holding it (so --deadline-like options reach it)


class FileCopy(NamedTuple):
    """A file to copy, resolved: where it is on this host, where it goes in the bundle."""

    source: str
    dest: str
    optional: bool = False  # absent (ENOENT) is not a problem: not every kernel has it


@dataclass(frozen=True)
class Source:
    """A file named in a declaration: ``path`` under the host's ``/proc`` or ``/sys`` (``--proc-root`` and
    ``--sys-root`` honoured), or absolute when ``root`` is empty."""

    root: str  # "proc" | "sys" | ""
    path: str
    dest: str
    optional: bool = False

    def resolve(self, options: BundleOptions) -> FileCopy:
        base = {"proc": options.proc_root, "sys": options.sys_root}.get(self.root)
        return FileCopy(str(under(base, self.path)) if base else self.path, self.dest, self.optional)


def proc(path: str, optional: bool = False) -> Source:
    """``/proc/<path>`` into ``raw/proc/<path>``."""
    return Source("proc", path, f"raw/proc/{path}", optional)


@dataclass
class Found:
    """What a step's file function resolved on this host: the files to copy, what it could not resolve and why,
    notes for the manifest; or why there is nothing to copy at all (``skipped``)."""

    files: list[FileCopy] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


@dataclass(frozen=True)
class Copy:
    """Files copied verbatim, the tail of each kept under the ``cap`` option (sos: ``add_copy_spec``).

    ``files``: fixed ``Source``s, or a function of the state for what the snapshot decides (the watched
    groups' files). A file that cannot be read is a problem named in the reason, unless its errno is in
    ``not_problems`` (a control file that refuses reads) or it is optional and absent.
    """

    name: str
    description: str
    files: tuple[Source, ...] | Callable[[State], Found]
    cap: str = "file_cap"
    not_problems: frozenset[int] = frozenset()
    timeout: Seconds | None = None


@dataclass(frozen=True)
class Command:
    """A command's stdout into ``dest`` (sos: ``add_cmd_output``): stdin closed, its own process group killed
    at the deadline, what it printed until then kept, the tail under the ``cap`` option.

    ``program`` is looked up on PATH first (absent: skipped with ``missing``, ``{program}`` filled in); then
    ``requires``; then ``args`` builds the rest of the command line from the state.
    """

    name: str
    description: str
    program: str | Callable[[BundleOptions], str]
    args: Callable[[State], Sequence[str]]
    dest: str
    missing: str
    requires: tuple[Check, ...] = ()
    cap: str = "command_cap"
    env: tuple[tuple[str, str], ...] = ()  # set on top of this process's environment
    timeout: Seconds | None = None


@dataclass(frozen=True)
class Gather:
    """Anything else, in code: ``fn(state, ctx)`` returns an ``Output`` (records, files, notes) and writes
    nothing. It should check ``ctx`` between chunks of work so it can stop at its deadline with what it has."""

    name: str
    description: str
    fn: Callable[[State, Context], Output]
    timeout: Seconds | None = None


Step = Copy | Command | Gather


@dataclass(frozen=True)
class Redaction:
    """Every file: every text rule; every record: every field rule (not a plugin's choice). ``masks``: what the
    plugin adds for shapes only it knows."""

    masks: tuple[Mask, ...] = ()


COMMON = Redaction()  # the common rules alone


@dataclass(frozen=True)
class Plugin:
    """One subsystem: its steps (or a function of the options giving them, one per ``--include`` say), when it
    does not apply, its deadline (each step's unless the step says otherwise), its redaction."""

    name: str
    description: str
    phase: Phase
    timeout: Seconds
    redaction: Redaction
    steps: tuple[Step, ...] | Callable[[BundleOptions], tuple[Step, ...]]
    when: tuple[Check, ...] = ()

    def steps_for(self, options: BundleOptions) -> tuple[Step, ...]:
        return self.steps(options) if callable(self.steps) else self.steps


def seconds(value: Seconds, options: BundleOptions) -> float:
    return float(getattr(options, value) if isinstance(value, str) else value)


def enabled_by(option: str, reason: str) -> Check:
    """Applies when the boolean option ``option`` is on (``--gpu``); else skipped with ``reason``."""
    return lambda state: None if getattr(state.options, option) else reason
