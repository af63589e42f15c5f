"""``diag wrap`` on a server no one here wrote: llama-cpp-python's own FastAPI server, on a GGUF written at test time.

Its server holds one model behind a lock (``llama_cpp.server.app.llama_inner_lock``): the engine adapter marks
each request's start where it takes that lock, so a burst of requests shows the queue in front of the model.
Its answers carry a random ``id`` and the ``created`` second; everything else -- the text at temperature 0,
the usage, every streamed chunk -- must be the same with tracking on and off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.recorder import FlightRecorder
from tests.procs import stop, wait_http
from tests.promserver import free_port

pytestmark = [pytest.mark.process, pytest.mark.slow]
MAX_TOKENS = 24
BURST_TOKENS = 128
VOLATILE = ("id", "created")  # a uuid and a timestamp per answer


def _engine_missing() -> str | None:
    try:
        import gguf  # noqa: F401
        import llama_cpp.server.app  # noqa: F401
    except ImportError as exc:
        return f"the engines extra is not installed ({exc}): pip install -c constraints.txt '.[engines]'"
    return None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = _engine_missing()
    if reason:
        pytest.skip(reason)
    from diag.demo.engine.model import write_model

    return write_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", 8 << 20, seed=0).path


def _serve(model: Path, tmp_path: Path, recorder: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    server = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
              "--n_ctx", "512", "--n_threads", "1", "--verbose", "false"]  # fmt: skip
    argv = server if recorder is None else [sys.executable, "-m", "diag.cli", "wrap", "--recorder", str(recorder),
                                            "--model", "tiny", "--", *server]  # fmt: skip
    log = tmp_path / f"server-{recorder is not None}.log"
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/v1/models", proc, timeout_s=120, log=log)
    return proc, url


def _stable(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in VOLATILE}


def _exchange(url: str) -> list[Any]:
    """Two completions and one streamed chat at temperature 0, one at a time; their answers without id and time."""
    out: list[Any] = []
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as client:
        for prompt in ("The quick brown fox", "secret prompt text"):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            out.append((r.status_code, r.headers["content-type"], _stable(r.json())))
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        out.append((r.status_code, [e if e == "[DONE]" else _stable(json.loads(e)) for e in events]))
    return out


def _burst(url: str, n: int) -> None:
    """``n`` completions at once: one model, one lock, so all but one wait. Each long enough (``BURST_TOKENS``) that
    the tens of milliseconds the clients take to start on a busy host are small beside one inference."""
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as client, ThreadPoolExecutor(n) as pool:
        body = {"prompt": "burst", "max_tokens": BURST_TOKENS, "temperature": 0}
        statuses = list(pool.map(lambda _: client.post("/v1/completions", json=body).status_code, range(n)))
    assert statuses == [200] * n


def test_llama_cpp_wrapped_answers_the_same_and_its_queue_is_measured_at_the_model_lock(model: Path, tmp_path: Path) -> None:
    plain, url = _serve(model, tmp_path, None)
    try:
        expected = _exchange(url)
    finally:
        stop(plain)
    recorder = tmp_path / "recorder.db"
    wrapped, url = _serve(model, tmp_path, recorder)
    try:
        assert _exchange(url) == expected
        _burst(url, 4)
        metrics = httpx.get(f"{url}/metrics", trust_env=False, timeout=30).text
    finally:
        stop(wrapped)
    assert 'llmdiag_requests_total{model="tiny",outcome="ok",route="/v1/completions"} 6.0' in metrics
    with FlightRecorder(recorder, readonly=True) as rec:
        rows = sorted((r.to_dict() for r in rec.read(["request"])), key=lambda r: r["arrival"])
    completions = [r for r in rows if r["route"] == "/v1/completions"]
    assert len(completions) == 6 and all(r["start"] is not None and r["outcome"] == "ok" for r in completions)
    burst = completions[2:]
    waits = sorted(r["start"] - r["arrival"] for r in burst)
    inference = sorted(r["finish"] - r["start"] for r in burst)
    # one lock: the k-th of the burst waits for the k-1 before it, each of which holds the model for its inference
    assert waits[-1] >= 2 * inference[0], (waits, inference)
    assert waits[0] < inference[0], (waits, inference)
    (chat,) = [r for r in rows if r["route"] == "/v1/chat/completions"]
    assert chat["ttft_s"] is not None and chat["ttft_s"] < chat["finish"] - chat["arrival"]
    assert b"secret prompt text" not in recorder.read_bytes()
