"""`pylon call`: one HTTP/3 request as the gateway would send it, body streamed to stdout."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from urllib.parse import urlsplit

from tunnel.client import client_configuration, open_client
from tunnel.types import StreamAborted


def _headers(raw: list[str]) -> list[tuple[str, str]]:
    headers = []
    for item in raw:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"header {item!r} is not 'name: value'")
        headers.append((name.strip().lower(), value.strip()))
    return headers


def _body(data: str | None) -> bytes | None:
    if data is None:
        return None
    if data.startswith("@"):
        return Path(data[1:]).read_bytes()
    return data.encode()


async def _call(namespace: argparse.Namespace) -> int:
    url = urlsplit(namespace.url)
    if url.scheme != "https" or not url.hostname:
        raise ValueError("URL must be https://HOST[:PORT]/path")
    body = _body(namespace.data)
    method = namespace.method or ("POST" if body is not None else "GET")
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    if (namespace.cert is None) != (namespace.key is None):
        raise ValueError("--cert and --key go together")
    configuration = client_configuration(
        verify=not namespace.insecure,
        cafile=namespace.cacert,
        server_name=url.hostname,
        client_cert=(namespace.cert, namespace.key) if namespace.cert else None,
    )
    async with open_client(url.hostname, url.port or 443, configuration=configuration) as client:
        try:
            response = await client.request(
                method, path, headers=_headers(namespace.headers), body=body, authority=url.netloc
            )
        except StreamAborted as error:
            # No response head: refused (e.g. a TLS alert 0x1xx for a missing client certificate).
            raise ConnectionError(f"no response, closed by the server: {error}") from error
        print(f"HTTP/3 {response.status}", file=sys.stderr)
        for name, value in response.headers:
            print(f"{name.decode()}: {value.decode('latin-1')}", file=sys.stderr)
        print(file=sys.stderr)
        async for chunk in response.chunks():
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    return 0 if response.status < 400 else 1


def run_call(namespace: argparse.Namespace) -> int:
    try:
        return asyncio.run(asyncio.wait_for(_call(namespace), timeout=300))
    except StreamAborted as error:
        print(f"pylon: response truncated: {error}", file=sys.stderr)
        return 3
    except (ValueError, OSError, ConnectionError, TimeoutError) as error:
        print(f"pylon: {error or type(error).__name__}", file=sys.stderr)
        return 2
