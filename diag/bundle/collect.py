"""The bundle's collectors: volatile state first, then cgroup/process files, GPU, kernel, journal, history.

Each factory returns a ``runner.Collector`` whose function *returns* what it found (``Output``) and
writes nothing: the main thread redacts, writes and hashes (see runner.py for why). Order matters
the way it does for nvidia-bug-report, which reads the GPU's power state before anything can
disturb it: PSI, meminfo and vmstat are copied first, because they change fastest and every later
collector perturbs them a little.

What is deliberately *not* collected: process environments (``/proc/<pid>/environ``: secrets live
there), raw command lines (``ProcessSample.cmdline`` is already redacted argv), prompts or
completions (the tracker records token counts only), core dumps, whole logs.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import sqlite3
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.cgroup import clean_cgroup_path, discover_mounts, parse_proc_cgroup
from collectors.kmsg import estimate_boot_time, parse_kmsg_record, parse_oom_events
from collectors.procfs import under
from collectors.recorder import FlightRecorder, RecorderCorrupt, default_recorder_path
from collectors.recorder_queries import RecorderReader
from collectors.records import CgroupSnapshot, ProcessSample
from diag.bundle.options import BundleOptions
from diag.bundle.redactor import Redactor, parse_many
from diag.bundle.runner import Collector, Context, OutFile, Output, read_tail, run_command

# Kernel lines worth keeping from the ring buffer: the OOM killer's header and summary lines, memcg
# usage dumps, the reaper, and NVIDIA Xid errors (a GPU falling off the bus looks like an OOM upstream).
OOM_LINE_RE = re.compile(r"(?i)\boom|out of memory|killed process|memory cgroup|memory: usage|swap: usage|NVRM: Xid")
# A superset of OOM_LINE_RE as plain substrings of the lower-cased record: a byte search is ~1000x cheaper
# than the case-insensitive regex (9 ms per 16 KiB), which matters when a starved host has thousands of records.
_OOM_NEEDLES = (b"oom", b"out of memory", b"killed process", b"memory cgroup", b"memory: usage", b"swap: usage", b"nvrm: xid")
MAX_KMSG_RECORDS = 200_000
PID_FILES = ("status", "cgroup", "oom_score", "oom_score_adj", "smaps_rollup", "limits")
PSI_FILES = ("cpu", "memory", "io", "irq")
MAX_CGROUPS = 8
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,40}$")


@dataclass
class State:
    """What later collectors learn from earlier ones (the snapshot's watched groups and model holders)."""

    options: BundleOptions
    redactor: Redactor
    started: float  # Unix time the bundle started
    since: float  # start of the history window
    staging: Path  # where the history collector streams timeline files
    cgroups: list[CgroupSnapshot] = field(default_factory=list)
    processes: list[ProcessSample] = field(default_factory=list)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _copy(path: str, rel: str, cap: int, ctx: Context) -> OutFile:
    tail = read_tail(path, cap, ctx)
    return OutFile(rel, _text(tail.data), tail.truncated, path, tail.size)


def _describe(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else str(exc)


# --------------------------------------------------------------------------- phase 1: volatile state


def raw_files(name: str, description: str, paths: list[tuple[str, str]], cap: int, timeout: float,
              optional: frozenset[str] = frozenset()) -> Collector:  # fmt: skip
    """Copy files verbatim (tail-capped). ``paths``: (source, bundle path). Missing optional ones are noted."""

    def fn(ctx: Context) -> Output:
        out = Output()
        problems = []
        for src, rel in paths:
            ctx.check()
            try:
                out.files.append(_copy(src, rel, cap, ctx))
            except OSError as exc:
                if not (src in optional and exc.errno == errno.ENOENT):
                    problems.append(f"{src}: {_describe(exc)}")
        if problems:
            out.reason = "; ".join(problems)
            out.status = "ok" if out.files else "error"
        return out

    return Collector(name, description, fn, timeout)


def volatile_collectors(o: BundleOptions) -> list[Collector]:
    proc = o.proc_root
    psi = [(str(under(proc, "pressure", r)), f"raw/proc/pressure/{r}") for r in PSI_FILES]
    return [
        raw_files(
            "proc.pressure",
            "host PSI (/proc/pressure/*)",
            psi,
            o.file_cap,
            o.volatile_timeout_s,
            optional=frozenset(src for src, _ in psi if src.endswith("irq")),
        ),
        raw_files(
            "proc.meminfo",
            "host memory (/proc/meminfo)",
            [(str(under(proc, "meminfo")), "raw/proc/meminfo")],
            o.file_cap,
            o.volatile_timeout_s,
        ),
        raw_files(
            "proc.vmstat",
            "host VM counters (/proc/vmstat)",
            [(str(under(proc, "vmstat")), "raw/proc/vmstat")],
            o.file_cap,
            o.volatile_timeout_s,
        ),
        raw_files(
            "proc.loadavg",
            "load average (/proc/loadavg)",
            [(str(under(proc, "loadavg")), "raw/proc/loadavg")],
            o.file_cap,
            o.volatile_timeout_s,
        ),
    ]


def snapshot_collector(state: State) -> Collector:
    """One ``SnapshotTaker`` sample: host, watched cgroups, process table (redacted cmdlines, no environments)."""
    o = state.options

    def fn(ctx: Context) -> Output:
        from collectors.snapshot import SamplerConfig, SnapshotTaker

        config = SamplerConfig(
            proc_root=o.proc_root, sys_root=o.sys_root, pids=o.pids, cgroups=o.cgroups, top_n=o.top_n,
            kmsg_path=None, gpu=False,  # kmsg and the GPU have collectors of their own (own timeouts)
        )  # fmt: skip
        taker = SnapshotTaker(config)
        try:
            snap = taker.take()
        finally:
            taker.close()
        state.cgroups = list(snap.cgroups)
        state.processes = list(snap.processes)
        out = Output(records=[r.to_dict() for r in (snap.host, *snap.cgroups, *snap.processes)])
        out.extra = {"processes": len(snap.processes), "cgroups": [c.path for c in snap.cgroups], "errors": snap.errors}
        if snap.errors:
            out.reason = "; ".join(f"{k}: {v}" for k, v in snap.errors.items())
        return out

    return Collector("snapshot", "host, watched cgroups and process table now (SnapshotTaker)", fn, o.snapshot_timeout_s)


# --------------------------------------------------------------------------- phase 2


@dataclass(frozen=True)
class GroupDirs:
    path: str
    memory_dir: Path | None  # v1 memory group, or the v2 group when memory is on v2
    memory_hierarchy: str  # "memory" (v1) | "unified" (v2)
    pressure_dir: Path | None  # the v2 group (or the hybrid's v2 twin) with memory.pressure


def resolve_group(snap: CgroupSnapshot, o: BundleOptions) -> GroupDirs:
    """The directories behind a watched group, resolved the way ``collectors.cgroup`` resolves them."""
    mounts = discover_mounts(o.sys_root)
    path = clean_cgroup_path(snap.path) or "/"
    if snap.version == "v2" and mounts.v2 is not None:
        d = under(mounts.v2, path)
        return GroupDirs(path, d, "unified", d)
    if snap.version in ("v1", "hybrid") and mounts.v1_memory is not None:
        v1 = under(mounts.v1_memory, path)
        twin = None
        if mounts.v2 is not None:
            twin = _v2_twin(v1, path, mounts.v2, o.proc_root)
        return GroupDirs(path, v1, "memory", twin)
    return GroupDirs(path, None, "memory", None)


def _v2_twin(v1_dir: Path, path: str, v2_root: Path, proc_root: str) -> Path | None:
    try:
        with open(v1_dir / "cgroup.procs", encoding="ascii", errors="replace") as fh:
            first = fh.readline().strip()
    except OSError:
        first = ""
    if first.isdigit():
        try:
            member = parse_proc_cgroup(Path(under(proc_root, first, "cgroup")).read_text())
        except OSError:
            member = None
        v2_path = clean_cgroup_path(member.v2) if member and member.v2 else None
        if v2_path and under(v2_root, v2_path).is_dir():
            return under(v2_root, v2_path)
    same = under(v2_root, path)
    return same if same.is_dir() else None


def _readable_memory_files(d: Path) -> list[Path]:
    """``memory.*`` files a read cannot change or block on (write-only control files are skipped)."""
    files = []
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        if not entry.name.startswith("memory."):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IRUSR:
            files.append(Path(entry.path))
    return files


def cgroup_collector(state: State) -> Collector:
    """The watched groups' ``memory.*`` files (v1 or v2) and the v2 twin's ``memory.pressure``, verbatim."""
    o = state.options

    def fn(ctx: Context) -> Output:
        groups = state.cgroups[:MAX_CGROUPS]
        if not groups:
            return Output(
                status="skipped", reason="no watched cgroup (pass --pid or --cgroup; by default the model holders' groups)"
            )
        out = Output()
        problems = []
        for snap in groups:
            ctx.check()
            dirs = resolve_group(snap, o)
            if dirs.memory_dir is None:
                problems.append(f"{snap.path}: no memory group found ({snap.missing.get('group', snap.version)})")
                continue
            rel_root = f"raw/cgroup/{dirs.memory_hierarchy}{dirs.path.rstrip('/')}"
            sources = [(p, f"{rel_root}/{p.name}") for p in _readable_memory_files(dirs.memory_dir)]
            if dirs.pressure_dir is not None and dirs.pressure_dir != dirs.memory_dir:
                rel_twin = f"raw/cgroup/unified{str(dirs.pressure_dir).split('/unified', 1)[-1].rstrip('/')}"
                sources.append((dirs.pressure_dir / "memory.pressure", f"{rel_twin}/memory.pressure"))
            for src, rel in sources:
                ctx.check()
                try:
                    out.files.append(_copy(str(src), rel, o.file_cap, ctx))
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES):
                        problems.append(f"{src}: {_describe(exc)}")
        out.extra = {"groups": [g.path for g in groups]}
        if problems:
            out.reason = "; ".join(problems)
            out.status = "ok" if out.files else "error"
        return out

    return Collector("cgroup.files", "watched cgroups: memory.* (v1/v2) and the v2 twin's memory.pressure", fn, 5.0)


def watched_pids(state: State) -> list[int]:
    o = state.options
    pids = list(dict.fromkeys([*o.pids, *(p.pid for p in state.processes if p.model_files)]))
    return pids[: o.max_watched_pids]


def pid_files_collector(state: State) -> Collector:
    """Per watched process: status, cgroup, oom_score(_adj), smaps_rollup, limits. Never environ or cmdline."""
    o = state.options

    def fn(ctx: Context) -> Output:
        pids = watched_pids(state)
        if not pids:
            return Output(status="skipped", reason="no watched process (pass --pid; by default the model holders)")
        out = Output()
        problems = []
        for pid in pids:
            for name in PID_FILES:
                ctx.check()
                src = str(under(o.proc_root, str(pid), name))
                try:
                    out.files.append(_copy(src, f"raw/proc/{pid}/{name}", o.file_cap, ctx))
                except OSError as exc:
                    problems.append(f"{src}: {_describe(exc)}")
        out.extra = {"pids": pids}
        if problems:
            out.reason = "; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else "")
            out.status = "ok" if out.files else "error"
        return out

    return Collector("process.files", "watched processes' /proc/<pid> status, cgroup, OOM score, smaps_rollup, limits", fn, 5.0)


def gpu_collector(state: State) -> Collector:
    """One NVML sample (``GpuSnapshot``) in its own collector: a wedged driver must not stall the rest."""
    o = state.options

    def fn(ctx: Context) -> Output:
        if not o.gpu:
            return Output(status="skipped", reason="disabled (--no-gpu)")
        from collectors.gpu import GpuSampler

        sampler = GpuSampler()
        try:
            snap = sampler.sample()
        finally:
            sampler.close()
        out = Output(records=[snap.to_dict()])
        if not snap.available:
            out.status, out.reason = "skipped", f"no GPU state: {snap.reason or 'NVML unavailable'}"
        return out

    return Collector("gpu", "GPU state through NVML (GpuSnapshot)", fn, o.command_timeout_s)


def nvidia_smi_collector(state: State) -> Collector:
    o = state.options

    def fn(ctx: Context) -> Output:
        if not o.gpu:
            return Output(status="skipped", reason="disabled (--no-gpu)")
        exe = shutil.which(o.nvidia_smi)
        if exe is None:
            return Output(status="skipped", reason=f"{o.nvidia_smi} not on PATH (no NVIDIA driver tools on this host)")
        argv = [exe, "-q"]
        return _command_output(argv, "raw/nvidia-smi-q.txt", o.command_cap, ctx)

    return Collector("nvidia-smi", "nvidia-smi -q (full GPU query), killed at its timeout", fn, o.command_timeout_s)


def _command_output(argv: list[str], rel: str, cap: int, ctx: Context, env: dict[str, str] | None = None) -> Output:
    """Run a command into ``rel``; its stdout is published as it arrives, so even an abandoned run keeps it."""
    printed = bytearray()

    def so_far() -> Output:
        data = bytes(printed)  # one copy under the GIL: the worker may still be appending
        kept = data[-cap:] if len(data) > cap else data
        return Output(argv=argv, files=[OutFile(rel, _text(kept), len(data) > cap, " ".join(argv))],
                      reason=f"{len(kept)} bytes of output printed before it was abandoned")  # fmt: skip

    ctx.partial = so_far
    res = run_command(argv, ctx, cap, env=env, sink=printed)
    out = Output(argv=argv, return_code=res.return_code, timeout_hit=res.timed_out)
    out.files.append(OutFile(rel, _text(res.stdout), res.truncated, " ".join(argv)))
    if res.timed_out:
        out.reason = f"killed after {res.duration_s:.1f} s (timeout); kept {len(res.stdout)} bytes of output"
    elif res.return_code != 0:
        out.status = "error"
        err = _text(res.stderr).strip().splitlines()
        out.reason = f"exit code {res.return_code}" + (f": {err[-1][:300]}" if err else "")
    return out


def journal_unit(state: State) -> str | None:
    """``--unit``, else the systemd service the watched group belongs to (``/system.slice/vllm.service``)."""
    if state.options.unit:
        return state.options.unit
    for snap in state.cgroups:
        for part in reversed(snap.path.split("/")):
            if part.endswith(".service"):
                return part
    return None


def journal_collector(state: State) -> Collector:
    o = state.options

    def fn(ctx: Context) -> Output:
        exe = shutil.which("journalctl")
        if exe is None:
            return Output(status="skipped", reason="journalctl not found: no systemd journal on this host")
        if not any(os.path.isdir(p) for p in ("/run/systemd/system", "/run/log/journal", "/var/log/journal")):
            return Output(
                status="skipped", reason="systemd is not running here (no /run/systemd/system) and there are no journal files"
            )
        unit = journal_unit(state)
        if unit is None:
            return Output(
                status="skipped", reason="no service unit: pass --unit, or watch a process (--pid) of a systemd service"
            )
        argv = [exe, "-u", unit, f"--since=@{int(state.since)}", "--no-pager", "-q", "-o", "short-iso", "-n", "20000"]
        return _command_output(
            argv, "raw/journal.txt", o.journal_cap, ctx, env={**os.environ, "SYSTEMD_PAGER": "", "PAGER": "cat"}
        )

    return Collector("journal", "the service unit's journal excerpt (journalctl -u UNIT --since)", fn, o.command_timeout_s)


@dataclass
class _KmsgRead:
    """OOM-related lines kept from /dev/kmsg so far (the newest ``cap`` bytes of them)."""

    cap: int
    lines: deque[str] = field(default_factory=deque)
    bytes: int = 0
    truncated: bool = False
    records: int = 0
    overwritten: int = 0
    stopped: str | None = None  # why reading stopped before the end of the ring buffer

    def keep(self, line: str) -> None:
        self.lines.append(line)
        self.bytes += len(line) + 1
        while self.bytes > self.cap and self.lines:
            self.bytes -= len(self.lines.popleft()) + 1
            self.truncated = True


def _read_kmsg(fd: int, got: _KmsgRead, ctx: Context, budget_end: float) -> None:
    """Read records until the ring buffer is drained (EAGAIN), the record cap, or ``budget_end``.

    Never blocks (O_NONBLOCK) and never runs into its deadline: on a thrashing, CPU-starved host it stops
    at its own time budget and returns the lines it kept, saying so, instead of being abandoned with
    nothing. A cheap byte search picks the candidate records; only those are decoded and parsed.
    """
    while got.records < MAX_KMSG_RECORDS:
        if got.records % 64 == 0 and (ctx.cancel.is_set() or time.monotonic() > budget_end):
            got.stopped = f"stopped at its time budget after {got.records} records (newer kernel lines not read)"
            return
        try:
            data = os.read(fd, 16384)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # overwritten under us; the next read resumes at the oldest kept record
                got.overwritten += 1
                got.records += 1  # progress, so the budget check above still runs
                continue
            raise
        if not data:
            return
        got.records += 1
        lowered = data.lower()
        if not any(needle in lowered for needle in _OOM_NEEDLES):
            continue
        for line in _text(data).split("\n"):
            rec = parse_kmsg_record(line)
            if rec is not None and OOM_LINE_RE.search(rec.message):
                got.keep(line)
    got.stopped = f"stopped after {MAX_KMSG_RECORDS} records"


def _kmsg_output(got: _KmsgRead, state: State) -> Output:
    lines = list(got.lines)
    events = parse_oom_events(lines, boot_time=estimate_boot_time())
    out = Output(records=[e.to_dict() for e in events if e.ts >= state.since], reason=got.stopped)
    out.files.append(OutFile("raw/kmsg-oom.txt", "".join(f"{line}\n" for line in lines), got.truncated,
                             state.options.kmsg_path))  # fmt: skip
    out.extra = {"records_read": got.records, "lines_kept": len(lines), "oom_events": len(events),
                 "oom_events_in_window": len(out.records), "overwritten": got.overwritten}  # fmt: skip
    return out


def kmsg_collector(state: State) -> Collector:
    """OOM-related kernel lines from the *start* of the ring buffer, read without blocking; OomEvents from them."""
    o = state.options

    def fn(ctx: Context) -> Output:
        try:
            fd = os.open(o.kmsg_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            return Output(status="skipped", reason=f"cannot open {o.kmsg_path}: {_describe(exc)}")
        got = _KmsgRead(o.kmsg_cap)
        ctx.partial = lambda: _kmsg_output(_KmsgRead(got.cap, deque(got.lines), got.bytes, got.truncated, got.records,
                                                     got.overwritten, "abandoned at its deadline"), state)  # fmt: skip
        # Leave a fifth of the time (at most 1 s) to parse the kept lines and hand them back.
        budget_end = ctx.deadline - min(1.0, 0.2 * ctx.remaining())
        try:
            _read_kmsg(fd, got, ctx, budget_end)
        finally:
            os.close(fd)
        return _kmsg_output(got, state)

    return Collector("kmsg", "kernel OOM lines from the ring buffer (/dev/kmsg, non-blocking), redacted", fn, 5.0)


def include_collector(state: State, path: str, index: int) -> Collector:
    o = state.options
    rel = f"raw/include/{index}-{os.path.basename(path.rstrip('/')) or 'file'}"
    return raw_files(f"include.{index}", f"copy of {path} (--include)", [(path, rel)], o.file_cap, 5.0)


# --------------------------------------------------------------------------- history


@dataclass
class History:
    files: dict[str, Path]  # kind -> staged jsonl
    rows: dict[str, int] = field(default_factory=dict)  # kind -> rows written
    bytes: int = 0
    oom_keys: set[tuple[int | None, int]] = field(default_factory=set)


def history_collector(state: State) -> Collector:
    """The flight recorder's last ``--since``, streamed (redacted per field) into staged ``timeline/*.jsonl``.

    One JSON record per line, one file per kind, oldest first: what ``diag.sources.load_bundle`` reads
    (the bundle's own analysis reads the folder with it, so findings.json is what ``diag analyze
    --bundle`` gives anywhere). Rows are decoded in batches (``parse_many``) for the redactor; a record
    no rule touches is written as it was stored. Over ``history_cap`` bytes the OLDEST rows are left out
    (the window starts later). Cancelled at its deadline, it stops at the next batch and returns what it
    has (marked truncated), so the main thread can adopt it.
    """
    o = state.options

    def fn(ctx: Context) -> Output:
        path = Path(o.recorder) if o.recorder is not None else default_recorder_path()
        if not path.exists():
            return Output(status="skipped", reason=f"no flight recorder at {path} (run `diag collect` to keep history)")
        try:
            FlightRecorder(path, readonly=True).close()
            return _stream_history(path, ctx)
        except (RecorderCorrupt, sqlite3.DatabaseError) as exc:
            why = exc if isinstance(exc, RecorderCorrupt) else f"{path} is not a readable flight recorder ({exc})"
            return Output(status="error", reason=f"history missing: {why}; the agent moves such a file aside on its "
                          "next start, or pass --recorder with another file")  # fmt: skip
        except PermissionError as exc:
            return Output(status="error", reason=f"history missing: cannot read {path}: {_describe(exc)}")

    def _stream_history(path: Path, ctx: Context) -> Output:
        since, truncated, skipped_rows = _window_under_cap(path, state.since, o.history_cap, ctx)
        hist = History({})
        cancelled = False
        handles: dict[str, Any] = {}
        state.staging.mkdir(parents=True, exist_ok=True)
        redactor = state.redactor
        try:
            with RecorderReader.open(path) as rec:
                rows = rec.rows(since=since)
                while chunk := list(itertools.islice(rows, 1000)):
                    if ctx.cancel.is_set():
                        cancelled = True
                        break
                    for (_ts, kind, body), parsed in zip(chunk, parse_many([r[2] for r in chunk]), strict=True):
                        k = kind if _KIND_RE.match(kind or "") else "unknown"
                        got = redactor.record_line(body, f"timeline/{k}.jsonl", parsed)
                        if got is None:
                            continue
                        line, obj = got
                        if obj.get("kind") != kind and isinstance(obj.get("kind"), str) and _KIND_RE.match(obj["kind"]):
                            k = obj["kind"]  # the record's own kind wins over the row's label
                        fh = handles.get(k)
                        if fh is None:
                            hist.files[k] = state.staging / f"{k}.jsonl"
                            fh = handles[k] = open(hist.files[k], "w", encoding="utf-8")  # noqa: SIM115 - closed below
                        fh.write(line)
                        fh.write("\n")
                        hist.rows[k] = hist.rows.get(k, 0) + 1
                        hist.bytes += len(line) + 1
                        if k == "oom":
                            hist.oom_keys.add(oom_key(obj))
        finally:
            for fh in handles.values():
                fh.close()
        total = sum(hist.rows.values())
        out = Output(extra={"history": hist, "rows": total, "bytes": hist.bytes, "recorder": str(path),
                            "since": since, "rows_left_out": skipped_rows})  # fmt: skip
        if cancelled:
            out.timeout_hit = True
            out.extra["truncated"] = True
            out.reason = f"stopped at its deadline after {total} rows: the newest records of the window are missing"
        elif truncated:
            out.reason = f"history over {o.history_cap} bytes: the oldest {skipped_rows} rows left out (window starts later)"
            out.extra["truncated"] = True
        if total == 0:
            out.status, out.reason = "skipped", f"the flight recorder {path} has no records in the window"
        return out

    return Collector("history", "flight recorder history (--since), as timeline/*.jsonl", fn, o.history_timeout_s)


def oom_key(obj: dict[str, Any]) -> tuple[int | None, int]:
    pid = obj.get("pid")
    return (pid if isinstance(pid, int) else None, round(float(obj.get("ts") or 0.0)))


def _window_under_cap(path: Path, since: float, cap: int, ctx: Context) -> tuple[float, bool, int]:
    """Move the window's start forward until the rows in it fit ``cap`` bytes of JSON (newest kept)."""
    with RecorderReader.open(path, timeout_s=5.0) as reader:
        total, count = reader.size_from(since)
        if total <= cap:
            return since, False, 0
        kept = rows = 0
        cutoff = since
        for ts, length in reader.lengths_newest_first(since):
            if rows % 5000 == 0:
                ctx.check()
            if kept + length > cap:
                break
            kept += length
            rows += 1
            cutoff = ts
        return cutoff, True, count - rows


# --------------------------------------------------------------------------- assembly


def phase_two(state: State) -> list[Collector]:
    o = state.options
    collectors = [
        cgroup_collector(state),
        pid_files_collector(state),
        gpu_collector(state),
        kmsg_collector(state),
        nvidia_smi_collector(state),
        journal_collector(state),
        history_collector(state),
    ]
    collectors += [include_collector(state, p, i) for i, p in enumerate(o.includes, 1)]
    return collectors
