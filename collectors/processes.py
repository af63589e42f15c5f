"""Per-process memory sampler: the biggest processes, every process holding a model file, and watched PIDs.

Why hand-rolled over psutil: it must read any ``proc_root`` (fixture trees in tests, a host /proc
mounted into a container), it must never raise, and it must stay cheap at 1 Hz (the agent's budget is
1 % of a core). The expensive parts are kept off the per-second path:

* every sample reads only ``/proc/<pid>/stat`` for every process (pid, comm, ppid, faults, threads,
  start time, RSS): enough to rank by RSS and to tell a PID reuse from the same process;
* ``smaps_rollup`` (PSS/USS/swap; a page-table walk in the kernel), ``cmdline`` and ``cgroup`` are read
  only for the processes that end up in the sample;
* model-file discovery (``maps`` + every ``fd`` link) is cached per (pid, start time) and redone when the
  process is new, every ``model_rescan_s`` seconds (staggered per PID so scans do not pile up on one
  tick), or at once when its RSS or its address space (stat ``vsize``: an mmap shows there before a
  page is touched) moved by ``rss_jump_bytes`` or more. A process that starts mapping a large model is
  therefore reported at the next sample, any other new model holder within ``model_rescan_s`` seconds.

Failure handling, per the team contract: a process that vanishes mid-read is skipped silently. A
process whose ``stat`` cannot be read or has no ``(comm)`` framing is skipped too -- without stat there
is no identity (start time) and no RSS to rank by. Any other unreadable or garbled file leaves its
fields None and lists them in ``missing`` with the reason. Kernel threads (PF_KTHREAD in the stat flags)
are skipped unless watched: they have no user memory and no model files.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from collectors.procfs import ReadResult, read_text
from collectors.records import ProcessSample
from collectors.redact import redact_argv

DEFAULT_MODEL_EXTENSIONS: tuple[str, ...] = (
    ".safetensors",
    ".gguf",
    ".bin",
    ".pt",
    ".pth",
    ".onnx",
    ".npy",
    ".npz",
    ".ckpt",
)

PF_KTHREAD = 0x00200000
MAX_CMDLINE_READ = 64 * 1024  # a command line is at most ARG_MAX; we display the first 64 KiB
MAX_CMDLINE_DISPLAY = 4096
MAX_MAPS_READ = 8 << 20  # ~80k mappings; a JVM can have 60k
_STAT_READ = 4096

try:
    _PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
    _CLK_TCK = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-Linux
    _PAGE_SIZE, _CLK_TCK = 4096, 100

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class _Stat:
    comm: str
    ppid: int | None
    flags: int | None
    minflt: int | None
    majflt: int | None
    threads: int | None
    start_ticks: int | None
    vsize: int | None
    rss_pages: int | None
    missing: dict[str, str]


# field name in ProcessSample -> (stat field number per proc(5), attribute)
_STAT_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("ppid", 4, "ppid"),
    ("", 9, "flags"),
    ("minor_faults", 10, "minflt"),
    ("major_faults", 12, "majflt"),
    ("num_threads", 20, "threads"),
    ("start_time_s", 22, "start_ticks"),
    ("", 23, "vsize"),
    ("rss_bytes", 24, "rss_pages"),
)


def parse_stat(text: str) -> _Stat | None:
    """Parse /proc/<pid>/stat. ``comm`` may hold spaces and parentheses: split after the LAST ')'.

    None when there is no ``(comm)`` framing at all; otherwise each field that is absent or not an
    integer is None and named in ``missing``.
    """
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        return None
    rest = text[close_paren + 1 :].split()
    values: dict[str, int | None] = {}
    missing: dict[str, str] = {}
    for name, number, attr in _STAT_FIELDS:
        index = number - 3  # rest[0] is field 3 (state)
        value: int | None = None
        if index < len(rest):
            value = _uint(rest[index])
        if value is None and name:
            missing[name] = f"stat field {number} absent or not a non-negative integer"
        values[attr] = value
    return _Stat(comm=text[open_paren + 1 : close_paren], missing=missing, **values)  # type: ignore[arg-type]


def parse_memory_cgroup(text: str) -> str | None:
    """The memory controller's path from /proc/<pid>/cgroup: the v1 ``memory`` line, else the v2 ``0::`` one."""
    v2: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if not path.startswith("/"):
            continue
        if "memory" in controllers.split(","):
            return path
        if hierarchy == "0" and controllers == "":
            v2 = path
    return v2


