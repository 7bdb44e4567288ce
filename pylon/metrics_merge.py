"""One /metrics for several worker processes: their expositions merged series by series.

With `workers > 1` every worker keeps its own registry (the same `Metrics` as
a single process, live gauges included) and the supervisor serves the merge,
so dashboards and alerts read one Pylon per pod whatever the worker count.

Merge rules, by what a series means when there are several processes:
counters, histograms and summaries add up; gauges add up (open connections,
active streams, resident memory) except the ones listed in `GAUGE_RULES`,
where the sum would lie (readiness is 1 only if every worker is ready; a
start time is the earliest). `_created` series keep the earliest time.
Pure functions over exposition text: parsing and rendering are
prometheus_client's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["GAUGE_RULES", "merge_expositions", "render"]

GaugeRule = Literal["sum", "min", "max"]

GAUGE_RULES: Mapping[str, GaugeRule] = {
    "pylon_ready": "min",
    "pylon_engine_ready": "min",
    "process_start_time_seconds": "min",
    "process_max_fds": "min",
    "pylon_build_info": "max",
    "python_info": "max",
}
"""Gauges that are not additive across workers; every other gauge is summed."""

_COMBINE: Mapping[GaugeRule, Callable[[float, float], float]] = {
    "sum": lambda a, b: a + b,
    "min": min,
    "max": max,
}

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def rule_for(family: str, kind: str, rules: Mapping[str, GaugeRule] = GAUGE_RULES) -> GaugeRule:
    """How values of one series combine across workers."""
    if family.endswith("_created"):
        return "min"
    if kind == "gauge":
        return rules.get(family, "sum")
    return "sum"


def merge_expositions(
    texts: Iterable[str], *, rules: Mapping[str, GaugeRule] = GAUGE_RULES
) -> list[Metric]:
    """Families of all `texts`, each series combined by `rule_for`; first-seen order.

    A family whose type differs between texts keeps the first type seen; its
    other samples are still combined by name and labels (the workers run the
    same code, so this only happens across a version skew during a restart).
    """
    families: dict[str, Metric] = {}
    values: dict[str, dict[SampleKey, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            combine = _COMBINE[rule_for(merged.name, merged.type, rules)]
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                previous = series.get(key)
                series[key] = sample.value if previous is None else combine(previous, sample.value)
    for name, merged in families.items():
        merged.samples = [
            Sample(sample_name, dict(labels), value)
            for (sample_name, labels), value in values[name].items()
        ]
    return list(families.values())


class _Fixed:
    """A collector that yields families computed beforehand."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(families: Sequence[Metric]) -> bytes:
    """The classic text format, as a registry's `generate_latest` writes it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)
