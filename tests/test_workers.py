"""Multi-process Pylon: workers on one UDP port, restarts, drain, merged metrics.

End to end through the real `pylon serve --workers N` process tree, real QUIC
clients on loopback and a mock engine; the merge itself is tested as a pure
function with generated registries.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.mock import MockEngine, MockEngineOptions
from pylon.config import AuthSettings, Settings, TlsSettings, UpstreamSettings
from pylon.devcert import ensure_dev_certificate
from pylon.metrics_merge import merge_expositions, render, rule_for
from pylon.supervisor import PoolTiming, start_supervisor, worker_settings
from tests.harness import CHAT, eventually, process_alive, run, tunnel_headers
from tests.test_admin import documented_metrics
from tunnel.client import H3Client, client_configuration, open_client

BODY = orjson.dumps({"model": "mock-model", "messages": []})
STREAM_BODY = orjson.dumps({"model": "mock-model", "stream": True, "messages": []})
INFERENCE_2XX = ("pylon_requests_total", {"route": "inference", "status_class": "2xx"})


# --- the merge, as a pure function ------------------------------------------------------


def _exposition(requests: int, active: int, ready: int, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("pylon_requests_total", "requests", ["route"], registry=registry)
    counter.labels("inference").inc(requests)
    Gauge("pylon_active_streams", "streams", registry=registry).set(active)
    Gauge("pylon_ready", "ready", registry=registry).set(ready)
    histogram = Histogram("pylon_ttfb_seconds", "ttfb", buckets=(0.1, 1.0), registry=registry)
    for latency in latencies:
        histogram.observe(latency)
    return generate_latest(registry).decode()


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    wanted = tuple(sorted((labels or {}).items()))
    matches = [
        value
        for (sample, sample_labels), value in _values(text).items()
        if sample == name and all(item in sample_labels for item in wanted)
    ]
    assert matches, f"{name}{labels or ''} not exposed"
    return sum(matches)


WORKER = st.tuples(
    st.integers(0, 10_000),
    st.integers(0, 512),
    st.integers(0, 1),
    st.lists(st.floats(0, 5, allow_nan=False), max_size=20),
)


@given(st.lists(WORKER, min_size=1, max_size=6))
def test_merged_series_add_up_except_readiness_which_is_the_minimum(
    workers: list[tuple[int, int, int, list[float]]],
) -> None:
    merged = render(merge_expositions([_exposition(*worker) for worker in workers])).decode()
    assert _value(merged, "pylon_requests_total") == sum(w[0] for w in workers)
    assert _value(merged, "pylon_active_streams") == sum(w[1] for w in workers)
    assert _value(merged, "pylon_ready") == min(w[2] for w in workers)
    assert _value(merged, "pylon_ttfb_seconds_count") == sum(len(w[3]) for w in workers)
    latencies = [latency for w in workers for latency in w[3]]
    assert _value(merged, "pylon_ttfb_seconds_bucket", {"le": "1.0"}) == sum(
        1 for latency in latencies if latency <= 1.0
    )


@given(st.lists(WORKER, min_size=2, max_size=5), st.randoms())
def test_merge_does_not_depend_on_worker_order(
    workers: list[tuple[int, int, int, list[float]]], rng: object
) -> None:
    texts = [_exposition(*worker) for worker in workers]
    shuffled = list(texts)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    forward = _values(render(merge_expositions(texts)).decode())
    backward = _values(render(merge_expositions(shuffled)).decode())
    assert forward.keys() == backward.keys()
    for key, value in forward.items():
        assert backward[key] == pytest.approx(value), key


@given(WORKER)
def test_one_worker_merges_to_itself(worker: tuple[int, int, int, list[float]]) -> None:
    text = _exposition(*worker)
    assert _values(render(merge_expositions([text])).decode()) == _values(text)


@pytest.mark.parametrize(
    ("family", "kind", "rule"),
    [
        ("pylon_requests", "counter", "sum"),
        ("pylon_requests_created", "gauge", "min"),
        ("pylon_open_connections", "gauge", "sum"),
        ("pylon_engine_ready", "gauge", "min"),
        ("process_start_time_seconds", "gauge", "min"),
        ("pylon_build_info", "gauge", "max"),
        ("pylon_request_duration_seconds", "histogram", "sum"),
    ],
)
def test_merge_rules(family: str, kind: str, rule: str) -> None:
    assert rule_for(family, kind) == rule


@pytest.mark.parametrize(
    ("listen", "expected"),
    [("127.0.0.1:0", "127.0.0.1:4999"), ("[::1]:0", "[::1]:4999"), ("0.0.0.0:443", "0.0.0.0:4999")],
)
def test_worker_settings_pin_port_engine_and_a_private_admin_port(
    listen: str, expected: str
) -> None:
    settings = Settings(listen=listen, workers=4, admin_listen="0.0.0.0:9464", dev=True)
    tls = TlsSettings(cert_file=Path("c.pem"), key_file=Path("k.pem"))
    worker = worker_settings(settings, port=4999, upstream_url="http://engine:8000", tls=tls)
    assert (worker.listen, worker.workers, worker.admin_listen) == (expected, 1, "127.0.0.1:0")
    assert (worker.upstream.url, worker.tls) == ("http://engine:8000", tls)
    round_trip = Settings.model_validate(orjson.loads(orjson.dumps(worker.model_dump(mode="json"))))
    assert round_trip == worker


# --- the real process tree ----------------------------------------------------------------


@dataclass
class Tree:
    process: asyncio.subprocess.Process
    port: int
    admin_port: int
    worker_admin_ports: dict[int, int]
    """pid -> admin port, as announced at start."""

    async def metrics(self, port: int | None = None) -> str:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port or self.admin_port}/metrics")
        assert response.status_code == 200
        return response.text

    async def readyz(self) -> int:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"http://127.0.0.1:{self.admin_port}/readyz")).status_code


async def _ready_line(stdout: asyncio.StreamReader, pattern: str) -> re.Match[str]:
    line = (await asyncio.wait_for(stdout.readline(), 30)).decode()
    match = re.search(pattern, line)
    assert match, line
    return match


@contextlib.asynccontextmanager
async def pylon_workers(engine: MockEngine, tmp_path: Path, workers: int) -> AsyncIterator[Tree]:
    cert, key = ensure_dev_certificate(tmp_path)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "pylon.cli", "serve", "--insecure-no-auth"),
        *("--workers", str(workers), "--upstream", engine.url, "--drain-grace-s", "10"),
        *("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"),
        *("--cert", str(cert), "--key", str(key), "--log-level", "warning"),
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        port = int((await _ready_line(process.stdout, r"tunnel on 127\.0\.0\.1:(\d+)")).group(1))
        admin = int((await _ready_line(process.stdout, r"admin on 127\.0\.0\.1:(\d+)")).group(1))
        announced = [
            await _ready_line(process.stdout, r"worker \d+ pid (\d+) admin 127\.0\.0\.1:(\d+)")
            for _ in range(workers)
        ]
        tree = Tree(process, port, admin, {int(m.group(1)): int(m.group(2)) for m in announced})
        assert await eventually(lambda: _is_ready(tree), within_s=10), "never ready"
        yield tree
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        # Read the pipe to its end, so its transport closes before the loop does.
        await asyncio.wait_for(process.stdout.read(), 10)


async def _is_ready(tree: Tree) -> bool:
    return await tree.readyz() == 200


async def _requests_on_one_connection(port: int, name: str, count: int) -> list[int]:
    configuration = client_configuration(verify=False)
    async with open_client("127.0.0.1", port, configuration=configuration) as client:
        statuses = []
        for index in range(count):
            response = await client.request(
                "POST", CHAT, headers=tunnel_headers(f"{name}-{index}"), body=BODY
            )
            await response.read()
            statuses.append(response.status)
        return statuses


@pytest.mark.e2e
def test_connections_spread_over_workers_and_each_stays_on_its_worker(tmp_path: Path) -> None:
    connections, per_connection = 16, 5

    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=3, token_delay_s=0))
        await engine.start()
        try:
            async with pylon_workers(engine, tmp_path, workers=2) as tree:
                statuses = await asyncio.gather(
                    *(
                        _requests_on_one_connection(tree.port, f"c{n}", per_connection)
                        for n in range(connections)
                    )
                )
                assert all(status == 200 for batch in statuses for status in batch)
                per_worker = [
                    _value(await tree.metrics(port), *INFERENCE_2XX)
                    for port in tree.worker_admin_ports.values()
                ]
                # Every request of a connection reached the worker that accepted it,
                # so each worker served whole connections: a multiple of five.
                assert all(served % per_connection == 0 for served in per_worker), per_worker
                assert all(served > 0 for served in per_worker), f"one worker idle: {per_worker}"
                worker_cpu = [
                    _value(await tree.metrics(port), "process_cpu_seconds_total")
                    for port in tree.worker_admin_ports.values()
                ]
                merged = await tree.metrics()
                assert _value(merged, *INFERENCE_2XX) == connections * per_connection
                assert _value(merged, "pylon_workers_running") == 2
                # Process series cover the whole tree: every worker's CPU is inside.
                assert _value(merged, "process_cpu_seconds_total") >= sum(worker_cpu)
                scraped = {name for name, _ in _values(merged)}
                missing = {
                    name
                    for name in documented_metrics()
                    if name not in scraped and name + "_bucket" not in scraped
                }
                assert missing == set(), "documented but not served by the supervisor"
        finally:
            await engine.close()

    run(scenario(), timeout_s=90)


@pytest.mark.e2e
def test_a_killed_worker_is_restarted_and_the_port_keeps_serving(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=3, token_delay_s=0))
        await engine.start()
        try:
            async with pylon_workers(engine, tmp_path, workers=2) as tree:
                victim = next(iter(tree.worker_admin_ports))
                os.kill(victim, signal.SIGKILL)

                assert await eventually(lambda: _restarted_once(tree), within_s=15)
                assert await eventually(lambda: _is_ready(tree), within_s=10)
                statuses = await asyncio.gather(
                    *(_requests_on_one_connection(tree.port, f"r{n}", 2) for n in range(8))
                )
                assert all(status == 200 for batch in statuses for status in batch)
        finally:
            await engine.close()

    run(scenario(), timeout_s=90)


async def _restarted_once(tree: Tree) -> bool:
    text = await tree.metrics()
    return (
        _value(text, "pylon_worker_restarts_total", {"reason": "crashed"}) == 1
        and _value(text, "pylon_workers_running") == 2
    )


async def _answered(client: H3Client, name: str, *, within_s: float) -> bool:
    """One request on an open connection; False if no answer came within `within_s`."""
    try:
        async with asyncio.timeout(within_s):
            response = await client.request("POST", CHAT, headers=tunnel_headers(name), body=BODY)
            await response.read()
    except TimeoutError:
        return False
    return response.status == 200


@pytest.mark.e2e
def test_a_worker_restart_moves_no_connection_of_the_other_workers(tmp_path: Path) -> None:
    connections = 12

    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=3, token_delay_s=0))
        await engine.start()
        configuration = client_configuration(verify=False)
        try:
            async with (
                pylon_workers(engine, tmp_path, workers=2) as tree,
                contextlib.AsyncExitStack() as held,
            ):
                clients = [
                    await held.enter_async_context(
                        open_client("127.0.0.1", tree.port, configuration=configuration)
                    )
                    for _ in range(connections)
                ]
                assert all(
                    await asyncio.gather(
                        *(_answered(c, f"a{n}", within_s=10) for n, c in enumerate(clients))
                    )
                )
                served = {
                    pid: int(_value(await tree.metrics(port), *INFERENCE_2XX))
                    for pid, port in tree.worker_admin_ports.items()
                }
                # The victim is the worker with fewer connections, so the survivor holds some.
                victim, survivor = sorted(served, key=served.__getitem__)
                os.kill(victim, signal.SIGKILL)

                assert await eventually(lambda: _restarted_once(tree), within_s=15)
                assert await eventually(lambda: _is_ready(tree), within_s=10)
                answered = await asyncio.gather(
                    *(_answered(c, f"b{n}", within_s=5) for n, c in enumerate(clients))
                )
                # Every connection of the surviving worker still reaches it; only the
                # killed worker's connections are gone (their state died with it).
                assert sum(answered) == served[survivor], (served, answered)
                # The restarted worker takes new connections on the same port.
                assert await _requests_on_one_connection(tree.port, "c", 2) == [200, 200]
        finally:
            await engine.close()

    run(scenario(), timeout_s=120)


class RebindingNat:
    """A NAT between the test client and Pylon whose outside port can change.

    The client talks to the inside socket; the NAT relays each datagram to
    Pylon from its outside socket and the answers back. `rebind` moves the
    outside to a new port, as a NAT does when its mapping expires: Pylon sees
    the same connection arrive from another address.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._client: tuple[str, int] | None = None
        self._inside: asyncio.DatagramTransport | None = None
        self._outside: asyncio.DatagramTransport | None = None
        self.port = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._inside, _ = await loop.create_datagram_endpoint(
            lambda: _Relay(self._from_client), local_addr=("127.0.0.1", 0)
        )
        self.port = self._inside.get_extra_info("sockname")[1]
        await self.rebind()

    async def rebind(self) -> None:
        old = self._outside
        self._outside, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Relay(self._from_pylon), local_addr=("127.0.0.1", 0)
        )
        if old is not None:
            old.close()

    def close(self) -> None:
        for transport in (self._inside, self._outside):
            if transport is not None:
                transport.close()

    def _from_client(self, data: bytes, addr: tuple[str, int]) -> None:
        self._client = addr
        assert self._outside is not None
        self._outside.sendto(data, self._target)

    def _from_pylon(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._client is not None and self._inside is not None:
            self._inside.sendto(data, self._client)


class _Relay(asyncio.DatagramProtocol):
    def __init__(self, deliver: Callable[[bytes, tuple[str, int]], None]) -> None:
        self._deliver = deliver

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self._deliver(data, addr)


def _served(text: str) -> float:
    """Inference requests answered 200 by one worker (0 before its first)."""
    try:
        return _value(text, *INFERENCE_2XX)
    except AssertionError:
        return 0


@pytest.mark.e2e
def test_a_connection_whose_gateway_address_changes_stays_on_its_worker(tmp_path: Path) -> None:
    rebinds = 8  # by address hash alone, all 8 would stay on one of 2 workers 1 time in 256

    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=3, token_delay_s=0))
        await engine.start()
        nat: RebindingNat | None = None
        try:
            async with pylon_workers(engine, tmp_path, workers=2) as tree:
                nat = RebindingNat(("127.0.0.1", tree.port))
                await nat.start()
                configuration = client_configuration(verify=False)
                async with open_client(
                    "127.0.0.1", nat.port, configuration=configuration
                ) as client:
                    answered = [await _answered(client, "m0", within_s=5)]
                    for n in range(1, rebinds + 1):
                        await nat.rebind()
                        if n % 2 == 0:  # a migration: the client moves to a fresh ID as well
                            client._quic.change_connection_id()
                        answered.append(await _answered(client, f"m{n}", within_s=5))
                assert all(answered), answered
                served = [
                    _served(await tree.metrics(port)) for port in tree.worker_admin_ports.values()
                ]
                assert sorted(served) == [0, rebinds + 1], served
                assert _value(await tree.metrics(), "pylon_workers_steered") == 1
        finally:
            if nat is not None:
                nat.close()
            await engine.close()

    run(scenario(), timeout_s=120)


