"""An independent HTTP/3 client: ngtcp2's `gtlsclient` through Pylon, with and without loss.

Every other test drives Pylon with aioquic on both ends; this one uses
ngtcp2/nghttp3 (Debian's `ngtcp2-client`, version 0.12, ALPN h3) so a quirk
shared by the two aioquic ends cannot hide a bug. gtlsclient 0.12 cannot add
request headers, so it cannot send the `x-request-id` an inference request
needs: the download goes through a health path (no tunnel headers required)
to a static upstream serving 1 MiB, and the upload gets Pylon's complete 400
answer while the rest of its body is refused with STOP_SENDING. A download
from two workers checks that a connection migrating to a new address and
connection ID stays on its worker (`tunnel.steering`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from pylon.config import AuthSettings, Settings, TlsSettings, UpstreamSettings
from pylon.devcert import ensure_dev_certificate
from pylon.supervisor import start_supervisor
from tests.harness import in_ci, run, stack

pytestmark = pytest.mark.e2e

BLOB = random.Random(9).randbytes(1 << 20)
BLOB_PATH = "/blob"
UPLOAD_BYTES = 256 * 1024
CLIENT_BOUND_S = 30.0
"""gtlsclient must finish within this (a bound on hangs, not a speed goal)."""
LOSS = {
    "no-loss": [],
    "5pct": ["--tx-loss=0.05", "--rx-loss=0.05"],
    "15pct": ["--tx-loss=0.15", "--rx-loss=0.15"],
}


def gtlsclient() -> str:
    path = shutil.which("gtlsclient")
    if path is None:
        message = "gtlsclient not installed (apt-get install ngtcp2-client)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


async def _serve_blob(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1, one request per connection: GET /blob is BLOB, anything else 404."""
    head = await reader.readuntil(b"\r\n\r\n")
    found = head.startswith(f"GET {BLOB_PATH} ".encode())
    status, body = (b"200 OK", BLOB) if found else (b"404 Not Found", b"not found")
    writer.write(
        b"HTTP/1.1 %s\r\ncontent-type: application/octet-stream\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()


@contextlib.asynccontextmanager
async def static_upstream() -> AsyncIterator[str]:
    server = await asyncio.start_server(_serve_blob, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def fetch(
    port: int, path: str, download: Path, *, options: list[str]
) -> tuple[int, bytes, bytes]:
    """Run gtlsclient for one request; (exit code, downloaded body, stderr)."""
    download.mkdir()
    process = await asyncio.create_subprocess_exec(
        gtlsclient(),
        "--quiet",
        "--exit-on-all-streams-close",
        f"--download={download}",
        *options,
        "127.0.0.1",
        str(port),
        f"https://127.0.0.1:{port}{path}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), CLIENT_BOUND_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    saved = download / path.rsplit("/", 1)[-1]
    return process.returncode or 0, saved.read_bytes() if saved.exists() else b"", stderr


@pytest.mark.parametrize("loss", list(LOSS))
def test_gtlsclient_downloads_byte_exact(tmp_path: Path, loss: str) -> None:
    async def scenario() -> None:
        async with (
            static_upstream() as url,
            stack(tmp_path, engine=None, upstream_url=url, health_paths=[BLOB_PATH]) as s,
        ):
            code, body, stderr = await fetch(
                s.pylon.port, BLOB_PATH, tmp_path / "download", options=LOSS[loss]
            )
            assert code == 0, stderr.decode(errors="replace")
            assert hashlib.sha256(body).digest() == hashlib.sha256(BLOB).digest()

    run(scenario())


@pytest.mark.parametrize("loss", list(LOSS))
def test_gtlsclient_upload_gets_a_complete_answer(tmp_path: Path, loss: str) -> None:
    async def scenario() -> None:
        upload = tmp_path / "upload.bin"
        upload.write_bytes(random.Random(3).randbytes(UPLOAD_BYTES))
        async with stack(tmp_path) as s:
            options = ["--http-method=POST", f"--data={upload}", *LOSS[loss]]
            code, body, stderr = await fetch(
                s.pylon.port, "/v1/embeddings", tmp_path / "download", options=options
            )
            assert code == 0, stderr.decode(errors="replace")
            assert orjson.loads(body)["error"]["code"] == "bad_tunnel_header"
            assert s.engine is not None
            reached = [r for r in s.engine.snapshot()["requests"] if r["path"] == "/v1/embeddings"]
            assert reached == [], "a rejected upload reached the engine"

    run(scenario())


TRICKLE_CHUNKS, TRICKLE_GAP_S = 16, 0.08
"""The blob in 16 parts 80 ms apart: a download that lasts past the address change."""


async def _trickle_blob(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(BLOB)
        )
        part = len(BLOB) // TRICKLE_CHUNKS
        for start in range(0, len(BLOB), part):
            if start:
                await asyncio.sleep(TRICKLE_GAP_S)
            writer.write(BLOB[start : start + part])
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # Pylon gave up on a stalled download
    finally:
        # Closed however the handler ends, so the loop never closes over an open socket.
        writer.close()


def test_gtlsclient_download_survives_a_migration_with_workers(tmp_path: Path) -> None:
    """ngtcp2 migrates to a new local port, and to a fresh connection ID, 300 ms
    into a download from Pylon under two workers steered by connection ID: each
    download completes. By address hash alone each run would reach the other
    worker, and stall, half the time: four runs would all pass by luck one time
    in sixteen. (gtlsclient 0.12's `--nat-rebinding` drops every packet on its
    new path, against Caddy as well; NAT rebinding is covered by
    tests/test_workers.py.)"""

    async def scenario() -> None:
        handlers: set[asyncio.Task[Any]] = set()

        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            await _trickle_blob(reader, writer)

        server = await asyncio.start_server(tracked, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        cert, key = ensure_dev_certificate(tmp_path)
        settings = Settings(
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            workers=2,
            log_level="warning",
            health_paths=[BLOB_PATH],
            upstream=UpstreamSettings(url=url),
            tls=TlsSettings(cert_file=cert, key_file=key),
            auth=AuthSettings(insecure_no_auth=True),
        )
        supervisor = await start_supervisor(settings, registry=CollectorRegistry())
        try:
            for run_number in range(4):
                code, body, stderr = await fetch(
                    supervisor.port,
                    BLOB_PATH,
                    tmp_path / f"download-{run_number}",
                    options=["--change-local-addr=300ms"],
                )
                assert code == 0, stderr.decode(errors="replace")
                assert hashlib.sha256(body).digest() == hashlib.sha256(BLOB).digest(), run_number
        finally:
            await supervisor.close()
            server.close()
            await server.wait_closed()
            # Python 3.11's wait_closed does not wait for the handlers.
            await asyncio.gather(*handlers, return_exceptions=True)

    run(scenario(), timeout_s=180)
