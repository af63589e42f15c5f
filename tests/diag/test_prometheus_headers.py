"""``--header`` and ``--tenant`` on every ``--prometheus`` path, against a real Prometheus behind a checking proxy.

Mimir, Cortex and Thanos' receive and query-frontend want a tenant (``X-Scope-OrgID``) and usually sit behind
an authenticating proxy. Here a small reverse proxy on 127.0.0.1 stands in front of a real Prometheus
(three recorded machines backfilled with promtool): it answers 401 to a request without the expected bearer
token and tenant, and forwards the rest. Every path that takes ``--prometheus`` must get through it with the
options -- ``diag analyze`` on one target and on the fleet, ``diag dashboards preview``, the triage worker's
analysis -- and be refused, in one line saying why, without them. The token is a secret: it must appear in
no output, message, log line or written file.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from diag.sources.fleet import load_fleet
from diag.sources.prometheus import load_prometheus, request_headers
from diag.triage.diagnosis import Source, run_analysis
from tests.diag.fleet_series import SELECTOR, recording, write_fleet
from tests.promserver import prometheus, require_prometheus

pytestmark = [pytest.mark.process, pytest.mark.slow]

TOKEN = "s3cr3t-7d1f0c9a-token"  # looked for in every output below
TENANT = "team-a"
GOOD = {"Authorization": f"Bearer {TOKEN}", "X-Scope-OrgID": TENANT}
ARGS = ["--header", f"Authorization: Bearer {TOKEN}", "--tenant", TENANT]
SICK = {"node03": "queue_backlog", "node11": "host_oom"}
SINCE_S = 80.0


class _Gate(BaseHTTPRequestHandler):
    """401 unless the bearer token and the tenant are both right; else the request goes on to Prometheus."""

    upstream = ""
    seen: ClassVar[list[tuple[str, bool]]] = []  # (path, admitted) of every request
    lock = threading.Lock()

    def _admit(self) -> bool:
        ok = self.headers.get("Authorization") == f"Bearer {TOKEN}" and self.headers.get("X-Scope-OrgID") == TENANT
        with self.lock:
            self.seen.append((self.path, ok))
        if not ok:
            body = b"no org id or bad credentials\n"
            self.send_response(401)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        return ok

    def _relay(self, r: httpx.Response) -> None:
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self._admit():
            self._relay(httpx.post(self.upstream + self.path, content=body, timeout=60, trust_env=False,
                                   headers={"Content-Type": self.headers.get("Content-Type", "")}))  # fmt: skip

    def do_GET(self) -> None:
        if self._admit():
            self._relay(httpx.get(self.upstream + self.path, timeout=60, trust_env=False))

    def log_message(self, *_args: object) -> None:
        pass


@dataclass
class Gate:
    url: str
    direct: str  # Prometheus itself, for the reference answers
    end: float

    def seen(self) -> list[tuple[str, bool]]:
        with _Gate.lock:
            return list(_Gate.seen)

    def reset(self) -> None:
        with _Gate.lock:
            _Gate.seen.clear()


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gate]:
    require_prometheus()
    plan = [("node03", recording("queue")), ("node05", recording("healthy")), ("node11", recording("host-oom"))]
    end = float(int(time.time()) - 600)
    om = write_fleet(plan, end, tmp_path_factory.mktemp("gate") / "fleet.om")
    with prometheus([], backfill=[om]) as prom:
        _Gate.upstream = prom.url
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Gate)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield Gate(f"http://127.0.0.1:{server.server_address[1]}", prom.url, end)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)


def _since(gate: Gate) -> str:
    return f"{int(time.time() - gate.end + SINCE_S)}s"


def _diag(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diag.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)  # fmt: skip


def test_without_the_headers_the_store_refuses_and_the_message_says_what_to_give(gate: Gate) -> None:
    with pytest.raises(ValueError, match=r"HTTP 401 .*unauthorized: give --header/--tenant"):
        load_prometheus(gate.url, selector=f'{SELECTOR},host="node03"', since_s=SINCE_S, until=gate.end)
    wrong = {"Authorization": "Bearer not-it", "X-Scope-OrgID": TENANT}
    with pytest.raises(ValueError, match="the --header/--tenant given were refused"):
        load_fleet(gate.url, selector=SELECTOR, since_s=SINCE_S, until=gate.end, step_s=1.0, headers=wrong)
    only_token = {"Authorization": f"Bearer {TOKEN}"}  # the tenant matters on its own
    with pytest.raises(ValueError, match="HTTP 401"):
        load_prometheus(gate.url, since_s=SINCE_S, until=gate.end, headers=only_token)


def test_with_them_every_query_is_admitted_and_the_answer_is_the_direct_one(gate: Gate) -> None:
    gate.reset()
    selector = f'{SELECTOR},host="node11"'
    through = load_prometheus(gate.url, selector=selector, since_s=SINCE_S, until=gate.end, headers=GOOD)
    direct = load_prometheus(gate.direct, selector=selector, since_s=SINCE_S, until=gate.end)
    assert set(through.host) == set(direct.host) and set(through.service) == set(direct.service) and through.host
    fleet = load_fleet(gate.url, selector=SELECTOR, since_s=SINCE_S, until=gate.end, step_s=1.0, headers=GOOD,
                       concurrency=3)  # fmt: skip
    assert [t.name for t in fleet.targets] == ["node03", "node05", "node11"]
    seen = gate.seen()
    assert len(seen) > 50 and all(ok for _, ok in seen), [p for p, ok in seen if not ok]


def test_the_commands_get_through_and_never_show_the_token(gate: Gate, tmp_path: Path) -> None:
    gate.reset()
    fleet = _diag("analyze", "--prometheus", gate.url, "--fleet", SELECTOR, "--since", _since(gate), "--json", *ARGS)
    assert fleet.returncode == 0, fleet.stderr[-2000:]
    rows = {t["target"]: t["verdict"] for t in json.loads(fleet.stdout)["targets"]}
    assert rows == {"node03": "queue_backlog", "node05": "healthy", "node11": "host_oom"}
    one = _diag("analyze", "--prometheus", gate.url, "--selector", f'{SELECTOR},host="node03"', "--since",
                _since(gate), *ARGS)  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    out = tmp_path / "preview.html"
    preview = _diag("dashboards", "preview", "--prometheus", gate.url, "--since", "1h", "--out", str(out), *ARGS)
    assert preview.returncode == 0, preview.stderr[-2000:]
    assert gate.seen() and all(ok for _, ok in gate.seen())
    refused = _diag("analyze", "--prometheus", gate.url, "--fleet", SELECTOR, "--header", "Authorization: Bearer "
                    + TOKEN[::-1], "--tenant", TENANT)  # fmt: skip
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr and "Traceback" not in refused.stderr
    for done in (fleet, one, preview, refused):
        assert TOKEN not in done.stdout + done.stderr and TOKEN[::-1] not in done.stdout + done.stderr
    assert TOKEN not in out.read_text()


def test_the_triage_worker_uses_them_and_keeps_them_out_of_its_record(gate: Gate, caplog: pytest.LogCaptureFixture
                                                                      ) -> None:  # fmt: skip
    """The receiver's analysis runs in a worker with the source's headers; what it stores holds no token."""
    source = Source("prometheus", gate.url, ("host",), tuple(request_headers([f"Authorization: Bearer {TOKEN}"],
                                                                             TENANT).items()))  # fmt: skip
    assert TOKEN not in repr(source) and TOKEN not in source.describe()
    caplog.set_level(logging.DEBUG)
    doc = run_analysis(source.kind, source.target, 'host="node03"', SINCE_S, gate.end, headers=dict(source.headers))
    assert "error" not in doc, doc
    assert doc["verdict"]["primary"] == "queue_backlog"
    denied = run_analysis(source.kind, source.target, 'host="node03"', SINCE_S, gate.end)
    assert "HTTP 401" in denied["error"]
    assert TOKEN not in json.dumps(doc) + json.dumps(denied) + caplog.text
