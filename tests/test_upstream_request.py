"""The request encoder: what it writes reads back the same in h11, and it refuses what h11
refuses to send, so nothing invalid or mis-framed reaches the engine."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.upstream_request import RequestEncodingError, encode_request_head

HOST = (b"host", b"engine:8000")

token_bytes = st.binary(min_size=1, max_size=12).filter(
    lambda name: name.lower() not in (b"host", b"content-length", b"transfer-encoding")
)
"""Any bytes as a field name: most are not tokens, which both encoders must refuse."""
value_bytes = st.binary(max_size=16)
valid_names = (
    st.text(
        alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$%&'*+^`|~",
        min_size=1,
        max_size=12,
    )
    .map(str.encode)
    .filter(lambda name: name.lower() not in (b"host", b"content-length", b"transfer-encoding"))
)
valid_values = st.from_regex(rb"\A(?:[!-~\x80-\xff]+(?:[ \t]+[!-~\x80-\xff]+)*)?\Z")


def parse_with_h11(wire: bytes) -> tuple[h11.Request, bytes]:
    """What an HTTP/1.1 server makes of the bytes: the request, and its whole body."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(wire)
    request = server.next_event()
    assert isinstance(request, h11.Request)
    body = b""
    while True:
        event = server.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise AssertionError(f"the request did not end: {event!r}")
    assert server.next_event() is h11.NEED_DATA  # nothing after the body
    return request, body


def encode(
    headers: list[tuple[bytes, bytes]], chunks: list[bytes], *, method: str = "POST"
) -> bytes:
    head, framing = encode_request_head(method, b"/v1/chat/completions?x=1", headers)
    wire = head + b"".join(framing.encode(chunk) for chunk in chunks) + framing.end()
    assert framing.complete
    return wire


@given(
    fields=st.lists(st.tuples(valid_names, valid_values), max_size=8),
    chunks=st.lists(st.binary(max_size=40), max_size=6),
    chunked=st.booleans(),
)
def test_what_is_written_reads_back_the_same(
    fields: list[tuple[bytes, bytes]], chunks: list[bytes], chunked: bool
) -> None:
    body = b"".join(chunks)
    framing = (
        (b"transfer-encoding", b"chunked") if chunked else (b"content-length", b"%d" % len(body))
    )
    request, received = parse_with_h11(encode([*fields, HOST, framing], chunks))
    assert request.method == b"POST"
    assert request.target == b"/v1/chat/completions?x=1"
    assert request.headers[0] == HOST  # Host first, as h11 writes it
    assert sorted(request.headers) == sorted(
        (name.lower(), value) for name, value in [*fields, HOST, framing]
    )
    assert received == body


@given(name=st.one_of(valid_names, token_bytes), value=st.one_of(valid_values, value_bytes))
def test_a_field_is_refused_exactly_when_h11_refuses_it(name: bytes, value: bytes) -> None:
    headers = [HOST, (name, value)]
    try:
        h11.Connection(h11.CLIENT).send(h11.Request(method="GET", target="/", headers=headers))
    except h11.LocalProtocolError:
        h11_refuses = True
    else:
        h11_refuses = False
    try:
        encode_request_head("GET", b"/", headers)
    except RequestEncodingError:
        refused = True
    else:
        refused = False
    assert refused == h11_refuses


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("GET", b"/a b"),
        ("GET", b"/a\r\nx: y"),
        ("GET", b""),
        ("G ET", b"/"),
        ("", b"/"),
        ("GÉT", b"/"),
    ],
)
def test_a_request_line_that_would_break_is_refused(method: str, target: bytes) -> None:
    with pytest.raises(RequestEncodingError):
        encode_request_head(method, target, [HOST])


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [HOST, HOST],
        [HOST, (b"content-length", b"1"), (b"content-length", b"1")],
        [HOST, (b"content-length", b"-1")],
        [HOST, (b"content-length", b"1"), (b"transfer-encoding", b"chunked")],
        [HOST, (b"transfer-encoding", b"gzip")],
        [HOST, (b"x-a", b"v\r\ninjected: 1")],
        [HOST, (b"x-a", b" leading space")],
    ],
    ids=[
        "no host",
        "two hosts",
        "two lengths",
        "negative length",
        "length and chunked",
        "not chunked",
        "line break in a value",
        "leading space",
    ],
)
def test_a_head_with_broken_framing_or_fields_is_refused(
    headers: list[tuple[bytes, bytes]],
) -> None:
    with pytest.raises(RequestEncodingError):
        encode_request_head("POST", b"/", headers)


def test_a_body_longer_than_its_declared_length_is_refused_before_it_is_written() -> None:
    _, framing = encode_request_head("POST", b"/", [HOST, (b"content-length", b"5")])
    assert framing.encode(b"abc") == b"abc"
    with pytest.raises(RequestEncodingError, match="too much"):
        framing.encode(b"def")  # would run 1 byte into the next request on the connection


def test_a_body_shorter_than_its_declared_length_cannot_end() -> None:
    _, framing = encode_request_head("POST", b"/", [HOST, (b"content-length", b"5")])
    framing.encode(b"abc")
    with pytest.raises(RequestEncodingError, match="too little"):
        framing.end()
    assert not framing.complete  # so the connection is not reused


def test_no_declared_framing_means_no_body() -> None:
    _, framing = encode_request_head("GET", b"/health", [HOST])
    with pytest.raises(RequestEncodingError):
        framing.encode(b"x")
    assert framing.end() == b""
    assert framing.complete


def test_nothing_can_follow_the_end_of_a_body() -> None:
    _, framing = encode_request_head("POST", b"/", [HOST, (b"transfer-encoding", b"chunked")])
    assert framing.end() == b"0\r\n\r\n"
    with pytest.raises(RequestEncodingError):
        framing.encode(b"more")
