"""What a scenario's records keep of the shared host: its own groups' processes, OOM kills and configurations, and
not another job's -- an engine server elsewhere on the host has its configuration read by the agent too."""

from __future__ import annotations

from collectors.recorder import FlightRecorder
from collectors.records import ProcessSample, ServiceConfig
from diag.demo.scenarios.recording import scenario_records

GROUP = "/llmdiag-demo-service-1"


def test_another_jobs_engine_configuration_is_dropped_with_its_process(tmp_path) -> None:
    path = tmp_path / "recorder.db"
    rec = FlightRecorder(path)
    settings = {"engine": "llama.cpp", "n_ctx": 2048}
    rec.write([
        ServiceConfig(ts=1.0, service="llama_cpp.server", pid=10, settings=settings),  # before its first sample
        ServiceConfig(ts=1.0, service="llama_cpp.server", pid=20, settings=settings),  # another job's server
        ServiceConfig(ts=1.0, service="demo", pid=None, settings={"workers": 1}),  # the tracker's own, no pid
        ServiceConfig(ts=1.5, service="llama_cpp.server", pid=30, settings=settings),  # named by the scenario
        ProcessSample(ts=2.0, pid=10, comm="python", memory_cgroup=GROUP),
        ProcessSample(ts=2.0, pid=20, comm="python", memory_cgroup="/other-job"),
    ])  # fmt: skip
    rec.close()
    kept = scenario_records(path, [GROUP], pids=[30])
    configs = sorted((o["pid"] is None, o["pid"]) for o in kept if o["kind"] == "config")
    assert configs == [(False, 10), (False, 30), (True, None)]
    assert [o["pid"] for o in kept if o["kind"] == "process"] == [10]
