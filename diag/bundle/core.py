"""Take an incident bundle: collect (volatile first), analyse, report, write, hash, archive -- within a deadline.

The time budget is split up front so that a slow phase cannot starve the ones after it:

    collection   up to 60 % of the deadline (volatile state first, at most 20 %)
    analysis     up to 80 %
    report       up to 90 % (charts are skipped, not waited for, when time is short; the page without
                 charts is then rendered, and a loaded host needs the last 10 % for it and the writing)
    writing      the rest: findings, report, redaction.json, manifest, SHA256SUMS, tar.gz

Every step that could hang runs under ``runner.run_collectors`` (abandonable workers); the main
thread only writes what came back, through the redactor. The bundle always completes: a step that
timed out is recorded (``timeout_hit``) and reported, never waited for.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import shutil
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.redact import redact_argv_counts
from diag.bundle.charts import ChartData
from diag.bundle.options import BundleOptions
from diag.bundle.plugin import Context, Output, Phase, State
from diag.bundle.plugins import PLUGINS
from diag.bundle.plugins.history import History, oom_key
from diag.bundle.plugins.processes import watched_pids
from diag.bundle.redactor import Redactor
from diag.bundle.runner import Collector, Run, collectors, run_collectors
from diag.bundle.selfcg import SelfCgroup, leave_watched
from diag.bundle.writer import BundleWriter, EarlyArchive

FORMAT = 1
Progress = Callable[[str], None]


def tool_version() -> str:
    try:
        from importlib.metadata import version

        return version("llm-diag")
    except Exception:
        return "unknown"


@dataclass
class BundleResult:
    root: Path
    archive: Path | None
    verdict: str
    headline: str
    manifest: dict[str, Any]
    duration_s: float
    runs: list[Run] = field(default_factory=list)


def _stamp(ts: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ts))


def _safe_host(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60] or "host"


class _Log:
    """Progress on stderr, and the same lines kept for the bundle's log.txt (redacted when written)."""

    def __init__(self, sink: Progress | None) -> None:
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        self.sink = sink

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.2f}s] {message}"
        self.lines.append(line)
        if self.sink is not None:
            self.sink(line)


def stderr_progress(line: str) -> None:
    print(f"diag bundle: {line}", file=sys.stderr, flush=True)


