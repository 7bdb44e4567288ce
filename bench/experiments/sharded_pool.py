"""Candidate: Pylon's upstream httpx pool split into shards (round-robin per request).

httpcore's pool re-examines every pooled connection whenever a request is
queued or released, and for each idle one it counts all connections again
(`connection_pool.py`, `_assign_requests_to_connections`): O(N^2) in the
connections, with a readability poll per connection. With 256 streams the
pool holds ~256 connections. SHARDS independent clients keep each pool
N / SHARDS large; limits stay as configured per shard.

Run: python -m bench compare --workload stream \
        --candidate-command "python -m bench.experiments.sharded_pool"
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import httpx

import pylon.app
from pylon.config import UpstreamSettings
from pylon.forwarder import build_upstream_client

SHARDS = int(os.environ.get("PYLON_EXPERIMENT_SHARDS", "16"))


class ShardedClient:
    """The part of httpx.AsyncClient Pylon uses, spread over several clients."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self._clients = clients
        self._next = itertools.cycle(clients)

    def build_request(self, *args: Any, **kwargs: Any) -> httpx.Request:
        return self._clients[0].build_request(*args, **kwargs)

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        return await next(self._next).send(request, **kwargs)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clients[0], name)


def sharded(settings: UpstreamSettings) -> Any:
    return ShardedClient([build_upstream_client(settings) for _ in range(SHARDS)])


def main() -> int:
    setattr(pylon.app, "build_upstream_client", sharded)  # noqa: B010 (patch for the experiment)
    from pylon.cli import main as pylon_main

    return pylon_main()


if __name__ == "__main__":
    sys.exit(main())
