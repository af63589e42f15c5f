"""The demo model: a byte tokenizer and a small decoder-only transformer in numpy (float32).

Why numpy and not torch: the point is a service whose *memory behaviour* is real and explainable on
a 2-core CI box with no GPU -- weights resident per worker or shared, a KV cache that really grows
with the context, an MoE router whose per-expert token counts are real -- without a 1.5 GB torch
install (a demo must start on any host in seconds). The text it writes is noise (random weights); the bytes it
holds and the work it does are not.

Architecture (shapes in ``weights.ModelConfig``): token embedding + hashed-trigram embedding +
sinusoidal positions (scaled by 0.05: at full scale their shared direction dominates every hidden
state and a random router sends all tokens to one or two experts, so ``--router-skew 0`` would not be
balanced) -> ``n_layers`` x [RMSNorm, multi-head causal attention with a per-sequence KV
cache, RMSNorm, dense SiLU FFN or top-k MoE FFN] -> RMSNorm -> tied output projection. Sampling is
over printable ASCII and newline at temperature 1 with a generator seeded from the prompt (the same
prompt gives the same text), and always runs ``max_tokens`` steps (EOS is never chosen, like vLLM's
``ignore_eos`` in benchmarks), so the work per request is a function of its tokens only.

Memory per token in flight, with the defaults (d 256, 2 layers, FFN 512): the KV cache keeps 4 KiB
per token for the life of the request (reserved for prompt + max_tokens when the request enters the
model, as vLLM reserves blocks; it doubles if fed more), and a prefill holds ~12 KiB per token of
activations transiently. Attention scores are computed in query chunks of ``ATTN_CHUNK`` rows, so
they cost ``heads * ATTN_CHUNK * context * 4`` bytes at a time: every memory term is linear in the
context, none quadratic.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from diag.demo.weights import BOS, PAD, VOCAB_BYTES, LoadedWeights, ModelConfig

ATTN_CHUNK = 256
_PRINTABLE = np.full(259, -np.inf, dtype=np.float32)
_PRINTABLE[32:127] = 0.0
_PRINTABLE[10] = 0.0


class ByteTokenizer:
    """UTF-8 bytes are the tokens (0-255); BOS/EOS/PAD are 256-258. Nothing to download, nothing to leak."""

    def encode(self, text: str) -> list[int]:
        return [BOS, *text.encode("utf-8", errors="replace")]

    def decode(self, ids: Seq[int]) -> str:
        return bytes(i for i in ids if 0 <= i < VOCAB_BYTES).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        """Prompt tokens without building the list (admission checks run before any work)."""
        return 1 + len(text.encode("utf-8", errors="replace"))


class KVCache:
    """Keys and values of one sequence, [layers, heads, capacity, head_dim] each, grown by doubling.

    Grows with prompt and generated tokens for the life of the request and is freed with it, so a
    long context shows up in RSS exactly as it does in a real server's KV cache.
    """

    def __init__(self, config: ModelConfig, capacity: int = 64) -> None:
        self.config = config
        self.length = 0
        self._alloc(max(1, capacity))

    def _alloc(self, capacity: int) -> None:
        c = self.config
        shape = (c.n_layers, c.n_heads, capacity, c.head_dim)
        k, v = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, extra: int) -> None:
        need = self.length + extra
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            self._alloc(cap)


@dataclass
class Sequence:
    """One request's state inside the model: its tokens so far, its KV cache, what it still owes."""

    ids: list[int]
    max_tokens: int
    cache: KVCache
    prompt_len: int = 0
    generated: list[int] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens

    @property
    def pending(self) -> list[int]:
        """Tokens not yet in the KV cache: the whole prompt before prefill, the last token after."""
        return self.ids[self.cache.length :]


