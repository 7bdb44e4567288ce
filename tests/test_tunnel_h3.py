"""HTTP/3 request validation, in memory: a malformed request fails its stream, not the connection.

Client and server QuicConnections exchange datagrams directly (no sockets), as
aioquic's own tests do, so each case is deterministic.
"""

from __future__ import annotations

import itertools
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path

import aioquic.h3.connection
import pylsqpack
import pytest
from aioquic.h3.connection import (
    H3_ALPN,
    ErrorCode,
    FrameType,
    FrameUnexpected,
    H3Connection,
    MessageError,
    encode_frame,
    validate_request_headers,
)
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StreamDataReceived, StreamReset
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.devcert import ensure_dev_certificate
from tunnel.h3 import (
    RequestMalformed,
    TunnelH3Connection,
    aioquic_validate_header_name,
    aioquic_validate_header_value,
    header_name_passes,
    header_value_passes,
)
from tunnel.types import MalformedRequest
from tunnel.validation import parse_request_head

CLIENT_ADDR = ("1.2.3.4", 1234)
SERVER_ADDR = ("2.3.4.5", 4433)
GOOD_HEAD = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"n"), (b":path", b"/")]


class Pair:
    """A connected client/server pair; `pump` moves datagrams until both are quiet."""

    def __init__(self, tmp_path: Path) -> None:
        cert, key = ensure_dev_certificate(tmp_path)
        server_configuration = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
        server_configuration.load_cert_chain(cert, key)
        client_configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        client_configuration.verify_mode = ssl.CERT_NONE
        self.client = QuicConnection(configuration=client_configuration)
        self.server = QuicConnection(
            configuration=server_configuration,
            original_destination_connection_id=self.client.original_destination_connection_id,
        )
        self.client.connect(SERVER_ADDR, now=0.0)
        self.now = 0.0
        self.pump()
        self.client_h3 = H3Connection(self.client)
        self.server_h3 = TunnelH3Connection(self.server)
        self.server_events: list[H3Event] = []
        self.server_quic_events: list[QuicEvent] = []
        self.client_quic_events: list[QuicEvent] = []
        self.client_events: list[H3Event] = []
        self.pump()

    def pump(self) -> None:
        for _ in range(50):
            self.now += 0.001
            moved = self._move(self.client, self.server, CLIENT_ADDR)
            moved += self._move(self.server, self.client, SERVER_ADDR)
            self._drain_events()
            if not moved:
                return

    def _move(self, sender: QuicConnection, receiver: QuicConnection, addr: tuple[str, int]) -> int:
        datagrams = sender.datagrams_to_send(now=self.now)
        for data, _ in datagrams:
            receiver.receive_datagram(data, addr, now=self.now)
        return len(datagrams)

    def _drain_events(self) -> None:
        if not hasattr(self, "server_h3"):
            while self.server.next_event() or self.client.next_event():
                pass
            return
        while (event := self.server.next_event()) is not None:
            self.server_quic_events.append(event)
            self.server_events.extend(self.server_h3.handle_event(event))
        while (event := self.client.next_event()) is not None:
            self.client_quic_events.append(event)
            self.client_events.extend(self.client_h3.handle_event(event))

    def request(self, headers: Iterable[tuple[bytes, bytes]], *, body: bytes = b"") -> int:
        stream_id = self.client.get_next_available_stream_id()
        self.client_h3.send_headers(stream_id, list(headers), end_stream=not body)
        for index in range(len(body)):  # one byte per write flushes out buffering bugs
            self.client_h3.send_data(stream_id, body[index : index + 1], end_stream=False)
        if body:
            self.client_h3.send_data(stream_id, b"", end_stream=True)
        self.pump()
        return stream_id

    @property
    def server_open(self) -> bool:
        return not self.server._close_pending and self.server._close_event is None


def started_responses(pair: Pair) -> tuple[int, int]:
    """Two requests answered with a 200 head: one for Pylon's methods, one for aioquic's."""
    fast, reference = pair.request(GOOD_HEAD), pair.request(GOOD_HEAD)
    for stream_id in (fast, reference):
        pair.server_h3.send_headers(stream_id, [(b":status", b"200")])
    return fast, reference


