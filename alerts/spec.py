"""The SLO spec: what to alert on, read from YAML and validated before anything is generated.

Why a spec of our own and not raw PromQL (as Sloth takes): the two mistakes users make most with
generated SLO alerts are a latency threshold that is not a bucket boundary (the rule then silently
measures a different threshold, or nothing) and tiers that cannot fire. Both can only be caught when
the spec says *which histogram* and *which threshold*, so that is what it says. Every error names
the field (``slos[1].latency.threshold``) and what would be valid.

Shape (see ``alerts/slo.yaml`` for the shipped, commented default)::

    version: 1
    period: 30d                      # 30d | 28d | 7d
    model_label: model               # label that names the model on the metrics (vLLM: model_name)
    selector: ''                     # extra matchers on every SLI metric, e.g. job="llm-api"
    labels: {team: llm}              # added to every generated alert (routing)
    runbook_url: URL                 # alert annotation; may use {{ $labels.slo }} templates
    grafana_url: http://HOST:3000    # Grafana's base URL: alerts link panels of the generated dashboards
    routing: {receiver_url}          # base URL of `diag triage serve`; routes post to its page/ticket paths
    tiers: [{name, severity, long, short, budget_percent, min_events}, ...]
    engine: vllm                     # optional: the engine's own cause alerts (vLLM: KV saturation, queue, preemptions)
    slos:
      - name: availability
        objective: 99.5              # percent of good events
        availability: {metric, label, good: [...]}   # a counter family (ours, an engine's, http_requests_total)
      - name: ttft
        objective: 99
        latency: {metric, threshold}  # seconds; must be a bucket boundary
        tiers: [fast, slow]          # optional: keep only these tiers
      - name: e2e
        objective: 99
        histogram: tgi_request_duration   # the same as latency:, spelt flat
        threshold_seconds: 2.5251168294
      - name: errors
        objective: 99.5
        error_query: sum by (job) (increase(http_requests_total{status="5xx"}[{{.window}}]))  # Sloth-style raw ratio
        total_query: sum by (job) (increase(http_requests_total[{{.window}}]))

Histograms and counters are looked up in ``collectors.catalog`` (ours and pinned upstream families) and in
``collectors.backends`` (vLLM, TGI, llama.cpp at their pinned versions), plus the API servers' HTTP families
(``HTTP_FAMILIES``). A raw ratio's two queries are PromQL that give the *count* of errors and of requests over the
window ``{{.window}}`` stands for (``increase``, not ``rate``: the generator records them as the window's errors and
requests, and the request count gates each tier); they are recorded as they are, summed by job and model.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from alerts.receiver_routes import DEFAULT_RECEIVER_URL
from alerts.slo_names import PERIODS, WINDOWS
from collectors import backends, catalog

SEVERITIES = ("page", "ticket")
# At most 12 digits: int() refuses more than 4300, and no window is longer than a few years.
_DURATION_RE = re.compile(r"(\d{1,12})([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Used with fullmatch: "$" would let a trailing newline through into file names and label names.
_NAME_RE = re.compile(r"[a-z][a-z0-9_-]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# A spec is a few kilobytes; a larger file is a mistake (or hostile), refused before it is parsed.
MAX_SPEC_BYTES = 1 << 20
# A spec nests four levels deep; deeper documents are refused before validation walks them.
MAX_DEPTH = 16
# Values quoted in error messages are cut to a readable size (a 1 MB string must not become a 1 MB message).
_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlevel = 3


def _show(value: Any) -> str:
    return _SHOW.repr(value)


# Label names the generator itself sets on alerts: a spec that sets them would break routing or inhibition.
RESERVED_LABELS = frozenset({"slo", "tier", "severity", "long_window", "short_window", "burn_factor", "model", "job",
                             "diag_class", "alertname"})  # fmt: skip


class SpecError(ValueError):
    """A spec problem; the message starts with the field path, so one line tells the user what to fix."""


def duration_s(text: str, where: str = "duration") -> int:
    """Seconds of a Prometheus-style duration with one unit (``5m``, ``1h``, ``30d``)."""
    m = _DURATION_RE.fullmatch(str(text).strip())
    if not m or int(m.group(1)) <= 0:
        raise SpecError(f"{where}: {_show(text)} is not a duration like 5m, 1h, 3d")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def format_number(x: float) -> str:
    """Shortest decimal that round-trips: thresholds print as 0.144, never 0.14399999999999999."""
    return repr(round(x, 12)).removesuffix(".0") if x == int(x) else repr(round(x, 12))


@dataclass(frozen=True)
class Tier:
    name: str
    severity: str
    long: str
    short: str
    budget_percent: float  # share of the period's error budget spent when the alert fires
    min_events: int  # requests in the long window below which the tier stays silent (low traffic)

    def burn_factor(self, period: str) -> float:
        """Burn rate that spends ``budget_percent`` of the budget in the long window (Sloth's formula)."""
        return round(self.budget_percent / 100 * duration_s(period) / duration_s(self.long), 6)


@dataclass(frozen=True)
class Availability:
    metric: str
    label: str
    good: tuple[str, ...]


@dataclass(frozen=True)
class Latency:
    metric: str  # the histogram's base name (without _bucket/_count)
    threshold: float  # seconds; a bucket boundary


@dataclass(frozen=True)
class RawRatio:
    """Sloth-style: two PromQL queries, each the count over the window (``{{.window}}``) of errors and of requests."""

    error_query: str
    total_query: str

    def render(self, window: str) -> tuple[str, str]:
        return self.error_query.replace(WINDOW_PLACEHOLDER, window), self.total_query.replace(WINDOW_PLACEHOLDER, window)


WINDOW_PLACEHOLDER = "{{.window}}"
SLI = Availability | Latency | RawRatio
# The engines whose own cause alerts a spec can ask for (``engine:``); ``llmdiag`` is our tracker's (the default).
ENGINES: tuple[str, ...] = ("llmdiag", "vllm")
# Counter families of the engines' HTTP front ends (prometheus-fastapi-instrumentator: vLLM's API server), which the
# catalog does not declare: an availability SLO may count them (label ``status``: 2xx, 4xx, 5xx).
HTTP_FAMILIES: dict[str, tuple[str, ...]] = {"http_requests_total": ("handler", "method", "status")}


@dataclass(frozen=True)
class SLO:
    name: str
    objective: float  # percent
    description: str
    sli: SLI
    tiers: tuple[Tier, ...]
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def budget(self) -> float:
        """Allowed error ratio (1 - objective), rounded so 99.9 gives 0.001 and not 0.000999..."""
        return round(1 - self.objective / 100, 10)


@dataclass(frozen=True)
class Spec:
    period: str
    model_label: str
    selector: str
    labels: dict[str, str]
    runbook_url: str
    grafana_url: str  # Grafana's base URL ('' = no dashboard links)
    receiver_url: str  # base URL of `diag triage serve`
    slos: tuple[SLO, ...]
    tiers: tuple[Tier, ...]  # the spec's full tier table, in order fastest first
    engine: str = "llmdiag"  # whose cause alerts: our tracker's families, or an engine's own (ENGINES)

    @property
    def windows(self) -> tuple[str, ...]:
        """Every window a recording rule is needed for: the fixed set plus any custom tier windows.

        The period is left out even when a tier uses it as a window: the period's own group records it, and
        recording one name twice would give two series with the same labels."""
        extra = {w for t in self.tiers for w in (t.long, t.short)} - set(WINDOWS)
        return tuple(w for w in WINDOWS + tuple(sorted(extra, key=duration_s)) if w != self.period)


DEFAULT_SPEC_PATH = Path(__file__).with_name("slo.yaml")


class _SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases and deep nesting.

    Why: a spec needs none, and an alias bomb ("billion laughs": each level aliases the previous one nine
    times) loads in microseconds as shared references but then expands without end the first time anything
    walks or prints it."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} is not allowed in a spec (write the value out)", event.start_mark
            )
        # The composer recurses once per level: a document nested thousands deep is refused here, at once,
        # rather than by a RecursionError after seconds of work.
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels (a spec is four deep)", event.start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_spec_document(path: Path) -> Any:
    """The decoded YAML document of a spec file, or a SpecError naming the file and the problem.

    Refused before validation: a file over ``MAX_SPEC_BYTES``, bytes that are not UTF-8, invalid YAML, more
    than one document, aliases, nesting deeper than ``MAX_DEPTH`` and control characters in strings."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES // 1024} KiB; a spec is a few kilobytes of YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start}); a spec is YAML") from None
    try:
        doc = yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass: plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]  # one line, as every error
        raise SpecError(f"{path}:{where} not valid YAML: {problem}") from None
    except RecursionError:
        raise SpecError(f"{path}: not valid YAML for a spec: nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more than 4300 digits
        raise SpecError(f"{path}: a value cannot be read: {_show(str(exc))}") from None
    if doc is None:
        raise SpecError(f"{path}: empty; a spec is a YAML mapping (see alerts/slo.yaml)")
    _check_tree(doc, str(path))
    return doc


def _check_tree(doc: Any, where: str) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` and strings with control characters (other than tab and
    newline), which would otherwise reach rule files and PromQL. Iterative: no recursion on hostile depth."""
    stack: list[tuple[Any, int, str]] = [(doc, 0, "spec")]
    while stack:
        node, depth, field_path = stack.pop()
        if depth > MAX_DEPTH:
            raise SpecError(f"{where}: {field_path}: nested deeper than {MAX_DEPTH} levels; a spec is four deep")
        if isinstance(node, dict):
            for k, v in node.items():
                _check_string(k, where, f"{field_path} key")
                stack.append((v, depth + 1, f"{field_path}.{k if isinstance(k, str) and _LABEL_RE.fullmatch(k) else _show(k)}"))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{field_path}[{i}]") for i, v in enumerate(node))
        else:
            _check_string(node, where, field_path)


