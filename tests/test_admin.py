"""End-to-end tests of the admin server (/healthz, /readyz, /metrics) and readiness.

Real parts only: a MockEngine on port 0, `start_pylon` with its tunnel and
admin listeners on port 0, an aioquic client playing the gateway, and httpx
talking to the admin port. Plain `asyncio.run`, no pytest plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from backends.mock import MockEngine, MockEngineOptions
from pylon.admin import AdminRoutes, start_admin
from pylon.app import RunningPylon, start_pylon
from pylon.config import Settings, UpstreamSettings
from pylon.logs import JsonFormatter
from pylon.readiness import Readiness
from tunnel.client import ClientResponse, client_configuration, open_client

PROBE_INTERVAL_S = 0.05
DOC = Path(__file__).parent.parent / "docs" / "observability.md"
CHAT = "/v1/chat/completions"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def settings_for(tmp_path: Path, upstream_url: str, **extra: Any) -> Settings:
    return Settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        dev=True,
        state_dir=tmp_path,
        upstream=UpstreamSettings(url=upstream_url),
        **extra,
    )


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path,
) -> AsyncIterator[tuple[MockEngine, RunningPylon, httpx.AsyncClient]]:
    engine = MockEngine(MockEngineOptions())
    await engine.start()
    try:
        pylon = await start_pylon(
            settings_for(tmp_path, engine.url), probe_interval_s=PROBE_INTERVAL_S
        )
        try:
            base_url = f"http://127.0.0.1:{pylon.admin_port}"
            async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=5) as admin:
                yield engine, pylon, admin
        finally:
            await pylon.close()
    finally:
        await engine.close()


def status_is(admin: httpx.AsyncClient, path: str, status: int) -> Callable[[], Any]:
    async def check() -> bool:
        return (await admin.get(path)).status_code == status

    return check


async def tunnel_request(
    port: int, *, headers: list[tuple[str, str]] | None = None
) -> tuple[ClientResponse, bytes]:
    base = [("x-request-id", "r1"), ("content-type", "application/json")]
    async with open_client(
        "127.0.0.1", port, configuration=client_configuration(verify=False)
    ) as client:
        response = await client.request(
            "POST", CHAT, headers=base + (headers or []), body=b'{"model":"m","messages":[]}'
        )
        body = await response.read()
    return response, body


def family_of(sample: str) -> str:
    """The documented name a scraped sample belongs to (a counter's `_created` drops `_total`)."""
    for suffix in ("_bucket", "_sum", "_count", "_created"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --- liveness and readiness ------------------------------------------------------


def test_healthz_answers_from_the_event_loop(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (_, _, admin):
            response = await admin.get("/healthz")
            assert (response.status_code, response.text) == (200, "ok\n")
            assert (await admin.head("/healthz")).status_code == 200

    run(scenario())


def test_readyz_follows_the_engine_health_probe(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (engine, pylon, admin):
            await wait_for(status_is(admin, "/readyz", 200))
            assert (
                pylon.registry.get_sample_value("pylon_engine_ready", {"backend": "passthrough"})
                == 1
            )
            engine.set_behaviour(health_status=503)
            await wait_for(status_is(admin, "/readyz", 503), timeout_s=10 * PROBE_INTERVAL_S + 1)
            assert "engine_not_ready" in (await admin.get("/readyz")).text
            assert (
                pylon.registry.get_sample_value("pylon_engine_ready", {"backend": "passthrough"})
                == 0
            )
            labels = {"backend": "passthrough", "result": "unhealthy"}
            assert (pylon.registry.get_sample_value("pylon_engine_probes_total", labels) or 0) >= 1
            engine.set_behaviour(health_status=200)
            await wait_for(status_is(admin, "/readyz", 200))

    run(scenario())


def test_readyz_fails_once_draining_even_with_a_healthy_engine(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (_, pylon, admin):
            await wait_for(status_is(admin, "/readyz", 200))
            pylon.readiness.mark_draining()
            response = await admin.get("/readyz")
            assert response.status_code == 503
            assert "draining" in response.text
            assert pylon.registry.get_sample_value("pylon_ready") == 0
            assert (await admin.get("/healthz")).status_code == 200

    run(scenario())


def test_unreachable_engine_is_not_ready(tmp_path: Path) -> None:
    async def scenario() -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{unused.getsockname()[1]}"
            pylon = await start_pylon(settings_for(tmp_path, dead_url), probe_interval_s=0.05)
        try:
            labels = {"backend": "passthrough", "result": "unreachable"}

            async def probed() -> bool:
                return (
                    pylon.registry.get_sample_value("pylon_engine_probes_total", labels) or 0
                ) > 0

            await wait_for(probed)
            assert not pylon.readiness.ready
            assert pylon.readiness.reasons() == ["engine_not_ready"]
        finally:
            await pylon.close()

    run(scenario())


@pytest.mark.parametrize(
    ("listener_up", "draining", "engine_ready", "status", "body"),
    [
        (True, False, True, 200, "ready\n"),
        (True, False, False, 503, "not ready: engine_not_ready\n"),
        (True, True, True, 503, "not ready: draining\n"),
        (False, True, False, 503, "not ready: listener_down, draining, engine_not_ready\n"),
    ],
)
def test_readyz_combines_the_three_flags(
    listener_up: bool, draining: bool, engine_ready: bool, status: int, body: str
) -> None:
    readiness = Readiness(listener_up=listener_up, draining=draining, engine_ready=engine_ready)
    response = AdminRoutes(registry=CollectorRegistry(), readiness=readiness).respond(
        "GET", "/readyz"
    )
    assert (response.status, response.body.decode()) == (status, body)
    assert readiness.ready is (status == 200)


def test_a_failing_collector_answers_500_and_the_server_keeps_serving() -> None:
    def broken() -> float:
        raise RuntimeError("gauge exploded")

    async def scenario() -> None:
        registry = CollectorRegistry()
        Gauge("broken", "A gauge whose read fails.", registry=registry).set_function(broken)
        server = await start_admin("127.0.0.1", 0, registry=registry, readiness=Readiness())
        try:
            base_url = f"http://127.0.0.1:{server.port}"
            async with httpx.AsyncClient(base_url=base_url, trust_env=False) as admin:
                assert (await admin.get("/metrics")).status_code == 500
                assert (await admin.get("/healthz")).status_code == 200
        finally:
            await server.close()

    run(scenario())


# --- /metrics ------------------------------------------------------------------------


def test_metrics_parse_and_count_a_real_http3_request(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (_, pylon, admin):
            labels = frozenset(
                {"backend": "passthrough", "route": "inference", "status_class": "2xx"}.items()
            )
            before = samples((await admin.get("/metrics")).text)
            assert before[("pylon_requests_total", labels)] == 0  # pre-created
            response, body = await tunnel_request(pylon.port)
            assert response.status == 200 and body
            scraped = await admin.get("/metrics")
            assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
            after = samples(scraped.text)
            assert after[("pylon_requests_total", labels)] == 1
            assert after[
                ("pylon_response_bytes_total", frozenset({("backend", "passthrough")}))
            ] == len(body)
            assert (
                "pylon_build_info",
                frozenset({("backend", "passthrough"), ("version", "0.1.0")}),
            ) in after
            # The client has closed; the server learns of it a moment later.
            for _ in range(500):
                gauges = samples((await admin.get("/metrics")).text)
                if gauges[("pylon_open_connections", frozenset())] == 0:
                    break
                await asyncio.sleep(0.01)
            assert gauges[("pylon_open_connections", frozenset())] == 0

    run(scenario())


SUPERVISOR_METRICS = {
    "pylon_workers",
    "pylon_workers_running",
    "pylon_worker_restarts_total",
    "pylon_worker_scrape_failures_total",
    "pylon_workers_steered",
}
"""Only a multi-process Pylon has these (tests/test_workers.py checks them)."""


def documented_metrics() -> set[str]:
    return set(re.findall(r"`(pylon_[a-z_]+)`", DOC.read_text()))


def test_every_scraped_pylon_metric_is_documented_and_vice_versa(tmp_path: Path) -> None:
    async def scenario() -> set[str]:
        async with running(tmp_path) as (_, _, admin):
            text = (await admin.get("/metrics")).text
        return {name for name, _ in samples(text) if name.startswith("pylon_")}

    scraped = asyncio.run(scenario())
    documented = documented_metrics() - SUPERVISOR_METRICS
    families = {family_of(sample) for sample in scraped}
    undocumented = {f for f in families if f not in documented and f + "_total" not in documented}
    stale = {d for d in documented if d not in scraped and d + "_bucket" not in scraped}
    assert (undocumented, stale) == (set(), set())


def test_unknown_path_and_method_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (_, _, admin):
            assert (await admin.get("/nope")).status_code == 404
            assert (await admin.post("/metrics", content=b"x")).status_code == 405
            assert (await admin.get("/healthz?verbose=1")).status_code == 200

    run(scenario())


def test_malformed_request_gets_400_and_close(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (_, pylon, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", pylon.admin_port)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            reply = await reader.read()
            writer.close()
            await writer.wait_closed()
            assert reply.startswith(b"HTTP/1.1 400 ")

    run(scenario())


def test_close_stops_the_admin_server_and_the_listener(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (_, pylon, admin):
            await admin.get("/healthz")  # leaves a keep-alive connection open
            port = pylon.admin_port
            await pylon.close()
            assert not pylon.readiness.listener_up
            with pytest.raises(httpx.TransportError):
                await admin.get("/healthz")
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)

    run(scenario())


def test_admin_port_in_use_fails_start_up_cleanly(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions())
        await engine.start()
        try:
            with socket.socket() as taken:
                taken.bind(("127.0.0.1", 0))
                taken.listen()
                address = f"127.0.0.1:{taken.getsockname()[1]}"
                settings = settings_for(tmp_path, engine.url).model_copy(
                    update={"admin_listen": address}
                )
                with pytest.raises(OSError):
                    await start_pylon(settings)
        finally:
            await engine.close()

    run(scenario())


# --- what reaches the engine and the access log -------------------------------------


def test_trace_context_passes_through_unchanged(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(tmp_path) as (engine, pylon, _):
            trace = [("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)]
            response, _ = await tunnel_request(pylon.port, headers=trace)
            assert response.status == 200
            (record,) = [r for r in engine.snapshot()["requests"] if r["path"] == CHAT]
            seen = {name: value for name, value in record["headers"]}
            assert seen["traceparent"] == TRACEPARENT
            assert seen["tracestate"] == TRACESTATE

    run(scenario())


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_one_json_access_line_per_request(tmp_path: Path) -> None:
    access = logging.getLogger("pylon.access")
    handler, level = _Lines(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        run(_one_request(tmp_path))
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    (line,) = [json.loads(text) for text in handler.lines]
    assert line["msg"] == "request finished"
    assert line["request_id"] == "r1"
    assert (line["backend"], line["route"], line["status"]) == ("passthrough", "inference", 200)
    assert line["request_bytes"] == len(b'{"model":"m","messages":[]}')
    assert line["response_bytes"] > 0 and line["ttfb_s"] > 0 and line["duration_s"] > 0
    assert line["cancelled_by"] is None and "emitted_priority" in line
    assert "messages" not in json.dumps(line)  # never a body


async def _one_request(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, pylon, _):
        await tunnel_request(pylon.port)
