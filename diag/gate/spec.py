"""The gate's spec: the load steps and each step's criteria, written down before the run, read from YAML.

Why a spec and not flags: a rollout gate is a contract -- "at the target peak no OOM kill, p99 under 2 s" --
that is reviewed, versioned and re-run unchanged against the next model revision. So it is validated in
full before any request leaves: every error names the field by its path (``steps[2].criteria.e2e_p99_s``),
says what it got and what is accepted, and the first one found is raised as a ``SpecError``.

The shape (a complete example is ``docs/gate-example.yaml``)::

    endpoint: /v1/completions          # or /v1/chat/completions
    model: my-model                    # sent as "model" (optional)
    stream: false                      # the default of every step
    request_timeout: 30s               # every request is bounded by it
    max_in_flight: 256                 # open loop: arrivals beyond it are counted as dropped, never delayed
    seed: 0                            # arrival times and lengths are reproducible
    defaults: {prompt_tokens: 32, output_tokens: 16, criteria: {error_ratio: 0.01}}
    steps:
      - name: peak
        rate: 8                        # requests/s, Poisson arrivals (open loop); or concurrency: N (closed loop)
        duration: 20s
        prompt_tokens: {uniform: [16, 64]}   # or a number, or {normal: {mean: 32, stddev: 8}}
        criteria: {e2e_p99_s: 2, ttft_p50_s: 0.5, oom_kills: 0, psi_memory_some_avg10: 10}
    infrastructure: {require_cgroup_v2: false, require_psi: true, require_memory_max: true, forbid_swap: true}
    application:                       # checked before the steps (graceful_termination: after them)
      readiness: {path: /healthz, within: 60s}
      short_request: {prompt_tokens: 8, output_tokens: 8, within: 10s}
      long_prefill: {prompt_tokens: 2048, output_tokens: 1, within: 60s}
      concurrency: {requests: 4, within: 30s}
      graceful_termination: true       # needs --pid or --unit: SIGTERM with requests in flight (streamed if stream: true)
    neighbour:                         # the negative check: a bounded memory hog in a sibling cgroup during a step
      during: peak                     # the step it runs in (default: the last one)
      memory: 256MiB                   # what the hog touches; its group's hard limit is this plus a small slack
      start_after: 4s                  # into the step: the requests before it are the "before" (default: a third)
      hold: 6s                         # how long it holds its memory (default: to the step's end)
      criteria: {max_target_reclaimed_ratio: 0.1, e2e_p99_s: 2, max_latency_ratio: 2, oom_kills: 0}
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from diag.units import parse_duration, parse_size

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_STEPS = 32
MAX_STEP_S = 3600.0  # one step of an hour is already a soak test, not a gate
MAX_RATE = 10_000.0
MAX_CONCURRENCY = 4096
MAX_TOKENS = 1_000_000
MAX_IN_FLIGHT = 65_536
QUANTILE_RE = re.compile(r"^(e2e|ttft|itl)_p(\d{1,2}(?:\.\d{1,3})?)_s$")
TOP_KEYS = frozenset({"endpoint", "model", "stream", "request_timeout", "max_in_flight", "seed", "defaults", "steps", "version"})
TOP_KEYS = TOP_KEYS | {"infrastructure", "application"}  # the gates before the load: see "the gates' sections"
STEP_KEYS = frozenset({"name", "rate", "concurrency", "duration", "prompt_tokens", "output_tokens", "stream", "criteria"})
DEFAULT_KEYS = STEP_KEYS - {"name", "rate", "concurrency", "duration"}
SCALAR_CRITERIA = ("error_ratio", "oom_kills", "psi_memory_some_avg10", "drain_s")
TOP_KEYS = TOP_KEYS | {"neighbour"}  # the negative check: see "the neighbour section" below


class SpecError(ValueError):
    """A spec that cannot run: the message names the field path, the value and what is accepted."""


@dataclass(frozen=True)
class Lengths:
    """A token length: fixed, uniform in [low, high], or normal (mean, stddev) rounded and clipped to [1, ...]."""

    kind: str  # fixed | uniform | normal
    a: float
    b: float = 0.0

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, min(MAX_TOKENS, round(rng.gauss(self.a, self.b))))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform {int(self.a)}..{int(self.b)}"
        return f"normal {self.a:g}±{self.b:g}"


@dataclass(frozen=True)
class Quantile:
    """A latency quantile ceiling: ``metric`` (e2e, ttft, itl) at quantile ``q`` (0..1) under ``limit_s``."""

    metric: str
    q: float
    limit_s: float

    @property
    def key(self) -> str:
        return f"{self.metric}_p{self.q * 100:g}_s"


@dataclass(frozen=True)
class Recovery:
    """After an overload, latency is back within ``e2e_below_s`` no later than ``within_s`` into the step."""

    within_s: float
    e2e_below_s: float


@dataclass(frozen=True)
class Criteria:
    """One step's PASS conditions; a criterion left out is not judged."""

    quantiles: tuple[Quantile, ...] = ()
    error_ratio: float | None = None
    oom_kills: int | None = None
    psi_memory_some_avg10: float | None = None
    drain_s: float | None = None
    recovery: Recovery | None = None

    def names(self) -> list[str]:
        out = [q.key for q in self.quantiles]
        out += [k for k in SCALAR_CRITERIA if getattr(self, k) is not None]
        return out + (["recovery_s"] if self.recovery else [])


