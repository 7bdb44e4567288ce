"""A real Prometheus scrapes the admin /metrics of a running Pylon.

Pylon runs in-process (tunnel and admin on port 0) in front of a mock engine;
Prometheus (the Debian `prometheus` package) runs as a subprocess with a 1 s
scrape interval. After a few real HTTP/3 requests the test asks Prometheus'
query API for `pylon_requests_total` until the scraped value shows them. The
event loop keeps serving Pylon while it polls, so polling uses async httpx.
Without the binary the test is skipped, except in CI (CI=true) where it fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from backends.mock import MockEngine, MockEngineOptions
from pylon.app import start_pylon
from pylon.config import Settings, UpstreamSettings
from tunnel.client import client_configuration, open_client

REQUESTS = 3
WAIT_S = 30.0
QUERY = 'sum(pylon_requests_total{job="pylon",route="inference",status_class="2xx"})'


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        message = "prometheus binary not installed (apt-get install -y prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_config(directory: Path, admin_port: int) -> Path:
    config = directory / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: pylon\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{admin_port}']\n"
    )
    return config


def start_prometheus(
    binary: str, directory: Path, *, admin_port: int, web_port: int
) -> subprocess.Popen[bytes]:
    log = (directory / "prometheus.log").open("wb")
    try:
        return subprocess.Popen(
            [
                binary,
                f"--config.file={write_config(directory, admin_port)}",
                f"--storage.tsdb.path={directory / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()  # the child holds its own copy


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def send_requests(port: int, count: int) -> None:
    configuration = client_configuration(verify=False)
    async with open_client("127.0.0.1", port, configuration=configuration) as client:
        for index in range(count):
            response = await client.request(
                "POST",
                "/v1/chat/completions",
                headers=[("x-request-id", f"scrape-{index}"), ("content-type", "application/json")],
                body=b'{"model":"m","messages":[]}',
            )
            await response.read()
            assert response.status == 200


async def query_until(web_port: int, expected: float) -> float | None:
    """Poll Prometheus' query API until QUERY equals `expected`; the last value seen."""
    seen: float | None = None
    deadline = time.monotonic() + WAIT_S
    base_url = f"http://127.0.0.1:{web_port}"
    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                answer = (await client.get("/api/v1/query", params={"query": QUERY})).json()
            except (httpx.TransportError, ValueError):
                answer = {}  # Prometheus still starting
            for result in answer.get("data", {}).get("result", []):
                seen = float(result["value"][1])
            if seen == expected:
                return seen
            await asyncio.sleep(0.25)
    return seen


def test_real_prometheus_scrapes_pylon(tmp_path: Path) -> None:
    binary = prometheus_binary()

    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions())
        await engine.start()
        settings = Settings(
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            dev=True,
            state_dir=tmp_path,
            upstream=UpstreamSettings(url=engine.url),
        )
        pylon = await start_pylon(settings)
        web_port = free_tcp_port()
        process = start_prometheus(binary, tmp_path, admin_port=pylon.admin_port, web_port=web_port)
        try:
            await send_requests(pylon.port, REQUESTS)
            seen = await query_until(web_port, REQUESTS)
        finally:
            stop(process)
            await pylon.close()
            await engine.close()
        log = (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:]
        assert seen == REQUESTS, f"Prometheus saw {seen}; its log ends:\n{log}"

    asyncio.run(scenario())
