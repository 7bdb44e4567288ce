"""SGLang adapter: body priority (polarity set by the engine's flag) and deny-list.

Owns every fact about what SGLang's server reads from a caller, in the one
table below, and the mapping from a normalized platform level to the body
`priority`. The families SGLang reads by prefix (`x-override-*`, `x-smg-*`,
`x-sglext-*`) are stripped by prefix; everything else is an exact name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from backends.base import BackendAdapter, BodyPath, Derived, RouteClass
from backends.config import SglangConfig
from backends.priority import PriorityPolicy

PRIORITY_FIELD: BodyPath = ("priority",)
"""Optional[int]; higher runs first unless --schedule-low-priority-values-first."""

# --- The SGLang table (engines.md). Extend here when SGLang adds an input. ---

DENIED_HEADERS: frozenset[str] = frozenset(
    {
        "x-data-parallel-rank",  # overrides the body rank
        "x-smg-routing-key",  # also covered by x-smg-*; named for a precise label
        "x-custom-labels",
    }
)
DENIED_HEADER_PREFIXES: tuple[str, ...] = (
    "x-override-",  # overwrite body fields (x-override-priority, ...) when enabled
    "x-smg-",
    "x-sglext-",
)
DENIED_BODY_FIELDS: tuple[BodyPath, ...] = tuple(
    (key,)
    for key in (
        "rid",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "lora_path",
        "session_id",
        "session_params",
        "extra_key",
        "cache_salt",
        "custom_logit_processor",
        "custom_labels",
        "routing_key",
        "kv_hints",
        "conversation_id",
        "external_trace_header",
        "received_time",
        "log_metrics",
    )
)
DERIVED_BODY_FIELDS: tuple[BodyPath, ...] = (PRIORITY_FIELD,)
"""Always removed; written only when the engine runs priority scheduling."""

ROUTES: Mapping[tuple[str, str], RouteClass] = {
    ("POST", "/v1/chat/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/completions"): RouteClass.INFERENCE,
    ("POST", "/v1/embeddings"): RouteClass.INFERENCE,
    ("POST", "/generate"): RouteClass.INFERENCE,
    ("GET", "/v1/models"): RouteClass.MODELS,
    ("GET", "/health"): RouteClass.HEALTH,
    ("GET", "/health_generate"): RouteClass.HEALTH,
    ("GET", "/ready"): RouteClass.HEALTH,
    ("GET", "/ping"): RouteClass.HEALTH,
}
"""Never reachable: /abort_request, /flush_cache, /update_weights_*,
/load_lora_adapter, /start_profile, sessions, /server_info, /metrics, ..."""


class SglangAdapter(BackendAdapter):
    name: ClassVar[str] = "sglang"
    routes: ClassVar[Mapping[tuple[str, str], RouteClass]] = ROUTES
    denied_headers: ClassVar[frozenset[str]] = DENIED_HEADERS
    denied_header_prefixes: ClassVar[tuple[str, ...]] = DENIED_HEADER_PREFIXES
    denied_body_fields: ClassVar[tuple[BodyPath, ...]] = DENIED_BODY_FIELDS
    derived_body_fields: ClassVar[tuple[BodyPath, ...]] = DERIVED_BODY_FIELDS

    def __init__(
        self, config: SglangConfig | None = None, policy: PriorityPolicy | None = None
    ) -> None:
        super().__init__(policy)
        self.config = config if config is not None else SglangConfig()

    def derive(self, level: int | None) -> Derived:
        """Nothing unless the engine schedules by priority (it may answer 503 to
        one otherwise); then the level in the engine's polarity, times `scale`
        so platform levels can cross the engine's preemption threshold."""
        if level is None or not self.config.priority_scheduling:
            return Derived()
        ranked = level if self.config.low_values_first else self.policy.ceiling - level
        priority = ranked * self.config.scale
        return Derived(body_fields={PRIORITY_FIELD: priority}, emitted_priority=priority)
