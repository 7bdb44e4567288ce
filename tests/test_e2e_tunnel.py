"""The tunnel over real QUIC: malformed streams, state released on a long-lived connection."""

from __future__ import annotations

import asyncio
import gc
import socket
from pathlib import Path
from typing import Any

import pytest
from aioquic.h3.connection import ErrorCode

from tests.harness import CHAT, eventually, run, stack, tunnel_headers
from tunnel.client import H3Client
from tunnel.server import TunnelOptions
from tunnel.types import StreamAborted

pytestmark = pytest.mark.e2e

HEAD = (
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"p"),
    (b":path", CHAT.encode()),
)
BODY = b'{"model":"mock-model","messages":[]}'


@pytest.mark.parametrize(
    "headers",
    [
        (*HEAD, (b"X-Request-Id", b"upper")),
        HEAD[1:],
        (*HEAD, (b"transfer-encoding", b"chunked")),
    ],
    ids=["uppercase-name", "missing-method", "connection-specific"],
)
def test_malformed_stream_is_reset_and_connection_keeps_serving(
    tmp_path: Path, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            stream_id = client.open_request(headers, end=True)
            with pytest.raises(StreamAborted) as aborted:
                await client.response(stream_id)
            assert aborted.value.error_code == ErrorCode.H3_MESSAGE_ERROR
            labels = {"backend": "passthrough", "reason": "malformed_request"}
            assert s.metric("pylon_requests_rejected_total", **labels) == 1
            ok = await client.request("POST", CHAT, headers=tunnel_headers("after"), body=BODY)
            assert ok.status == 200
            await ok.read()

    run(scenario())


async def requests_one_at_a_time(client: H3Client, count: int) -> None:
    """Small requests in turn, each answered 200, with a pause for the client's ACK."""
    for index in range(count):
        response = await client.request(
            "POST", CHAT, headers=tunnel_headers(f"one-{index}"), body=BODY
        )
        assert response.status == 200
        await response.read()
        await asyncio.sleep(0.005)


def test_a_small_request_costs_one_datagram_each_way(tmp_path: Path) -> None:
    """The request arrives in one datagram and its ACK leaves with the response
    (tunnel.acks), not in a datagram of its own before it."""
    requests = 20

    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            warm = await client.request("POST", CHAT, headers=tunnel_headers("warm"), body=BODY)
            await warm.read()
            await asyncio.sleep(0.05)  # the handshake's last ACKs
            (protocol,) = s.pylon.tunnel.registry.connections
            quic = protocol._quic
            counts = {"in": 0, "out": 0}
            receive, send = quic.receive_datagram, quic.datagrams_to_send

            def counted_receive(data: bytes, addr: Any, now: float) -> None:
                counts["in"] += 1
                receive(data, addr, now=now)

            def counted_send(now: float) -> list[tuple[bytes, Any]]:
                datagrams = send(now=now)
                counts["out"] += len(datagrams)
                return datagrams

            quic.receive_datagram = counted_receive  # type: ignore[method-assign]
            quic.datagrams_to_send = counted_send  # type: ignore[method-assign]
            await requests_one_at_a_time(client, requests)
            # In: the request and the client's ACK. A few spare for a slow machine.
            assert counts["in"] <= 2 * requests + 4
            assert counts["out"] <= requests + 4

    run(scenario())


def test_the_quic_timer_is_re_armed_only_for_an_earlier_deadline(tmp_path: Path) -> None:
    """Each packet sent or acknowledged moves aioquic's loss deadline later; the
    timer armed for the earlier deadline stays (tunnel.server.timer_can_stay)."""
    requests = 20

    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            warm = await client.request("POST", CHAT, headers=tunnel_headers("warm"), body=BODY)
            await warm.read()
            (protocol,) = s.pylon.tunnel.registry.connections
            counts = {"transmits": 0, "armed": 0, "needless": 0, "late": 0}
            transmit = protocol.transmit

            def counted_transmit() -> None:
                timer, armed_at = protocol._timer, protocol._timer_at
                transmit()
                counts["transmits"] += 1
                rearmed = protocol._timer is not timer and protocol._timer is not None
                counts["armed"] += rearmed
                deadline = protocol._quic.get_timer()
                if rearmed and timer is not None and armed_at is not None and deadline is not None:
                    # The pending timer would have fired in time, yet was replaced.
                    counts["needless"] += armed_at <= deadline
                if deadline is not None and protocol._timer_at is not None:
                    counts["late"] += protocol._timer_at > deadline

            protocol.transmit = counted_transmit  # type: ignore[method-assign]
            await requests_one_at_a_time(client, requests)
            assert counts["late"] == 0, counts  # never armed past the connection's deadline
            assert counts["needless"] == 0, counts
            assert counts["transmits"] >= 2 * requests
            # How often a new timer is due depends on the machine's pace (one per ACK
            # delay at most); the timer stays on most transmits all the same.
            assert counts["transmits"] - counts["armed"] >= requests, counts

    run(scenario())


def test_stream_state_is_freed_on_a_long_lived_connection(tmp_path: Path) -> None:
    """Many requests on one connection (ok, rejected, reset) leave no per-stream state behind."""

    async def scenario() -> None:
        async with stack(tmp_path) as s, s.client() as client:
            for index in range(300):
                kind = index % 3
                if kind == 0:
                    response = await client.request(
                        "POST", CHAT, headers=tunnel_headers(f"ok-{index}"), body=BODY
                    )
                    await response.read()
                elif kind == 1:
                    response = await client.request("POST", CHAT, headers=[], body=BODY)
                    assert response.status == 400
                    await response.read()
                else:
                    response = await client.request(
                        "POST", "/admin/flush", headers=tunnel_headers(f"nf-{index}"), body=BODY
                    )
                    assert response.status == 404
                    await response.read()
            await client.ping()
            (protocol,) = s.pylon.tunnel.registry.connections
            gc.collect()
            # QUIC frees a stream once the peer acknowledged its end: allow for the ACKs.
            freed = await eventually(lambda: protocol.tracked_state_count() == 0, within_s=5)
            assert freed, f"{protocol.tracked_state_count()} per-stream objects left behind"

    run(scenario(), timeout_s=120)


def test_udp_socket_buffers_are_raised(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with stack(tmp_path) as s:
            sock = s.pylon.tunnel._server._transport.get_extra_info("socket")
            cap = int(Path("/proc/sys/net/core/rmem_max").read_text())
            # Linux doubles the request (for its bookkeeping) after capping it at rmem_max.
            expected = min(TunnelOptions().udp_buffer_bytes, cap)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= expected

    run(scenario())
