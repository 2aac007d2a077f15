"""``PrometheusStatLogger``: series in a registry of the engine's own, named by Prometheus
conventions under ``legato:`` with units in the names, and, with ``vllm_metric_names``, the
same figures under vLLM's names (``vllm:``) too, with vLLM's ``vllm:cache_config_info`` and
``vllm:lora_requests_info``. ``BatchHistogram`` feeds a histogram a whole step's samples
at once and exposes it exactly as prometheus_client's ``Histogram``.

Never imports trio or torch.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ..protocol.messages import SpecDecodingStats
from .logger_base import StepStatLogger
from .records import StepStats

if TYPE_CHECKING:
    from ..config import EngineConfig

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1 ... 5,000,000


_SORT_FROM = 8
"""Batches this large are sorted and cut at the bounds; smaller ones are placed one by one
(one ``bisect`` each). Sorting wins from between 4 and 16 samples on; at 256 it is about
3x faster than placing them one by one, and numpy's searchsorted only catches up near 1024."""


class BatchHistogram(Collector):
    """A Prometheus histogram with one label (``model_name``) that takes a whole step's
    samples at once: ``observe_many(values)``. Registered in ``registry`` as a custom
    collector; it is exposed exactly as a prometheus_client ``Histogram`` child with the
    same name, help, label and buckets (``le`` inclusive, ``+Inf`` appended, ``_count``
    equal to the ``+Inf`` bucket, ``_sum``, and ``_created`` unless prometheus_client's
    created series are disabled).

    The bucket counts are plain Python ints. A batch takes the lock once: call
    ``observe_many`` from one thread (the engine's event loop); ``collect()`` (a scrape)
    may run on any thread and sees whole batches only, so its buckets are cumulative and
    monotone and its ``_count`` and ``_sum`` cover the same samples.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        model_name: str,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets not in sorted order")
        if not bounds or bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        if len(bounds) < 2:
            raise ValueError(f"{name}: must have at least two buckets")
        self.name = name
        self.documentation = documentation
        self._model_name = model_name
        self._bounds = bounds
        self._le: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Observe every sample of ``values`` (any sequence of floats; may be empty)."""
        n = len(values)
        if not n:
            return
        total = sum(values)
        if total != total:  # a NaN (or +inf with -inf): NaNs go in the sum only
            values = [v for v in values if v == v]
            n = len(values)
        bounds, counts = self._bounds, self._counts
        with self._lock:
            self._sum += total
            if n < _SORT_FROM:
                for value in values:
                    counts[bisect_left(bounds, value)] += 1
                return
            ordered = sorted(values)  # C-speed float compares: cheaper than min() + max()
            low = bisect_left(bounds, ordered[0])
            high = bisect_left(bounds, ordered[-1])
            placed = 0  # samples in the buckets before bucket i
            for i in range(low, high):  # often none: a step's latencies share a bucket
                upto = bisect_right(ordered, bounds[i], placed)
                counts[i] += upto - placed
                placed = upto
            counts[high] += n - placed

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for le, count in zip(self._le, counts, strict=True):
            cumulative += count
            buckets.append((le, float(cumulative)))
        family.add_metric([self._model_name], buckets, total)
        # Read at each scrape, as prometheus_client's own metrics do.
        if getattr(prometheus_metrics, "_use_created", True):
            family.samples.append(
                Sample(self.name + "_created", {"model_name": self._model_name}, self._created)
            )
        yield family


