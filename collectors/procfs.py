"""Tolerant readers and parsers for kernel text files (/proc, cgroupfs).

Why hand-written rather than psutil: every sampler must read under a configurable root (fixtures in
tests, a container reading the host's /proc), must be cheap enough for 1 Hz, and must never raise:
a garbled, truncated, empty or huge file yields "missing" with a reason, not an exception. These
functions are that contract. Parsers take text and return what they could parse; they skip lines
they do not understand rather than failing the whole file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from collectors.records import Psi, PsiLine

# The kernel prints PSI averages as "%lu.%02lu"; anything else (nan, 1e2, 1_0) is garbage.
_PSI_AVG = re.compile(r"[0-9]{1,3}\.[0-9]{1,2}")

# Kernel text files we read are small (vmstat ~ 8 KiB, smaps_rollup < 1 KiB). A cap protects the
# agent from a pathological or hostile file (a FIFO, /dev/zero bind-mounted in a fixture...).
MAX_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class ReadResult:
    """Text of a file, or why it could not be read.

    ``truncated`` says the file was longer than the cap and ``text`` holds only its first
    ``max_bytes``: the last line may be cut mid-number, so a caller that cannot tolerate that
    (a single-value file, a counter) should treat it as unreadable.
    """

    text: str | None
    error: str | None = None
    truncated: bool = False
    errno: int | None = None  # of the failed open/read: lets a caller tell "absent" (ENOENT) from "broken"

    @property
    def ok(self) -> bool:
        return self.text is not None


def read_text(path: str | os.PathLike[str], max_bytes: int = MAX_READ_BYTES) -> ReadResult:
    """Read a small kernel file without ever raising.

    Opens with O_NONBLOCK so a FIFO planted where a file should be cannot hang the sampler.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return ReadResult(None, _describe(exc), errno=exc.errno)
    except ValueError:  # a NUL inside the path (e.g. from a garbled /proc/<pid>/cgroup line)
        return ReadResult(None, "invalid path (embedded NUL byte)")
    try:
        chunks: list[bytes] = []
        remaining = max_bytes + 1  # one byte past the cap tells "exactly max_bytes" from "longer"
        while remaining > 0:
            chunk = os.read(fd, min(65536, remaining))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        return ReadResult(None, _describe(exc), errno=exc.errno)
    finally:
        os.close(fd)
    truncated = len(data) > max_bytes
    if truncated:
        data = data[:max_bytes]
    return ReadResult(data.decode("utf-8", errors="replace"), truncated=truncated)


def _describe(exc: OSError) -> str:
    name = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    return f"{name} ({exc.filename})" if exc.filename else name


def _int_token(token: str) -> int | None:
    """A kernel-printed decimal integer, or None.

    Stricter than ``int()``: Python also accepts ``1_000``, ``+5`` and non-ASCII digits (``١٢``),
    none of which the kernel prints, so a garbled file could otherwise yield a plausible number.
    The length cap (a u64 has 20 digits) also keeps ``int()`` away from its 4300-digit limit,
    past which it raises.
    """
    digits = token[1:] if token[:1] == "-" else token
    if not digits or len(digits) > 24 or not digits.isascii() or not digits.isdigit():
        return None
    return int(token)


def parse_int(text: str | None) -> int | None:
    """A single-integer file (memory.current, usage_in_bytes ...). None if it is not one."""
    if text is None:
        return None
    return _int_token(text.strip())


def parse_limit(text: str | None) -> tuple[bool, int | None]:
    """A v2 limit file: ``max`` means unlimited. Returns (parsed_ok, bytes or None for unlimited)."""
    if text is None:
        return False, None
    value = text.strip()
    if value == "max":
        return True, None
    number = parse_int(value)
    return (number is not None and number >= 0), number


def parse_flat_keyed(text: str | None) -> dict[str, int]:
    """``key value`` per line (memory.stat, memory.events, oom_control, /proc/vmstat).

    Lines that do not have exactly a key and an integer are skipped: the kernel adds keys over time,
    and a garbled line must not take the rest of the file down with it.
    """
    result: dict[str, int] = {}
    if not text:
        return result
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        value = _int_token(parts[1])
        if value is not None:
            result[parts[0]] = value
    return result


def parse_psi(text: str | None) -> Psi | None:
    """``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` and the ``full`` line. None if neither parses."""
    if not text:
        return None
    lines: dict[str, PsiLine] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 5 or parts[0] not in ("some", "full"):
            continue
        fields: dict[str, str] = {}
        for item in parts[1:]:
            key, sep, value = item.partition("=")
            if sep:
                fields[key] = value
        avgs = [_PSI_AVG.fullmatch(fields.get(k, "")) for k in ("avg10", "avg60", "avg300")]
        total = _int_token(fields.get("total", ""))
        if not all(avgs) or total is None or total < 0:
            continue
        parsed = PsiLine(
            avg10=float(fields["avg10"]),
            avg60=float(fields["avg60"]),
            avg300=float(fields["avg300"]),
            total_us=total,
        )
        if not all(v <= 100.0 for v in (parsed.avg10, parsed.avg60, parsed.avg300)):
            continue
        lines[parts[0]] = parsed
    if not lines:
        return None
    return Psi(some=lines.get("some"), full=lines.get("full"))


def parse_meminfo(text: str | None) -> dict[str, int]:
    """/proc/meminfo to bytes by kernel key. ``kB`` means KiB; unit-less lines (HugePages_*) stay counts."""
    result: dict[str, int] = {}
    if not text:
        return result
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts or len(parts) > 2:
            continue
        value = _int_token(parts[0])
        if value is None:
            continue
        if len(parts) == 2:
            if parts[1] != "kB":
                continue
            value *= 1024
        if value < 0:
            continue
        result[key.strip()] = value
    return result


def under(root: str | os.PathLike[str], *parts: str) -> Path:
    """Join path parts under a root, stripping leading slashes so /proc-style paths stay inside it."""
    return Path(root, *(p.lstrip("/") for p in parts))