@pytest.mark.e2e
def test_sigterm_drains_every_worker_and_leaves_no_process(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=20, token_delay_s=0.05))
        await engine.start()
        try:
            async with httpx.AsyncClient() as direct:
                expected = (
                    await direct.post(
                        engine.url + CHAT, content=STREAM_BODY, headers=dict(tunnel_headers("d"))
                    )
                ).content
            configuration = client_configuration(verify=False)
            async with (
                pylon_workers(engine, tmp_path, workers=2) as tree,
                contextlib.AsyncExitStack() as clients,
            ):
                responses = []
                for _ in range(6):  # six connections: both workers get some
                    client = await clients.enter_async_context(
                        open_client("127.0.0.1", tree.port, configuration=configuration)
                    )
                    responses.append(
                        await client.request(
                            "POST", CHAT, headers=tunnel_headers("d"), body=STREAM_BODY
                        )
                    )
                readers = [asyncio.ensure_future(response.read()) for response in responses]
                await asyncio.sleep(0.2)
                assert not any(reader.done() for reader in readers), "streams ended too early"
                tree.process.send_signal(signal.SIGTERM)
                assert await eventually(lambda: _not_ready(tree), within_s=2)
                bodies = await asyncio.gather(*readers)
                assert all(response.status == 200 for response in responses)
                assert all(body == expected for body in bodies), "an in-flight stream was cut"
                assert await asyncio.wait_for(tree.process.wait(), 20) == 0
                assert not [pid for pid in tree.worker_admin_ports if process_alive(pid)]
        finally:
            await engine.close()

    run(scenario(), timeout_s=90)


