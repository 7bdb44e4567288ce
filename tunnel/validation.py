"""RFC 9114 request-head validation beyond what aioquic enforces itself.

aioquic already rejects invalid name characters, uppercase names,
connection-specific fields and duplicate or misplaced pseudo-headers; here the
header list becomes a `RequestHead`, and the rules a request-serving endpoint
adds (a method, a scheme, an origin-form path, no extended CONNECT) are
checked. Pure: headers in, head or `MalformedRequest` out.
"""

from __future__ import annotations

from collections.abc import Iterable

from tunnel.types import MalformedRequest, RequestHead

_REQUIRED_PSEUDO_HEADERS = (b":method", b":scheme", b":path")

# RFC 9114 §4.2: these must never appear in an HTTP/3 message.
CONNECTION_SPECIFIC_FIELDS = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


def parse_request_head(header_list: Iterable[tuple[bytes, bytes]]) -> RequestHead:
    pseudo: dict[bytes, bytes] = {}
    regular: list[tuple[bytes, bytes]] = []
    for name, value in header_list:
        if name.startswith(b":"):
            if regular:
                raise MalformedRequest(f"pseudo-header {name!r} after regular headers")
            if name in pseudo:
                raise MalformedRequest(f"pseudo-header {name!r} repeated")
            pseudo[name] = value
            continue
        _check_regular_field(name, value)
        regular.append((name, value))
    return _head_from(pseudo, tuple(regular))


def _check_regular_field(name: bytes, value: bytes) -> None:
    if not name or name != name.lower():
        raise MalformedRequest(f"header name {name!r} is empty or not lowercase")
    if name in CONNECTION_SPECIFIC_FIELDS:
        raise MalformedRequest(f"connection-specific header {name!r}")
    if name == b"te" and value.lower() != b"trailers":
        raise MalformedRequest("te header other than 'trailers'")


def _head_from(pseudo: dict[bytes, bytes], regular: tuple[tuple[bytes, bytes], ...]) -> RequestHead:
    if b":protocol" in pseudo or pseudo.get(b":method") == b"CONNECT":
        raise MalformedRequest("CONNECT is not served by this endpoint")
    missing = [name.decode() for name in _REQUIRED_PSEUDO_HEADERS if not pseudo.get(name)]
    if missing:
        raise MalformedRequest(f"missing pseudo-headers {missing}")
    unknown = set(pseudo) - {*_REQUIRED_PSEUDO_HEADERS, b":authority"}
    if unknown:
        raise MalformedRequest(f"unknown pseudo-headers {sorted(unknown)}")
    path = pseudo[b":path"]
    if not path.startswith(b"/"):
        raise MalformedRequest("path is not in origin form")
    try:
        return RequestHead(
            method=pseudo[b":method"].decode("ascii"),
            scheme=pseudo[b":scheme"].decode("ascii"),
            authority=pseudo.get(b":authority", b"").decode("ascii"),
            path=path.decode("ascii"),
            headers=regular,
        )
    except UnicodeDecodeError as exc:
        raise MalformedRequest("non-ASCII pseudo-header value") from exc
