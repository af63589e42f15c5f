"""Every signal a source fills, and every series a rule reads, is spelt as ``diag.timeline.signals`` spells it.

Why: a source that writes ``service:queue_dept`` or a rule that reads ``cgroups[g]["working_sets"]``
does not crash -- the rule just never sees the signal and is reported "not evaluated" (or finds
nothing) forever. These tests build Timelines through every source (the recorder, a bundle folder,
the Prometheus loader answering from a fake server), run every rule on them with the series dicts
watched, and fail on any name the registry does not hold.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from collectors import catalog as cat
from collectors.recorder import FlightRecorder
from diag.bundle.report import WHY_MISSING, why_missing
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.base import RULES
from diag.rules.engine import analyze, load_rules
from diag.sources import prometheus as prom_source
from diag.sources.bundle import load_bundle
from diag.sources.recorder import load_recorder
from diag.timeline import Timeline, signals, timeline_from_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPLAYS = sorted(FIXTURES.rglob("*.jsonl.gz"))
LOADER = Path(prom_source.__file__)


def _unknown(names: set[str]) -> list[str]:
    return sorted(n for n in names if not signals.fillable(n))


# --------------------------------------------------------------------------- the registry itself


def test_every_series_a_rule_may_ask_for_is_one_a_source_can_fill() -> None:
    assert _unknown(set(signals.SERIES)) == []


@pytest.mark.parametrize(
    "typo",
    [
        "service:queue_dept",
        "cgroup:working_sets",
        "host:psi.memory.som.avg10",
        "host:memory.",
        "host:memory.availble",
        "process:rs",
        "gpu:util",
    ],
)
def test_a_misspelt_signal_is_not_fillable(typo: str) -> None:
    assert not signals.fillable(typo)


# --------------------------------------------------------------------------- recorder and bundle


def _recorded_timelines(tmp_path: Path) -> Iterator[tuple[str, Timeline]]:
    for path in REPLAYS:
        yield path.name, timeline_from_records(read_jsonl_gz(path))
    records = read_jsonl_gz(FIXTURES / "scenarios" / "noisy-neighbour.jsonl.gz")
    with FlightRecorder(tmp_path / "r.db") as rec:
        rec.write_rows([(float(r["ts"]), r["kind"], int(r.get("schema", 1)), json.dumps(r)) for r in records])
    yield "recorder", load_recorder(tmp_path / "r.db")
    folder = tmp_path / "bundle" / "timeline"
    folder.mkdir(parents=True)
    for kind in {r["kind"] for r in records}:
        lines = (json.dumps(r) for r in records if r["kind"] == kind)
        (folder / f"{kind}.jsonl").write_text("\n".join(lines) + "\n")
    yield "bundle", load_bundle(tmp_path / "bundle")


def test_recorder_and_bundle_timelines_name_only_registry_signals(tmp_path: Path) -> None:
    seen: set[str] = set()
    for name, tl in _recorded_timelines(tmp_path):
        assert _unknown(tl.signals()) == [], name
        seen |= tl.signals()
    # The fixtures do reach every scope (an empty check would pass by itself).
    assert {"host:memory.available", "cgroup:working_set", "process:rss", "requests", "ooms"} <= seen


# --------------------------------------------------------------------------- the Prometheus loader


CATALOG_NAMES = {
    n
    for spec in vars(cat).values()
    for s in (spec.values() if isinstance(spec, dict) else (spec,))
    if isinstance(n := getattr(s, "name", None), str)
}
LABELS = {
    "instance": "10.0.0.5:9464", "cgroup": "/svc", "id": "/svc", "pid": "42", "comm": "python", "gpu": "0",
    "resource": "memory", "kind": "some", "event": "oom_kill", "model": "/m/w.safetensors", "constraint": "CONSTRAINT_MEMCG",
}  # fmt: skip
OUTCOMES = ("ok", "error", "rejected", "queue_timeout", "inference_timeout")


class FakePrometheus:
    """Answers every query as if each catalog family it names were exported (``only`` filters the families).

    ``{__name__=~"a|b"}`` gets one series per family, labelled with every label the loader reads;
    an expression over a family (rate, histogram_quantile, sum) gets one unnamed series, or one per
    outcome for ``sum by (outcome)``. Values rise, so counters increase and OOM kills are counted.
    """

    def __init__(self, only: Any) -> None:
        self.only = only

    def families(self, query: str) -> list[str]:
        names = set(re.findall(r'__name__=~"([^"]*)"', query))
        found = {n for group in names for n in group.split("|")}
        found |= set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", query))
        return sorted(n for n in found if _family(n) in CATALOG_NAMES and self.only(_family(n)))

    def call(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        query = params["query"]
        names = self.families(query)
        if path == "/api/v1/query":  # the scrape-interval probe: raw samples 15 s apart
            t = float(params["time"])
            return _matrix([{"__name__": n, **LABELS} for n in names], [t - 30, t - 15, t])
        start, end, step = float(params["start"]), float(params["end"]), float(params["step"])
        ts = list(np.arange(start, end + step / 2, step))
        if not names:
            return _matrix([], ts)
        if query.startswith("{"):
            return _matrix([{"__name__": n, **LABELS} for n in names], ts)
        if "sum by (outcome)" in query:
            return _matrix([{"outcome": o} for o in OUTCOMES], ts)
        return _matrix([dict(LABELS)], ts)


def _family(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def _matrix(labels: list[dict[str, str]], ts: list[float]) -> dict[str, Any]:
    return {
        "resultType": "matrix",
        "result": [{"metric": m, "values": [[t, str(i + 1.0)] for i, t in enumerate(ts)]} for m in labels],
    }


def _load(monkeypatch: pytest.MonkeyPatch, only: Any) -> Timeline:
    fake = FakePrometheus(only)
    monkeypatch.setattr(prom_source._Prometheus, "_call", lambda self, path, params: fake.call(path, params))
    return prom_source.load_prometheus("http://127.0.0.1:9", since_s=600, until=1_800_000_000.0)


OURS = "llmdiag_"
# What each load must have filled: proof that the fake reached the loader's every scope and fallback.
EXPECTED = {
    "ours": {
        "host:memory.available", "host:psi.memory.some.avg10", "host:vmstat.pgmajfault", "cgroup:working_set",
        "cgroup:psi.memory.full.avg10", "cgroup:events.oom_kill", "cgroup:stat.anon", "process:rss", "gpu:util_memory",
        "gpu:reserved", "gpu_processes", "ooms", "service:queue_wait_p50_s", "service:inference_mean_s",
        "service:timeout_rps", "service:queue_depth", "service:active_inferences",
    },
    "external": {
        "host:memory.available", "host:psi.memory.some.avg10", "cgroup:limit", "cgroup:psi.memory.some.avg10",
        "gpu:used", "ooms", "service:queue_wait_p95_s", "service:throughput_rps", "service:queue_depth",
    },
}  # fmt: skip


@pytest.mark.parametrize("families", ["ours", "external"])
def test_the_prometheus_loader_fills_only_registry_signals(monkeypatch: pytest.MonkeyPatch, families: str) -> None:
    tl = _load(monkeypatch, (lambda n: n.startswith(OURS)) if families == "ours" else (lambda n: not n.startswith(OURS)))
    present = tl.signals()
    assert EXPECTED[families] <= present, sorted(EXPECTED[families] - present)
    assert _unknown(present) == []
    assert _unknown({f"service:{k}" for k in tl.service}) == []  # also the model holders (service:model_processes:<m>)


def test_the_loaders_catalog_maps_cover_the_catalog() -> None:
    assert set(prom_source._CADVISOR_KEYS) == set(cat.CADVISOR_MEMORY)
    assert set(prom_source._GPU_MEMORY_KEYS) == set(cat.GPU_MEMORY)
    assert _unknown({f"cgroup:{v}" for v in prom_source._CADVISOR_KEYS.values()}) == []
    assert _unknown({f"gpu:{v}" for v in [*prom_source._GPU_MEMORY_KEYS.values(), *prom_source._GPU_UTIL_KEYS.values()]}) == []
    assert _unknown({f"service:{v}" for v in prom_source._OUTCOME_RATES.values()}) == []


def _spelt_signals(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals in the loader that spell a signal key themselves instead of naming a ``diag.timeline.signals`` constant.

    Allowed: catalog keys (``cat.X["total"]``) and the keys of the loader's catalog->signal maps, which are
    the catalog's words, not the Timeline's.
    """
    allowed: set[int] = set()
    for node in ast.walk(tree):
        catalog_entry = isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
        if catalog_entry and isinstance(node.value.value, ast.Name) and node.value.value.id == "cat":
            allowed.add(id(node.slice))
        if isinstance(node, ast.Dict):
            allowed.update(id(k) for k in node.keys if k is not None)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # docstrings
            allowed.add(id(node.value))
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and str(head.value).startswith(("psi.", "memory.", "vmstat.", "stat.", "events")):
                bad.append((node.lineno, str(head.value)))
    for node in ast.walk(tree):
        spelt = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed
        if spelt and any(node.value in keys for keys in signals.FILLED.values()):
            bad.append((node.lineno, node.value))
    return bad