def _rmsnorm(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    return x * (gain / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _positions(pos: np.ndarray, d: int) -> np.ndarray:
    half = d // 2
    freq = np.exp(-np.log(10000.0) * np.arange(half, dtype=np.float32) / half)
    ang = pos[:, None].astype(np.float32) * freq[None, :]
    return (0.05 * np.concatenate([np.sin(ang), np.cos(ang)], axis=1)).astype(np.float32)


def _trigram_rows(ids: np.ndarray, prev: tuple[int, int], rows: int) -> np.ndarray:
    """Row of the hashed trigram table for each token (its two predecessors and itself)."""
    full = np.concatenate([np.asarray(prev, dtype=np.uint64), ids.astype(np.uint64)])
    a, b, c = full[:-2], full[1:-1], full[2:]
    h = (a * np.uint64(0x9E3779B1) + b * np.uint64(0x85EBCA77) + c * np.uint64(0xC2B2AE3D)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    return (h % np.uint64(rows)).astype(np.intp)


class StepAborted(Exception):
    """``step`` stopped early because ``should_stop`` said every sequence in it was abandoned."""


class DemoModel:
    """Runs ragged batches (prefill of several prompts, or one decode step of several sequences) in one pass.

    Projections and FFNs run on the batch's tokens concatenated -- so a batch's activation memory
    is proportional to its total tokens, as in vLLM's varlen prefill -- and attention runs per
    sequence against its own KV cache. ``router_skew`` adds that many logits (the router's logits have
    unit scale) to expert 0: 0 leaves the random router balanced, 3+ sends nearly every token there.

    ``capacity_factor`` > 0 gives every expert a capacity per pass of ``ceil(factor * tokens * top_k /
    experts)`` token-slots, as GShard/Switch-style MoE layers do: tokens routed to a full expert are
    dropped from it (in token order; they keep their other experts and the residual path) -- the
    overflow is real and the output changes. 0 (the default) = no capacity, nothing dropped.
    """

    def __init__(self, weights: LoadedWeights, router_skew: float = 0.0, capacity_factor: float = 0.0) -> None:
        self.weights = weights
        self.config = weights.config
        self.router_skew = float(router_skew)
        self.capacity_factor = float(capacity_factor)
        if self.capacity_factor < 0:
            raise ValueError("capacity_factor must not be negative")

    def new_sequence(self, prompt_ids: Seq[int], max_tokens: int) -> Sequence:
        ids = list(prompt_ids)
        seed = zlib.crc32(np.asarray(ids, dtype=np.int32).tobytes())
        cache = KVCache(self.config, capacity=len(ids) + max_tokens)
        return Sequence(ids, max_tokens, cache, prompt_len=len(ids), rng=np.random.default_rng(seed))

    def step(
        self,
        seqs: Seq[Sequence],
        routing: np.ndarray | None = None,
        capacity: np.ndarray | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Feed every sequence its pending tokens and append one greedy token to each.

        ``routing`` ([layers, experts] int64), when given, accumulates how many token-slots each
        expert received -- the real counts, for ``record_routing``; ``capacity`` ([layers] int64), when
        given and a capacity factor is set, accumulates each layer's per-expert capacity of the passes.
        ``should_stop``, when given, is asked between layers and attention chunks; True raises
        ``StepAborted`` (the sequences are left unusable): a long prefill whose requests all timed
        out stops within a chunk instead of running to its end.
        """
        self._should_stop = should_stop
        live = [s for s in seqs if not s.done and s.pending]
        if not live:
            return
        c = self.config
        t = self.weights.tensors
        segs: list[tuple[Sequence, int, int]] = []  # (seq, offset in the batch, start position)
        ids_parts, pos_parts, row_parts = [], [], []
        off = 0
        for s in live:
            pend = np.asarray(s.pending, dtype=np.int64)
            start = s.cache.length
            s.cache.reserve(len(pend))
            prev = tuple([PAD, PAD, *s.ids[:start]][-2:])
            ids_parts.append(pend)
            pos_parts.append(np.arange(start, start + len(pend)))
            row_parts.append(_trigram_rows(pend, prev, c.table_rows))  # type: ignore[arg-type]
            segs.append((s, off, start))
            off += len(pend)
        ids = np.concatenate(ids_parts)
        x = t["tok_emb"][ids] + t["ngram_table"][np.concatenate(row_parts)] + _positions(np.concatenate(pos_parts), c.d_model)

        for layer in range(c.n_layers):
            self._check()
            p = f"layers.{layer}."
            h = _rmsnorm(x, t[p + "attn_norm"])
            q, k, v = h @ t[p + "wq"], h @ t[p + "wk"], h @ t[p + "wv"]
            attn = np.empty_like(q)
            for s, o, start in segs:
                n = len(s.ids) - start
                attn[o : o + n] = self._attend(s.cache, layer, start, q[o : o + n], k[o : o + n], v[o : o + n])
            x = x + attn @ t[p + "wo"]
            h = _rmsnorm(x, t[p + "ffn_norm"])
            ffn = self._moe(h, p, layer, routing, capacity) if c.experts else _silu(h @ t[p + "w1"]) @ t[p + "w2"]
            x = x + ffn

        last = np.array([o + len(s.ids) - start - 1 for s, o, start in segs])
        logits = _rmsnorm(x[last], t["final_norm"]) @ t["tok_emb"].T + _PRINTABLE
        gumbel = np.stack([s.rng.gumbel(size=logits.shape[1]) for s, _o, _start in segs]).astype(np.float32)
        nxt = np.argmax(logits + gumbel, axis=1)  # Gumbel-max: a sample from softmax(logits)
        for (s, _o, start), tok in zip(segs, nxt, strict=True):
            s.cache.length = len(s.ids)
            assert s.cache.length > start
            s.ids.append(int(tok))
            s.generated.append(int(tok))

    def _check(self) -> None:
        stop = getattr(self, "_should_stop", None)
        if stop is not None and stop():
            raise StepAborted("every sequence of this step was abandoned")

    def _attend(self, cache: KVCache, layer: int, start: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        c = self.config
        n = q.shape[0]
        hd = c.head_dim
        cache.k[layer, :, start : start + n] = k.reshape(n, c.n_heads, hd).transpose(1, 0, 2)
        cache.v[layer, :, start : start + n] = v.reshape(n, c.n_heads, hd).transpose(1, 0, 2)
        qh = q.reshape(n, c.n_heads, hd).transpose(1, 0, 2) * np.float32(1.0 / np.sqrt(hd))
        out = np.empty((c.n_heads, n, hd), dtype=np.float32)
        for lo in range(0, n, ATTN_CHUNK):
            self._check()
            hi = min(n, lo + ATTN_CHUNK)
            ctx = start + hi  # keys this chunk may see: everything up to its last query
            keys, vals = cache.k[layer, :, :ctx], cache.v[layer, :, :ctx]
            scores = qh[:, lo:hi] @ keys.transpose(0, 2, 1)  # [heads, chunk, ctx]
            qpos = np.arange(start + lo, start + hi)[:, None]
            scores[:, np.arange(ctx)[None, :] > qpos] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            out[:, lo:hi] = scores @ vals
        return out.transpose(1, 0, 2).reshape(n, c.d_model)

    def _moe(
        self, h: np.ndarray, p: str, layer: int, routing: np.ndarray | None, capacity: np.ndarray | None = None
    ) -> np.ndarray:
        c = self.config
        t = self.weights.tensors
        logits = h @ t[p + "router"]
        if self.router_skew:
            logits[:, 0] += np.float32(self.router_skew)
        k = c.top_k
        top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        chosen = np.take_along_axis(logits, top, axis=1)
        gate = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        gate /= gate.sum(axis=1, keepdims=True)
        counts = np.bincount(top.ravel(), minlength=c.experts)
        if routing is not None:
            routing[layer] += counts  # demand: what the router asked for, overflow included
        cap = -(-int(self.capacity_factor * h.shape[0] * k) // c.experts) if self.capacity_factor > 0 else None
        if cap is not None and capacity is not None:
            capacity[layer] += cap
        out = np.zeros_like(h)
        w1, w2 = t[p + "experts_w1"], t[p + "experts_w2"]
        for e in np.nonzero(counts)[0]:
            rows, slot = np.nonzero(top == e)  # a token picks an expert at most once: rows are unique
            if cap is not None:
                rows, slot = rows[:cap], slot[:cap]  # the expert is full: later tokens overflow (dropped here)
            out[rows] += gate[rows, slot, None] * (_silu(h[rows] @ w1[e]) @ w2[e])
        return out


def generate(model: DemoModel, prompts: Seq[Seq[int]], max_tokens: int) -> list[list[int]]:
    """Convenience for tests and benches: run prompts as one batch to completion, return generated ids."""
    seqs = [model.new_sequence(p, max_tokens) for p in prompts]
    while not all(s.done for s in seqs):
        model.step(seqs)
    return [s.generated for s in seqs]
