"""Malformed HTTP/3 from a raw aioquic client against the real listener (RFC 9114).

A malformed request head fails its stream (H3_MESSAGE_ERROR, §4.1.2) and the
connection keeps serving; a framing error on a request stream fails the
connection (§7.1: H3_FRAME_ERROR; §4.1: H3_FRAME_UNEXPECTED). Either way the
engine never sees the bad request, and a fresh connection is served at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from aioquic.asyncio.client import connect
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameType, Setting, encode_frame

from tests.harness import CHAT, Stack, run, stack, tunnel_headers
from tests.security_kit import RecordingClient
from tunnel.client import client_configuration
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

BODY = orjson.dumps({"model": "mock-model", "messages": []})
HEAD = (
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"pylon"),
    (b":path", CHAT.encode()),
    (b"x-request-id", b"bad-1"),
)


@contextlib.asynccontextmanager
async def raw_client(s: Stack) -> AsyncIterator[RecordingClient]:
    async with connect(
        "127.0.0.1",
        s.pylon.port,
        configuration=client_configuration(verify=False),
        create_protocol=RecordingClient,
    ) as client:
        assert isinstance(client, RecordingClient)
        yield client


async def served(client: RecordingClient, request_id: str) -> bool:
    response = await client.request("POST", CHAT, headers=tunnel_headers(request_id), body=BODY)
    await response.read()
    return response.status == 200


def engine_saw(s: Stack, request_id: str) -> bool:
    assert s.engine is not None
    return any(r["x_request_id"] == request_id for r in s.engine.snapshot()["requests"])


STREAM_ERRORS = {
    "uppercase-name": (*HEAD, (b"X-Upper", b"1")),
    "unknown-pseudo": (*HEAD[:4], (b":bogus", b"1"), *HEAD[4:]),
    "pseudo-after-regular": (*HEAD[:3], HEAD[4], HEAD[3]),
    "missing-path": (*HEAD[:3], HEAD[4]),
    "duplicate-method": ((b":method", b"GET"), *HEAD),
    "connection-header": (*HEAD, (b"connection", b"keep-alive")),
}


@pytest.mark.parametrize("headers", STREAM_ERRORS.values(), ids=STREAM_ERRORS.keys())
def test_malformed_head_fails_only_its_stream(
    tmp_path: Path, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, raw_client(s) as client:
            stream_id = client.open_request(headers, end=True)
            with pytest.raises(StreamAborted) as aborted:
                await client.response(stream_id)
            assert aborted.value.error_code == ErrorCode.H3_MESSAGE_ERROR
            assert await served(client, "same-connection")
            assert client.terminated is None
            assert not engine_saw(s, "bad-1")

    run(scenario())


CONNECTION_ERRORS = {
    # §4.1: a request stream starts with HEADERS.
    "data-before-headers": (encode_frame(FrameType.DATA, b"x"), ErrorCode.H3_FRAME_UNEXPECTED),
    # §7.2.4: SETTINGS only on the control stream.
    "settings-on-request-stream": (
        encode_frame(FrameType.SETTINGS, b""),
        ErrorCode.H3_FRAME_UNEXPECTED,
    ),
    # §7.2.8: HTTP/2 frame types are reserved and an error on any stream.
    "http2-priority-frame": (encode_frame(0x02, b"\x00" * 5), ErrorCode.H3_FRAME_UNEXPECTED),
    # §7.1: a frame cut short by the end of the stream.
    "truncated-headers": (
        encode_uint_var(FrameType.HEADERS) + encode_uint_var(100) + b"\x00" * 10,
        ErrorCode.H3_FRAME_ERROR,
    ),
    "truncated-frame-header": (encode_uint_var(FrameType.HEADERS), ErrorCode.H3_FRAME_ERROR),
    # A QPACK bomb: 100 KB naming one dynamic entry 100,000 times (up to 400 MB
    # decoded with a 4 KiB table). Pylon offers no dynamic table, so any
    # reference is a decompression failure (RFC 9204 §2.2.3), found at once.
    "qpack-dynamic-reference": (
        encode_frame(FrameType.HEADERS, b"\x02\x00" + b"\x80" * 100_000),
        ErrorCode.QPACK_DECOMPRESSION_FAILED,
    ),
}


def test_pylon_offers_no_qpack_dynamic_table(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, raw_client(s) as client:
            assert await served(client, "ok")
            settings = client._h3.received_settings
            assert settings is not None
            assert settings[Setting.QPACK_MAX_TABLE_CAPACITY] == 0
            assert settings[Setting.QPACK_BLOCKED_STREAMS] == 0

    run(scenario())


def test_pylon_encodes_responses_without_the_clients_dynamic_table(tmp_path: Path) -> None:
    """The client offers aioquic's 4 KiB table; a response that used it would cost the
    client a Section Acknowledgment on its decoder stream, and Pylon an ACK for that."""

    async def scenario() -> None:
        async with stack(tmp_path) as s, raw_client(s) as client:
            sent = client._h3.sent_settings
            assert sent is not None and sent[Setting.QPACK_MAX_TABLE_CAPACITY] > 0
            for n in range(5):  # the same response fields again and again
                assert await served(client, f"same-fields-{n}")
            assert client._h3._encoder_bytes_received == 0  # no insertions
            assert client._h3._decoder_bytes_sent == 0  # nothing to acknowledge

    run(scenario())


@pytest.mark.parametrize(
    ("raw", "error_code"), CONNECTION_ERRORS.values(), ids=CONNECTION_ERRORS.keys()
)
def test_framing_error_fails_the_connection_and_a_fresh_one_is_served(
    tmp_path: Path, raw: bytes, error_code: ErrorCode
) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            async with raw_client(s) as client:
                stream_id = client._quic.get_next_available_stream_id()
                client._quic.send_stream_data(stream_id, raw, end_stream=True)
                client.transmit()
                await client.wait_closed()
                assert client.terminated is not None
                assert client.terminated.error_code == error_code
            async with raw_client(s) as fresh:
                assert await served(fresh, "fresh")

    run(scenario())
