"""Host-wide memory and pressure: PSI, /proc/meminfo, /proc/vmstat -> one ``HostSnapshot``.

Why these three files: PSI says whether tasks are *waiting* (the symptom users feel), meminfo says
how much memory is left, and vmstat's cumulative fault/scan/swap counters say whether the kernel is
reclaiming and refaulting (thrashing) rather than merely full. Each is one small read, cheap enough
for 1 Hz.

Contract: ``sample()`` never raises. A source that cannot be read or parsed and a required field
(``memory.total``, ``memory.available``, ``psi.cpu``/``psi.memory``/``psi.io``) that is absent go
into ``missing`` as ``field -> reason``; optional fields a kernel does not have are simply absent.

MemAvailable fallback (kernels before 3.14 lack the line; so do the node_exporter and procfs
fixtures). We reproduce the kernel's own ``si_mem_available`` (mm/show_mem.c, formerly
mm/page_alloc.c), in pages::

    wmark_low   = sum over zones of the low watermark
    available   = MemFree - totalreserve
                + pagecache   - min(pagecache / 2, wmark_low)     # pagecache = Active(file) + Inactive(file)
                + reclaimable - min(reclaimable / 2, wmark_low)   # KReclaimable, else SReclaimable
    available   = max(available, 0)

``totalreserve`` is what the kernel keeps back from userspace: per zone, the high watermark plus
the largest lowmem_reserve ("protection") entry, capped at the zone's managed pages
(``calculate_totalreserve_pages``). Kernels 3.14-4.5 subtracted ``wmark_low`` there instead; we
follow the current formula because it is what every kernel that *does* print MemAvailable agrees
with, and it can be checked: on a live host, hiding MemAvailable and estimating it reproduces the
kernel's number to within a page (tests/collectors/test_host.py).

Where the watermarks come from, best first (``HostSampler.available_method`` says which was used):

* ``zoneinfo``: /proc/zoneinfo ``low``/``high``/``managed``/``protection`` per zone -- exact.
* ``min_free_kbytes``: /proc/sys/vm/min_free_kbytes is the sum of the zones' *min* watermarks; the
  kernel sets low = min + d and high = min + 2d with d = max(min/4, managed * 10/10000)
  (watermark_scale_factor's default). totalreserve is approximated by that high sum; the
  lowmem_reserve term is unknown and left out, so the estimate errs high by at most the
  protection of the smaller zones (tens of MiB on a typical x86-64 host).
* ``default_min_free``: when that file is unreadable too (a fixture root), min_free_kbytes is what
  the kernel computes at boot, ``sqrt(16 * lowmem_kbytes)`` clamped to [128 KiB, 256 MiB], with
  MemTotal standing in for lowmem. An approximation: flagged by ``memory_available_estimated``
  like the others.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import math
import os
import re
import time
from dataclasses import dataclass

from collectors.catalog import MEMINFO_FIELDS, PSI_RESOURCES, VMSTAT_FIELDS
from collectors.procfs import parse_flat_keyed, parse_meminfo, parse_psi, read_text, under
from collectors.records import HostSnapshot, Psi

# irq pressure (kernel >= 6.1, CONFIG_IRQ_TIME_ACCOUNTING) is optional: absent is not "missing".
OPTIONAL_PSI_RESOURCES: tuple[str, ...] = ("irq",)

# Before 4.8 the reclaim scan/steal counters were per zone (pgscan_kswapd_normal ...); their sum is
# the later node-wide counter. Only real zone names: pgscan_direct_throttle is a different counter.
_PER_ZONE_RECLAIM = re.compile(r"(pgscan|pgsteal)_(kswapd|direct)_(dma|dma32|normal|highmem|movable|device)")

_VMSTAT_WANTED = frozenset(VMSTAT_FIELDS)

# zoneinfo on a many-CPU, many-node host carries a per-CPU pageset block per zone; it can pass the
# default 1 MiB cap, and only the watermark lines near each zone header matter.
_ZONEINFO_MAX_BYTES = 8 << 20


@dataclass(frozen=True)
class Watermarks:
    """What ``si_mem_available`` needs from the zones, in pages."""

    low: int
    totalreserve: int
    method: str  # zoneinfo | min_free_kbytes | default_min_free


def parse_zoneinfo(text: str | None) -> Watermarks | None:
    """Sum of low watermarks and the kernel's ``totalreserve_pages`` from /proc/zoneinfo; None if no zone parses.

    Per zone: ``low``, ``high``, ``managed`` (``present`` on kernels before 3.8) and the
    ``protection: (a, b, ...)`` array. The per-CPU ``high:``/``count:`` lines carry a colon and are
    not watermarks, so only colon-less two-token lines are read as fields.
    """
    if not text:
        return None
    zones: list[dict[str, int]] = []
    current: dict[str, int] | None = None
    for line in text.splitlines():
        if line.startswith("Node ") and ", zone" in line:
            current = {}
            zones.append(current)
            continue
        if current is None:
            continue
        stripped = line.strip()
        if stripped.startswith("protection:"):
            inner = stripped[len("protection:") :].strip().strip("()")
            values = [v.strip() for v in inner.split(",")]
            numbers = [int(v) for v in values if v.isascii() and v.isdigit() and len(v) <= 24]
            if numbers and len(numbers) == len(values):
                current["protection"] = max(numbers)
            continue
        parts = stripped.split()
        if len(parts) == 2 and parts[0] in ("low", "high", "managed", "present"):
            value = parts[1]
            if value.isascii() and value.isdigit() and len(value) <= 24:
                current[parts[0]] = int(value)
    low_sum = 0
    reserve = 0
    parsed = 0
    for zone in zones:
        if "low" not in zone or "high" not in zone:
            continue
        parsed += 1
        low_sum += zone["low"]
        managed = zone.get("managed", zone.get("present"))
        zone_reserve = zone["high"] + zone.get("protection", 0)
        if managed is not None:
            zone_reserve = min(zone_reserve, managed)
        reserve += zone_reserve
    if parsed == 0:
        return None
    return Watermarks(low=low_sum, totalreserve=reserve, method="zoneinfo")


def watermarks_from_min_free(min_free_kbytes: int, mem_total_kbytes: int, page_size: int, method: str) -> Watermarks:
    """Approximate watermarks from vm.min_free_kbytes (see the module docstring for the formula)."""
    kib_per_page = max(page_size // 1024, 1)
    min_pages = min_free_kbytes // kib_per_page
    step = max(min_pages // 4, (mem_total_kbytes // kib_per_page) * 10 // 10000)
    return Watermarks(low=min_pages + step, totalreserve=min_pages + 2 * step, method=method)


def default_min_free_kbytes(mem_total_kbytes: int) -> int:
    """The kernel's boot-time default (``calculate_min_free_kbytes``): sqrt(lowmem_kbytes * 16), clamped."""
    return min(max(math.isqrt(max(mem_total_kbytes, 0) * 16), 128), 262144)


