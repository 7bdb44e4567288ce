"""Candidate: Pylon's tunnel on aiopquic (picoquic, in C) instead of aioquic, to measure only.

What Pylon would cost per request on a native QUIC stack, end to end, before
anyone ports `tunnel/` to one. The launcher replaces `pylon.app.start_tunnel`
with a listener on aiopquic that keeps the rest of Pylon as it is: Pylon's
HTTP/3 layer (`TunnelH3Connection`, aioquic's H3 code run over aiopquic's QUIC
connection), `parse_request_head`, `TunnelStream` and the whole service behind
them. It is not a tunnel to deploy, and it leaves out what aiopquic lacks or
does its own way:

- no client certificates: aiopquic's server never asks for one, so
  `--client-ca` cannot work (bearer tokens, checked by the service, still do);
- it binds the port on every address (0.0.0.0 and [::]), whatever `--listen`
  names, and owns its socket, so `--workers` (the SO_REUSEPORT group,
  connection-ID steering) does not apply;
- request-body credit is aiopquic's own (returned as the tunnel reads events,
  not as the handler consumes the body), and the connection, stream and
  header-frame limits, GOAWAY on drain, keep-alive PINGs and 0-RTT are not
  wired.

Run (aiopquic installed; docs/performance.md says how it was built here):
    python -m bench compare --workload small --concurrency 1 --workers 1 \\
        --candidate-command "python -m bench.experiments.aiopquic_tunnel"
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aioquic.h3.connection import ErrorCode
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import StopSendingReceived, StreamDataReceived, StreamReset
from cryptography.hazmat.primitives import serialization

import pylon.app
from tunnel.h3 import RequestMalformed, TunnelH3Connection
from tunnel.listener import ConnectionRegistry
from tunnel.server import TunnelOptions, serve_stream
from tunnel.stream import Handler, TunnelStream
from tunnel.types import HeaderList, MalformedRequest
from tunnel.validation import parse_request_head

logger = logging.getLogger(__name__)

# Imported by name: aiopquic is optional and has no type information.
_server: Any = importlib.import_module("aiopquic.asyncio.server")
_protocol: Any = importlib.import_module("aiopquic.asyncio.protocol")
_configuration: Any = importlib.import_module("aiopquic.quic.configuration")
_events: Any = importlib.import_module("aiopquic.quic.events")


class AiopquicTunnelProtocol(_protocol.QuicConnectionProtocol):  # type: ignore[misc]
    """One connection: aiopquic's QUIC events into Pylon's HTTP/3 layer and streams."""

    def __init__(
        self, *args: Any, handler: Handler, options: TunnelOptions, registry: Any, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._handler = handler
        self._options = options
        self._registry = registry
        self._quic._quic_logger = None  # H3Connection reads it; aiopquic has none
        self._h3: TunnelH3Connection | None = None
        self.streams: dict[int, TunnelStream] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        registry.opened(self)

    def quic_event_received(self, event: Any) -> None:
        if isinstance(event, _events.ConnectionTerminated):
            for stream_id in list(self.streams):
                self._abort_stream(stream_id, event.error_code)
            self._registry.closed(self)
            return
        if isinstance(event, _events.StreamDataReceived):
            converted: Any = StreamDataReceived(
                data=bytes(event.data), end_stream=event.end_stream, stream_id=event.stream_id
            )
        elif isinstance(event, _events.StreamReset):
            converted = StreamReset(error_code=event.error_code, stream_id=event.stream_id)
            self._abort_stream(event.stream_id, event.error_code)
        elif isinstance(event, _events.StopSendingReceived):
            converted = StopSendingReceived(error_code=event.error_code, stream_id=event.stream_id)
            self._abort_stream(event.stream_id, event.error_code)
        else:
            return
        if self._h3 is None:
            self._h3 = TunnelH3Connection(self._quic)
        for h3_event in self._h3.handle_event(converted):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            if event.stream_id not in self.streams:
                self._start_stream(event.stream_id, event.headers, ended=event.stream_ended)
            elif event.stream_ended:
                self.streams[event.stream_id].feed(b"", end=True)
        elif isinstance(event, DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.feed(event.data, end=event.stream_ended)
        elif isinstance(event, RequestMalformed):
            self._abort_stream(event.stream_id, ErrorCode.H3_MESSAGE_ERROR)

    def _start_stream(
        self, stream_id: int, headers: Iterable[tuple[bytes, bytes]], *, ended: bool
    ) -> None:
        try:
            head = parse_request_head(headers)
        except MalformedRequest as exc:
            logger.info("malformed request on stream %d: %s", stream_id, exc)
            self._quic.reset_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
            return
        stream = TunnelStream(
            stream_id=stream_id,
            head=head,
            owner=self,
            max_queued_bytes=self._options.max_queued_bytes_per_stream,
            read_batch_bytes=self._options.read_batch_bytes,
            over_limit=None,
            early=False,
        )
        stream.feed(b"", end=ended)
        self.streams[stream_id] = stream
        self._tasks[stream_id] = asyncio.ensure_future(self._run_handler(stream))

    async def _run_handler(self, stream: TunnelStream) -> None:
        try:
            await serve_stream(self._handler, stream)
        finally:
            self.streams.pop(stream.stream_id, None)
            self._tasks.pop(stream.stream_id, None)
            if self._h3 is not None:
                self._h3.forget_stream(stream.stream_id)

    def _abort_stream(self, stream_id: int, error_code: int) -> None:
        stream, task = self.streams.get(stream_id), self._tasks.get(stream_id)
        if stream is not None and task is not None:
            stream.abort(error_code)
            task.cancel()

    # --- StreamOwner, used by TunnelStream --------------------------------------------

    def stream_send_headers(self, stream_id: int, headers: HeaderList, *, end: bool) -> None:
        assert self._h3 is not None
        self._h3.send_headers(stream_id, list(headers), end_stream=end)

    def stream_send_data(self, stream_id: int, data: bytes, *, end: bool) -> None:
        assert self._h3 is not None
        self._h3.send_data(stream_id, data, end_stream=end)

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        self._quic.reset_stream(stream_id, error_code)

    def stream_queued_bytes(self, stream_id: int) -> int:
        return int(self._quic.tx_data_ring_used(stream_id))

    def stream_consumed(self, stream_id: int, byte_count: int) -> None:
        pass  # aiopquic returns credit as its events are read

    def stream_awaits_drain(self, stream: TunnelStream) -> None:
        # No ACK hook here: poll until the stream's send ring has room again.
        asyncio.get_running_loop().call_later(0.001, self._wake, stream)

    def _wake(self, stream: TunnelStream) -> None:
        if not stream.wake_if_drained():
            self.stream_awaits_drain(stream)

    # --- what the registry's gauges and drain read -------------------------------------

    def queued_bytes(self) -> int:
        return sum(self.stream_queued_bytes(stream_id) for stream_id in self.streams)

    def send_goaway(self) -> None:
        pass

    def close(self, error_code: int = 0) -> None:
        self._quic.close(error_code)


class AiopquicTunnelServer:
    def __init__(self, server: Any, registry: ConnectionRegistry, port: int, state: Any) -> None:
        self._server = server
        self.registry = registry
        self.port = port
        self._state = state

    def close(self) -> None:
        self._server.close()
        self._state.cleanup()


def _pem_files(configuration: QuicConfiguration, directory: Path) -> tuple[Path, Path]:
    """The certificate and key Pylon loaded, as the files picoquic reads."""
    assert configuration.certificate is not None and configuration.private_key is not None
    cert, key = directory / "cert.pem", directory / "key.pem"
    cert.write_bytes(configuration.certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        configuration.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


async def start_aiopquic_tunnel(
    *,
    host: str,
    port: int,
    configuration: QuicConfiguration,
    handler: Handler,
    options: TunnelOptions,
    registry_factory: Any = ConnectionRegistry,
    sock: Any = None,
) -> AiopquicTunnelServer:
    if sock is not None or options.client_auth is not None:
        raise RuntimeError("the aiopquic candidate serves neither --workers nor --client-ca")
    registry = registry_factory()
    state = tempfile.TemporaryDirectory()
    cert, key = _pem_files(configuration, Path(state.name))
    settings = _configuration.QuicConfiguration(
        is_client=False,
        alpn_protocols=["h3"],
        certificate_file=str(cert),
        private_key_file=str(key),
        max_stream_data=options.request_window_bytes,
    )

    def create_protocol(quic: Any, stream_handler: Any = None) -> AiopquicTunnelProtocol:
        return AiopquicTunnelProtocol(
            quic, handler=handler, options=options, registry=registry, stream_handler=stream_handler
        )

    server = await _server.serve(
        host, port, configuration=settings, create_protocol=create_protocol
    )
    return AiopquicTunnelServer(server, registry, port, state)


def main() -> int:
    setattr(pylon.app, "start_tunnel", start_aiopquic_tunnel)  # noqa: B010 (patch for the experiment)
    from pylon.cli import main as pylon_main

    return pylon_main()


if __name__ == "__main__":
    sys.exit(main())
