"""Human units on the command line: durations (``90s``, ``30m``, ``2h``, ``1d``) and sizes (``256MiB``, ``1G``),
and whether a host given there is this machine.

Errors say what was expected, because an on-call engineer typing under stress deserves better than
a traceback.
"""

from __future__ import annotations

import ipaddress
import math
import re

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


class NotPositive(ValueError):
    """A duration or size that parses but is zero: a ``ValueError`` like the others, told apart by callers that
    word "must be positive" and "not a duration" differently."""


def parse_duration(text: str) -> float:
    """Seconds from ``500ms``, ``90s``, ``30m``, ``2h``, ``1d``; a bare number is seconds."""
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration; use e.g. 90s, 30m, 2h or 1d")
    value = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    if value <= 0:
        raise NotPositive(f"{text!r}: a duration must be positive")
    return value


def parse_size(text: str) -> int:
    """Bytes from ``256MiB``, ``1G``, ``512k``, ``1000000``. K/M/G/T are powers of 1024 (what people mean for RAM)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; use e.g. 256MiB, 1GiB or a number of bytes")
    number, prefix = float(match.group(1)), match.group(2).lower()
    value = int(number * 1024 ** _SIZE_POWERS[prefix])
    if value <= 0:
        raise NotPositive(f"{text!r}: a size must be positive")
    return value


def format_duration(seconds: float) -> str:
    """The shortest spelling ``parse_duration`` reads back exactly: ``1h``, ``400d``, ``10ms``, ``90s``.

    Why: option messages state their bounds in the units people type (``at most 1h``, not ``at most 3600s``
    or ``3.456e+07s``), and a bound in a message must itself be a value the option accepts."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 0.001)):
        count = seconds / size
        if count >= 1 and math.isclose(count, round(count), rel_tol=0, abs_tol=1e-9):
            return f"{round(count)}{unit}"
    return f"{seconds:g}s"


def format_size(value: int) -> str:
    """The shortest binary spelling ``parse_size`` reads back exactly: ``64KiB``, ``256MiB``, ``1GiB``, ``1000``."""
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if value >= 1024**power and value % 1024**power == 0:
            return f"{value // 1024**power}{unit}"
    return str(value)


def format_bytes(value: float | None) -> str:
    """``1.5 GiB``: binary prefixes, as memory is sized. None or a non-finite number (a missing sample) is ``-``."""
    if value is None or not math.isfinite(value):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_seconds(seconds: float) -> str:
    """``850 ms`` below ten seconds, ``12.3 s`` from there: a latency as a finding's summary says it."""
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def format_value(v: object, unit: str = "") -> str:
    """One evidence value with its unit, for people: bytes with binary prefixes, sub-second times in ms.

    Why here: the terminal view and the bundle's reports print the same evidence; one formatter keeps
    them saying the same thing (the terminal used to print raw byte counts)."""
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{v} {unit}".strip()
    if unit in ("bytes", "B"):
        return format_bytes(float(v))
    if unit in ("bytes/s", "B/s"):
        return format_bytes(float(v)) + "/s"
    if unit in ("s", "seconds") and abs(v) < 1:
        return f"{v * 1000:.0f} ms"
    text = f"{v:.4g}" if isinstance(v, float) else str(v)
    return f"{text} {unit}".strip()


def is_loopback(host: str) -> bool:
    """True for a host that is this machine: ``localhost``, 127.0.0.0/8 or ``::1`` (bracketed as in a URL or not).

    One answer for every command that treats this machine apart -- a receiver listening without a token, a gate
    target reached without ``--allow-remote``, a store asked for uncompressed replies."""
    host = host.strip().lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
