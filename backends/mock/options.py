"""Start-up options of a mock engine and the runtime behaviour tests can change.

Strategy: `MockEngineOptions` mirrors the real engines' command-line flags
that matter for priority and queueing; it is fixed for the engine's life.
`Behaviour` is the part a test may change at runtime through
`PUT /test-control` (or `MockEngine.set_behaviour`); it is a frozen value
replaced as a whole, so a request in flight keeps the copy it started with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

ENGINE_FLAVOURS: tuple[str, ...] = ("openai", "dynamo", "vllm", "sglang")
"""Engines the mock can emulate; "openai" is the generic one behind `passthrough`."""


@dataclass(frozen=True)
class MockEngineOptions:
    """How the mock engine is started (the real engines' relevant flags)."""

    engine: str = "openai"
    """One of ENGINE_FLAVOURS."""
    tokens: int = 8
    """Tokens per completion unless the request's `max_tokens` says otherwise."""
    token_delay_s: float = 0.0
    """Delay before each generated token."""
    slots: int | None = None
    """Concurrent generation slots; None = unlimited (no queue)."""
    vllm_scheduling_policy: str = "priority"
    """vLLM `--scheduling-policy`; "fcfs" ignores priority as the real engine does."""
    sglang_priority_scheduling: bool = True
    """SGLang `--enable-priority-scheduling`."""
    sglang_low_values_first: bool = False
    """SGLang `--schedule-low-priority-values-first`."""
    sglang_default_priority: int | None = None
    """SGLang `--default-priority-value`; None = requests without priority run last."""
    sglang_preemption_threshold: int = 10
    """SGLang `--priority-scheduling-preemption-threshold` (recorded, not enforced)."""
    sglang_header_overrides: bool = False
    """SGLang `SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`."""
    sglang_abort_on_priority_when_disabled: bool = False
    """SGLang `--abort-on-priority-when-disabled`."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_FLAVOURS:
            raise ValueError(f"unknown mock engine {self.engine!r}; one of {ENGINE_FLAVOURS}")
        if self.vllm_scheduling_policy not in ("priority", "fcfs"):
            raise ValueError("vllm_scheduling_policy must be 'priority' or 'fcfs'")


@dataclass(frozen=True)
class Behaviour:
    """What a test may change at runtime; same field names as PUT /test-control."""

    tokens: int
    token_delay_ms: float
    slots: int | None
    health_status: int = 200
    """Status of the health routes (503 emulates "not ready")."""
    fail_after_tokens: int | None = None
    """Streaming requests: abruptly close the TCP connection after this many tokens."""
    status_override: int | None = None
    """Answer every inference request with this status and an engine-shaped error."""


def initial_behaviour(options: MockEngineOptions) -> Behaviour:
    return Behaviour(
        tokens=options.tokens,
        token_delay_ms=options.token_delay_s * 1000.0,
        slots=options.slots,
    )


_INT_FIELDS = ("tokens", "health_status")
_OPTIONAL_INT_FIELDS = ("slots", "fail_after_tokens", "status_override")


def apply_changes(current: Behaviour, changes: Mapping[str, Any]) -> Behaviour:
    """Validate and apply a PUT /test-control object; raises ValueError on a bad field."""
    for name, value in changes.items():
        _check_field(name, value)
    return replace(current, **dict(changes))


def _check_field(name: str, value: Any) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in _INT_FIELDS and is_int and value >= 0:
        return
    if name in _OPTIONAL_INT_FIELDS and (value is None or (is_int and value >= 0)):
        return
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if name == "token_delay_ms" and is_number and value >= 0:
        return
    raise ValueError(f"invalid test-control field {name}={value!r}")
