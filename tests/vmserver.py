"""A real single-node VictoriaMetrics on 127.0.0.1 for tests: free port, temporary storage, stopped by PID.

Why a real one: long-term stores speak Prometheus's query API with their own semantics -- VictoriaMetrics'
``rate`` does not extrapolate, its lookback follows the scrape interval rather than 5 minutes, and it refuses
queries past its ``-search.max*`` limits with a 422 and its own error text. A fake would only repeat our
assumptions about all that. The Debian package ``victoria-metrics`` (1.79 in bookworm) provides the binary;
its service is never started, we run our own. Without the binary the test is skipped with the reason.

Series go in as Prometheus sends them to a long-term store: remote write (``/api/v1/write``: a protobuf
``WriteRequest``, snappy-compressed), from the same OpenMetrics documents the Prometheus tests backfill with
promtool, and are flushed (``/internal/force_flush``) before the first query. Remote write rather than the text
import API because it carries Prometheus' staleness markers: the recordings' converter writes a NaN where
Prometheus would write one (a process that exited), and only remote write can send it as the marker -- the
text import drops a NaN, and VictoriaMetrics then shows the vanished series for a few more steps.
Both encodings are written out here (a few lines each: protobuf's varints, snappy's literal-only blocks) rather
than adding a protobuf and a snappy package to the test dependencies for one fixture.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.promserver import free_port, stop, wait_ready

BINARY = "victoria-metrics"


def require_victoria_metrics() -> str:
    path = shutil.which(BINARY)
    if path is None:
        pytest.skip("the victoria-metrics binary is not installed (Debian package 'victoria-metrics'; "
                    "`make system-deps` installs it)")  # fmt: skip
    return path


@dataclass
class VmServer:
    url: str
    pid: int
    folder: Path

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "vm.log").read_text(errors="replace")[-n:]
        return ""

    def remote_write(self, path: Path, batch_samples: int = 500_000) -> int:
        """Send an OpenMetrics file's samples by remote write (NaN as the staleness marker); the samples sent.

        Streamed: a request every ``batch_samples`` samples, so a file of gigabytes (``bench/fleet.py``) never
        sits in memory whole; a series split over two requests is joined by the store."""
        series: dict[str, list[tuple[float, int]]] = {}
        pending = sent = 0

        def flush() -> None:
            body = b"".join(_field_bytes(1, _timeseries(k, v)) for k, v in series.items())
            r = httpx.post(f"{self.url}/api/v1/write", content=_snappy_literal(body), timeout=300, trust_env=False,
                           headers={"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                                    "X-Prometheus-Remote-Write-Version": "0.1.0"})  # fmt: skip
            if r.status_code >= 300:
                raise RuntimeError(f"remote write refused: HTTP {r.status_code}: {r.text[:300]}")
            series.clear()

        with path.open() as lines:
            for line in lines:
                if not line.strip() or line.startswith("#"):
                    continue
                key, value, ts = line.rstrip("\n").rsplit(" ", 2)
                number = STALE_NAN if value == "NaN" else float(value)
                series.setdefault(key, []).append((number, round(float(ts) * 1000)))
                pending += 1
                if pending >= batch_samples:
                    flush()
                    sent, pending = sent + pending, 0
        if series:
            flush()
        httpx.get(f"{self.url}/internal/force_flush", timeout=60, trust_env=False).raise_for_status()
        return sent + pending


# Prometheus' staleness marker: a NaN with this exact bit pattern (value.StaleNaN).
STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _timeseries(key: str, samples: list[tuple[float, int]]) -> bytes:
    """``TimeSeries{labels (1): Label{name (1), value (2)}, samples (2): Sample{value (1) double, timestamp (2)}}``."""
    name, _, inner = key.partition("{")
    labels = {"__name__": name}
    for label, raw in _LABEL.findall(inner.rstrip("}")):
        labels[label] = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m[0]], raw)
    out = [_field_bytes(1, _field_bytes(1, k.encode()) + _field_bytes(2, v.encode())) for k, v in sorted(labels.items())]
    for value, ts in samples:
        sample = b"\x09" + struct.pack("<d", value) + b"\x10" + _varint(ts & 0xFFFFFFFFFFFFFFFF)
        out.append(_field_bytes(2, sample))
    return b"".join(out)


def _snappy_literal(data: bytes) -> bytes:
    """A valid snappy block holding ``data`` as literals only (no compression: the decoder needs none)."""
    out = [_varint(len(data))]
    for i in range(0, len(data), 1 << 16):
        chunk = data[i : i + (1 << 16)]
        n = len(chunk) - 1
        out.append(bytes([n << 2]) if n < 60 else bytes([62 << 2]) + n.to_bytes(3, "little"))
        out.append(chunk)
    return b"".join(out)


@contextlib.contextmanager
def victoria_metrics(flags: Sequence[str] = (), ready_timeout_s: float = 20.0) -> Iterator[VmServer]:
    """Run VictoriaMetrics with ``flags`` (e.g. ``-search.maxUniqueTimeseries=10``); killed by PID, data removed.

    ``-search.disableCache``: the rollup cache assumes data arrives in time order; backfilled samples would
    otherwise be hidden behind cached empty answers. ``-retentionPeriod=100y``: any imported time is kept."""
    binary = require_victoria_metrics()
    folder = Path(tempfile.mkdtemp(prefix="llmdiag-vm-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        port = free_port()
        with (folder / "vm.log").open("wb") as log:
            proc = subprocess.Popen(
                [binary, f"-storageDataPath={folder / 'data'}", f"-httpListenAddr=127.0.0.1:{port}",
                 "-retentionPeriod=100y", "-search.disableCache", "-loggerLevel=WARN", *flags],
                stdout=log, stderr=subprocess.STDOUT, cwd=folder,
            )  # fmt: skip
        server = VmServer(f"http://127.0.0.1:{port}", proc.pid, folder)
        wait_ready(proc, f"{server.url}/health", "victoria-metrics", ready_timeout_s, server.log_tail)
        yield server
    finally:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)
