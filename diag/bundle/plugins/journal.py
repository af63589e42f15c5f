"""The service unit's journal over the history window (``journalctl -u UNIT --since``), and the masks that
keep prompts out of it.

An inference server's log can carry its users' prompts: vLLM's request logger prints each request's prompt
and prompt token ids (``Received request ID: prompt: '...', params: ..., prompt_token_ids: [...]``) and, with
``--enable-log-outputs``, each completion (``Generated response ID: output: '...', output_token_ids: [...]``;
format of vllm/entrypoints/logger.py). No text rule knows those shapes, so the journal plugin masks them
itself: the text (a Python repr) and the token ids (which decode back to the text); the request id, the
sampling parameters and the finish reason stay.
"""

from __future__ import annotations

import os
import re

from diag.bundle.plugin import Mask, State

JOURNAL_DIRS = ("/run/systemd/system", "/run/log/journal", "/var/log/journal")
MAX_LINES = 20_000

_PY_STR = r"""(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""  # a Python str repr, quotes and escapes
PROMPT_MASKS = (
    Mask("request_log_text", re.compile(rf"(Received request [^:\n]*: prompt: ){_PY_STR}"), r"\1<redacted>"),
    Mask("request_log_text", re.compile(rf"(Generated response [^:\n]*: output: ){_PY_STR}"), r"\1<redacted>"),
    Mask("request_log_text", re.compile(r"(\b(?:prompt|output)_token_ids: )\[[^\]\n]*\]"), r"\1<redacted>"),
)


def journal_unit(state: State) -> str | None:
    """``--unit``, else the systemd service the watched group belongs to (``/system.slice/vllm.service``)."""
    if state.options.unit:
        return state.options.unit
    for snap in state.cgroups:
        for part in reversed(snap.path.split("/")):
            if part.endswith(".service"):
                return part
    return None


def no_journal(state: State) -> str | None:
    if any(os.path.isdir(p) for p in JOURNAL_DIRS):
        return None
    return "systemd is not running here (no /run/systemd/system) and there are no journal files"


def no_unit(state: State) -> str | None:
    if journal_unit(state) is not None:
        return None
    return "no service unit: pass --unit, or watch a process (--pid) of a systemd service"


def journal_args(state: State) -> list[str]:
    return ["-u", str(journal_unit(state)), f"--since=@{int(state.since)}", "--no-pager", "-q", "-o", "short-iso",
            "-n", str(MAX_LINES)]  # fmt: skip
