"""Multi-process Pylon (`workers > 1`): worker processes on one UDP port, one admin endpoint.

One asyncio process tops out at one core, and a busy GPU node's tunnel
traffic needs more (docs/performance.md). The supervisor binds `workers` UDP
sockets on the tunnel port, one SO_REUSEPORT group, and starts `workers`
copies of Pylon (`pylon.worker`), each with its own event loop serving one of
those sockets. A BPF program on the group picks each datagram's socket from
its destination connection ID, and each worker issues IDs that pick its own
socket (`tunnel.steering`), so a gateway connection stays on the worker that
accepted it even when the gateway's address changes. Where the kernel
refuses the program, the group falls back to the kernel's hash of each
datagram's addresses, which keeps a connection in place only while the
gateway's address stays the same.

The supervisor keeps every socket of the group open, and a restarted worker
gets the same socket again. The group never changes while Pylon runs, so
neither does the socket each datagram reaches: a worker's crash or restart
moves no connection of another worker. (Were each worker to bind its own socket, the
group would shrink and regrow around a restart, and the kernel would map the
other workers' connections to different sockets, which then drop them as
unknown.) Datagrams that reach a dead worker's socket wait in its receive
buffer for the restarted worker: new connections are answered late, not
refused; the dead worker's own connections are gone with its state.

The supervisor itself serves no tunnel traffic. It:
- prepares what must happen once (the --dev certificate and mock engine, a
  concrete port when port 0 was asked for) and hands each worker complete
  settings;
- restarts a worker that dies, with backoff, and kills one whose /healthz
  stops answering (its loop is stuck) so it is restarted too;
- serves /metrics (every worker's series merged, `pylon.metrics_merge`, plus
  its own), /readyz (ready only when every worker is) and /healthz;
- on SIGTERM stops being ready and passes SIGTERM on: each worker drains its
  own connections (GOAWAY, grace period) and exits; a second signal is passed
  on too and stops them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from backends.mock import MockEngine
from pylon.admin import TEXT, AdminResponse, AdminServer, start_admin_server
from pylon.app import CUT_SETTLE_S, StartupError, certificate_files, start_mock_if_needed
from pylon.config import Settings, TlsSettings, split_host_port
from pylon.metrics import SupervisorMetrics
from pylon.metrics_merge import merge_expositions, render
from pylon.signals import SecondSignal, ShutdownSignals
from tunnel.steering import ConnectionIdSteering, attach_reuseport_program

__all__ = [
    "PoolTiming",
    "RunningSupervisor",
    "WorkerPool",
    "start_supervisor",
    "supervise_until_signalled",
]

logger = logging.getLogger("pylon.supervisor")


@dataclass(frozen=True)
class PoolTiming:
    """How patient the supervisor is with its workers (tests shorten these)."""

    ready_timeout_s: float = 30.0
    """A worker that has not bound its socket and admin port by then failed to start."""
    restart_backoff_s: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
    """Delay before restart number n in a row; a worker that ran `stable_after_s` resets it."""
    stable_after_s: float = 30.0
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0
    unresponsive_after_checks: int = 3
    """Missed /healthz answers in a row before a worker is killed and restarted (~15 s)."""


METRICS_QUERY_TIMEOUT_S = 5.0
"""Per worker, for a /metrics asked of the supervisor (Prometheus waits 10 s by default)."""
READYZ_QUERY_TIMEOUT_S = 1.0
"""Per worker, for a /readyz asked of the supervisor: below the kubelet's 2 s probe timeout."""
STOP_MARGIN_S = 5.0
"""Past a worker's own drain grace and cut settling, before it is killed."""
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class WorkerStartFailed(StartupError):
    """A worker exited or stayed silent before it was ready."""


@dataclass
class Worker:
    index: int
    process: asyncio.subprocess.Process
    admin_port: int
    started_at: float

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def admin_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin_port}{path}"


