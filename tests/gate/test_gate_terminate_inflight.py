"""Graceful termination signals only once the server has read every one of its requests.

A real process serves the completions endpoint over a real socket, slow to *start* a request: each connection's
request sits unread in its socket for a while (as on a loaded host, behind a busy loop). On SIGTERM it stops
accepting, closes every connection whose request it has not read yet (what uvicorn does to a connection with no
request in progress), finishes the ones it has, and exits. Signalled before it read them, the requests are refused
and the drain looks failed; signalled once it read them (the kernel's socket table says so), both complete.

The kernel-table reader itself is checked on fixture tables: which row is the server's end, and what counts as read.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.gate.app_gate import graceful_termination, start_time
from diag.gate.http_client import HttpClient
from diag.gate.inflight import TcpTables, kernel_address, parse_tcp_table, read_by_server
from diag.gate.spec import Probe, parse_spec

READ_AFTER_S = 1.5  # longer than any pause a prober could take for "the loopback hop" on a quiet host
WORK_S = 0.5

SLOW_READER = r"""
import json, signal, socket, sys, threading, time

READ_AFTER_S, WORK_S = float(sys.argv[1]), float(sys.argv[2])
stop = threading.Event()


def handle(conn):
    with conn:
        time.sleep(READ_AFTER_S)  # the request waits unread in the socket: nothing reads it before this
        if stop.is_set():
            return  # shutting down: a request not yet read is not taken (the connection is closed unanswered)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += conn.recv(65536)
        time.sleep(WORK_S)
        n = json.loads(body)["max_tokens"]
        out = json.dumps({"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(out), out))


listener = socket.create_server(("127.0.0.1", 0))
workers = []


def accept():
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # the listener was closed: the shutdown
        workers.append(threading.Thread(target=handle, args=(conn,)))
        workers[-1].start()


signal.signal(signal.SIGTERM, lambda *_: stop.set())
threading.Thread(target=accept, daemon=True).start()
print(listener.getsockname()[1], flush=True)
stop.wait()
listener.close()  # no new connection; then every request already accepted is finished (or refused, if unread)
for worker in list(workers):
    worker.join()
"""


@pytest.mark.process
def test_sigterm_waits_until_the_server_has_read_every_request() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_READER, str(READ_AFTER_S), str(WORK_S)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        started = start_time(proc.pid)
        spec = parse_spec(
            {"endpoint": "/v1/completions", "steps": [{"rate": 1, "duration": 1, "prompt_tokens": 4, "output_tokens": 4}]}
        )
        probe = Probe(prompt_tokens=4, output_tokens=4, within_s=30, requests=2)
        lines: list[str] = []

        async def go() -> object:
            async with HttpClient(f"http://127.0.0.1:{port}") as client:
                t0 = time.monotonic()
                check = await graceful_termination(client, spec, probe, proc.pid, started, lines.append)
                return check, time.monotonic() - t0

        check, took = asyncio.run(go())
        status = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert check.state == "PASS", check  # type: ignore[attr-defined]
    assert check.value.startswith("2/2 in-flight requests completed; exited "), check  # type: ignore[attr-defined]
    assert status == 0 and took >= READ_AFTER_S + WORK_S  # signalled only after the server read both
    assert any(line.startswith(f"application: SIGTERM to pid {proc.pid} with 2 requests") for line in lines), lines


HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _row(local: str, remote: str, state: str, tx: int, rx: int) -> str:
    return f"   0: {local} {remote} {state} {tx:08X}:{rx:08X} 00:00000000 00000000     0        0 1 1\n"


def _tables(tmp: Path, pid: int, tcp: str = "", tcp6: str = "") -> str:
    net = tmp / "proc" / str(pid) / "net"
    net.mkdir(parents=True)
    (net / "tcp").write_text(HEADER + tcp)
    (net / "tcp6").write_text(HEADER + tcp6)
    return str(tmp / "proc")


def _read(pid: int, client: tuple[str, int], server: tuple[str, int], proc_root: str) -> bool:
    """As the gate asks it: the server's tables and this process's, both under ``proc_root``."""
    return read_by_server(TcpTables(pid, proc_root), TcpTables(os.getpid(), proc_root), client, server)


def test_the_kernel_address_format() -> None:
    if sys.byteorder != "little":
        pytest.skip("the fixture's addresses are written for a little-endian host")
    assert kernel_address("127.0.0.1", 8080) == "0100007F:1F90"
    assert kernel_address("::1", 443) == "00000000000000000000000001000000:01BB"
    assert kernel_address("::ffff:127.0.0.1", 80) == "0000000000000000FFFF00000100007F:0050"
    table = parse_tcp_table(HEADER + _row("0100007F:1F90", "0100007F:9C40", "01", 0, 12) + "garbage line\n")
    assert table[("0100007F:1F90", "0100007F:9C40")].rx_queue == 12


def test_read_means_the_servers_end_is_established_with_nothing_unread(tmp_path: Path) -> None:
    pid = 2**22 + 7  # no process has it: only the fixture's tables answer
    server, client = ("127.0.0.1", 8080), ("127.0.0.1", 40000)
    srv, cli = kernel_address(*server), kernel_address(*client)
    unread = _tables(tmp_path / "a", pid, tcp=_row(srv, cli, "01", 0, 200))
    assert not _read(pid, client, server, unread)  # in the accept queue or the socket, not in the server
    done = _tables(tmp_path / "b", pid, tcp=_row(srv, cli, "01", 0, 0))
    assert _read(pid, client, server, done)
    reversed_ends = _tables(tmp_path / "c", pid, tcp=_row(cli, srv, "01", 0, 0))  # the client's end is not the server's
    assert not _read(pid, client, server, reversed_ends)
    closing = _tables(tmp_path / "d", pid, tcp=_row(srv, cli, "08", 0, 0))  # CLOSE_WAIT: the client went away
    assert not _read(pid, client, server, closing)
    mapped = _tables(tmp_path / "e", pid, tcp6=_row(kernel_address("::ffff:127.0.0.1", 8080),
                                                     kernel_address("::ffff:127.0.0.1", 40000), "01", 0, 0))  # fmt: skip
    assert _read(pid, client, server, mapped)  # a dual-stack server's row for an IPv4 peer
    assert not _read(pid, client, server, str(tmp_path / "nothing"))  # no table at all: never vouched for
