"""Build a Timeline from a Prometheus server (``/api/v1/query_range``): the fleet-scale path.

Why: at fleet scale nobody copies flight recorders around -- the agent's and the tracker's
``/metrics`` are already scraped into Prometheus, so ``diag analyze --prometheus URL --selector
'job="llm"'`` rebuilds the same Timeline from there and the same rules run on it. Metric names come
only from ``collectors.catalog`` (ours, and the external families declared there); below they are
named by their catalog entries (``cat.X``). The series keys they fill are spelt by ``diag.timeline.signals``
(``sig.X``), the vocabulary the rules ask in, so a Prometheus-built Timeline names a signal exactly
as a recorder-built one does.

What is filled, and from what (ours first; the external family only where ours is absent):

- ``host``: ``memory.<snake>`` (bytes) from ``cat.HOST_MEMORY`` or node_exporter's ``cat.NODE_MEMORY``;
  ``psi.<res>.some.total_s`` / ``psi.<res>.full.total_s`` (cumulative seconds) from
  ``cat.HOST_PSI_WAITING``/``_STALLED`` or ``cat.NODE_PSI_*``; ``psi.<res>.<kind>.avg10`` (percent)
  from ``cat.HOST_PSI_AVG10`` x 100, or -- node_exporter exports no averages -- derived as
  ``rate(total[W]) x 100`` (an average over the rate window W, not the kernel's 10 s EWMA);
  ``vmstat.<field>`` (cumulative) from ``cat.HOST_VMSTAT`` or ``cat.NODE_VMSTAT``.
- ``cgroups[path]``: ``usage``, ``working_set``, ``limit``, ``high``, ``peak``, ``swap``, ``stat.<key>``,
  ``events.<key>`` / ``events_local.<key>``, ``under_oom``, ``psi.memory.<kind>.total_s`` from the
  ``cat.CGROUP_*`` families (label ``cgroup``); else cAdvisor (``cat.CADVISOR_*``, label ``id``):
  usage, working_set, swap, limit (0 = unlimited there, so zeros are dropped), memory PSI totals.
  Exporters give cgroup PSI as totals only, so ``psi.memory.<kind>.avg10`` is derived as
  ``rate(total[W]) x 100`` (percent; an average over W, not the kernel's 10 s EWMA).
- ``processes``: one track per (pid, comm) from ``cat.PROCESS_*`` (rss, pss, uss, swap,
  major_faults), keyed ``"<pid>@<comm>"``. Prometheus has no process start time, so a pid reused by
  a program with the same comm continues the same track, and ``cmdline``/``memory_cgroup``/
  ``model_files`` are unknown (empty). Limitation: ``cat.MODEL_PROCESSES{model}`` says how many
  processes hold each model file but not *which* pids, so it goes to
  ``service["model_processes:<model path>"]`` instead of ``ProcessTrack.model_files``.
- ``gpus[index]``: ``total``/``used``/``free``/``reserved`` (bytes), ``util_gpu``/``util_memory``
  (0-1) from ``cat.GPU_MEMORY``/``cat.GPU_UTILIZATION``; else DCGM ``cat.DCGM_FB_USED``/``_FREE``
  (MiB x 2^20). ``gpu_processes`` from ``cat.GPU_PROCESS_MEMORY``. ``cat.GPU_AVAILABLE`` = 0
  throughout sets ``gpu_unavailable_reason``.
- ``ooms``: kills cannot be rebuilt as kernel events. Each increase of ``cat.OOM_KILLS{constraint}``
  becomes that many synthetic ``OomEvent(ts, constraint=..., source="prometheus")`` at the step
  where the increase was seen (no pid, task or memcg); else the same from node_exporter's
  ``cat.NODE_VMSTAT["oom_kill"]`` (constraint unknown). ``counts["host"]`` is set (to the number of
  steps) only when such a counter was observed: that is what makes ``ooms`` an evaluated signal,
  where "no event" then means "no kill".
- ``service`` (request side, summed over every target the selector matches -- the service, not one
  process), with W = the rate window (4 x step, at least 4 scrape intervals), from the feeds of
  ``collectors.backends.FEEDS`` -- ours, vLLM's, TGI's and llama.cpp's families, the first with data
  filling each signal, the same table the agent's recorded scrapes are read by
  (``diag.timeline.backends``), so both paths name and mean a signal alike:

  ========= =================================================================== ==================
  how       query                                                               fills
  ========= =================================================================== ==================
  histogram histogram_quantile(0.5 | 0.95, sum by (le) (rate(<bucket>[W]))),     <stem>_p50_s,
            sum(rate(<sum>[W])) / sum(rate(<count>[W]))                         _p95_s, _mean_s
  rate      sum(rate(<counter>{select}[W]))                                     requests_rps,
                                                                                throughput_rps ...
  gauge     sum(<gauge>{select}), max() for a ratio (KV-cache usage)            queue_depth, kv ...
  ratio     sum(rate(<a>[W])) / sum(rate(<b>[W]))                               prefix-cache hits,
                                                                                itl_mean_s
  sum_rate  sum(rate(<histogram>_sum[W]))                                       tokens per second
  ========= =================================================================== ==================

  plus ``model_processes:<m>`` from cat.MODEL_PROCESSES{model=m}, this host. Quantiles are NaN (so
  absent) in windows without requests. An outcome series exists once the exporter created it (our
  tracker creates every outcome at 0 with the first request). vLLM names are queried both as declared
  and with ``:`` escaped to ``_`` (see ``_variants``).

Host-level series (host, cgroups, processes, GPUs, OOMs) describe *one* machine. Targets are grouped
by host (the ``instance`` label without its port, so the agent and a cAdvisor on the same machine
combine); when the selector matches several hosts, the one with the most samples is used and
``timeline.source`` says so -- narrow ``--selector`` (``instance=~"10.0.0.5:.*"``) to choose.

For every target at once (``diag analyze --fleet``), ``diag.sources.fleet`` runs this query set once for the
whole fleet and splits the results per target, each assembled here.

A series absent from Prometheus is absent from the Timeline (never zeros). An unreachable server,
an HTTP error or a Prometheus ``status: error`` raises ``ValueError`` with a one-line reason.

Long-term stores speak the same API with limits of their own (VictoriaMetrics' ``-search.max*`` flags,
Thanos' and Mimir's series and sample limits): a refusal over such a limit is named in one line with what to
change (a shorter ``--since`` for a points limit, narrower matchers for a series limit) instead of the store's
whole error text, and a reply marked ``isPartial`` (a VictoriaMetrics cluster with a storage node down) is
refused, since rules reading part of the series would give a verdict the data does not support. Extra request
headers (``request_headers``: ``--header``, ``--tenant`` as ``X-Scope-OrgID`` for Mimir, Cortex and Thanos'
receive and query-frontend) go with every request and are never shown: they usually carry a bearer token.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from collectors import backends as bk
from collectors import catalog as cat
from collectors.records import OomEvent
from diag.timeline import Series, Timeline, TimelineBuilder
from diag.timeline import signals as sig
from diag.units import format_duration, is_loopback

log = logging.getLogger(__name__)

MAX_POINTS = 11_000  # Prometheus refuses a range query with more points per series
TARGET_POINTS = 10_000  # what the default step aims for (a margin under MAX_POINTS)
DEFAULT_SCRAPE_S = 15.0  # assumed when no sample is found to measure the scrape interval
PROBE_WINDOW_S = 600.0  # how far back the scrape-interval probe looks
MIB = float(1 << 20)
_NAME_OK = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]*$")
TENANT_HEADER = "X-Scope-OrgID"  # the tenant of Mimir, Cortex and Thanos' receive and query-frontend
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)
# Headers the HTTP client writes itself (a second copy would make a malformed or smuggled request).
_CLIENT_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})
_TENANT = re.compile(r"^[A-Za-z0-9!_.*'()|-]{1,150}$")  # Mimir's tenant ID characters; | joins tenants
# A store's refusal over one of its limits -> what the user can change. VictoriaMetrics names its flag
# (``cannot exceed -search.maxPointsPerTimeseries=40``); Prometheus' and Thanos' own points limit is 11 000.
_POINTS_LIMIT = re.compile(r"too many points .*?: (\d+); cannot exceed -search\.maxPointsPerTimeseries=(\d+)")
_FLAG_LIMIT = re.compile(r"-search\.(maxSamplesPerQuery|maxSeries|maxQueryLen|maxMemoryPerQuery|maxTagValues)(?:=(\d+))?")
_SERIES_LIMIT = re.compile(r"number of matching timeseries exceeds (\d+)")
_OTHER_LIMITS = re.compile(r"(max[-_ ]?series|max[-_ ]?samples|maximum number of (series|samples|chunks)|limit: \d+|"
                           r"exceeded maximum resolution|query.*too (large|long)|err-mimir-[a-z-]+)", re.IGNORECASE)  # fmt: skip

# Catalog keys -> the signal keys of diag.timeline.signals (the catalog's words for a part are not the Timeline's
# spelling; tests/diag/test_signal_vocabulary.py checks every catalog key has its entry here).
_CADVISOR_KEYS = {"usage": sig.CG_USAGE, "working_set": sig.CG_WORKING_SET, "swap": sig.CG_SWAP, "limit": sig.CG_LIMIT}
_GPU_MEMORY_KEYS = {"total": sig.GPU_TOTAL, "used": sig.GPU_USED, "free": sig.GPU_FREE, "reserved": sig.GPU_RESERVED}
_GPU_UTIL_KEYS = {"gpu": sig.GPU_UTIL_GPU, "memory": sig.GPU_UTIL_MEMORY}  # by the ``resource`` label
_QUANTILES = ((0.5, "p50"), (0.95, "p95"))  # (quantile, the stat of diag.timeline.signals.latency)
# Request outcomes (the tracker's ``outcome`` label) -> the service rate filled from that outcome alone (read from
# the feeds: what collectors.backends selects on our request counter).
_OUTCOME_RATES = {
    feed.select[0][1][0]: feed.signal
    for feed in bk.FEEDS
    if feed.family is bk.OURS_REQUESTS and feed.select and len(feed.select[0][1]) == 1
}


def default_step(since_s: float, scrape_s: float = 1.0) -> float:
    """Resolution of the range queries: one point per scrape, but never more than TARGET_POINTS per series.

    A step below the scrape interval only repeats samples (inflating sample counts the rules rely on).
    """
    return max(1.0, scrape_s, since_s / TARGET_POINTS)


@dataclass
class _Result:
    """One series of a range query: its labels and its samples (NaN-free, ascending time)."""

    labels: dict[str, str]
    ts: np.ndarray
    values: np.ndarray

    @property
    def name(self) -> str:
        return self.labels.get("__name__", "")

    @property
    def host(self) -> str:
        return _host_of(self.labels.get("instance", ""))


def _host_of(instance: str) -> str:
    """``10.0.0.5:9464`` -> ``10.0.0.5``; ``[::1]:9100`` -> ``[::1]``; no port -> as is."""
    m = re.match(r"^(.*?):\d+$", instance)
    return m.group(1) if m else instance


def _normalise_selector(selector: str) -> str:
    sel = selector.strip()
    if sel.startswith("{") and sel.endswith("}"):
        sel = sel[1:-1].strip()
    return sel.rstrip(",").strip()


def _fmt_duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds * 1000))}ms"


def request_headers(headers: Sequence[str] = (), tenant: str | None = None) -> dict[str, str]:
    """``--header 'Name: value'`` (repeatable) and ``--tenant ID`` as the headers of every query.

    Why checked here, before any query: a header the HTTP layer would refuse or mangle (a line break, no colon)
    otherwise fails mid-analysis, or is sent as something else. The messages never repeat a value -- it is
    usually a bearer token -- only the header's position and name. Raises ValueError (one line).
    """
    out: dict[str, str] = {}
    seen: dict[str, str] = {}  # lower-case name -> the name as given
    for i, text in enumerate(headers, 1):
        name, colon, value = text.partition(":")
        name, value = name.strip(), value.strip()
        where = f"--header ({_ordinal(i)})"
        if not colon or not name:
            raise ValueError(f"{where}: expected 'Name: value', e.g. 'Authorization: Bearer <token>' (value not shown)")
        if not _HEADER_NAME.match(name):
            raise ValueError(f"{where}: the name before ':' is not an HTTP header name (letters, digits, - and _)")
        where = f"--header ({_ordinal(i)}, {name})"  # the name is shown once it is known to be one, never the value
        if name.lower() in _CLIENT_HEADERS:
            raise ValueError(f"{where}: set by the HTTP client itself; give another header")
        if not value:
            raise ValueError(f"{where}: empty value")
        if any(ord(c) < 32 or ord(c) == 127 for c in value) or not value.isascii():
            raise ValueError(f"{where}: the value holds control or non-ASCII characters (value not shown)")
        if name.lower() in seen:
            raise ValueError(f"{where}: given twice; give each header once")
        seen[name.lower()] = name
        out[name] = value
    if tenant is not None:
        if TENANT_HEADER.lower() in seen:
            raise ValueError(f"--tenant and --header {TENANT_HEADER}: the same header twice; give one of them")
        if not _TENANT.match(tenant):
            raise ValueError("--tenant: 1-150 letters, digits or !-_.*'() (tenants joined with |; value not shown)")
        out[TENANT_HEADER] = tenant
    return out


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th, 21st: which of the repeated options a message is about."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _on_loopback(base: str) -> bool:
    """True when the server is this machine (127.0.0.0/8, ::1, localhost): its replies are then asked uncompressed.

    Why: Prometheus and VictoriaMetrics gzip a reply whenever the client accepts it, and over loopback that buys
    nothing -- the server spends its CPU compressing (measured at 200 targets: 398 MiB of JSON to 16 MiB) and this
    process decompresses, on the cores they share. Over a network the compression is kept: there it saves the
    transfer."""
    return is_loopback(urlsplit(base).hostname or "")


class _Prometheus:
    """A thin query client: every failure becomes a ValueError with a one-line reason.

    ``headers`` go with every request (authentication, the tenant) and appear in no message or log line.
    """

    def __init__(self, url: str, selector: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> None:
        base = url.strip().rstrip("/")
        if not re.match(r"^https?://[^/]+", base):
            raise ValueError(f"--prometheus {url!r}: expected a base URL such as http://127.0.0.1:9090")
        self.base = base
        self.selector = _normalise_selector(selector)
        self.timeout_s = timeout_s
        self.authenticated = bool(headers)
        # No redirects while headers are set: httpx drops Authorization when a redirect changes the host, but
        # not a token in another header (X-Api-Key ...), which would follow the redirect to the other host.
        sent = dict(headers or {})
        if _on_loopback(base) and not any(k.lower() == "accept-encoding" for k in sent):
            sent["Accept-Encoding"] = "identity"  # see ``_on_loopback``
        self.http = httpx.Client(timeout=timeout_s, follow_redirects=not headers, trust_env=False,
                                 headers=sent)  # fmt: skip
        self.queries = 0

    def close(self) -> None:
        self.http.close()

    # ---- PromQL helpers (names always come from the catalog)

    def sel(self, name: str, extra: str = "") -> str:
        """``name{selector,extra}`` (a ``{__name__=~...}`` form for names that can appear escaped, see ``_variants``)."""
        names = _variants(name)
        matchers = ",".join(m for m in (self.selector, extra) if m)
        if len(names) == 1:
            return f"{name}{{{matchers}}}"
        return self.sel_names(names, extra)

    def sel_names(self, names: Iterable[str], extra: str = "") -> str:
        """``{__name__=~"a|b|c",selector}``: one query for many families (results keep ``__name__``)."""
        every = sorted({v for n in names for v in _variants(n)})
        regex = "|".join(every)
        matchers = ",".join(m for m in (f'__name__=~"{regex}"', self.selector, extra) if m)
        return f"{{{matchers}}}"

    # ---- HTTP

    def _count(self) -> None:
        self.queries += 1

    def _post(self, where: str, params: dict[str, Any]) -> httpx.Response:
        return self.http.post(where, data=params)

    def _call(self, path: str, params: dict[str, Any]) -> Any:
        self._count()
        where = f"{self.base}{path}"
        try:
            resp = self._post(where, params)
        except httpx.TimeoutException:
            raise ValueError(f"Prometheus at {self.base} did not answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach Prometheus at {self.base}: {exc}") from None
        try:
            body = self._decode(resp)
        except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
            body = None
        if isinstance(body, dict) and body.get("status") == "error":
            raise ValueError(self._refusal(params, body))
        if resp.status_code in (301, 302, 303, 307, 308) and self.authenticated:
            raise ValueError(f"Prometheus at {self.base} redirected {path} to another address; with --header/--tenant "
                             "redirects are not followed (the headers would go along): give the final URL")  # fmt: skip
        if resp.status_code in (401, 403):
            given = "the --header/--tenant given were refused" if self.authenticated else "give --header/--tenant"
            raise ValueError(f"Prometheus at {self.base} answered HTTP {resp.status_code} for {path} "
                             f"({'unauthorized' if resp.status_code == 401 else 'forbidden'}: {given})")  # fmt: skip
        if resp.status_code != 200:
            hint = " (is this a Prometheus server?)" if resp.status_code in (404, 405) else ""
            raise ValueError(f"Prometheus at {self.base} answered HTTP {resp.status_code} for {path}{hint}")
        if not isinstance(body, dict) or body.get("status") != "success" or not isinstance(body.get("data"), dict):
            raise ValueError(f"Prometheus at {self.base} sent an unexpected answer for {path} (not a Prometheus API reply)")
        if body.get("isPartial") is True:
            raise ValueError(f"Prometheus at {self.base} answered {path} with partial data (isPartial: a storage node "
                             "did not answer); a diagnosis of part of the series could be wrong: retry when the "
                             "store is whole")  # fmt: skip
        for warning in body.get("warnings") or ():
            log.warning("Prometheus: %s", warning)
        return body["data"]

    def _refusal(self, params: dict[str, Any], body: dict[str, Any]) -> str:
        """One line for a query the server refused: a store's limit named with what to change, else its error."""
        error = str(body.get("error") or "")
        query = str(params.get("query", ""))
        short = query if len(query) <= 160 else query[:157] + "..."
        points = _POINTS_LIMIT.search(error)
        if points:
            asked, limit = int(points[1]), int(points[2])
            step = float(params.get("step") or 0)
            span = math.floor((limit - 1) * step)  # whole seconds: a bound --since accepts
            fits = f" (at most {format_duration(span)} at this step)" if span >= 1 else ""
            return (f"Prometheus at {self.base} refused a range of {asked} points per series: its limit is "
                    f"-search.maxPointsPerTimeseries={limit}; shorten --since{fits} or raise the limit")  # fmt: skip
        series = _SERIES_LIMIT.search(error)  # VictoriaMetrics' text names no flag for this one
        flag = _FLAG_LIMIT.search(error)
        if series:
            return (f"Prometheus at {self.base} refused {short!r}: more series match than its limit "
                    f"-search.maxUniqueTimeseries={series[1]}; narrow the matchers (--selector, or --fleet with fewer "
                    "targets) or raise the limit")  # fmt: skip
        if flag:
            what = f"-search.{flag[1]}" + (f"={flag[2]}" if flag[2] else "")
            return (f"Prometheus at {self.base} refused {short!r} over its limit {what}: shorten --since or narrow "
                    "the matchers, or raise the limit")  # fmt: skip
        if _OTHER_LIMITS.search(error):
            text = error if len(error) <= 300 else error[:297] + "..."
            return (f"Prometheus at {self.base} refused {short!r} over one of its limits ({text}): shorten --since "
                    "or narrow the matchers, or raise the limit")  # fmt: skip
        text = error if len(error) <= 500 else error[:497] + "..."
        return f"Prometheus at {self.base} rejected {short!r}: {body.get('errorType')}: {text}"

    def _decode(self, resp: httpx.Response) -> Any:
        """The reply's JSON document (a subclass may decode it more lazily)."""
        return resp.json()

    def range(self, query: str, start: float, end: float, step: float) -> list[_Result]:
        params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        data = self._call("/api/v1/query_range", params)
        return _parse_matrix(data)

    def raw(self, query: str, at: float) -> list[_Result]:
        """An instant query of a range vector (``x[10m]``): the raw samples as scraped."""
        data = self._call("/api/v1/query", {"query": query, "time": f"{at:.3f}"})
        return _parse_matrix(data)


