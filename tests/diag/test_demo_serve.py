"""``diag demo serve`` with two workers under real HTTP load: every request counted exactly once, everywhere.

The server runs as a real subprocess on a free loopback port (uvicorn's spawn supervisor, two
workers), is driven over HTTP, and is stopped with SIGTERM by PID; its flight recorder is read after
the workers flushed it on shutdown.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
import typer
from typer.testing import CliRunner

from collectors import catalog
from collectors.recorder import FlightRecorder
from collectors.tracking.series import FLUSH_INTERVAL_S
from diag.cli.demo import register
from diag.demo.harness import post_all, sample_sum, scrape, start_demo

RID = catalog.REQUESTS.name
E2E_COUNT = catalog.REQUEST_E2E.name + "_count"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.process
def test_two_workers_count_every_request_once_and_stop_cleanly(tmp_path: Path) -> None:
    rec = tmp_path / "rec.db"
    srv = start_demo(
        ["--max-prompt-tokens", "256"],
        workers=2,
        weights_mb=16,
        weights_dir=tmp_path / "w",
        log_dir=tmp_path,
        recorder=rec,
    )
    try:
        prom_dirs = {_environ(pid).get("PROMETHEUS_MULTIPROC_DIR") for pid in srv.worker_pids}
        assert len(prom_dirs) == 1 and None not in prom_dirs
        prom_dir = Path(str(prom_dirs.pop()))
        assert prom_dir.is_dir()

        # Rounds of 20 normal prompts + 2 over --max-prompt-tokens, until both workers have answered
        # (the kernel picks the worker per connection).
        statuses: collections.Counter[int] = collections.Counter()
        served_by: set[str] = set()
        sent = 0
        while len(served_by) < 2 and sent < 440:
            bodies = [{"prompt": "p" * (5 + 7 * i), "max_tokens": 4} for i in range(20)]
            bodies += [{"prompt": "x" * 400, "max_tokens": 4}] * 2
            responses = post_all(srv.url, bodies, concurrency=8)
            sent += len(bodies)
            statuses.update(r.status_code for r in responses)
            ok = [r.json() for r in responses if r.status_code == 200]
            served_by |= {body["system_fingerprint"] for body in ok}
            assert all(len(b["choices"][0]["text"]) > 0 and b["usage"]["completion_tokens"] == 4 for b in ok)
        assert len(served_by) == 2, f"only {served_by} answered {sent} requests"
        assert set(statuses) == {200, 413}

        health = httpx.get(srv.url + "/healthz", timeout=5).json()
        assert health["status"] == "ok" and health["pid"] in srv.worker_pids
        # Summed over both workers by the multiprocess collector; a worker writes its counts to the shared files at
        # least every FLUSH_INTERVAL_S (the scraped one before it answers), so the other's are there within that.
        deadline = time.monotonic() + 10 * FLUSH_INTERVAL_S
        metrics = scrape(srv.url)
        while sample_sum(metrics, RID) != sent and time.monotonic() < deadline:
            time.sleep(0.1)
            metrics = scrape(srv.url)
    finally:
        code = srv.stop()

    assert code == 0  # SIGTERM: the supervisor stopped its workers and exited cleanly
    assert not any(psutil.pid_exists(pid) for pid in srv.worker_pids)
    assert not prom_dir.exists()  # the multiprocess dir is removed at exit

    assert sample_sum(metrics, RID) == sent
    assert sample_sum(metrics, RID, outcome="ok") == statuses[200]
    assert sample_sum(metrics, RID, outcome="error") == statuses[413]
    assert sample_sum(metrics, E2E_COUNT) == sent  # no request was rejected, so each has an e2e sample

    with FlightRecorder(rec, readonly=True) as fr:
        rows = list(fr.read(["request"]))
    assert len(rows) == sent
    assert collections.Counter(r.outcome for r in rows) == {"ok": statuses[200], "error": statuses[413]}
    assert {r.pid for r in rows} == set(srv.worker_pids)
    assert {r.prompt_tokens for r in rows if r.outcome == "error"} == {401}
    # Never a prompt or a completion in the recorder: only token counts.
    with FlightRecorder(rec, readonly=True) as fr:
        bodies_text = " ".join(body for _ts, _kind, body in fr.rows())
    assert "ppppp" not in bodies_text and "xxxxx" not in bodies_text
    assert "ppppp" not in srv.log() and "xxxxx" not in srv.log()


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


@pytest.mark.process
def test_long_context_raises_worker_memory_and_sigint_stops_it(tmp_path: Path) -> None:
    """An unbounded prompt limit lets one long prompt lift the worker's peak memory (KV cache + activations)."""
    srv = start_demo(["--max-prompt-tokens", "0"], workers=1, weights_mb=16, weights_dir=tmp_path / "w", log_dir=tmp_path)
    try:
        (pid,) = srv.worker_pids
        assert post_all(srv.url, [{"prompt": "short", "max_tokens": 4}])[0].status_code == 200
        before = _hwm(pid)
        long_prompt = "all work and no play " * 200  # 4201 tokens
        response = post_all(srv.url, [{"prompt": long_prompt, "max_tokens": 4}])[0]
        after = _hwm(pid)
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 4201
        kv_bytes = 4201 * 2 * 2 * 256 * 4  # tokens x (K,V) x layers x d_model x float32
        print(f"worker peak RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB for a 4201-token prompt")
        assert after - before > kv_bytes
        assert long_prompt[:40] not in srv.log()
        os.kill(srv.pid, signal.SIGINT)
        srv.proc.wait(20)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert not any(psutil.pid_exists(pid) for pid in srv.worker_pids)


def test_cli_registers_demo_serve_with_safe_defaults() -> None:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:
        """root"""

    runner = CliRunner()
    result = runner.invoke(app, ["demo", "serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for flag in ("--workers", "--max-concurrency", "--queue-size", "--preload", "--refresh", "--batching",
                 "--max-prompt-tokens", "--memory-guard", "--recorder", "--weights-mb", "--router-skew"):  # fmt: skip
        assert flag in result.output
    bad = runner.invoke(app, ["demo", "serve", "--preload", "everywhere"])
    assert bad.exit_code != 0