async def _not_ready(tree: Tree) -> bool:
    return await tree.readyz() == 503


@pytest.mark.e2e
def test_a_hung_worker_is_killed_and_restarted(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = MockEngine(MockEngineOptions(tokens=3, token_delay_s=0))
        await engine.start()
        cert, key = ensure_dev_certificate(tmp_path)
        settings = Settings(
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            workers=2,
            log_level="warning",
            upstream=UpstreamSettings(url=engine.url),
            tls=TlsSettings(cert_file=cert, key_file=key),
            auth=AuthSettings(insecure_no_auth=True),
        )
        registry = CollectorRegistry()
        impatient = PoolTiming(
            health_check_interval_s=0.2,
            health_check_timeout_s=0.2,
            unresponsive_after_checks=2,
            restart_backoff_s=(0.1,),
        )
        supervisor = await start_supervisor(settings, registry=registry, timing=impatient)
        try:
            hung = supervisor.workers.running()[0]
            os.kill(hung.pid, signal.SIGSTOP)  # its event loop stops answering /healthz

            def replaced() -> bool:
                text = generate_latest(registry).decode()
                pids = {worker.pid for worker in supervisor.workers.running()}
                return (
                    _value(text, "pylon_worker_restarts_total", {"reason": "unresponsive"}) == 1
                    and len(pids) == 2
                    and hung.pid not in pids
                )

            assert await eventually(replaced, within_s=20), "hung worker not replaced"
            assert not process_alive(hung.pid)
            statuses = await asyncio.gather(
                *(_requests_on_one_connection(supervisor.port, f"h{n}", 2) for n in range(6))
            )
            assert all(status == 200 for batch in statuses for status in batch)
        finally:
            await supervisor.close()
            await engine.close()

    run(scenario(), timeout_s=90)


def test_a_worker_that_cannot_start_fails_the_start_with_its_reason(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pylon.cli", "serve", "--insecure-no-auth", "--workers", "2"),
            *("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"),
            *("--upstream", "http://127.0.0.1:9", "--cert", str(missing), "--key", str(missing)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "missing.pem" in result.stderr, result.stderr
    assert re.search(r"worker \d exited with status \d+ before it was ready", result.stderr)
