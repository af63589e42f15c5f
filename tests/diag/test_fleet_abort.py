"""A fleet load stops sending at the first refused query and says why, instead of working through the rest; and its
client decodes replies its own way (a series at a time, times shared).

The fleet's queries run on many threads with a few in flight (``load_fleet``'s ``concurrency``); without a stop,
one refusal -- a store's series limit on the host families, say -- would be raised only after every other
query had had its turn (60-odd of them, seconds each on a large fleet). Checked at the wire: a server on
127.0.0.1 answers the scrape-interval probe, refuses the query for the host families, and answers every other
query after 0.3 s; it counts the requests that reach it after the refusal went out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import ClassVar
from urllib.parse import parse_qs

import pytest

from diag.sources.fleet import _LazyPrometheus, load_fleet
from tests.httpstub import JsonHandler, serving

pytestmark = pytest.mark.process
END = 1_733_000_000.0
REFUSAL = "the query hit the store's series limit (a test refusal)"


class _Store(JsonHandler):
    protocol_version = "HTTP/1.1"
    lock = threading.Lock()
    refused_at: ClassVar[list[float]] = []
    received: ClassVar[list[tuple[float, str]]] = []

    def do_POST(self) -> None:
        form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode())
        query = form.get("query", [""])[0]
        with self.lock:
            self.received.append((time.monotonic(), query))
        if self.path.startswith("/api/v1/query_range") and "llmdiag_host_memory" in query:
            with self.lock:
                self.refused_at.append(time.monotonic())
            self.reply_json(422, {"status": "error", "errorType": "execution", "error": REFUSAL})
            return
        if self.path.startswith("/api/v1/query_range") and query == "two_series_on_one_grid":
            values = [[END - 10, "1"], [END - 5, "2"], [END, "3"]]
            result = [{"metric": {"instance": f"n{i}:9464"}, "values": values} for i in range(2)]
            self.reply_json(200, {"status": "success", "data": {"resultType": "matrix", "result": result}})
            return
        if self.path.startswith("/api/v1/query_range"):
            time.sleep(0.3)
            self.reply_json(200, {"status": "success", "data": {"resultType": "matrix", "result": []}})
            return
        # the probe of the scrape interval: one series sampled every 5 s
        series = {"metric": {"__name__": "up"}, "values": [[END - 60 + 5 * i, "1"] for i in range(12)]}
        self.reply_json(200, {"status": "success", "data": {"resultType": "matrix", "result": [series]}})


@pytest.fixture
def store() -> Iterator[str]:
    _Store.refused_at, _Store.received = [], []
    with serving(_Store) as url:
        yield url


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_the_first_refusal_is_raised_and_nothing_more_is_sent(store: str, concurrency: int) -> None:
    with pytest.raises(ValueError, match="a test refusal"):
        load_fleet(store, selector='job="llm"', since_s=3600, until=END, step_s=5, concurrency=concurrency)
    (refused_at,) = _Store.refused_at
    after = [q for t, q in _Store.received if t > refused_at]
    # Only what was in flight when the refusal went out may still arrive (each other slot's request takes 0.3 s,
    # so a slot cannot be handed on twice before the refusal is read); without the stop, every query left would.
    assert len(after) <= concurrency, after
    assert len(_Store.received) < 20, len(_Store.received)  # the set is ~70 queries: most were never sent


def test_the_fleet_client_decodes_each_series_onto_shared_read_only_grids(store: str) -> None:
    """The fleet's own client, not the single path's, answers its queries (its replies are decoded a series at a time
    and series on the same steps share one read-only time array: what keeps 200 targets' replies in memory bounds)."""
    prom = _LazyPrometheus(store, "", 5.0, in_flight=2)
    try:
        first = prom.range("two_series_on_one_grid", END - 10, END, 5)
        again = prom.range("two_series_on_one_grid", END - 10, END, 5)
    finally:
        prom.close()
    grids = {id(r.ts) for r in [*first, *again]}
    assert len(first) == 2 and len(grids) == 1, grids
    assert not first[0].ts.flags.writeable and list(first[1].values) == [1.0, 2.0, 3.0]
