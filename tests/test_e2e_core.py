"""End to end: aioquic client -> Pylon (real QUIC on loopback) -> mock engine (real HTTP)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx
import orjson
import pytest

from backends.mock import MockEngineOptions
from tests.harness import CHAT, eventually, run, stack, tunnel_headers
from tests.test_upstream_transport import Engine, Exchange
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

CHAT_BODY = orjson.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
STREAM_BODY = orjson.dumps(
    {"model": "mock-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
)


async def _direct(url: str, body: bytes, request_id: str) -> bytes:
    async with httpx.AsyncClient() as client:
        response = await client.post(
            url + CHAT, content=body, headers=dict(tunnel_headers(request_id))
        )
        return response.content


@pytest.mark.parametrize("body", [CHAT_BODY, STREAM_BODY], ids=["plain", "sse"])
def test_chat_completion_is_byte_exact(tmp_path: Path, body: bytes) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            assert s.engine is not None
            response = await client.request("POST", CHAT, headers=tunnel_headers("r-1"), body=body)
            tunneled = await response.read()
            assert response.status == 200
            assert response.header("x-request-id") == "r-1"
            assert tunneled == await _direct(s.engine.url, body, "r-1")
            if b"stream" in body:
                assert tunneled.endswith(b"data: [DONE]\n\n")

    run(scenario())


def test_streaming_is_incremental(tmp_path: Path) -> None:
    """The first SSE event reaches the gateway while the engine is still generating."""

    async def scenario() -> None:
        engine = MockEngineOptions(tokens=6, token_delay_s=0.2)
        async with stack(tmp_path, engine=engine) as s, s.client() as client:
            assert s.engine is not None
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("inc-1"), body=STREAM_BODY
            )
            chunks = response.chunks()
            first = await anext(chunks)
            assert first.startswith(b"data: ")
            record = s.engine.snapshot()["latest"][f"POST {CHAT}"]["mock-model"]
            assert record["finish_s"] is None, "engine had already finished: not incremental"
            assert record["tokens_sent"] < 6
            rest = b"".join([chunk async for chunk in chunks])
            assert rest.endswith(b"data: [DONE]\n\n")

    run(scenario())


def test_large_request_body_arrives_byte_exact(tmp_path: Path) -> None:
    payload = orjson.dumps({"model": "mock-model", "input": "x" * (6 * 1024 * 1024)})

    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            assert s.engine is not None
            response = await client.request(
                "POST", "/v1/embeddings", headers=tunnel_headers("big-1"), body=payload
            )
            assert response.status == 200
            await response.read()
            record = s.engine.snapshot()["latest"]["POST /v1/embeddings"]["mock-model"]
            assert record["body_bytes"] == len(payload)
            assert record["body_sha256"] == hashlib.sha256(payload).hexdigest()

    run(scenario())


@pytest.mark.parametrize("connections", [1, 4])
def test_200_concurrent_requests(tmp_path: Path, connections: int) -> None:
    async def scenario() -> None:
        engine = MockEngineOptions(tokens=4, token_delay_s=0.01)
        async with stack(tmp_path, engine=engine) as s:
            assert s.engine is not None
            expected = await _direct(s.engine.url, STREAM_BODY, "same-id")

            async def one_connection(index: int) -> list[bytes]:
                async with s.client() as client:

                    async def one(n: int) -> bytes:
                        response = await client.request(
                            "POST", CHAT, headers=tunnel_headers("same-id"), body=STREAM_BODY
                        )
                        assert response.status == 200
                        return await response.read()

                    per_connection = 200 // connections
                    return await asyncio.gather(*(one(n) for n in range(per_connection)))

            results = await asyncio.gather(*(one_connection(i) for i in range(connections)))
            bodies = [body for group in results for body in group]
            assert len(bodies) == 200
            assert all(body == expected for body in bodies)

    run(scenario(), timeout_s=120)


def test_gateway_reset_aborts_the_engine_request(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngineOptions(tokens=200, token_delay_s=0.05)
        async with stack(tmp_path, engine=engine) as s, s.client() as client:
            assert s.engine is not None
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("abort-1"), body=STREAM_BODY
            )
            await anext(response.chunks())
            response.reset()
            engine_ref = s.engine
            assert await eventually(
                lambda: "abort-1" in str(engine_ref.snapshot()["aborted"]), within_s=1.0
            )
            assert s.metric("pylon_cancellations_total", backend="passthrough", by="gateway") == 1

    run(scenario())


def test_engine_down_answers_502_and_keeps_serving(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            stack(tmp_path, engine=None, upstream_url="http://127.0.0.1:9") as s,
            s.client() as client,
        ):
            for attempt in range(2):
                response = await client.request(
                    "POST", CHAT, headers=tunnel_headers(f"down-{attempt}"), body=CHAT_BODY
                )
                body = orjson.loads(await response.read())
                assert response.status == 502
                assert body["error"]["code"] == "upstream_unreachable"
                assert response.header("x-pylon-retry-safe") == "true"

    run(scenario())


def test_engine_dying_mid_stream_resets_the_stream(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngineOptions(tokens=50, token_delay_s=0.01)
        async with stack(tmp_path, engine=engine) as s, s.client() as client:
            assert s.engine is not None
            s.engine.set_behaviour(fail_after_tokens=3)
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("crash-1"), body=STREAM_BODY
            )
            assert response.status == 200
            with pytest.raises(StreamAborted):
                await response.read()
            s.engine.set_behaviour(fail_after_tokens=None)
            again = await client.request(
                "POST", CHAT, headers=tunnel_headers("crash-2"), body=STREAM_BODY
            )
            assert (await again.read()).endswith(b"[DONE]\n\n")

    run(scenario())


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ([("content-type", "application/json")], "bad_tunnel_header"),
        (tunnel_headers("p-1", x_priority="high"), "bad_tunnel_header"),
        (tunnel_headers("p-2", x_priority="-1"), "bad_tunnel_header"),
        (tunnel_headers("p-3", x_priority="4294967296"), "bad_tunnel_header"),
    ],
    ids=["missing-request-id", "priority-word", "priority-negative", "priority-over-u32"],
)
def test_bad_tunnel_headers_get_400_and_connection_survives(
    tmp_path: Path, headers: list[tuple[str, str]], code: str
) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            assert s.engine is not None
            response = await client.request("POST", CHAT, headers=headers, body=CHAT_BODY)
            error = orjson.loads(await response.read())
            assert response.status == 400
            assert error["error"]["code"] == code
            reached = [r for r in s.engine.snapshot()["requests"] if r["path"] == CHAT]
            assert reached == [], "a rejected request reached the engine"
            ok = await client.request("POST", CHAT, headers=tunnel_headers("ok-1"), body=CHAT_BODY)
            assert ok.status == 200
            await ok.read()

    run(scenario())


def test_an_early_error_stops_the_upload_and_reaches_the_gateway(tmp_path: Path) -> None:
    """A 400 sent while the body is still arriving declines the rest of it (STOP_SENDING);
    the gateway stops sending, reads the 400, and the connection serves the next request."""
    body = orjson.dumps({"model": "mock-model", "input": "x" * (2 * 1024 * 1024)})

    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            no_request_id = [("content-type", "application/json")]
            response = await client.request(
                "POST", CHAT, headers=no_request_id, body=body, chunk_size=16 * 1024
            )
            error = orjson.loads(await response.read())
            assert response.status == 400
            assert error["error"]["code"] == "bad_tunnel_header"
            assert response.stream_id not in client._declined, "kept after the upload stopped"
            ok = await client.request("POST", CHAT, headers=tunnel_headers("ok-2"), body=CHAT_BODY)
            assert ok.status == 200
            await ok.read()

    run(scenario())


def test_slow_reader_keeps_queued_bytes_bounded(tmp_path: Path) -> None:
    """A reader that trickles keeps Pylon's unacknowledged bytes near the cap, not the body size."""
    cap = 256 * 1024

    async def scenario() -> None:
        engine = MockEngineOptions(tokens=30_000, token_delay_s=0.0)
        body = orjson.dumps(
            {"model": "mock-model", "stream": True, "max_tokens": 30_000, "messages": []}
        )
        async with (
            stack(tmp_path, engine=engine, limits={"max_queued_response_bytes": cap}) as s,
            s.client(receive_window_bytes=64 * 1024) as client,
        ):
            response = await client.request("POST", CHAT, headers=tunnel_headers("slow"), body=body)
            peak = 0
            received = 0
            next_pause = 0
            async for chunk in response.chunks():
                received += len(chunk)
                peak = max(peak, s.pylon.tunnel.registry.queued_bytes())
                if received >= next_pause:  # trickle: a pause every 64 KiB read
                    next_pause += 64 * 1024
                    await asyncio.sleep(0.02)
            assert received > 4 * 1024 * 1024, "response too small to show the bound"
            # One engine read (httpx reads up to 64 KiB) may land on top of the cap.
            assert peak <= cap + 64 * 1024, f"queued {peak} bytes with a {cap}-byte cap"

    run(scenario(), timeout_s=120)


