"""HTTP/3 connection that fails a malformed request's stream, not the connection.

RFC 9114 §4.1.2 makes a malformed request a *stream* error
(H3_MESSAGE_ERROR), but aioquic raises `MessageError` out of its frame parser
and closes the whole connection. A tunnel connection carries every caller's
requests for days, so one bad request must not take the others down: this
subclass turns a `MessageError` on a request stream into a `RequestMalformed`
event, resets that stream and ignores the rest of its bytes. QPACK state stays
consistent because `MessageError` is only raised after a field section was
fully decoded.

It also gives aioquic's field checks a scan in C (`install_field_checks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aioquic.h3.connection
import pylsqpack
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import (
    ErrorCode,
    FrameType,
    H3Connection,
    H3Stream,
    HeadersState,
    MessageError,
    QpackDecompressionFailed,
    is_interim_response,
    stream_is_request_response,
)
from aioquic.h3.events import DataReceived, H3Event, Headers
from aioquic.quic.connection import QuicConnection, stream_is_unidirectional
from aioquic.quic.events import QuicEvent, StreamDataReceived, StreamReset

_DATA_FRAME_TYPE = encode_uint_var(FrameType.DATA)
_HEADERS_FRAME_TYPE = encode_uint_var(FrameType.HEADERS)

_VALID_NAME_BYTES = bytes(c for c in range(256) if 0x20 < c < 0x7F and not 0x41 <= c <= 0x5A)
"""RFC 9113 §8.2.1 as aioquic checks it: no control, space, uppercase or non-ASCII byte."""
_COLON, _NUL, _LF, _CR, _SP, _HTAB = 0x3A, 0x00, 0x0A, 0x0D, 0x20, 0x09

aioquic_validate_header_name = aioquic.h3.connection.validate_header_name
aioquic_validate_header_value = aioquic.h3.connection.validate_header_value


def header_name_passes(name: bytes) -> bool:
    """True only for a name aioquic's `validate_header_name` accepts, checked in C."""
    if name.translate(None, _VALID_NAME_BYTES):
        return False
    return _COLON not in name or name.find(b":", 1) == -1


def header_value_passes(value: bytes) -> bool:
    """True only for a value aioquic's `validate_header_value` accepts, checked in C."""
    if _NUL in value or _LF in value or _CR in value:
        return False
    return not value or (value[0] not in (_SP, _HTAB) and value[-1] not in (_SP, _HTAB))


def _validate_header_name(key: bytes) -> None:
    if not header_name_passes(key):
        aioquic_validate_header_name(key)  # raises aioquic's own error for it


def _validate_header_value(key: bytes, value: bytes) -> None:
    if not header_value_passes(value):
        aioquic_validate_header_value(key, value)  # raises aioquic's own error for it


def install_field_checks() -> None:
    """Make aioquic check each request field with C scans instead of a Python loop per byte.

    aioquic validates every received field byte by byte in Python: about 5 %
    of Pylon's instructions per small request (a bearer token and a request
    id are 60 bytes alone). The fast checks accept exactly what aioquic's
    accept, and hand anything else to aioquic's own, which raises its usual
    error; so verdicts and messages are unchanged
    (tests/test_tunnel_h3.py checks it over arbitrary bytes).
    """
    checks: dict[str, Callable[..., None]] = {
        "validate_header_name": _validate_header_name,
        "validate_header_value": _validate_header_value,
    }
    for name, check in checks.items():
        setattr(aioquic.h3.connection, name, check)


install_field_checks()


@dataclass
class RequestMalformed(H3Event):
    """A request stream violated RFC 9114 message rules and was reset."""

    stream_id: int
    reason: str


