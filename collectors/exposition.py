"""Reading a Prometheus exposition into what the scrape keeps of it: only the mapped families, labels summed away.

Why a module of its own: the scrape (``collectors.scrape``) fetches, this reads. What is read is exactly the families
``collectors.backends`` maps to a signal, in both spellings (``vllm:x`` and the escaped ``vllm_x``), every series
parsed by prometheus_client's own parsers -- strict, and what vLLM exports with -- the first time a target shows it
and only its value read afterwards (``Reader``: label parsing is nearly all of the cost, and a server's series rarely
change between scrapes). Labels a feed does not select on are summed away, as the Prometheus loader's ``sum()`` does;
what is left is capped per family (``max_series``, the overflow counted), as is a label value's length. Histograms
become what each bucket gained since the previous scrape (``deltas``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from collectors import backends as bk

MAX_BODY_BYTES = 8 << 20  # a vLLM host with many engines writes ~1 MiB; beyond this it is not a /metrics page
MAX_SERIES_PER_FAMILY = 32  # kept label sets per family (a feed selects on a bounded label: finished_reason ...)
MAX_LABEL_VALUE = 128  # characters of a kept label value
MAX_LINES_PER_FAMILY = 20_000  # sample lines of one family handed to the parser (it holds a family's samples at once)
ERROR_REASONS: tuple[str, ...] = ("timeout", "connect", "http", "too_large", "parse", "no_families")


class ScrapeError(Exception):
    """A scrape that produced nothing: ``reason`` is one of ``ERROR_REASONS``, ``detail`` says what happened."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    max_bytes: int = MAX_BODY_BYTES
    max_series: int = MAX_SERIES_PER_FAMILY
    max_label_value: int = MAX_LABEL_VALUE


def _roles() -> dict[str, tuple[bk.Family, str]]:
    """Sample name (both spellings) -> (family, role): value | bucket | sum | count | quantile."""
    out: dict[str, tuple[bk.Family, str]] = {}

    def add(name: str, fam: bk.Family, role: str) -> None:
        for spelling in (name, name.replace(":", "_")):
            out.setdefault(spelling, (fam, role))

    for fam in bk.SCRAPED.values():
        if fam.type == "counter":
            add(fam.base + "_total", fam, "value")
            add(fam.base, fam, "value")
        elif fam.type == "gauge":
            add(fam.name, fam, "value")
        else:
            add(fam.name + "_sum", fam, "sum")
            add(fam.name + "_count", fam, "count")
            if fam.type == "histogram":
                add(fam.name + "_bucket", fam, "bucket")
            else:
                add(fam.name, fam, "quantile")
    return out


SAMPLE_ROLES: dict[str, tuple[bk.Family, str]] = _roles()


def _spellings(declared: Iterable[str]) -> dict[str, str]:
    """Each name and its escaped spelling -> the name as declared (``vllm_x_total`` -> ``vllm:x_total``)."""
    return {spelling: name for name in declared for spelling in (name, name.replace(":", "_"))}


# Sample names, and the names a ``# HELP``/``# TYPE``/``# UNIT`` line of a mapped family may carry (the classic format
# names a counter with ``_total``, OpenMetrics without), each with its declared spelling.
_CANONICAL: dict[str, str] = _spellings(n for n in SAMPLE_ROLES if ":" in n or ":" not in SAMPLE_ROLES[n][0].name)
_HEADER_NAMES: dict[str, str] = _spellings(
    base for fam in bk.SCRAPED.values() for base in (fam.name, fam.base, fam.base + "_total")
)
NEEDS_BUCKETS: frozenset[str] = frozenset(f.family.name for f in bk.FEEDS if f.how == "histogram")


@dataclass
class Lines:
    """What ``mapped_lines`` found: the mapped families' lines, and counts about the rest of the exposition."""

    lines: list[str | tuple[str, str, str]]  # in order: # HELP/TYPE/UNIT/EOF lines, and sample lines as (the line,
    # its series part, what follows it); names in their declared spelling
    samples: int  # sample lines in the whole exposition
    over: int  # lines of mapped families left out beyond the per-family cap
    dialects: dict[str, int]  # sample lines by the dialect their name's prefix belongs to

    @property
    def kept(self) -> list[tuple[str, str, str]]:
        return [item for item in self.lines if isinstance(item, tuple)]

    def text(self, only: list[tuple[str, str, str]] | None = None) -> str:
        """The lines as an exposition, in their order (OpenMetrics wants each family's samples after its # TYPE);
        ``only``: just these sample lines, with every header line."""
        wanted = None if only is None else {id(item) for item in only}
        body = [item if isinstance(item, str) else item[0] for item in self.lines
                if isinstance(item, str) or wanted is None or id(item) in wanted]  # fmt: skip
        return "\n".join(body) + "\n" if body else ""


