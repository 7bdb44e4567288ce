"""The HTTP/3 listener: binds the UDP port and tracks its connections.

`start_tunnel` turns a QuicConfiguration and a handler into a bound
`TunnelServer`; the `ConnectionRegistry` is what gauges read at scrape time
and what a drain uses to send GOAWAY on every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, ErrorCode
from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import SessionTicket

from tunnel.server import TunnelOptions, TunnelProtocol
from tunnel.stream import Handler


class ConnectionRegistry:
    """Open tunnel connections, read at scrape time by gauges."""

    def __init__(self) -> None:
        self.connections: set[TunnelProtocol] = set()
        self.draining = False

    def start_drain(self) -> None:
        """GOAWAY on every connection, and on any that opens from now on."""
        self.draining = True
        for protocol in self.connections:
            protocol.send_goaway()

    def opened(self, protocol: TunnelProtocol) -> None:
        self.connections.add(protocol)

    def closed(self, protocol: TunnelProtocol) -> None:
        self.connections.discard(protocol)

    def active_streams(self) -> int:
        return sum(len(protocol.streams) for protocol in self.connections)

    def queued_bytes(self) -> int:
        return sum(protocol.queued_bytes() for protocol in self.connections)


class SingleUseTickets:
    """Resumption tickets, each accepted once (RFC 8446 §8.1): a replayed ClientHello
    finds its ticket gone, so its early data is rejected. Bounded, oldest dropped first."""

    def __init__(self, *, capacity: int = 100_000) -> None:
        self._tickets: OrderedDict[bytes, SessionTicket] = OrderedDict()
        self._capacity = capacity

    def add(self, ticket: SessionTicket) -> None:
        self._tickets[ticket.ticket] = ticket
        while len(self._tickets) > self._capacity:
            self._tickets.popitem(last=False)

    def take(self, label: bytes) -> SessionTicket | None:
        return self._tickets.pop(label, None)


SHORT_HEADER_FIXED_BIT = 0x40
"""RFC 9000 §17.3: a 1-RTT packet's first byte has the long-header bit clear, this one set."""


class RoutingQuicServer(QuicServer):
    """aioquic's server, routing 1-RTT packets to their connection without a header parse.

    After the handshake every datagram of a connection is a short-header packet
    whose destination connection ID, of the length Pylon issues, starts at its
    second byte. aioquic parses the whole header into an object for each
    datagram only to take that ID (1.2 µs of the 37 µs a body datagram
    costs); the ID is sliced here instead. Anything else (long headers, an
    unknown ID, a clear fixed bit) takes aioquic's own path, which decides.
    The connection parses the packet in full either way.
    """

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        datagram = cast(bytes, data)
        if datagram and datagram[0] & 0xC0 == SHORT_HEADER_FIXED_BIT:
            cid_length = self._configuration.connection_id_length
            protocol = self._protocols.get(datagram[1 : 1 + cid_length])
            if protocol is not None:
                protocol.datagram_received(data, addr)
                return
        super().datagram_received(data, addr)


class TunnelServer:
    """A bound HTTP/3 listener; `port` is the real port when 0 was asked for."""

    def __init__(self, server: RoutingQuicServer, registry: ConnectionRegistry) -> None:
        self._server = server
        self.registry = registry

    @property
    def port(self) -> int:
        transport = self._server._transport
        assert transport is not None
        return int(transport.get_extra_info("sockname")[1])

    def close(self) -> None:
        for protocol in list(self.registry.connections):
            protocol.close(error_code=ErrorCode.H3_NO_ERROR)
        self._server.close()


async def start_tunnel(
    *,
    host: str,
    port: int,
    configuration: QuicConfiguration,
    handler: Handler,
    options: TunnelOptions,
    registry_factory: Callable[[], ConnectionRegistry] = ConnectionRegistry,
    sock: socket.socket | None = None,
) -> TunnelServer:
    """Bind the UDP port and serve HTTP/3 on it.

    `sock`, when given, is an already bound UDP socket to serve on instead of
    binding `host:port`: a worker process gets its socket of the port's
    SO_REUSEPORT group from the supervisor that holds the group open.
    """
    registry = registry_factory()
    configuration.alpn_protocols = H3_ALPN
    configuration.max_stream_data = options.request_window_bytes

    def create_protocol(*args: Any, **kwargs: Any) -> TunnelProtocol:
        return TunnelProtocol(*args, handler=handler, options=options, registry=registry, **kwargs)

    tickets = SingleUseTickets() if options.session_tickets else None

    def create_server() -> RoutingQuicServer:
        return RoutingQuicServer(
            configuration=configuration,
            create_protocol=create_protocol,
            session_ticket_fetcher=tickets.take if tickets else None,
            session_ticket_handler=tickets.add if tickets else None,
        )

    loop = asyncio.get_running_loop()
    if sock is not None:
        _, server = await loop.create_datagram_endpoint(create_server, sock=sock)
    else:
        _, server = await loop.create_datagram_endpoint(create_server, local_addr=(host, port))
    _raise_socket_buffers(server, options.udp_buffer_bytes)
    return TunnelServer(server, registry)


def _raise_socket_buffers(server: QuicServer, size: int) -> None:
    """Bigger UDP buffers: with the kernel default a 256-stream burst dropped ~300
    datagrams per run. The kernel caps the value at net.core.{r,w}mem_max."""
    transport = server._transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or size <= 0:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)
