"""Plugins as declarations: the runner executes what a plugin declares -- its files, its commands, its checks, its
deadline, its redaction -- and the bundle's own plugin table keeps the order and the guarantees of the bundle.

A plugin written here the way a new one would be added (one declaration) runs real files, a real command and a
real hung command through the real runner.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from diag.bundle.options import BundleOptions
from diag.bundle.plugin import (
    COMMON,
    Command,
    Context,
    Copy,
    FileCopy,
    Found,
    Gather,
    Output,
    Phase,
    Plugin,
    Source,
    State,
    enabled_by,
    proc,
)
from diag.bundle.plugins import PLUGINS
from diag.bundle.plugins.journal import PROMPT_MASKS
from diag.bundle.redactor import Redactor
from diag.bundle.runner import collectors, run_collectors

CANARY = "c4n4ry7e11"


def _state(tmp_path: Path, **options: object) -> State:
    return State(BundleOptions(out_dir=tmp_path, **options), Redactor(), time.time(), time.time() - 60, tmp_path / "staging")


def _run(plugins: tuple[Plugin, ...], state: State, phase: Phase = Phase.AFTER_SNAPSHOT) -> dict[str, object]:
    runs = run_collectors(collectors(plugins, state, phase), time.monotonic() + 30, lambda _: None)
    return {r.name: r for r in runs}


def test_the_bundle_collects_volatile_state_first_and_names_every_step_once(tmp_path: Path) -> None:
    state = _state(tmp_path, includes=("/etc/hostname", "/etc/os-release"))
    volatile = [c.name for c in collectors(PLUGINS, state, Phase.VOLATILE)]
    after = [c.name for c in collectors(PLUGINS, state, Phase.AFTER_SNAPSHOT)]
    assert volatile == ["proc.pressure", "proc.meminfo", "proc.vmstat", "proc.loadavg", "snapshot"]
    assert after == ["cgroup.files", "process.files", "gpu", "nvidia-smi", "kmsg", "journal", "history", "backends",
                     "include.1", "include.2"]  # fmt: skip
    assert len({p.name for p in PLUGINS}) == len(PLUGINS)
    # every step's deadline comes from its plugin's declaration (or the option it names)
    by = {c.name: c for c in collectors(PLUGINS, state, Phase.AFTER_SNAPSHOT)}
    assert by["history"].timeout_s == state.options.history_timeout_s and by["history"].plugin == "history"
    assert by["nvidia-smi"].timeout_s == state.options.command_timeout_s and by["nvidia-smi"].plugin == "gpu"


@pytest.mark.process
def test_a_new_plugin_is_one_declaration_and_the_runner_does_the_rest(tmp_path: Path) -> None:
    present = tmp_path / "present.txt"
    present.write_text("".join(f"line {i:04d}\n" for i in range(1000)))  # 10 000 bytes: over the cap below
    refused = tmp_path / "refused.txt"
    refused.write_text("x")
    refused.chmod(0)
    seen: list[str] = []

    def gather(state: State, ctx: Context) -> Output:
        seen.append("gathered")
        return Output(records=[{"kind": "note", "ts": 1.0}], extra={"n": 1})

    plugin = Plugin(
        "example", "an example subsystem", Phase.AFTER_SNAPSHOT, timeout=7.0, redaction=COMMON,
        steps=(
            Copy("example.files", "files", (Source("", str(present), "raw/example/present.txt"),
                                            Source("", str(tmp_path / "absent"), "raw/example/absent", optional=True),
                                            Source("", str(tmp_path / "missing"), "raw/example/missing"))),
            Command("example.cmd", "a command", "sh", lambda s: ["-c", "echo hello; echo oops >&2; exit 3"],
                    "raw/example/cmd.txt", missing="{program} not on PATH"),
            Command("example.absent", "no such program", "llmdiag-no-such-program", lambda s: [], "raw/x",
                    missing="{program} not on PATH"),
            Gather("example.gather", "code", gather, timeout=2.0),
        ),
    )  # fmt: skip
    state = _state(tmp_path, file_cap=4096)
    by = _run((plugin,), state)
    files = by["example.files"]
    assert files.timeout_s == 7.0 and files.plugin == "example"
    (copied,) = files.output.files  # the optional absent file is not a problem, the other absent one is
    assert copied.truncated and copied.text.endswith("line 0999\n") and len(copied.text) <= 4096
    assert files.status == "ok" and files.reason == f"{tmp_path / 'missing'}: No such file or directory"
    cmd = by["example.cmd"]
    assert cmd.status == "error" and cmd.reason == "exit code 3: oops" and cmd.output.files[0].text == "hello\n"
    assert by["example.absent"].status == "skipped" and by["example.absent"].reason == "llmdiag-no-such-program not on PATH"
    gathered = by["example.gather"]
    assert gathered.timeout_s == 2.0 and gathered.output.records == [{"kind": "note", "ts": 1.0}] and seen == ["gathered"]


def test_a_plugin_that_does_not_apply_says_why_for_every_step_and_runs_nothing(tmp_path: Path) -> None:
    ran: list[str] = []
    plugin = Plugin(
        "gpu-like", "needs --gpu", Phase.AFTER_SNAPSHOT, timeout=5.0, redaction=COMMON,
        when=(enabled_by("gpu", "disabled (--no-gpu)"),),
        steps=(Gather("a", "a", lambda s, c: ran.append("a") or Output()),
               Command("b", "b", "sh", lambda s: ["-c", "true"], "raw/b", missing="-")),
    )  # fmt: skip
    by = _run((plugin,), _state(tmp_path, gpu=False))
    assert {n: (r.status, r.reason) for n, r in by.items()} == {"a": ("skipped", "disabled (--no-gpu)"),
                                                                 "b": ("skipped", "disabled (--no-gpu)")}  # fmt: skip
    assert ran == []


def test_a_copy_step_names_unresolved_sources_and_ignores_the_errnos_it_declares(tmp_path: Path) -> None:
    readable = tmp_path / "memory.current"
    readable.write_text("123\n")

    def found(state: State) -> Found:
        return Found([FileCopy(str(readable), "raw/a"), FileCopy(str(tmp_path), "raw/dir")], problems=["/g: no memory group"])

    quiet = Copy("quiet", "a directory read is EISDIR: declared not a problem", found, not_problems=frozenset({errno.EISDIR}))
    loud = Copy("loud", "the same without the declaration", found)
    by = _run((Plugin("p", "p", Phase.AFTER_SNAPSHOT, 5.0, COMMON, (quiet, loud)),), _state(tmp_path))
    assert by["quiet"].reason == "/g: no memory group" and len(by["quiet"].output.files) == 1
    assert by["loud"].reason == f"/g: no memory group; {tmp_path}: Is a directory"
    skipped = Copy("none", "nothing to copy", lambda s: Found(skipped="no watched cgroup"))
    assert _run((Plugin("q", "q", Phase.AFTER_SNAPSHOT, 5.0, COMMON, (skipped,)),), _state(tmp_path))["none"].status == "skipped"


@pytest.mark.process
def test_a_hung_command_of_a_plugin_is_killed_at_the_plugin_deadline_and_keeps_its_output(tmp_path: Path) -> None:
    plugin = Plugin(
        "stuck", "a command that hangs", Phase.AFTER_SNAPSHOT, timeout=1.0, redaction=COMMON,
        steps=(Command("stuck.cmd", "prints then hangs", "sh", lambda s: ["-c", "echo first; exec sleep 300"],
                       "raw/stuck.txt", missing="-"),),
    )  # fmt: skip
    started = time.monotonic()
    run = _run((plugin,), _state(tmp_path))["stuck.cmd"]
    assert time.monotonic() - started < 10
    assert run.timeout_hit and run.status == "timeout" and run.output.files[0].text == "first\n"


def test_proc_sources_follow_the_proc_root(tmp_path: Path) -> None:
    options = BundleOptions(proc_root=str(tmp_path))
    assert proc("pressure/irq", optional=True).resolve(options) == FileCopy(f"{tmp_path}/pressure/irq",
                                                                            "raw/proc/pressure/irq", True)  # fmt: skip


VLLM_LINES = (
    f"vllm[42]: INFO 11-30 12:00:01 logger.py:39] Received request cmpl-9f1: prompt: 'tell me {CANARY} it\\'s, params: x', "
    f"params: SamplingParams(n=1, temperature=0.7, max_tokens=64), prompt_token_ids: [1, 4093, 3323], "
    "prompt_embeds shape: None, lora_request: None.\n"
    f'vllm[42]: INFO 11-30 12:00:02 logger.py:60] Generated response cmpl-9f1 (streaming complete): output: "{CANARY} '
    'done", output_token_ids: [318, 2], finish_reason: stop\n'
    "vllm[42]: INFO 11-30 12:00:03 metrics.py:455] Avg prompt throughput: 12.0 tokens/s, Running: 1 reqs\n"
)


def test_the_journal_masks_prompts_and_completions_of_the_request_log() -> None:
    redactor = Redactor()
    out = redactor.text(VLLM_LINES, "raw/journal.txt", PROMPT_MASKS)
    assert CANARY not in out and "4093" not in out and "318, 2" not in out
    lines = out.splitlines()
    assert lines[0].endswith(
        "Received request cmpl-9f1: prompt: <redacted>, params: SamplingParams(n=1, temperature=0.7, "
        "max_tokens=64), prompt_token_ids: <redacted>, prompt_embeds shape: None, lora_request: None."
    )
    assert lines[1].endswith("output: <redacted>, output_token_ids: <redacted>, finish_reason: stop")
    assert lines[2] == VLLM_LINES.splitlines()[2]  # a line without request text is left as it was
    assert redactor.report()["per_file"]["raw/journal.txt"] == {"request_log_text": 4}
    # without the journal's masks, the common rules alone let the prompt through: the masks are what stop it
    assert CANARY in Redactor().text(VLLM_LINES, "raw/journal.txt")


@pytest.mark.process
def test_the_journal_plugin_applies_its_masks_in_a_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not any(os.path.isdir(p) for p in ("/run/systemd/system", "/run/log/journal", "/var/log/journal")):
        pytest.skip("no journal directory on this host: the journal plugin skips (tested by its reason)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "journalctl").write_text(f"#!/bin/sh\ncat <<'EOF'\n{VLLM_LINES}EOF\n")
    (bin_dir / "journalctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    from diag.bundle import take_bundle

    options = BundleOptions(out_dir=tmp_path, since_s=600, recorder=tmp_path / "none.db", deadline_s=60, tar=False,
                            gpu=False, unit="vllm.service")  # fmt: skip
    root = take_bundle(options, None).root
    text = (root / "raw" / "journal.txt").read_text()
    assert "Received request cmpl-9f1: prompt: <redacted>" in text and CANARY not in text
    manifest = json.loads((root / "manifest.json").read_text())
    journal = next(c for c in manifest["collectors"] if c["name"] == "journal")
    assert journal["plugin"] == "journal" and journal["status"] == "ok"
    assert json.loads((root / "redaction.json").read_text())["per_file"]["raw/journal.txt"] == {"request_log_text": 4}
    assert not [p for p in root.rglob("*") if p.is_file() and CANARY.encode() in p.read_bytes()]


def test_a_plugin_mask_runs_before_the_common_rules(tmp_path: Path) -> None:
    """A mask's own replacement goes through the common rules too, so a careless mask cannot reintroduce a secret."""
    import re

    from diag.bundle.plugin import Mask

    mask = Mask("demo", re.compile(r"SECRET\((\w+)\)"), r"password=\1")
    out = Redactor().text("value SECRET(hunter22)\n", "raw/x", (mask,))
    assert "hunter22" not in out
