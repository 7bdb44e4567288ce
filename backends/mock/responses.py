"""Deterministic OpenAI-shaped response bodies and SSE framing of the mock engines.

Strategy: a completion is the tokens "tok0 tok1 ...", so a test can predict
every byte. Each inference route has one `RouteFormat` (dispatch by table):
its non-streaming body, one streamed event per token, and the closing events
(`data: [DONE]` everywhere except the Responses API, which ends with a
`response.completed` event as OpenAI's does). Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backends.mock.inputs import body_get, is_json_int

MODEL_ID = "mock-model"
DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
"""SSE comment line vLLM may send; a proxy must pass it through untouched."""
EMBEDDING_DIMENSIONS = 8


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def sse(payload: Mapping[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + dumps(payload) + b"\n\n"


def token_text(index: int) -> str:
    """The text of token `index` as streamed: "tok0", " tok1", " tok2", ..."""
    return f"tok{index}" if index == 0 else f" tok{index}"


def completion_text(tokens: int) -> str:
    return "".join(token_text(i) for i in range(tokens))


def requested_tokens(path: str, body: Mapping[str, Any], default: int) -> int:
    """The request's own length limit (max_tokens and friends) if it is an int."""
    for key in _LENGTH_FIELDS.get(path, ("max_tokens",)):
        value = body_get(body, key)
        if is_json_int(value) and value >= 0:
            return int(value)
    return default


_LENGTH_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/generate": ("sampling_params.max_new_tokens", "max_tokens"),
    "/v1/responses": ("max_output_tokens", "max_tokens"),
}


def model_of(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else MODEL_ID


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}


def chat_body(rid: str, model: str, tokens: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": completion_text(tokens)}
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
        "usage": _usage(tokens),
    }


def text_body(rid: str, model: str, tokens: int) -> dict[str, Any]:
    choice = {"index": 0, "text": completion_text(tokens), "finish_reason": "length"}
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": _usage(tokens),
    }


def responses_body(rid: str, model: str, tokens: int) -> dict[str, Any]:
    content = [{"type": "output_text", "text": completion_text(tokens), "annotations": []}]
    output = [{"type": "message", "id": f"msg_{rid}", "role": "assistant", "content": content}]
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": 0,
        "status": "completed",
        "model": model,
        "output": output,
        "usage": {"input_tokens": 1, "output_tokens": tokens, "total_tokens": tokens + 1},
    }


def generate_body(rid: str, _model: str, tokens: int) -> dict[str, Any]:
    """SGLang's native /generate shape."""
    meta = {
        "id": rid,
        "prompt_tokens": 1,
        "completion_tokens": tokens,
        "finish_reason": {"type": "length", "length": tokens},
    }
    return {"text": completion_text(tokens), "meta_info": meta}


def chat_chunk(rid: str, model: str, index: int) -> bytes:
    delta = (
        {"role": "assistant", "content": token_text(index)}
        if index == 0
        else {"content": token_text(index)}
    )
    return sse(_chunk(f"chatcmpl-{rid}", "chat.completion.chunk", model, {"delta": delta}))


def chat_end(rid: str, model: str, _tokens: int) -> list[bytes]:
    last = _chunk(f"chatcmpl-{rid}", "chat.completion.chunk", model, {"delta": {}}, "length")
    return [sse(last), DONE]


def text_chunk(rid: str, model: str, index: int) -> bytes:
    return sse(_chunk(f"cmpl-{rid}", "text_completion", model, {"text": token_text(index)}))


def text_end(rid: str, model: str, _tokens: int) -> list[bytes]:
    last = _chunk(f"cmpl-{rid}", "text_completion", model, {"text": ""}, "length")
    return [sse(last), DONE]


def _chunk(
    cid: str, obj: str, model: str, choice: dict[str, Any], finish: str | None = None
) -> dict[str, Any]:
    full = {"index": 0, **choice, "finish_reason": finish}
    return {"id": cid, "object": obj, "created": 0, "model": model, "choices": [full]}


def responses_chunk(rid: str, _model: str, index: int) -> bytes:
    payload = {"type": "response.output_text.delta", "item_id": f"msg_{rid}",
               "output_index": 0, "content_index": 0, "delta": token_text(index)}  # fmt: skip
    return sse(payload, event="response.output_text.delta")


def responses_end(rid: str, model: str, tokens: int) -> list[bytes]:
    payload = {"type": "response.completed", "response": responses_body(rid, model, tokens)}
    return [sse(payload, event="response.completed")]


def generate_chunk(rid: str, _model: str, index: int) -> bytes:
    """SGLang streams the cumulative text so far."""
    meta = {"id": rid, "completion_tokens": index + 1, "finish_reason": None}
    return sse({"text": completion_text(index + 1), "meta_info": meta})


def generate_end(_rid: str, _model: str, _tokens: int) -> list[bytes]:
    return [DONE]


@dataclass(frozen=True)
class RouteFormat:
    """How one inference route answers, whole and streamed."""

    body: Callable[[str, str, int], dict[str, Any]]
    chunk: Callable[[str, str, int], bytes]
    end: Callable[[str, str, int], list[bytes]]


ROUTE_FORMATS: dict[str, RouteFormat] = {
    "/v1/chat/completions": RouteFormat(chat_body, chat_chunk, chat_end),
    "/v1/completions": RouteFormat(text_body, text_chunk, text_end),
    "/v1/responses": RouteFormat(responses_body, responses_chunk, responses_end),
    "/generate": RouteFormat(generate_body, generate_chunk, generate_end),
}


def embeddings_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """One deterministic vector per input, derived from the input's text."""
    raw = body.get("input", "")
    inputs = raw if isinstance(raw, list) else [raw]
    data = [
        {"object": "embedding", "index": i, "embedding": embedding_of(str(item))}
        for i, item in enumerate(inputs)
    ]
    return {"object": "list", "data": data, "model": model_of(body), "usage": _usage(0)}


def embedding_of(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 255.0, 6) for b in digest[:EMBEDDING_DIMENSIONS]]


def models_body() -> dict[str, Any]:
    model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "mock"}
    return {"object": "list", "data": [model]}