_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _check_string(value: Any, where: str, field_path: str) -> None:
    if isinstance(value, str) and _CONTROL_RE.search(value):
        raise SpecError(f"{where}: {field_path}: control character in {_show(value)}")


def load_spec(path: str | Path | None = None) -> Spec:
    """Read and validate a spec file (the shipped default when None). Every error names the file."""
    path = Path(path) if path is not None else DEFAULT_SPEC_PATH
    doc = read_spec_document(path)
    try:
        return parse_spec(doc)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _known(doc: dict[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(doc) - allowed, key=str)  # keys may be numbers, dates or None: sort by their text
    if unknown:
        raise SpecError(f"{where}: unknown field {_show(unknown[0])} (allowed: {', '.join(sorted(allowed))})")


def _string(doc: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if value is None:
        raise SpecError(f"{where}.{key}: required")
    if not isinstance(value, str):
        raise SpecError(f"{where}.{key}: expected a string, got {_show(value)}")
    return value


def _number(doc: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = doc.get(key, default)
    if value is None:
        raise SpecError(f"{where}.{key}: required")
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise SpecError(f"{where}.{key}: expected a number, got {_show(value)}")
    return float(value)


def _finite(value: int | float) -> bool:
    """math.isfinite, except that an integer too large for a float is not finite here (isfinite raises)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# A base URL the generator appends paths to: scheme, host (name, IPv4 or [IPv6]), optional port, optional path.
# No user:password (it would be written into every generated file), no query or fragment (paths go after it).
_BASE_URL_RE = re.compile(r"(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:\d{1,5})?(/[A-Za-z0-9._~/-]*)?")


def _base_url(doc: dict[str, Any], key: str, where: str, default: str, *, allow_path: bool) -> str:
    """An http(s) base URL without credentials, query or fragment; trailing slashes removed ('' stays '')."""
    url = _string(doc, key, where, default).strip()
    if not url:
        if default:
            raise SpecError(f"{where}.{key}: empty; give a URL like {default} (or leave the field out)")
        return ""
    m = _BASE_URL_RE.fullmatch(url)
    if m is None:
        raise SpecError(f"{where}.{key}: {_show(url)} is not an http(s) base URL like "
                        f"{default or 'http://127.0.0.1:3000'} (no user:password, query or fragment)")  # fmt: skip
    path = (m.group(4) or "").rstrip("/")
    if path and not allow_path:
        raise SpecError(f"{where}.{key}: {_show(url)} has a path ({path}); give the receiver's base URL like "
                        f"{default}: the generator appends the paths the receiver serves")  # fmt: skip
    return url.rstrip("/")


def _labels(value: Any, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in _mapping(value or {}, where).items():
        if not isinstance(k, str) or not _LABEL_RE.fullmatch(k):
            raise SpecError(f"{where}: {_show(k)} is not a Prometheus label name")
        if k in RESERVED_LABELS:
            raise SpecError(f"{where}.{k}: reserved (the generator sets it)")
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise SpecError(f"{where}.{k}: expected a string value, got {_show(v)}")
        out[k] = str(v)
    return out


def _tier(doc: Any, where: str) -> Tier:
    doc = _mapping(doc, where)
    _known(doc, where, {"name", "severity", "long", "short", "budget_percent", "min_events"})
    name = _string(doc, "name", where)
    if not _NAME_RE.fullmatch(name):
        raise SpecError(f"{where}.name: {_show(name)} must be lower case letters, digits, - or _")
    severity = _string(doc, "severity", where)
    if severity not in SEVERITIES:
        raise SpecError(f"{where}.severity: {_show(severity)} is not one of {', '.join(SEVERITIES)}")
    long, short = _string(doc, "long", where), _string(doc, "short", where)
    if duration_s(short, f"{where}.short") >= duration_s(long, f"{where}.long"):
        raise SpecError(f"{where}.short: {short} must be shorter than long ({long})")
    budget = _number(doc, "budget_percent", where)
    if not 0 < budget <= 100:
        raise SpecError(f"{where}.budget_percent: {budget:g} must be in (0, 100]")
    min_events = _number(doc, "min_events", where, 0)
    if min_events < 0 or min_events != int(min_events):
        raise SpecError(f"{where}.min_events: {min_events:g} must be a whole number >= 0")
    return Tier(name, severity, long, short, budget, int(min_events))


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("fast", "page", "1h", "5m", 2, 20),
    Tier("medium", "page", "6h", "30m", 5, 50),
    Tier("slow", "ticket", "1d", "2h", 10, 100),
    Tier("long", "ticket", "3d", "6h", 10, 200),
)


def histogram_buckets(metric: str) -> tuple[float, ...] | None:
    """Bucket boundaries declared for a histogram (ours, an external one, an inference backend's), else None."""
    spec = catalog.CATALOG.get(metric)
    if spec is not None:
        return spec.buckets if spec.type == "histogram" else None
    if metric in catalog.EXTERNAL_HISTOGRAM_BUCKETS:
        return catalog.EXTERNAL_HISTOGRAM_BUCKETS[metric]
    fam = backends.FAMILIES.get(metric)
    return fam.buckets if fam is not None and fam.type == "histogram" else None


def family_type(metric: str) -> str | None:
    """The declared type of a family (catalog, inference backends, HTTP front ends), or None when nobody declares it."""
    spec = catalog.CATALOG.get(metric)
    if spec is not None:
        return spec.type
    if metric in backends.FAMILIES:
        return backends.FAMILIES[metric].type
    if metric in HTTP_FAMILIES:
        return "counter"
    try:
        return catalog.external(metric).type
    except KeyError:
        return None


def _is_counter(metric: str) -> bool:
    return family_type(metric) == "counter"


def known_latency_histograms() -> list[str]:
    """Every declared histogram in seconds an SLO may name (for the error message of an unknown one)."""
    ours = [n for n, s in catalog.CATALOG.items() if s.type == "histogram" and s.unit == "seconds"]
    theirs = [f.name for f in backends.FAMILIES.values() if f.type == "histogram" and f.dialect != "llmdiag"
              and ("seconds" in f.name or "duration" in f.name)]  # fmt: skip
    return sorted(set(ours) | set(catalog.EXTERNAL_HISTOGRAM_BUCKETS) | set(theirs))


def snap_to_bucket(threshold: float, buckets: tuple[float, ...]) -> float | None:
    """The declared boundary equal to ``threshold`` (to 9 significant digits: TGI's are 0.0001 x 1.5^k), or None."""
    for b in buckets:
        if math.isclose(threshold, b, rel_tol=1e-9) or format_number(b) == format_number(threshold):
            return b
    return None


def _raw_query(body: dict[str, Any], key: str, where: str) -> str:
    """A raw PromQL query of a ratio SLI: one line, the window placeholder, balanced brackets and quotes."""
    query = _string(body, key, where).strip()
    w = f"{where}.{key}"
    if not query:
        raise SpecError(f"{w}: empty; give the PromQL count of events over {WINDOW_PLACEHOLDER}")
    if "\n" in query:
        raise SpecError(f"{w}: one line of PromQL, please (no newline)")
    if WINDOW_PLACEHOLDER not in query:
        raise SpecError(f"{w}: {_show(query)} has no {WINDOW_PLACEHOLDER}: the generator needs it to record every window, "
                        f"e.g. sum(increase(http_requests_total{{status=\"5xx\"}}[{WINDOW_PLACEHOLDER}]))")  # fmt: skip
    problem = _bracket_problem(query.replace(WINDOW_PLACEHOLDER, "5m"))
    if problem:
        raise SpecError(f"{w}: {_show(query)} is not valid PromQL: {problem}")
    return query


def _bracket_problem(query: str) -> str:
    """'' when brackets and quotes balance, else what is wrong (the rest is promtool's to check)."""
    pairs, stack, quote = {")": "(", "]": "[", "}": "{"}, [], ""
    i = 0
    while i < len(query):
        ch = query[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in ")]}" and (not stack or stack.pop() != pairs[ch]):
            return f"unbalanced {ch!r} at character {i + 1}"
        i += 1
    if quote:
        return f"unterminated string ({quote})"
    if stack:
        return f"unclosed {stack[-1]!r}"
    return ""


SLI_FORMS = ("availability", "latency", "histogram", "error_query")


def _sli(doc: dict[str, Any], where: str, live: dict[str, tuple[float, ...]] | None) -> SLI:
    kinds = [k for k in SLI_FORMS if k in doc]
    if "total_query" in doc and "error_query" not in doc:
        raise SpecError(f"{where}.error_query: required with total_query (a raw ratio gives both)")
    if "threshold_seconds" in doc and "histogram" not in doc:
        raise SpecError(f"{where}.histogram: required with threshold_seconds (the histogram the threshold is a bucket of)")
    if len(kinds) != 1:
        raise SpecError(f"{where}: give exactly one of availability:, latency:, histogram: + threshold_seconds:, "
                        f"or error_query: + total_query:" + (f" (got {', '.join(kinds)})" if kinds else ""))  # fmt: skip
    kind = kinds[0]
    if kind == "error_query":
        return RawRatio(_raw_query(doc, "error_query", where), _raw_query(doc, "total_query", where))
    if kind == "histogram":
        return _latency(_string(doc, "histogram", where), _number(doc, "threshold_seconds", where), where,
                        f"{where}.histogram", f"{where}.threshold_seconds", live)  # fmt: skip
    body = _mapping(doc[kind], f"{where}.{kind}")
    w = f"{where}.{kind}"
    if kind == "availability":
        _known(body, w, {"metric", "label", "good"})
        metric = _string(body, "metric", w)
        if not _is_counter(metric):
            kind_of = family_type(metric)
            raise SpecError(f"{w}.metric: {_show(metric)} is " + (f"a {kind_of}, not a counter" if kind_of else
                            "not a counter in the catalog, the inference backends or the HTTP families") +
                            " (availability counts events)")  # fmt: skip
        good = body.get("good")
        if not isinstance(good, list) or not good or not all(isinstance(g, str) and g for g in good):
            raise SpecError(f"{w}.good: a non-empty list of the label values that count as good")
        return Availability(metric, _string(body, "label", w), tuple(good))
    _known(body, w, {"metric", "threshold"})
    return _latency(_string(body, "metric", w), _number(body, "threshold", w), w, f"{w}.metric", f"{w}.threshold", live)


def _latency(metric: str, threshold: float, w: str, metric_field: str, threshold_field: str,
             live: dict[str, tuple[float, ...]] | None) -> Latency:  # fmt: skip
    """A latency SLI: a histogram that exists, and a threshold that is one of its bucket boundaries where declared."""
    if threshold <= 0:
        raise SpecError(f"{threshold_field}: {threshold:g} s must be above 0")
    declared_type = family_type(metric)
    if declared_type is not None and declared_type != "histogram":
        raise SpecError(f"{metric_field}: {_show(metric)} is a {declared_type}, not a histogram (a latency SLO counts "
                        "requests under a bucket boundary)")  # fmt: skip
    buckets = live.get(metric) if live is not None else histogram_buckets(metric)
    if buckets is None and live is not None:
        raise SpecError(f"{metric_field}: {_show(metric)} is not a histogram on the live /metrics "
                        "(a labelled histogram appears only after its first observation)")  # fmt: skip
    if buckets is None and declared_type is None:
        raise SpecError(f"{metric_field}: {_show(metric)} is not a histogram in the catalog or the inference backends "
                        f"(known: {', '.join(known_latency_histograms())})")  # fmt: skip
    if buckets is None:  # declared, but its boundaries are set at run time: check them with --metrics-url
        return Latency(metric, threshold)
    snapped = snap_to_bucket(threshold, buckets)
    if snapped is None:
        raise SpecError(f"{threshold_field}: {threshold:g} s is not a bucket boundary of {metric} "
                        f"(boundaries: {', '.join(format_number(b) for b in buckets)})")  # fmt: skip
    if live is not None:  # the declaration must agree too, or the default rules drift from what is served
        declared = histogram_buckets(metric)
        if declared is not None and snap_to_bucket(threshold, declared) is None:
            raise SpecError(f"{threshold_field}: {threshold:g} s is a live bucket but not one declared for {metric}")
    return Latency(metric, snapped)


def parse_spec(doc: Any, live_buckets: dict[str, tuple[float, ...]] | None = None) -> Spec:
    """Validate a decoded YAML document. ``live_buckets``: histogram -> ``le`` bounds read from a live /metrics."""
    doc = _mapping(doc, "spec")
    if "dashboard_url" in doc:
        raise SpecError("spec.dashboard_url: replaced by grafana_url (Grafana's base URL, e.g. http://127.0.0.1:3000); "
                        "each alert's link is built from the generated dashboards' uids and panels")  # fmt: skip
    _known(doc, "spec", {"version", "period", "model_label", "selector", "labels", "runbook_url", "grafana_url",
                         "routing", "tiers", "slos", "engine"})  # fmt: skip
    engine = _string(doc, "engine", "spec", "llmdiag")
    if engine not in ENGINES:
        raise SpecError(f"spec.engine: {_show(engine)} is not one of {', '.join(ENGINES)} (whose cause alerts to generate)")
    if doc.get("version", 1) != 1:
        raise SpecError(f"spec.version: {_show(doc.get('version'))} is not supported (only 1)")
    period = _string(doc, "period", "spec", "30d")
    if period not in PERIODS:
        raise SpecError(f"spec.period: {_show(period)} is not one of {', '.join(PERIODS)}")
    model_label = _string(doc, "model_label", "spec", "model")
    if not _LABEL_RE.fullmatch(model_label):
        raise SpecError(f"spec.model_label: {_show(model_label)} is not a label name")
    selector = _string(doc, "selector", "spec", "").strip()
    if selector and not re.match(r'^\s*[a-zA-Z_]\w*\s*(=|!=|=~|!~)\s*"[^"]*"(\s*,\s*[a-zA-Z_]\w*\s*(=|!=|=~|!~)\s*"[^"]*")*\s*$',
                                 selector):  # fmt: skip
        raise SpecError(f'spec.selector: {_show(selector)} is not a list of label matchers like job="llm-api"')
    routing = _mapping(doc.get("routing") or {}, "spec.routing")
    for old_key in ("page_url", "ticket_url"):
        if old_key in routing:
            raise SpecError(f"spec.routing.{old_key}: replaced by receiver_url, the base URL of `diag triage serve` "
                            f"(e.g. {DEFAULT_RECEIVER_URL}); the page and ticket routes post to the paths it serves")  # fmt: skip
    _known(routing, "spec.routing", {"receiver_url"})
    receiver_url = _base_url(routing, "receiver_url", "spec.routing", DEFAULT_RECEIVER_URL, allow_path=False)
    grafana_url = _base_url(doc, "grafana_url", "spec", "", allow_path=True)
    tiers_doc = doc.get("tiers")
    if tiers_doc is None:
        tiers = DEFAULT_TIERS
    else:
        if not isinstance(tiers_doc, list) or not tiers_doc:
            raise SpecError("spec.tiers: a non-empty list (or leave it out for the workbook's four)")
        tiers = tuple(_tier(t, f"spec.tiers[{i}]") for i, t in enumerate(tiers_doc))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise SpecError(f"spec.tiers: duplicate tier name in {_show(names)}")
    if list(tiers) != sorted(tiers, key=lambda t: duration_s(t.long)):
        raise SpecError("spec.tiers: list tiers fastest first (by long window): inhibition relies on the order")
    for i, tier in enumerate(tiers):
        # The rules carry the burn factor to six decimals; one that rounds to 0 is an alert on any error at all.
        if tier.burn_factor(period) <= 0:
            raise SpecError(
                f"spec.tiers[{i}].budget_percent: {tier.budget_percent:g} is too small for a {period} period "
                f"and a {tier.long} window: the burn-rate threshold rounds to 0 (the tier would fire on any error)"
            )
    slos_doc = doc.get("slos")
    if not isinstance(slos_doc, list) or not slos_doc:
        raise SpecError("spec.slos: a non-empty list of SLOs")
    slos: list[SLO] = []
    for i, s in enumerate(slos_doc):
        where = f"slos[{i}]"
        s = _mapping(s, where)
        _known(s, where, {"name", "objective", "description", "availability", "latency", "histogram", "threshold_seconds",
                          "error_query", "total_query", "tiers", "labels"})  # fmt: skip
        name = _string(s, "name", where)
        if not _NAME_RE.fullmatch(name):
            raise SpecError(f"{where}.name: {_show(name)} must be lower case letters, digits, - or _")
        if name in {x.name for x in slos}:
            raise SpecError(f"{where}.name: {_show(name)} is used twice")
        objective = _number(s, "objective", where)
        if not 0 < objective < 100:
            raise SpecError(f"{where}.objective: {objective:g} must be a percentage in (0, 100); 100 leaves no budget")
        keep = s.get("tiers")
        if keep is None:
            chosen = tiers
        else:
            if not isinstance(keep, list) or not keep:
                raise SpecError(f"{where}.tiers: a non-empty list of tier names from {names}")
            for t in keep:
                if t not in names:
                    raise SpecError(f"{where}.tiers: {_show(t)} is not a tier (tiers: {', '.join(names)})")
            chosen = tuple(t for t in tiers if t.name in keep)
        slos.append(SLO(name, objective, _string(s, "description", where, ""), _sli(s, where, live_buckets), chosen,
                        _labels(s.get("labels"), f"{where}.labels")))  # fmt: skip
    return Spec(
        period=period,
        model_label=model_label,
        selector=selector,
        labels=_labels(doc.get("labels"), "spec.labels"),
        runbook_url=_string(doc, "runbook_url", "spec", ""),
        grafana_url=grafana_url,
        receiver_url=receiver_url,
        slos=tuple(slos),
        tiers=tiers,
        engine=engine,
    )


def live_histogram_buckets(exposition: str) -> dict[str, tuple[float, ...]]:
    """Histogram -> its ``le`` bounds (without +Inf), from a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[float]] = {}
    for fam in text_string_to_metric_families(exposition):
        if fam.type != "histogram":
            continue
        for sample in fam.samples:
            le = sample.labels.get("le")
            if sample.name.endswith("_bucket") and le is not None and le != "+Inf":
                out.setdefault(fam.name, set()).add(float(le))
    return {k: tuple(sorted(v)) for k, v in out.items()}