def _parse_matrix(data: dict[str, Any]) -> list[_Result]:
    if data.get("resultType") != "matrix":
        return []
    out = []
    result = data.get("result")
    for item in result if isinstance(result, list) else ():
        try:
            values = item.get("values") or ()
            if not values:
                continue
            ts = np.fromiter((v[0] for v in values), dtype=np.float64, count=len(values))
            vals = np.array([v[1] for v in values], dtype=np.float64)  # "NaN", "+Inf" parse as floats
            metric = {str(k): str(v) for k, v in (item.get("metric") or {}).items()}
        except (AttributeError, TypeError, ValueError, IndexError, KeyError, OverflowError):
            # Not the documented [[unix_seconds, "value"], ...] shape: that series is left out, the rest loads.
            log.warning("Prometheus: a series in an unexpected shape was left out")
            continue
        keep = ~np.isnan(vals) & np.isfinite(ts)
        if not keep.any():
            continue
        out.append(_Result(metric, ts[keep], vals[keep]))
    return out


# --------------------------------------------------------------------------- assembling


@dataclass
class _Loaded:
    """What the queries found, before the host filter and the Timeline."""

    host: list[tuple[_Result, str, float]] = field(default_factory=list)  # (result, series name, scale)
    cgroups: list[tuple[_Result, str, str, float]] = field(default_factory=list)  # (result, path, series, scale)
    processes: list[tuple[_Result, str]] = field(default_factory=list)
    gpus: list[tuple[_Result, int, str, float]] = field(default_factory=list)
    gpu_available: list[_Result] = field(default_factory=list)
    gpu_processes: list[_Result] = field(default_factory=list)
    ooms: list[tuple[_Result, str | None]] = field(default_factory=list)
    model_processes: list[_Result] = field(default_factory=list)
    service: dict[str, Series] = field(default_factory=dict)


