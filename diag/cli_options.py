"""Option checks shared by the ``diag`` commands: every value validated before any work starts.

Why a module of its own: each check names the option, the value and the accepted forms in one line, the
same way in every command, and raises ``OptionError`` -- the commands turn that into exit status 2. A
check never touches the system beyond a stat, so a bad command line costs nothing and changes nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from diag.units import parse_duration, parse_size

_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,255}$")
_EXT_RE = re.compile(r"^\.?[A-Za-z0-9_+-]{1,32}$")


class OptionError(ValueError):
    """A command-line value that is malformed, out of range, or cannot apply with the other options."""


def duration(option: str, text: str, *, low: float | None = None, high: float | None = None) -> float:
    """Seconds from ``text``, within [low, high]; the message names the option and the accepted forms."""
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise OptionError(f"{option}: {exc}") from None
    if low is not None and value < low:
        raise OptionError(f"{option} {text}: at least {low:g}s")
    if high is not None and value > high:
        raise OptionError(f"{option} {text}: at most {high:g}s")
    return value


def size(option: str, text: str, *, low: int | None = None) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise OptionError(f"{option}: {exc}") from None
    if low is not None and value < low:
        raise OptionError(f"{option} {text}: at least {low // 1024} KiB")
    return value


def pids(values: Iterable[int] | None) -> tuple[int, ...]:
    out = tuple(values or ())
    for pid in out:
        if pid <= 0:
            raise OptionError(f"--pid {pid}: a process id is a positive number, e.g. --pid $(pgrep -o vllm)")
    return out


def cgroups(values: Iterable[str] | None) -> tuple[str, ...]:
    """Group paths as /proc/<pid>/cgroup prints them: absolute, no ``.``/``..`` parts, no NUL."""
    from collectors.cgroup import clean_cgroup_path

    out = tuple(values or ())
    for path in out:
        if clean_cgroup_path(path) is None:
            raise OptionError(
                f"--cgroup {path!r}: give the group's absolute path as /proc/<pid>/cgroup prints it, "
                "e.g. /system.slice/vllm.service (no '..')"
            )
    return out


def model_extensions(values: Iterable[str] | None) -> tuple[str, ...]:
    out = []
    for ext in values or ():
        if not _EXT_RE.match(ext):
            raise OptionError(f"--model-ext {ext!r}: a file extension such as .gguf or safetensors")
        out.append(ext if ext.startswith(".") else f".{ext}")
    return tuple(out)


def existing_dir(option: str, path: Path) -> Path:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise OptionError(f"{option} {path}: {what}")
    return path


def bundle_path(option: str, path: Path) -> Path:
    """A bundle as ``diag bundle`` leaves it: its folder, or its ``.tar.gz``/``.tar`` (read in place, never extracted)."""
    if path.is_dir():
        return path
    if not path.exists():
        raise OptionError(f"{option} {path}: does not exist")
    if not path.is_file() or not path.name.endswith((".tar.gz", ".tgz", ".tar")):
        raise OptionError(f"{option} {path}: neither a bundle folder nor a .tar.gz/.tar bundle archive")
    return path


def writable_file_path(option: str, path: Path) -> Path:
    """A file path we may create: not a folder, and its nearest existing parent is a folder."""
    if path.is_dir():
        raise OptionError(f"{option} {path}: is a folder; give a file path, e.g. {path / 'recorder.db'}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OptionError(f"{option} {path}: {parent} is not a folder")
    return path


def out_dir(option: str, path: Path) -> Path:
    """An output folder: created when missing (as every archiver does); a file in the way is refused."""
    if path.exists() and not path.is_dir():
        raise OptionError(f"{option} {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptionError(f"{option} {path}: cannot create the folder: {os.strerror(exc.errno or 0) or exc}") from None
    return path


def existing_file(option: str, path: Path) -> Path:
    if not os.path.lexists(path):
        raise OptionError(f"{option} {path}: no such file")
    if path.is_dir():
        raise OptionError(f"{option} {path}: is a folder, not a file")
    if not os.access(path, os.R_OK):
        raise OptionError(f"{option} {path}: not readable by this user (permission denied)")
    return path


def unit_name(text: str | None) -> str | None:
    if text is not None and not _UNIT_RE.match(text):
        raise OptionError(f"--unit {text!r}: a systemd unit name such as vllm.service")
    return text


def http_url(option: str, text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OptionError(f"{option} {text!r}: an http(s) base URL, e.g. http://127.0.0.1:9090")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError:
        raise OptionError(f"{option} {text!r}: the port is not a number from 0 to 65535") from None
    return text


def refuse(given: dict[str, bool], because: str) -> None:
    """Refuse options that cannot apply: ``given`` maps option name -> whether the user gave it."""
    named = [name for name, was_given in given.items() if was_given]
    if named:
        raise OptionError(f"{', '.join(named)} cannot be used {because}")
