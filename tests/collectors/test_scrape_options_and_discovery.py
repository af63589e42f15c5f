"""``--scrape``'s options refused before anything starts, and ``--scrape auto``'s reading of ``/proc``.

The options: a URL that is not http(s), credentials in a URL, ``--scrape-timeout`` without ``--scrape``, ``--scrape``
with ``--once`` -- each one line on stderr and exit 2, nothing started. Discovery: the kernel's ``/proc/net/tcp``
lines (little-endian words), which bound addresses are reachable over loopback, and a real listening socket of this
process found through ``/proc`` as the agent finds a backend's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from collectors.discover import listeners, loopback_host, parse_listeners
from diag.cli.collect import _scrape_targets

DIAG = [sys.executable, "-m", "diag.cli", "collect"]


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scrape", "ftp://127.0.0.1/metrics"], "--scrape 'ftp://127.0.0.1/metrics': a backend's /metrics URL"),
        (["--scrape", "http://user:secret@127.0.0.1:8000/metrics"], "credentials in the URL are not accepted"),
        (["--scrape", "http://127.0.0.1:99999/metrics"], "the port is not a number from 0 to 65535"),
        (["--scrape-timeout", "2s"], "--scrape-timeout cannot be used without --scrape"),
        (["--scrape", "auto", "--scrape-timeout", "0s"], "--scrape-timeout 0s: must be positive"),
        (["--once", "--scrape", "auto"], "--scrape cannot be used with --once"),
    ],
)
def test_a_scrape_option_that_cannot_apply_is_refused_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run([*DIAG, "--recorder", str(tmp_path / "r.db"), *args] if "--once" not in args else [*DIAG, *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "secret" not in proc.stderr
    assert not (tmp_path / "r.db").exists()  # nothing started


def test_scrape_values_normalised() -> None:
    urls, auto = _scrape_targets(["127.0.0.1:8000", "http://[::1]:9000", "auto", "http://127.0.0.1:8000/metrics"])
    assert urls == ("http://127.0.0.1:8000/metrics", "http://[::1]:9000/metrics") and auto


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0 100 0 0 10 0
   1: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1002 1 0 100 0 0 10 0
   2: 0500000A:1F42 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1003 1 0 100 0 0 10 0
   3: 0100007F:1F43 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1004 1 0 100 0 0 10 0
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F44 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:1F45 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2002 1 0 100 0 0 10 0
   2: B80D0120000000000000000001000000:1F46 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2003 1 0 100 0 0 10 0
"""  # noqa: E501 - the kernel's own line width


def test_listening_sockets_and_which_are_reachable_over_loopback() -> None:
    v4, v6 = parse_listeners(TCP), parse_listeners(TCP6)
    assert set(v4) == {1001, 1002, 1003}  # 1004 is an established connection, not a listener
    reach = {inode: (loopback_host(addr), port) for inode, (addr, port) in {**v4, **v6}.items()}
    assert reach[1001] == ("127.0.0.1", 8000)  # bound to 127.0.0.1
    assert reach[1002] == ("127.0.0.1", 8001)  # bound to every address
    assert reach[1003] == (None, 8002)  # 10.0.0.5 only: never probed
    assert reach[2001] == ("::1", 8004)
    assert reach[2002] == ("127.0.0.1", 8005)  # ::ffff:127.0.0.1
    assert reach[2003] == (None, 8006)  # 2001:db8::1


@pytest.mark.process
def test_this_process_listening_socket_is_found_through_proc() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        found = listeners("/proc", [os.getpid()])
    assert any(listener.port == port and listener.host == "127.0.0.1" for listener in found), found
    assert all(listener.url.startswith(("http://127.0.0.1:", "http://[::1]:")) for listener in found)
