"""Backend adapters: everything Pylon knows about the engine behind it.

Pure code only (no I/O, no clock): config blocks, the priority policy, one
adapter per engine with its deny-lists and routes, and the generic sanitizing
functions those tables feed. `pylon` imports this package; never the reverse.
"""

from backends.base import (
    TRUSTED_ROUTER_HEADER_PREFIXES,
    TRUSTED_ROUTER_HEADERS,
    BackendAdapter,
    BodyPath,
    Derived,
    Headers,
    RouteClass,
    SanitizedHeaders,
)
from backends.config import (
    BackendConfig,
    DynamoConfig,
    DynamoStrictBand,
    PassthroughConfig,
    SglangConfig,
    VllmConfig,
)
from backends.dynamo import DynamoAdapter
from backends.passthrough import PassthroughAdapter
from backends.priority import (
    DEFAULT_PRIORITY_CEILING,
    AbsentPriority,
    PriorityPolicy,
    normalize_level,
)
from backends.registry import BACKEND_TYPES, build_adapter
from backends.sanitize import BodyRejected, BodyRewrite, rewrite_json_body, strip_headers
from backends.sglang import SglangAdapter
from backends.vllm import VllmAdapter

__all__ = [
    "BACKEND_TYPES",
    "DEFAULT_PRIORITY_CEILING",
    "TRUSTED_ROUTER_HEADERS",
    "TRUSTED_ROUTER_HEADER_PREFIXES",
    "AbsentPriority",
    "BackendAdapter",
    "BackendConfig",
    "BodyPath",
    "BodyRejected",
    "BodyRewrite",
    "Derived",
    "DynamoAdapter",
    "DynamoConfig",
    "DynamoStrictBand",
    "Headers",
    "PassthroughAdapter",
    "PassthroughConfig",
    "PriorityPolicy",
    "RouteClass",
    "SanitizedHeaders",
    "SglangAdapter",
    "SglangConfig",
    "VllmAdapter",
    "VllmConfig",
    "build_adapter",
    "normalize_level",
    "rewrite_json_body",
    "strip_headers",
]
