"""The fleet and single-target diagnosis on a real VictoriaMetrics give what they give on a real Prometheus.

The same 21 machines as ``test_fleet_prometheus`` (six recorded incidents, fourteen healthy runs, one thin),
backfilled into Prometheus with promtool and sent to VictoriaMetrics by remote write, as Prometheus would
forward them to a long-term store. VictoriaMetrics answers the same queries with its own ``rate`` (no
extrapolation) and its own lookback, so the request-side numbers differ a little; what must not differ is
the diagnosis: the same targets, verdicts and classes, the same host series and process tracks (a killed
worker ends where Prometheus ends it: its staleness marker travels by remote write). Past its query limits
(``-search.max*``) the command says which limit and what to change, in one line; a reply marked partial (a
cluster with a storage node down, which a single node cannot produce: added to a real reply at the wire)
is refused rather than diagnosed.
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
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from diag.cli.fleet import judge_fleet
from diag.rules.engine import analyze
from diag.sources.fleet import _LazyPrometheus, load_fleet, runs_prometheus_engine
from diag.sources.prometheus import load_prometheus
from tests.diag.fleet_series import SCENARIO, SELECTOR, SICK, SINCE_S, THIN, recording, write_fleet
from tests.promserver import PromServer, prometheus, require_prometheus
from tests.vmserver import VmServer, require_victoria_metrics, victoria_metrics

pytestmark = [pytest.mark.process, pytest.mark.slow]


@dataclass
class Stores:
    prom: PromServer
    vm: VmServer
    end: float
    series: Path  # the fleet's OpenMetrics, for stores started by a test


def _plan() -> list[tuple[str, Any]]:
    healthy = recording("healthy")
    t1 = max(r["ts"] for r in healthy)
    plan: list[tuple[str, Any]] = []
    for i in range(1, 21):
        name = f"node{i:02d}"
        plan.append((name, recording(SCENARIO[SICK[name]]) if name in SICK else healthy))
    plan.append((THIN, [r for r in healthy if r["ts"] >= t1 - 5]))  # fewer steps than the fleet table needs
    return plan


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    require_prometheus()
    require_victoria_metrics()
    end = float(int(time.time()) - 600)  # inside both stores' retention, clear of Prometheus' head block
    om = write_fleet(_plan(), end, tmp_path_factory.mktemp("fleet") / "fleet.om")
    with prometheus([], backfill=[om]) as prom, victoria_metrics() as vm:
        assert vm.remote_write(om) > 100_000
        yield Stores(prom, vm, end, om)


def _rows(url: str, end: float, **kw: Any) -> dict[str, dict[str, Any]]:
    fleet = load_fleet(url, selector=SELECTOR, since_s=SINCE_S, until=end, step_s=1.0, **kw)
    return {r["target"]: r for r in judge_fleet(fleet.targets, 2, lambda _m: None)}


def _essentials(rows: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    return {name: (r["verdict"], r["class"], r["points"]) for name, r in rows.items()}


def test_the_fleet_table_is_the_same_on_victoria_metrics(stores: Stores) -> None:
    on_prom, on_vm = _rows(stores.prom.url, stores.end), _rows(stores.vm.url, stores.end)
    assert _essentials(on_vm) == _essentials(on_prom)
    # ... and it is the right table, not the same mistake twice.
    assert {n: on_vm[n]["class"] for n in SICK} == SICK
    assert on_vm[THIN]["verdict"] == "too_little_data"
    assert [n for n, r in on_vm.items() if r["verdict"] == "healthy"] == [n for n in on_vm if n not in SICK and n != THIN]
    for name in SICK:
        assert on_vm[name]["confidence"] == pytest.approx(on_prom[name]["confidence"], abs=0.1), name


@pytest.mark.parametrize("name", ["node03", "node11", "node05"])
def test_one_target_gets_the_same_verdict_and_series(stores: Stores, name: str) -> None:
    """The single-target path with its own step (measured from the raw samples, as the command does)."""
    selector = f'{SELECTOR},host="{name}"'
    on_prom = load_prometheus(stores.prom.url, selector=selector, since_s=SINCE_S, until=stores.end)
    on_vm = load_prometheus(stores.vm.url, selector=selector, since_s=SINCE_S, until=stores.end)
    verdicts = [analyze(t).to_dict()["verdict"]["primary"] for t in (on_prom, on_vm)]
    assert verdicts[0] == verdicts[1] == SICK.get(name, "healthy")
    assert set(on_vm.host) == set(on_prom.host) and set(on_vm.service) == set(on_prom.service)
    for key, series in on_prom.host.items():  # as stored, to the last digits VictoriaMetrics' decimal storage keeps
        np.testing.assert_array_equal(on_vm.host[key].ts, series.ts, err_msg=key)
        np.testing.assert_allclose(on_vm.host[key].values, series.values, rtol=1e-9, err_msg=key)
    assert set(on_vm.processes) == set(on_prom.processes) and set(on_vm.cgroups) == set(on_prom.cgroups)
    for key, track in on_prom.processes.items():  # an exited worker ends at the same step (its staleness marker)
        assert {n: len(s) for n, s in on_vm.processes[key].series.items()} == {
            n: len(s) for n, s in track.series.items()}, key  # fmt: skip
    assert len(on_vm.ooms) == len(on_prom.ooms)


def test_prometheus_sends_the_buckets_and_victoria_metrics_its_own_quantiles(stores: Stores) -> None:
    """Which stores the fleet asks for bucket rates (quantiles made here) is told by their build info: Prometheus
    gives its version, VictoriaMetrics an empty document -- the table above is the same either way."""
    clients = [_LazyPrometheus(s.url, "", 10.0) for s in (stores.prom, stores.vm)]
    try:
        assert [runs_prometheus_engine(c) for c in clients] == [True, False]
    finally:
        for c in clients:
            c.close()


def test_the_command_prints_the_same_table_from_victoria_metrics(stores: Stores) -> None:
    since = f"{int(time.time() - stores.end + SINCE_S)}s"
    args = [sys.executable, "-m", "diag.cli", "analyze", "--prometheus", stores.vm.url, "--fleet", SELECTOR,
            "--since", since, "--json"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    got = {t["target"]: (t["verdict"], t["class"]) for t in doc["targets"]}
    want = {n: (r["verdict"], r["class"]) for n, r in _rows(stores.prom.url, stores.end).items()}
    assert got == want and len(got) == 21


def _refusal(vm: VmServer, args: list[str]) -> str:
    """The command's one line when the store refuses (exit status 2, no traceback)."""
    done = subprocess.run([sys.executable, "-m", "diag.cli", "analyze", "--prometheus", vm.url, *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("diag analyze --fleet:")]  # progress
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_range_over_the_points_limit_says_how_long_a_window_fits(stores: Stores) -> None:
    with victoria_metrics(["-search.maxPointsPerTimeseries=40"]) as vm:
        vm.remote_write(stores.series)
        since = f"{int(time.time() - stores.end + SINCE_S)}s"  # about 680 points at the measured 1 s step
        for extra in (["--fleet", SELECTOR], ["--selector", f'{SELECTOR},host="node03"']):
            line = _refusal(vm, [*extra, "--since", since])
            assert "-search.maxPointsPerTimeseries=40" in line and "shorten --since (at most 39s" in line, line
            assert len(line) < 300, line  # not the store's 2 kB error with the whole query in it
        # The advice holds: a window that fits is answered, and the verdict is the one Prometheus gives.
        timeline = load_prometheus(vm.url, selector=f'{SELECTOR},host="node03"', since_s=39, until=stores.end,
                                   step_s=1.0)  # fmt: skip
        assert timeline.service


def test_too_many_series_names_the_limit_and_says_to_narrow(stores: Stores) -> None:
    with victoria_metrics(["-search.maxUniqueTimeseries=100"]) as vm:
        vm.remote_write(stores.series)
        since = f"{int(time.time() - stores.end + SINCE_S)}s"
        line = _refusal(vm, ["--fleet", SELECTOR, "--since", since])
        assert "-search.maxUniqueTimeseries=100" in line and "narrow the matchers" in line, line
        # One machine's series are under the limit: the narrower selector the message asks for is answered.
        narrow = load_prometheus(vm.url, selector=f'{SELECTOR},host="node11"', since_s=SINCE_S, until=stores.end)
        assert analyze(narrow).to_dict()["verdict"]["primary"] == "host_oom"


class _Partial(BaseHTTPRequestHandler):
    """Forwards to the real store and marks each successful reply ``isPartial``, as a VictoriaMetrics cluster
    does when a storage node did not answer (the one thing a single node cannot be made to do)."""

    upstream = ""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        r = httpx.post(self.upstream + self.path, content=body, timeout=60, trust_env=False,
                       headers={"Content-Type": self.headers.get("Content-Type", "")})  # fmt: skip
        doc = r.json()
        if doc.get("status") == "success":
            doc["isPartial"] = True
        out = json.dumps(doc).encode()
        self.send_response(r.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_args: object) -> None:
        pass


def test_a_partial_reply_is_refused_not_diagnosed(stores: Stores) -> None:
    _Partial.upstream = stores.vm.url
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Partial)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ValueError, match="partial data"):
            load_prometheus(url, selector=f'{SELECTOR},host="node03"', since_s=SINCE_S, until=stores.end)
        with pytest.raises(ValueError, match="partial data"):  # the fleet's own decoder reads the flag too
            load_fleet(url, selector=SELECTOR, since_s=SINCE_S, until=stores.end, step_s=1.0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
