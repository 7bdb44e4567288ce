"""Passthrough adapter: any OpenAI-compatible server, no engine-specific inputs.

Owns the OpenAI route allow-list used when Pylon does not know the engine.
Only the always-on deny-lists (trusted-router and tunnel-internal headers,
added by the base class) apply; no body is rewritten and no priority is
written, because Pylon cannot know what an unknown engine would read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from backends.base import BackendAdapter, RouteClass
from backends.config import PassthroughConfig
from backends.priority import PriorityPolicy

OPENAI_ROUTES: Mapping[tuple[str, str], RouteClass] = {
    ("POST", "/v1/chat/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/embeddings"): RouteClass.INFERENCE,
    ("POST", "/v1/responses"): RouteClass.INFERENCE,
    ("GET", "/v1/models"): RouteClass.MODELS,
    ("GET", "/health"): RouteClass.HEALTH,
}
"""The OpenAI surface plus the conventional health route; nothing else."""


class PassthroughAdapter(BackendAdapter):
    name: ClassVar[str] = "passthrough"
    routes: ClassVar[Mapping[tuple[str, str], RouteClass]] = OPENAI_ROUTES

    def __init__(
        self, config: PassthroughConfig | None = None, policy: PriorityPolicy | None = None
    ) -> None:
        super().__init__(policy)
        self.config = config if config is not None else PassthroughConfig()
