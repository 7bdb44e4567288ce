"""What `tunnel.acks` costs a request body: the server's QUIC CPU for an upload, in memory.

The hook runs once per received datagram, and an upload is all datagrams, so
this is its worst case. A client and a server QuicConnection exchange the
body in memory (`bench.sendpath.MemoryPair`, 1 ms a tick, Pylon's credit hook
on as on every tunnel connection); only the server's calls are timed. Rounds
alternate the hooked and the plain server; the report gives the median CPU
of each, their ratio, and the datagrams the server sent (its ACKs).

Run: python -m bench.experiments.ack_upload [--rounds 5] [--body-bytes 4000000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.quic.connection import QuicConnection

from bench.sendpath import connect
from tunnel.acks import delay_acknowledgements
from tunnel.flow import ConsumptionCredit

WRITE_BYTES = 20_000
"""The body is handed to the client in writes of this size, one a tick."""


@dataclass(frozen=True)
class UploadRun:
    hooked: bool
    server_cpu_s: float
    server_datagrams: int


def run_once(cert_dir: Path, *, hooked: bool, body_bytes: int) -> UploadRun:
    sent = [0]

    def install(server: QuicConnection) -> None:
        ConsumptionCredit(server, window_bytes=2 * body_bytes)  # credit is not what is measured
        if hooked:
            delay_acknowledgements(server)
        datagrams_to_send = server.datagrams_to_send

        def counted(now: float) -> list[tuple[bytes, Any]]:
            datagrams = datagrams_to_send(now=now)
            sent[0] += len(datagrams)
            return datagrams

        server.datagrams_to_send = counted  # type: ignore[method-assign]

    pair = connect(cert_dir, server_hook=install)
    pair.server_cpu_s, sent[0] = 0.0, 0
    stream_id = pair.client.get_next_available_stream_id()
    writes = max(1, body_bytes // WRITE_BYTES)
    for index in range(writes):
        pair.client.send_stream_data(stream_id, bytes(WRITE_BYTES), end_stream=index == writes - 1)
        pair.tick()
    pair.tick(50)  # the last ACKs
    return UploadRun(hooked, pair.server_cpu_s, sent[0])


def run_uploads(*, rounds: int, body_bytes: int) -> list[UploadRun]:
    runs = []
    with tempfile.TemporaryDirectory() as cert_dir:
        for index in range(rounds):
            for hooked in (index % 2 == 0, index % 2 == 1):  # alternate who goes first
                runs.append(run_once(Path(cert_dir), hooked=hooked, body_bytes=body_bytes))
    return runs


def report(runs: list[UploadRun], *, body_bytes: int) -> str:
    def median(hooked: bool, value: Callable[[UploadRun], float]) -> float:
        return statistics.median(value(r) for r in runs if r.hooked == hooked)

    def cpu(run: UploadRun) -> float:
        return run.server_cpu_s

    def datagrams(run: UploadRun) -> float:
        return run.server_datagrams

    plain, hooked = median(False, cpu), median(True, cpu)
    plain_sent, hooked_sent = median(False, datagrams), median(True, datagrams)
    return (
        f"server QUIC CPU for a {body_bytes:,}-byte upload, median of {len(runs) // 2} rounds:\n"
        f"  aioquic's ACKs        {1e3 * plain:7.1f} ms, {plain_sent:.0f} datagrams sent\n"
        f"  tunnel.acks           {1e3 * hooked:7.1f} ms, {hooked_sent:.0f} datagrams sent\n"
        f"  hooked/plain          {hooked / plain:7.2f}x"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.ack_upload")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--body-bytes", type=int, default=4_000_000)
    ns = parser.parse_args(argv)
    print(report(run_uploads(rounds=ns.rounds, body_bytes=ns.body_bytes), body_bytes=ns.body_bytes))


if __name__ == "__main__":
    main()
