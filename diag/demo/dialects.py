"""The reference backend speaking another engine's /metrics: vLLM's, TGI's or llama.cpp server's families.

Why: llm-diag must diagnose engines it did not instrument, from their own metrics alone (``diag collect
--scrape``). The demo serving those families from its *own live state* -- its queue, its running batch,
its KV-cache budget (``diag.demo.kvcache``), the timings of the requests it really served -- lets every
scenario run as an uninstrumented vLLM, TGI or llama.cpp host would, end to end, on this machine.

What is exported: every family of the dialect declared in ``collectors.backends`` (names, types, label
names, fixed buckets are read from there, never spelled here) that the demo's state can fill and that
the pinned release of the engine has (a family declared for a later or an earlier release is left out:
a vLLM of the pinned commit exports no ``num_requests_waiting_by_reason``, a llama.cpp server of the
pinned commit no KV usage). Families the demo has nothing for (prefix caching, speculative tokens,
per-method batch timings) are left out too, as a host that never used the feature would not fill them.
Runtime-set buckets (TGI's token-length histograms: 100 steps of the configured maximum) are computed as
the engine computes them from the demo's limits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from collectors import backends as bk
from diag.demo.kvcache import KvBudget

OURS = "llmdiag"
DIALECTS: tuple[str, ...] = bk.DIALECTS  # llmdiag (ours: the tracker's families), vllm, tgi, llamacpp
PINNED = {"vllm": bk.VLLM_AT, "tgi": bk.TGI_AT, "llamacpp": bk.LLAMACPP_AT}
TGI_LENGTH_STEPS = 100


@dataclass
class _Hist:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class Served:
    """One finished request's timings (seconds, from its arrival) and token counts."""

    prompt_tokens: int
    output_tokens: int
    queue_s: float  # arrival -> a slot
    ttft_s: float  # arrival -> first token
    e2e_s: float  # arrival -> last token
    inference_s: float  # slot -> last token (prefill + decode)
    prefill_s: float  # slot -> first token
    decode_s: float  # first token -> last token


def _labels(names: Iterable[str], values: dict[str, str]) -> str:
    pairs = [f'{n}="{values[n]}"' for n in names if n in values]
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{float(v):.1f}"


