"""The listener's 1-RTT routing shortcut sends every datagram where aioquic's server would.

`RoutingQuicServer` looks up a short-header packet's connection by slicing its
destination connection ID; aioquic's `QuicServer` parses the header first.
Both get the same datagrams and the same connection table, and must deliver
each datagram to the same connection (or drop it, or answer it, alike).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aioquic.asyncio.server
import pytest
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from hypothesis import given, settings
from hypothesis import strategies as st

from tunnel.listener import RoutingQuicServer

ADDR = ("127.0.0.1", 4433)
KNOWN_CIDS = [os.urandom(8) for _ in range(3)]


class Recorder:
    """Stands in for a connection's protocol and for the UDP transport."""

    def __init__(self, name: str, log: list[tuple[str, bytes]]) -> None:
        self.name = name
        self._log = log

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._log.append((self.name, data))

    def sendto(self, data: bytes, addr: Any) -> None:
        self._log.append(("sent", data))


def route(server_type: type[QuicServer], datagram: bytes) -> list[tuple[str, bytes]]:
    async def deliver() -> list[tuple[str, bytes]]:
        log: list[tuple[str, bytes]] = []
        server = server_type(configuration=QuicConfiguration(is_client=False))
        server.connection_made(Recorder("transport", log))  # type: ignore[arg-type]
        for index, cid in enumerate(KNOWN_CIDS):
            server._protocols[cid] = Recorder(f"connection-{index}", log)  # type: ignore[assignment]
        server.datagram_received(datagram, ADDR)
        return log

    return asyncio.run(deliver())


def short_header(first_byte: int, cid: bytes, payload: bytes) -> bytes:
    return bytes([first_byte]) + cid + payload


# Below 1200 bytes: aioquic's server would open a connection for a long Initial
# that size, which needs a certificate and is not what is compared here.
PAYLOADS = st.binary(max_size=300)
DATAGRAMS = st.one_of(
    st.binary(max_size=1199),
    st.builds(
        short_header,
        st.integers(min_value=0, max_value=255),
        st.sampled_from(KNOWN_CIDS) | st.binary(max_size=9),
        PAYLOADS,
    ),
)


@settings(max_examples=300, deadline=None)
@given(datagram=DATAGRAMS)
def test_every_datagram_goes_where_aioquic_sends_it(datagram: bytes) -> None:
    assert route(RoutingQuicServer, datagram) == route(QuicServer, datagram)


def test_a_known_connection_gets_its_short_header_packets() -> None:
    datagram = short_header(0x40, KNOWN_CIDS[1], b"\x00" * 40)
    assert route(RoutingQuicServer, datagram) == [("connection-1", datagram)]
    # The long-header bit, or a clear fixed bit, is not a 1-RTT packet: dropped.
    assert route(RoutingQuicServer, short_header(0x00, KNOWN_CIDS[1], b"\x00" * 40)) == []


def test_a_known_connection_is_found_without_parsing_the_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_parse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("header parsed")

    monkeypatch.setattr(aioquic.asyncio.server, "pull_quic_header", no_parse)
    datagram = short_header(0x40, KNOWN_CIDS[2], b"\x00" * 40)
    assert route(RoutingQuicServer, datagram) == [("connection-2", datagram)]
