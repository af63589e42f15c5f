"""Option checks shared by the ``diag`` commands: every value validated before any work starts.

Why a module of its own: each check names the option, the value and the accepted forms in one line, the
same way in every command, and raises ``OptionError`` -- the commands turn that into exit status 2. A
check never touches the system beyond a stat, so a bad command line costs nothing and changes nothing.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from diag.units import NotPositive, format_duration, format_size, parse_duration, parse_size

_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,255}$")
_EXT_RE = re.compile(r"^\.?[A-Za-z0-9_+-]{1,32}$")


class OptionError(ValueError):
    """A command-line value that is malformed, out of range, or cannot apply with the other options."""


def listing(values: Sequence[str]) -> str:
    """``a, b or c``: how every message lists the values it suggests (tests read them back from it)."""
    values = list(values)
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


# Durations suggested when a call site names none; each message keeps only those within the option's range.
_DURATION_LADDER = ("500ms", "1s", "5s", "30s", "5m", "30m", "2h", "1d", "7d")


def _suggest(examples: Sequence[str] | None, parse: Callable[[str], float], low: float | None, high: float | None) -> str:
    """``; use e.g. a, b or c`` with only the examples the option accepts (none: an empty string)."""
    fitting = [e for e in (examples if examples is not None else _DURATION_LADDER) if _within(parse(e), low, high)]
    if examples is None:
        fitting = fitting[:3]
    return f"; use e.g. {listing(fitting)}" if fitting else ""


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def duration(
    option: str, text: str, *, low: float | None = None, high: float | None = None, examples: Sequence[str] | None = None
) -> float:
    """Seconds from ``text``, within [low, high]. The message names the option and the value, states the bound
    in the units people type (``at most 1h``) and suggests only ``examples`` within the range."""
    hint = _suggest(examples, parse_duration, low, high)
    try:
        value = parse_duration(text)
    except NotPositive:
        raise OptionError(f"{option} {text}: must be positive{hint}") from None
    except ValueError:
        raise OptionError(f"{option}: {text!r} is not a duration (a number with ms, s, m, h or d){hint}") from None
    if low is not None and value < low:
        raise OptionError(f"{option} {text}: at least {format_duration(low)}{hint}")
    if high is not None and value > high:
        raise OptionError(f"{option} {text}: at most {format_duration(high)}{hint}")
    return value


def size(option: str, text: str, *, low: int | None = None, examples: Sequence[str] = ("256MiB", "1GiB")) -> int:
    """Bytes from ``text`` (K/M/G/T are powers of 1024), at least ``low``; suggests only accepted ``examples``."""
    hint = _suggest(examples, parse_size, low, None)
    try:
        value = parse_size(text)
    except NotPositive:
        raise OptionError(f"{option} {text}: must be positive{hint}") from None
    except ValueError:
        raise OptionError(
            f"{option}: {text!r} is not a size (bytes, or a number with K, M, G or T: powers of 1024){hint}"
        ) from None
    if low is not None and value < low:
        raise OptionError(f"{option} {text}: at least {format_size(low)}{hint}")
    return value


def choice(option: str, value: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (as typed, or in another case): the message lists them all."""
    for accepted in choices:
        if value == accepted or value.lower() == accepted.lower():
            return accepted
    raise OptionError(f"{option} {value!r}: use one of {listing(choices)}")


def number(
    option: str, value: float, *, low: float | None = None, high: float | None = None, meaning: str = "",
    examples: Sequence[str] = (),
) -> float:  # fmt: skip
    """A number within [low, high]; ``meaning`` says what it is (``a fraction of memory; 0 = off``)."""
    if _within(value, low, high):
        return value
    if low is not None and high is not None:
        where = f"from {low:g} to {high:g}"
    else:
        where = f"at least {low:g}" if low is not None else f"at most {high:g}"
    said = f" ({meaning})" if meaning else ""
    hint = f"; use e.g. {listing(examples)}" if examples else ""
    raise OptionError(f"{option} {value:g}: {where}{said}{hint}")


def port(option: str, value: int) -> int:
    if not 0 <= value <= 65535:
        raise OptionError(f"{option} {value}: a TCP port from 0 to 65535; use e.g. 8000 or 0 (0: any free port)")
    return value


_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_RE = re.compile(rf"^(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?$")


def host(option: str, text: str) -> str:
    """An interface to bind: an IP address (``127.0.0.1``, ``::1``) or a host name; dotted digits that are no
    address (``999.1.1.1``) are refused rather than looked up."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return text.strip("[]")
    except ValueError:
        pass
    if _HOST_RE.match(text) and not re.fullmatch(r"[0-9.]+", text):
        return text
    raise OptionError(f"{option} {text!r}: an IP address or host name to bind; use e.g. 127.0.0.1 or localhost")


def pids(values: Iterable[int] | None) -> tuple[int, ...]:
    out = tuple(values or ())
    for pid in out:
        if pid <= 0:
            raise OptionError(f"--pid {pid}: a process id is a positive number, as $(pgrep -o vllm) prints it")
    return out


def cgroups(values: Iterable[str] | None) -> tuple[str, ...]:
    """Group paths as /proc/<pid>/cgroup prints them: absolute, no ``.``/``..`` parts, no NUL."""
    from collectors.cgroup import clean_cgroup_path

    out = tuple(values or ())
    for path in out:
        if clean_cgroup_path(path) is None:
            raise OptionError(
                f"--cgroup {path!r}: give the group's absolute path as /proc/<pid>/cgroup prints it (no '..'); "
                "use e.g. /system.slice/vllm.service"
            )
    return out


def model_extensions(values: Iterable[str] | None) -> tuple[str, ...]:
    out = []
    for ext in values or ():
        if not _EXT_RE.match(ext):
            raise OptionError(f"--model-ext {ext!r}: a file extension; use e.g. .gguf or safetensors")
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


def writable_file_path(option: str, path: Path, example_name: str = "recorder.db") -> Path:
    """A file path we may create: not a folder, and its nearest existing parent is a folder."""
    if path.is_dir():
        raise OptionError(f"{option} {path}: is a folder; give a file path, use e.g. {path / example_name}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OptionError(f"{option} {path}: {parent} is not a folder")
    return path


def folder_path(option: str, path: Path) -> Path:
    """A folder that exists or can be made later: not a file, and its nearest existing parent is a folder.
    Nothing is created here (the command makes it once everything else is valid)."""
    if path.exists() and not path.is_dir():
        raise OptionError(f"{option} {path}: exists and is not a folder")
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
        raise OptionError(f"--unit {text!r}: a systemd unit name; use e.g. vllm.service")
    return text


def http_url(option: str, text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OptionError(f"{option} {text!r}: an http(s) base URL; use e.g. http://127.0.0.1:9090")
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
