"""QUIC/HTTP3 termination with no engine knowledge: request heads and bodies in,
responses out, with flow control and resets both ways."""

from tunnel.client import ClientResponse, H3Client, client_configuration, open_client
from tunnel.listener import ConnectionRegistry, TunnelServer, start_tunnel
from tunnel.server import TunnelOptions, TunnelProtocol
from tunnel.stream import Handler, TunnelStream
from tunnel.types import MalformedRequest, RequestHead, StreamAborted

__all__ = [
    "ClientResponse",
    "ConnectionRegistry",
    "H3Client",
    "Handler",
    "MalformedRequest",
    "RequestHead",
    "StreamAborted",
    "TunnelOptions",
    "TunnelProtocol",
    "TunnelServer",
    "TunnelStream",
    "client_configuration",
    "open_client",
    "start_tunnel",
]
