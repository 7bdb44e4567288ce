"""Route tables of the mock engines: which path is health, models, admin or inference.

Strategy: classification is a pure function of (flavour, method, path); the
dispatcher then picks the handler from a table keyed by the class. Admin
routes are the union of the three engines' never-through-the-tunnel routes:
they answer 200 and are recorded, so a test can prove the proxy never
reached one.
"""

from __future__ import annotations

from enum import StrEnum

from backends.mock.flavours import Flavour

CONTROL_PATH = "/test-control"

ADMIN_PATHS = frozenset(
    {
        # Dynamo
        "/metrics", "/busy_threshold", "/openapi.json", "/docs",
        # vLLM
        "/load", "/version", "/scale_elastic_ep", "/sleep", "/wake_up", "/is_sleeping",
        "/reset_prefix_cache", "/collective_rpc", "/pause", "/resume", "/update_weights",
        # SGLang
        "/abort_request", "/flush_cache", "/load_lora_adapter", "/unload_lora_adapter",
        "/pause_generation", "/continue_generation", "/start_profile", "/stop_profile",
        "/set_internal_state", "/get_server_info", "/server_info", "/open_session",
        "/close_session", "/slow_down", "/configure_logging", "/get_model_info",
    }
)  # fmt: skip
ADMIN_PREFIXES = ("/update_weights", "/inference/v1/", "/rl/", "/engine/")
"""Families matched by prefix (`/update_weights_from_disk`, vLLM's `/inference/v1/*`)."""


class RouteKind(StrEnum):
    CONTROL = "control"
    ADMIN = "admin"
    HEALTH = "health"
    MODELS = "models"
    INFERENCE = "inference"
    WRONG_METHOD = "wrong_method"
    NOT_FOUND = "not_found"


def is_admin(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)


def classify(flavour: Flavour, method: str, path: str) -> RouteKind:
    if path == CONTROL_PATH:
        return RouteKind.CONTROL
    if is_admin(path):
        return RouteKind.ADMIN
    expected = _expected_method(flavour, path)
    if expected is None:
        return RouteKind.NOT_FOUND
    if method != expected[0]:
        return RouteKind.WRONG_METHOD
    return expected[1]


def _expected_method(flavour: Flavour, path: str) -> tuple[str, RouteKind] | None:
    if path in flavour.health_routes:
        return "GET", RouteKind.HEALTH
    if path == "/v1/models":
        return "GET", RouteKind.MODELS
    if path in flavour.inference_routes:
        return "POST", RouteKind.INFERENCE
    return None
