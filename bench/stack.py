"""The processes under test: mock engine, Pylon and Caddy as subprocesses on loopback.

Strategy: each is a context manager that starts the process with its output
in a log file, waits until it really serves (engine /health, Pylon /readyz,
Caddy's TLS port), and always stops it on exit: SIGTERM, then SIGKILL after a
bound. Children run in their own session, so a Ctrl-C reaches only the bench,
whose `finally` blocks stop them in order. Ports are picked free just before
start; every address is 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.caddy import caddyfile

HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 2000


@dataclass(frozen=True)
class Service:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def free_port_tcp_and_udp() -> int:
    """A port free for both TCP and UDP (an HTTPS site with HTTP/3 needs both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            try:
                udp.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free for both TCP and UDP")


@contextlib.contextmanager
def _running(
    name: str,
    argv: Sequence[str],
    *,
    port: int,
    log_dir: Path,
    ready: Callable[[], bool],
    env: dict[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[Service]:
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    service = Service(name, process, port, log_path)
    try:
        wait_for(service, ready, timeout_s=ready_timeout_s, exited="at start-up", late="ready")
        yield service
    finally:
        _stop(process)


def wait_for(
    service: Service, check: Callable[[], bool], *, timeout_s: float, exited: str, late: str
) -> None:
    """Poll `check` until it holds; fail if the service exits or `timeout_s` passes.

    The errors read "<name> exited <exited>" and "<name> not <late> in <timeout_s> s".
    """
    deadline = time.monotonic() + timeout_s
    while not _quietly(check):
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited {exited}:\n{log_tail(service)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} not {late} in {timeout_s} s")
        time.sleep(0.05)


def _quietly(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except (OSError, httpx.HTTPError):
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def log_tail(service: Service) -> str:
    data = service.log_path.read_bytes()[-LOG_TAIL_BYTES:]
    return data.decode(errors="replace")


def _http_ok(url: str) -> Callable[[], bool]:
    return lambda: httpx.get(url, timeout=1.0, trust_env=False).status_code == 200


def _tcp_open(port: int) -> Callable[[], bool]:
    def check() -> bool:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True

    return check


def _python_env() -> dict[str, str]:
    """This environment without PYLON_* variables, so only the bench's flags configure Pylon."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYLON_")}


@contextlib.contextmanager
def engine(
    log_dir: Path,
    *,
    flavour: str = "openai",
    tokens: int = 16,
    token_delay_ms: float = 0.0,
    slots: int | None = None,
) -> Iterator[Service]:
    """`pylon mock-engine` on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "pylon.cli", "mock-engine", "--engine", flavour]
    argv += ["--listen", f"{HOST}:{port}", "--tokens", str(tokens)]
    argv += ["--token-delay-ms", str(token_delay_ms)]
    argv += ["--slots", str(slots)] if slots is not None else []
    ready = _http_ok(f"http://{HOST}:{port}/health")
    with _running(
        f"engine-{flavour}", argv, port=port, log_dir=log_dir, ready=ready, env=_python_env()
    ) as service:
        yield service


@contextlib.contextmanager
def pylon(
    log_dir: Path,
    *,
    upstream: str,
    cert: Path,
    key: Path,
    token_file: Path | None,
    backend: str = "passthrough",
    extra_args: Sequence[str] = (),
    name: str = "pylon",
    command: Sequence[str] = (),
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[Service]:
    """`pylon serve` on a free UDP port, ready when its /readyz says so.

    With `token_file`, requests must carry `authorization: Bearer <token>`, as
    in production; without, Pylon runs with `--insecure-no-auth`. `command`
    replaces `python -m pylon.cli` (to measure a candidate change without
    editing Pylon).
    """
    port, admin_port = free_port(socket.SOCK_DGRAM), free_port()
    if command and command[0] in ("python", "python3"):
        command = (sys.executable, *command[1:])  # the bench's interpreter, so the same venv
    argv = [*(command or (sys.executable, "-m", "pylon.cli")), "serve", "--upstream", upstream]
    argv += ["--cert", str(cert), "--key", str(key), "--backend", backend]
    argv += ["--token-file", str(token_file)] if token_file else ["--insecure-no-auth"]
    argv += ["--listen", f"{HOST}:{port}", "--admin-listen", f"{HOST}:{admin_port}", *extra_args]
    ready = _http_ok(f"http://{HOST}:{admin_port}/readyz")
    with _running(
        name,
        argv,
        port=port,
        log_dir=log_dir,
        ready=ready,
        env=_python_env(),
        ready_timeout_s=ready_timeout_s,
    ) as s:
        yield s


def write_token(directory: Path) -> tuple[Path, tuple[str, str]]:
    """A fresh bearer token file for Pylon and the header that presents it."""
    token = secrets.token_urlsafe(32)
    path = directory / "tokens"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path, ("authorization", f"Bearer {token}")


def caddy_binary() -> str | None:
    return shutil.which("caddy")


@contextlib.contextmanager
def caddy(
    log_dir: Path, *, upstream_port: int, cert: Path, key: Path, access_log: bool = True
) -> Iterator[Service]:
    """Caddy 2.6 with HTTP/3 in front of the engine; its state stays under `log_dir`."""
    binary = caddy_binary()
    if binary is None:
        raise FileNotFoundError("caddy is not installed (Debian: apt-get install -y caddy)")
    port = free_port_tcp_and_udp()
    config = log_dir / "Caddyfile"
    upstream = f"{HOST}:{upstream_port}"
    config.write_text(
        caddyfile(port=port, upstream=upstream, cert=cert, key=key, access_log=access_log)
    )
    state = log_dir / "caddy-state"
    env: dict[str, Any] = {**os.environ, "XDG_DATA_HOME": str(state), "XDG_CONFIG_HOME": str(state)}
    argv = [binary, "run", "--config", str(config), "--adapter", "caddyfile"]
    log_path, tcp_open = log_dir / "caddy.log", _tcp_open(port)

    def ready() -> bool:  # the H3 listener is up once Caddy logs "server running"
        return tcp_open() and b"server running" in log_path.read_bytes()

    with _running("caddy", argv, port=port, log_dir=log_dir, ready=ready, env=env) as s:
        yield s


def engine_snapshot(engine_url: str) -> dict[str, Any]:
    """The mock engine's GET /test-control (records with arrival_s, start_s, finish_s)."""
    response = httpx.get(engine_url + "/test-control", timeout=30.0, trust_env=False)
    response.raise_for_status()
    snapshot: dict[str, Any] = response.json()
    return snapshot


def engine_clear(engine_url: str) -> None:
    httpx.delete(engine_url + "/test-control", timeout=30.0, trust_env=False).raise_for_status()
