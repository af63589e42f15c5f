"""Fleet diagnosis on a real Prometheus: 20 machines backfilled from recorded runs, diagnosed in one pass.

Six machines carry a recorded incident (two each of queue backlog, memory leak and host OOM), fourteen are
healthy runs, one more holds only the last seconds of a healthy run. Their series are what a Prometheus
scraping each machine's agent and backend would hold (``tests/diag/fleet_series.py``), backfilled with promtool.
The fleet must name every sick machine's class, flag no healthy one, list the thin one as such, give each
target the Timeline the single-target path gives it, and issue as many queries for 20 targets as for 5
(counted at the wire, by a forwarding proxy on loopback).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest

from diag.cli.fleet import judge_fleet
from diag.sources.fleet import MIN_POINTS, Fleet, load_fleet
from diag.sources.prometheus import load_prometheus
from tests.diag.fleet_series import SCENARIO, SELECTOR, SICK, SINCE_S, THIN, recording, write_fleet
from tests.promserver import PromServer, prometheus, require_prometheus

pytestmark = [pytest.mark.process, pytest.mark.slow]


@dataclass
class Stack:
    prom: PromServer
    end: float


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_prometheus()
    healthy = recording("healthy")
    t1 = max(r["ts"] for r in healthy)
    thin = [r for r in healthy if r["ts"] >= t1 - 5]  # six seconds: fewer steps than the fleet table needs
    plan: list[tuple[str, Any]] = []
    for i in range(1, 21):
        name = f"node{i:02d}"
        plan.append((name, recording(SCENARIO[SICK[name]]) if name in SICK else healthy))
    plan.append((THIN, thin))
    end = float(int(time.time()) - 600)  # inside the TSDB's retention, clear of the head block
    om = write_fleet(plan, end, tmp_path_factory.mktemp("fleet") / "fleet.om")
    with prometheus([], backfill=[om]) as prom:
        yield Stack(prom, end)


def _fleet(stack: Stack, selector: str = SELECTOR, **kw: Any) -> Fleet:
    return load_fleet(stack.prom.url, selector=selector, since_s=SINCE_S, until=stack.end, step_s=1.0, **kw)


@pytest.fixture(scope="module")
def rows(stack: Stack) -> dict[str, dict[str, Any]]:
    fleet = _fleet(stack)
    return {r["target"]: r for r in judge_fleet(fleet.targets, 2, lambda _m: None)}


def test_every_sick_target_is_found_with_its_class(rows: dict[str, dict[str, Any]]) -> None:
    for name, cls in SICK.items():
        assert rows[name]["verdict"] == cls, (name, rows[name]["verdict"], rows[name]["evidence"])
        assert rows[name]["class"] == cls and rows[name]["confidence"] >= 0.5 and rows[name]["evidence"]


def test_no_healthy_target_is_flagged(rows: dict[str, dict[str, Any]]) -> None:
    healthy = [n for n in rows if n not in SICK and n != THIN]
    assert len(healthy) == 14
    assert {n: rows[n]["verdict"] for n in healthy} == dict.fromkeys(healthy, "healthy")


def test_a_thin_target_is_listed_as_such(rows: dict[str, dict[str, Any]]) -> None:
    row = rows[THIN]
    assert row["points"] < MIN_POINTS
    assert row["verdict"] == "too_little_data" and str(row["points"]) in row["evidence"]


def test_each_target_gets_the_single_target_timeline(stack: Stack) -> None:
    """The split feeds the single path's assembly: series for series, value for value, the same Timeline."""
    fleet = {t.name: t for t in _fleet(stack).targets}
    for name in ("node03", "node11", "node05"):
        mine = fleet[name].timeline()
        # The selector the target's Timeline names is valid PromQL selecting that machine alone.
        assert fleet[name].selector in mine.source
        alone = load_prometheus(stack.prom.url, selector=fleet[name].selector, since_s=SINCE_S, until=stack.end,
                                step_s=1.0)  # fmt: skip
        for part in ("host", "service"):
            assert set(getattr(mine, part)) == set(getattr(alone, part)), (name, part)
            for key, series in getattr(alone, part).items():
                np.testing.assert_array_equal(getattr(mine, part)[key].values, series.values, err_msg=f"{name} {key}")
        assert set(mine.cgroups) == set(alone.cgroups) and set(mine.processes) == set(alone.processes)
        assert len(mine.ooms) == len(alone.ooms)


