"""The adapter registry: `backend.type` -> adapter, by table (no if/elif chain).

Owns the one place a config block becomes an adapter. Adding a backend means
one config class in `backends.config`, one adapter module, one row here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from backends.base import BackendAdapter
from backends.config import BackendConfig
from backends.dynamo import DynamoAdapter
from backends.passthrough import PassthroughAdapter
from backends.priority import PriorityPolicy
from backends.sglang import SglangAdapter
from backends.vllm import VllmAdapter

__all__ = ["BACKEND_TYPES", "build_adapter"]

# Each factory takes the config class whose `type` is its key; the
# discriminated union guarantees that pairing, which is why `Any` is safe here.
_ADAPTERS: Mapping[str, Callable[[Any, PriorityPolicy], BackendAdapter]] = {
    PassthroughAdapter.name: PassthroughAdapter,
    DynamoAdapter.name: DynamoAdapter,
    VllmAdapter.name: VllmAdapter,
    SglangAdapter.name: SglangAdapter,
}

BACKEND_TYPES: tuple[str, ...] = tuple(_ADAPTERS)
"""Every accepted `backend.type` value."""


def build_adapter(config: BackendConfig, policy: PriorityPolicy) -> BackendAdapter:
    """The adapter for a validated backend config block."""
    try:
        factory = _ADAPTERS[config.type]
    except KeyError:
        raise ValueError(f"unknown backend type {config.type!r}") from None
    return factory(config, policy)
