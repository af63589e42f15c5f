"""Has the server read a request yet? Told from the kernel's socket tables, not guessed from elapsed time.

Why: graceful termination must signal only once every one of its requests is *in the server* -- a request still in
the client's buffer, in the kernel's accept queue or unread in the server's socket when SIGTERM lands is refused or
closed by a server that stops reading on the signal, and the gate would blame the server's drain for the client's
haste. No answer byte can say so in general: a plain completion answers only when it is done, and a streamed one
queued behind a model lock may send nothing until its turn. The kernel can: the server's end of the connection is a
row of ``/proc/<pid>/net/tcp`` (or ``tcp6``) whose receive queue counts the request's bytes the process has not read
yet. Once it is established and empty -- and the client has nothing left to send -- the server has the whole request.
What the kernel sees is the process taking the bytes: uvicorn (and any server on an ``asyncio.Protocol``) parses them
in the same callback and starts the request there; a server that buffers what it reads and parses it later is ahead of
what this can tell.

The server is the local process the gate was told to signal, so its socket table is this host's (its own network
namespace, read through its PID). A row that is not there at all (a target reached through something else) cannot be
vouched for: the caller waits, up to its deadline, and says so rather than signal blind.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

from collectors.procfs import read_text, under

ESTABLISHED = "01"


@dataclass(frozen=True, slots=True)
class TcpRow:
    state: str  # two hex digits, the kernel's TCP state ("01" established)
    tx_queue: int
    rx_queue: int  # bytes received and not yet read by the socket's owner


def kernel_address(host: str, port: int) -> str:
    """``host:port`` as the kernel prints it in /proc/net/tcp{,6}: each 32-bit word of the address in hex, read in the
    host's byte order, then the port in hex."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    packed = socket.inet_pton(family, host)
    words = (packed[i : i + 4] for i in range(0, len(packed), 4))
    return "".join(f"{int.from_bytes(w, sys.byteorder):08X}" for w in words) + f":{port:04X}"


def _mapped(host: str) -> str | None:
    """The IPv4-mapped IPv6 form of an IPv4 address (a dual-stack server's row for an IPv4 peer is in tcp6)."""
    return None if ":" in host else f"::ffff:{host}"


def parse_tcp_table(text: str | None) -> dict[tuple[str, str], TcpRow]:
    """/proc/net/tcp or tcp6, keyed by (local, remote) as printed; lines that do not parse are skipped."""
    rows: dict[tuple[str, str], TcpRow] = {}
    for line in (text or "").splitlines()[1:]:
        fields = line.split()
        if len(fields) < 5 or ":" not in fields[4]:
            continue
        tx, _, rx = fields[4].partition(":")
        try:
            rows[(fields[1].upper(), fields[2].upper())] = TcpRow(fields[3].upper(), int(tx, 16), int(rx, 16))
        except ValueError:
            continue
    return rows


class TcpTables:
    """One reading of a process's ``tcp`` and ``tcp6`` tables (its network namespace), keyed as the kernel prints them.

    Why a snapshot: a wait polls every connection of the gate's requests each turn, and a busy server's tables run to
    thousands of rows; each turn reads and parses them once, on the event loop, not once per connection."""

    def __init__(self, pid: int, proc_root: str = "/proc") -> None:
        self.rows: dict[tuple[str, str], TcpRow] = {}
        for table in ("tcp", "tcp6"):  # IPv4 and IPv6 keys differ in length: one dict holds both
            self.rows.update(parse_tcp_table(read_text(under(proc_root, str(pid), "net", table)).text))

    def row(self, local: tuple[str, int], remote: tuple[str, int]) -> TcpRow | None:
        """The row of the connection from ``local`` to ``remote`` (``(host, port)`` pairs), as itself or, for IPv4
        ends, in its IPv4-mapped IPv6 form; None when the tables have no such row."""
        for local_host, remote_host in ((local[0], remote[0]), (_mapped(local[0]), _mapped(remote[0]))):
            if local_host is None or remote_host is None:
                continue
            row = self.rows.get((kernel_address(local_host, local[1]), kernel_address(remote_host, remote[1])))
            if row is not None:
                return row
        return None


def read_by_server(server_tables: TcpTables, own_tables: TcpTables, client: tuple[str, int], server: tuple[str, int]) -> bool:
    """The server process has read everything the client sent on this connection: its end (in ``server_tables``) is
    established with nothing unread, and the client's own end (in ``own_tables``, this process's, when they show it)
    has nothing still unacknowledged."""
    row = server_tables.row(server, client)
    if row is None or row.state != ESTABLISHED or row.rx_queue:
        return False
    own = own_tables.row(client, server)  # the same connection seen from this end
    return own is None or own.tx_queue == 0
