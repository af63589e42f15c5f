"""The gate's spec is validated in full before any load, each error naming the field; lengths, arrivals and the
criteria's judgement are pure functions checked here without a process."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest
import yaml

from diag.gate.criteria import HostFacts, judge, quantile, recovery_time
from diag.gate.load import Result, StepLoad, arrivals, request_body
from diag.gate.spec import Recovery, SpecError, load_spec, parse_spec
from tests.paths import REPO

EXAMPLE = REPO / "docs" / "gate-example.yaml"
GOOD = {
    "endpoint": "/v1/completions",
    "steps": [{"name": "a", "rate": 2, "duration": "5s", "prompt_tokens": 8, "output_tokens": 4}],
}


def _with(path: str, value: object) -> dict:
    """GOOD with one field replaced (``steps.0.rate`` style path); ``...`` deletes it."""
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if value is ...:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return doc


def test_the_shipped_example_parses_as_written() -> None:
    spec = load_spec(EXAMPLE)
    assert [s.name for s in spec.steps] == ["idle", "normal", "peak", "concurrent", "recovery"]
    peak = spec.steps[2]
    assert peak.rate == 8 and peak.duration_s == 12 and peak.concurrency is None
    assert peak.criteria.names() == ["e2e_p99_s", "error_ratio", "oom_kills", "psi_memory_some_avg10", "drain_s"]
    assert spec.steps[3].concurrency == 2 and spec.steps[3].rate is None
    assert spec.steps[4].criteria.recovery == Recovery(within_s=4, e2e_below_s=1)
    assert spec.request_timeout_s == 20 and spec.seed == 7


@pytest.mark.parametrize(
    ("path", "value", "named", "says"),
    [
        ("endpoint", "/v1/embeddings", "endpoint", "/v1/chat/completions"),
        ("steps", [], "steps", "at least one step"),
        ("steps.0.rate", -1, "steps[0].rate", "more than 0"),
        ("steps.0.rate", "fast", "steps[0].rate", "number"),
        ("steps.0.concurrency", 4, "steps[0]", "exactly one of rate"),
        ("steps.0.duration", "soon", "steps[0].duration", "duration"),
        ("steps.0.duration", ..., "steps[0].duration", "missing"),
        ("steps.0.prompt_tokens", 0, "steps[0].prompt_tokens", "at least 1"),
        ("steps.0.prompt_tokens", {"uniform": [9, 3]}, "steps[0].prompt_tokens.uniform[1]", "at least 9"),
        ("steps.0.prompt_tokens", {"zipf": 2}, "steps[0].prompt_tokens.zipf", "unknown distribution"),
        ("steps.0.output_tokens", {"normal": {"mean": 5}}, "steps[0].output_tokens.normal", "stddev"),
        ("steps.0.criteria", {"e2e_p99_s": "quick"}, "steps[0].criteria.e2e_p99_s", "duration"),
        ("steps.0.criteria", {"latency": 1}, "steps[0].criteria.latency", "unknown criterion"),
        ("steps.0.criteria", {"error_ratio": 2}, "steps[0].criteria.error_ratio", "at most 1"),
        ("steps.0.criteria", {"ttft_p50_s": 1}, "steps[0].criteria.ttft_p50_s", "stream: true"),
        ("steps.0.criteria", {"recovery": {"within_s": 3}}, "steps[0].criteria.recovery", "e2e_below_s"),
        ("steps.0.colour", "red", "steps[0].colour", "unknown key"),
        ("steps.0.name", "has space", "steps[0].name", "short name"),
        ("request_timeout", 0, "request_timeout", "more than 0"),
        ("stream", "yes", "stream", "true or false"),
    ],
)
def test_each_bad_field_is_named_with_what_is_accepted(path: str, value: object, named: str, says: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_with(path, value))
    assert str(err.value).startswith(f"{named}:") or str(err.value).startswith(f"{named}."), str(err.value)
    assert says in str(err.value)


def test_duplicate_step_names_and_files_that_are_not_specs(tmp_path: Path) -> None:
    doc = _with("steps", [GOOD["steps"][0], GOOD["steps"][0]])
    with pytest.raises(SpecError, match=r"steps\[1\]\.name: 'a' is used by an earlier step"):
        parse_spec(doc)
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [\n  - name: a\n")
    with pytest.raises(SpecError, match=r"not valid YAML at line \d+"):
        load_spec(bad)
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(tmp_path / "absent.yaml")
    bad.write_text("- just a list\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(bad)


def test_defaults_fill_steps_and_a_step_overrides_them() -> None:
    doc = {
        "defaults": {"prompt_tokens": 8, "output_tokens": 2, "stream": True, "criteria": {"error_ratio": 0.1, "ttft_p50_s": 1}},
        "steps": [{"rate": 1, "duration": 2}, {"name": "b", "rate": 1, "duration": 2, "criteria": {"error_ratio": 0.5}}],
    }
    spec = parse_spec(doc)
    first, second = spec.steps
    assert first.name == "step1" and first.stream and first.criteria.error_ratio == 0.1
    assert second.criteria.error_ratio == 0.5 and [q.key for q in second.criteria.quantiles] == ["ttft_p50_s"]


def test_lengths_stay_in_their_distribution() -> None:
    doc = _with("steps.0.prompt_tokens", {"uniform": [10, 20]})
    doc["steps"][0]["output_tokens"] = {"normal": {"mean": 50, "stddev": 10}}
    spec = parse_spec(doc)
    rng = random.Random(1)
    prompts = [spec.steps[0].prompt_tokens.draw(rng) for _ in range(2000)]
    outs = [spec.steps[0].output_tokens.draw(rng) for _ in range(2000)]
    assert min(prompts) == 10 and max(prompts) == 20
    assert 48 < statistics.mean(outs) < 52 and 8 < statistics.stdev(outs) < 12
    body = request_body(spec, spec.steps[0], rng)
    assert 10 <= len(body["prompt"].split()) <= 20 and body["stream"] is False
    chat = parse_spec({**doc, "endpoint": "/v1/chat/completions", "model": "m"})
    body = request_body(chat, chat.steps[0], rng)
    assert body["messages"][0]["role"] == "user" and body["model"] == "m" and "prompt" not in body


def test_arrivals_are_poisson_at_the_rate() -> None:
    """Exponential gaps: the count over a long window is near rate x duration and the gaps' CV is near 1."""
    at = arrivals(50.0, 200.0, random.Random(3))
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert abs(len(at) - 10_000) < 4 * 100  # Poisson: sd = sqrt(10 000)
    assert 0.95 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.05
    assert all(0 <= t < 200 for t in at) and at == sorted(at)