def load_prometheus(
    url: str,
    *,
    selector: str = "",
    since_s: float = 3600,
    step_s: float | None = None,
    timeout_s: float = 30.0,
    until: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> Timeline:
    """The last ``since_s`` seconds (up to ``until``, default now) of what ``selector`` matches, as a Timeline.

    ``selector`` is PromQL label matchers without braces, e.g. ``job="llm",instance=~"10.0.0.5:.*"``
    (braces are accepted too). ``step_s`` defaults to one point per scrape interval (measured from the
    raw samples), coarsened so no series exceeds ~10 000 points. ``headers``: sent with every query (see
    ``request_headers``). Raises ValueError when Prometheus cannot be reached or refuses a query; a selector
    that matches nothing gives an empty Timeline.
    """
    _check_window(since_s, step_s)
    end = float(until) if until is not None else time.time()
    start = end - float(since_s)
    prom = _Prometheus(url, selector, timeout_s, headers)
    try:
        step, window = _resolution(prom, end, since_s, step_s)
        q = _Queries(prom, start, end, step, window)
        loaded = _Loaded()
        q.host(loaded)
        q.cgroups(loaded)
        q.processes(loaded)
        q.gpus(loaded)
        q.ooms(loaded)
        q.service(loaded)
        queries = prom.queries
    finally:
        prom.close()
    timeline = _assemble(loaded, url, prom.selector, start, end)
    log.info("prometheus: %d queries, step %gs, window %s -> %s", queries, step, _fmt_duration(window), timeline.source)
    return timeline


def _check_window(since_s: float, step_s: float | None) -> None:
    if since_s <= 0:
        raise ValueError("since must be positive")
    if step_s is not None and step_s <= 0:
        raise ValueError("step must be positive")


def _resolution(prom: _Prometheus, end: float, since_s: float, step_s: float | None) -> tuple[float, float]:
    """(step, rate window) of the range queries: ``step_s`` or one point per measured scrape, within MAX_POINTS."""
    probe_s = min(since_s, PROBE_WINDOW_S)
    scrape_s = _scrape_interval(prom, end, probe_s)
    if scrape_s is None and since_s > probe_s:
        # Nothing in the window's last minutes (the service stopped, the agent died, or history read long after):
        # measured at the window's start instead of assumed, where a guess of 15 s over series scraped every
        # second would leave a store without Prometheus' 5-minute lookback (VictoriaMetrics) a point in 15.
        scrape_s = _scrape_interval(prom, end - since_s + probe_s, probe_s)
    if scrape_s is None:
        scrape_s = DEFAULT_SCRAPE_S
    step = step_s if step_s is not None else default_step(since_s, scrape_s)
    step = max(step, since_s / (MAX_POINTS - 1))
    return step, max(4 * step, 4 * scrape_s)


def _scrape_interval(prom: _Prometheus, end: float, window_s: float) -> float | None:
    """Median spacing of raw samples of a few always-present series (``up``, host memory, request counter), over
    ``window_s`` up to ``end``; None when none has three samples there."""
    names = [cat.PROMETHEUS_UP.name, cat.HOST_MEMORY["total"].name, cat.NODE_MEMORY["total"].name, cat.REQUESTS.name,
             cat.VLLM_RUNNING.name, bk.TGI_QUEUE_SIZE.name, bk.LLAMACPP_PROCESSING.name]  # fmt: skip
    results = prom.raw(f"{prom.sel_names(names)}[{_fmt_duration(window_s)}]", end)
    spacings = [float(np.median(np.diff(r.ts))) for r in results if len(r.ts) >= 3]
    return min(spacings) if spacings else None


class _Queries:
    """The query set of one Timeline; each method fills its part of a ``_Loaded``.

    ``EVERY_FALLBACK``: query an exporter's fallback family even where ours was found (the fleet path, where some
    targets may have ours and others only node_exporter; ours still wins, being merged first).
    """

    EVERY_FALLBACK = False

    def __init__(self, prom: _Prometheus, start: float, end: float, step: float, window: float) -> None:
        self.prom, self.start, self.end, self.step = prom, start, end, step
        self.w = _fmt_duration(window)

    def range(self, query: str) -> list[_Result]:
        return self.prom.range(query, self.start, self.end, self.step)

    def names(self, names: Iterable[str]) -> list[_Result]:
        return self.range(self.prom.sel_names(names))

    # ---- host

    def host(self, out: _Loaded) -> None:
        ours: dict[str, tuple[str, float]] = {}
        for snake, spec in cat.HOST_MEMORY.items():
            ours[spec.name] = (sig.HOST_MEMORY + snake, 1.0)
        for r, spec in cat.HOST_PSI_WAITING.items():
            ours[spec.name] = (sig.psi(r, "some", sig.PSI_TOTAL), 1.0)
        for r, spec in cat.HOST_PSI_STALLED.items():
            ours[spec.name] = (sig.psi(r, "full", sig.PSI_TOTAL), 1.0)
        for f, spec in cat.HOST_VMSTAT.items():
            ours[spec.name] = (sig.HOST_VMSTAT + f, 1.0)
        found: set[str] = set()
        for res in self.names([*ours, cat.HOST_PSI_AVG10.name]):
            if res.name == cat.HOST_PSI_AVG10.name:
                resource, kind = res.labels.get("resource"), res.labels.get("kind")
                if resource and kind:
                    key = sig.psi(resource, kind, sig.PSI_AVG10)
                    out.host.append((res, key, 100.0))
                    found.add(key)
            elif res.name in ours:
                key, scale = ours[res.name]
                out.host.append((res, key, scale))
                found.add(key)
        # node_exporter for whatever ours lacks
        node: dict[str, str] = {}
        for snake, fam in cat.NODE_MEMORY.items():
            node[fam.name] = sig.HOST_MEMORY + snake
        for r, fam in cat.NODE_PSI_WAITING.items():
            node[fam.name] = sig.psi(r, "some", sig.PSI_TOTAL)
        for r, fam in cat.NODE_PSI_STALLED.items():
            node[fam.name] = sig.psi(r, "full", sig.PSI_TOTAL)
        for f, fam in cat.NODE_VMSTAT.items():
            node[fam.name] = sig.HOST_VMSTAT + f
        wanted = {name: key for name, key in node.items() if key not in found or self.EVERY_FALLBACK}
        if wanted:
            for res in self.names(wanted):
                if res.name in wanted:
                    out.host.append((res, wanted[res.name], 1.0))
                    found.add(wanted[res.name])
        # avg10 from rate(total) where no average was exported (node_exporter has none)
        for kind, families in (("some", cat.NODE_PSI_WAITING), ("full", cat.NODE_PSI_STALLED)):
            for r, fam in families.items():
                ours_total = cat.HOST_PSI_WAITING.get(r) if kind == "some" else cat.HOST_PSI_STALLED.get(r)
                key = sig.psi(r, kind, sig.PSI_AVG10)
                if (key in found and not self.EVERY_FALLBACK) or sig.psi(r, kind, sig.PSI_TOTAL) not in found:
                    continue
                for name in (ours_total.name if ours_total else None, fam.name):
                    if name is None:
                        continue
                    got = self.range(f"rate({self.prom.sel(name)}[{self.w}]) * 100")
                    if got:
                        out.host.extend((res, key, 1.0) for res in got)
                        found.add(key)
                        if not self.EVERY_FALLBACK:
                            break

    # ---- cgroups

    def cgroups(self, out: _Loaded) -> None:
        """Our cgroup families; cAdvisor's only where ours are absent."""
        self.cgroups_ours(out)
        if out.cgroups:
            return
        self.cgroups_cadvisor(out)

    def cgroups_ours(self, out: _Loaded) -> None:
        simple = {
            cat.CGROUP_USAGE.name: sig.CG_USAGE, cat.CGROUP_WORKING_SET.name: sig.CG_WORKING_SET,
            cat.CGROUP_LIMIT.name: sig.CG_LIMIT, cat.CGROUP_HIGH.name: sig.CG_HIGH, cat.CGROUP_PEAK.name: sig.CG_PEAK,
            cat.CGROUP_SWAP.name: sig.CG_SWAP, cat.CGROUP_UNDER_OOM.name: sig.CG_UNDER_OOM,
            cat.CGROUP_PSI_WAITING.name: sig.psi("memory", "some", sig.PSI_TOTAL),
            cat.CGROUP_PSI_STALLED.name: sig.psi("memory", "full", sig.PSI_TOTAL),
            **{spec.name: sig.CG_STAT + key for key, spec in cat.CGROUP_STAT_BYTES.items()},
            **{spec.name: sig.CG_STAT + key for key, spec in cat.CGROUP_STAT_COUNTERS.items()},
        }  # fmt: skip
        for res in self.names([*simple, cat.CGROUP_EVENTS.name]):
            path = res.labels.get("cgroup")
            if not path:
                continue
            if res.name == cat.CGROUP_EVENTS.name:
                event, scope = res.labels.get("event"), res.labels.get("scope", "hierarchical")
                if event:
                    family = sig.CG_EVENTS_LOCAL if scope == "local" else sig.CG_EVENTS
                    out.cgroups.append((res, path, family + event, 1.0))
            elif res.name in simple:
                out.cgroups.append((res, path, simple[res.name], 1.0))
        if out.cgroups:
            self._cgroup_psi_avg(out, "cgroup", cat.CGROUP_PSI_WAITING.name, cat.CGROUP_PSI_STALLED.name)

    def cgroups_cadvisor(self, out: _Loaded) -> None:
        cadvisor = {fam.name: _CADVISOR_KEYS[key] for key, fam in cat.CADVISOR_MEMORY.items()}
        cadvisor[cat.CADVISOR_PSI_WAITING.name] = sig.psi("memory", "some", sig.PSI_TOTAL)
        cadvisor[cat.CADVISOR_PSI_STALLED.name] = sig.psi("memory", "full", sig.PSI_TOTAL)
        for res in self.names(cadvisor):
            path = res.labels.get("id")
            key = cadvisor.get(res.name)
            if not path or key is None:
                continue
            if key == sig.CG_LIMIT:  # 0 means unlimited in cAdvisor: absent, as in our convention
                keep = res.values > 0
                if not keep.any():
                    continue
                res = _Result(res.labels, res.ts[keep], res.values[keep])
            out.cgroups.append((res, path, key, 1.0))
        self._cgroup_psi_avg(out, "id", cat.CADVISOR_PSI_WAITING.name, cat.CADVISOR_PSI_STALLED.name)

    def _cgroup_psi_avg(self, out: _Loaded, label: str, some: str, full: str) -> None:
        """``psi.memory.<kind>.avg10`` per group as rate(total[W]) x 100: exporters give cgroup PSI totals only.

        Like the host's node_exporter fallback, an average over the rate window, not the kernel's 10 s EWMA.
        """
        have = {key for _, _, key, _ in out.cgroups}
        for kind, name in (("some", some), ("full", full)):
            if sig.psi("memory", kind, sig.PSI_TOTAL) not in have:
                continue
            for res in self.range(f"rate({self.prom.sel(name)}[{self.w}]) * 100"):
                path = res.labels.get(label)
                if path:
                    out.cgroups.append((res, path, sig.psi("memory", kind, sig.PSI_AVG10), 1.0))

    # ---- processes and model holders

    def processes(self, out: _Loaded) -> None:
        names = {
            cat.PROCESS_RSS.name: sig.PROC_RSS, cat.PROCESS_PSS.name: sig.PROC_PSS, cat.PROCESS_USS.name: sig.PROC_USS,
            cat.PROCESS_SWAP.name: sig.PROC_SWAP, cat.PROCESS_MAJOR_FAULTS.name: sig.PROC_MAJOR_FAULTS,
        }  # fmt: skip
        for res in self.names([*names, cat.MODEL_PROCESSES.name]):
            if res.name == cat.MODEL_PROCESSES.name:
                if res.labels.get("model"):
                    out.model_processes.append(res)
            elif res.name in names and res.labels.get("pid"):
                out.processes.append((res, names[res.name]))

    # ---- GPUs

    def gpus(self, out: _Loaded) -> None:
        """Our GPU families; DCGM's framebuffer only where ours are absent."""
        self.gpus_ours(out)
        if out.gpus:
            return
        self.gpus_dcgm(out)

    def gpus_ours(self, out: _Loaded) -> None:
        parts = {spec.name: _GPU_MEMORY_KEYS[part] for part, spec in cat.GPU_MEMORY.items()}
        extra = [cat.GPU_UTILIZATION.name, cat.GPU_AVAILABLE.name, cat.GPU_PROCESS_MEMORY.name]
        for res in self.names([*parts, *extra]):
            if res.name == cat.GPU_AVAILABLE.name:
                out.gpu_available.append(res)
                continue
            if res.name == cat.GPU_PROCESS_MEMORY.name:
                out.gpu_processes.append(res)
                continue
            index = _int(res.labels.get("gpu"))
            if index is None:
                continue
            if res.name == cat.GPU_UTILIZATION.name:
                key = _GPU_UTIL_KEYS.get(res.labels.get("resource") or "")
                if key is not None:
                    out.gpus.append((res, index, key, 1.0))
            elif res.name in parts:
                out.gpus.append((res, index, parts[res.name], 1.0))

    def gpus_dcgm(self, out: _Loaded) -> None:
        dcgm = {cat.DCGM_FB_USED.name: sig.GPU_USED, cat.DCGM_FB_FREE.name: sig.GPU_FREE}
        for res in self.names(dcgm):
            index = _int(res.labels.get("gpu"))
            if index is not None and res.name in dcgm:
                out.gpus.append((res, index, dcgm[res.name], MIB))

    # ---- OOM kills

    def ooms(self, out: _Loaded) -> None:
        """Our OOM-kill counter; node_exporter's ``oom_kill`` only where ours is absent."""
        self.ooms_ours(out)
        if out.ooms:
            return
        self.ooms_node(out)

    def ooms_ours(self, out: _Loaded) -> None:
        for res in self.range(self.prom.sel(cat.OOM_KILLS.name)):
            out.ooms.append((res, res.labels.get("constraint") or None))

    def ooms_node(self, out: _Loaded) -> None:
        for res in self.range(self.prom.sel(cat.NODE_VMSTAT["oom_kill"].name)):
            out.ooms.append((res, None))

    # ---- request side (summed over every target the selector matches)

    def service(self, out: _Loaded) -> None:
        """Each signal of ``collectors.backends.FEEDS`` from its first feed whose query has data."""
        svc = out.service
        for signal in bk.signals():
            for feed in bk.feeds_of(signal):
                got = self.feed(feed)
                if got:
                    for key, series in got.items():
                        svc.setdefault(key, series)
                    break

    def _selector(self, name: str, feed: bk.Feed) -> str:
        extra = ",".join(f'{label}=~"{"|".join(re.escape(v) for v in values)}"' for label, values in feed.select)
        return self.prom.sel(name, extra)

    def _rate(self, name: str, feed: bk.Feed) -> str:
        return f"sum(rate({self._selector(name, feed)}[{self.w}]))"

    def feed(self, feed: bk.Feed) -> dict[str, Series]:
        """The series one feed gives, by service key (empty: its family has no data here)."""
        name = feed.family.name
        if feed.how == "gauge":
            series = _single(self.range(f"{feed.combine}({self._selector(name, feed)})"))
            return {feed.signal: series} if series is not None else {}
        if feed.how == "rate":
            series = _single(self.range(self._rate(name, feed)))
            return {feed.signal: series} if series is not None else {}
        if feed.how == "ratio":
            assert feed.per is not None
            series = _single(self.range(f"{self._rate(name, feed)} / {self._rate(feed.per.name, feed)}"))
            return {feed.signal: series} if series is not None else {}
        if feed.how == "sum_rate":
            series = _single(self.range(self._rate(name + "_sum", feed)))
            return {feed.signal: series} if series is not None else {}
        got: dict[str, Series] = {}
        for q, stat in _QUANTILES:
            expr = f"histogram_quantile({q}, sum by (le) (rate({self._selector(name + '_bucket', feed)}[{self.w}])))"
            series = _single(self.range(expr))
            if series is None:
                break  # no requests in the whole window (or no such family): the next feed is tried
            got[sig.latency(feed.signal, stat)] = series
        if got:
            # The mean per step (rate of the sum over rate of the count) is exact where buckets are coarse.
            mean = _single(self.range(f"{self._rate(name + '_sum', feed)} / {self._rate(name + '_count', feed)}"))
            if mean is not None:
                got[sig.latency(feed.signal, "mean")] = mean
        return got


def _variants(name: str) -> tuple[str, ...]:
    """A name, plus its OpenMetrics-escaped form when it has a colon (``vllm:x`` -> ``vllm_x``).

    Why: prometheus_client >= 0.22 answers a Prometheus that asks for OpenMetrics with
    ``escaping=underscores`` and rewrites ``:`` to ``_`` in sample names (UTF-8 name escaping), so a
    vLLM scraped that way is stored as ``vllm_num_requests_running``. Both spellings are queried.
    """
    if not _NAME_OK.match(name):
        raise ValueError(f"not a metric name: {name!r}")
    return (name, name.replace(":", "_")) if ":" in name else (name,)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _series(res: _Result, scale: float = 1.0) -> Series:
    return Series(res.ts.copy(), res.values * scale if scale != 1.0 else res.values.copy())


def _single(results: Sequence[_Result]) -> Series | None:
    return _series(results[0]) if results else None


def _merge(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> Series:
    """Join pieces of one signal (the same name from several series): time-sorted; a duplicate time keeps the first."""
    if len(parts) == 1:
        ts, vals = parts[0]
        return Series(ts.copy(), vals.copy())
    ts = np.concatenate([p[0] for p in parts])
    vals = np.concatenate([p[1] for p in parts])
    order = np.argsort(ts, kind="stable")
    ts, vals = ts[order], vals[order]
    first = np.ones(ts.size, dtype=bool)
    first[1:] = ts[1:] != ts[:-1]
    return Series(ts[first], vals[first])


def _pick_host(loaded: _Loaded) -> tuple[str | None, list[str]]:
    """The host whose host-level series hold the most samples, and every host seen."""
    samples: dict[str, int] = defaultdict(int)
    groups: list[Iterable[_Result]] = [
        (r for r, *_ in loaded.host), (r for r, *_ in loaded.cgroups), (r for r, _ in loaded.processes),
        (r for r, *_ in loaded.gpus), (r for r, _ in loaded.ooms), loaded.model_processes, loaded.gpu_available,
        loaded.gpu_processes,
    ]  # fmt: skip
    for group in groups:
        for r in group:
            samples[r.host] += len(r.ts)
    if not samples:
        return None, []
    hosts = sorted(samples, key=lambda h: (-samples[h], h))
    return hosts[0], hosts


def _ooms_from(res: _Result, constraint: str | None) -> list[OomEvent]:
    """One synthetic event per counted kill, at the step where the counter rose (a reset counts from 0)."""
    events = []
    if len(res.ts) < 2:
        return events
    dv = np.diff(res.values)
    inc = np.where(dv >= 0, dv, res.values[1:])  # after a reset the new value is all new kills
    for i in np.nonzero(inc > 0)[0]:
        n = round(float(inc[i]))
        ts = float(res.ts[i + 1])
        events.extend(OomEvent(ts=ts, constraint=constraint, source="prometheus") for _ in range(n))
    return events


def _assemble(loaded: _Loaded, url: str, selector: str, start: float, end: float) -> Timeline:
    """The chosen host's series, the fleet's request side and the synthetic OOM kills, through the one Timeline builder."""
    host, hosts = _pick_host(loaded)

    def mine(r: _Result) -> bool:
        return r.host == host

    # Pieces of one signal (the same name from several series) are merged here: a duplicate time keeps the first.
    host_pieces: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    for res, key, scale in loaded.host:
        if mine(res):
            host_pieces[key].append((res.ts, res.values * scale))
    cg: dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = defaultdict(lambda: defaultdict(list))
    for res, path, key, scale in loaded.cgroups:
        if mine(res):
            cg[path][key].append((res.ts, res.values * scale))
    tracks: dict[str, tuple[int, str]] = {}
    proc_pieces: dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = defaultdict(lambda: defaultdict(list))
    for res, key in loaded.processes:
        pid = _int(res.labels.get("pid"))
        if not mine(res) or pid is None:
            continue
        comm = res.labels.get("comm", "")
        track_key = f"{pid}@{comm}"  # no start time in Prometheus: a pid reused by the same comm continues the track
        tracks.setdefault(track_key, (pid, comm))
        proc_pieces[track_key][key].append((res.ts, res.values))
    gp: dict[int, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = defaultdict(lambda: defaultdict(list))
    for res, index, key, scale in loaded.gpus:
        if mine(res):
            gp[index][key].append((res.ts, res.values * scale))
    service = dict(loaded.service)  # fleet-wide request side, plus this host's model holders
    for res in loaded.model_processes:
        if mine(res):
            service[sig.SVC_MODEL_PROCESSES + res.labels["model"]] = _series(res)
    groups: list[tuple[str, Any, dict[str, Series]]] = [
        ("host", None, {k: _merge(v) for k, v in host_pieces.items()}),
        *(("cgroups", path, {k: _merge(v) for k, v in series.items()}) for path, series in cg.items()),
        *(("processes", key, {k: _merge(v) for k, v in proc_pieces[key].items()}) for key in tracks),
        *(("gpus", index, {k: _merge(v) for k, v in series.items()}) for index, series in sorted(gp.items())),
        ("service", None, service),
    ]

    builder = TimelineBuilder(window=(start, end))  # the query window when no series has data
    for key, (pid, comm) in tracks.items():
        builder.add_track(key, pid, None, comm=comm)
    for scope, group, series in groups:
        for name, values in series.items():
            builder.add_series(scope, group, name, values)
    available = [r for r in loaded.gpu_available if mine(r)]
    if not gp and available and all(float(np.max(r.values)) == 0.0 for r in available):
        builder.mark_unavailable("gpus", f"NVML unavailable on the agent ({cat.GPU_AVAILABLE.name} = 0 throughout)")
    rows: dict[str, list[np.ndarray]] = defaultdict(list)
    for res in loaded.gpu_processes:
        gpu, pid = _int(res.labels.get("gpu")), _int(res.labels.get("pid"))
        if mine(res) and gpu is not None and pid is not None:
            rows["ts"].append(res.ts)
            rows["gpu"].append(np.full(res.ts.size, float(gpu)))
            rows["pid"].append(np.full(res.ts.size, float(pid)))
            rows["used_bytes"].append(res.values)
    if rows:
        builder.add_rows("gpu_processes", {k: np.concatenate(v) for k, v in rows.items()})
    oom_series = [(r, c) for r, c in loaded.ooms if mine(r)]
    builder.keep("ooms", [e for r, c in oom_series for e in _ooms_from(r, c)])
    # Counts: "host" only where an OOM counter was seen (it makes the absence of kills evidence), then series and samples.
    if oom_series:
        builder.counts["host"] = max(len(r.ts) for r, _ in oom_series)
    builder.counts["prometheus_series"] = sum(len(series) for _, _, series in groups)
    for scope, kind in (("cgroups", "cgroup"), ("processes", "process")):
        samples = [len(s) for sc, _, series in groups if sc == scope for s in series.values()]
        if any(sc == scope for sc, _, _ in groups):
            builder.counts[kind] = sum(samples)
    where = f"prometheus:{url}"
    if selector:
        where += f" {{{selector}}}"
    if host is not None and len(hosts) > 1:
        shown = ", ".join(hosts[:5]) + ("..." if len(hosts) > 5 else "")
        where += f" host {host} ({len(hosts)} hosts matched: {shown}; narrow --selector to choose)"
        log.warning("selector matches %d hosts; host-level series are from %s", len(hosts), host)
    builder.source = where
    return builder.build()