def estimate_available(meminfo: dict[str, int], marks: Watermarks, page_size: int) -> int | None:
    """``si_mem_available`` on parsed meminfo (bytes by kernel key); None if its inputs are absent."""
    try:
        free = meminfo["MemFree"] // page_size
        pagecache = (meminfo["Active(file)"] + meminfo["Inactive(file)"]) // page_size
    except KeyError:
        return None
    reclaimable = meminfo.get("KReclaimable", meminfo.get("SReclaimable", 0)) // page_size
    available = free - marks.totalreserve
    available += pagecache - min(pagecache // 2, marks.low)
    available += reclaimable - min(reclaimable // 2, marks.low)
    return max(available, 0) * page_size


def _page_size() -> int:
    with contextlib.suppress(ValueError, OSError):
        size = os.sysconf("SC_PAGE_SIZE")
        if size > 0:
            return size
    return 4096


class HostSampler:
    """Reads PSI, meminfo and vmstat under ``proc_root`` (a fixture tree, or a container's view of the host)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self.page_size = _page_size()
        # How the last sample got memory.available: "kernel" (MemAvailable), a Watermarks.method, or None.
        self.available_method: str | None = None

    def sample(self, now: float | None = None) -> HostSnapshot:
        snap = HostSnapshot(ts=time.time() if now is None else now)
        try:
            self._psi(snap)
            self._meminfo(snap)
            self._vmstat(snap)
        except Exception as exc:  # the parsers are written not to raise; this keeps the promise if one does
            snap.missing.setdefault("host", f"sampler error: {type(exc).__name__}")
        return snap

    # ------------------------------------------------------------------ sources

    def _read(self, *parts: str, max_bytes: int | None = None) -> tuple[str | None, str | None, int | None]:
        path = under(self.proc_root, *parts)
        result = read_text(path) if max_bytes is None else read_text(path, max_bytes)
        if result.text is None:
            return None, result.error or "unreadable", result.errno
        if result.truncated:
            return None, f"larger than the read cap, not a kernel file ({path})", None
        return result.text, None, None

    def _psi(self, snap: HostSnapshot) -> None:
        for resource in (*PSI_RESOURCES, *OPTIONAL_PSI_RESOURCES):
            text, error, errno = self._read("pressure", resource)
            optional = resource in OPTIONAL_PSI_RESOURCES
            if text is None:
                if not (optional and errno == errno_codes.ENOENT):  # this kernel has no such resource
                    snap.missing[f"psi.{resource}"] = error or "unreadable"
                continue
            psi: Psi | None = parse_psi(text)
            if psi is None:
                snap.missing[f"psi.{resource}"] = "no parseable some/full line"
                continue
            snap.psi[resource] = psi

    def _meminfo(self, snap: HostSnapshot) -> None:
        self.available_method = None
        text, error, _ = self._read("meminfo")
        if text is None:
            snap.missing["memory"] = error or "unreadable"
            snap.missing["memory.total"] = "meminfo unreadable"
            snap.missing["memory.available"] = "meminfo unreadable"
            return
        raw = parse_meminfo(text)
        if not raw:
            snap.missing["memory"] = "no parseable lines in meminfo"
        for key, snake in MEMINFO_FIELDS.items():
            if key in raw:
                snap.memory[snake] = raw[key]
        if "total" not in snap.memory:
            snap.missing["memory.total"] = "MemTotal not in meminfo"
        if "available" in snap.memory:
            self.available_method = "kernel"
            return
        marks = self._watermarks(raw)
        estimate = estimate_available(raw, marks, self.page_size)
        if estimate is None:
            snap.missing["memory.available"] = "MemAvailable absent, and MemFree/Active(file)/Inactive(file) too"
            return
        snap.memory["available"] = estimate
        snap.memory_available_estimated = True
        self.available_method = marks.method

    def _watermarks(self, meminfo: dict[str, int]) -> Watermarks:
        text, _, _ = self._read("zoneinfo", max_bytes=_ZONEINFO_MAX_BYTES)
        marks = parse_zoneinfo(text)
        if marks is not None:
            return marks
        total_kb = meminfo.get("MemTotal", 0) // 1024
        text, _, _ = self._read("sys", "vm", "min_free_kbytes")
        value = text.strip() if text else ""
        if value.isascii() and value.isdigit() and len(value) <= 24:
            return watermarks_from_min_free(int(value), total_kb, self.page_size, "min_free_kbytes")
        return watermarks_from_min_free(default_min_free_kbytes(total_kb), total_kb, self.page_size, "default_min_free")

    def _vmstat(self, snap: HostSnapshot) -> None:
        text, error, _ = self._read("vmstat")
        if text is None:
            snap.missing["vmstat"] = error or "unreadable"
            return
        # ~180 lines, ~25 wanted: drop the rest before parsing (halves the sampler's CPU time).
        wanted = _VMSTAT_WANTED
        raw = parse_flat_keyed("\n".join(
            line for line in text.splitlines()
            if line.partition(" ")[0] in wanted or line.startswith(("pgscan_", "pgsteal_"))
        ))  # fmt: skip
        zone_sums: dict[str, int] = {}
        for key, value in raw.items():
            if value < 0:
                continue
            if key in wanted:
                snap.vmstat[key] = value
                continue
            match = _PER_ZONE_RECLAIM.fullmatch(key)
            if match:
                name = f"{match.group(1)}_{match.group(2)}"
                zone_sums[name] = zone_sums.get(name, 0) + value
        for name, total in zone_sums.items():
            if name in wanted:
                snap.vmstat.setdefault(name, total)
        if not snap.vmstat:
            snap.missing["vmstat"] = "none of the known counters in vmstat"
