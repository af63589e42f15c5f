"""The redaction engine owns its memory: no module state changes, engines never share, answers never depend on it.

``collectors.redact`` remembers judged names and compiled patterns between texts (a serving log names the same
settings on every line). That memory lives in a ``RedactionEngine``; the module's functions use a default one.
These tests pin the ownership down: redacting through the module's functions leaves every module-level
container as it was, one engine's memory is invisible to another, and a warm engine answers exactly as a
fresh one and as the frozen reference engine.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from collectors import redact as redact_module
from collectors.redact import RedactionEngine, redact_argv_counts, redact_text

ROOT = Path(__file__).resolve().parents[2]

# Texts that make every remembering path work: settings (few names repeated, many distinct names, near misses),
# flags, command lines, a text holding the first marks.
TEXTS = [
    "token=a&password=b&x=c",
    "token=a&" * 80 + "password: b",  # many settings of few names: the pattern of names
    "".join(f"token{i}=v{i}&" for i in range(300)),  # many distinct names: the marked split
    "".join(f'"TOKENS{i}": "a", "apiKey{i}": "b", ' for i in range(50)),  # near misses beside secrets
    "\x00token=x \x01password=y \ufdd0key=z",  # the first marks are taken: another mark is compiled
    "serve --api-key abc --port 1 --hf-token def --max-tokens 3",
    "Authorization: Bearer abcdef\nx=1",
]
ARGVS = [
    ["serve", "--api-key", "v1", "--port", "1", "-H", "Authorization:", "Bearer", "v2"],
    ["python", "-m", "vllm", "--model", "m", "--password", "v3", "--tokenizer", "t"],
]


def _module_containers(module: ModuleType) -> dict[str, object]:
    """Deep copies of the module's mutable containers (dicts, sets, lists), the default engine excluded."""
    return {
        name: copy.deepcopy(value)
        for name, value in vars(module).items()
        if isinstance(value, (dict, set, list)) and not name.startswith("__")
    }


def _redact_everything(text_fn, argv_fn) -> list[object]:
    return [text_fn(t) for t in TEXTS] + [argv_fn(a) for a in ARGVS]


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("redact_reference_engine", ROOT / "bench" / "redact_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_redacting_through_the_module_changes_no_module_level_container() -> None:
    before = _module_containers(redact_module)
    _redact_everything(redact_text, redact_argv_counts)
    after = _module_containers(redact_module)
    assert after.keys() == before.keys()
    changed = [name for name in before if before[name] != after[name]]
    assert not changed, f"module-level state mutated by redaction: {changed}"


def test_the_default_engine_remembers_what_it_judged() -> None:
    """The memory the module functions use exists and fills (so the check above is not vacuous)."""
    fresh = RedactionEngine()
    assert fresh.remembered() == {"names": 0, "setting_names": 0, "name_patterns": 0, "mark_patterns": 0}
    _redact_everything(fresh.redact_text, fresh.redact_argv_counts)
    held = fresh.remembered()
    assert held["names"] > 0 and held["setting_names"] > 0 and held["name_patterns"] > 0 and held["mark_patterns"] >= 2


def test_two_engines_share_no_memory() -> None:
    a, b = RedactionEngine(), RedactionEngine()
    _redact_everything(a.redact_text, a.redact_argv_counts)
    assert a.remembered()["setting_names"] > 0
    assert b.remembered() == {"names": 0, "setting_names": 0, "name_patterns": 0, "mark_patterns": 0}
    _redact_everything(b.redact_text, b.redact_argv_counts)
    assert a.remembered() == b.remembered()  # the same texts, the same memory: each filled its own


@pytest.mark.parametrize("cache_max", [0, 1, 4096])
def test_warm_fresh_and_reference_engines_answer_alike(cache_max: int) -> None:
    """Memory only saves work: a warm engine (every text twice), a fresh engine per text and the frozen
    reference engine give the same output and counts, whatever the memory's size."""
    reference = _reference()
    warm = RedactionEngine(name_cache_max=cache_max, fast_patterns_max=max(cache_max, 1))
    for _ in range(2):
        for text in TEXTS:
            expected = reference.redact_text(text)
            assert warm.redact_text(text) == expected, text
            assert RedactionEngine().redact_text(text) == expected, text
        for argv in ARGVS:
            expected_argv = reference.redact_argv_counts(argv)
            assert warm.redact_argv_counts(argv) == expected_argv, argv
            assert RedactionEngine().redact_argv_counts(argv) == expected_argv, argv


def test_memory_stays_within_its_bounds() -> None:
    engine = RedactionEngine(name_cache_max=8, fast_patterns_max=2)
    for i in range(50):
        engine.redact_text("".join(f"token{i}x{j}=v&" for j in range(40)) + f"--secret{i} a --key{i} b")
        engine.redact_text(f"token{i}=a&" * 40)  # a pattern of names each time: at most two kept
    held = engine.remembered()
    assert held["names"] <= 8 and held["setting_names"] <= 8 and held["name_patterns"] <= 2
