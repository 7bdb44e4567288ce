"""Every Prometheus metric Pylon exposes, declared on an injected registry.

No module-level metrics: each `Metrics` owns its series on the registry it is
given, so tests use a fresh `CollectorRegistry()`. One method per observation
keeps label plumbing out of the pipeline. Label values come from fixed sets
(backend, route class, status class, error code, deny-list entry, ...), never
from request contents; series are pre-created so rates start at zero. Live
gauges read state at scrape time instead of drifting inc()/dec() pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from backends.base import RouteClass
from pylon.pipeline import Derivation

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
"""From a cached health check (ms) to a long generation (minutes)."""

PRIORITY_BUCKETS = (0, 1, 5, 10, 50, 100, 250, 500, 750, 900, 990, 1000, 10_000, 100_000, 2**31 - 1)
"""Covers the default ceiling of 1000, scaled SGLang values, and the i32 bound."""

STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx", "reset")
REJECT_REASONS = (
    "bad_tunnel_header",
    "route_not_allowed",
    "body_invalid",
    "body_too_large",
    "malformed_request",
    "draining",
)
UPSTREAM_ERROR_KINDS = ("connect", "not_ready", "timeout", "reset", "protocol")
CANCELLERS = ("gateway", "engine", "timeout")


def status_class(status: int | None) -> str:
    return "reset" if status is None else f"{min(max(status // 100, 2), 5)}xx"


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, backend: str, version: str) -> None:
        self.backend = backend
        self.requests = Counter(
            "pylon_requests_total",
            "Tunnel requests finished, by route class and status class.",
            ["backend", "route", "status_class"],
            registry=registry,
        )
        self.duration = Histogram(
            "pylon_request_duration_seconds",
            "Time from request head to end of response.",
            ["backend", "route"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.ttfb = Histogram(
            "pylon_time_to_first_byte_seconds",
            "Time from request head to the first response body byte sent to the gateway.",
            ["backend", "route"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.priority = Histogram(
            "pylon_priority_emitted",
            "Engine-native priority value Pylon wrote, by backend.",
            ["backend"],
            buckets=PRIORITY_BUCKETS,
            registry=registry,
        )
        self.derivations = Counter(
            "pylon_priority_derivations_total",
            "Priority derivation outcomes on tunneled requests.",
            ["backend", "outcome"],
            registry=registry,
        )
        self.stripped = Counter(
            "pylon_stripped_total",
            "Client-supplied scheduling/routing inputs removed, by deny-list entry.",
            ["backend", "kind", "name"],
            registry=registry,
        )
        self.rejected = Counter(
            "pylon_requests_rejected_total",
            "Requests Pylon answered itself without reaching the engine, by reason.",
            ["backend", "reason"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "pylon_upstream_errors_total",
            "Engine-side failures, by kind.",
            ["backend", "kind"],
            registry=registry,
        )
        self.cancellations = Counter(
            "pylon_cancellations_total",
            "Requests ended abnormally, by who ended them.",
            ["backend", "by"],
            registry=registry,
        )
        self.request_bytes = Counter(
            "pylon_request_bytes_total",
            "Request body bytes forwarded to the engine.",
            ["backend"],
            registry=registry,
        )
        self.response_bytes = Counter(
            "pylon_response_bytes_total",
            "Response body bytes sent to the gateway.",
            ["backend"],
            registry=registry,
        )
        self.build_info = Info("pylon_build", "Pylon version and backend.", registry=registry)
        self.build_info.info({"version": version, "backend": backend})
        self._registry = registry
        self._precreate()

    def _precreate(self) -> None:
        for route in RouteClass:
            for status in STATUS_CLASSES:
                self.requests.labels(self.backend, route.value, status)
            self.duration.labels(self.backend, route.value)
            self.ttfb.labels(self.backend, route.value)
        for outcome in Derivation:
            self.derivations.labels(self.backend, outcome.value)
        for reason in REJECT_REASONS:
            self.rejected.labels(self.backend, reason)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(self.backend, kind)
        for by in CANCELLERS:
            self.cancellations.labels(self.backend, by)
        self.priority.labels(self.backend)
        self.request_bytes.labels(self.backend)
        self.response_bytes.labels(self.backend)

    def live_gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is read from live state at scrape time."""
        Gauge(name, documentation, registry=self._registry).set_function(read)

    # --- observations ---------------------------------------------------------------

    def request_finished(
        self,
        *,
        route: str,
        status: int | None,
        duration_s: float,
        ttfb_s: float | None,
        request_bytes: int,
        response_bytes: int,
    ) -> None:
        self.requests.labels(self.backend, route, status_class(status)).inc()
        self.duration.labels(self.backend, route).observe(duration_s)
        if ttfb_s is not None:
            self.ttfb.labels(self.backend, route).observe(ttfb_s)
        self.request_bytes.labels(self.backend).inc(request_bytes)
        self.response_bytes.labels(self.backend).inc(response_bytes)

    def priority_derived(self, outcome: Derivation, emitted: int | None) -> None:
        self.derivations.labels(self.backend, outcome.value).inc()
        if emitted is not None:
            self.priority.labels(self.backend).observe(emitted)

    def inputs_stripped(self, kind: str, names: Iterable[str]) -> None:
        for name in names:
            self.stripped.labels(self.backend, kind, name).inc()

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(self.backend, reason).inc()

    def upstream_failed(self, kind: str) -> None:
        self.upstream_errors.labels(self.backend, kind).inc()

    def request_cancelled(self, by: str) -> None:
        self.cancellations.labels(self.backend, by).inc()
