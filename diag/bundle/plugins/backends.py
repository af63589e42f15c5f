"""One raw ``/metrics`` exposition of each backend the agent scraped, taken at bundle time.

Why: the flight recorder keeps only the families a rule reads, summed over labels no rule splits by. During
an incident the rest of what vLLM, TGI or llama.cpp exports (per-engine series, LoRA, speculative decoding,
the cache configuration) is what someone reads next -- so the bundle keeps it whole, once, as the backend
wrote it. Which backends: the targets of the ``backend`` records of the recorder's last ``RECENT_S`` (what
``diag collect --scrape`` was scraping). Each file goes through the redactor like every file of the bundle.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

from collectors.exposition import ScrapeError
from collectors.recorder import default_recorder_path
from collectors.recorder_queries import RecorderReader
from collectors.scrape import fetch
from diag.bundle.plugin import Context, OutFile, Output, State

RECENT_S = 600.0  # targets scraped within this long before the bundle
MAX_TARGETS = 8
PER_TARGET_TIMEOUT_S = 5.0
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def scraped_targets(path: Path, since: float) -> list[str]:
    """The distinct ``target`` URLs of the recorder's backend records since ``since``, most recent first."""
    with RecorderReader.open(path) as rec:
        bodies = rec.bodies("backend", since, None)
    seen: dict[str, None] = {}
    for body in reversed(bodies):
        try:
            target = json.loads(body).get("target")
        except (ValueError, AttributeError):
            continue
        if isinstance(target, str) and target.startswith(("http://", "https://")):
            seen.setdefault(target)
    return list(seen)


def slug(target: str) -> str:
    """``http://127.0.0.1:8000/metrics`` -> ``127.0.0.1_8000_metrics``: a file name that says which backend."""
    return _SLUG.sub("_", target.split("://", 1)[-1]).strip("_")[:80] or "backend"


def expositions(state: State, ctx: Context) -> Output:
    o = state.options
    path = Path(o.recorder) if o.recorder is not None else default_recorder_path()
    if not path.exists():
        return Output(status="skipped", reason=f"no flight recorder at {path}: no scraped backend to ask")
    try:
        targets = scraped_targets(path, state.started - RECENT_S)
    except sqlite3.Error as exc:
        return Output(status="skipped", reason=f"cannot read the flight recorder {path}: {exc}")
    if not targets:
        return Output(status="skipped", reason="the agent scraped no backend recently (diag collect --scrape)")
    out = Output()
    problems: list[str] = []
    for i, target in enumerate(targets[:MAX_TARGETS], 1):
        ctx.check()
        timeout = min(PER_TARGET_TIMEOUT_S, ctx.remaining())
        if timeout <= 0.05:
            problems.append(f"{target}: no time left")
            continue
        started = time.monotonic()
        try:
            got = fetch(target, timeout, o.file_cap)
        except ScrapeError as exc:
            problems.append(f"{target}: {exc.reason} ({exc.detail})")
            continue
        text = got.body.decode("utf-8", errors="replace")
        out.files.append(OutFile(f"raw/backends/{i}-{slug(target)}.prom", text, source=target, source_bytes=len(got.body)))
        out.extra.setdefault("targets", []).append(
            {"target": target, "bytes": len(got.body), "content_type": got.content_type,
             "seconds": round(time.monotonic() - started, 3)}
        )  # fmt: skip
    if len(targets) > MAX_TARGETS:
        problems.append(f"{len(targets) - MAX_TARGETS} more backends not asked (at most {MAX_TARGETS})")
    if problems:
        out.reason = "; ".join(problems)
        if not out.files:
            out.status = "error"
    return out
