"""The scrape's parsing against each backend's own exposition, and against hostile input.

The vendored captures (``tests/fixtures/external/backends``, provenance in ``PROVENANCE.md``) are vLLM @005a810b,
TGI @db931fc and llama.cpp @aa6192d3 rendered from their source's metric definitions (``tests/backend_captures.py``):
the first test proves the files are still exactly that. Then what a scrape keeps of each, in both of vLLM's
spellings and formats; then fuzzed input -- cut anywhere, random bytes, hostile label values, a million
series streamed over loopback -- where the scrape must stay bounded, never raise, and count what it refused.
"""

from __future__ import annotations

import contextlib
import http.server
import math
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collectors import backends as bk
from collectors.exposition import MAX_BODY_BYTES, Hist, Limits, Reader, ScrapeError, deltas, parse
from collectors.scrape import ScrapeHealth, TargetScraper, fetch
from tests.backend_captures import CAPTURES, CONTENT_TYPES, VLLM_FINISHED, VLLM_QUEUE_TIMES, tgi_capture, vllm_capture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "external" / "backends"
MODEL = 'model_name="Qwen/Qwen2.5-7B-Instruct"'


def _capture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def test_the_vendored_captures_are_the_upstream_definitions_rendered() -> None:
    for name, make in CAPTURES.items():
        assert (FIXTURES / name).read_bytes() == make(), f"{name} differs from tests/backend_captures.py's rendering"
    provenance = (FIXTURES.parent / "PROVENANCE.md").read_text()
    for name in CAPTURES:
        assert f"backends/{name}" in provenance


# --------------------------------------------------------------------------- what a scrape keeps of each backend


def test_vllm_two_engines_summed_and_kv_usage_kept_per_engine() -> None:
    p = parse(_capture("vllm-005a810b.prom"), CONTENT_TYPES["vllm-005a810b.prom"])
    assert bk.dialect_of(p.families) == "vllm"
    assert p.gauges["vllm:num_requests_running"] == 24.0 and p.gauges["vllm:num_requests_waiting"] == 14.0
    for engine in ("0", "1"):
        assert p.gauges[f'vllm:kv_cache_usage_perc{{engine="{engine}",{MODEL}}}'] == 0.97
    for reason, n in VLLM_FINISHED.items():
        assert p.counters[f'vllm:request_success_total{{finished_reason="{reason}"}}'] == 2 * n
    queue = p.hists[("vllm:request_queue_time_seconds", ())]
    assert queue.count == 2 * 10 * len(VLLM_QUEUE_TIMES)
    assert math.isclose(queue.sum, 2 * 10 * sum(VLLM_QUEUE_TIMES))
    assert queue.buckets[math.inf] == queue.count and set(queue.buckets) == {*bk.VLLM_QUEUE_TIME.buckets, math.inf}
    # families no feed reads are not kept, and neither are _created lines nor the API server's http_requests_total
    kept = set(p.gauges) | set(p.counters) | {k[0] for k in p.hists}
    assert not any("created" in k or "http_requests" in k or "iteration_tokens" in k for k in kept)


def test_vllm_openmetrics_escaped_or_not_keeps_the_same_as_the_text_format() -> None:
    text = parse(_capture("vllm-005a810b.prom"), CONTENT_TYPES["vllm-005a810b.prom"])
    escaped = _capture("vllm-005a810b.openmetrics")
    assert b"vllm_num_requests_running{" in escaped  # the escaped spelling, as prometheus_client writes it
    for body in (escaped, vllm_capture(2, "openmetrics", escaping="allow-utf-8")):
        om = parse(body, CONTENT_TYPES["vllm-005a810b.openmetrics"])
        assert (om.gauges, om.counters, om.hists) == (text.gauges, text.counters, text.hists)


def test_tgi_counters_without_total_histograms_and_summaries() -> None:
    p = parse(_capture("tgi-db931fc.prom"), CONTENT_TYPES["tgi-db931fc.prom"])
    assert bk.dialect_of(p.families) == "tgi"
    assert p.counters["tgi_request_count"] == 120 and p.counters['tgi_request_failure{err="overloaded"}'] == 10
    assert p.gauges == {"tgi_queue_size": 9.0, "tgi_batch_current_size": 16.0}
    queue = p.hists[("tgi_request_queue_duration", ())]
    assert len(queue.buckets) == len(bk.TGI_DURATION_BUCKETS) + 1 and queue.count == 100
    # a tokens-per-request histogram feeds a rate of its _sum only: no buckets kept
    assert p.hists[("tgi_request_generated_tokens", ())].buckets == {}
    assert p.hists[("tgi_request_generated_tokens", ())].sum == 18000


