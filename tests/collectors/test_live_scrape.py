"""``diag collect --scrape`` for real: the agent scraping a vLLM at the wire and the reference backend's own /metrics.

1. A vLLM /metrics at the wire (``tests/vllm_wire.py``: the families of vLLM @005a810b, served over loopback)
   and a URL nobody listens on: the agent (a real ``diag collect`` process) records backend samples at its
   interval, counts the refused scrapes on its own /metrics without stopping, and ``diag analyze`` on the
   recorder -- an uninstrumented vLLM host -- evaluates the queue-vs-thrash rule from the scraped families; the
   Timeline holds queue wait, waiting/running, KV-cache usage, preemptions, TTFT, inter-token latency and
   outcomes. ``diag bundle`` on that recorder keeps one raw exposition of the backend and its scrapes.
2. The reference backend (``diag demo serve``, the tracker's families) found by ``--scrape auto``: the
   process holding the weights file listens on a loopback port whose /metrics is probed and scraped.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from collectors.recorder_queries import RecorderReader
from diag.demo.harness import post_all, start_demo
from diag.sources.recorder import load_recorder
from tests.promserver import free_port
from tests.vllm_wire import VllmMetrics, serve

pytestmark = pytest.mark.process

DIAG = [sys.executable, "-m", "diag.cli"]


def _closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


def _backend_rows(path: Path) -> list[dict[str, object]]:
    """The backend records so far (none while the agent is still creating the file)."""
    try:
        with RecorderReader.open(path) as rec:
            return [json.loads(b) for b in rec.bodies("backend", 0.0, None)]
    except sqlite3.OperationalError:
        return []


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _wait(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.mark.slow
def test_an_uninstrumented_vllm_host_is_scraped_counted_analysed_and_bundled(tmp_path: Path) -> None:
    rec = tmp_path / "rec.db"
    listen = free_port()
    dead = f"http://127.0.0.1:{_closed_port()}/metrics"
    with serve(VllmMetrics("vllm-model")) as port:
        target = f"http://127.0.0.1:{port}/metrics"
        agent = subprocess.Popen(
            [*DIAG, "collect", "--interval", "500ms", "--listen", f"127.0.0.1:{listen}", "--recorder", str(rec),
             "--no-kmsg", "--no-gpu", "--scrape", f"127.0.0.1:{port}", "--scrape", dead, "--scrape-timeout", "1s"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            _wait(lambda: rec.exists() and sum(r["target"] == target for r in _backend_rows(rec)) >= 12, 60,
                  "12 scrapes of the vLLM stand-in in the recorder")  # fmt: skip
            exposed = _metrics(listen)
        finally:
            agent.terminate()
            _, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, err
        assert "connect" in err  # the dead target is reported once, not every sample
        assert err.count(f"scrape of {dead} failed") == 1
        bundle = subprocess.run([*DIAG, "bundle", "--recorder", str(rec), "--out", str(tmp_path), "--no-tar",
                                 "--deadline", "60s", "--no-gpu", "-q"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bundle.returncode == 0, bundle.stderr
    # the agent's own /metrics: the scrapes' health by target and reason, never vLLM's families
    assert f'llmdiag_backend_up{{dialect="vllm",target="{target}"}} 1.0' in exposed
    assert f'llmdiag_backend_scrape_errors_total{{reason="connect",target="{dead}"}}' in exposed
    assert "vllm:num_requests_running" not in exposed
    rows = _backend_rows(rec)
    assert {r["dialect"] for r in rows if r["target"] == target} == {"vllm"}
    assert all(r["up"] is False and str(r["error"]).startswith("connect") for r in rows if r["target"] == dead)
    tl = load_recorder(rec)
    for key in ("queue_wait_p50_s", "queue_wait_mean_s", "requests_waiting", "requests_running", "kv_cache_usage_ratio",
                "preemptions_rps", "ttft_p95_s", "itl_p50_s", "throughput_rps", "prefix_cache_hit_ratio",
                "generation_tokens_rps"):  # fmt: skip
        assert key in tl.service, key
    assert float(tl.service["queue_wait_mean_s"].values[-1]) == pytest.approx(0.1)  # the stand-in's 0.1 s per request
    assert float(tl.service["prefix_cache_hit_ratio"].values[-1]) == pytest.approx(0.25)
    analysis = subprocess.run([*DIAG, "analyze", "--recorder", str(rec), "--json"], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert analysis.returncode == 0, analysis.stderr
    result = json.loads(analysis.stdout)
    assert "aggregated.queue_vs_thrash" in result["evaluated"]
    assert "aggregated.queue_vs_thrash" not in {n["rule"] for n in result["not_evaluated"]}
    # the bundle: the scrapes in its timeline, and one raw exposition of the backend that answered
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("llm-diag-bundle")]
    raw = list((folder / "raw" / "backends").glob("*.prom"))
    assert len(raw) == 1 and "vllm:num_requests_running" in raw[0].read_text()
    assert (folder / "timeline" / "backend.jsonl").exists()
    manifest = json.loads((folder / "manifest.json").read_text())
    (step,) = [r for r in manifest["collectors"] if r["name"] == "backends"]
    assert dead in (step.get("reason") or "")  # the dead one is named in the step's reason, the live one is there
    bundled = subprocess.run([*DIAG, "analyze", "--bundle", str(folder), "--json"], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert "aggregated.queue_vs_thrash" in json.loads(bundled.stdout)["evaluated"]


@pytest.mark.slow
def test_scrape_auto_finds_the_reference_backend_by_its_weights_file(tmp_path: Path) -> None:
    rec = tmp_path / "rec.db"
    srv = start_demo(workers=1, weights_mb=8, weights_dir=tmp_path / "w", log_dir=tmp_path)
    try:
        agent = subprocess.Popen(
            [*DIAG, "collect", "--interval", "500ms", "--listen", "off", "--recorder", str(rec), "--no-kmsg", "--no-gpu",
             "--scrape", "auto"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{srv.port}"
            _wait(lambda: rec.exists() and any(r.get("dialect") == "llmdiag" for r in _backend_rows(rec)), 60,
                  "a scrape of the reference backend found by --scrape auto")  # fmt: skip
            # The tracker creates its request families with the first request: a first batch, scraped, then the
            # batch whose rate is measured against it (a counter first seen has no baseline, on any path).
            for batch in (2, 12):
                before = sum(r.get("dialect") == "llmdiag" for r in _backend_rows(rec))
                post_all(url, [{"prompt": "hello " * 8, "max_tokens": 4}] * batch, concurrency=4)
                _wait(lambda b=before: sum(r.get("dialect") == "llmdiag" for r in _backend_rows(rec)) >= b + 4, 60,
                      "4 more scrapes")  # fmt: skip
        finally:
            agent.terminate()
            _, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, err
    finally:
        srv.stop()
    ours = f"http://127.0.0.1:{srv.port}/metrics"
    targets = {r["target"] for r in _backend_rows(rec) if r.get("dialect") == "llmdiag"}
    assert ours in targets  # (another reference backend on this shared host may be found beside it: auto finds them all)
    assert all(t.startswith(("http://127.0.0.1:", "http://[::1]:")) for t in targets)
    tl = load_recorder(rec)
    assert {"requests_rps", "throughput_rps", "requests_running", "requests_waiting"} <= set(tl.service)
    assert float(tl.service["throughput_rps"].values.max()) > 0
