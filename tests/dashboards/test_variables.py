"""The dashboards' ``model`` variable is filled from whichever family is present, in a real Prometheus.

A vLLM-only host labels its series ``model_name``, not ``model``: a variable read from our families only
offered just "All" there. Here a real Prometheus scrapes nothing but a vLLM /metrics at the wire
(tests/vllm_wire.py) in a plain job -- no relabelling, as a Prometheus configured without the shipped
scrape config would -- and each dashboard's variable query, evaluated and cut by its regex as Grafana
does for ``query_result()``, must offer the served model.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from dashboards.build import render
from dashboards.definitions import all_dashboards
from tests.promserver import PromServer, ScrapeJob, prometheus, require_prometheus
from tests.vllm_wire import VllmMetrics, serve

pytestmark = pytest.mark.process

ALL = ".+"  # what Grafana substitutes for an "All" multi-value variable


def variable(board: dict[str, Any], name: str) -> dict[str, Any]:
    (var,) = [v for v in board["templating"]["list"] if v["name"] == name]
    return var


def values(prom: PromServer, var: dict[str, Any]) -> set[str]:
    """The options Grafana would offer: ``query_result(EXPR)`` evaluated, each result line cut by the regex."""
    query = re.sub(r"\$\{?(job|instance|slo)\}?", ALL, var["query"])
    m = re.fullmatch(r"query_result\((.+)\)", query)
    assert m is not None, query
    regex = re.compile(var["regex"].strip("/"))
    out = set()
    for sample in prom.query(m.group(1)):
        labels = ", ".join(f'{k}="{v}"' for k, v in sorted(sample["metric"].items()))
        line = f"{{{labels}}} {sample['value'][1]} {sample['value'][0]}"  # Grafana's text of one result
        found = regex.search(line)
        if found:
            out.add(found.group(1))
    return out


@pytest.fixture(scope="module")
def vllm_only() -> Any:
    require_prometheus()
    model = VllmMetrics("meta-llama/Llama-3.1-8B-Instruct")
    with serve(model) as port, prometheus([ScrapeJob("vllm", [f"127.0.0.1:{port}"])]) as prom:
        assert prom.wait_for('vllm:num_requests_running{job="vllm"}', bool, 40), prom.log_tail()
        yield prom


def test_a_vllm_only_host_offers_its_model(vllm_only: PromServer) -> None:
    boards = [render(d) for d in all_dashboards() if d.uid not in ("llmdiag-slo", "llmdiag-fleet")]  # fleet: no model
    assert len(boards) == 6
    for board in boards:
        assert values(vllm_only, variable(board, "model")) == {"meta-llama/Llama-3.1-8B-Instruct"}, board["uid"]


def test_the_check_sees_the_old_variable_offer_nothing(vllm_only: PromServer) -> None:
    """The variable as it was (our request counter only) finds no model on the same server."""
    old = {"query": 'query_result(count by (model) (llmdiag_requests_total{job=~"$job", instance=~"$instance"}))',
           "regex": '/model="([^"]+)"/'}  # fmt: skip
    assert values(vllm_only, old) == set()
