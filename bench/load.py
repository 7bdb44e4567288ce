"""The multi-process load generator: N worker processes, one event loop and client each.

Strategy: the parent spawns the workers; each connects first (QUIC
handshakes and imports stay outside the measurement), then all start at one
shared instant. Request i of a run belongs to worker `i % workers`, uses
`pattern[i % len(pattern)]` and is named `<run_id>-<i>`. Closed loop: each
worker keeps its share of `concurrency` requests in flight. Open loop:
request i is sent at `start + i / rate` whether or not earlier ones have
answered (no coordinated omission). Nothing runs past `duration_s` +
`drain_s`; stragglers are abandoned and recorded as timeouts. Records come
back over a queue and are merged; each worker also reports its own CPU time,
so a saturated client is visible in the results.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue as queue_module
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.sharedctypes import SynchronizedArray
from typing import Any

from bench.drivers import Driver, Target, open_driver
from bench.progress import Progress
from bench.stats import Record
from bench.workloads import RequestSpec

SETUP_TIMEOUT_S = 30.0
"""Spawning, importing and connecting a worker: generous for a loaded 2-core machine."""
START_DELAY_S = 0.05
POLL_S = 0.1


@dataclass(frozen=True)
class LoadSpec:
    target: Target
    pattern: tuple[RequestSpec, ...]
    requests: int
    """Requests in the run (fewer if `duration_s` ends it first)."""
    concurrency: int | None = None
    """Closed loop: requests in flight at once."""
    rate_rps: float | None = None
    """Open loop: requests started per second."""
    duration_s: float = 60.0
    """No request starts after this."""
    drain_s: float = 30.0
    """Requests still running this long after `duration_s` are abandoned."""
    ramp_s: float = 0.0
    """Closed loop: spread the first request of each concurrent slot over this long,
    so a run of streams reaches a steady state instead of starting in lockstep."""
    workers: int = 2
    streams_per_connection: int = 64
    """QUIC connections per worker = ceil(in-flight / this); quic-go (Caddy) allows 100."""
    run_id: str = "bench"

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_rps is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate_rps (open)")
        if self.requests < 1 or self.workers < 1 or not self.pattern:
            raise ValueError("requests, workers and pattern must be non-empty")

    @property
    def effective_workers(self) -> int:
        return max(1, min(self.workers, self.requests, self.concurrency or self.requests))

    def share(self, total: int, worker: int) -> int:
        workers = self.effective_workers
        return total // workers + (1 if worker < total % workers else 0)

    def in_flight(self, worker: int) -> int:
        """Most requests this worker can have in flight (sizes its connections)."""
        if self.concurrency is not None:
            return self.share(self.concurrency, worker)
        assert self.rate_rps is not None
        issued = math.ceil(self.rate_rps * (self.duration_s + self.drain_s))
        return max(1, self.share(min(self.requests, issued), worker))

    def indices(self, worker: int) -> Iterator[int]:
        """The request numbers this worker sends."""
        return iter(range(worker, self.requests, self.effective_workers))


@dataclass(frozen=True)
class LoadResult:
    records: list[Record]
    wall_s: float
    """From the common start to the last worker's end."""
    client_cpu_s: float
    """CPU time of all workers while they ran the load."""


@dataclass(frozen=True)
class _WorkerResult:
    records: list[Record]
    end_s: float
    cpu_s: float


def run_load(
    spec: LoadSpec, *, label: str = "load", on_start: Callable[[], None] | None = None
) -> LoadResult:
    """Run one load in worker processes; blocks until every worker has reported.

    `on_start` runs once every worker is connected, just before the common
    start: where a caller snapshots the CPU time of the processes under test.
    """
    ctx = multiprocessing.get_context("spawn")
    workers = spec.effective_workers
    ready, go = ctx.Barrier(workers + 1), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    done: SynchronizedArray[int] = ctx.Array("q", workers, lock=False)
    results: Any = ctx.Queue()
    args = (spec, ready, go, start_at, done, results)
    processes = [
        ctx.Process(target=_worker_main, args=(w, *args), daemon=True) for w in range(workers)
    ]
    for process in processes:
        process.start()
    try:
        _await_ready(ready, processes, results, workers=workers)
        if on_start is not None:
            on_start()
        start_at.value = time.monotonic() + START_DELAY_S
        go.set()
        return _collect(spec, results, done, start=start_at.value, label=label, workers=workers)
    finally:
        for process in processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.terminate()
                process.join()


