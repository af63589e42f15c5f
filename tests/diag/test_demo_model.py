"""The demo backend's parts in-process: checkpoint, loading modes, model, KV cache, MoE routing, batcher, refresh.

Everything here is real (real safetensors files in a temp dir, real numpy forward passes, the real
batcher thread); the tracker is replaced only by the plain callables the batcher and registry accept.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diag.demo.batcher import Batcher
from diag.demo.model import ByteTokenizer, DemoModel, KVCache, generate
from diag.demo.settings import DemoSettings
from diag.demo.weights import (
    BOS,
    MIN_TABLE_ROWS,
    ModelConfig,
    WeightRegistry,
    ensure_weights,
    load_weights,
    read_header,
)

MB = 1024 * 1024


@pytest.fixture(scope="module")
def wdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def dense(wdir: Path) -> Path:
    return ensure_weights(wdir, ModelConfig.for_budget(8))


@pytest.fixture(scope="module")
def moe(wdir: Path) -> Path:
    return ensure_weights(wdir, ModelConfig.for_budget(24, experts=8, top_k=2))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _random_prompts(n: int, length: int, seed: int = 1) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choice(string.ascii_letters + " ") for _ in range(length)) for _ in range(n)]


# --------------------------------------------------------------------------- checkpoint


def test_checkpoint_size_follows_budget_and_is_deterministic(tmp_path: Path) -> None:
    cfg = ModelConfig.for_budget(12, seed=3)
    a = ensure_weights(tmp_path / "a", cfg)
    b = ensure_weights(tmp_path / "b", cfg)
    other = ensure_weights(tmp_path / "c", ModelConfig.for_budget(12, seed=4))
    assert abs(a.stat().st_size - 12 * MB) < 0.02 * 12 * MB
    assert _sha(a) == _sha(b)  # same config + seed -> the same bytes
    assert _sha(a) != _sha(other)
    with open(a, "rb") as fh:
        infos, meta = read_header(fh.read(1 << 20))
    assert ModelConfig.from_json(meta["config"]) == cfg
    assert infos["ngram_table"].shape == (cfg.table_rows, cfg.d_model)
    # The table holds most of the bytes (that is what keeps per-token compute small): the core is a
    # fixed ~4 MiB, so at the default 200 MiB the table is ~98 % of the file.
    table = infos["ngram_table"]
    assert (table.end - table.begin) > 0.6 * a.stat().st_size
    big = ModelConfig.for_budget(200)
    assert 4 * big.table_rows * big.d_model > 0.95 * big.nbytes()


def test_tiny_budget_keeps_the_minimum_table() -> None:
    cfg = ModelConfig.for_budget(1, experts=8)
    assert cfg.table_rows == MIN_TABLE_ROWS
    assert cfg.nbytes() > 1 * MB  # the core alone is bigger than asked: the file is larger, not broken


def test_loading_modes_private_copy_vs_shared_mapping(dense: Path) -> None:
    private = load_weights(dense, "per-worker")
    shared = load_weights(dense, "shared")
    try:
        for name, arr in private.tensors.items():
            np.testing.assert_array_equal(arr, shared.tensors[name])
        table_p, table_s = private.tensors["ngram_table"], shared.tensors["ngram_table"]
        assert table_p.flags.writeable  # a private copy: writing it changes nothing else
        assert not table_s.flags.writeable  # a view into the read-only mmap
        assert not np.shares_memory(table_p, table_s)
        before = float(table_s[0, 0])
        table_p[0, 0] += 1.0
        assert float(table_s[0, 0]) == before
        assert private.checksum == pytest.approx(shared.checksum)
        # Both keep the file mapped: that is how a process sampler sees who holds the model.
        maps = Path(f"/proc/{os.getpid()}/maps").read_text()
        assert str(dense) in maps
    finally:
        private.close()


# --------------------------------------------------------------------------- model


def test_tokenizer_round_trip_and_count() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld"
    ids = tok.encode(text)
    assert ids[0] == BOS and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.count(text) == len(ids)


def test_generation_is_deterministic_and_printable(dense: Path) -> None:
    model = DemoModel(load_weights(dense, "shared"))
    tok = ByteTokenizer()
    prompts = [tok.encode("the quick brown fox"), tok.encode("x" * 300)]
    out1 = generate(model, prompts, 12)
    out2 = generate(model, prompts, 12)
    assert out1 == out2
    assert [len(o) for o in out1] == [12, 12]
    assert all(c == 10 or 32 <= c < 127 for o in out1 for c in o)
    # A batch gives each sequence the same result as running it alone (attention is per sequence).
    assert generate(model, prompts[:1], 12) == out1[:1]


def test_kv_cache_grows_with_context(dense: Path) -> None:
    model = DemoModel(load_weights(dense, "shared"))
    cfg = model.config
    per_token = 2 * cfg.n_layers * cfg.d_model * 4  # keys + values, every layer, float32
    sizes = {}
    for n in (16, 256, 2048):
        seq = model.new_sequence([BOS] + [65] * (n - 1), max_tokens=4)
        while not seq.done:
            model.step([seq])
        assert seq.cache.length == n + 3  # the prompt and every generated token but the last are cached
        sizes[n] = seq.cache.nbytes
    assert sizes[2048] == (2048 + 4) * per_token
    assert sizes[2048] > 100 * sizes[16]

    cache = KVCache(cfg, capacity=4)
    cache.length = 4
    cache.reserve(1)  # fed past its reservation, it doubles
    assert cache.capacity == 8


def _routing(model: DemoModel, prompts: list[list[int]], steps: int) -> np.ndarray:
    cfg = model.config
    counts = np.zeros((cfg.n_layers, cfg.experts), dtype=np.int64)
    seqs = [model.new_sequence(p, steps) for p in prompts]
    while not all(s.done for s in seqs):
        model.step(seqs, counts)
    return counts


def test_moe_routing_counts_are_real_and_skew_moves_tokens_to_one_expert(moe: Path) -> None:
    weights = load_weights(moe, "shared")
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in _random_prompts(12, 80)]
    tokens_fed = sum(len(p) for p in prompts) + len(prompts) * 3  # prompts + 3 decode steps of 4 tokens
    balanced = _routing(DemoModel(weights, router_skew=0.0), prompts, 4)
    hot = _routing(DemoModel(weights, router_skew=6.0), prompts, 4)
    cfg = weights.config
    for counts in (balanced, hot):
        assert (counts.sum(axis=1) == tokens_fed * cfg.top_k).all()  # every token reaches top_k experts
    # skew 0: no expert gets most tokens; high skew: expert 0 gets (nearly) every token.
    assert (balanced.max(axis=1) < 0.6 * tokens_fed).all()
    assert (hot[:, 0] > 0.95 * tokens_fed).all()
    top_over_median = [c.max() / max(1.0, float(np.median(c))) for c in (balanced[0], hot[0])]
    assert top_over_median[1] > top_over_median[0]


# --------------------------------------------------------------------------- batcher


class _Sink:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.routing: list[tuple[int, list[int]]] = []

    def batch(self, **kw: Any) -> None:
        self.batches.append(kw)

    def route(self, layer: int, counts: list[int]) -> None:
        self.routing.append((layer, counts))


def _run(batcher: Batcher, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    async def main() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(p, max_tokens) for p in prompts))

    batcher.start()
    try:
        return asyncio.run(main())
    finally:
        batcher.stop()


@pytest.mark.parametrize("mode", ["requests", "tokens"])
def test_batcher_caps_batches_by_its_policy(dense: Path, mode: str) -> None:
    weights = load_weights(dense, "shared")
    sink = _Sink()
    batcher = Batcher(
        lambda: weights, mode=mode, max_batch_requests=6, max_batch_tokens=600, batch_wait_s=0.05, on_batch=sink.batch
    )
    tok = ByteTokenizer()
    prompts = [tok.encode("s" * 9), tok.encode("L" * 499)] * 6  # 10 and 500 tokens, interleaved
    done = _run(batcher, prompts, 3)
    assert [len(d.ids) for d in done] == [3] * len(prompts)
    assert sum(b["requests"] for b in sink.batches) == len(prompts)
    assert sum(b["input_tokens"] for b in sink.batches) == sum(len(p) for p in prompts)
    totals = [b["input_tokens"] for b in sink.batches]
    assert all(b["requests"] <= 6 for b in sink.batches)
    if mode == "tokens":
        assert max(totals) <= 600
    else:
        assert max(totals) > 600  # request-count batching lets the batch carry several long prompts


def test_batcher_reports_routing_per_layer(moe: Path) -> None:
    weights = load_weights(moe, "shared")
    sink = _Sink()
    batcher = Batcher(lambda: weights, on_batch=sink.batch, on_routing=sink.route, router_skew=6.0)
    tok = ByteTokenizer()
    _run(batcher, [tok.encode(p) for p in _random_prompts(3, 40)], 2)
    layers = weights.config.n_layers
    assert len(sink.routing) == layers * len(sink.batches)
    for _layer, counts in sink.routing:
        assert len(counts) == weights.config.experts
        assert counts[0] == max(counts)


def test_cancelled_request_leaves_its_batch(dense: Path) -> None:
    weights = load_weights(dense, "shared")
    batcher = Batcher(lambda: weights)
    tok = ByteTokenizer()

    async def main() -> tuple[bool, list[int]]:
        slow = asyncio.ensure_future(batcher.submit(tok.encode("y" * 50), 100_000))
        await asyncio.sleep(0.2)
        slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        quick = await asyncio.wait_for(batcher.submit(tok.encode("hi"), 3), 10)  # the model thread is free again
        return slow.cancelled(), quick.ids

    batcher.start()
    try:
        cancelled, ids = asyncio.run(main())
    finally:
        batcher.stop()
    assert cancelled and len(ids) == 3


# --------------------------------------------------------------------------- refresh policy


class _Hook:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def __call__(self, name: str, bytes_read: int | None = None, cache_hit: bool | None = None) -> Any:
        yield
        self.calls.append({"name": name, "bytes_read": bytes_read, "cache_hit": cache_hit})


@pytest.mark.parametrize("mode", ["per-worker", "shared"])
def test_every_request_refresh_rereads_the_checkpoint(dense: Path, mode: str) -> None:
    hook = _Hook()
    reg = WeightRegistry(dense, mode=mode, refresh="every-request", loader_hook=hook)  # type: ignore[arg-type]
    first = reg.current
    for _ in range(3):
        assert reg.for_request() is not first
    size = dense.stat().st_size
    assert [c["bytes_read"] for c in hook.calls] == [size] * 4
    assert {c["cache_hit"] for c in hook.calls} == {False}


def test_ttl_and_none_do_not_read_on_the_request_path(dense: Path, tmp_path: Path) -> None:
    for refresh in ("none", "ttl"):
        hook = _Hook()
        reg = WeightRegistry(dense, mode="shared", refresh=refresh, ttl_s=300, loader_hook=hook)  # type: ignore[arg-type]
        try:
            first = reg.current
            assert all(reg.for_request() is first for _ in range(5))
            assert len(hook.calls) == 1  # the warm-up load only
        finally:
            reg.close()
    # TTL revalidation: an unchanged file is a cache hit with nothing read; a changed one is re-read.
    copy = tmp_path / dense.name
    copy.write_bytes(dense.read_bytes())
    hook = _Hook()
    reg = WeightRegistry(copy, mode="shared", refresh="ttl", ttl_s=300, loader_hook=hook)
    try:
        assert reg.revalidate() is False
        assert hook.calls[-1] == {"name": "checkpoint", "bytes_read": 0, "cache_hit": True}
        os.utime(copy, ns=(1, 1))
        assert reg.revalidate() is True
        assert hook.calls[-1]["bytes_read"] == copy.stat().st_size
    finally:
        reg.close()


def test_settings_round_trip_and_validation() -> None:
    s = DemoSettings(weights_path="/x", preload="shared", max_concurrency=None, recorder=None)
    assert DemoSettings.from_json(s.to_json()) == s
    with pytest.raises(ValueError):
        DemoSettings(preload="everywhere")
    with pytest.raises(ValueError):
        DemoSettings(batching="vibes")


def test_the_step_floor_paces_each_step_and_the_cpu_only_adds_to_it(dense: Path) -> None:
    """With ``min_step_s`` every model step (the prefill, then one per decoded token) lasts at least the floor, so
    a request's service time has a host-independent lower bound: what makes a planned overload an overload on a
    busy host as on an idle one."""
    weights = load_weights(dense, "shared")
    tok = ByteTokenizer()
    prompt = tok.encode("a short prompt")
    # Each step's length is taken where the batcher paces it, so the check does not compare two runs' wall
    # clocks: on a loaded host the unpaced run's own CPU time can exceed the paced run's floors.
    steps: dict[float, list[float]] = {}
    for floor in (0.0, 0.03):
        batcher = Batcher(lambda: weights, mode="requests", min_step_s=floor)
        lengths = steps[floor] = []
        pace = batcher._pace

        def timed(step_started: float, pace: Callable[[float], None] = pace, lengths: list[float] = lengths) -> None:
            pace(step_started)
            lengths.append(time.monotonic() - step_started)

        batcher._pace = timed  # type: ignore[method-assign]
        done = _run(batcher, [prompt], 10)
        assert len(done[0].ids) == 10  # the same work, only paced
        # one prefill step + 9 decode steps (the prefill yields the first token)
        assert len(lengths) == 10, lengths
    assert all(length >= 0.03 for length in steps[0.03]), steps
    with pytest.raises(ValueError, match="min_step_s"):
        Batcher(lambda: weights, min_step_s=-1)
