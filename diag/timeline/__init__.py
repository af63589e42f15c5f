"""The Timeline: every recorded signal as columns aligned on Unix time (``model``), and how it is built (``builder``).

Public names stay importable from ``diag.timeline``; see ``diag.timeline.model`` for the naming of signals and
``diag.timeline.signals`` for the vocabulary itself (every name a rule may ask for, derived from the same record
declarations the builder follows, so it lives beside them).
"""

from diag.timeline.builder import TimelineBuilder, timeline_from_records
from diag.timeline.model import NAN, ProcessTrack, Series, Table, Timeline

__all__ = ["NAN", "ProcessTrack", "Series", "Table", "Timeline", "TimelineBuilder", "timeline_from_records"]
