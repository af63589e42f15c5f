"""A tiny OpenAI-compatible server for the load generator's timing tests and bench/gate.py, run as its own process.

Why a process of its own and raw asyncio: the generator is measured, not the server, so the server must not
share the generator's interpreter (its GIL would be the generator's lag) and must not be the bottleneck at a
few thousand requests per second (an HTTP/1.1 keep-alive loop, no framework). It answers

- ``POST /v1/completions`` and ``/v1/chat/completions``: after ``--delay`` seconds, a completions JSON with
  ``max_tokens`` completion tokens; with ``"stream": true``, Server-Sent Events: the first token after
  ``--ttft``, then one every ``--itl`` seconds, then ``data: [DONE]`` (chunked transfer encoding);
- ``GET /stats``: the wall-clock time each completion request arrived and the most that were ever in flight.

``python -m tests.gate.stub --delay 0.05`` prints its port on the first line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

state = {"received": [], "in_flight": 0, "max_in_flight": 0}


def _head(status: str, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json(body: object, status: str = "200 OK") -> bytes:
    data = json.dumps(body).encode()
    return _head(status, {"Content-Type": "application/json", "Content-Length": str(len(data))}) + data


async def _complete(req: dict, writer: asyncio.StreamWriter, args: argparse.Namespace, chat: bool) -> None:
    n = int(req.get("max_tokens") or 16)
    if not req.get("stream"):
        if args.delay:
            await asyncio.sleep(args.delay)
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": "x" * n}} if chat else {"text": "x" * n})
        writer.write(_json({"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": n}}))
        return
    writer.write(_head("200 OK", {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"}))
    await asyncio.sleep(args.ttft)
    for i in range(n):
        if i:
            await asyncio.sleep(args.itl)
        piece = {"delta": {"content": "x"}} if chat else {"text": "x"}
        event = f"data: {json.dumps({'choices': [{'index': 0, **piece}]})}\n\n".encode()
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/stats":
                writer.write(_json({"received": state["received"], "max_in_flight": state["max_in_flight"]}))
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                state["received"].append(time.time())
                state["in_flight"] += 1
                state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
                try:
                    await _complete(json.loads(body), writer, args, chat=path.endswith("chat/completions"))
                finally:
                    state["in_flight"] -= 1
            else:
                writer.write(_json({"error": "not found"}, "404 Not Found"))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(args: argparse.Namespace) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(r, w, args), "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before a non-streamed answer")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before the first streamed token")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between streamed tokens")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
