"""0-RTT: off by default (no tickets issued); when enabled, only replay-safe requests are
served from early data and the rest get 425; tickets are single use."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from aioquic.asyncio.client import connect
from aioquic.tls import SessionTicket

from backends.mock import MockEngine, MockEngineOptions
from pylon.app import RunningPylon, start_pylon
from pylon.config import Settings
from pylon.devcert import ensure_dev_certificate
from tests.harness import CHAT, run, tunnel_headers
from tunnel.client import H3Client, client_configuration
from tunnel.listener import SingleUseTickets

pytestmark = pytest.mark.e2e

BODY = orjson.dumps({"model": "mock-model", "messages": []})


@contextlib.asynccontextmanager
async def pylon_with(tmp_path: Path, *, enable_0rtt: bool) -> AsyncIterator[RunningPylon]:
    engine = MockEngine(MockEngineOptions())
    await engine.start()
    cert, key = ensure_dev_certificate(tmp_path)
    settings = Settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        tls={"cert_file": cert, "key_file": key},
        upstream={"url": engine.url},
        auth={"insecure_no_auth": True},
        security={"enable_0rtt": enable_0rtt},
    )
    pylon = await start_pylon(settings)
    try:
        yield pylon
    finally:
        await pylon.close()
        await engine.close()


async def first_visit(port: int) -> list[SessionTicket]:
    tickets: list[SessionTicket] = []
    async with connect(
        "127.0.0.1",
        port,
        configuration=client_configuration(verify=False),
        create_protocol=H3Client,
        session_ticket_handler=tickets.append,
    ) as client:
        assert isinstance(client, H3Client)
        response = await client.request("POST", CHAT, headers=tunnel_headers("first"), body=BODY)
        assert response.status == 200
        await response.read()
        await client.ping()
    return tickets


def test_no_tickets_by_default(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pylon_with(tmp_path, enable_0rtt=False) as pylon:
            assert await first_visit(pylon.port) == []

    run(scenario())


def test_early_data_serves_only_replay_safe_requests(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pylon_with(tmp_path, enable_0rtt=True) as pylon:
            tickets = await first_visit(pylon.port)
            assert tickets, "no resumption ticket issued"
            configuration = client_configuration(verify=False)
            configuration.session_ticket = tickets[-1]
            async with connect(
                "127.0.0.1",
                pylon.port,
                configuration=configuration,
                create_protocol=H3Client,
                wait_connected=False,
            ) as client:
                assert isinstance(client, H3Client)
                # Both requests leave before the handshake completes: 0-RTT data.
                post = client.open_request(
                    (
                        (b":method", b"POST"),
                        (b":scheme", b"https"),
                        (b":authority", b"p"),
                        (b":path", CHAT.encode()),
                        (b"x-request-id", b"early-post"),
                    ),
                    end=True,
                )
                get = client.open_request(
                    (
                        (b":method", b"GET"),
                        (b":scheme", b"https"),
                        (b":authority", b"p"),
                        (b":path", b"/health"),
                    ),
                    end=True,
                )
                refused, served = await client.response(post), await client.response(get)
                assert client._quic.tls.early_data_accepted, "the requests were not early data"
                error = orjson.loads(await refused.read())
                assert refused.status == 425
                assert error["error"]["code"] == "too_early"
                assert refused.header("x-pylon-retry-safe") == "true"
                assert served.status == 200
                await served.read()
                after = await client.request(
                    "POST", CHAT, headers=tunnel_headers("late"), body=BODY
                )
                assert after.status == 200, "after the handshake the same request is served"
                await after.read()
            rejected = pylon.registry.get_sample_value(
                "pylon_requests_rejected_total", {"backend": "passthrough", "reason": "too_early"}
            )
            assert rejected == 1

    run(scenario())


def test_tickets_are_single_use_and_bounded() -> None:
    store = SingleUseTickets(capacity=2)
    tickets = [SessionTicket(*[None] * 8) for _ in range(3)]  # type: ignore[arg-type]
    for index, ticket in enumerate(tickets):
        ticket.ticket = bytes([index])
        store.add(ticket)
    assert store.take(b"\x00") is None, "the oldest ticket beyond capacity is dropped"
    assert store.take(b"\x01") is tickets[1]
    assert store.take(b"\x01") is None, "a ticket is accepted once"
