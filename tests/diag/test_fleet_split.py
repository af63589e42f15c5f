"""How the fleet's results are split per target: by the label's value (an instance by its host part), ours
before an exporter's fallback per target, series without the label counted and left out. Pure data, no server."""

from __future__ import annotations

import numpy as np

from diag.sources.fleet import _split, _target_selector
from diag.sources.prometheus import _Loaded, _Result
from diag.timeline import Series


def _res(**labels: str) -> _Result:
    return _Result(dict(labels), np.arange(3.0), np.ones(3))


def test_an_instance_is_its_host_so_agent_and_engine_are_one_target() -> None:
    loaded = _Loaded()
    loaded.host.append((_res(__name__="m", instance="10.0.0.5:9464"), "memory.total", 1.0))
    loaded.processes.append((_res(__name__="p", instance="10.0.0.5:8000", pid="7"), "rss"))
    loaded.host.append((_res(__name__="m", instance="[::1]:9464"), "memory.total", 1.0))
    shares, unlabelled = _split(loaded, _Loaded(), {}, "instance")
    assert sorted(shares) == ["10.0.0.5", "[::1]"] and unlabelled == 0
    assert len(shares["10.0.0.5"].host) == 1 and len(shares["10.0.0.5"].processes) == 1


def test_a_fallback_family_only_where_the_target_lacks_ours() -> None:
    loaded, fallback = _Loaded(), _Loaded()
    loaded.cgroups.append((_res(host="a", cgroup="/svc"), "/svc", "usage", 1.0))
    fallback.cgroups.append((_res(host="a", id="/svc"), "/svc", "usage", 1.0))
    fallback.cgroups.append((_res(host="b", id="/svc"), "/svc", "usage", 1.0))
    fallback.ooms.append((_res(host="b"), None))
    shares, _ = _split(loaded, fallback, {}, "host")
    assert [e[0].labels.get("cgroup") for e in shares["a"].cgroups] == ["/svc"]  # ours, not cAdvisor's
    assert [e[0].labels.get("id") for e in shares["b"].cgroups] == ["/svc"] and len(shares["b"].ooms) == 1


def test_series_without_the_label_are_counted_and_the_request_side_joins_its_target() -> None:
    loaded = _Loaded()
    loaded.host.append((_res(host="a"), "memory.total", 1.0))
    loaded.host.append((_res(instance="x:1"), "memory.total", 1.0))
    two = Series(np.arange(2.0), np.ones(2))
    service = {"a": {"requests_rps": two}, "c": {"queue_depth": two}}
    shares, unlabelled = _split(loaded, _Loaded(), service, "host")
    assert unlabelled == 1
    assert set(shares) == {"a", "c"}  # a target with only a request side is still a target
    assert set(shares["a"].service) == {"requests_rps"}


def test_the_target_selector_is_a_quoted_promql_matcher() -> None:
    assert _target_selector('job="llm"', "instance", "10.0.0.5") == 'job="llm",instance=~"10\\\\.0\\\\.0\\\\.5(:[0-9]+)?"'
    assert _target_selector("", "host", 'we"ird') == 'host="we\\"ird"'
