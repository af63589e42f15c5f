"""The host agent behind ``diag collect``: sample every interval, record, serve /metrics.

Design choices, and why:
- One thread samples on a fixed schedule (start + k * interval); an overrun skips ticks instead of
  piling up, so a thrashing host gets fewer samples, not a backlog of late ones.
- Each sample is written to the flight recorder in one transaction; the recorder is trimmed every
  ``trim_interval_s`` (not every sample: trimming scans an index).
- /metrics is served by prometheus_client's small WSGI server on its own daemon thread and renders
  the latest snapshot on scrape, so a slow scraper never delays sampling.
- SIGTERM/SIGINT set a flag; the current sample finishes, the recorder is closed cleanly, exit 0.
  A kill -9 loses at most the transaction in flight (SQLite WAL), never the file.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from collectors.exporter import SnapshotCollector
from collectors.recorder import FlightRecorder
from collectors.snapshot import Snapshot, SnapshotTaker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> ListenAddress:
        """``127.0.0.1:9464``, ``[::1]:9464`` or ``:9464`` (loopback). Raises ValueError with the reason."""
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"listen address {text!r} needs HOST:PORT, e.g. 127.0.0.1:9464")
        host = host.strip("[]") or "127.0.0.1"
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"listen address {text!r}: port {port_text!r} is not a number") from None
        if not 0 <= port <= 65535:
            raise ValueError(f"listen address {text!r}: port out of range")
        return cls(host, port)


class Agent:
    def __init__(
        self,
        taker: SnapshotTaker,
        *,
        interval_s: float = 1.0,
        recorder: FlightRecorder | None = None,
        trim_interval_s: float = 10.0,
        on_sample: Callable[[Snapshot], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval must be positive")
        self.taker = taker
        self.interval_s = interval_s
        self.recorder = recorder
        self.trim_interval_s = trim_interval_s
        self.on_sample = on_sample
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.stop_event = threading.Event()
        self.samples = 0
        self._last_trim = 0.0
        self._server: object | None = None

    def serve(self, address: ListenAddress) -> None:
        server, _thread = start_http_server(address.port, addr=address.host, registry=self.registry)
        self._server = server
        log.info("serving /metrics on http://%s:%d/metrics", address.host, server.server_port)

    @property
    def bound_port(self) -> int | None:
        return getattr(self._server, "server_port", None)

    def step(self) -> Snapshot:
        """Take one sample, record it, publish it. Never raises for a recorder problem."""
        snapshot = self.taker.take()
        recorder_error = False
        size = None
        if self.recorder is not None:
            try:
                self.recorder.write(snapshot.records())
                now = time.monotonic()
                if now - self._last_trim >= self.trim_interval_s:
                    self._last_trim = now
                    size = self.recorder.trim().size_bytes
            except Exception as exc:  # a full disk must not stop /metrics or the sampling
                recorder_error = True
                log.warning("flight recorder write failed: %s", exc)
        self.collector.update(snapshot, recorder_size=size, recorder_error=recorder_error)
        self.samples += 1
        if self.on_sample is not None:
            self.on_sample(snapshot)
        return snapshot

    def run(self, max_samples: int | None = None) -> None:
        """Sample until stopped (signal, ``stop()``) or ``max_samples`` reached."""
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            self.step()
            if max_samples is not None and self.samples >= max_samples:
                break
            next_tick += self.interval_s
            now = time.monotonic()
            if next_tick < now:  # overran: skip the missed ticks rather than bursting to catch up
                next_tick = now + self.interval_s - ((now - next_tick) % self.interval_s)
            self.stop_event.wait(next_tick - now)

    def stop(self, *_: object) -> None:
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
        if self.recorder is not None:
            self.recorder.close()
        self.taker.close()
