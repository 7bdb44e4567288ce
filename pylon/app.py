"""Assembles a running Pylon from `Settings`: tunnel listener, upstream client,
metrics, readiness, the engine probe and the admin server.

Each part gets only its own slice of the settings, converted here at the edge
(settings -> QuicConfiguration, httpx client, pipeline options). Every part
started registers its cleanup on one exit stack: a start-up failure unwinds
what was started, and `RunningPylon.close()` unwinds the same stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
from aioquic.quic.configuration import QuicConfiguration
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from backends.base import BackendAdapter
from backends.mock import MockEngine, MockEngineOptions
from backends.registry import build_adapter
from pylon.admin import AdminServer, start_admin
from pylon.auth import Admission, AuthSetupError, TunnelAuth, tunnel_auth_from
from pylon.config import Settings, split_host_port
from pylon.devcert import ensure_dev_certificate
from pylon.forwarder import Forwarder, build_upstream_client, build_upstream_transport
from pylon.metrics import DenyList, Metrics
from pylon.pipeline import PipelineOptions
from pylon.readiness import PROBE_INTERVAL_S, EngineProbe, Readiness
from pylon.service import ServiceOptions, TunnelService
from pylon.tracing import Tracing, TracingUnavailable, build_tracing
from tunnel.limits import TunnelLimits
from tunnel.listener import TunnelServer, start_tunnel
from tunnel.server import TunnelOptions
from tunnel.steering import ConnectionIdSteering

logger = logging.getLogger("pylon")

MOCK_FLAVOUR_FOR_BACKEND = {"passthrough": "openai"}
"""The built-in mock engine that emulates each backend (same name unless listed)."""


DRAIN_POLL_S = 0.05
"""How often a drain checks for in-flight streams: small against any grace period."""

CUT_SETTLE_S = 1.0
"""After the grace period, how long cut streams get to send their resets and be counted."""


class StartupError(Exception):
    """Settings that cannot run (missing certificate or upstream outside --dev)."""


@dataclass
class RunningPylon:
    settings: Settings
    tunnel: TunnelServer
    upstream_client: httpx.AsyncClient
    metrics: Metrics
    registry: CollectorRegistry
    mock_engine: MockEngine | None
    upstream_url: str
    readiness: Readiness
    """Flags behind /readyz; call `readiness.mark_draining()` on SIGTERM."""
    probe: EngineProbe
    admin: AdminServer
    service: TunnelService
    _cleanup: contextlib.AsyncExitStack = field(repr=False)

    @property
    def port(self) -> int:
        return self.tunnel.port

    @property
    def admin_port(self) -> int:
        return self.admin.port

    async def close(self) -> None:
        """Stop admin server, probe, listener, upstream client and mock, in that order.

        Requests still running are cut first and counted as cancelled "by drain".
        """
        self.service.cut_in_flight(by="drain")
        await self._cleanup.aclose()

    def start_drain(self) -> None:
        """Not ready at once, GOAWAY to the gateway, 503 (retry-safe) for new requests."""
        self.readiness.mark_draining()
        self.service.draining = True
        self.tunnel.registry.start_drain()

    async def drain(self, *, grace_s: float) -> bool:
        """Start draining and wait for in-flight requests; True if all finished in time."""
        self.start_drain()
        if await self._streams_done_within(grace_s):
            return True
        self.service.cut_in_flight(by="drain")
        await self._streams_done_within(CUT_SETTLE_S)
        return False

    async def _streams_done_within(self, bound_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while self.tunnel.registry.active_streams() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return self.tunnel.registry.active_streams() == 0


def certificate_files(settings: Settings) -> tuple[Path, Path]:
    """The configured certificate and key, or in --dev the generated ones."""
    cert_file, key_file = settings.tls.cert_file, settings.tls.key_file
    if cert_file is not None and key_file is not None:
        return cert_file, key_file
    if not settings.dev:
        raise StartupError("a TLS certificate and key are required (--cert/--key), or --dev")
    return ensure_dev_certificate(settings.state_dir)


def quic_configuration(settings: Settings) -> QuicConfiguration:
    cert_file, key_file = certificate_files(settings)
    configuration = QuicConfiguration(is_client=False, idle_timeout=settings.quic_idle_timeout_s)
    configuration.load_cert_chain(cert_file, key_file)
    return configuration


async def start_mock_if_needed(settings: Settings) -> tuple[MockEngine | None, str]:
    if settings.upstream.url is not None:
        return None, settings.upstream.url
    if not settings.dev:
        raise StartupError("an upstream engine URL is required (--upstream), or --dev")
    flavour = MOCK_FLAVOUR_FOR_BACKEND.get(settings.backend.type, settings.backend.type)
    engine = MockEngine(MockEngineOptions(engine=flavour, token_delay_s=0.05))
    await engine.start("127.0.0.1", 0)
    return engine, engine.url


async def start_pylon(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    probe_interval_s: float = PROBE_INTERVAL_S,
    tracer_provider: Any = None,
    tunnel_socket: socket.socket | None = None,
    steering: ConnectionIdSteering | None = None,
) -> RunningPylon:
    """Start every part; `tracer_provider` lets tests collect spans in memory.

    `tunnel_socket` is a worker's bound socket of the port's SO_REUSEPORT group
    (`pylon.supervisor`), and `steering` its place in the group; without them
    the tunnel binds `settings.listen` and issues random connection IDs.
    """
    registry = registry if registry is not None else CollectorRegistry()
    configuration = quic_configuration(settings)
    try:
        auth = tunnel_auth_from(settings)
    except AuthSetupError as exc:
        raise StartupError(str(exc)) from exc
    async with contextlib.AsyncExitStack() as stack:  # unwinds only if start-up fails
        mock_engine, upstream_url = await start_mock_if_needed(settings)
        if mock_engine is not None:
            stack.push_async_callback(mock_engine.close)
        upstream = settings.upstream.model_copy(update={"url": upstream_url})
        adapter = build_adapter(settings.backend, settings.priority)
        metrics = _metrics_for(adapter, registry)
        transport = build_upstream_transport(upstream)
        client = build_upstream_client(upstream, transport)  # closing it closes the transport
        stack.push_async_callback(client.aclose)
        forwarder = Forwarder(transport, upstream)
        try:
            tracing = build_tracing(
                enabled=settings.tracing.enabled,
                backend=adapter.name,
                tracer_provider=tracer_provider,
            )
        except TracingUnavailable as exc:
            raise StartupError(str(exc)) from exc
        service = build_service(
            settings,
            adapter=adapter,
            forwarder=forwarder,
            metrics=metrics,
            tracing=tracing,
            auth=auth,
        )
        tunnel = await _start_listener(
            settings,
            configuration,
            service,
            auth=auth,
            metrics=metrics,
            sock=tunnel_socket,
            steering=steering,
        )
        stack.callback(tunnel.close)
        readiness = Readiness(listener_up=True)
        stack.callback(_mark_listener_down, readiness)
        probe = EngineProbe(
            client, upstream_url, readiness=readiness, metrics=metrics, interval_s=probe_interval_s
        )
        admin = await _start_admin_side(stack, settings, probe=probe, registry=registry)
        _register_live_gauges(metrics, tunnel, readiness)
        return RunningPylon(
            settings,
            tunnel,
            client,
            metrics,
            registry,
            mock_engine,
            upstream_url,
            readiness=readiness,
            probe=probe,
            admin=admin,
            service=service,
            _cleanup=stack.pop_all(),
        )
    raise AssertionError("unreachable")  # mypy: AsyncExitStack may swallow exceptions


def build_service(
    settings: Settings,
    *,
    adapter: BackendAdapter,
    forwarder: Forwarder,
    metrics: Metrics,
    tracing: Tracing | None,
    auth: TunnelAuth,
) -> TunnelService:
    """The request handler from its settings slices (tests assemble it the same way)."""
    return TunnelService(
        adapter=adapter,
        forwarder=forwarder,
        options=ServiceOptions(
            pipeline=PipelineOptions(
                policy=settings.priority,
                derive_priority=settings.derive_priority,
                extra_health_paths=frozenset(settings.health_paths),
                allowed_headers=settings.security.header_allowlist(),
            ),
            max_body_bytes=settings.limits.max_body_bytes,
            total_timeout_s=settings.upstream.total_timeout_s,
            admission=Admission(
                max_header_bytes=settings.limits.max_header_bytes, tokens=auth.tokens
            ),
            body_idle_timeout_s=settings.limits.request_body_idle_timeout_s,
        ),
        metrics=metrics,
        tracing=tracing,
    )


async def _start_listener(
    settings: Settings,
    configuration: QuicConfiguration,
    service: TunnelService,
    *,
    auth: TunnelAuth,
    metrics: Metrics,
    sock: socket.socket | None,
    steering: ConnectionIdSteering | None,
) -> TunnelServer:
    host, port = split_host_port(settings.listen)
    limits = settings.limits
    return await start_tunnel(
        host=host,
        port=port,
        configuration=configuration,
        handler=service,
        options=TunnelOptions(
            max_queued_bytes_per_stream=settings.limits.max_queued_response_bytes,
            request_window_bytes=settings.limits.request_window_bytes,
            ping_interval_s=settings.quic_ping_interval_s or None,
            limits=TunnelLimits(
                max_connections=limits.max_connections,
                max_streams_per_connection=limits.max_streams_per_connection,
                max_streams_total=limits.max_streams_total,
                # Twice the decoded limit: encoded sizes up to it still get a 431.
                max_header_frame_bytes=2 * limits.max_header_bytes,
            ),
            client_auth=auth.client,
            session_tickets=settings.security.enable_0rtt,
            on_connection_refused=metrics.connection_refused,
            on_stream_refused=metrics.request_rejected,
            steering=steering,
        ),
        sock=sock,
    )


async def _start_admin_side(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    *,
    probe: EngineProbe,
    registry: CollectorRegistry,
) -> AdminServer:
    """Start the engine probe and the admin server, registering their cleanup."""
    probe.start()
    stack.push_async_callback(probe.stop)
    host, port = split_host_port(settings.admin_listen)
    admin = await start_admin(host, port, registry=registry, readiness=probe.readiness)
    stack.push_async_callback(admin.close)
    return admin


def _metrics_for(adapter: BackendAdapter, registry: CollectorRegistry) -> Metrics:
    # process_* (CPU, memory, fds) and python_info, as on the default registry.
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return Metrics(
        registry, backend=adapter.name, version=version("pylon"), deny_list=DenyList.of(adapter)
    )


def _mark_listener_down(readiness: Readiness) -> None:
    readiness.listener_up = False


def _register_live_gauges(metrics: Metrics, tunnel: TunnelServer, readiness: Readiness) -> None:
    registry = tunnel.registry
    metrics.live_gauge(
        "pylon_open_connections",
        "Open QUIC connections from the gateway.",
        lambda: len(registry.connections),
    )
    metrics.live_gauge(
        "pylon_active_streams", "Request streams being served.", registry.active_streams
    )
    metrics.live_gauge(
        "pylon_queued_response_bytes",
        "Response bytes sent toward the gateway and not yet acknowledged.",
        registry.queued_bytes,
    )
    metrics.live_gauge(
        "pylon_ready",
        "1 when /readyz answers 200 (listener up, not draining, engine ready), else 0.",
        lambda: 1 if readiness.ready else 0,
    )
