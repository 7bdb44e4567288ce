"""Every limit hit once, end to end: the answer the gateway gets and the metric that counts it.

Body size (413), header section (431, and a reset for a HEADERS frame too big
to buffer), concurrent streams per connection and in total (503, retry-safe),
open connections (CONNECTION_CLOSE with CONNECTION_REFUSED), a request body
that stops arriving (408, or a reset once the engine saw part of it) and the
QUIC idle timeout. After each, the same or a fresh connection is served.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from aioquic.asyncio.client import connect
from aioquic.h3.connection import ErrorCode
from aioquic.quic.packet import QuicErrorCode

from backends.mock import MockEngineOptions
from tests.harness import CHAT, Stack, eventually, run, stack, tunnel_headers
from tests.security_kit import RecordingClient
from tunnel.client import ClientResponse, H3Client, client_configuration
from tunnel.limits import STREAM_CREDIT_HEADROOM
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

BODY = orjson.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
STREAM_BODY = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
SLOW_ENGINE = MockEngineOptions(tokens=8, token_delay_s=0.05)
"""Streams that stay busy long enough (0.4 s) for one more request to be refused."""
BACKEND = "passthrough"


def rejected(s: Stack, reason: str, backend: str = BACKEND) -> float:
    return s.metric("pylon_requests_rejected_total", backend=backend, reason=reason)


def engine_paths(s: Stack) -> list[str]:
    assert s.engine is not None
    return [record["path"] for record in s.engine.snapshot()["requests"]]


async def error_of(response: ClientResponse) -> str:
    return str(orjson.loads(await response.read())["error"]["code"])


async def served(client: H3Client, request_id: str) -> bool:
    response = await client.request("POST", CHAT, headers=tunnel_headers(request_id), body=BODY)
    await response.read()
    return response.status == 200


def test_body_over_the_limit_gets_413(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path, limits={"max_body_bytes": 1024}) as s, s.client() as client:
            big = orjson.dumps({"model": "mock-model", "input": "x" * 4096})
            response = await client.request("POST", CHAT, headers=tunnel_headers("big"), body=big)
            assert (response.status, await error_of(response)) == (413, "body_too_large")
            assert rejected(s, "body_too_large") == 1
            assert await served(client, "after")

    run(scenario())


def test_header_section_over_the_limit_gets_431_and_a_huge_frame_is_reset(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path, limits={"max_header_bytes": 4096}) as s, s.client() as client:
            headers = [*tunnel_headers("h-1"), ("x-big", "a" * 5000)]
            response = await client.request("POST", CHAT, headers=headers, body=BODY)
            assert (response.status, await error_of(response)) == (431, "header_too_large")
            assert rejected(s, "header_too_large") == 1
            # Incompressible, so the encoded frame is over twice the limit: never decoded.
            headers = [*tunnel_headers("h-2"), ("x-huge", os.urandom(10_000).hex())]
            with pytest.raises(StreamAborted) as aborted:
                await client.request("POST", CHAT, headers=headers, body=BODY)
            assert aborted.value.error_code == ErrorCode.H3_MESSAGE_ERROR
            assert rejected(s, "header_too_large") == 2
            assert CHAT not in engine_paths(s)
            assert await served(client, "after")

    run(scenario())


async def open_streams(client: H3Client, count: int, prefix: str) -> list[ClientResponse]:
    """Streaming requests that are being served (their first token has arrived)."""
    responses = []
    for index in range(count):
        response = await client.request(
            "POST", CHAT, headers=tunnel_headers(f"{prefix}-{index}"), body=STREAM_BODY
        )
        assert response.status == 200
        await anext(response.chunks())
        responses.append(response)
    return responses


async def refused_503(client: H3Client, code: str) -> None:
    response = await client.request("POST", CHAT, headers=tunnel_headers("over"), body=BODY)
    assert (response.status, await error_of(response)) == (503, code)
    assert response.header("x-pylon-retry-safe") == "true"


def test_streams_over_the_per_connection_limit_get_503(tmp_path: Path) -> None:
    limits = {"max_streams_per_connection": 2}

    async def scenario() -> None:
        async with stack(tmp_path, engine=SLOW_ENGINE, limits=limits) as s, s.client() as client:
            # QUIC stream credit follows the limit (aioquic's own default is 128).
            assert client._quic._remote_max_streams_bidi == 2 + STREAM_CREDIT_HEADROOM
            busy = await open_streams(client, 2, "busy")
            await refused_503(client, "connection_stream_limit")
            assert rejected(s, "connection_stream_limit") == 1
            async with s.client() as other:  # the limit is per connection
                assert await served(other, "other-connection")
            for response in busy:
                await response.read()
            assert await served(client, "after")

    run(scenario())


def test_streams_over_the_total_limit_get_503(tmp_path: Path) -> None:
    limits = {"max_streams_total": 2}

    async def scenario() -> None:
        async with (
            stack(tmp_path, engine=SLOW_ENGINE, limits=limits) as s,
            s.client() as first,
            s.client() as second,
        ):
            busy = await open_streams(first, 2, "busy")
            await refused_503(second, "total_stream_limit")
            assert rejected(s, "total_stream_limit") == 1
            for response in busy:
                await response.read()
            assert await served(second, "after")

    run(scenario())


def test_connections_over_the_limit_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path, limits={"max_connections": 1}) as s:
            async with s.client() as client:
                protocols: list[RecordingClient] = []

                def create(*args: Any, **kwargs: Any) -> RecordingClient:
                    protocols.append(RecordingClient(*args, **kwargs))
                    return protocols[-1]

                configuration = client_configuration(verify=False)
                with pytest.raises(ConnectionError):
                    async with connect(
                        "127.0.0.1",
                        s.pylon.port,
                        configuration=configuration,
                        create_protocol=create,
                    ):
                        pass
                (refused,) = protocols
                assert refused.terminated is not None
                assert refused.terminated.error_code == QuicErrorCode.CONNECTION_REFUSED
                assert (
                    s.metric(
                        "pylon_connections_refused_total",
                        backend=BACKEND,
                        reason="connection_limit",
                    )
                    == 1
                )
                assert await served(client, "still-open")
            registry = s.pylon.tunnel.registry
            assert await eventually(lambda: not registry.connections, within_s=5)
            async with s.client() as fresh:
                assert await served(fresh, "fresh")

    run(scenario())


async def stalled_body(client: H3Client, request_id: str) -> ClientResponse:
    """Head and half a body, then silence (a slow-loris gateway)."""
    head = (
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":authority", b"pylon"),
        (b":path", CHAT.encode()),
        *((name.encode(), value.encode()) for name, value in tunnel_headers(request_id)),
    )
    stream_id = client.open_request(head, end=False)
    client.send_body(stream_id, BODY[: len(BODY) // 2], end=False)
    return await client.response(stream_id)


IDLE = {"request_body_idle_timeout_s": 0.3}


def test_stalled_body_gets_408_before_anything_reached_the_engine(tmp_path: Path) -> None:
    """vLLM bodies are sanitized, so buffered whole: the engine has seen nothing yet."""
    engine = MockEngineOptions(engine="vllm")

    async def scenario() -> None:
        async with (
            stack(tmp_path, engine=engine, backend={"type": "vllm"}, limits=IDLE) as s,
            s.client() as client,
        ):
            response = await stalled_body(client, "slow")
            assert (response.status, await error_of(response)) == (408, "body_idle_timeout")
            assert rejected(s, "body_idle_timeout", backend="vllm") == 1
            assert CHAT not in engine_paths(s)
            assert await served(client, "after")

    run(scenario())


def test_stalled_body_resets_the_stream_once_the_engine_saw_part_of_it(tmp_path: Path) -> None:
    """Passthrough streams the body to the engine: a partial request must not look whole."""

    async def scenario() -> None:
        async with stack(tmp_path, limits=IDLE) as s, s.client() as client:
            with pytest.raises(StreamAborted) as aborted:
                await stalled_body(client, "slow")
            assert aborted.value.error_code == ErrorCode.H3_REQUEST_INCOMPLETE
            assert rejected(s, "body_idle_timeout") == 1
            assert s.metric("pylon_cancellations_total", backend=BACKEND, by="limit") == 1
            assert await served(client, "after")

    run(scenario())


def test_quic_idle_timeout_closes_a_silent_connection(tmp_path: Path) -> None:
    settings: dict[str, Any] = {"quic_idle_timeout_s": 0.5, "quic_ping_interval_s": 0}

    async def scenario() -> None:
        async with stack(tmp_path, **settings) as s:
            async with s.client() as client:
                assert await served(client, "before")
                assert s.metric("pylon_open_connections") == 1
                await asyncio.sleep(0.6)
                assert await eventually(lambda: s.metric("pylon_open_connections") == 0, within_s=3)
            async with s.client() as fresh:
                assert await served(fresh, "fresh")

    run(scenario())