def test_llamacpp_unlabelled_families_in_cpp_number_format() -> None:
    p = parse(_capture("llamacpp-aa6192d3.prom"), CONTENT_TYPES["llamacpp-aa6192d3.prom"])
    assert bk.dialect_of(p.families) == "llamacpp"
    assert p.gauges == {"llamacpp:requests_processing": 4.0, "llamacpp:requests_deferred": 11.0}
    assert p.counters["llamacpp:tokens_predicted_total"] == 1.23457e06  # C++'s %g: six significant digits
    assert p.counters["llamacpp:tokens_predicted_seconds_total"] == 24691.3


def test_deltas_keep_each_non_zero_bucket_and_its_lower_neighbour_and_count_a_restart_as_new() -> None:
    before = Hist({0.1: 1, 0.5: 3, 1.0: 3, math.inf: 3}, 1.0, 3)
    now = Hist({0.1: 1, 0.5: 3, 1.0: 5, math.inf: 6}, 4.5, 6)
    got = deltas(now, before, "x", ())
    assert got == {'x_bucket{le="0.5"}': 0.0, 'x_bucket{le="1.0"}': 2.0, 'x_bucket{le="+Inf"}': 1.0, "x_sum": 3.5, "x_count": 3.0}
    restarted = Hist({0.1: 0, 0.5: 1, 1.0: 1, math.inf: 1}, 0.3, 1)
    assert deltas(restarted, now, "x", ())['x_bucket{le="0.5"}'] == 1.0  # fewer than before: all of it is new
    assert deltas(now, None, "x", ()) == {}  # first seen: no baseline


def test_the_series_cache_reads_values_again_and_parses_whatever_is_new() -> None:
    first = _capture("vllm-005a810b.prom")
    second = first.replace(
        b'finished_reason="stop",model_name="Qwen/Qwen2.5-7B-Instruct"} 40.0',
        b'finished_reason="stop",model_name="Qwen/Qwen2.5-7B-Instruct"} 45.0',
    )
    second = second.replace(b"# TYPE vllm:request_success_total counter\n", b"# TYPE vllm:request_success_total counter\n"
                            b'vllm:request_success_total{engine="0",finished_reason="error",model_name="m"} 3.0\n')  # fmt: skip
    assert second.count(b"45.0") == 2 and b'"error"' in second
    reader = Reader()
    reader.read(first, "text/plain")
    assert sum(idx >= 0 for idx in reader.lines.values()) > 300  # every mapped line of the first scrape (two engines)
    again = reader.read(second, "text/plain")
    fresh = parse(second, "text/plain")
    assert (again.gauges, again.counters, again.hists) == (fresh.gauges, fresh.counters, fresh.hists)
    assert again.counters['vllm:request_success_total{finished_reason="stop"}'] == 90.0  # two engines
    assert again.counters['vllm:request_success_total{finished_reason="error"}'] == 3.0
    bad = second.replace(b"} 45.0", b"} 4_5.0", 1)  # a value prometheus_client refuses, on a line the cache knows
    with pytest.raises(ScrapeError) as err:
        reader.read(bad, "text/plain")
    assert err.value.reason == "parse"


# --------------------------------------------------------------------------- hostile and broken input


def _vllm_counter_lines(values: list[str]) -> bytes:
    lines = ["# TYPE vllm:request_success_total counter"]
    for i, v in enumerate(values):
        esc = v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        lines.append(f'vllm:request_success_total{{engine="0",finished_reason="{esc}",model_name="m"}} {i}')
    return ("\n".join(lines) + "\n").encode()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CAPTURES)), cut=st.floats(0.0, 1.0))
def test_an_exposition_cut_anywhere_is_parsed_or_refused_never_a_crash(name: str, cut: float) -> None:
    body = _capture(name)
    piece = body[: int(len(body) * cut)]
    full = parse(body, CONTENT_TYPES[name])
    try:
        p = parse(piece, CONTENT_TYPES[name])
    except ScrapeError as exc:
        assert exc.reason in ("parse", "no_families")
        return
    assert p.families <= full.families  # a cut never invents a family


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=4096), openmetrics=st.booleans())
def test_random_bytes_are_parsed_or_refused(body: bytes, openmetrics: bool) -> None:
    kind = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain; version=0.0.4"
    with contextlib.suppress(ScrapeError):
        parse(body, kind)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300), min_size=1, max_size=80))
