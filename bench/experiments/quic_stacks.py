"""The QUIC stack alone, over loopback: aioquic against aiopquic (picoquic, in C) as the server.

What a native stack would save Pylon per small request, before porting
`tunnel/` to it. Each round starts a server on one stack in a subprocess; the
same aioquic client sends it `--requests` small requests (the `small`
workload's sizes: 420 bytes up, 380 down), one stream each, `--concurrency` in
flight on one connection, and the server's CPU time is read from /proc. The
server answers each request as soon as the request has all arrived, so what is
measured is the stack: packets in and out, crypto, ACKs, timers, the event
loop. With `--h3` both servers run aioquic's HTTP/3 layer (`H3Connection`, as
Pylon does) over their QUIC connection and the client sends HTTP/3 requests.
Rounds alternate which stack goes first; the report gives the median CPU per
request of each stack and their ratio.

aiopquic is not a dependency of Pylon (docs/performance.md says why, and how
it was built on this machine); without it the experiment measures aioquic only.

Run: python -m bench.experiments.quic_stacks [--h3] [--requests 2000] [--concurrency 1] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import serve
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent, StreamDataReceived

from bench import procfs
from bench.stack import HOST, free_port
from pylon.cli import run_event_loop
from pylon.devcert import ensure_dev_certificate

STACKS = ("aioquic", "aiopquic")
REQUEST_BODY = b"q" * 420
RESPONSE_BODY = b"r" * 380
REQUEST_HEAD = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"localhost"),
    (b":path", b"/v1/chat/completions"),
    (b"content-type", b"application/json"),
]
RESPONSE_HEAD = [(b":status", b"200"), (b"content-type", b"application/json")]
RAW_ALPN = "pylon-bench"
WARMUP_REQUESTS = 200
LOAD_TIMEOUT_S = 120.0


def stack_available(stack: str) -> bool:
    return stack == "aioquic" or importlib.util.find_spec(stack) is not None


class _Answerer:
    """Answers each request once it has all arrived, over HTTP/3 or a bare stream."""

    def __init__(self, *, h3: bool) -> None:
        self._h3 = h3
        self._http: H3Connection | None = None

    def answer(self, quic: Any, event: QuicEvent) -> None:
        if not self._h3:
            if isinstance(event, StreamDataReceived) and event.end_stream:
                quic.send_stream_data(event.stream_id, RESPONSE_BODY, end_stream=True)
            return
        if self._http is None:
            self._http = H3Connection(quic)
        for http_event in self._http.handle_event(event):
            if isinstance(http_event, DataReceived) and http_event.stream_ended:
                self._http.send_headers(http_event.stream_id, RESPONSE_HEAD)
                self._http.send_data(http_event.stream_id, RESPONSE_BODY, end_stream=True)


async def _serve_aioquic(port: int, cert: Path, key: Path, *, h3: bool) -> Any:
    configuration = QuicConfiguration(is_client=False, alpn_protocols=[_alpn(h3)])
    configuration.load_cert_chain(cert, key)

    class Server(QuicConnectionProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._answerer = _Answerer(h3=h3)

        def quic_event_received(self, event: QuicEvent) -> None:
            self._answerer.answer(self._quic, event)
            self.transmit()

    return await serve(HOST, port, configuration=configuration, create_protocol=Server)


async def _serve_aiopquic(port: int, cert: Path, key: Path, *, h3: bool) -> Any:
    # Imported by name: aiopquic is optional and has no type information.
    server: Any = importlib.import_module("aiopquic.asyncio.server")
    protocol: Any = importlib.import_module("aiopquic.asyncio.protocol")
    configuration: Any = importlib.import_module("aiopquic.quic.configuration")
    events: Any = importlib.import_module("aiopquic.quic.events")

    class Server(protocol.QuicConnectionProtocol):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._answerer = _Answerer(h3=h3)
            self._quic._quic_logger = None  # H3Connection reads it; aiopquic has none

        def quic_event_received(self, event: Any) -> None:
            # aioquic's HTTP/3 layer takes aioquic's events; aiopquic's carry a memoryview.
            if isinstance(event, events.StreamDataReceived):
                converted = StreamDataReceived(
                    data=bytes(event.data), end_stream=event.end_stream, stream_id=event.stream_id
                )
                self._answerer.answer(self._quic, converted)

    settings = configuration.QuicConfiguration(
        is_client=False,
        alpn_protocols=[_alpn(h3)],
        certificate_file=str(cert),
        private_key_file=str(key),
    )
    # aiopquic binds the port on every address; the client still connects over loopback.
    return await server.serve(HOST, port, configuration=settings, create_protocol=Server)


def _alpn(h3: bool) -> str:
    return "h3" if h3 else RAW_ALPN


def serve_forever(stack: str, port: int, cert: Path, key: Path, *, h3: bool) -> None:
    async def main() -> None:
        start = _serve_aioquic if stack == "aioquic" else _serve_aiopquic
        listening = await start(port, cert, key, h3=h3)
        print("ready", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            listening.close()

    run_event_loop(main(), choice="auto")


async def send_requests(port: int, *, requests: int, concurrency: int, h3: bool) -> None:
    """Send `requests` small requests on one connection, `concurrency` at a time."""
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=[_alpn(h3)], verify_mode=ssl.CERT_NONE
    )
    answered: dict[int, asyncio.Future[None]] = {}

    class Client(QuicConnectionProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.http = H3Connection(self._quic) if h3 else None

        def quic_event_received(self, event: QuicEvent) -> None:
            if self.http is None:
                if isinstance(event, StreamDataReceived) and event.end_stream:
                    answered.pop(event.stream_id).set_result(None)
                return
            for http_event in self.http.handle_event(event):
                if isinstance(http_event, DataReceived) and http_event.stream_ended:
                    answered.pop(http_event.stream_id).set_result(None)

    async with connect(HOST, port, configuration=configuration, create_protocol=Client) as client:
        assert isinstance(client, Client)

        async def one() -> None:
            stream_id = client._quic.get_next_available_stream_id()
            done = answered[stream_id] = asyncio.get_running_loop().create_future()
            if client.http is None:
                client._quic.send_stream_data(stream_id, REQUEST_BODY, end_stream=True)
            else:
                client.http.send_headers(stream_id, REQUEST_HEAD)
                client.http.send_data(stream_id, REQUEST_BODY, end_stream=True)
            client.transmit()
            await done

        async def lane(count: int) -> None:
            for _ in range(count):
                await one()

        share, extra = divmod(requests, concurrency)
        async with asyncio.timeout(LOAD_TIMEOUT_S):  # a server that stops answering fails the run
            await asyncio.gather(
                *(lane(share + (lane_index < extra)) for lane_index in range(concurrency))
            )


@dataclass(frozen=True)
class StackRun:
    stack: str
    requests: int
    server_cpu_s: float
    wall_s: float

    @property
    def cpu_per_request_s(self) -> float:
        return self.server_cpu_s / self.requests


def run_once(
    stack: str, cert: Path, key: Path, *, requests: int, concurrency: int, h3: bool
) -> StackRun:
    port = free_port(socket.SOCK_DGRAM)
    command = [sys.executable, "-m", "bench.experiments.quic_stacks", "serve", stack, str(port)]
    command += [str(cert), str(key)] + (["--h3"] if h3 else [])
    server = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the {stack} server did not start (exit {server.wait()})")
        run_event_loop(
            send_requests(port, requests=WARMUP_REQUESTS, concurrency=1, h3=h3), choice="auto"
        )
        cpu_before, start = procfs.cpu_seconds(server.pid), time.perf_counter()
        load = send_requests(port, requests=requests, concurrency=concurrency, h3=h3)
        run_event_loop(load, choice="auto")
        wall = time.perf_counter() - start
        return StackRun(stack, requests, procfs.cpu_seconds(server.pid) - cpu_before, wall)
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def run_rounds(
    stacks: tuple[str, ...], *, rounds: int, requests: int, concurrency: int, h3: bool
) -> list[StackRun]:
    runs = []
    with tempfile.TemporaryDirectory() as state:
        cert, key = ensure_dev_certificate(Path(state))
        for index in range(rounds):
            shift = index % len(stacks)  # each round starts with the next stack
            for stack in stacks[shift:] + stacks[:shift]:
                run = run_once(stack, cert, key, requests=requests, concurrency=concurrency, h3=h3)
                runs.append(run)
                print(
                    f"round {index + 1} {stack:9s} {1e6 * run.cpu_per_request_s:7.1f} us/request",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def report(runs: list[StackRun]) -> str:
    stacks = list(dict.fromkeys(run.stack for run in runs))
    medians = {
        stack: statistics.median(r.cpu_per_request_s for r in runs if r.stack == stack)
        for stack in stacks
    }
    rounds = len(runs) // len(stacks)
    lines = [f"server CPU per request, median of {rounds} rounds:"]
    lines += [f"  {stack:9s} {1e6 * cpu:7.1f} us" for stack, cpu in medians.items()]
    if len(stacks) == 2:
        first, second = stacks
        lines.append(f"  {second}/{first} {medians[second] / medians[first]:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        serving = argparse.ArgumentParser(prog="quic_stacks serve")
        serving.add_argument("stack", choices=STACKS)
        serving.add_argument("port", type=int)
        serving.add_argument("cert", type=Path)
        serving.add_argument("key", type=Path)
        serving.add_argument("--h3", action="store_true")
        ns = serving.parse_args(args[1:])
        serve_forever(ns.stack, ns.port, ns.cert, ns.key, h3=ns.h3)
        return
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.quic_stacks")
    parser.add_argument("--h3", action="store_true", help="aioquic's HTTP/3 layer on both stacks")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    ns = parser.parse_args(args)
    stacks = tuple(stack for stack in STACKS if stack_available(stack))
    if len(stacks) < len(STACKS):
        print("aiopquic is not installed: measuring aioquic only", file=sys.stderr)
    runs = run_rounds(
        stacks, rounds=ns.rounds, requests=ns.requests, concurrency=ns.concurrency, h3=ns.h3
    )
    print(report(runs))


if __name__ == "__main__":
    main()
