"""One worker process of a multi-process Pylon (`python -m pylon.worker`, started by
`pylon.supervisor`, never by hand).

The supervisor writes its pid, the worker's complete settings, the number
of the tunnel socket it passed down and that socket's place in the group
(`tunnel.steering`) as JSON on stdin
(`pylon.supervisor.worker_payload`: the certificate already generated, the
upstream URL resolved, the admin server on an ephemeral loopback port) and
reads one JSON line back on stdout once the worker serves: its pid and admin
port. The worker then serves like a single Pylon on that socket, one of the
port's SO_REUSEPORT group, until SIGTERM (drain) or a second signal (stop at
once). If the supervisor dies, the kernel sends the worker SIGTERM (Linux
parent-death signal), so no worker outlives it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys

from pylon.app import RunningPylon, StartupError
from pylon.cli import run_event_loop, serve_until_signalled
from pylon.config import Settings
from pylon.logs import configure_logging
from tunnel.steering import ConnectionIdSteering

PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the supervisor exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def announce(pylon: RunningPylon) -> None:
    """The one stdout line the supervisor waits for; later prints go to stderr."""
    ready = {"pid": os.getpid(), "port": pylon.port, "admin_port": pylon.admin_port}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    sys.stdout = sys.stderr


def main() -> int:
    payload = json.loads(sys.stdin.buffer.read())
    exit_with_parent(payload["supervisor_pid"])
    settings = Settings.model_validate(payload["settings"])
    tunnel_socket = socket.socket(fileno=payload["tunnel_fd"])
    steering = ConnectionIdSteering(payload["worker_index"], payload["worker_count"])
    configure_logging(level=settings.log_level, human=settings.dev)
    try:
        return run_event_loop(
            serve_until_signalled(
                settings, on_started=announce, tunnel_socket=tunnel_socket, steering=steering
            ),
            choice=settings.event_loop,
        )
    except StartupError as error:
        print(f"pylon worker: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"pylon worker: cannot listen: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
