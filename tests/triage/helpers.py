"""Shared test helpers: webhook bodies, a receiver subprocess, and wire-level stand-ins for GitHub and Jira.

The trackers are the one thing here that is not real: GitHub and Jira cannot run on this machine,
so ``FakeTracker`` is a local HTTP server speaking exactly the documented endpoints the sinks use
(GitHub REST issues/comments, Jira REST v2 issue/search/comment/transitions) -- and counting what
it was asked, which is what the tests assert on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "external" / "alertmanager-0.25-webhook.json"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fingerprint(labels: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]


def alert(labels: dict[str, str], status: str = "firing", starts: float = 1_700_000_000.0, **annotations: str) -> dict[str, Any]:
    return {
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(starts),
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else rfc3339(starts + 60),
        "generatorURL": "http://127.0.0.1:9090/graph?g0.expr=up",
        "fingerprint": fingerprint(labels),
    }


def body(*alerts: dict[str, Any], group_key: str = '{}:{alertname="X"}') -> dict[str, Any]:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    common = dict(alerts[0]["labels"]) if alerts else {}
    return {
        "receiver": "triage",
        "status": status,
        "alerts": list(alerts),
        "groupLabels": {"alertname": common.get("alertname", "")},
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:9093",
        "version": "4",
        "groupKey": group_key,
        "truncatedAlerts": 0,
    }


class ReceiverProcess:
    """``diag triage serve`` as a real subprocess on a free port; stopped (or kill -9'd) by PID."""

    def __init__(
        self, db: Path | str, *args: str, env: dict[str, str] | None = None, port: int | None = None,
        log_dir: Path | None = None,
    ) -> None:  # fmt: skip
        """``db``: a SQLite file (the log goes beside it) or a postgresql:// URL (give ``log_dir``)."""
        self.db = db
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = (log_dir or Path(db).parent) / f"receiver-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ReceiverProcess:
        cmd = [sys.executable, "-m", "diag.cli", "triage", "serve", "--listen", f"127.0.0.1:{self.port}", "--db", str(self.db)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*cmd, *self.args], stdout=log, stderr=log, env=self.env, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"receiver exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                # 5 s a probe: a receiver restarted into a storm of retried deliveries answers slowly, not never
                if httpx.get(f"{self.url}/healthz", timeout=5.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"receiver did not come up within {timeout_s}s: {self.log.read_text()[-2000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def post(self, doc: Any, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}/webhook", json=doc, timeout=30.0, **kwargs)


@contextlib.contextmanager
def receiver(db: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[ReceiverProcess]:
    proc = ReceiverProcess(db, *args, env=env).start()
    try:
        yield proc
    finally:
        proc.stop()


class FakeTracker:
    """GitHub Issues + Jira REST v2 at the wire, in one local server: exactly the endpoints the sinks call.

    ``down = True`` answers every request 503 (a tracker outage). ``calls`` records (method, path).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.down = False
        self.calls: list[tuple[str, str]] = []
        self.gh_issues: dict[int, dict[str, Any]] = {}
        self.jira_issues: dict[str, dict[str, Any]] = {}
        self.auth: list[str] = []
        tracker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, doc: Any) -> None:
                raw = b"" if status == 204 else json.dumps(doc).encode()  # 204 No Content carries no body
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                data = json.loads(self.rfile.read(length) or b"null")
                with tracker.lock:
                    tracker.calls.append((self.command, self.path))
                    tracker.auth.append(self.headers.get("Authorization", ""))
                    if tracker.down:
                        self._reply(503, {"message": "down"})
                        return
                    status, doc = tracker.route(self.command, self.path, data)
                self._reply(status, doc)

            do_GET = do_POST = do_PATCH = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client killed mid-request (the kill -9 tests) is expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def route(self, method: str, path: str, data: Any) -> tuple[int, Any]:
        url = httpx.URL(path)
        p = url.path
        if m := re.fullmatch(r"/repos/([^/]+/[^/]+)/issues", p):
            if method == "GET":
                label = url.params.get("labels", "")
                return 200, [i for i in self.gh_issues.values() if label in i["labels"]]
            number = len(self.gh_issues) + 1
            issue = {"number": number, "html_url": f"https://github.test/{m.group(1)}/issues/{number}", "title": data["title"],
                     "body": data["body"], "labels": list(data.get("labels") or []), "state": "open", "comments": [],
                     "state_reason": None}  # fmt: skip
            self.gh_issues[number] = issue
            return 201, issue
        if m := re.fullmatch(r"/repos/[^/]+/[^/]+/issues/(\d+)/comments", p):
            self.gh_issues[int(m.group(1))]["comments"].append(data["body"])
            return 201, {"id": len(self.calls)}
        if m := re.fullmatch(r"/repos/[^/]+/[^/]+/issues/(\d+)", p):
            issue = self.gh_issues[int(m.group(1))]
            issue["state"] = data["state"]
            issue["state_reason"] = data.get("state_reason")
            return 200, issue
        if p == "/rest/api/2/search":
            label = re.search(r'labels = "([^"]+)"', data["jql"]).group(1)  # type: ignore[union-attr]
            found = [{"key": k} for k, i in self.jira_issues.items() if label in i["labels"]]
            return 200, {"issues": found[: data.get("maxResults", 50)], "total": len(found)}
        if p == "/rest/api/2/issue":
            key = f"{data['fields']['project']['key']}-{len(self.jira_issues) + 1}"
            self.jira_issues[key] = {**data["fields"], "status": "To Do", "comments": []}
            return 201, {"id": str(len(self.jira_issues)), "key": key, "self": f"{self.url}/rest/api/2/issue/{key}"}
        if m := re.fullmatch(r"/rest/api/2/issue/([A-Z]+-\d+)/comment", p):
            self.jira_issues[m.group(1)]["comments"].append(data["body"])
            return 201, {"id": str(len(self.calls))}
        if m := re.fullmatch(r"/rest/api/2/issue/([A-Z]+-\d+)/transitions", p):
            names = {"11": "To Do", "31": "Done"}
            if method == "GET":
                return 200, {"transitions": [{"id": k, "name": v} for k, v in names.items()]}
            self.jira_issues[m.group(1)]["status"] = names[data["transition"]["id"]]
            return 204, {}
        return 404, {"message": f"not found: {method} {p}"}

    def creates(self) -> int:
        with self.lock:
            return sum(
                1 for method, path in self.calls if method == "POST" and (path.endswith("/issues") or path == "/rest/api/2/issue")
            )


def recorder_from_fixture(name: str, path: Path) -> tuple[float, float]:
    """Write a scenario fixture's records into a flight recorder; (first ts, last ts)."""
    from collectors.recorder import FlightRecorder
    from diag.demo.scenarios.recording import read_jsonl_gz

    records = read_jsonl_gz(REPO / "tests" / "fixtures" / "scenarios" / f"{name}.jsonl.gz")
    recorder = FlightRecorder(path, retention_s=10**9)
    recorder.write_rows([(r["ts"], r["kind"], int(r.get("schema", 1)), json.dumps(r)) for r in records])
    recorder.close()
    ts = [r["ts"] for r in records]
    return min(ts), max(ts)
