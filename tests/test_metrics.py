"""Unit tests of `pylon.metrics.Metrics`: one fresh registry per test.

Each observation method must move exactly the sample it is about; every
labelled series exists at zero before the first observation; label values
stay inside their fixed sets whatever a caller passes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from backends.base import Derived, RouteClass
from backends.config import (
    BackendConfig,
    DynamoConfig,
    PassthroughConfig,
    SglangConfig,
    VllmConfig,
)
from backends.priority import PriorityPolicy
from backends.registry import build_adapter
from backends.sanitize import rewrite_json_body, strip_headers
from pylon.metrics import (
    CANCELLERS,
    OTHER,
    PROBE_RESULTS,
    REJECT_REASONS,
    ROUTES,
    STATUS_CLASSES,
    UPSTREAM_ERROR_KINDS,
    DenyList,
    Metrics,
    status_class,
)
from pylon.pipeline import Derivation
from pylon.readiness import ProbeResult

BACKEND = "vllm"
DENY = DenyList(headers=("x-data-parallel-rank", "x-override-*"), body_fields=("priority",))


def fresh() -> tuple[Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return Metrics(registry, backend=BACKEND, version="9.9.9", deny_list=DENY), registry


def value(registry: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return registry.get_sample_value(metric, {"backend": BACKEND, **labels})


Observation = Callable[[Metrics], None]

CASES: list[tuple[str, Observation, str, dict[str, str], float]] = [
    (
        "request_finished counts by route and status class",
        lambda m: m.request_finished(
            route="inference",
            status=429,
            duration_s=0.2,
            ttfb_s=0.05,
            request_bytes=10,
            response_bytes=30,
        ),
        "pylon_requests_total",
        {"route": "inference", "status_class": "4xx"},
        1,
    ),
    (
        "request_finished observes the duration",
        lambda m: m.request_finished(
            route="models",
            status=200,
            duration_s=0.2,
            ttfb_s=None,
            request_bytes=0,
            response_bytes=0,
        ),
        "pylon_request_duration_seconds_sum",
        {"route": "models"},
        0.2,
    ),
    (
        "request_finished observes time to first byte",
        lambda m: m.request_finished(
            route="health",
            status=200,
            duration_s=0.2,
            ttfb_s=0.05,
            request_bytes=0,
            response_bytes=0,
        ),
        "pylon_time_to_first_byte_seconds_sum",
        {"route": "health"},
        0.05,
    ),
    (
        "request_finished counts request bytes",
        lambda m: m.request_finished(
            route="inference",
            status=200,
            duration_s=1,
            ttfb_s=None,
            request_bytes=7,
            response_bytes=0,
        ),
        "pylon_request_bytes_total",
        {},
        7,
    ),
    (
        "request_finished counts response bytes",
        lambda m: m.request_finished(
            route="inference",
            status=200,
            duration_s=1,
            ttfb_s=None,
            request_bytes=0,
            response_bytes=9,
        ),
        "pylon_response_bytes_total",
        {},
        9,
    ),
    (
        "a reset request is its own status class",
        lambda m: m.request_finished(
            route="inference",
            status=None,
            duration_s=1,
            ttfb_s=None,
            request_bytes=0,
            response_bytes=0,
        ),
        "pylon_requests_total",
        {"route": "inference", "status_class": "reset"},
        1,
    ),
    (
        "priority_derived counts the outcome",
        lambda m: m.priority_derived(Derivation.EMITTED, 5),
        "pylon_priority_derivations_total",
        {"outcome": "emitted"},
        1,
    ),
    (
        "priority_derived observes the emitted value",
        lambda m: m.priority_derived(Derivation.EMITTED, 5),
        "pylon_priority_emitted_sum",
        {},
        5,
    ),
    (
        "priority_derived without a value observes nothing",
        lambda m: m.priority_derived(Derivation.ABSENT_OMITTED, None),
        "pylon_priority_emitted_count",
        {},
        0,
    ),
    (
        "inputs_stripped counts each deny-list entry",
        lambda m: m.inputs_stripped("header", ["x-override-*", "x-data-parallel-rank"]),
        "pylon_stripped_total",
        {"kind": "header", "name": "x-override-*"},
        1,
    ),
    (
        "inputs_stripped counts body fields",
        lambda m: m.inputs_stripped("body", ["priority"]),
        "pylon_stripped_total",
        {"kind": "body", "name": "priority"},
        1,
    ),
    (
        "request_rejected counts the reason",
        lambda m: m.request_rejected("body_too_large"),
        "pylon_requests_rejected_total",
        {"reason": "body_too_large"},
        1,
    ),
    (
        "upstream_failed counts the kind",
        lambda m: m.upstream_failed("timeout"),
        "pylon_upstream_errors_total",
        {"kind": "timeout"},
        1,
    ),
    (
        "request_cancelled counts who cancelled",
        lambda m: m.request_cancelled("gateway"),
        "pylon_cancellations_total",
        {"by": "gateway"},
        1,
    ),
    (
        "engine_probed counts the result",
        lambda m: m.engine_probed(ProbeResult.UNREACHABLE, ready=False),
        "pylon_engine_probes_total",
        {"result": "unreachable"},
        1,
    ),
    (
        "engine_probed sets the readiness gauge",
        lambda m: m.engine_probed(ProbeResult.HEALTHY, ready=True),
        "pylon_engine_ready",
        {},
        1,
    ),
]


@pytest.mark.parametrize(
    ("observe", "name", "labels", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_observation_moves_its_sample(
    observe: Observation, name: str, labels: dict[str, str], expected: float
) -> None:
    metrics, registry = fresh()
    assert value(registry, name, **labels) == 0
    observe(metrics)
    assert value(registry, name, **labels) == pytest.approx(expected)


def test_every_labelled_series_exists_at_zero() -> None:
    _, registry = fresh()
    for route in ROUTES:
        for status in STATUS_CLASSES:
            assert value(registry, "pylon_requests_total", route=route, status_class=status) == 0
        assert value(registry, "pylon_request_duration_seconds_count", route=route) == 0
        assert value(registry, "pylon_time_to_first_byte_seconds_count", route=route) == 0
    expected = {
        ("pylon_priority_derivations_total", "outcome"): [d.value for d in Derivation],
        ("pylon_requests_rejected_total", "reason"): REJECT_REASONS,
        ("pylon_upstream_errors_total", "kind"): UPSTREAM_ERROR_KINDS,
        ("pylon_cancellations_total", "by"): CANCELLERS,
        ("pylon_engine_probes_total", "result"): PROBE_RESULTS,
    }
    for (name, label), values in expected.items():
        for label_value in values:
            assert value(registry, name, **{label: label_value}) == 0, (name, label_value)
    for header in DENY.headers:
        assert value(registry, "pylon_stripped_total", kind="header", name=header) == 0
    assert value(registry, "pylon_stripped_total", kind="body", name="priority") == 0
    assert value(registry, "pylon_engine_ready") == 0


def test_build_info_carries_version_and_backend() -> None:
    _, registry = fresh()
    labels = {"version": "9.9.9", "backend": BACKEND}
    assert registry.get_sample_value("pylon_build_info", labels) == 1


def test_route_classes_are_all_route_labels() -> None:
    assert {route.value for route in RouteClass} < set(ROUTES)


@pytest.mark.parametrize(
    ("observe", "name", "label"),
    [
        (lambda m: m.request_rejected("GET /secret"), "pylon_requests_rejected_total", "reason"),
        (lambda m: m.upstream_failed("weird"), "pylon_upstream_errors_total", "kind"),
        (lambda m: m.request_cancelled("the moon"), "pylon_cancellations_total", "by"),
    ],
)
def test_unknown_label_values_are_counted_as_other(
    observe: Observation, name: str, label: str
) -> None:
    metrics, registry = fresh()
    observe(metrics)
    assert value(registry, name, **{label: OTHER}) == 1
    assert (
        len(_label_values(registry, name, label)) == len(_label_values(fresh()[1], name, label)) + 1
    )


def test_unknown_route_and_stripped_name_are_bounded() -> None:
    metrics, registry = fresh()
    metrics.request_finished(
        route="/v1/secret/path",
        status=200,
        duration_s=1,
        ttfb_s=None,
        request_bytes=0,
        response_bytes=0,
    )
    metrics.inputs_stripped("header", ["x-not-on-the-list"])
    metrics.inputs_stripped("cookie", ["priority"])
    assert value(registry, "pylon_requests_total", route=OTHER, status_class="2xx") == 1
    assert value(registry, "pylon_stripped_total", kind="header", name=OTHER) == 1
    assert value(registry, "pylon_stripped_total", kind=OTHER, name=OTHER) == 1
    assert "/v1/secret/path" not in _label_values(registry, "pylon_requests_total", "route")


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (None, "reset"),
        (100, "2xx"),
        (200, "2xx"),
        (304, "3xx"),
        (404, "4xx"),
        (503, "5xx"),
        (999, "5xx"),
    ],
)
def test_status_class(status: int | None, expected: str) -> None:
    assert status_class(status) == expected


def test_live_gauge_is_read_at_scrape_time() -> None:
    metrics, registry = fresh()
    state = {"open": 3}
    metrics.live_gauge("pylon_open_connections", "Open connections.", lambda: state["open"])
    assert registry.get_sample_value("pylon_open_connections") == 3
    state["open"] = 1
    assert registry.get_sample_value("pylon_open_connections") == 1


@pytest.mark.parametrize(
    "config",
    [PassthroughConfig(), VllmConfig(), SglangConfig(priority_scheduling=True), DynamoConfig()],
)
def test_deny_list_labels_are_exactly_what_the_sanitizer_reports(config: BackendConfig) -> None:
    adapter = build_adapter(config, PriorityPolicy())
    deny = DenyList.of(adapter)
    spoofed = [(name.replace("*", "x").encode(), b"1") for name in deny.headers]
    assert set(strip_headers(adapter, spoofed).stripped) == set(deny.headers)
    body: dict[str, Any] = {"model": "m"}
    for field in deny.body_fields:
        *parents, leaf = field.split(".")
        target = body
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = 1
    stripped = rewrite_json_body(adapter, json.dumps(body).encode(), Derived()).stripped
    assert set(stripped) == set(deny.body_fields)


def test_without_a_deny_list_the_sanitizer_names_are_kept() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, backend=BACKEND, version="1")
    metrics.inputs_stripped("header", ["x-data-parallel-rank"])
    labels = {"backend": BACKEND, "kind": "header", "name": "x-data-parallel-rank"}
    assert registry.get_sample_value("pylon_stripped_total", labels) == 1


def _label_values(registry: CollectorRegistry, name: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and label in sample.labels
    }
