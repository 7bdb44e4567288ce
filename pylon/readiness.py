"""Whether Pylon should receive traffic, and the background probe of the engine behind it.

Strategy: `Readiness` is three plain flags (listener up, draining, engine
ready) and the one rule that combines them; no I/O, no clock. `EngineProbe`
is the only I/O here: a task that GETs the engine's health route through the
same pooled httpx client the forwarder uses, every `interval_s`, and writes
the answer into `Readiness` and the `pylon_engine_ready` gauge. /readyz then
reads the flags, so a scrape never waits on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:  # metrics imports ProbeResult from here
    from pylon.metrics import Metrics

__all__ = [
    "ENGINE_HEALTH_PATH",
    "PROBE_INTERVAL_S",
    "EngineProbe",
    "ProbeResult",
    "Readiness",
]

logger = logging.getLogger("pylon.readiness")

ENGINE_HEALTH_PATH = "/health"
"""Every supported engine (vLLM, SGLang, Dynamo, OpenAI-compatible) answers it."""

PROBE_INTERVAL_S = 2.0
"""Below Kubernetes' default readinessProbe period (10 s), so /readyz is fresh."""

MIN_PROBE_TIMEOUT_S = 1.0
"""A probe may take its interval or this, whichever is longer: a short test
interval must not turn a busy loopback engine into "unreachable"."""


class ProbeResult(StrEnum):
    """Outcome of one engine health probe (a bounded metric label)."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    """The engine answered with a non-2xx status."""
    UNREACHABLE = "unreachable"
    """No answer: connect error, reset or timeout."""


@dataclass
class Readiness:
    """The flags /readyz combines; the engine starts not ready until a probe says so."""

    listener_up: bool = False
    """The QUIC listener is bound."""
    draining: bool = False
    """Shutdown has begun: finish in-flight work, take no new traffic."""
    engine_ready: bool = False
    """The last engine health probe succeeded."""

    def mark_draining(self) -> None:
        """Called on SIGTERM: /readyz fails from now on, whatever the engine says."""
        self.draining = True

    @property
    def ready(self) -> bool:
        return self.listener_up and not self.draining and self.engine_ready

    def reasons(self) -> list[str]:
        """Why Pylon is not ready (empty when it is), for the /readyz body."""
        reasons = []
        if not self.listener_up:
            reasons.append("listener_down")
        if self.draining:
            reasons.append("draining")
        if not self.engine_ready:
            reasons.append("engine_not_ready")
        return reasons


class EngineProbe:
    """Polls the engine's health route in the background until `stop()`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        upstream_url: str,
        *,
        readiness: Readiness,
        metrics: Metrics,
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._client = client
        self._url = upstream_url.rstrip("/") + ENGINE_HEALTH_PATH
        self.readiness = readiness
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout_s = max(interval_s, MIN_PROBE_TIMEOUT_S)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def probe_once(self) -> ProbeResult:
        result = await self._check()
        ready = result is ProbeResult.HEALTHY
        if ready != self.readiness.engine_ready:
            level = logging.INFO if ready else logging.WARNING
            logger.log(level, "engine %s", "ready" if ready else f"not ready ({result.value})")
        self.readiness.engine_ready = ready
        self._metrics.engine_probed(result, ready=ready)
        return result

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval_s)

    async def _check(self) -> ProbeResult:
        # The forwarder's client has no read timeout (generations are long);
        # a probe that outlives its budget counts as no answer.
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.get(self._url)
        except (httpx.HTTPError, TimeoutError):
            return ProbeResult.UNREACHABLE
        except Exception:  # a bug must not freeze readiness at its last value
            logger.exception("engine probe failed")
            return ProbeResult.UNREACHABLE
        return ProbeResult.HEALTHY if response.is_success else ProbeResult.UNHEALTHY
