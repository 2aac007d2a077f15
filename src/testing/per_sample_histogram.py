"""PerSampleHistogram: ``BatchHistogram``'s reference, for its tests and benchmark.

Never imports torch or trio.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Histogram


class PerSampleHistogram:
    """``BatchHistogram``'s constructor and ``observe_many`` over a real prometheus_client
    ``Histogram`` child fed one locked ``observe`` per sample (the way before
    ``BatchHistogram``): what its exposition must equal, and what it is timed against."""

    def __init__(
        self,
        name: str,
        documentation: str,
        model_name: str,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.child = Histogram(
            name, documentation, ["model_name"], buckets=buckets, registry=registry
        ).labels(model_name)

    def observe_many(self, values: Sequence[float]) -> None:
        for value in values:
            self.child.observe(value)
