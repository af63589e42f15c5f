"""The precedence table (``diag/rules/precedence.py``): each entry by name, the two kinds of step, and the engine applying it.

Each entry of ``PRECEDENCE`` has a test below that uses the real table: remove the entry and its test
fails. ``ENTRY_TESTS`` names them, and a guard fails when the table gains an entry without one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.base import RULES, Finding
from diag.rules.engine import analyze, load_rules
from diag.rules.memory import memory_pressure
from diag.rules.precedence import PRECEDENCE, Ceiling, JustUnder, Precedence, apply_precedence
from diag.timeline import Timeline, timeline_from_records

SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
STALL_NOTE = "sustained full stalls with page-ins (refaults, faults or swap): see the thrashing finding"
OOM_NOTE = "the kernel OOM-killed in this window: see the OOM finding (pressure is how it got there)"
CLASS_OF = {
    "memory.pressure": "memory_pressure",
    "stalls.thrashing": "thrashing",
    "oom.host": "host_oom",
    "requests.queue_backlog": "queue_backlog",
    "aggregated.queue_vs_thrash": "queue_backlog",
    "aggregated.queue_from_gauges": "queue_backlog",
    "kv_cache.saturation": "kv_cache_saturation",
    "oom.gpu": "gpu_oom",
    "placement.noisy_neighbour": "noisy_neighbour",
    "config.unsafe": "unsafe_config",
}
KV_NOTE = "the KV cache is full and the engine preempts: the wait is for KV blocks, see the KV-cache finding"


def _findings(**confidence: float) -> dict[str, Finding]:
    """Findings by rule id (``memory_pressure=0.9`` is rule ``memory.pressure``), each with a plain summary."""
    out = {}
    for key, conf in confidence.items():
        rule_id = key.replace("_", ".", 1)
        out[rule_id] = Finding(CLASS_OF[rule_id], rule_id, conf, f"{rule_id} summary")
    return out


def _fixture(path: str, kinds: tuple[str, ...] | None = None) -> Timeline:
    records = read_jsonl_gz(SCENARIOS / path)
    return timeline_from_records([r for r in records if kinds is None or r["kind"] in kinds], source=path)


# --------------------------------------------------------------------------- each entry, by name


def test_pressure_gives_way_to_stall_thrashing_with_page_ins() -> None:
    found = _findings(memory_pressure=0.9, stalls_thrashing=0.65)
    applied = apply_precedence(found)
    pressure = found["memory.pressure"]
    assert pressure.confidence == 0.45 and pressure.summary == f"memory.pressure summary; {STALL_NOTE}"
    assert applied == ["memory.pressure gives way to stalls.thrashing (from 0.6): capped at 0.45"]
    assert found["stalls.thrashing"].confidence == 0.65  # the other finding is left as it is
    # Stalls without page-ins (the stall rule's 0.35-0.4) are reclaim, not thrashing: pressure stands.
    weak = _findings(memory_pressure=0.9, stalls_thrashing=0.4)
    assert apply_precedence(weak) == [] and weak["memory.pressure"].confidence == 0.9


def test_pressure_ranks_just_under_a_firm_oom_kill_of_its_own() -> None:
    found = _findings(memory_pressure=0.9, oom_host=0.85)
    apply_precedence(found)
    pressure = found["memory.pressure"]
    assert pressure.confidence == pytest.approx(0.8) and pressure.summary.endswith(f"; {OOM_NOTE}")
    assert pressure.confidence >= 0.5  # still contributing, not hidden
    # A kill the OOM rule could not tie to the service (0.55 host-wide, 0.3 another tenant's) changes nothing.
    for other in (0.55, 0.3):
        theirs = _findings(memory_pressure=0.9, oom_host=other)
        assert apply_precedence(theirs) == [] and theirs["memory.pressure"].confidence == 0.9


def _found(**by_rule: float) -> dict[str, Finding]:
    """Findings by dotted rule id (rule ids with underscores in their second part)."""
    return {rule_id: Finding(CLASS_OF[rule_id], rule_id, conf, f"{rule_id} summary") for rule_id, conf in by_rule.items()}


def test_backlog_gives_way_to_a_firm_kv_saturation() -> None:
    found = _found(**{"requests.queue_backlog": 0.8, "kv_cache.saturation": 0.8})
    apply_precedence(found)
    backlog = found["requests.queue_backlog"]
    assert backlog.confidence == 0.45 and backlog.summary.endswith(f"; {KV_NOTE}")
    # A KV suspect (latency flat, or no latency data) leaves the backlog as it is.
    weak = _found(**{"requests.queue_backlog": 0.8, "kv_cache.saturation": 0.45})
    assert apply_precedence(weak) == [] and weak["requests.queue_backlog"].confidence == 0.8


def test_aggregated_backlog_gives_way_to_a_firm_kv_saturation() -> None:
    found = _found(**{"aggregated.queue_vs_thrash": 0.7, "kv_cache.saturation": 0.75})
    apply_precedence(found)
    assert found["aggregated.queue_vs_thrash"].confidence == 0.45


def test_gauge_backlog_gives_way_to_a_firm_kv_saturation() -> None:
    found = _found(**{"aggregated.queue_from_gauges": 0.6, "kv_cache.saturation": 0.75})
    apply_precedence(found)
    backlog = found["aggregated.queue_from_gauges"]
    assert backlog.confidence == 0.45 and backlog.summary.endswith(f"; {KV_NOTE}")
    weak = _found(**{"aggregated.queue_from_gauges": 0.6, "kv_cache.saturation": 0.45})
    assert apply_precedence(weak) == [] and weak["aggregated.queue_from_gauges"].confidence == 0.6


BACKLOG_RULES = ("requests.queue_backlog", "aggregated.queue_vs_thrash", "aggregated.queue_from_gauges")


@pytest.mark.parametrize("backlog", BACKLOG_RULES)
def test_a_neighbour_ranks_just_under_a_firm_backlog(backlog: str) -> None:
    found = _found(**{"placement.noisy_neighbour": 0.7, backlog: 0.55})
    applied = apply_precedence(found)
    neighbour = found["placement.noisy_neighbour"]
    assert neighbour.confidence == pytest.approx(0.5) and "see the queue-backlog finding" in neighbour.summary
    assert applied == [f"placement.noisy_neighbour gives way to {backlog} (from 0.55): just under it (0.05 below) when it "
                       "would outrank it"]  # fmt: skip
    # A backlog that is partly a symptom (0.4: the service slowed or stalled) leaves the neighbour as it is.
    weak = _found(**{"placement.noisy_neighbour": 0.7, backlog: 0.4})
    assert apply_precedence(weak) == [] and weak["placement.noisy_neighbour"].confidence == 0.7


def test_a_neighbour_under_a_backlog_already_capped_by_kv_saturation_stays() -> None:
    """The table is read top to bottom: a backlog that gave way to a full KV cache is no longer firm."""
    found = _found(**{"placement.noisy_neighbour": 0.7, "aggregated.queue_vs_thrash": 0.65, "kv_cache.saturation": 0.75})
    apply_precedence(found)
    assert found["aggregated.queue_vs_thrash"].confidence == 0.45
    assert found["placement.noisy_neighbour"].confidence == 0.7


def test_kv_saturation_ranks_just_under_a_cuda_oom() -> None:
    found = _found(**{"kv_cache.saturation": 0.8, "oom.gpu": 0.7})
    apply_precedence(found)
    kv = found["kv_cache.saturation"]
    assert kv.confidence == pytest.approx(0.65) and "CUDA allocations failed" in kv.summary


def test_an_oom_kill_ranks_just_under_a_configuration_that_does_not_fit() -> None:
    found = _found(**{"oom.host": 0.85, "config.unsafe": 0.7})
    applied = apply_precedence(found)
    kill = found["oom.host"]
    assert kill.confidence == pytest.approx(0.65) and "see the unsafe-configuration finding" in kill.summary
    assert applied == ["oom.host gives way to config.unsafe (from 0.7): just under it (0.05 below) when it would outrank it"]
    # Over the limit on paper only (0.6), or merely risky settings: the kill stands.
    for other in (0.6, 0.45):
        theirs = _found(**{"oom.host": 0.85, "config.unsafe": other})
        assert apply_precedence(theirs) == [] and theirs["oom.host"].confidence == 0.85


ENTRY_TESTS = {
    ("oom.host", "config.unsafe"): test_an_oom_kill_ranks_just_under_a_configuration_that_does_not_fit,
    ("requests.queue_backlog", "kv_cache.saturation"): test_backlog_gives_way_to_a_firm_kv_saturation,
    ("aggregated.queue_vs_thrash", "kv_cache.saturation"): test_aggregated_backlog_gives_way_to_a_firm_kv_saturation,
    ("aggregated.queue_from_gauges", "kv_cache.saturation"): test_gauge_backlog_gives_way_to_a_firm_kv_saturation,
    ("kv_cache.saturation", "oom.gpu"): test_kv_saturation_ranks_just_under_a_cuda_oom,
    ("memory.pressure", "stalls.thrashing"): test_pressure_gives_way_to_stall_thrashing_with_page_ins,
    ("memory.pressure", "oom.host"): test_pressure_ranks_just_under_a_firm_oom_kill_of_its_own,
    **{("placement.noisy_neighbour", b): test_a_neighbour_ranks_just_under_a_firm_backlog for b in BACKLOG_RULES},
}


def test_every_entry_of_the_table_has_its_test() -> None:
    assert {(e.rule, e.yields_to) for e in PRECEDENCE} == set(ENTRY_TESTS)


def test_entries_name_registered_rules_of_other_classes_without_a_cycle() -> None:
    load_rules()
    for e in PRECEDENCE:
        assert e.rule in RULES and e.yields_to in RULES, e
        assert RULES[e.rule].cls != RULES[e.yields_to].cls, e
        assert 0 < e.firm_at <= 1 and e.note and e.why, e
    gives_way = {(e.rule, e.yields_to) for e in PRECEDENCE}
    assert not {(b, a) for a, b in gives_way} & gives_way  # nothing gives way both ways


# --------------------------------------------------------------------------- how a step applies


def test_a_ceiling_notes_the_other_finding_even_when_already_under_it() -> None:
    found = _findings(memory_pressure=0.4, stalls_thrashing=0.8)
    apply_precedence(found)
    assert found["memory.pressure"].confidence == 0.4 and found["memory.pressure"].summary.endswith(STALL_NOTE)


def test_just_under_leaves_a_finding_that_already_ranks_under_the_other_alone() -> None:
    found = _findings(memory_pressure=0.7, oom_host=0.85)
    assert apply_precedence(found) == []
    assert found["memory.pressure"].confidence == 0.7 and found["memory.pressure"].summary == "memory.pressure summary"


def test_steps_apply_in_table_order_and_once_per_class() -> None:
    found = _findings(memory_pressure=0.9, stalls_thrashing=0.8, oom_host=0.85)
    apply_precedence(found)
    pressure = found["memory.pressure"]
    assert pressure.confidence == 0.45  # capped for thrashing first, then already under the kill
    assert pressure.summary.count("see the") == 1 and pressure.yielded_to == {"thrashing"}
    apply_precedence(found)  # a second pass finds the class already yielded to: nothing doubles
    assert pressure.summary.count("see the") == 1


def test_a_class_the_rule_already_gave_way_to_on_its_own_evidence_is_not_noted_again() -> None:
    found = _findings(memory_pressure=0.45, stalls_thrashing=0.85)
    found["memory.pressure"].yielded_to.add("thrashing")
    assert apply_precedence(found) == []
    assert found["memory.pressure"].summary == "memory.pressure summary"


def test_nothing_to_give_way_to_changes_nothing() -> None:
    alone = _findings(memory_pressure=0.9)
    assert apply_precedence(alone) == [] and alone["memory.pressure"].confidence == 0.9
    only_others = _findings(stalls_thrashing=0.8, oom_host=0.85)
    assert apply_precedence(only_others) == []


def test_a_table_is_data_the_function_takes() -> None:
    table = [Precedence("oom.host", "memory.pressure", 0.5, JustUnder(0.1), "see pressure", "a test's own reason")]
    found = _findings(memory_pressure=0.9, oom_host=0.95)
    assert apply_precedence(found, table) == [
        "oom.host gives way to memory.pressure (from 0.5): just under it (0.1 below) when it would outrank it"
    ]
    assert found["oom.host"].confidence == pytest.approx(0.8) and found["memory.pressure"].confidence == 0.9
    assert Ceiling(0.3).step(0.9, 0.1) == 0.3 and JustUnder(0.05).step(0.5, 0.6) is None


def test_the_mark_of_what_a_finding_gave_way_to_stays_out_of_the_document() -> None:
    found = _findings(memory_pressure=0.9, stalls_thrashing=0.8)
    apply_precedence(found)
    doc = found["memory.pressure"].to_dict()
    assert "yielded_to" not in doc and doc["confidence"] == 0.45 and doc["summary"].endswith(STALL_NOTE)


# --------------------------------------------------------------------------- the engine applies it, the rules do not


def test_the_rule_reports_its_own_evidence_and_the_engine_ranks_it_under_the_kill() -> None:
    """A memcg OOM kill after strong pressure (24 MiB margin): pressure alone says 0.9, the analysis 0.8."""
    tl = _fixture("variants/host-oom-margin-24.jsonl.gz")
    alone = memory_pressure(tl)
    assert isinstance(alone, Finding) and alone.confidence == 0.9 and "OOM" not in alone.summary
    analysis = analyze(tl)
    by_rule = {f.rule: f for f in analysis.findings}
    kill, pressure = by_rule["oom.host"], by_rule["memory.pressure"]
    assert pressure.confidence == pytest.approx(kill.confidence - 0.05) and pressure.summary.endswith(OOM_NOTE)
    assert analysis.primary == "host_oom" and "memory_pressure" in analysis.contributing


def test_the_engine_caps_pressure_under_stall_thrashing_that_the_rule_never_sees() -> None:
    """Refault thrashing with too few request rows: only the stall-only rule sees it; pressure alone says 0.9."""
    tl = _fixture("variants/thrash-headroom-0.3.jsonl.gz")
    alone = memory_pressure(tl)
    assert isinstance(alone, Finding) and alone.confidence == 0.9 and not alone.yielded_to
    by_rule = {f.rule: f for f in analyze(tl).findings}
    assert by_rule["stalls.thrashing"].confidence >= 0.6
    assert by_rule["memory.pressure"].confidence == 0.45 and by_rule["memory.pressure"].summary.endswith(STALL_NOTE)


def test_pressure_that_saw_thrashing_itself_gets_one_note_only() -> None:
    """The thrash run without the tracker: pressure's own view shows full stalls with major faults (0.45, its own
    note), and the stall-only rule finds thrashing too -- the table does not add a second note."""
    tl = _fixture("thrash.jsonl.gz", kinds=("host", "cgroup", "process", "oom"))
    alone = memory_pressure(tl)
    assert isinstance(alone, Finding) and alone.confidence == 0.45 and alone.yielded_to == {"thrashing"}
    by_rule = {f.rule: f for f in analyze(tl).findings}
    assert by_rule["stalls.thrashing"].confidence >= 0.6
    assert by_rule["memory.pressure"].summary == alone.summary and alone.summary.count("see the thrashing finding") == 1


def test_the_architecture_document_shows_every_entry() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    for e in PRECEDENCE:
        assert f"| `{e.rule}` | `{e.yields_to}` | {e.firm_at:g} " in doc, e.describe()