@dataclass(frozen=True)
class Step:
    """One load step: open loop at ``rate`` requests/s or closed loop with ``concurrency`` clients, for ``duration_s``."""

    name: str
    duration_s: float
    prompt_tokens: Lengths
    output_tokens: Lengths
    stream: bool
    criteria: Criteria
    rate: float | None = None
    concurrency: int | None = None

    def describe(self) -> str:
        load = f"{self.rate:g} req/s open loop" if self.rate is not None else f"{self.concurrency} clients closed loop"
        return f"{load}, {self.duration_s:g} s, prompt {self.prompt_tokens.describe()}, output {self.output_tokens.describe()}"


@dataclass(frozen=True)
class GateSpec:
    endpoint: str
    steps: tuple[Step, ...]
    model: str | None = None
    request_timeout_s: float = 30.0
    max_in_flight: int = 1024
    seed: int = 0
    source: str = "<spec>"
    neighbour: NeighbourSpec | None = None
    infrastructure: InfraSpec = field(default_factory=lambda: InfraSpec())
    application: AppSpec | None = None
    stream: bool = False  # the top-level default: how the service's clients call it (graceful termination sends so)

    @property
    def total_s(self) -> float:
        return sum(s.duration_s for s in self.steps)


# --------------------------------------------------------------------------- validation helpers


def _bad(path: str, value: Any, accepted: str) -> SpecError:
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return SpecError(f"{path}: got {shown}; {accepted}")