_KB_LINE = re.compile(r"^(?P<key>[A-Za-z_]+):[ \t]+(?P<value>[0-9]{1,20}) kB[ \t]*$", re.MULTILINE | re.ASCII)
_ROLLUP_KEYS = frozenset({"Rss", "Pss", "Private_Clean", "Private_Dirty", "Swap", "Locked"})
_STATUS_KEYS = frozenset({"VmRSS", "VmSwap"})


def _kb_values(text: str | None, keys: frozenset[str]) -> dict[str, int]:
    """``Key:   123 kB`` lines (smaps_rollup, status) to bytes, for the wanted keys only; the rest is skipped."""
    if not text:
        return {}
    return {m["key"]: int(m["value"]) * 1024 for m in _KB_LINE.finditer(text) if m["key"] in keys}


def parse_smaps_rollup(text: str | None) -> dict[str, int]:
    """smaps_rollup to bytes for Rss, Pss, Private_Clean, Private_Dirty, Swap and Locked (the header line is skipped)."""
    return _kb_values(text, _ROLLUP_KEYS)


def _uint(token: str) -> int | None:
    """A kernel-printed unsigned decimal, or None (``int()`` would also take ``+5``, ``1_0`` and non-ASCII digits)."""
    if 0 < len(token) <= 20 and token.isascii() and token.isdigit():
        return int(token)
    return None


def split_cmdline(raw: bytes, truncated: bool = False) -> list[str]:
    """NUL-separated argv to a list. A truncated read drops its last, partial, argument."""
    args = raw.split(b"\0")
    if args and (args[-1] == b"" or truncated):
        args.pop()
    return [a.decode("utf-8", errors="replace") for a in args]


def model_process_counts(samples: Iterable[ProcessSample]) -> dict[str, int]:
    """Model file path -> number of distinct processes (pid, start time) that map it or hold it open."""
    holders: dict[str, set[tuple[int, float | None]]] = {}
    for sample in samples:
        for path in sample.model_files:
            holders.setdefault(path, set()).add((sample.pid, sample.start_time_s))
    return {path: len(procs) for path, procs in sorted(holders.items())}