def take_bundle(options: BundleOptions, progress: Progress | None = stderr_progress) -> BundleResult:
    """Collect, analyse and write one bundle. Never raises for a collector problem; raises OSError when
    the output folder cannot be created (nothing else can be done then)."""
    _one_malloc_arena()
    log = _Log(progress)
    t0 = time.monotonic()
    started = time.time()
    deadline = options.deadline_s
    at = lambda share: t0 + share * deadline  # noqa: E731 - budget points, monotonic
    host = socket.gethostname()
    name = f"llm-diag-bundle-{_stamp(started)}-{_safe_host(host)}"
    root = Path(options.out_dir).resolve() / name
    redactor = Redactor()
    writer = BundleWriter(root, redactor)
    staging = root / ".staging" / "timeline"
    state = State(options, redactor, started, started - options.since_s, staging)
    log(f"writing {root} (deadline {deadline:g} s, history since {options.since_s:g} s)")

    # ---- never run inside the group we diagnose (explicit targets: before collecting anything)
    selfcg = SelfCgroup(None, None)
    if options.pids or options.cgroups:
        selfcg = _leave(options, [*options.cgroups, *_pid_groups(options)], log)

    # ---- phase 1: volatile state (the plugins declared VOLATILE: /proc copies and the sampler's snapshot)
    runs = run_collectors(collectors(PLUGINS, state, Phase.VOLATILE), at(0.2), log)
    if not (options.pids or options.cgroups):
        selfcg = _leave(options, [c.path for c in state.cgroups], log)

    # ---- phase 2: what the snapshot decides (group and process files), GPU, kernel, commands, history
    preload = _preload_analysis()
    runs += run_collectors(collectors(PLUGINS, state, Phase.AFTER_SNAPSHOT), at(0.6), log)

    # ---- write what came back: raw files, the history adopted, the snapshot's records appended
    counts = _write_collected(writer, runs, redactor, log)
    shutil.rmtree(root / ".staging", ignore_errors=True)

    # ---- the archive begins with the timeline (final now), in the background; the rest joins it at the end
    archive = EarlyArchive(writer, compresslevel=1) if options.tar else None  # level 1 vs 3: ~35 % less time, ~8 % more bytes
    if archive is not None:
        archive.begin("timeline/")

    # ---- analysis (abandonable): the folder read back the way `diag analyze --bundle` reads it
    analysis_doc, analysis_error, chart_data, tl_window = _analyse(root, at(0.8), runs, log, preload)
    findings_entry = None
    if analysis_doc is not None:
        findings_entry = writer.write_json("findings.json", analysis_doc, collector="analysis")
        analysis_doc = json.loads((root / findings_entry.path).read_text(encoding="utf-8"))  # report what was written
    else:
        writer.write_json("findings.json", {"error": analysis_error, "verdict": None}, collector="analysis")
    verdict = (analysis_doc or {}).get("verdict", {}).get("primary") or "unknown"

    # ---- report (abandonable: charts take time on a starved host)
    command, argv_counts = redact_argv_counts(list(options.argv) or ["diag", "bundle"])
    redactor.add_counts("manifest.json", argv_counts)
    notices = [w for w in (selfcg.warning,) if w]  # not `warnings`: this module uses the warnings module
    notices += [
        f"collector {r.name} timed out after {r.timeout_s:g} s: its data is missing or partial" for r in runs if r.timeout_hit
    ]
    if archive is not None:
        archive.wait()  # the timeline's hashes
    writer.hash_all()
    run_docs = [_run_doc(r, writer) for r in runs]
    from diag.bundle.report import ReportData

    window = tl_window if tl_window is not None and tl_window[1] else (state.since, started)
    data = ReportData(
        bundle_name=name, host=host, created=started, window=window, since_s=options.since_s, version=tool_version(),
        command=command, analysis=analysis_doc, analysis_error=analysis_error, runs=run_docs,
        redaction=redactor.report(), self_cgroup=selfcg.to_dict(), record_counts=counts, warnings=notices,
    )  # fmt: skip
    _report(writer, data, chart_data, at(0.9), runs, log)

    # ---- the tool's own log, redaction.json, manifest, SHA256SUMS, archive
    log(f"verdict: {verdict}")
    writer.write_text("log.txt", "\n".join(log.lines) + "\n", collector="bundle")
    writer.write_json("redaction.json", redactor.report(), collector="bundle")
    writer.hash_all()
    duration = time.monotonic() - t0
    about = {"host": host, "bundle": name, "created": started, "command": command, "window": window, "duration_s": duration,
             "verdict": verdict, "self_cgroup": selfcg.to_dict(), "timeline": counts}  # fmt: skip
    manifest = _manifest(about, options, state, runs, writer)
    writer.write_json("manifest.json", manifest, collector="bundle")
    writer.write_sums()
    archive_path = None
    if archive is not None:
        archive_path, _ = archive.finish()
        log(f"archive {archive_path}")
    from diag.views.analysis import verdict_headline

    said = (analysis_doc or {}).get("verdict") or {}
    headline = verdict_headline(verdict, said.get("suspects") or [], said.get("too_little_data") or [])
    return BundleResult(root, archive_path, verdict, headline, manifest, time.monotonic() - t0, runs)


# --------------------------------------------------------------------------- steps


def _manifest(about: dict[str, Any], options: BundleOptions, state: State, runs: list[Run],
              writer: BundleWriter) -> dict[str, Any]:  # fmt: skip
    """manifest.json: what was asked, what each collector did (timing, timeout, bytes, sha256), every file."""
    window, duration = about["window"], about["duration_s"]
    return {
        "format": FORMAT,
        "tool": "llm-diag",
        "version": tool_version(),
        "host": about["host"],
        "bundle": about["bundle"],
        "created": about["created"],
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(about["created"])),
        "command": about["command"],
        "window": {"requested_since_s": options.since_s, "start": window[0], "end": window[1]},
        "deadline_s": options.deadline_s,
        "duration_s": round(duration, 3),
        "deadline_exceeded": duration > options.deadline_s,
        "verdict": about["verdict"],
        "self_cgroup": about["self_cgroup"],
        "watched": {
            "pids": list(options.pids),
            "cgroups": list(options.cgroups) or [c.path for c in state.cgroups],
            "model_holders": watched_pids(state),
        },
        "collectors": [_run_doc(r, writer) for r in runs],
        "timeline": about["timeline"],
        "files": [vars(f) for f in sorted(writer.files.values(), key=lambda f: f.path)],
    }