def test_the_prometheus_loader_spells_no_signal_itself() -> None:
    assert _spelt_signals(ast.parse(LOADER.read_text())) == []


def test_a_spelt_signal_in_the_loader_is_caught() -> None:
    source = LOADER.read_text()
    for constant, literal in (
        ("got[sig.latency(feed.signal, stat)]", 'got["queue_wait_p50_s"]'),
        ("sig.psi(r, kind, sig.PSI_AVG10)", 'f"psi.{r}.{kind}.avg10"'),
    ):
        assert constant in source
        source = source.replace(constant, literal)
    assert {value for _, value in _spelt_signals(ast.parse(source))} == {"queue_wait_p50_s", "psi."}


# --------------------------------------------------------------------------- what the rules read


class _Watched(dict):  # type: ignore[type-arg]
    """A series dict that remembers every key a rule asked it for (present or not)."""

    def __init__(self, data: dict[str, Any], scope: str, asked: set[str]) -> None:
        super().__init__(data)
        self.scope, self.asked = scope, asked

    def __getitem__(self, key: str) -> Any:
        self.asked.add(self.scope + key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(self.scope + key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.asked.add(self.scope + str(key))
        return super().__contains__(key)


def _watch(tl: Timeline, asked: set[str]) -> Timeline:
    tl.host = _Watched(tl.host, "host:", asked)
    tl.cgroups = {path: _Watched(series, "cgroup:", asked) for path, series in tl.cgroups.items()}
    for track in tl.processes.values():
        track.series = _Watched(track.series, "process:", asked)
    tl.gpus = {i: _Watched(series, "gpu:", asked) for i, series in tl.gpus.items()}
    tl.service = _Watched(tl.service, "service:", asked)
    return tl


def test_every_series_a_rule_reads_is_in_the_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: set[str] = set()
    for _, tl in _recorded_timelines(tmp_path):
        analyze(_watch(tl, asked))
    for families in ("ours", "external"):
        only = (lambda n: n.startswith(OURS)) if families == "ours" else (lambda n: not n.startswith(OURS))
        analyze(_watch(_load(monkeypatch, only), asked))
    assert _unknown(asked) == []
    # The watch does see the rules' reads, on every scope (an empty set would pass by itself).
    assert {"host:memory.available", "cgroup:working_set", "process:rss", "service:queue_depth"} <= asked


def test_the_reports_why_missing_words_name_registry_signals() -> None:
    scopes = tuple(signals.FILLED)
    for prefix, _ in WHY_MISSING:
        assert prefix.startswith(scopes) or any(t.startswith(prefix) for t in signals.TABLES), prefix
    load_rules()
    for r in RULES.values():
        for name in (*r.needs, *r.needs_any):
            assert why_missing(name) != "signal not present in the records", (r.id, name)
