"""Packet loss for the test client: a seeded share of datagrams dropped both ways.

Strategy: the loss sits where the client meets the network, as aioquic's own
asyncio tests do it: outgoing datagrams are dropped in a wrapper around the
datagram transport (`sendto`), incoming ones in `datagram_received`, so the
QUIC stacks on both ends see real loss and must recover (retransmissions,
PTO probes, flow-control updates lost and resent). One `random.Random(seed)`
decides, so a run can be repeated with the same drop pattern up to timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from aioquic.asyncio.client import connect
from aioquic.quic.configuration import QuicConfiguration

from tunnel.client import H3Client


@dataclass
class Loss:
    """Drop decisions and counts for one connection."""

    rate: float
    """Share of datagrams dropped in each direction, 0.0 to 1.0."""
    seed: int = 0
    sent: int = 0
    received: int = 0
    dropped_out: int = 0
    dropped_in: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("rate must be between 0 and 1")
        self._rng = random.Random(self.seed)

    def drop_outgoing(self) -> bool:
        self.sent += 1
        dropped = self._rng.random() < self.rate
        self.dropped_out += dropped
        return dropped

    def drop_incoming(self) -> bool:
        self.received += 1
        dropped = self._rng.random() < self.rate
        self.dropped_in += dropped
        return dropped


class _LossyTransport:
    """The datagram transport, minus the datagrams `Loss` drops on the way out."""

    def __init__(self, transport: asyncio.DatagramTransport, loss: Loss) -> None:
        self._transport = transport
        self._loss = loss

    def sendto(self, data: bytes, addr: Any = None) -> None:
        if not self._loss.drop_outgoing():
            self._transport.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class LossyH3Client(H3Client):
    def __init__(self, *args: Any, loss: Loss, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss = loss

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's selector datagram transport does not subclass DatagramTransport.
        lossy = _LossyTransport(cast(asyncio.DatagramTransport, transport), self.loss)
        super().connection_made(cast(asyncio.DatagramTransport, lossy))

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if not self.loss.drop_incoming():
            super().datagram_received(data, addr)


@contextlib.asynccontextmanager
async def open_lossy_client(
    host: str, port: int, *, configuration: QuicConfiguration, loss: Loss
) -> AsyncIterator[LossyH3Client]:
    """Like `tunnel.client.open_client`, with `loss` applied to every datagram."""

    def create_protocol(*args: Any, **kwargs: Any) -> LossyH3Client:
        return LossyH3Client(*args, loss=loss, **kwargs)

    async with connect(
        host, port, configuration=configuration, create_protocol=create_protocol
    ) as client:
        assert isinstance(client, LossyH3Client)
        yield client