def _pid_groups(options: BundleOptions) -> list[str]:
    from collectors.cgroup import parse_proc_cgroup
    from collectors.procfs import read_text, under

    groups = []
    for pid in options.pids:
        member = parse_proc_cgroup(read_text(under(options.proc_root, str(pid), "cgroup")).text)
        groups += [g for g in (member.v1_memory, member.v2) if g]
    return groups


def _leave(options: BundleOptions, groups: list[str], log: Progress) -> SelfCgroup:
    state = leave_watched(groups, options.proc_root, options.sys_root)
    if state.moved_to is not None:
        log(f"was inside the watched cgroup {state.inside}: moved this process to {state.moved_to}")
    if state.warning:
        log(f"WARNING: {state.warning}")
    return state


def _write_collected(writer: BundleWriter, runs: list[Run], redactor: Redactor, log: Progress) -> dict[str, int]:
    """Raw files through the redactor; staged history adopted; snapshot/GPU/kmsg records appended.

    Returns the records written per kind (timeline/<kind>.jsonl lines).
    """
    hist_run = next((r for r in runs if r.name == "history"), None)
    hist: History | None = None
    if hist_run is not None and hist_run.output is not None:
        hist = hist_run.output.extra.pop("history", None)
    counts: dict[str, int] = dict(hist.rows) if hist is not None else {}
    if hist is not None:
        truncated = bool(hist_run.output.extra.get("truncated"))  # type: ignore[union-attr]
        for kind, staged in hist.files.items():
            writer.adopt(f"timeline/{kind}.jsonl", staged, truncated=truncated, collector="history")
    seen_ooms = hist.oom_keys if hist is not None else set()
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    for run in runs:
        out = run.output
        if out is None:
            continue
        for f in out.files:
            if "\x00" in f.text:  # binary: the rules read text; what they cannot read is not shipped
                redactor.drop_file(f.path, f"binary content from {f.source or run.name}: not copied")
                continue
            writer.write_text(
                f.path, f.text, truncated=f.truncated, source=f.source, collector=run.name, masks=run.redaction.masks
            )
        lines: dict[str, list[str]] = {}
        for obj in out.records:
            kind = str(obj.get("kind") or "unknown")
            if kind == "oom" and oom_key(obj) in seen_ooms:
                continue  # the agent already recorded this kill
            clean = redactor.value(obj, f"timeline/{kind}.jsonl")
            lines.setdefault(kind, []).append(dumps(clean))
        for kind, batch in lines.items():
            writer.append_lines(f"timeline/{kind}.jsonl", batch, collector=run.name)
            counts[kind] = counts.get(kind, 0) + len(batch)
    counts = dict(sorted(counts.items()))
    log(f"timeline: {sum(counts.values())} records ({', '.join(f'{k} {n}' for k, n in counts.items())})")
    return counts


Window = tuple[float, float]


def _analyse(root: Path, deadline: float, runs: list[Run], log: Progress,
             preload: threading.Thread) -> tuple[dict[str, Any] | None, str | None, ChartData | None, Window | None]:  # fmt: skip
    """Read the bundle back with ``load_bundle``, run the rules, copy out what the charts need.

    Reading back (rather than keeping what was collected) makes findings.json what ``diag analyze
    --bundle`` gives on this folder anywhere, by construction. The Timeline is let go as soon as the
    rules and the chart extract are done, so the report step's memory does not stack on top of it.
    """
    holder: dict[str, Any] = {}

    def fn(ctx: Context) -> Output:
        # One importer of the rule modules at a time: the background imports are done first (normally long since).
        preload.join()
        from diag.bundle.charts import extract
        from diag.rules.engine import analyze
        from diag.sources import load_bundle

        tl = load_bundle(root)
        holder["window"] = (tl.start, tl.end)
        with warnings.catch_warnings(record=True) as caught:  # numpy's "All-NaN slice" and the like: to the log
            warnings.simplefilter("always")
            holder["doc"] = analyze(tl).to_dict()
        for w in {str(w.message) for w in caught}:
            log(f"analysis warning: {w}")
        holder["charts"] = extract(tl)
        return Output()

    budget = max(1.0, deadline - time.monotonic())
    (run,) = run_collectors(
        [Collector("analysis", "rules engine over the bundle's timeline", fn, budget)], time.monotonic() + budget, log
    )
    runs.append(run)
    if run.status == "ok" and "doc" in holder:
        return holder["doc"], None, holder.get("charts"), holder.get("window")
    return None, run.reason or run.status, None, holder.get("window")


