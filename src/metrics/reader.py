"""``get_metrics_snapshot``: an engine's Prometheus series as vLLM's ``Metric`` objects.

vLLM's ``LLMEngine.get_metrics()`` / ``LLM.get_metrics()`` return a ``list[Metric]``
read from the Prometheus registry (``vllm.v1.metrics.reader``): a ``Gauge`` or
``Counter`` per labelled sample, a ``Histogram`` (bucket counts keyed by ``le``, count
and sum) per labelled histogram. Code that reads them (``for m in engine.get_metrics():
if m.name == "vllm:num_requests_running": ...``) reads legato's the same way.

Where legato differs: the registry is the engine's own (not the process's global one),
and both prefixes are read: ``legato:`` always, ``vllm:`` with ``vllm_metric_names``.

Never imports trio or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

PREFIXES = ("vllm:", "legato:")


@dataclass
class Metric:
    """One series (a name and its labels); the subclasses carry the value."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound ("le") -> cumulative


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``vllm:`` / ``legato:`` series in ``registry``, as vLLM's reader builds them."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIXES):
            continue
        if family.type == "gauge":
            collected += [
                Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples
            ]
        elif family.type == "counter":
            collected += [
                Counter(family.name, dict(s.labels), int(s.value))
                for s in family.samples
                if s.name.endswith("_total")
            ]
        elif family.type == "histogram":
            by_labels: dict[tuple[tuple[str, str], ...], Histogram] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                key = tuple(sorted(labels.items()))
                one = by_labels.setdefault(key, Histogram(family.name, labels, 0, 0.0))
                if s.name.endswith("_bucket"):
                    one.buckets[s.labels["le"]] = int(s.value)
                elif s.name.endswith("_count"):
                    one.count = int(s.value)
                elif s.name.endswith("_sum"):
                    one.sum = float(s.value)
            collected += by_labels.values()
    return collected