def _mapping(path: str, value: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(path, value, "expected a mapping of keys to values")
    for key in value:
        if not isinstance(key, str) or key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            raise SpecError(f"{where}: unknown key; accepted here: {', '.join(sorted(allowed))}")
    return value


def _number(path: str, value: Any, *, low: float, high: float, integer: bool = False, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(path, value, f"expected a {'whole ' if integer else ''}number")
    if integer and value != int(value):
        raise _bad(path, value, "expected a whole number")
    if value < low or (open_low and value == low) or value > high:
        lo = f"more than {low:g}" if open_low else f"at least {low:g}"
        raise _bad(path, value, f"expected {lo} and at most {high:g}")
    return float(value)


def _seconds(path: str, value: Any, *, high: float) -> float:
    """A duration: a number of seconds or a string with a unit (``500ms``, ``20s``, ``2m``)."""
    if isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError:
            raise _bad(path, value, "expected a duration: seconds, or a number with ms, s, m or h (e.g. 20s)") from None
    else:
        seconds = _number(path, value, low=0.0, high=high, open_low=True)
    if seconds > high:
        raise _bad(path, value, f"expected at most {high:g} s")
    return seconds


def _lengths(path: str, value: Any) -> Lengths:
    if not isinstance(value, dict):
        return Lengths("fixed", _number(path, value, low=1, high=MAX_TOKENS, integer=True))
    if len(value) != 1:
        raise SpecError(f"{path}: give one of a number, {{uniform: [low, high]}} or {{normal: {{mean: M, stddev: S}}}}")
    ((kind, body),) = value.items()
    if kind == "uniform":
        if not isinstance(body, list) or len(body) != 2:
            raise _bad(f"{path}.uniform", body, "expected [low, high]")
        low = _number(f"{path}.uniform[0]", body[0], low=1, high=MAX_TOKENS, integer=True)
        high = _number(f"{path}.uniform[1]", body[1], low=low, high=MAX_TOKENS, integer=True)
        return Lengths("uniform", low, high)
    if kind == "normal":
        body = _mapping(f"{path}.normal", body, frozenset({"mean", "stddev"}))
        if set(body) != {"mean", "stddev"}:
            raise SpecError(f"{path}.normal: needs both mean and stddev")
        mean = _number(f"{path}.normal.mean", body["mean"], low=1, high=MAX_TOKENS)
        return Lengths("normal", mean, _number(f"{path}.normal.stddev", body["stddev"], low=0, high=MAX_TOKENS))
    raise SpecError(f"{path}.{kind}: unknown distribution; accepted: uniform, normal (or a plain number)")


def _criteria(path: str, value: Any) -> Criteria:
    if value is None:
        return Criteria()
    if not isinstance(value, dict):
        raise _bad(path, value, "expected a mapping of criteria")
    quantiles: list[Quantile] = []
    out: dict[str, Any] = {}
    for key, limit in value.items():
        where = f"{path}.{key}"
        match = QUANTILE_RE.match(str(key))
        if match:
            q = float(match.group(2)) / 100.0
            if not 0.0 < q < 1.0:
                raise SpecError(f"{where}: the quantile must be between p0 and p100 (exclusive), e.g. e2e_p99_s")
            quantiles.append(Quantile(match.group(1), q, _seconds(where, limit, high=MAX_STEP_S)))
        elif key == "error_ratio":
            out[key] = _number(where, limit, low=0.0, high=1.0)
        elif key == "oom_kills":
            out[key] = int(_number(where, limit, low=0, high=1_000_000, integer=True))
        elif key == "psi_memory_some_avg10":
            out[key] = _number(where, limit, low=0.0, high=100.0)
        elif key == "drain_s":
            out[key] = _seconds(where, limit, high=MAX_STEP_S)
        elif key == "recovery":
            body = _mapping(where, limit, frozenset({"within_s", "e2e_below_s"}))
            if set(body) != {"within_s", "e2e_below_s"}:
                raise SpecError(f"{where}: needs both within_s and e2e_below_s")
            out[key] = Recovery(_seconds(f"{where}.within_s", body["within_s"], high=MAX_STEP_S),
                                _seconds(f"{where}.e2e_below_s", body["e2e_below_s"], high=MAX_STEP_S))  # fmt: skip
        else:
            raise SpecError(
                f"{where}: unknown criterion; accepted: e2e_pNN_s, ttft_pNN_s, itl_pNN_s (e.g. e2e_p99_s), "
                f"{', '.join(SCALAR_CRITERIA)}, recovery"
            )
    return Criteria(quantiles=tuple(quantiles), **out)


def _step(i: int, raw: Any, defaults: dict[str, Any], top_stream: bool, names: set[str]) -> Step:
    path = f"steps[{i}]"
    raw = _mapping(path, raw, STEP_KEYS)
    name = raw.get("name", f"step{i + 1}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}", name):
        raise _bad(f"{path}.name", name, "expected a short name of letters, digits, '-', '_' or '.'")
    if name in names:
        raise SpecError(f"{path}.name: {name!r} is used by an earlier step; each step needs its own name")
    names.add(name)
    if ("rate" in raw) == ("concurrency" in raw):
        raise SpecError(f"{path}: give exactly one of rate (requests/s, open loop) or concurrency (clients, closed loop)")
    if "duration" not in raw:
        raise SpecError(f"{path}.duration: missing; e.g. duration: 30s")
    merged = {**defaults, **raw}
    own = raw.get("criteria") or {}
    if not isinstance(own, dict):
        raise _bad(f"{path}.criteria", own, "expected a mapping of criteria")
    crit = {**(defaults.get("criteria") or {}), **own}  # a step's own criterion overrides the default one
    if "prompt_tokens" not in merged or "output_tokens" not in merged:
        missing = "prompt_tokens" if "prompt_tokens" not in merged else "output_tokens"
        raise SpecError(f"{path}.{missing}: missing (here or under defaults); e.g. {missing}: 32")
    stream = merged.get("stream", top_stream)
    if not isinstance(stream, bool):
        raise _bad(f"{path}.stream", stream, "expected true or false")
    criteria = _criteria(f"{path}.criteria", crit)
    for q in criteria.quantiles:
        if q.metric in ("ttft", "itl") and not stream:
            raise SpecError(f"{path}.criteria.{q.key}: {q.metric} is measured on streamed responses only; set stream: true")
    return Step(
        name=name,
        duration_s=_seconds(f"{path}.duration", raw["duration"], high=MAX_STEP_S),
        prompt_tokens=_lengths(f"{path}.prompt_tokens", merged["prompt_tokens"]),
        output_tokens=_lengths(f"{path}.output_tokens", merged["output_tokens"]),
        stream=stream,
        criteria=criteria,
        rate=_number(f"{path}.rate", raw["rate"], low=0.0, high=MAX_RATE, open_low=True) if "rate" in raw else None,
        concurrency=int(_number(f"{path}.concurrency", raw["concurrency"], low=1, high=MAX_CONCURRENCY, integer=True))
        if "concurrency" in raw
        else None,
    )


def parse_spec(data: Any, source: str = "<spec>") -> GateSpec:
    """A validated ``GateSpec`` from the parsed YAML document; ``SpecError`` names the first bad field."""
    top = _mapping("", data, TOP_KEYS) if isinstance(data, dict) else None
    if top is None:
        raise SpecError(f"{source}: expected a mapping with endpoint and steps at the top (got {type(data).__name__})")
    if top.get("version", 1) != 1:
        raise _bad("version", top["version"], "this diag gate reads version 1")
    endpoint = top.get("endpoint", ENDPOINTS[0])
    if endpoint not in ENDPOINTS:
        raise _bad("endpoint", endpoint, f"accepted: {', '.join(ENDPOINTS)}")
    model = top.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise _bad("model", model, "expected the model name the server serves, as a string")
    stream = top.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", stream, "expected true or false")
    timeout = _seconds("request_timeout", top.get("request_timeout", 30), high=600)
    in_flight = int(_number("max_in_flight", top.get("max_in_flight", 1024), low=1, high=MAX_IN_FLIGHT, integer=True))
    seed = int(_number("seed", top.get("seed", 0), low=0, high=2**63 - 1, integer=True))
    defaults = _mapping("defaults", top.get("defaults") or {}, DEFAULT_KEYS)
    if "criteria" in defaults and not isinstance(defaults["criteria"], dict):
        raise _bad("defaults.criteria", defaults["criteria"], "expected a mapping of criteria")
    if "criteria" in defaults:
        _criteria("defaults.criteria", defaults["criteria"])  # its own paths in the message
    steps_raw = top.get("steps")
    if not isinstance(steps_raw, list) or not steps_raw:
        raise _bad("steps", steps_raw, "expected a list of at least one step")
    if len(steps_raw) > MAX_STEPS:
        raise SpecError(f"steps: {len(steps_raw)} steps; at most {MAX_STEPS}")
    names: set[str] = set()
    steps = tuple(_step(i, raw, defaults, stream, names) for i, raw in enumerate(steps_raw))
    spec = GateSpec(endpoint, steps, model.strip() if model else None, timeout, in_flight, seed, source, stream=stream)
    return _with_neighbour(_with_gates(spec, top), top)


def load_spec(path: str | Path) -> GateSpec:
    """Read and validate a spec file; ``SpecError`` for an unreadable file, bad YAML or a bad field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{p}: cannot read the spec ({exc.strerror if isinstance(exc, OSError) else exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SpecError(f"{p}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    return parse_spec(data, source=str(p))


# --------------------------------------------------------------------------- the gates' sections
# ``infrastructure:`` and ``application:``, checked before the steps (diag/gate/infra.py, diag/gate/app_gate.py).

INFRA_REQUIREMENTS = ("require_cgroup_v2", "require_psi", "require_memory_max", "require_memory_accounting", "forbid_swap")
APP_KEYS = frozenset({"readiness", "short_request", "long_prefill", "concurrency", "graceful_termination"})
MAX_APP_REQUESTS = 256  # the concurrency check's and the termination's requests: a gate's probe, not a load step


@dataclass(frozen=True)
class InfraSpec:
    """What the host must hold. Every requirement is off by default: the infrastructure gate then only reports
    (a v1 host, no limit, swap on are WARNs); a requirement the host does not meet FAILs the gate."""

    require_cgroup_v2: bool = False
    require_psi: bool = False  # memory PSI readable (the group's own, or at least the host's)
    require_memory_max: bool = False  # the target's group has an effective hard limit
    require_memory_accounting: bool = False  # the memory controller accounts for the target's group
    forbid_swap: bool = False  # the target's memory cannot go to swap (no swap, or a zero swap limit)

    def required(self) -> list[str]:
        return [k for k in INFRA_REQUIREMENTS if getattr(self, k)]


@dataclass(frozen=True)
class Readiness:
    """A GET of ``path`` on the target, polled until it answers 2xx, at most ``within_s``."""

    path: str = "/health"
    within_s: float = 60.0


@dataclass(frozen=True)
class Probe:
    """``requests`` simultaneous completions of these lengths, each to succeed within ``within_s``."""

    prompt_tokens: int
    output_tokens: int
    within_s: float
    requests: int = 1


@dataclass(frozen=True)
class AppSpec:
    """The application gate: each check left out is not run."""

    readiness: Readiness | None = None
    short_request: Probe | None = None
    long_prefill: Probe | None = None
    concurrency: Probe | None = None
    graceful_termination: Probe | None = None  # requests in flight at SIGTERM; within_s: the process's exit

    def names(self) -> list[str]:
        return [k for k in ("readiness", "short_request", "long_prefill", "concurrency", "graceful_termination")
                if getattr(self, k) is not None]  # fmt: skip


def _flag(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(path, value, "expected true or false")
    return value


def _infrastructure(value: Any) -> InfraSpec:
    if value is None:
        return InfraSpec()
    body = _mapping("infrastructure", value, frozenset(INFRA_REQUIREMENTS))
    return InfraSpec(**{k: _flag(f"infrastructure.{k}", v) for k, v in body.items()})


def _readiness(value: Any) -> Readiness:
    path = "application.readiness"
    if isinstance(value, str):
        value = {"path": value}
    body = _mapping(path, value, frozenset({"path", "within"}))
    url_path = body.get("path", Readiness.path)
    if not isinstance(url_path, str) or not url_path.startswith("/") or "://" in url_path or any(c.isspace() for c in url_path):
        raise _bad(f"{path}.path", url_path, "expected a path on the target starting with '/', e.g. /health")
    return Readiness(url_path, _seconds(f"{path}.within", body.get("within", Readiness.within_s), high=MAX_STEP_S))


def _probe(path: str, value: Any, defaults: dict[str, float], *, need: tuple[str, ...] = ()) -> Probe | None:
    """A request check: ``true`` takes ``defaults``, a mapping overrides them; ``false`` leaves the check out."""
    if value is False:
        return None
    if value is True:
        if need:
            raise SpecError(f"{path}: give a mapping with {need[0]}, e.g. {{{need[0]}: {int(defaults.get(need[0], 4))}}}")
        value = {}
    body = _mapping(
        path, value, frozenset({"prompt_tokens", "output_tokens", "within", "requests"} & (set(defaults) | set(need)))
    )
    for key in need:
        if key not in body:
            raise SpecError(f"{path}.{key}: missing; e.g. {key}: {int(defaults.get(key, 4))}")
    merged = {**defaults, **body}
    tokens = {k: int(_number(f"{path}.{k}", merged[k], low=1, high=MAX_TOKENS, integer=True))
              for k in ("prompt_tokens", "output_tokens")}  # fmt: skip
    requests = int(_number(f"{path}.requests", merged.get("requests", 1), low=1, high=MAX_APP_REQUESTS, integer=True))
    return Probe(**tokens, within_s=_seconds(f"{path}.within", merged["within"], high=MAX_STEP_S), requests=requests)


def _application(value: Any) -> AppSpec | None:
    if value is None:
        return None
    body = _mapping("application", value, APP_KEYS)
    p = "application."
    return AppSpec(
        readiness=_readiness(body["readiness"]) if "readiness" in body else None,
        short_request=_probe(p + "short_request", body["short_request"], {"prompt_tokens": 8, "output_tokens": 8,
                             "within": 30.0}) if "short_request" in body else None,
        long_prefill=_probe(p + "long_prefill", body["long_prefill"], {"prompt_tokens": 2048, "output_tokens": 1,
                            "within": 120.0}, need=("prompt_tokens",)) if "long_prefill" in body else None,
        concurrency=_probe(p + "concurrency", body["concurrency"], {"prompt_tokens": 16, "output_tokens": 8,
                           "within": 60.0, "requests": 4}, need=("requests",)) if "concurrency" in body else None,
        graceful_termination=_probe(p + "graceful_termination", body["graceful_termination"], {"prompt_tokens": 8,
                                    "output_tokens": 32, "within": 30.0, "requests": 2})
        if "graceful_termination" in body else None,
    )  # fmt: skip


def _with_gates(spec: GateSpec, top: dict[str, Any]) -> GateSpec:
    """The spec with its ``infrastructure:`` and ``application:`` sections read (both optional)."""
    return replace(spec, infrastructure=_infrastructure(top.get("infrastructure")),
                   application=_application(top.get("application")))  # fmt: skip


# --------------------------------------------------------------------------- the neighbour section
# ``neighbour:``: a bounded memory hog in a sibling cgroup of the service's during one step (diag/gate/neighbour.py).

NEIGHBOUR_KEYS = frozenset({"during", "memory", "start_after", "hold", "criteria"})
NEIGHBOUR_CRITERIA = ("max_target_reclaimed_ratio", "max_latency_ratio", "error_ratio", "oom_kills")
MIN_NEIGHBOUR_BYTES = 1 << 20
MAX_NEIGHBOUR_BYTES = 4 << 30  # a neighbour that needs more is a capacity test, not a gate's probe
MIN_HOLD_S = 1.0  # the target's memory is sampled a few times a second: less shows nothing


@dataclass(frozen=True)
class NeighbourCriteria:
    """What the service must hold while the neighbour holds its memory; a criterion left out is not judged.

    ``max_target_reclaimed_ratio``: the share of the service's resident memory the kernel took back during the
    hold; ``max_latency_ratio``: e2e p99 during the hold over p99 before it (same step, same load); the latency
    quantiles and ``error_ratio`` count the requests scheduled during the hold; ``oom_kills`` in the service."""

    quantiles: tuple[Quantile, ...] = ()
    max_target_reclaimed_ratio: float | None = None
    max_latency_ratio: float | None = None
    error_ratio: float | None = None
    oom_kills: int | None = None

    def names(self) -> list[str]:
        return [q.key for q in self.quantiles] + [k for k in NEIGHBOUR_CRITERIA if getattr(self, k) is not None]


@dataclass(frozen=True)
class NeighbourSpec:
    """A hog touching ``memory_bytes`` in a sibling cgroup of the service's, from ``start_after_s`` into step
    ``during`` for ``hold_s``, while that step's load runs."""

    during: str
    memory_bytes: int
    start_after_s: float
    hold_s: float
    criteria: NeighbourCriteria


def _neighbour_criteria(path: str, value: Any) -> NeighbourCriteria:
    if value is None:
        return NeighbourCriteria()
    if not isinstance(value, dict):
        raise _bad(path, value, "expected a mapping of criteria")
    quantiles: list[Quantile] = []
    out: dict[str, Any] = {}
    for key, limit in value.items():
        where = f"{path}.{key}"
        match = QUANTILE_RE.match(str(key))
        if match and match.group(1) == "e2e":
            q = float(match.group(2)) / 100.0
            if not 0.0 < q < 1.0:
                raise SpecError(f"{where}: the quantile must be between p0 and p100 (exclusive), e.g. e2e_p99_s")
            quantiles.append(Quantile("e2e", q, _seconds(where, limit, high=MAX_STEP_S)))
        elif key in ("max_target_reclaimed_ratio", "error_ratio"):
            out[key] = _number(where, limit, low=0.0, high=1.0)
        elif key == "max_latency_ratio":
            out[key] = _number(where, limit, low=1.0, high=1000.0)
        elif key == "oom_kills":
            out[key] = int(_number(where, limit, low=0, high=1_000_000, integer=True))
        else:
            raise SpecError(f"{where}: unknown criterion; accepted: e2e_pNN_s (e.g. e2e_p99_s), {', '.join(NEIGHBOUR_CRITERIA)}")
    return NeighbourCriteria(quantiles=tuple(quantiles), **out)


def _neighbour_memory(path: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            size = parse_size(value)
        except ValueError:
            raise _bad(path, value, "expected a size, e.g. 256MiB or 1GiB") from None
    else:
        size = int(_number(path, value, low=MIN_NEIGHBOUR_BYTES, high=MAX_NEIGHBOUR_BYTES, integer=True))
    if not MIN_NEIGHBOUR_BYTES <= size <= MAX_NEIGHBOUR_BYTES:
        raise _bad(path, value, f"expected between 1MiB and {MAX_NEIGHBOUR_BYTES >> 30}GiB")
    return size


def parse_neighbour(value: Any, steps: tuple[Step, ...]) -> NeighbourSpec:
    """The ``neighbour:`` section against the steps it refers to; ``SpecError`` names the first bad field."""
    body = _mapping("neighbour", value, NEIGHBOUR_KEYS)
    if "memory" not in body:
        raise SpecError("neighbour.memory: missing; the size the hog touches, e.g. memory: 256MiB")
    during = body.get("during", steps[-1].name)
    by_name = {s.name: s for s in steps}
    if during not in by_name:
        raise _bad("neighbour.during", during, f"expected the name of a step: {', '.join(by_name)}")
    step = by_name[during]
    start = _seconds("neighbour.start_after", body["start_after"], high=MAX_STEP_S) if "start_after" in body \
        else step.duration_s / 3  # fmt: skip
    if start >= step.duration_s:
        raise SpecError(f"neighbour.start_after: {start:g} s is not within step {during!r} ({step.duration_s:g} s)")
    hold = _seconds("neighbour.hold", body["hold"], high=MAX_STEP_S) if "hold" in body else step.duration_s - start
    if hold < MIN_HOLD_S:
        raise _bad("neighbour.hold", body.get("hold", hold), f"expected at least {MIN_HOLD_S:g} s")
    if start + hold > step.duration_s + 1e-9:
        raise SpecError(
            f"neighbour: start_after {start:g} s + hold {hold:g} s ends after step {during!r} ({step.duration_s:g} s); "
            "the neighbour runs while that step's load does"
        )
    criteria = _neighbour_criteria("neighbour.criteria", body.get("criteria"))
    if not criteria.names():
        raise SpecError("neighbour.criteria: missing; e.g. {max_target_reclaimed_ratio: 0.1, e2e_p99_s: 2, oom_kills: 0}")
    if criteria.max_latency_ratio is not None and start <= 0:
        raise SpecError("neighbour.criteria.max_latency_ratio: needs start_after > 0 (the requests before are the baseline)")
    return NeighbourSpec(during, _neighbour_memory("neighbour.memory", body["memory"]), start, hold, criteria)


def _with_neighbour(spec: GateSpec, top: dict[str, Any]) -> GateSpec:
    if top.get("neighbour") is None:
        return spec
    return replace(spec, neighbour=parse_neighbour(top["neighbour"], spec.steps))