def test_a_slow_gateway_does_not_count_as_an_idle_engine(tmp_path: Path) -> None:
    """The idle budget covers waiting for the engine, not waiting for the gateway to drain."""

    async def scenario() -> None:
        body = orjson.dumps({"model": "mock-model", "stream": True, "max_tokens": 5000})
        async with (
            stack(
                tmp_path,
                engine=MockEngineOptions(tokens=5000),
                upstream={"idle_timeout_s": 0.3},
                limits={"max_queued_response_bytes": 64 * 1024},
            ) as s,
            s.client(receive_window_bytes=32 * 1024) as client,
        ):
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("slow-gw"), body=body
            )
            chunks = response.chunks()
            first = await anext(chunks)
            await asyncio.sleep(1.0)  # the gateway stalls well past the engine idle budget
            rest = b"".join([chunk async for chunk in chunks])
            assert (first + rest).endswith(b"data: [DONE]\n\n")

    run(scenario())


@pytest.mark.parametrize("transport", ["h11", "httpcore"])
def test_pylon_adds_no_header_and_keeps_no_cookie_between_requests(
    tmp_path: Path, transport: str
) -> None:
    """A proxy is not a user agent: what the engine gets is what the gateway sent
    (less the stripped headers, plus framing), and a Set-Cookie answered to one
    request never rides on another."""

    async def set_cookie(exchange: Exchange) -> None:
        await exchange.reply(b"{}", headers=[("set-cookie", "session=tenant-a; Path=/")])

    async def scenario() -> None:
        async with (
            Engine(set_cookie) as engine,
            stack(
                tmp_path, engine=None, upstream_url=engine.url, upstream={"transport": transport}
            ) as s,
            s.client() as client,
        ):
            for name in ("tenant-a", "tenant-b"):
                response = await client.request(
                    "POST", CHAT, headers=tunnel_headers(name), body=CHAT_BODY
                )
                await response.read()
                assert response.status == 200
                assert response.header("set-cookie") == "session=tenant-a; Path=/"
            forwarded = [e for e in engine.requests if e.request.method == b"POST"]
            assert len(forwarded) == 2  # the readiness probe's GETs aside
            for exchange in forwarded:
                received = {name for name, _ in exchange.request.headers}
                framing = {b"content-length", b"transfer-encoding"}
                assert received - framing == {b"host", b"content-type", b"x-request-id"}

    run(scenario())


