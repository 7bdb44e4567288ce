"""Candidate: a 4 MiB receive and send buffer on Pylon's UDP socket.

aioquic leaves the kernel default (net.core.rmem_default, 208 KiB here); a
burst of datagrams while the event loop is busy overflows it, the kernel
drops them, and QUIC loss recovery and congestion control slow every stream
of the connection. quic-go (Caddy) raises its buffers at start for the same
reason. The kernel caps the value at net.core.rmem_max / wmem_max.

Run: python -m bench compare --workload stream \
        --candidate-command "python -m bench.experiments.udp_buffers"
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import pylon.app
from tunnel.listener import TunnelServer, start_tunnel

BUFFER_BYTES = 4 << 20


async def start_with_buffers(**kwargs: Any) -> TunnelServer:
    server = await start_tunnel(**kwargs)
    transport = server._server._transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
    return server


def main() -> int:
    setattr(pylon.app, "start_tunnel", start_with_buffers)  # noqa: B010 (patch for the experiment)
    from pylon.cli import main as pylon_main

    return pylon_main()


if __name__ == "__main__":
    sys.exit(main())
