"""OTLP export configured from the environment: a real OTLP/HTTP receiver on 127.0.0.1, a real child process."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

ROOT = Path(__file__).resolve().parents[2]


class _Receiver(http.server.BaseHTTPRequestHandler):
    bodies: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        type(self).bodies.append((self.path, self.rfile.read(length)))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


_CHILD = textwrap.dedent(
    """
    from opentelemetry import trace
    from prometheus_client import CollectorRegistry
    from collectors.tracking import RequestTracker, configure_otlp_from_env
    tracker = RequestTracker("otlp-model", recorder=False, registry=CollectorRegistry(), span_sample_ratio=1.0,
                             queue_span_min_s=0.0)
    with tracker.request("/v1/completions") as req:
        req.acquire_sync()
        req.set_prompt_tokens(11)
        req.set_output_tokens(5)
    assert configure_otlp_from_env() is True  # idempotent
    tracker.close()
    trace.get_tracer_provider().shutdown()   # flushes the BatchSpanProcessor
    """
)


@pytest.mark.process
def test_spans_go_to_the_otlp_endpoint_from_the_environment() -> None:
    _Receiver.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
            "OTEL_SERVICE_NAME": "llm-diag-test",
        }
        env.pop("OTEL_SDK_DISABLED", None)
        subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, check=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    spans = {}
    services = set()
    for path, body in _Receiver.bodies:
        assert path == "/v1/traces"
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            for attr in resource_spans.resource.attributes:
                if attr.key == "service.name":
                    services.add(attr.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans[span.name] = {a.key: a.value for a in span.attributes}
    assert services == {"llm-diag-test"}
    assert set(spans) == {"llm.queue", "llm.inference"}
    inference = spans["llm.inference"]
    assert inference["gen_ai.request.model"].string_value == "otlp-model"
    assert inference["gen_ai.operation.name"].string_value == "text_completion"
    assert inference["gen_ai.usage.input_tokens"].int_value == 11
    assert inference["gen_ai.usage.output_tokens"].int_value == 5


@pytest.mark.process
def test_an_application_provider_wins_over_the_environment() -> None:
    child = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from collectors.tracking import configure_otlp_from_env
        mine = TracerProvider()
        trace.set_tracer_provider(mine)
        assert configure_otlp_from_env() is False
        assert trace.get_tracer_provider() is mine
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    subprocess.run([sys.executable, "-c", child], env=env, cwd=ROOT, check=True, timeout=60)
