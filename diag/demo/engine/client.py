"""Drive a llama-cpp-python server through its OpenAI-compatible API, timing each request from the client.

Why client-side timing: the server is not instrumented (that is the point of the uninstrumented
attachment), so a request row is what any load generator or gateway in front of it could write. With
streaming, the client sees three moments: the request sent (``arrival``), the first streamed token
(``start``: llama-cpp-python sends the first event only once it holds the model lock and has decoded
one token, so this is the queue wait plus one prompt evaluation, an upper bound on the engine's own
start) and the last token (``finish``). ``ttft_s`` is the same first-token time, reported as such.

Requests go to 127.0.0.1 only; temperature 0 (greedy) unless asked, so answers are reproducible.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from collectors.records import RequestTiming

TIMEOUT = httpx.Timeout(120.0, connect=10.0)


@dataclass
class Streamed:
    """One streamed answer: its text and the client's timing of it."""

    text: str
    arrival: float
    first_token: float | None
    finish: float
    chunks: int
    finish_reason: str | None = None
    raw_events: list[str] = field(default_factory=list)  # the ``data:`` payloads as sent: for comparisons to the byte

    def row(self, *, route: str, pid: int | None, model: str = "") -> RequestTiming:
        """The request row any client could record (see the module doc for what ``start`` means here)."""
        ok = self.first_token is not None and self.finish_reason is not None  # a stream cut short ends without one
        return RequestTiming(
            ts=self.finish,
            arrival=self.arrival,
            start=self.first_token,
            finish=self.finish,
            outcome="ok" if ok else "error",
            route=route,
            model=model,
            output_tokens=self.chunks,
            ttft_s=None if self.first_token is None else self.first_token - self.arrival,
            pid=pid,
        )


def completion(client: httpx.Client, base: str, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0) -> dict:
    """``POST /v1/completions`` without streaming: the whole JSON answer."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": 0}
    resp = client.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    resp.raise_for_status()
    return resp.json()


def _events(resp: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, up to ``[DONE]``."""
    for line in resp.iter_lines():
        if not line.startswith("data:"):
            continue  # blank separators and ": ping" comments
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


def stream(client: httpx.Client, base: str, route: str, body: dict) -> Streamed:
    """POST ``body`` with ``stream: true`` to ``route`` (``/v1/completions`` or ``/v1/chat/completions``), timing it."""
    body = {"temperature": 0.0, "seed": 0, **body, "stream": True}
    arrival = time.time()
    first: float | None = None
    parts: list[str] = []
    raw: list[str] = []
    chunks = 0
    reason = None
    with client.stream("POST", f"{base}{route}", json=body, timeout=TIMEOUT) as resp:
        resp.raise_for_status()
        for data in _events(resp):
            raw.append(data)
            choice = json.loads(data)["choices"][0]
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")  # a chat stream's first event carries only the role
            if piece:
                chunks += 1
                if first is None:
                    first = time.time()
            parts.append(piece or "")
            reason = choice.get("finish_reason") or reason
    return Streamed("".join(parts), arrival, first, time.time(), chunks, reason, raw)


def chat_body(content: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def request_body(route: str, prompt: str, max_tokens: int) -> dict:
    """The body for ``route``: the prompt as the user's one message for chat, as the prompt otherwise."""
    return chat_body(prompt, max_tokens) if route.endswith("chat/completions") else {"prompt": prompt, "max_tokens": max_tokens}


def drive(
    base: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    max_tokens: int,
    route: str = "/v1/completions",
    pid: int | None = None,
) -> list[RequestTiming]:
    """Send every prompt, streamed, ``concurrency`` at a time; one timed row per request, in completion order."""

    def one(prompt: str) -> RequestTiming:
        return stream(client, base, route, request_body(route, prompt, max_tokens)).row(route=route, pid=pid)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def drive_until(
    base: str,
    seconds: float,
    *,
    concurrency: int,
    max_tokens: int,
    route: str = "/v1/completions",
    pid: int | None = None,
) -> list[RequestTiming]:
    """Closed-loop load for ``seconds``: ``concurrency`` clients, each sending its next streamed request when the
    last one ends (what a slow engine meets from a fixed pool of callers). A request begun before the end finishes."""
    end = time.monotonic() + seconds

    def worker(n: int) -> list[RequestTiming]:
        out: list[RequestTiming] = []
        while time.monotonic() < end:
            prompt = f"client {n}, request {len(out)}: is the model paging?"
            out.append(stream(client, base, route, request_body(route, prompt, max_tokens)).row(route=route, pid=pid))
        return out

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        return [row for rows in pool.map(worker, range(concurrency)) for row in rows]