def _preload_analysis() -> threading.Thread:
    """Import the rules and the loaders in the background while phase 2 runs.

    Why: the history plugin spends much of its time inside SQLite, which lets go of the GIL, and the
    analysis that follows it starts with ~0.25 s of imports; on a host with a core to spare the two overlap.
    Nothing is run but imports: a failure here is the analysis's to report, when it imports them again.
    """

    def load() -> None:
        with contextlib.suppress(Exception):
            from diag.rules.engine import load_rules
            from diag.rules.usl import load_curve  # noqa: F401 - imported for the charts' extract
            from diag.sources import load_bundle  # noqa: F401

            load_rules()

    thread = threading.Thread(target=load, name="bundle-preload", daemon=True)
    thread.start()
    return thread


M_ARENA_MAX = -8  # glibc mallopt parameter


def _one_malloc_arena() -> None:
    """Make every thread allocate from one glibc arena.

    Why: the history collector, the analysis and the report run in different worker threads, and glibc
    gives each thread its own arena; memory one phase frees is then not reused by the next, and the
    peak becomes the *sum* of the phases (measured: 167 MiB instead of ~125 MiB for an hour of history).
    A no-op where there is no glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)


def _report(writer: BundleWriter, data: Any, chart_data: ChartData | None, deadline: float, runs: list[Run],
            log: Progress) -> None:  # fmt: skip
    """report.md, then report.html with charts under the deadline; a page to open is always written."""
    from diag.bundle.report import render_html, render_markdown

    try:
        markdown = render_markdown(data)
    except Exception as exc:  # a template bug must not cost the bundle
        log(f"report.md failed: {type(exc).__name__}: {exc}")
        markdown = _plain_report(data, exc)
    writer.write_text("report.md", markdown, collector="report")
    holder: dict[str, Any] = {}

    def fn(ctx: Context) -> Output:
        holder["html"], holder["charts"] = render_html(data, chart_data)
        return Output(extra={"charts": holder["charts"]})

    budget = max(1.0, deadline - time.monotonic())
    (run,) = run_collectors([Collector("report", "report.html with charts (inline SVG)", fn, budget)],
                            time.monotonic() + budget, log)  # fmt: skip
    runs.append(run)
    if "html" in holder and run.status == "ok":
        writer.write_text("report.html", holder["html"], collector="report", html=True)
        log(f"report.html: {holder['charts']} charts")
        return
    try:  # charts timed out or failed: the same page without them
        html, _ = render_html(data, None)
    except Exception as exc:
        log(f"report.html failed: {type(exc).__name__}: {exc}")
        text = _plain_report(data, exc).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        head = '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>bundle</title></head>'
        html = f"{head}<body><pre>{text}</pre></body></html>\n"
    writer.write_text("report.html", html, collector="report", html=True)


def _plain_report(data: Any, exc: BaseException) -> str:
    """The verdict and the pointers to the files, when the templates cannot render."""
    analysis = data.analysis or {}
    verdict = (analysis.get("verdict") or {}).get("primary") or "unknown"
    return (
        f"# Incident bundle {data.bundle_name}\n\nVerdict: {verdict}\n\n"
        f"(The full report could not be rendered: {type(exc).__name__}: {exc}. The findings are in findings.json, "
        "what each collector did in manifest.json.)\n"
    )


def _run_doc(run: Run, writer: BundleWriter) -> dict[str, Any]:
    out = run.output
    files = [f for f in writer.files.values() if f.collector == run.name]
    doc: dict[str, Any] = {
        "name": run.name,
        "plugin": run.plugin,
        "description": run.description,
        "status": run.status,
        "reason": run.reason,
        "start": run.start,
        "end": run.end,
        "duration_s": run.duration_s,
        "timeout_s": run.timeout_s,
        "timeout_hit": run.timeout_hit,
        "abandoned": run.abandoned,
        "return_code": out.return_code if out else None,
        "exec": " ".join(out.argv) if out and out.argv else None,
        "bytes": sum(f.bytes for f in files),
        "truncated": any(f.truncated for f in files),
        "files": [{"path": f.path, "bytes": f.bytes, "sha256": f.sha256, "truncated": f.truncated} for f in files],
        "records": len(out.records) if out else 0,
    }
    if out is not None:
        doc["notes"] = {k: v for k, v in out.extra.items() if k != "history" and isinstance(v, (int, float, str, bool, list))}
    if len(files) == 1:
        doc["sha256"] = files[0].sha256
    return doc
