"""How the forwarder frames each request for the engine, on both upstream transports: the
Host it names, and a body that arrives whole under the length or chunking it declares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.config import UpstreamSettings
from pylon.forwarder import Forwarder, build_upstream_transport, parse_target, response_headers
from pylon.upstream_connection import _framed
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


def _any_casing(name: bytes) -> st.SearchStrategy[bytes]:
    return st.tuples(
        *(st.sampled_from([bytes([c]).lower(), bytes([c]).upper()]) for c in name)
    ).map(b"".join)


@given(
    length_name=_any_casing(b"content-length"),
    length=st.integers(min_value=0, max_value=10**12),
    others=st.lists(
        st.tuples(st.sampled_from([b"content-type", b"x-engine", b"connection"]), st.binary()),
        max_size=4,
    ),
    echo=st.sampled_from([None, "r-7"]),
)
def test_the_engines_length_is_relayed_once_in_any_casing(
    length_name: bytes, length: int, others: list[tuple[bytes, bytes]], echo: str | None
) -> None:
    raw = [*others, (length_name, str(length).encode()), (b"x-request-id", b"engine-made")]
    response = httpx.Response(200, headers=raw)
    headers = response_headers(response, echo)
    lengths = [value for name, value in headers if name == b"content-length"]
    assert lengths == [str(length).encode()]
    assert [value for name, value in headers if name == b"x-request-id"] == (
        [b"r-7"] if echo else []
    )
    assert not any(name == b"connection" for name, _ in headers)


def test_no_length_is_made_up_for_a_response_without_one() -> None:
    response = httpx.Response(200, headers=[(b"Transfer-Encoding", b"chunked")])
    assert response_headers(response, None) == ()


@given(
    name=st.one_of(_any_casing(b"content-length"), _any_casing(b"transfer-encoding")),
    value=st.sampled_from([b"3", b"chunked"]),
)
def test_a_request_that_declares_its_framing_in_any_casing_keeps_it(
    name: bytes, value: bytes
) -> None:
    request = httpx.Request("POST", "http://engine/", headers=[(name, value)], content=b"abc")
    request.headers = httpx.Headers([(name, value)])  # exactly what the caller declared
    headers, body = _framed(request)
    assert (headers, body) == ([(name, value)], b"abc")


def test_a_request_without_framing_gets_a_length() -> None:
    request = httpx.Request("POST", "http://engine/", content=b"abc")
    request.headers = httpx.Headers([(b"host", b"engine")])
    assert _framed(request) == ([(b"host", b"engine"), (b"content-length", b"3")], b"abc")
