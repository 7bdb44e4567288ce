"""The engine's response parsed without I/O (`pylon.upstream_response`), any split, any framing.

The transport tests drive the same parser through real sockets; these pin
what llhttp leaves to Pylon: 1xx heads, HEAD, EOF, the head bound, bytes
after the body, and what makes a connection reusable.
"""

from __future__ import annotations

import itertools

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.upstream_response import (
    END_OF_BODY,
    MAX_HEAD_BYTES,
    NEED_DATA,
    ResponseEvent,
    ResponseHead,
    ResponseParser,
)


def events(parser: ResponseParser, *pieces: bytes, eof: bool = False) -> list[ResponseEvent]:
    out: list[ResponseEvent] = []
    for piece in pieces:
        parser.receive_data(piece)
        while (event := parser.next_event()) is not NEED_DATA:
            out.append(event)
    if eof:
        parser.receive_eof()
        while (event := parser.next_event()) is not NEED_DATA:
            out.append(event)
    return out


def body_of(out: list[ResponseEvent]) -> bytes:
    assert out[-1] is END_OF_BODY
    return b"".join(e for e in out if isinstance(e, bytes))


def chunked(body: bytes, size: int) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(
    body=st.binary(max_size=2000),
    chunk_size=st.integers(1, 500),
    cuts=st.lists(st.integers(0, 3000), max_size=10),
    framing=st.sampled_from(["chunked", "content-length", "until-close"]),
)
def test_any_split_gives_one_head_the_exact_body_and_the_end(
    body: bytes, chunk_size: int, cuts: list[int], framing: str
) -> None:
    heads = {
        "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked(body, chunk_size),
        "content-length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        "until-close": b"HTTP/1.1 200 OK\r\nX-Any-Case: Kept\r\n\r\n" + body,
    }
    parser = ResponseParser()
    out = events(parser, *split(heads[framing], cuts), eof=framing == "until-close")
    head = out[0]
    assert isinstance(head, ResponseHead) and head.status_code == 200 and head.reason == b"OK"
    assert head.headers[0][0] in (b"Transfer-Encoding", b"Content-Length", b"X-Any-Case")
    assert body_of(out[1:]) == body
    assert all(e for e in out[1:-1])  # no empty chunks
    assert parser.reusable == (framing != "until-close")


def test_informational_heads_are_skipped() -> None:
    parser = ResponseParser()
    out = events(
        parser,
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
        b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
    )
    assert out == [ResponseHead(201, b"Created", [(b"content-length", b"2")]), b"ok", END_OF_BODY]
    assert parser.reusable


def test_a_response_to_head_ends_at_its_head_and_retires_the_connection() -> None:
    parser = ResponseParser(head_request=True)
    out = events(parser, b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
    assert out == [ResponseHead(200, b"OK", [(b"content-length", b"1000")]), END_OF_BODY]
    assert not parser.reusable


@pytest.mark.parametrize("status", [204, 304])
def test_bodyless_statuses_end_at_the_head(status: int) -> None:
    parser = ResponseParser()
    out = events(parser, b"HTTP/1.1 %d X\r\n\r\n" % status)
    assert out == [ResponseHead(status, b"X", []), END_OF_BODY]
    assert parser.reusable


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ],
    ids=["connection close", "HTTP/1.0"],
)
def test_a_response_that_closes_is_complete_but_not_reusable(wire: bytes) -> None:
    parser = ResponseParser()
    assert body_of(events(parser, wire)[1:]) == b"ok"
    assert not parser.reusable


@pytest.mark.parametrize("later", [False, True], ids=["same read", "later read"])
@pytest.mark.parametrize("extra", [b"EXTRA", b"HTTP/1.1 2"], ids=["garbage", "a next head"])
def test_bytes_after_the_body_retire_the_connection(later: bool, extra: bytes) -> None:
    """Garbage makes llhttp fail after the end; the start of a head it would parse on."""
    parser = ResponseParser()
    wire = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    out = events(parser, wire, extra) if later else events(parser, wire + extra)
    assert body_of(out[1:]) == b"ok"
    assert not parser.reusable


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-le",
        b"",
    ],
    ids=["content-length", "chunked", "mid-head", "before anything"],
)
def test_eof_before_the_end_is_a_protocol_error(wire: bytes) -> None:
    parser = ResponseParser()
    with pytest.raises(httpx.RemoteProtocolError):
        events(parser, *([wire] if wire else []), eof=True)


@pytest.mark.parametrize(
    "wire",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
    ],
    ids=["not HTTP", "two lengths", "length and chunked", "bad chunk size", "upgrade"],
)
def test_invalid_or_ambiguous_responses_are_protocol_errors(wire: bytes) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        events(ResponseParser(), wire)


def test_the_head_is_bounded() -> None:
    parser = ResponseParser()
    with pytest.raises(httpx.RemoteProtocolError, match="head over"):
        events(parser, b"HTTP/1.1 200 OK\r\n", b"x-big: " + b"a" * MAX_HEAD_BYTES + b"\r\n")


def test_header_values_lose_surrounding_whitespace() -> None:
    out = events(ResponseParser(), b"HTTP/1.1 200 OK\r\nx-a:  v w \t\r\ncontent-length: 0\r\n\r\n")
    assert out[0] == ResponseHead(200, b"OK", [(b"x-a", b"v w"), (b"content-length", b"0")])


def test_reading_past_the_close_is_an_error_not_a_wait() -> None:
    parser = ResponseParser()
    assert body_of(events(parser, b"HTTP/1.1 200 OK\r\n\r\nall", eof=True)[1:]) == b"all"
    with pytest.raises(httpx.RemoteProtocolError):
        parser.receive_eof()
