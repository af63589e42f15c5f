"""Two real Alertmanager 0.25 peers in one gossip cluster on 127.0.0.1, for the triage tests.

Why two: in production every HA peer may deliver the same notification (each waits its position x
peer timeout, then sends unless the gossip already says another did). ``peer_timeout`` is set tiny
here so both often do -- the receiver must turn that into one incident. "Often" is a race the gossip
sometimes wins, so a test that needs duplicates for certain asks for ``clustered=False``: two peers
that never hear of each other (a partitioned HA pair), each delivering every group. Ports are free
ephemeral ones (web and cluster), processes are stopped by PID, data lives in a temporary folder.
Without the Debian package (``prometheus-alertmanager`` + ``amtool``) the tests skip with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.paths import REPO
from tests.triage.helpers import free_port

HA_EXAMPLE = REPO / "collectors" / "deploy" / "alertmanager-triage-ha.yml"
HA_TOKEN_FILE = "/etc/alertmanager/llm-diag-triage.token"
BINARY_CANDIDATES = ("prometheus-alertmanager", "alertmanager")

CONFIG = """
global:
  resolve_timeout: 2m
route:
  receiver: triage
  group_by: [alertname, job, instance]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: triage
    webhook_configs:
      - url: {url}
        send_resolved: true
        max_alerts: 0
"""


def binaries() -> tuple[str, str]:
    am = next((p for p in map(shutil.which, BINARY_CANDIDATES) if p), None)
    amtool = shutil.which("amtool")
    if am is None or amtool is None:
        pytest.skip("Alertmanager and amtool are not installed (Debian package prometheus-alertmanager)")
    return am, amtool


def ha_example(a: str, b: str, token_file: str, **timers: str) -> str:
    """The shipped HA example with these receivers (base URLs) and token file, and the route timers given
    (``group_wait="1s"``...): only what a test must change. Each timer named must be in the example once."""
    text = HA_EXAMPLE.read_text()
    urls = re.findall(r"url: (http://[^\s]+/webhook)", text)
    assert len(urls) == 2, urls  # the example routes to two receivers
    text = text.replace(urls[0], f"{a}/webhook").replace(urls[1], f"{b}/webhook")
    assert text.count(HA_TOKEN_FILE) == 2
    text = text.replace(HA_TOKEN_FILE, token_file)
    for timer, value in timers.items():
        text, n = re.subn(rf"\b{timer}: \S+", f"{timer}: {value}", text)
        assert n == 1, timer
    return text


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class AlertmanagerPair:
    def __init__(
        self, folder: Path, webhook_url: str = "", peer_timeout: str = "10ms", *, clustered: bool = True,
        config_text: str | None = None,
    ) -> None:  # fmt: skip
        """``config_text``: a whole Alertmanager configuration instead of the one-receiver ``CONFIG`` for ``webhook_url``."""
        self.am, self.amtool = binaries()
        self.folder = folder
        self.web = [free_port(), free_port()]
        self.cluster = [free_port(), free_port()]
        config = folder / "alertmanager.yml"
        config.write_text(config_text if config_text is not None else CONFIG.format(url=webhook_url))
        self.clustered = clustered
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(2):
            data = folder / f"am{i}"
            data.mkdir()
            cmd = [self.am, f"--config.file={config}", f"--storage.path={data}", f"--web.listen-address=127.0.0.1:{self.web[i]}"]
            if clustered:
                cmd += [
                    f"--cluster.listen-address=127.0.0.1:{self.cluster[i]}", f"--cluster.peer=127.0.0.1:{self.cluster[1 - i]}",
                    f"--cluster.peer-timeout={peer_timeout}", "--cluster.gossip-interval=100ms", "--cluster.settle-timeout=5s",
                ]  # fmt: skip
            else:
                cmd.append("--cluster.listen-address=")  # an empty address turns clustering off
            cmd.append("--log.level=warn")
            log = open(folder / f"am{i}.log", "wb")  # noqa: SIM115 - closed with the process in stop()
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log))
        self._wait_ready()

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.web]

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for url, proc in zip(self.urls, self.procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"alertmanager exited: {(self.folder / 'am0.log').read_text()[-2000:]}")
                try:
                    if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("alertmanager not ready")
                time.sleep(0.1)
        if not self.clustered:
            return
        while time.monotonic() < deadline:  # both peers see each other
            status = httpx.get(f"{self.urls[0]}/api/v2/status", timeout=2).json()
            if len(status.get("cluster", {}).get("peers") or []) == 2:
                return
            time.sleep(0.2)
        raise RuntimeError("the two alertmanagers did not form a cluster")

    def add(self, labels: dict[str, str], *, start: float | None = None, end: float | None = None, **annotations: str) -> None:
        """``amtool alert add`` to *both* peers, as Prometheus sends every alert to every Alertmanager."""
        args = [f"{k}={v}" for k, v in labels.items()]
        args += [f"--annotation={k}={v}" for k, v in annotations.items()]
        if start is not None:
            args.append(f"--start={iso(start)}")
        if end is not None:
            args.append(f"--end={iso(end)}")
        for url in self.urls:
            subprocess.run(
                [self.amtool, "alert", "add", f"--alertmanager.url={url}", *args], check=True, capture_output=True, timeout=30
            )

    def post(self, alerts: list[dict]) -> None:
        """``POST /api/v2/alerts`` of a batch to *both* peers, as Prometheus sends each evaluation's alerts to every
        Alertmanager (``amtool`` would start a process per alert)."""
        for url in self.urls:
            r = httpx.post(f"{url}/api/v2/alerts", json=alerts, timeout=30)
            assert r.status_code == 200, r.text[:300]

    def counter(self, name: str, integration: str = "webhook") -> list[float]:
        """A counter of each peer's /metrics, summed over its series for ``integration``."""
        out = []
        for url in self.urls:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            out.append(sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith((f"{name} ", f"{name}{{")) and f'integration="{integration}"' in line
            ))  # fmt: skip
        return out

    def notifications(self) -> list[float]:
        """``alertmanager_notifications_total{integration="webhook"}`` of each peer: who actually delivered."""
        return self.counter("alertmanager_notifications_total")

    def stop(self) -> None:
        """Each peer in turn (SIGTERM by PID, SIGKILL if it lingers): stopped together, the peer that exits second
        waits out its 10 s timeout for a leave broadcast no peer is left to receive ("unable to leave gossip mesh")."""
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