def mapped_lines(text: str, max_per_family: int = MAX_LINES_PER_FAMILY) -> Lines:
    """The lines of ``text`` that belong to mapped families (and ``# EOF``), with counts of what else it held.

    An escaped name gets its declared spelling, so the parser sees one name per family whichever the exporter wrote
    (prometheus_client escapes the samples of OpenMetrics but not their # HELP and # TYPE lines).
    """
    kept: list[str | tuple[str, str, str]] = []
    samples = 0
    over = 0
    per_family: dict[str, int] = {}
    dialects: dict[str, int] = {}
    for line in text.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            if line.startswith("# EOF"):
                kept.append(line)
                continue
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE", "UNIT") and parts[2] in _HEADER_NAMES:
                rest = f" {parts[3]}" if len(parts) > 3 else ""
                kept.append(f"# {parts[1]} {_HEADER_NAMES[parts[2]]}{rest}")
            continue
        samples += 1
        end = len(line)
        for stop in ("{", " ", "\t"):
            i = line.find(stop, 0, end)
            if i >= 0:
                end = i
        sample = line[:end]
        found = SAMPLE_ROLES.get(sample)
        dialect = found[0].dialect if found is not None else bk.dialect_by_prefix(sample)
        if dialect is not None:
            dialects[dialect] = dialects.get(dialect, 0) + 1
        if found is None:
            continue
        name = found[0].name
        n = per_family.get(name, 0)
        if n >= max_per_family:
            over += 1
            continue
        per_family[name] = n + 1
        canonical = _CANONICAL.get(sample, sample)
        close = line.rfind("}") + 1 if line.startswith("{", end) else end
        kept.append((line if canonical == sample else canonical + line[end:], canonical + line[end:close], line[close:]))
    return Lines(kept, samples, over, dialects)