def test_an_engine_slow_to_answer_gets_504_at_the_response_header_deadline(
    tmp_path: Path,
) -> None:
    """`upstream.response_header_timeout_s`: the head is 4 s away, the deadline 0.3 s."""

    async def scenario() -> None:
        engine = MockEngineOptions(tokens=8, token_delay_s=0.5)
        upstream = {"response_header_timeout_s": 0.3}
        async with stack(tmp_path, engine=engine, upstream=upstream) as s, s.client() as client:
            loop = asyncio.get_running_loop()
            started = loop.time()
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("slow-head"), body=CHAT_BODY
            )
            body = orjson.loads(await response.read())
            assert (response.status, body["error"]["code"]) == (504, "upstream_timeout")
            assert "no response head in time" in body["error"]["message"]
            assert 0.3 <= loop.time() - started < 3.0
            assert s.metric("pylon_upstream_errors_total", backend="passthrough", kind="timeout")

    run(scenario())


def test_the_total_deadline_answers_504_or_cuts_a_started_stream(tmp_path: Path) -> None:
    """`upstream.total_timeout_s`: before the head a 504; after it, a reset (a cut body
    must never end like a whole one), counted as cancelled by the timeout."""

    async def scenario() -> None:
        engine = MockEngineOptions(tokens=1000, token_delay_s=0.05)
        upstream = {"total_timeout_s": 0.5}
        async with stack(tmp_path, engine=engine, upstream=upstream) as s, s.client() as client:
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers("slow-whole"), body=CHAT_BODY
            )
            body = orjson.loads(await response.read())
            assert (response.status, body["error"]["code"]) == (504, "upstream_timeout")
            assert "total deadline exceeded" in body["error"]["message"]
            streamed = await client.request(
                "POST", CHAT, headers=tunnel_headers("slow-stream"), body=STREAM_BODY
            )
            assert streamed.status == 200
            with pytest.raises(StreamAborted):
                async for _ in streamed.chunks():
                    pass
            assert s.metric("pylon_cancellations_total", backend="passthrough", by="timeout") == 1

    run(scenario())