class _Series:
    """The engine's series under one prefix, with their ``model_name`` children cached:
    ``labels()`` is a locked dict lookup, too slow to call per series per step. The
    histograms are ``BatchHistogram`` s, fed a whole step at a time."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model: str, full: bool) -> None:
        def gauge(name: str, doc: str) -> Any:
            return Gauge(prefix + name, doc, ["model_name"], registry=registry).labels(model)

        def counter(name: str, doc: str) -> Any:
            return Counter(prefix + name, doc, ["model_name"], registry=registry).labels(model)

        def histogram(
            name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS
        ) -> BatchHistogram:
            return BatchHistogram(prefix + name, doc, model, buckets, registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        # Series vLLM has no name for are published under legato: only (``full``).
        self.kv_blocks: tuple[Any, Any] | None = None
        if full:
            self.kv_blocks = (
                gauge("kv_cache_blocks_used", "KV-cache blocks in use."),
                gauge("kv_cache_blocks_total", "KV-cache blocks in all."),
            )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            prefix + "request_success",
            "Requests finished, by reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._model = model
        self._success_by_reason: dict[str, Any] = {}
        # Speculative decoding, as vLLM's spec_decode series.
        self.spec_drafts = counter("spec_decode_num_drafts", "Requests verified with drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos_family = Counter(
            prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0: the first draft).",
            ["model_name", "position"],
            registry=registry,
        )
        self._spec_per_pos: list[Any] = []
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.request_prompt = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", _TOKEN_BUCKETS
        )
        self.request_generation = histogram(
            "request_generation_tokens",
            "Tokens generated by each finished request.",
            _TOKEN_BUCKETS,
        )

    def spec_decoding(self, spec: SpecDecodingStats) -> None:
        """Speculative decoding's counts since the previous step's."""
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        per_pos = self._spec_per_pos
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            if pos == len(per_pos):
                per_pos.append(self._spec_per_pos_family.labels(self._model, str(pos)))
            per_pos[pos].inc(count)

    def success(self, reason: str) -> Any:
        child = self._success_by_reason.get(reason)
        if child is None:
            child = self._success_by_reason[reason] = self._success.labels(self._model, reason)
        return child

    def record(self, step: StepStats) -> None:
        """One step's figures. A counter is touched only when its amount is not zero
        (``inc(0)`` would take its lock for nothing); gauges only when the step carries
        the scheduler's figures."""
        s = step.scheduler
        if s is not None:
            self.running.set(s.num_running)
            self.waiting.set(s.num_waiting)
            self.kv_usage.set(s.kv_cache_usage)
            if self.kv_blocks is not None:
                self.kv_blocks[0].set(s.num_blocks_used)
                self.kv_blocks[1].set(s.num_blocks_total)
            if s.prefix_cache_queries:
                self.prefix_queries.inc(s.prefix_cache_queries)
            if s.prefix_cache_hits:
                self.prefix_hits.inc(s.prefix_cache_hits)
            if s.num_preempted:
                self.preemptions.inc(s.num_preempted)
            if s.spec_decoding is not None:
                self.spec_decoding(s.spec_decoding)
        if step.num_prompt_tokens:
            self.prompt_tokens.inc(step.num_prompt_tokens)
        if step.num_generation_tokens:
            self.generation_tokens.inc(step.num_generation_tokens)
        self.ttft.observe_many(step.time_to_first_token)
        self.itl.observe_many(step.inter_token_latency)
        self.queue.observe_many(step.queue_time)
        finished = step.finished
        if finished:
            for done in finished:
                self.success(done.finish_reason).inc()
            self.e2e.observe_many([done.e2e_latency for done in finished])
            self.request_prompt.observe_many([done.num_prompt_tokens for done in finished])
            self.request_generation.observe_many([done.num_generation_tokens for done in finished])


class PrometheusStatLogger(StepStatLogger):
    """The engine's Prometheus series, in a registry of its own (``exposition()`` is
    what ``/metrics`` serves). Every series has the ``model_name`` label.

    With ``vllm_names`` the figures vLLM has a name for are published twice: under
    ``legato:`` and under vLLM's ``vllm:`` (``vllm:num_requests_running``,
    ``vllm:kv_cache_usage_perc``, ``vllm:request_success_total{finished_reason}``,
    ``vllm:time_to_first_token_seconds`` ...), so dashboards and the Kubernetes
    inference gateway written for vLLM read them unchanged.
    """

    def __init__(
        self,
        model_name: str = "legato",
        *,
        vllm_names: bool = False,
        cache_config: dict[str, str] | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._series = [_Series(self.registry, "legato:", model_name, full=True)]
        self._cache_info: CacheConfigInfo | None = None
        self._lora_info: Any = None
        self._max_lora = str(max_loras)
        if vllm_names:
            self._series.append(_Series(self.registry, "vllm:", model_name, full=False))
            self._cache_info = CacheConfigInfo(cache_config or {}, self.registry)
            if max_loras is not None:
                self._lora_info = Gauge(
                    "vllm:lora_requests_info",
                    "Running stats on lora requests.",
                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                    registry=self.registry,
                )

    def record_step(self, step: StepStats) -> None:
        for series in self._series:
            series.record(step)
        s = step.scheduler
        if s is not None and self._cache_info is not None:
            if self._cache_info.num_blocks is None:
                self._cache_info.num_blocks = s.num_blocks_total + 1  # with the null block
            if self._lora_info is not None and s.running_lora_adapters is not None:
                waiting = s.waiting_lora_adapters or {}
                self._lora_info.labels(
                    self._max_lora, ",".join(waiting), ",".join(s.running_lora_adapters)
                ).set_to_current_time()

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format."""
        return generate_latest(self.registry)


class CacheConfigInfo(Collector):
    """vLLM's ``vllm:cache_config_info``: a gauge of 1 whose labels are the KV-cache
    configuration (what the Kubernetes inference gateway reads a replica's capacity
    from). ``num_gpu_blocks`` is the engine's KV block count, null block included as
    vLLM counts it: from ``num_kv_blocks`` when that was given, else from the first
    step's figures (the block count is sized at start-up; "None" until then)."""

    def __init__(self, labels: dict[str, str], registry: CollectorRegistry) -> None:
        self._labels = labels
        self.num_blocks: int | None = (
            int(labels["num_gpu_blocks"])
            if labels.get("num_gpu_blocks", "None") != "None"
            else None
        )
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import GaugeMetricFamily

        labels = {**self._labels, "num_gpu_blocks": str(self.num_blocks), "engine": "0"}
        family = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(labels),
        )
        family.add_metric(list(labels.values()), 1.0)
        yield family

    def describe(self) -> Iterator[Any]:
        return self.collect()


def cache_config_labels(config: EngineConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels for ``config`` (vLLM's CacheConfig field names)."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "num_gpu_blocks": str(config.num_kv_blocks),
        "num_gpu_blocks_override": str(config.num_kv_blocks),
        "num_cpu_blocks": "None",
    }
