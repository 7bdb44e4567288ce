"""OpenTelemetry spans: off by default; on, one server span per tunnel request and a client
span for the upstream request, children of the gateway's traceparent, which still reaches
the engine unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from backends.mock import MockEngine, MockEngineOptions
from pylon.app import RunningPylon, start_pylon
from pylon.config import Settings
from tests.harness import CHAT, run, tunnel_headers
from tunnel.client import client_configuration, open_client

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@contextlib.asynccontextmanager
async def traced_stack(
    tmp_path: Path, *, enabled: bool, provider: TracerProvider
) -> AsyncIterator[tuple[RunningPylon, MockEngine]]:
    engine = MockEngine(MockEngineOptions(engine="dynamo"))
    await engine.start()
    settings = Settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        dev=True,
        state_dir=tmp_path,
        upstream={"url": engine.url},
        backend={"type": "dynamo"},
        tracing={"enabled": enabled},
    )
    pylon = await start_pylon(settings, registry=CollectorRegistry(), tracer_provider=provider)
    try:
        yield pylon, engine
    finally:
        await pylon.close()
        await engine.close()


async def _one_request(port: int) -> None:
    async with open_client(
        "127.0.0.1", port, configuration=client_configuration(verify=False)
    ) as c:
        headers = [
            *tunnel_headers("trace-1", x_priority="3"),
            ("traceparent", TRACEPARENT),
            ("tracestate", "vendor=1"),
        ]
        response = await c.request(
            "POST", CHAT, headers=headers, body=orjson.dumps({"model": "m", "messages": []})
        )
        assert response.status == 200
        await response.read()


@pytest.mark.parametrize("enabled", [True, False])
def test_spans_and_trace_context(tmp_path: Path, enabled: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def scenario() -> None:
        async with traced_stack(tmp_path, enabled=enabled, provider=provider) as (pylon, engine):
            await _one_request(pylon.port)
            record = next(r for r in engine.snapshot()["requests"] if r["path"] == CHAT)
            assert ["traceparent", TRACEPARENT] in record["headers"], "traceparent changed"
            assert ["tracestate", "vendor=1"] in record["headers"]

    run(scenario())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    if not enabled:
        assert spans == {}
        return
    tunnel, upstream = spans["pylon.tunnel_request"], spans["pylon.upstream_request"]
    assert format(tunnel.context.trace_id, "032x") == TRACE_ID
    assert upstream.parent is not None and upstream.parent.span_id == tunnel.context.span_id
    assert tunnel.attributes is not None
    assert tunnel.attributes["pylon.request_id"] == "trace-1"
    assert tunnel.attributes["pylon.backend"] == "dynamo"
    assert tunnel.attributes["pylon.priority.emitted"] == 997
    assert tunnel.attributes["http.response.status_code"] == 200