@dataclass
class Hist:
    """A histogram's cumulative values at one scrape: bucket upper bound -> count, ``_sum``, ``_count``."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0


HistKey = tuple[str, tuple[tuple[str, str], ...]]  # (family name, kept labels sorted)


@dataclass
class Parsed:
    """What one exposition held of the mapped families, other labels summed away."""

    gauges: dict[str, float] = field(default_factory=dict)  # series key -> value
    counters: dict[str, float] = field(default_factory=dict)  # series key -> cumulative value
    hists: dict[HistKey, Hist] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)  # declared names of the families seen
    dropped: int = 0  # series beyond the per-family cap, or with an over-long kept label value
    samples: int = 0  # sample lines in the whole exposition
    dialects: dict[str, int] = field(default_factory=dict)  # sample lines by the dialect of their name's prefix

    @property
    def dialect(self) -> str:
        """Whose families these are: by the mapped ones, else by the names' prefixes (an idle server's)."""
        if self.families:
            return bk.dialect_of(self.families)
        if self.dialects:
            return max(self.dialects, key=lambda d: (self.dialects[d], -bk.DIALECTS.index(d)))  # type: ignore[arg-type]
        return "unknown"


@dataclass(frozen=True)
class Slot:
    """Where a sample's value goes once its labels are summed away: a gauge's or counter's series key, or one part
    (a bucket, ``_sum``, ``_count``) of a histogram."""

    family: str
    kind: str  # gauge | counter | bucket | sum | count
    key: str | HistKey
    le: float = math.nan


UNMAPPED, DROPPED = -1, -2  # what a line's series part may be remembered as instead of a slot


class Reader:
    """Reads one target's expositions into ``Parsed``, remembering what each series line means.

    Why remember: nearly all of a scrape's cost is prometheus_client parsing labels, and a server's series are the
    same from one scrape to the next -- only values change. A line whose series part (name and labels) was
    parsed before has just its value read, refused as prometheus_client would refuse it (a value with ``_``, a
    text that is not a number: the line goes back through the parser, which says why); every new series goes
    through prometheus_client's parser. OpenMetrics is parsed whole every time (names canonicalised first: see
    ``mapped_lines``). The per-family cap admits the first ``max_series`` label sets a target ever shows.
    """

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self.lines: dict[str, int] = {}  # series part -> slot index, or UNMAPPED / DROPPED
        self.slots: list[Slot] = []
        self.slot_of: dict[Slot, int] = {}
        self.admitted: dict[str, set[tuple[tuple[str, str], ...]]] = {}

    def read(self, body: bytes, content_type: str) -> Parsed:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ScrapeError("parse", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if content_type.split(";")[0].strip().lower() == "application/openmetrics-text":
            return self._openmetrics(text)
        acc: list[float] = [0.0] * len(self.slots)
        seen = bytearray(len(self.slots))
        unknown: list[tuple[str, str]] = []
        samples = dropped = 0
        if len(self.lines) > 100_000:
            self.lines.clear()  # series come and go over days: what is remembered stays about one exposition's worth
        get = self.lines.get
        for line in text.split("\n"):
            if not line or line[0] == "#":
                continue
            samples += 1
            close = line.rfind("}") + 1
            if close <= 0:
                close = line.find(" ")
                if close < 0:
                    close = line.find("\t")
            series = line[:close] if close > 0 else line
            idx = get(series)
            if idx is None:
                unknown.append((line, series))
                continue
            if idx < 0:
                dropped += idx == DROPPED
                continue
            rest = line[close:]
            try:
                if "_" in rest:
                    raise ValueError
                value = float(rest)
            except ValueError:  # a timestamp after the value, or no number at all: the parser decides
                unknown.append((line, series))
                continue
            if value - value == 0.0:  # not NaN or infinite (neither counts)
                acc[idx] += value
                seen[idx] = 1
        if unknown:
            dropped += self._parse_new(unknown, acc, seen)
        out = self._parsed(acc, seen, samples, dropped)
        if not out.families:
            return self._unmapped(out, text)
        return out

    def _parse_new(self, unknown: list[tuple[str, str]], acc: list[float], seen: bytearray) -> int:
        """New series lines through prometheus_client's text parser; their slots remembered. Returns lines dropped."""
        to_parse: list[tuple[str, str]] = []
        per_family: dict[str, int] = {}
        dropped = 0
        for line, series in unknown:
            name = series.split("{", 1)[0].rstrip()
            found = SAMPLE_ROLES.get(name)
            if found is None:
                self.lines[series] = UNMAPPED
                continue
            n = per_family.get(found[0].name, 0)
            if n >= MAX_LINES_PER_FAMILY:
                dropped += 1
                continue
            per_family[found[0].name] = n + 1
            to_parse.append((line, series))
        if not to_parse:
            return dropped
        try:
            parsed = [s for metric in text_families("\n".join(line for line, _ in to_parse) + "\n") for s in metric.samples]
        except Exception as exc:  # the parsers raise ValueError mostly, but hostile input reaches others too
            raise ScrapeError("parse", _short(f"{type(exc).__name__}: {exc}")) from None
        remember = len(parsed) == len(to_parse)  # one sample per line, in order: each line's meaning can be kept
        for i, s in enumerate(parsed):
            idx = self._slot(s.name, s.labels)
            if remember:
                self.lines[to_parse[i][1]] = idx
            dropped += _accumulate(acc, seen, idx, s.value)
        return dropped

    def _slot(self, name: str, labels: dict[str, str]) -> int:
        found = SAMPLE_ROLES.get(name)
        if found is None:
            return UNMAPPED
        fam, role = found
        if role == "quantile" or (role == "bucket" and fam.name not in NEEDS_BUCKETS):
            return UNMAPPED
        le = math.nan
        if role == "bucket":
            try:
                le = float(labels.get("le", "nan"))
            except ValueError:
                return UNMAPPED
            if math.isnan(le):
                return UNMAPPED
        kept = tuple(sorted((k, v) for k in fam.keep if (v := labels.get(k)) is not None))
        if any(len(v) > self.limits.max_label_value for _, v in kept):
            return DROPPED
        admitted = self.admitted.setdefault(fam.name, set())
        if kept not in admitted:
            if len(admitted) >= self.limits.max_series:
                return DROPPED
            admitted.add(kept)
        if role == "value":
            slot = Slot(fam.name, fam.type, bk.series_key(fam.name, dict(kept)))
        else:
            slot = Slot(fam.name, role, (fam.name, kept), le)
        idx = self.slot_of.get(slot)
        if idx is None:
            idx = self.slot_of[slot] = len(self.slots)
            self.slots.append(slot)
        return idx

    def _parsed(self, acc: list[float], seen: bytearray, samples: int, dropped: int) -> Parsed:
        out = Parsed(samples=samples, dropped=dropped)
        for idx in (i for i, flag in enumerate(seen) if flag):
            slot, value = self.slots[idx], acc[idx]
            out.families.add(slot.family)
            if slot.kind == "gauge":
                out.gauges[slot.key] = value  # type: ignore[index]
            elif slot.kind == "counter":
                out.counters[slot.key] = value  # type: ignore[index]
            else:
                hist = out.hists.get(slot.key)  # type: ignore[arg-type]
                if hist is None:
                    hist = out.hists[slot.key] = Hist()  # type: ignore[index]
                if slot.kind == "bucket":
                    hist.buckets[slot.le] = value
                elif slot.kind == "sum":
                    hist.sum = value
                else:
                    hist.count = value
        return out

    def _unmapped(self, out: Parsed, text: str) -> Parsed:
        """No mapped family in the exposition: a backend's page before its first request, or not a backend's."""
        lines = mapped_lines(text)
        out.dialects = lines.dialects
        if not lines.dialects:
            raise ScrapeError("no_families", f"none of the known backend families among {out.samples} samples")
        return out

    def _openmetrics(self, text: str) -> Parsed:
        lines = mapped_lines(text)
        if not lines.kept:
            if "# EOF" not in text:
                raise ScrapeError("parse", "OpenMetrics exposition without # EOF (cut off?)")
            return self._unmapped(Parsed(samples=lines.samples), text)
        try:
            parsed = [s for metric in openmetrics_families(lines.text()) for s in metric.samples]
        except Exception as exc:  # the parsers raise ValueError mostly, but hostile input reaches others too
            raise ScrapeError("parse", _short(f"{type(exc).__name__}: {exc}")) from None
        acc: list[float] = [0.0] * len(self.slots)
        seen = bytearray(len(self.slots))
        dropped = lines.over
        for s in parsed:
            dropped += _accumulate(acc, seen, self._slot(s.name, s.labels), s.value)
        out = self._parsed(acc, seen, lines.samples, dropped)
        return out if out.families else self._unmapped(out, text)