def _read_bytes(path: str, max_bytes: int) -> tuple[bytes | None, str | None, bool]:
    """(data, error, truncated). Never raises; O_NONBLOCK so a FIFO in a fixture cannot hang us."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        return None, _describe(exc), False
    except ValueError:  # NUL in the path
        return None, "invalid path", False
    try:
        chunks: list[bytes] = []
        remaining = max_bytes
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks), None, remaining <= 0
    except OSError as exc:
        return None, _describe(exc), False
    finally:
        os.close(fd)


def _describe(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else type(exc).__name__


@dataclass
class _Known:
    """What we remember about one process between samples (model-file discovery is the costly part)."""

    start_ticks: int | None
    model_files: tuple[str, ...] = ()
    model_error: str | None = None
    # Whether this process was ever seen holding a model file: it stays sampled after it closes the file, since
    # workers that read a checkpoint into private memory and close it (torch.load) are still model copies.
    held_model: bool = False
    scanned: bool = False
    scanned_at: float = 0.0
    next_scan: float = 0.0
    rss_at_scan: int = 0
    vsize_at_scan: int = 0
    cmdline_raw: bytes | None = None
    cmdline: str = ""
    rollup: dict[str, int] | None = None  # last smaps_rollup values (the expensive read)
    rollup_at: float = 0.0
    rss_at_rollup: int = 0


@dataclass
class _Candidate:
    pid: int
    stat: _Stat
    rss: int | None
    known: _Known


class ProcessSampler:
    """Samples processes under ``proc_root``; see the module docstring for what is read when.

    ``extra_model_paths`` are absolute files or directories that count as model files whatever their
    extension (a file equal to one, or anywhere under one). ``watch_pids`` are always reported while
    they exist, kernel threads included.
    """

    def __init__(
        self,
        proc_root: str | os.PathLike[str] = "/proc",
        *,
        top_n: int = 10,
        model_extensions: Sequence[str] = DEFAULT_MODEL_EXTENSIONS,
        extra_model_paths: Sequence[str] = (),
        watch_pids: Sequence[int] = (),
        model_rescan_s: float = 10.0,
        smaps_interval_s: float = 10.0,
        rss_jump_bytes: int = 32 << 20,
        rss_jump_ratio: float = 0.2,
    ) -> None:
        self.proc_root = str(proc_root)
        self.top_n = max(0, int(top_n))
        self.watch_pids = frozenset(int(p) for p in watch_pids)
        self.model_rescan_s = max(0.0, float(model_rescan_s))
        self.smaps_interval_s = max(0.0, float(smaps_interval_s))
        self.rss_jump_bytes = int(rss_jump_bytes)
        self.rss_jump_ratio = float(rss_jump_ratio)
        self.errors = 0
        self.last_error: str | None = None
        self._known: dict[int, _Known] = {}
        self._models = _ModelMatcher(model_extensions, extra_model_paths)

    # ------------------------------------------------------------------ public

    def sample(self, now: float | None = None) -> list[ProcessSample]:
        """One sample: top-N by RSS, every model holder, every watched PID (sorted by RSS, largest first).

        Never raises: an unexpected failure returns [] and is counted in ``errors`` / ``last_error``.
        """
        ts = time.time() if now is None else float(now)
        try:
            return self._sample(ts)
        except Exception as exc:  # a bug here must not stop the agent loop
            self.errors += 1
            self.last_error = repr(exc)
            return []

    def _sample(self, ts: float) -> list[ProcessSample]:
        try:
            names = os.listdir(self.proc_root)
        except OSError as exc:
            self.last_error = f"cannot list {self.proc_root}: {_describe(exc)}"
            return []
        candidates: list[_Candidate] = []
        seen: set[int] = set()
        for name in names:
            if not (name.isascii() and name.isdigit()):
                continue
            pid = int(name)
            candidate = self._read_stat(pid)
            if candidate is None:
                continue
            seen.add(pid)
            candidates.append(candidate)
        for pid in list(self._known):
            if pid not in seen:
                del self._known[pid]

        for candidate in candidates:
            self._refresh_models(candidate, ts)

        by_rss = sorted(candidates, key=lambda c: c.rss or 0, reverse=True)
        chosen: dict[int, _Candidate] = {}
        user = [c for c in by_rss if not _is_kthread(c.stat)]
        for c in user[: self.top_n]:
            chosen[c.pid] = c
        for c in candidates:
            if c.known.model_files or c.known.held_model or c.pid in self.watch_pids:
                chosen[c.pid] = c
        samples: list[ProcessSample] = []
        for c in sorted(chosen.values(), key=lambda c: c.rss or 0, reverse=True):
            sample = self._build(c, ts)
            if sample is not None:
                samples.append(sample)
        return samples

    # ------------------------------------------------------------------ per process

    def _pid_path(self, pid: int, name: str) -> str:
        return f"{self.proc_root}/{pid}/{name}"

    def _gone(self, pid: int, errno_: int | None = None) -> bool:
        """The process exited: its /proc directory is gone, or a read said ESRCH (an exited, not yet reaped
        process keeps its directory but has no memory left to report -- reporting it would be stale)."""
        return errno_ == errno.ESRCH or not os.path.isdir(f"{self.proc_root}/{pid}")

    def _read_stat(self, pid: int) -> _Candidate | None:
        try:
            fd = os.open(self._pid_path(pid, "stat"), _OPEN_FLAGS)
        except OSError:
            return None
        try:
            data = os.read(fd, _STAT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        stat = parse_stat(data.decode("utf-8", errors="replace"))
        if stat is None:
            return None
        if _is_kthread(stat) and pid not in self.watch_pids:
            return None
        rss = stat.rss_pages * _PAGE_SIZE if stat.rss_pages is not None else None
        known = self._known.get(pid)
        if known is None or known.start_ticks != stat.start_ticks:
            known = _Known(start_ticks=stat.start_ticks)
            self._known[pid] = known
        return _Candidate(pid=pid, stat=stat, rss=rss, known=known)

    def _refresh_models(self, c: _Candidate, clock: float) -> None:
        known = c.known
        fresh = not known.scanned
        due = fresh or clock >= known.next_scan or clock < known.scanned_at
        if not due and c.rss is not None:
            jump = abs(c.rss - known.rss_at_scan)
            due = jump >= self.rss_jump_bytes and jump >= self.rss_jump_ratio * max(known.rss_at_scan, 1)
        if not due and c.stat.vsize is not None:
            # mmap of a model grows the address space at once, before a page is touched.
            due = abs(c.stat.vsize - known.vsize_at_scan) >= self.rss_jump_bytes
        if not due:
            return
        known.model_files, known.model_error = self._scan_models(c.pid)
        known.held_model = known.held_model or bool(known.model_files)
        known.scanned, known.scanned_at = True, clock
        known.rss_at_scan = c.rss or 0
        known.vsize_at_scan = c.stat.vsize or 0
        if fresh:
            # Stagger the fleet: the first rescan of each PID falls somewhere in (0, rescan] from now.
            spread = ((c.pid * 2654435761) % 1024 + 1) / 1024
            known.next_scan = clock + self.model_rescan_s * spread
        else:
            known.next_scan = clock + self.model_rescan_s

    def _scan_models(self, pid: int) -> tuple[tuple[str, ...], str | None]:
        """Model files mapped (maps) or open (fd links) by ``pid``; the error when neither was readable."""
        found: set[str] = set()
        errors: list[str] = []
        raw, err, _ = _read_bytes(self._pid_path(pid, "maps"), MAX_MAPS_READ)
        if raw is None:
            errors.append(f"maps: {err}")
        else:
            text = raw.decode("utf-8", errors="surrogateescape")
            found.update(self._models.in_maps(text))
        fd_dir = self._pid_path(pid, "fd")
        try:
            entries = os.listdir(fd_dir)
        except OSError as exc:
            errors.append(f"fd: {_describe(exc)}")
            entries = []
        for entry in entries:
            try:
                target = os.readlink(f"{fd_dir}/{entry}")
            except OSError:
                continue  # closed between listdir and readlink, or not a link in a fixture
            path = self._models.match(target)
            if path is not None:
                found.add(path)
        error = "; ".join(errors) if len(errors) == 2 else None
        # Paths are bytes to the kernel; keep records valid UTF-8 (undecodable bytes become U+FFFD).
        cleaned = {p.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for p in found}
        return tuple(sorted(cleaned)), error

    def _build(self, c: _Candidate, ts: float) -> ProcessSample | None:
        pid, stat, known = c.pid, c.stat, c.known
        missing = dict(stat.missing)
        sample = ProcessSample(
            ts=ts,
            pid=pid,
            ppid=stat.ppid,
            comm=stat.comm,
            start_time_s=stat.start_ticks / _CLK_TCK if stat.start_ticks is not None else None,
            rss_bytes=c.rss,
            major_faults=stat.majflt,
            minor_faults=stat.minflt,
            num_threads=stat.threads,
            model_files=list(known.model_files),
        )
        if known.model_error:
            missing["model_files"] = known.model_error

        raw, err, truncated = _read_bytes(self._pid_path(pid, "cmdline"), MAX_CMDLINE_READ)
        if raw is None:
            if self._gone(pid):
                return None
            missing["cmdline"] = err or "unreadable"
        elif raw == known.cmdline_raw:
            sample.cmdline = known.cmdline
        else:
            display = redact_argv(split_cmdline(raw, truncated))
            if len(display) > MAX_CMDLINE_DISPLAY:
                display = display[: MAX_CMDLINE_DISPLAY - 1] + "…"
            known.cmdline_raw, known.cmdline = raw, display
            sample.cmdline = display

        # smaps_rollup walks every mapping in the kernel (~0.5-1.5 ms for a big Python/torch process), so
        # PSS/USS/swap are re-read every smaps_interval_s, or at once when RSS moved a lot; RSS itself is fresh.
        rss_moved = abs((c.rss or 0) - known.rss_at_rollup)
        if (
            known.rollup is not None
            and ts - known.rollup_at < self.smaps_interval_s
            and not (rss_moved >= self.rss_jump_bytes and rss_moved >= self.rss_jump_ratio * max(known.rss_at_rollup, 1))
        ):
            rollup, values = ReadResult(""), known.rollup
        else:
            rollup = read_text(self._pid_path(pid, "smaps_rollup"))
            values = parse_smaps_rollup(rollup.text) if rollup.ok else {}
            if not rollup.ok and self._gone(pid, rollup.errno):
                return None
            if rollup.ok:
                known.rollup, known.rollup_at, known.rss_at_rollup = values, ts, c.rss or 0

        def reason(keys: str) -> str:
            return f"smaps_rollup: {rollup.error}" if not rollup.ok else f"smaps_rollup lacks {keys}"

        sample.pss_bytes = values.get("Pss")
        if sample.pss_bytes is None:
            missing["pss_bytes"] = reason("Pss")
        if "Private_Clean" in values and "Private_Dirty" in values:
            sample.uss_bytes = values["Private_Clean"] + values["Private_Dirty"]
        else:
            missing["uss_bytes"] = reason("Private_Clean/Private_Dirty")
        sample.swap_bytes = values.get("Swap")
        # Locked (mlock'd) pages are ones reclaim cannot drop: the same read, no extra cost; absent on old kernels.
        sample.locked_bytes = values.get("Locked")
        if sample.rss_bytes is None and "Rss" in values:
            sample.rss_bytes = values["Rss"]
            missing.pop("rss_bytes", None)
        if sample.swap_bytes is None or sample.rss_bytes is None:
            # smaps_rollup needs ptrace access (not root) or a 4.14+ kernel; status is world-readable.
            status = _kb_values(read_text(self._pid_path(pid, "status")).text, _STATUS_KEYS)
            if sample.swap_bytes is None:
                sample.swap_bytes = status.get("VmSwap")
            if sample.rss_bytes is None and "VmRSS" in status:
                sample.rss_bytes = status["VmRSS"]
                missing.pop("rss_bytes", None)
        if sample.swap_bytes is None:
            missing["swap_bytes"] = reason("Swap") + "; status lacks VmSwap"

        cgroup = read_text(self._pid_path(pid, "cgroup"))
        if not cgroup.ok:
            if self._gone(pid, cgroup.errno):
                return None
            missing["memory_cgroup"] = cgroup.error or "unreadable"
        else:
            sample.memory_cgroup = parse_memory_cgroup(cgroup.text or "")
            if sample.memory_cgroup is None:
                missing["memory_cgroup"] = "no memory controller or cgroup v2 line"
        sample.missing = missing
        return sample


def _is_kthread(stat: _Stat) -> bool:
    return stat.flags is not None and bool(stat.flags & PF_KTHREAD)


class _ModelMatcher:
    """Finds model-file paths in a maps file and tells whether an fd link target is one.

    Why not one regex anchored at each line start: a busy Python process has ~300 mappings, and trying
    a path pattern at every line costs more than the kernel spends producing the file. Instead the
    search is anchored on the rare part -- a model extension at the end of a line -- and the path is
    then cut out of that line (maps' first five fields never contain '/'). A deleted-but-still-mapped
    model keeps counting (it is still resident); its `` (deleted)`` suffix is dropped.
    """

    _DELETED = " (deleted)"

    def __init__(self, extensions: Sequence[str], extra_paths: Sequence[str]) -> None:
        self.exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions if e)
        self.extras = tuple(str(Path(p)) for p in extra_paths if p and str(p).startswith("/"))
        deleted = r"(?: \(deleted\))?$"
        self._ext_re = (
            re.compile(r"(?i:" + "|".join(re.escape(e) for e in self.exts) + r")" + deleted, re.MULTILINE) if self.exts else None
        )
        self._extra_re = (
            re.compile(r"(?<=\s)(?:" + "|".join(re.escape(p) for p in self.extras) + r")(?:/[^\n]*?)?" + deleted, re.MULTILINE)
            if self.extras
            else None
        )

    def in_maps(self, text: str) -> set[str]:
        found: set[str] = set()
        for pattern in (self._ext_re, self._extra_re):
            if pattern is None:
                continue
            for m in pattern.finditer(text):
                line_start = text.rfind("\n", 0, m.start()) + 1
                slash = text.find("/", line_start, m.end())
                if slash >= 0:
                    path = text[slash : m.end()]
                    found.add(path[: -len(self._DELETED)] if path.endswith(self._DELETED) else path)
        return found

    def match(self, target: str) -> str | None:
        """The model path an fd link points at, or None (sockets, pipes, other files)."""
        if not target.startswith("/"):
            return None
        path = target[: -len(self._DELETED)] if target.endswith(self._DELETED) else target
        if self.exts and path.lower().endswith(self.exts):
            return path
        for extra in self.extras:
            if path == extra or path.startswith(extra + "/"):
                return path
        return None


__all__ = [
    "DEFAULT_MODEL_EXTENSIONS",
    "ProcessSampler",
    "model_process_counts",
    "parse_memory_cgroup",
    "parse_smaps_rollup",
    "parse_stat",
    "split_cmdline",
]