def _load(results: list[Result], *, load_end: float = 10.0, end: float = 11.0, dropped: int = 0) -> StepLoad:
    spec = parse_spec(GOOD)
    return StepLoad(spec.steps[0], t0=0.0, wall0=1000.0, results=results, dropped=dropped, load_end=load_end, end=end)


def _res(at: float, e2e: float, status: int = 200, error: str | None = None) -> Result:
    return Result(scheduled=at, sent=at, done=at + e2e, status=status, error=error)


def test_criteria_judge_what_was_measured() -> None:
    spec = parse_spec(
        _with(
            "steps.0.criteria",
            {"e2e_p50_s": 0.5, "e2e_p99_s": 1, "error_ratio": 0.05, "drain_s": 2, "oom_kills": 0, "psi_memory_some_avg10": 10},
        )
    )
    results = [_res(i * 0.1, 0.2) for i in range(95)] + [_res(9.5 + i * 0.1, 3.0) for i in range(3)]
    results += [_res(9.9, 0.01, status=429, error="HTTP 429"), _res(9.95, 20, error="timeout")]
    host = HostFacts(psi_some_avg10_max=12.5, psi_scope="host", oom_kills=1, oom_detail="python (pid 7) in /svc")
    got = {v.criterion: v for v in judge(_load(results), spec.steps[0].criteria, host)}
    assert got["e2e_p50_s"].passed and got["e2e_p50_s"].value == pytest.approx(0.2)
    assert not got["e2e_p99_s"].passed and got["e2e_p99_s"].value == pytest.approx(quantile([0.2] * 95 + [3.0] * 3, 0.99))
    assert got["error_ratio"].passed and got["error_ratio"].value == pytest.approx(2 / 100)
    assert "1 HTTP 429" in got["error_ratio"].note and "1 timeout" in got["error_ratio"].note
    assert got["drain_s"].passed and got["drain_s"].value == pytest.approx(1.0)
    assert not got["oom_kills"].passed and "pid 7" in got["oom_kills"].note
    assert not got["psi_memory_some_avg10"].passed and got["psi_memory_some_avg10"].measured == "12.5 %"
    unknown = {
        v.criterion: v
        for v in judge(_load(results), spec.steps[0].criteria, HostFacts(None, "host", None, oom_unreadable_why="no kmsg"))
    }
    assert not unknown["oom_kills"].passed and unknown["oom_kills"].note == "no kmsg"  # no evidence is no pass
    assert not unknown["psi_memory_some_avg10"].passed
    nothing = {v.criterion: v for v in judge(_load([_res(1, 1, 503, "HTTP 503")], dropped=3), spec.steps[0].criteria, host)}
    assert nothing["e2e_p99_s"].measured == "no data" and not nothing["e2e_p99_s"].passed
    assert nothing["error_ratio"].value == 1.0 and "3 dropped at max_in_flight" in nothing["error_ratio"].note


def test_recovery_is_the_first_arrival_after_which_every_request_is_fast() -> None:
    slow_then_fast = (
        [_res(t, 3.0) for t in (0.5, 1.0, 2.0)] + [_res(2.5, 0.1), _res(3.0, 2.0)] + [_res(t, 0.1) for t in (3.5, 4, 5)]
    )
    assert recovery_time(_load(slow_then_fast), Recovery(within_s=5, e2e_below_s=1)) == pytest.approx(3.5)
    assert recovery_time(_load([_res(1, 0.1), _res(2, 5.0)]), Recovery(5, 1)) is None  # slow at the end: never recovered
    assert recovery_time(_load([_res(1, 0.1), _res(2, 0.1, 500, "HTTP 500")]), Recovery(5, 1)) is None