class TunnelH3Connection(H3Connection):
    def __init__(self, quic: QuicConnection) -> None:
        super().__init__(quic)
        self._failed_streams: set[int] = set()

    def handle_event(self, event: QuicEvent) -> list[H3Event]:
        if isinstance(event, StreamReset | StreamDataReceived) and (
            event.stream_id in self._failed_streams
        ):
            ended = isinstance(event, StreamReset) or event.end_stream
            if ended:
                self._failed_streams.discard(event.stream_id)
            return []
        return super().handle_event(event)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        # An SSE response calls this once per token. aioquic's own method spends
        # its time on a context manager per call and a copy of the payload into
        # a frame buffer; the checks and the frame bytes here are the same, with
        # one copy. An end with no bytes is a bare FIN, where aioquic would send
        # an empty DATA frame with it.
        stream = self._stream.get(stream_id)
        if (
            stream is None
            or stream.headers_send_state != HeadersState.AFTER_HEADERS
            or self._quic_logger is not None
        ):
            super().send_data(stream_id, data, end_stream)
            return
        frame = b"".join((_DATA_FRAME_TYPE, encode_uint_var(len(data)), data)) if data else b""
        if end_stream:
            stream.finish_sending()
            self._drop_if_ended(stream)
        self._quic.send_stream_data(stream_id, frame, end_stream)

    def send_headers(self, stream_id: int, headers: Headers, end_stream: bool = False) -> None:
        # A response head, once per request: aioquic's own method without its
        # context manager and with the frame's bytes joined, not built in a
        # Buffer. An interim (1xx) head, trailers or a logged connection take
        # aioquic's path, which also raises its errors for a wrong state.
        stream = self._stream.get(stream_id)
        if (
            stream is None
            or stream.headers_send_state != HeadersState.INITIAL
            or self._quic_logger is not None
            or is_interim_response(headers)
        ):
            super().send_headers(stream_id, headers, end_stream)
            return
        try:
            if end_stream:
                stream.finish_sending()
            frame_data = self._encode_headers(stream_id, headers)
            stream.headers_send_state = HeadersState.AFTER_HEADERS
        finally:
            self._drop_if_ended(stream)
        frame = b"".join((_HEADERS_FRAME_TYPE, encode_uint_var(len(frame_data)), frame_data))
        self._quic.send_stream_data(stream_id, frame, end_stream)

    # QPACK: with nothing for the encoder or decoder stream (the usual case: a
    # field section that changes no dynamic table), aioquic still queues an empty
    # write on that stream per request. These are its own two steps without it.

    def _encode_headers(self, stream_id: int, headers: Headers) -> bytes:
        encoder, frame_data = self._encoder.encode(stream_id, headers)
        if encoder:
            self._encoder_bytes_sent += len(encoder)
            # set when the connection was made, as aioquic's own call assumes
            self._quic.send_stream_data(self._local_encoder_stream_id, encoder)  # type: ignore[arg-type]
        return frame_data

    def _decode_headers(self, stream_id: int, frame_data: bytes | None) -> Headers:
        try:
            if frame_data is None:
                decoder, headers = self._decoder.resume_header(stream_id)
            else:
                decoder, headers = self._decoder.feed_header(stream_id, frame_data)
        except pylsqpack.DecompressionFailed as exc:
            raise QpackDecompressionFailed() from exc
        if decoder:
            self._decoder_bytes_sent += len(decoder)
            self._quic.send_stream_data(self._local_decoder_stream_id, decoder)  # type: ignore[arg-type]
        return headers

    def _receive_stream_data(self, event: StreamDataReceived) -> list[H3Event]:
        stream = self._stream.get(event.stream_id)
        if (
            stream is not None
            and stream.frame_type == FrameType.DATA
            and (frame_size := stream.frame_size) is not None
            and len(event.data) < frame_size
            and not event.end_stream
            and not stream.buffer
            and not stream.blocked
            and not stream_is_unidirectional(event.stream_id)
        ):
            # All of it is body bytes inside the current DATA frame: aioquic's
            # own shortcut for a fragment, without the context manager it
            # enters for every chunk before reaching it.
            data = event.data
            stream.content_length += len(data)
            stream.frame_size = frame_size - len(data)
            return [
                DataReceived(
                    data=data, push_id=stream.push_id, stream_id=event.stream_id, stream_ended=False
                )
            ]
        if stream_is_unidirectional(event.stream_id):
            return super()._receive_stream_data(event)
        try:
            return self._receive_request_data(event)
        except MessageError as exc:
            self._fail_stream(event.stream_id, end_stream=event.end_stream)
            return [RequestMalformed(stream_id=event.stream_id, reason=exc.reason_phrase)]

    def _receive_request_data(self, event: StreamDataReceived) -> list[H3Event]:
        """aioquic's `_receive_stream_data` for a request stream, without the generator
        context manager it enters per chunk (`_get_or_create_stream`), same steps."""
        stream_id = event.stream_id
        stream = self._stream.get(stream_id)
        if stream is None:
            stream = self._stream[stream_id] = H3Stream(stream_id)
        try:
            return self._receive_request_or_push_data(stream, event.data, event.end_stream)
        finally:
            self._drop_if_ended(stream)

    def _drop_if_ended(self, stream: H3Stream) -> None:
        """Forget a stream done both ways: what aioquic's `_get_or_create_stream` does on
        the way out, for the methods here that do its work without it."""
        if stream.is_ended():
            self._stream.pop(stream.stream_id, None)

    def _fail_stream(self, stream_id: int, *, end_stream: bool) -> None:
        self._stream.pop(stream_id, None)
        if not end_stream:
            self._failed_streams.add(stream_id)
            self._quic.stop_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
        self._quic.reset_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)

    def forget_stream(self, stream_id: int) -> None:
        """The application is done sending (FIN or reset): free state once both halves end.

        A reset sent through the QUIC layer never marks the H3 stream's sending
        half as ended, so without this a long-lived connection would keep one
        H3Stream per failed request forever.
        """
        stream = self._stream.get(stream_id)
        if stream is None:
            return
        stream.sending_ended = True
        self._drop_if_ended(stream)

    @property
    def tracked_stream_count(self) -> int:
        """Request streams whose state is held (for leak tests and gauges).

        The peer's control and QPACK streams live as long as the connection and
        are not counted.
        """
        requests = sum(1 for stream_id in self._stream if stream_is_request_response(stream_id))
        return requests + len(self._failed_streams)
