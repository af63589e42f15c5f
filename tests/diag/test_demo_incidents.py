"""Incident families reproduced on the real demo server: a loader on the request path, batch sizing, MoE skew.

- ``--refresh every-request`` re-reads the checkpoint inside every request: LoaderEvents land on the
  request path; ``--refresh ttl`` reads nothing after warm-up.
- ``--batching requests`` lets a batch of long prompts carry many times the tokens of a batch of
  short ones; ``--batching tokens`` caps every batch at the budget.
- ``--experts 8 --router-skew 6`` sends (nearly) every token to expert 0; skew 0 spreads them.
Evidence is read from the flight recorder (``LoaderEvent``, ``BatchStats``, ``RoutingStats``), as the rules read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.recorder import FlightRecorder
from diag.demo.harness import post_all, start_demo

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def wdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


def _read(path: Path, kind: str) -> list:
    with FlightRecorder(path, readonly=True) as fr:
        return list(fr.read([kind]))


@pytest.mark.parametrize("refresh", ["every-request", "ttl"])
def test_refresh_policy_decides_whether_loads_sit_on_the_request_path(tmp_path: Path, wdir: Path, refresh: str) -> None:
    rec = tmp_path / "rec.db"
    srv = start_demo(
        ["--refresh", refresh, "--refresh-ttl", "300", "--preload", "per-worker"],
        workers=2,
        weights_mb=16,
        weights_dir=wdir,
        log_dir=tmp_path,
        recorder=rec,
    )
    n = 6
    try:
        responses = post_all(srv.url, [{"prompt": f"refresh me {i}", "max_tokens": 3} for i in range(n)])
        assert srv.weights_file is not None
        size = srv.weights_file.stat().st_size
    finally:
        srv.stop()
    assert [r.status_code for r in responses] == [200] * n

    events = _read(rec, "loader")
    warmup = [e for e in events if not e.in_request_path]
    in_path = [e for e in events if e.in_request_path]
    assert len(warmup) == 2 and {e.pid for e in warmup} == set(srv.worker_pids)  # one start-up load per worker
    assert all(e.bytes_read == size and e.cache_hit is False for e in warmup)
    if refresh == "every-request":
        assert len(in_path) == n  # one full re-read inside each request
        assert all(e.bytes_read == size and e.cache_hit is False and e.duration_s > 0 for e in in_path)
        requests = _read(rec, "request")
        # each re-read happened inside a request's arrival -> start window (1 ms for wall vs monotonic clocks)
        for e in in_path:
            end = e.start + e.duration_s
            assert any(r.arrival <= e.start and r.start is not None and end <= r.start + 1e-3 for r in requests)
    else:
        assert in_path == []  # nothing read on the request path after warm-up
        assert len(events) == 2


def _batches(mode: str, tmp_path: Path, wdir: Path) -> tuple[list, int]:
    rec = tmp_path / f"rec-{mode}.db"
    srv = start_demo(
        f"--batching {mode} --max-batch-requests 8 --max-batch-tokens 2048 --max-concurrency 16 --queue-size 64".split(),
        weights_mb=16,
        weights_dir=wdir,
        log_dir=tmp_path,
        recorder=rec,
    )
    short = {"prompt": "hi there", "max_tokens": 4}  # 9 tokens
    long = {"prompt": "L" * 1499, "max_tokens": 4}  # 1500 tokens
    sent = 0
    try:
        for body in (short, long, short):
            responses = post_all(srv.url, [body] * 8, concurrency=8)
            assert {r.status_code for r in responses} == {200}
            sent += 8
    finally:
        srv.stop()
    return _read(rec, "batch"), sent


def test_request_count_batching_lets_batch_tokens_swing_while_a_token_budget_caps_them(tmp_path: Path, wdir: Path) -> None:
    by_requests, sent_r = _batches("requests", tmp_path, wdir)
    by_tokens, sent_t = _batches("tokens", tmp_path, wdir)
    for batches, sent in ((by_requests, sent_r), (by_tokens, sent_t)):
        assert sum(b.requests for b in batches) == sent  # every request ran in exactly one batch
        assert all(b.requests <= 8 for b in batches)
    tokens_r = [b.input_tokens for b in by_requests]
    tokens_t = [b.input_tokens for b in by_tokens]
    print(f"requests mode: {len(tokens_r)} batches, tokens {min(tokens_r)}..{max(tokens_r)}; "
          f"tokens mode: {len(tokens_t)} batches, tokens {min(tokens_t)}..{max(tokens_t)}")  # fmt: skip
    assert max(tokens_r) >= 10 * min(tokens_r)
    assert max(tokens_r) > 2048  # several long prompts in one batch: the budget would have refused it
    assert max(tokens_t) <= 2048
    assert max(b.max_request_tokens for b in by_tokens) == 1500


def _routing(skew: str, tmp_path: Path, wdir: Path) -> list:
    rec = tmp_path / f"rec-skew{skew}.db"
    srv = start_demo(
        ["--experts", "8", "--top-k", "2", "--router-skew", skew],
        weights_mb=24,
        weights_dir=wdir,
        log_dir=tmp_path,
        recorder=rec,
    )
    prompts = [f"{i}: the quick brown fox jumps over the lazy dog, {i * 7919} times" for i in range(12)]
    try:
        responses = post_all(srv.url, [{"prompt": p, "max_tokens": 6} for p in prompts], concurrency=4)
        assert {r.status_code for r in responses} == {200}
    finally:
        srv.stop()
    return _read(rec, "routing")


def test_router_skew_sends_the_tokens_to_one_hot_expert(tmp_path: Path, wdir: Path) -> None:
    balanced, hot = _routing("0", tmp_path, wdir), _routing("6", tmp_path, wdir)
    for rows in (balanced, hot):
        assert rows and {r.layer for r in rows} == {0, 1}
        assert all(len(r.expert_tokens) == 8 for r in rows)
    share = {
        name: sum(r.expert_tokens[0] for r in rows) / sum(sum(r.expert_tokens) for r in rows)
        for name, rows in (("balanced", balanced), ("hot", hot))
    }
    print(f"expert 0 share of token-slots: {share}")
    # top-2 routing: a token that always picks expert 0 gives it half of all slots.
    assert share["hot"] > 0.45
    assert share["balanced"] < 0.3
    assert all(r.top_expert_tokens == r.expert_tokens[0] for r in hot)
    assert min(r.balancedness for r in balanced) > max(r.balancedness for r in hot)
