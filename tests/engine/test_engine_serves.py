"""llama-cpp-python's own server, on a GGUF written here, answers deterministically at temperature 0.

Why: every engine scenario rests on this harness -- a model file llama.cpp really loads, a server
started inside a real memory cgroup, readiness polled, requests through the OpenAI-compatible API,
and cleanup by PID. Greedy decoding on fixed random weights makes the answers reproducible, so the
streamed and the plain paths must agree to the byte, and two runs of one request too.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from diag.demo.engine.client import chat_body, completion, stream
from diag.demo.engine.model import PRINTABLE, WrittenModel
from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from tests.livecg import require_live

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
MIB = 1 << 20
TOKENS = 12
ASCII = {chr(b - 3) for b in range(len(PRINTABLE)) if PRINTABLE[b]}


@pytest.mark.host_quiet(
    reason="one server in a group far above the model: greedy answers compared with each other, CPU only, no verdict"
)
def test_completions_and_streamed_chat_are_deterministic(tmp_path: Path, engine_model: WrittenModel) -> None:
    require_live()
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        group = made.create("serve", 1024 * MIB)
        settings = EngineSettings(model=engine_model.path, n_ctx=256, n_threads=1)
        with EngineServer(settings, tmp_path / "server.log", group=group) as server, httpx.Client() as client:
            assert server.pid in group.pids()  # the engine runs inside the limited group, not beside it
            first = completion(client, server.url, "The queue", max_tokens=TOKENS)
            again = completion(client, server.url, "The queue", max_tokens=TOKENS)
            other = completion(client, server.url, "A page fault", max_tokens=TOKENS)
            streamed = stream(client, server.url, "/v1/completions", {"prompt": "The queue", "max_tokens": TOKENS})
            chat = [stream(client, server.url, "/v1/chat/completions", chat_body("Why slow?", TOKENS)) for _ in range(2)]
            pid = server.pid
    finally:
        made.close()
    assert not made.leftovers
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped by PID with its group
    text = first["choices"][0]["text"]
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == TOKENS
    assert len(text) == TOKENS and set(text) <= ASCII, text  # one printable byte per token, never an early stop
    assert again["choices"][0]["text"] == text
    assert other["choices"][0]["text"] != text  # the answer depends on the prompt: a real forward pass
    assert streamed.text == text and streamed.chunks == TOKENS and streamed.finish_reason == "length"
    assert streamed.first_token is not None and streamed.arrival < streamed.first_token <= streamed.finish
    assert chat[0].text == chat[1].text and chat[0].chunks == TOKENS, [c.text for c in chat]
    assert chat[0].text != text  # the chat template wraps the prompt: another input, another answer