def test_grouping_by_the_host_label_gives_the_same_targets(stack: Stack, rows: dict[str, dict[str, Any]]) -> None:
    fleet = _fleet(stack, by="host")
    by_host = {r["target"]: r["verdict"] for r in judge_fleet(fleet.targets, 1, lambda _m: None)}
    assert by_host == {name: row["verdict"] for name, row in rows.items()}


class _Counting(BaseHTTPRequestHandler):
    """Forwards every request to the real Prometheus and counts it: the queries as the server sees them."""

    upstream = ""
    count = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.lock:
            type(self).count += 1
        r = httpx.post(self.upstream + self.path, content=body, timeout=60, trust_env=False,
                       headers={"Content-Type": self.headers.get("Content-Type", "")})  # fmt: skip
        self.send_response(r.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def do_GET(self) -> None:  # the store's build info (which quantile path it gets), asked once: not a query
        r = httpx.get(self.upstream + self.path, timeout=60, trust_env=False)
        self.send_response(r.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def log_message(self, *_args: object) -> None:
        pass


def test_the_query_count_does_not_grow_with_the_targets(stack: Stack) -> None:
    _Counting.upstream = stack.prom.url
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        proxy = f"http://127.0.0.1:{server.server_address[1]}"
        counts = {}
        for label, selector in (("5", f'{SELECTOR},host=~"node0[1-5]"'), ("20", f'{SELECTOR},host=~"node[01][0-9]|node20"')):
            _Counting.count = 0
            fleet = load_fleet(proxy, selector=selector, since_s=SINCE_S, until=stack.end, step_s=1.0, concurrency=3)
            counts[label] = (_Counting.count, len(fleet.targets), fleet.queries)
        single_before = _Counting.count
        load_prometheus(proxy, selector=f'{SELECTOR},host="node01"', since_s=SINCE_S, until=stack.end, step_s=1.0)
        single = _Counting.count - single_before
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    (wire5, n5, own5), (wire20, n20, own20) = counts["5"], counts["20"]  # several queries in flight: counted alike
    assert (n5, n20) == (5, 20)
    assert wire5 == wire20 == own5 == own20, counts
    # One query set for the fleet, where a loop over targets would issue one set each.
    assert wire20 < 2 * single, (wire20, single)


def test_the_command_prints_a_ranked_table_and_json(stack: Stack) -> None:
    """The command line end to end (its window ends now: the last minutes hold no new samples)."""
    since = f"{int(time.time() - stack.end + SINCE_S)}s"
    args = [sys.executable, "-m", "diag.cli", "analyze", "--prometheus", stack.prom.url, "--fleet", SELECTOR,
            "--since", since]  # fmt: skip
    doc = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300, check=True).stdout)
    names = [t["target"] for t in doc["targets"]]
    assert len(names) == 21 and doc["by"] == "instance" and doc["queries"] > 0
    sick = [t for t in doc["targets"] if t["verdict"] not in ("healthy", "inconclusive", "too_little_data")]
    assert names[: len(sick)] == [t["target"] for t in sick]  # sick first ...
    confidences = [t["confidence"] for t in sick]
    assert confidences == sorted(confidences, reverse=True)  # ... by confidence
    text = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    assert "node03" in text.stdout and "verdict" in text.stdout
    assert "targets from" in text.stderr and "judged" in text.stderr  # progress on stderr, not in the table
