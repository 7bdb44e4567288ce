"""Optional OpenTelemetry spans for the tunnel request and the upstream request.

Off by default, and then nothing here is imported on the hot path: the
service holds `None` and skips tracing entirely. When on, the OTLP exporter is
configured by the standard `OTEL_*` variables (endpoint, headers, service
name). The gateway's W3C `traceparent`/`tracestate` become the parent of
Pylon's spans and still reach the engine unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

TRACE_CONTEXT_HEADERS = (b"traceparent", b"tracestate")


class TracingUnavailable(Exception):
    """Tracing was asked for but the OpenTelemetry packages are not installed."""


class Tracing:
    def __init__(self, *, tracer: Any, propagator: Any, backend: str) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._backend = backend

    def tunnel_span(
        self, *, method: str, path: str, headers: Iterable[tuple[bytes, bytes]]
    ) -> AbstractContextManager[Any]:
        from opentelemetry.trace import SpanKind

        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in TRACE_CONTEXT_HEADERS
        }
        return self._tracer.start_as_current_span(  # type: ignore[no-any-return]
            "pylon.tunnel_request",
            context=self._propagator.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path.split("?", 1)[0],
                "pylon.backend": self._backend,
            },
        )

    def upstream_span(self) -> AbstractContextManager[Any]:
        from opentelemetry.trace import SpanKind

        return self._tracer.start_as_current_span(  # type: ignore[no-any-return]
            "pylon.upstream_request", kind=SpanKind.CLIENT
        )


def build_tracing(*, enabled: bool, backend: str, tracer_provider: Any = None) -> Tracing | None:
    """A `Tracing`, or None when off; `tracer_provider` lets tests collect spans in memory."""
    if not enabled:
        return None
    try:
        from opentelemetry.propagate import get_global_textmap
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            "tracing needs the OpenTelemetry packages: pip install 'pylon[tracing]'"
        ) from exc
    if tracer_provider is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        tracer_provider = TracerProvider(resource=Resource.create({"service.name": "pylon"}))
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(
        tracer=tracer_provider.get_tracer("pylon"),
        propagator=get_global_textmap(),
        backend=backend,
    )
