"""The diagnosis, live: ``diag collect --diagnose-every 15s`` runs the rules engine on the agent's own
recent records and exports what it concludes, so Prometheus can alert on a *diagnosis* and not only
on symptoms. (The option itself is checked by ``diag.cli.collect``; ``MIN_EVERY_S`` is its floor.)

Exported (names from the catalog):
- ``llmdiag_incident{class}``: 1 while the class is concluded (the verdict's primary or a contributing
  class), 0 for every other class of the engine -- a bounded set of series that exists from the
  first run, so ``== 0`` and absence are told apart;
- ``llmdiag_incident_confidence{class}``: the strongest finding's confidence (0 when none);
- ``llmdiag_incident_info{class, rule, summary, evidence}``: the finding's words, for the
  ``LLMDiagIncident`` alert's annotations (read with the ``query`` template function).

Why an info metric and not templated text in the rule: the summary and evidence carry the numbers
the rule found ("pid 42 was OOM-killed in /llm at 3.9 GiB"), which no static template can know.
Labels stay bounded: one info series per concluded class at most, its text cut to
``INCIDENT_TEXT_MAX`` characters and frozen when the class is first concluded, so an incident is
one series (not one per evaluation) and its annotations do not change while it fires.

Cost: the recorder is read read-only for the last ``WINDOW_S`` seconds in this process (no worker
processes: forking a threaded server is unsafe), on a daemon thread that sleeps on the agent's stop
event. The window is kept between runs (``diag.sources.recorder.RecorderWindow``): each run decodes
only the rows written since the last one, and builds the same Timeline a full read would.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from collectors import catalog as cat

log = logging.getLogger(__name__)

WINDOW_S = 300.0  # the recent window each run analyses: what "now" means for an alert; ~0.7 % of a core at 15 s
MIN_EVERY_S = 5.0  # below this the analysis would cost more than the 2 % CPU budget on a busy recorder


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= cat.INCIDENT_TEXT_MAX else text[: cat.INCIDENT_TEXT_MAX - 1] + "…"


def _evidence_text(finding: Any) -> str:
    if not finding.evidence:
        return ""
    ev = finding.evidence[0]
    unit = f" {ev.unit}" if ev.unit else ""
    return _short(f"{ev.what}: {ev.value}{unit}")


class LiveDiagnosis(Collector):
    """Runs the engine every ``every_s`` and serves the result as metrics (a prometheus_client Collector)."""

    def __init__(self, recorder: str | Path, every_s: float, window_s: float = WINDOW_S) -> None:
        from diag.rules.classes import INCIDENT_CLASSES

        self.recorder = Path(recorder)
        self.every_s = every_s
        self.window_s = window_s
        self.classes: tuple[str, ...] = tuple(INCIDENT_CLASSES)
        self._lock = threading.Lock()
        self._concluded: dict[str, float] = {}  # class -> confidence
        self._confidence: dict[str, float] = {}
        self._info: dict[str, tuple[str, str, str]] = {}  # class -> (rule, summary, evidence), frozen while concluded
        self._ran = False
        self.runs = 0
        self.failures = 0
        self.last_duration_s: float | None = None
        self._recent: Any = None  # diag.sources.recorder.RecorderWindow, made on the first run

    def _window(self) -> Any:
        """The recorder's window, kept between runs so that each run decodes only the rows new since the last."""
        if self._recent is None:
            from diag.sources.recorder import RecorderWindow

            self._recent = RecorderWindow(self.recorder, self.window_s)
        return self._recent

    def run_once(self) -> Any:
        """One analysis of the recent window; updates what ``collect`` serves. Returns the Analysis."""
        from diag.rules.engine import analyze

        started = time.monotonic()
        timeline = self._window().load()
        analysis = analyze(timeline)
        # "inconclusive" and "healthy" are verdicts, not classes: only a concluded class raises its series
        concluded = [analysis.primary, *analysis.contributing] if analysis.primary in self.classes else []
        best: dict[str, Any] = {}
        for f in analysis.findings:
            if f.cls not in best or f.confidence > best[f.cls].confidence:
                best[f.cls] = f
        with self._lock:
            self._confidence = {c: float(f.confidence) for c, f in best.items()}
            self._concluded = {c: self._confidence.get(c, 0.0) for c in concluded}
            for c in list(self._info):
                if c not in self._concluded:
                    del self._info[c]
            for c in concluded:
                if c not in self._info and c in best:
                    f = best[c]
                    self._info[c] = (f.rule, _short(f.summary), _evidence_text(f))
            self._ran = True
        self.runs += 1
        self.last_duration_s = time.monotonic() - started
        return analysis

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.every_s):
            try:
                self.run_once()
            except Exception as exc:  # a locked or trimmed recorder must not kill the agent's diagnosis for good
                self.failures += 1
                log.warning("live diagnosis failed: %s: %s", type(exc).__name__, exc)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if not self._ran:
                return
            concluded, confidence, info = dict(self._concluded), dict(self._confidence), dict(self._info)
        incident = GaugeMetricFamily(cat.INCIDENT.name, cat.INCIDENT.help, labels=list(cat.INCIDENT.labels))
        conf = GaugeMetricFamily(cat.INCIDENT_CONFIDENCE.name, cat.INCIDENT_CONFIDENCE.help,
                                 labels=list(cat.INCIDENT_CONFIDENCE.labels))  # fmt: skip
        for c in self.classes:
            incident.add_metric([c], 1.0 if c in concluded else 0.0)
            conf.add_metric([c], confidence.get(c, 0.0))
        yield incident
        yield conf
        if info:
            fam = GaugeMetricFamily(cat.INCIDENT_INFO.name, cat.INCIDENT_INFO.help, labels=list(cat.INCIDENT_INFO.labels))
            for c, (rule, summary, evidence) in sorted(info.items()):
                fam.add_metric([c, rule, summary, evidence], 1.0)
            yield fam


def start_live_diagnosis(agent: Any, recorder: str | Path, every_s: float | None) -> LiveDiagnosis | None:
    """Attach the live diagnosis to a ``collectors.agent.Agent`` (no-op when ``every_s`` is None).

    Registers the metrics on the agent's registry and starts a daemon thread that stops with the agent.
    """
    if every_s is None:
        return None
    live = LiveDiagnosis(recorder, every_s)
    agent.registry.register(live)
    thread = threading.Thread(target=live.loop, args=(agent.stop_event,), name="llmdiag-live-diagnosis", daemon=True)
    thread.start()
    log.info("live diagnosis every %gs over the last %gs (pid %d)", every_s, live.window_s, os.getpid())
    return live
