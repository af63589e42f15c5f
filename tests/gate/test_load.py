"""The load generator against a stub server in its own process: open loop keeps its schedule however slow the
server is (no coordinated omission), closed loop never exceeds its clients, streaming gives TTFT and
inter-token gaps as the client sees them, and the request timeout bounds every request.

Each timing bound sits halfway between what the right behaviour gives and what the wrong one would, on the scale
the stub sets (its 1 s answers, its 0.3 s first token, its 5 s stall), not at the few milliseconds an idle host
shows: the suite runs on two cores beside other tests, where a process can wait a few hundred milliseconds for a
CPU (the stub received 10 % of its requests 0.34 s late so), and that must not read as a wrong load generator."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from diag.gate.alarm import Alarm
from diag.gate.criteria import quantile
from diag.gate.load import StepLoad, make_client, run_step
from diag.gate.spec import GateSpec, parse_spec
from tests.gate.stubproc import stub_server

pytestmark = pytest.mark.process


def _spec(step: dict, **top: object) -> GateSpec:
    return parse_spec({**top, "steps": [{"name": "s", "prompt_tokens": 4, "output_tokens": 8, **step}]})


def _run(url: str, spec: GateSpec) -> StepLoad:
    async def go() -> StepLoad:
        async with make_client(url, spec) as client:
            return await run_step(client, spec, spec.steps[0], 0, asyncio.Event())

    return asyncio.run(go())


def test_open_loop_keeps_its_schedule_when_the_server_is_slow() -> None:
    """Each answer takes 1 s while requests arrive 25 per second: a closed loop would send a handful; this one
    sends them all on time, ~25 in flight, and each latency counts from the scheduled send."""
    spec = _spec({"rate": 25, "duration": "4s"})
    with stub_server("--delay", "1.0") as stub:
        t_wall = time.time()
        load = _run(stub.url, spec)
        stats = stub.stats()
    n = len(load.results)
    assert 100 - 4 * 10 < n < 100 + 4 * 10, n  # Poisson count over 4 s at 25/s: sd 10
    assert all(r.ok for r in load.results), {r.error for r in load.results}
    # the server saw the pile-up a closed loop would have hidden: in flight ~ Poisson(25) while arrivals last, and a
    # client that waited for answers with fewer than 20 connections could not reach 20
    assert stats["max_in_flight"] >= 20
    assert len(stats["received"]) == n
    # the server received each request near its scheduled time (loop time -> wall time through the step's anchor):
    # a request held back for a free connection would arrive a whole 1 s answer late, or more
    sched = sorted(load.wall(r.scheduled) for r in load.results)
    late = [got - want for got, want in zip(sorted(stats["received"]), sched, strict=True)]
    assert quantile(late, 0.9) < 0.5 and min(late) > -0.01, (quantile(late, 0.9), min(late))
    assert min(stats["received"]) >= t_wall
    e2e = [r.e2e_s for r in load.results]
    assert min(e2e) >= 1.0 and statistics.median(e2e) < 1.5
    assert all(r.scheduled - load.t0 < 4.0 for r in load.results)  # the schedule ends with the step
    assert load.load_end - load.t0 <= 4.5 and load.end - load.load_end >= 0.5  # arrivals stop; the rest drains
    assert quantile([r.lag_s for r in load.results], 0.5) < 0.1  # sent on schedule, not after an answer (>= 1 s)


def test_closed_loop_holds_its_clients_and_max_in_flight_drops_rather_than_delays() -> None:
    with stub_server("--delay", "0.1") as stub:
        load = _run(stub.url, _spec({"concurrency": 3, "duration": "2s"}))
        assert stub.stats()["max_in_flight"] == 3
        n = len(load.results)
        assert 3 * 2 / 0.1 * 0.4 < n <= 3 * 2 / 0.1 + 3, n  # ~60: 3 clients x 20 round trips of 0.1 s, none idle long
        # open loop at 200/s against 0.1 s answers, at most 5 in flight: the excess is dropped, not queued
        capped = _run(stub.url, _spec({"rate": 200, "duration": "1s"}, max_in_flight=5))
        assert stub.stats()["max_in_flight"] == 5
    assert 200 - 4 * 15 < len(capped.results) + capped.dropped < 200 + 4 * 15
    assert len(capped.results) <= 5 * 1 / 0.1 + 5 and capped.dropped > 100
    # sent on time or not at all: delaying the excess instead would put the median send seconds late
    assert quantile([r.lag_s for r in capped.results], 0.5) < 0.1


def test_streaming_measures_ttft_and_inter_token_gaps_and_the_timeout_bounds_a_request() -> None:
    spec = _spec({"rate": 5, "duration": "2s", "stream": True})
    with stub_server("--ttft", "0.3", "--itl", "0.05") as stub:
        load = _run(stub.url, spec)
        chat = _run(
            stub.url,
            parse_spec(
                {
                    "endpoint": "/v1/chat/completions",
                    "steps": [{"name": "c", "rate": 5, "duration": "1s", "prompt_tokens": 4, "output_tokens": 5, "stream": True}],
                }
            ),
        )
    ok = [r for r in load.results if r.ok]
    assert ok and len(ok) == len(load.results)
    ttft = [r.ttft_s for r in ok]
    # the first token, not the whole answer: it comes 0.35 s (the last 7 gaps) before the end; a client that
    # buffered the answer would see both at once
    assert all(t is not None and t >= 0.3 for t in ttft) and statistics.median(ttft) < 0.6, ttft
    assert statistics.median(r.e2e_s - t for t, r in zip(ttft, ok, strict=True)) > 0.2, ttft
    gaps = [g for r in ok for g in r.itl_s]
    assert all(r.output_tokens == 8 and len(r.itl_s) == 7 for r in ok)
    assert 0.03 < statistics.median(gaps) < 0.2  # one gap per chunk, each about the stub's 0.05 s
    assert all(r.e2e_s >= 0.3 + 7 * 0.05 for r in ok)
    assert chat.results and all(r.ok and r.output_tokens == 5 for r in chat.results)
    with stub_server("--delay", "5") as stub:
        t0 = time.monotonic()
        slow = _run(stub.url, _spec({"rate": 10, "duration": "0.5s"}, request_timeout="0.5s"))
        took = time.monotonic() - t0
    assert slow.results and {r.error for r in slow.results} == {"timeout"}
    assert all(0.5 <= r.e2e_s < 2.5 for r in slow.results) and took < 4.0  # cut at 0.5 s, not at the 5 s answer


@pytest.mark.parametrize("precise", [True, False], ids=["timerfd", "spin"])
def test_an_alarm_fires_never_before_its_time_and_a_replaced_or_cancelled_time_not_at_all(precise: bool) -> None:
    """The open loop's wake-up (diag.gate.alarm): early would send before the schedule, which no load on the host
    can excuse, so that bound is exact; late is the host's, so only an upper bound far above a busy host's delays."""

    async def go() -> tuple[str, list[tuple[str, float, float]]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[str, float, float]] = []
        due = {"t": 0.0, "name": ""}
        alarm = Alarm(loop, lambda: fired.append((due["name"], due["t"], time.monotonic())), precise=precise)
        try:
            for name, delay in (("a", 0.02), ("b", 0.0005), ("c", 0.0), ("d", -0.01)):
                due["t"], due["name"] = time.monotonic() + delay, name
                alarm.at(due["t"])
                async with asyncio.timeout(30):
                    while len(fired) < "abcd".index(name) + 1:
                        await asyncio.sleep(0)
            alarm.at(time.monotonic() + 0.05)  # replaced by a sooner time: fires once, at that one
            due["t"], due["name"] = time.monotonic() + 0.01, "e"
            alarm.at(due["t"])
            async with asyncio.timeout(30):
                while len(fired) < 5:
                    await asyncio.sleep(0)
            alarm.at(time.monotonic() + 0.01)
            alarm.cancel()  # and a cancelled one never fires
            await asyncio.sleep(0.2)  # past both the replaced time and the cancelled one
        finally:
            alarm.close()
        return alarm.kind, fired

    kind, fired = asyncio.run(go())
    assert kind == ("timerfd" if precise else "spin")
    assert [name for name, _, _ in fired] == ["a", "b", "c", "d", "e"]
    assert all(got >= want for _, want, got in fired), fired
    assert all(got - want < 5.0 for _, want, got in fired), fired
