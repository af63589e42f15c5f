"""Placement family: how many copies of the model are resident, and whose pressure is it?

- ``duplicate_model_processes``: several processes, alive at the same time, hold the same model file
  (``ProcessTrack.model_files``) *and* their memory says each has a private copy. Holding the file is
  not enough: four workers mapping one shared read-only mmap each show the file and a big RSS, but
  their USS is small and their summed PSS is about one copy. The copy size comes from the service's
  own records (``ServiceConfig.settings["weights_bytes"]``, else the largest ``LoaderEvent.bytes_read``);
  without either, a holder whose private memory dominates its RSS (USS/RSS >= 0.6) counts as a private
  copy, and confidence is capped at 0.6 because the size is inferred. NVML's per-process GPU memory
  (``gpu_processes``) counts copies on a GPU the same way.
- ``noisy_neighbour``: the host's PSI (memory, and io as support) is up while the service cgroup's own
  memory PSI stays flat -- the stalls are someone else's -- and/or the host's MemAvailable falls while
  the service's usage does not. Other watched cgroups whose PSI rose are named as suspects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from diag.rules import levels, numstats, stats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.stall_signals import PSI_SOME_UP
from diag.timeline import ProcessTrack, Series, Timeline
from diag.units import format_bytes

PRIVATE_COPY_SHARE = 0.7  # a holder with USS >= 70 % of the model size holds a private copy (some pages may be untouched)
PRIVATE_DOMINANT = levels.PRIVATE_DOMINANT  # size unknown: USS/RSS at or above this: the big part is private
SHARED_COPY_SHARE = 0.5  # summed PSS - USS of the holders >= half a copy: the weights sit in a shared mapping
MATERIAL_WASTE_OF_LIMIT = 0.05  # the extra copies must cost >= 5 % of the limit to be an incident
GPU_COPY_SHARE = 0.10  # a process holding >= 10 % of a GPU is a candidate copy there
SIMILAR_HOLDINGS = 1.5  # copy size unknown: GPU holdings within 1.5x of each other look like copies of one model
FULL_COPIES_PSS = 0.9  # summed PSS >= 90 % of (copies x size): every copy is fully resident
SIMILAR_PRIVATE = 0.5  # copy size unknown: the smallest private copy >= half the largest
SMALL_COPY_CEILING = 0.4  # real duplication, but cheaper than MATERIAL_WASTE_OF_LIMIT: a suspect at most

HOST_PSI_ELEVATED = 5.0  # percent: the scenario's neighbour drives host memory PSI some to 5-20 %; idle hosts sit near 0
SERVICE_PSI_CALM = 1.0  # percent, and at most SERVICE_SHARE_OF_HOST of the host's
SERVICE_SHARE_OF_HOST = 0.25  # the service's PSI (or memory growth) at most a quarter of the host's (or of its drop)
HOST_HOT_SAMPLES = 3  # host PSI samples at or above HOST_PSI_ELEVATED: fewer is a blip
# A neighbour is a process that keeps taking memory; a stall of a few seconds (another job's start, a burst of
# reclaim) is an event on the host, not an incident of a service that kept serving. Measured: scenario neighbours
# keep host PSI up for 7-45 s without a break (even in 10 s windows), other jobs on a shared 2-core host stalled it
# for 3-5 s at a time. Shorter than this, the finding is a note, shown with its evidence.
HOST_SUSTAINED_S = 6.0
BRIEF_STALL_CEILING = 0.25  # a note: listed with its evidence, below both the suspect and the incident line
NEAREST_S = 5.0  # a service sample pairs with a host sample at most this far away
OWN_PRESSURE_CEILING = 0.45  # someone else's pressure may be real, but the service stalls on its own as well
AVAILABLE_LOW = 0.20  # MemAvailable under 20 % of MemTotal at the end
AVAILABLE_DROP = 0.05  # ... after falling by >= 5 % of MemTotal


# --------------------------------------------------------------------------- duplicate model processes


@dataclass
class Holder:
    track: ProcessTrack
    rss: float
    uss: float
    pss: float


def _model_size(timeline: Timeline, path: str) -> tuple[float | None, str]:
    sizes = []
    for cfg in timeline.configs:
        wb = cfg.settings.get("weights_bytes")
        mp = cfg.settings.get("model_path")
        if (
            isinstance(wb, (int, float))
            and wb > 0
            and (not mp or mp == path or str(mp).rsplit("/", 1)[-1] == path.rsplit("/", 1)[-1])
        ):
            sizes.append(float(wb))
    if sizes:
        return max(sizes), "ServiceConfig weights_bytes"
    t = timeline.loader
    if len(t) and "bytes_read" in t:
        read = t["bytes_read"][np.isfinite(t["bytes_read"])]
        if read.size and float(read.max()) > 0:
            return float(read.max()), "largest loader read (LoaderEvent bytes_read)"
    return None, "unknown"


def _at(series: Series | None, when: np.ndarray) -> float:
    """Median of the series at the given sample times (exact stamps: one agent snapshot shares one ts)."""
    if series is None:
        return math.nan
    s = series.valid()
    vals = s.values[np.isin(s.ts, when)]
    return float(numstats.median(vals)) if vals.size else math.nan


def _holders(tracks: list[ProcessTrack]) -> tuple[list[Holder], np.ndarray]:
    """The largest set of holders sampled together, with each one's median RSS/USS/PSS over those samples."""
    stamps = [t.series["rss"].valid().ts for t in tracks if "rss" in t.series]
    if not stamps:
        return [], np.empty(0)
    all_ts, counts = np.unique(np.concatenate(stamps), return_counts=True)
    most = int(counts.max())
    when = all_ts[counts == most]
    latest = when[-1]  # the set alive together at the last such sample (a rolling restart changes the set)
    out = []
    for t in tracks:
        if "rss" not in t.series or not np.isin(latest, t.series["rss"].ts):
            continue
        rss = _at(t.series.get("rss"), when)
        if math.isfinite(rss):
            out.append(Holder(t, rss, _at(t.series.get("uss"), when), _at(t.series.get("pss"), when)))
    return out, when