class DialectMetrics:
    """The live state one worker exports in ``dialect`` (and in each of ``also``); the app calls ``arrived`` and
    ``finished`` (or ``left``).

    The state is the engine's, whatever the dialect: one set of counters and histograms, which ``render`` writes as
    any exported engine names them. So one run can be read by several engines' mappings at once -- the same requests,
    the same queue, the same KV cache -- where separate runs would each see their own load.
    """

    def __init__(self, dialect: str, model_name: str, kv: KvBudget | None, *, max_prompt_tokens: int,
                 max_output_tokens: int, running: Callable[[], int] = lambda: 0, also: Iterable[str] = ()) -> None:  # fmt: skip
        exported = (dialect, *also)
        for d in exported:
            if d not in PINNED:
                raise ValueError(f"metrics dialect must be one of {', '.join(PINNED)} (or {OURS}: the tracker's own)")
        if len(set(exported)) != len(exported):
            raise ValueError(f"metrics dialects named twice: {', '.join(exported)}")
        self.dialect = dialect
        self.exported = exported
        self.kv = kv
        self.running_now = running  # the engine's running batch (the batcher's live sequences)
        self.const = {"model_name": model_name, "engine": "0"}
        self._lock = threading.Lock()
        self.in_system = 0  # arrived, not yet answered: running or waiting (for a slot, a batch, KV blocks)
        self.counters: dict[tuple[str, str], float] = {}
        self.hists: dict[str, _Hist] = {}
        self.max_prompt_tokens, self.max_output_tokens = max_prompt_tokens, max_output_tokens
        self.families_of = {
            d: [f for f in bk.families_of(d) if f.versions == PINNED[d] and f.name in FILLED[d]] for d in exported
        }
        for fams in self.families_of.values():
            for f in fams:
                if f.type == "histogram":
                    self.hists[f.name] = _Hist(self._buckets(f))

    def _buckets(self, f: bk.Family) -> tuple[float, ...]:
        if f.buckets is not None:
            return f.buckets
        top = {bk.TGI_INPUT_LENGTH.name: self.max_prompt_tokens,
               bk.TGI_GENERATED_TOKENS.name: self.max_prompt_tokens + self.max_output_tokens}[f.name]  # fmt: skip
        return tuple(float(top * (i + 1) / TGI_LENGTH_STEPS) for i in range(TGI_LENGTH_STEPS))

    # ------------------------------------------------------------------ what the app reports

    def arrived(self) -> None:
        with self._lock:
            self.in_system += 1

    def left(self, *, refused: bool, failed: bool) -> None:
        """A request that ends without a completion: refused at admission, or failed."""
        with self._lock:
            self.in_system -= 1
            self._add(bk.TGI_REQUEST_COUNT.name, 1)
            if refused:
                self._add(bk.TGI_REQUEST_FAILURE.name, 1, "overloaded")
            elif failed:
                self._add(bk.TGI_REQUEST_FAILURE.name, 1, "generation")

    def finished(self, r: Served) -> None:
        with self._lock:
            self.in_system -= 1
            tpot = r.decode_s / max(1, r.output_tokens - 1)
            for name, value in (
                (bk.VLLM_PROMPT_TOKENS.name, r.prompt_tokens),
                (bk.VLLM_GENERATION_TOKENS.name, r.output_tokens),
                (bk.LLAMACPP_PROMPT_TOKENS.name, r.prompt_tokens),
                (bk.LLAMACPP_PROMPT_SECONDS.name, r.prefill_s),
                (bk.LLAMACPP_TOKENS_PREDICTED.name, r.output_tokens),
                (bk.LLAMACPP_PREDICTED_SECONDS.name, r.decode_s),
                (bk.TGI_REQUEST_COUNT.name, 1),
                (bk.TGI_REQUEST_SUCCESS.name, 1),
            ):
                self._add(name, value)
            self._add(bk.VLLM_SUCCESS.name, 1, "length")  # the demo always generates max_tokens
            for name, value in (
                (bk.VLLM_TTFT.name, r.ttft_s),
                (bk.VLLM_TPOT.name, tpot),
                (bk.VLLM_E2E.name, r.e2e_s),
                (bk.VLLM_QUEUE_TIME.name, r.queue_s),
                (bk.VLLM_INFERENCE_TIME.name, r.inference_s),
                (bk.VLLM_PREFILL_TIME.name, r.prefill_s),
                (bk.VLLM_DECODE_TIME.name, r.decode_s),
                (bk.TGI_REQUEST_DURATION.name, r.e2e_s),
                (bk.TGI_QUEUE_DURATION.name, r.queue_s),
                (bk.TGI_INFERENCE_DURATION.name, r.inference_s),
                (bk.TGI_TIME_PER_TOKEN.name, tpot),
                (bk.TGI_INPUT_LENGTH.name, r.prompt_tokens),
                (bk.TGI_GENERATED_TOKENS.name, r.output_tokens),
            ):
                h = self.hists.get(name)
                if h is not None:
                    h.observe(value)

    def _add(self, name: str, value: float, label: str = "") -> None:
        self.counters[(name, label)] = self.counters.get((name, label), 0.0) + value

    # ------------------------------------------------------------------ the exposition

    def _gauges(self) -> dict[str, float]:
        usage = self.kv.usage if self.kv is not None else 0.0
        running = min(self.running_now(), self.in_system)
        waiting = self.in_system - running
        p_tok, p_s = (
            self.counters.get((bk.LLAMACPP_PROMPT_TOKENS.name, ""), 0.0),
            self.counters.get((bk.LLAMACPP_PROMPT_SECONDS.name, ""), 0.0),
        )
        g_tok, g_s = (
            self.counters.get((bk.LLAMACPP_TOKENS_PREDICTED.name, ""), 0.0),
            self.counters.get((bk.LLAMACPP_PREDICTED_SECONDS.name, ""), 0.0),
        )
        return {
            bk.VLLM_RUNNING.name: running,
            bk.VLLM_WAITING.name: waiting,
            bk.VLLM_KV_USAGE.name: usage,
            bk.TGI_QUEUE_SIZE.name: waiting,
            bk.TGI_BATCH_CURRENT_SIZE.name: running,
            bk.TGI_BATCH_MAX_TOTAL_TOKENS.name: self.kv.total_tokens if self.kv is not None else 0,
            bk.LLAMACPP_PROCESSING.name: running,
            bk.LLAMACPP_DEFERRED.name: waiting,
            bk.LLAMACPP_PROMPT_TPS.name: p_tok / p_s if p_s > 0 else 0.0,
            bk.LLAMACPP_PREDICTED_TPS.name: g_tok / g_s if g_s > 0 else 0.0,
        }

    def render(self, dialect: str | None = None) -> str:
        """The classic text exposition (version 0.0.4) of every family ``dialect`` (default: the first) exports, as
        that engine writes it."""
        families = self.families_of[dialect or self.dialect]
        with self._lock:
            gauges = self._gauges()
            if self.kv is not None:
                self.counters[(bk.VLLM_PREEMPTIONS.name, "")] = float(self.kv.preemptions)
            lines: list[str] = []
            for f in families:
                lines.append(f"# HELP {f.base} {f.help}")
                lines.append(f"# TYPE {f.base} {f.type}")
                lines.extend(self._samples(f, gauges))
        return "\n".join(lines) + "\n"

    def _samples(self, f: bk.Family, gauges: dict[str, float]) -> list[str]:
        label_of = {"finished_reason": "length", "err": "", "reason": ""}
        if f.type == "gauge":
            return [f"{f.name}{_labels(f.labels, self.const)} {_num(gauges.get(f.name, 0.0))}"]
        if f.type == "counter":
            sample = f.base + "_total" if f.name.endswith("_total") else f.name
            extra = [n for n in f.labels if n in label_of]
            if not extra:
                return [f"{sample}{_labels(f.labels, self.const)} {_num(self.counters.get((f.name, ''), 0.0))}"]
            out = []
            for (name, label), value in sorted(self.counters.items()):
                if name == f.name:
                    out.append(f"{sample}{_labels(f.labels, {**self.const, extra[0]: label})} {_num(value)}")
            return out
        h = self.hists[f.name]
        out = []
        for b, c in zip(h.buckets, h.counts, strict=True):
            out.append(f"{f.name}_bucket{_labels((*f.labels, 'le'), {**self.const, 'le': _num(b)})} {_num(c)}")
        out.append(f"{f.name}_bucket{_labels((*f.labels, 'le'), {**self.const, 'le': '+Inf'})} {_num(h.n)}")
        out.append(f"{f.name}_sum{_labels(f.labels, self.const)} {_num(h.total)}")
        out.append(f"{f.name}_count{_labels(f.labels, self.const)} {_num(h.n)}")
        return out


