"""The bench's HTTP/3 client: `tunnel.client.H3Client` plus arrival stamps per chunk.

Strategy: the gateway-like client is reused as is; the subclass only notes
the time each datagram was read, so latency and gap measurements do not
depend on how late the reader task happened to run.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.h3.events import DataReceived, H3Event

from tunnel.client import H3Client, client_configuration

RECEIVE_BUFFER_BYTES = 4 << 20
"""With the kernel default (208 KiB) a busy client drops a fast proxy's datagrams (Caddy's,
measured), and QUIC loss recovery then slows the proxy down; capped by net.core.rmem_max."""


class TimedH3Client(H3Client):
    """Stamps each body chunk with the time its datagram was read off the socket.

    `H3Client` queues chunks for a reader task; under load that task runs
    late and two tokens that arrived 20 ms apart would be read together and
    look like a 0 ms gap. The stamp is taken before the datagram is parsed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._received_at = 0.0
        self._arrivals: dict[int, collections.deque[float]] = {}

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # the client must not be where datagrams get dropped
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._received_at = time.monotonic()
        super().datagram_received(data, addr)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, DataReceived) and event.data and event.stream_id in self._bodies:
            self._arrivals.setdefault(event.stream_id, collections.deque()).append(
                self._received_at
            )
        super()._h3_event_received(event)

    def arrival(self, stream_id: int) -> float:
        """When the chunk just read from `stream_id` arrived (in order)."""
        stamps = self._arrivals.get(stream_id)
        return stamps.popleft() if stamps else time.monotonic()

    def forget(self, stream_id: int) -> None:
        self._arrivals.pop(stream_id, None)


@contextlib.asynccontextmanager
async def open_timed_client(host: str, port: int) -> AsyncIterator[TimedH3Client]:
    """A QUIC connection like `tunnel.client.open_client` (no certificate check: loopback)."""
    configuration = client_configuration(verify=False)
    async with connect(
        host, port, configuration=configuration, create_protocol=TimedH3Client
    ) as client:
        assert isinstance(client, TimedH3Client)
        yield client
