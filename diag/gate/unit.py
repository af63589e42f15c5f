"""``diag gate --unit NAME``: a systemd unit's memory settings, its cgroup and main process, read with
``systemctl show``; and systemd-oomd's state (``systemctl is-active systemd-oomd``, ``oomctl``).

Why systemctl and not the unit files: what counts is what systemd applied (drop-ins, ``systemctl set-property``,
defaults of the slice), and ``systemctl show`` prints exactly that. Every command has a deadline and its failure
is said in one line (``UnitError``), never a traceback; the command runner is a parameter so the parsing is
tested on ``systemctl show``'s own text, and the commands themselves on a fake ``systemctl`` first on PATH.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from collectors.cgroup import clean_cgroup_path

PROPERTIES = ("LoadState", "ActiveState", "ControlGroup", "MainPID",
              "MemoryAccounting", "MemoryHigh", "MemoryMax", "MemoryLow", "MemoryMin")  # fmt: skip
COMMAND_S = 10.0  # systemctl answers in milliseconds; one that hangs (a wedged bus) must not hold the gate
UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\@-]{1,255}$")
UNLIMITED = "infinity"


class UnitError(ValueError):
    """The unit could not be read: the message names the unit and the reason, in one line."""


@dataclass(frozen=True)
class Completed:
    """What a command did: its exit status and output (text)."""

    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str]], Completed]


def run_command(argv: Sequence[str]) -> Completed:
    """Run ``argv`` with a deadline; a missing executable or a timeout is raised as ``UnitError``."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise UnitError(f"{argv[0]}: not found on PATH")
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=COMMAND_S, check=False,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise UnitError(f"{' '.join(argv[:2])}: no answer in {COMMAND_S:g} s") from None
    except OSError as exc:
        raise UnitError(f"{argv[0]}: cannot run ({exc.strerror})") from None
    return Completed(done.returncode, done.stdout, done.stderr)


@dataclass(frozen=True)
class UnitInfo:
    """A unit as systemd applied it: every property read, and the cgroup and main PID the gate watches."""

    name: str
    properties: dict[str, str]
    cgroup: str | None
    main_pid: int | None

    def memory(self, key: str) -> int | None:
        """A Memory* property in bytes; None for ``infinity`` (no limit) or a value not read."""
        value = self.properties.get(key, "")
        return int(value) if value.isdigit() else None

    def describe(self) -> str:
        keys = ("ActiveState", "ControlGroup", "MainPID", "MemoryAccounting", "MemoryMax", "MemoryHigh", "MemoryLow", "MemoryMin")
        return " ".join(f"{k}={self.properties[k]}" for k in keys if k in self.properties)


def check_name(name: str) -> str:
    """A unit name as systemctl takes it; refused in one line otherwise (never passed on to a command)."""
    if not UNIT_RE.match(name) or name.startswith("-"):
        raise UnitError(f"--unit {name!r}: not a systemd unit name (letters, digits and :_.\\@-, e.g. vllm.service)")
    return name


def parse_show(text: str) -> dict[str, str]:
    """``Key=Value`` lines as ``systemctl show`` prints them (a value may itself hold '=')."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _first_line(done: Completed) -> str:
    text = (done.stderr or done.stdout).strip()
    return text.splitlines()[0] if text else f"exit status {done.returncode}"


def show_unit(name: str, run: Runner = run_command) -> UnitInfo:
    """The unit's properties; ``UnitError`` when systemctl is missing or fails, or systemd does not know the unit."""
    check_name(name)
    argv = ["systemctl", "show", name, *(f"--property={p}" for p in PROPERTIES)]
    try:
        done = run(argv)
    except UnitError as exc:
        raise UnitError(f"--unit {name}: {exc}") from None
    if done.returncode != 0:
        raise UnitError(f"--unit {name}: systemctl show failed: {_first_line(done)}")
    props = parse_show(done.stdout)
    if props.get("LoadState") == "not-found":
        raise UnitError(f"--unit {name}: systemd has no such unit (LoadState=not-found)")
    if "ControlGroup" not in props and "MainPID" not in props:
        raise UnitError(f"--unit {name}: systemctl show printed neither ControlGroup nor MainPID")
    raw_cg = props.get("ControlGroup", "")
    cgroup = clean_cgroup_path(raw_cg) if raw_cg else None
    if raw_cg and cgroup is None:
        raise UnitError(f"--unit {name}: ControlGroup={raw_cg!r} is not a cgroup path")
    pid_text = props.get("MainPID", "0")
    if not pid_text.isdigit():
        raise UnitError(f"--unit {name}: MainPID={pid_text!r} is not a process id")
    return UnitInfo(name, props, cgroup, int(pid_text) or None)


@dataclass(frozen=True)
class OomdState:
    """systemd-oomd as ``systemctl is-active`` and ``oomctl`` report it; ``why`` says what could not be read."""

    active: str | None  # "active", "inactive", "failed" ... ; None: could not be asked
    oomctl: str | None = None  # oomctl's output where it ran
    why: str = ""

    def monitors(self, cgroup: str | None) -> bool | None:
        """Whether oomctl lists ``cgroup`` (or an ancestor) among the groups it watches; None when unknown."""
        if self.oomctl is None or cgroup is None:
            return None
        paths = re.findall(r"Path:\s*(\S+)", self.oomctl)
        return any(cgroup == p or cgroup.startswith(p.rstrip("/") + "/") for p in paths)


def oomd_state(run: Runner = run_command) -> OomdState:
    """Ask systemd whether systemd-oomd runs, and where it does, what oomctl says it watches."""
    try:
        done = run(["systemctl", "is-active", "systemd-oomd.service"])
    except UnitError as exc:
        return OomdState(None, why=str(exc))
    state = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    if not state or state in ("unknown", "offline") or (done.returncode != 0 and "booted" in done.stderr):
        return OomdState(None, why=f"systemctl is-active: {_first_line(done)}")
    if state != "active":
        return OomdState(state)
    try:
        dump = run(["oomctl"])
    except UnitError as exc:
        return OomdState(state, why=str(exc))
    if dump.returncode != 0:
        return OomdState(state, why=f"oomctl: {_first_line(dump)}")
    return OomdState(state, dump.stdout)
