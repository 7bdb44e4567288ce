"""Tunnel header parsing (once, typed), hop-by-hop stripping, and upstream error mapping."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.errors import (
    BadTunnelHeader,
    UpstreamNotReady,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnreachable,
    map_upstream_errors,
    upstream_error_for,
)
from pylon.tunnel_headers import (
    HOP_BY_HOP_HEADERS,
    U32_MAX,
    parse_priority_value,
    parse_tunnel_headers,
    strip_hop_by_hop,
)

Header = tuple[bytes, bytes]


def _parse(*headers: Header, require: bool = True) -> tuple[str | None, int | None]:
    parsed = parse_tunnel_headers(list(headers), require_request_id=require)
    return parsed.request_id, parsed.priority


def random_casing(name: bytes) -> st.SearchStrategy[bytes]:
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda flips: bytes(
            c ^ 0x20 if flip and chr(c).isalpha() else c
            for c, flip in zip(name, flips, strict=True)
        )
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"0", 0), (b"7", 7), (b" 7 ", 7), (b"\t42\t", 42), (b"007", 7), (b"4294967295", U32_MAX)],
)
def test_priority_values_accepted(value: bytes, expected: int) -> None:
    assert parse_priority_value(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b" ",
        b"-1",
        b"+1",
        b"1.0",
        b"1e3",
        b"high",
        b"4294967296",
        b"99999999999",
        b"1 2",
        b"\xd9\xa3",
        b"0x10",
    ],
)
def test_priority_values_rejected(value: bytes) -> None:
    with pytest.raises(BadTunnelHeader):
        parse_priority_value(value)


def test_absent_priority_is_none_not_zero() -> None:
    assert _parse((b"x-request-id", b"r")) == ("r", None)
    assert _parse((b"x-request-id", b"r"), (b"x-priority", b"0")) == ("r", 0)


def test_rfc9218_priority_header_is_not_the_platform_priority() -> None:
    assert _parse((b"x-request-id", b"r"), (b"priority", b"u=0")) == ("r", None)


@given(st.integers(min_value=0, max_value=U32_MAX), st.sampled_from([b"", b" ", b"\t", b"  "]))
def test_every_u32_round_trips_with_whitespace(number: int, pad: bytes) -> None:
    assert parse_priority_value(pad + str(number).encode() + pad) == number


@given(st.binary(max_size=16))
def test_priority_parser_returns_u32_or_raises_the_one_error(value: bytes) -> None:
    try:
        number = parse_priority_value(value)
    except BadTunnelHeader:
        return
    assert 0 <= number <= U32_MAX
    assert value.strip(b" \t").isdigit()


@given(random_casing(b"x-priority"), random_casing(b"x-request-id"))
def test_tunnel_header_names_in_any_casing(priority_name: bytes, id_name: bytes) -> None:
    assert _parse((id_name, b"abc"), (priority_name, b"3")) == ("abc", 3)


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-request-id", b"")],
        [(b"x-request-id", b"has space")],
        [(b"x-request-id", b"x" * 129)],
        [(b"x-request-id", b"caf\xc3\xa9")],
        [(b"x-request-id", b"a"), (b"x-request-id", b"b")],
        [(b"x-request-id", b"a"), (b"x-priority", b"1"), (b"x-priority", b"2")],
    ],
    ids=["missing", "empty", "space", "too-long", "non-ascii", "repeated", "priority-repeated"],
)
def test_bad_tunnel_headers_rejected(headers: list[Header]) -> None:
    with pytest.raises(BadTunnelHeader):
        _parse(*headers)


@given(
    st.one_of(
        st.binary(max_size=140),
        st.binary(min_size=1, max_size=140).map(
            lambda raw: bytes(0x21 + b % 0x5E for b in raw)  # visible ASCII only
        ),
    )
)
def test_request_id_is_one_to_128_visible_ascii_bytes(value: bytes) -> None:
    expected = 1 <= len(value) <= 128 and all(0x21 <= b <= 0x7E for b in value)
    try:
        parsed = _parse((b"x-request-id", value))
    except BadTunnelHeader:
        assert not expected
    else:
        assert expected
        assert parsed == (value.decode("ascii"), None)


def test_health_requests_need_no_request_id() -> None:
    assert _parse(require=False) == (None, None)


header_names = st.sampled_from(
    [*HOP_BY_HOP_HEADERS, b"content-type", b"accept", b"x-custom", b"traceparent", b"Connection"]
)
header_lists = st.lists(st.tuples(header_names, st.binary(max_size=12)), max_size=12)


@given(header_lists)
def test_hop_by_hop_strip_is_idempotent_and_complete(headers: list[Header]) -> None:
    once = strip_hop_by_hop(headers)
    assert strip_hop_by_hop(once) == once
    assert not any(name in HOP_BY_HOP_HEADERS for name, _ in once)


def test_headers_named_by_connection_are_dropped() -> None:
    headers = [(b"connection", b"x-secret, Keep-Alive"), (b"x-secret", b"1"), (b"accept", b"*/*")]
    assert strip_hop_by_hop(headers) == [(b"accept", b"*/*")]


@pytest.mark.parametrize(
    ("exc", "expected", "status", "retry_safe"),
    [
        (httpx.ConnectError("refused"), UpstreamUnreachable, 502, True),
        (httpx.ConnectTimeout("slow"), UpstreamUnreachable, 502, True),
        (httpx.PoolTimeout("full"), UpstreamNotReady, 503, True),
        (httpx.ReadTimeout("idle"), UpstreamTimeout, 504, False),
        (httpx.RemoteProtocolError("closed"), UpstreamReset, 502, False),
        (httpx.ReadError("reset"), UpstreamReset, 502, False),
        (httpx.LocalProtocolError("bad"), UpstreamProtocolError, 502, False),
    ],
)
def test_upstream_errors_map_to_status(
    exc: Exception, expected: type, status: int, retry_safe: bool
) -> None:
    error = upstream_error_for(exc)
    assert type(error) is expected
    assert error.status == status
    assert error.retry_safe is retry_safe
    body = orjson.loads(error.body())
    assert set(body["error"]) == {"message", "type", "code"}
    assert (b"x-pylon-retry-safe", b"true") in error.headers() or not retry_safe


async def _raised_through_map(exc: BaseException | None) -> BaseException | None:
    try:
        # Nested: one shared, stateless map serves both.
        async with map_upstream_errors(), map_upstream_errors():
            if exc is not None:
                raise exc
    except BaseException as raised:  # the test inspects whatever escaped
        return raised
    return None


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TimeoutError(), UpstreamTimeout),
        (httpx.ReadError("gone"), UpstreamReset),
        (httpx.ConnectError("refused"), UpstreamUnreachable),
    ],
    ids=["budget", "read", "connect"],
)
def test_upstream_error_map_translates_with_the_cause_kept(
    exc: BaseException, expected: type
) -> None:
    raised = asyncio.run(_raised_through_map(exc))
    assert type(raised) is expected
    assert raised.__cause__ is exc


@pytest.mark.parametrize("exc", [ValueError("bug"), asyncio.CancelledError(), None])
def test_upstream_error_map_lets_everything_else_through(exc: BaseException | None) -> None:
    assert asyncio.run(_raised_through_map(exc)) is exc