# What the demo's state fills, per dialect (family names from collectors.backends).
_VLLM = (bk.VLLM_RUNNING, bk.VLLM_WAITING, bk.VLLM_KV_USAGE, bk.VLLM_PREEMPTIONS, bk.VLLM_PROMPT_TOKENS,
         bk.VLLM_GENERATION_TOKENS, bk.VLLM_SUCCESS, bk.VLLM_TTFT, bk.VLLM_TPOT, bk.VLLM_E2E, bk.VLLM_QUEUE_TIME,
         bk.VLLM_INFERENCE_TIME, bk.VLLM_PREFILL_TIME, bk.VLLM_DECODE_TIME)  # fmt: skip
_TGI = (bk.TGI_REQUEST_COUNT, bk.TGI_REQUEST_SUCCESS, bk.TGI_REQUEST_FAILURE, bk.TGI_QUEUE_SIZE, bk.TGI_BATCH_CURRENT_SIZE,
        bk.TGI_BATCH_MAX_TOTAL_TOKENS, bk.TGI_REQUEST_DURATION, bk.TGI_QUEUE_DURATION, bk.TGI_INFERENCE_DURATION,
        bk.TGI_TIME_PER_TOKEN, bk.TGI_INPUT_LENGTH, bk.TGI_GENERATED_TOKENS)  # fmt: skip
_LLAMACPP = (bk.LLAMACPP_PROMPT_TOKENS, bk.LLAMACPP_PROMPT_SECONDS, bk.LLAMACPP_TOKENS_PREDICTED,
             bk.LLAMACPP_PREDICTED_SECONDS, bk.LLAMACPP_PROMPT_TPS, bk.LLAMACPP_PREDICTED_TPS, bk.LLAMACPP_PROCESSING,
             bk.LLAMACPP_DEFERRED)  # fmt: skip
FILLED: dict[str, frozenset[str]] = {
    "vllm": frozenset(f.name for f in _VLLM),
    "tgi": frozenset(f.name for f in _TGI),
    "llamacpp": frozenset(f.name for f in _LLAMACPP),
}