def _gpu_copies(timeline: Timeline, pids: set[int], size: float | None) -> tuple[int, list[Evidence]]:
    """Processes (model holders when known) holding a model-sized share of one GPU at the latest sample."""
    t = timeline.gpu_processes
    if not len(t):
        return 0, []
    last = t.select(t["ts"] == t["ts"].max())
    best, ev = 0, []
    for gpu in np.unique(last["gpu"]):
        rows = last.select(last["gpu"] == gpu)
        used = np.nan_to_num(rows["used_bytes"])
        total = timeline.gpus.get(int(gpu), {}).get("total")
        cap = total.last() if total is not None else math.nan
        if size:
            big = used >= PRIVATE_COPY_SHARE * size
        elif math.isfinite(cap):
            big = used >= GPU_COPY_SHARE * cap
        else:
            big = used > 0
        if pids:
            big &= np.isin(rows["pid"], list(pids))
        n = int(big.sum())
        if n >= 2 and (size or float(used[big].max()) <= SIMILAR_HOLDINGS * float(used[big].min())):
            desc = ", ".join(f"pid {int(p)}: {format_bytes(float(u))}" for p, u in zip(rows["pid"][big], used[big], strict=True))
            ev.append(
                Evidence(f"GPU {int(gpu)} processes holding a copy (NVML)", desc, "", float(last["ts"][0]), float(last["ts"][0]))
            )
            best = max(best, n)
    return best, ev


