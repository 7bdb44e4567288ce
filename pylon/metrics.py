"""Every Prometheus metric Pylon exposes, declared on an injected registry.

No module-level metrics: each `Metrics` owns its series on the registry it is
given, so tests use a fresh `CollectorRegistry()`. One method per observation
keeps label plumbing out of the pipeline. Label values come from fixed sets
(backend, route class, status class, error kind, deny-list entry, ...), never
from request contents: a value outside its set is counted as "other". Series
are pre-created so rates start at zero. Live gauges read state at scrape time
instead of drifting inc()/dec() pairs. docs/observability.md lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from backends.base import BackendAdapter, RouteClass, dotted, prefix_pattern
from pylon.pipeline import Derivation
from pylon.readiness import ProbeResult
from tunnel.server import CONNECTION_LIMIT
from tunnel.tls import Refusal

SeriesT = TypeVar("SeriesT", Counter, Histogram)

LATENCY_BUCKETS_S: tuple[float, ...] = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60, 120, 300),
)
"""From a cached health check (ms) to a long generation (minutes)."""

PRIORITY_BUCKETS = (0, 1, 5, 10, 50, 100, 250, 500, 750, 900, 990, 1000, 10_000, 100_000, 2**31 - 1)
"""Covers the default ceiling of 1000, scaled SGLang values, and the i32 bound."""

OTHER = "other"
"""Where a label value outside its fixed set is counted (a bug to look at, not a new series)."""
UNROUTED = "unrouted"
"""Route label of a request that failed before its route was classified."""
ROUTES = (*(route.value for route in RouteClass), UNROUTED)
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx", "reset")
REJECT_REASONS = (
    "bad_tunnel_header",
    "route_not_allowed",
    "body_invalid",
    "body_too_large",
    "malformed_request",
    "draining",
    "unauthorized",
    "header_too_large",
    "connection_stream_limit",
    "total_stream_limit",
    "body_idle_timeout",
    "too_early",
)
CONNECTION_REFUSALS = (CONNECTION_LIMIT, *(refusal.value for refusal in Refusal))
UPSTREAM_ERROR_KINDS = ("connect", "not_ready", "timeout", "reset", "protocol")
CANCELLERS = ("gateway", "engine", "timeout", "drain", "limit")
STRIP_KINDS = ("header", "body")
PROBE_RESULTS = tuple(result.value for result in ProbeResult)


def status_class(status: int | None) -> str:
    return "reset" if status is None else f"{min(max(status // 100, 2), 5)}xx"


def bounded(value: str, allowed: Sequence[str]) -> str:
    return value if value in allowed else OTHER


@dataclass(frozen=True)
class DenyList:
    """The adapter's deny-list entries as they appear in `pylon_stripped_total{name}`."""

    headers: tuple[str, ...] = ()
    """Exact header names and prefix patterns (``x-gateway-destination-endpoint*``)."""
    body_fields: tuple[str, ...] = ()
    """Dotted JSON paths (``nvext.agent_hints.priority``)."""

    @classmethod
    def of(cls, adapter: BackendAdapter) -> DenyList:
        exact = sorted(adapter.all_denied_headers() | adapter.derived_header_names())
        prefixes = [prefix_pattern(prefix) for prefix in adapter.all_denied_header_prefixes()]
        fields = [dotted(path) for path in adapter.all_denied_body_fields()]
        return cls(headers=(*exact, *prefixes), body_fields=tuple(fields))

    def names(self, kind: str) -> tuple[str, ...]:
        return {"header": self.headers, "body": self.body_fields}.get(kind, ())


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        backend: str,
        version: str,
        deny_list: DenyList | None = None,
    ) -> None:
        self.backend = backend
        self.deny_list = deny_list
        self._registry = registry
        self._kept_series: dict[
            tuple[Counter | Histogram, tuple[str, ...]], Counter | Histogram
        ] = {}
        self._declare_requests()
        self._declare_inputs()
        self._declare_failures()
        self.build_info = Info("pylon_build", "Pylon version and backend.", registry=registry)
        self.build_info.info({"version": version, "backend": backend})
        self._precreate()

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        return Counter(name, documentation, ["backend", *labels], registry=self._registry)

    def _histogram(
        self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(
            name, documentation, ["backend", *labels], buckets=buckets, registry=self._registry
        )

    def _declare_requests(self) -> None:
        self.requests = self._counter(
            "pylon_requests_total",
            "Tunnel requests finished, by route class and status class.",
            "route",
            "status_class",
        )
        self.duration = self._histogram(
            "pylon_request_duration_seconds",
            "Time from request head to end of response.",
            ["route"],
            LATENCY_BUCKETS_S,
        )
        self.ttfb = self._histogram(
            "pylon_time_to_first_byte_seconds",
            "Time from request head to the first response body byte sent to the gateway.",
            ["route"],
            LATENCY_BUCKETS_S,
        )
        self.request_bytes = self._counter(
            "pylon_request_bytes_total", "Request body bytes forwarded to the engine."
        )
        self.response_bytes = self._counter(
            "pylon_response_bytes_total", "Response body bytes sent to the gateway."
        )

    def _declare_inputs(self) -> None:
        self.priority = self._histogram(
            "pylon_priority_emitted",
            "Engine-native priority value Pylon wrote, by backend.",
            [],
            PRIORITY_BUCKETS,
        )
        self.derivations = self._counter(
            "pylon_priority_derivations_total",
            "Priority derivation outcomes on tunneled requests.",
            "outcome",
        )
        self.stripped = self._counter(
            "pylon_stripped_total",
            "Client-supplied scheduling/routing inputs removed, by deny-list entry.",
            "kind",
            "name",
        )

    def _declare_failures(self) -> None:
        self.rejected = self._counter(
            "pylon_requests_rejected_total",
            "Requests Pylon answered itself without reaching the engine, by reason.",
            "reason",
        )
        self.upstream_errors = self._counter(
            "pylon_upstream_errors_total", "Engine-side failures, by kind.", "kind"
        )
        self.cancellations = self._counter(
            "pylon_cancellations_total", "Requests ended abnormally, by who ended them.", "by"
        )
        self.engine_ready = Gauge(
            "pylon_engine_ready",
            "1 when the last engine health probe succeeded, else 0.",
            ["backend"],
            registry=self._registry,
        )
        self.engine_probes = self._counter(
            "pylon_engine_probes_total", "Engine health probes, by result.", "result"
        )
        self.connections_refused = self._counter(
            "pylon_connections_refused_total",
            "Tunnel connections refused before any request was served, by reason.",
            "reason",
        )

    def _precreate(self) -> None:
        backend = self.backend
        for route in ROUTES:
            for status in STATUS_CLASSES:
                self.requests.labels(backend, route, status)
            self.duration.labels(backend, route)
            self.ttfb.labels(backend, route)
        labelled: list[tuple[Counter, Iterable[str]]] = [
            (self.derivations, (outcome.value for outcome in Derivation)),
            (self.rejected, REJECT_REASONS),
            (self.upstream_errors, UPSTREAM_ERROR_KINDS),
            (self.cancellations, CANCELLERS),
            (self.engine_probes, PROBE_RESULTS),
            (self.connections_refused, CONNECTION_REFUSALS),
        ]
        for counter, values in labelled:
            for value in values:
                counter.labels(backend, value)
        for kind in STRIP_KINDS:
            for name in self.deny_list.names(kind) if self.deny_list is not None else ():
                self.stripped.labels(backend, kind, name)
        for unlabelled in (self.priority, self.request_bytes, self.response_bytes):
            unlabelled.labels(backend)
        self.engine_ready.labels(backend).set(0)

    def _series(self, metric: SeriesT, *labels: str) -> SeriesT:
        """This backend's series of `metric` for `labels`, looked up once and kept.

        `labels()` validates and locks on every call: 1.5 µs, and a request makes
        seven such calls. Series are never removed, so a kept one stays live.
        """
        key = (metric, labels)
        series = self._kept_series.get(key)
        if series is None:
            series = self._kept_series[key] = metric.labels(self.backend, *labels)
        return cast(SeriesT, series)

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
        route = bounded(route, ROUTES)
        self._series(self.requests, route, status_class(status)).inc()
        self._series(self.duration, route).observe(duration_s)
        if ttfb_s is not None:
            self._series(self.ttfb, route).observe(ttfb_s)
        self._series(self.request_bytes).inc(request_bytes)
        self._series(self.response_bytes).inc(response_bytes)

    def priority_derived(self, outcome: Derivation, emitted: int | None) -> None:
        self._series(self.derivations, outcome.value).inc()
        if emitted is not None:
            self._series(self.priority).observe(emitted)

    def inputs_stripped(self, kind: str, names: Iterable[str]) -> None:
        kind = bounded(kind, STRIP_KINDS)
        for name in names:
            self.stripped.labels(self.backend, kind, self._deny_entry(kind, name)).inc()

    def _deny_entry(self, kind: str, name: str) -> str:
        # Without a deny list (unit tests of other parts) the sanitizer's own
        # output is trusted: it only ever returns deny-list entries.
        if self.deny_list is None:
            return name
        return bounded(name, self.deny_list.names(kind))

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(self.backend, bounded(reason, REJECT_REASONS)).inc()

    def connection_refused(self, reason: str) -> None:
        self.connections_refused.labels(self.backend, bounded(reason, CONNECTION_REFUSALS)).inc()

    def upstream_failed(self, kind: str) -> None:
        self.upstream_errors.labels(self.backend, bounded(kind, UPSTREAM_ERROR_KINDS)).inc()

    def request_cancelled(self, by: str) -> None:
        self.cancellations.labels(self.backend, bounded(by, CANCELLERS)).inc()

    def engine_probed(self, result: ProbeResult, *, ready: bool) -> None:
        self.engine_probes.labels(self.backend, result.value).inc()
        self.engine_ready.labels(self.backend).set(1 if ready else 0)


WORKER_EXITS = ("crashed", "unresponsive")


class SupervisorMetrics:
    """The supervisor's own series (`workers > 1`), merged into /metrics with the workers'."""

    def __init__(
        self, registry: CollectorRegistry, *, configured_workers: int, steered: bool
    ) -> None:
        self._registry = registry
        self.workers = Gauge(
            "pylon_workers", "Worker processes configured (--workers).", registry=registry
        )
        self.workers.set(configured_workers)
        Gauge(
            "pylon_workers_steered",
            "1 when packets find their worker by connection ID, 0 when by address hash.",
            registry=registry,
        ).set(int(steered))
        self.restarts = Counter(
            "pylon_worker_restarts_total",
            "Worker processes restarted, by why the previous one ended.",
            ["reason"],
            registry=registry,
        )
        self.scrape_failures = Counter(
            "pylon_worker_scrape_failures_total",
            "Worker /metrics scrapes that failed: that scrape lacked the worker's series.",
            registry=registry,
        )
        for reason in WORKER_EXITS:
            self.restarts.labels(reason)

    def running_gauge(self, read: Callable[[], float]) -> None:
        """Read at scrape time: a worker being restarted is not counted."""
        Gauge(
            "pylon_workers_running",
            "Worker processes running and serving.",
            registry=self._registry,
        ).set_function(read)

    def worker_restarted(self, reason: str) -> None:
        self.restarts.labels(bounded(reason, WORKER_EXITS)).inc()
