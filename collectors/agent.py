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
- The recorder's faults never stop sampling or /metrics: a failed write is counted and logged; a full
  disk makes the recorder drop its oldest rows (``FlightRecorder.write``); a file deleted, replaced
  or found not to be a database is set aside and a fresh recorder started (``llmdiag_recorder_resets_total``).
- What ``--pid``/``--cgroup`` resolve to is written as a ``WatchScope`` record at start and whenever it
  changes, and a target that is missing is warned about once per change -- then looked for every sample.
- Backends' own /metrics (``--scrape``) are scraped on threads of their own (``collectors.scrape``), so a
  hung backend never delays a sample; their records are written with the next sample, and only the
  scrapes' health is served on /metrics. With ``--scrape auto`` the model-file holders of each sample are
  handed to the discovery thread (``collectors.discover``), which keeps the targets current.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from collectors.discover import AutoTargets
from collectors.exporter import SnapshotCollector
from collectors.recorder import FlightRecorder, is_corruption, move_aside, open_for_writing
from collectors.records import Record, WatchScope
from collectors.scrape import Scrapers
from collectors.series_cap import SeriesCaps
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
        scrapers: Scrapers | None = None,
        discovery: AutoTargets | None = None,
        caps: SeriesCaps | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval must be positive")
        self.taker = taker
        self.interval_s = interval_s
        self.recorder = recorder
        self.trim_interval_s = trim_interval_s
        self.on_sample = on_sample
        self.collector = SnapshotCollector(caps)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.scrapers = scrapers
        self.discovery = discovery
        if scrapers is not None:
            self.registry.register(scrapers.health)
        self.stop_event = threading.Event()
        self.samples = 0
        self._last_trim = 0.0
        self._server: object | None = None
        self._scope_key: tuple[object, ...] | None = None
        self._scope_pending: WatchScope | None = None
        self._reopen_reason: str | None = None  # the recorder must be started afresh before the next write
        self._disk_full_before = 0  # full-disk events of recorders replaced since start

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
        records: list[Record] = snapshot.records()
        if self.discovery is not None:
            self.discovery.update(p.pid for p in snapshot.processes if p.model_files)
        if self.scrapers is not None:
            records.extend(self.scrapers.drain())
        scope = self._scope_change(snapshot.scope)
        if scope is not None:
            records.append(scope)
        recorder_error, size = self._record(records)
        if recorder_error and scope is not None:
            self._scope_pending = scope  # not on disk: write it with the next sample that succeeds
        self.collector.update(snapshot, recorder_size=size, recorder_error=recorder_error)
        self.samples += 1
        if self.on_sample is not None:
            self.on_sample(snapshot)
        return snapshot

    def _record(self, records: list[Record]) -> tuple[bool, int | None]:
        """Write one sample (and trim now and then); returns (failed, size after a trim)."""
        if self.recorder is None:
            return False, None
        reason = self._reopen_reason or self.recorder.file_problem()
        if reason is not None and not self._restart_recorder(reason):
            return True, None
        try:
            self.recorder.write(records)
            now = time.monotonic()
            size = None
            if now - self._last_trim >= self.trim_interval_s:
                self._last_trim = now
                size = self.recorder.trim().size_bytes
            return False, size
        except Exception as exc:  # a full or read-only disk must not stop /metrics or the sampling
            log.warning("flight recorder write failed: %s", exc)
            if isinstance(exc, sqlite3.DatabaseError) and is_corruption(exc):
                self._reopen_reason = "corrupt"  # set aside and start afresh before the next write
            return True, None
        finally:
            self.collector.recorder_state(disk_full=self._disk_full_before + self.recorder.disk_full)

    def _restart_recorder(self, reason: str) -> bool:
        """Start a fresh recorder at the same path (a damaged file is moved aside first). False: try next sample.

        Why at the same path: ``diag analyze`` and ``diag bundle`` find the agent's history there.
        """
        assert self.recorder is not None
        old = self.recorder
        if reason == "corrupt" or self._reopen_reason is not None:
            old.close()  # a damaged file's -wal/-shm move aside with it (move_aside); a retry has closed it already
        else:
            old.abandon()  # deleted or replaced: its leftover -wal/-shm must not meet the new file
        self._reopen_reason = reason
        try:
            if reason == "corrupt" and old.path.exists():
                aside = move_aside(old.path)
                log.warning("flight recorder %s is damaged; moved it to %s (kept)", old.path, aside)
            elif not old.path.exists() and any(os.path.lexists(f"{old.path}{s}") for s in ("-wal", "-shm")):
                move_aside(old.path, label="orphan", sidecars_only=True)  # a WAL without its file: never replay it
            fresh, aside = open_for_writing(old.path, old.retention_s, old.max_size_bytes)
        except (OSError, ValueError, sqlite3.Error) as exc:
            log.warning("cannot start a fresh flight recorder at %s (%s); trying again next sample", old.path, exc)
            return False
        log.warning("flight recorder %s was %s: started a fresh one", old.path, reason)
        self._disk_full_before += old.disk_full
        self.recorder = fresh
        self._reopen_reason = None
        self.count_reset("corrupt" if aside is not None else reason)
        self._scope_key = None  # the fresh file needs the watch scope again
        return True

    def count_reset(self, reason: str) -> None:
        """Count a fresh start of the recorder (``corrupt``, ``deleted``, ``replaced``) on /metrics."""
        self.collector.recorder_state(reset=reason)

    def _scope_change(self, scope: WatchScope | None) -> WatchScope | None:
        """The scope when it differs from the last one written (or one is still owed), else None; warns on change."""
        if scope is None:
            return None
        key = (tuple(scope.resolved_pids), tuple(scope.resolved_cgroups), tuple(scope.missing))
        if key == self._scope_key:
            pending, self._scope_pending = self._scope_pending, None
            return pending
        self._scope_key = key
        self._scope_pending = None
        for line in scope.missing:
            log.warning("watch target not found (looking again every sample): %s", line)
        if not scope.missing:
            log.info("every watch target found: pids %s, cgroups %s", scope.resolved_pids, scope.resolved_cgroups)
        return scope

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
        if self.discovery is not None:
            self.discovery.stop()
        if self.scrapers is not None:
            self.scrapers.close()
            late = self.scrapers.drain()  # scrapes finished since the last sample: theirs too
            if late and self.recorder is not None:
                self._record(list(late))
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
        if self.recorder is not None:
            self.recorder.close()
        self.taker.close()