@rule(
    "placement.duplicate_models",
    "duplicate_model_processes",
    needs=("process:model_files",),
    needs_any=("process:uss", "process:pss", "gpu_processes"),
)
def duplicate_model_processes(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Several live processes hold the same model file, each with its own private copy (not a shared mmap)."""
    by_file: dict[str, list[ProcessTrack]] = {}
    for track in timeline.processes.values():
        for path in track.model_files:
            by_file.setdefault(path, []).append(track)
    scope = stats.service_scope(timeline, ac)
    results = []
    for path, tracks in by_file.items():
        holders, when = _holders(tracks)
        size, size_source = _model_size(timeline, path)
        gpu_n, gpu_ev = _gpu_copies(timeline, {t.pid for t in tracks}, size)
        if len(holders) < 2 and gpu_n < 2:
            continue
        results.append(_judge(timeline, scope, path, holders, when, size, size_source, gpu_n, gpu_ev))
    found = [r for r in results if r is not None]
    return max(found, key=lambda f: f.confidence) if found else None


def _judge(
    timeline: Timeline,
    scope: stats.Scope,
    path: str,
    holders: list[Holder],
    when: np.ndarray,
    size: float | None,
    size_source: str,
    gpu_n: int,
    gpu_ev: list[Evidence],
) -> Finding | None:
    """A finding for one model file held by several processes, or None when the copies are shared or too cheap."""
    n = len(holders)
    start, end = (float(when[0]), float(when[-1])) if when.size else (timeline.start, timeline.end)
    sum_pss = float(np.nansum([h.pss for h in holders]))
    sum_uss = float(np.nansum([h.uss for h in holders]))
    ev = [
        Evidence("model file", path, "", start, end),
        Evidence("processes holding it at the same time", n, "processes", start, end),
        Evidence(
            "per holder RSS / USS / PSS",
            "; ".join(
                f"pid {h.track.pid}: {format_bytes(h.rss)} / {format_bytes(h.uss)} / {format_bytes(h.pss)}" for h in holders
            ),
            "",
            start,
            end,
        ),
        Evidence("summed USS of the holders", round(sum_uss), "bytes", start, end),
        Evidence("summed PSS of the holders", round(sum_pss), "bytes", start, end),
    ]
    group = stats.track_cgroup(timeline, holders[0].track) if holders else None
    limit, limit_source = stats.limit_for(timeline, group if group in timeline.cgroups else None)
    # The holders' share of *shared* pages: with one shared mmap it contains the model (sum ~ libs + one
    # copy); with private copies only the interpreter's shared libraries (tens of MiB).
    shared_part = float(np.nansum([h.pss - h.uss for h in holders if math.isfinite(h.pss) and math.isfinite(h.uss)]))
    ev.append(Evidence("summed shared share of the holders (PSS - USS)", round(shared_part), "bytes", start, end))
    counted = (
        _copies_of_known_size(holders, size, size_source, shared_part, sum_pss, gpu_n, limit, (start, end))
        if size
        else _copies_by_private_share(holders, shared_part, gpu_n, limit, (start, end))
    )
    if counted is None:
        return None
    copies, waste, conf, copy_ev = counted
    ev += copy_ev
    ev += gpu_ev
    if limit:
        ev.append(Evidence(f"extra copies' cost vs {limit_source}", round(waste / limit, 3), "ratio", start, end))
    shared_note = (
        "a shared mmap would put the weights in the holders' shared pages;"
        f" their summed PSS - USS is only {format_bytes(shared_part)}"
        if size
        else "a shared mmap: each holder's private memory (USS) dominates its RSS"
    )
    return Finding(
        "duplicate_model_processes",
        "placement.duplicate_models",
        min(conf, 0.95),
        f"{copies} processes each hold a private copy of {path.rsplit('/', 1)[-1]}: ~{format_bytes(waste)} spent on extra copies",
        ev,
        [f"one shared copy: {shared_note}"],
        [
            "Load the model once and share it: preload in the parent before forking workers, or mmap the weights read-only "
            "(safetensors) so every worker maps the same page-cache copy.",
            "Or run one process with more threads/async concurrency instead of N worker processes.",
            "On GPUs, one engine per device: several processes each loading the model multiply its memory.",
        ],
        start,
        end,
    )


def _copies_of_known_size(
    holders: list[Holder],
    size: float,
    size_source: str,
    shared_part: float,
    sum_pss: float,
    gpu_n: int,
    limit: float | None,
    span: tuple[float, float],
) -> tuple[int, float, float, list[Evidence]] | None:
    """(copies, bytes spent on extra copies, confidence, evidence) when one copy's size is known.

    Why the shared share decides first: with one shared mmap the holders' PSS - USS holds the model,
    and their private memory (USS) is interpreter, not weights -- so no holder counts as a copy.
    None: one private copy at most (a shared mmap or a single loader), which is not duplication.
    """
    start, end = span
    ev = [Evidence(f"one copy ({size_source})", round(size), "bytes", start, end)]
    sharing = shared_part >= SHARED_COPY_SHARE * size
    private = [h for h in holders if math.isfinite(h.uss) and h.uss >= PRIVATE_COPY_SHARE * size]
    copies = 0 if sharing else len(private)  # a shared copy: the holders' USS is interpreter, not weights
    if not (copies >= 2 or gpu_n >= 2):
        return None
    ev.append(Evidence("summed PSS / one copy", round(sum_pss / size, 2), "copies", start, end))
    conf = 0.75
    if copies == len(holders):
        conf += 0.1
    if sum_pss >= FULL_COPIES_PSS * copies * size:
        conf += 0.05
    if gpu_n >= 2:
        conf += 0.05
    copies = max(copies, gpu_n)
    waste = (copies - 1) * size
    if limit and waste < MATERIAL_WASTE_OF_LIMIT * limit:
        conf = min(conf, SMALL_COPY_CEILING)  # real duplication, but too cheap to be anyone's incident
    return copies, waste, conf, ev


def _copies_by_private_share(
    holders: list[Holder], shared_part: float, gpu_n: int, limit: float | None, span: tuple[float, float]
) -> tuple[int, float, float, list[Evidence]] | None:
    """(copies, bytes spent on extra copies, confidence, evidence) when one copy's size is unknown.

    Without a size, a copy is a holder whose private memory dominates its RSS, the holders' private
    sizes are similar, and the extra copies cost a material share of the limit; a lower confidence
    than with a known size, since an interpreter's private heap looks the same. None otherwise.
    """
    start, end = span
    ev = []
    ratios = [h.uss / h.rss for h in holders if math.isfinite(h.uss) and h.rss > 0]
    private = [h for h in holders if math.isfinite(h.uss) and h.rss > 0 and h.uss / h.rss >= PRIVATE_DOMINANT]
    if private and shared_part >= SHARED_COPY_SHARE * float(np.median([h.uss for h in private])):
        private = []  # as much shared as private: a shared mapping carries the weights
    uss = [h.uss for h in private]
    copies = len(private)
    similar = copies >= 2 and min(uss) >= SIMILAR_PRIVATE * max(uss)
    waste = (copies - 1) * float(np.median(uss)) if copies >= 2 else 0.0
    material = bool(limit) and waste >= MATERIAL_WASTE_OF_LIMIT * limit
    if ratios:
        ev.append(Evidence("median USS / RSS of the holders", round(float(np.median(ratios)), 3), "ratio", start, end))
    if not ((similar and material) or gpu_n >= 2):
        return None
    ev.append(
        Evidence(
            "one copy", "unknown: no ServiceConfig weights_bytes or loader reads; private memory used instead", "", start, end
        )
    )
    return max(copies, gpu_n), waste, 0.6, ev


# --------------------------------------------------------------------------- noisy neighbour


def _nearest(series: Series, ts: np.ndarray) -> np.ndarray:
    """Value of ``series`` at the sample nearest each of ``ts`` (NaN if none within 5 s)."""
    s = series.valid()
    if not len(s):
        return np.full(ts.size, np.nan)
    idx = np.clip(np.searchsorted(s.ts, ts), 1, len(s) - 1) if len(s) > 1 else np.zeros(ts.size, dtype=int)
    if len(s) > 1:
        left = idx - 1
        idx = np.where(np.abs(s.ts[left] - ts) <= np.abs(s.ts[idx] - ts), left, idx)
    out = s.values[idx].astype(np.float64)
    out[np.abs(s.ts[idx] - ts) > NEAREST_S] = np.nan
    return out


@dataclass
class _Case:
    """What the noisy-neighbour checks found so far: evidence, reasons for the summary, exclusions, confidence."""

    ev: list[Evidence] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    rules_out: list[str] = field(default_factory=list)
    conf: float = 0.0
    psi_split: bool = False
    longest_s: float = math.inf  # the longest unbroken stretch of elevated host PSI (inf: PSI not judged)


def _longest_run_s(ts: np.ndarray, hot: np.ndarray) -> float:
    """Seconds covered by the longest run of consecutive ``hot`` samples, each counted for one sampling step."""
    step = float(np.median(np.diff(ts))) if ts.size > 1 else 0.0
    best, start = 0.0, None
    for i, h in enumerate(hot):
        if h and start is None:
            start = i
        if start is not None and (not h or i == hot.size - 1):
            end = i if h else i - 1
            best = max(best, float(ts[end] - ts[start]) + step)
            start = None
    return best


def _psi_split(timeline: Timeline, groups: list[str], case: _Case) -> None:
    """Host memory stalls that the service does not share."""
    host_mem = stats.stall_percent(timeline.host, "psi.memory.some")
    if not len(host_mem):
        return
    hot = host_mem.values >= HOST_PSI_ELEVATED
    if int(hot.sum()) < HOST_HOT_SAMPLES:
        return
    hot_ts = host_mem.ts[hot]
    svc = np.nanmax(
        np.vstack([_nearest(stats.stall_percent(timeline.cgroups[g], "psi.memory.some"), hot_ts) for g in groups]), axis=0
    )
    host_level = float(np.median(host_mem.values[hot]))
    case.longest_s = _longest_run_s(host_mem.ts, hot)
    svc_level = float(np.nanmedian(svc)) if np.isfinite(svc).any() else math.nan
    t0, t1 = float(hot_ts[0]), float(hot_ts[-1])
    case.ev.append(
        Evidence("host memory PSI some while elevated, median", round(host_level, 2), "%", t0, t1, stats.excerpt(host_mem))
    )
    case.ev.append(
        Evidence(
            f"service cgroup memory PSI some at the same times, median ({', '.join(groups)})",
            round(svc_level, 2) if math.isfinite(svc_level) else None,
            "%",
            t0,
            t1,
        )
    )
    if math.isfinite(svc_level) and svc_level <= max(SERVICE_PSI_CALM, SERVICE_SHARE_OF_HOST * host_level):
        case.psi_split = True
        case.conf = 0.65
        case.reasons.append(
            f"host memory PSI some {host_level:.1f} % in {int(hot.sum())} samples while the service's stays at {svc_level:.1f} %"
        )
    else:
        case.rules_out.append(
            f"noisy_neighbour: the service's own memory PSI ({svc_level:.1f} %) rose with the host's"
            " -- the pressure is (also) ours"
        )


def _host_drained(timeline: Timeline, groups: list[str], case: _Case) -> None:
    """Host memory drained by someone else: MemAvailable fell while the service's own memory did not grow."""
    total = stats.host_total(timeline)
    avail = timeline.host.get("memory.available")
    if not total or avail is None or len(avail.valid()) < stats.MIN_SAMPLES:
        return
    a0, a1 = stats.edge_level(avail, "first"), stats.edge_level(avail, "last")
    drop = a0 - a1
    svc_change = 0.0
    for g in groups:
        cg = timeline.cgroups[g]
        mem = cg.get("working_set") or cg.get("usage")
        if mem is not None and len(mem.valid()):
            svc_change += stats.edge_level(mem, "last") - stats.edge_level(mem, "first")
    if not (drop >= AVAILABLE_DROP * total and a1 <= AVAILABLE_LOW * total and svc_change <= SERVICE_SHARE_OF_HOST * drop):
        return
    case.conf = 0.8 if case.psi_split else 0.55
    t0, t1 = float(avail.ts[0]), float(avail.ts[-1])
    case.ev.append(
        Evidence("host MemAvailable start -> end", f"{format_bytes(a0)} -> {format_bytes(a1)}", "", t0, t1, stats.excerpt(avail))
    )
    case.ev.append(Evidence("service cgroup memory change over the same time", round(svc_change), "bytes", t0, t1))
    case.reasons.append(
        f"host MemAvailable fell {format_bytes(drop)} to {format_bytes(a1)} while the service's memory changed "
        f"{format_bytes(svc_change)}"
    )


@rule(
    "placement.noisy_neighbour",
    "noisy_neighbour",
    needs=("cgroup:psi.memory.some.avg10",),
    needs_any=("host:psi.memory.some.avg10", "host:psi.io.some.avg10"),
)
def noisy_neighbour(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Host pressure up while the service cgroup's own PSI and memory stay flat: someone else's pressure."""
    scope = stats.service_scope(timeline, ac)
    groups = [g for g in scope.cgroups if len(stats.stall_percent(timeline.cgroups[g], "psi.memory.some"))]
    if not groups:
        return None
    host_io = stats.stall_percent(timeline.host, "psi.io.some")
    case = _Case()
    _psi_split(timeline, groups, case)
    _host_drained(timeline, groups, case)
    ev, reasons, rules_out, conf = case.ev, case.reasons, case.rules_out, case.conf
    if conf <= 0:
        return None
    own = [(g, stats.stall_percent(timeline.cgroups[g], "psi.memory.some")) for g in groups]
    own_hot = [(g, float(p.values.max())) for g, p in own if stats.sustained_above(p, PSI_SOME_UP)[0]]
    if own_hot:
        reasons.append(
            "but the service has memory pressure episodes of its own ("
            + ", ".join(f"{g} up to {m:.0f} %" for g, m in own_hot)
            + ")"
        )
    if len(host_io) and stats.sustained_above(host_io, HOST_PSI_ELEVATED)[0]:
        conf += 0.05
        ev.append(
            Evidence(
                "host io PSI some, max", round(float(host_io.values.max()), 2), "%", float(host_io.ts[0]), float(host_io.ts[-1])
            )
        )
        reasons.append("host io pressure up too")
    suspects = []
    for g, cg in timeline.cgroups.items():
        if g in scope.cgroups or g == "/":
            continue
        psi = stats.stall_percent(cg, "psi.memory.some")
        if len(psi) and stats.sustained_above(psi, HOST_PSI_ELEVATED)[0]:
            suspects.append(f"{g} (memory PSI some up to {float(psi.values.max()):.0f} %)")
    if suspects:
        conf += 0.05
        ev.append(Evidence("other watched cgroups under pressure", "; ".join(suspects), "", timeline.start, timeline.end))
    if case.psi_split and case.longest_s < HOST_SUSTAINED_S and conf < 0.8:
        conf = min(conf, BRIEF_STALL_CEILING)
        reasons.append(f"but the host's stalls lasted at most {case.longest_s:.0f} s at a time: a brief event, not a neighbour")
    if own_hot:
        conf = min(conf, OWN_PRESSURE_CEILING)
    else:
        rules_out.append("memory_pressure / thrashing of the service: its own cgroup PSI stayed flat")
    return Finding(
        "noisy_neighbour",
        "placement.noisy_neighbour",
        min(conf, 0.9),
        "The pressure is someone else's: " + "; ".join(reasons) + (f"; suspects: {', '.join(suspects)}" if suspects else ""),
        ev,
        rules_out,
        [
            "Isolate the neighbour: give it a memory limit with memory.high below it so it reclaims its own pages.",
            "Protect the service with memory.low / memory.min (cgroup v2) so reclaim takes from others first.",
            "Move the service (or the neighbour) to another host, or pin them to separate NUMA nodes/CPUs.",
        ],
        timeline.start,
        timeline.end,
    )
