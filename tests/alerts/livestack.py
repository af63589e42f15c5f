"""A real alerting stack for live tests: Prometheus 2.42 with rule files, Alertmanager 0.25, a webhook sink.

Everything listens on 127.0.0.1 on free ports, runs from a temporary folder and is stopped by PID.
The sink is the only thing written here: a local HTTP server speaking Alertmanager's webhook
(version 4) that keeps every delivery with its arrival time. It serves exactly the paths
``diag triage serve`` serves (``alerts.receiver_routes``) and answers any other path 404 as the receiver
does -- which Alertmanager treats as final and drops -- so a route to a wrong path fails the test
instead of being delivered.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from alerts.receiver_routes import route_severity
from tests import procs
from tests.promserver import free_port

ALERTMANAGER = "prometheus-alertmanager"


@dataclass
class Delivery:
    at: float  # time.time() when the sink got it
    receiver_path: str  # the severity of the route it came by (page, ticket; '' for the plain /webhook)
    body: dict[str, Any]


@dataclass
class Sink:
    """Webhook receiver; ``alerts()`` flattens every delivered alert with its delivery time and route's severity."""

    port: int = 0
    deliveries: list[Delivery] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # paths answered 404: alerts Alertmanager then dropped
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        """What a spec's ``routing.receiver_url`` names."""
        return f"http://127.0.0.1:{self.port}"

    def alerts(self, since: float = 0.0) -> list[tuple[float, str, dict[str, Any]]]:
        with self.lock:
            return [(d.at, d.receiver_path, a) for d in self.deliveries if d.at >= since
                    for a in d.body.get("alerts", []) if a.get("status") == "firing"]  # fmt: skip

    def wait_for(self, match: Any, since: float, timeout_s: float) -> tuple[float, str, dict[str, Any]] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for item in self.alerts(since):
                if match(item[2]):
                    return item
            time.sleep(0.2)
        return None


@contextlib.contextmanager
def webhook_sink() -> Iterator[Sink]:
    sink = Sink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            severity = route_severity(self.path)
            if severity is None:
                with sink.lock:
                    sink.refused.append(self.path)
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b"not found; Alertmanager should POST to /webhook\n")
                return
            with sink.lock:
                sink.deliveries.append(Delivery(time.time(), severity, json.loads(raw or b"{}")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    sink.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def alertmanager(config_yaml: str, folder: Path) -> Iterator[str]:
    binary = shutil.which(ALERTMANAGER) or shutil.which("alertmanager")
    if binary is None:
        pytest.skip("Alertmanager is not installed (Debian package prometheus-alertmanager; `make test` installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "alertmanager.yml").write_text(config_yaml)
    port = free_port()
    log = folder / "alertmanager.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([binary, f"--config.file={folder / 'alertmanager.yml'}", f"--storage.path={folder / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=folder)  # fmt: skip
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/-/ready", proc, 30, log)
        yield f"127.0.0.1:{port}"
    finally:
        procs.stop(proc)


@contextlib.contextmanager
def prometheus_with_rules(rule_files: Sequence[Path], jobs: dict[str, str], alertmanager_addr: str, folder: Path,
                          interval: str = "1s") -> Iterator[str]:  # fmt: skip
    """Prometheus scraping ``jobs`` (name -> host:port), evaluating ``rule_files`` every ``interval``, alerting one AM."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian package 'prometheus'; `make test` installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}", "rule_files:"]
    lines += [f'  - "{p}"' for p in rule_files]
    lines += ["alerting:", "  alertmanagers:", "    - static_configs:", f'        - targets: ["{alertmanager_addr}"]',
              "scrape_configs:"]  # fmt: skip
    for name, target in jobs.items():
        lines += [f'  - job_name: "{name}"', "    static_configs:", f'      - targets: ["{target}"]']
    (folder / "prometheus.yml").write_text("\n".join(lines) + "\n")
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=folder)  # fmt: skip
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/-/ready", proc, 30, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        procs.stop(proc)


@contextlib.contextmanager
def agent(recorder: Path, cgroups: Sequence[str], folder: Path, diagnose_every: str = "5s") -> Iterator[tuple[str, int]]:
    """``diag collect`` on a free port with the live diagnosis on; yields (host:port, pid)."""
    log = folder / "agent.log"
    argv = [sys.executable, "-m", "diag.cli", "collect", "--listen", "127.0.0.1:0", "--recorder", str(recorder),
            "--diagnose-every", diagnose_every, "--no-gpu"]  # fmt: skip
    for cg in cgroups:
        argv += ["--cgroup", cg]
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    try:
        addr = procs.agent_address(log, proc, 60)
        yield addr, proc.pid
    finally:
        procs.stop(proc)