def _await_ready(ready: Any, processes: list[Any], results: Any, *, workers: int) -> None:
    """Wait until every worker is connected; fail at once, with its traceback, if one died."""
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while ready.n_waiting < workers:
        if not all(p.is_alive() for p in processes) or time.monotonic() > deadline:
            ready.abort()
            raise RuntimeError(f"load workers did not start:\n{_first_error(results)}")
        time.sleep(POLL_S / 5)
    ready.wait(SETUP_TIMEOUT_S)


def _first_error(results: Any) -> str:
    try:
        _, outcome = results.get(timeout=1.0)
    except queue_module.Empty:
        return "(no report)"
    return outcome if isinstance(outcome, str) else "(a worker finished early)"


def _collect(
    spec: LoadSpec, results: Any, done: Any, *, start: float, label: str, workers: int
) -> LoadResult:
    progress = Progress(label, spec.requests)
    deadline = start + spec.duration_s + spec.drain_s + SETUP_TIMEOUT_S
    gathered: dict[int, _WorkerResult] = {}
    while len(gathered) < workers:
        progress.update(sum(done))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{workers - len(gathered)} load workers did not report")
        try:
            worker, outcome = results.get(timeout=POLL_S)
        except queue_module.Empty:
            continue
        if isinstance(outcome, str):
            raise RuntimeError(f"load worker {worker} failed:\n{outcome}")
        gathered[worker] = outcome
    progress.close(sum(done))
    records = [r for w in sorted(gathered) for r in gathered[w].records]
    end = max(r.end_s for r in gathered.values())
    cpu = sum(r.cpu_s for r in gathered.values())
    return LoadResult(records=records, wall_s=end - start, client_cpu_s=cpu)


def _worker_main(
    worker: int, spec: LoadSpec, ready: Any, go: Any, start_at: Any, done: Any, results: Any
) -> None:
    try:
        outcome: _WorkerResult | str = asyncio.run(_worker(worker, spec, ready, go, start_at, done))
    except BaseException:  # report anything to the parent rather than die silently
        import traceback

        outcome = traceback.format_exc()
    results.put((worker, outcome))


async def _worker(
    worker: int, spec: LoadSpec, ready: Any, go: Any, start_at: Any, done: Any
) -> _WorkerResult:
    in_flight = spec.in_flight(worker)
    connections = math.ceil(in_flight / spec.streams_per_connection)
    async with open_driver(spec.target, connections=connections, concurrency=in_flight) as driver:
        await asyncio.to_thread(ready.wait, SETUP_TIMEOUT_S)
        await asyncio.to_thread(go.wait, SETUP_TIMEOUT_S)
        start = start_at.value
        await asyncio.sleep(max(start - time.monotonic(), 0))
        cpu_before = _cpu_s()
        run = _Run(spec, driver, worker, start, done)
        records = await (run.closed(in_flight) if spec.concurrency else run.open())
        return _WorkerResult(records, end_s=time.monotonic(), cpu_s=_cpu_s() - cpu_before)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Run:
    """One worker's share of a run."""

    def __init__(
        self, spec: LoadSpec, driver: Driver, worker: int, start: float, done: Any
    ) -> None:
        self._spec = spec
        self._driver = driver
        self._worker = worker
        self._done = done
        self._start = start
        self._stop_issuing = start + spec.duration_s
        self._deadline = self._stop_issuing + spec.drain_s
        self._indices = spec.indices(worker)
        self.records: list[Record] = []

    async def closed(self, concurrency: int) -> list[Record]:
        total, workers = self._spec.concurrency or 1, self._spec.effective_workers
        slots = [self._worker + k * workers for k in range(concurrency)]
        await asyncio.gather(*(self._loop(slot * self._spec.ramp_s / total) for slot in slots))
        return self.records

    async def _loop(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        for index in self._indices:
            if time.monotonic() >= self._stop_issuing:
                return
            await self._one(index)

    async def open(self) -> list[Record]:
        assert self._spec.rate_rps is not None
        tasks = []
        for index in self._indices:
            send_at = self._start + index / self._spec.rate_rps
            if send_at >= self._stop_issuing:
                break
            await asyncio.sleep(max(send_at - time.monotonic(), 0))
            tasks.append(asyncio.create_task(self._one(index)))
        await asyncio.gather(*tasks)
        return self.records

    async def _one(self, index: int) -> None:
        spec = self._spec.pattern[index % len(self._spec.pattern)]
        request_id = f"{self._spec.run_id}-{index}"
        try:
            record = await self._driver.send(spec, request_id, deadline=self._deadline)
        except Exception as exc:  # a broken connection fails the request, not the run
            record = Record(spec.label, request_id, time.monotonic(), error=type(exc).__name__)
        self.records.append(record)
        self._done[self._worker] += 1