async def spawn_worker(
    steering: ConnectionIdSteering,
    settings: Settings,
    tunnel_socket: socket.socket,
    *,
    ready_timeout_s: float,
) -> Worker:
    """Start `python -m pylon.worker` on `tunnel_socket`, the group's socket number
    `steering.index`, and wait for its ready line."""
    index = steering.index
    payload = worker_payload(
        settings, supervisor_pid=os.getpid(), tunnel_fd=tunnel_socket.fileno(), steering=steering
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pylon.worker",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        pass_fds=(tunnel_socket.fileno(),),
        # Its own process group: a terminal's Ctrl-C reaches the supervisor
        # only, which then drains the workers instead of cutting them.
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(payload)
    process.stdin.close()
    try:
        async with asyncio.timeout(ready_timeout_s):
            line = await process.stdout.readline()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise WorkerStartFailed(f"worker {index} not ready after {ready_timeout_s:.0f} s") from None
    if not line:
        code = await process.wait()
        raise WorkerStartFailed(f"worker {index} exited with status {code} before it was ready")
    ready = json.loads(line)
    loop = asyncio.get_running_loop()
    return Worker(index, process, int(ready["admin_port"]), started_at=loop.time())


class WorkerPool:
    """One worker per tunnel socket, kept running; queried over their admin ports."""

    def __init__(
        self,
        *,
        settings: Settings,
        tunnel_sockets: list[socket.socket],
        metrics: SupervisorMetrics,
        client: httpx.AsyncClient,
        timing: PoolTiming = PoolTiming(),
    ) -> None:
        self._settings = settings
        self._tunnel_sockets = tunnel_sockets
        self._slots: list[Worker | None] = [None] * len(tunnel_sockets)
        self._metrics = metrics
        self._client = client
        self._timing = timing
        self._stopping = False
        self._unresponsive: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """All workers ready, or none left running and WorkerStartFailed."""
        spawned = await asyncio.gather(
            *(self._spawn(index) for index in range(len(self._slots))), return_exceptions=True
        )
        failures = [result for result in spawned if isinstance(result, BaseException)]
        for result in spawned:
            if isinstance(result, Worker):
                self._slots[result.index] = result
        if failures:
            await self.stop(timeout_s=0)
            raise failures[0]
        self._tasks = [
            asyncio.create_task(self._keep_running(index)) for index in range(len(self._slots))
        ]
        self._tasks.append(asyncio.create_task(self._check_health()))

    def running(self) -> list[Worker]:
        return [worker for worker in self._slots if worker is not None and worker.running]

    def signal_all(self, signum: int) -> None:
        self._stopping = True
        for worker in self.running():
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signum)

    async def wait_exited(self, timeout_s: float) -> bool:
        """True if every worker exited within `timeout_s`, all with status 0."""
        processes = [worker.process for worker in self.running()]
        if processes:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*(process.wait() for process in processes))
        exited = [worker for worker in self._slots if worker is not None]
        return all(worker.process.returncode == 0 for worker in exited)

    async def stop(self, *, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL whatever still runs after `timeout_s`; no restarts."""
        self.signal_all(signal.SIGTERM)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.wait_exited(timeout_s)
        for worker in self.running():
            worker.process.kill()
        await asyncio.gather(*(worker.process.wait() for worker in self._slots if worker))

    async def scrape(self) -> list[str]:
        """Each running worker's /metrics text; a worker that fails is left out and counted."""
        answers = await asyncio.gather(
            *(self._get(w, "/metrics", METRICS_QUERY_TIMEOUT_S) for w in self.running()),
            return_exceptions=True,
        )
        texts = []
        for answer in answers:
            if isinstance(answer, httpx.Response) and _ok(answer):
                texts.append(answer.text)
            else:
                self._metrics.scrape_failures.inc()
        return texts

    async def not_ready_reasons(self) -> list[str]:
        """Why some worker is not ready (empty when all are)."""
        reasons = [f"worker {index} restarting" for index in self._missing()]
        workers = self.running()
        answers = await asyncio.gather(
            *(self._get(w, "/readyz", READYZ_QUERY_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        for worker, answer in zip(workers, answers, strict=True):
            if not isinstance(answer, httpx.Response):
                reasons.append(f"worker {worker.index} not answering")
            elif answer.status_code != 200:
                reasons.append(f"worker {worker.index} {answer.text.strip()}")
        return reasons

    def _missing(self) -> list[int]:
        return [
            index
            for index, worker in enumerate(self._slots)
            if worker is None or not worker.running
        ]

    async def _get(self, worker: Worker, path: str, timeout_s: float) -> httpx.Response:
        return await self._client.get(worker.admin_url(path), timeout=timeout_s)

    async def _spawn(self, index: int) -> Worker:
        return await spawn_worker(
            ConnectionIdSteering(index, len(self._tunnel_sockets)),
            self._settings,
            self._tunnel_sockets[index],
            ready_timeout_s=self._timing.ready_timeout_s,
        )

    async def _keep_running(self, index: int) -> None:
        failures_in_a_row = 0
        loop = asyncio.get_running_loop()
        while True:
            worker = self._slots[index]
            if worker is not None:
                code = await worker.process.wait()
                if self._stopping:
                    return
                reason = "unresponsive" if index in self._unresponsive else "crashed"
                self._unresponsive.discard(index)
                logger.error("worker %d (pid %d) %s, status %s", index, worker.pid, reason, code)
                self._metrics.worker_restarted(reason)
                stable = loop.time() - worker.started_at >= self._timing.stable_after_s
                failures_in_a_row = 0 if stable else failures_in_a_row
            backoff = self._timing.restart_backoff_s
            delay = backoff[min(failures_in_a_row, len(backoff) - 1)]
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                restarted = await self._spawn(index)
            except WorkerStartFailed as error:
                self._slots[index] = None
                logger.error("%s", error)
            else:
                self._slots[index] = restarted
                logger.info("worker %d restarted (pid %d)", index, restarted.pid)
            failures_in_a_row += 1

    async def _check_health(self) -> None:
        misses: dict[int, int] = {}
        while True:
            await asyncio.sleep(self._timing.health_check_interval_s)
            workers = self.running()
            answers = await asyncio.gather(
                *(
                    self._client.get(
                        w.admin_url("/healthz"), timeout=self._timing.health_check_timeout_s
                    )
                    for w in workers
                ),
                return_exceptions=True,
            )
            misses = {
                worker.pid: 0 if _ok(answer) else misses.get(worker.pid, 0) + 1
                for worker, answer in zip(workers, answers, strict=True)
            }
            for worker in workers:
                missed = misses[worker.pid] >= self._timing.unresponsive_after_checks
                if missed and not self._stopping:
                    logger.error(
                        "worker %d (pid %d) stopped answering /healthz", worker.index, worker.pid
                    )
                    self._unresponsive.add(worker.index)
                    worker.process.kill()


def _ok(answer: httpx.Response | BaseException) -> bool:
    return isinstance(answer, httpx.Response) and answer.status_code == 200


class SupervisorRoutes:
    """The admin endpoint of a multi-process Pylon."""

    def __init__(self, *, registry: CollectorRegistry, workers: WorkerPool) -> None:
        self._registry = registry
        self._workers = workers
        self.draining = False

    async def respond(self, method: str, target: str) -> AdminResponse:
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz", "/readyz"):
            return AdminResponse(404, TEXT, b"not found\n")
        if method not in ("GET", "HEAD"):
            return AdminResponse(405, TEXT, b"method not allowed\n")
        if path == "/metrics":
            return await self.metrics()
        if path == "/readyz":
            return await self.readyz()
        return AdminResponse(200, TEXT, b"ok\n")

    async def metrics(self) -> AdminResponse:
        own = generate_latest(self._registry).decode()
        workers = await self._workers.scrape()
        return AdminResponse(200, PROMETHEUS_TEXT, render(merge_expositions([own, *workers])))

    async def readyz(self) -> AdminResponse:
        reasons = ["draining"] if self.draining else []
        reasons += await self._workers.not_ready_reasons()
        if not reasons:
            return AdminResponse(200, TEXT, b"ready\n")
        return AdminResponse(503, TEXT, f"not ready: {', '.join(reasons)}\n".encode())


@dataclass
class RunningSupervisor:
    settings: Settings
    port: int
    upstream_url: str
    workers: WorkerPool
    routes: SupervisorRoutes
    admin: AdminServer
    mock_engine: MockEngine | None
    _cleanup: contextlib.AsyncExitStack = field(repr=False)

    @property
    def admin_port(self) -> int:
        return self.admin.port

    def start_drain(self) -> None:
        """Not ready at once; every worker drains its own connections."""
        self.routes.draining = True
        self.workers.signal_all(signal.SIGTERM)

    async def close(self) -> None:
        await self._cleanup.aclose()


def worker_payload(
    settings: Settings, *, supervisor_pid: int, tunnel_fd: int, steering: ConnectionIdSteering
) -> bytes:
    """What `pylon.worker` reads on stdin."""
    return json.dumps(
        {
            "supervisor_pid": supervisor_pid,
            "tunnel_fd": tunnel_fd,
            "worker_index": steering.index,
            "worker_count": steering.count,
            "settings": settings.model_dump(mode="json"),
        }
    ).encode()


def bind_tunnel_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` UDP sockets on one address, one SO_REUSEPORT group. Socket `i` of
    the list is socket `i` of the group, the index `tunnel.steering` names,
    since they join it in that order and none leaves while Pylon runs. The
    first bind fails early if something else holds the port and turns port 0
    into the concrete port the others then join."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            address = sock.getsockname()  # port 0 is now concrete: the others join it
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def steer_by_connection_id(sockets: list[socket.socket]) -> bool:
    """Attach the steering program to the group; False (and a warning) where the
    kernel refuses it and the address hash stays in charge."""
    try:
        attach_reuseport_program(sockets[0], len(sockets))
    except OSError as error:
        logger.warning(
            "cannot steer the tunnel port by connection ID (%s): a connection whose "
            "gateway address changes will be lost to another worker",
            error,
        )
        return False
    return True


def worker_settings(
    settings: Settings, *, port: int, upstream_url: str, tls: TlsSettings
) -> Settings:
    """A worker's settings: one process, a concrete port and engine, a private admin port."""
    host, _ = split_host_port(settings.listen)
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return settings.model_copy(
        update={
            "workers": 1,
            "listen": listen,
            "admin_listen": "127.0.0.1:0",
            "tls": tls,
            "upstream": settings.upstream.model_copy(update={"url": upstream_url}),
        }
    )


async def start_supervisor(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    timing: PoolTiming = PoolTiming(),
) -> RunningSupervisor:
    registry = registry if registry is not None else CollectorRegistry()
    cert_file, key_file = certificate_files(settings)
    host, port = split_host_port(settings.listen)
    async with contextlib.AsyncExitStack() as stack:  # unwinds only if start-up fails
        tunnel_sockets = bind_tunnel_sockets(host, port, settings.workers)
        for tunnel_socket in tunnel_sockets:  # closed last: after the workers stopped
            stack.callback(tunnel_socket.close)
        mock_engine, upstream_url = await start_mock_if_needed(settings)
        if mock_engine is not None:
            stack.push_async_callback(mock_engine.close)
        client = httpx.AsyncClient(trust_env=False)
        stack.push_async_callback(client.aclose)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        metrics = SupervisorMetrics(
            registry,
            configured_workers=settings.workers,
            steered=steer_by_connection_id(tunnel_sockets),
        )
        port = int(tunnel_sockets[0].getsockname()[1])
        concrete = worker_settings(
            settings,
            port=port,
            upstream_url=upstream_url,
            tls=TlsSettings(cert_file=cert_file, key_file=key_file),
        )
        pool = WorkerPool(
            settings=concrete,
            tunnel_sockets=tunnel_sockets,
            metrics=metrics,
            client=client,
            timing=timing,
        )
        await pool.start()
        stack.push_async_callback(pool.stop, timeout_s=_worker_stop_timeout(settings))
        metrics.running_gauge(lambda: len(pool.running()))
        routes = SupervisorRoutes(registry=registry, workers=pool)
        admin_host, admin_port = split_host_port(settings.admin_listen)
        admin = await start_admin_server(admin_host, admin_port, routes.respond)
        stack.push_async_callback(admin.close)
        return RunningSupervisor(
            settings,
            port=port,
            upstream_url=upstream_url,
            workers=pool,
            routes=routes,
            admin=admin,
            mock_engine=mock_engine,
            _cleanup=stack.pop_all(),
        )
    raise AssertionError("unreachable")  # mypy: AsyncExitStack may swallow exceptions


def _worker_stop_timeout(settings: Settings) -> float:
    return settings.drain_grace_s + CUT_SETTLE_S + STOP_MARGIN_S


async def supervise_until_signalled(
    settings: Settings, *, on_started: Callable[[RunningSupervisor], None]
) -> int:
    """Supervise until SIGTERM/SIGINT, then drain the workers; a second signal stops at once."""
    supervisor = await start_supervisor(settings)
    signals = ShutdownSignals()
    on_started(supervisor)
    try:
        await signals.first()
        logger.info(
            "draining %d workers", settings.workers, extra={"grace_s": settings.drain_grace_s}
        )
        supervisor.start_drain()
        try:
            exited = await signals.unless_another(
                supervisor.workers.wait_exited(_worker_stop_timeout(settings))
            )
        except SecondSignal:
            logger.warning("second signal: stopping workers without waiting for in-flight requests")
            supervisor.workers.signal_all(signal.SIGTERM)
            return 1
        return 0 if exited else 1
    finally:
        await supervisor.close()