def parse(body: bytes, content_type: str, limits: Limits = Limits()) -> Parsed:
    """The mapped families of one exposition, read afresh. Raises ``ScrapeError`` (``parse``, ``no_families``)."""
    return Reader(limits).read(body, content_type)


def _short(text: str) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


def le_text(le: float) -> str:
    return "+Inf" if math.isinf(le) and le > 0 else repr(le)


def deltas(now: Hist, before: Hist | None, family: str, kept: Sequence[tuple[str, str]]) -> dict[str, float]:
    """What a histogram gained since ``before``: per bucket (each non-zero one and its lower neighbour), sum, count.

    A count or bucket that went down is a restart of the backend: everything it holds now is new (as PromQL's
    ``increase()`` counts after a reset). Without ``before`` (the series is new) there is no baseline: nothing.
    """
    if before is None:
        return {}
    reset = now.count < before.count or any(v < before.buckets.get(le, 0.0) for le, v in now.buckets.items())
    base = Hist() if reset else before
    out: dict[str, float] = {}
    labels = dict(kept)
    les = sorted(now.buckets)
    prev_cum = 0.0
    gains = []
    for le in les:
        cum = now.buckets[le] - base.buckets.get(le, 0.0)
        gains.append(max(0.0, cum - prev_cum))
        prev_cum = cum
    for i, (le, gain) in enumerate(zip(les, gains, strict=True)):
        if gain > 0 or (i + 1 < len(gains) and gains[i + 1] > 0):
            out[bk.series_key(family + "_bucket", {**labels, "le": le_text(le)})] = gain
    total = now.sum - base.sum
    count = now.count - base.count
    if count > 0:
        out[bk.series_key(family + "_sum", labels)] = total
        out[bk.series_key(family + "_count", labels)] = count
    return out


def _accumulate(acc: list[float], seen: bytearray, idx: int, value: float) -> int:
    """Add one parsed sample to its slot (series that share a slot, such as two ports' copies, sum);
    returns 1 when the sample was dropped by the cardinality cap, so the caller can count it."""
    if idx == DROPPED:
        return 1
    if idx >= 0 and math.isfinite(value):
        if idx >= len(acc):
            acc.extend([0.0] * (idx + 1 - len(acc)))
            seen.extend(bytes(idx + 1 - len(seen)))
        acc[idx] += value
        seen[idx] = 1
    return 0
