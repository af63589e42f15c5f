"""How fast can ``diag gate``'s load generator send open-loop arrivals on time?

The generator alone (``diag.gate.load``, the code ``diag gate`` runs; no host agent) sends Poisson arrivals at
each rate for a few seconds to the stub server of the tests (``tests/gate/stub.py``: its own process, raw
asyncio HTTP/1.1 keep-alive, answering at once), and prints per rate: the rate achieved, the send lag (a
request's start behind its scheduled time) p50 / p99 / max, the errors, and the generator's own CPU per request.
The figure of merit is the highest rate whose send-lag p99 stays <= 1 ms: above it the generator's own
lateness, not the server, would start to shape the latencies it reports (they count from the schedule, so
the lag is charged, not hidden -- but the load is then not quite the one asked for).

    .venv/bin/python bench/gate.py                       # rates 25 .. 800, 5 s each
    .venv/bin/python bench/gate.py --rates 500,1000 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diag.gate.criteria import quantile
from diag.gate.load import StepLoad, make_client, run_step
from diag.gate.spec import parse_spec
from tests.gate.stubproc import stub_server

LAG_TARGET_S = 0.001


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _step(url: str, rate: float, seconds: float) -> tuple[StepLoad, float]:
    spec = parse_spec({
        "request_timeout": "10s", "max_in_flight": 4096,
        "steps": [{"name": "b", "rate": rate, "duration": seconds, "prompt_tokens": 16, "output_tokens": 8}],
    })  # fmt: skip
    warm = parse_spec({"steps": [{"rate": 50, "duration": 0.5, "prompt_tokens": 4, "output_tokens": 4}]})
    async with make_client(url, spec, connections=512) as client:
        await run_step(client, warm, warm.steps[0], 0, asyncio.Event())  # connections open, code paths warm
        cpu0 = _cpu_s()
        load = await run_step(client, spec, spec.steps[0], 0, asyncio.Event())
        return load, _cpu_s() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="25,50,100,200,400,800", help="requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="each rate's duration")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    best = 0.0
    print(f"{'rate':>6} {'achieved':>9} {'sent':>6} {'err':>5} {'lag p50':>9} {'lag p99':>9} {'lag max':>9} {'cpu/req':>9}")
    with stub_server() as stub:
        for rate in rates:
            load, cpu = asyncio.run(_step(stub.url, rate, args.seconds))
            lags = [r.lag_s for r in load.results]
            n = len(load.results)
            errors = sum(1 for r in load.results if not r.ok) + load.dropped
            p99 = quantile(lags, 0.99)
            if p99 <= LAG_TARGET_S and errors == 0:
                best = max(best, rate)
            print(f"{rate:>6.0f} {n / (load.load_end - load.t0):>9.0f} {n:>6} {errors:>5} {quantile(lags, 0.5) * 1e3:>7.3f}ms "
                  f"{p99 * 1e3:>7.3f}ms {max(lags) * 1e3:>7.3f}ms {cpu / max(1, n) * 1e6:>7.0f}us")  # fmt: skip
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end (other work shares them)")
    print(f"highest rate with send-lag p99 <= {LAG_TARGET_S * 1e3:g} ms and no errors: {best:.0f} requests/s")


if __name__ == "__main__":
    main()
