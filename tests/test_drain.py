"""Graceful drain of the real `pylon serve` process: SIGTERM loses no in-flight request."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from backends.mock import MockEngine, MockEngineOptions
from pylon.devcert import ensure_dev_certificate
from tests.harness import CHAT, run, tunnel_headers
from tunnel.client import client_configuration, open_client

pytestmark = pytest.mark.e2e

STREAM_BODY = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
GRACE_S = 15


async def _start_pylon(
    engine: MockEngine, tmp_path: Path
) -> tuple[asyncio.subprocess.Process, int]:
    cert, key = ensure_dev_certificate(tmp_path)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pylon.cli",
        "serve",
        "--insecure-no-auth",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--upstream",
        engine.url,
        "--cert",
        str(cert),
        "--key",
        str(key),
        "--drain-grace-s",
        str(GRACE_S),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    line = (await process.stdout.readline()).decode()
    match = re.search(r"tunnel on 127\.0\.0\.1:(\d+)", line)
    assert match, line
    return process, int(match.group(1))


def test_sigterm_drains_in_flight_streams(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=20, token_delay_s=0.05))
        await engine.start()
        process, port = await _start_pylon(engine, tmp_path)
        try:
            async with httpx.AsyncClient() as direct:
                expected = (
                    await direct.post(
                        engine.url + CHAT,
                        content=STREAM_BODY,
                        headers=dict(tunnel_headers("drain")),
                    )
                ).content
            configuration = client_configuration(verify=False)
            async with open_client("127.0.0.1", port, configuration=configuration) as client:
                responses = [
                    await client.request(
                        "POST", CHAT, headers=tunnel_headers("drain"), body=STREAM_BODY
                    )
                    for _ in range(20)
                ]
                readers = [asyncio.ensure_future(r.read()) for r in responses]
                await asyncio.sleep(0.2)
                assert not any(reader.done() for reader in readers), "streams ended too early"
                process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                late = await client.request(
                    "POST", CHAT, headers=tunnel_headers("late"), body=STREAM_BODY
                )
                late_body = orjson.loads(await late.read())
                assert late.status == 503
                assert late.header("x-pylon-retry-safe") == "true"
                assert late_body["error"]["code"] == "draining"
                bodies = await asyncio.gather(*readers)
            assert all(body == expected for body in bodies), "an in-flight stream was cut"
            assert await asyncio.wait_for(process.wait(), GRACE_S) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await engine.close()

    run(scenario(), timeout_s=60)


def test_second_signal_stops_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=400, token_delay_s=0.05))
        await engine.start()
        process, port = await _start_pylon(engine, tmp_path)
        try:
            configuration = client_configuration(verify=False)
            async with open_client("127.0.0.1", port, configuration=configuration) as client:
                response = await client.request(
                    "POST", CHAT, headers=tunnel_headers("long"), body=STREAM_BODY
                )
                await anext(response.chunks())
                process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                assert process.returncode is None, "exited before the in-flight stream ended"
                process.send_signal(signal.SIGINT)
                assert await asyncio.wait_for(process.wait(), 5) != 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await engine.close()

    run(scenario(), timeout_s=60)
