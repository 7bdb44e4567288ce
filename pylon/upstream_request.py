"""The HTTP/1.1 request to the engine, encoded: a validated head, then the body's framing.

Strategy: the head is checked against the RFC 9110/9112 grammar h11 applies
to a client's request (method and field names are tokens, the target and
field values have no control characters or line breaks, exactly one Host),
and written with Host first, as h11 writes it. The body is framed by what
the head declares: Content-Length exactly that many bytes (more or fewer is
an error before anything wrong reaches the wire, so a body can never run
into the next request on a kept-alive connection), chunked otherwise, none
when the head declares neither. h11's state machine did the same per event
at 39 µs per small request, 5 % of Pylon's CPU (docs/performance.md);
llhttp reads the response (`pylon.upstream_response`).

Pure: bytes in, bytes out, no I/O. Errors are `RequestEncodingError`, which
the connection raises as httpx's `LocalProtocolError`, as h11's own was.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
"""RFC 9110 §5.6.2: a method or a field name."""
FIELD_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
"""RFC 9110 §5.5: visible characters and obs-text, inner spaces or tabs, no NUL, CR or LF."""
REQUEST_TARGET = re.compile(rb"[\x21-\x7e]+")
"""RFC 9112 §3.2: visible ASCII; a space or a line break would end the request line."""

CHUNKED = b"chunked"
LAST_CHUNK = b"0\r\n\r\n"


class RequestEncodingError(ValueError):
    """Pylon was about to write a request that is not valid HTTP/1.1."""


class BodyFraming:
    """The body as the head declared it: `encode` each chunk, then `end`."""

    def __init__(self, content_length: int | None) -> None:
        """`content_length` None is chunked."""
        self._remaining = content_length
        self.complete = False
        """The whole body was encoded, its terminator included."""

    def encode(self, chunk: bytes) -> bytes:
        if self.complete:
            raise RequestEncodingError("request body already ended")
        if self._remaining is None:
            return b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
        if len(chunk) > self._remaining:
            raise RequestEncodingError("too much data for declared Content-Length")
        self._remaining -= len(chunk)
        return chunk

    def end(self) -> bytes:
        if self._remaining:
            raise RequestEncodingError("too little data for declared Content-Length")
        self.complete = True
        return LAST_CHUNK if self._remaining is None else b""


def encode_request_head(
    method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]]
) -> tuple[bytes, BodyFraming]:
    """The request line and fields, and the framing they declare for the body."""
    method_bytes = method.encode("ascii", "replace")
    if TOKEN.fullmatch(method_bytes) is None:
        raise RequestEncodingError(f"invalid method {method!r}")
    if REQUEST_TARGET.fullmatch(target) is None:
        raise RequestEncodingError(f"invalid request target {target!r}")
    hosts: list[bytes] = []
    lines: list[bytes] = []
    content_length: int | None = None
    chunked = False
    for name, value in headers:
        if TOKEN.fullmatch(name) is None:
            raise RequestEncodingError(f"invalid header name {name!r}")
        if FIELD_VALUE.fullmatch(value) is None:
            raise RequestEncodingError(f"invalid value for header {name!r}")
        lowered = name.lower()
        if lowered == b"host":
            hosts.append(b"%b: %b\r\n" % (name, value))
            continue
        if lowered == b"content-length":
            if content_length is not None or not value.isdigit():
                raise RequestEncodingError("Content-Length must be one decimal number")
            content_length = int(value)
        elif lowered == b"transfer-encoding":
            if chunked or value.lower() != CHUNKED:
                raise RequestEncodingError("only Transfer-Encoding: chunked is supported")
            chunked = True
        lines.append(b"%b: %b\r\n" % (name, value))
    if len(hosts) != 1:
        raise RequestEncodingError("an HTTP/1.1 request needs exactly one Host header")
    if chunked and content_length is not None:
        raise RequestEncodingError("both Content-Length and Transfer-Encoding")
    head = b"%b %b HTTP/1.1\r\n%b%b\r\n" % (method_bytes, target, hosts[0], b"".join(lines))
    return head, BodyFraming(None if chunked else content_length or 0)
