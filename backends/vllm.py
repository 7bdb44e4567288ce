"""vLLM adapter: body priority (lower runs earlier) and the rank/session deny-list.

Owns every fact about what vLLM's OpenAI server reads from a caller, in the one
table below, and the mapping from a normalized platform level to the body
`priority`. vLLM's `X-Vllm-Priority` header overrides the body, so it is
stripped and Pylon writes only the body field. The client's `x-request-id` is
not handled here: the pipeline forwards exactly one, the tunnel's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from backends.base import BackendAdapter, BodyPath, Derived, RouteClass
from backends.config import VllmConfig
from backends.priority import PriorityPolicy

PRIORITY_FIELD: BodyPath = ("priority",)
"""int, lower runs earlier; only honoured under `--scheduling-policy priority`."""

# --- The vLLM table (engines.md). Extend here when vLLM adds an input. ---

DENIED_HEADERS: frozenset[str] = frozenset(
    {
        "x-vllm-priority",  # overrides the body priority when it parses as an int
        "x-data-parallel-rank",  # pins the data-parallel rank
        "x-session-id",
    }
)
DENIED_BODY_FIELDS: tuple[BodyPath, ...] = (
    ("request_id",),
    ("session_id",),
    # client-chosen remote_host/remote_port make the server connect where told
    ("kv_transfer_params",),
    ("ec_transfer_params",),
    ("vllm_xargs",),
    ("cache_salt",),
)
DERIVED_BODY_FIELDS: tuple[BodyPath, ...] = (PRIORITY_FIELD,)

ROUTES: Mapping[tuple[str, str], RouteClass] = {
    ("POST", "/v1/chat/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/embeddings"): RouteClass.INFERENCE,
    ("POST", "/v1/responses"): RouteClass.INFERENCE,
    ("GET", "/v1/models"): RouteClass.MODELS,
    ("GET", "/health"): RouteClass.HEALTH,
    ("GET", "/ping"): RouteClass.HEALTH,
}
"""Never reachable: /metrics, /load, /version, /scale_elastic_ep,
/inference/v1/*, and the dev-mode routes (/sleep, /collective_rpc, ...)."""


class VllmAdapter(BackendAdapter):
    name: ClassVar[str] = "vllm"
    routes: ClassVar[Mapping[tuple[str, str], RouteClass]] = ROUTES
    denied_headers: ClassVar[frozenset[str]] = DENIED_HEADERS
    denied_body_fields: ClassVar[tuple[BodyPath, ...]] = DENIED_BODY_FIELDS
    derived_body_fields: ClassVar[tuple[BodyPath, ...]] = DERIVED_BODY_FIELDS

    def __init__(
        self, config: VllmConfig | None = None, policy: PriorityPolicy | None = None
    ) -> None:
        super().__init__(policy)
        self.config = config if config is not None else VllmConfig()

    def derive(self, level: int | None) -> Derived:
        """`priority = level`: vLLM shares the platform's polarity.

        None (absent under the `omit` policy) still writes the ceiling: vLLM's
        own default is 0, its MOST urgent class, and absent must never be
        promoted there (tunnel contract), so omitting is not safe on vLLM.
        """
        priority = self.policy.ceiling if level is None else level
        return Derived(body_fields={PRIORITY_FIELD: priority}, emitted_priority=priority)
