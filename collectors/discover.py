"""``--scrape auto``: the /metrics of the processes serving a model, found from ``/proc`` and probed on loopback.

Why from the model-file holders: on a host nobody described, the processes that map or hold a model file
*are* the inference service (the agent already finds them every sample). Their listening TCP sockets --
or those of their parent and grandparent, since vLLM's API server is the parent of the engine that holds
the weights and uvicorn's master the parent of its workers -- are where its ``/metrics`` lives. Each is
probed once with ``GET /metrics`` (a port that does not answer with a backend's families is not scraped,
and is probed again only after ``REPROBE_S``).

Loopback only: a socket bound to all addresses or to loopback is reached at 127.0.0.1 or ``[::1]``; one
bound to another address, or a process in another network namespace (a container: its loopback is not
ours), is left alone. Nothing is ever sent to a non-loopback address from here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from collectors.exposition import Limits, ScrapeError, parse
from collectors.procfs import read_text, under
from collectors.scrape import Fetched, Scrapers, fetch

log = logging.getLogger(__name__)

TCP_LISTEN = "0A"
ANCESTORS = 2  # how far up from a holder to look for the listening socket
REDISCOVER_S = 30.0  # how often the holders' sockets are looked at again
REPROBE_S = 300.0  # a port that was not a backend is probed again after this long
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Listener:
    pid: int
    host: str  # the loopback address to reach it at: 127.0.0.1 or ::1
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"


def _hex_addr(text: str) -> tuple[bytes, int] | None:
    """``0100007F:1F90`` (the kernel's little-endian words) -> (address bytes, port)."""
    addr, _, port = text.partition(":")
    try:
        raw = bytes.fromhex(addr)
        port_n = int(port, 16)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # each 32-bit word is in host (little-endian) order
    return b"".join(words), port_n


def loopback_host(address: bytes) -> str | None:
    """Where to reach a socket bound to ``address`` over loopback, or None when it is not reachable that way."""
    if len(address) == 4:
        if address == b"\0\0\0\0" or address[0] == 127:
            return "127.0.0.1"
        return None
    if address == bytes(16) or address == bytes(15) + b"\1":
        return "::1"
    if address[:12] == bytes(10) + b"\xff\xff":  # an IPv4-mapped address
        v4 = address[12:]
        return "127.0.0.1" if v4 == b"\0\0\0\0" or v4[0] == 127 else None
    return None


def parse_listeners(text: str) -> dict[int, tuple[bytes, int]]:
    """``/proc/<pid>/net/tcp`` or ``tcp6``: socket inode -> (local address, port) of each listening socket."""
    out: dict[int, tuple[bytes, int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != TCP_LISTEN:
            continue
        local = _hex_addr(fields[1])
        if local is None or not fields[9].isdigit():
            continue
        out[int(fields[9])] = local
    return out


def socket_inodes(proc_root: str, pid: int) -> set[int]:
    """The inodes of the sockets a process holds open (``socket:[N]`` links in ``/proc/<pid>/fd``)."""
    inodes: set[int] = set()
    fd_dir = under(proc_root, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            link = os.readlink(fd_dir / name)
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdigit():
            inodes.add(int(link[8:-1]))
    return inodes


def _ppid(proc_root: str, pid: int) -> int | None:
    stat = read_text(under(proc_root, str(pid), "stat"), 4096)
    if not stat.ok or stat.text is None:
        return None
    fields = stat.text.rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _same_netns(proc_root: str, pid: int) -> bool:
    try:
        return os.readlink(under(proc_root, str(pid), "ns", "net")) == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def candidate_pids(proc_root: str, holders: Iterable[int]) -> list[int]:
    """The holders and their parents up to ``ANCESTORS`` levels (never pid 1)."""
    out: dict[int, None] = {}
    for pid in holders:
        current: int | None = pid
        for _ in range(ANCESTORS + 1):
            if current is None or current <= 1:
                break
            out.setdefault(current)
            current = _ppid(proc_root, current)
    return list(out)


def listeners(proc_root: str, holders: Iterable[int]) -> list[Listener]:
    """Loopback-reachable listening TCP sockets of the holders and their parents (same network namespace only)."""
    found: dict[tuple[str, int], Listener] = {}
    for pid in candidate_pids(proc_root, holders):
        if not _same_netns(proc_root, pid):
            continue
        inodes = socket_inodes(proc_root, pid)
        if not inodes:
            continue
        table: dict[int, tuple[bytes, int]] = {}
        for name in ("tcp", "tcp6"):
            got = read_text(under(proc_root, str(pid), "net", name), 4 << 20)
            if got.ok and got.text is not None:
                table.update(parse_listeners(got.text))
        for inode in inodes & table.keys():
            address, port = table[inode]
            host = loopback_host(address)
            if host is not None and port > 0:
                found.setdefault((host, port), Listener(pid, host, port))
    return sorted(found.values(), key=lambda x: (x.port, x.host))


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S, fetcher: Callable[[str, float, int], Fetched] = fetch) -> bool:
    """Whether ``url`` answers with at least one known backend family."""
    try:
        got = fetcher(url, timeout_s, Limits().max_bytes)
        parse(got.body, got.content_type)
    except ScrapeError as exc:
        log.debug("%s is not a backend's /metrics: %s", url, exc)
        return False
    return True


class AutoTargets(threading.Thread):
    """Keeps ``scrapers`` on the /metrics of the current model-file holders (plus the explicit ``--scrape`` URLs).

    The agent hands it the holder pids of each sample (``update``); every ``REDISCOVER_S`` (or when the
    holders change) it looks at their sockets, probes the new ones, and sets the scrapers' targets.
    """

    def __init__(self, scrapers: Scrapers, proc_root: str, explicit: Iterable[str] = (),
                 prober: Callable[[str], bool] = probe) -> None:  # fmt: skip
        super().__init__(name="scrape discovery", daemon=True)
        self.scrapers = scrapers
        self.proc_root = proc_root
        self.explicit = list(explicit)
        self.prober = prober
        self._holders: tuple[int, ...] = ()
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._verdicts: dict[str, tuple[bool, float]] = {}  # url -> (is a backend, when probed)
        self.found: list[str] = []

    def update(self, holders: Iterable[int]) -> None:
        holders = tuple(sorted(set(holders)))
        if holders != self._holders:
            self._holders = holders
            self._changed.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.discover()
            except Exception:  # discovery must never take the agent down; it tries again next round
                log.exception("--scrape auto: discovery failed")
            self._changed.wait(REDISCOVER_S)
            self._changed.clear()

    def discover(self) -> list[str]:
        now = time.monotonic()
        urls = []
        for listener in listeners(self.proc_root, self._holders):
            verdict = self._verdicts.get(listener.url)
            if verdict is None or (not verdict[0] and now - verdict[1] > REPROBE_S):
                verdict = (self.prober(listener.url), now)
                self._verdicts[listener.url] = verdict
                if verdict[0]:
                    log.info("--scrape auto: scraping %s (pid %d listens there)", listener.url, listener.pid)
            if verdict[0]:
                urls.append(listener.url)
        self.found = urls
        self.scrapers.set_targets([*self.explicit, *urls])
        return urls

    def stop(self) -> None:
        self._stopping.set()
        self._changed.set()
