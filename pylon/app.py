"""Assembles a running Pylon from `Settings`: tunnel listener, upstream client, metrics.

Each part gets only its own slice of the settings, converted here at the edge
(settings -> QuicConfiguration, httpx client, pipeline options).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from importlib.metadata import version

import httpx
from aioquic.quic.configuration import QuicConfiguration
from prometheus_client import CollectorRegistry

from backends.mock import MockEngine, MockEngineOptions
from backends.registry import build_adapter
from pylon.config import Settings, split_host_port
from pylon.devcert import ensure_dev_certificate
from pylon.forwarder import Forwarder, build_upstream_client
from pylon.metrics import Metrics
from pylon.pipeline import PipelineOptions
from pylon.service import ServiceOptions, TunnelService
from tunnel.server import TunnelOptions, TunnelServer, start_tunnel

logger = logging.getLogger("pylon")

MOCK_FLAVOUR_FOR_BACKEND = {"passthrough": "openai"}
"""The built-in mock engine that emulates each backend (same name unless listed)."""


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

    @property
    def port(self) -> int:
        return self.tunnel.port

    async def close(self) -> None:
        self.tunnel.close()
        await self.upstream_client.aclose()
        if self.mock_engine is not None:
            await self.mock_engine.close()


def quic_configuration(settings: Settings) -> QuicConfiguration:
    cert_file, key_file = settings.tls.cert_file, settings.tls.key_file
    if cert_file is None or key_file is None:
        if not settings.dev:
            raise StartupError("a TLS certificate and key are required (--cert/--key), or --dev")
        cert_file, key_file = ensure_dev_certificate(settings.state_dir)
    configuration = QuicConfiguration(is_client=False, idle_timeout=settings.quic_idle_timeout_s)
    configuration.load_cert_chain(cert_file, key_file)
    return configuration


async def _start_mock_if_needed(settings: Settings) -> tuple[MockEngine | None, str]:
    if settings.upstream.url is not None:
        return None, settings.upstream.url
    if not settings.dev:
        raise StartupError("an upstream engine URL is required (--upstream), or --dev")
    flavour = MOCK_FLAVOUR_FOR_BACKEND.get(settings.backend.type, settings.backend.type)
    engine = MockEngine(MockEngineOptions(engine=flavour, token_delay_s=0.05))
    await engine.start("127.0.0.1", 0)
    return engine, engine.url


async def start_pylon(
    settings: Settings, *, registry: CollectorRegistry | None = None
) -> RunningPylon:
    registry = registry if registry is not None else CollectorRegistry()
    configuration = quic_configuration(settings)
    mock_engine, upstream_url = await _start_mock_if_needed(settings)
    upstream = settings.upstream.model_copy(update={"url": upstream_url})
    adapter = build_adapter(settings.backend, settings.priority)
    metrics = Metrics(registry, backend=adapter.name, version=version("pylon"))
    client = build_upstream_client(upstream)
    service = TunnelService(
        adapter=adapter,
        forwarder=Forwarder(client, upstream),
        options=ServiceOptions(
            pipeline=PipelineOptions(
                policy=settings.priority,
                derive_priority=settings.derive_priority,
                extra_health_paths=frozenset(settings.health_paths),
            ),
            max_body_bytes=settings.limits.max_body_bytes,
            total_timeout_s=settings.upstream.total_timeout_s,
        ),
        metrics=metrics,
    )
    host, port = split_host_port(settings.listen)
    try:
        tunnel = await start_tunnel(
            host=host,
            port=port,
            configuration=configuration,
            handler=service,
            options=TunnelOptions(
                max_queued_bytes_per_stream=settings.limits.max_queued_response_bytes,
                request_window_bytes=settings.limits.request_window_bytes,
            ),
        )
    except BaseException:
        await client.aclose()
        if mock_engine is not None:
            with contextlib.suppress(Exception):
                await mock_engine.close()
        raise
    _register_live_gauges(metrics, tunnel)
    return RunningPylon(settings, tunnel, client, metrics, registry, mock_engine, upstream_url)


def _register_live_gauges(metrics: Metrics, tunnel: TunnelServer) -> None:
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