def client_data(pair: Pair, stream_id: int) -> list[DataReceived]:
    return [
        event
        for event in pair.client_events
        if isinstance(event, DataReceived) and event.stream_id == stream_id
    ]


def client_body(pair: Pair, stream_id: int) -> bytes:
    return b"".join(event.data for event in client_data(pair, stream_id))


MALFORMED = {
    "uppercase-name": [*GOOD_HEAD, (b"X-Upper", b"1")],
    "missing-path": GOOD_HEAD[:3],
    "missing-method": GOOD_HEAD[1:],
    "duplicate-path": [*GOOD_HEAD, (b":path", b"/again")],
    "pseudo-after-regular": [*GOOD_HEAD[:3], (b"accept", b"*/*"), GOOD_HEAD[3]],
    "unknown-pseudo": [*GOOD_HEAD, (b":bogus", b"x")],
    "connection-header": [*GOOD_HEAD, (b"connection", b"close")],
    "te-not-trailers": [*GOOD_HEAD, (b"te", b"gzip")],
    "empty-path": [*GOOD_HEAD[:3], (b":path", b"")],
}


@pytest.mark.parametrize("headers", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_request_fails_only_its_stream(tmp_path: Path, headers: list) -> None:
    pair = Pair(tmp_path)
    bad = pair.request(headers)
    malformed = [e for e in pair.server_events if isinstance(e, RequestMalformed)]
    assert [e.stream_id for e in malformed] == [bad]
    assert any(
        isinstance(e, StreamReset)
        and e.stream_id == bad
        and e.error_code == ErrorCode.H3_MESSAGE_ERROR
        for e in pair.client_quic_events
    )
    assert pair.server_open
    good = pair.request(GOOD_HEAD)
    assert any(isinstance(e, HeadersReceived) and e.stream_id == good for e in pair.server_events)
    assert pair.server_open


def test_content_length_mismatch_fails_the_stream_after_headers(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    head = [(b":method", b"POST"), *GOOD_HEAD[1:], (b"content-length", b"10")]
    bad = pair.request(head, body=b"abc")
    assert any(isinstance(e, RequestMalformed) and e.stream_id == bad for e in pair.server_events)
    assert pair.server_open
    good = pair.request(head[:-1], body=b"hello")
    data = b"".join(
        e.data for e in pair.server_events if isinstance(e, DataReceived) and e.stream_id == good
    )
    assert data == b"hello"


def test_failed_stream_state_is_released(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    for _ in range(20):
        pair.request(MALFORMED["uppercase-name"])
    assert pair.server_open
    assert pair.server_h3.tracked_stream_count == 0


@pytest.mark.parametrize(
    "headers",
    [
        [(b":method", b"CONNECT"), (b":authority", b"h:1")],
        [*GOOD_HEAD[:3], (b":path", b"relative")],
        [*GOOD_HEAD[:3], (b":path", b"/\xff")],
    ],
    ids=["connect", "not-origin-form", "non-ascii-path"],
)
def test_parse_request_head_rejects(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(MalformedRequest):
        parse_request_head(headers)


def test_parse_request_head_keeps_regular_headers_in_order() -> None:
    head = parse_request_head([*GOOD_HEAD, (b"a", b"1"), (b"b", b"2"), (b"a", b"3")])
    assert (head.method, head.path, head.authority) == ("GET", "/", "n")
    assert head.headers == ((b"a", b"1"), (b"b", b"2"), (b"a", b"3"))


def test_body_data_is_framed_as_aioquic_frames_it(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    fast, reference = pair.request(GOOD_HEAD), pair.request(GOOD_HEAD)
    queued: dict[int, bytes] = {}
    for stream_id in (fast, reference):
        pair.server_h3.send_headers(stream_id, [(b":status", b"200")])
        queued[stream_id] = bytes(pair.server._streams[stream_id].sender._buffer)
    chunks = [b"x" * size for size in (1, 63, 64, 16_383, 16_384, 70_000)]
    for chunk in chunks:
        pair.server_h3.send_data(fast, chunk, end_stream=False)
        H3Connection.send_data(pair.server_h3, reference, chunk, end_stream=False)

    def body_frames(stream_id: int) -> bytes:
        buffer = bytes(pair.server._streams[stream_id].sender._buffer)
        return buffer[len(queued[stream_id]) :]

    assert body_frames(fast) == body_frames(reference)
    assert len(body_frames(fast)) > sum(map(len, chunks))
    pair.server_h3.send_data(fast, b"", end_stream=True)
    for _ in range(20):
        pair.pump()
    assert client_body(pair, fast) == b"".join(chunks)


BODY_SPLITS = st.lists(st.integers(min_value=0, max_value=5_000), min_size=1, max_size=12)
_STREAM_NUMBERS = itertools.count()


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory) -> tuple[H3Connection, H3Connection]:
    """Two connected servers for the whole module: a handshake per example is slow."""
    return (
        Pair(tmp_path_factory.mktemp("fast")).server_h3,
        Pair(tmp_path_factory.mktemp("reference")).server_h3,
    )


@settings(max_examples=60, deadline=None)
@given(frame_sizes=BODY_SPLITS, cuts=st.lists(st.integers(min_value=0, max_value=1 << 16)))
def test_body_fragments_give_the_events_aioquic_gives(
    two_servers: tuple[H3Connection, H3Connection], frame_sizes: list[int], cuts: list[int]
) -> None:
    """The DATA-fragment fast path yields exactly aioquic's events, however the
    request's frames are cut into stream chunks (splits inside frame headers too)."""
    fast, reference = two_servers
    stream_id = 4 * next(_STREAM_NUMBERS)
    _, header_block = pylsqpack.Encoder().encode(stream_id, GOOD_HEAD)
    frames = [bytes([index % 251]) * size for index, size in enumerate(frame_sizes)]
    wire = encode_frame(FrameType.HEADERS, header_block) + b"".join(
        encode_frame(FrameType.DATA, frame) for frame in frames
    )
    points = sorted({cut % (len(wire) + 1) for cut in cuts} | {0, len(wire)})
    chunks = [wire[start:end] for start, end in itertools.pairwise(points)]
    events_fast: list[H3Event] = []
    events_reference: list[H3Event] = []
    for index, chunk in enumerate(chunks):
        event = StreamDataReceived(
            data=chunk, end_stream=index == len(chunks) - 1, stream_id=stream_id
        )
        events_fast.extend(fast.handle_event(event))
        events_reference.extend(H3Connection._receive_stream_data(reference, event))
    assert events_fast == events_reference
    assert (stream_id in fast._stream) == (stream_id in reference._stream)
    body = [event for event in events_fast if isinstance(event, DataReceived)]
    assert b"".join(event.data for event in body) == b"".join(frames)
    assert body[-1].stream_ended


def test_a_request_never_enters_the_stream_context_manager(
    two_servers: tuple[H3Connection, H3Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its head, a body fragment inside a DATA frame, and the rest with the FIN."""
    fast, _ = two_servers
    stream_id = 4 * next(_STREAM_NUMBERS)
    _, header_block = pylsqpack.Encoder().encode(stream_id, GOOD_HEAD)
    wire = encode_frame(FrameType.HEADERS, header_block) + encode_frame(FrameType.DATA, b"a" * 100)

    def entered(stream_id: int) -> None:
        raise AssertionError("context manager entered")

    monkeypatch.setattr(fast, "_get_or_create_stream", entered)
    events = [
        *fast.handle_event(
            StreamDataReceived(data=wire[:-50], end_stream=False, stream_id=stream_id)
        ),
        *fast.handle_event(
            StreamDataReceived(data=wire[-50:-30], end_stream=False, stream_id=stream_id)
        ),
        *fast.handle_event(
            StreamDataReceived(data=wire[-30:], end_stream=True, stream_id=stream_id)
        ),
    ]
    assert isinstance(events[0], HeadersReceived)
    assert events[2] == DataReceived(data=b"a" * 20, stream_id=stream_id, stream_ended=False)
    assert b"".join(e.data for e in events if isinstance(e, DataReceived)) == b"a" * 100
    assert events[-1].stream_ended  # type: ignore[attr-defined]
    fast.forget_stream(stream_id)  # the response is done: no state is left
    assert stream_id not in fast._stream


def _aioquic_accepts(check: Callable[..., None], *args: bytes) -> bool:
    try:
        check(*args)
    except MessageError:
        return False
    return True


FIELD_BYTES = st.binary(max_size=24) | st.lists(
    st.sampled_from(b"aZ:-\x00\n\r \t\x7f\x80\x20\x21\x40\x41\x5a\x5b"), max_size=12
).map(bytes)
"""Arbitrary bytes, and strings built from the bytes at the edges of each rule."""


@given(FIELD_BYTES)
def test_the_fast_name_check_passes_only_what_aioquic_accepts(name: bytes) -> None:
    assert header_name_passes(name) == _aioquic_accepts(aioquic_validate_header_name, name)


@given(FIELD_BYTES)
def test_the_fast_value_check_passes_only_what_aioquic_accepts(value: bytes) -> None:
    assert header_value_passes(value) == _aioquic_accepts(
        aioquic_validate_header_value, b"k", value
    )


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        (b"X-Upper", b"v", "contains invalid characters"),
        (b"x:colon", b"v", "contains a non-initial colon"),
        (b"x-nul", b"a\x00b", "value has forbidden characters"),
        (b"x-lead", b" v", "value starts with whitespace"),
        (b"x-trail", b"v\t", "value ends with whitespace"),
    ],
)
def test_a_field_aioquic_rejects_gets_aioquics_own_error(
    name: bytes, value: bytes, reason: str
) -> None:
    # Through aioquic's request parsing, which calls the installed checks.
    assert aioquic.h3.connection.validate_header_name is not aioquic_validate_header_name
    with pytest.raises(MessageError, match=reason):
        validate_request_headers([*GOOD_HEAD, (name, value)])


def test_the_end_of_a_chunked_body_is_a_bare_fin(tmp_path: Path) -> None:
    """The same bytes as aioquic's, less its empty DATA frame; the client sees the end."""
    pair = Pair(tmp_path)
    fast, reference = started_responses(pair)
    for stream_id in (fast, reference):
        pair.server_h3.send_data(stream_id, b"body", end_stream=False)
    pair.server_h3.send_data(fast, b"", end_stream=True)
    H3Connection.send_data(pair.server_h3, reference, b"", end_stream=True)
    sent = {sid: bytes(pair.server._streams[sid].sender._buffer) for sid in (fast, reference)}
    assert sent[fast] + encode_frame(FrameType.DATA, b"") == sent[reference]
    assert pair.server._streams[fast].sender._buffer_fin == len(sent[fast])
    pair.pump()
    for stream_id in (fast, reference):
        assert client_body(pair, stream_id) == b"body"
        assert client_data(pair, stream_id)[-1].stream_ended
    assert pair.server_h3.tracked_stream_count == 0  # both dropped once done both ways
    with pytest.raises(FrameUnexpected, match="not allowed"):  # aioquic's own error
        pair.server_h3.send_data(fast, b"", end_stream=True)
    with pytest.raises(FrameUnexpected, match="not allowed"):
        H3Connection.send_data(pair.server_h3, reference, b"", end_stream=True)


def test_qpack_streams_carry_only_real_instructions(tmp_path: Path) -> None:
    """No empty write per request; what the dynamic table needs still goes out."""
    pair = Pair(tmp_path)
    writes: list[tuple[int, bytes]] = []
    send_stream_data = pair.server.send_stream_data

    def record(stream_id: int, data: bytes, end_stream: bool = False) -> None:
        writes.append((stream_id, data))
        send_stream_data(stream_id, data, end_stream)

    pair.server.send_stream_data = record  # type: ignore[method-assign]
    h3 = pair.server_h3
    qpack_streams = {h3._local_encoder_stream_id, h3._local_decoder_stream_id}
    repeated = [*GOOD_HEAD, (b"x-tenant", b"a-tenant-name-worth-indexing")]
    for _ in range(3):
        stream_id = pair.request(repeated)
        pair.server_h3.send_headers(stream_id, [(b":status", b"200"), (b"x-tenant", b"t" * 40)])
        pair.pump()
    assert [data for sid, data in writes if sid in qpack_streams and not data] == []
    decoder_bytes = sum(
        len(data) for sid, data in writes if sid == pair.server_h3._local_decoder_stream_id
    )
    assert decoder_bytes == pair.server_h3._decoder_bytes_sent > 0  # acknowledgements went
    assert pair.server_h3._encoder_bytes_sent > 0  # and the response's insertions
    heads = [event for event in pair.server_events if isinstance(event, HeadersReceived)]
    assert [dict(event.headers)[b"x-tenant"] for event in heads] == [repeated[-1][1]] * 3


def test_last_bytes_with_the_fin_are_framed_as_aioquic_frames_them(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    fast, reference = started_responses(pair)
    pair.server_h3.send_data(fast, b"tail", end_stream=True)
    H3Connection.send_data(pair.server_h3, reference, b"tail", end_stream=True)
    senders = {sid: pair.server._streams[sid].sender for sid in (fast, reference)}
    assert bytes(senders[fast]._buffer) == bytes(senders[reference]._buffer)
    assert senders[fast]._buffer_fin == senders[reference]._buffer_fin is not None
    assert pair.server_h3.tracked_stream_count == 0


HEAD_SEQUENCES = {
    "a head": [([(b":status", b"200"), (b"content-type", b"text/event-stream")], False)],
    "a head that ends the response": [([(b":status", b"204")], True)],
    "an interim head, then the head": [
        ([(b":status", b"103"), (b"link", b"</a>; rel=preload")], False),
        ([(b":status", b"200")], False),
    ],
    "a head, then trailers": [([(b":status", b"200")], False), ([(b"x-done", b"1")], True)],
}


@pytest.mark.parametrize("heads", HEAD_SEQUENCES.values(), ids=HEAD_SEQUENCES.keys())
def test_response_heads_are_framed_as_aioquic_frames_them(
    tmp_path: Path, heads: list[tuple[list[tuple[bytes, bytes]], bool]]
) -> None:
    """The same FIN, H3 state and decoded heads as aioquic's own `send_headers`."""
    pair = Pair(tmp_path)
    fast, reference = pair.request(GOOD_HEAD), pair.request(GOOD_HEAD)
    for headers, end in heads:
        pair.server_h3.send_headers(fast, headers, end_stream=end)
        H3Connection.send_headers(pair.server_h3, reference, headers, end_stream=end)
    senders = {sid: pair.server._streams[sid].sender for sid in (fast, reference)}
    # QPACK encodes each field section for its own stream, so compare the frames' shape
    # and what the client decodes.
    assert (senders[fast]._buffer_fin is None) == (senders[reference]._buffer_fin is None)
    states = {sid: pair.server_h3._stream.get(sid) for sid in (fast, reference)}
    assert (states[fast] is None) == (states[reference] is None)
    if states[fast] is not None and states[reference] is not None:
        assert states[fast].headers_send_state == states[reference].headers_send_state
    pair.pump()
    received = {
        stream_id: [
            list(event.headers)
            for event in pair.client_events
            if isinstance(event, HeadersReceived) and event.stream_id == stream_id
        ]
        for stream_id in (fast, reference)
    }
    assert received[fast] == received[reference] == [headers for headers, _ in heads]


def test_a_head_in_a_wrong_state_gets_aioquics_own_error(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    stream_id = pair.request(GOOD_HEAD)
    pair.server_h3.send_headers(stream_id, [(b":status", b"200")])
    pair.server_h3.send_headers(stream_id, [(b"x-done", b"1")])  # trailers
    with pytest.raises(FrameUnexpected, match="HEADERS frame is not allowed"):
        pair.server_h3.send_headers(stream_id, [(b":status", b"200")])
