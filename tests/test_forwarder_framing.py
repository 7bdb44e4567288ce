"""How the forwarder frames each request for the engine, on both upstream transports: the
Host it names, and a body that arrives whole under the length or chunking it declares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pylon.config import UpstreamSettings
from pylon.forwarder import Forwarder, build_upstream_transport, parse_target
from tests.harness import run
from tests.test_upstream_transport import Engine, Exchange, ok

TRANSPORTS = ["h11", "httpcore"]


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset : offset + size]
        await asyncio.sleep(0)


async def forwarded(
    transport: str, *, method: str, content: bytes | AsyncIterator[bytes]
) -> tuple[Exchange, bytes]:
    """The request as the engine received it, and the body Pylon got back."""
    async with Engine(ok) as engine:
        settings = UpstreamSettings(url=engine.url, transport=transport)
        upstream = build_upstream_transport(settings)
        forwarder = Forwarder(upstream, settings)
        headers = ((b"content-type", b"application/json"),)
        async with forwarder.exchange(
            method=method, path="/v1/echo", headers=headers, content=content, request_id="r-1"
        ) as response:
            chunks = [chunk async for chunk in response.chunks()]
        await upstream.aclose()
        (exchange,) = engine.requests
        return exchange, b"".join(chunks)


def names(exchange: Exchange) -> list[bytes]:
    return [name.lower() for name, _ in exchange.request.headers]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_buffered_body_goes_with_its_length_and_one_host(transport: str) -> None:
    body = b'{"prompt": "' + b"x" * 3000 + b'"}'

    async def scenario() -> None:
        exchange, answer = await forwarded(transport, method="POST", content=body)
        assert exchange.body == body
        assert answer == b"ok:" + body
        assert exchange.header(b"content-length") == str(len(body)).encode()
        assert names(exchange).count(b"host") == 1
        assert b"transfer-encoding" not in names(exchange)

    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_streamed_body_goes_chunked_and_arrives_whole(transport: str) -> None:
    body = bytes(range(256)) * 300

    async def scenario() -> None:
        exchange, _ = await forwarded(transport, method="POST", content=pieces(body, 1000))
        assert exchange.body == body
        assert exchange.header(b"transfer-encoding") == b"chunked"
        assert b"content-length" not in names(exchange)

    run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("method", "length"), [("POST", b"0"), ("GET", None)])
def test_an_empty_body_is_declared_as_httpx_declares_it(
    transport: str, method: str, length: bytes | None
) -> None:
    async def scenario() -> None:
        exchange, _ = await forwarded(transport, method=method, content=b"")
        assert exchange.body == b""
        assert exchange.header(b"content-length") == length
        assert b"transfer-encoding" not in names(exchange)

    run(scenario())


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://engine.internal:8000/v1/x", b"engine.internal:8000"),
        ("http://engine.internal/v1/x", b"engine.internal"),
        ("https://engine.internal:443/v1/x", b"engine.internal"),
        ("http://[::1]:8000/v1/x", b"[::1]:8000"),
    ],
)
def test_the_host_names_the_port_only_when_it_is_not_the_default(url: str, host: bytes) -> None:
    assert parse_target(url)[1] == host