def test_hostile_label_values_are_capped_counted_and_stored_as_keys_that_read_back(values: list[str]) -> None:
    limits = Limits(max_series=16, max_label_value=64)
    try:
        p = parse(_vllm_counter_lines(values), "text/plain", limits)
    except ScrapeError as exc:
        assert exc.reason in ("parse", "no_families")
        return
    admitted = list(dict.fromkeys(v for v in values if len(v) <= 64))[:16]  # the first 16 distinct short values
    assert sorted(bk.parse_series_key(k)[1]["finished_reason"] for k in p.counters) == sorted(admitted)  # type: ignore[index]
    assert p.dropped == sum(1 for v in values if v not in admitted)
    for key in p.counters:
        name, labels = bk.parse_series_key(key) or ("", {})
        assert name == "vllm:request_success_total" and set(labels) == {"finished_reason"}


def test_a_family_of_eighty_thousand_series_stays_bounded_in_memory_and_counted() -> None:
    values = [f"reason-{i}" for i in range(80_000)]
    body = _vllm_counter_lines(values)
    assert len(body) < MAX_BODY_BYTES
    tracemalloc.start()
    try:
        p = parse(body, "text/plain")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(p.counters) == 32 and p.dropped == 80_000 - 32
    assert peak < 80 * 2**20, f"peak {peak / 2**20:.0f} MiB while parsing a {len(body) / 2**20:.1f} MiB exposition"


# --------------------------------------------------------------------------- over loopback


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def do_GET(self) -> None:
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode == "million":  # a million series, streamed without a length
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            chunk = "".join(f'vllm:num_requests_waiting{{model_name="m{i}",engine="0"}} 1\n' for i in range(10_000))
            with contextlib.suppress(OSError):
                for _ in range(100):
                    self.wfile.write(chunk.encode())
            return
        if mode == "slow":  # headers at once, then a byte now and then
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(100):
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.05)
            return
        body, status, kind = {
            "ok": (tgi_capture(), 200, "text/plain; charset=utf-8"),
            "html": (b"<html><body>Not metrics</body></html>", 200, "text/html"),
            "error": (b"boom", 500, "text/plain"),
            "garbage": (b'vllm:num_requests_waiting{model_name="m" 1\n', 200, "text/plain"),
        }[mode]
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@contextlib.contextmanager
def _server(mode: str) -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.mode = mode  # type: ignore[attr-defined]
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.process
def test_a_million_series_is_cut_off_at_the_byte_cap_and_counted() -> None:
    with _server("million") as url:
        tracemalloc.start()
        started = time.monotonic()
        try:
            with pytest.raises(ScrapeError) as err:
                fetch(url, 30.0, 4 << 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert err.value.reason == "too_large"
    assert peak < 16 << 20 and time.monotonic() - started < 20


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.process
def test_every_way_a_scrape_fails_is_a_record_and_a_count_never_an_exception() -> None:
    health = ScrapeHealth()
    for mode, reason in (("html", "no_families"), ("error", "http"), ("garbage", "parse"), ("slow", "timeout")):
        with _server(mode) as url:
            rec = TargetScraper(url, Limits(timeout_s=0.5)).scrape()
        health.observe(rec)
        assert rec.up is False and rec.error is not None and rec.error.startswith(reason), (mode, rec.error)
    refused = TargetScraper(f"http://127.0.0.1:{_closed_port()}/metrics").scrape()
    assert refused.up is False and refused.error is not None and refused.error.startswith("connect")
    with _server("ok") as url:
        good = TargetScraper(url).scrape()
    assert good.up is True and good.dialect == "tgi" and good.gauges["tgi_queue_size"] == 9.0
    for rec in (refused, good):
        health.observe(rec)
    exposed = generate_latest(_registry(health)).decode()
    samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(exposed) for s in fam.samples]
    errors = {(lb["target"], lb["reason"]): v for n, lb, v in samples if n == "llmdiag_backend_scrape_errors_total"}
    for reason in ("timeout", "no_families", "http", "parse"):
        assert sum(v for (_, r), v in errors.items() if r == reason) == 1.0, reason
    assert errors[(refused.target, "connect")] == 1.0 and errors[(good.target, "timeout")] == 0.0
    up = {lb["target"]: (lb["dialect"], v) for n, lb, v in samples if n == "llmdiag_backend_up"}
    assert up[good.target] == ("tgi", 1.0) and up[refused.target] == ("unknown", 0.0)
    assert not any(n.startswith("tgi_") for n, _, _ in samples)  # only the scrapes' health, never the backend's families


def _registry(health: ScrapeHealth) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(health)
    return reg
