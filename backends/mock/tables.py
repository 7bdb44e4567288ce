"""Tables of the inputs each engine reads: priority and routing headers and body fields.

Strategy: one place per engine, copied from /work/shared/spec/engines.md, so
the lists are easy to compare with the spec and to extend when the engines
add names. The generic "openai" mock records the union of all of them, so a
passthrough test can see whatever reached the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.mock.inputs import HeaderList, body_matching, headers_matching


@dataclass(frozen=True)
class FieldSet:
    """Headers (exact names and prefixes) and dotted body paths an engine reads."""

    headers: frozenset[str] = frozenset()
    header_prefixes: tuple[str, ...] = ()
    body_paths: tuple[str, ...] = ()

    def collect(self, headers: HeaderList, body: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "headers": headers_matching(headers, self.headers, self.header_prefixes),
            "body": body_matching(body, self.body_paths),
        }

    def union(self, other: FieldSet) -> FieldSet:
        prefixes = self.header_prefixes + tuple(
            p for p in other.header_prefixes if p not in self.header_prefixes
        )
        paths = self.body_paths + tuple(p for p in other.body_paths if p not in self.body_paths)
        return FieldSet(self.headers | other.headers, prefixes, paths)


@dataclass(frozen=True)
class InputTable:
    priority: FieldSet
    routing: FieldSet


# Routing headers only a trusted router may set (llm-d / Gateway API Inference
# Extension); no engine should receive them from a caller.
_GATEWAY = FieldSet(
    headers=frozenset(
        {
            "x-prefiller-host-port",
            "x-encoder-hosts-ports",
            "x-data-parallel-host-port",
            "x-kv-cache-source-host-port",
            "x-data-parallel-rank",
        }
    ),
    header_prefixes=("x-gateway-destination-endpoint",),
)

DYNAMO_NVEXT_KEYS = frozenset(
    {
        "ignore_eos",
        "top_k",
        "repetition_penalty",
        "greed_sampling",
        "use_raw_prompt",
        "annotations",
        "backend_instance_id",
        "decode_worker_id",
        "prefill_worker_id",
        "dp_rank",
        "prefill_dp_rank",
        "cache_salt",
        "routing_constraints",
        "router",
        "metadata_upload",
        "agent_hints",
        "extra_fields",
        "max_thinking_tokens",
    }
)
"""nvext keys Dynamo accepts; any other key is a 400 (serde deny_unknown_fields)."""

DYNAMO_TOP_LEVEL_FIELDS = frozenset(
    {
        # OpenAI chat/completions/embeddings request fields
        "model", "messages", "prompt", "suffix", "echo", "best_of", "stream",
        "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "n", "stop", "seed", "user", "tools", "tool_choice", "parallel_tool_calls",
        "functions", "function_call", "logprobs", "top_logprobs", "presence_penalty",
        "frequency_penalty", "logit_bias", "response_format", "input", "encoding_format",
        "dimensions", "modalities", "audio", "prediction", "reasoning_effort", "store",
        "metadata", "service_tier", "web_search_options",
        # Responses API
        "instructions", "previous_response_id", "text", "reasoning", "truncation",
        "include", "max_output_tokens", "background", "conversation",
        # Dynamo's flattened common extensions
        "nvext", "ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty",
        "include_stop_str_in_output", "guided_json", "guided_regex", "guided_grammar",
        "guided_choice", "guided_decoding_backend", "guided_whitespace_pattern",
        "chat_template_args", "chat_template_kwargs", "cache_salt",
    }
)  # fmt: skip
"""Top-level fields Dynamo accepts; note there is no vLLM-style `priority`."""

_DYNAMO = InputTable(
    priority=FieldSet(
        headers=frozenset({"x-dynamo-request-priority", "x-dynamo-request-strict-priority"}),
        body_paths=(
            "nvext.agent_hints.priority",
            "nvext.agent_hints.strict_priority",
            "nvext.agent_hints.latency_sensitivity",
        ),
    ),
    routing=FieldSet(
        headers=frozenset(
            {
                "x-dynamo-worker-instance-id", "x-worker-instance-id",
                "x-dynamo-prefill-instance-id", "x-prefill-instance-id",
                "x-dynamo-dp-rank", "x-dp-rank", "x-data-parallel-rank",
                "x-dynamo-prefill-dp-rank", "x-prefill-dp-rank",
                "x-tenant-id", "request-id", "x-dynamo-request-id",
                "x-dynamo-session-id", "x-dynamo-parent-session-id", "x-dynamo-session-final",
            }
        ),
        header_prefixes=("x-dynamo-meta-",),
        body_paths=(
            "nvext.backend_instance_id", "nvext.decode_worker_id", "nvext.prefill_worker_id",
            "nvext.dp_rank", "nvext.prefill_dp_rank", "nvext.cache_salt",
            "nvext.routing_constraints", "nvext.router", "nvext.metadata_upload",
            "nvext.agent_hints.speculative_prefill", "cache_salt",
        ),
    ).union(_GATEWAY),
)  # fmt: skip

_VLLM = InputTable(
    priority=FieldSet(headers=frozenset({"x-vllm-priority"}), body_paths=("priority",)),
    routing=FieldSet(
        headers=frozenset({"x-data-parallel-rank", "x-session-id", "x-request-id"}),
        body_paths=(
            "request_id", "session_id", "kv_transfer_params", "ec_transfer_params",
            "vllm_xargs", "cache_salt",
        ),
    ).union(_GATEWAY),
)  # fmt: skip

_SGLANG = InputTable(
    priority=FieldSet(headers=frozenset({"x-override-priority"}), body_paths=("priority",)),
    routing=FieldSet(
        headers=frozenset({"x-data-parallel-rank", "x-custom-labels", "x-smg-routing-key"}),
        header_prefixes=("x-override-", "x-smg-", "x-sglext-"),
        body_paths=(
            "rid", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
            "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
            "decode_tp_size", "lora_path", "session_id", "session_params", "extra_key",
            "cache_salt", "custom_logit_processor", "custom_labels", "routing_key",
            "kv_hints", "conversation_id", "external_trace_header", "received_time",
            "log_metrics",
        ),
    ).union(_GATEWAY),
)  # fmt: skip

_OPENAI = InputTable(
    priority=_DYNAMO.priority.union(_VLLM.priority)
    .union(_SGLANG.priority)
    .union(FieldSet(headers=frozenset({"x-priority", "priority"}))),
    routing=_DYNAMO.routing.union(_VLLM.routing).union(_SGLANG.routing),
)

TABLES: dict[str, InputTable] = {
    "openai": _OPENAI,
    "dynamo": _DYNAMO,
    "vllm": _VLLM,
    "sglang": _SGLANG,
}
